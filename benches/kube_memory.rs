//! Peak RSS of an agent whose stores hold a large cluster (issue #6 target: ≤ 64 MiB with
//! 10,000 pods, 1,000 NetworkPolicies and 100 AdminNetworkPolicies), read from the API
//! server, against the same agent reading the same objects from a manifest file, in the
//! same run.
//!
//! The clusters are two baselines (10 pods; 10,000 pods without policies),
//! `synth::Shape::LOAD_TEST` (10,000 pods on 100 nodes, 1,000 NetworkPolicies, 100 ANPs ×
//! 100 rules of at most 10 peers, a BANP) and the same with 10 rules per ANP, each served by the scripted API server of
//! the tests (`tests/common/apiserver.rs`) on loopback. Each agent runs `--dry-run`: it
//! lists everything (through its watchers, or from the file), compiles the snapshot and
//! renders its ruleset, which is the agent's peak; it logs its `VmHWM`.
//!
//! `cargo bench --bench kube_memory` (release build, about a minute after the build).
#[path = "../tests/common/apiserver.rs"]
mod apiserver;

use std::process::Command;

use serde::Serialize;
use tierproxy::synth::{self, Shape};

/// Runs `cmd` (an agent with `--dry-run`) to its end; its peak RSS in MiB, from the
/// `peak_rss_mib` (`VmHWM`) of its "snapshot compiled" log line. (`wait4`'s `ru_maxrss`
/// cannot be used: it counts this process's own RSS at the fork.)
fn peak_mib(cmd: &mut Command) -> u64 {
    let out = cmd.output().expect("the agent runs");
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the agent failed: {log}");
    eprint!("{log}");
    log.lines()
        .filter(|l| l.contains("snapshot compiled"))
        .find_map(|l| l.split("peak_rss_mib=").nth(1)?.split_whitespace().next()?.parse().ok())
        .expect("a peak_rss_mib in the agent's log")
}

fn values<T: Serialize>(items: &[T]) -> impl Iterator<Item = serde_json::Value> + '_ {
    items.iter().map(|o| serde_json::to_value(o).expect("serializable"))
}

fn main() {
    // Two baselines (a 10-pod cluster: the process itself; 10,000 pods and no policies: the
    // pods' store), #7's load-test set (100 rules per ANP: 10,000 admin rules, 100,000
    // peers), and the same cluster with 10 rules per ANP.
    let tiny = Shape {
        pods: 10,
        namespaces: 2,
        nodes: 2,
        network_policies: 1,
        admin_policies: 1,
        rules_per_admin_policy: 1,
        ..Shape::LOAD_TEST
    };
    let pods_only = Shape {
        network_policies: 0,
        admin_policies: 1,
        rules_per_admin_policy: 1,
        ..Shape::LOAD_TEST
    };
    // Issue #6's target applies to the two policy sets, not to the baselines.
    for (what, shape, target) in [
        ("10 pods (the process)", tiny, false),
        ("10,000 pods, no policies (the pods' store)", pods_only, false),
        ("100 ANPs x 100 rules", Shape::LOAD_TEST, true),
        ("100 ANPs x 10 rules", Shape { rules_per_admin_policy: 10, ..Shape::LOAD_TEST }, true),
    ] {
        println!("== {what}");
        measure(shape, target);
    }
}

fn measure(shape: Shape, target: bool) {
    let exe = env!("CARGO_BIN_EXE_tierproxy");
    let inputs = synth::cluster(shape, 1);
    let node = inputs.nodes[0].metadata.name.clone().expect("node name");
    let i = &inputs;
    let all: Vec<serde_json::Value> = values(&i.namespaces)
        .chain(values(&i.nodes))
        .chain(values(&i.pods))
        .chain(values(&i.network_policies))
        .chain(values(&i.admin_network_policies))
        .chain(values(&i.baseline_admin_network_policies))
        .chain(values(&i.cluster_network_policies))
        .collect();
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("cluster.json");
    let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": all});
    std::fs::write(&file, list.to_string()).expect("manifest written");
    let api = apiserver::FakeApi::start();
    for o in all {
        api.apply(o);
    }
    let kubeconfig = api.kubeconfig(dir.path());
    println!(
        "cluster: {} pods, {} nodes, {} NetworkPolicies, {} ANPs, {} BANPs ({} MB of JSON)",
        i.pods.len(),
        i.nodes.len(),
        i.network_policies.len(),
        i.admin_network_policies.len(),
        i.baseline_admin_network_policies.len(),
        std::fs::metadata(&file).map(|m| m.len() >> 20).unwrap_or(0)
    );
    let base = || {
        let mut c = Command::new(exe);
        // Its log (stderr) says the RSS after the lists and after the compile.
        c.args(["agent", "--dry-run", "--node", &node]).env("TIERPROXY_LOG", "info");
        c.env_remove("KUBECONFIG");
        c.stdout(std::process::Stdio::null());
        c
    };
    let kube =
        peak_mib(base().args(["--kube", "--no-policy-status"]).env("KUBECONFIG", &kubeconfig));
    let files = peak_mib(base().arg("--manifests").arg(&file));
    println!("agent peak RSS, stores from the API server (--kube): {kube} MiB");
    println!("agent peak RSS, the same objects from a manifest file: {files} MiB");
    println!("ratio kube / file: {:.2}", kube as f64 / files as f64);
    if target {
        println!("target <= 64 MiB: {}", if kube <= 64 { "PASS" } else { "MISS" });
    }
}
