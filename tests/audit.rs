//! The audit pipeline against a real OTLP receiver on loopback (gRPC and HTTP/protobuf,
//! built on the official protobuf types), and the JSON Lines sink on real files: the exact
//! events and attributes, per-policy switches, deny aggregation, rate limits, and the
//! faults a collector can have (absent, slow, killed mid-stream) in lossy and lossless
//! modes.
//!
//! No network namespace is needed: decisions come from a compiled snapshot, handed to the
//! pipeline as the NFQUEUE readers do. `datapath_netns` checks the same events for real
//! connections through the lab. Every loop is bounded in count; waits are bounded in time.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use serde_json::json;
use tierproxy::audit::event::{self, attr};
use tierproxy::audit::limit::Limits;
use tierproxy::audit::receiver::{Received, Receiver};
use tierproxy::audit::{
    AuditConfig, Auditor, CloseReason, ConnectionEnd, Defaults, FlowInfo, JsonTarget, Mode,
    OtlpConfig, OtlpProtocol, Sampling, Selection, SinkConfig,
};
use tierproxy::cluster::manifest::parse_str;
use tierproxy::policy::{Flow, FlowKey, Protocol, Revision, Snapshot};

/// Nodes n1, n2; namespaces a, b; pods with an `app` label. ANP `b-guard` denies 9090 from
/// a and passes 8080 from a; NetworkPolicy `b/allow-a` allows 8080 from a; BANP denies
/// ingress to a from b. `ANNOTATION` is replaced by the test.
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
metadata: {name: a, labels: {kubernetes.io/metadata.name: a}}
---
apiVersion: v1
kind: Namespace
metadata: {name: b, labels: {kubernetes.io/metadata.name: b}}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: a, labels: {app: shop, team: red}}
spec: {nodeName: n1, containers: [{name: c}]}
status: {podIP: 10.60.1.2}
---
apiVersion: v1
kind: Pod
metadata: {name: server, namespace: a, labels: {app: db}}
spec: {nodeName: n1, containers: [{name: c, ports: [{containerPort: 8080}]}]}
status: {podIP: 10.60.1.3}
---
apiVersion: v1
kind: Pod
metadata: {name: remote, namespace: b, labels: {app: api}}
spec: {nodeName: n2, containers: [{name: c}]}
status: {podIP: 10.60.2.2}
---
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: b-guard, ANNOTATION}
spec:
  priority: 10
  subject: {namespaces: {matchLabels: {kubernetes.io/metadata.name: b}}}
  ingress:
  - name: no-9090-from-a
    action: Deny
    from: [{namespaces: {matchLabels: {kubernetes.io/metadata.name: a}}}]
    ports: [{portNumber: {protocol: TCP, port: 9090}}]
  - name: 8080-to-namespace-owners
    action: Pass
    from: [{namespaces: {matchLabels: {kubernetes.io/metadata.name: a}}}]
    ports: [{portNumber: {protocol: TCP, port: 8080}}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: allow-a, namespace: b}
spec:
  podSelector: {}
  ingress:
  - from: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: a}}}]
    ports: [{port: 8080}]
---
apiVersion: policy.networking.k8s.io/v1alpha1
kind: BaselineAdminNetworkPolicy
metadata: {name: default}
spec:
  subject: {namespaces: {matchLabels: {kubernetes.io/metadata.name: a}}}
  ingress:
  - name: not-from-b
    action: Deny
    from: [{namespaces: {matchLabels: {kubernetes.io/metadata.name: b}}}]
"#;

const CLIENT: &str = "10.60.1.2";
const SERVER: &str = "10.60.1.3";
const REMOTE: &str = "10.60.2.2";
const EXTERNAL: &str = "203.0.113.10";

fn snapshot_with(annotation: &str) -> Arc<Snapshot> {
    let text = CLUSTER.replace("ANNOTATION", annotation);
    let loaded = parse_str(Path::new("audit.yaml"), &text).expect("test YAML parses");
    assert!(loaded.problems.iter().all(|p| !p.is_error()), "{:?}", loaded.problems);
    let compiled = Snapshot::compile(&loaded.inputs, Revision(3));
    assert!(compiled.problems.iter().all(|p| !p.is_error()), "{:?}", compiled.problems);
    Arc::new(compiled.snapshot)
}

fn snapshot() -> Arc<Snapshot> {
    snapshot_with("annotations: {}")
}

/// Antrea-native policies added to [`CLUSTER`] (issue #22): the ClusterNetworkPolicy
/// `sec-audit` in Tier `securityops` on a/server's ingress — 7000 allowed with
/// `enableLogging` and a `logLabel`, 7001 allowed without, 7002 rejected, 7003 dropped by
/// an unnamed rule — and an Antrea NetworkPolicy `b/allow-a`, named as the upstream
/// NetworkPolicy beside it, rejecting 7004 to b's pods (Tier `application`, the default).
const ANTREA: &str = r#"
---
apiVersion: crd.antrea.io/v1beta1
kind: ClusterNetworkPolicy
metadata: {name: sec-audit}
spec:
  tier: securityops
  priority: 5
  appliedTo: [{podSelector: {matchLabels: {app: db}}}]
  ingress:
  - name: logged-allow
    action: Allow
    ports: [{protocol: TCP, port: 7000}]
    enableLogging: true
    logLabel: pci-7000
  - name: quiet-allow
    action: Allow
    ports: [{protocol: TCP, port: 7001}]
  - name: refuse-7002
    action: Reject
    ports: [{protocol: TCP, port: 7002}]
  - action: Drop
    ports: [{protocol: TCP, port: 7003}]
---
apiVersion: crd.antrea.io/v1beta1
kind: NetworkPolicy
metadata: {name: allow-a, namespace: b}
spec:
  priority: 1
  appliedTo: [{podSelector: {}}]
  ingress:
  - action: Reject
    ports: [{protocol: TCP, port: 7004}]
"#;

fn antrea_snapshot() -> Arc<Snapshot> {
    let text = format!("{}{ANTREA}", CLUSTER.replace("ANNOTATION", "annotations: {}"));
    let loaded = parse_str(Path::new("antrea.yaml"), &text).expect("test YAML parses");
    assert!(loaded.problems.iter().all(|p| !p.is_error()), "{:?}", loaded.problems);
    let compiled = Snapshot::compile(&loaded.inputs, Revision(3));
    assert!(compiled.problems.iter().all(|p| !p.is_error()), "{:?}", compiled.problems);
    Arc::new(compiled.snapshot)
}

fn sa(ip: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip.parse::<IpAddr>().unwrap(), port)
}

/// Decides `src:sport → dst:dport` (TCP) as the client's node n1 does and hands it to
/// `auditor` as an NFQUEUE reader would; returns whether it was audited.
fn decide(
    auditor: &Auditor,
    plan: &Selection,
    s: &Arc<Snapshot>,
    src: SocketAddr,
    dst: SocketAddr,
) -> (bool, Arc<tierproxy::policy::Decision>) {
    let flow = Flow { src: src.ip(), dst: dst.ip(), protocol: Protocol::Tcp, dst_port: dst.port() };
    let d = Arc::new(s.decide(&flow));
    let info = FlowInfo {
        key: FlowKey { src, dst, protocol: Protocol::Tcp },
        time: SystemTime::now(),
        point: Default::default(),
    };
    (auditor.decision(plan, s, info, &d), d)
}

/// A config with one sink, every decision logged, no aggregation and no rate limit.
fn config(sink: SinkConfig) -> AuditConfig {
    let mut c = AuditConfig::new("n1", vec![sink]);
    c.defaults = Defaults { allow_sample: 1, deny: true, pass: true, close: true };
    c.deny_window = Duration::ZERO;
    c.limits = Limits { per_rule: 0.0, node: 0.0 };
    c.context = tierproxy::audit::event::Context::new("n1", vec!["app".into(), "team".into()]);
    c.flush_timeout = Duration::from_secs(10);
    c
}

fn otlp(protocol: OtlpProtocol, endpoint: String) -> SinkConfig {
    SinkConfig::Otlp(OtlpConfig {
        protocol: Some(protocol),
        endpoint: Some(endpoint),
        // Compressed, with a header: the receiver must still read every record.
        gzip: Some(true),
        headers: vec![("x-tenant".into(), "audit-test".into())],
        batch_size: 64,
        batch_delay: Duration::from_millis(20),
        timeout: Some(Duration::from_secs(2)),
        ..OtlpConfig::from_env()
    })
}

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// A loopback port nothing listens on (bound, then released).
fn dead_port() -> SocketAddr {
    TcpListener::bind(loopback()).unwrap().local_addr().unwrap()
}

fn attrs_of(r: &Received) -> serde_json::Value {
    serde_json::Value::Object(r.attributes.clone().into_iter().collect())
}

fn find<'a>(recs: &'a [Received], event: &str, pred: impl Fn(&Received) -> bool) -> &'a Received {
    let found: Vec<&Received> = recs.iter().filter(|r| r.event_name == event && pred(r)).collect();
    assert_eq!(found.len(), 1, "one {event} expected, found {}: {recs:#?}", found.len());
    found[0]
}

/// One word per basis: an event's `tierproxy.basis` is the `reason` `explain -o json` (and
/// `/debug/explain`) gives the same direction, for each basis there is (issue #21: the two
/// once said `isolation` and `isolated`).
#[test]
fn the_audit_basis_is_explains_reason() {
    use tierproxy::policy::Direction;
    let s = snapshot();
    let ctx = event::Context::new("n1", Vec::new());
    let mut names = event::Names::default();
    names.refresh(&s, &ctx);
    let mut seen = BTreeSet::new();
    // Ingress of b/remote: the ANP's Deny (a rule); the NetworkPolicy isolates it on 7070.
    // Ingress of a/server: from its own node; egress of a/client: no policy (default).
    for (src, dst) in [
        (sa(CLIENT, 40000), sa(REMOTE, 9090)),
        (sa(CLIENT, 40001), sa(REMOTE, 7070)),
        (sa("172.31.0.2", 40002), sa(SERVER, 8080)),
        (sa(CLIENT, 40003), sa(SERVER, 8080)),
    ] {
        let flow =
            Flow { src: src.ip(), dst: dst.ip(), protocol: Protocol::Tcp, dst_port: dst.port() };
        let d = s.decide(&flow);
        let info = FlowInfo {
            key: FlowKey { src, dst, protocol: Protocol::Tcp },
            time: SystemTime::now(),
            point: Default::default(),
        };
        for (dir, o) in [(Direction::Egress, &d.egress), (Direction::Ingress, &d.ingress)] {
            let Some(o) = o else { continue };
            let e = event::decision(&ctx, &s, &mut names, &info, &d, dir);
            let reason = tierproxy::explain::outcome_json(&s, dir, Some(o))["reason"].clone();
            let basis = e.str(attr::BASIS).expect("a decision event has a basis");
            assert_eq!(reason, json!(basis), "{src} -> {dst} {dir:?}");
            seen.insert(basis.to_string());
        }
    }
    let seen: Vec<&str> = seen.iter().map(String::as_str).collect();
    assert_eq!(seen, ["default", "isolation", "own-node", "rule"]);
}

#[test]
fn allow_deny_pass_and_close_arrive_over_otlp_http_and_grpc_with_their_exact_attributes() {
    for protocol in [OtlpProtocol::HttpProtobuf, OtlpProtocol::Grpc] {
        let receiver = Receiver::start(protocol, loopback()).unwrap();
        let s = snapshot();
        let (plan, problems) = Selection::new(&s, config(otlp(protocol, String::new())).defaults);
        assert!(problems.is_empty());
        let auditor = Auditor::start(config(otlp(protocol, receiver.endpoint()))).unwrap();
        // Pass then NetworkPolicy allow (ingress of b/remote); egress of a/client: no policy.
        let (audited, allowed) = decide(&auditor, &plan, &s, sa(CLIENT, 40001), sa(REMOTE, 8080));
        assert!(audited);
        // ANP deny.
        decide(&auditor, &plan, &s, sa(CLIENT, 40002), sa(REMOTE, 9090));
        // BANP deny (ingress of a/server from b).
        decide(&auditor, &plan, &s, sa(REMOTE, 40003), sa(SERVER, 8080));
        let end = ConnectionEnd {
            reason: CloseReason::Normal,
            to_server: 120,
            to_client: 4096,
            duration: Duration::from_millis(1500),
        };
        let admitted = tierproxy::audit::Admitted {
            flow: FlowInfo {
                key: FlowKey {
                    src: sa(CLIENT, 40001),
                    dst: sa(REMOTE, 8080),
                    protocol: Protocol::Tcp,
                },
                time: SystemTime::now(),
                point: Default::default(),
            },
            decision: allowed,
        };
        auditor.connection_end(&s, &admitted, end);
        auditor.shutdown();
        let recs = receiver.wait_for(Duration::from_secs(10), |r| r.len() >= 7);
        assert_eq!(recs.len(), 7, "{protocol:?}: {recs:#?}");

        for r in &recs {
            assert_eq!(r.scope, "tierproxy.audit");
            assert_eq!(r.resource.get("service.name"), Some(&json!("tierproxy")));
            assert_eq!(r.resource.get("k8s.node.name"), Some(&json!("n1")));
            assert!(r.resource.contains_key("service.version"));
            assert!(r.time_unix_nano > 0);
            assert!(!r.body.is_empty());
        }
        let pass = find(&recs, event::DECISION, |r| {
            r.int(attr::SRC_PORT) == Some(40001) && r.str(attr::DIRECTION) == Some("ingress")
        });
        assert_eq!(
            attrs_of(pass),
            json!({
                "network.transport": "tcp", "network.type": "ipv4",
                "source.address": CLIENT, "source.port": 40001,
                "destination.address": REMOTE, "destination.port": 8080,
                "k8s.node.name": "n1",
                "tierproxy.direction": "ingress", "tierproxy.verdict": "allow",
                "tierproxy.flow.verdict": "allow", "tierproxy.basis": "rule",
                "tierproxy.decision.point": "first-packet",
                "tierproxy.tier": "networkpolicy",
                "tierproxy.policy.kind": "NetworkPolicy",
                "tierproxy.policy.api_version": "networking.k8s.io/v1",
                "tierproxy.policy.namespace": "b",
                "tierproxy.policy.name": "allow-a", "security_rule.ruleset.name": "b/allow-a",
                "security_rule.name": "ingress[0]", "tierproxy.rule.index": 0,
                "tierproxy.rule.action": "Allow",
                "tierproxy.pass_chain": ["AdminNetworkPolicy b-guard: 8080-to-namespace-owners"],
                "tierproxy.revision": 3,
                "tierproxy.source.kind": "pod", "tierproxy.source.k8s.namespace.name": "a",
                "tierproxy.source.k8s.pod.name": "client",
                "tierproxy.source.k8s.pod.label.app": "shop",
                "tierproxy.source.k8s.pod.label.team": "red",
                "tierproxy.destination.kind": "pod",
                "tierproxy.destination.k8s.namespace.name": "b",
                "tierproxy.destination.k8s.pod.name": "remote",
                "tierproxy.destination.k8s.pod.label.app": "api",
            }),
            "{protocol:?}"
        );
        assert_eq!(pass.severity, "INFO");
        let egress = find(&recs, event::DECISION, |r| {
            r.int(attr::SRC_PORT) == Some(40001) && r.str(attr::DIRECTION) == Some("egress")
        });
        assert_eq!(egress.str(attr::BASIS), Some("default"));
        assert_eq!(egress.str(attr::RULESET), None);

        let deny = find(&recs, event::DECISION, |r| {
            r.int(attr::SRC_PORT) == Some(40002) && r.str(attr::DIRECTION) == Some("ingress")
        });
        assert_eq!(deny.severity, "WARN");
        for (k, v) in [
            (attr::VERDICT, json!("deny")),
            (attr::FLOW_VERDICT, json!("deny")),
            (attr::TIER, json!("admin")),
            (attr::POLICY_KIND, json!("AdminNetworkPolicy")),
            (attr::POLICY_API_VERSION, json!("policy.networking.k8s.io/v1alpha1")),
            (attr::RULESET, json!("b-guard")),
            (attr::RULE_NAME, json!("no-9090-from-a")),
            (attr::RULE_ACTION, json!("Deny")),
            (attr::RULE_INDEX, json!(0)),
            (attr::COUNT, json!(1)),
        ] {
            assert_eq!(deny.attributes.get(k), Some(&v), "{k} in {deny:#?}");
        }
        assert!(!deny.attributes.contains_key(attr::POLICY_NAMESPACE));
        assert!(!deny.attributes.contains_key(attr::PASS_CHAIN));

        let baseline = find(&recs, event::DECISION, |r| {
            r.int(attr::SRC_PORT) == Some(40003) && r.str(attr::DIRECTION) == Some("ingress")
        });
        assert_eq!(baseline.str(attr::TIER), Some("baseline"));
        assert_eq!(baseline.str(attr::RULE_NAME), Some("not-from-b"));
        assert_eq!(baseline.str("tierproxy.destination.k8s.pod.name"), Some("server"));

        let end = find(&recs, event::CONNECTION_END, |_| true);
        for (k, v) in [
            (attr::CLOSE_REASON, json!("normal")),
            (attr::BYTES_TO_SERVER, json!(120)),
            (attr::BYTES_TO_CLIENT, json!(4096)),
            (attr::DURATION_MS, json!(1500)),
            (attr::SRC_PORT, json!(40001)),
            (attr::FLOW_VERDICT, json!("allow")),
            (attr::REVISION, json!(3)),
        ] {
            assert_eq!(end.attributes.get(k), Some(&v), "{k} in {end:#?}");
        }
        let st = auditor.stats();
        assert_eq!(st.emitted.load(Ordering::Relaxed), 7);
        assert_eq!(st.sinks[0].exported.load(Ordering::Relaxed), 7);
    }
}

/// Issue #22: an Antrea rule's `enableLogging: true` audits its decisions even where the
/// node would not (allow sampling 0), with its `logLabel`; a rule without it keeps the
/// node's defaults; a Reject is its own verdict and action, and a Drop says `Drop`; events
/// name the Antrea Tier and the policy's apiVersion, so the Antrea NetworkPolicy `b/allow-a`
/// is never taken for the upstream one of the same name.
#[test]
fn antrea_decisions_arrive_over_otlp_with_tier_api_version_action_and_log_label() {
    for protocol in [OtlpProtocol::HttpProtobuf, OtlpProtocol::Grpc] {
        let receiver = Receiver::start(protocol, loopback()).unwrap();
        let s = antrea_snapshot();
        let mut c = config(otlp(protocol, receiver.endpoint()));
        c.defaults.allow_sample = 0;
        let (plan, problems) = Selection::new(&s, c.defaults);
        assert!(problems.is_empty());
        let auditor = Auditor::start(c).unwrap();
        let audited =
            |port, dst, dport| decide(&auditor, &plan, &s, sa(CLIENT, port), sa(dst, dport)).0;
        assert!(audited(40100, SERVER, 7000), "enableLogging audits an allow");
        assert!(!audited(40101, SERVER, 7001), "without it, allows follow sampling 0");
        assert!(audited(40102, SERVER, 7002));
        assert!(audited(40103, SERVER, 7003));
        assert!(audited(40104, REMOTE, 7004));
        auditor.shutdown();
        // One record each (the ingress): the client's egress is a default allow, unsampled.
        let recs = receiver.wait_for(Duration::from_secs(10), |r| r.len() >= 4);
        assert_eq!(recs.len(), 4, "{protocol:?}: {recs:#?}");
        assert!(recs.iter().all(|r| r.str(attr::DIRECTION) == Some("ingress")), "{recs:#?}");

        let logged = find(&recs, event::DECISION, |r| r.int(attr::SRC_PORT) == Some(40100));
        assert_eq!(
            attrs_of(logged),
            json!({
                "network.transport": "tcp", "network.type": "ipv4",
                "source.address": CLIENT, "source.port": 40100,
                "destination.address": SERVER, "destination.port": 7000,
                "k8s.node.name": "n1",
                "tierproxy.direction": "ingress", "tierproxy.verdict": "allow",
                "tierproxy.flow.verdict": "allow", "tierproxy.basis": "rule",
                "tierproxy.decision.point": "first-packet",
                "tierproxy.policy.kind": "ClusterNetworkPolicy",
                "tierproxy.policy.api_version": "crd.antrea.io/v1beta1",
                "tierproxy.policy.name": "sec-audit", "security_rule.ruleset.name": "sec-audit",
                "tierproxy.tier": "securityops",
                "security_rule.name": "logged-allow", "tierproxy.rule.index": 0,
                "tierproxy.rule.action": "Allow", "tierproxy.rule.log_label": "pci-7000",
                "tierproxy.revision": 3,
                "tierproxy.source.kind": "pod", "tierproxy.source.k8s.namespace.name": "a",
                "tierproxy.source.k8s.pod.name": "client",
                "tierproxy.source.k8s.pod.label.app": "shop",
                "tierproxy.source.k8s.pod.label.team": "red",
                "tierproxy.destination.kind": "pod",
                "tierproxy.destination.k8s.namespace.name": "a",
                "tierproxy.destination.k8s.pod.name": "server",
                "tierproxy.destination.k8s.pod.label.app": "db",
            }),
            "{protocol:?}"
        );
        assert_eq!(logged.severity, "INFO");

        let reject = find(&recs, event::DECISION, |r| r.int(attr::SRC_PORT) == Some(40102));
        assert_eq!(reject.severity, "WARN");
        assert!(reject.body.starts_with("reject tcp "), "{}", reject.body);
        for (k, v) in [
            (attr::VERDICT, json!("reject")),
            (attr::FLOW_VERDICT, json!("reject")),
            (attr::TIER, json!("securityops")),
            (attr::POLICY_KIND, json!("ClusterNetworkPolicy")),
            (attr::POLICY_API_VERSION, json!("crd.antrea.io/v1beta1")),
            (attr::RULESET, json!("sec-audit")),
            (attr::RULE_NAME, json!("refuse-7002")),
            (attr::RULE_INDEX, json!(2)),
            (attr::RULE_ACTION, json!("Reject")),
            (attr::COUNT, json!(1)),
        ] {
            assert_eq!(reject.attributes.get(k), Some(&v), "{k} in {reject:#?}");
        }
        assert!(!reject.attributes.contains_key(attr::LOG_LABEL));

        let drop = find(&recs, event::DECISION, |r| r.int(attr::SRC_PORT) == Some(40103));
        for (k, v) in [
            (attr::VERDICT, json!("deny")),
            (attr::RULE_NAME, json!("ingress[3]")),
            (attr::RULE_ACTION, json!("Drop")),
        ] {
            assert_eq!(drop.attributes.get(k), Some(&v), "{k} in {drop:#?}");
        }

        let annp = find(&recs, event::DECISION, |r| r.int(attr::SRC_PORT) == Some(40104));
        for (k, v) in [
            (attr::VERDICT, json!("reject")),
            (attr::TIER, json!("application")),
            (attr::POLICY_KIND, json!("NetworkPolicy")),
            (attr::POLICY_API_VERSION, json!("crd.antrea.io/v1beta1")),
            (attr::POLICY_NAMESPACE, json!("b")),
            (attr::RULESET, json!("b/allow-a")),
            (attr::RULE_NAME, json!("ingress[0]")),
            (attr::RULE_ACTION, json!("Reject")),
        ] {
            assert_eq!(annp.attributes.get(k), Some(&v), "{k} in {annp:#?}");
        }
        assert!(
            annp.body.ends_with(": NetworkPolicy.crd.antrea.io b/allow-a rule ingress[0]"),
            "{}",
            annp.body
        );
        assert_eq!(auditor.stats().sinks[0].exported.load(Ordering::Relaxed), 4);
    }
}

/// `enableLogging` is the rule's own request: node defaults that log nothing and the
/// policy's `tierproxy.io/audit: "off"` leave it logged, and leave every other rule as it
/// was (issue #22).
#[test]
fn enable_logging_audits_its_rule_whatever_the_node_defaults_and_the_annotation() {
    let nothing = Defaults { allow_sample: 0, deny: false, pass: false, close: true };
    let flow = |port| {
        let (src, dst) = (CLIENT.parse().unwrap(), SERVER.parse().unwrap());
        Flow { src, dst, protocol: Protocol::Tcp, dst_port: port }
    };
    let s = antrea_snapshot();
    let (plan, _) = Selection::new(&s, nothing);
    // `select` answers [ingress, egress].
    assert_eq!(plan.select(&s, &s.decide(&flow(7000))), [true, false]);
    for port in [7001, 7002, 7003] {
        assert_eq!(plan.select(&s, &s.decide(&flow(port))), [false, false], "{port}");
    }
    // The node's defaults log denies and rejects: the rules without enableLogging are
    // logged as before.
    let (plan, _) = Selection::new(&s, Defaults { deny: true, ..nothing });
    for port in [7000, 7002, 7003] {
        assert_eq!(plan.select(&s, &s.decide(&flow(port))), [true, false], "{port}");
    }
    assert_eq!(plan.select(&s, &s.decide(&flow(7001))), [false, false]);
    // An annotation's `off` does not silence it.
    let text = format!("{}{ANTREA}", CLUSTER.replace("ANNOTATION", "annotations: {}")).replace(
        "metadata: {name: sec-audit}",
        r#"metadata: {name: sec-audit, annotations: {tierproxy.io/audit: "off, rule:logged-allow=off"}}"#,
    );
    let loaded = parse_str(Path::new("antrea.yaml"), &text).unwrap();
    let off = Snapshot::compile(&loaded.inputs, Revision(4)).snapshot;
    let (plan, problems) = Selection::new(&off, Defaults { deny: true, ..nothing });
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(plan.select(&off, &off.decide(&flow(7000))), [true, false]);
    assert_eq!(plan.select(&off, &off.decide(&flow(7002))), [false, false]);
}

#[test]
fn the_policy_annotation_switches_logging_per_action_and_per_rule() {
    let s = snapshot_with(r#"annotations: {tierproxy.io/audit: "off, rule:no-9090-from-a=on"}"#);
    let defaults = Defaults { allow_sample: 0, deny: true, pass: true, close: true };
    let (plan, problems) = Selection::new(&s, defaults);
    assert!(problems.is_empty(), "{problems:?}");
    let d = |port| {
        let (src, dst) = (CLIENT.parse().unwrap(), REMOTE.parse().unwrap());
        s.decide(&Flow { src, dst, protocol: Protocol::Tcp, dst_port: port })
    };
    // `select` answers [ingress, egress]. Deny by the switched-on rule: logged (ingress);
    // the client's egress is an allow with allow sampling off: not logged.
    assert_eq!(plan.select(&s, &d(9090)), [true, false]);
    // The Pass rule is switched off by the bare `off`, the NetworkPolicy allow is not
    // sampled: nothing.
    assert_eq!(plan.select(&s, &d(8080)), [false, false]);
    // A policy without the annotation: the node's defaults (deny on).
    let flow = Flow {
        src: REMOTE.parse().unwrap(),
        dst: SERVER.parse().unwrap(),
        protocol: Protocol::Tcp,
        dst_port: 8080,
    };
    assert_eq!(plan.select(&s, &s.decide(&flow)), [true, false]);

    // Without the annotation the Pass is logged by the node default.
    let plain = snapshot();
    let (plan, _) = Selection::new(&plain, defaults);
    let flow = Flow {
        src: CLIENT.parse().unwrap(),
        dst: REMOTE.parse().unwrap(),
        protocol: Protocol::Tcp,
        dst_port: 8080,
    };
    assert_eq!(plan.select(&plain, &plain.decide(&flow)), [true, false]);

    // An annotation that does not parse is reported by object and field, and that policy
    // is audited in full (the Pass above is logged again).
    let bad = snapshot_with(r#"annotations: {tierproxy.io/audit: "loud"}"#);
    let (plan, problems) = Selection::new(&bad, defaults);
    assert_eq!(problems.len(), 1);
    let msg = problems[0].to_string();
    assert!(
        msg.starts_with(
            "AdminNetworkPolicy b-guard: metadata.annotations[tierproxy.io/audit]: \"loud\""
        ),
        "{msg}"
    );
    assert_eq!(plan.select(&bad, &bad.decide(&flow)), [true, false]);
}

/// a/client to a/server, TCP 8080: allowed, and both its directions decided on n1.
fn client_to_server_8080() -> Flow {
    Flow {
        src: CLIENT.parse().unwrap(),
        dst: SERVER.parse().unwrap(),
        protocol: Protocol::Tcp,
        dst_port: 8080,
    }
}

#[test]
fn allow_sampling_is_one_flow_in_n_and_keeps_both_directions_of_a_flow_together() {
    let s = snapshot();
    let (plan, _) =
        Selection::new(&s, Defaults { allow_sample: 4, deny: false, pass: false, close: true });
    let flow = client_to_server_8080();
    let d = s.decide(&flow);
    assert!(d.egress.is_some() && d.ingress.is_some());
    let picks: Vec<[bool; 2]> = (0..12).map(|_| plan.select(&s, &d)).collect();
    assert_eq!(picks.iter().filter(|p| **p == [true, true]).count(), 3, "{picks:?}");
    assert!(picks.iter().all(|p| p[0] == p[1]), "{picks:?}");
}

/// Issue #20: a flow the kernel sampled (a cached UDP class's flow whose new event the
/// ruleset let through) is logged where its hits ask for sampling, without this plan's
/// counter, which it leaves alone; `always` tells the hits that log every flow (an
/// annotation, `enableLogging`) from those that sample, so that their classes stay out of
/// the kernel-side cache.
#[test]
fn a_flow_the_kernel_sampled_is_logged_and_always_names_the_hits_that_log_every_flow() {
    let s = snapshot();
    let sampled = Defaults { allow_sample: 4, deny: false, pass: false, close: true };
    let (plan, _) = Selection::new(&s, sampled);
    let flow = client_to_server_8080();
    let d = s.decide(&flow);
    assert!(d.egress.is_some() && d.ingress.is_some());
    for _ in 0..5 {
        assert_eq!(plan.select_as(&s, &d, Sampling::Taken), [true, true]);
    }
    // The counter was not moved: the next four counted flows are sampled as the first
    // four would have been (the first of them).
    let picks: Vec<[bool; 2]> = (0..4).map(|_| plan.select(&s, &d)).collect();
    assert_eq!(picks, [[true, true], [false, false], [false, false], [false, false]]);
    assert!(!plan.always(&s, &d), "sampled allows");
    // Allows in full by the node's default, or never: `always` follows.
    let (all, _) = Selection::new(&s, Defaults { allow_sample: 1, ..sampled });
    assert!(all.always(&s, &d));
    let (none, _) = Selection::new(&s, Defaults { allow_sample: 0, ..sampled });
    assert!(!none.always(&s, &d));
    assert_eq!(none.select_as(&s, &d, Sampling::Taken), [false, false]);
    // A policy's annotation that logs its allows: always, whatever the sampling.
    let on = snapshot_with(r#"annotations: {tierproxy.io/audit: "on"}"#);
    let (plan, problems) = Selection::new(&on, Defaults { allow_sample: 0, ..sampled });
    assert!(problems.is_empty(), "{problems:?}");
    let to_remote = Flow { dst: REMOTE.parse().unwrap(), ..flow };
    let d = on.decide(&to_remote);
    assert!(plan.always(&on, &d), "{d:?}");
}

/// A JSON Lines sink into `path`, never rotated.
fn json_file(path: &Path) -> SinkConfig {
    SinkConfig::Json(JsonTarget::File { path: path.to_path_buf(), max_bytes: 1 << 30, keep: 1 })
}

fn json_lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// An auditor writing JSON Lines to `path` with a 30 s deny window (every deny of the
/// tests below folds into its first), the small cluster's snapshot and its selection.
fn aggregating_to_json(path: &Path) -> (Auditor, Arc<Snapshot>, Arc<Selection>) {
    let mut c = config(json_file(path));
    c.deny_window = Duration::from_secs(30);
    let s = snapshot();
    let (plan, _) = Selection::new(&s, c.defaults);
    (Auditor::start(c).unwrap(), s, plan)
}

#[test]
fn identical_denies_in_a_window_become_one_event_with_their_count() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    let (auditor, s, plan) = aggregating_to_json(&path);
    // 20 connection attempts of one client to one denied port (new source port each), and
    // 3 to another port.
    for port in 0..20 {
        decide(&auditor, &plan, &s, sa(CLIENT, 41000 + port), sa(REMOTE, 9090));
    }
    for port in 0..3 {
        decide(&auditor, &plan, &s, sa(CLIENT, 42000 + port), sa(EXTERNAL, 25));
    }
    // Shutdown closes the open windows.
    auditor.shutdown();
    let lines = json_lines(&path);
    let denies: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|l| l["event"] == event::DECISION && l["attributes"][attr::VERDICT] == "deny")
        .collect();
    assert_eq!(denies.len(), 1, "{lines:#?}");
    assert_eq!(denies[0]["attributes"][attr::COUNT], 20);
    assert_eq!(denies[0]["attributes"][attr::SRC_PORT], 41000, "the first one's port");
    assert!(denies[0]["attributes"][attr::LAST_SEEN].is_string());
    // The external flows are allowed (no egress policy for a/client): three events, one
    // per connection, never folded.
    let external = lines.iter().filter(|l| l["attributes"][attr::DST_ADDR] == EXTERNAL).count();
    assert_eq!(external, 3);
    assert_eq!(auditor.stats().aggregated.load(Ordering::Relaxed), 19);
}

/// A stream of records (a flood of denies from a hostile pod, each a record) wakes the
/// worker once per batch, not once per record: woken per record, a deny flood cost the
/// agent a thread wake-up per denied packet on top of its decision.
#[test]
fn a_stream_of_records_wakes_the_worker_once_per_batch() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    let (auditor, s, plan) = aggregating_to_json(&path);
    const RECORDS: u16 = 2000;
    for port in 0..RECORDS {
        decide(&auditor, &plan, &s, sa(CLIENT, 20000 + port), sa(REMOTE, 9090));
    }
    auditor.shutdown();
    let stats = auditor.stats();
    assert_eq!(stats.submitted.load(Ordering::Relaxed), u64::from(RECORDS));
    assert_eq!(stats.aggregated.load(Ordering::Relaxed), u64::from(RECORDS) - 1);
    let wakeups = stats.wakeups.load(Ordering::Relaxed);
    assert!(
        wakeups * 4 <= u64::from(RECORDS),
        "{wakeups} wake-ups of the worker for {RECORDS} records: fewer than 4 a wake-up"
    );
}

/// A client retrying against an Antrea Reject is folded as one retrying against a deny.
#[test]
fn identical_rejects_in_a_window_become_one_event_with_their_count() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    let mut c = config(json_file(&path));
    c.deny_window = Duration::from_secs(30);
    c.defaults.allow_sample = 0;
    let s = antrea_snapshot();
    let (plan, _) = Selection::new(&s, c.defaults);
    let auditor = Auditor::start(c).unwrap();
    for port in 0..12 {
        decide(&auditor, &plan, &s, sa(CLIENT, 45000 + port), sa(SERVER, 7002));
    }
    auditor.shutdown();
    let lines = json_lines(&path);
    assert_eq!(lines.len(), 1, "{lines:#?}");
    assert_eq!(lines[0]["attributes"][attr::VERDICT], "reject");
    assert_eq!(lines[0]["attributes"][attr::COUNT], 12);
    assert_eq!(lines[0]["attributes"][attr::SRC_PORT], 45000, "the first one's port");
    assert_eq!(auditor.stats().aggregated.load(Ordering::Relaxed), 11);
}

#[test]
fn rate_limits_suppress_per_rule_and_report_every_suppressed_event() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    let mut c = config(json_file(&path));
    // One event per 100 s per rule, burst 1: the refill during the test is nil, however
    // slow the machine.
    c.limits = Limits { per_rule: 0.01, node: 0.0 };
    c.defaults.allow_sample = 0;
    let s = snapshot();
    let (plan, _) = Selection::new(&s, c.defaults);
    let auditor = Auditor::start(c).unwrap();
    // 50 denies by one rule; aggregation is off (window 0), so each is an event.
    for i in 0..50u16 {
        decide(&auditor, &plan, &s, sa(CLIENT, 43000 + i), sa(REMOTE, 9090));
    }
    auditor.shutdown();
    let lines = json_lines(&path);
    let emitted = lines.iter().filter(|l| l["event"] == event::DECISION).count() as i64;
    let suppressed: i64 = lines
        .iter()
        .filter(|l| l["event"] == event::SUPPRESSED)
        .map(|l| {
            assert_eq!(l["attributes"][attr::SUPPRESSED_BY], "rule");
            assert_eq!(l["attributes"][attr::RULESET], "b-guard");
            l["attributes"][attr::SUPPRESSED_COUNT].as_i64().unwrap()
        })
        .sum();
    // Aggregation is off (window 0): each deny is its own event until the limit.
    assert_eq!(emitted, 1, "the burst");
    assert_eq!(emitted + suppressed, 50, "{lines:#?}");
}

/// The Antrea NetworkPolicy `b/allow-a` and the upstream one have the same namespace, name
/// and rule name (`ingress[0]`): each keeps its own per-rule bucket, and each summary names
/// its policy's kind and apiVersion.
#[test]
fn rate_limits_keep_an_antrea_policy_apart_from_the_upstream_one_of_the_same_name() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    let mut c = config(json_file(&path));
    c.limits = Limits { per_rule: 0.01, node: 0.0 };
    // Only the ingress records: the Pass to the NetworkPolicy (8080) and the Reject (7004).
    c.defaults.allow_sample = 0;
    let s = antrea_snapshot();
    let (plan, _) = Selection::new(&s, c.defaults);
    let auditor = Auditor::start(c).unwrap();
    for i in 0..3u16 {
        decide(&auditor, &plan, &s, sa(CLIENT, 46000 + i), sa(REMOTE, 8080));
        decide(&auditor, &plan, &s, sa(CLIENT, 46100 + i), sa(REMOTE, 7004));
    }
    auditor.shutdown();
    let lines = json_lines(&path);
    let decisions: Vec<&serde_json::Value> =
        lines.iter().filter(|l| l["event"] == event::DECISION).collect();
    let versions: BTreeSet<&str> = decisions
        .iter()
        .map(|l| l["attributes"][attr::POLICY_API_VERSION].as_str().unwrap())
        .collect();
    assert_eq!(versions, BTreeSet::from(["crd.antrea.io/v1beta1", "networking.k8s.io/v1"]));
    assert_eq!(decisions.len(), 2, "the burst of each policy's rule: {lines:#?}");
    let mut summaries = BTreeSet::new();
    for l in lines.iter().filter(|l| l["event"] == event::SUPPRESSED) {
        let a = &l["attributes"];
        assert_eq!(a[attr::RULESET], "b/allow-a");
        assert_eq!(a[attr::POLICY_KIND], "NetworkPolicy");
        summaries.insert((
            a[attr::POLICY_API_VERSION].as_str().unwrap().to_string(),
            a[attr::SUPPRESSED_COUNT].as_i64().unwrap(),
        ));
    }
    let expected = [("crd.antrea.io/v1beta1", 2), ("networking.k8s.io/v1", 2)];
    assert_eq!(summaries, expected.map(|(v, n)| (v.to_string(), n)).into(), "{lines:#?}");
}

#[test]
fn the_json_file_rotates_by_size_without_splitting_or_losing_a_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    let c = config(SinkConfig::Json(JsonTarget::File {
        path: path.clone(),
        max_bytes: 8 * 1024,
        keep: 100,
    }));
    let s = snapshot();
    let (plan, _) = Selection::new(&s, c.defaults);
    let auditor = Auditor::start(c).unwrap();
    for i in 0..200u16 {
        decide(&auditor, &plan, &s, sa(CLIENT, 30000 + i), sa(EXTERNAL, 443));
    }
    auditor.shutdown();
    let mut ports = BTreeSet::new();
    let mut files = 0;
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let p = entry.unwrap().path();
        files += 1;
        let len = std::fs::metadata(&p).unwrap().len();
        assert!(len <= 8 * 1024 + 3 * 1024, "{}: {len} bytes", p.display());
        for l in json_lines(&p) {
            assert!(ports.insert(l["attributes"][attr::SRC_PORT].as_i64().unwrap()), "{l}");
        }
    }
    assert!(files > 3, "rotated into {files} files");
    assert_eq!(ports.len(), 200);
}

/// Submits `n` allowed external flows (one event each) with source ports from `first`.
fn submit(auditor: &Auditor, s: &Arc<Snapshot>, plan: &Selection, first: u16, n: u16) {
    for i in 0..n {
        decide(auditor, plan, s, sa(CLIENT, first + i), sa(EXTERNAL, 443));
    }
}

/// Runs `f` on a thread; `Some` if it finished within `limit` (a liveness bound, far above
/// what it needs: a stall never finishes).
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit).ok()
}

/// Joins `t`, failing the test if it has not finished within `limit` (a stall).
fn join_within(t: std::thread::JoinHandle<()>, limit: Duration) {
    let until = std::time::Instant::now() + limit;
    while !t.is_finished() && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(t.is_finished(), "still waiting after {limit:?}: events are not being delivered");
    t.join().unwrap();
}

fn ports_received(r: &Receiver) -> BTreeSet<i64> {
    r.records().iter().filter_map(|x| x.int(attr::SRC_PORT)).collect()
}

#[test]
fn lossy_never_waits_and_counts_drops_when_the_receiver_is_absent_or_slow() {
    for slow in [false, true] {
        let receiver = Receiver::start(OtlpProtocol::HttpProtobuf, loopback()).unwrap();
        let endpoint = if slow {
            receiver.set_delay(Duration::from_millis(300));
            receiver.endpoint()
        } else {
            format!("http://{}", dead_port())
        };
        let mut c = config(otlp(OtlpProtocol::HttpProtobuf, endpoint));
        c.queue_capacity = 64;
        c.flush_timeout = Duration::from_millis(500);
        let s = snapshot();
        let (plan, _) = Selection::new(&s, c.defaults);
        let auditor = Arc::new(Auditor::start(c).unwrap());
        let a = auditor.clone();
        let done = within(Duration::from_secs(60), move || submit(&a, &s, &plan, 1000, 20_000));
        assert!(done.is_some(), "slow={slow}: the data path waited on audit");
        auditor.shutdown();
        let st = auditor.stats();
        let dropped = st.dropped_queue.load(Ordering::Relaxed)
            + st.sinks[0].dropped_queue.load(Ordering::Relaxed)
            + st.sinks[0].failed.load(Ordering::Relaxed);
        assert!(dropped > 0, "slow={slow}: drops are counted");
        let exported = st.sinks[0].exported.load(Ordering::Relaxed);
        assert!(dropped + exported <= 20_000);
        if slow {
            assert!(exported > 0, "a slow receiver still gets events");
            // An export abandoned at the flush deadline counts as failed, but the receiver
            // may still store it after it was given up on (at least once). The sink counts
            // it as its attempt ends at the deadline (a loaded machine may run it late).
            let received = || ports_received(&receiver).len() as u64;
            let failed = || st.sinks[0].failed.load(Ordering::Relaxed);
            let exported = || st.sinks[0].exported.load(Ordering::Relaxed);
            assert!(
                wait_until(Duration::from_secs(10), || {
                    (exported()..=exported() + failed()).contains(&received())
                }),
                "received {}, exported {}, failed {}",
                received(),
                exported(),
                failed()
            );
        } else {
            assert_eq!(exported, 0);
        }
    }
}

#[test]
fn lossless_waits_and_delivers_every_event_when_the_receiver_comes_back_or_restarts() {
    let addr = dead_port();
    let mut c = config(otlp(OtlpProtocol::Grpc, format!("http://{addr}")));
    c.mode = Mode::Lossless;
    c.queue_capacity = 16;
    let s = snapshot();
    let (plan, _) = Selection::new(&s, c.defaults);
    let auditor = Arc::new(Auditor::start(c).unwrap());
    // No receiver: the submitter fills the queues and then waits.
    let (a, s2, p2) = (auditor.clone(), s.clone(), plan.clone());
    let submitter = std::thread::spawn(move || submit(&a, &s2, &p2, 1000, 300));
    std::thread::sleep(Duration::from_secs(2));
    assert!(!submitter.is_finished(), "lossless: new flows wait while audit cannot deliver");
    // The receiver comes up on the endpoint: everything is delivered.
    let mut receiver = Receiver::start(OtlpProtocol::Grpc, addr).unwrap();
    receiver.wait_for(Duration::from_secs(60), |r| r.len() >= 300);
    join_within(submitter, Duration::from_secs(60));
    assert_eq!(ports_received(&receiver), (1000..1300).collect());

    // Killed mid-stream: stop it while events flow, restart it, nothing is lost.
    let (a, s2, p2) = (auditor.clone(), s.clone(), plan.clone());
    let submitter = std::thread::spawn(move || submit(&a, &s2, &p2, 2000, 300));
    receiver.wait_for(Duration::from_secs(30), |r| {
        r.iter().any(|x| x.int(attr::SRC_PORT).is_some_and(|p| p >= 2000))
    });
    receiver.stop();
    let before = ports_received(&receiver);
    std::thread::sleep(Duration::from_millis(500));
    let receiver = Receiver::start(OtlpProtocol::Grpc, addr).unwrap();
    join_within(submitter, Duration::from_secs(60));
    auditor.shutdown();
    // Delivered at least once: a batch cut mid-request may be delivered twice.
    let mut all = before;
    all.extend(ports_received(&receiver));
    let missing: Vec<i64> = (2000..2300).filter(|p| !all.contains(p)).collect();
    assert!(missing.is_empty(), "lost: {missing:?}");
    let st = auditor.stats();
    assert_eq!(st.dropped_queue.load(Ordering::Relaxed), 0);
    assert_eq!(st.sinks[0].dropped_queue.load(Ordering::Relaxed), 0);
    assert_eq!(st.sinks[0].failed.load(Ordering::Relaxed), 0);
    assert!(st.sinks[0].retries.load(Ordering::Relaxed) > 0);
    assert!(st.sinks[0].exported.load(Ordering::Relaxed) >= 600);
}

#[test]
fn lossy_survives_a_receiver_killed_mid_stream_and_lossless_waits_out_a_slow_one() {
    // Lossy, killed mid-stream: the data path never waits; what could not be delivered is
    // counted.
    let mut receiver = Receiver::start(OtlpProtocol::HttpProtobuf, loopback()).unwrap();
    let mut c = config(otlp(OtlpProtocol::HttpProtobuf, receiver.endpoint()));
    c.queue_capacity = 64;
    c.flush_timeout = Duration::from_millis(500);
    let s = snapshot();
    let (plan, _) = Selection::new(&s, c.defaults);
    let auditor = Arc::new(Auditor::start(c).unwrap());
    submit(&auditor, &s, &plan, 1000, 200);
    receiver.wait_for(Duration::from_secs(10), |r| !r.is_empty());
    receiver.stop();
    let got_before = receiver.count();
    let (a, s2, p2) = (auditor.clone(), s.clone(), plan.clone());
    let done = within(Duration::from_secs(60), move || submit(&a, &s2, &p2, 2000, 20_000));
    assert!(done.is_some(), "the data path waited on a dead collector");
    auditor.shutdown();
    let st = auditor.stats();
    let lost = st.dropped_queue.load(Ordering::Relaxed)
        + st.sinks[0].dropped_queue.load(Ordering::Relaxed)
        + st.sinks[0].failed.load(Ordering::Relaxed);
    assert!(got_before > 0);
    assert!(lost > 0, "drops after the kill are counted");

    // Lossless, slow: every event arrives, in batches answered 200 ms apart.
    let receiver = Receiver::start(OtlpProtocol::Grpc, loopback()).unwrap();
    receiver.set_delay(Duration::from_millis(200));
    let mut c = config(otlp(OtlpProtocol::Grpc, receiver.endpoint()));
    c.mode = Mode::Lossless;
    c.queue_capacity = 16;
    let auditor = Arc::new(Auditor::start(c).unwrap());
    let (a, s2, p2) = (auditor.clone(), s.clone(), plan.clone());
    let done = within(Duration::from_secs(60), move || submit(&a, &s2, &p2, 3000, 400));
    assert!(done.is_some(), "lossless against a slow receiver did not finish");
    auditor.shutdown();
    assert_eq!(ports_received(&receiver), (3000..3400).collect());
    assert_eq!(auditor.stats().sinks[0].failed.load(Ordering::Relaxed), 0);
}

#[test]
fn otlp_with_tls_trusts_the_given_ca_and_only_it_over_grpc_and_http() {
    for protocol in [OtlpProtocol::Grpc, OtlpProtocol::HttpProtobuf] {
        otlp_with_tls(protocol);
    }
}

fn otlp_with_tls(protocol: OtlpProtocol) {
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let (cert_pem, key_pem) = (cert.cert.pem(), cert.signing_key.serialize_pem());
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, &cert_pem).unwrap();
    let receiver =
        Receiver::start_tls(protocol, loopback(), cert_pem.as_bytes(), key_pem.as_bytes()).unwrap();
    let endpoint = format!("https://localhost:{}", receiver.addr.port());
    let s = snapshot();
    for trusted in [true, false] {
        let mut sink = otlp(protocol, endpoint.clone());
        if let SinkConfig::Otlp(o) = &mut sink {
            o.ca_file = trusted.then(|| ca.clone());
        }
        let mut c = config(sink);
        // Long enough for the exporter's own retries of a failed handshake.
        c.flush_timeout = Duration::from_secs(30);
        let (plan, _) = Selection::new(&s, c.defaults);
        let auditor = Auditor::start(c).unwrap();
        let first: u16 = if trusted { 5000 } else { 6000 };
        submit(&auditor, &s, &plan, first, 20);
        auditor.shutdown();
        let got: BTreeSet<i64> = ports_received(&receiver)
            .into_iter()
            .filter(|p| (i64::from(first)..i64::from(first) + 20).contains(p))
            .collect();
        let st = &auditor.stats().sinks[0];
        if trusted {
            assert_eq!(got.len(), 20, "{protocol:?}: the CA file is trusted");
        } else {
            // The system's roots do not include the test's self-signed certificate.
            assert!(got.is_empty(), "{protocol:?}: an untrusted certificate is refused");
            assert_eq!(st.failed.load(Ordering::Relaxed), 20, "{protocol:?}: the loss is counted");
        }
    }
}

#[test]
fn with_connection_ends_off_a_cut_by_policy_change_is_still_reported() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    let mut c = config(json_file(&path));
    c.defaults.close = false;
    let s = snapshot();
    let auditor = Auditor::start(c).unwrap();
    let flow = Flow {
        src: CLIENT.parse().unwrap(),
        dst: SERVER.parse().unwrap(),
        protocol: Protocol::Tcp,
        dst_port: 8080,
    };
    let decision = Arc::new(s.decide(&flow));
    for (port, reason) in [(100, CloseReason::Normal), (101, CloseReason::PolicyChange)] {
        let admitted = tierproxy::audit::Admitted {
            flow: FlowInfo {
                key: FlowKey {
                    src: sa(CLIENT, port),
                    dst: sa(SERVER, 8080),
                    protocol: Protocol::Tcp,
                },
                time: SystemTime::now(),
                point: Default::default(),
            },
            decision: decision.clone(),
        };
        let end = ConnectionEnd { reason, to_server: 1, to_client: 2, duration: Duration::ZERO };
        auditor.connection_end(&s, &admitted, end);
    }
    auditor.shutdown();
    let lines = json_lines(&path);
    assert_eq!(lines.len(), 1, "{lines:#?}");
    assert_eq!(lines[0]["event"], event::CONNECTION_END);
    assert_eq!(lines[0]["attributes"][attr::CLOSE_REASON], "policy-change");
    assert_eq!(lines[0]["attributes"][attr::SRC_PORT], 101);
}

/// A collector that accepts every connection and never answers, as one that is hung
/// (stopped, deadlocked, or behind a proxy whose backend is wedged): it holds each
/// connection open and never reads or writes a byte.
struct BlackHole {
    addr: SocketAddr,
    stop: Arc<std::sync::atomic::AtomicBool>,
    accepting: Option<std::thread::JoinHandle<Vec<std::net::TcpStream>>>,
    /// The connections it held, kept open (silent) after it stops listening.
    held: Vec<std::net::TcpStream>,
}

impl BlackHole {
    fn start() -> Self {
        let listener = TcpListener::bind(loopback()).unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let st = stop.clone();
        let accepting = std::thread::spawn(move || {
            let mut held = Vec::new();
            while !st.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((c, _)) => held.push(c),
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
            held
        });
        BlackHole { addr, stop, accepting: Some(accepting), held: Vec::new() }
    }

    fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops listening (the port is free for a real collector) but keeps every connection
    /// it accepted open and silent. Returns how many it accepted.
    fn stop_listening(&mut self) -> usize {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.accepting.take() {
            self.held = t.join().unwrap();
        }
        self.held.len()
    }
}

impl Drop for BlackHole {
    fn drop(&mut self) {
        self.stop_listening();
    }
}

/// Lines of `path` written in full so far (the sink may be writing the next one).
fn complete_lines(path: &Path) -> u64 {
    std::fs::read(path).unwrap_or_default().iter().filter(|b| **b == b'\n').count() as u64
}

/// Waits until `f()` holds or `limit` passes; returns whether it held.
fn wait_until(limit: Duration, f: impl Fn() -> bool) -> bool {
    let until = std::time::Instant::now() + limit;
    while !f() {
        if std::time::Instant::now() >= until {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}

/// Ends of `n` proxied connections (ports from `first`), as the proxy reports them:
/// never waiting, whatever audit does.
fn end_connections(auditor: &Auditor, s: &Arc<Snapshot>, first: u16, n: u16) {
    let flow = Flow {
        src: CLIENT.parse().unwrap(),
        dst: EXTERNAL.parse().unwrap(),
        protocol: Protocol::Tcp,
        dst_port: 443,
    };
    let decision = Arc::new(s.decide(&flow));
    for port in first..first + n {
        let admitted = tierproxy::audit::Admitted {
            flow: FlowInfo {
                key: FlowKey {
                    src: sa(CLIENT, port),
                    dst: sa(EXTERNAL, 443),
                    protocol: Protocol::Tcp,
                },
                time: SystemTime::now(),
                point: Default::default(),
            },
            decision: decision.clone(),
        };
        let end = ConnectionEnd {
            reason: CloseReason::Normal,
            to_server: 1,
            to_client: 2,
            duration: Duration::ZERO,
        };
        auditor.connection_end(s, &admitted, end);
    }
}

/// The OTLP sink of `protocol` into `hole` with a 200 ms export deadline, in batches of
/// `batch`, then the JSON file `path`; lossless, queues of `capacity`.
fn hung_config(
    protocol: OtlpProtocol,
    hole: &BlackHole,
    batch: usize,
    path: &Path,
    capacity: usize,
) -> AuditConfig {
    let mut sink = otlp(protocol, hole.endpoint());
    if let SinkConfig::Otlp(o) = &mut sink {
        o.timeout = Some(Duration::from_millis(200));
        o.batch_size = batch;
    }
    let mut c = config(sink);
    c.sinks.push(json_file(path));
    c.mode = Mode::Lossless;
    c.queue_capacity = capacity;
    c
}

#[test]
fn lossless_abandons_exports_to_a_hung_collector_and_the_json_file_keeps_up() {
    for protocol in [OtlpProtocol::Grpc, OtlpProtocol::HttpProtobuf] {
        hung_collector(protocol);
    }
}

fn hung_collector(protocol: OtlpProtocol) {
    const CAPACITY: usize = 64;
    let mut hole = BlackHole::start();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    let c = hung_config(protocol, &hole, CAPACITY, &path, CAPACITY);
    let s = snapshot();
    let (plan, _) = Selection::new(&s, c.defaults);
    let auditor = Arc::new(Auditor::start(c).unwrap());
    let stats = auditor.stats().clone();
    let submitted = || stats.submitted.load(Ordering::Relaxed);
    let st = stats.sinks[0].clone();
    let retries = || st.retries.load(Ordering::Relaxed);
    let timeouts = || st.timeouts.load(Ordering::Relaxed);
    let lines = || complete_lines(&path);

    // (a) More decisions than the OTLP sink can hold. The data path accepts a queue's
    // worth and more, then new flows wait (lossless): the sink is stuck on its first batch
    // (an attempt has timed out) with a full queue behind it. Every decision accepted is
    // in the JSON file, and the ends of established connections keep being written.
    let n = 4 * CAPACITY as u16;
    let (a, s2, p2) = (auditor.clone(), s.clone(), plan.clone());
    let submitter = std::thread::spawn(move || submit(&a, &s2, &p2, 1000, n));
    let stuck = || {
        stats.waits.load(Ordering::Relaxed) > 0
            && auditor.sink_depths()[0] >= CAPACITY
            && timeouts() > 0
    };
    assert!(
        wait_until(Duration::from_secs(20), || stuck() && lines() == submitted()),
        "{protocol:?}: new flows wait: {}; the JSON file has {} of the {} decisions accepted",
        stuck(),
        lines(),
        submitted()
    );
    let accepted = submitted();
    assert!(accepted >= CAPACITY as u64 && accepted < u64::from(n), "{protocol:?}: {accepted}");
    end_connections(&auditor, &s, 20_000, 50);
    // (Ends are records handed over too: `submitted` counts them.)
    assert!(
        wait_until(Duration::from_secs(10), || {
            lines() == submitted() && submitted() >= accepted + 50
        }),
        "{protocol:?}: connection ends are not written while OTLP hangs ({} of {})",
        lines(),
        accepted + 50
    );

    // (b) Each export attempt is abandoned at its deadline and retried: three attempts
    // take 3 × 200 ms plus backoffs of 100, 200, 400 ms.
    assert!(
        wait_until(Duration::from_secs(10), || timeouts() >= 3 && retries() >= 3),
        "{protocol:?}: hung exports are not abandoned and retried: {:?} (retries, timeouts)",
        (retries(), timeouts())
    );
    assert_eq!(st.exported.load(Ordering::Relaxed), 0);

    // (c) A real collector takes the port; the hung connections stay open and silent.
    // Everything is delivered, and the new flows that waited go on.
    assert!(hole.stop_listening() > 0, "{protocol:?}: the exporter connected to the hole");
    let receiver = Receiver::start(protocol, hole.addr).unwrap();
    join_within(submitter, Duration::from_secs(30));
    let want: BTreeSet<i64> = (1000..1000 + i64::from(n)).chain(20_000..20_050).collect();
    receiver.wait_for(Duration::from_secs(30), |_| ports_received(&receiver).is_superset(&want));
    let got = ports_received(&receiver);
    let missing: Vec<&i64> = want.difference(&got).collect();
    assert!(missing.is_empty(), "{protocol:?}: not delivered after recovery: {missing:?}");
    auditor.shutdown();
    assert_eq!(lines(), u64::from(n) + 50);
    assert_eq!(stats.dropped_queue.load(Ordering::Relaxed), 0);
    for sk in &stats.sinks {
        assert_eq!(sk.dropped_queue.load(Ordering::Relaxed), 0, "{}", sk.name);
        assert_eq!(sk.failed.load(Ordering::Relaxed), 0, "{}", sk.name);
    }
}

#[test]
fn lossless_shutdown_with_a_hung_collector_ends_by_the_deadline_and_counts_the_loss() {
    for protocol in [OtlpProtocol::Grpc, OtlpProtocol::HttpProtobuf] {
        let hole = BlackHole::start();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let mut c = hung_config(protocol, &hole, 16, &path, 64);
        c.flush_timeout = Duration::from_millis(500);
        let s = snapshot();
        let (plan, _) = Selection::new(&s, c.defaults);
        let auditor = Arc::new(Auditor::start(c).unwrap());
        let stats = auditor.stats().clone();
        // New flows wait on the hung sink...
        let (a, s2, p2) = (auditor.clone(), s.clone(), plan.clone());
        let submitter = std::thread::spawn(move || submit(&a, &s2, &p2, 1000, 1000));
        assert!(wait_until(Duration::from_secs(20), || stats.waits.load(Ordering::Relaxed) > 0));
        // ...until shutdown, which ends within its deadline (and a grace to count) and
        // lets them go.
        let a = auditor.clone();
        let took = within(Duration::from_secs(10), move || {
            let t = std::time::Instant::now();
            a.shutdown();
            t.elapsed()
        });
        let took = took.unwrap_or_else(|| panic!("{protocol:?}: shutdown did not end"));
        assert!(took < Duration::from_secs(2), "{protocol:?}: shutdown took {took:?}");
        join_within(submitter, Duration::from_secs(10));
        // Every event handed to the sinks is in the JSON file, and counted as failed by
        // the OTLP sink, which abandoned it.
        let emitted = stats.emitted.load(Ordering::Relaxed);
        let (otlp, json) = (&stats.sinks[0], &stats.sinks[1]);
        assert!(emitted >= 64, "{protocol:?}: {emitted}");
        // (The JSON sink has had the flush timeout; a loaded machine may run it late.)
        assert!(wait_until(Duration::from_secs(10), || complete_lines(&path) == emitted));
        assert_eq!(json_lines(&path).len() as u64, emitted, "{protocol:?}");
        assert_eq!(json.exported.load(Ordering::Relaxed), emitted, "{protocol:?}");
        assert_eq!(otlp.exported.load(Ordering::Relaxed), 0, "{protocol:?}");
        // Counted as its attempt ends at the deadline (a loaded machine may run it late).
        let failed = || otlp.failed.load(Ordering::Relaxed);
        assert!(
            wait_until(Duration::from_secs(10), || failed() == emitted),
            "{protocol:?}: the OTLP sink counted {} failed of {emitted}",
            failed()
        );
    }
}
