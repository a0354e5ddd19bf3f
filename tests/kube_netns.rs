//! End to end with the API-server source (issue #6): `tierproxy lab` builds the topology,
//! its agents run with `--kube` against a scripted API server on loopback
//! (`common::apiserver`), and enforce what the API says: policies that exist only in the
//! API, their changes, an outage (the last good snapshot stays in force), and the elected
//! agent's policy status and Events.
//!
//! Needs CAP_NET_ADMIN and CAP_SYS_ADMIN (root). Without them the test prints
//! `SKIPPED: <test>: needs CAP_NET_ADMIN (...)` to stderr and returns, unless
//! `TIERPROXY_REQUIRE_NETNS=1`, which turns that into a failure (CI sets it). A guard runs
//! `lab down` when the test ends, also when it panics; traffic stays inside the lab's
//! namespaces, every wait is bounded.

use std::process::Output;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

mod common;
use common::apiserver::FakeApi;
use common::*;

const ANP: &str = "policy.networking.k8s.io/v1alpha1";
/// The agents' metrics and debug address, in each node's namespace.
const METRICS: &str = "127.0.0.1:19470";

/// Two nodes; `a/client` and `a/server` on n1, `b/remote` on n2.
fn topology() -> Vec<Value> {
    let node = |name: &str, ip: &str| {
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
               "status": {"addresses": [{"type": "InternalIP", "address": ip}]}})
    };
    let ns = |name: &str| {
        json!({"apiVersion": "v1", "kind": "Namespace",
               "metadata": {"name": name, "labels": {"kubernetes.io/metadata.name": name}}})
    };
    let pod = |ns: &str, name: &str, node: &str, ip: &str| {
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
               "spec": {"nodeName": node, "containers": [{"name": "c", "ports": [
                   {"containerPort": 8080}, {"containerPort": 7070}]}]},
               "status": {"phase": "Running", "podIP": ip}})
    };
    vec![
        node("n1", "172.31.0.2"),
        node("n2", "172.31.0.3"),
        ns("a"),
        ns("b"),
        pod("a", "client", "n1", "10.61.1.2"),
        pod("a", "server", "n1", "10.61.1.3"),
        pod("b", "remote", "n2", "10.61.2.2"),
    ]
}

/// An ANP that denies egress from every pod to namespace `b` on TCP 8080.
fn deny_b_8080(priority: i64) -> Value {
    json!({"apiVersion": ANP, "kind": "AdminNetworkPolicy", "metadata": {"name": "deny-b-8080"},
           "spec": {"priority": priority, "subject": {"namespaces": {}},
                    "egress": [{"name": "no-8080", "action": "Deny",
                                "to": [{"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": "b"}}}],
                                "ports": [{"portNumber": {"protocol": "TCP", "port": 8080}}]}]}})
}

/// Waits up to `limit` for `f`; false if it never held.
fn eventually(limit: Duration, f: impl Fn() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if f() {
            return true;
        }
        if start.elapsed() > limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn condition(api: &FakeApi, name: &str) -> Option<Value> {
    api.get(ANP, "AdminNetworkPolicy", None, name).and_then(|o| {
        o["status"]["conditions"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["type"] == "tierproxy.io/Accepted").cloned())
    })
}

fn agent_log(lab: &Lab, node: &str) -> String {
    let path = format!("/run/tierproxy-lab/{}/agent-{node}.log", lab.prefix);
    std::fs::read_to_string(path).unwrap_or_default()
}

#[test]
fn agents_enforce_what_the_api_server_says_and_write_policy_status() {
    if !netns_available("agents_enforce_what_the_api_server_says_and_write_policy_status") {
        return;
    }
    let api = FakeApi::start();
    for o in topology() {
        api.apply(o);
    }
    api.apply(deny_b_8080(10));
    let lab = Lab::new("kube");
    let kubeconfig = api.kubeconfig(lab.dir.path());
    // The lab builds the topology from the same objects; the policies exist only in the
    // API server.
    let list = json!({"apiVersion": "v1", "kind": "List", "items": topology()});
    let topo = lab.file("topology.json", &list.to_string());
    let o: Output = bin()
        .env("KUBECONFIG", &kubeconfig)
        .args(["lab", "up", "--prefix", &lab.prefix, "--manifests", topo.to_str().unwrap()])
        .args(["--agent-arg=--kube", "--agent-arg=--kube-retry-max-ms=300"])
        .args(["--agent-arg=--lease-namespace=tierproxy-system"])
        // Each agent serves /debug/snapshot on loopback in its node's namespace.
        .arg(format!("--agent-arg=--metrics-addr={METRICS}"))
        .output()
        .expect("tierproxy runs");
    assert!(o.status.success(), "lab up: {}", text(&o));
    let client = netns_of_pod(&lab, "a", "client");
    let t = Duration::from_millis(1500);

    // The API's ANP is enforced: 8080 to namespace b denied, 7070 and same-node allowed.
    assert!(!connects(&client, "10.61.2.2:8080", t), "denied by the API's ANP");
    assert!(connects(&client, "10.61.2.2:7070", t));
    assert!(connects(&client, "10.61.1.3:8080", t));
    // Both agents list every watched resource from the API.
    let requests = api.requests();
    for r in ["/api/v1/pods?", "/api/v1/nodes?", "/apis/networking.k8s.io/v1/networkpolicies?"] {
        assert!(
            requests.iter().filter(|q| q.contains(r) && !q.contains("watch=true")).count() >= 2,
            "{r}"
        );
    }

    // One agent holds the Lease and writes the ANP's condition.
    assert!(
        eventually(Duration::from_secs(10), || condition(&api, "deny-b-8080").is_some()),
        "status written: {}",
        agent_log(&lab, "n1") + &agent_log(&lab, "n2")
    );
    let c = condition(&api, "deny-b-8080").unwrap();
    assert_eq!((c["status"].as_str(), c["reason"].as_str()), (Some("True"), Some("Accepted")));
    // Each agent announces on its Node that it enforces (issue #18), so the other node
    // forwards its pods' connections after deciding them instead of proxying them again.
    let annotated = |node: &str| {
        api.get("v1", "Node", None, node)
            .is_some_and(|n| n["metadata"]["annotations"]["tierproxy.io/enforcing"] == "true")
    };
    assert!(
        eventually(Duration::from_secs(10), || annotated("n1") && annotated("n2")),
        "both nodes announced: {}",
        agent_log(&lab, "n1") + &agent_log(&lab, "n2")
    );
    // Status writes (changes the engine cannot see) rebuild no snapshot. The one above came
    // with the agents' start, beside the Node annotations: at most one rebuild each per
    // agent. Then a marker ANP that selects no pod comes, its status is written, and it
    // goes: the watch delivers the status write between the two, and from the snapshot
    // that holds the marker to the one without it, each agent's revision moves by one.
    let node_writes =
        api.writes().iter().filter(|(m, p, _)| m == "PATCH" && p.contains("/nodes/")).count();
    assert_eq!(node_writes, 2, "{:?}", api.writes());
    // (revision, admin policies) of `node`'s snapshot in force.
    let snapshot = |node: &str| -> Option<(u64, u64)> {
        let (_, body) = http_get(&netns_of_node(&lab, node), METRICS, "/debug/snapshot")?;
        let v: Value = serde_json::from_str(&body).ok()?;
        Some((v["revision"].as_u64()?, v["counts"]["AdminNetworkPolicy"].as_u64()?))
    };
    let admin_policies = |node: &str, n: u64| {
        assert!(
            eventually(Duration::from_secs(10), || snapshot(node).is_some_and(|(_, a)| a == n)),
            "{node}'s snapshot has {n} admin policies: {:?} {}",
            snapshot(node),
            agent_log(&lab, node)
        );
        snapshot(node).expect("answered just now").0
    };
    api.apply(json!({"apiVersion": ANP, "kind": "AdminNetworkPolicy", "metadata": {"name": "marker"},
                     "spec": {"priority": 50, "subject": {"namespaces": {"matchLabels": {"none": "none"}}}}}));
    let mut with_marker = Vec::new();
    for node in ["n1", "n2"] {
        with_marker.push(admin_policies(node, 2));
        let log = agent_log(&lab, node);
        let rebuilds = log.matches("snapshot applied").count();
        assert!(rebuilds <= node_writes + 1, "{node} rebuilt {rebuilds} times: {log}");
    }
    assert!(
        eventually(Duration::from_secs(10), || condition(&api, "marker").is_some()),
        "the marker's status written"
    );
    // The marker goes after the leader's next Lease renewal (every 5 s): later than the
    // agents' debounce (100 ms) after the status write, so a rebuild for the status would
    // be one of its own, not merged with the deletion's.
    let renewals =
        || api.writes().iter().filter(|(m, p, _)| m == "PUT" && p.contains("/leases/")).count();
    let before = renewals();
    assert!(eventually(Duration::from_secs(10), || renewals() > before), "a Lease renewal");
    api.delete(ANP, "AdminNetworkPolicy", None, "marker");
    for (node, before) in ["n1", "n2"].into_iter().zip(with_marker) {
        let after = admin_policies(node, 1);
        assert_eq!(after, before + 1, "{node}: the marker's deletion rebuilt, its status did not");
    }
    let lease = api.get(
        "coordination.k8s.io/v1",
        "Lease",
        Some("tierproxy-system"),
        "tierproxy-policy-status",
    );
    let holder =
        lease.as_ref().and_then(|l| l["spec"]["holderIdentity"].as_str().map(str::to_string));
    assert!(matches!(holder.as_deref(), Some("n1" | "n2")), "{lease:?}");

    // Changes in the API: the ANP goes, an isolating NetworkPolicy comes. Enforced within
    // the debounce and a rebuild (bounded at 5 s here).
    api.delete(ANP, "AdminNetworkPolicy", None, "deny-b-8080");
    api.apply(json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                     "metadata": {"name": "isolate", "namespace": "b"},
                     "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}));
    assert!(
        eventually(Duration::from_secs(5), || !connects(&client, "10.61.2.2:8080", t)
            && !connects(&client, "10.61.2.2:7070", t)),
        "the NetworkPolicy from the API isolates b/remote"
    );
    api.delete("networking.k8s.io/v1", "NetworkPolicy", Some("b"), "isolate");
    assert!(
        eventually(Duration::from_secs(5), || connects(&client, "10.61.2.2:8080", t)),
        "open again once the API deletes it"
    );

    // An invalid ANP: reported on its status (False, Invalid) and by an Event; nothing
    // else changes.
    api.apply(json!({"apiVersion": ANP, "kind": "AdminNetworkPolicy", "metadata": {"name": "bad"},
                     "spec": {"priority": 1001, "subject": {"namespaces": {}}}}));
    assert!(eventually(Duration::from_secs(10), || {
        condition(&api, "bad").is_some_and(|c| c["status"] == "False" && c["reason"] == "Invalid")
    }));
    assert!(condition(&api, "bad").unwrap()["message"].as_str().unwrap().contains("spec.priority"));
    assert!(eventually(Duration::from_secs(5), || {
        api.writes().iter().any(|(m, p, b)| {
            m == "POST"
                && p.contains("/events")
                && b["reason"] == "InvalidPolicy"
                && b["regarding"]["name"] == "bad"
        })
    }));
    assert!(connects(&client, "10.61.2.2:8080", t));

    // An outage: the agents keep enforcing the last good snapshot and say so; a change
    // made in the API after it ends is enforced.
    api.apply(deny_b_8080(10));
    assert!(eventually(Duration::from_secs(5), || !connects(&client, "10.61.2.2:8080", t)));
    api.set_down(true);
    assert!(
        eventually(Duration::from_secs(5), || agent_log(&lab, "n1")
            .contains("watch failed; enforcing the last good snapshot")),
        "{}",
        agent_log(&lab, "n1")
    );
    assert!(!connects(&client, "10.61.2.2:8080", t), "still denied during the outage");
    assert!(connects(&client, "10.61.2.2:7070", t), "still allowed during the outage");
    api.set_down(false);
    api.delete(ANP, "AdminNetworkPolicy", None, "deny-b-8080");
    assert!(
        eventually(Duration::from_secs(10), || connects(&client, "10.61.2.2:8080", t)),
        "a change after the outage is enforced: {}",
        agent_log(&lab, "n1")
    );
    assert!(agent_log(&lab, "n1").contains("watch recovered"));

    // An upgrade (issue #23): n1's next agent, beside the old one on the same metrics
    // address, takes over; the old one, gone when `lab upgrade` returns, leaves the Node's
    // announcement to it instead of taking it back.
    let removals = |api: &FakeApi| {
        api.writes()
            .into_iter()
            .filter(|(m, path, body)| {
                m == "PATCH"
                    && path.starts_with("/api/v1/nodes/n1")
                    && body["metadata"]["annotations"]["tierproxy.io/enforcing"].is_null()
            })
            .count()
    };
    let removed_before = removals(&api);
    let up = bin()
        .env("KUBECONFIG", &kubeconfig)
        .args(["lab", "upgrade", "--prefix", &lab.prefix, "--node", "n1"])
        .output()
        .expect("tierproxy runs");
    assert!(up.status.success(), "lab upgrade: {}", text(&up));
    let upgraded: Value = serde_json::from_slice(&up.stdout).expect("one JSON line");
    assert_eq!(upgraded["handed_over"], true, "{upgraded}");
    assert_eq!(removals(&api), removed_before, "the old agent took n1's announcement back");
    assert!(annotated("n1"));
    assert!(connects(&client, "10.61.2.2:7070", t), "the new agent proxies");
    let debug = http_get(&netns_of_node(&lab, "n1"), METRICS, "/debug/snapshot");
    assert_eq!(debug.map(|(code, _)| code), Some(200), "the new agent serves the metrics address");

    // A stopped agent takes its announcement back before it exits (SIGTERM: `lab down`
    // waits for the agents to exit).
    let down = lab.lab(&["down"]);
    assert!(down.status.success(), "{}", text(&down));
    for node in ["n1", "n2"] {
        let n = api.get("v1", "Node", None, node).expect("node");
        assert!(
            n["metadata"]["annotations"].get("tierproxy.io/enforcing").is_none(),
            "{node} still announced after its agent stopped: {n}"
        );
    }
}

/// `GET path` on `addr` from inside `netns`: (status code, body), or `None` if no answer.
fn http_get(netns: &str, addr: &str, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    tierproxy::lab::netns::in_netns(netns, || {
        let Ok(mut s) = std::net::TcpStream::connect_timeout(
            &addr.parse().unwrap(),
            Duration::from_millis(500),
        ) else {
            return Ok(None);
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let _ = write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n");
        let mut reply = String::new();
        let _ = s.read_to_string(&mut reply);
        let code = reply.split_whitespace().nth(1).and_then(|c| c.parse().ok());
        let body = reply.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
        Ok(code.map(|c| (c, body)))
    })
    .expect("netns")
}

/// A network namespace of the test's own, deleted when dropped.
struct Netns(String);

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// An agent still waiting for the API server's initial lists is alive (`/healthz`), not
/// ready (`/readyz`), says why in its metrics, and has installed nothing.
#[test]
fn an_agent_waiting_for_the_initial_lists_is_live_not_ready_and_installs_nothing() {
    let test = "an_agent_waiting_for_the_initial_lists_is_live_not_ready_and_installs_nothing";
    if !netns_available(test) {
        return;
    }
    let api = FakeApi::start();
    api.set_down(true);
    let ns = Netns(format!("{}-kw", prefix("kube")));
    let ok = std::process::Command::new("ip").args(["netns", "add", &ns.0]).status();
    assert!(ok.is_ok_and(|s| s.success()), "ip netns add");
    let ok =
        std::process::Command::new("ip").args(["-n", &ns.0, "link", "set", "lo", "up"]).status();
    assert!(ok.is_ok_and(|s| s.success()), "lo up");
    let dir = tempfile::tempdir().unwrap();
    let mut agent = bin()
        .env("KUBECONFIG", api.kubeconfig(dir.path()))
        .args(["agent", "--kube", "--node", "n1", "--netns", &ns.0])
        .args(["--metrics-addr", "127.0.0.1:19469", "--no-tcp-tw-reuse"])
        .args(["--kube-retry-max-ms", "200", "--log"])
        .arg(dir.path().join("agent.log"))
        .spawn()
        .expect("agent starts");
    struct Kill<'a>(&'a mut std::process::Child);
    impl Drop for Kill<'_> {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let agent = Kill(&mut agent);
    let metric = |name: &str| -> Option<f64> {
        let (_, body) = http_get(&ns.0, "127.0.0.1:19469", "/metrics")?;
        body.lines().find(|l| l.starts_with(name))?.split_whitespace().last()?.parse().ok()
    };
    assert!(
        eventually(Duration::from_secs(10), || {
            http_get(&ns.0, "127.0.0.1:19469", "/healthz").is_some_and(|(c, _)| c == 200)
        }),
        "/healthz answers while the lists wait: {}",
        std::fs::read_to_string(dir.path().join("agent.log")).unwrap_or_default()
    );
    assert_eq!(http_get(&ns.0, "127.0.0.1:19469", "/readyz").map(|(c, _)| c), Some(503));
    assert!(eventually(Duration::from_secs(5), || {
        metric("tierproxy_kube_watch_errors_total").is_some_and(|v| v > 0.0)
    }));
    assert!(metric("tierproxy_kube_stale_seconds").is_some());
    // Nothing installed in the namespace: no tierproxy chain, no policy route.
    let rules = std::process::Command::new("ip")
        .args(["netns", "exec", &ns.0, "iptables-save", "-t", "mangle"])
        .output()
        .expect("iptables-save");
    assert!(!String::from_utf8_lossy(&rules.stdout).contains("TIERPROXY"));
    drop(agent);
}
