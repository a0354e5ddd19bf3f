//! Incremental compile (issue #21 item 2): a [`Compiler`] keeps what its last compile
//! built and, when the next inputs differ only in the labels of pods or namespaces or in
//! the specs of policies, patches the previous snapshot instead of compiling everything
//! again.
//!
//! A label change moves pods in and out of interned pod sets, and nothing else: pod ids,
//! addresses, policies, their rules and their order stay. So a patch
//! 1. updates the label indexes and, for every interned [`SetKey`], the membership of each
//!    pod whose labels (or whose namespace's labels) changed;
//! 2. for each pod whose membership of some set flipped, sets the pod's class again in the
//!    [`Matcher`](crate::policy::matcher::Matcher)s that name those sets
//!    ([`Matcher::set_pod`](crate::policy::matcher::Matcher::set_pod)), points the policies whose
//!    subject is one of those sets at the new set, and rebuilds the pod's per-pod policy
//!    list (interned with the others);
//! 3. compiles each edited policy alone against the cluster as it is now, under the same
//!    policy id ([`State::edit_policy`]), so nothing that names other policies changes;
//!    an admin policy's rules that equal the previous version's, in their place, are
//!    reused as compiled, and so are the matchers of a direction whose rules all are. A
//!    policy whose tier or priority changed keeps its id too: ids are slots, not
//!    positions in the evaluation order, and the per-pod lists, which carry the order,
//!    take it out where it was and put it in at its new place ([`place`]). The port and
//!    address indexes are by id, and order-free.
//!
//! What the patch copies is what it changes: the snapshot's parts are shared (`Arc`) with
//! the snapshot it came from, which stays valid for whoever still decides with it.
//!
//! Everything else is compiled in full, with the reason kept in [`Pass::Full`]: the first
//! compile, a pod, namespace, node or policy that came or went, a pod whose address, node,
//! ports or phase changed, any node change, more relabelled pods or namespaces at once
//! than a patch is worth ([`MIN_BULK`]), too many policies whose address ranges changed
//! ([`MAX_ADDR_EXTRA`]), duplicates, and pod sets no policy uses any more outgrowing the
//! live ones. (Per-pod lists no pod uses any more are dropped by the patch itself,
//! [`State::compact_policy_sets`].) The patched snapshot
//! decides every flow and reports every problem as a full compile of the same inputs
//! (property test `an_incremental_compile_decides_as_a_full_compile`,
//! tests/properties.rs); its ids of per-pod lists and pod sets may differ, which nothing
//! outside the snapshot sees.
//!
//! Source: issue #21 item 2; docs/architecture.md, "Incremental compile".

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::Arc;

use kube::Resource;

use super::cluster::{Cluster, NO_LABELS, SetKey};
use super::index::{DeclaredPorts, addr_ranges, declared_ports, matcher, place, port_ranges};
use super::{Inputs, meta_name, meta_namespace, own_annotations, parallel};
use crate::policy::api::{Namespace, NetworkPolicy, Node, Pod, v1alpha1, v1alpha2};
use crate::policy::labels::LabelsRef;
use crate::policy::matcher::Scratch;
use crate::policy::model::{Revision, Rule, SetId};
use crate::policy::problem::{Kind, ObjectRef, Problem};
use crate::policy::snapshot::{PodPolicies, Policy, PolicyLists, Snapshot};
use crate::policy::validate::NAMESPACE_NAME_LABEL;
use crate::policy::{Compiled, PodView};

/// What the last [`Compiler::compile`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pass {
    /// Compiled everything ([`Snapshot::compile_validated`]); the reason a patch could not
    /// do, e.g. `"a pod came or went"`.
    Full(&'static str),
    /// Patched the previous snapshot: the pods and the namespaces whose labels changed,
    /// the policies edited (all 0 when nothing the snapshot reads changed).
    Patched {
        /// Pods whose labels changed.
        pods: usize,
        /// Namespaces whose labels changed.
        namespaces: usize,
        /// Policies whose spec (or own annotations) changed.
        policies: usize,
    },
}

impl std::fmt::Display for Pass {
    /// `full (<reason>)` or `patched (<n> pods, <m> namespaces, <k> policies)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Pass::Full(reason) => write!(f, "full ({reason})"),
            Pass::Patched { pods, namespaces, policies } => {
                write!(f, "patched ({pods} pods, {namespaces} namespaces, {policies} policies)")
            }
        }
    }
}

/// Compiles validated inputs ([`Snapshot::compile_validated`]'s contract: every object
/// was validated and the invalid ones left out) again and again, patching the previous
/// snapshot where the change allows it (module docs). One per snapshot builder.
pub struct Compiler {
    state: Option<State>,
    last: Pass,
    workers: usize,
}

impl Default for Compiler {
    fn default() -> Self {
        Compiler::new()
    }
}

impl Compiler {
    /// A compiler with nothing compiled yet: its first compile is a full one.
    pub fn new() -> Compiler {
        Compiler::with_workers(parallel::default_workers())
    }

    /// [`Compiler::new`] with the number of threads a full compile spreads over.
    pub(crate) fn with_workers(workers: usize) -> Compiler {
        Compiler { state: None, last: Pass::Full("first compile"), workers }
    }

    /// What the last [`Compiler::compile`] did.
    pub fn last_pass(&self) -> &Pass {
        &self.last
    }

    /// The snapshot of `inputs` as `revision`, with the problems a full compile reports
    /// (for validated inputs: duplicates and address conflicts). Patches the previous
    /// snapshot when, since the previous call, only pod or namespace labels or policies'
    /// specs changed; otherwise compiles everything
    /// ([`Compiler::last_pass`] says which, and why). Never fails, as [`Snapshot::compile`].
    pub fn compile(&mut self, inputs: &Inputs, revision: Revision) -> Compiled {
        let reason = match self.state.as_mut() {
            None => "first compile",
            Some(state) => match state.sources.diff(inputs, &state.cluster.ns_ids) {
                Ok(changes) => {
                    let (pods, namespaces) = (changes.pods.len(), changes.namespaces.len());
                    match state.patch(changes, revision) {
                        Ok(policies) => {
                            self.last = Pass::Patched { pods, namespaces, policies };
                            return Compiled {
                                snapshot: state.snapshot.clone(),
                                problems: state.problems.clone(),
                            };
                        }
                        Err(reason) => reason,
                    }
                }
                Err(reason) => reason,
            },
        };
        // The old state goes first: its parts are shared with snapshots still in use, and
        // what is not shared should not stay alive beside the new compile.
        self.state = None;
        self.last = Pass::Full(reason);
        let (compiled, cluster) = Snapshot::compile_inner(inputs, revision, false, self.workers);
        self.state = State::new(inputs, &compiled, cluster);
        compiled
    }
}

/// What a compiler keeps between compiles.
struct State {
    /// The compile-time state, its parts shared with `snapshot`.
    cluster: Cluster,
    /// The last snapshot returned (its parts shared with it).
    snapshot: Snapshot,
    problems: Vec<Problem>,
    sources: Sources,
    /// By set id: the (policy id, direction) of every matcher one of whose rules names
    /// the set.
    set_users: Vec<Vec<(u32, u8)>>,
    /// By set id: the policies whose subject the set is.
    subject_users: Vec<Vec<u32>>,
    /// The per-pod lists' ids (`snapshot.policy_sets`).
    policy_set_ids: HashMap<PodPolicies, u32>,
    /// Per-pod lists in use after the last full compile or [`State::compact_policy_sets`].
    live_policy_sets: usize,
    /// Interned pod sets of the last full compile.
    full_sets: usize,
    /// Policy ids by object.
    policy_ids: HashMap<ObjectRef, u32>,
    /// The named ports the pods declare (pods do not change in a patch).
    declared: DeclaredPorts,
}

/// Most policies per direction whose address ranges a patch may change
/// ([`AddrIndex::add_everywhere`]) before a full compile: each is a candidate for every
/// external peer until then, which makes deciding a flow with an external peer a little
/// slower.
///
/// [`AddrIndex::add_everywhere`]: crate::policy::matcher::AddrIndex::add_everywhere
const MAX_ADDR_EXTRA: usize = 64;

/// Pods (or namespaces) whose labels may change in one patch before a full compile is
/// done instead, when 5 % of them is fewer: a patch costs about 0.1–0.3 ms per pod on the
/// large synthetic cluster (10,000 pods, 1,822 interned pod sets), a full compile ~200 ms.
const MIN_BULK: usize = 16;

/// The changes a patch covers, found by [`Sources::diff`].
#[derive(Default)]
struct Changes {
    /// Relabelled namespaces: id and new labels (with `kubernetes.io/metadata.name`).
    namespaces: Vec<(u32, BTreeMap<String, String>)>,
    /// Relabelled pod-network pods: id, old and new source.
    pods: Vec<(u32, PodSource, PodSource)>,
    /// Policies whose `spec` or own annotations changed, as they are now.
    policies: Vec<Edit>,
}

/// A policy that changed: its new version, and for the admin kinds the version compiled
/// last (whose unchanged rules the edit reuses).
enum Edit {
    Network(Arc<NetworkPolicy>),
    Admin(Arc<v1alpha1::AdminNetworkPolicy>, Arc<v1alpha1::AdminNetworkPolicy>),
    Baseline(Arc<v1alpha1::BaselineAdminNetworkPolicy>, Arc<v1alpha1::BaselineAdminNetworkPolicy>),
    Cluster(Arc<v1alpha2::ClusterNetworkPolicy>, Arc<v1alpha2::ClusterNetworkPolicy>),
}

impl State {
    /// The state after a full compile; `None` when the inputs hold duplicates (each
    /// later compile is then a full one, which reports them).
    fn new(inputs: &Inputs, compiled: &Compiled, cluster: Cluster) -> Option<State> {
        let snapshot = compiled.snapshot.clone();
        let sources = Sources::of(inputs, &snapshot)?;
        let sets = cluster.interner.sets.len();
        let mut set_users: Vec<Vec<(u32, u8)>> = vec![Vec::new(); sets];
        let mut subject_users: Vec<Vec<u32>> = vec![Vec::new(); sets];
        // Each matcher's distinct sets, found with a mark per set (which matcher saw it
        // last) rather than a sort: a million peers name a few thousand sets.
        let mut seen_by: Vec<Option<(u32, u8)>> = vec![None; sets];
        for (pid, p) in snapshot.policies.iter().enumerate() {
            if let Some(s) = p.subject_set {
                subject_users[s as usize].push(pid as u32);
            }
            for d in 0..2 {
                if p.matchers[d].is_none() {
                    continue;
                }
                let user = (pid as u32, d as u8);
                for r in &p.rules[d] {
                    for &s in &r.peers.pod_sets {
                        if seen_by[s as usize] != Some(user) {
                            seen_by[s as usize] = Some(user);
                            set_users[s as usize].push(user);
                        }
                    }
                }
            }
        }
        let policy_set_ids =
            snapshot.policy_sets.iter().enumerate().map(|(i, l)| (l.clone(), i as u32)).collect();
        let policy_ids = snapshot
            .policies
            .iter()
            .enumerate()
            .map(|(i, p)| (ObjectRef::clone(&p.object), i as u32))
            .collect();
        Some(State {
            live_policy_sets: snapshot.policy_sets.len(),
            full_sets: sets,
            policy_ids,
            declared: declared_ports(&snapshot.pods),
            cluster,
            snapshot,
            problems: compiled.problems.clone(),
            sources,
            set_users,
            subject_users,
            policy_set_ids,
        })
    }

    /// Applies `changes` to the snapshot (module docs), as `revision`. Returns how many
    /// policies were edited (an admin policy given as a new allocation may prove unchanged).
    ///
    /// # Errors
    /// Why the changes need a full compile after all (the state is then spent): an edited
    /// policy that compiles to none, more changes at once than a patch is
    /// worth, too many address-range edits or unused pod sets since the last full compile.
    fn patch(&mut self, changes: Changes, revision: Revision) -> Result<usize, &'static str> {
        if self.cluster.interner.sets.len() > 2 * self.full_sets + 1024 {
            return Err("the pod sets no policy uses outgrew the live ones");
        }
        let (pods, namespaces) = (self.snapshot.pods.len(), self.snapshot.namespaces.len());
        if changes.pods.len() > MIN_BULK.max(pods / 20)
            || changes.namespaces.len() > MIN_BULK.max(namespaces / 20)
        {
            return Err("many pods or namespaces changed at once: a full compile costs less");
        }
        // Per pod, the sets whose membership of it flipped.
        let mut flipped: BTreeMap<u32, Vec<SetId>> = BTreeMap::new();
        for (ns, labels) in changes.namespaces {
            self.relabel_namespace(ns, labels, &mut flipped);
        }
        for (pod, old, new) in changes.pods {
            self.relabel_pod(pod, &old, &new, &mut flipped);
        }
        let mut changed_sets: Vec<SetId> = flipped.values().flatten().copied().collect();
        changed_sets.sort_unstable();
        changed_sets.dedup();
        let s = &mut self.snapshot;
        for &set in &changed_sets {
            let now = &self.cluster.interner.sets[set as usize];
            s.pod_sets[set as usize] = Arc::clone(now);
            for &pid in &self.subject_users[set as usize] {
                s.policies[pid as usize].subject = Arc::clone(now);
            }
        }
        s.pod_index = Arc::clone(&self.cluster.pod_index);
        s.namespaces = Arc::clone(&self.cluster.namespaces);
        for (pod, mut sets) in flipped {
            sets.sort_unstable();
            sets.dedup();
            self.repatch_pod(pod, &sets);
        }
        // What the edits replace (the previous versions of the objects, and of their
        // compiled policies, when no snapshot still shares them) is freed off the path to
        // the new snapshot: a 100-rule ANP of 100 peers each takes ~0.3 ms to free.
        let mut retired = Vec::with_capacity(changes.policies.len());
        for edit in changes.policies {
            retired.extend(self.edit_policy(edit)?);
        }
        let edited = retired.len();
        free_elsewhere(retired);
        if self.snapshot.policy_sets.len() > 2 * self.live_policy_sets + 1024 {
            self.compact_policy_sets();
        }
        // An edit only adds sets (the ones its new selectors name).
        let (known, sets) = (self.snapshot.pod_sets.len(), &self.cluster.interner.sets);
        self.snapshot.pod_sets.extend_from_slice(&sets[known..]);
        self.snapshot.revision = revision;
        Ok(edited)
    }

    /// Drops the per-pod lists no pod uses any more (edits and relabels leave the lists
    /// they replaced behind) and numbers the others again: one pass over the pods, where
    /// a full compile would cost a hundred times more.
    fn compact_policy_sets(&mut self) {
        let s = &mut self.snapshot;
        let mut renumbered = vec![u32::MAX; s.policy_sets.len()];
        let mut kept: Vec<PodPolicies> = Vec::new();
        for id in Arc::make_mut(&mut s.per_pod) {
            let new = &mut renumbered[*id as usize];
            if *new == u32::MAX {
                *new = kept.len() as u32;
                kept.push(s.policy_sets[*id as usize].clone());
            }
            *id = *new;
        }
        self.policy_set_ids.retain(|_, id| {
            *id = renumbered[*id as usize];
            *id != u32::MAX
        });
        self.live_policy_sets = kept.len();
        s.policy_sets = kept;
    }

    /// Compiles the new version of a policy under its id: its pod sets interned (new
    /// ones resolved against the cluster as it is now), its matchers built, the per-pod
    /// lists of the pods it selected or selects now (and, when its tier or priority
    /// changed, of every pod it selects, at its new place), the port index patched
    /// exactly, and the address index made to take it as a candidate for every external
    /// address when its address ranges changed.
    ///
    /// Returns the edit and the policy it replaced, for the caller to free; `None` when
    /// the new version of an admin policy proves to compile as the last one (the same
    /// rules, tier, priority, subject and own annotations).
    ///
    /// # Errors
    /// When the policy compiles to none, or was not compiled before (neither happens for
    /// a policy [`Sources::diff`] found edited; a full compile follows).
    fn edit_policy(&mut self, edit: Edit) -> Result<Option<(Edit, Policy)>, &'static str> {
        use super::admin::{AdminObject, Edited, admin_policy_edited};
        let object = match &edit {
            Edit::Network(np) => ObjectRef::namespaced(
                Kind::NetworkPolicy,
                meta_namespace(&np.metadata),
                meta_name(&np.metadata),
            ),
            Edit::Admin(o, _) => {
                ObjectRef::cluster(Kind::AdminNetworkPolicy, meta_name(&o.metadata))
            }
            Edit::Baseline(o, _) => {
                ObjectRef::cluster(Kind::BaselineAdminNetworkPolicy, meta_name(&o.metadata))
            }
            Edit::Cluster(o, _) => {
                ObjectRef::cluster(Kind::ClusterNetworkPolicy, meta_name(&o.metadata))
            }
        };
        let pid =
            *self.policy_ids.get(&object).ok_or("an edited policy was not compiled before")?;
        let c = &mut self.cluster;
        let s = &mut self.snapshot;
        let old = &s.policies[pid as usize];
        // Per direction, whether every rule is the one compiled before (admin kinds).
        let policy = match &edit {
            Edit::Network(np) => {
                c.network_policy(object, np).map(|p| Edited::Compiled(p, [false; 2]))
            }
            Edit::Admin(new, was) => {
                admin_policy_edited(c, object, AdminObject::Anp(new), AdminObject::Anp(was), old)
            }
            Edit::Baseline(new, was) => {
                admin_policy_edited(c, object, AdminObject::Banp(new), AdminObject::Banp(was), old)
            }
            Edit::Cluster(new, was) => {
                admin_policy_edited(c, object, AdminObject::Cnp(new), AdminObject::Cnp(was), old)
            }
        };
        let (mut policy, kept) = match policy {
            Some(Edited::Compiled(policy, kept)) => (policy, kept),
            Some(Edited::Unchanged) => return Ok(None),
            None => {
                return Err("an edited policy compiles to none (its namespace is not declared)");
            }
        };
        let mut scratch = Scratch::default();
        let sets = &self.cluster.interner.sets;
        for (d, kept) in kept.into_iter().enumerate() {
            if kept {
                // The same rules against the same sets: the same matcher.
                policy.matchers[d] = old.matchers[d].clone();
                continue;
            }
            let rules = &policy.rules[d];
            scratch.resize(s.pods.len());
            policy.matchers[d] =
                matcher(rules, sets.as_slice(), &self.cluster.addrs, &mut scratch).map(Arc::new);
        }

        // Who names which set now.
        self.set_users.resize(sets.len(), Vec::new());
        self.subject_users.resize(sets.len(), Vec::new());
        if old.subject_set != policy.subject_set {
            if let Some(set) = old.subject_set {
                self.subject_users[set as usize].retain(|&u| u != pid);
            }
            if let Some(set) = policy.subject_set {
                self.subject_users[set as usize].push(pid);
            }
        }
        for d in (0..2).filter(|&d| !kept[d]) {
            // Only the sets it stopped or started naming: most of an edited policy's
            // sets are named by many policies, and an edit leaves most of them as they were.
            let named = |p: &Policy| match p.matchers[d] {
                Some(_) => named_sets(&p.rules[d]),
                None => Vec::new(),
            };
            let user = (pid, d as u8);
            for (set, named_now) in sorted_difference(&named(old), &named(&policy)) {
                let users = &mut self.set_users[set as usize];
                if named_now {
                    users.push(user);
                } else {
                    users.retain(|&u| u != user);
                }
            }
        }

        // The per-pod lists of the pods it selected or selects, where that changed or
        // where its place did: out of the lists it was in, into the lists it belongs
        // in now, at its place.
        let (s0, s1) = (Arc::clone(&old.subject), Arc::clone(&policy.subject));
        let moved = place(old) != place(&policy);
        let (a0, a1) = (old.applies, policy.applies);
        if moved || a0 != a1 || !(Arc::ptr_eq(&s0, &s1) || *s0 == *s1) {
            let (t0, t1) = (old.tier.index(), policy.tier.index());
            let at = place(&policy);
            let mut memo: HashMap<(u32, bool, bool), u32> = HashMap::new();
            let per_pod = Arc::make_mut(&mut s.per_pod);
            for pod in (&*s0 | &*s1).iter() {
                let (in0, in1) = (s0.contains(pod), s1.contains(pod));
                let current = per_pod[pod as usize];
                per_pod[pod as usize] = *memo.entry((current, in0, in1)).or_insert_with(|| {
                    let mut lists = s.policy_sets[current as usize].thaw();
                    for list in &mut lists[t0] {
                        list.retain(|&q| q != pid);
                    }
                    for (list, applies) in lists[t1].iter_mut().zip(a1) {
                        if in1 && applies {
                            let i = list.partition_point(|&q| place(&s.policies[q as usize]) < at);
                            list.insert(i, pid);
                        }
                    }
                    intern_lists(&mut self.policy_set_ids, &mut s.policy_sets, lists)
                });
            }
        }

        // The port index exactly; the address index by a superset when it changed.
        let policies = s.policies.len();
        for d in (0..2).filter(|&d| !kept[d]) {
            let ports = |rules: &[Rule]| {
                let mut out: [Vec<(u32, u32)>; 3] = Default::default();
                port_ranges(rules, &self.declared, |proto, lo, hi| out[proto].push((lo, hi)));
                out.map(merged)
            };
            let (before, after) = (ports(&old.rules[d]), ports(&policy.rules[d]));
            for proto in 0..3 {
                if before[proto] != after[proto] {
                    let index = &mut Arc::make_mut(&mut s.port_index)[d][proto];
                    index.set_policy(pid, &after[proto], policies);
                }
            }
            let addresses = |rules: &[Rule]| {
                let (mut v4, mut v6) = (Vec::new(), Vec::new());
                addr_ranges(
                    rules,
                    |is_v4, lo, hi| {
                        if is_v4 { v4.push((lo, hi)) } else { v6.push((lo, hi)) }
                    },
                );
                (merged(v4), merged(v6))
            };
            if addresses(&old.rules[d]) != addresses(&policy.rules[d]) {
                let index = &mut Arc::make_mut(&mut s.addr_index)[d];
                if index.extra() >= MAX_ADDR_EXTRA {
                    return Err(
                        "too many policies' address ranges changed since the last full compile",
                    );
                }
                index.add_everywhere(pid);
            }
        }
        let old = std::mem::replace(&mut s.policies[pid as usize], policy);
        Ok(Some((edit, old)))
    }

    /// Namespace `ns` now has `labels`: its entry and label index, the memo of pods by
    /// namespace selector, and the pod sets keyed by namespace selectors.
    fn relabel_namespace(
        &mut self,
        ns: u32,
        labels: BTreeMap<String, String>,
        flipped: &mut BTreeMap<u32, Vec<SetId>>,
    ) {
        let c = &mut self.cluster;
        let entry = &mut Arc::make_mut(&mut c.namespaces)[ns as usize];
        let old = std::mem::replace(&mut entry.labels, labels);
        let new = &entry.labels;
        let pods = entry.pods.clone();
        c.ns_index.remove(ns, &old);
        c.ns_index.insert(ns, new);
        for (sel, members) in &mut c.ns_pods {
            match (sel.matches(&old), sel.matches(new)) {
                (false, true) => *members |= &pods,
                (true, false) => *members -= &pods,
                _ => {}
            }
        }
        for &(ref key, id) in c.interner.ids.iter() {
            let (ns_sel, pod_sel) = match key {
                SetKey::Namespaces(n) => (n, None),
                SetKey::Pods(n, p) => (n, Some(p)),
                SetKey::InNamespace(..) | SetKey::Union(_) => continue,
            };
            let now = ns_sel.matches(new);
            if ns_sel.matches(&old) == now {
                continue;
            }
            let moved = match pod_sel {
                Some(p) => c.pod_index.resolve_in(&pods, p),
                None => pods.clone(),
            };
            if moved.is_empty() {
                continue;
            }
            let set = Arc::make_mut(&mut c.interner.sets[id as usize]);
            if now {
                *set |= &moved;
            } else {
                *set -= &moved;
            }
            for pod in &moved {
                flipped.entry(pod).or_default().push(id);
            }
        }
    }

    /// Pod `pod` now has the labels of `new` (it had those of `old`): the pod label index
    /// and its membership of every pod set keyed by a pod selector.
    fn relabel_pod(
        &mut self,
        pod: u32,
        old: &PodSource,
        new: &PodSource,
        flipped: &mut BTreeMap<u32, Vec<SetId>>,
    ) {
        let c = &mut self.cluster;
        let (old, new) = (old.labels(), new.labels());
        let index = Arc::make_mut(&mut c.pod_index);
        index.remove(pod, &old);
        index.insert(pod, &new);
        let ns = c.pods[pod as usize].namespace;
        let ns_labels = &c.namespaces[ns as usize].labels;
        for &(ref key, id) in c.interner.ids.iter() {
            let member = match key {
                SetKey::Namespaces(_) | SetKey::Union(_) => continue,
                SetKey::Pods(n, p) => n.matches(ns_labels) && p.matches(&new),
                SetKey::InNamespace(n, p) => *n == ns && p.matches(&new),
            };
            let set = &mut c.interner.sets[id as usize];
            if set.contains(pod) == member {
                continue;
            }
            let set = Arc::make_mut(set);
            if member {
                set.insert(pod);
            } else {
                set.remove(pod);
            }
            flipped.entry(pod).or_default().push(id);
        }
    }

    /// After the sets `sets` (sorted) gained or lost pod `pod`: the pod's class in every
    /// matcher naming one of them, and its per-pod policy list.
    fn repatch_pod(&mut self, pod: u32, sets: &[SetId]) {
        let s = &mut self.snapshot;
        let addr: Option<IpAddr> = match s.pod_ips[pod as usize].as_slice() {
            [a] => Some(*a),
            _ => None,
        };
        let mut users: Vec<(u32, u8)> =
            sets.iter().flat_map(|&set| self.set_users[set as usize].iter().copied()).collect();
        users.sort_unstable();
        users.dedup();
        for (pid, d) in users {
            let p = &mut s.policies[pid as usize];
            let rules = &p.rules[d as usize];
            let Some(m) = p.matchers[d as usize].as_mut() else { continue };
            if Arc::make_mut(m).set_pod(pod, rules, &s.pod_sets, addr).is_err() {
                // Its class table is full: build it again from what the sets hold now, or,
                // past what a matcher numbers, evaluate that direction rule by rule.
                let mut scratch = Scratch::new(s.pods.len());
                p.matchers[d as usize] =
                    matcher(rules, s.pod_sets.as_slice(), &self.cluster.addrs, &mut scratch)
                        .map(Arc::new);
            }
        }
        // The pod's per-pod list: the policies whose subject flipped join or leave it.
        let current = &s.policy_sets[s.per_pod[pod as usize] as usize];
        let mut lists = current.thaw();
        let mut changed = false;
        for &set in sets {
            for &pid in &self.subject_users[set as usize] {
                let p = &s.policies[pid as usize];
                let member = p.subject.contains(pod);
                for (list, applies) in lists[p.tier.index()].iter_mut().zip(p.applies) {
                    if !applies {
                        continue;
                    }
                    match (list.iter().position(|&q| q == pid), member) {
                        (None, true) => {
                            let at = place(p);
                            let i = list.partition_point(|&q| place(&s.policies[q as usize]) < at);
                            list.insert(i, pid);
                        }
                        (Some(i), false) => {
                            list.remove(i);
                        }
                        _ => continue,
                    }
                    changed = true;
                }
            }
        }
        if !changed {
            return;
        }
        let id = intern_lists(&mut self.policy_set_ids, &mut s.policy_sets, lists);
        Arc::make_mut(&mut s.per_pod)[pod as usize] = id;
    }
}

/// Drops `retired` on a thread of its own (inline if no thread can be started): freeing a
/// large object's thousands of allocations need not delay the snapshot that replaced it.
fn free_elsewhere<T: Send + 'static>(retired: Vec<T>) {
    if retired.is_empty() {
        return;
    }
    // On a spawn error the closure, and `retired` with it, is dropped here.
    let _ = std::thread::Builder::new().name("tierproxy-free".into()).spawn(move || drop(retired));
}

/// The id of per-pod lists `lists` in `sets` (`ids` indexes them), added if new.
fn intern_lists(
    ids: &mut HashMap<PodPolicies, u32>,
    sets: &mut Vec<PodPolicies>,
    lists: PolicyLists,
) -> u32 {
    let lists = PodPolicies::new(&lists);
    if let Some(&id) = ids.get(&lists) {
        return id;
    }
    let id = sets.len() as u32;
    sets.push(lists.clone());
    ids.insert(lists, id);
    id
}

/// `ranges` (inclusive) sorted, with overlapping and adjacent ones merged: equal results
/// cover equal positions.
fn merged<T: Copy + Ord + num_like::Successor>(mut ranges: Vec<(T, T)>) -> Vec<(T, T)> {
    ranges.sort_unstable();
    let mut out: Vec<(T, T)> = Vec::with_capacity(ranges.len());
    for (lo, hi) in ranges {
        match out.last_mut() {
            Some(last) if last.1.successor().is_none_or(|next| lo <= next) => {
                last.1 = last.1.max(hi);
            }
            _ => out.push((lo, hi)),
        }
    }
    out
}

mod num_like {
    /// The next value, if any.
    pub(super) trait Successor: Sized {
        fn successor(self) -> Option<Self>;
    }
    impl Successor for u32 {
        fn successor(self) -> Option<Self> {
            self.checked_add(1)
        }
    }
    impl Successor for u128 {
        fn successor(self) -> Option<Self> {
            self.checked_add(1)
        }
    }
}

/// The values in exactly one of the sorted, deduplicated `old` and `new`, each with
/// whether it is in `new`.
fn sorted_difference(old: &[SetId], new: &[SetId]) -> Vec<(SetId, bool)> {
    let (mut i, mut j, mut out) = (0, 0, Vec::new());
    loop {
        match (old.get(i), new.get(j)) {
            (Some(a), Some(b)) if a == b => (i, j) = (i + 1, j + 1),
            (Some(&a), b) if b.is_none_or(|&b| a < b) => {
                out.push((a, false));
                i += 1;
            }
            (_, Some(&b)) => {
                out.push((b, true));
                j += 1;
            }
            _ => return out,
        }
    }
}

/// The distinct pod sets `rules` name, sorted.
fn named_sets(rules: &[Rule]) -> Vec<SetId> {
    let mut out: Vec<SetId> = rules.iter().flat_map(|r| r.peers.pod_sets.iter().copied()).collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// A pod as given: a whole Pod (manifests in full form) or a view.
#[derive(Clone)]
enum PodSource {
    Pod(Arc<Pod>),
    View(Arc<PodView>),
}

impl PodSource {
    fn is(&self, other: &PodSource) -> bool {
        match (self, other) {
            (PodSource::Pod(a), PodSource::Pod(b)) => Arc::ptr_eq(a, b),
            (PodSource::View(a), PodSource::View(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    fn view(&self) -> Cow<'_, PodView> {
        match self {
            PodSource::Pod(p) => Cow::Owned(PodView::from_pod(p)),
            PodSource::View(v) => Cow::Borrowed(v),
        }
    }

    /// Namespace (`default` when empty, as the compiler reads it) and name.
    fn key(&self) -> (&str, &str) {
        match self {
            PodSource::Pod(p) => (
                p.metadata.namespace.as_deref().filter(|n| !n.is_empty()).unwrap_or("default"),
                p.metadata.name.as_deref().unwrap_or_default(),
            ),
            PodSource::View(v) => (&v.namespace, &v.name),
        }
    }

    fn labels(&self) -> LabelsRef<'_> {
        match self {
            PodSource::Pod(p) => LabelsRef::Map(p.metadata.labels.as_ref().unwrap_or(&NO_LABELS)),
            PodSource::View(v) => LabelsRef::Compact(&v.labels),
        }
    }
}

/// The pods of `inputs` in the order the compiler reads them: whole ones, then views.
fn pod_sources(inputs: &Inputs) -> Vec<PodSource> {
    let pods = inputs.pods.iter().map(|p| PodSource::Pod(Arc::clone(p)));
    pods.chain(inputs.pod_views.iter().map(|v| PodSource::View(Arc::clone(v)))).collect()
}

/// `(namespace, name)` of an object, the namespace as given.
fn key_of<T: Resource>(o: &T) -> (Option<&str>, &str) {
    (o.meta().namespace.as_deref(), o.meta().name.as_deref().unwrap_or_default())
}

/// The objects of `new` that are not the same allocation as their counterpart of `old`
/// (`same`), as (old index, new index) pairs; counterparts share a key. `None` when the
/// keys of `new` are not those of `old`: an object came, went or is given twice.
///
/// Sources hand out their objects in a stable order (the stores keep it while objects
/// only change), so the objects are first compared position by position; only when a
/// position holds another key are they matched by key.
fn changed_pairs<'a, O, N, K: std::hash::Hash + Eq>(
    old: &'a [O],
    new: &'a [N],
    same: impl Fn(&O, &N) -> bool,
    old_key: impl Fn(&'a O) -> K,
    new_key: impl Fn(&'a N) -> K,
) -> Option<Vec<(usize, usize)>> {
    if old.len() != new.len() {
        return None;
    }
    let mut out = Vec::new();
    let in_place = (0..new.len()).all(|k| {
        if same(&old[k], &new[k]) {
            return true;
        }
        out.push((k, k));
        old_key(&old[k]) == new_key(&new[k])
    });
    if in_place {
        return Some(out);
    }
    out.clear();
    let at: rustc_hash::FxHashMap<K, usize> =
        old.iter().enumerate().map(|(i, o)| (old_key(o), i)).collect();
    let mut seen = vec![false; old.len()];
    for (j, n) in new.iter().enumerate() {
        let &i = at.get(&new_key(n))?;
        if std::mem::replace(&mut seen[i], true) {
            return None;
        }
        if !same(&old[i], n) {
            out.push((i, j));
        }
    }
    Some(out)
}

/// The last inputs, kind by kind in the order given: what [`Sources::diff`] compares the
/// next ones with.
struct Sources {
    pods: Vec<PodSource>,
    /// The ids of the pod-network pods: namespace → name → id.
    pod_ids: HashMap<String, HashMap<String, u32>>,
    namespaces: Vec<Arc<Namespace>>,
    nodes: Vec<Arc<Node>>,
    network_policies: Vec<Arc<NetworkPolicy>>,
    admin: Vec<Arc<v1alpha1::AdminNetworkPolicy>>,
    baseline: Vec<Arc<v1alpha1::BaselineAdminNetworkPolicy>>,
    cluster: Vec<Arc<v1alpha2::ClusterNetworkPolicy>>,
}

/// Whether `new` holds the objects of `old`, each the same allocation or `same` as its
/// counterpart.
fn unchanged<T: Resource>(old: &[Arc<T>], new: &[Arc<T>], same: fn(&T, &T) -> bool) -> bool {
    changed_pairs(old, new, |a, b| Arc::ptr_eq(a, b), |o| key_of(&**o), |o| key_of(&**o))
        .is_some_and(|pairs| pairs.iter().all(|&(i, j)| same(&old[i], &new[j])))
}

/// Two versions of each of some objects: (old, new).
type Versions<T> = Vec<(Arc<T>, Arc<T>)>;

/// The policies that are not the same allocation as their counterpart in `old` and that
/// `same` does not find equal, as (old, new) pairs.
///
/// # Errors
/// When a policy came, went or is given twice.
fn edited<T: Resource>(
    old: &[Arc<T>],
    new: &[Arc<T>],
    same: fn(&T, &T) -> bool,
) -> Result<Versions<T>, &'static str> {
    let pairs = changed_pairs(old, new, Arc::ptr_eq, |o| key_of(&**o), |o| key_of(&**o))
        .ok_or("a policy came or went")?;
    Ok(pairs
        .into_iter()
        .filter(|&(i, j)| !same(&old[i], &new[j]))
        .map(|(i, j)| (Arc::clone(&old[i]), Arc::clone(&new[j])))
        .collect())
}

/// NetworkPolicies compile from their `spec` and their own annotations.
macro_rules! same_policy {
    ($t:ty) => {
        (|a: &$t, b: &$t| {
            a.spec == b.spec && own_annotations(&a.metadata) == own_annotations(&b.metadata)
        }) as fn(&$t, &$t) -> bool
    };
}

/// Nodes compile from their labels, own annotations and `status.addresses`.
fn same_node(a: &Node, b: &Node) -> bool {
    let addresses = |n: &Node| n.status.as_ref().and_then(|s| s.addresses.clone());
    a.metadata.labels == b.metadata.labels
        && own_annotations(&a.metadata) == own_annotations(&b.metadata)
        && addresses(a) == addresses(b)
}

/// A namespace's labels as compiled: its own, with `kubernetes.io/metadata.name` set to
/// its name.
fn namespace_labels(ns: &Namespace, name: &str) -> BTreeMap<String, String> {
    let mut labels = ns.metadata.labels.clone().unwrap_or_default();
    labels.insert(NAMESPACE_NAME_LABEL.to_string(), name.to_string());
    labels
}

/// Whether a key repeats in `keys`.
fn repeats<K: std::hash::Hash + Eq>(keys: impl ExactSizeIterator<Item = K>) -> bool {
    let n = keys.len();
    keys.collect::<std::collections::HashSet<K>>().len() != n
}

impl Sources {
    /// The sources of `inputs`, compiled into `snapshot`; `None` when a key repeats (the
    /// compiler then reports it, and every compile is a full one until it goes), and while
    /// `inputs` hold Antrea objects.
    fn of(inputs: &Inputs, snapshot: &Snapshot) -> Option<Sources> {
        // An Antrea policy's subject and rule-level appliedTo are unions of pod sets,
        // which a patch does not follow yet: with Antrea objects every compile is full.
        if !inputs.antrea.is_empty() {
            return None;
        }
        let pods = pod_sources(inputs);
        if repeats(pods.iter().map(PodSource::key))
            || repeats(inputs.namespaces.iter().map(|o| key_of(&**o)))
            || repeats(inputs.nodes.iter().map(|o| key_of(&**o)))
            || repeats(inputs.network_policies.iter().map(|o| key_of(&**o)))
            || repeats(inputs.admin_network_policies.iter().map(|o| key_of(&**o)))
            || repeats(inputs.baseline_admin_network_policies.iter().map(|o| key_of(&**o)))
            || repeats(inputs.cluster_network_policies.iter().map(|o| key_of(&**o)))
        {
            return None;
        }
        let mut pod_ids: HashMap<String, HashMap<String, u32>> = HashMap::new();
        for id in 0..snapshot.pod_count() {
            let (ns, name) = snapshot.pod_name(id);
            pod_ids.entry(ns.to_string()).or_default().insert(name.to_string(), id);
        }
        Some(Sources {
            pods,
            pod_ids,
            namespaces: inputs.namespaces.clone(),
            nodes: inputs.nodes.clone(),
            network_policies: inputs.network_policies.clone(),
            admin: inputs.admin_network_policies.clone(),
            baseline: inputs.baseline_admin_network_policies.clone(),
            cluster: inputs.cluster_network_policies.clone(),
        })
    }

    /// What changed from the last inputs to `inputs` if a patch covers it, with the new
    /// inputs recorded; otherwise why not (the sources are then stale: a full compile
    /// follows, which makes new ones). `ns_ids`: the namespaces' ids.
    fn diff(
        &mut self,
        inputs: &Inputs,
        ns_ids: &super::cluster::NameIds,
    ) -> Result<Changes, &'static str> {
        if !unchanged(&self.nodes, &inputs.nodes, same_node) {
            return Err("a node changed, came or went");
        }
        let mut changes = Changes::default();
        // Every new allocation of an admin policy is a candidate: the edit compares it rule
        // by rule with the last one, once, and leaves it alone if nothing changed
        // (`admin_policy_edited`), where comparing here first would compare twice.
        let edited = (
            edited(&self.network_policies, &inputs.network_policies, same_policy!(NetworkPolicy))?,
            edited(&self.admin, &inputs.admin_network_policies, |_, _| false)?,
            edited(&self.baseline, &inputs.baseline_admin_network_policies, |_, _| false)?,
            edited(&self.cluster, &inputs.cluster_network_policies, |_, _| false)?,
        );
        let (network, admin, baseline, cluster) = edited;
        changes.policies.extend(network.into_iter().map(|(_, new)| Edit::Network(new)));
        changes.policies.extend(admin.into_iter().map(|(was, new)| Edit::Admin(new, was)));
        changes.policies.extend(baseline.into_iter().map(|(was, new)| Edit::Baseline(new, was)));
        changes.policies.extend(cluster.into_iter().map(|(was, new)| Edit::Cluster(new, was)));

        fn ns_key(o: &Arc<Namespace>) -> &str {
            o.metadata.name.as_deref().unwrap_or_default()
        }
        let namespaces =
            changed_pairs(&self.namespaces, &inputs.namespaces, Arc::ptr_eq, ns_key, ns_key)
                .ok_or("a namespace came or went")?;
        for &(i, j) in &namespaces {
            let (was, ns) = (&self.namespaces[i], &inputs.namespaces[j]);
            if was.metadata.labels != ns.metadata.labels {
                let name = ns_key(ns);
                let id = *ns_ids.get(name).ok_or("a namespace came or went")?;
                changes.namespaces.push((id, namespace_labels(ns, name)));
            }
        }

        let pods = pod_sources(inputs);
        let pairs = changed_pairs(&self.pods, &pods, PodSource::is, PodSource::key, PodSource::key)
            .ok_or("a pod came or went")?;
        for &(i, j) in &pairs {
            let (was, now) = (&self.pods[i], &pods[j]);
            let (old, new) = (was.view(), now.view());
            if *old == *new {
                continue;
            }
            let (mut o, mut n) = (old.into_owned(), new.into_owned());
            o.labels = Default::default();
            n.labels = Default::default();
            if o != n {
                return Err("a pod's node, addresses, ports or phase changed");
            }
            let (ns, name) = now.key();
            if let Some(&id) = self.pod_ids.get(ns).and_then(|m| m.get(name)) {
                changes.pods.push((id, was.clone(), now.clone()));
            }
        }

        // Every check passed: record the new inputs.
        self.network_policies.clone_from(&inputs.network_policies);
        self.admin.clone_from(&inputs.admin_network_policies);
        self.baseline.clone_from(&inputs.baseline_admin_network_policies);
        self.cluster.clone_from(&inputs.cluster_network_policies);
        if namespaces.iter().all(|&(i, j)| i == j) {
            for (i, _) in namespaces {
                self.namespaces[i] = Arc::clone(&inputs.namespaces[i]);
            }
        } else {
            self.namespaces.clone_from(&inputs.namespaces);
        }
        if pairs.iter().all(|&(i, j)| i == j) {
            for (i, _) in pairs {
                self.pods[i] = pods[i].clone();
            }
        } else {
            self.pods = pods;
        }
        Ok(changes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::ProblemKind;
    use crate::synth::{self, Shape};

    fn small() -> Inputs {
        let shape = Shape { namespaces: 6, pods: 60, nodes: 3, ..Shape::LARGE };
        let shape = Shape { network_policies: 10, admin_policies: 6, ..shape };
        let mut i = synth::cluster(Shape { rules_per_admin_policy: 5, max_peers: 5, ..shape }, 5);
        i.pod_views = i.pods.drain(..).map(|p| Arc::new(PodView::from_pod(&p))).collect();
        i
    }

    fn relabel(i: &mut Inputs, k: usize, value: &str) {
        let mut v = (*i.pod_views[k]).clone();
        let mut labels: BTreeMap<String, String> =
            v.labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        labels.insert("tier".into(), value.into());
        v.labels = labels.into();
        i.pod_views[k] = Arc::new(v);
    }

    /// Each kind of change compiles as the module docs say, and `last_pass` names it.
    #[test]
    fn each_change_is_patched_or_compiled_in_full_as_documented() {
        let mut i = small();
        let mut c = Compiler::with_workers(1);
        let mut step = 0;
        let mut compile = |c: &mut Compiler, i: &Inputs| {
            step += 1;
            c.compile(i, Revision(step)).snapshot
        };
        compile(&mut c, &i);
        assert_eq!(c.last_pass(), &Pass::Full("first compile"));
        compile(&mut c, &i);
        assert_eq!(c.last_pass(), &Pass::Patched { pods: 0, namespaces: 0, policies: 0 });

        relabel(&mut i, 3, "db");
        compile(&mut c, &i);
        assert_eq!(c.last_pass(), &Pass::Patched { pods: 1, namespaces: 0, policies: 0 });

        let mut ns = (*i.namespaces[2]).clone();
        ns.metadata.labels.get_or_insert_default().insert("env".into(), "elsewhere".into());
        i.namespaces[2] = Arc::new(ns);
        let mut np = (*i.network_policies[1]).clone();
        let spec = np.spec.get_or_insert_default();
        spec.pod_selector.get_or_insert_default().match_labels =
            Some([("tier".to_string(), "edited".to_string())].into());
        i.network_policies[1] = Arc::new(np);
        compile(&mut c, &i);
        assert_eq!(c.last_pass(), &Pass::Patched { pods: 0, namespaces: 1, policies: 1 });

        let mut anp = (*i.admin_network_policies[0]).clone();
        anp.spec.priority += 1;
        i.admin_network_policies[0] = Arc::new(anp);
        compile(&mut c, &i);
        assert_eq!(c.last_pass(), &Pass::Patched { pods: 0, namespaces: 0, policies: 1 });

        // Every admin policy given again as a new allocation (a manifest parsed again, a
        // status write): compared, nothing edited. Then one own annotation: an edit.
        for p in &mut i.admin_network_policies {
            *p = Arc::new((**p).clone());
        }
        compile(&mut c, &i);
        assert_eq!(c.last_pass(), &Pass::Patched { pods: 0, namespaces: 0, policies: 0 });
        let mut anp = (*i.admin_network_policies[1]).clone();
        anp.metadata.annotations = Some([("tierproxy.io/audit".into(), "all".into())].into());
        i.admin_network_policies[1] = Arc::new(anp);
        let s = compile(&mut c, &i);
        assert_eq!(c.last_pass(), &Pass::Patched { pods: 0, namespaces: 0, policies: 1 });
        let id = (0..s.policy_count())
            .find(|&p| {
                *s.policy_ref(p)
                    == ObjectRef::cluster(
                        Kind::AdminNetworkPolicy,
                        meta_name(&i.admin_network_policies[1].metadata),
                    )
            })
            .unwrap();
        assert_eq!(s.policy_annotation(id, "tierproxy.io/audit"), Some("all"));

        let mut moved = (*i.pod_views[4]).clone();
        moved.ips = vec!["10.250.0.9".parse().unwrap()];
        i.pod_views[4] = Arc::new(moved);
        compile(&mut c, &i);
        assert_eq!(c.last_pass(), &Pass::Full("a pod's node, addresses, ports or phase changed"));

        i.pod_views.pop();
        compile(&mut c, &i);
        assert_eq!(c.last_pass(), &Pass::Full("a pod came or went"));

        for k in 0..=MIN_BULK {
            relabel(&mut i, k, "bulk");
        }
        compile(&mut c, &i);
        assert_eq!(
            c.last_pass(),
            &Pass::Full("many pods or namespaces changed at once: a full compile costs less")
        );

        // Lists in another order are matched by key: still a patch.
        i.pod_views.reverse();
        i.network_policies.reverse();
        compile(&mut c, &i);
        assert_eq!(c.last_pass(), &Pass::Patched { pods: 0, namespaces: 0, policies: 0 });

        i.pod_views.push(Arc::clone(&i.pod_views[0]));
        compile(&mut c, &i);
        assert_eq!(c.last_pass(), &Pass::Full("a pod came or went"));
    }

    /// A patch shares what it did not change with the snapshot it came from.
    #[test]
    fn a_pod_relabel_copies_only_what_it_changes() {
        let mut i = small();
        let mut c = Compiler::with_workers(1);
        let before = c.compile(&i, Revision(1)).snapshot;
        relabel(&mut i, 7, "api");
        let after = c.compile(&i, Revision(2)).snapshot;
        assert!(matches!(c.last_pass(), Pass::Patched { pods: 1, .. }));
        assert!(Arc::ptr_eq(&before.pods, &after.pods));
        assert!(Arc::ptr_eq(&before.pod_ips, &after.pod_ips));
        assert!(Arc::ptr_eq(&before.by_ip, &after.by_ip));
        assert!(Arc::ptr_eq(&before.port_index, &after.port_index));
        assert!(Arc::ptr_eq(&before.addr_index, &after.addr_index));
        assert!(!Arc::ptr_eq(&before.pod_index, &after.pod_index), "the pod's labels moved");
        for (a, b) in before.policies.iter().zip(&after.policies) {
            assert!(Arc::ptr_eq(&a.rules, &b.rules), "{}: rules copied", a.object);
        }
    }

    /// Every flow of `shape`'s cluster decided by `patched` as by a full compile of `i`,
    /// compared by policy names (ids may differ), and the same priority conflicts.
    fn assert_decides_as_full(patched: &Snapshot, i: &Inputs, what: &str) {
        use crate::policy::compile::priority_conflicts;
        let full = Snapshot::compile(i, patched.revision()).snapshot;
        let named = |s: &Snapshot, d: crate::policy::Decision| {
            let side = |o: Option<crate::policy::Outcome>| {
                o.map(|o| {
                    let basis = match o.basis {
                        crate::policy::Basis::Rule { hit, .. } => {
                            format!("{}#{}", s.policy_ref(hit.policy), hit.rule)
                        }
                        crate::policy::Basis::Isolated { policy } => {
                            format!("isolated by {}", s.policy_ref(policy))
                        }
                        other => format!("{other:?}"),
                    };
                    let passed: Vec<String> =
                        o.passed.iter().map(|h| s.policy_ref(h.policy).to_string()).collect();
                    (o.verdict, basis, passed)
                })
            };
            (d.verdict, side(d.egress), side(d.ingress))
        };
        let shape = Shape { namespaces: 6, pods: 60, nodes: 3, ..Shape::LARGE };
        for f in synth::flows(shape, 3_000, 17) {
            assert_eq!(
                named(patched, patched.decide(&f)),
                named(&full, full.decide(&f)),
                "{what}: {f:?}"
            );
        }
        let lines = |s: &Snapshot| -> Vec<String> {
            priority_conflicts(s).iter().map(ToString::to_string).collect()
        };
        assert_eq!(lines(patched), lines(&full), "{what}: priority conflicts");
    }

    /// A policy whose priority or tier changes keeps its id and is patched: each pod's
    /// lists take it out where it was and put it in at its new place, ties by name
    /// included, and every flow is decided as a full compile decides it.
    #[test]
    fn a_policy_that_moves_in_the_evaluation_order_is_patched() {
        let mut i = small();
        let cnp = |name: &str, tier: &str, priority: i32, action: &str| {
            let v = serde_json::json!({
                "apiVersion": "policy.networking.k8s.io/v1alpha2",
                "kind": "ClusterNetworkPolicy",
                "metadata": {"name": name},
                "spec": {
                    "tier": tier, "priority": priority,
                    "subject": {"namespaces": {"matchLabels": {"env": "prod"}}},
                    "egress": [{"action": action, "to": [{"pods": {
                        "namespaceSelector": {}, "podSelector": {"matchLabels": {"tier": "db"}}}}]}],
                    "ingress": [{"action": action, "from": [{"namespaces": {}}]}],
                },
            });
            Arc::new(serde_json::from_value::<v1alpha2::ClusterNetworkPolicy>(v).unwrap())
        };
        i.cluster_network_policies = vec![
            cnp("a-deny", "Admin", 40, "Deny"),
            cnp("b-accept", "Baseline", 5, "Accept"),
            cnp("c-deny", "Admin", 10, "Deny"),
        ];
        let mut c = Compiler::with_workers(1);
        let mut revision = 1;
        c.compile(&i, Revision(revision));
        let priorities: Vec<i32> =
            i.admin_network_policies.iter().map(|p| p.spec.priority).collect();
        let mut step = |c: &mut Compiler, i: &Inputs, what: &str| {
            revision += 1;
            let s = c.compile(i, Revision(revision)).snapshot;
            assert_eq!(
                c.last_pass(),
                &Pass::Patched { pods: 0, namespaces: 0, policies: 1 },
                "{what}"
            );
            assert_decides_as_full(&s, i, what);
        };
        // Each ANP to the front, to the back, and onto its neighbour's priority (a tie
        // broken by name, on either side).
        for k in 0..i.admin_network_policies.len() {
            for to in [0, 1000, priorities[(k + 1) % priorities.len()], priorities[k]] {
                let mut anp = (*i.admin_network_policies[k]).clone();
                if anp.spec.priority == to {
                    continue;
                }
                anp.spec.priority = to;
                i.admin_network_policies[k] = Arc::new(anp);
                step(&mut c, &i, &format!("ANP {k} to priority {to}"));
            }
        }
        // A ClusterNetworkPolicy from the Admin tier to the Baseline tier and back, its
        // priority onto another's in each tier. At Admin 10 it ties with `c-deny` (same
        // subject), which has the lower id but comes second by name: the conflict must
        // say `a-deny` is evaluated first.
        for (tier, priority) in [("Baseline", 40), ("Baseline", 5), ("Admin", 5), ("Admin", 10)] {
            i.cluster_network_policies[0] = cnp("a-deny", tier, priority, "Deny");
            step(&mut c, &i, &format!("CNP to {tier} {priority}"));
        }
        let last = c.compile(&i, Revision(revision + 1)).snapshot;
        let conflicts = crate::policy::compile::priority_conflicts(&last);
        assert!(
            conflicts.iter().any(|p| p.object.name == "a-deny"
                && matches!(&p.kind, ProblemKind::PriorityConflict { other, first: true, .. }
                    if other.name == "c-deny")),
            "{conflicts:?}"
        );
    }

    #[test]
    fn sorted_difference_names_what_only_one_side_holds() {
        assert_eq!(sorted_difference(&[], &[]), vec![]);
        assert_eq!(
            sorted_difference(&[1, 3, 5, 9], &[2, 3, 9, 10, 11]),
            vec![(1, false), (2, true), (5, false), (10, true), (11, true)]
        );
        assert_eq!(sorted_difference(&[4, 7], &[]), vec![(4, false), (7, false)]);
    }

    /// Per-pod lists that moves leave behind are dropped by a patch, not by a full
    /// compile: priorities moved back and forth until the lists no pod uses outgrow the
    /// live ones, every build patched, and the compacted snapshot decides as a full
    /// compile.
    #[test]
    fn per_pod_lists_left_behind_are_compacted_in_a_patch() {
        // Ten ANPs that select every pod: each move is a new order, so new lists.
        let mut i = small();
        let anp = |k: usize, priority: i32| {
            let v = serde_json::json!({
                "apiVersion": "policy.networking.k8s.io/v1alpha1",
                "kind": "AdminNetworkPolicy",
                "metadata": {"name": format!("all-{k}")},
                "spec": {
                    "priority": priority,
                    "subject": {"namespaces": {}},
                    "ingress": [{"action": "Pass", "from": [{"namespaces": {}}]}],
                },
            });
            Arc::new(serde_json::from_value::<v1alpha1::AdminNetworkPolicy>(v).unwrap())
        };
        i.admin_network_policies = (0..10).map(|k| anp(k, k as i32)).collect();
        let mut c = Compiler::with_workers(1);
        let first = c.compile(&i, Revision(1)).snapshot;
        let live = first.policy_sets.len();
        let mut longest = live;
        let mut compacted = None;
        let mut x = 1u64;
        for round in 0..5_000u64 {
            let k = round as usize % i.admin_network_policies.len();
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            i.admin_network_policies[k] = anp(k, (x >> 33) as i32 % 1_000);
            let s = c.compile(&i, Revision(round + 2)).snapshot;
            assert!(
                matches!(c.last_pass(), Pass::Patched { .. }),
                "round {round}: {}",
                c.last_pass()
            );
            if s.policy_sets.len() < longest {
                compacted = Some(s);
                break;
            }
            longest = s.policy_sets.len();
        }
        let s = compacted.expect("the lists were compacted within 5,000 moves");
        // Compacted once the lists outgrew the live ones (2 × live + 1,024), not before.
        assert!(longest >= 1024, "compacted after {longest} lists, {live} live");
        let used: std::collections::HashSet<u32> = s.per_pod.iter().copied().collect();
        assert_eq!(used.len(), s.policy_sets.len(), "every list kept is used");
        assert_decides_as_full(&s, &i, "after the compaction");
    }
}
