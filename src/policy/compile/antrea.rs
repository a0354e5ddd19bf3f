//! The Antrea pass of a compile: Antrea ClusterNetworkPolicies (ACNP) and NetworkPolicies
//! (ANNP) of `crd.antrea.io/v1beta1` into [`Policy`]s placed in Antrea's global order.
//!
//! The semantics are `shared/reference/antrea-model.md`'s, section by section:
//! - §2–§3 tiers: a policy's [`rank`](crate::policy::model::rank) is its Tier's priority,
//!   looked up by name in the [`TierTable`] of the static Tiers and the Tier objects
//!   given; below 253 it sits in the admin-level list before NetworkPolicy, Antrea's
//!   `baseline` Tier (253) after it;
//! - §5 actions: Allow, Drop (a silent drop, [`Action::Deny`]), Reject, Pass;
//! - §6 appliedTo: at the policy or on every rule (a rule's own set then scopes only that
//!   rule); an ACNP entry is `podSelector` AND `namespaceSelector`, either alone meaning
//!   every namespace or every pod of the selected ones; an ANNP entry selects pods of its
//!   own namespace;
//! - §7 peers: absent or empty → every address; a `podSelector` alone is cluster-wide in an
//!   ACNP and namespace-local in an ANNP; `namespaces.match: Self` and `sameLabels`
//!   depend on the subject's namespace ([`Relative`]); ipBlock with `except`;
//!   `nodeSelector`; a peer naming nothing selects nothing;
//! - §8 ports: protocol defaulting to TCP, `endPort`, named ports resolved on the
//!   destination pod; `protocols` (ICMP, IGMP) never match TCP/UDP/SCTP;
//! - §9 fail closed: a peer or port this engine cannot evaluate (fqdn, group,
//!   serviceAccount, externalEntitySelector, scope ClusterSet, toServices, l7Protocols,
//!   sourcePort, a field outside the kind's schema) matches nothing in an Allow rule; a
//!   Drop, Reject or Pass rule holding one applies to all the traffic its ports select
//!   (a Pass then acts as a drop).
//!
//! Validation (CRD schema and Antrea's webhook) is [`validate::antrea_cluster_network_policy`]'s;
//! [`admit`] runs it against the Tier table the same objects make.

use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use roaring::RoaringBitmap;

use super::cluster::{Cluster, SetKey};
use super::parallel::{balanced_ranges, default_workers, par_for_each_mut, par_ranges};
use super::set_dict::{EVERYTHING, RawSet, SetDict, gather, intern_used};
use super::{
    first_byte, meta_namespace, own_annotations, port_u16, protocol_or_tcp, selector,
    touch_selector,
};
use crate::policy::antrea_tiers::{TierTable, tier_object_name};
use crate::policy::api::LabelSelector;
use crate::policy::api::antrea::{
    self, AppliedTo, NamespaceMatchType, NetworkPolicyPeer, NetworkPolicyPort, PeerScope,
    PolicySpecRef, RuleAction,
};
use crate::policy::cidr::{self, Block};
use crate::policy::model::{
    Action, Direction, PeersBuilder, Relative, Rule, SameNamespaces, SetId, Tier, rank,
};
use crate::policy::ports::{PortMatch, PortSpec, Ports};
use crate::policy::problem::{Kind, ObjectRef, Problem, ProblemKind};
use crate::policy::snapshot::Policy;
use crate::policy::validate;

/// The Antrea objects of `objects` that Antrea's API server would hold: one per kind,
/// namespace and name (the last; earlier ones reported as duplicates), Tiers admitted by
/// [`TierTable::build`], and each policy validated against that table
/// ([`validate::antrea_cluster_network_policy`], [`validate::antrea_network_policy`]).
/// Problems go to `problems`; an object with an error is left out (none of its rules
/// apply: it fails closed as a policy missing from the API server would). Tiers are
/// admitted in creation order, then name order (which decides which of two Tiers of one
/// priority is refused).
pub fn admit(objects: &antrea::Objects, problems: &mut Vec<Problem>) -> antrea::Objects {
    let (table, tiers) = admit_tiers(objects, problems);
    // Each policy is checked against the Tier table alone, so the checks run on worker
    // threads (a large set holds a thousand policies and a hundred thousand peers); their
    // problems are reported in input order all the same.
    fn admit_kind<T: kube::Resource + Send + Sync>(
        items: &[Arc<T>],
        kind: Kind,
        check: impl Fn(&T, &mut Vec<Problem>) + Sync,
        weight: impl Fn(&T) -> usize,
        problems: &mut Vec<Problem>,
    ) -> Vec<Arc<T>> {
        let kept = last_of_each(items, kind, problems);
        let weights: Vec<usize> = kept.iter().map(|p| weight(p)).collect();
        let ranges = balanced_ranges(&weights, default_workers());
        let checked = par_ranges(&kept, &ranges, |_, chunk| {
            chunk
                .iter()
                .map(|p| {
                    let mut found = Vec::new();
                    check(p, &mut found);
                    found
                })
                .collect::<Vec<_>>()
        });
        let mut admitted = Vec::with_capacity(kept.len());
        for (p, found) in kept.into_iter().zip(checked.into_iter().flatten()) {
            let valid = !found.iter().any(Problem::is_error);
            problems.extend(found);
            if valid {
                admitted.push(p);
            }
        }
        admitted
    }
    antrea::Objects {
        tiers,
        cluster_network_policies: admit_kind(
            &objects.cluster_network_policies,
            Kind::AntreaClusterNetworkPolicy,
            |p, out| validate::antrea_cluster_network_policy(p, &table, out),
            |p| weight((&p.spec).into()),
            problems,
        ),
        network_policies: admit_kind(
            &objects.network_policies,
            Kind::AntreaNetworkPolicy,
            |p, out| validate::antrea_network_policy(p, &table, out),
            |p| weight((&p.spec).into()),
            problems,
        ),
    }
}

/// [`admit`]'s first step: the Tiers of `objects` admitted in creation order, and their
/// table.
fn admit_tiers(
    objects: &antrea::Objects,
    problems: &mut Vec<Problem>,
) -> (TierTable, Vec<Arc<antrea::Tier>>) {
    let mut tiers = last_of_each(&objects.tiers, Kind::AntreaTier, problems);
    crate::policy::antrea_tiers::creation_order(&mut tiers);
    TierTable::build(&tiers, problems)
}

/// `items` with one object per [`ObjectRef`]: the last of each, where it stands; every
/// earlier one is reported ([`ProblemKind::Duplicate`], as the compiler does for the other
/// kinds).
fn last_of_each<T: kube::Resource>(
    items: &[Arc<T>],
    kind: Kind,
    problems: &mut Vec<Problem>,
) -> Vec<Arc<T>> {
    let mut seen = std::collections::HashSet::new();
    let mut kept: Vec<Arc<T>> = Vec::with_capacity(items.len());
    for it in items.iter().rev() {
        let r = validate::object_ref(kind, it.meta());
        if seen.insert(r.clone()) {
            kept.push(Arc::clone(it));
        } else {
            problems.push(Problem::warning(&r, "", ProblemKind::Duplicate));
        }
    }
    kept.reverse();
    kept
}

/// Antrea pass: with `validate`, admits `objects` as [`admit`] does (reporting to
/// `problems`); without, takes them as admitted, only building the Tier table (a policy
/// whose Tier is missing is still reported and left out). Returns the policies, ACNPs
/// then ANNPs, each kind by name; interns their selectors in `c`.
///
/// Shaped as the admin pass is ([`super::admin`]): workers ([`prepare`], up to `workers`
/// threads) check each policy against the Tier table (with `validate`) and compile the
/// valid ones right after, while their objects are in cache, keying every pod set a peer
/// or `appliedTo` entry names in their own [`SetDict`]; the keys that kept rules use are
/// then interned in worker order, each policy's `appliedTo` sets made on the calling
/// thread ([`Cluster::applied_sets`], interning unions), and the policies finished on the
/// workers again ([`finish`]: set ids, the subject). Problems come
/// as the Tiers', the duplicates', then each policy's in the order the policies are
/// compiled.
pub(super) fn antrea_policies(
    c: &mut Cluster,
    objects: &antrea::Objects,
    validate: bool,
    workers: usize,
    problems: &mut Vec<Problem>,
) -> Vec<Policy> {
    if objects.is_empty() {
        return Vec::new();
    }
    let (table, mut acnps, mut annps) = if validate {
        // What [`admit`] does, but for the policies' checks: those run in `prepare`, each
        // right before the policy compiles. Checked in a pass of their own, the policies'
        // objects were read from memory twice (with the bench's Antrea set, its 97 MiB of
        // objects: the pass took 58-61 ms instead of 68-71, docs/architecture.md).
        let table = admit_tiers(objects, problems).0;
        let acnps = last_of_each(
            &objects.cluster_network_policies,
            Kind::AntreaClusterNetworkPolicy,
            problems,
        );
        let annps = last_of_each(&objects.network_policies, Kind::AntreaNetworkPolicy, problems);
        (table, acnps, annps)
    } else {
        // Admitted Tiers build without problems; their problems were reported where
        // they were admitted.
        let mut tiers = objects.tiers.clone();
        crate::policy::antrea_tiers::creation_order(&mut tiers);
        let table = TierTable::build(&tiers, &mut Vec::new()).0;
        (table, objects.cluster_network_policies.clone(), objects.network_policies.clone())
    };
    acnps.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    annps.sort_by_key(|p| (meta_namespace(&p.metadata), p.metadata.name.clone()));
    let items: Vec<Item<'_>> = acnps
        .iter()
        .map(|p| Item {
            kind: Kind::AntreaClusterNetworkPolicy,
            metadata: &p.metadata,
            spec: (&p.spec).into(),
            namespaced: false,
            check: validate.then_some(Check::Acnp(p)),
        })
        .chain(annps.iter().map(|p| Item {
            kind: Kind::AntreaNetworkPolicy,
            metadata: &p.metadata,
            spec: (&p.spec).into(),
            namespaced: true,
            check: validate.then_some(Check::Annp(p)),
        }))
        .collect();
    let (prepared, dicts) = prepare(&items, c, &table, workers);
    let key_sets = intern_used(c, dicts);
    // Each kept policy's `appliedTo` sets on the calling thread, which alone holds the
    // interner (a list of several is interned as their union); the rest of it on the
    // workers ([`finish`]), which read the interned sets.
    let mut kept = Vec::with_capacity(prepared.len());
    for p in prepared {
        problems.extend(p.problems);
        if let Some(body) = p.body {
            let applied = c.applied_sets(&body, &key_sets[p.worker]);
            kept.push(Finishing { body: Some(body), worker: p.worker, applied, policy: None });
        }
    }
    let weights: Vec<usize> = kept
        .iter()
        .map(|f| f.body.iter().flat_map(|b| b.rules.iter().flatten()))
        .map(|rules| rules.map(|r| 1 + r.peers.pod_sets.len()).sum::<usize>() + 1)
        .collect();
    let interned = &c.interner.sets;
    par_for_each_mut(&mut kept, &balanced_ranges(&weights, workers), |f| {
        let body = f.body.take().expect("finished once");
        f.policy = Some(finish(body, &key_sets[f.worker], &f.applied, interned));
    });
    kept.into_iter().map(|f| f.policy.expect("finished")).collect()
}

/// A kept policy between its `appliedTo` sets and [`finish`].
struct Finishing {
    body: Option<Body>,
    /// The worker whose keys the body holds.
    worker: usize,
    applied: AppliedSets,
    policy: Option<Policy>,
}

/// The pod set of a policy's `appliedTo` list, or of each rule's (by direction and rule
/// index; `None` for a rule without one).
struct AppliedSets {
    policy: Option<SetId>,
    rules: [Vec<Option<SetId>>; 2],
}

/// One admitted Antrea policy, as [`prepare`] reads it.
struct Item<'a> {
    kind: Kind,
    metadata: &'a ObjectMeta,
    spec: PolicySpecRef<'a>,
    /// An ANNP (its `metadata.namespace` scopes its selectors), not an ACNP.
    namespaced: bool,
    /// The object to validate before compiling it; `None` when it was validated already.
    check: Option<Check<'a>>,
}

/// An Antrea policy to validate against the Tier table.
#[derive(Clone, Copy)]
enum Check<'a> {
    Acnp(&'a antrea::ClusterNetworkPolicy),
    Annp(&'a antrea::NetworkPolicy),
}

/// What a worker of [`prepare`] made of one policy.
struct Prepared {
    /// Its validation problems (when [`Item::check`] asked for them), or a missing Tier;
    /// with an error the policy is left out.
    problems: Vec<Problem>,
    /// `None` when the policy is left out: its Tier is missing, or it is an ANNP in a
    /// namespace nobody declared (no pod lives there: it selects nothing).
    body: Option<Body>,
    /// The worker whose [`SetDict`] the body's keys index.
    worker: usize,
}

/// A policy compiled on a worker, its pod sets still keys of the worker's [`SetDict`]:
/// in its rules' `peers.pod_sets` (unsorted) and `relative` peers, and in the
/// `appliedTo` lists kept beside them.
struct Body {
    object: ObjectRef,
    tier: Tier,
    rank: u8,
    priority: f64,
    tier_name: String,
    annotations: Box<[(String, String)]>,
    /// The policy-level `appliedTo` entries' keys; `None` when it has none (every rule then
    /// has its own).
    applied_to: Option<Vec<u32>>,
    /// With no policy-level `appliedTo`: per direction and rule, that rule's entries' keys.
    rule_applied_to: [Vec<Vec<u32>>; 2],
    /// Rules by [`Direction`] index.
    rules: [Vec<Rule>; 2],
}

impl Body {
    /// Every key the body holds (with repeats).
    fn keys(&self) -> impl Iterator<Item = u32> + '_ {
        let rules = self.rules.iter().flatten();
        let applied = self.applied_to.iter().chain(self.rule_applied_to.iter().flatten());
        applied.flatten().copied().chain(rules.flat_map(|r| {
            let relative = r.peers.relative.iter().map(|rel| rel.pods);
            r.peers.pod_sets.iter().copied().chain(relative)
        }))
    }
}

/// Validates (where [`Item::check`] says so) and compiles `items` on up to `workers`
/// threads (ranges of about equal rules and peers), each with its own [`SetDict`] (the
/// keys of the policies kept marked used). Returns, in item order, what each became, and
/// each worker's dict.
fn prepare(
    items: &[Item<'_>],
    c: &Cluster,
    table: &TierTable,
    workers: usize,
) -> (Vec<Prepared>, Vec<SetDict>) {
    let weights: Vec<usize> = items.iter().map(|i| weight(i.spec)).collect();
    let ranges = balanced_ranges(&weights, workers);
    let results = par_ranges(items, &ranges, |worker, chunk| {
        let mut w = Worker { dict: SetDict::new(&c.interner), c, table };
        let prepared: Vec<Prepared> = chunk
            .iter()
            .enumerate()
            .map(|(i, item)| {
                if let Some(next) = chunk.get(i + 1) {
                    touch(next.spec);
                }
                let mut problems = Vec::new();
                match item.check {
                    Some(Check::Acnp(p)) => {
                        validate::antrea_cluster_network_policy(p, table, &mut problems)
                    }
                    Some(Check::Annp(p)) => {
                        validate::antrea_network_policy(p, table, &mut problems)
                    }
                    None => {}
                }
                // An object with an error is left out, as [`admit`] leaves it out.
                let body = match problems.iter().any(Problem::is_error) {
                    true => None,
                    false => w.policy(item, &mut problems),
                };
                if let Some(body) = &body {
                    w.dict.mark_used(body.keys());
                }
                Prepared { problems, body, worker }
            })
            .collect();
        (prepared, w.dict)
    });
    gather(results, items.len())
}

/// Reads the first byte of every selector's first label, rule name and port protocol of a
/// policy, in one pass of loads independent of each other, so that the CPU overlaps their
/// cache misses; run on the next policy before validating and compiling one, which then
/// read them one miss after another (as the admin pass touches its next rule's peers,
/// [`super::admin`]). The bench's Antrea set is 97 MiB of objects read once a compile.
fn touch(spec: PolicySpecRef<'_>) {
    let first = first_byte;
    let sel = |s: &Option<LabelSelector>| s.as_ref().map_or(0, touch_selector);
    let applied = |a: &AppliedTo| sel(&a.namespace_selector) ^ sel(&a.pod_selector);
    let mut acc = spec.applied_to.iter().fold(0u8, |acc, a| acc ^ applied(a));
    for r in spec.ingress.iter().chain(spec.egress) {
        for p in r.from.iter().chain(&r.to) {
            acc ^= sel(&p.namespace_selector) ^ sel(&p.pod_selector);
        }
        acc ^= r.applied_to.iter().fold(0u8, |acc, a| acc ^ applied(a));
        if let Some(p) = r.ports.first() {
            acc ^= p.protocol.as_deref().map_or(0, first);
        }
        acc ^= first(&r.name);
    }
    std::hint::black_box(acc);
}

/// About how much compiling a policy takes: its rules and peers.
pub(super) fn weight(spec: PolicySpecRef<'_>) -> usize {
    let rules = spec.ingress.iter().chain(spec.egress);
    1 + spec.applied_to.len() + rules.map(|r| 1 + r.from.len() + r.to.len()).sum::<usize>()
}

/// What one peer of a rule selects, before the rule's action decides what an
/// unevaluable peer means.
enum PeerSet {
    /// A pod set: a key of the worker's [`SetDict`] that resolves.
    Pods(u32),
    /// Pods relative to the subject's namespace: the key of the peer's pods in every
    /// namespace.
    Relative(u32, SameNamespaces),
    /// Node ids.
    Nodes(RoaringBitmap),
    /// An address block.
    Block(Block),
    /// Nothing (a peer naming no selector: Antrea's group "selects nothing when all
    /// selectors are missing").
    Nothing,
    /// A peer this engine cannot evaluate (§9).
    Unevaluable,
}

/// One worker of [`prepare`]: its dict, and what it reads of the cluster (namespace ids,
/// the node label index) and the Tier table.
struct Worker<'c> {
    dict: SetDict,
    c: &'c Cluster,
    table: &'c TierTable,
}

impl Worker<'_> {
    /// Compiles one admitted policy. `None` (with an error in `problems`) when its Tier
    /// does not exist; `None` alone for an ANNP in a namespace nobody declared.
    fn policy(&mut self, item: &Item<'_>, problems: &mut Vec<Problem>) -> Option<Body> {
        let spec = item.spec;
        let object = validate::object_ref(item.kind, item.metadata);
        let Some(entry) = self.table.get(spec.tier) else {
            problems.push(Problem::error(
                &object,
                "spec.tier",
                ProblemKind::Invalid {
                    value: spec.tier.to_owned(),
                    reason: format!("tier {} does not exist", tier_object_name(spec.tier).as_ref()),
                },
            ));
            return None;
        };
        // No pod lives in a namespace nobody declared: an ANNP there selects nothing (as a
        // NetworkPolicy there does).
        let ns = match item.namespaced {
            true => Some(*self.c.ns_ids.get(&meta_namespace(item.metadata))?),
            false => None,
        };
        let (tier, rank) = if entry.priority >= rank::ANTREA_BASELINE {
            (Tier::Baseline, entry.priority)
        } else {
            (Tier::Admin, entry.priority)
        };
        let applied_to =
            (!spec.applied_to.is_empty()).then(|| self.applied_to(spec.applied_to, ns));
        let mut rule_applied_to: [Vec<Vec<u32>>; 2] = Default::default();
        let mut rules: [Vec<Rule>; 2] =
            [spec.ingress.len(), spec.egress.len()].map(Vec::with_capacity);
        for (d, list) in [(Direction::Ingress, spec.ingress), (Direction::Egress, spec.egress)] {
            for (i, r) in list.iter().enumerate() {
                if applied_to.is_none() {
                    rule_applied_to[d as usize].push(self.applied_to(&r.applied_to, ns));
                }
                rules[d as usize].push(self.rule(i, d, r, ns));
            }
        }
        Some(Body {
            object,
            tier,
            rank,
            priority: spec.priority,
            tier_name: tier_object_name(spec.tier).into_owned(),
            annotations: own_annotations(item.metadata),
            applied_to,
            rule_applied_to,
            rules,
        })
    }

    /// The keys of the pod sets an `appliedTo` list selects (§6), those that resolve.
    /// Entries of kinds this engine does not evaluate (group, serviceAccount, service,
    /// nodeSelector, externalEntitySelector; `validate` warns about each) select no pod.
    fn applied_to(&mut self, list: &[AppliedTo], ns: Option<u32>) -> Vec<u32> {
        let mut keys = Vec::with_capacity(list.len());
        for a in list {
            let AppliedTo {
                pod_selector,
                namespace_selector,
                external_entity_selector,
                group,
                service_account,
                service,
                node_selector,
            } = a;
            let other = external_entity_selector.is_some()
                || !group.is_empty()
                || service_account.is_some()
                || service.is_some()
                || node_selector.is_some();
            if other {
                continue;
            }
            let set = match (ns, namespace_selector, pod_selector) {
                // ANNP: "podSelector within the ANNP's Namespace only"; a namespaceSelector
                // is outside its schema (pruned by the API server).
                (Some(ns), _, Some(p)) => RawSet::InNamespace(ns, p.into()),
                // An empty entry: Antrea's group selector keeps the ANNP's namespace and
                // matches every pod there (`group.go NewGroupSelector`,
                // `group_entity_index.go match`; antrea-model.md §11.5).
                (Some(ns), _, None) => RawSet::InNamespace(ns, EVERYTHING),
                (None, Some(n), Some(p)) => RawSet::Pods(n.into(), p.into()),
                (None, Some(n), None) => RawSet::Namespaces(n.into()),
                (None, None, Some(p)) => RawSet::Pods(EVERYTHING, p.into()),
                (None, None, None) => continue,
            };
            let k = self.dict.key(set);
            if self.dict.resolves(k) {
                keys.push(k);
            }
        }
        keys
    }

    /// The key of a set that resolves, else [`PeerSet::Unevaluable`] (a selector that
    /// does not compile).
    fn pods(&mut self, set: RawSet<'_>) -> PeerSet {
        let k = self.dict.key(set);
        match self.dict.resolves(k) {
            true => PeerSet::Pods(k),
            false => PeerSet::Unevaluable,
        }
    }

    /// One peer of a rule (§7), in a policy of namespace `ns` (an ANNP's) or none (ACNP).
    fn peer(&mut self, p: &NetworkPolicyPeer, d: Direction, ns: Option<u32>) -> PeerSet {
        let NetworkPolicyPeer {
            ip_block,
            pod_selector,
            namespace_selector,
            namespaces,
            external_entity_selector,
            group,
            fqdn,
            service_account,
            node_selector,
            scope,
            unknown: _,
        } = p;
        // A key outside this position's schema (or no peer's key at all): the peer cannot
        // be evaluated as written (§9).
        if validate::peer_outside_schema(p, ns.is_some(), d) {
            return PeerSet::Unevaluable;
        }
        // Antrea's `toAntreaPeerForCRD` reads the first of ipBlock, group, fqdn,
        // serviceAccount, nodeSelector and ignores the rest of the peer.
        if let Some(b) = ip_block {
            return match cidr::parse(&b.cidr) {
                Ok(net) => {
                    let except = b.except.iter().filter_map(|e| cidr::parse(e).ok()).collect();
                    PeerSet::Block(Block { net, except })
                }
                Err(_) => PeerSet::Unevaluable,
            };
        }
        if !group.is_empty() || !fqdn.is_empty() || service_account.is_some() {
            return PeerSet::Unevaluable;
        }
        if let Some(n) = node_selector {
            return match selector(n) {
                Some(s) => PeerSet::Nodes(self.c.node_index.resolve(&s)),
                None => PeerSet::Unevaluable,
            };
        }
        if external_entity_selector.is_some() || *scope == Some(PeerScope::ClusterSet) {
            return PeerSet::Unevaluable;
        }
        if let Some(n) = namespaces {
            let same = match (&n.match_, &n.same_labels) {
                (Some(NamespaceMatchType::SelfNamespace), _) => SameNamespaces::Own,
                // An empty list names no label: Antrea drops such a peer
                // (`splitPeersByScope`); here it is a peer this engine cannot evaluate
                // (§9), warned by validation.
                (None, Some(keys)) if keys.is_empty() => return PeerSet::Unevaluable,
                (None, Some(keys)) => SameNamespaces::Labels(keys.clone().into_boxed_slice()),
                (None, None) => return PeerSet::Unevaluable,
            };
            let set = match pod_selector {
                Some(p) => RawSet::Pods(EVERYTHING, p.into()),
                None => RawSet::Namespaces(EVERYTHING),
            };
            return match self.pods(set) {
                PeerSet::Pods(k) => PeerSet::Relative(k, same),
                other => other,
            };
        }
        match (namespace_selector, pod_selector, ns) {
            (Some(n), Some(p), _) => self.pods(RawSet::Pods(n.into(), p.into())),
            (Some(n), None, _) => self.pods(RawSet::Namespaces(n.into())),
            // ANNP: the pods of the policy's namespace; ACNP: of every namespace.
            (None, Some(p), Some(ns)) => self.pods(RawSet::InNamespace(ns, p.into())),
            (None, Some(p), None) => self.pods(RawSet::Pods(EVERYTHING, p.into())),
            // An empty ANNP peer selects its namespace (as an empty appliedTo entry does);
            // an empty ACNP peer selects nothing.
            (None, None, Some(ns)) => self.pods(RawSet::InNamespace(ns, EVERYTHING)),
            (None, None, None) => PeerSet::Nothing,
        }
    }

    /// One rule at position `index` of direction `d`; its `applied_to` is left `None`
    /// (the finishing step sets it from [`Body::rule_applied_to`]).
    fn rule(&mut self, index: usize, d: Direction, r: &antrea::Rule, ns: Option<u32>) -> Rule {
        let action = match r.action {
            RuleAction::Allow => Action::Allow,
            RuleAction::Drop => Action::Deny,
            RuleAction::Reject => Action::Reject,
            RuleAction::Pass => Action::Pass,
        };
        let allow = action == Action::Allow;
        let list = match d {
            Direction::Ingress => &r.from,
            Direction::Egress => &r.to,
        };
        let (ports, ports_unevaluable, selects_no_port) =
            antrea_ports(&r.ports, &r.protocols, allow);
        // `toServices` and `l7Protocols` are peers and ports this engine cannot evaluate.
        let to_services = d == Direction::Egress && !r.to_services.is_empty();
        let mut unknown = ports_unevaluable || !r.l7_protocols.is_empty();
        let mut peers = PeersBuilder::default();
        // Most peers are pod sets: sized for them, boxing the list for the snapshot is
        // this allocation, not a shrinking second one.
        peers.pod_sets.reserve_exact(list.len());
        if list.is_empty() && !to_services {
            // "Absent or empty list → every address" (crd_utils.go `matchAllPeer`).
            peers.all = true;
        }
        if to_services {
            unknown = true;
        }
        for p in list {
            match self.peer(p, d, ns) {
                PeerSet::Pods(k) => peers.pod_sets.push(k),
                PeerSet::Relative(pods, same) => peers.relative.push(Relative { pods, same }),
                PeerSet::Nodes(n) => *peers.nodes.get_or_insert_with(RoaringBitmap::new) |= n,
                PeerSet::Block(b) => peers.blocks.push(b),
                PeerSet::Nothing => {}
                PeerSet::Unevaluable => unknown = true,
            }
        }
        let mut fail_closed = false;
        let mut action = action;
        if unknown {
            if allow {
                // An Allow matches nothing through what it cannot evaluate: an L7 or
                // toServices Allow matches nothing at all.
                if !r.l7_protocols.is_empty() || to_services {
                    peers = PeersBuilder::default();
                }
            } else {
                // "applies to all the traffic its ports select"; a Pass acts as a drop.
                peers = PeersBuilder::all();
                fail_closed = true;
                if action == Action::Pass {
                    action = Action::Deny;
                }
            }
        }
        if selects_no_port {
            // Only ICMP/IGMP protocols, or only port entries an Allow cannot evaluate.
            peers = PeersBuilder::default();
        }
        Rule {
            name: (!r.name.is_empty()).then(|| r.name.as_str().into()),
            index: index as u32,
            action,
            peers: peers.build(),
            ports,
            fail_closed,
            applied_to: None,
            enable_logging: r.enable_logging,
            log_label: (!r.log_label.is_empty()).then(|| Arc::from(r.log_label.as_str())),
        }
    }
}

impl Cluster {
    /// The pod sets of a [`prepare`]d policy's `appliedTo` lists (`sets`: its worker's key
    /// → set id): each list one set, a union of several interned.
    fn applied_sets(&mut self, body: &Body, sets: &[SetId]) -> AppliedSets {
        let policy = body.applied_to.as_ref().map(|keys| self.applied_set(keys, sets));
        let rules = [0, 1].map(|d| {
            let lists = &body.rule_applied_to[d];
            (0..body.rules[d].len())
                .map(|i| lists.get(i).map(|keys| self.applied_set(keys, sets)))
                .collect()
        });
        AppliedSets { policy, rules }
    }

    /// The one pod set an `appliedTo` list's keys select: the set itself when there is
    /// one, else the interned union of them (empty for none).
    fn applied_set(&mut self, keys: &[u32], sets: &[SetId]) -> SetId {
        let mut ids: Vec<SetId> = keys.iter().map(|&k| sets[k as usize]).collect();
        ids.sort_unstable();
        ids.dedup();
        match ids.as_slice() {
            [one] => *one,
            _ => self.intern(SetKey::Union(ids)),
        }
    }
}

/// Finishes a policy [`prepare`]d on a worker whose keys are interned (`sets`: the
/// worker's key → set id; `applied`: its `appliedTo` sets; `interned`: the interner's
/// sets): the rules' pod sets become sorted set ids, and the subject is the policy's
/// `appliedTo` set or the union of its rules'.
fn finish(
    body: Body,
    sets: &[SetId],
    applied: &AppliedSets,
    interned: &[Arc<RoaringBitmap>],
) -> Policy {
    let Body {
        object,
        tier,
        rank,
        priority,
        tier_name,
        annotations,
        applied_to: _,
        rule_applied_to: _,
        mut rules,
    } = body;
    let mut subject = RoaringBitmap::new();
    for (d, rules) in rules.iter_mut().enumerate() {
        for (i, rule) in rules.iter_mut().enumerate() {
            rule.peers.map_pod_sets(|k| sets[k as usize]);
            for rel in rule.peers.relative.iter_mut() {
                rel.pods = sets[rel.pods as usize];
            }
            if let Some(s) = applied.rules[d][i] {
                // A rule whose appliedTo selects nothing applies to no subject.
                subject |= &*interned[s as usize];
                rule.applied_to = Some(s);
            }
        }
    }
    let applies = [!rules[0].is_empty(), !rules[1].is_empty()];
    let (subject, subject_set) = match applied.policy {
        Some(s) => (Arc::clone(&interned[s as usize]), Some(s)),
        None => (Arc::new(subject), None),
    };
    Policy {
        object: Arc::new(object),
        tier,
        rank,
        priority,
        antrea_tier: Some(Arc::from(tier_name)),
        rules: Arc::new(rules),
        matchers: [None, None],
        subject,
        subject_set,
        applies,
        annotations: annotations.into(),
    }
}

/// A rule's `ports` and `protocols` (§8): the port list, whether some entry could not be
/// evaluated (`sourcePort`), and whether the rule selects no TCP, UDP or SCTP port at all
/// (only `protocols` entries, or an Allow whose every entry names a source port).
fn antrea_ports(
    ports: &[NetworkPolicyPort],
    protocols: &[antrea::NetworkPolicyProtocol],
    allow: bool,
) -> (Ports, bool, bool) {
    if ports.is_empty() && protocols.is_empty() {
        return (Ports::any(), false, false);
    }
    let mut unevaluable = false;
    // At most one entry a port: sized so that the boxed slice below is this allocation,
    // not a second one.
    let mut out = Vec::with_capacity(ports.len());
    for p in ports {
        let NetworkPolicyPort { protocol, port, end_port, source_port, source_end_port } = p;
        if source_port.is_some() || source_end_port.is_some() {
            unevaluable = true;
            if allow {
                // An Allow matches nothing through a source port it cannot check.
                continue;
            }
        }
        let protocol = Some(protocol_or_tcp(protocol.as_deref()));
        let ports = match port {
            None => PortSpec::Any,
            Some(IntOrString::Int(n)) => {
                // Validation refuses ports outside 1–65535 and an endPort below port; an
                // unvalidated one selects the ports it names that exist, never others.
                let hi = end_port.unwrap_or(*n);
                if *n > i32::from(u16::MAX) || hi < 1 || hi < *n {
                    continue;
                }
                PortSpec::Range(port_u16(*n), port_u16(hi))
            }
            Some(IntOrString::String(name)) => PortSpec::Named(name.clone()),
        };
        out.push(PortMatch { protocol, ports });
    }
    let none = out.is_empty();
    (Ports(out.into_boxed_slice()), unevaluable, none)
}
