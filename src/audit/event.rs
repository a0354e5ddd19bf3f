//! Audit events: what one record says, rendered from a [`Decision`] or from the end of a
//! proxied connection, with the attribute names of `docs/audit.md`.
//!
//! An [`Event`] is an OpenTelemetry log record with an event name (a fixed, low-cardinality
//! constant: [`DECISION`], [`CONNECTION_END`], [`SUPPRESSED`]), a short human body, and
//! every fact as an attribute. Attribute names follow the OpenTelemetry semantic
//! conventions where one exists (`network.transport`, `source.address`,
//! `security_rule.name`, …) and use the `tierproxy.` prefix otherwise.
//!
//! Sources: KEP-2091 "Future work: Audit Logging"; OpenTelemetry Logs Data Model (event
//! name, body, attributes, severity); semantic conventions `network.*`, `source.*`,
//! `destination.*`, `security_rule.*`, `k8s.*` (v1.3x).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use crate::policy::compile::{Action, Direction, Endpoint};
use crate::policy::eval::{Basis, Decision, Outcome, RuleHit};
use crate::policy::{FlowKey, Kind, Protocol, Snapshot};

/// Event name of a decision record: one per audited direction of a new flow.
pub const DECISION: &str = "tierproxy.policy.decision";
/// Event name of the end of a proxied connection.
pub const CONNECTION_END: &str = "tierproxy.connection.end";
/// Event name of a summary of events a rate limit suppressed.
pub const SUPPRESSED: &str = "tierproxy.audit.suppressed";

/// Prefix of tierproxy's own attributes.
pub const PREFIX: &str = "tierproxy.";

/// An attribute value. Strings are shared: names repeat from event to event, and every
/// sink reads the same event.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// A string known at build time (`tcp`, `allow`, a kind): no allocation.
    Static(&'static str),
    /// A string.
    Str(Arc<str>),
    /// An integer.
    Int(i64),
    /// A list of strings (the Pass chain).
    List(Vec<Arc<str>>),
}

/// OpenTelemetry severity of an event (Logs Data Model `SeverityNumber`: INFO = 9,
/// WARN = 13).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Severity {
    /// Allows, connection ends, summaries.
    Info,
    /// Denies.
    Warn,
}

impl Severity {
    /// `INFO` / `WARN`.
    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Info => "INFO",
            Severity::Warn => "WARN",
        }
    }
}

/// One audit record.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// [`DECISION`], [`CONNECTION_END`] or [`SUPPRESSED`].
    pub name: &'static str,
    /// When it happened (the first packet's arrival for a decision; the close for an end).
    pub time: SystemTime,
    /// Severity.
    pub severity: Severity,
    /// A short human sentence (shared by the sinks).
    pub body: Arc<str>,
    /// Everything else, in a stable order.
    pub attributes: Vec<(&'static str, Value)>,
}

impl Event {
    /// The value of attribute `key`, if present.
    pub fn attr(&self, key: &str) -> Option<&Value> {
        self.attributes.iter().find(|(k, _)| *k == key).map(|(_, v)| v)
    }

    /// The string value of attribute `key`, if present and a string.
    pub fn str(&self, key: &str) -> Option<&str> {
        match self.attr(key)? {
            Value::Static(s) => Some(s),
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    fn push(&mut self, key: &'static str, value: Value) {
        self.attributes.push((key, value));
    }

    /// A string attribute whose value is known at build time.
    fn str_attr(&mut self, key: &'static str, value: &'static str) {
        self.push(key, Value::Static(value));
    }

    /// A string attribute made at run time.
    fn string_attr(&mut self, key: &'static str, value: impl Into<Arc<str>>) {
        self.push(key, Value::Str(value.into()));
    }

    fn int_attr(&mut self, key: &'static str, value: i64) {
        self.push(key, Value::Int(value));
    }

    /// Adds `tierproxy.deny.count`, the number of identical denies this record stands for
    /// (see [`super::limit::Aggregator`]), and the time of the last one.
    pub fn set_count(&mut self, count: u64, last: SystemTime) {
        self.int_attr(attr::COUNT, i64::try_from(count).unwrap_or(i64::MAX));
        self.string_attr(attr::LAST_SEEN, rfc3339(last).as_str());
    }
}

/// Attribute names (docs/audit.md lists each with its meaning and OCSF field).
pub mod attr {
    /// semconv `network.transport`: `tcp`, `udp`, `sctp`.
    pub const TRANSPORT: &str = "network.transport";
    /// semconv `network.type`: `ipv4`, `ipv6`.
    pub const NETWORK_TYPE: &str = "network.type";
    /// semconv `source.address`: the client's IP.
    pub const SRC_ADDR: &str = "source.address";
    /// semconv `source.port`.
    pub const SRC_PORT: &str = "source.port";
    /// semconv `destination.address`: the original destination IP (after DNAT).
    pub const DST_ADDR: &str = "destination.address";
    /// semconv `destination.port`.
    pub const DST_PORT: &str = "destination.port";
    /// semconv `k8s.node.name`: the node whose agent decided.
    pub const NODE: &str = "k8s.node.name";
    /// semconv `security_rule.name`: the rule's `name`, or `ingress[i]` / `egress[i]`.
    pub const RULE_NAME: &str = "security_rule.name";
    /// semconv `security_rule.ruleset.name`: the policy, `name` or `namespace/name`.
    pub const RULESET: &str = "security_rule.ruleset.name";
    /// `ingress` or `egress`: the direction this record decides.
    pub const DIRECTION: &str = "tierproxy.direction";
    /// `allow` / `deny`: this direction's verdict.
    pub const VERDICT: &str = "tierproxy.verdict";
    /// `allow` / `deny`: the flow's verdict (both directions).
    pub const FLOW_VERDICT: &str = "tierproxy.flow.verdict";
    /// Where the decision was made: `first-packet`, `accept`, `re-decision` or `conntrack`
    /// ([`super::DecisionPoint`]).
    pub const DECISION_POINT: &str = "tierproxy.decision.point";
    /// `rule`, `isolation`, `default`, `own-node`: what decided the direction.
    pub const BASIS: &str = "tierproxy.basis";
    /// The deciding policy's tier: `admin`, `networkpolicy`, `baseline`, or an Antrea
    /// policy's Tier name (`securityops`, `application`, a custom Tier's); absent for
    /// `default` and `own-node`.
    pub const TIER: &str = "tierproxy.tier";
    /// The deciding policy's kind as its manifest spells it, e.g. `AdminNetworkPolicy`;
    /// an Antrea ClusterNetworkPolicy says `ClusterNetworkPolicy` too, and
    /// [`POLICY_API_VERSION`] tells it from the upstream one.
    pub const POLICY_KIND: &str = "tierproxy.policy.kind";
    /// The deciding policy's `apiVersion`, e.g. `policy.networking.k8s.io/v1alpha1`,
    /// `crd.antrea.io/v1beta1` ([`crate::policy::Kind::api_version`]).
    pub const POLICY_API_VERSION: &str = "tierproxy.policy.api_version";
    /// The deciding policy's namespace (NetworkPolicy only).
    pub const POLICY_NAMESPACE: &str = "tierproxy.policy.namespace";
    /// The deciding policy's name.
    pub const POLICY_NAME: &str = "tierproxy.policy.name";
    /// The rule's position in the policy's ingress or egress list.
    pub const RULE_INDEX: &str = "tierproxy.rule.index";
    /// The rule's action as its API spells it: `Allow`, `Deny`, `Pass`; `Accept` for a
    /// ClusterNetworkPolicy allow; `Drop` and `Reject` for an Antrea rule's.
    pub const RULE_ACTION: &str = "tierproxy.rule.action";
    /// `true` when the rule failed closed (a peer of an unknown kind).
    pub const FAIL_CLOSED: &str = "tierproxy.rule.fail_closed";
    /// The Antrea rule's `logLabel`, when it has one.
    pub const LOG_LABEL: &str = "tierproxy.rule.log_label";
    /// The Pass rules taken on the way, in order: `Kind name: rule`.
    pub const PASS_CHAIN: &str = "tierproxy.pass_chain";
    /// The snapshot revision that decided.
    pub const REVISION: &str = "tierproxy.revision";
    /// Number of identical denies or rejects (same flow but source port) the record
    /// stands for.
    pub const COUNT: &str = "tierproxy.deny.count";
    /// Time of the last of them (RFC 3339).
    pub const LAST_SEEN: &str = "tierproxy.deny.last_seen";
    /// `normal`, `reset`, `timeout`, `policy-change`, `shutdown`, `upstream-unreachable`.
    pub const CLOSE_REASON: &str = "tierproxy.connection.close_reason";
    /// Bytes from the client to the server.
    pub const BYTES_TO_SERVER: &str = "tierproxy.connection.bytes_to_server";
    /// Bytes from the server to the client.
    pub const BYTES_TO_CLIENT: &str = "tierproxy.connection.bytes_to_client";
    /// Milliseconds from accept to close.
    pub const DURATION_MS: &str = "tierproxy.connection.duration_ms";
    /// Events a rate limit suppressed (in a [`super::SUPPRESSED`] record).
    pub const SUPPRESSED_COUNT: &str = "tierproxy.suppressed.count";
    /// `rule` or `node`: which limit suppressed them.
    pub const SUPPRESSED_BY: &str = "tierproxy.suppressed.by";
}

/// Node-wide context of rendering: the node's name and the pod label keys reported.
#[derive(Debug, Clone, Default)]
pub struct Context {
    /// This node's name.
    pub node: Arc<str>,
    label_keys: Vec<String>,
    /// Per label key: its source and destination attribute names.
    label_attrs: Vec<[&'static str; 2]>,
}

/// Interns an attribute name built at start-up (label keys): a handful per process, kept
/// for its life, so events carry `&'static str` keys.
fn intern(name: String) -> &'static str {
    static NAMES: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());
    let mut names = NAMES.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(n) = names.iter().find(|n| **n == name) {
        return n;
    }
    let n: &'static str = Box::leak(name.into_boxed_str());
    names.push(n);
    n
}

impl Context {
    /// Context for node `node`, reporting pod labels `label_keys` on both ends as
    /// `tierproxy.source.k8s.pod.label.<key>` / `tierproxy.destination.k8s.pod.label.<key>`.
    pub fn new(node: &str, label_keys: Vec<String>) -> Self {
        let label_attrs = label_keys
            .iter()
            .map(|k| {
                [
                    intern(format!("{PREFIX}source.k8s.pod.label.{k}")),
                    intern(format!("{PREFIX}destination.k8s.pod.label.{k}")),
                ]
            })
            .collect();
        Context { node: node.into(), label_keys, label_attrs }
    }

    /// The pod label keys reported.
    pub fn label_keys(&self) -> &[String] {
        &self.label_keys
    }
}

/// Names of one policy, shared by its events.
#[derive(Debug, Clone)]
struct PolicyNames {
    kind: Kind,
    /// The kind for people: an Antrea kind with its group
    /// (`ClusterNetworkPolicy.crd.antrea.io`), as `Kind`'s `Display` and `explain` write it.
    kind_text: Arc<str>,
    namespace: Option<Arc<str>>,
    name: Arc<str>,
    /// `name` or `namespace/name`.
    ruleset: Arc<str>,
    /// [`Snapshot::policy_tier_name`]: static for the upstream tiers, the Tier object's
    /// name for an Antrea policy.
    tier: Value,
}

/// Names of one rule, shared by its events.
#[derive(Debug, Clone)]
struct RuleNames {
    /// The rule's `name`, or `ingress[i]` / `egress[i]`.
    name: Arc<str>,
    /// Antrea `logLabel`.
    log_label: Option<Arc<str>>,
}

/// Most addresses whose text is kept; beyond it the cache starts over.
const MAX_CACHED_IPS: usize = 65_536;

/// The strings of one snapshot, made once and shared by every event that names them:
/// pod, node, policy and rule names, the pods' labels of interest, and address texts.
/// Renewed when the snapshot's revision changes ([`Names::refresh`]).
#[derive(Debug, Default)]
pub struct Names {
    revision: Option<u64>,
    pods: HashMap<u32, [Arc<str>; 2]>,
    nodes: HashMap<u32, Arc<str>>,
    policies: HashMap<u32, PolicyNames>,
    rules: HashMap<(u32, Direction, u32), RuleNames>,
    /// By label key (as [`Context::label_keys`]): by pod id.
    labels: Vec<Vec<Option<Arc<str>>>>,
    ips: HashMap<IpAddr, Arc<str>>,
}

impl Names {
    /// Makes these the names of `snapshot` (a no-op when they already are): projects the
    /// pods' labels of interest (one pass per key) and forgets the previous snapshot's.
    pub fn refresh(&mut self, snapshot: &Snapshot, ctx: &Context) {
        let rev = snapshot.revision().0;
        if self.revision == Some(rev) {
            return;
        }
        self.revision = Some(rev);
        self.pods.clear();
        self.nodes.clear();
        self.policies.clear();
        self.rules.clear();
        self.labels = ctx
            .label_keys
            .iter()
            .map(|k| {
                let mut v = vec![None; snapshot.pod_count() as usize];
                for (value, pods) in snapshot.pod_label_values(k) {
                    let value: Arc<str> = value.into();
                    for p in pods {
                        v[p as usize] = Some(value.clone());
                    }
                }
                v
            })
            .collect();
    }

    fn ip(&mut self, ip: IpAddr) -> Arc<str> {
        if self.ips.len() >= MAX_CACHED_IPS {
            self.ips.clear();
        }
        self.ips.entry(ip).or_insert_with(|| ip.to_string().into()).clone()
    }

    fn pod(&mut self, s: &Snapshot, pod: u32) -> [Arc<str>; 2] {
        self.pods
            .entry(pod)
            .or_insert_with(|| {
                let (ns, name) = s.pod_name(pod);
                [ns.into(), name.into()]
            })
            .clone()
    }

    fn node(&mut self, s: &Snapshot, node: u32) -> Arc<str> {
        self.nodes.entry(node).or_insert_with(|| s.node_name(node).into()).clone()
    }

    fn policy(&mut self, s: &Snapshot, policy: u32) -> PolicyNames {
        self.policies
            .entry(policy)
            .or_insert_with(|| {
                let o = s.policy_ref(policy);
                let ruleset: Arc<str> = match &o.namespace {
                    Some(ns) => format!("{ns}/{}", o.name).into(),
                    None => o.name.as_str().into(),
                };
                let upstream = s.policy_tier(policy).as_str();
                let tier = match s.policy_tier_name(policy) {
                    // An upstream policy's tier, or an Antrea Tier of the same name.
                    t if t == upstream => Value::Static(upstream),
                    t => Value::Str(t.into()),
                };
                PolicyNames {
                    kind: o.kind,
                    kind_text: o.kind.to_string().into(),
                    namespace: o.namespace.as_deref().map(Arc::from),
                    name: o.name.as_str().into(),
                    ruleset,
                    tier,
                }
            })
            .clone()
    }

    /// The rule's `name` (or `ingress[i]` / `egress[i]` when it has none) and `logLabel`.
    fn rule(&mut self, s: &Snapshot, dir: Direction, hit: RuleHit) -> RuleNames {
        self.rules
            .entry((hit.policy, dir, hit.rule))
            .or_insert_with(|| {
                let info = s.rule_info(dir, hit);
                RuleNames {
                    name: match info.name {
                        Some(n) => n.into(),
                        None => format!("{}[{}]", dir.as_str(), info.index).into(),
                    },
                    log_label: info.log_label.map(Arc::from),
                }
            })
            .clone()
    }
}

/// A flow as the data path saw it: both ends with ports, the protocol, and when its first
/// packet arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlowInfo {
    /// The 5-tuple: the client's address and port, the original destination, the
    /// transport protocol.
    pub key: FlowKey,
    /// When the first packet was decided.
    pub time: SystemTime,
    /// Where the decision was made.
    pub point: DecisionPoint,
}

/// Where a decision was made (attribute `tierproxy.decision.point`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DecisionPoint {
    /// On the flow's first packet, from the queue, before any handshake: the rule.
    #[default]
    FirstPacket,
    /// By the proxy as it took a connection or UDP flow whose first packet was not decided:
    /// the kernel passed it on undecided (a full queue failing open, `--fail-open`), or the
    /// decision aged out before the proxy took it (issue #17). A denied TCP connection is
    /// then reset after its handshake instead of timing out.
    Accept,
    /// Again, for a live connection, after a policy or cluster change (issue #5).
    Redecision,
    /// When conntrack reported the entry of a UDP flow whose first datagram skipped the
    /// queue (its class — client, port, server — was in the kernel-side cache of classes
    /// the snapshot in force allowed; issue #20). The kernel forwarded that datagram on the
    /// cache's word; a snapshot that denies the flow by now deletes its entry.
    Conntrack,
    /// By the next agent, for a live connection the previous agent handed over to it on an
    /// upgrade or restart, before relaying a byte of it (issue #23).
    HandOver,
}

impl DecisionPoint {
    /// The attribute value: `first-packet`, `accept`, `re-decision`, `conntrack`,
    /// `hand-over`.
    pub fn as_str(self) -> &'static str {
        match self {
            DecisionPoint::FirstPacket => "first-packet",
            DecisionPoint::Accept => "accept",
            DecisionPoint::Redecision => "re-decision",
            DecisionPoint::Conntrack => "conntrack",
            DecisionPoint::HandOver => "hand-over",
        }
    }
}

fn transport(p: Protocol) -> &'static str {
    match p {
        Protocol::Tcp => "tcp",
        Protocol::Udp => "udp",
        Protocol::Sctp => "sctp",
    }
}

fn flow_attrs(e: &mut Event, ctx: &Context, names: &mut Names, flow: &FlowInfo) {
    e.str_attr(attr::TRANSPORT, transport(flow.key.protocol));
    e.str_attr(attr::NETWORK_TYPE, if flow.key.src.is_ipv4() { "ipv4" } else { "ipv6" });
    e.push(attr::SRC_ADDR, Value::Str(names.ip(flow.key.src.ip())));
    e.int_attr(attr::SRC_PORT, i64::from(flow.key.src.port()));
    e.push(attr::DST_ADDR, Value::Str(names.ip(flow.key.dst.ip())));
    e.int_attr(attr::DST_PORT, i64::from(flow.key.dst.port()));
    e.push(attr::NODE, Value::Str(ctx.node.clone()));
}

/// The attribute names of one end of a flow.
struct Side {
    kind: &'static str,
    namespace: &'static str,
    pod: &'static str,
    node: &'static str,
    /// Index into a label's `[source, destination]` attribute names.
    index: usize,
}

const SOURCE: Side = Side {
    kind: "tierproxy.source.kind",
    namespace: "tierproxy.source.k8s.namespace.name",
    pod: "tierproxy.source.k8s.pod.name",
    node: "tierproxy.source.k8s.node.name",
    index: 0,
};

const DESTINATION: Side = Side {
    kind: "tierproxy.destination.kind",
    namespace: "tierproxy.destination.k8s.namespace.name",
    pod: "tierproxy.destination.k8s.pod.name",
    node: "tierproxy.destination.k8s.node.name",
    index: 1,
};

/// `pod`, `node` or `external`, and the names of that end.
fn endpoint_attrs(
    e: &mut Event,
    ctx: &Context,
    side: &Side,
    snapshot: &Snapshot,
    names: &mut Names,
    ip: IpAddr,
) {
    match snapshot.endpoint(ip) {
        Endpoint::Pod(p) => {
            let [ns, name] = names.pod(snapshot, p);
            e.str_attr(side.kind, "pod");
            e.push(side.namespace, Value::Str(ns));
            e.push(side.pod, Value::Str(name));
            for (keys, by_pod) in ctx.label_attrs.iter().zip(&names.labels) {
                if let Some(Some(v)) = by_pod.get(p as usize) {
                    e.push(keys[side.index], Value::Str(v.clone()));
                }
            }
        }
        Endpoint::Node(n) => {
            e.str_attr(side.kind, "node");
            e.push(side.node, Value::Str(names.node(snapshot, n)));
        }
        Endpoint::External => e.str_attr(side.kind, "external"),
    }
}

/// The action as the policy's API spells it: v1alpha2 ClusterNetworkPolicy `Accept`;
/// Antrea's `Drop` for a deny (`crd.antrea.io/v1beta1` `RuleAction`: Allow, Drop, Reject,
/// Pass).
fn action_word(kind: Kind, action: Action) -> &'static str {
    match (kind, action) {
        (Kind::ClusterNetworkPolicy, Action::Allow) => "Accept",
        (Kind::AntreaClusterNetworkPolicy | Kind::AntreaNetworkPolicy, Action::Deny) => "Drop",
        (_, a) => a.as_str(),
    }
}

/// The record for direction `dir` of `decision` (which must have an outcome for `dir`).
/// `names` must have been refreshed for `snapshot` ([`Names::refresh`]).
///
/// # Panics
/// If `decision` has no outcome for `dir`, or did not come from `snapshot`.
pub fn decision(
    ctx: &Context,
    snapshot: &Snapshot,
    names: &mut Names,
    flow: &FlowInfo,
    decision: &Decision,
    dir: Direction,
) -> Event {
    let o: &Outcome = match dir {
        Direction::Ingress => decision.ingress.as_ref(),
        Direction::Egress => decision.egress.as_ref(),
    }
    .expect("an audited direction has an outcome");
    let severity = if !o.verdict.is_allow() { Severity::Warn } else { Severity::Info };
    let mut e = Event {
        name: DECISION,
        time: flow.time,
        severity,
        body: Arc::from(""),
        attributes: Vec::with_capacity(32),
    };
    flow_attrs(&mut e, ctx, names, flow);
    e.str_attr(attr::DIRECTION, dir.as_str());
    e.str_attr(attr::VERDICT, o.verdict.as_str());
    e.str_attr(attr::FLOW_VERDICT, decision.verdict.as_str());
    e.str_attr(attr::DECISION_POINT, flow.point.as_str());
    let mut why = String::new();
    let policy_attrs = |e: &mut Event, p: &PolicyNames| {
        e.str_attr(attr::POLICY_KIND, p.kind.as_str());
        e.str_attr(attr::POLICY_API_VERSION, p.kind.api_version());
        if let Some(ns) = &p.namespace {
            e.push(attr::POLICY_NAMESPACE, Value::Str(ns.clone()));
        }
        e.push(attr::POLICY_NAME, Value::Str(p.name.clone()));
        e.push(attr::RULESET, Value::Str(p.ruleset.clone()));
        e.push(attr::TIER, p.tier.clone());
    };
    match o.basis {
        Basis::Rule { hit, .. } => {
            e.str_attr(attr::BASIS, "rule");
            let p = names.policy(snapshot, hit.policy);
            policy_attrs(&mut e, &p);
            let info = snapshot.rule_info(dir, hit);
            let rule = names.rule(snapshot, dir, hit);
            e.push(attr::RULE_NAME, Value::Str(rule.name.clone()));
            e.int_attr(attr::RULE_INDEX, i64::from(info.index));
            e.str_attr(attr::RULE_ACTION, action_word(p.kind, info.action));
            if info.fail_closed {
                e.str_attr(attr::FAIL_CLOSED, "true");
            }
            if let Some(l) = rule.log_label {
                e.push(attr::LOG_LABEL, Value::Str(l));
            }
            let _ = write!(why, "{} {} rule {}", p.kind_text, p.ruleset, rule.name);
        }
        Basis::Isolated { policy } => {
            e.str_attr(attr::BASIS, "isolation");
            let p = names.policy(snapshot, policy);
            policy_attrs(&mut e, &p);
            let _ = write!(why, "isolated by NetworkPolicy {} and no rule allows it", p.ruleset);
        }
        Basis::NoPolicy => {
            e.str_attr(attr::BASIS, "default");
            why.push_str("no policy applies (default allow)");
        }
        Basis::OwnNode => {
            e.str_attr(attr::BASIS, "own-node");
            why.push_str("from the pod's own node (always allowed)");
        }
    }
    if !o.passed.is_empty() {
        let chain: Vec<Arc<str>> = o
            .passed
            .iter()
            .map(|&h| {
                let p = names.policy(snapshot, h.policy);
                format!("{} {}: {}", p.kind_text, p.ruleset, names.rule(snapshot, dir, h).name)
                    .into()
            })
            .collect();
        why.push_str(", after Pass by ");
        for (i, c) in chain.iter().enumerate() {
            if i > 0 {
                why.push_str(" then ");
            }
            why.push_str(c);
        }
        e.push(attr::PASS_CHAIN, Value::List(chain));
    }
    e.int_attr(attr::REVISION, i64::try_from(decision.revision.0).unwrap_or(i64::MAX));
    endpoint_attrs(&mut e, ctx, &SOURCE, snapshot, names, flow.key.src.ip());
    endpoint_attrs(&mut e, ctx, &DESTINATION, snapshot, names, flow.key.dst.ip());
    let subject = match dir {
        Direction::Egress => flow.key.src.ip(),
        Direction::Ingress => flow.key.dst.ip(),
    };
    let subject = match snapshot.endpoint(subject) {
        Endpoint::Pod(p) => {
            let [ns, name] = names.pod(snapshot, p);
            format!("{ns}/{name}")
        }
        ep => snapshot.endpoint_name(ep),
    };
    e.body = format!(
        "{} {} {} -> {} ({} of {subject}): {why}",
        o.verdict.as_str(),
        transport(flow.key.protocol),
        flow.key.src,
        flow.key.dst,
        dir.as_str(),
    )
    .into();
    e
}

/// How a proxied connection ended, as audited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseReason {
    /// Both sides closed.
    Normal,
    /// A side reset, or an I/O error.
    Reset,
    /// No byte either way for the idle timeout.
    Timeout,
    /// A new policy denies it (re-decision, issue #5).
    PolicyChange,
    /// The agent shut down.
    Shutdown,
    /// The original destination refused or did not answer; the client was reset.
    UpstreamUnreachable,
    /// The proxy reached one of its limits (open files) and could not connect upstream;
    /// the client was reset (issue #17: counted in `tierproxy_limit_hits_total`).
    ResourceLimit,
}

impl CloseReason {
    /// The attribute value: `normal`, `reset`, `timeout`, `policy-change`, `shutdown`,
    /// `upstream-unreachable`, `resource-limit`.
    pub fn as_str(self) -> &'static str {
        match self {
            CloseReason::Normal => "normal",
            CloseReason::Reset => "reset",
            CloseReason::Timeout => "timeout",
            CloseReason::PolicyChange => "policy-change",
            CloseReason::Shutdown => "shutdown",
            CloseReason::UpstreamUnreachable => "upstream-unreachable",
            CloseReason::ResourceLimit => "resource-limit",
        }
    }
}

/// What the proxy knows when a connection ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionEnd {
    /// Why it ended.
    pub reason: CloseReason,
    /// Bytes client → server.
    pub to_server: u64,
    /// Bytes server → client.
    pub to_client: u64,
    /// From accept to close.
    pub duration: Duration,
}

/// The record of a connection's end; `decision` is the one that admitted it. `names`
/// must have been refreshed for `snapshot` (which names the ends).
pub fn connection_end(
    ctx: &Context,
    snapshot: &Snapshot,
    names: &mut Names,
    flow: &FlowInfo,
    decision: &Decision,
    end: &ConnectionEnd,
) -> Event {
    let time = flow.time + end.duration;
    let mut e = Event {
        name: CONNECTION_END,
        time,
        severity: Severity::Info,
        body: format!(
            "{} {} -> {} ended ({}) after {:.3} s: {} B to server, {} B to client",
            transport(flow.key.protocol),
            flow.key.src,
            flow.key.dst,
            end.reason.as_str(),
            end.duration.as_secs_f64(),
            end.to_server,
            end.to_client
        )
        .into(),
        attributes: Vec::with_capacity(24),
    };
    flow_attrs(&mut e, ctx, names, flow);
    e.str_attr(attr::CLOSE_REASON, end.reason.as_str());
    e.int_attr(attr::BYTES_TO_SERVER, i64::try_from(end.to_server).unwrap_or(i64::MAX));
    e.int_attr(attr::BYTES_TO_CLIENT, i64::try_from(end.to_client).unwrap_or(i64::MAX));
    e.int_attr(attr::DURATION_MS, i64::try_from(end.duration.as_millis()).unwrap_or(i64::MAX));
    e.str_attr(attr::FLOW_VERDICT, decision.verdict.as_str());
    e.int_attr(attr::REVISION, i64::try_from(decision.revision.0).unwrap_or(i64::MAX));
    endpoint_attrs(&mut e, ctx, &SOURCE, snapshot, names, flow.key.src.ip());
    endpoint_attrs(&mut e, ctx, &DESTINATION, snapshot, names, flow.key.dst.ip());
    e
}

/// The rule a per-rule rate limit suppressed events of, as a [`SUPPRESSED`] record names
/// it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SuppressedRule<'a> {
    /// The policy's kind and apiVersion ([`attr::POLICY_KIND`],
    /// [`attr::POLICY_API_VERSION`]): an Antrea NetworkPolicy and the upstream one of the
    /// same namespace and name are two rules. `None` where no policy decided.
    pub policy: Option<(&'a str, &'a str)>,
    /// [`attr::RULESET`]: the policy, or `default` where no policy decided.
    pub ruleset: &'a str,
    /// [`attr::RULE_NAME`]: `direction/rule`, or the basis where no policy decided.
    pub rule: &'a str,
}

/// A summary of `count` events suppressed by the `by` limit (`rule` or `node`) since the
/// last summary; `rule` names the rule for a per-rule limit.
pub fn suppressed(
    ctx: &Context,
    time: SystemTime,
    by: &'static str,
    rule: Option<SuppressedRule<'_>>,
    count: u64,
) -> Event {
    let mut e = Event {
        name: SUPPRESSED,
        time,
        severity: Severity::Warn,
        body: match rule {
            Some(SuppressedRule { policy: Some((kind, version)), ruleset, rule }) => format!(
                "{count} audit events of {kind} {ruleset} ({version}) rule {rule} suppressed \
                 by the per-rule rate limit"
            ),
            Some(SuppressedRule { policy: None, ruleset, rule }) => format!(
                "{count} audit events of {ruleset} rule {rule} suppressed by the per-rule rate \
                 limit"
            ),
            None => format!("{count} audit events suppressed by the {by} rate limit"),
        }
        .into(),
        attributes: vec![],
    };
    e.push(attr::NODE, Value::Str(ctx.node.clone()));
    e.str_attr(attr::SUPPRESSED_BY, by);
    e.int_attr(attr::SUPPRESSED_COUNT, i64::try_from(count).unwrap_or(i64::MAX));
    if let Some(r) = rule {
        if let Some((kind, version)) = r.policy {
            e.string_attr(attr::POLICY_KIND, kind);
            e.string_attr(attr::POLICY_API_VERSION, version);
        }
        e.string_attr(attr::RULESET, r.ruleset);
        e.string_attr(attr::RULE_NAME, r.rule);
    }
    e
}

/// RFC 3339 UTC with nanoseconds, e.g. `2026-11-24T05:34:05.123456789Z`.
pub fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_nanos(t).to_string()
}

/// The resource as a JSON object, serialised once per sink ([`write_json`]).
pub fn resource_json(resource: &[(&'static str, String)]) -> String {
    let m: serde_json::Map<String, serde_json::Value> = resource
        .iter()
        .map(|(k, v)| ((*k).to_string(), serde_json::Value::from(v.as_str())))
        .collect();
    serde_json::Value::Object(m).to_string()
}

fn json_str(out: &mut Vec<u8>, s: &str) {
    // Writing to a Vec cannot fail; serde_json quotes and escapes.
    let _ = serde_json::to_writer(&mut *out, s);
}

/// Appends the JSON Lines form of `event` to `out` (one object, no newline): `time`,
/// `event`, `severity`, `body`, `attributes` (an object, in the event's order) and
/// `resource` (`resource_json`, from [`resource_json`]).
pub fn write_json(event: &Event, resource_json: &str, out: &mut Vec<u8>) {
    out.extend_from_slice(b"{\"time\":\"");
    out.extend_from_slice(rfc3339(event.time).as_bytes());
    out.extend_from_slice(b"\",\"event\":");
    json_str(out, event.name);
    out.extend_from_slice(b",\"severity\":\"");
    out.extend_from_slice(event.severity.as_str().as_bytes());
    out.extend_from_slice(b"\",\"body\":");
    json_str(out, &event.body);
    out.extend_from_slice(b",\"attributes\":{");
    for (i, (k, v)) in event.attributes.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        json_str(out, k);
        out.push(b':');
        match v {
            Value::Static(s) => json_str(out, s),
            Value::Str(s) => json_str(out, s),
            Value::Int(n) => {
                let _ = write!(JsonInt(out), "{n}");
            }
            Value::List(l) => {
                out.push(b'[');
                for (j, s) in l.iter().enumerate() {
                    if j > 0 {
                        out.push(b',');
                    }
                    json_str(out, s);
                }
                out.push(b']');
            }
        }
    }
    out.extend_from_slice(b"},\"resource\":");
    out.extend_from_slice(resource_json.as_bytes());
    out.push(b'}');
}

/// `fmt::Write` into a byte buffer (integers).
struct JsonInt<'a>(&'a mut Vec<u8>);

impl std::fmt::Write for JsonInt<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.0.extend_from_slice(s.as_bytes());
        Ok(())
    }
}

/// The JSON Lines form of `event` as a string ([`write_json`]).
pub fn to_json(event: &Event, resource: &[(&'static str, String)]) -> String {
    let mut out = Vec::new();
    write_json(event, &resource_json(resource), &mut out);
    String::from_utf8(out).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::cluster::manifest::parse_str;
    use crate::policy::{Flow, Revision};

    /// Pods x/a and x/b; an Antrea ClusterNetworkPolicy `guard` in Tier `securityops` on
    /// x/b's ingress (81 Drop with `enableLogging` and `logLabel`, 82 an unnamed Reject, 83
    /// Pass), and an upstream ClusterNetworkPolicy of the same name accepting 84.
    const CLUSTER: &str = r#"
apiVersion: v1
kind: Node
metadata: {name: n1}
status: {addresses: [{type: InternalIP, address: 172.31.0.2}]}
---
apiVersion: v1
kind: Namespace
metadata: {name: x, labels: {kubernetes.io/metadata.name: x}}
---
apiVersion: v1
kind: Pod
metadata: {name: a, namespace: x, labels: {app: a}}
spec: {nodeName: n1, containers: [{name: c}]}
status: {podIP: 10.0.0.1}
---
apiVersion: v1
kind: Pod
metadata: {name: b, namespace: x, labels: {app: b}}
spec: {nodeName: n1, containers: [{name: c}]}
status: {podIP: 10.0.0.2}
---
apiVersion: crd.antrea.io/v1beta1
kind: ClusterNetworkPolicy
metadata: {name: guard}
spec:
  tier: securityops
  priority: 1
  appliedTo: [{podSelector: {matchLabels: {app: b}}}]
  ingress:
  - {name: logged, action: Drop, ports: [{protocol: TCP, port: 81}], enableLogging: true, logLabel: pci-81}
  - {action: Reject, ports: [{protocol: TCP, port: 82}]}
  - {name: hop, action: Pass, ports: [{protocol: TCP, port: 83}]}
---
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {name: guard}
spec:
  tier: Admin
  priority: 1
  subject: {namespaces: {}}
  ingress:
  - {name: ok, action: Accept, from: [{namespaces: {}}], protocols: [{tcp: {destinationPort: {number: 84}}}]}
"#;

    /// The ingress record of x/a → x/b on TCP `port`.
    fn ingress(port: u16) -> Event {
        let loaded = parse_str(Path::new("t.yaml"), CLUSTER).unwrap();
        assert!(loaded.problems.iter().all(|p| !p.is_error()), "{:?}", loaded.problems);
        let compiled = Snapshot::compile(&loaded.inputs, Revision(1));
        assert!(compiled.problems.iter().all(|p| !p.is_error()), "{:?}", compiled.problems);
        let s = compiled.snapshot;
        let (src, dst) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let d = s.decide(&Flow { src, dst, protocol: Protocol::Tcp, dst_port: port });
        let ctx = Context::new("n1", Vec::new());
        let mut names = Names::default();
        names.refresh(&s, &ctx);
        let flow = FlowInfo {
            key: FlowKey {
                src: (src, 40000).into(),
                dst: (dst, port).into(),
                protocol: Protocol::Tcp,
            },
            time: SystemTime::UNIX_EPOCH,
            point: DecisionPoint::FirstPacket,
        };
        decision(&ctx, &s, &mut names, &flow, &d, Direction::Ingress)
    }

    #[test]
    fn an_antrea_drop_names_its_tier_group_action_and_log_label() {
        let e = ingress(81);
        for (k, v) in [
            (attr::VERDICT, "deny"),
            (attr::TIER, "securityops"),
            (attr::POLICY_KIND, "ClusterNetworkPolicy"),
            (attr::POLICY_API_VERSION, "crd.antrea.io/v1beta1"),
            (attr::RULESET, "guard"),
            (attr::RULE_NAME, "logged"),
            (attr::RULE_ACTION, "Drop"),
            (attr::LOG_LABEL, "pci-81"),
        ] {
            assert_eq!(e.str(k), Some(v), "{k} in {e:#?}");
        }
        assert_eq!(e.severity, Severity::Warn);
        assert!(
            e.body.ends_with(": ClusterNetworkPolicy.crd.antrea.io guard rule logged"),
            "{}",
            e.body
        );
    }

    #[test]
    fn an_antrea_reject_is_its_own_verdict_and_action() {
        let e = ingress(82);
        for (k, v) in [
            (attr::VERDICT, "reject"),
            (attr::FLOW_VERDICT, "reject"),
            (attr::TIER, "securityops"),
            (attr::POLICY_API_VERSION, "crd.antrea.io/v1beta1"),
            (attr::RULE_NAME, "ingress[1]"),
            (attr::RULE_ACTION, "Reject"),
        ] {
            assert_eq!(e.str(k), Some(v), "{k} in {e:#?}");
        }
        assert_eq!(e.attr(attr::RULE_INDEX), Some(&Value::Int(1)));
        assert_eq!(e.attr(attr::LOG_LABEL), None, "no logLabel, no attribute");
        assert_eq!(e.severity, Severity::Warn);
        assert!(e.body.starts_with("reject tcp 10.0.0.1:40000 -> 10.0.0.2:82"), "{}", e.body);
    }

    #[test]
    fn the_upstream_policy_of_the_same_name_keeps_its_own_words() {
        let e = ingress(84);
        for (k, v) in [
            (attr::VERDICT, "allow"),
            (attr::TIER, "admin"),
            (attr::POLICY_KIND, "ClusterNetworkPolicy"),
            (attr::POLICY_API_VERSION, "policy.networking.k8s.io/v1alpha2"),
            (attr::RULESET, "guard"),
            (attr::RULE_ACTION, "Accept"),
        ] {
            assert_eq!(e.str(k), Some(v), "{k} in {e:#?}");
        }
        assert!(e.body.ends_with(": ClusterNetworkPolicy guard rule ok"), "{}", e.body);
        // An Antrea Pass is named with its group in the chain; the flow then finds no
        // policy (no NetworkPolicy, no baseline) and is allowed by default.
        let e = ingress(83);
        assert_eq!(e.str(attr::BASIS), Some("default"));
        assert_eq!(
            e.attr(attr::PASS_CHAIN),
            Some(&Value::List(vec!["ClusterNetworkPolicy.crd.antrea.io guard: hop".into()]))
        );
    }
}
