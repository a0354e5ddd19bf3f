//! API objects + cluster state → an immutable, indexed [`Snapshot`].
//!
//! Stage two of three (store → snapshot → decision, DESIGN §5): everything that can be
//! worked out before a packet arrives is worked out here, once per revision:
//!
//! - every object is validated ([`super::validate`]); objects with errors are left out and
//!   reported, the rest is used (the caller may keep the last good version of a rejected
//!   object);
//! - namespaces, pods and nodes get dense ids, and each kind gets a [`LabelIndex`];
//! - every distinct selector (and namespace×pod selector pair) is resolved once into a
//!   bitmap of pod ids and interned, so a thousand rules naming `app=web` share one set;
//! - every pod gets, per direction, the ordered list of Admin-tier and Baseline-tier
//!   policies whose subject selects it and the NetworkPolicies that isolate it, so
//!   [`Snapshot::decide`](super::eval) walks only what applies.
//!
//! One file per pass, in the order `compile_inner` runs them:
//!
//! - [`cluster`]: namespaces, nodes, pods (ids, addresses, label indexes), then who owns
//!   each address; fills the compile-time `Cluster` that the later passes read;
//! - [`admin`]: ANP, CNP and BANP → Admin- and Baseline-tier policies;
//! - [`network`]: NetworkPolicy → NetworkPolicy-tier policies;
//! - [`antrea`]: Antrea ClusterNetworkPolicy and NetworkPolicy → policies at their Tier's
//!   place in Antrea's global order;
//! - [`index`]: evaluation order, each policy's matchers, the port and address indexes,
//!   the per-pod policy lists;
//! - [`checks`]: what runs on a finished snapshot ([`priority_conflicts`],
//!   [`unreachable_rules`]);
//! - [`incremental`]: the [`Compiler`], which keeps the compile-time state and patches the
//!   last snapshot after small changes instead of running the passes again.
//!
//! The large parts (pods, admin and Antrea objects, matchers) run on up to four threads
//! ([`parallel`]); their workers key the pod sets that peers name in their own
//! [`set_dict`], interned afterwards in worker order. Decisions and problems do not depend
//! on how many threads, and for one thread count the snapshot does not depend on thread
//! timing.
//!
//! The tier order itself lives in one place: [`Tier::ORDER`]. The passes only derive from
//! it: policies sort by tier through `Tier`'s `Ord` ([`index`]), and the per-pod lists are
//! by [`Tier::index`].
//!
//! [`LabelIndex`]: super::selector::LabelIndex

mod admin;
mod antrea;
mod checks;
mod cluster;
mod incremental;
mod index;
mod network;
mod parallel;
mod set_dict;

use std::sync::Arc;

use super::api::{
    LabelSelector, Namespace, NetworkPolicy, Node, Pod, SelectorRef, v1alpha1, v1alpha2,
};
use super::labels::Labels;
pub use super::model::{
    ANNOTATION_ENFORCING, ANNOTATION_PREFIX, Action, Direction, Endpoint, Revision, Tier,
};
use super::ports::Protocol;
use super::problem::{ObjectRef, Problem, ProblemKind};
use super::selector::Selector;
use super::snapshot::Snapshot;
pub use antrea::admit as admit_antrea;
pub use checks::{priority_conflicts, unreachable_rules};
use cluster::Cluster;
pub use cluster::PodView;
pub use incremental::{Compiler, Pass};

/// The API objects a snapshot is compiled from. Order within each list does not matter;
/// an object given twice (same kind, namespace, name) is used once, the later one winning.
/// Objects are shared (`Arc`): a source's store, the last good policies and the compiler
/// read the same allocation, so a rebuild copies no object.
#[derive(Debug, Clone, Default)]
pub struct Inputs {
    /// `v1` Namespaces. Namespaces that pods or policies live in but that are missing here
    /// are created implicitly, with only the `kubernetes.io/metadata.name` label.
    pub namespaces: Vec<Arc<Namespace>>,
    /// `v1` Nodes; their `status.addresses` (InternalIP, ExternalIP) are node IPs.
    pub nodes: Vec<Arc<Node>>,
    /// `v1` Pods. Pods in phase Succeeded or Failed hold no IP and are ignored.
    pub pods: Vec<Arc<Pod>>,
    /// Pods already cut to what the engine reads ([`PodView`]), as a source that keeps
    /// many of them stores them (the API-server watchers); validated by their source. A
    /// view and a Pod with the same namespace and name: the view wins.
    pub pod_views: Vec<Arc<PodView>>,
    /// `networking.k8s.io/v1` NetworkPolicies.
    pub network_policies: Vec<Arc<NetworkPolicy>>,
    /// `v1alpha1` AdminNetworkPolicies.
    pub admin_network_policies: Vec<Arc<v1alpha1::AdminNetworkPolicy>>,
    /// `v1alpha1` BaselineAdminNetworkPolicies (only `default` is valid).
    pub baseline_admin_network_policies: Vec<Arc<v1alpha1::BaselineAdminNetworkPolicy>>,
    /// `v1alpha2` ClusterNetworkPolicies.
    pub cluster_network_policies: Vec<Arc<v1alpha2::ClusterNetworkPolicy>>,
    /// Antrea-native objects (`crd.antrea.io/v1beta1` Tier, ClusterNetworkPolicy and
    /// NetworkPolicy; `shared/reference/antrea-model.md`). The Tiers given here and the
    /// six static ones make the Tier table each policy's `spec.tier` is looked up in.
    pub antrea: super::api::antrea::Objects,
}

/// The annotations of `meta` whose key starts with [`ANNOTATION_PREFIX`], sorted by key.
pub(super) fn own_annotations(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> Box<[(String, String)]> {
    meta.annotations
        .iter()
        .flatten()
        .filter(|(k, _)| k.starts_with(ANNOTATION_PREFIX))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// The result of compiling: the snapshot and everything worth telling about the input.
#[derive(Debug)]
pub struct Compiled {
    /// The snapshot, built from every object without errors.
    pub snapshot: Snapshot,
    /// Errors (object left out) and warnings (object used), in input order per kind.
    pub problems: Vec<Problem>,
}

/// Compiles a selector that validation has already checked; an unknown operator (only
/// possible if validation was skipped) makes the selector match nothing, failing closed.
pub(super) fn selector<'a>(sel: impl Into<SelectorRef<'a>>) -> Option<Selector> {
    Selector::compile(sel.into()).ok()
}

/// The first byte of `s` (0 when empty): one load, for the passes that touch an object's
/// strings ahead of reading them ([`touch_selector`]).
#[inline]
pub(super) fn first_byte(s: &str) -> u8 {
    s.as_bytes().first().copied().unwrap_or(0)
}

/// Reads the first bytes of a selector's first label and of its first expression's key,
/// and nothing else: the loads the admin and Antrea passes issue for the next rule or
/// policy while they compile this one, so that the CPU overlaps their cache misses.
/// Returns them folded into a byte, for the caller to keep alive (`black_box`).
#[inline]
pub(super) fn touch_selector(s: &LabelSelector) -> u8 {
    let labels = s.match_labels.as_ref().and_then(Labels::first);
    let expr = s.match_expressions.as_ref().and_then(|e| e.first());
    labels.map_or(0, |(k, v)| first_byte(k) ^ first_byte(v))
        ^ expr.map_or(0, |e| first_byte(&e.key))
}

pub(super) fn protocol_or_tcp(p: Option<&str>) -> Protocol {
    // "If not specified, this field defaults to TCP." Validation rejects other names.
    p.and_then(|p| p.parse().ok()).unwrap_or(Protocol::Tcp)
}

pub(super) fn port_u16(p: i32) -> u16 {
    // Validation guarantees 1..=65535; clamp rather than wrap if it was skipped.
    p.clamp(0, u16::MAX as i32) as u16
}

pub(super) fn meta_name(m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> String {
    m.name.clone().unwrap_or_default()
}

/// The namespace of a namespaced object; manifests may omit it, meaning `default`, as
/// `kubectl apply` does.
pub fn meta_namespace(m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> String {
    m.namespace.clone().filter(|n| !n.is_empty()).unwrap_or_else(|| "default".to_string())
}

/// Keeps the last object per key, then orders by key, so the result is independent of
/// input order. Reports each duplicate, in input order.
pub(super) fn dedup_sorted<'a, T>(
    items: &'a [Arc<T>],
    key: impl Fn(&T) -> ObjectRef,
    problems: &mut Vec<Problem>,
) -> Vec<(ObjectRef, &'a T)> {
    dedup_keyed(items.iter().map(|it| (key(it), &**it)).collect(), problems)
}

/// [`dedup_sorted`] of values already keyed, in input order: the last value of each key,
/// in key order; each duplicate reported, in input order.
///
/// A stable sort, then the last of each run of equal keys: input from the API server comes
/// sorted already, so the sort is one pass of comparisons (a map inserted key by key
/// compared each key a dozen times for 10,000 Pods).
pub(super) fn dedup_keyed<V>(
    keyed: Vec<(ObjectRef, V)>,
    problems: &mut Vec<Problem>,
) -> Vec<(ObjectRef, V)> {
    let mut keyed: Vec<(ObjectRef, usize, V)> =
        keyed.into_iter().enumerate().map(|(i, (k, v))| (k, i, v)).collect();
    keyed.sort_by(|a, b| a.0.cmp(&b.0));
    // Every entry but the first of a run is a later copy: (its input position, its key).
    let mut duplicates: Vec<(usize, ObjectRef)> = Vec::new();
    let mut out: Vec<(ObjectRef, V)> = Vec::with_capacity(keyed.len());
    for (k, i, v) in keyed {
        match out.last_mut() {
            Some(last) if last.0 == k => {
                duplicates.push((i, k));
                last.1 = v;
            }
            _ => out.push((k, v)),
        }
    }
    duplicates.sort_unstable_by_key(|&(i, _)| i);
    for (_, k) in duplicates {
        problems.push(Problem::warning(&k, "", ProblemKind::Duplicate));
    }
    out
}

/// [`dedup_sorted`], then each object validated with `check` (unless `validate` is false),
/// its problems reported, and the objects with an error left out: the objects a pass
/// compiles, in key order.
pub(super) fn valid_sorted<'a, T>(
    items: &'a [Arc<T>],
    key: impl Fn(&T) -> ObjectRef,
    check: fn(&T, &mut Vec<Problem>),
    validate: bool,
    problems: &mut Vec<Problem>,
) -> Vec<(ObjectRef, &'a T)> {
    let mut out = dedup_sorted(items, key, problems);
    if validate {
        out.retain(|&(_, o)| {
            let start = problems.len();
            check(o, problems);
            !problems[start..].iter().any(Problem::is_error)
        });
    }
    out
}

impl Snapshot {
    /// Compiles `inputs` into a snapshot with `revision`.
    ///
    /// Never fails: objects with validation errors are left out and reported in
    /// [`Compiled::problems`] (with warnings for what is used but worth knowing). The result
    /// does not depend on the order of objects within `inputs`.
    pub fn compile(inputs: &Inputs, revision: Revision) -> Compiled {
        Self::compile_inner(inputs, revision, true, parallel::default_workers()).0
    }

    /// [`Snapshot::compile`] for inputs whose objects were each validated already (the
    /// daemon validates an object once, when it changes, not on every snapshot) and from
    /// which invalid objects were removed. Skips validation; everything else is the same.
    pub fn compile_validated(inputs: &Inputs, revision: Revision) -> Compiled {
        Self::compile_inner(inputs, revision, false, parallel::default_workers()).0
    }

    /// The passes in order. `workers`: most threads to spread the large parts over (see
    /// [`parallel::balanced_ranges`]). Problems come kind by kind: namespaces, nodes,
    /// pods, addresses, admin kinds, NetworkPolicies. Returns the compile-time state
    /// too, which a [`Compiler`] keeps to patch the snapshot.
    fn compile_inner(
        inputs: &Inputs,
        revision: Revision,
        validate: bool,
        workers: usize,
    ) -> (Compiled, Cluster) {
        let mut problems = Vec::new();
        let mut c = Cluster::default();
        c.namespaces(inputs, validate, &mut problems);
        c.nodes(inputs, validate, &mut problems);
        let pod_labels = c.pods(inputs, validate, workers, &mut problems);
        c.label_indexes(&pod_labels, workers);
        let by_ip = c.addresses(&mut problems);

        let mut policies = admin::admin_policies(&mut c, inputs, validate, workers, &mut problems);
        policies.extend(network::network_policies(&mut c, inputs, validate, &mut problems));
        policies.extend(antrea::antrea_policies(
            &mut c,
            &inputs.antrea,
            validate,
            workers,
            &mut problems,
        ));
        index::evaluation_order(&mut policies);
        let (port_index, addr_index) = index::matchers_and_indexes(
            &mut policies,
            &c.interner.sets,
            &c.addrs,
            &c.pods,
            workers,
        );
        let (per_pod, policy_sets) = index::per_pod_policies(&policies, c.pods.len(), workers);

        let snapshot = Snapshot {
            revision,
            pods: Arc::clone(&c.pods),
            namespaces: Arc::clone(&c.namespaces),
            nodes: Arc::clone(&c.nodes),
            by_ip: Arc::new(by_ip),
            node_addrs: Arc::clone(&c.node_addrs),
            pod_ips: Arc::clone(&c.pod_ips),
            pod_sets: c.interner.sets.clone(),
            policies,
            per_pod: Arc::new(per_pod),
            policy_sets,
            port_index: Arc::new(port_index),
            addr_index: Arc::new(addr_index),
            pod_index: Arc::clone(&c.pod_index),
        };
        (Compiled { snapshot, problems }, c)
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;
    use crate::policy::problem::{Kind, ProblemKind};
    use crate::synth::{self, Shape};

    /// Asserts that `many` (compiled on several workers) has `one`'s problems, policies
    /// in order and decisions on `flows`, and decides them as the reference evaluator
    /// does.
    fn assert_compiled_alike(
        one: &Compiled,
        many: &Compiled,
        flows: &[crate::policy::Flow],
        what: &str,
    ) {
        assert_eq!(one.problems, many.problems, "{what}: problems differ");
        let names = |s: &Snapshot| -> Vec<ObjectRef> {
            s.policies.iter().map(|p| ObjectRef::clone(&p.object)).collect()
        };
        assert_eq!(names(&one.snapshot), names(&many.snapshot), "{what}");
        for f in flows {
            let d = many.snapshot.decide(f);
            assert_eq!(one.snapshot.decide(f), d, "{what}: {f:?}");
            assert_eq!(many.snapshot.decide_reference(f), d, "{what}: {f:?}");
        }
    }

    /// `pod`'s key.
    fn pod_ref(pod: &Pod) -> ObjectRef {
        ObjectRef::namespaced(Kind::Pod, meta_namespace(&pod.metadata), meta_name(&pod.metadata))
    }

    /// `pod`'s id in `s`.
    fn pod_id(s: &Snapshot, pod: &Pod) -> Option<u32> {
        s.find_pod(&meta_namespace(&pod.metadata), &meta_name(&pod.metadata))
    }

    /// `pod` with `ip` as its only address (`status.podIP`).
    fn with_ip(pod: &Pod, ip: &str) -> Arc<Pod> {
        let mut pod = pod.clone();
        let status = pod.status.get_or_insert_with(Default::default);
        status.pod_ip = Some(ip.to_string());
        status.pod_ips = None;
        Arc::new(pod)
    }

    /// A cluster above [`parallel::PARALLEL_MIN_PEERS`], with duplicates, invalid objects and
    /// warnings among the admin objects, so that every part of the parallel path runs.
    fn large_inputs() -> Inputs {
        let shape = Shape {
            namespaces: 60,
            pods: 1_200,
            nodes: 6,
            network_policies: 80,
            admin_policies: 24,
            rules_per_admin_policy: 20,
            max_peers: 30,
            admin_selects_all: false,
        };
        let mut inputs = synth::cluster(shape, 7);
        let anps = &mut inputs.admin_network_policies;
        // A duplicate (warning), an out-of-range priority (error: left out), and a selector
        // value that is not a label value (a warning inside CRDs; the peer still compiles).
        anps.push(anps[3].clone());
        let mut bad = (*anps[5]).clone();
        bad.metadata.name = Some("bad-priority".into());
        bad.spec.priority = 5000;
        anps.insert(1, Arc::new(bad));
        let mut odd = (*anps[8]).clone();
        odd.metadata.name = Some("odd-selector".into());
        if let Some(p) = odd.spec.egress[0].to[0].pods.as_mut() {
            p.pod_selector.match_labels = Some([("app", "not a label value")].into());
        }
        anps.push(Arc::new(odd));
        inputs
    }

    #[test]
    fn a_node_enforces_when_annotated_true_and_its_pods_are_found_in_one_pass() {
        let shape = Shape { namespaces: 4, pods: 40, nodes: 3, ..Shape::LARGE };
        let mut inputs = synth::cluster(shape, 3);
        for (i, value) in [(0, "true"), (1, "false")] {
            let mut node = (*inputs.nodes[i]).clone();
            node.metadata
                .annotations
                .get_or_insert_default()
                .insert(ANNOTATION_ENFORCING.into(), value.into());
            inputs.nodes[i] = Arc::new(node);
        }
        let s = Snapshot::compile(&inputs, Revision(1)).snapshot;
        let name = |i: usize| inputs.nodes[i].metadata.name.clone().unwrap();
        let id = |i: usize| s.find_node(&name(i)).unwrap();
        assert!(s.node_enforcing(id(0)), "annotated \"true\"");
        assert!(!s.node_enforcing(id(1)), "annotated \"false\"");
        assert!(!s.node_enforcing(id(2)), "not annotated");
        let mut on_0 = s.pod_ips_on(|n| n == id(0));
        let mut expected = s.local_pod_ips(id(0));
        assert!(!expected.is_empty());
        on_0.sort();
        expected.sort();
        assert_eq!(on_0, expected);
        let all = s.pod_ips_on(|_| true).len();
        let each: usize = (0..3).map(|i| s.local_pod_ips(id(i)).len()).sum();
        assert_eq!(all, each);
    }

    #[test]
    fn compiling_on_several_workers_gives_what_one_worker_gives() {
        let inputs = large_inputs();
        let one = Snapshot::compile_inner(&inputs, Revision(1), true, 1).0;
        for workers in [2, 3, 4] {
            let many = Snapshot::compile_inner(&inputs, Revision(1), true, workers).0;
            let shape = Shape { namespaces: 60, pods: 1_200, nodes: 6, ..Shape::LARGE };
            let flows = synth::flows(shape, 5_000, 11);
            assert_compiled_alike(&one, &many, &flows, &format!("{workers} workers"));
        }
        assert!(one.problems.iter().any(|p| p.object.name == "bad-priority" && p.is_error()));
        assert!(one.problems.iter().any(|p| p.object.name == "odd-selector" && !p.is_error()));
        assert!(one.snapshot.policies.iter().all(|p| p.object.name != "bad-priority"));
    }

    /// The Antrea pass spread over workers: same problems, policies and decisions as on
    /// one, with and without validation (without it, the workers report a missing Tier
    /// themselves), including an ANNP in a namespace nobody declared.
    #[test]
    fn antrea_policies_compile_on_several_workers_as_on_one() {
        let shape = Shape { namespaces: 40, pods: 800, nodes: 4, ..Shape::LARGE };
        let mut inputs = synth::cluster(Shape { admin_policies: 2, ..shape }, 5);
        let antrea_shape = synth::AntreaShape {
            custom_tiers: 4,
            acnps_per_tier: 6,
            annps: 40,
            rules_per_policy: 8,
            max_peers: 5,
        };
        inputs.antrea = synth::antrea(antrea_shape, shape, 5);
        let objects = &mut inputs.antrea;
        // As much work as the pass weighs it (rules and peers): enough to be split.
        let acnps =
            objects.cluster_network_policies.iter().map(|p| antrea::weight((&p.spec).into()));
        let annps = objects.network_policies.iter().map(|p| antrea::weight((&p.spec).into()));
        let total: usize = acnps.chain(annps).sum();
        assert!(total > parallel::PARALLEL_MIN_PEERS, "too small to split: {total}");
        let mut lost = (*objects.cluster_network_policies[3]).clone();
        lost.metadata.name = Some("in-a-lost-tier".into());
        lost.spec.tier = "no-such-tier".into();
        objects.cluster_network_policies.push(Arc::new(lost));
        let mut stray = (*objects.network_policies[2]).clone();
        stray.metadata.namespace = Some("nobody-declared-this".into());
        objects.network_policies.push(Arc::new(stray));
        let flows = synth::flows(shape, 3_000, 13);
        for validate in [true, false] {
            let one = Snapshot::compile_inner(&inputs, Revision(1), validate, 1).0;
            let lost: Vec<_> =
                one.problems.iter().filter(|p| p.object.name == "in-a-lost-tier").collect();
            assert!(lost.iter().any(|p| p.is_error()), "validate {validate}: {:?}", one.problems);
            let antrea = one.snapshot.policies.iter().filter(|p| p.antrea_tier.is_some());
            assert_eq!(antrea.count(), 100, "every Antrea policy but the two left out");
            for workers in [2, 3, 4] {
                let many = Snapshot::compile_inner(&inputs, Revision(1), validate, workers).0;
                let what = format!("validate {validate}, {workers} workers");
                assert_compiled_alike(&one, &many, &flows, &what);
                assert_eq!(one.snapshot.pod_sets.len(), many.snapshot.pod_sets.len(), "{what}");
            }
        }
    }

    /// The per-pod policy lists read off the list-class trie are, pod by pod, the lists a
    /// plain walk of every policy's subject builds; each distinct list is kept once, in
    /// order of first use by pod id; the same whether one trie walks every pod or one per
    /// worker walks a range of them.
    #[test]
    fn per_pod_lists_are_each_pods_policies_in_order_and_interned() {
        let shape = Shape { namespaces: 30, pods: 600, nodes: 3, ..Shape::LARGE };
        let mut inputs = synth::cluster(Shape { admin_policies: 6, ..shape }, 9);
        let antrea = synth::AntreaShape {
            custom_tiers: 3,
            acnps_per_tier: 4,
            annps: 30,
            rules_per_policy: 4,
            max_peers: 3,
        };
        inputs.antrea = synth::antrea(antrea, shape, 9);
        for workers in [1, 2, 3] {
            let s = Snapshot::compile_inner(&inputs, Revision(1), true, workers).0.snapshot;
            let pods = s.pods.len();
            let mut plain = vec![crate::policy::snapshot::PolicyLists::default(); pods];
            let mut visits = 0;
            for (pid, p) in s.policies.iter().enumerate() {
                for d in Direction::BOTH {
                    if p.applies[d as usize] {
                        for pod in p.subject.iter() {
                            plain[pod as usize][p.tier.index()][d as usize].push(pid as u32);
                            visits += 1;
                        }
                    }
                }
            }
            // Enough to be split over the workers' ranges of pods.
            assert!(visits > parallel::PARALLEL_MIN_PEERS, "{visits}");
            let mut first_use = Vec::new();
            for (pod, want) in plain.iter().enumerate() {
                let id = s.per_pod[pod] as usize;
                assert_eq!(s.policy_sets[id].thaw(), *want, "{workers} workers, pod {pod}");
                if !first_use.contains(&id) {
                    assert_eq!(id, first_use.len(), "ids in order of first use");
                    first_use.push(id);
                }
            }
            assert_eq!(first_use.len(), s.policy_sets.len(), "every list is some pod's");
            let distinct: std::collections::HashSet<_> = s.policy_sets.iter().collect();
            assert_eq!(distinct.len(), s.policy_sets.len(), "each list kept once");
            assert!(s.policy_sets.len() > 10, "the cluster's pods differ: {}", s.policy_sets.len());
            let many = |l: &crate::policy::snapshot::PodPolicies| {
                (0..Tier::COUNT).any(|t| l.list(t, 0).len() > 5)
            };
            assert!(s.policy_sets.iter().any(many), "some pods have many policies");
        }
    }

    /// The pods' label index is built in ranges on several workers and merged: it equals
    /// the one built on one, for a cluster large enough to be split.
    #[test]
    fn label_indexes_built_on_several_workers_are_the_one_built_on_one() {
        let shape = Shape { namespaces: 50, pods: 5_000, nodes: 4, ..Shape::LARGE };
        assert_eq!(parallel::balanced_ranges(&vec![1; shape.pods], 2).len(), 2, "split");
        let inputs = synth::cluster(Shape { admin_policies: 2, ..shape }, 4);
        let (_, one) = Snapshot::compile_inner(&inputs, Revision(1), false, 1);
        for workers in [2, 3] {
            let (_, many) = Snapshot::compile_inner(&inputs, Revision(1), false, workers);
            assert!(*one.pod_index == *many.pod_index, "{workers} workers");
        }
        assert_eq!(one.pod_index.all().len(), 5_000);
    }

    /// Pods name namespaces and nodes that no object declares: each is made once, on
    /// first use, and later pods find it; the ids of declared ones are looked up where the
    /// pods are read (on the workers for a large cluster), alike on one worker and on two.
    #[test]
    fn pods_in_undeclared_namespaces_and_nodes_share_what_the_first_one_made() {
        let shape = Shape { namespaces: 50, pods: 5_000, nodes: 4, ..Shape::LARGE };
        assert_eq!(parallel::balanced_ranges(&vec![1; shape.pods], 2).len(), 2, "split");
        let mut inputs = synth::cluster(shape, 6);
        for (i, namespace, node) in [(10, "ghost", None), (20, "ghost", Some("ghost-node"))]
            .into_iter()
            .chain([(4_000, "ns-1", Some("ghost-node")), (30, "ns-2", Some("node-1"))])
        {
            let mut pod = (*inputs.pods[i]).clone();
            pod.metadata.namespace = Some(namespace.into());
            if let Some(spec) = pod.spec.as_mut() {
                spec.node_name = node.map(str::to_string);
            }
            inputs.pods[i] = Arc::new(pod);
        }
        let one = Snapshot::compile_inner(&inputs, Revision(1), true, 1).0;
        let two = Snapshot::compile_inner(&inputs, Revision(1), true, 2).0;
        assert_eq!(one.problems, two.problems);
        let declared = synth::cluster(shape, 6);
        let (pods, namespaces, nodes, _) =
            Snapshot::compile(&declared, Revision(1)).snapshot.counts();
        for c in [&one, &two] {
            let s = &c.snapshot;
            assert_eq!(s.counts().0, pods);
            assert_eq!(
                (s.counts().1, s.counts().2),
                (namespaces + 1, nodes + 1),
                "one of each made"
            );
            let ghost_node = s.find_node("ghost-node");
            let pod = |i: usize| pod_id(s, &inputs.pods[i]).unwrap();
            assert_eq!(s.pod_name(pod(10)).0, "ghost");
            assert_eq!(s.pod_name(pod(20)).0, "ghost");
            assert_eq!(s.pod_node(pod(10)), None);
            assert_eq!(s.pod_node(pod(20)), ghost_node);
            assert_eq!(s.pod_node(pod(4_000)), ghost_node);
            assert_eq!(s.pod_node(pod(30)), s.find_node("node-1"));
            assert_eq!(s.pod_name(pod(30)).0, "ns-2");
        }
        for f in synth::flows(shape, 3_000, 8) {
            assert_eq!(one.snapshot.decide(&f), two.snapshot.decide(&f), "{f:?}");
        }
    }

    /// An address claimed twice: the first claimant (nodes before pods, then pods by id)
    /// keeps it, and each later one is warned about, naming the first.
    #[test]
    fn address_conflicts_warn_each_later_claimant_and_the_first_keeps_the_address() {
        let shape = Shape { namespaces: 4, pods: 40, nodes: 3, ..Shape::LARGE };
        let mut inputs = synth::cluster(shape, 3);
        let first = inputs.pods[0].clone();
        let first_ip = first.status.as_ref().and_then(|s| s.pod_ip.clone()).unwrap();
        let node_ip = synth::node_ip(1).to_string();
        inputs.pods[5] = with_ip(&inputs.pods[5], &first_ip);
        inputs.pods[6] = with_ip(&inputs.pods[6], &node_ip);
        let c = Snapshot::compile(&inputs, Revision(1));
        let conflicts: Vec<(&ObjectRef, IpAddr, &ObjectRef)> = c
            .problems
            .iter()
            .filter_map(|p| match &p.kind {
                ProblemKind::AddressConflict { addr, other } => Some((&p.object, *addr, other)),
                _ => None,
            })
            .collect();
        let node = ObjectRef::cluster(Kind::Node, meta_name(&inputs.nodes[1].metadata));
        let (first_ip, node_ip): (IpAddr, IpAddr) =
            (first_ip.parse().unwrap(), node_ip.parse().unwrap());
        // Pods claim in id order, which is key order: of the two pods with one address,
        // the one named first keeps it.
        let (keeps, later) = {
            let (a, b) = (pod_ref(&first), pod_ref(&inputs.pods[5]));
            if a < b { (a, b) } else { (b, a) }
        };
        let sixth = pod_ref(&inputs.pods[6]);
        let mut want = vec![(&later, first_ip, &keeps), (&sixth, node_ip, &node)];
        want.sort_by(|a, b| a.0.cmp(b.0));
        assert_eq!(conflicts, want, "{:?}", c.problems);
        let s = &c.snapshot;
        let keeper = s.find_pod(keeps.namespace.as_deref().unwrap(), &keeps.name).unwrap();
        assert_eq!(s.endpoint(first_ip), Endpoint::Pod(keeper));
        assert_eq!(s.endpoint(node_ip), Endpoint::Node(s.find_node(&node.name).unwrap()));
        let sixth = pod_id(s, &inputs.pods[6]).unwrap();
        assert_eq!(s.pod_ips(sixth), [node_ip], "the pod keeps its address, not its claim");
    }

    /// Pods given as views (the API-server source's form) compile to the same snapshot
    /// as the Pods they came from; a view wins over a Pod of the same name.
    #[test]
    fn pod_views_decide_as_the_pods_they_came_from() {
        let shape = Shape { namespaces: 60, pods: 1_200, nodes: 6, ..Shape::LARGE };
        let pods_in = synth::cluster(Shape { admin_policies: 12, max_peers: 30, ..shape }, 3);
        let views_in = Inputs {
            pods: Vec::new(),
            pod_views: pods_in.pods.iter().map(|p| Arc::new(PodView::from_pod(p))).collect(),
            ..pods_in.clone()
        };
        let a = Snapshot::compile(&pods_in, Revision(1));
        let b = Snapshot::compile(&views_in, Revision(1));
        assert_eq!(a.problems, b.problems);
        assert_eq!(a.snapshot.counts(), b.snapshot.counts());
        for f in synth::flows(shape, 5_000, 5) {
            assert_eq!(a.snapshot.decide(&f), b.snapshot.decide(&f), "{f:?}");
        }
        // A view and a Pod with one name: the view is used (and the pair reported as a
        // duplicate; the agent drops a file's Pod that the API server also has).
        let pod = &pods_in.pods[0];
        let mut moved = PodView::from_pod(pod);
        moved.ips = vec!["10.250.0.1".parse().unwrap()];
        let both = Inputs { pod_views: vec![Arc::new(moved)], ..pods_in.clone() };
        let c = Snapshot::compile(&both, Revision(1));
        let id = pod_id(&c.snapshot, pod);
        assert_eq!(c.snapshot.pod_ips(id.unwrap()), ["10.250.0.1".parse::<IpAddr>().unwrap()]);
        assert!(c.problems.iter().any(|p| matches!(p.kind, ProblemKind::Duplicate)));
    }

    /// Pods listed more than once: the last of each name is kept, each later one is
    /// reported as a duplicate in input order, and a dropped one's own problems are not
    /// reported; alike on one worker and on two (the Pods are read on the workers).
    #[test]
    fn duplicate_pods_keep_the_last_and_report_each_later_one_in_input_order() {
        let shape = Shape { namespaces: 4, pods: 40, nodes: 3, ..Shape::LARGE };
        let mut inputs = synth::cluster(shape, 3);
        let (a, b) = (inputs.pods[3].clone(), inputs.pods[7].clone());
        let dropped_invalid = with_ip(&inputs.pods[3], "not-an-ip");
        let b_last = with_ip(&inputs.pods[7], "10.250.0.4");
        let a_last = with_ip(&inputs.pods[3], "10.250.0.3");
        inputs.pods.insert(10, dropped_invalid);
        inputs.pods.insert(20, b_last);
        inputs.pods.push(a_last);
        let one = Snapshot::compile_inner(&inputs, Revision(1), true, 1).0;
        let two = Snapshot::compile_inner(&inputs, Revision(1), true, 2).0;
        assert_eq!(one.problems, two.problems);
        let duplicates: Vec<&ObjectRef> = two
            .problems
            .iter()
            .filter(|p| matches!(p.kind, ProblemKind::Duplicate))
            .map(|p| &p.object)
            .collect();
        assert_eq!(duplicates, [&pod_ref(&a), &pod_ref(&b), &pod_ref(&a)]);
        assert!(two.problems.iter().all(|p| !p.is_error()), "{:?}", two.problems);
        for (pod, ip) in [(&a, "10.250.0.3"), (&b, "10.250.0.4")] {
            let id = pod_id(&two.snapshot, pod).unwrap();
            assert_eq!(two.snapshot.pod_ips(id), [ip.parse::<IpAddr>().unwrap()]);
        }
        assert_eq!(
            two.snapshot.counts(),
            Snapshot::compile(&synth::cluster(shape, 3), Revision(1)).snapshot.counts()
        );
    }

    /// The validating path builds rules from the validator's `after_rule` visits, the
    /// other from its own loop: both must see every rule, in order.
    #[test]
    fn validated_and_unvalidated_compiles_decide_alike() {
        let shape = Shape { namespaces: 60, pods: 1_200, nodes: 6, ..Shape::LARGE };
        let inputs = synth::cluster(Shape { admin_policies: 12, max_peers: 30, ..shape }, 3);
        let checked = Snapshot::compile_inner(&inputs, Revision(1), true, 2).0;
        assert!(checked.problems.iter().all(|p| !p.is_error()));
        let unchecked = Snapshot::compile_inner(&inputs, Revision(1), false, 2).0;
        let rules = |s: &Snapshot| -> usize {
            s.policies.iter().flat_map(|p| p.rules.iter()).map(Vec::len).sum()
        };
        assert_eq!(rules(&checked.snapshot), rules(&unchecked.snapshot));
        for f in synth::flows(shape, 5_000, 5) {
            assert_eq!(checked.snapshot.decide(&f), unchecked.snapshot.decide(&f), "{f:?}");
        }
    }
}
