//! The synthetic cluster generator (benchmarks, load tests) must produce valid input, or
//! the benchmarks would measure an engine that dropped the invalid objects.

use tierproxy::policy::{Revision, Snapshot};
use tierproxy::synth::{self, Shape};

#[test]
fn synthetic_cluster_is_valid_and_deterministic() {
    let shape = Shape {
        namespaces: 20,
        pods: 200,
        nodes: 4,
        network_policies: 30,
        admin_policies: 12,
        rules_per_admin_policy: 10,
        max_peers: 10,
        admin_selects_all: false,
    };
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
