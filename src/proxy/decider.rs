//! First-packet decisions for one node: the current snapshot, a decision cache keyed by
//! flow and snapshot revision, and the decisions waiting for the proxy to accept the
//! connections they admitted.
//!
//! Source: issue #3 "First-packet decisions"; DESIGN §3 (which node decides which
//! direction) and §5 (one published snapshot, read without locks; a moka cache keyed by
//! flow and revision).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;

use super::forwarded::Forwarded;
use super::registry::{Registry, StopReason, Tracked};
use crate::audit::{self, Auditor, DecisionPoint, FlowInfo};
use crate::metrics::DataPathMetrics;
use crate::policy::FlowKey;
use crate::policy::eval::{Decision, Flow, Verdict};
use crate::policy::{Problem, Revision, Snapshot};

/// What the deciders read: a compiled snapshot, this node's id in it, and the audit
/// selection built for it; and, for the agent's debug endpoint, the problems its build
/// found.
#[derive(Debug)]
pub struct Current {
    /// The snapshot; its revision keys the decision cache.
    pub snapshot: Arc<Snapshot>,
    /// This node's id in `snapshot` ([`Snapshot::find_node`]).
    pub node: u32,
    /// What is audited under `snapshot` ([`audit::Selection::new`]).
    pub audit: Arc<audit::Selection>,
    /// The problems of the objects `snapshot` was built from (decoding, validation,
    /// priority conflicts: [`crate::agent::build`]); deciders never read them
    /// (`GET /debug/snapshot` does, [`crate::debug`]).
    pub problems: Arc<[Problem]>,
}

/// A decision handed from the first packet to the proxy: the decision, and whether the
/// flow is audited (its connection's end is audited too).
#[derive(Debug, Clone)]
pub struct Admission {
    /// The decision.
    pub decision: Arc<Decision>,
    /// The flow's decision went to audit.
    pub audited: bool,
    /// When the first packet was decided.
    pub time: SystemTime,
    /// Where it was decided.
    pub point: DecisionPoint,
}

/// What [`Decider::first_packet`] answers.
#[derive(Debug, Clone)]
pub struct FirstPacket {
    /// The decision.
    pub decision: Arc<Decision>,
    /// An allowed flow's class may enter the kernel-side cache of allowed classes
    /// (`redirect` rule 7): false only for a kernel-path UDP flow whose decision audit
    /// logs in full where the kernel samples the cached classes' flows
    /// ([`Decider::with_cached_udp_sample`]); the queue then answers without the cache
    /// (`proxy::queue`). True for anything not allowed.
    pub cache: bool,
}

/// Decision cache and hand-over sizes.
#[derive(Debug, Clone, Copy)]
pub struct DeciderLimits {
    /// Most `(flow, revision)` entries cached (a flow omits the source port, so one entry
    /// serves every connection between the same two ends and port).
    pub cache_entries: u64,
    /// Most decisions waiting for the proxy to accept their connection.
    pub pending_entries: u64,
    /// How long a decision waits for its connection (seconds of wall time). A client that
    /// gives up after its SYN leaves one entry behind for this long, and a half-open flood
    /// one per SYN the policy allows: 10 s, past any handshake (a retransmitted SYN is
    /// decided again); a connection the proxy takes later (it waited in the backlog at the
    /// connection limit) is decided then ([`Decider::take_or_decide`]).
    pub pending_ttl: Duration,
    /// A cached decision not used for this long is dropped: a flood of new flows fills the
    /// cache, and its entries must not keep their memory once the flood is over (issue
    /// #17).
    pub cache_idle: Duration,
    /// Most kernel-forwarded UDP flows whose end is reported ([`Forwarded`]); 0 on the
    /// UDP proxy path, where nothing reports their end.
    pub forwarded_flows: usize,
}

impl Default for DeciderLimits {
    fn default() -> Self {
        DeciderLimits {
            cache_entries: 65_536,
            pending_entries: 65_536,
            pending_ttl: Duration::from_secs(10),
            cache_idle: Duration::from_secs(60),
            forwarded_flows: 16_384,
        }
    }
}

/// Counters of first-packet decisions since start.
#[derive(Debug, Default)]
pub struct DecisionStats {
    /// Flows allowed.
    pub allowed: AtomicU64,
    /// Flows denied (packet dropped).
    pub denied: AtomicU64,
    /// Flows rejected (an Antrea `Reject` rule: the client is refused at once).
    pub rejected: AtomicU64,
    /// Refusals sent to the clients of rejected flows, by [`super::reject::Answer::index`]
    /// (TCP RST, ICMP administratively prohibited, SCTP ABORT).
    pub refusals: [AtomicU64; 3],
    /// Rejected packets that got no refusal: over the rate limit
    /// ([`super::reject::MAX_PER_SECOND`]), a packet its protocol never answers, or a send
    /// that failed. Each is dropped all the same.
    pub refusals_unsent: AtomicU64,
    /// Decisions answered from the cache.
    pub cache_hits: AtomicU64,
    /// Live connections and UDP flows closed because a new snapshot denies them.
    pub policy_cuts: AtomicU64,
    /// Manifest changes that could not be used (the last good snapshot stayed in force).
    pub reload_errors: AtomicU64,
    /// Connections and UDP flows taken without a first-packet decision and decided then
    /// ([`Decider::take_or_decide`], [`Decider::decide_cached`]): a TCP SYN or a UDP flow's
    /// first datagram of a class the kernel-side cache holds (allowed by the snapshot in
    /// force; `redirect` rule 7), a first packet the kernel passed on undecided (a full
    /// queue failing open), or a decision that aged out before the proxy took the
    /// connection.
    pub decided_at_accept: AtomicU64,
}

/// What one re-decision of the live connections did ([`Decider::redecide`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Redecided {
    /// Live connections and UDP flows decided again.
    pub checked: usize,
    /// Those now denied, told to stop.
    pub cut: usize,
}

/// Decides flows for one node. Shared by the NFQUEUE workers (which decide) and the proxy
/// (which takes the decision of each connection it accepts). Every method takes `&self`
/// and never blocks on another caller for long (moka shards its maps; the snapshot is an
/// `ArcSwap`).
pub struct Decider {
    current: ArcSwap<Current>,
    cache: moka::sync::Cache<(Flow, Revision), Arc<Decision>>,
    pending: moka::sync::Cache<FlowKey, Admission>,
    auditor: Arc<Auditor>,
    metrics: Arc<DataPathMetrics>,
    forwarded: Forwarded,
    /// One in how many new flows of a cached UDP class the ruleset reports through
    /// conntrack's new events ([`Decider::with_cached_udp_sample`]).
    cached_udp_sample: u32,
    /// The node is the next agent's (issue #23): this one acts on nothing any more.
    retired: std::sync::atomic::AtomicBool,
    /// Counters, for logs and tests.
    pub stats: DecisionStats,
}

impl Decider {
    /// Marks this agent's decider retired: the next agent took the node over (issue #23).
    /// From now on the kernel-forwarded flows' event thread and the reloader change nothing
    /// on the node (no conntrack deletion, no ruleset write): the next agent, on its own
    /// snapshot, does.
    pub fn retire(&self) {
        self.retired.store(true, Ordering::Release);
    }

    /// Whether [`Decider::retire`] was called.
    pub fn retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }

    /// A decider over `current`, auditing through `auditor` and counting in `metrics`.
    pub fn new(
        current: Current,
        limits: DeciderLimits,
        auditor: Arc<Auditor>,
        metrics: Arc<DataPathMetrics>,
    ) -> Self {
        Decider {
            auditor,
            metrics,
            current: ArcSwap::from_pointee(current),
            cache: moka::sync::Cache::builder()
                .max_capacity(limits.cache_entries)
                .time_to_idle(limits.cache_idle)
                .build(),
            pending: moka::sync::Cache::builder()
                .max_capacity(limits.pending_entries)
                .time_to_live(limits.pending_ttl)
                .build(),
            forwarded: Forwarded::new(limits.forwarded_flows),
            cached_udp_sample: 1,
            stats: DecisionStats::default(),
            retired: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// This decider for a ruleset that reports one in `n` new flows of a cached UDP class
    /// through conntrack's new events (`redirect::RulesetSpec::with_cached_udp_sample`):
    /// 1, the default, every one (the agent samples them for audit itself); `n` ≥ 2, the
    /// kernel's sample, which the agent then audits as sampled ([`audit::Sampling::Taken`]);
    /// 0, none. With any `n` but 1, an allowed UDP class whose decision audit logs in full
    /// ([`audit::Selection::always`]) is answered without caching it
    /// ([`FirstPacket::cache`]), so that each of its flows is decided and audited at the
    /// queue; and the end of a cached flow the agent never saw counts its decision
    /// ([`super::forwarded::destroyed`]).
    pub fn with_cached_udp_sample(mut self, n: u32) -> Self {
        self.cached_udp_sample = n;
        self
    }

    /// What [`Decider::with_cached_udp_sample`] set (1 by default).
    pub fn cached_udp_sample(&self) -> u32 {
        self.cached_udp_sample
    }

    /// The kernel-forwarded UDP flows this node tracks ([`super::forwarded`]).
    pub fn forwarded(&self) -> &Forwarded {
        &self.forwarded
    }

    /// Publishes a new snapshot. Cached decisions of older revisions are never returned
    /// again (the revision is part of the key) and age out of the cache.
    pub fn publish(&self, current: Current) {
        self.current.store(Arc::new(current));
    }

    /// The snapshot decisions are made against now.
    pub fn current(&self) -> Arc<Current> {
        self.current.load_full()
    }

    /// Decides `flow` as this node enforces it ([`Snapshot::decide_on_node`]), through the
    /// cache.
    pub fn decide(&self, flow: Flow) -> Arc<Decision> {
        self.decide_in(&self.current.load(), flow)
    }

    /// [`Decider::decide`] against `current`.
    fn decide_in(&self, current: &Current, flow: Flow) -> Arc<Decision> {
        let key = (flow, current.snapshot.revision());
        if let Some(d) = self.cache.get(&key) {
            self.stats.cache_hits.fetch_add(1, Ordering::Relaxed);
            return d;
        }
        let d = Arc::new(current.snapshot.decide_on_node(&flow, current.node));
        self.cache.insert(key, d.clone());
        d
    }

    /// The auditor decisions go to.
    pub fn auditor(&self) -> &Arc<Auditor> {
        &self.auditor
    }

    /// The data path's metrics.
    pub fn metrics(&self) -> &DataPathMetrics {
        &self.metrics
    }

    /// Decides the first packet of the flow `key`, audits the decision, and, when it is
    /// allowed and `proxied` (the packet was TPROXY'd: the proxy will accept its flow), keeps
    /// it for [`Decider::take`] (the proxy attaches it to the connection it accepts). A flow
    /// the kernel forwards once decided (the kernel-forwarded flows' queue: UDP, SCTP, TCP
    /// from an enforced pod) is never taken; an allowed UDP one is tracked in
    /// [`Decider::forwarded`] until its conntrack entry goes. A rejected one is kept too
    /// when `proxied` and `hand_reject` (the caller lets the packet on to the proxy, which
    /// refuses it: see `queue`'s reader), so that the proxy takes this decision rather than
    /// deciding and auditing the flow a second time. In lossless audit mode this waits
    /// while the audit queue is full.
    ///
    /// Returns the decision, and whether an allowed flow's class may enter the kernel-side
    /// cache ([`FirstPacket::cache`]).
    pub fn first_packet(&self, key: FlowKey, proxied: bool, hand_reject: bool) -> FirstPacket {
        let started = std::time::Instant::now();
        let admission =
            self.decide_and_audit(key, DecisionPoint::FirstPacket, audit::Sampling::Count);
        let d = admission.decision.clone();
        // Where the kernel samples the flows of cached UDP classes, a class audit logs in
        // full stays out of the cache: the agent would not see most of its flows.
        let cache = d.verdict != Verdict::Allow
            || proxied
            || key.protocol != crate::policy::Protocol::Udp
            || self.cached_udp_sample == 1
            || !self.auditor.enabled()
            || {
                let current = self.current.load();
                !current.audit.always(&current.snapshot, &d)
            };
        if d.verdict == Verdict::Reject && proxied && hand_reject {
            self.pending.insert(key, admission);
        } else if d.verdict == Verdict::Allow {
            if proxied {
                self.pending.insert(key, admission);
            } else if key.protocol == crate::policy::Protocol::Udp
                && (d.egress.is_some() || d.ingress.is_some())
            {
                self.forwarded.admit(key, admission);
            }
        }
        self.metrics.decision_seconds.observe(started.elapsed().as_secs_f64());
        FirstPacket { decision: d, cache }
    }

    /// Decides `key` now (at `point`), audits the decision when the plan selects it
    /// (sampled as `sampling` says), and counts it (verdict, tier).
    fn decide_and_audit(
        &self,
        key: FlowKey,
        point: DecisionPoint,
        sampling: audit::Sampling,
    ) -> Admission {
        let current = self.current.load();
        let decision = self.decide_in(&current, key.flow());
        let time = SystemTime::now();
        let flow = FlowInfo { key, time, point };
        let audited = self.auditor.enabled()
            && (decision.egress.is_some() || decision.ingress.is_some())
            && self.auditor.decision_as(
                &current.audit,
                &current.snapshot,
                flow,
                &decision,
                sampling,
            );
        self.count(&decision);
        Admission { decision, audited, time, point }
    }

    /// Decides every live connection and UDP flow in `registry` again against the current
    /// snapshot, and tells those now denied to stop ([`StopReason::PolicyChange`]: TCP resets
    /// both sides, a UDP flow closes its sockets). Each denying decision is audited like a
    /// first packet's (it names the rule that now denies); the end follows with reason
    /// `policy-change`. Call after [`Decider::publish`]: a connection registered while this
    /// runs checks its own admission ([`Decider::recheck`]).
    ///
    /// Source: NetworkPolicy ("should terminate and block the existing connection as soon
    /// as can be expected"), issue #5 "Live change", DESIGN §5.
    pub fn redecide(&self, registry: &Registry) -> Redecided {
        let current = self.current.load_full();
        let mut out = Redecided::default();
        for t in registry.connections() {
            out.checked += 1;
            let d = self.decide_in(&current, t.key.flow());
            if !d.verdict.is_allow() {
                self.cut(&current, &t, &d);
                out.cut += 1;
            }
        }
        out
    }

    /// For a connection just registered as `tracked` with `admission`: when a snapshot
    /// newer than the admission's is in force and denies it, audits that decision, marks
    /// the connection stopped for a policy change and returns `false`.
    pub fn recheck(&self, admission: &Admission, tracked: &Tracked) -> bool {
        let current = self.current.load_full();
        if admission.decision.revision == current.snapshot.revision() {
            return true;
        }
        let d = self.decide_in(&current, tracked.key.flow());
        if d.verdict == Verdict::Allow {
            return true;
        }
        self.cut(&current, tracked, &d);
        false
    }

    fn cut(&self, current: &Current, tracked: &Tracked, d: &Arc<Decision>) {
        self.audit_cut(current, tracked.key, d);
        tracked.stop(StopReason::PolicyChange);
    }

    /// Audits (as a re-decision) and counts the cut of the kernel-forwarded flow `key`,
    /// which the snapshot in force denies; the caller deletes its conntrack entry
    /// ([`super::forwarded::sweep`]).
    pub fn cut_forwarded(&self, key: FlowKey) {
        let current = self.current.load_full();
        let d = self.decide_in(&current, key.flow());
        self.audit_cut(&current, key, &d);
    }

    fn audit_cut(&self, current: &Current, key: FlowKey, d: &Arc<Decision>) {
        self.audit_cut_at(current, key, d, DecisionPoint::Redecision);
    }

    fn audit_cut_at(
        &self,
        current: &Current,
        key: FlowKey,
        d: &Arc<Decision>,
        point: DecisionPoint,
    ) {
        if self.auditor.enabled() {
            let flow = FlowInfo { key, time: SystemTime::now(), point };
            self.auditor.decision(&current.audit, &current.snapshot, flow, d);
        }
        self.stats.policy_cuts.fetch_add(1, Ordering::Relaxed);
    }

    /// Runs the caches' pending housekeeping now, so that entries that expired (a flood's)
    /// are freed without waiting for the next access.
    pub fn maintain(&self) {
        self.cache.run_pending_tasks();
        self.pending.run_pending_tasks();
    }

    /// The admission of the flow `key`, removed from the hand-over map; `None` when none
    /// is waiting (it aged out, or the flow was admitted before this process started —
    /// the caller then decides again with [`Decider::decide`]).
    pub fn take(&self, key: &FlowKey) -> Option<Admission> {
        self.pending.remove(key)
    }

    /// Counts the decision `d` (verdict, tier): every decision this decider makes, and that
    /// of a kernel-forwarded UDP flow of a cached class that the agent learns of only at
    /// its end (its new event was spared, [`Decider::with_cached_udp_sample`];
    /// [`super::forwarded::destroyed`]), which is not audited (the kernel did not sample it).
    pub fn count(&self, d: &Decision) {
        match d.verdict {
            Verdict::Allow => self.stats.allowed.fetch_add(1, Ordering::Relaxed),
            Verdict::Deny => self.stats.denied.fetch_add(1, Ordering::Relaxed),
            Verdict::Reject => self.stats.rejected.fetch_add(1, Ordering::Relaxed),
        };
        self.metrics.decision(d);
    }

    /// The admission of the kernel-forwarded UDP flow `key` whose first datagram skipped the
    /// queue (its class was in the kernel-side cache of allowed classes, `redirect` rule 7):
    /// decided now, on the snapshot in force, audited with the decision point `conntrack`
    /// and counted in [`DecisionStats::decided_at_accept`]. Called when conntrack reports
    /// the flow's new entry ([`super::forwarded::watch`]): for every such flow, or, with
    /// [`Decider::with_cached_udp_sample`] `n` ≥ 2, for the kernel's sample of one in `n`,
    /// which is then audited as sampled.
    pub fn decide_cached(&self, key: FlowKey) -> Admission {
        self.stats.decided_at_accept.fetch_add(1, Ordering::Relaxed);
        // With n ≥ 2 the kernel let this flow's new event through as its sample.
        let sampling = if self.cached_udp_sample >= 2 {
            audit::Sampling::Taken
        } else {
            audit::Sampling::Count
        };
        self.decide_and_audit(key, DecisionPoint::Conntrack, sampling)
    }

    /// The admission of the flow `key` the proxy just took: its first packet's
    /// ([`Decider::take`]), else a decision made now, audited and counted like a first
    /// packet's and in [`DecisionStats::decided_at_accept`]. That happens for every TCP
    /// connection whose class the kernel-side cache holds (its SYN skipped the queue,
    /// `redirect` rule 7: decided here, on the snapshot in force, and audited with the
    /// decision point `accept`), when the kernel
    /// passed the first packet on undecided (fail-open with a full queue: the proxy is
    /// then where the flow is decided, and a denied TCP connection is reset after its
    /// handshake, not timed out), when the decision aged out ([`DeciderLimits::pending_ttl`])
    /// or when the flow predates this process.
    pub fn take_or_decide(&self, key: FlowKey) -> Admission {
        if let Some(a) = self.take(&key) {
            return a;
        }
        self.stats.decided_at_accept.fetch_add(1, Ordering::Relaxed);
        self.decide_and_audit(key, DecisionPoint::Accept, audit::Sampling::Count)
    }

    /// The live connection `tracked`, which the previous agent handed over (issue #23),
    /// decided again on the snapshot in force before a byte of it is relayed here, as a
    /// re-decision after a change is: a policy that changed while the agents changed over
    /// is enforced on it. A denying decision is audited (decision point `hand-over`) and
    /// counted, and the connection told to stop for a policy change; an allowing one is
    /// not audited again (the previous agent audited its admission). Returns the decision.
    pub fn adopt(&self, tracked: &Tracked) -> Arc<Decision> {
        let current = self.current.load_full();
        let d = self.decide_in(&current, tracked.key.flow());
        if !d.verdict.is_allow() {
            self.audit_cut_at(&current, tracked.key, &d, DecisionPoint::HandOver);
            tracked.stop(StopReason::PolicyChange);
        }
        d
    }
}

/// What the data path's unit tests decide with: a decider for node `n1` of a cluster given
/// as manifests, auditing every decision and end to a JSON Lines file, with metrics they
/// can read back.
#[cfg(test)]
pub(crate) mod testing {
    use std::path::{Path, PathBuf};

    use super::*;
    use crate::audit::{AuditConfig, CloseReason, Defaults, JsonTarget, SinkConfig};

    /// The decider, its auditor, its metrics and the audit file.
    pub(crate) struct TestDecider {
        pub(crate) decider: Arc<Decider>,
        pub(crate) auditor: Arc<Auditor>,
        pub(crate) metrics: crate::metrics::Metrics,
        pub(crate) audit_file: PathBuf,
    }

    /// Every decision and end audited.
    pub(crate) fn every_decision() -> Defaults {
        Defaults { allow_sample: 1, deny: true, pass: true, close: true }
    }

    /// The snapshot of `manifests` at `revision`, for node `n1`.
    pub(crate) fn current(manifests: &str, revision: u64) -> Current {
        let loaded = crate::cluster::manifest::parse_str(Path::new("t.yaml"), manifests).unwrap();
        let snapshot = Arc::new(Snapshot::compile(&loaded.inputs, Revision(revision)).snapshot);
        let node = snapshot.find_node("n1").unwrap();
        let (plan, _) = audit::Selection::new(&snapshot, every_decision());
        Current { snapshot, node, audit: plan, problems: Arc::default() }
    }

    /// A decider over `manifests` (revision 1) auditing to `dir`/audit.jsonl.
    pub(crate) fn decider(manifests: &str, dir: &Path) -> TestDecider {
        let audit_file = dir.join("audit.jsonl");
        let mut config = AuditConfig::new(
            "n1",
            vec![SinkConfig::Json(JsonTarget::File {
                path: audit_file.clone(),
                max_bytes: 1 << 20,
                keep: 1,
            })],
        );
        config.defaults = every_decision();
        let auditor = Arc::new(Auditor::start(config).unwrap());
        let metrics = crate::metrics::Metrics::new(crate::metrics::Scraped(Box::new(Vec::new)));
        let decider = Arc::new(Decider::new(
            current(manifests, 1),
            DeciderLimits::default(),
            auditor.clone(),
            metrics.data_path.clone(),
        ));
        TestDecider { decider, auditor, metrics, audit_file }
    }

    impl TestDecider {
        /// The value of the sample named `sample` (name and labels as exposed).
        pub(crate) fn metric(&self, sample: &str) -> u64 {
            self.metrics
                .encode()
                .lines()
                .find_map(|l| l.strip_prefix(sample)?.strip_prefix(' ')?.parse().ok())
                .unwrap_or(0)
        }

        /// `tierproxy_connections_closed_total{reason}` now.
        pub(crate) fn closed(&self, reason: CloseReason) -> u64 {
            let sample =
                format!("tierproxy_connections_closed_total{{reason=\"{}\"}}", reason.as_str());
            self.metric(&sample)
        }

        /// `tierproxy_connections_closed_total` over every reason.
        pub(crate) fn closed_total(&self) -> u64 {
            self.metrics
                .encode()
                .lines()
                .filter(|l| l.starts_with("tierproxy_connections_closed_total{"))
                .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
                .sum()
        }

        /// `tierproxy_connections_opened_total` now.
        pub(crate) fn opened(&self) -> u64 {
            self.metric("tierproxy_connections_opened_total")
        }

        /// Flushes audit (no event is written after this) and returns its events.
        pub(crate) fn events(&self) -> Vec<serde_json::Value> {
            self.auditor.shutdown();
            let text = std::fs::read_to_string(&self.audit_file).unwrap_or_default();
            text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
        }

        /// The close reasons of the connection-end events (flushes audit).
        pub(crate) fn end_events(&self) -> Vec<String> {
            end_reasons(&self.events())
        }
    }

    /// The close reasons of the connection-end events among `events`.
    pub(crate) fn end_reasons(events: &[serde_json::Value]) -> Vec<String> {
        events
            .iter()
            .filter(|v| v["event"] == crate::audit::event::CONNECTION_END)
            .map(|v| {
                v["attributes"][crate::audit::event::attr::CLOSE_REASON]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect()
    }

    /// The `attribute` (a byte count) of each connection-end event among `events`, sorted.
    pub(crate) fn end_bytes(events: &[serde_json::Value], attribute: &str) -> Vec<u64> {
        let mut v: Vec<u64> = events
            .iter()
            .filter(|v| v["event"] == crate::audit::event::CONNECTION_END)
            .map(|v| v["attributes"][attribute].as_u64().unwrap())
            .collect();
        v.sort_unstable();
        v
    }

    /// The decision points of the decision events among `events` (one event per audited
    /// direction: two for a flow between two pods of the node).
    pub(crate) fn decision_points(events: &[serde_json::Value]) -> Vec<String> {
        events
            .iter()
            .filter(|v| v["event"] == crate::audit::event::DECISION)
            .map(|v| {
                v["attributes"][crate::audit::event::attr::DECISION_POINT]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect()
    }

    /// Two pods of node n1 on loopback addresses, so that the proxy's upstream leg needs
    /// no transparent socket: the client 127.0.0.2, the server 127.0.0.3.
    pub(crate) const LOOPBACK_CLUSTER: &str = r#"
apiVersion: v1
kind: Node
metadata: {name: n1}
status: {addresses: [{type: InternalIP, address: 172.31.0.2}]}
---
apiVersion: v1
kind: Namespace
metadata: {name: a}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: a}
spec: {nodeName: n1, containers: [{name: c}]}
status: {podIP: 127.0.0.2}
---
apiVersion: v1
kind: Pod
metadata: {name: server, namespace: a}
spec: {nodeName: n1, containers: [{name: c}]}
status: {podIP: 127.0.0.3}
"#;

    /// [`LOOPBACK_CLUSTER`] with the server isolated for ingress, allowing nothing.
    pub(crate) fn loopback_cluster_denying() -> String {
        format!(
            "{LOOPBACK_CLUSTER}---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {{name: deny-all, namespace: a}}
spec: {{podSelector: {{}}, policyTypes: [Ingress]}}
"
        )
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use super::*;
    use crate::policy::Protocol;

    /// [`testing::LOOPBACK_CLUSTER`]'s two pods on pod-network addresses: client
    /// 10.60.1.2, server 10.60.1.3.
    fn cluster() -> String {
        testing::LOOPBACK_CLUSTER
            .replace("127.0.0.2", "10.60.1.2")
            .replace("127.0.0.3", "10.60.1.3")
    }

    fn key(sport: u16) -> FlowKey {
        let src: SocketAddr = format!("10.60.1.2:{sport}").parse().unwrap();
        FlowKey { src, dst: "10.60.1.3:8080".parse().unwrap(), protocol: Protocol::Tcp }
    }

    /// Issue #22: a rejected first packet that the queue's reader lets on to the proxy
    /// (`hand_reject`) leaves its decision for the proxy to take, so the flow is decided,
    /// counted and audited once; one the reader refuses itself leaves nothing.
    #[test]
    fn a_rejected_first_packet_handed_to_the_proxy_is_taken_not_decided_again() {
        let dir = tempfile::tempdir().unwrap();
        let rejecting = format!(
            "{}---
apiVersion: crd.antrea.io/v1beta1
kind: ClusterNetworkPolicy
metadata: {{name: reject-all}}
spec:
  priority: 1
  tier: securityops
  appliedTo: [{{podSelector: {{}}}}]
  ingress: [{{action: Reject, from: [{{podSelector: {{}}}}]}}]
",
            cluster()
        );
        let t = testing::decider(&rejecting, dir.path());
        let d = &t.decider;
        let udp = |sport| FlowKey { protocol: Protocol::Udp, ..key(sport) };
        assert_eq!(d.first_packet(udp(1000), true, true).decision.verdict, Verdict::Reject);
        let a = d.take_or_decide(udp(1000));
        assert_eq!((a.point, a.decision.verdict), (DecisionPoint::FirstPacket, Verdict::Reject));
        assert_eq!(d.stats.decided_at_accept.load(Ordering::Relaxed), 0);
        assert_eq!(d.stats.rejected.load(Ordering::Relaxed), 1);
        // Refused by the reader: nothing kept, a later take decides anew.
        d.first_packet(udp(2000), true, false);
        assert_eq!(d.take_or_decide(udp(2000)).point, DecisionPoint::Accept);
        assert_eq!(d.stats.decided_at_accept.load(Ordering::Relaxed), 1);
    }

    /// Issue #17, item 6: a flow the proxy takes without a first-packet decision (the
    /// kernel let it through a full fail-open queue) is decided there, counted, and audited
    /// as decided at accept; one the queue decided keeps its first packet's decision.
    #[test]
    fn a_flow_taken_without_a_first_packet_decision_is_decided_audited_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        let t = testing::decider(&cluster(), dir.path());
        let d = &t.decider;
        d.first_packet(key(1000), true, false);
        let a = d.take_or_decide(key(1000));
        assert_eq!(a.point, DecisionPoint::FirstPacket);
        assert_eq!(d.stats.decided_at_accept.load(Ordering::Relaxed), 0);
        let a = d.take_or_decide(key(2000));
        assert_eq!(a.point, DecisionPoint::Accept);
        assert_eq!(a.decision.verdict, Verdict::Allow);
        assert!(a.audited);
        assert_eq!(d.stats.decided_at_accept.load(Ordering::Relaxed), 1);
        let events = t.events();
        let point = |port: u16| {
            let of_port: Vec<serde_json::Value> =
                events.iter().filter(|v| v["attributes"]["source.port"] == port).cloned().collect();
            let points = testing::decision_points(&of_port);
            points
                .first()
                .cloned()
                .unwrap_or_else(|| panic!("no event for port {port}: {events:?}"))
        };
        assert_eq!(point(1000), "first-packet");
        assert_eq!(point(2000), "accept");
    }

    /// Issue #20: where the kernel samples the flows of cached UDP classes (a sample other
    /// than 1), an allowed kernel-path UDP flow whose class audit logs in full (a
    /// NetworkPolicy annotated `tierproxy.io/audit: "on"`) is answered without caching it,
    /// so that each of its flows comes to the queue; a class audit samples may be cached,
    /// and so may every class where the kernel reports every cached flow (sample 1), a
    /// proxied flow, and TCP. A cached flow the kernel let through as its sample is audited
    /// without the agent's own counter.
    #[test]
    fn a_udp_class_audit_logs_in_full_stays_out_of_the_cache_where_the_kernel_samples() {
        let dir = tempfile::tempdir().unwrap();
        let manifests = format!(
            r#"{}---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {{name: logged, namespace: a, annotations: {{tierproxy.io/audit: "on"}}}}
spec:
  podSelector: {{}}
  policyTypes: [Ingress]
  ingress: [{{ports: [{{protocol: UDP, port: 53}}]}}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {{name: plain, namespace: a}}
spec:
  podSelector: {{}}
  policyTypes: [Ingress]
  ingress: [{{ports: [{{protocol: UDP, port: 5353}}, {{protocol: TCP, port: 53}}]}}]
"#,
            cluster()
        );
        let t = testing::decider(&manifests, dir.path());
        let sampled = audit::Defaults { allow_sample: 4, ..testing::every_decision() };
        let decider = |n: u32| {
            let mut current = testing::current(&manifests, 1);
            current.audit = audit::Selection::new(&current.snapshot, sampled).0;
            let metrics = crate::metrics::Metrics::new(crate::metrics::Scraped(Box::new(Vec::new)));
            Decider::new(current, DeciderLimits::default(), t.auditor.clone(), metrics.data_path)
                .with_cached_udp_sample(n)
        };
        let flow = |protocol, port: u16| FlowKey {
            protocol,
            dst: format!("10.60.1.3:{port}").parse().unwrap(),
            ..key(40000)
        };
        let kernel = decider(4);
        let logged = kernel.first_packet(flow(Protocol::Udp, 53), false, false);
        assert_eq!((logged.decision.verdict, logged.cache), (Verdict::Allow, false));
        let plain = kernel.first_packet(flow(Protocol::Udp, 5353), false, false);
        assert_eq!((plain.decision.verdict, plain.cache), (Verdict::Allow, true));
        assert!(kernel.first_packet(flow(Protocol::Udp, 53), true, false).cache, "proxied");
        assert!(kernel.first_packet(flow(Protocol::Tcp, 53), false, false).cache, "TCP");
        assert!(decider(1).first_packet(flow(Protocol::Udp, 53), false, false).cache);
        // Every flow the kernel reports is its sample: audited, all four.
        let audited = (0..4).filter(|_| kernel.decide_cached(flow(Protocol::Udp, 5353)).audited);
        assert_eq!(audited.count(), 4);
        // Where every cached flow is reported, the agent samples them: one in four.
        let every = decider(1);
        let audited = (0..4).filter(|_| every.decide_cached(flow(Protocol::Udp, 5353)).audited);
        assert_eq!(audited.count(), 1);
    }
}
