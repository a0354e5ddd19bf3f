//! Peak RSS of an agent whose stores hold a large cluster (issue #6 target: ≤ 64 MiB with
//! 10,000 pods, 1,000 NetworkPolicies and 100 AdminNetworkPolicies), read from the API
//! server, against the same agent reading the same objects from a JSON and from a YAML
//! manifest file (issue #17, item 9: the file source's memory close to the API source's),
//! in the same run.
//!
//! The clusters are two baselines (10 pods; 10,000 pods without policies),
//! `synth::Shape::LOAD_TEST` (10,000 pods on 100 nodes, 1,000 NetworkPolicies, 100 ANPs ×
//! 100 rules of at most 10 peers, a BANP) and the same with 10 rules per ANP, each served
//! by the scripted API server of the tests (`tests/common/apiserver.rs`) on loopback and
//! written as one `kind: List` (compact JSON, block-style YAML). Each agent runs
//! `--dry-run`: it lists everything (through its watchers, or from the file), compiles the
//! snapshot and renders its ruleset, which is the agent's peak; it logs its `VmHWM`. Last,
//! the file source alone reads 125,000 pods from one JSON file (about 40 MB): peak RSS and
//! the agent's wall time (start to exit: load, compile, render).
//!
//! The API-server agent runs twice: with its default lists (`resourceVersion=0`, answered
//! whole, as from the API server's watch cache) and with `--kube-list-page-size 500`
//! (paged quorum reads), for the ratio of their peaks (issue #19, item 7).
//!
//! With `KUBE_MEMORY_BASELINE=/path/to/an/older/tierproxy`, every file measurement is also
//! run with that binary in the same run, and the ratios new / baseline are printed (a file
//! the baseline refuses is reported as refused).
//!
//! `cargo bench --bench kube_memory` (release build, a few minutes after the build).
#[path = "../tests/common/apiserver.rs"]
mod apiserver;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde::Serialize;
use tierproxy::synth::{self, Shape};

/// What one agent run gave.
#[derive(Debug, Clone)]
enum Run {
    /// Peak RSS (MiB) and wall time.
    Done { peak_mib: u64, wall: Duration },
    /// The agent failed; its first error line.
    Refused(String),
}

impl Run {
    fn peak(&self) -> Option<u64> {
        match self {
            Run::Done { peak_mib, .. } => Some(*peak_mib),
            Run::Refused(_) => None,
        }
    }

    fn wall(&self) -> Option<Duration> {
        match self {
            Run::Done { wall, .. } => Some(*wall),
            Run::Refused(_) => None,
        }
    }
}

impl std::fmt::Display for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Run::Done { peak_mib, wall } => {
                write!(f, "peak RSS {peak_mib} MiB, {:.2} s", wall.as_secs_f64())
            }
            Run::Refused(why) => write!(f, "refused: {why}"),
        }
    }
}

/// Runs `cmd` (an agent with `--dry-run`) to its end: its peak RSS in MiB, from the
/// `peak_rss_mib` (`VmHWM`) of its "snapshot compiled" log line (`wait4`'s `ru_maxrss`
/// cannot be used: it counts this process's own RSS at the fork), and its wall time.
fn run(cmd: &mut Command) -> Run {
    let start = Instant::now();
    let out = cmd.output().expect("the agent runs");
    let wall = start.elapsed();
    let log = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        let first = log.lines().find(|l| l.contains("error")).unwrap_or("(no error line)");
        return Run::Refused(first.chars().take(200).collect());
    }
    let peak_mib = log
        .lines()
        .filter(|l| l.contains("snapshot compiled"))
        .find_map(|l| l.split("peak_rss_mib=").nth(1)?.split_whitespace().next()?.parse().ok())
        .expect("a peak_rss_mib in the agent's log");
    Run::Done { peak_mib, wall }
}

fn values<T: Serialize>(items: &[T]) -> impl Iterator<Item = serde_json::Value> + '_ {
    items.iter().map(|o| serde_json::to_value(o).expect("serializable"))
}

/// An agent `--dry-run` for `node` with `exe`, logging at info (its log says the RSS
/// after the lists and after the compile).
fn agent(exe: &Path, node: &str) -> Command {
    let mut c = Command::new(exe);
    c.args(["agent", "--dry-run", "--node", node]).env("TIERPROXY_LOG", "info");
    c.env_remove("KUBECONFIG");
    c.stdout(std::process::Stdio::null());
    c
}

fn ratio(a: Option<u64>, b: Option<u64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) => format!("{:.2}", a as f64 / b as f64),
        _ => "n/a".into(),
    }
}

/// Peak RSS and wall time of `ours` over `theirs`.
fn compare(ours: &Run, theirs: &Run) -> String {
    let wall = match (ours.wall(), theirs.wall()) {
        (Some(a), Some(b)) => format!("{:.2}", a.as_secs_f64() / b.as_secs_f64()),
        _ => "n/a".into(),
    };
    format!("peak RSS {}, wall time {wall}", ratio(ours.peak(), theirs.peak()))
}

fn main() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_tierproxy"));
    let baseline = std::env::var_os("KUBE_MEMORY_BASELINE").map(PathBuf::from);
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
        measure(&exe, baseline.as_deref(), shape, target);
    }
    println!("== 125,000 pods from one JSON file (the file source alone)");
    large_file(&exe, baseline.as_deref());
}

fn measure(exe: &Path, baseline: Option<&Path>, shape: Shape, target: bool) {
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
    let json = dir.path().join("cluster.json");
    let yaml = dir.path().join("cluster.yaml");
    let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": all});
    std::fs::write(&json, list.to_string()).expect("manifest written");
    std::fs::write(&yaml, serde_saphyr::to_string(&list).expect("YAML")).expect("manifest written");
    drop(list);
    let api = apiserver::FakeApi::start();
    for o in all {
        api.apply(o);
    }
    let kubeconfig = api.kubeconfig(dir.path());
    let mib = |p: &Path| std::fs::metadata(p).map(|m| m.len() as f64 / (1 << 20) as f64);
    println!(
        "cluster: {} pods, {} nodes, {} NetworkPolicies, {} ANPs, {} BANPs ({:.1} MiB of JSON, {:.1} MiB of YAML)",
        i.pods.len(),
        i.nodes.len(),
        i.network_policies.len(),
        i.admin_network_policies.len(),
        i.baseline_admin_network_policies.len(),
        mib(&json).unwrap_or(0.0),
        mib(&yaml).unwrap_or(0.0),
    );
    let kube = run(agent(exe, &node)
        .args(["--kube", "--no-policy-status"])
        .env("KUBECONFIG", &kubeconfig));
    println!("agent, stores from the API server (--kube): {kube}");
    let paged = run(agent(exe, &node)
        .args(["--kube", "--no-policy-status", "--kube-list-page-size", "500"])
        .env("KUBECONFIG", &kubeconfig));
    println!("agent, the same in pages of 500 (--kube-list-page-size 500): {paged}");
    println!("  ratio whole lists / pages (peak RSS): {}", ratio(kube.peak(), paged.peak()));
    for (what, file) in [("JSON", &json), ("YAML", &yaml)] {
        let ours = run(agent(exe, &node).arg("--manifests").arg(file));
        println!("agent, the same objects from a {what} file: {ours}");
        println!("  ratio file / API server (peak RSS): {}", ratio(ours.peak(), kube.peak()));
        if let Some(b) = baseline {
            let theirs = run(agent(b, &node).arg("--manifests").arg(file));
            println!("  baseline binary, {what} file: {theirs}");
            println!("  ratio new / baseline: {}", compare(&ours, &theirs));
        }
    }
    if target {
        let pass = kube.peak().is_some_and(|p| p <= 64);
        println!("target <= 64 MiB from the API server: {}", if pass { "PASS" } else { "MISS" });
    }
}

fn large_file(exe: &Path, baseline: Option<&Path>) {
    let shape = Shape {
        pods: 125_000,
        network_policies: 0,
        admin_policies: 1,
        rules_per_admin_policy: 1,
        ..Shape::LOAD_TEST
    };
    let inputs = synth::cluster(shape, 1);
    let node = inputs.nodes[0].metadata.name.clone().expect("node name");
    let i = &inputs;
    let all: Vec<serde_json::Value> = values(&i.namespaces)
        .chain(values(&i.nodes))
        .chain(values(&i.pods))
        .chain(values(&i.admin_network_policies))
        .chain(values(&i.baseline_admin_network_policies))
        .collect();
    let dir = tempfile::tempdir().expect("temp dir");
    let json = dir.path().join("pods.json");
    let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": all});
    std::fs::write(&json, list.to_string()).expect("manifest written");
    drop(list);
    drop(inputs);
    println!("{} MiB of JSON", std::fs::metadata(&json).map(|m| m.len() >> 20).unwrap_or(0));
    let ours = run(agent(exe, &node).arg("--manifests").arg(&json));
    println!("agent: {ours}");
    if let Some(b) = baseline {
        let theirs = run(agent(b, &node).arg("--manifests").arg(&json));
        println!("baseline binary: {theirs}");
        println!("ratio new / baseline: {}", compare(&ours, &theirs));
    }
}
