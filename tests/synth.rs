//! The synthetic cluster generator (benchmarks, load tests) must produce valid input, or
//! the benchmarks would measure an engine that dropped the invalid objects.

use tierproxy::policy::{Basis, Revision, Snapshot, Verdict};
use tierproxy::synth::{self, Shape};

/// A small cluster of `pods` pods in 20 namespaces on 4 nodes, 30 NetworkPolicies and
/// 12 ANPs × 10 rules × ≤ 10 peers.
fn small(pods: usize) -> Shape {
    Shape {
        namespaces: 20,
        pods,
        nodes: 4,
        network_policies: 30,
        admin_policies: 12,
        rules_per_admin_policy: 10,
        max_peers: 10,
        admin_selects_all: false,
    }
}

#[test]
fn synthetic_cluster_is_valid_and_deterministic() {
    let shape = small(200);
    let inputs = synth::cluster(shape, 7);
    let c = Snapshot::compile(&inputs, Revision(1));
    let errors: Vec<String> =
        c.problems.iter().filter(|p| p.is_error()).map(|p| p.to_string()).collect();
    assert!(errors.is_empty(), "{}", errors.join("\n"));
    assert_eq!(c.snapshot.counts(), (200, 20, 4, 30 + 12 + 1));
    // Same seed, same flows and decisions.
    let again = Snapshot::compile(&synth::cluster(shape, 7), Revision(1)).snapshot;
    for f in synth::flows(shape, 500, 9) {
        assert_eq!(c.snapshot.decide(&f), again.decide(&f));
    }
}

/// The Antrea-native set of issue #22's benchmark compiles without errors, its policies
/// decide flows (some of them Reject, some decided in a custom Tier), and the fast path
/// agrees with the reference evaluation on every flow.
#[test]
fn synthetic_antrea_set_is_valid_decides_and_agrees_with_the_reference() {
    let shape = small(400);
    let antrea = synth::AntreaShape {
        custom_tiers: 8,
        acnps_per_tier: 10,
        annps: 40,
        rules_per_policy: 6,
        max_peers: 5,
    };
    let mut inputs = synth::cluster(shape, 7);
    inputs.antrea = synth::antrea(antrea, shape, 7);
    let c = Snapshot::compile(&inputs, Revision(1));
    let errors: Vec<String> =
        c.problems.iter().filter(|p| p.is_error()).map(|p| p.to_string()).collect();
    assert!(errors.is_empty(), "{}", errors.join("\n"));
    assert_eq!(c.snapshot.counts().3, 30 + 12 + 1 + (8 + 6) * 10 + 40);
    let s = &c.snapshot;
    let (mut rejects, mut custom) = (0, 0);
    for f in synth::flows(shape, 4000, 9) {
        let d = s.decide(&f);
        assert_eq!(d, s.decide_reference(&f), "{f:?}");
        rejects += usize::from(d.verdict == Verdict::Reject);
        for o in [&d.egress, &d.ingress].into_iter().flatten() {
            if let Basis::Rule { hit, .. } = o.basis {
                custom += usize::from(s.policy_tier_name(hit.policy).starts_with("tier-"));
            }
        }
    }
    assert!(rejects > 0 && custom > 0, "rejects {rejects}, custom-tier hits {custom}");
}
