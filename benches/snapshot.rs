//! What a change costs until the next snapshot is in force: the agent's builder
//! ([`tierproxy::cluster::builder::Builder`]) on the large synthetic cluster of issue #2
//! (10,000 pods as the API source keeps them, 1,000 NetworkPolicies, 100 ANPs × 100
//! rules, a BANP), issue #21 item 2.
//!
//! Run: `cargo bench --bench snapshot` (`SNAPSHOT_CHURN_SECS` sets the churn phase's
//! length, 60 s by default, 0 to skip it; `SNAPSHOT_ROUNDS` the rounds per single change,
//! 20; `SNAPSHOT_ONLY=<text>` runs only the single changes whose name holds it). It
//! prints, measured in the same run:
//! - the first build (every object validated, then compiled) next to
//!   [`Snapshot::compile`] of the same objects (validation inside the compile), the
//!   baseline of everything below;
//! - a new snapshot after one change, per kind of change: a pod's labels, one
//!   NetworkPolicy's spec, one ANP's rules, one ANP's priority, a namespace's labels (p50 /
//!   p99 / max over the rounds, and how the last build compiled: patched or in full, and
//!   why; the targets of issue #21: ≤ 5 ms p99 for a pod or a policy, ≤ 20 ms for a
//!   namespace);
//! - churn: 100 pod-label changes a second for the churn phase, each followed by a build,
//!   while another thread decides random flows on whichever snapshot is in force (swapped
//!   in as the agent does): snapshot latency p50 / p99 (from the change to the snapshot
//!   in force), changes merged into one build when builds fall behind, and decide p99
//!   during the churn next to decide p99 with no churn.

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use tierproxy::cluster::builder::Builder;
use tierproxy::cluster::manifest::Loaded;
use tierproxy::policy::api::v1alpha1::AdminNetworkPolicy;
use tierproxy::policy::api::{Namespace, NetworkPolicy};
use tierproxy::policy::{Inputs, PodView, Revision, Snapshot};
use tierproxy::synth::{self, Shape};

const SEED: u64 = 2091;

/// The synthetic cluster with its pods as views, as the API source holds them.
fn inputs() -> Inputs {
    let mut i = synth::cluster(Shape::LARGE, SEED);
    i.pod_views = i.pods.drain(..).map(|p| Arc::new(PodView::from_pod(&p))).collect();
    i
}

fn loaded(i: &Inputs) -> Loaded {
    Loaded { inputs: i.clone(), ..Loaded::default() }
}

/// p50, p99, max of `d`, in ms.
fn percentiles(mut d: Vec<Duration>) -> (f64, f64, f64) {
    d.sort();
    let at = |q: f64| d[((d.len() as f64 * q) as usize).min(d.len() - 1)].as_secs_f64() * 1e3;
    (at(0.5), at(0.99), d.last().map_or(0.0, |x| x.as_secs_f64() * 1e3))
}

/// `pods[k]` with one label value changed (`round` picks it, so every round changes).
fn relabel_pod(i: &mut Inputs, k: usize, round: usize) {
    let mut v = (*i.pod_views[k]).clone();
    let mut labels: std::collections::BTreeMap<String, String> =
        v.labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    labels.insert("tier".into(), ["web", "api", "db"][round % 3].into());
    v.labels = labels.into();
    i.pod_views[k] = Arc::new(v);
}

fn edit_network_policy(i: &mut Inputs, k: usize, round: usize) {
    let mut np: NetworkPolicy = (*i.network_policies[k]).clone();
    let spec = np.spec.get_or_insert_with(Default::default);
    let selector = spec.pod_selector.get_or_insert_with(Default::default);
    let tier = ["web", "api", "db"][round % 3];
    selector.match_labels.get_or_insert_with(Default::default).insert("tier".into(), tier.into());
    i.network_policies[k] = Arc::new(np);
}

/// One ANP's rules edited: its first egress rule's action flipped and its peers rotated
/// (its place in the evaluation order kept).
fn edit_admin_rules(i: &mut Inputs, k: usize, round: usize) {
    use tierproxy::policy::api::v1alpha1::AdminNetworkPolicyRuleAction as A;
    let mut anp: AdminNetworkPolicy = (*i.admin_network_policies[k]).clone();
    if let Some(rule) = anp.spec.egress.first_mut() {
        rule.action = if round.is_multiple_of(2) { A::Deny } else { A::Allow };
        let n = rule.to.len();
        rule.to.rotate_left(1 % n.max(1));
    }
    i.admin_network_policies[k] = Arc::new(anp);
}

/// One ANP's priority changed: its place in the evaluation order moves.
fn edit_admin_priority(i: &mut Inputs, k: usize, round: usize) {
    let mut anp: AdminNetworkPolicy = (*i.admin_network_policies[k]).clone();
    anp.spec.priority = (anp.spec.priority + 1 + round as i32) % 1000;
    i.admin_network_policies[k] = Arc::new(anp);
}

fn relabel_namespace(i: &mut Inputs, k: usize, round: usize) {
    let mut ns: Namespace = (*i.namespaces[k]).clone();
    ns.metadata
        .labels
        .get_or_insert_with(Default::default)
        .insert("env".into(), ["prod", "staging", "dev"][round % 3].into());
    i.namespaces[k] = Arc::new(ns);
}

/// A change to one object (`index`, `round`) of the inputs.
type Change = fn(&mut Inputs, usize, usize);

/// Builds after each of `rounds` changes made by `change` (on object `round * 37 % n`).
/// How the builder's last build compiled.
fn builder_pass(b: &Builder) -> String {
    b.last_pass().to_string()
}

fn single_changes(
    builder: &mut Builder,
    i: &mut Inputs,
    revision: &mut u64,
    rounds: usize,
    n: usize,
    change: Change,
) -> Vec<Duration> {
    (0..rounds)
        .map(|round| {
            change(i, round * 37 % n, round);
            *revision += 1;
            let started = Instant::now();
            let built = builder.build(loaded(i), Revision(*revision), None).expect("builds");
            let took = started.elapsed();
            black_box(built);
            took
        })
        .collect()
}

/// Decides random flows on the snapshot in force until `stop`; each call timed alone.
fn decide_loop(current: &ArcSwap<Snapshot>, stop: &AtomicBool) -> Vec<u64> {
    let flows = synth::flows(Shape::LARGE, 4096, SEED + 1);
    let mut ns = Vec::with_capacity(1 << 20);
    let mut k = 0;
    while !stop.load(Ordering::Relaxed) && ns.len() < 20_000_000 {
        let s = current.load();
        for _ in 0..256 {
            k = (k + 1) % flows.len();
            let t = Instant::now();
            black_box(s.decide(black_box(&flows[k])));
            ns.push(t.elapsed().as_nanos() as u64);
        }
    }
    ns
}

fn p99_ns(mut ns: Vec<u64>) -> u64 {
    ns.sort_unstable();
    ns[((ns.len() as f64 * 0.99) as usize).min(ns.len() - 1)]
}

fn main() {
    let rounds: usize =
        std::env::var("SNAPSHOT_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    let churn_secs: u64 =
        std::env::var("SNAPSHOT_CHURN_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(60);
    let mut i = inputs();
    println!("== tierproxy snapshot benchmark (seed {SEED}, issue #21 item 2) ==");
    println!(
        "cluster: {} pods (views), {} namespaces, {} NetworkPolicies, {} ANPs x {} rules, 1 BANP",
        i.pod_views.len(),
        i.namespaces.len(),
        i.network_policies.len(),
        i.admin_network_policies.len(),
        Shape::LARGE.rules_per_admin_policy
    );

    let compile: Vec<Duration> = (0..5)
        .map(|_| {
            let t = Instant::now();
            black_box(Snapshot::compile(&i, Revision(1)));
            t.elapsed()
        })
        .collect();
    let firsts: Vec<Duration> = (0..5)
        .map(|_| {
            let t = Instant::now();
            black_box(Builder::new().build(loaded(&i), Revision(1), None).expect("builds"));
            t.elapsed()
        })
        .collect();
    let (c50, _, _) = percentiles(compile);
    let (f50, _, _) = percentiles(firsts);
    println!("Snapshot::compile (validation inside):  median {c50:.1} ms (the baseline)");
    println!(
        "builder, first build:                   median {f50:.1} ms ({:.2}x compile)",
        f50 / c50
    );

    let mut builder = Builder::new();
    let mut revision = 1;
    builder.build(loaded(&i), Revision(revision), None).expect("builds");
    let cases: [(&str, usize, Change, f64); 5] = [
        ("one pod's labels", i.pod_views.len(), relabel_pod, 5.0),
        ("one NetworkPolicy's spec", i.network_policies.len(), edit_network_policy, 5.0),
        ("one ANP's rules", i.admin_network_policies.len(), edit_admin_rules, 5.0),
        ("one ANP's priority", i.admin_network_policies.len(), edit_admin_priority, 5.0),
        ("one namespace's labels", i.namespaces.len(), relabel_namespace, 20.0),
    ];
    let only = std::env::var("SNAPSHOT_ONLY").ok();
    for (what, n, change, target) in cases {
        if only.as_deref().is_some_and(|o| !what.contains(o)) {
            continue;
        }
        let d = single_changes(&mut builder, &mut i, &mut revision, rounds, n, change);
        let (p50, p99, max) = percentiles(d);
        println!(
            "after {what:<26} p50 {p50:7.1} ms  p99 {p99:7.1} ms  max {max:7.1} ms  ({:.3}x compile; target p99 <= {target} ms; last: {})",
            p99 / c50,
            builder_pass(&builder)
        );
    }

    // Decide with no churn, then during churn.
    let current = ArcSwap::from_pointee(
        builder.build(loaded(&i), Revision(revision), None).expect("builds").snapshot,
    );
    let stop = AtomicBool::new(false);
    let quiet = std::thread::scope(|s| {
        let h = s.spawn(|| decide_loop(&current, &stop));
        std::thread::sleep(Duration::from_secs(2));
        stop.store(true, Ordering::Relaxed);
        h.join().expect("decider")
    });
    let quiet_p99 = p99_ns(quiet);
    stop.store(false, Ordering::Relaxed);
    let (latencies, merged, during) = std::thread::scope(|s| {
        let h = s.spawn(|| decide_loop(&current, &stop));
        let every = Duration::from_millis(10);
        let start = Instant::now();
        let end = start + Duration::from_secs(churn_secs);
        let mut latencies = Vec::new();
        let mut merged = 0usize;
        let mut k = 0usize;
        let mut next = start;
        while next < end {
            // Every change due by now (100 a second), merged into one build as the agent's
            // reloader merges the changes that queued up while it built.
            let first_due = next;
            let mut changes = 0;
            while next <= Instant::now() && next < end {
                relabel_pod(&mut i, k * 7919 % 10_000, k);
                k += 1;
                changes += 1;
                next += every;
            }
            if changes == 0 {
                std::thread::sleep(next.saturating_duration_since(Instant::now()));
                continue;
            }
            merged += changes - 1;
            revision += 1;
            let built = builder.build(loaded(&i), Revision(revision), None).expect("builds");
            current.store(Arc::new(built.snapshot));
            latencies.push(first_due.elapsed());
        }
        stop.store(true, Ordering::Relaxed);
        (latencies, merged, h.join().expect("decider"))
    });
    let builds = latencies.len();
    if builds == 0 {
        return;
    }
    let (p50, p99, max) = percentiles(latencies);
    println!(
        "churn, 100 pod-label changes/s for {churn_secs} s: {builds} builds, {merged} changes merged into a later build"
    );
    println!("  change -> snapshot in force: p50 {p50:.1} ms  p99 {p99:.1} ms  max {max:.1} ms");
    println!(
        "  decide p99 during churn {} ns; without churn {} ns ({:.2}x; target p99 <= 2000 ns)",
        p99_ns(during.clone()),
        quiet_p99,
        p99_ns(during) as f64 / quiet_p99 as f64
    );
}
