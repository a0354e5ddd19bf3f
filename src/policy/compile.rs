//! API objects + cluster state → an immutable, indexed [`Snapshot`].
//!
//! Stage two of three (store → snapshot → decision, DESIGN §5): everything that can be
//! worked out before a packet arrives is worked out here, once per revision:
//!
//! - every object is validated ([`super::validate`]); objects with errors are left out and
//!   reported, the rest is used (the caller may keep the last good version of a rejected
//!   object);
//! - namespaces, pods and nodes get dense ids, and each kind gets a [`LabelIndex`];
//! - every distinct selector (and namespace×pod selector pair) is resolved once into a
//!   bitmap of pod ids and interned, so a thousand rules naming `app=web` share one set;
//! - every pod gets, per direction, the ordered list of Admin-tier and Baseline-tier
//!   policies whose subject selects it and the NetworkPolicies that isolate it, so
//!   [`Snapshot::decide`](super::eval) walks only what applies.
//!
//! The large parts (pods, admin objects, matchers) run on up to four threads; decisions
//! and problems do not depend on how many, and for one thread count the snapshot does
//! not depend on thread timing.
//!
//! The tier order itself lives in one place: [`super::eval::TIER_ORDER`].

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use roaring::RoaringBitmap;

use super::api::{
    LabelSelector, Namespace, NamespacedPod, NetworkPolicy, Node, Pod, SelectorRef, v1alpha1,
    v1alpha2,
};
use super::cidr::{self, Block};
use super::labels::{LabelSet, Labels, LabelsRef};
use super::matcher::{
    AddrIndex, MAX_RULES, Matcher, PodAddrs, PortIndex, block_ranges, protocol_index,
};
pub use super::model::{
    ANNOTATION_ENFORCING, ANNOTATION_PREFIX, Action, Direction, Endpoint, Revision, Tier,
};
use super::model::{NamespaceEntry, NodeEntry, Peers, PodEntry, Rule, SetId};
use super::ports::{NamedPort, PortMatch, PortSpec, Ports, Protocol};
use super::problem::{Kind, ObjectRef, Problem, ProblemKind};
use super::selector::{LabelIndex, Selector};
use super::snapshot::{PodPolicies, Policy, Snapshot};
use super::validate::{self, NAMESPACE_NAME_LABEL};

/// The API objects a snapshot is compiled from. Order within each list does not matter;
/// an object given twice (same kind, namespace, name) is used once, the later one winning.
/// Objects are shared (`Arc`): a source's store, the last good policies and the compiler
/// read the same allocation, so a rebuild copies no object.
#[derive(Debug, Clone, Default)]
pub struct Inputs {
    /// `v1` Namespaces. Namespaces that pods or policies live in but that are missing here
    /// are created implicitly, with only the `kubernetes.io/metadata.name` label.
    pub namespaces: Vec<Arc<Namespace>>,
    /// `v1` Nodes; their `status.addresses` (InternalIP, ExternalIP) are node IPs.
    pub nodes: Vec<Arc<Node>>,
    /// `v1` Pods. Pods in phase Succeeded or Failed hold no IP and are ignored.
    pub pods: Vec<Arc<Pod>>,
    /// Pods already cut to what the engine reads ([`PodView`]), as a source that keeps
    /// many of them stores them (the API-server watchers); validated by their source. A
    /// view and a Pod with the same namespace and name: the view wins.
    pub pod_views: Vec<Arc<PodView>>,
    /// `networking.k8s.io/v1` NetworkPolicies.
    pub network_policies: Vec<Arc<NetworkPolicy>>,
    /// `v1alpha1` AdminNetworkPolicies.
    pub admin_network_policies: Vec<Arc<v1alpha1::AdminNetworkPolicy>>,
    /// `v1alpha1` BaselineAdminNetworkPolicies (only `default` is valid).
    pub baseline_admin_network_policies: Vec<Arc<v1alpha1::BaselineAdminNetworkPolicy>>,
    /// `v1alpha2` ClusterNetworkPolicies.
    pub cluster_network_policies: Vec<Arc<v1alpha2::ClusterNetworkPolicy>>,
}

/// The annotations of `meta` whose key starts with [`ANNOTATION_PREFIX`], sorted by key.
fn own_annotations(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> Box<[(String, String)]> {
    meta.annotations
        .iter()
        .flatten()
        .filter(|(k, _)| k.starts_with(ANNOTATION_PREFIX))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// The result of compiling: the snapshot and everything worth telling about the input.
#[derive(Debug)]
pub struct Compiled {
    /// The snapshot, built from every object without errors.
    pub snapshot: Snapshot,
    /// Errors (object left out) and warnings (object used), in input order per kind.
    pub problems: Vec<Problem>,
}

/// Interns pod sets by the selector(s) that produced them.
#[derive(Default)]
struct Interner {
    ids: HashMap<SetKey, SetId>,
    sets: Vec<RoaringBitmap>,
}

#[derive(Hash, PartialEq, Eq)]
enum SetKey {
    /// Pods in namespaces matching the selector.
    Namespaces(Selector),
    /// Pods matching the pod selector in namespaces matching the namespace selector.
    Pods(Selector, Selector),
    /// Pods matching the selector in one namespace (NetworkPolicy `podSelector`).
    InNamespace(u32, Selector),
}

/// Compile-time state: indexes over the cluster.
struct Cluster {
    /// See [`Cluster::pods_in_namespaces`].
    ns_pods: HashMap<Selector, RoaringBitmap>,
    pods: Vec<PodEntry>,
    namespaces: Vec<NamespaceEntry>,
    ns_ids: HashMap<String, u32>,
    nodes: Vec<NodeEntry>,
    pod_index: LabelIndex,
    ns_index: LabelIndex,
    node_index: LabelIndex,
    interner: Interner,
    /// Single-address pods sorted by address, for folding address matches into pod classes.
    addrs: PodAddrs,
}

/// Appends an injective byte encoding of `sel` to `out`: equal encodings ⇔ equal
/// selectors (every string is length-prefixed, every optional field carries a presence
/// byte). One pass over the selector's maps gives both the memo key's hash and its
/// equality check, where hashing and then comparing the objects read them twice.
fn encode_selector(out: &mut Vec<u8>, sel: SelectorRef<'_>) {
    fn put(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u32).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }
    let SelectorRef { match_labels, match_expressions } = sel;
    match match_labels {
        None => out.push(0),
        Some(labels) => {
            out.push(1);
            out.extend_from_slice(&(labels.len() as u32).to_le_bytes());
            for (k, v) in labels.pairs() {
                put(out, k);
                put(out, v);
            }
        }
    }
    match match_expressions {
        None => out.push(0),
        Some(exprs) => {
            out.push(1);
            out.extend_from_slice(&(exprs.len() as u32).to_le_bytes());
            for e in exprs {
                put(out, &e.key);
                put(out, &e.operator);
                match &e.values {
                    None => out.push(0),
                    Some(values) => {
                        out.push(1);
                        out.extend_from_slice(&(values.len() as u32).to_le_bytes());
                        for v in values {
                            put(out, v);
                        }
                    }
                }
            }
        }
    }
}

/// Sets `out` to the [`encode_selector`] key of a `namespaces` peer (`pods == None`) or a
/// `pods` peer.
fn encode_peer(out: &mut Vec<u8>, ns: &LabelSelector, pods: Option<&LabelSelector>) {
    out.clear();
    encode_selector(out, ns.into());
    match pods {
        None => out.push(0),
        Some(p) => {
            out.push(1);
            encode_selector(out, p.into());
        }
    }
}

impl Cluster {
    fn namespaces_matching(&self, sel: &Selector) -> RoaringBitmap {
        self.ns_index.resolve(sel)
    }

    fn pods_in(&self, namespaces: &RoaringBitmap) -> RoaringBitmap {
        let mut out = RoaringBitmap::new();
        for ns in namespaces {
            out |= &self.namespaces[ns as usize].pods;
        }
        out
    }

    /// The pods of the namespaces `ns` selects, memoised: the few namespace selectors of a
    /// large policy set recur in many `pods` peers.
    fn pods_in_namespaces(&mut self, ns: &Selector) -> &RoaringBitmap {
        if !self.ns_pods.contains_key(ns) {
            let pods = self.pods_in(&self.namespaces_matching(ns));
            self.ns_pods.insert(ns.clone(), pods);
        }
        &self.ns_pods[ns]
    }

    fn intern(&mut self, key: SetKey) -> SetId {
        if let Some(&id) = self.interner.ids.get(&key) {
            return id;
        }
        let set = match &key {
            SetKey::Namespaces(ns) => self.pods_in_namespaces(ns).clone(),
            SetKey::Pods(ns, pods) => {
                let in_namespaces = self.pods_in_namespaces(ns).clone();
                in_namespaces & self.pod_index.resolve(pods)
            }
            SetKey::InNamespace(ns, pods) => {
                &self.namespaces[*ns as usize].pods & self.pod_index.resolve(pods)
            }
        };
        let id = self.interner.sets.len() as SetId;
        self.interner.sets.push(set);
        self.interner.ids.insert(key, id);
        id
    }
}

/// Compiles a selector that validation has already checked; an unknown operator (only
/// possible if validation was skipped) makes the selector match nothing, failing closed.
fn selector<'a>(sel: impl Into<SelectorRef<'a>>) -> Option<Selector> {
    Selector::compile(sel.into()).ok()
}

fn namespaced_pod_key(np: &NamespacedPod) -> Option<SetKey> {
    let NamespacedPod { namespace_selector, pod_selector } = np;
    Some(SetKey::Pods(selector(namespace_selector)?, selector(pod_selector)?))
}

fn protocol_or_tcp(p: Option<&str>) -> Protocol {
    // "If not specified, this field defaults to TCP." Validation rejects other names.
    p.and_then(|p| p.parse().ok()).unwrap_or(Protocol::Tcp)
}

fn port_u16(p: i32) -> u16 {
    // Validation guarantees 1..=65535; clamp rather than wrap if it was skipped.
    p.clamp(0, u16::MAX as i32) as u16
}

/// ANP / BANP `ports` (v1alpha1 `AdminNetworkPolicyPort`).
fn anp_ports(ports: &Option<Vec<v1alpha1::AdminNetworkPolicyPort>>) -> Ports {
    let Some(ports) = ports else { return Ports::any() };
    Ports(
        ports
            .iter()
            .filter_map(|p| {
                let v1alpha1::AdminNetworkPolicyPort { port_number, named_port, port_range } = p;
                if let Some(v1alpha1::Port { protocol, port }) = port_number {
                    let port = port_u16(*port);
                    Some(PortMatch {
                        protocol: Some(protocol_or_tcp(protocol.as_deref())),
                        ports: PortSpec::Range(port, port),
                    })
                } else if let Some(v1alpha1::PortRange { protocol, start, end }) = port_range {
                    Some(PortMatch {
                        protocol: Some(protocol_or_tcp(protocol.as_deref())),
                        ports: PortSpec::Range(port_u16(*start), port_u16(*end)),
                    })
                } else {
                    // "NamedPort selects a port on a pod(s) based on name." The protocol is
                    // that of the named container port.
                    named_port
                        .as_ref()
                        .map(|n| PortMatch { protocol: None, ports: PortSpec::Named(n.clone()) })
                }
            })
            .collect(),
    )
}

/// CNP `protocols` (v1alpha2 `ClusterNetworkPolicyProtocol`): "If unspecified,
/// protocol-specific attributes will not be used to match traffic."
fn cnp_ports(protocols: &Option<Vec<v1alpha2::ClusterNetworkPolicyProtocol>>) -> Ports {
    let Some(protocols) = protocols else { return Ports::any() };
    let spec = |pp: &v1alpha2::ProtocolPort| match &pp.destination_port {
        None => PortSpec::Any,
        Some(v1alpha2::DestinationPort { number: Some(n), .. }) => {
            PortSpec::Range(port_u16(*n), port_u16(*n))
        }
        Some(v1alpha2::DestinationPort { range: Some(r), .. }) => {
            PortSpec::Range(port_u16(r.start), port_u16(r.end))
        }
        Some(v1alpha2::DestinationPort { number: None, range: None }) => PortSpec::Any,
    };
    Ports(
        protocols
            .iter()
            .filter_map(|p| {
                let v1alpha2::ClusterNetworkPolicyProtocol {
                    tcp,
                    udp,
                    sctp,
                    destination_named_port,
                } = p;
                if let Some(pp) = tcp {
                    Some(PortMatch { protocol: Some(Protocol::Tcp), ports: spec(pp) })
                } else if let Some(pp) = udp {
                    Some(PortMatch { protocol: Some(Protocol::Udp), ports: spec(pp) })
                } else if let Some(pp) = sctp {
                    Some(PortMatch { protocol: Some(Protocol::Sctp), ports: spec(pp) })
                } else {
                    destination_named_port
                        .as_ref()
                        .map(|n| PortMatch { protocol: None, ports: PortSpec::Named(n.clone()) })
                }
            })
            .collect(),
    )
}

/// NetworkPolicy `ports`: "If this field is empty or missing, this rule matches all ports".
fn np_ports(ports: &Option<Vec<k8s_openapi::api::networking::v1::NetworkPolicyPort>>) -> Ports {
    let Some(ports) = ports else { return Ports::any() };
    Ports(
        ports
            .iter()
            .map(|p| {
                let k8s_openapi::api::networking::v1::NetworkPolicyPort {
                    end_port,
                    port,
                    protocol,
                } = p;
                let protocol = Some(protocol_or_tcp(protocol.as_deref()));
                let ports = match port {
                    // "If this field is not provided, this matches all port names and numbers."
                    None => PortSpec::Any,
                    Some(IntOrString::Int(n)) => {
                        let lo = port_u16(*n);
                        // "endPort indicates that the range of ports from port to endPort if
                        // set, inclusive, should be allowed by the policy."
                        PortSpec::Range(lo, end_port.map_or(lo, port_u16))
                    }
                    Some(IntOrString::String(name)) => PortSpec::Named(name.clone()),
                };
                PortMatch { protocol, ports }
            })
            .collect(),
    )
}

/// The peer kinds shared by ANP, BANP and CNP, gathered from one peer object.
struct PeerFields<'a> {
    namespaces: Option<&'a LabelSelector>,
    pods: Option<&'a NamespacedPod>,
    nodes: Option<&'a LabelSelector>,
    networks: Option<&'a Vec<String>>,
    domain_names: Option<&'a Vec<String>>,
}

impl<'a> PeerFields<'a> {
    fn anp_ingress(p: &'a v1alpha1::AdminNetworkPolicyIngressPeer) -> Self {
        let v1alpha1::AdminNetworkPolicyIngressPeer { namespaces, pods } = p;
        PeerFields {
            namespaces: namespaces.as_ref(),
            pods: pods.as_ref(),
            nodes: None,
            networks: None,
            domain_names: None,
        }
    }
    fn anp_egress(p: &'a v1alpha1::AdminNetworkPolicyEgressPeer) -> Self {
        let v1alpha1::AdminNetworkPolicyEgressPeer {
            namespaces,
            pods,
            nodes,
            networks,
            domain_names,
        } = p;
        PeerFields {
            namespaces: namespaces.as_ref(),
            pods: pods.as_ref(),
            nodes: nodes.as_ref(),
            networks: networks.as_ref(),
            domain_names: domain_names.as_ref(),
        }
    }
    fn banp_egress(p: &'a v1alpha1::BaselineAdminNetworkPolicyEgressPeer) -> Self {
        let v1alpha1::BaselineAdminNetworkPolicyEgressPeer { namespaces, pods, nodes, networks } =
            p;
        PeerFields {
            namespaces: namespaces.as_ref(),
            pods: pods.as_ref(),
            nodes: nodes.as_ref(),
            networks: networks.as_ref(),
            domain_names: None,
        }
    }
    fn cnp_ingress(p: &'a v1alpha2::ClusterNetworkPolicyIngressPeer) -> Self {
        let v1alpha2::ClusterNetworkPolicyIngressPeer { namespaces, pods } = p;
        PeerFields {
            namespaces: namespaces.as_ref(),
            pods: pods.as_ref(),
            nodes: None,
            networks: None,
            domain_names: None,
        }
    }
    fn cnp_egress(p: &'a v1alpha2::ClusterNetworkPolicyEgressPeer) -> Self {
        let v1alpha2::ClusterNetworkPolicyEgressPeer {
            namespaces,
            pods,
            nodes,
            networks,
            domain_names,
        } = p;
        PeerFields {
            namespaces: namespaces.as_ref(),
            pods: pods.as_ref(),
            nodes: nodes.as_ref(),
            networks: networks.as_ref(),
            domain_names: domain_names.as_ref(),
        }
    }
}

/// Compiles one ANP/BANP/CNP rule, at `index` in its direction, on a worker of
/// [`prepare_admin`]. Its selector peers are left as keys of `dict` in
/// `peers.pod_sets`, unsorted; `compile_inner` turns them into sorted pod set ids once
/// every worker's keys are interned.
///
/// Implements the fail-closed rule for unknown peers (network-policy-api
/// `ClusterNetworkPolicyEgressPeer`): "For Accept rules, 'fail closed' means: 'treat the
/// rule as matching no traffic'. For Deny and Pass rules, 'fail closed' means: 'treat the
/// rule as a Deny all rule'".
fn admin_rule<'a>(
    index: usize,
    name: &'a str,
    action: Action,
    peers: impl Iterator<Item = PeerFields<'a>>,
    ports: Ports,
    dict: &mut PeerDict,
    node_index: &LabelIndex,
) -> Rule {
    let mut out = Peers { pod_sets: Vec::with_capacity(peers.size_hint().0), ..Peers::default() };
    let mut unknown = false;
    // A selector this engine cannot compile (an unknown operator; the API server does not
    // validate selectors inside custom resources) is treated like a peer of an unknown
    // kind: it fails closed.
    for p in peers {
        let key = match (p.namespaces, p.pods) {
            (Some(ns), _) => Some(dict.key(ns, None)),
            (None, Some(np)) => Some(dict.key(&np.namespace_selector, Some(&np.pod_selector))),
            (None, None) => None,
        };
        if let Some(k) = key {
            if dict.sets[k as usize].is_some() {
                out.pod_sets.push(k);
            } else {
                unknown = true;
            }
        } else if let Some(nodes) = p.nodes {
            match selector(nodes) {
                Some(s) => {
                    let set = node_index.resolve(&s);
                    *out.nodes.get_or_insert_with(RoaringBitmap::new) |= set;
                }
                None => unknown = true,
            }
        } else if let Some(nets) = p.networks {
            out.blocks.extend(nets.iter().filter_map(|n| cidr::parse(n).ok()).map(Block::new));
        } else if p.domain_names.is_some() {
            // Not resolvable by this engine: matches no traffic (warned by validate).
        } else {
            unknown = true;
        }
    }
    let (action, fail_closed) = match (action, unknown) {
        (Action::Deny | Action::Pass, true) => {
            out = Peers { all: true, ..Peers::default() };
            (Action::Deny, true)
        }
        (a, _) => (a, false),
    };
    Rule {
        name: (!name.is_empty()).then(|| name.to_string()),
        index: index as u32,
        action,
        peers: out,
        ports,
        fail_closed,
    }
}

/// The distinct selector peers one worker of [`prepare_admin`] met, by content: a million
/// peers name a few hundred distinct selector pairs, so only these few are compiled.
#[derive(Default)]
struct PeerDict {
    /// Keys by [`encode_peer`] bytes.
    ids: rustc_hash::FxHashMap<Box<[u8]>, u32>,
    /// Per key, the pod set it names (`None`: a selector does not compile, so the peer
    /// fails closed).
    sets: Vec<Option<SetKey>>,
    buf: Vec<u8>,
}

impl PeerDict {
    fn key(&mut self, ns: &LabelSelector, pods: Option<&LabelSelector>) -> u32 {
        encode_peer(&mut self.buf, ns, pods);
        // FxHash: these keys come from the cluster's own objects, not from a remote peer.
        if let Some(&id) = self.ids.get(self.buf.as_slice()) {
            return id;
        }
        let id = self.sets.len() as u32;
        self.sets.push(match pods {
            None => selector(ns).map(SetKey::Namespaces),
            Some(p) => selector(ns).zip(selector(p)).map(|(n, p)| SetKey::Pods(n, p)),
        });
        self.ids.insert(self.buf.as_slice().into(), id);
        id
    }
}

/// An admin-tier or baseline-tier policy object, before compiling.
#[derive(Clone, Copy)]
enum AdminObject<'a> {
    Anp(&'a v1alpha1::AdminNetworkPolicy),
    Cnp(&'a v1alpha2::ClusterNetworkPolicy),
    Banp(&'a v1alpha1::BaselineAdminNetworkPolicy),
}

impl<'a> AdminObject<'a> {
    /// The object's `metadata`.
    fn metadata(self) -> &'a k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        match self {
            AdminObject::Anp(o) => &o.metadata,
            AdminObject::Cnp(o) => &o.metadata,
            AdminObject::Banp(o) => &o.metadata,
        }
    }

    /// Position of the kind in compile order (ANP, CNP, BANP), which is also the order
    /// problems are reported in.
    fn order(self) -> usize {
        match self {
            AdminObject::Anp(_) => 0,
            AdminObject::Cnp(_) => 1,
            AdminObject::Banp(_) => 2,
        }
    }

    /// Peers in all rules (plus one): the work of preparing the object.
    fn weight(self) -> usize {
        let [ingress, egress] = rule_counts(self);
        let peers = |d: Direction, rules: usize| -> usize {
            (0..rules).filter_map(|i| PeerSlice::of(self, d, i)).map(PeerSlice::len).sum()
        };
        1 + peers(Direction::Ingress, ingress) + peers(Direction::Egress, egress)
    }
}

/// An admin object that passed validation, ready for [`Cluster::admin_policy`].
struct AdminBody<'a> {
    tier: Tier,
    priority: i32,
    namespaces: &'a Option<LabelSelector>,
    pods: &'a Option<NamespacedPod>,
    /// Rules by [`Direction`] index; selector peers are worker keys (see [`admin_rule`])
    /// until `compile_inner` turns them into set ids.
    rules: [Vec<Rule>; 2],
}

/// What a worker made of one admin object.
struct Prepared<'a> {
    /// Validation problems, in the validator's order.
    problems: Vec<Problem>,
    /// `None` when validation found an error: the object is left out.
    body: Option<AdminBody<'a>>,
    /// The worker whose [`PeerDict`] the rules' keys index.
    worker: usize,
}

/// Below this many peers in all admin objects together, compiling stays on the calling
/// thread (spawning costs more than it saves).
const PARALLEL_MIN_PEERS: usize = 4096;

/// Most threads a compile uses: enough for a large input on a small node, few enough not
/// to crowd a big node while the agent rebuilds.
const MAX_WORKERS: usize = 4;

/// The machine's parallelism, at most [`MAX_WORKERS`].
fn default_workers() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, MAX_WORKERS)
}

/// Splits items of the given weights into at most `workers` contiguous ranges of about
/// equal total weight (one range when the total is below [`PARALLEL_MIN_PEERS`]).
fn balanced_ranges(weights: &[usize], workers: usize) -> Vec<std::ops::Range<usize>> {
    let total: usize = weights.iter().sum();
    let workers = if total < PARALLEL_MIN_PEERS { 1 } else { workers.max(1) };
    let mut out = Vec::with_capacity(workers);
    let (mut start, mut acc) = (0, 0);
    for (i, w) in weights.iter().enumerate() {
        acc += w;
        if out.len() + 1 < workers && acc * workers >= total * (out.len() + 1) {
            out.push(start..i + 1);
            start = i + 1;
        }
    }
    out.push(start..weights.len());
    out
}

/// Runs `work` on each range of `items` (from [`balanced_ranges`]), the first on the
/// calling thread and the others on scoped threads, and returns the results in range order.
/// A panic in a worker is resumed on the caller.
fn par_ranges<T: Sync, R: Send>(
    items: &[T],
    ranges: &[std::ops::Range<usize>],
    work: impl Fn(usize, &[T]) -> R + Sync,
) -> Vec<R> {
    if ranges.len() <= 1 {
        return vec![work(0, items)];
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = ranges[1..]
            .iter()
            .enumerate()
            .map(|(w, r)| {
                let (work, chunk) = (&work, &items[r.clone()]);
                scope.spawn(move || work(w + 1, chunk))
            })
            .collect();
        let mut out = vec![work(0, &items[ranges[0].clone()])];
        for h in handles {
            out.push(h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)));
        }
        out
    })
}

/// Runs `work` on every item, the items split into `ranges` (contiguous, covering them
/// all, from [`balanced_ranges`]): the first range on the calling thread, the others on
/// scoped threads. A panic in a worker is resumed on the caller.
fn par_for_each_mut<T: Send>(
    items: &mut [T],
    ranges: &[std::ops::Range<usize>],
    work: impl Fn(&mut T) + Sync,
) {
    if ranges.len() <= 1 {
        items.iter_mut().for_each(work);
        return;
    }
    std::thread::scope(|scope| {
        let (first, mut rest) = items.split_at_mut(ranges[0].len());
        let mut handles = Vec::with_capacity(ranges.len() - 1);
        for r in &ranges[1..] {
            let (mine, tail) = std::mem::take(&mut rest).split_at_mut(r.len());
            rest = tail;
            let work = &work;
            handles.push(scope.spawn(move || mine.iter_mut().for_each(work)));
        }
        first.iter_mut().for_each(&work);
        for h in handles {
            h.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
        }
    });
}

/// Validates admin objects and keys every selector peer of their rules, spread over
/// worker threads: the one pass over a large input's million peers, whose cost is the
/// memory latency of reading them, so it scales with cores. Returns, in input order, what
/// each object became, and each worker's distinct peers.
fn prepare_admin<'a>(
    items: &[(ObjectRef, AdminObject<'a>)],
    node_index: &LabelIndex,
    validate: bool,
    workers: usize,
) -> (Vec<Prepared<'a>>, Vec<PeerDict>) {
    let weights: Vec<usize> = items.iter().map(|(_, o)| o.weight()).collect();
    let ranges = balanced_ranges(&weights, workers);
    let results = par_ranges(items, &ranges, |worker, chunk| {
        let mut dict = PeerDict::default();
        let prepared: Vec<Prepared<'a>> =
            chunk
                .iter()
                .map(|&(_, obj)| {
                    let mut problems = Vec::new();
                    let mut rules = rule_counts(obj).map(Vec::with_capacity);
                    // Each rule is compiled right after it is validated, while its peers are
                    // in cache: reading them is the cost of a large input. Its peers are
                    // touched just before (`PeerSlice::touch`). An object found invalid is
                    // dropped whole (its peers' keys go unused).
                    if let Some(first) = PeerSlice::of(obj, Direction::Ingress, 0)
                        .or(PeerSlice::of(obj, Direction::Egress, 0))
                    {
                        first.touch();
                    }
                    let mut build = |d: Direction, i: usize| {
                        rules[d as usize].push(admin_rule_at(obj, d, i, &mut dict, node_index));
                        touch_next_rule(obj, d, i);
                    };
                    if validate {
                        let out = &mut problems;
                        match obj {
                            AdminObject::Anp(p) => validate::admin_network_policy_rules(p, out)
                                .for_each(|(d, i)| build(d, i)),
                            AdminObject::Cnp(p) => validate::cluster_network_policy_rules(p, out)
                                .for_each(|(d, i)| build(d, i)),
                            AdminObject::Banp(p) => {
                                validate::baseline_admin_network_policy_rules(p, out)
                                    .for_each(|(d, i)| build(d, i))
                            }
                        }
                    } else {
                        let [ingress, egress] = rule_counts(obj);
                        (0..ingress).for_each(|i| build(Direction::Ingress, i));
                        (0..egress).for_each(|i| build(Direction::Egress, i));
                    }
                    let body = (!problems.iter().any(Problem::is_error)).then(|| {
                        let (tier, priority, namespaces, pods) = admin_head(obj);
                        AdminBody { tier, priority, namespaces, pods, rules }
                    });
                    Prepared { problems, body, worker }
                })
                .collect();
        (prepared, dict)
    });
    let mut prepared = Vec::with_capacity(items.len());
    let mut dicts = Vec::with_capacity(results.len());
    for (p, d) in results {
        prepared.extend(p);
        dicts.push(d);
    }
    (prepared, dicts)
}

/// Tier, priority and subject (`namespaces`, `pods`) of an admin object.
fn admin_head<'a>(
    obj: AdminObject<'a>,
) -> (Tier, i32, &'a Option<LabelSelector>, &'a Option<NamespacedPod>) {
    match obj {
        AdminObject::Anp(p) => {
            let v1alpha1::AdminNetworkPolicySubject { namespaces, pods } = &p.spec.subject;
            (Tier::Admin, p.spec.priority, namespaces, pods)
        }
        AdminObject::Cnp(p) => {
            let v1alpha2::ClusterNetworkPolicySubject { namespaces, pods } = &p.spec.subject;
            let tier = match p.spec.tier {
                v1alpha2::Tier::Admin => Tier::Admin,
                v1alpha2::Tier::Baseline => Tier::Baseline,
            };
            (tier, p.spec.priority, namespaces, pods)
        }
        AdminObject::Banp(p) => {
            let v1alpha1::AdminNetworkPolicySubject { namespaces, pods } = &p.spec.subject;
            // BANP has no priority. It is the cluster-wide default of v1alpha1, while
            // Baseline-tier CNPs (v1alpha2) carry explicit priorities: BANP goes after them.
            (Tier::Baseline, BANP_PRIORITY, namespaces, pods)
        }
    }
}

/// Number of ingress and egress rules of an admin object.
fn rule_counts(obj: AdminObject<'_>) -> [usize; 2] {
    match obj {
        AdminObject::Anp(p) => [p.spec.ingress.len(), p.spec.egress.len()],
        AdminObject::Cnp(p) => [p.spec.ingress.len(), p.spec.egress.len()],
        AdminObject::Banp(p) => [p.spec.ingress.len(), p.spec.egress.len()],
    }
}

/// The peers of one admin rule, whatever the object's kind.
#[derive(Clone, Copy)]
enum PeerSlice<'a> {
    AnpIngress(&'a [v1alpha1::AdminNetworkPolicyIngressPeer]),
    AnpEgress(&'a [v1alpha1::AdminNetworkPolicyEgressPeer]),
    BanpEgress(&'a [v1alpha1::BaselineAdminNetworkPolicyEgressPeer]),
    CnpIngress(&'a [v1alpha2::ClusterNetworkPolicyIngressPeer]),
    CnpEgress(&'a [v1alpha2::ClusterNetworkPolicyEgressPeer]),
}

impl<'a> PeerSlice<'a> {
    /// The peers of rule `i` of direction `d` (`None` past the last rule).
    fn of(obj: AdminObject<'a>, d: Direction, i: usize) -> Option<Self> {
        Some(match (obj, d) {
            (AdminObject::Anp(p), Direction::Ingress) => {
                PeerSlice::AnpIngress(&p.spec.ingress.get(i)?.from)
            }
            (AdminObject::Anp(p), Direction::Egress) => {
                PeerSlice::AnpEgress(&p.spec.egress.get(i)?.to)
            }
            (AdminObject::Banp(p), Direction::Ingress) => {
                PeerSlice::AnpIngress(&p.spec.ingress.get(i)?.from)
            }
            (AdminObject::Banp(p), Direction::Egress) => {
                PeerSlice::BanpEgress(&p.spec.egress.get(i)?.to)
            }
            (AdminObject::Cnp(p), Direction::Ingress) => {
                PeerSlice::CnpIngress(&p.spec.ingress.get(i)?.from)
            }
            (AdminObject::Cnp(p), Direction::Egress) => {
                PeerSlice::CnpEgress(&p.spec.egress.get(i)?.to)
            }
        })
    }

    fn len(self) -> usize {
        match self {
            PeerSlice::AnpIngress(s) => s.len(),
            PeerSlice::AnpEgress(s) => s.len(),
            PeerSlice::BanpEgress(s) => s.len(),
            PeerSlice::CnpIngress(s) => s.len(),
            PeerSlice::CnpEgress(s) => s.len(),
        }
    }

    /// Peer `j` (below [`PeerSlice::len`]).
    fn get(self, j: usize) -> PeerFields<'a> {
        match self {
            PeerSlice::AnpIngress(s) => PeerFields::anp_ingress(&s[j]),
            PeerSlice::AnpEgress(s) => PeerFields::anp_egress(&s[j]),
            PeerSlice::BanpEgress(s) => PeerFields::banp_egress(&s[j]),
            PeerSlice::CnpIngress(s) => PeerFields::cnp_ingress(&s[j]),
            PeerSlice::CnpEgress(s) => PeerFields::cnp_egress(&s[j]),
        }
    }

    fn iter(self) -> impl ExactSizeIterator<Item = PeerFields<'a>> {
        (0..self.len()).map(move |j| self.get(j))
    }

    /// Reads the first label of every selector peer (its `Labels` slice and the first
    /// bytes of its first key and value) and nothing else. Each peer's reads are
    /// independent of the others', so the CPU overlaps their cache misses, where validating
    /// peer after peer waits for each miss in turn: reading a million scattered peers took
    /// 66 ms after this pass against 98 ms without, on one thread.
    fn touch(self) {
        fn first(s: &str) -> u8 {
            s.as_bytes().first().copied().unwrap_or(0)
        }
        let mut acc = 0u8;
        let mut sel = |s: &LabelSelector| {
            if let Some((k, v)) = s.match_labels.as_ref().and_then(Labels::first) {
                acc ^= first(k) ^ first(v);
            }
            if let Some(e) = s.match_expressions.as_ref().and_then(|e| e.first()) {
                acc ^= first(&e.key);
            }
        };
        for p in self.iter() {
            if let Some(ns) = p.namespaces {
                sel(ns);
            }
            if let Some(np) = p.pods {
                sel(&np.namespace_selector);
                sel(&np.pod_selector);
            }
        }
        std::hint::black_box(acc);
    }
}

/// Compiles rule `i` of direction `d` of an admin object (`i` below its [`rule_counts`]),
/// with [`admin_rule`].
fn admin_rule_at<'a>(
    obj: AdminObject<'a>,
    d: Direction,
    i: usize,
    dict: &mut PeerDict,
    node_index: &LabelIndex,
) -> Rule {
    let (name, action, ports) = match (obj, d) {
        (AdminObject::Anp(p), Direction::Ingress) => {
            let r = &p.spec.ingress[i];
            (&r.name, anp_action(r.action), anp_ports(&r.ports))
        }
        (AdminObject::Anp(p), Direction::Egress) => {
            let r = &p.spec.egress[i];
            (&r.name, anp_action(r.action), anp_ports(&r.ports))
        }
        (AdminObject::Cnp(p), Direction::Ingress) => {
            let r = &p.spec.ingress[i];
            (&r.name, cnp_action(r.action), cnp_ports(&r.protocols))
        }
        (AdminObject::Cnp(p), Direction::Egress) => {
            let r = &p.spec.egress[i];
            (&r.name, cnp_action(r.action), cnp_ports(&r.protocols))
        }
        (AdminObject::Banp(p), Direction::Ingress) => {
            let r = &p.spec.ingress[i];
            (&r.name, banp_action(r.action), anp_ports(&r.ports))
        }
        (AdminObject::Banp(p), Direction::Egress) => {
            let r = &p.spec.egress[i];
            (&r.name, banp_action(r.action), anp_ports(&r.ports))
        }
    };
    match PeerSlice::of(obj, d, i) {
        Some(peers) => admin_rule(i, name, action, peers.iter(), ports, dict, node_index),
        None => admin_rule(i, name, action, std::iter::empty(), ports, dict, node_index),
    }
}

/// Runs [`PeerSlice::touch`] on the rule after rule `i` of direction `d` (ingress rules,
/// then egress rules), if there is one.
fn touch_next_rule(obj: AdminObject<'_>, d: Direction, i: usize) {
    let next = PeerSlice::of(obj, d, i + 1).or(match d {
        Direction::Ingress => PeerSlice::of(obj, Direction::Egress, 0),
        Direction::Egress => None,
    });
    if let Some(peers) = next {
        peers.touch();
    }
}

/// The [`Matcher`]s of every policy direction with at most [`MAX_RULES`] rules, by
/// policy, built on worker threads (each depends only on its policy's rules and the
/// interned pod sets).
fn build_matchers(
    policies: &[Policy],
    sets: &[RoaringBitmap],
    addrs: &PodAddrs,
    pods: usize,
    workers: usize,
) -> Vec<[Option<Matcher>; 2]> {
    let weights: Vec<usize> = policies
        .iter()
        .map(|p| p.rules.iter().flatten().map(|r| 1 + r.peers.pod_sets.len()).sum())
        .collect();
    let ranges = balanced_ranges(&weights, workers);
    let built = par_ranges(policies, &ranges, |_, chunk| {
        let mut scratch = vec![0; pods];
        let mut build = |r: &Vec<Rule>| {
            (r.len() <= MAX_RULES).then(|| Matcher::build(r, sets, addrs, &mut scratch))
        };
        chunk.iter().map(|p| [build(&p.rules[0]), build(&p.rules[1])]).collect::<Vec<_>>()
    });
    built.into_iter().flatten().collect()
}

impl Cluster {
    fn subject(
        &mut self,
        namespaces: &Option<LabelSelector>,
        pods: &Option<NamespacedPod>,
    ) -> RoaringBitmap {
        let key = match (namespaces, pods) {
            (Some(ns), _) => selector(ns).map(SetKey::Namespaces),
            (None, Some(p)) => namespaced_pod_key(p),
            // Validation rejects an empty subject; it selects nothing.
            (None, None) => None,
        };
        match key {
            Some(k) => {
                let id = self.intern(k);
                self.interner.sets[id as usize].clone()
            }
            None => RoaringBitmap::new(),
        }
    }
}

fn anp_action(a: v1alpha1::AdminNetworkPolicyRuleAction) -> Action {
    match a {
        v1alpha1::AdminNetworkPolicyRuleAction::Allow => Action::Allow,
        v1alpha1::AdminNetworkPolicyRuleAction::Deny => Action::Deny,
        v1alpha1::AdminNetworkPolicyRuleAction::Pass => Action::Pass,
    }
}

fn banp_action(a: v1alpha1::BaselineAdminNetworkPolicyRuleAction) -> Action {
    match a {
        v1alpha1::BaselineAdminNetworkPolicyRuleAction::Allow => Action::Allow,
        v1alpha1::BaselineAdminNetworkPolicyRuleAction::Deny => Action::Deny,
    }
}

fn cnp_action(a: v1alpha2::ClusterNetworkPolicyRuleAction) -> Action {
    match a {
        v1alpha2::ClusterNetworkPolicyRuleAction::Accept => Action::Allow,
        v1alpha2::ClusterNetworkPolicyRuleAction::Deny => Action::Deny,
        v1alpha2::ClusterNetworkPolicyRuleAction::Pass => Action::Pass,
    }
}

fn meta_name(m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> String {
    m.name.clone().unwrap_or_default()
}

/// The namespace of a namespaced object; manifests may omit it, meaning `default`, as
/// `kubectl apply` does.
pub fn meta_namespace(m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> String {
    m.namespace.clone().filter(|n| !n.is_empty()).unwrap_or_else(|| "default".to_string())
}

/// Keeps the last object per key, then orders by key, so the result is independent of
/// input order. Reports each duplicate.
fn dedup_sorted<'a, T>(
    items: &'a [Arc<T>],
    key: impl Fn(&T) -> ObjectRef,
    problems: &mut Vec<Problem>,
) -> Vec<(ObjectRef, &'a T)> {
    let mut map: BTreeMap<ObjectRef, &T> = BTreeMap::new();
    for it in items {
        let it: &T = it;
        let k = key(it);
        if map.insert(k.clone(), it).is_some() {
            problems.push(Problem::warning(&k, "", ProblemKind::Duplicate));
        }
    }
    map.into_iter().collect()
}

fn parse_ips(values: impl IntoIterator<Item = String>) -> Vec<IpAddr> {
    let mut out: Vec<IpAddr> = Vec::new();
    for v in values {
        if let Ok(ip) = v.parse::<IpAddr>()
            && !out.contains(&ip)
        {
            out.push(ip);
        }
    }
    out
}

/// What a worker makes of one pod: its validation problems and, unless it has errors or
/// has terminated, the fields a snapshot keeps.
/// A Pod as the engine reads it: what a store of many pods keeps instead of the whole
/// object. Its struct is about 150 bytes, against 4.8 kB for a k8s-openapi `Pod` with
/// one `Container` before any string; stored with its labels and key, about 1.2 kB of RSS
/// per pod of the synthetic clusters against 5.4 kB.
///
/// Source: the fields the engine reads of `v1` Pod: `metadata.{namespace,name,labels}`,
/// `spec.nodeName`, `spec.hostNetwork`, the named ports of `spec.containers[*].ports`,
/// `status.phase`, `status.podIP` and `status.podIPs`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PodView {
    /// `metadata.namespace` (`default` when empty).
    pub namespace: String,
    /// `metadata.name`.
    pub name: String,
    /// `metadata.labels`.
    pub labels: Labels,
    /// `spec.nodeName`.
    pub node_name: Option<String>,
    /// `spec.hostNetwork`.
    pub host_network: bool,
    /// `status.phase` is Succeeded or Failed: the pod holds no IP and takes no traffic.
    /// A source that validates pods itself (the manifest source's compact form) sets it
    /// for an invalid pod too, which the compiler would leave out the same way.
    pub terminated: bool,
    /// `status.podIP` and `status.podIPs`, parsed, without duplicates, podIP first; where
    /// podIPs\[0\] disagrees with podIP, podIPs is dropped (as the v1 conversion does).
    pub ips: Vec<IpAddr>,
    /// The named ports of `spec.containers` (named ports resolve on them).
    pub named_ports: Vec<NamedPort>,
}

impl PodView {
    /// The view of `pod`. Unparseable IPs are left out (validation reports them).
    pub fn from_pod(pod: &Pod) -> PodView {
        let spec = pod.spec.as_ref();
        PodView {
            namespace: meta_namespace(&pod.metadata),
            name: meta_name(&pod.metadata),
            labels: pod.metadata.labels.as_ref().map(Labels::from).unwrap_or_default(),
            node_name: spec.and_then(|s| s.node_name.clone()),
            host_network: spec.and_then(|s| s.host_network).unwrap_or(false),
            terminated: terminated(pod),
            ips: pod_ips(pod),
            named_ports: named_ports(pod),
        }
    }

    fn object_ref(&self) -> ObjectRef {
        ObjectRef::namespaced(Kind::Pod, self.namespace.clone(), self.name.clone())
    }
}

struct PodFields<'a> {
    /// `spec.nodeName`.
    node: Option<&'a String>,
    /// `status.podIP` / `status.podIPs`, parsed.
    ips: Vec<IpAddr>,
    host_network: bool,
    /// Named container ports.
    ports: Vec<NamedPort>,
}

/// `status.phase` is Succeeded or Failed: the pod holds no IP and takes no traffic.
fn terminated(pod: &Pod) -> bool {
    matches!(pod.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Succeeded" | "Failed"))
}

/// `status.podIP` and `status.podIPs`, parsed, podIP first. "podIPs ... If this field is
/// specified, the 0th entry must match the podIP field"; where they disagree, the v1
/// conversion keeps podIP and drops podIPs.
fn pod_ips(pod: &Pod) -> Vec<IpAddr> {
    let Some(st) = pod.status.as_ref() else { return Vec::new() };
    let listed: Vec<String> = st.pod_ips.iter().flatten().map(|p| p.ip.clone()).collect();
    match &st.pod_ip {
        Some(ip) if listed.first().is_some_and(|first| first != ip) => parse_ips([ip.clone()]),
        Some(ip) => parse_ips(std::iter::once(ip.clone()).chain(listed)),
        None => parse_ips(listed),
    }
}

/// The named ports of `spec.containers`.
fn named_ports(pod: &Pod) -> Vec<NamedPort> {
    pod.spec
        .iter()
        .flat_map(|s| s.containers.iter())
        .flat_map(|ctr| ctr.ports.iter().flatten())
        .filter_map(|p| {
            Some(NamedPort {
                name: p.name.clone().filter(|n| !n.is_empty())?,
                protocol: protocol_or_tcp(p.protocol.as_deref()),
                port: port_u16(p.container_port),
            })
        })
        .collect()
}

/// Labels of a pod without any.
static NO_LABELS: BTreeMap<String, String> = BTreeMap::new();

/// One pod as the compile loop reads it, borrowed from a whole Pod or from a view.
struct PodItem<'a> {
    labels: LabelsRef<'a>,
    /// `None`: terminated or invalid (no IP, no traffic).
    fields: Option<PodFields<'a>>,
}

/// Validates a whole `pod` (with `validate`) and reads its fields without copying its
/// labels or names.
fn prepare_pod(pod: &Pod, validate: bool) -> (Vec<Problem>, PodItem<'_>) {
    let mut problems = Vec::new();
    if validate {
        validate::pod(pod, &mut problems);
    }
    let usable = !terminated(pod) && !problems.iter().any(Problem::is_error);
    let spec = pod.spec.as_ref();
    let fields = usable.then(|| PodFields {
        node: spec.and_then(|s| s.node_name.as_ref()),
        ips: pod_ips(pod),
        host_network: spec.and_then(|s| s.host_network).unwrap_or(false),
        ports: named_ports(pod),
    });
    let labels = LabelsRef::Map(pod.metadata.labels.as_ref().unwrap_or(&NO_LABELS));
    (problems, PodItem { labels, fields })
}

/// The per-pod fields the snapshot keeps; `None` for a terminated pod.
fn pod_fields(view: &PodView) -> Option<PodFields<'_>> {
    (!view.terminated).then(|| PodFields {
        node: view.node_name.as_ref(),
        ips: view.ips.clone(),
        host_network: view.host_network,
        ports: view.named_ports.clone(),
    })
}

impl Snapshot {
    /// Compiles `inputs` into a snapshot with `revision`.
    ///
    /// Never fails: objects with validation errors are left out and reported in
    /// [`Compiled::problems`] (with warnings for what is used but worth knowing). The result
    /// does not depend on the order of objects within `inputs`.
    pub fn compile(inputs: &Inputs, revision: Revision) -> Compiled {
        Self::compile_inner(inputs, revision, true, default_workers())
    }

    /// [`Snapshot::compile`] for inputs whose objects were each validated already (the
    /// daemon validates an object once, when it changes, not on every snapshot) and from
    /// which invalid objects were removed. Skips validation; everything else is the same.
    pub fn compile_validated(inputs: &Inputs, revision: Revision) -> Compiled {
        Self::compile_inner(inputs, revision, false, default_workers())
    }

    /// `workers`: most threads to spread the large parts over (see [`balanced_ranges`]).
    fn compile_inner(
        inputs: &Inputs,
        revision: Revision,
        validate: bool,
        workers: usize,
    ) -> Compiled {
        let mut problems = Vec::new();

        // --- Namespaces.
        let namespaces = dedup_sorted(
            &inputs.namespaces,
            |n| ObjectRef::cluster(Kind::Namespace, meta_name(&n.metadata)),
            &mut problems,
        );
        let mut c = Cluster {
            ns_pods: HashMap::new(),
            pods: Vec::new(),
            namespaces: Vec::new(),
            ns_ids: HashMap::new(),
            nodes: Vec::new(),
            pod_index: LabelIndex::default(),
            ns_index: LabelIndex::default(),
            node_index: LabelIndex::default(),
            interner: Interner::default(),
            addrs: PodAddrs::default(),
        };
        for (r, ns) in namespaces {
            let start = problems.len();
            if validate {
                validate::namespace(ns, &mut problems);
            }
            if problems[start..].iter().any(Problem::is_error) {
                continue;
            }
            let mut labels = ns.metadata.labels.clone().unwrap_or_default();
            // SetDefaults_Namespace: the API server sets `kubernetes.io/metadata.name` to the
            // name, overwriting any other value (KEP-2161), so selectors on it always work.
            labels.insert(NAMESPACE_NAME_LABEL.to_string(), r.name.clone());
            c.ns_ids.insert(r.name.clone(), c.namespaces.len() as u32);
            c.namespaces.push(NamespaceEntry { name: r.name, labels, pods: RoaringBitmap::new() });
        }

        // --- Nodes.
        let nodes = dedup_sorted(
            &inputs.nodes,
            |n| ObjectRef::cluster(Kind::Node, meta_name(&n.metadata)),
            &mut problems,
        );
        let mut node_ids: HashMap<String, u32> = HashMap::new();
        let mut node_addrs: Vec<Vec<IpAddr>> = Vec::new();
        for (r, node) in nodes {
            let start = problems.len();
            if validate {
                validate::node(node, &mut problems);
            }
            if problems[start..].iter().any(Problem::is_error) {
                continue;
            }
            // Node IPs: status.addresses of type InternalIP / ExternalIP.
            let addrs = node
                .status
                .as_ref()
                .and_then(|s| s.addresses.as_ref())
                .map(|a| {
                    parse_ips(
                        a.iter()
                            .filter(|a| a.type_ == "InternalIP" || a.type_ == "ExternalIP")
                            .map(|a| a.address.clone()),
                    )
                })
                .unwrap_or_default();
            let id = c.nodes.len() as u32;
            node_ids.insert(r.name.clone(), id);
            c.nodes.push(NodeEntry {
                name: r.name,
                labels: node.metadata.labels.clone().unwrap_or_default(),
                annotations: own_annotations(&node.metadata),
            });
            node_addrs.push(addrs);
        }

        // --- Pods.
        let pods = dedup_sorted(
            &inputs.pods,
            |p| {
                ObjectRef::namespaced(
                    Kind::Pod,
                    meta_namespace(&p.metadata),
                    meta_name(&p.metadata),
                )
            },
            &mut problems,
        );
        let mut pod_ips: Vec<Vec<IpAddr>> = Vec::new();
        let mut pod_labels: Vec<LabelsRef<'_>> = Vec::new();
        // hostNetwork pods' IPs are their node's: gathered to add to node addresses.
        let mut host_ips: Vec<(u32, Vec<IpAddr>)> = Vec::new();
        // Validation and the views of whole Pods on worker threads; then the views a
        // source gave (they win over a Pod with the same name), in key order.
        let prepared = par_ranges(&pods, &balanced_ranges(&vec![1; pods.len()], workers), {
            |_, chunk| chunk.iter().map(|&(_, pod)| prepare_pod(pod, validate)).collect::<Vec<_>>()
        });
        let mut items: BTreeMap<ObjectRef, PodItem<'_>> = BTreeMap::new();
        for ((r, _), (found, item)) in pods.into_iter().zip(prepared.into_iter().flatten()) {
            problems.extend(found);
            items.insert(r, item);
        }
        for v in &inputs.pod_views {
            let r = v.object_ref();
            let item = PodItem { labels: LabelsRef::Compact(&v.labels), fields: pod_fields(v) };
            if items.insert(r.clone(), item).is_some() {
                problems.push(Problem::warning(&r, "", ProblemKind::Duplicate));
            }
        }
        for (r, item) in items {
            let Some(PodFields { node, ips, host_network, ports }) = item.fields else {
                continue;
            };
            let node = node.map(|n| match node_ids.get(n.as_str()) {
                Some(&id) => id,
                None => {
                    // A node known only from pods: no labels, no addresses but its
                    // hostNetwork pods'.
                    let id = c.nodes.len() as u32;
                    c.nodes.push(NodeEntry {
                        name: n.clone(),
                        labels: BTreeMap::new(),
                        annotations: Box::default(),
                    });
                    node_addrs.push(Vec::new());
                    node_ids.insert(n.clone(), id);
                    id
                }
            });
            if host_network {
                // "Note that host-networked pods are not included in subject selection" /
                // "in this type of peer": such a pod is its node, for policy.
                if let Some(n) = node {
                    host_ips.push((n, ips));
                }
                continue;
            }
            let ns = match c.ns_ids.get(r.namespace.as_deref().unwrap_or_default()) {
                Some(&id) => id,
                None => {
                    let name = r.namespace.clone().unwrap_or_default();
                    let labels = BTreeMap::from([(NAMESPACE_NAME_LABEL.to_string(), name.clone())]);
                    let id = c.namespaces.len() as u32;
                    c.ns_ids.insert(name.clone(), id);
                    c.namespaces.push(NamespaceEntry { name, labels, pods: RoaringBitmap::new() });
                    id
                }
            };
            let id = c.pods.len() as u32;
            c.namespaces[ns as usize].pods.insert(id);
            c.pods.push(PodEntry { namespace: ns, name: r.name, node, ports });
            pod_ips.push(ips);
            pod_labels.push(item.labels);
        }
        c.addrs = PodAddrs::new(&pod_ips);
        for (n, ips) in host_ips {
            for ip in ips {
                if !node_addrs[n as usize].contains(&ip) {
                    node_addrs[n as usize].push(ip);
                }
            }
        }
        for (i, labels) in pod_labels.iter().enumerate() {
            c.pod_index.insert(i as u32, labels);
        }
        for (i, ns) in c.namespaces.iter().enumerate() {
            c.ns_index.insert(i as u32, &ns.labels);
        }
        for (i, n) in c.nodes.iter().enumerate() {
            c.node_index.insert(i as u32, &n.labels);
        }

        // --- Addresses: nodes first, then pods; the first claimant keeps an address.
        let mut by_ip: HashMap<IpAddr, Endpoint> = HashMap::new();
        let mut owner: HashMap<IpAddr, ObjectRef> = HashMap::new();
        let claims = node_addrs
            .iter()
            .enumerate()
            .flat_map(|(i, a)| a.iter().map(move |ip| (*ip, Endpoint::Node(i as u32))))
            .chain(
                pod_ips
                    .iter()
                    .enumerate()
                    .flat_map(|(i, a)| a.iter().map(move |ip| (*ip, Endpoint::Pod(i as u32)))),
            );
        for (ip, ep) in claims {
            let who = match ep {
                Endpoint::Node(n) => {
                    ObjectRef::cluster(Kind::Node, c.nodes[n as usize].name.clone())
                }
                Endpoint::Pod(p) => {
                    let pod = &c.pods[p as usize];
                    ObjectRef::namespaced(
                        Kind::Pod,
                        c.namespaces[pod.namespace as usize].name.clone(),
                        pod.name.clone(),
                    )
                }
                Endpoint::External => continue,
            };
            match owner.get(&ip) {
                Some(first) if *first != who => problems.push(Problem::warning(
                    &who,
                    "status",
                    ProblemKind::AddressConflict { addr: ip, other: first.clone() },
                )),
                Some(_) => {}
                None => {
                    owner.insert(ip, who);
                    by_ip.insert(ip, ep);
                }
            }
        }

        // --- Policies, gathered per tier and then ordered.
        let mut policies: Vec<Policy> = Vec::new();

        // Admin- and baseline-tier objects (ANP, CNP, BANP) hold nearly all of a large
        // input's peers: they are validated and their selector peers keyed on worker
        // threads (`prepare_admin`); each distinct peer is then compiled once, here.
        let mut duplicates: [Vec<Problem>; 3] = Default::default();
        // Cluster-scoped admin objects of one kind, deduplicated, as `AdminObject`s.
        fn of_kind<'a, T: kube::Resource>(
            items: &'a [Arc<T>],
            kind: Kind,
            wrap: fn(&'a T) -> AdminObject<'a>,
            duplicates: &mut Vec<Problem>,
        ) -> impl Iterator<Item = (ObjectRef, AdminObject<'a>)> {
            let key = move |p: &T| ObjectRef::cluster(kind, meta_name(p.meta()));
            dedup_sorted(items, key, duplicates).into_iter().map(move |(r, p)| (r, wrap(p)))
        }
        let [anp_dups, cnp_dups, banp_dups] = &mut duplicates;
        let admin_items: Vec<(ObjectRef, AdminObject<'_>)> = of_kind(
            &inputs.admin_network_policies,
            Kind::AdminNetworkPolicy,
            AdminObject::Anp,
            anp_dups,
        )
        .chain(of_kind(
            &inputs.cluster_network_policies,
            Kind::ClusterNetworkPolicy,
            AdminObject::Cnp,
            cnp_dups,
        ))
        .chain(of_kind(
            &inputs.baseline_admin_network_policies,
            Kind::BaselineAdminNetworkPolicy,
            AdminObject::Banp,
            banp_dups,
        ))
        .collect();
        let (prepared, dicts) = prepare_admin(&admin_items, &c.node_index, validate, workers);
        // Worker order, so set ids do not depend on thread timing.
        // Only keys that valid objects use get a pod set: a key whose selectors do not
        // compile is in no rule (its peers failed closed), nor is a key only invalid
        // objects used.
        let mut used: Vec<Vec<bool>> = dicts.iter().map(|d| vec![false; d.sets.len()]).collect();
        for p in &prepared {
            for rule in p.body.iter().flat_map(|b| b.rules.iter().flatten()) {
                for &k in &rule.peers.pod_sets {
                    used[p.worker][k as usize] = true;
                }
            }
        }
        // Workers' keys naming the same set meet in the interner.
        let key_sets: Vec<Vec<SetId>> = dicts
            .into_iter()
            .zip(&used)
            .map(|(d, used)| {
                d.sets
                    .into_iter()
                    .zip(used)
                    .map(|(set, &used)| set.filter(|_| used).map_or(SetId::MAX, |k| c.intern(k)))
                    .collect()
            })
            .collect();
        // Problems per kind in input order, as for every other kind: a kind's duplicates,
        // then its objects' validation problems.
        // Rules' keys become set ids, on the workers again (a million ids to sort).
        let mut prepared = prepared;
        let weights: Vec<usize> = prepared
            .iter()
            .map(|p| p.body.iter().flat_map(|b| b.rules.iter().flatten()))
            .map(|rules| rules.map(|r| r.peers.pod_sets.len()).sum())
            .collect();
        par_for_each_mut(&mut prepared, &balanced_ranges(&weights, workers), |p| {
            for rule in p.body.iter_mut().flat_map(|b| b.rules.iter_mut().flatten()) {
                let ids = &mut rule.peers.pod_sets;
                for id in ids.iter_mut() {
                    *id = key_sets[p.worker][*id as usize];
                }
                ids.sort_unstable();
                ids.dedup();
            }
        });
        let mut reported = 0;
        for ((r, obj), p) in admin_items.into_iter().zip(prepared) {
            while reported <= obj.order() {
                problems.append(&mut duplicates[reported]);
                reported += 1;
            }
            problems.extend(p.problems);
            if let Some(body) = p.body {
                policies.push(c.admin_policy(r, body, own_annotations(obj.metadata())));
            }
        }
        for d in &mut duplicates[reported..] {
            problems.append(d);
        }

        for (r, np) in dedup_sorted(
            &inputs.network_policies,
            |p| {
                ObjectRef::namespaced(
                    Kind::NetworkPolicy,
                    meta_namespace(&p.metadata),
                    meta_name(&p.metadata),
                )
            },
            &mut problems,
        ) {
            let start = problems.len();
            if validate {
                validate::network_policy(np, &mut problems);
            }
            if problems[start..].iter().any(Problem::is_error) {
                continue;
            }
            if let Some(p) = c.network_policy(r, np) {
                policies.push(p);
            }
        }

        // Evaluation order inside each tier: priority, then name, then kind — "ties broken
        // deterministically by name" (DESIGN §2); `check` reports the ties.
        policies.sort_by(|a, b| {
            (a.tier, a.priority, &a.object.name, a.object.kind, &a.object.namespace).cmp(&(
                b.tier,
                b.priority,
                &b.object.name,
                b.object.kind,
                &b.object.namespace,
            ))
        });

        // The matchers on worker threads, and beside them (a third thread on a small
        // machine, which the OS interleaves) the port and address indexes: independent
        // sweeps over every rule.
        let (matchers, (port_index, addr_index)) = std::thread::scope(|scope| {
            let indexes = (workers > 1 && policies.len() >= 64)
                .then(|| scope.spawn(|| (port_index(&policies, &c.pods), addr_index(&policies))));
            let matchers =
                build_matchers(&policies, &c.interner.sets, &c.addrs, c.pods.len(), workers);
            let indexes = match indexes {
                Some(h) => h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)),
                None => (port_index(&policies, &c.pods), addr_index(&policies)),
            };
            (matchers, indexes)
        });
        for (p, m) in policies.iter_mut().zip(matchers) {
            p.matchers = m;
        }

        let mut per_pod = vec![PodPolicies::default(); c.pods.len()];
        for (pid, p) in policies.iter().enumerate() {
            for d in Direction::BOTH {
                if !p.applies[d as usize] {
                    continue;
                }
                for pod in &p.subject {
                    let lists = &mut per_pod[pod as usize];
                    let list = match p.tier {
                        Tier::Admin => &mut lists.admin[d as usize],
                        Tier::NetworkPolicy => &mut lists.network[d as usize],
                        Tier::Baseline => &mut lists.baseline[d as usize],
                    };
                    list.push(pid as u32);
                }
            }
        }

        let mut policy_sets: Vec<PodPolicies> = Vec::new();
        let mut set_ids: HashMap<PodPolicies, u32> = HashMap::new();
        let per_pod: Vec<u32> = per_pod
            .into_iter()
            .map(|lists| {
                *set_ids.entry(lists).or_insert_with_key(|lists| {
                    policy_sets.push(lists.clone());
                    (policy_sets.len() - 1) as u32
                })
            })
            .collect();
        drop(set_ids);
        let snapshot = Snapshot {
            revision,
            pods: c.pods,
            namespaces: c.namespaces,
            nodes: c.nodes,
            by_ip,
            node_addrs,
            pod_ips,
            pod_sets: c.interner.sets,
            policies,
            per_pod,
            policy_sets,
            port_index,
            addr_index,
            pod_index: c.pod_index,
        };
        Compiled { snapshot, problems }
    }
}

/// Builds the [`PortIndex`] of every direction and protocol. Named ports count as every
/// port number some pod declares under that name (and protocol): a superset, so the index
/// never hides a policy that could match.
fn port_index(policies: &[Policy], pods: &[PodEntry]) -> [[PortIndex; 3]; 2] {
    let mut declared: HashMap<&str, Vec<(Protocol, u16)>> = HashMap::new();
    for np in pods.iter().flat_map(|p| &p.ports) {
        let e = declared.entry(np.name.as_str()).or_default();
        if !e.contains(&(np.protocol, np.port)) {
            e.push((np.protocol, np.port));
        }
    }
    let mut out: [[PortIndex; 3]; 2] = Default::default();
    for d in Direction::BOTH {
        let mut ranges: [Vec<(u32, u32, u32)>; 3] = Default::default();
        for (pid, p) in policies.iter().enumerate() {
            let pid = pid as u32;
            for r in &p.rules[d as usize] {
                if r.ports.0.is_empty() {
                    for proto in &mut ranges {
                        proto.push((0, u16::MAX as u32, pid));
                    }
                }
                for m in &r.ports.0 {
                    match (&m.ports, m.protocol) {
                        (PortSpec::Any, Some(proto)) => {
                            ranges[protocol_index(proto)].push((0, u16::MAX as u32, pid))
                        }
                        (PortSpec::Range(lo, hi), Some(proto)) => {
                            ranges[protocol_index(proto)].push((*lo as u32, *hi as u32, pid))
                        }
                        (PortSpec::Named(name), want) => {
                            for &(proto, port) in declared.get(name.as_str()).into_iter().flatten()
                            {
                                if want.is_none_or(|w| w == proto) {
                                    ranges[protocol_index(proto)].push((
                                        port as u32,
                                        port as u32,
                                        pid,
                                    ));
                                }
                            }
                        }
                        (_, None) => {}
                    }
                }
            }
        }
        out[d as usize] = ranges.map(|mut r| PortIndex::build(&mut r, policies.len()));
    }
    out
}

/// Builds the [`AddrIndex`] of each direction: every `networks`/`ipBlock` range of every
/// rule, and the whole address space for rules that match every peer.
fn addr_index(policies: &[Policy]) -> [AddrIndex; 2] {
    Direction::BOTH.map(|d| {
        let (mut v4, mut v6) = (Vec::new(), Vec::new());
        let mut scratch = Vec::new();
        for (pid, p) in policies.iter().enumerate() {
            let pid = pid as u32;
            for r in &p.rules[d as usize] {
                if r.peers.all {
                    v4.push((0, u32::MAX as u128, pid));
                    v6.push((0, u128::MAX, pid));
                }
                for b in &r.peers.blocks {
                    block_ranges(b, &mut scratch);
                    let target = if b.net.addr().is_ipv4() { &mut v4 } else { &mut v6 };
                    target.extend(scratch.drain(..).map(|(lo, hi)| (lo, hi, pid)));
                }
            }
        }
        AddrIndex::build(&mut v4, &mut v6, policies.len())
    })
}

/// Sort key of the BaselineAdminNetworkPolicy within the Baseline tier: after every
/// ClusterNetworkPolicy `tier: Baseline` (whose priorities are 0–1000).
const BANP_PRIORITY: i32 = 1001;

impl Cluster {
    /// Finishes a validated admin object prepared by [`prepare_admin`], whose rules' peer
    /// keys are already pod set ids: resolves its subject. Its matchers come later
    /// ([`build_matchers`]).
    fn admin_policy(
        &mut self,
        object: ObjectRef,
        body: AdminBody<'_>,
        annotations: Box<[(String, String)]>,
    ) -> Policy {
        let AdminBody { tier, priority, namespaces, pods, rules } = body;
        let subject = self.subject(namespaces, pods);
        // "ANPs with no ingress rules do not affect ingress traffic."
        let applies = [!rules[0].is_empty(), !rules[1].is_empty()];
        Policy {
            object,
            tier,
            priority,
            rules,
            matchers: [None, None],
            subject,
            applies,
            annotations,
        }
    }

    fn network_policy(&mut self, object: ObjectRef, np: &NetworkPolicy) -> Option<Policy> {
        use k8s_openapi::api::networking::v1::{
            NetworkPolicyEgressRule, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicySpec,
        };
        let ns_name = object.namespace.clone().unwrap_or_default();
        let ns = match self.ns_ids.get(&ns_name) {
            Some(&id) => id,
            // No pod lives in a namespace nobody declared: the policy selects nothing.
            None => return None,
        };
        let no_spec = NetworkPolicySpec::default();
        let NetworkPolicySpec { egress, ingress, pod_selector, policy_types } =
            np.spec.as_ref().unwrap_or(&no_spec);
        // "This field is optional. If it is not specified, it defaults to an empty
        // selector" — which selects all pods in the namespace.
        let subject = match selector(&pod_selector.clone().unwrap_or_default()) {
            Some(s) => {
                let id = self.intern(SetKey::InNamespace(ns, s));
                self.pod_sets(id).clone()
            }
            None => RoaringBitmap::new(),
        };
        // policyTypes defaulting (API server, SetDefaults_NetworkPolicySpec): "If this field
        // is not specified, it will default based on the existence of ingress or egress
        // rules; policies that contain an egress section are assumed to affect egress, and
        // all policies (whether or not they contain an ingress section) are assumed to
        // affect ingress."
        let applies = match policy_types.as_deref() {
            Some(t) if !t.is_empty() => {
                [t.iter().any(|t| t == "Ingress"), t.iter().any(|t| t == "Egress")]
            }
            _ => [true, egress.as_ref().is_some_and(|e| !e.is_empty())],
        };
        let mut rules: [Vec<Rule>; 2] = [Vec::new(), Vec::new()];
        let compile_rule = |c: &mut Cluster, peers: &Option<Vec<NetworkPolicyPeer>>| -> Peers {
            // "If this field is empty or missing, this rule matches all sources/destinations."
            let Some(list) = peers.as_ref().filter(|l| !l.is_empty()) else {
                return Peers { all: true, ..Peers::default() };
            };
            let mut out = Peers::default();
            for p in list {
                let NetworkPolicyPeer { ip_block, namespace_selector, pod_selector } = p;
                if let Some(b) = ip_block {
                    if let Ok(net) = cidr::parse(&b.cidr) {
                        let except =
                            b.except.iter().flatten().filter_map(|e| cidr::parse(e).ok()).collect();
                        out.blocks.push(Block { net, except });
                    }
                    continue;
                }
                let key = match (namespace_selector, pod_selector) {
                    // "If namespaceSelector is also set, then the NetworkPolicyPeer as a
                    // whole selects the pods matching podSelector in the Namespaces selected
                    // by NamespaceSelector."
                    (Some(n), Some(p)) => {
                        selector(n).zip(selector(p)).map(|(n, p)| SetKey::Pods(n, p))
                    }
                    (Some(n), None) => selector(n).map(SetKey::Namespaces),
                    // "Otherwise it selects the pods matching podSelector in the policy's own
                    // namespace."
                    (None, Some(p)) => selector(p).map(|p| SetKey::InNamespace(ns, p)),
                    (None, None) => None,
                };
                if let Some(k) = key {
                    out.pod_sets.push(c.intern(k));
                }
            }
            out.pod_sets.sort_unstable();
            out.pod_sets.dedup();
            out
        };
        if applies[Direction::Ingress as usize] {
            for (i, r) in ingress.iter().flatten().enumerate() {
                let NetworkPolicyIngressRule { from, ports } = r;
                let peers = compile_rule(self, from);
                rules[0].push(Rule {
                    name: None,
                    index: i as u32,
                    action: Action::Allow,
                    peers,
                    ports: np_ports(ports),
                    fail_closed: false,
                });
            }
        }
        if applies[Direction::Egress as usize] {
            for (i, r) in egress.iter().flatten().enumerate() {
                let NetworkPolicyEgressRule { to, ports } = r;
                let peers = compile_rule(self, to);
                rules[1].push(Rule {
                    name: None,
                    index: i as u32,
                    action: Action::Allow,
                    peers,
                    ports: np_ports(ports),
                    fail_closed: false,
                });
            }
        }
        Some(Policy {
            object,
            tier: Tier::NetworkPolicy,
            priority: 0,
            rules,
            matchers: [None, None],
            subject,
            applies,
            annotations: own_annotations(&np.metadata),
        })
    }

    fn pod_sets(&self, id: SetId) -> &RoaringBitmap {
        &self.interner.sets[id as usize]
    }
}

/// Pairs of admin-tier (or baseline-tier CNP) policies with equal priority whose subjects
/// overlap, each with the number of pods both select: one warning on each policy of a
/// pair, naming the other and saying which is evaluated first (policies are in evaluation
/// order, so the first of a pair is the one ordered first). Used by `check` and the policy
/// status (KEP-2091 "Risks and Mitigations": "provide a warning if there is another ANP
/// with the same priority").
pub fn priority_conflicts(s: &Snapshot) -> Vec<Problem> {
    let mut out = Vec::new();
    let by_prio: BTreeMap<(Tier, i32), Vec<&Policy>> = s
        .policies
        .iter()
        .filter(|p| p.tier != Tier::NetworkPolicy && p.priority != BANP_PRIORITY)
        .fold(BTreeMap::new(), |mut m, p| {
            m.entry((p.tier, p.priority)).or_insert_with(Vec::new).push(p);
            m
        });
    for ((_, prio), ps) in by_prio {
        for (i, a) in ps.iter().enumerate() {
            for b in &ps[i + 1..] {
                let overlap = a.subject.intersection_len(&b.subject) as usize;
                if overlap > 0 {
                    // On both policies: each one's rules are ordered against the other's
                    // (issue #19: the second of a tie said Accepted).
                    for (this, other, first) in [(a, b, true), (b, a, false)] {
                        out.push(Problem::warning(
                            &this.object,
                            "spec.priority",
                            ProblemKind::PriorityConflict {
                                priority: prio,
                                other: other.object.clone(),
                                overlap,
                                first,
                            },
                        ));
                    }
                }
            }
        }
    }
    out
}

/// Rules that match no traffic in this snapshot, and policies that select no pod: worth a
/// look, since pods may be missing from the input or a selector may be misspelled.
pub fn unreachable_rules(s: &Snapshot) -> Vec<Problem> {
    let mut out = Vec::new();
    let declared: BTreeSet<&str> =
        s.pods.iter().flat_map(|p| p.ports.iter().map(|n| n.name.as_str())).collect();
    for p in &s.policies {
        if p.subject.is_empty() {
            out.push(Problem::warning(
                &p.object,
                "spec",
                ProblemKind::NeverMatches { reason: "the subject selects no pod".into() },
            ));
        }
        for d in Direction::BOTH {
            for r in &p.rules[d as usize] {
                let field = format!("spec.{}[{}]", d.as_str(), r.index);
                let peers = &r.peers;
                let no_peer = !peers.all
                    && peers.blocks.is_empty()
                    && peers.nodes.as_ref().is_none_or(|n| n.is_empty())
                    && peers.pod_sets.iter().all(|&id| s.pod_sets[id as usize].is_empty());
                if no_peer {
                    out.push(Problem::warning(
                        &p.object,
                        field.clone(),
                        ProblemKind::NeverMatches {
                            reason: "no peer of this rule selects anything".into(),
                        },
                    ));
                }
                let missing: Vec<&str> =
                    r.ports.named().filter(|n| !declared.contains(n)).collect();
                if !missing.is_empty() && missing.len() == r.ports.0.len() {
                    out.push(Problem::warning(
                        &p.object,
                        format!("{field}.ports"),
                        ProblemKind::NeverMatches {
                            reason: format!(
                                "no pod declares the named port(s) {}",
                                missing.join(", ")
                            ),
                        },
                    ));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::{self, Shape};

    /// A cluster above [`PARALLEL_MIN_PEERS`], with duplicates, invalid objects and
    /// warnings among the admin objects, so that every part of the parallel path runs.
    fn large_inputs() -> Inputs {
        let shape = Shape {
            namespaces: 60,
            pods: 1_200,
            nodes: 6,
            network_policies: 80,
            admin_policies: 24,
            rules_per_admin_policy: 20,
            max_peers: 30,
            admin_selects_all: false,
        };
        let mut inputs = synth::cluster(shape, 7);
        let anps = &mut inputs.admin_network_policies;
        // A duplicate (warning), an out-of-range priority (error: left out), and a selector
        // value that is not a label value (a warning inside CRDs; the peer still compiles).
        anps.push(anps[3].clone());
        let mut bad = (*anps[5]).clone();
        bad.metadata.name = Some("bad-priority".into());
        bad.spec.priority = 5000;
        anps.insert(1, Arc::new(bad));
        let mut odd = (*anps[8]).clone();
        odd.metadata.name = Some("odd-selector".into());
        if let Some(p) = odd.spec.egress[0].to[0].pods.as_mut() {
            p.pod_selector.match_labels = Some([("app", "not a label value")].into());
        }
        anps.push(Arc::new(odd));
        inputs
    }

    #[test]
    fn a_node_enforces_when_annotated_true_and_its_pods_are_found_in_one_pass() {
        let shape = Shape { namespaces: 4, pods: 40, nodes: 3, ..Shape::LARGE };
        let mut inputs = synth::cluster(shape, 3);
        for (i, value) in [(0, "true"), (1, "false")] {
            let mut node = (*inputs.nodes[i]).clone();
            node.metadata
                .annotations
                .get_or_insert_default()
                .insert(ANNOTATION_ENFORCING.into(), value.into());
            inputs.nodes[i] = Arc::new(node);
        }
        let s = Snapshot::compile(&inputs, Revision(1)).snapshot;
        let name = |i: usize| inputs.nodes[i].metadata.name.clone().unwrap();
        let id = |i: usize| s.find_node(&name(i)).unwrap();
        assert!(s.node_enforcing(id(0)), "annotated \"true\"");
        assert!(!s.node_enforcing(id(1)), "annotated \"false\"");
        assert!(!s.node_enforcing(id(2)), "not annotated");
        let mut on_0 = s.pod_ips_on(|n| n == id(0));
        let mut expected = s.local_pod_ips(id(0));
        assert!(!expected.is_empty());
        on_0.sort();
        expected.sort();
        assert_eq!(on_0, expected);
        let all = s.pod_ips_on(|_| true).len();
        let each: usize = (0..3).map(|i| s.local_pod_ips(id(i)).len()).sum();
        assert_eq!(all, each);
    }

    #[test]
    fn compiling_on_several_workers_gives_what_one_worker_gives() {
        let inputs = large_inputs();
        let one = Snapshot::compile_inner(&inputs, Revision(1), true, 1);
        for workers in [2, 3, 4] {
            let many = Snapshot::compile_inner(&inputs, Revision(1), true, workers);
            assert_eq!(one.problems, many.problems, "{workers} workers: problems differ");
            let names = |s: &Snapshot| -> Vec<ObjectRef> {
                s.policies.iter().map(|p| p.object.clone()).collect()
            };
            assert_eq!(names(&one.snapshot), names(&many.snapshot));
            let shape = Shape { namespaces: 60, pods: 1_200, nodes: 6, ..Shape::LARGE };
            for f in synth::flows(shape, 5_000, 11) {
                let d = many.snapshot.decide(&f);
                assert_eq!(one.snapshot.decide(&f), d, "{workers} workers: {f:?}");
                assert_eq!(many.snapshot.decide_reference(&f), d, "{workers} workers: {f:?}");
            }
        }
        assert!(one.problems.iter().any(|p| p.object.name == "bad-priority" && p.is_error()));
        assert!(one.problems.iter().any(|p| p.object.name == "odd-selector" && !p.is_error()));
        assert!(one.snapshot.policies.iter().all(|p| p.object.name != "bad-priority"));
    }

    /// Pods given as views (the API-server source's form) compile to the same snapshot
    /// as the Pods they came from; a view wins over a Pod of the same name.
    #[test]
    fn pod_views_decide_as_the_pods_they_came_from() {
        let shape = Shape { namespaces: 60, pods: 1_200, nodes: 6, ..Shape::LARGE };
        let pods_in = synth::cluster(Shape { admin_policies: 12, max_peers: 30, ..shape }, 3);
        let views_in = Inputs {
            pods: Vec::new(),
            pod_views: pods_in.pods.iter().map(|p| Arc::new(PodView::from_pod(p))).collect(),
            ..pods_in.clone()
        };
        let a = Snapshot::compile(&pods_in, Revision(1));
        let b = Snapshot::compile(&views_in, Revision(1));
        assert_eq!(a.problems, b.problems);
        assert_eq!(a.snapshot.counts(), b.snapshot.counts());
        for f in synth::flows(shape, 5_000, 5) {
            assert_eq!(a.snapshot.decide(&f), b.snapshot.decide(&f), "{f:?}");
        }
        // A view and a Pod with one name: the view is used (and the pair reported as a
        // duplicate; the agent drops a file's Pod that the API server also has).
        let pod = &pods_in.pods[0];
        let mut moved = PodView::from_pod(pod);
        moved.ips = vec!["10.250.0.1".parse().unwrap()];
        let both = Inputs { pod_views: vec![Arc::new(moved)], ..pods_in.clone() };
        let c = Snapshot::compile(&both, Revision(1));
        let id = c.snapshot.find_pod(&meta_namespace(&pod.metadata), &meta_name(&pod.metadata));
        assert_eq!(c.snapshot.pod_ips(id.unwrap()), ["10.250.0.1".parse::<IpAddr>().unwrap()]);
        assert!(c.problems.iter().any(|p| matches!(p.kind, ProblemKind::Duplicate)));
    }

    /// The validating path builds rules from the validator's `after_rule` visits, the
    /// other from its own loop: both must see every rule, in order.
    #[test]
    fn validated_and_unvalidated_compiles_decide_alike() {
        let shape = Shape { namespaces: 60, pods: 1_200, nodes: 6, ..Shape::LARGE };
        let inputs = synth::cluster(Shape { admin_policies: 12, max_peers: 30, ..shape }, 3);
        let checked = Snapshot::compile_inner(&inputs, Revision(1), true, 2);
        assert!(checked.problems.iter().all(|p| !p.is_error()));
        let unchecked = Snapshot::compile_inner(&inputs, Revision(1), false, 2);
        let rules = |s: &Snapshot| -> usize {
            s.policies.iter().flat_map(|p| &p.rules).map(Vec::len).sum()
        };
        assert_eq!(rules(&checked.snapshot), rules(&unchecked.snapshot));
        for f in synth::flows(shape, 5_000, 5) {
            assert_eq!(checked.snapshot.decide(&f), unchecked.snapshot.decide(&f), "{f:?}");
        }
    }

    #[test]
    fn balanced_ranges_cover_every_item_once_in_order() {
        let weights: Vec<usize> = (0..50).map(|i| 1 + (i * 37) % 500).collect();
        for workers in 1..=5 {
            let ranges = balanced_ranges(&weights, workers);
            assert!(ranges.len() <= workers.max(1));
            assert_eq!(ranges.first().map(|r| r.start), Some(0));
            assert_eq!(ranges.last().map(|r| r.end), Some(weights.len()));
            assert!(ranges.windows(2).all(|w| w[0].end == w[1].start));
        }
        // Small inputs stay on the calling thread.
        assert_eq!(balanced_ranges(&[1, 2, 3], 4), vec![0..3]);
        assert_eq!(balanced_ranges(&[], 4), vec![0..0]);
    }

    #[test]
    fn peer_keys_are_equal_exactly_when_the_selectors_are() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;
        let labels = |pairs: &[(&str, &str)]| LabelSelector {
            match_labels: Some(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
            match_expressions: None,
        };
        let expr = |values: Option<Vec<&str>>| LabelSelector {
            match_labels: None,
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: "k".into(),
                operator: "In".into(),
                values: values.map(|v| v.into_iter().map(String::from).collect()),
            }]),
        };
        let distinct = [
            labels(&[("ab", "c")]),
            labels(&[("a", "bc")]),
            labels(&[("a", "b"), ("c", "d")]),
            labels(&[]),
            LabelSelector::default(),
            expr(None),
            expr(Some(vec![])),
            expr(Some(vec!["a", "b"])),
            expr(Some(vec!["ab"])),
        ];
        let key = |ns: &LabelSelector, pods: Option<&LabelSelector>| {
            let mut k = Vec::new();
            encode_peer(&mut k, ns, pods);
            k
        };
        for (i, a) in distinct.iter().enumerate() {
            assert_eq!(key(a, None), key(&a.clone(), None));
            for (j, b) in distinct.iter().enumerate() {
                assert_eq!(i == j, key(a, None) == key(b, None), "{a:?} vs {b:?}");
                assert_eq!(i == j, key(a, Some(a)) == key(b, Some(a)), "{a:?} vs {b:?}");
                // A `namespaces` peer never shares a key with a `pods` peer.
                assert_ne!(key(a, None), key(b, Some(a)));
            }
        }
    }
}
