//! Property tests of invariants of the tiered model (DESIGN §2), over random small
//! clusters and policy sets built from a small label vocabulary so that selectors overlap.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use proptest::prelude::*;
use serde_json::{Value, json};
use tierproxy::policy::api::{Namespace, NetworkPolicy, Pod, v1alpha1};
use tierproxy::policy::{
    Basis, Decision, Direction, Flow, Inputs, Protocol, Revision, Snapshot, Tier,
};

const NAMESPACES: usize = 3;
const EXTERNAL: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 5);

fn pod_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 0, 0, i as u8 + 1)
}

/// A label selector over the vocabulary: `{}` or `{key: value}`.
fn selector(key: &'static str, values: &'static [&'static str]) -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!({})),
        prop::sample::select(values).prop_map(move |v| json!({"matchLabels": {key: v}})),
    ]
}

fn ns_selector() -> impl Strategy<Value = Value> {
    selector("env", &["a", "b"])
}

fn pod_selector() -> impl Strategy<Value = Value> {
    selector("app", &["x", "y", "z"])
}

/// Peers of ANP rules, BANP rules (no domainNames) and NP rules.
fn admin_peer() -> impl Strategy<Value = Value> {
    prop_oneof![
        ns_selector().prop_map(|s| json!({"namespaces": s})),
        (ns_selector(), pod_selector())
            .prop_map(|(n, p)| json!({"pods": {"namespaceSelector": n, "podSelector": p}})),
        cidr().prop_map(|c| json!({"networks": [c]})),
    ]
}

fn cidr() -> impl Strategy<Value = String> {
    prop_oneof![
        (0u8..8, 29u8..=32).prop_map(|(i, len)| format!("10.0.0.{}/{len}", i + 1)),
        Just("10.0.0.0/24".to_string()),
        Just("203.0.113.0/24".to_string()),
    ]
}

fn ports(named: bool) -> impl Strategy<Value = Option<Value>> {
    let named_port = if named { "http" } else { "" };
    prop_oneof![
        Just(None),
        // CEL forbids named ports with networks peers, which egress rules here may have.
        Just(if named { Some(json!([{"namedPort": named_port}])) } else { None }),
        prop::sample::select(&[80u16, 443][..])
            .prop_map(|p| Some(json!([{"portNumber": {"protocol": "TCP", "port": p}}]))),
        Just(Some(json!([{"portRange": {"protocol": "UDP", "start": 53, "end": 80}}]))),
    ]
}

fn admin_rule(
    actions: &'static [&'static str],
    peer_field: &'static str,
) -> impl Strategy<Value = Value> {
    let named = peer_field == "from";
    (prop::sample::select(actions), prop::collection::vec(admin_peer(), 1..3), ports(named))
        .prop_map(move |(action, peers, ports)| {
            let mut r = json!({"action": action, peer_field: peers});
            if let Some(p) = ports {
                r["ports"] = p;
            }
            r
        })
}

/// Keeps only peers legal in ingress rules (namespaces, pods).
fn ingress_only(mut rule: Value) -> Value {
    if let Some(peers) = rule["from"].as_array_mut() {
        peers.retain(|p| p.get("networks").is_none());
        if peers.is_empty() {
            peers.push(json!({"namespaces": {}}));
        }
    }
    rule
}

fn subject() -> impl Strategy<Value = Value> {
    prop_oneof![
        ns_selector().prop_map(|s| json!({"namespaces": s})),
        (ns_selector(), pod_selector())
            .prop_map(|(n, p)| json!({"pods": {"namespaceSelector": n, "podSelector": p}})),
    ]
}

fn anp(i: usize) -> impl Strategy<Value = v1alpha1::AdminNetworkPolicy> {
    (
        0i32..4,
        subject(),
        prop::collection::vec(admin_rule(&["Allow", "Deny", "Pass"], "from"), 0..3),
        prop::collection::vec(admin_rule(&["Allow", "Deny", "Pass"], "to"), 0..3),
    )
        .prop_map(move |(priority, subject, ingress, egress)| {
            let ingress: Vec<Value> = ingress.into_iter().map(ingress_only).collect();
            serde_json::from_value(json!({
                "apiVersion": "policy.networking.k8s.io/v1alpha1",
                "kind": "AdminNetworkPolicy",
                "metadata": {"name": format!("anp-{i}")},
                "spec": {"priority": priority, "subject": subject, "ingress": ingress, "egress": egress},
            }))
            .expect("generated ANP decodes")
        })
}

fn banp() -> impl Strategy<Value = v1alpha1::BaselineAdminNetworkPolicy> {
    (
        subject(),
        prop::collection::vec(admin_rule(&["Allow", "Deny"], "from"), 0..3),
        prop::collection::vec(admin_rule(&["Allow", "Deny"], "to"), 0..3),
    )
        .prop_map(|(subject, ingress, egress)| {
            let ingress: Vec<Value> = ingress.into_iter().map(ingress_only).collect();
            serde_json::from_value(json!({
                "apiVersion": "policy.networking.k8s.io/v1alpha1",
                "kind": "BaselineAdminNetworkPolicy",
                "metadata": {"name": "default"},
                "spec": {"subject": subject, "ingress": ingress, "egress": egress},
            }))
            .expect("generated BANP decodes")
        })
}

fn np_peer() -> impl Strategy<Value = Value> {
    prop_oneof![
        pod_selector().prop_map(|p| json!({"podSelector": p})),
        ns_selector().prop_map(|n| json!({"namespaceSelector": n})),
        (ns_selector(), pod_selector())
            .prop_map(|(n, p)| json!({"namespaceSelector": n, "podSelector": p})),
        cidr().prop_map(|c| json!({"ipBlock": {"cidr": c}})),
        Just(json!({"ipBlock": {"cidr": "10.0.0.0/24", "except": ["10.0.0.0/30", "10.0.0.6/31"]}})),
    ]
}

fn np_ports() -> impl Strategy<Value = Option<Value>> {
    prop_oneof![
        Just(None),
        Just(Some(json!([{"port": 80}]))),
        Just(Some(json!([{"port": "http"}]))),
        Just(Some(json!([{"port": "dns", "protocol": "UDP"}]))),
        Just(Some(json!([{"protocol": "UDP", "port": 53, "endPort": 80}]))),
    ]
}

fn np(i: usize) -> impl Strategy<Value = NetworkPolicy> {
    (
        0..NAMESPACES,
        pod_selector(),
        prop::collection::vec((prop::collection::vec(np_peer(), 0..3), np_ports()), 0..3),
        prop::option::of(prop::collection::vec(
            (prop::collection::vec(np_peer(), 0..3), np_ports()),
            0..3,
        )),
    )
        .prop_map(move |(ns, sel, ingress, egress)| {
            let rules = |peer_field: &str, rules: Vec<(Vec<Value>, Option<Value>)>| -> Vec<Value> {
                rules
                    .into_iter()
                    .map(|(peers, ports)| {
                        let mut r = json!({peer_field: peers});
                        if let Some(p) = ports {
                            r["ports"] = p;
                        }
                        r
                    })
                    .collect()
            };
            let mut spec = json!({"podSelector": sel, "ingress": rules("from", ingress)});
            if let Some(e) = egress {
                spec["egress"] = json!(rules("to", e));
            }
            serde_json::from_value(json!({
                "apiVersion": "networking.k8s.io/v1",
                "kind": "NetworkPolicy",
                "metadata": {"name": format!("np-{i}"), "namespace": format!("ns{ns}")},
                "spec": spec,
            }))
            .expect("generated NP decodes")
        })
}

fn cluster() -> impl Strategy<Value = (Vec<Namespace>, Vec<Pod>)> {
    (
        prop::collection::vec(prop::sample::select(&["a", "b"][..]), NAMESPACES),
        prop::collection::vec((0..NAMESPACES, prop::sample::select(&["x", "y", "z"][..])), 2..8),
    )
        .prop_map(|(ns_env, pods)| {
            let namespaces = ns_env
                .iter()
                .enumerate()
                .map(|(i, env)| {
                    serde_json::from_value(json!({"metadata": {"name": format!("ns{i}"), "labels": {"env": env}}}))
                        .expect("namespace decodes")
                })
                .collect();
            let pods = pods
                .iter()
                .enumerate()
                .map(|(i, (ns, app))| {
                    serde_json::from_value(json!({
                        "metadata": {"name": format!("p{i}"), "namespace": format!("ns{ns}"), "labels": {"app": app}},
                        "spec": {"containers": [{"name": "c", "ports": [
                            {"name": "http", "containerPort": 80},
                            {"name": "dns", "containerPort": 53, "protocol": "UDP"},
                        ]}]},
                        "status": {"podIP": pod_ip(i).to_string()},
                    }))
                    .expect("pod decodes")
                })
                .collect();
            (namespaces, pods)
        })
}

fn inputs() -> impl Strategy<Value = Inputs> {
    (
        cluster(),
        prop::collection::vec(0..1usize, 0..4)
            .prop_flat_map(|v| v.iter().enumerate().map(|(i, _)| anp(i)).collect::<Vec<_>>()),
        prop::collection::vec(0..1usize, 0..4)
            .prop_flat_map(|v| v.iter().enumerate().map(|(i, _)| np(i)).collect::<Vec<_>>()),
        prop::option::of(banp()),
    )
        .prop_map(|((namespaces, pods), anps, nps, banp)| Inputs {
            namespaces: namespaces.into_iter().map(Arc::new).collect(),
            pods: pods.into_iter().map(Arc::new).collect(),
            network_policies: nps.into_iter().map(Arc::new).collect(),
            admin_network_policies: anps.into_iter().map(Arc::new).collect(),
            baseline_admin_network_policies: banp.into_iter().map(Arc::new).collect(),
            ..Inputs::default()
        })
}

fn compile(i: &Inputs) -> Snapshot {
    let c = Snapshot::compile(i, Revision(1));
    let errors: Vec<_> = c.problems.iter().filter(|p| p.is_error()).collect();
    assert!(errors.is_empty(), "generated input is invalid: {errors:?}");
    c.snapshot
}

/// Every flow between pods (and to/from one external address), TCP 80/443 and UDP 53.
fn flows(i: &Inputs) -> Vec<Flow> {
    let mut ips: Vec<IpAddr> = (0..i.pods.len()).map(|p| IpAddr::V4(pod_ip(p))).collect();
    ips.push(IpAddr::V4(EXTERNAL));
    let mut out = Vec::new();
    for &src in &ips {
        for &dst in &ips {
            if src == dst {
                continue;
            }
            for (protocol, dst_port) in
                [(Protocol::Tcp, 80), (Protocol::Tcp, 443), (Protocol::Udp, 53)]
            {
                out.push(Flow { src, dst, protocol, dst_port });
            }
        }
    }
    out
}

/// A decision without indexes: verdicts, tiers and policy names per direction.
fn summary(s: &Snapshot, d: &Decision) -> String {
    let side = |o: &Option<tierproxy::policy::Outcome>| match o {
        None => "n/a".to_string(),
        Some(o) => {
            let basis = match o.basis {
                Basis::Rule { tier, hit } => {
                    format!("{}:{}#{}", tier.as_str(), s.policy_ref(hit.policy).name, hit.rule)
                }
                Basis::Isolated { .. } => "isolation".to_string(),
                Basis::NoPolicy => "default".to_string(),
                Basis::OwnNode => "own-node".to_string(),
            };
            let passed: Vec<String> =
                o.passed.iter().map(|h| s.policy_ref(h.policy).name.clone()).collect();
            format!("{:?}/{basis}/{passed:?}", o.verdict)
        }
    };
    format!("{:?} e={} i={}", d.verdict, side(&d.egress), side(&d.ingress))
}

fn admin_decided(o: &Option<tierproxy::policy::Outcome>) -> bool {
    matches!(o, Some(o) if matches!(o.basis, Basis::Rule { tier: Tier::Admin, .. }))
}

/// Cases per property ([`ProptestConfig::cases`]).
const CASES: u32 = 128;

/// Runs `test` on [`CASES`] values of `strategy`, as `proptest!` does (a failure is shrunk,
/// and persisted beside this file), and returns how many cases reached the branch the
/// property guards: `test` says whether its case did. A property that holds only where a
/// condition holds says nothing if the condition never does; its caller asserts the count.
fn counting<S: Strategy>(
    strategy: S,
    test: impl Fn(S::Value) -> Result<bool, TestCaseError>,
) -> usize {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let reached = AtomicUsize::new(0);
    let config =
        ProptestConfig { cases: CASES, source_file: Some(file!()), ..ProptestConfig::default() };
    let mut runner = proptest::test_runner::TestRunner::new(config);
    let result = runner.run(&strategy, |v| {
        if test(v)? {
            reached.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    reached.into_inner()
}

/// An admin-tier Allow or Deny is never overridden: removing every NetworkPolicy and the
/// BANP leaves each admin-decided direction exactly as it was.
#[test]
fn admin_decisions_are_not_overridden() {
    let reached = counting(inputs(), |i| {
        let full = compile(&i);
        let admin_only = compile(&Inputs {
            network_policies: vec![],
            baseline_admin_network_policies: vec![],
            ..i.clone()
        });
        let mut reached = false;
        for f in flows(&i) {
            let d = full.decide(&f);
            let a = admin_only.decide(&f);
            if admin_decided(&d.egress) {
                prop_assert_eq!(&d.egress, &a.egress);
                reached = true;
            }
            if admin_decided(&d.ingress) {
                prop_assert_eq!(&d.ingress, &a.ingress);
                reached = true;
            }
        }
        Ok(reached)
    });
    assert!(reached > 0, "no case of {CASES} had a direction the admin tier decided");
}

/// Adding a BANP never changes a direction that the admin or NetworkPolicy tier decided.
#[test]
fn banp_never_changes_what_higher_tiers_decided() {
    let reached = counting((inputs(), banp()), |(i, b)| {
        let without = compile(&Inputs { baseline_admin_network_policies: vec![], ..i.clone() });
        let with =
            compile(&Inputs { baseline_admin_network_policies: vec![Arc::new(b)], ..i.clone() });
        let higher = |o: &Option<tierproxy::policy::Outcome>| {
            matches!(
                o,
                Some(o) if matches!(
                    o.basis,
                    Basis::Rule { tier: Tier::Admin | Tier::NetworkPolicy, .. } | Basis::Isolated { .. }
                )
            )
        };
        let mut reached = false;
        for f in flows(&i) {
            let a = without.decide(&f);
            let b = with.decide(&f);
            // Policy indexes are equal too: the BANP sorts after every admin and NP policy.
            if higher(&a.egress) {
                prop_assert_eq!(&a.egress, &b.egress);
                reached = true;
            }
            if higher(&a.ingress) {
                prop_assert_eq!(&a.ingress, &b.ingress);
                reached = true;
            }
        }
        Ok(reached)
    });
    assert!(reached > 0, "no case of {CASES} had a direction a higher tier decided");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: CASES, ..ProptestConfig::default() })]

    /// Verdicts (and what decided them) do not depend on the order of objects.
    #[test]
    fn order_does_not_matter(i in inputs(), seed in any::<u64>()) {
        let a = compile(&i);
        let mut shuffled = i.clone();
        let mut rng = seed;
        let mut shuffle = |n: usize| -> Vec<usize> {
            let mut idx: Vec<usize> = (0..n).collect();
            for k in (1..n).rev() {
                rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                idx.swap(k, (rng >> 33) as usize % (k + 1));
            }
            idx
        };
        let perm = shuffle(i.pods.len());
        shuffled.pods = perm.iter().map(|&k| i.pods[k].clone()).collect();
        let perm = shuffle(i.network_policies.len());
        shuffled.network_policies = perm.iter().map(|&k| i.network_policies[k].clone()).collect();
        let perm = shuffle(i.admin_network_policies.len());
        shuffled.admin_network_policies = perm.iter().map(|&k| i.admin_network_policies[k].clone()).collect();
        shuffled.namespaces.reverse();
        let b = compile(&shuffled);
        for f in flows(&i) {
            prop_assert_eq!(summary(&a, &a.decide(&f)), summary(&b, &b.decide(&f)), "flow {:?}", f);
        }
    }

    /// The precompiled rule masks pick exactly the rule the plain rule-by-rule walk picks,
    /// for every policy, direction and flow.
    #[test]
    fn matcher_agrees_with_reference_walk(i in inputs()) {
        let s = compile(&i);
        for f in flows(&i) {
            for pid in 0..s.policy_count() {
                for (dir, peer) in [(Direction::Egress, f.dst), (Direction::Ingress, f.src)] {
                    prop_assert_eq!(
                        s.first_rule_fast(pid, dir, peer, &f),
                        s.first_rule_reference(pid, dir, peer, &f),
                        "policy {} {:?} flow {:?}", s.policy_ref(pid), dir, f
                    );
                }
            }
        }
    }

    /// The fast path (port index + rule masks) decides exactly as the plain walk over
    /// every applicable policy, rule and peer.
    #[test]
    fn decide_agrees_with_reference(i in inputs()) {
        let s = compile(&i);
        for f in flows(&i) {
            prop_assert_eq!(s.decide(&f), s.decide_reference(&f), "flow {:?}", f);
        }
    }

    /// An ipBlock allows exactly the addresses inside `cidr` and outside every `except`,
    /// computed here with integer masks, independently of the engine's CIDR code.
    #[test]
    fn ip_block_except_containment(
        base in any::<u32>(), len in 8u8..=30, ex_off in any::<u32>(), ex_extra in 1u8..=8, probe in any::<u32>(),
    ) {
        let mask = |l: u8| if l == 0 { 0 } else { u32::MAX << (32 - l) };
        let net = base & mask(len);
        let ex_len = (len + ex_extra).min(32);
        let ex = (net | (ex_off & !mask(len))) & mask(ex_len);
        // Probe inside the block most of the time.
        let ip = net | (probe & !mask(len));
        let expected = (ip & mask(len)) == net && (ip & mask(ex_len)) != ex;
        let ipv4 = |v: u32| Ipv4Addr::from(v);
        let i = Inputs {
            namespaces: vec![serde_json::from_value(json!({"metadata": {"name": "ns"}})).unwrap()],
            pods: vec![serde_json::from_value(json!({
                "metadata": {"name": "p", "namespace": "ns"},
                "spec": {"containers": [{"name": "c"}]},
                // 0.0.0.1 is never equal to the probe address below unless by chance; skip then.
                "status": {"podIP": "192.0.2.1"},
            })).unwrap()],
            network_policies: vec![serde_json::from_value(json!({
                "metadata": {"name": "b", "namespace": "ns"},
                "spec": {"podSelector": {}, "ingress": [{"from": [{"ipBlock": {
                    // Host bits set on purpose: the engine must mask them.
                    "cidr": format!("{}/{len}", ipv4(base)),
                    "except": [format!("{}/{ex_len}", ipv4(ex))],
                }}]}]},
            })).unwrap()],
            ..Inputs::default()
        };
        prop_assume!(ipv4(ip) != Ipv4Addr::new(192, 0, 2, 1));
        let s = compile(&i);
        let d = s.decide(&Flow { src: IpAddr::V4(ipv4(ip)), dst: "192.0.2.1".parse().unwrap(), protocol: Protocol::Tcp, dst_port: 80 });
        prop_assert_eq!(d.verdict == tierproxy::policy::Verdict::Allow, expected, "ip {} block {}/{} except {}/{}", ipv4(ip), ipv4(net), len, ipv4(ex), ex_len);
    }

    /// A CIDR with host bits set means the same network as its masked form.
    #[test]
    fn host_bits_are_masked(addr in any::<u32>(), len in 0u8..=32, probe in any::<u32>()) {
        let with_bits = tierproxy::policy::cidr::parse(&format!("{}/{len}", Ipv4Addr::from(addr))).unwrap();
        let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
        let masked = tierproxy::policy::cidr::parse(&format!("{}/{len}", Ipv4Addr::from(addr & mask))).unwrap();
        prop_assert_eq!(with_bits, masked);
        let ip = IpAddr::V4(Ipv4Addr::from(probe));
        prop_assert_eq!(with_bits.contains(&ip), (probe & mask) == (addr & mask));
    }
}

/// The problems of a compile as sorted lines (their order within a kind is not part of
/// the contract the builder keeps).
fn problem_lines(problems: &[tierproxy::policy::Problem]) -> Vec<String> {
    let mut lines: Vec<String> = problems.iter().map(|p| format!("{:?}", p)).collect();
    lines.sort();
    lines
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Issue #21, item 1: the agent's builder (each object validated once per version,
    /// results carried between builds, one compile of the admitted objects) decides every
    /// flow and reports every problem as a full compile of the same objects does, also
    /// when the previous build held other versions of objects of the same names.
    #[test]
    fn the_builder_decides_and_reports_as_a_full_compile(a in inputs(), b in inputs()) {
        use tierproxy::cluster::builder::Builder;
        use tierproxy::cluster::manifest::Loaded;
        let mut builder = Builder::new();
        for (n, i) in [&a, &b, &a].into_iter().enumerate() {
            let loaded = Loaded { inputs: i.clone(), ..Loaded::default() };
            let built = builder.build(loaded, Revision(n as u64 + 1), None).expect("no file errors");
            let full = Snapshot::compile(i, Revision(n as u64 + 1));
            let mut full_problems = full.problems;
            full_problems.extend(tierproxy::policy::compile::priority_conflicts(&full.snapshot));
            prop_assert_eq!(problem_lines(&built.problems), problem_lines(&full_problems), "build {}", n);
            for f in flows(i) {
                prop_assert_eq!(
                    summary(&built.snapshot, &built.snapshot.decide(&f)),
                    summary(&full.snapshot, &full.snapshot.decide(&f)),
                    "build {}, flow {:?}", n, f
                );
            }
        }
    }
}

/// One change between two compiles of [`an_incremental_compile_decides_as_a_full_compile`]:
/// pod or namespace labels and policy edits, moves in the evaluation order included (which
/// a [`Compiler`](tierproxy::policy::compile::Compiler) patches), or a change it compiles
/// in full.
#[derive(Debug, Clone)]
enum Change {
    /// Pod `.0`'s `app` label set to `.1` (removed: `None`).
    PodApp(usize, Option<&'static str>),
    /// Namespace `.0`'s `env` label set to `.1` (removed: `None`).
    NamespaceEnv(usize, Option<&'static str>),
    /// An ANP's subject replaced by `.1`, and its last egress rule replaced by `.2` (or
    /// dropped): new pod sets, peers and ports.
    AnpEdit(usize, Value, Option<Value>),
    /// An ANP's first rule dropped (ingress with `.1`, else egress): the rules after it
    /// move up one position.
    AnpDropFirst(usize, bool),
    /// A NetworkPolicy's `podSelector` replaced by `.1`, and with `.2` its ingress rules
    /// dropped.
    NpEdit(usize, Value, bool),
    /// An ANP's priority set to `.1` (moves it among the others, or ties it with one,
    /// whose order is then by name).
    AnpPriority(usize, i32),
    /// A pod deleted: compiled in full.
    DeletePod(usize),
}

fn change() -> impl Strategy<Value = Change> {
    let app = prop::option::of(prop::sample::select(&["x", "y", "z"][..]));
    let env = prop::option::of(prop::sample::select(&["a", "b"][..]));
    prop_oneof![
        6 => (any::<usize>(), app).prop_map(|(i, v)| Change::PodApp(i, v)),
        3 => (any::<usize>(), env).prop_map(|(i, v)| Change::NamespaceEnv(i, v)),
        2 => (any::<usize>(), subject(), prop::option::of(admin_rule(&["Allow", "Deny", "Pass"], "to")))
            .prop_map(|(i, s, r)| Change::AnpEdit(i, s, r)),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(i, d)| Change::AnpDropFirst(i, d)),
        2 => (any::<usize>(), pod_selector(), any::<bool>()).prop_map(|(i, s, d)| Change::NpEdit(i, s, d)),
        2 => (any::<usize>(), 0i32..6).prop_map(|(i, p)| Change::AnpPriority(i, p)),
        1 => any::<usize>().prop_map(Change::DeletePod),
    ]
}

/// ANP `k` (modulo their number, if any) replaced by a copy `edit` changed; a patch covers
/// it.
fn edit_anp(
    i: &mut Inputs,
    k: usize,
    edit: impl FnOnce(&mut v1alpha1::AdminNetworkPolicy),
) -> bool {
    if !i.admin_network_policies.is_empty() {
        let k = k % i.admin_network_policies.len();
        let mut anp = (*i.admin_network_policies[k]).clone();
        edit(&mut anp);
        i.admin_network_policies[k] = Arc::new(anp);
    }
    true
}

/// `change` applied to `i`; whether a patch covers it.
fn apply(i: &mut Inputs, change: &Change) -> bool {
    fn set(
        labels: &mut Option<std::collections::BTreeMap<String, String>>,
        key: &str,
        v: Option<&str>,
    ) {
        let labels = labels.get_or_insert_default();
        match v {
            Some(v) => labels.insert(key.into(), v.into()),
            None => labels.remove(key),
        };
    }
    match *change {
        Change::PodApp(k, v) => {
            if !i.pod_views.is_empty() {
                let k = k % i.pod_views.len();
                let mut view = (*i.pod_views[k]).clone();
                let mut labels =
                    Some(view.labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
                set(&mut labels, "app", v);
                view.labels = labels.unwrap_or_default().into();
                i.pod_views[k] = Arc::new(view);
            } else {
                let k = k % i.pods.len();
                let mut pod = (*i.pods[k]).clone();
                set(&mut pod.metadata.labels, "app", v);
                i.pods[k] = Arc::new(pod);
            }
            true
        }
        Change::NamespaceEnv(k, v) => {
            let k = k % i.namespaces.len();
            let mut ns = (*i.namespaces[k]).clone();
            set(&mut ns.metadata.labels, "env", v);
            i.namespaces[k] = Arc::new(ns);
            true
        }
        Change::AnpEdit(k, ref subject, ref rule) => edit_anp(i, k, |anp| {
            anp.spec.subject = serde_json::from_value(subject.clone()).expect("subject decodes");
            anp.spec.egress.pop();
            if let Some(rule) = rule {
                anp.spec.egress.push(serde_json::from_value(rule.clone()).expect("rule decodes"));
            }
        }),
        Change::AnpDropFirst(k, ingress) => edit_anp(i, k, |anp| {
            if ingress && !anp.spec.ingress.is_empty() {
                anp.spec.ingress.remove(0);
            } else if !anp.spec.egress.is_empty() {
                anp.spec.egress.remove(0);
            }
        }),
        Change::NpEdit(k, ref selector, drop_rules) => {
            if i.network_policies.is_empty() {
                return true;
            }
            let k = k % i.network_policies.len();
            let mut np = (*i.network_policies[k]).clone();
            let spec = np.spec.get_or_insert_default();
            spec.pod_selector = Some(serde_json::from_value(selector.clone()).expect("decodes"));
            if drop_rules {
                spec.ingress = None;
            }
            i.network_policies[k] = Arc::new(np);
            true
        }
        Change::AnpPriority(k, priority) => edit_anp(i, k, |anp| anp.spec.priority = priority),
        Change::DeletePod(k) => {
            let list_len = i.pods.len() + i.pod_views.len();
            if list_len <= 1 {
                return true;
            }
            if !i.pod_views.is_empty() {
                i.pod_views.remove(k % i.pod_views.len());
            } else {
                i.pods.remove(k % i.pods.len());
            }
            false
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: CASES, ..ProptestConfig::default() })]

    /// Issue #21, item 2: a compiler that patches its previous snapshot after label
    /// changes (and compiles in full after other changes) decides every flow and reports
    /// every problem as a full compile of the same objects, change after change, with pods
    /// given whole or as views, and the same priority conflicts; label changes and policy
    /// edits (priority changes included) are patched.
    #[test]
    fn an_incremental_compile_decides_as_a_full_compile(
        start in inputs(),
        views in any::<bool>(),
        steps in prop::collection::vec(prop::collection::vec(change(), 1..4), 1..6),
    ) {
        use tierproxy::policy::PodView;
        use tierproxy::policy::compile::{Compiler, Pass};
        // Every address the start's pods hold, deleted pods' too (external then).
        let all_flows = flows(&start);
        let mut i = start;
        if views {
            i.pod_views = i.pods.drain(..).map(|p| Arc::new(PodView::from_pod(&p))).collect();
        }
        let mut compiler = Compiler::new();
        // The previous snapshot, with a full compile of its inputs: a patch must leave it
        // as it was (deciders may still use it).
        let mut previous = (compiler.compile(&i, Revision(1)).snapshot, Snapshot::compile(&i, Revision(1)).snapshot);
        for (n, changes) in steps.iter().enumerate() {
            let mut patchable = true;
            for c in changes {
                patchable &= apply(&mut i, c);
            }
            let revision = Revision(n as u64 + 2);
            let patched = compiler.compile(&i, revision);
            if patchable {
                prop_assert!(
                    matches!(compiler.last_pass(), Pass::Patched { .. }),
                    "step {}: {:?} compiled as {}", n, changes, compiler.last_pass()
                );
            }
            let full = Snapshot::compile(&i, revision);
            prop_assert_eq!(patched.snapshot.revision(), revision);
            prop_assert_eq!(problem_lines(&patched.problems), problem_lines(&full.problems), "step {}", n);
            {
                use tierproxy::policy::compile::priority_conflicts;
                prop_assert_eq!(
                    format!("{:?}", priority_conflicts(&patched.snapshot)),
                    format!("{:?}", priority_conflicts(&full.snapshot)),
                    "step {}: priority conflicts", n
                );
            }
            for f in &all_flows {
                prop_assert_eq!(
                    summary(&patched.snapshot, &patched.snapshot.decide(f)),
                    summary(&full.snapshot, &full.snapshot.decide(f)),
                    "step {}: {:?}, flow {:?}", n, changes, f
                );
                prop_assert_eq!(
                    summary(&previous.0, &previous.0.decide(f)),
                    summary(&previous.1, &previous.1.decide(f)),
                    "step {}: the previous snapshot changed; flow {:?}", n, f
                );
            }
            previous = (patched.snapshot, full.snapshot);
        }
    }
}
