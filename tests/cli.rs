//! End-to-end tests of the `tierproxy` binary: `explain` over the bundled examples (the
//! seed documents' policies with hand-derived expectations), `check`, and bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tierproxy"))
}

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples")
}

fn run(args: &[&str]) -> Output {
    bin().args(args).output().expect("tierproxy runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).expect("temp file written");
    p
}

#[test]
fn explain_over_the_examples_meets_every_expectation() {
    let ex = examples();
    let o = run(&[
        "explain",
        "-m",
        ex.join("cluster.yaml").to_str().unwrap(),
        ex.join("policies").to_str().unwrap(),
        "--probes",
        ex.join("probes.jsonl").to_str().unwrap(),
        "-o",
        "json",
    ]);
    assert_eq!(o.status.code(), Some(0), "stderr: {}", stderr(&o));
    let lines: Vec<Value> = String::from_utf8(o.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).expect("each output line is JSON"))
        .collect();
    let probes = std::fs::read_to_string(ex.join("probes.jsonl")).unwrap();
    let expected: Vec<Value> = probes
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), expected.len(), "one output object per probe, in order");
    for (got, want) in lines.iter().zip(&expected) {
        assert_eq!(got["from"], want["from"]);
        assert_eq!(got["to"], want["to"]);
        assert_eq!(got["verdict"], want["expect"], "probe {want}");
        for dir in ["egress", "ingress"] {
            let o = &got[dir];
            let verdict = o["verdict"].as_str().unwrap();
            assert!(["allow", "deny", "reject", "n/a"].contains(&verdict));
            let tier = &o["tier"];
            // The upstream tiers, or the Antrea Tier of an Antrea policy (by its name).
            let antrea = o["policy"]["apiVersion"] == "crd.antrea.io/v1beta1";
            assert!(
                tier.is_null()
                    || (!antrea
                        && ["admin", "networkpolicy", "baseline", "default"]
                            .contains(&tier.as_str().unwrap()))
                    || (antrea
                        && ["incident-response", "securityops", "application"]
                            .contains(&tier.as_str().unwrap())),
                "{o}"
            );
            assert!(o["passed"].is_array());
        }
    }
    // The output says which rule decided: spot-check one probe per tier.
    let tiers: Vec<&str> = lines
        .iter()
        .flat_map(|l| [l["egress"]["tier"].as_str(), l["ingress"]["tier"].as_str()])
        .flatten()
        .collect();
    for t in ["admin", "networkpolicy", "baseline", "default"] {
        assert!(tiers.contains(&t), "some probe is decided by the {t} tier");
    }
    assert!(
        lines.iter().any(|l| !l["ingress"]["passed"].as_array().unwrap().is_empty()),
        "some probe passes"
    );
}

#[test]
fn explain_table_reports_a_mismatch_with_exit_1() {
    let dir = tempfile::tempdir().unwrap();
    let ex = examples();
    let probes = write(
        dir.path(),
        "p.jsonl",
        "{\"from\": \"203.0.113.10\", \"to\": \"203.0.113.11\", \"port\": 80, \"protocol\": \"TCP\", \"expect\": \"deny\"}\n",
    );
    let o = run(&[
        "explain",
        "-m",
        ex.join("cluster.yaml").to_str().unwrap(),
        "--probes",
        probes.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("MISMATCH: expected deny"), "{out}");
    assert!(out.contains("0 of 1 expectations met"), "{out}");
}

#[test]
fn explain_single_probe_from_flags() {
    let ex = examples();
    let o = run(&[
        "explain",
        "-m",
        ex.to_str().unwrap(),
        "--from",
        "203.0.113.10",
        "--to",
        "203.0.113.11",
        "--port",
        "443",
        "-o",
        "json",
    ]);
    // The examples directory holds probes.jsonl and conflicts; only YAML is read as
    // manifests, and the conflicts file adds a priority tie that is a warning only.
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["verdict"], "allow");
    assert_eq!(v["egress"]["verdict"], "n/a");
}

#[test]
fn invalid_objects_exit_2_naming_object_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let m = write(
        dir.path(),
        "bad.yaml",
        "apiVersion: policy.networking.k8s.io/v1alpha1\nkind: AdminNetworkPolicy\nmetadata: {name: too-high}\nspec:\n  priority: 1001\n  subject: {namespaces: {}}\n",
    );
    let err = explain_refused(&m);
    assert!(err.contains("AdminNetworkPolicy too-high: spec.priority"), "{err}");
    let v = first_check_problem(&m);
    assert_eq!(v["severity"], "error");
    assert_eq!(v["kind"], "AdminNetworkPolicy");
    assert_eq!(v["name"], "too-high");
    assert_eq!(v["field"], "spec.priority");
}

/// Antrea-native objects: an invalid one fails `check` and `explain` with exit 2, naming
/// object (with its API group) and field; a valid one passes, an out-of-scope field
/// warned; the upstream kind of the same name is unaffected.
#[test]
fn antrea_policies_are_validated_naming_object_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let bad = write(
        dir.path(),
        "bad.yaml",
        "apiVersion: crd.antrea.io/v1beta1\nkind: ClusterNetworkPolicy\nmetadata: {name: acnp}\nspec:\n  tier: nope\n  priority: 5\n  appliedTo: [{podSelector: {}}]\n  ingress: [{action: Drop}]\n",
    );
    let v = first_check_problem(&bad);
    assert_eq!(v["severity"], "error");
    assert_eq!(v["kind"], "ClusterNetworkPolicy");
    assert_eq!(v["group"], "crd.antrea.io");
    assert_eq!(v["name"], "acnp");
    assert_eq!(v["field"], "spec.tier");
    let err = explain_refused(&bad);
    assert!(err.contains("ClusterNetworkPolicy.crd.antrea.io acnp: spec.tier"), "{err}");

    let good = write(
        dir.path(),
        "good.yaml",
        "apiVersion: crd.antrea.io/v1beta1\nkind: NetworkPolicy\nmetadata: {name: p, namespace: a}\nspec:\n  priority: 5\n  appliedTo: [{podSelector: {}}]\n  ingress: [{action: Drop, from: [{fqdn: example.com}]}]\n---\napiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: p, namespace: a}\nspec: {podSelector: {}}\n",
    );
    let o = run(&["check", "-m", good.to_str().unwrap()]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(0), "{out}");
    // An out-of-scope field is named, never dropped in silence.
    assert!(out.contains("NetworkPolicy.crd.antrea.io a/p: spec.ingress[0].from[0].fqdn"), "{out}");
    assert!(out.contains("0 error(s), 1 warning(s)"), "{out}");
}

#[test]
fn wrong_types_and_malformed_yaml_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            "wrong-type.yaml",
            "apiVersion: v1\nkind: Pod\nmetadata: {name: p, namespace: a}\nspec: {containers: {name: c}}\n",
            "Pod a/p: spec.containers",
        ),
        ("syntax.yaml", "apiVersion: v1\nkind: [Pod\n", "not valid YAML"),
        (
            "port.yaml",
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: n, namespace: a}\nspec:\n  podSelector: {}\n  ingress: [{ports: [{port: 70000}]}]\n",
            "NetworkPolicy a/n: spec.ingress[0].ports[0].port",
        ),
    ];
    for (name, text, needle) in cases {
        let m = write(dir.path(), name, text);
        let o = run(&["check", "-m", m.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(2), "{name}");
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(out.contains(needle), "{name}: {out}");
    }
}

#[test]
fn hostile_yaml_is_refused_without_panic_or_hang() {
    let dir = tempfile::tempdir().unwrap();
    // Billion laughs: 10 levels of 10 aliases.
    let mut bomb = String::from("a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
    for i in 1..10 {
        let p = format!("*a{}", i - 1);
        bomb.push_str(&format!("a{i}: &a{i} [{}]\n", vec![p; 10].join(", ")));
    }
    let deep = format!("{}1{}", "[".repeat(10_000), "]".repeat(10_000));
    let cases = [
        ("bomb.yaml", bomb, "over the manifest limit on YAML alias expansion"),
        ("deep.yaml", deep, "over the manifest limit on nesting: 127 levels"),
        ("deep.json", format!("{}1{}", "[".repeat(200), "]".repeat(200)), "nesting: 127 levels"),
        ("binary.yaml", "\u{0}\u{1}\u{2}garbage: [".into(), "not valid YAML"),
    ];
    for (name, text, needle) in cases {
        let m = write(dir.path(), name, &text);
        let o = run(&["check", "-m", m.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(2), "{name}: {}", stderr(&o));
        assert!(!stderr(&o).contains("panicked"), "{name}");
        // `check` reports on stdout.
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(out.contains(&format!("{name}: ")) && out.contains(needle), "{name}: {out}");
    }
    // One byte over the size limit (a sparse file): refused before it is read.
    let big = dir.path().join("big.json");
    std::fs::File::create(&big).unwrap().set_len(64 << 20 | 1).unwrap();
    let o = run(&["check", "-m", big.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let want = "big.json: 67108865 bytes: over the manifest limit on size: 67108864 bytes (64 MiB)";
    assert!(out.contains(want), "{out}");
}

#[test]
fn unknown_probe_endpoint_is_a_named_error() {
    let ex = examples();
    let o = run(&[
        "explain",
        "-m",
        ex.join("cluster.yaml").to_str().unwrap(),
        "--from",
        "nope/pod",
        "--to",
        "1.2.3.4",
        "--port",
        "1",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("no pod nope/pod in the manifests"), "{}", stderr(&o));
}

/// `check`'s output for `policies` beside one pod (`a/p`), which must pass (exit 0:
/// warnings do not fail check).
fn check_warnings(policies: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let pod = "apiVersion: v1\nkind: Pod\nmetadata: {name: p, namespace: a}\n\
               spec: {containers: [{name: c}]}\nstatus: {podIP: 10.0.0.1}\n---";
    let m = write(dir.path(), "p.yaml", &format!("{pod}{policies}"));
    let o = run(&["check", "-m", m.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "warnings do not fail check: {}", stderr(&o));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The BaselineAdminNetworkPolicy ranks at priority 1 among the Baseline-tier
/// ClusterNetworkPolicies (antrea-model.md §3): a Baseline CNP at 1 whose subject overlaps
/// it is a tie, reported on both, the BANP's on `spec` (it has no priority field).
#[test]
fn check_reports_a_baseline_cnp_tied_with_the_banp() {
    let out = check_warnings(
        r#"
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {name: base}
spec:
  tier: Baseline
  priority: 1
  subject: {namespaces: {}}
  ingress: [{action: Accept, from: [{namespaces: {}}]}]
---
apiVersion: policy.networking.k8s.io/v1alpha1
kind: BaselineAdminNetworkPolicy
metadata: {name: default}
spec:
  subject: {namespaces: {}}
  ingress: [{action: Deny, from: [{namespaces: {}}]}]
"#,
    );
    assert!(
        out.contains("ClusterNetworkPolicy base: spec.priority: priority 1 is shared with BaselineAdminNetworkPolicy default")
            && out.contains("BaselineAdminNetworkPolicy default: spec: priority 1 is shared with ClusterNetworkPolicy base"),
        "{out}"
    );
}

#[test]
fn check_reports_domain_names_and_priority_conflicts() {
    let out = check_warnings(
        r#"
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: one}
spec:
  priority: 7
  subject: {namespaces: {}}
  egress: [{action: Allow, to: [{domainNames: ["*.example.com"]}]}]
---
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: two}
spec:
  priority: 7
  subject: {pods: {namespaceSelector: {}, podSelector: {}}}
  ingress: [{action: Deny, from: [{namespaces: {}}]}]
"#,
    );
    assert!(
        out.contains("AdminNetworkPolicy one: spec.egress[0]: domainNames peers are not resolved"),
        "{out}"
    );
    // On both policies of the tie (issue #19), each naming the other.
    assert!(
        out.contains("AdminNetworkPolicy one: spec.priority: priority 7 is shared with AdminNetworkPolicy two")
            && out.contains("this policy first"),
        "{out}"
    );
    assert!(
        out.contains("AdminNetworkPolicy two: spec.priority: priority 7 is shared with AdminNetworkPolicy one")
            && out.contains("the other first"),
        "{out}"
    );
}

#[test]
fn check_warns_of_an_audit_annotation_that_does_not_parse() {
    let dir = tempfile::tempdir().unwrap();
    let m = write(
        dir.path(),
        "p.yaml",
        r#"
apiVersion: v1
kind: Namespace
metadata: {name: a}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: quiet, namespace: a, annotations: {tierproxy.io/audit: "deny=off"}}
spec: {podSelector: {}}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: loud, namespace: a, annotations: {tierproxy.io/audit: "deny=loud"}}
spec: {podSelector: {}}
"#,
    );
    let o = run(&["check", "-m", m.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "a warning: the policy is enforced as written");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("NetworkPolicy a/loud: metadata.annotations[tierproxy.io/audit]: \"deny=loud\" is invalid: \"deny=loud\" is not on, off"),
        "{out}"
    );
    assert!(out.contains("the policy is audited in full"), "{out}");
    assert!(!out.contains("a/quiet: metadata.annotations"), "{out}");
}

#[test]
fn priority_ties_are_decided_by_name_and_reported() {
    let ex = examples();
    let manifests = [
        ex.join("cluster.yaml"),
        ex.join("policies"),
        ex.join("conflicts").join("same-priority.yaml"),
    ];
    let m: Vec<&str> = manifests.iter().map(|p| p.to_str().unwrap()).collect();
    let probes = ex.join("conflicts").join("probes.jsonl");
    let mut args = vec!["explain", "-m"];
    args.extend(&m);
    args.extend(["--probes", probes.to_str().unwrap()]);
    let o = run(&args);
    assert_eq!(o.status.code(), Some(0), "{}{}", String::from_utf8_lossy(&o.stdout), stderr(&o));
    let mut args = vec!["check", "-m"];
    args.extend(&m);
    let o = run(&args);
    assert!(String::from_utf8_lossy(&o.stdout).contains("priority 70 is shared with"));
}

/// `agent --dry-run` shows the exact ruleset for a node and changes nothing (no root
/// needed): the node's own pods are in the local set, other nodes' pods are not.
#[test]
fn agent_dry_run_prints_the_ruleset_for_the_node() {
    let ex = examples();
    let cluster = ex.join("cluster.yaml");
    let policies = ex.join("policies");
    let args = |node: &str| {
        vec![
            "agent".to_string(),
            "--node".into(),
            node.into(),
            "-m".into(),
            cluster.to_str().unwrap().into(),
            policies.to_str().unwrap().into(),
            "--redirect-backend".into(),
            "iptables".into(),
            "--dry-run".into(),
        ]
    };
    let o = bin().args(args("node-1")).output().expect("runs");
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.starts_with("# backend: iptables (configured"), "{text}");
    assert!(text.contains("add tierproxy-pods-v4-tmp 10.244.1.4"), "node-1 pod: {text}");
    assert!(!text.contains("10.244.2.3"), "node-2 pod in node-1's set: {text}");
    assert!(text.contains("-j TPROXY"), "{text}");
    let o = bin().args(args("node-9")).output().expect("runs");
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("node \"node-9\" is not among the Nodes"), "{}", stderr(&o));
}

#[test]
fn agent_kube_without_a_client_configuration_says_so_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let o = bin()
        .args(["agent", "--kube", "--node", "n1", "--dry-run"])
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env("KUBECONFIG", dir.path().join("missing-kubeconfig"))
        .env("HOME", dir.path())
        .output()
        .expect("tierproxy runs");
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("configuring the API-server client"), "{e}");
    assert!(e.contains("missing-kubeconfig"), "names the file it tried: {e}");
    assert_eq!(e.matches("missing-kubeconfig").count(), 1, "said once, not once per cause: {e}");
}

#[test]
fn agent_needs_manifests_or_kube() {
    let o = run(&["agent", "--node", "n1", "--dry-run"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--manifests"), "{}", stderr(&o));
}

/// deploy/metrics-access.yaml (issue #17, item 10): with the agents' metrics on the node
/// address, Prometheus's namespace may scrape every node's port 9469 and no other pod may;
/// the node's other ports and the pods' own traffic are untouched.
#[test]
fn the_metrics_access_policies_let_only_monitoring_reach_the_agents_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = write(
        dir.path(),
        "cluster.yaml",
        r#"
apiVersion: v1
kind: Node
metadata: {name: n1}
status: {addresses: [{type: InternalIP, address: 172.31.0.2}]}
---
apiVersion: v1
kind: Namespace
metadata: {name: monitoring, labels: {kubernetes.io/metadata.name: monitoring}}
---
apiVersion: v1
kind: Namespace
metadata: {name: shop, labels: {kubernetes.io/metadata.name: shop}}
---
apiVersion: v1
kind: Pod
metadata: {name: prometheus, namespace: monitoring}
spec: {nodeName: n1, containers: [{name: c}]}
status: {podIP: 10.60.1.2}
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: shop}
spec: {nodeName: n1, containers: [{name: c}]}
status: {podIP: 10.60.1.3}
"#,
    );
    let probes = write(
        dir.path(),
        "probes.jsonl",
        r#"{"from": "monitoring/prometheus", "to": "node/n1", "port": 9469, "expect": "allow"}
{"from": "shop/web", "to": "node/n1", "port": 9469, "expect": "deny"}
{"from": "shop/web", "to": "node/n1", "port": 10250, "expect": "allow"}
{"from": "shop/web", "to": "monitoring/prometheus", "port": 9469, "expect": "allow"}
"#,
    );
    let policy = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/metrics-access.yaml");
    let o = run(&[
        "explain",
        "-m",
        cluster.to_str().unwrap(),
        policy.to_str().unwrap(),
        "--probes",
        probes.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}{}", String::from_utf8_lossy(&o.stdout), stderr(&o));
}

/// `explain` of any flow over the manifests at `path`, which hold an invalid object: exit
/// 2; its standard error.
fn explain_refused(path: &std::path::Path) -> String {
    let m = path.to_str().unwrap();
    let o = run(&["explain", "-m", m, "--from", "10.0.0.1", "--to", "10.0.0.2", "--port", "80"]);
    assert_eq!(o.status.code(), Some(2));
    stderr(&o)
}

/// `check -o json` of the manifests at `path`, which hold an invalid object: exit 2; the
/// first problem reported.
fn first_check_problem(path: &std::path::Path) -> Value {
    let o = run(&["check", "-m", path.to_str().unwrap(), "-o", "json"]);
    assert_eq!(o.status.code(), Some(2));
    serde_json::from_slice(o.stdout.split(|b| *b == b'\n').next().unwrap()).unwrap()
}
