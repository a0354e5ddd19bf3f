//! Deciding flows: [`Snapshot::decide`] walks the tiers for each direction that applies.
//!
//! The contract (DESIGN §2): a connection from client C to server S is allowed iff
//! `decide(Egress, subject=C, peer=S) == Allow && decide(Ingress, subject=S, peer=C) ==
//! Allow`, each side evaluated only where the subject is a pod-network pod. Per direction,
//! the tiers in [`Tier::ORDER`] (the one place that says the order): the Admin tier (first
//! matching rule by priority; Pass skips the rest of the tier), then NetworkPolicy
//! (isolation is final), then the Baseline tier, then allow. What each tier does with its
//! matches is here; which tier comes when is not.
//!
//! A direction's candidates (the subject's policies that have a rule for the flow's port)
//! are each one to four cache misses: the policy, its matcher's header, the port table and
//! the peer's class. Taken one by one, they wait in a row, and a flow on a port that many
//! policies name visits fifty of them. So after its first two candidates (as many as most
//! flows need), a direction warms the next ones before deciding them, in batches of two,
//! then four, then eight: it asks for every batch member's policy lines, then their
//! matchers' headers, then the flow's data in them, so that a batch waits about three
//! misses rather than three per member. Warming only prefetches; what is decided, and in
//! which order, does not change. Measured in one process against the code without it, on
//! the `decide` bench's flows, 10 alternated rounds, two runs: with the Antrea set p99
//! 0.77× and 0.83×, p50 0.99× and 1.03×; the large cluster alone p99 0.99× and 0.93×, p50
//! 1.05× and 1.01× (docs/architecture.md, "Measured: with Antrea's tiers").
//!
//! Before either direction, a flow asks for the lines every decision of it reads whatever
//! its candidates (`warm_flow`): both pod ends' policy lists and address lists
//! and the destination's declared ports, so that the ingress direction's first misses
//! overlap the egress direction's work. Four alternated pairs of the `decide` bench
//! against the code without it: with the Antrea set p50 0.86–0.98× (each pair lower),
//! p99 0.98× by the medians; the large cluster alone p50 0.97×, p99 0.99×.
//!
//! A [`Decision`] holds no strings: it names policies and rules by index into the snapshot
//! it came from, so deciding allocates nothing unless a Pass is taken. Use
//! [`Snapshot::policy_ref`] and [`Snapshot::rule_info`] to name them.

use std::net::{IpAddr, SocketAddr};

use super::matcher::{has, prefetch, protocol_index};
use super::model::{Action, Direction, Endpoint, Peers, Revision, Tier};
use super::ports::{NamedPort, Protocol};
use super::problem::ObjectRef;
use super::snapshot::{Policy, Snapshot};

/// Candidates a direction decides before it warms any (module docs), and the size of its
/// first warmed batch; each later batch doubles, up to [`MAX_WARM`]. A flow decided by
/// its first candidate or two (the median) warms nothing.
const FIRST_WARM: usize = 2;

/// Most candidates warmed in one batch.
const MAX_WARM: usize = 8;

/// A new flow's first packet, as far as policy cares: the 5-tuple less the source port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Flow {
    /// Source (client) address.
    pub src: IpAddr,
    /// Destination (server) address: the original destination, after any DNAT.
    pub dst: IpAddr,
    /// Transport protocol.
    pub protocol: Protocol,
    /// Destination port.
    pub dst_port: u16,
}

/// A flow's 5-tuple, the one key of a flow everywhere outside policy: the key under which
/// a first-packet decision waits for the proxy to accept the connection it admitted, the
/// registry's and the flow tables' key, and the flow an audit event names
/// (`crate::audit::FlowInfo`). [`FlowKey::flow`] is what policy reads of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FlowKey {
    /// Client address and port.
    pub src: SocketAddr,
    /// Original destination address and port (after any DNAT that ran before the hook).
    pub dst: SocketAddr,
    /// Transport protocol.
    pub protocol: Protocol,
}

impl FlowKey {
    /// The policy view of this 5-tuple (the source port does not matter to policy).
    pub fn flow(&self) -> Flow {
        Flow {
            src: self.src.ip(),
            dst: self.dst.ip(),
            protocol: self.protocol,
            dst_port: self.dst.port(),
        }
    }
}

/// Allow, deny or reject.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// The flow may proceed.
    Allow,
    /// The flow is dropped silently.
    Deny,
    /// The flow is refused at once: the client gets a TCP RST or an ICMP error
    /// (administratively prohibited), as for a closed port. Only an Antrea `Reject` rule
    /// gives it (`shared/reference/antrea-model.md` §5).
    Reject,
}

impl Verdict {
    /// `allow` / `deny` / `reject`.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Allow => "allow",
            Verdict::Deny => "deny",
            Verdict::Reject => "reject",
        }
    }

    /// Whether the flow may proceed.
    pub fn is_allow(self) -> bool {
        self == Verdict::Allow
    }
}

/// A rule of a policy in a snapshot: policy index and the rule's position in the policy's
/// list for the direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RuleHit {
    /// Index of the policy in the snapshot.
    pub policy: u32,
    /// Position of the rule in the policy's ingress or egress list.
    pub rule: u32,
}

/// Why one direction got its verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Basis {
    /// A rule matched (Allow or Deny; a fail-closed rule counts as Deny).
    Rule {
        /// The tier of the policy.
        tier: Tier,
        /// The rule.
        hit: RuleHit,
    },
    /// NetworkPolicies isolate the subject in this direction and none of their rules
    /// matched: "traffic ... is allowed only if ... some NetworkPolicy allows it". `policy`
    /// is the first isolating policy by namespace/name.
    Isolated {
        /// The first isolating NetworkPolicy.
        policy: u32,
    },
    /// No tier decided: "all pods can communicate with each other" (default allow).
    NoPolicy,
    /// Ingress from the subject's own node is always allowed (kubelet probes; NetworkPolicy
    /// docs: "traffic to and from the node where a Pod is running is always allowed").
    OwnNode,
}

/// The decision for one direction.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Outcome {
    /// The direction's verdict.
    pub verdict: Verdict,
    /// What decided it.
    pub basis: Basis,
    /// Pass rules taken on the way, in order.
    pub passed: Vec<RuleHit>,
}

/// The decision for a flow: the final verdict and the outcome of each direction that
/// applies (`None` where that end is not a pod-network pod).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Decision {
    /// `Allow` iff every applicable direction allows; else the client's egress verdict if
    /// it is not Allow, else the server's ingress verdict.
    pub verdict: Verdict,
    /// The client's egress, if the client is a pod-network pod.
    pub egress: Option<Outcome>,
    /// The server's ingress, if the server is a pod-network pod.
    pub ingress: Option<Outcome>,
    /// The snapshot revision that decided.
    pub revision: Revision,
}

/// A rule, named for people and audit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RuleInfo<'a> {
    /// The rule's `name`, if set.
    pub name: Option<&'a str>,
    /// Position in the policy's ingress or egress list.
    pub index: u32,
    /// The effective action (a fail-closed rule reports `Deny`).
    pub action: Action,
    /// The rule holds a peer of an unknown kind and fails closed.
    pub fail_closed: bool,
    /// Antrea `enableLogging`: audit every decision of this rule (docs/audit.md).
    pub enable_logging: bool,
    /// Antrea `logLabel`, if set.
    pub log_label: Option<&'a str>,
}

impl Snapshot {
    /// What `ip` is: a pod-network pod, a node (or hostNetwork pod), or external.
    #[inline]
    pub fn endpoint(&self, ip: IpAddr) -> Endpoint {
        self.by_ip.get(&ip).copied().unwrap_or(Endpoint::External)
    }

    /// A short name for an endpoint: `ns/pod`, `node/<name>` or `external`.
    pub fn endpoint_name(&self, ep: Endpoint) -> String {
        match ep {
            Endpoint::Pod(p) => {
                let pod = &self.pods[p as usize];
                format!("{}/{}", self.namespaces[pod.namespace as usize].name, pod.name)
            }
            Endpoint::Node(n) => format!("node/{}", self.nodes[n as usize].name),
            Endpoint::External => "external".to_string(),
        }
    }

    /// Pod `pod`'s namespace and name (`metadata.namespace`, `metadata.name`).
    ///
    /// # Panics
    /// If `pod` is not a pod id of this snapshot (from [`Endpoint::Pod`]).
    pub fn pod_name(&self, pod: u32) -> (&str, &str) {
        let p = &self.pods[pod as usize];
        (&self.namespaces[p.namespace as usize].name, &p.name)
    }

    /// Node `node`'s `metadata.name`.
    ///
    /// # Panics
    /// If `node` is not a node id of this snapshot (from [`Endpoint::Node`]).
    pub fn node_name(&self, node: u32) -> &str {
        &self.nodes[node as usize].name
    }

    /// Each value pod label `key` takes, with the ids of the pods that carry it: one pass
    /// gives every pod's value of `key` (audit's labels of interest). Empty when no pod has
    /// the key.
    pub fn pod_label_values(
        &self,
        key: &str,
    ) -> impl Iterator<Item = (&str, &roaring::RoaringBitmap)> {
        self.pod_index.values(key)
    }

    /// Number of pod-network pods; pod ids are `0..pod_count()`.
    pub fn pod_count(&self) -> u32 {
        self.pods.len() as u32
    }

    /// The value of annotation `key` (which starts with
    /// [`ANNOTATION_PREFIX`](super::model::ANNOTATION_PREFIX); others are not kept) on
    /// the policy at `index`.
    ///
    /// # Panics
    /// If `index` did not come from a decision of this snapshot.
    pub fn policy_annotation(&self, index: u32, key: &str) -> Option<&str> {
        let a = &self.policies[index as usize].annotations;
        a.binary_search_by(|(k, _)| k.as_str().cmp(key)).ok().map(|i| a[i].1.as_str())
    }

    /// The policy at `index` (from a [`RuleHit`] or [`Basis::Isolated`]).
    ///
    /// # Panics
    /// If `index` did not come from a decision of this snapshot.
    pub fn policy_ref(&self, index: u32) -> &ObjectRef {
        &self.policies[index as usize].object
    }

    /// The tier of the policy at `index`.
    pub fn policy_tier(&self, index: u32) -> Tier {
        self.policies[index as usize].tier
    }

    /// The tier of the policy at `index` as people name it: an Antrea policy's Tier
    /// object name (`securityops`, a custom Tier's), else [`Tier::as_str`] (`admin`,
    /// `networkpolicy`, `baseline`).
    pub fn policy_tier_name(&self, index: u32) -> &str {
        let p = &self.policies[index as usize];
        p.antrea_tier.as_deref().unwrap_or(p.tier.as_str())
    }

    /// The rule `hit` names, in direction `dir`.
    ///
    /// # Panics
    /// If `hit` did not come from a decision of this snapshot.
    pub fn rule_info(&self, dir: Direction, hit: RuleHit) -> RuleInfo<'_> {
        let r = &self.policies[hit.policy as usize].rules[dir as usize][hit.rule as usize];
        RuleInfo {
            name: r.name.as_deref(),
            index: r.index,
            action: r.action,
            fail_closed: r.fail_closed,
            enable_logging: r.enable_logging,
            log_label: r.log_label.as_deref(),
        }
    }

    /// Decides a new flow (DESIGN §2). Allocates only when a Pass rule is taken.
    pub fn decide(&self, flow: &Flow) -> Decision {
        self.decide_impl::<true>(flow)
    }

    /// [`Snapshot::decide`] without the port index and the rule-mask matchers: every
    /// applicable policy, every rule, every peer, in order. The reference the fast path is
    /// tested against.
    #[doc(hidden)]
    pub fn decide_reference(&self, flow: &Flow) -> Decision {
        self.decide_impl::<false>(flow)
    }

    /// [`Snapshot::decide`] as the agent of node `node` (a node id from
    /// [`Snapshot::find_node`]) enforces it:
    /// - the client is a pod on `node`: both directions, as [`Snapshot::decide`] — egress,
    ///   and the server's ingress wherever the server runs. The server's node decides its
    ///   ingress again, but the client's node must know it too: its proxy completes the
    ///   client's handshake, so a flow the server's node would drop has to be dropped here,
    ///   at the first packet, for the client to time out as a denied connection must;
    /// - else the server is a pod on `node`: its ingress only (the client's node, if the
    ///   client is a pod, decided the egress);
    /// - else nothing is this node's to decide: both directions `None`, verdict Allow.
    pub fn decide_on_node(&self, flow: &Flow, node: u32) -> Decision {
        let src = self.endpoint(flow.src);
        let client_here =
            matches!(src, Endpoint::Pod(p) if self.pods[p as usize].node == Some(node));
        self.decide_scoped::<true>(flow, src, (!client_here).then_some(node))
    }

    /// The node a pod-network pod runs on (`spec.nodeName`), if known.
    pub fn pod_node(&self, pod: u32) -> Option<u32> {
        self.pods.get(pod as usize).and_then(|p| p.node)
    }

    #[inline]
    fn decide_impl<const FAST: bool>(&self, flow: &Flow) -> Decision {
        self.decide_scoped::<FAST>(flow, self.endpoint(flow.src), None)
    }

    #[inline]
    /// `src` is `self.endpoint(flow.src)`; with `node`, only directions whose subject pod
    /// runs on `node` are decided.
    fn decide_scoped<const FAST: bool>(
        &self,
        flow: &Flow,
        src: Endpoint,
        node: Option<u32>,
    ) -> Decision {
        let dst = self.endpoint(flow.dst);
        let dst_ports = self.declared_ports(dst);
        if FAST {
            self.warm_flow(src, dst, dst_ports);
        }
        let here = |p: u32| node.is_none_or(|n| self.pods[p as usize].node == Some(n));
        let egress = match src {
            Endpoint::Pod(p) if here(p) => {
                Some(self.direction::<FAST>(Direction::Egress, p, dst, flow.dst, flow, dst_ports))
            }
            _ => None,
        };
        let ingress = match dst {
            Endpoint::Pod(p) if here(p) => {
                Some(self.direction::<FAST>(Direction::Ingress, p, src, flow.src, flow, dst_ports))
            }
            _ => None,
        };
        // The client's egress first, as a packet meets them (antrea-model.md §4): an egress
        // Deny hides an ingress Reject, an egress Reject wins over anything at ingress.
        let verdict = [&egress, &ingress]
            .into_iter()
            .flatten()
            .map(|o| o.verdict)
            .find(|v| *v != Verdict::Allow)
            .unwrap_or(Verdict::Allow);
        Decision { verdict, egress, ingress, revision: self.revision }
    }

    /// Asks for the lines a flow's decision reads first whatever its candidates, before
    /// the egress direction waits on its own: each pod end's policy lists and address list
    /// (a candidate reads the peer's, to know whether it has several addresses), and the
    /// destination's declared ports (every candidate with a named port reads them). The
    /// ingress direction's then arrive while the egress one is decided. Only prefetches.
    #[inline]
    fn warm_flow(&self, src: Endpoint, dst: Endpoint, dst_ports: &[NamedPort]) {
        for ep in [dst, src] {
            if let Endpoint::Pod(p) = ep {
                prefetch(&self.pod_ips[p as usize]);
                prefetch(self.policy_sets[self.per_pod[p as usize] as usize].head());
            }
        }
        prefetch(dst_ports.as_ptr());
    }

    /// One direction of [`Snapshot::decide`]: `subject` is a pod id, `peer`/`peer_ip` the
    /// other end, `dst_ports` the container ports the destination declares.
    pub fn decide_direction(
        &self,
        dir: Direction,
        subject: u32,
        peer: Endpoint,
        peer_ip: IpAddr,
        flow: &Flow,
        dst_ports: &[NamedPort],
    ) -> Outcome {
        self.direction::<true>(dir, subject, peer, peer_ip, flow, dst_ports)
    }

    fn direction<const FAST: bool>(
        &self,
        dir: Direction,
        subject: u32,
        peer: Endpoint,
        peer_ip: IpAddr,
        flow: &Flow,
        dst_ports: &[NamedPort],
    ) -> Outcome {
        if dir == Direction::Ingress
            && let Endpoint::Node(n) = peer
            && self.pods[subject as usize].node == Some(n)
        {
            return Outcome { verdict: Verdict::Allow, basis: Basis::OwnNode, passed: Vec::new() };
        }
        let d = dir as usize;
        let lists = &self.policy_sets[self.per_pod[subject as usize] as usize];
        let mut passed = Vec::new();
        // Policies with no rule for this port cannot match: skip them on one bit each.
        let candidates: &[u64] = self.port_index[d][protocol_index(flow.protocol)]
            .candidates(flow.dst_port)
            .unwrap_or(&[]);
        // An external peer matches only by address (or a rule matching every peer).
        let by_address = match peer {
            Endpoint::External if FAST => Some(self.addr_index[d].candidates(peer_ip)),
            _ => None,
        };
        let skip = |pid: u32| {
            FAST && (!has(candidates, pid) || by_address.is_some_and(|c| !c.contains(pid)))
        };
        let first_rule = |pid: u32| {
            if FAST {
                self.first_rule(pid, d, subject, peer, peer_ip, flow, dst_ports)
            } else {
                let p = &self.policies[pid as usize];
                self.first_rule_linear(p, d, subject, peer, peer_ip, flow, dst_ports)
            }
        };
        // Warming (module docs): the next `n` candidates from `list[from]` on get their
        // lines asked for in three rounds (policy, matcher header, the flow's data), each
        // round's misses overlapping. Returns the list position after the last one.
        let warm = |list: &[u32], from: usize, n: usize| -> usize {
            let mut pids = [0u32; MAX_WARM];
            let (mut k, mut j) = (0, from);
            for &pid in &list[from..] {
                j += 1;
                if !skip(pid) {
                    pids[k] = pid;
                    k += 1;
                    if k == n {
                        break;
                    }
                }
            }
            let pids = &pids[..k];
            for &pid in pids {
                let p = &self.policies[pid as usize];
                prefetch(&p.matchers[d]);
                prefetch(&p.priority);
            }
            for &pid in pids {
                if let Some(m) = &self.policies[pid as usize].matchers[d] {
                    m.prefetch_header();
                }
            }
            for &pid in pids {
                if let Some(m) = &self.policies[pid as usize].matchers[d] {
                    m.prefetch_data(subject, peer, flow.protocol);
                }
            }
            j
        };
        // Called at each candidate `list[i]` before it is decided: the first `FIRST_WARM`
        // of the direction go unwarmed (most flows need no more); past them, a candidate
        // beyond the last warmed batch (`*warmed`, a list position) warms the next batch,
        // each twice the last.
        let (mut seen, mut batch) = (0usize, FIRST_WARM);
        let mut step = |list: &[u32], i: usize, warmed: &mut usize| {
            seen += 1;
            if FAST && seen > FIRST_WARM && i >= *warmed {
                *warmed = warm(list, i, batch);
                batch = (batch * 2).min(MAX_WARM);
            }
        };
        // Tier by tier in `Tier::ORDER`; the lists are by position in it.
        for (t, tier) in Tier::ORDER.into_iter().enumerate() {
            let list = lists.list(t, d);
            match tier {
                Tier::Admin | Tier::Baseline => {
                    let (mut i, mut warmed) = (0, 0);
                    while i < list.len() {
                        // Antrea policies of one rank and priority are one run, interleaved
                        // rule by rule: "(tier priority, policy priority, rule index)"
                        // (antrea-model.md §3, Antrea `Priority.Less`); the list's order
                        // breaks only ties of rule index. Any other policy is a run of one.
                        // A policy the indexes skip cannot match, so a run may as well start
                        // at its first member that can; skipping first keeps a skipped
                        // policy's header out of the cache, as before runs existed.
                        if skip(list[i]) {
                            i += 1;
                            continue;
                        }
                        step(list, i, &mut warmed);
                        let end = self.run_end(list, i);
                        let mut best: Option<RuleHit> = None;
                        for &pid in &list[i..end] {
                            if skip(pid) {
                                continue;
                            }
                            if let Some(ri) = first_rule(pid)
                                && best.is_none_or(|b| ri < b.rule)
                            {
                                best = Some(RuleHit { policy: pid, rule: ri });
                            }
                        }
                        i = end;
                        let Some(hit) = best else { continue };
                        let basis = Basis::Rule { tier, hit };
                        match self.policies[hit.policy as usize].rules[d][hit.rule as usize].action
                        {
                            Action::Allow => {
                                return Outcome { verdict: Verdict::Allow, basis, passed };
                            }
                            Action::Deny => {
                                return Outcome { verdict: Verdict::Deny, basis, passed };
                            }
                            Action::Reject => {
                                return Outcome { verdict: Verdict::Reject, basis, passed };
                            }
                            // "Pass: Skips all further ClusterNetworkPolicy rules in the
                            // current tier for the selected traffic, and passes evaluation
                            // to the next tier." An Antrea Pass likewise goes straight to
                            // NetworkPolicy, past every later admin-level rule (§5).
                            Action::Pass => {
                                passed.push(hit);
                                break;
                            }
                        }
                    }
                }
                Tier::NetworkPolicy => {
                    let Some(&first) = list.first() else { continue };
                    // The subject is isolated in this direction: "v1.NetworkPolicy always
                    // makes a final decision for selected pods".
                    let mut warmed = 0;
                    for (i, &pid) in list.iter().enumerate() {
                        if skip(pid) {
                            continue;
                        }
                        step(list, i, &mut warmed);
                        if let Some(ri) = first_rule(pid) {
                            let hit = RuleHit { policy: pid, rule: ri };
                            return Outcome {
                                verdict: Verdict::Allow,
                                basis: Basis::Rule { tier, hit },
                                passed,
                            };
                        }
                    }
                    return Outcome {
                        verdict: Verdict::Deny,
                        basis: Basis::Isolated { policy: first },
                        passed,
                    };
                }
            }
        }
        Outcome { verdict: Verdict::Allow, basis: Basis::NoPolicy, passed }
    }

    /// The first rule of policy `pid` in direction `d` that matches, by its precompiled
    /// [`Matcher`](super::matcher) or, above its rule limit, by walking the rules.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    fn first_rule(
        &self,
        pid: u32,
        d: usize,
        subject: u32,
        peer: Endpoint,
        peer_ip: IpAddr,
        flow: &Flow,
        dst_ports: &[NamedPort],
    ) -> Option<u32> {
        let p = &self.policies[pid as usize];
        match &p.matchers[d] {
            Some(m) => {
                let (multi, peer_pod) = match peer {
                    Endpoint::Pod(p) => (self.pod_ips[p as usize].len() > 1, p),
                    _ => (false, u32::MAX),
                };
                let relative = |r: u32| {
                    self.relative_matches(&p.rules[d][r as usize].peers, subject, peer_pod)
                };
                m.first_rule(
                    subject,
                    peer,
                    multi,
                    peer_ip,
                    flow.protocol,
                    flow.dst_port,
                    dst_ports,
                    relative,
                )
            }
            None => self.first_rule_linear(p, d, subject, peer, peer_ip, flow, dst_ports),
        }
    }

    /// The end of the run of policies starting at `list[i]` that decide together: Antrea
    /// policies of one rank and priority (interleaved by rule index), else `i + 1`.
    #[inline]
    fn run_end(&self, list: &[u32], i: usize) -> usize {
        let p = &self.policies[list[i] as usize];
        if p.antrea_tier.is_none() {
            return i + 1;
        }
        let same = |q: &u32| {
            let q = &self.policies[*q as usize];
            q.antrea_tier.is_some() && q.rank == p.rank && q.priority == p.priority
        };
        i + 1 + list[i + 1..].iter().take_while(|q| same(q)).count()
    }

    /// The subject of direction `dir` of `flow`: the server's pod for ingress, the
    /// client's for egress (`u32::MAX` when that end is not a pod: no subject-relative
    /// rule then applies).
    fn subject_of(&self, dir: Direction, flow: &Flow) -> u32 {
        let ip = match dir {
            Direction::Ingress => flow.dst,
            Direction::Egress => flow.src,
        };
        match self.endpoint(ip) {
            Endpoint::Pod(p) => p,
            _ => u32::MAX,
        }
    }

    /// The reference evaluation: every rule in order, every peer. Used above the matcher's
    /// rule limit, and by tests to check the matcher.
    #[doc(hidden)]
    pub fn first_rule_reference(
        &self,
        pid: u32,
        dir: Direction,
        peer_ip: IpAddr,
        flow: &Flow,
    ) -> Option<u32> {
        let dst_ports = self.declared_ports(self.endpoint(flow.dst));
        let p = &self.policies[pid as usize];
        let subject = self.subject_of(dir, flow);
        self.first_rule_linear(
            p,
            dir as usize,
            subject,
            self.endpoint(peer_ip),
            peer_ip,
            flow,
            dst_ports,
        )
    }

    /// The same as [`Self::first_rule_reference`] through the fast path.
    #[doc(hidden)]
    pub fn first_rule_fast(
        &self,
        pid: u32,
        dir: Direction,
        peer_ip: IpAddr,
        flow: &Flow,
    ) -> Option<u32> {
        let dst_ports = self.declared_ports(self.endpoint(flow.dst));
        let subject = self.subject_of(dir, flow);
        self.first_rule(
            pid,
            dir as usize,
            subject,
            self.endpoint(peer_ip),
            peer_ip,
            flow,
            dst_ports,
        )
    }

    /// The container ports `ep` declares (empty unless it is a pod): "named ports resolve on
    /// the destination pod's declared container ports".
    #[inline]
    fn declared_ports(&self, ep: Endpoint) -> &[NamedPort] {
        match ep {
            Endpoint::Pod(p) => &self.pods[p as usize].ports,
            _ => &[],
        }
    }

    /// Number of compiled policies; policy indexes are `0..policy_count()`.
    pub fn policy_count(&self) -> u32 {
        self.policies.len() as u32
    }

    /// The first rule of `p` in direction `d` that matches, walking every rule: `subject`
    /// (a pod id) for rule-level appliedTo and subject-relative peers.
    #[allow(clippy::too_many_arguments)]
    fn first_rule_linear(
        &self,
        p: &Policy,
        d: usize,
        subject: u32,
        peer: Endpoint,
        peer_ip: IpAddr,
        flow: &Flow,
        dst_ports: &[NamedPort],
    ) -> Option<u32> {
        p.rules[d]
            .iter()
            .position(|r| {
                r.applied_to.is_none_or(|s| self.pod_sets[s as usize].contains(subject))
                    && r.ports.matches(flow.protocol, flow.dst_port, dst_ports)
                    && self.peer_matches(&r.peers, subject, peer, peer_ip)
            })
            .map(|i| i as u32)
    }

    #[inline]
    fn peer_matches(&self, peers: &Peers, subject: u32, peer: Endpoint, ip: IpAddr) -> bool {
        if peers.all {
            return true;
        }
        let by_identity = match peer {
            Endpoint::Pod(p) => {
                peers.pod_sets.iter().any(|&s| self.pod_sets[s as usize].contains(p))
                    || (!peers.relative.is_empty() && self.relative_matches(peers, subject, p))
            }
            Endpoint::Node(n) => peers.nodes.as_ref().is_some_and(|set| set.contains(n)),
            Endpoint::External => false,
        };
        // ipBlock / networks match any address, pod and node IPs included (DESIGN §2).
        by_identity || peers.blocks.iter().any(|b| b.contains(ip))
    }

    /// Whether pod `peer` is one of the subject-relative peers of `peers` for pod
    /// `subject` (antrea-model.md §7: `namespaces.match: Self`, `sameLabels`).
    fn relative_matches(&self, peers: &Peers, subject: u32, peer: u32) -> bool {
        let Some(s) = self.pods.get(subject as usize) else { return false };
        let ns = |id: u32| &self.namespaces[id as usize];
        let peer_ns = self.pods[peer as usize].namespace;
        peers.relative.iter().any(|r| {
            self.pod_sets[r.pods as usize].contains(peer)
                && r.same.picks(
                    peer_ns == s.namespace,
                    &ns(s.namespace).labels,
                    &ns(peer_ns).labels,
                )
        })
    }
}
