//! Peak RSS of an agent whose stores hold a large cluster (issue #6 target: ≤ 64 MiB with
//! 10,000 pods, 1,000 NetworkPolicies and 100 AdminNetworkPolicies), read from the API
//! server, against the same agent reading the same objects from a manifest file, in the
//! same run.
//!
//! The cluster is `synth::Shape::LOAD_TEST` (10,000 pods on 100 nodes, 1,000
//! NetworkPolicies, 100 ANPs × 100 rules, a BANP), served by the scripted API server of
//! the tests (`tests/common/apiserver.rs`) on loopback. Each agent runs `--dry-run`: it
//! lists everything (through its watchers, or from the file), compiles the snapshot and
//! renders its ruleset, which is the agent's peak; its `ru_maxrss` is read with `wait4`.
//!
//! `cargo bench --bench kube_memory` (release build, ~1 minute).
#[path = "../tests/common/apiserver.rs"]
#[allow(dead_code)]
mod apiserver;

use std::process::Command;

use serde::Serialize;
use tierproxy::synth::{self, Shape};

/// Runs `cmd` to its end; its peak RSS in KiB and whether it succeeded.
fn peak_kib(cmd: &mut Command) -> (i64, bool) {
    let child = cmd.spawn().expect("the agent starts");
    let pid = child.id() as i32;
    let mut status = 0;
    // SAFETY: `rusage` is plain data the kernel fills; `pid` is our own child, waited once.
    let mut usage: nix::libc::rusage = unsafe { std::mem::zeroed() };
    let r = unsafe { nix::libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(r, pid, "wait4");
    std::mem::forget(child);
    (usage.ru_maxrss, nix::libc::WIFEXITED(status) && nix::libc::WEXITSTATUS(status) == 0)
}

fn values<T: Serialize>(items: &[T]) -> impl Iterator<Item = serde_json::Value> + '_ {
    items.iter().map(|o| serde_json::to_value(o).expect("serializable"))
}

fn main() {
    let exe = env!("CARGO_BIN_EXE_tierproxy");
    let inputs = synth::cluster(Shape::LOAD_TEST, 1);
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
        c.args(["agent", "--dry-run", "--node", &node]).env("TIERPROXY_LOG", "warn");
        c.stdout(std::process::Stdio::null());
        c
    };
    let (kube, ok_kube) =
        peak_kib(base().args(["--kube", "--no-policy-status"]).env("KUBECONFIG", &kubeconfig));
    let (files, ok_files) = peak_kib(base().arg("--manifests").arg(&file));
    assert!(ok_kube && ok_files, "an agent failed (kube: {ok_kube}, files: {ok_files})");
    let mib = |k: i64| k as f64 / 1024.0;
    println!("agent peak RSS, stores from the API server (--kube): {:.1} MiB", mib(kube));
    println!("agent peak RSS, the same objects from a manifest file: {:.1} MiB", mib(files));
    println!("ratio kube / file: {:.2}", kube as f64 / files as f64);
    println!("target <= 64 MiB: {}", if mib(kube) <= 64.0 { "PASS" } else { "MISS" });
}
