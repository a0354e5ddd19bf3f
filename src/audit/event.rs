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

use std::borrow::Cow;
use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::policy::compile::{Action, Direction, Endpoint};
use crate::policy::eval::{Basis, Decision, Outcome, RuleHit, Verdict};
use crate::policy::{Kind, Protocol, Snapshot};

/// Event name of a decision record: one per audited direction of a new flow.
pub const DECISION: &str = "tierproxy.policy.decision";
/// Event name of the end of a proxied connection.
pub const CONNECTION_END: &str = "tierproxy.connection.end";
/// Event name of a summary of events a rate limit suppressed.
pub const SUPPRESSED: &str = "tierproxy.audit.suppressed";

/// Prefix of tierproxy's own attributes.
pub const PREFIX: &str = "tierproxy.";

/// An attribute value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// A string.
    Str(String),
    /// An integer.
    Int(i64),
    /// A list of strings (the Pass chain).
    List(Vec<String>),
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
    /// A short human sentence.
    pub body: String,
    /// Everything else, in a stable order.
    pub attributes: Vec<(Cow<'static, str>, Value)>,
}

impl Event {
    /// The value of attribute `key`, if present.
    pub fn attr(&self, key: &str) -> Option<&Value> {
        self.attributes.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// The string value of attribute `key`, if present and a string.
    pub fn str(&self, key: &str) -> Option<&str> {
        match self.attr(key)? {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    fn push(&mut self, key: impl Into<Cow<'static, str>>, value: Value) {
        self.attributes.push((key.into(), value));
    }

    fn str_attr(&mut self, key: &'static str, value: impl Into<String>) {
        self.push(key, Value::Str(value.into()));
    }

    fn int_attr(&mut self, key: &'static str, value: i64) {
        self.push(key, Value::Int(value));
    }

    /// Adds `tierproxy.deny.count`, the number of identical denies this record stands for
    /// (see [`super::limit::Aggregator`]), and the time of the last one.
    pub fn set_count(&mut self, count: u64, last: SystemTime) {
        self.int_attr(attr::COUNT, i64::try_from(count).unwrap_or(i64::MAX));
        self.str_attr(attr::LAST_SEEN, rfc3339(last));
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
    /// `rule`, `isolation`, `default`, `own-node`: what decided the direction.
    pub const BASIS: &str = "tierproxy.basis";
    /// `admin`, `networkpolicy`, `baseline` (absent for `default` and `own-node`).
    pub const TIER: &str = "tierproxy.tier";
    /// The deciding policy's kind, e.g. `AdminNetworkPolicy`.
    pub const POLICY_KIND: &str = "tierproxy.policy.kind";
    /// The deciding policy's namespace (NetworkPolicy only).
    pub const POLICY_NAMESPACE: &str = "tierproxy.policy.namespace";
    /// The deciding policy's name.
    pub const POLICY_NAME: &str = "tierproxy.policy.name";
    /// The rule's position in the policy's ingress or egress list.
    pub const RULE_INDEX: &str = "tierproxy.rule.index";
    /// The rule's action as its API spells it: `Allow`, `Deny`, `Pass`; `Accept` for a
    /// ClusterNetworkPolicy allow.
    pub const RULE_ACTION: &str = "tierproxy.rule.action";
    /// `true` when the rule failed closed (a peer of an unknown kind).
    pub const FAIL_CLOSED: &str = "tierproxy.rule.fail_closed";
    /// The Pass rules taken on the way, in order: `Kind name: rule`.
    pub const PASS_CHAIN: &str = "tierproxy.pass_chain";
    /// The snapshot revision that decided.
    pub const REVISION: &str = "tierproxy.revision";
    /// Number of identical denies (same flow but source port) the record stands for.
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

/// Node-wide context of rendering.
#[derive(Debug, Clone, Default)]
pub struct Context {
    /// This node's name.
    pub node: String,
    /// Pod label keys reported on both ends (`tierproxy.source.k8s.pod.label.<key>`).
    pub label_keys: Vec<String>,
}

/// The pods' labels of interest for one snapshot: by key, each pod's value.
#[derive(Debug, Default)]
pub struct Labels {
    revision: u64,
    /// By key (as [`Context::label_keys`]): by pod id.
    values: Vec<Vec<Option<Arc<str>>>>,
}

impl Labels {
    /// Projects `snapshot`'s pod labels onto `keys` (one pass per key).
    pub fn new(snapshot: &Snapshot, keys: &[String]) -> Self {
        let values = keys
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
        Labels { revision: snapshot.revision().0, values }
    }

    /// The revision these labels were projected from.
    pub fn revision(&self) -> u64 {
        self.revision
    }
}

/// A flow as the data path saw it: both ends with ports, the protocol, and when its first
/// packet arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlowInfo {
    /// The client's address and port.
    pub src: SocketAddr,
    /// The original destination.
    pub dst: SocketAddr,
    /// The transport protocol.
    pub protocol: Protocol,
    /// When the first packet was decided.
    pub time: SystemTime,
}

fn transport(p: Protocol) -> &'static str {
    match p {
        Protocol::Tcp => "tcp",
        Protocol::Udp => "udp",
        Protocol::Sctp => "sctp",
    }
}

fn flow_attrs(e: &mut Event, ctx: &Context, flow: &FlowInfo) {
    e.str_attr(attr::TRANSPORT, transport(flow.protocol));
    e.str_attr(attr::NETWORK_TYPE, if flow.src.is_ipv4() { "ipv4" } else { "ipv6" });
    e.str_attr(attr::SRC_ADDR, flow.src.ip().to_string());
    e.int_attr(attr::SRC_PORT, i64::from(flow.src.port()));
    e.str_attr(attr::DST_ADDR, flow.dst.ip().to_string());
    e.int_attr(attr::DST_PORT, i64::from(flow.dst.port()));
    e.str_attr(attr::NODE, ctx.node.clone());
}

/// `pod`, `node` or `external`, and the names of that end.
fn endpoint_attrs(
    e: &mut Event,
    ctx: &Context,
    side: &'static str,
    snapshot: &Snapshot,
    labels: &Labels,
    ip: IpAddr,
) {
    let key = |rest: &str| -> Cow<'static, str> { format!("{PREFIX}{side}.{rest}").into() };
    match snapshot.endpoint(ip) {
        Endpoint::Pod(p) => {
            let (ns, name) = snapshot.pod_name(p);
            e.push(key("kind"), Value::Str("pod".into()));
            e.push(key("k8s.namespace.name"), Value::Str(ns.into()));
            e.push(key("k8s.pod.name"), Value::Str(name.into()));
            if labels.revision == snapshot.revision().0 {
                for (k, by_pod) in ctx.label_keys.iter().zip(&labels.values) {
                    if let Some(Some(v)) = by_pod.get(p as usize) {
                        e.push(key(&format!("k8s.pod.label.{k}")), Value::Str(v.to_string()));
                    }
                }
            }
        }
        Endpoint::Node(n) => {
            e.push(key("kind"), Value::Str("node".into()));
            e.push(key("k8s.node.name"), Value::Str(snapshot.node_name(n).into()));
        }
        Endpoint::External => e.push(key("kind"), Value::Str("external".into())),
    }
}

/// `name` or `namespace/name`.
fn policy_name(snapshot: &Snapshot, policy: u32) -> String {
    let o = snapshot.policy_ref(policy);
    match &o.namespace {
        Some(ns) => format!("{ns}/{}", o.name),
        None => o.name.clone(),
    }
}

/// The rule's `name`, or `ingress[i]` / `egress[i]` when it has none.
fn rule_name(snapshot: &Snapshot, dir: Direction, hit: RuleHit) -> String {
    let info = snapshot.rule_info(dir, hit);
    match info.name {
        Some(n) => n.to_string(),
        None => format!("{}[{}]", dir.as_str(), info.index),
    }
}

/// The action as the policy's API spells it (v1alpha2 ClusterNetworkPolicy: `Accept`).
fn action_word(kind: Kind, action: Action) -> &'static str {
    match (kind, action) {
        (Kind::ClusterNetworkPolicy, Action::Allow) => "Accept",
        (_, a) => a.as_str(),
    }
}

/// The record for direction `dir` of `decision` (which must have an outcome for `dir`).
///
/// # Panics
/// If `decision` has no outcome for `dir`, or did not come from `snapshot`.
pub fn decision(
    ctx: &Context,
    snapshot: &Snapshot,
    labels: &Labels,
    flow: &FlowInfo,
    decision: &Decision,
    dir: Direction,
) -> Event {
    let o: &Outcome = match dir {
        Direction::Ingress => decision.ingress.as_ref(),
        Direction::Egress => decision.egress.as_ref(),
    }
    .expect("an audited direction has an outcome");
    let severity = if o.verdict == Verdict::Deny { Severity::Warn } else { Severity::Info };
    let mut e = Event {
        name: DECISION,
        time: flow.time,
        severity,
        body: String::new(),
        attributes: vec![],
    };
    flow_attrs(&mut e, ctx, flow);
    e.str_attr(attr::DIRECTION, dir.as_str());
    e.str_attr(attr::VERDICT, o.verdict.as_str());
    e.str_attr(attr::FLOW_VERDICT, decision.verdict.as_str());
    let subject = match dir {
        Direction::Egress => flow.src,
        Direction::Ingress => flow.dst,
    };
    let mut why = String::new();
    let policy_attrs = |e: &mut Event, policy: u32| {
        let o = snapshot.policy_ref(policy);
        e.str_attr(attr::POLICY_KIND, o.kind.as_str());
        if let Some(ns) = &o.namespace {
            e.str_attr(attr::POLICY_NAMESPACE, ns.clone());
        }
        e.str_attr(attr::POLICY_NAME, o.name.clone());
        e.str_attr(attr::RULESET, policy_name(snapshot, policy));
        e.str_attr(attr::TIER, snapshot.policy_tier(policy).as_str());
    };
    match o.basis {
        Basis::Rule { hit, .. } => {
            e.str_attr(attr::BASIS, "rule");
            policy_attrs(&mut e, hit.policy);
            let info = snapshot.rule_info(dir, hit);
            let name = rule_name(snapshot, dir, hit);
            let kind = snapshot.policy_ref(hit.policy).kind;
            e.str_attr(attr::RULE_NAME, name.clone());
            e.int_attr(attr::RULE_INDEX, i64::from(info.index));
            e.str_attr(attr::RULE_ACTION, action_word(kind, info.action));
            if info.fail_closed {
                e.push(attr::FAIL_CLOSED, Value::Str("true".into()));
            }
            let _ = write!(why, "{kind} {} rule {name}", policy_name(snapshot, hit.policy));
        }
        Basis::Isolated { policy } => {
            e.str_attr(attr::BASIS, "isolation");
            policy_attrs(&mut e, policy);
            let _ = write!(
                why,
                "isolated by NetworkPolicy {} and no rule allows it",
                policy_name(snapshot, policy)
            );
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
        let chain: Vec<String> = o
            .passed
            .iter()
            .map(|&h| {
                let kind = snapshot.policy_ref(h.policy).kind;
                format!(
                    "{kind} {}: {}",
                    policy_name(snapshot, h.policy),
                    rule_name(snapshot, dir, h)
                )
            })
            .collect();
        let _ = write!(why, ", after Pass by {}", chain.join(" then "));
        e.push(attr::PASS_CHAIN, Value::List(chain));
    }
    e.int_attr(attr::REVISION, i64::try_from(decision.revision.0).unwrap_or(i64::MAX));
    endpoint_attrs(&mut e, ctx, "source", snapshot, labels, flow.src.ip());
    endpoint_attrs(&mut e, ctx, "destination", snapshot, labels, flow.dst.ip());
    e.body = format!(
        "{} {} {} -> {} ({} of {}): {why}",
        o.verdict.as_str(),
        transport(flow.protocol),
        flow.src,
        flow.dst,
        dir.as_str(),
        snapshot_name(snapshot, subject.ip()),
    );
    e
}

fn snapshot_name(snapshot: &Snapshot, ip: IpAddr) -> String {
    snapshot.endpoint_name(snapshot.endpoint(ip))
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
}

impl CloseReason {
    /// The attribute value: `normal`, `reset`, `timeout`, `policy-change`, `shutdown`,
    /// `upstream-unreachable`.
    pub fn as_str(self) -> &'static str {
        match self {
            CloseReason::Normal => "normal",
            CloseReason::Reset => "reset",
            CloseReason::Timeout => "timeout",
            CloseReason::PolicyChange => "policy-change",
            CloseReason::Shutdown => "shutdown",
            CloseReason::UpstreamUnreachable => "upstream-unreachable",
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

/// The record of a connection's end; `decision` is the one that admitted it.
pub fn connection_end(
    ctx: &Context,
    snapshot: &Snapshot,
    labels: &Labels,
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
            transport(flow.protocol),
            flow.src,
            flow.dst,
            end.reason.as_str(),
            end.duration.as_secs_f64(),
            end.to_server,
            end.to_client
        ),
        attributes: vec![],
    };
    flow_attrs(&mut e, ctx, flow);
    e.str_attr(attr::CLOSE_REASON, end.reason.as_str());
    e.int_attr(attr::BYTES_TO_SERVER, i64::try_from(end.to_server).unwrap_or(i64::MAX));
    e.int_attr(attr::BYTES_TO_CLIENT, i64::try_from(end.to_client).unwrap_or(i64::MAX));
    e.int_attr(attr::DURATION_MS, i64::try_from(end.duration.as_millis()).unwrap_or(i64::MAX));
    e.str_attr(attr::FLOW_VERDICT, decision.verdict.as_str());
    e.int_attr(attr::REVISION, i64::try_from(decision.revision.0).unwrap_or(i64::MAX));
    endpoint_attrs(&mut e, ctx, "source", snapshot, labels, flow.src.ip());
    endpoint_attrs(&mut e, ctx, "destination", snapshot, labels, flow.dst.ip());
    e
}

/// A summary of `count` events suppressed by the `by` limit (`rule` or `node`) since the
/// last summary; `ruleset`/`rule` name the rule for a per-rule limit.
pub fn suppressed(
    ctx: &Context,
    time: SystemTime,
    by: &'static str,
    ruleset: Option<&str>,
    rule: Option<&str>,
    count: u64,
) -> Event {
    let mut e = Event {
        name: SUPPRESSED,
        time,
        severity: Severity::Warn,
        body: match (ruleset, rule) {
            (Some(rs), Some(r)) => {
                format!(
                    "{count} audit events of {rs} rule {r} suppressed by the per-rule rate limit"
                )
            }
            _ => format!("{count} audit events suppressed by the {by} rate limit"),
        },
        attributes: vec![],
    };
    e.str_attr(attr::NODE, ctx.node.clone());
    e.str_attr(attr::SUPPRESSED_BY, by);
    e.int_attr(attr::SUPPRESSED_COUNT, i64::try_from(count).unwrap_or(i64::MAX));
    if let Some(rs) = ruleset {
        e.str_attr(attr::RULESET, rs.to_string());
    }
    if let Some(r) = rule {
        e.str_attr(attr::RULE_NAME, r.to_string());
    }
    e
}

/// RFC 3339 UTC with nanoseconds, e.g. `2026-11-24T05:34:05.123456789Z`.
pub fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_nanos(t).to_string()
}

/// The JSON Lines form of `event` (one object, no newline): `time`, `event`,
/// `severity`, `body`, `attributes` (an object, in the event's order) and `resource`.
pub fn to_json(event: &Event, resource: &[(&'static str, String)]) -> String {
    use serde_json::{Map, Value as J};
    let mut attrs = Map::with_capacity(event.attributes.len());
    for (k, v) in &event.attributes {
        let v = match v {
            Value::Str(s) => J::String(s.clone()),
            Value::Int(i) => J::from(*i),
            Value::List(l) => J::Array(l.iter().cloned().map(J::String).collect()),
        };
        attrs.insert(k.to_string(), v);
    }
    let mut res = Map::new();
    for (k, v) in resource {
        res.insert((*k).to_string(), J::String(v.clone()));
    }
    let mut m = Map::new();
    m.insert("time".into(), J::String(rfc3339(event.time)));
    m.insert("event".into(), J::String(event.name.into()));
    m.insert("severity".into(), J::String(event.severity.as_str().into()));
    m.insert("body".into(), J::String(event.body.clone()));
    m.insert("attributes".into(), J::Object(attrs));
    m.insert("resource".into(), J::Object(res));
    J::Object(m).to_string()
}
