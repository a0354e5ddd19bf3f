//! Read-only debug endpoints of the agent, served beside `/metrics` on its metrics address
//! (`--metrics-addr`): what the snapshot in force decides for a flow, and what it holds.
//!
//! - `GET /debug/explain?from=X&to=Y&port=N[&protocol=TCP|UDP|SCTP][&family=IPv4|IPv6]`:
//!   the object `tierproxy explain -o json` prints for that probe (the parameters are its
//!   flags and probe fields: `from` and `to` an IP address, `namespace/pod` or
//!   `node/<name>`; `protocol` TCP by default), decided against the snapshot in force, plus
//!   one key, `"agent"`: `{"node", "revision", "verdict", "egress", "ingress"}`, what this
//!   node's agent enforces of it ([`Snapshot::decide_on_node`]: a direction whose subject
//!   pod runs on another node is decided there, `"reason": "other-node"`). Decided apart
//!   from the data path: no decision cache, no audit, no counters. Unlike `explain`, a
//!   hostNetwork pod cannot be named (the snapshot keeps no hostNetwork pod names): give
//!   `node/<its node>` or its address.
//! - `GET /debug/snapshot`: `{"revision", "node", "counts", "errors", "warnings",
//!   "problems"}`: object counts per kind in the snapshot (pod-network pods, namespaces,
//!   nodes, and the policies in force by kind), and the problems the build of this
//!   snapshot found (decoding, validation, priority conflicts), each as `tierproxy check -o
//!   json` prints it. An object with an error is left out of the snapshot, or, for an admin
//!   policy with a recorded last good version ([`crate::cluster::lastgood`]), in force in
//!   that version (the agent's log and the policy's status say which).
//!
//! Answers are JSON (one line). Access: the answers name the cluster's pods, policies and
//! rules, so by default only a request from a loopback address (127.0.0.0/8, `::1`, and
//! their IPv4-mapped forms) is answered — from the node itself, or through `kubectl
//! port-forward` — and any other gets 403; `--debug-endpoints-from-anywhere` opens them to
//! every peer that reaches the metrics address. A bad query gets 400 naming the parameter
//! (`{"error", "parameter"}`), a request before the first snapshot 503.
//!
//! Source: issue #19, item 13.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::extract::{ConnectInfo, Query};
use axum::http::{StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::explain::{self, InputError, Probe};
use crate::policy::compile::Direction;
use crate::policy::{Kind, Protocol, Snapshot};
use crate::proxy::decider::Current;

/// Path of the explain endpoint.
pub const EXPLAIN_PATH: &str = "/debug/explain";
/// Path of the snapshot endpoint.
pub const SNAPSHOT_PATH: &str = "/debug/snapshot";

/// The query parameters of [`EXPLAIN_PATH`], as `tierproxy explain`'s flags and probe
/// fields name them.
pub const PARAMETERS: [&str; 5] = ["from", "to", "port", "protocol", "family"];

/// A bad debug query: the parameter and what is wrong with it (answered with 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{parameter}: {message}")]
pub struct QueryError {
    /// The parameter, as in the query (`from, to` when the two ends do not fit together).
    pub parameter: String,
    /// What is wrong.
    pub message: String,
}

fn bad(parameter: &str, message: impl Into<String>) -> QueryError {
    QueryError { parameter: parameter.to_string(), message: message.into() }
}

/// Whether a request from `peer` may be answered: a loopback address (IPv4-mapped IPv6
/// ones included: a dual-stack listener sees IPv4 peers so), or any with `from_anywhere`.
pub fn peer_allowed(peer: IpAddr, from_anywhere: bool) -> bool {
    from_anywhere || peer.to_canonical().is_loopback()
}

/// The probe of an explain query's parameters (`name=value` pairs, decoded).
///
/// # Errors
/// A parameter that is unknown, given twice, missing (`from`, `to`, `port`) or not of its
/// form (`port` 0–65535, `protocol` TCP/UDP/SCTP, `family` IPv4/IPv6).
pub fn probe_of(query: &[(String, String)]) -> Result<Probe, QueryError> {
    let mut given: [Option<&str>; 5] = [None; 5];
    for (name, value) in query {
        let Some(i) = PARAMETERS.iter().position(|p| p == name) else {
            return Err(bad(name, format!("unknown parameter (known: {})", PARAMETERS.join(", "))));
        };
        if given[i].replace(value).is_some() {
            return Err(bad(name, "given more than once"));
        }
    }
    let [from, to, port, protocol, family] = given;
    let from = from.ok_or_else(|| bad("from", "missing: namespace/pod, node/<name> or an IP"))?;
    let to = to.ok_or_else(|| bad("to", "missing: namespace/pod, node/<name> or an IP"))?;
    let port = port.ok_or_else(|| bad("port", "missing: the destination port"))?;
    let port: u16 = port
        .parse()
        .map_err(|_| bad("port", format!("{port:?} is not a port number (0-65535)")))?;
    let protocol = protocol.unwrap_or("TCP");
    protocol
        .parse::<Protocol>()
        .map_err(|e: crate::policy::ports::UnknownProtocol| bad("protocol", e.to_string()))?;
    if let Some(f) = family
        && f != "IPv4"
        && f != "IPv6"
    {
        return Err(bad("family", format!("must be \"IPv4\" or \"IPv6\", not {f:?}")));
    }
    Ok(Probe {
        from: from.to_string(),
        to: to.to_string(),
        port,
        protocol: protocol.to_string(),
        family: family.map(str::to_string),
        expect: None,
        note: None,
    })
}

/// The answer of [`EXPLAIN_PATH`] for `probe` against `current`: `explain`'s JSON object
/// and `"agent"` (see the module docs).
///
/// # Errors
/// An end that names no pod-network pod, node or address of the snapshot (the parameter
/// is `from` or `to`), or ends without an address of one family (`family`, or `from, to`).
pub fn explain_json(current: &Current, probe: &Probe) -> Result<Value, QueryError> {
    let s: &Snapshot = &current.snapshot;
    explain::addresses(s, None, &probe.from).map_err(|m| bad("from", m))?;
    explain::addresses(s, None, &probe.to).map_err(|m| bad("to", m))?;
    let flow = explain::resolve_with(s, None, 1, probe).map_err(|e| {
        let parameter = if probe.family.is_some() { "family" } else { "from, to" };
        match e {
            InputError::Probe { message, .. } => bad(parameter, message),
            other => bad(parameter, other.to_string()),
        }
    })?;
    let mut v = explain::probe_json(s, probe, &flow);
    let everywhere = s.decide(&flow);
    let here = s.decide_on_node(&flow, current.node);
    let direction = |dir: Direction, here: Option<&_>, anywhere: bool| match here {
        Some(o) => explain::outcome_json(s, dir, Some(o)),
        // The subject is a pod of another node: its agent decides this direction.
        None if anywhere => {
            let mut o = explain::outcome_json(s, dir, None);
            o["reason"] = json!("other-node");
            o
        }
        None => explain::outcome_json(s, dir, None),
    };
    v["agent"] = json!({
        "node": s.node_name(current.node),
        "revision": s.revision().0,
        "verdict": here.verdict.as_str(),
        "egress": direction(Direction::Egress, here.egress.as_ref(), everywhere.egress.is_some()),
        "ingress": direction(Direction::Ingress, here.ingress.as_ref(), everywhere.ingress.is_some()),
    });
    Ok(v)
}

/// The answer of [`SNAPSHOT_PATH`] for `current` (see the module docs).
pub fn snapshot_json(current: &Current) -> Value {
    let s: &Snapshot = &current.snapshot;
    let (pods, namespaces, nodes, _) = s.counts();
    let policy_kinds = [
        Kind::NetworkPolicy,
        Kind::AdminNetworkPolicy,
        Kind::BaselineAdminNetworkPolicy,
        Kind::ClusterNetworkPolicy,
    ];
    let mut per_kind = [0usize; 4];
    for i in 0..s.policy_count() {
        let kind = s.policy_ref(i).kind;
        if let Some(k) = policy_kinds.iter().position(|p| *p == kind) {
            per_kind[k] += 1;
        }
    }
    let mut counts = serde_json::Map::new();
    for (kind, n) in [(Kind::Namespace, namespaces), (Kind::Node, nodes), (Kind::Pod, pods)]
        .into_iter()
        .chain(policy_kinds.into_iter().zip(per_kind))
    {
        counts.insert(kind.as_str().to_string(), json!(n));
    }
    let errors = current.problems.iter().filter(|p| p.is_error()).count();
    json!({
        "revision": s.revision().0,
        "node": s.node_name(current.node),
        "counts": counts,
        "errors": errors,
        "warnings": current.problems.len() - errors,
        "problems": current.problems.iter().map(explain::problem_json).collect::<Vec<_>>(),
    })
}

/// The routes [`EXPLAIN_PATH`] and [`SNAPSHOT_PATH`], answering from `current()` (the
/// snapshot in force; `None` before the first one). They read the peer's address, so the
/// server must be run with `into_make_service_with_connect_info::<SocketAddr>()`
/// ([`crate::metrics::serve`] does); `from_anywhere` answers every peer, else loopback
/// ones only.
pub fn router<F>(current: F, from_anywhere: bool) -> axum::Router
where
    F: Fn() -> Option<Arc<Current>> + Clone + Send + Sync + 'static,
{
    let for_snapshot = current.clone();
    axum::Router::new()
        .route(
            EXPLAIN_PATH,
            axum::routing::get(move |ConnectInfo(peer): ConnectInfo<SocketAddr>, uri: Uri| {
                let current = current.clone();
                async move {
                    answer(peer, from_anywhere, &current, |c| {
                        let query = Query::<Vec<(String, String)>>::try_from_uri(&uri)
                            .map_err(|e| bad("query", e.body_text()))?;
                        explain_json(c, &probe_of(&query.0)?)
                    })
                }
            }),
        )
        .route(
            SNAPSHOT_PATH,
            axum::routing::get(move |ConnectInfo(peer): ConnectInfo<SocketAddr>| {
                let current = for_snapshot.clone();
                async move { answer(peer, from_anywhere, &current, |c| Ok(snapshot_json(c))) }
            }),
        )
}

/// The peer check first (a refused peer learns nothing, not even whether its query
/// parses), then `f` on the snapshot in force.
fn answer(
    peer: SocketAddr,
    from_anywhere: bool,
    current: &dyn Fn() -> Option<Arc<Current>>,
    f: impl FnOnce(&Current) -> Result<Value, QueryError>,
) -> Response {
    if !peer_allowed(peer.ip(), from_anywhere) {
        tracing::debug!(%peer, "debug endpoint request refused: not from a loopback address");
        let error = format!(
            "the debug endpoints answer requests from a loopback address only (this one came \
             from {}); ask from the node itself, or start the agent with \
             --debug-endpoints-from-anywhere",
            peer.ip()
        );
        return reply(StatusCode::FORBIDDEN, &json!({ "error": error }));
    }
    let Some(c) = current() else {
        let error = "no snapshot yet: the agent is still starting (see /readyz)";
        return reply(StatusCode::SERVICE_UNAVAILABLE, &json!({ "error": error }));
    };
    match f(&c) {
        Ok(v) => reply(StatusCode::OK, &v),
        Err(e) => reply(
            StatusCode::BAD_REQUEST,
            &json!({"error": e.to_string(), "parameter": e.parameter}),
        ),
    }
}

fn reply(status: StatusCode, body: &Value) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], format!("{body}\n")).into_response()
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::path::PathBuf;
    use std::sync::atomic::AtomicBool;

    use super::*;
    use crate::explain::{Format, ProbeSource};
    use crate::metrics::{Metrics, Scraped};
    use crate::policy::Revision;

    /// Two nodes; `a/client` and `a/server` on n1, `b/remote` on n2, a hostNetwork pod on
    /// n2. Two ANPs tie at priority 10 over every namespace (a priority conflict: a
    /// warning, so `explain` still decides).
    const CLUSTER: &str = r#"
apiVersion: v1
kind: Node
metadata: {name: n1}
status: {addresses: [{type: InternalIP, address: 172.31.0.2}]}
---
apiVersion: v1
kind: Node
metadata: {name: n2}
status: {addresses: [{type: InternalIP, address: 172.31.0.3}]}
---
apiVersion: v1
kind: Namespace
metadata: {name: a, labels: {team: blue}}
---
apiVersion: v1
kind: Namespace
metadata: {name: b}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: a}
spec: {nodeName: n1, containers: [{name: c}]}
status: {podIP: 10.61.1.2, podIPs: [{ip: 10.61.1.2}, {ip: "fd00:61::1:2"}]}
---
apiVersion: v1
kind: Pod
metadata: {name: server, namespace: a}
spec: {nodeName: n1, containers: [{name: c, ports: [{name: http, containerPort: 8080}]}]}
status: {podIP: 10.61.1.3, podIPs: [{ip: 10.61.1.3}, {ip: "fd00:61::1:3"}]}
---
apiVersion: v1
kind: Pod
metadata: {name: remote, namespace: b}
spec: {nodeName: n2, containers: [{name: c}]}
status: {podIP: 10.61.2.2}
---
apiVersion: v1
kind: Pod
metadata: {name: agent, namespace: b}
spec: {nodeName: n2, hostNetwork: true, containers: [{name: c}]}
status: {podIP: 172.31.0.3}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: server-from-client, namespace: a}
spec:
  podSelector: {}
  ingress: [{from: [{podSelector: {}}], ports: [{port: http}]}]
---
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: blue-not-to-b}
spec:
  priority: 10
  subject: {namespaces: {matchLabels: {team: blue}}}
  egress:
  - name: no-b
    action: Deny
    to: [{namespaces: {matchLabels: {kubernetes.io/metadata.name: b}}}]
---
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: tie}
spec:
  priority: 10
  subject: {namespaces: {}}
  ingress: [{name: pass-all, action: Pass, from: [{namespaces: {}}]}]
"#;

    /// The manifest in a temp dir, the agent's build of it for `node`, and a metrics
    /// server with the debug routes on a free loopback port.
    struct Served {
        _dir: tempfile::TempDir,
        file: PathBuf,
        addr: SocketAddr,
        _rt: tokio::runtime::Runtime,
    }

    fn serve(node: &str) -> Served {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("cluster.yaml");
        std::fs::write(&file, CLUSTER).unwrap();
        let loaded = crate::cluster::builder::gather(std::slice::from_ref(&file), None);
        let built = crate::agent::build(
            &mut crate::cluster::builder::Builder::new(),
            loaded,
            node,
            Revision(1),
            Default::default(),
            None,
            &mut crate::cluster::builder::ProblemLog::default(),
        )
        .unwrap();
        let current = Arc::new(built.current);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let metrics = Arc::new(Metrics::new(Scraped(Box::new(Vec::new))));
        let routes = router(move || Some(current.clone()), false);
        let addr = rt
            .block_on(crate::metrics::serve(
                "127.0.0.1:0".parse().unwrap(),
                metrics,
                Arc::new(AtomicBool::new(true)),
                || None,
                routes,
            ))
            .unwrap();
        Served { _dir: dir, file, addr, _rt: rt }
    }

    /// `GET path` over a real connection: the status code and the body as JSON.
    fn get(addr: SocketAddr, path: &str) -> (u16, Value) {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
        write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).unwrap();
        let status = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        let json = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {text}"));
        (status, json)
    }

    /// What `tierproxy explain -o json --from .. --to .. --port .. --protocol ..` prints.
    fn explained(file: &PathBuf, probe: Probe) -> Value {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let code = explain::explain(
            std::slice::from_ref(file),
            ProbeSource::One(probe),
            Format::Json,
            &mut out,
            &mut err,
        );
        assert_eq!(code, explain::EXIT_OK, "{}", String::from_utf8_lossy(&err));
        serde_json::from_slice(&out).unwrap()
    }

    fn probe(from: &str, to: &str, port: u16, protocol: &str) -> Probe {
        Probe {
            from: from.into(),
            to: to.into(),
            port,
            protocol: protocol.into(),
            family: None,
            expect: None,
            note: None,
        }
    }

    #[test]
    fn explain_over_http_answers_explains_json_and_what_this_node_enforces() {
        let served = serve("n1");
        // (query, the probe `explain` gets, verdict, this node's egress and ingress reasons)
        let cases = [
            // Both ends here: this node decides both directions.
            (
                "from=a/client&to=a/server&port=8080",
                probe("a/client", "a/server", 8080, "TCP"),
                "allow",
                ("allow", "default", "allow", "rule"),
            ),
            // The client here: both, the remote server's ingress too (the proxy completes
            // the client's handshake).
            (
                "from=a/client&to=b/remote&port=80&protocol=UDP",
                probe("a/client", "b/remote", 80, "UDP"),
                "deny",
                ("deny", "rule", "allow", "default"),
            ),
            // The client on n2: its egress is n2's.
            (
                "from=b/remote&to=10.61.1.3&port=9090",
                probe("b/remote", "10.61.1.3", 9090, "TCP"),
                "deny",
                ("n/a", "other-node", "deny", "isolation"),
            ),
            // A node is no subject (nor a pod peer of the isolating NetworkPolicy).
            (
                "from=node/n2&to=a%2Fserver&port=8080",
                probe("node/n2", "a/server", 8080, "TCP"),
                "deny",
                ("n/a", "not-a-pod", "deny", "isolation"),
            ),
        ];
        for (query, p, verdict, (ev, er, iv, ir)) in cases {
            let (status, mut got) = get(served.addr, &format!("{EXPLAIN_PATH}?{query}"));
            assert_eq!(status, 200, "{query}: {got}");
            let agent = got.as_object_mut().unwrap().remove("agent").expect("agent");
            assert_eq!(got, explained(&served.file, p), "{query}: explain's JSON");
            assert_eq!(agent["node"], "n1");
            assert_eq!(agent["revision"], 1);
            assert_eq!(agent["verdict"], verdict, "{query}: {agent}");
            assert_eq!(
                (&agent["egress"]["verdict"], &agent["egress"]["reason"]),
                (&json!(ev), &json!(er)),
                "{query}: {agent}"
            );
            assert_eq!(
                (&agent["ingress"]["verdict"], &agent["ingress"]["reason"]),
                (&json!(iv), &json!(ir)),
                "{query}: {agent}"
            );
        }
        // The family picks both ends' IPv6 addresses, as in a probe file.
        let (status, mut got) = get(
            served.addr,
            &format!("{EXPLAIN_PATH}?from=a/client&to=a/server&port=8080&family=IPv6"),
        );
        assert_eq!(status, 200, "{got}");
        got.as_object_mut().unwrap().remove("agent");
        let mut p = probe("a/client", "a/server", 8080, "TCP");
        p.family = Some("IPv6".into());
        assert_eq!(got, explained(&served.file, p));
        assert_eq!(got["addresses"]["to"], "fd00:61::1:3");
    }

    #[test]
    fn a_bad_query_gets_400_naming_the_parameter() {
        let served = serve("n1");
        for (query, parameter, says) in [
            ("to=a/server&port=80", "from", "missing"),
            ("from=a/client&port=80", "to", "missing"),
            ("from=a/client&to=a/server", "port", "missing"),
            ("from=a/client&to=a/server&port=http", "port", "\"http\" is not a port number"),
            ("from=a/client&to=a/server&port=70000", "port", "\"70000\" is not a port number"),
            ("from=a/client&to=a/server&port=80&protocol=ICMP", "protocol", "ICMP"),
            ("from=a/client&to=a/server&port=80&family=ipv6", "family", "\"ipv6\""),
            ("from=a/client&to=a/server&port=80&expect=deny", "expect", "unknown parameter"),
            ("from=a/client&from=b/remote&to=a/server&port=80", "from", "more than once"),
            ("from=a/nobody&to=a/server&port=80", "from", "no pod-network pod a/nobody"),
            ("from=a/client&to=node/n9&port=80", "to", "no node \"n9\" in the snapshot"),
            ("from=a/client&to=server&port=80", "to", "neither an IP address"),
            // A hostNetwork pod is not in the snapshot by name.
            ("from=b/agent&to=a/server&port=80", "from", "give node/<its node>"),
            ("from=b/remote&to=a/server&port=80&family=IPv6", "family", "no IPv6 address"),
            ("from=b/remote&to=fd00:61::1:3&port=80", "from, to", "share no IP family"),
        ] {
            let (status, got) = get(served.addr, &format!("{EXPLAIN_PATH}?{query}"));
            assert_eq!(status, 400, "{query}: {got}");
            assert_eq!(got["parameter"], parameter, "{query}: {got}");
            let error = got["error"].as_str().unwrap();
            assert!(error.starts_with(&format!("{parameter}: ")), "{query}: {error}");
            assert!(error.contains(says), "{query}: {error}");
        }
    }

    #[test]
    fn the_snapshot_endpoint_reports_revision_counts_and_the_builds_problems() {
        let served = serve("n1");
        let (status, got) = get(served.addr, SNAPSHOT_PATH);
        assert_eq!(status, 200, "{got}");
        assert_eq!(got["revision"], 1);
        assert_eq!(got["node"], "n1");
        // The hostNetwork pod is no pod-network pod.
        assert_eq!(
            got["counts"],
            json!({"Namespace": 2, "Node": 2, "Pod": 3, "NetworkPolicy": 1,
                   "AdminNetworkPolicy": 2, "BaselineAdminNetworkPolicy": 0,
                   "ClusterNetworkPolicy": 0})
        );
        // The tie, as a warning on the first of the two in name order (and, where the
        // engine reports a tie on both, on the other too).
        let problems = got["problems"].as_array().unwrap();
        assert_eq!(got["errors"], 0, "{got}");
        assert_eq!(got["warnings"], problems.len(), "{got}");
        assert!(
            problems.iter().all(|p| p["severity"] == "warning"
                && p["kind"] == "AdminNetworkPolicy"
                && p["field"] == "spec.priority"
                && p["message"].as_str().unwrap().contains("priority 10 is shared")),
            "{got}"
        );
        assert!(problems.iter().any(|p| p["name"] == "blue-not-to-b"), "{got}");
    }

    #[test]
    fn only_loopback_peers_are_answered_unless_opened() {
        for (peer, loopback) in [
            ("127.0.0.1", true),
            ("127.3.2.1", true),
            ("::1", true),
            ("::ffff:127.0.0.1", true),
            ("10.61.1.2", false),
            ("172.31.0.2", false),
            ("::ffff:10.61.1.2", false),
            ("fd00:61::1:2", false),
            ("0.0.0.0", false),
            ("::", false),
        ] {
            let ip: IpAddr = peer.parse().unwrap();
            assert_eq!(peer_allowed(ip, false), loopback, "{peer}");
            assert!(peer_allowed(ip, true), "{peer} with --debug-endpoints-from-anywhere");
        }
        // The answer for a refused peer, before anything else is looked at.
        let current = || -> Option<Arc<Current>> { panic!("a refused peer reads no snapshot") };
        let refused = answer("10.61.1.2:40000".parse().unwrap(), false, &current, |_| {
            unreachable!("a refused peer's query is not read")
        });
        assert_eq!(refused.status(), StatusCode::FORBIDDEN);
        // And a peer let in by the flag, before the first snapshot.
        let none = || None;
        let early = answer("10.61.1.2:40000".parse().unwrap(), true, &none, |_| Ok(json!({})));
        assert_eq!(early.status(), StatusCode::SERVICE_UNAVAILABLE);
    }
}
