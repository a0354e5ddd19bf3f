//! Stages 1 and 2 for Antrea's objects (`crd.antrea.io/v1beta1` Tier, ClusterNetworkPolicy,
//! NetworkPolicy; issue #22): validated together, since a policy is valid only if the Tier
//! it names exists, and admitted as the other policy kinds are (an invalid one as its last
//! good version, [`super::lastgood`]).
//!
//! 1. **Tiers**, last of each name, in creation order (then name order:
//!    [`crate::policy::antrea_tiers::creation_order`], as the compiler orders them), make
//!    the Tier table ([`TierTable::build`]: each Tier alone, then against the others: reserved and
//!    taken priorities, static Tiers, at most 20). They are validated together, again
//!    whenever one changes. An invalid Tier is replaced by its recorded version (same uid),
//!    and the table is built again with it; one without a valid record is left out.
//! 2. **Policies** are validated against that table, each once per version and table: a
//!    change of the table (a Tier created, deleted, or put back) validates every policy
//!    again, so a policy naming a Tier that does not exist turns valid when the Tier
//!    appears, and invalid when it goes.
//! 3. **Invalid policies** are replaced by their recorded versions, validated against the
//!    table plus the recorded Tiers that no longer exist and that those versions name
//!    ([`lastgood::ghost_tier`]): a Tier deleted under its policies (which Antrea's webhook
//!    refuses) keeps them, and itself at its recorded priority, in force; said once at
//!    WARN. What has no valid record is left out: none of its rules apply.
//!
//! tierproxy writes no status on these objects (Antrea's controller does); the report names
//! the invalid ones, for the status writer's Events.
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;

use kube::Resource;

use super::{Cache, Level, Stage, Versioned, check_kind, check_recorded, key_of};
use crate::cluster::lastgood::{self, Records};
use crate::policy::antrea_tiers::{TierTable, creation_order, tier_object_name};
use crate::policy::api::antrea;
use crate::policy::{Inputs, Kind, ObjectRef, Problem, ProblemKind, validate};

/// One run of [`TierTable::build`], kept for the next build: a list of Tiers that
/// validates as the last one (the same allocations, or equal content) gives its result
/// again without validating.
#[derive(Default)]
pub(super) struct TierRun {
    given: Vec<Arc<antrea::Tier>>,
    problems: Vec<Problem>,
    table: TierTable,
    /// Indices in `given` of the admitted Tiers.
    admitted: Vec<usize>,
}

impl TierRun {
    /// Builds the table of `tiers` unless they validate as the last run's; counts the
    /// Tiers validated in `validated`.
    fn run(&mut self, tiers: &[Arc<antrea::Tier>], validated: &mut usize) {
        let same = self.given.len() == tiers.len()
            && self.given.iter().zip(tiers).all(|(a, b)| Arc::ptr_eq(a, b) || a.validates_as(b));
        if same {
            // Hold the current allocations, so that older equal ones can be freed.
            self.given = tiers.to_vec();
            return;
        }
        let mut problems = Vec::new();
        let (table, admitted) = TierTable::build(tiers, &mut problems);
        let admitted = tiers
            .iter()
            .enumerate()
            .filter(|(_, t)| admitted.iter().any(|a| Arc::ptr_eq(a, t)))
            .map(|(i, _)| i)
            .collect();
        *validated += tiers.len();
        *self = TierRun { given: tiers.to_vec(), problems, table, admitted };
    }

    /// Whether the Tier at `i` of the last run's list was admitted.
    fn admits(&self, i: usize) -> bool {
        self.admitted.binary_search(&i).is_ok()
    }

    /// The admitted Tiers, in input order.
    fn admitted(&self) -> Vec<Arc<antrea::Tier>> {
        self.admitted.iter().map(|&i| Arc::clone(&self.given[i])).collect()
    }
}

/// A validation cache whose results hold for one Tier table: emptied when the table
/// changes.
pub(super) struct TableCache<T> {
    table: Option<TierTable>,
    cache: Cache<T>,
}

impl<T> Default for TableCache<T> {
    fn default() -> Self {
        TableCache { table: None, cache: Cache::default() }
    }
}

impl<T> TableCache<T> {
    /// The cache of results against `table`.
    fn of(&mut self, table: &TierTable) -> &mut Cache<T> {
        if self.table.as_ref() != Some(table) {
            self.cache = Cache::default();
            self.table = Some(table.clone());
        }
        &mut self.cache
    }
}

/// The validation state of Antrea's objects, carried from build to build.
#[derive(Default)]
pub(super) struct Caches {
    /// The Tiers as given.
    tiers: TierRun,
    /// The Tiers with the recorded versions of invalid ones put back.
    recorded_tiers: TierRun,
    /// Those and the recorded Tiers deleted under their policies.
    with_ghosts: TierRun,
    cluster: TableCache<antrea::ClusterNetworkPolicy>,
    namespaced: TableCache<antrea::NetworkPolicy>,
    recorded_cluster: TableCache<antrea::ClusterNetworkPolicy>,
    recorded_namespaced: TableCache<antrea::NetworkPolicy>,
}

/// What [`admit`] found.
#[derive(Default)]
pub(super) struct Admitted {
    /// The problems of the objects as given (duplicates, validation of the current
    /// versions); those of a recorded version put back are not among them.
    pub problems: Vec<Problem>,
    /// The objects enforced as their recorded version, with the generation recorded.
    pub kept: Vec<(ObjectRef, Option<i64>)>,
    /// The invalid objects left out.
    pub left_out: Vec<ObjectRef>,
    /// The objects whose version as given is valid, with its `metadata.generation`: what
    /// the leader may record.
    pub valid: BTreeMap<ObjectRef, Option<i64>>,
    /// What to log besides the problems.
    pub lines: Vec<(Level, String)>,
    /// Objects validated (Tiers: all of a list that changed).
    pub validated: usize,
}

/// `items` with one object per key: the last of each, where it stands; every earlier one
/// is reported ([`ProblemKind::Duplicate`]).
fn last_of_each<T: Resource>(
    items: Vec<Arc<T>>,
    kind: Kind,
    problems: &mut Vec<Problem>,
) -> Vec<Arc<T>> {
    let mut seen = HashSet::new();
    let mut kept: Vec<Arc<T>> = Vec::with_capacity(items.len());
    for it in items.into_iter().rev() {
        let r = key_of(kind, &*it);
        if seen.insert(r.clone()) {
            kept.push(it);
        } else {
            problems.push(Problem::warning(&r, "", ProblemKind::Duplicate));
        }
    }
    kept.reverse();
    kept
}

/// [`lastgood::put_back`] on `objects` alone.
fn put_back(
    objects: &mut antrea::Objects,
    records: Option<&Records>,
    invalid: &[ObjectRef],
) -> Vec<(ObjectRef, Option<i64>)> {
    let Some(records) = records.filter(|_| !invalid.is_empty()) else { return Vec::new() };
    let mut inputs = Inputs { antrea: std::mem::take(objects), ..Inputs::default() };
    let kept = lastgood::put_back(&mut inputs, records, invalid);
    *objects = inputs.antrea;
    kept
}

/// The Tier object name `spec.tier` of the policy `r` in `objects` names.
fn tier_of(objects: &antrea::Objects, r: &ObjectRef) -> Option<String> {
    let tier = match r.kind {
        Kind::AntreaClusterNetworkPolicy => objects
            .cluster_network_policies
            .iter()
            .find(|p| key_of(r.kind, &***p) == *r)
            .map(|p| p.spec.tier.as_str()),
        Kind::AntreaNetworkPolicy => objects
            .network_policies
            .iter()
            .find(|p| key_of(r.kind, &***p) == *r)
            .map(|p| p.spec.tier.as_str()),
        _ => None,
    }?;
    Some(tier_object_name(tier).into_owned())
}

/// Validates and admits `objects` (module docs), leaving in it what is to be compiled: the
/// admitted Tiers (and the recorded ones deleted under kept policies), the valid policies
/// and the recorded versions put back.
pub(super) fn admit(
    c: &mut Caches,
    objects: &mut antrea::Objects,
    records: Option<&Records>,
    build: u64,
) -> Admitted {
    let mut out = Admitted::default();
    if objects.is_empty() {
        // Forget what no build needs: the next object validates afresh.
        *c = Caches::default();
        return out;
    }

    // Tiers as given.
    let mut tiers =
        last_of_each(std::mem::take(&mut objects.tiers), Kind::AntreaTier, &mut out.problems);
    creation_order(&mut tiers);
    c.tiers.run(&tiers, &mut out.validated);
    out.problems.extend(c.tiers.problems.iter().cloned());
    let invalid_tiers: Vec<ObjectRef> = (0..tiers.len())
        .filter(|&i| !c.tiers.admits(i))
        .map(|i| key_of(Kind::AntreaTier, &*tiers[i]))
        .collect();
    let present: HashSet<String> = tiers.iter().filter_map(|t| t.metadata.name.clone()).collect();
    objects.tiers = tiers;
    let mut kept_tiers = put_back(objects, records, &invalid_tiers);
    let table = if kept_tiers.is_empty() {
        objects.tiers = c.tiers.admitted();
        c.tiers.table.clone()
    } else {
        // The valid Tiers and the recorded versions put back, where they stand.
        let put: Vec<Arc<antrea::Tier>> = objects
            .tiers
            .iter()
            .enumerate()
            .filter(|(i, t)| {
                c.tiers.admits(*i)
                    || kept_tiers.iter().any(|(k, _)| *k == key_of(Kind::AntreaTier, &***t))
            })
            .map(|(_, t)| Arc::clone(t))
            .collect();
        c.recorded_tiers.run(&put, &mut out.validated);
        let run = &c.recorded_tiers;
        kept_tiers.retain(|(k, _)| {
            put.iter()
                .enumerate()
                .any(|(i, t)| run.admits(i) && key_of(Kind::AntreaTier, &**t) == *k)
        });
        // A valid Tier that a recorded version put back before it now overlaps: refused,
        // and said (its own version is valid, so nothing above said it).
        let refused: BTreeSet<ObjectRef> = put
            .iter()
            .enumerate()
            .filter(|(i, _)| !run.admits(*i))
            .map(|(_, t)| key_of(Kind::AntreaTier, &**t))
            .filter(|r| !invalid_tiers.contains(r))
            .collect();
        out.problems.extend(run.problems.iter().filter(|p| refused.contains(&p.object)).cloned());
        objects.tiers = run.admitted();
        run.table.clone()
    };
    for t in &objects.tiers {
        let r = key_of(Kind::AntreaTier, &**t);
        if !kept_tiers.iter().any(|(k, _)| *k == r) {
            out.valid.insert(r, t.metadata.generation);
        }
    }
    for r in &invalid_tiers {
        if !kept_tiers.iter().any(|(k, _)| k == r) {
            out.left_out.push(r.clone());
            out.lines.push((
                Level::Error,
                format!(
                    "{r}: left out (no valid version is recorded): the policies naming it are \
                     invalid"
                ),
            ));
        }
    }

    // Policies as given, against the table.
    let mut stage = Stage::default();
    check_kind(
        &mut objects.cluster_network_policies,
        Kind::AntreaClusterNetworkPolicy,
        c.cluster.of(&table),
        &|p, out| validate::antrea_cluster_network_policy(p, &table, out),
        build,
        &mut stage,
    );
    check_kind(
        &mut objects.network_policies,
        Kind::AntreaNetworkPolicy,
        c.namespaced.of(&table),
        &|p, out| validate::antrea_network_policy(p, &table, out),
        build,
        &mut stage,
    );
    out.problems.append(&mut stage.problems);
    out.validated += stage.validated;
    let invalid: Vec<ObjectRef> = stage.invalid.into_iter().collect();
    fn generations<T: Resource>(
        list: &[Arc<T>],
        kind: Kind,
        invalid: &[ObjectRef],
        out: &mut BTreeMap<ObjectRef, Option<i64>>,
    ) {
        for o in list {
            let r = key_of(kind, &**o);
            if invalid.binary_search(&r).is_err() {
                out.insert(r, o.meta().generation);
            }
        }
    }
    generations(
        &objects.cluster_network_policies,
        Kind::AntreaClusterNetworkPolicy,
        &invalid,
        &mut out.valid,
    );
    generations(&objects.network_policies, Kind::AntreaNetworkPolicy, &invalid, &mut out.valid);

    // Invalid policies: their recorded versions, against the table and the recorded Tiers
    // deleted under them.
    let mut kept = put_back(objects, records, &invalid);
    let mut ghosts: Vec<Arc<antrea::Tier>> = Vec::new();
    if let Some(records) = records {
        for (r, _) in &kept {
            let Some(name) = tier_of(objects, r) else { continue };
            if table.get(&name).is_some()
                || present.contains(&name)
                || ghosts.iter().any(|g| g.metadata.name.as_deref() == Some(&name))
            {
                continue;
            }
            let tr = ObjectRef::cluster(Kind::AntreaTier, name);
            if let Some(t) = records.0.get(&tr).and_then(|rec| lastgood::ghost_tier(&tr, rec)) {
                ghosts.push(Arc::new(t));
            }
        }
    }
    let (table, ghosts) = if ghosts.is_empty() {
        (table, Vec::new())
    } else {
        let with: Vec<Arc<antrea::Tier>> =
            objects.tiers.iter().cloned().chain(ghosts.iter().cloned()).collect();
        c.with_ghosts.run(&with, &mut out.validated);
        let first = objects.tiers.len();
        let admitted: Vec<Arc<antrea::Tier>> = (first..with.len())
            .filter(|&i| c.with_ghosts.admits(i))
            .map(|i| Arc::clone(&with[i]))
            .collect();
        (c.with_ghosts.table.clone(), admitted)
    };
    if !kept.is_empty() {
        check_recorded(
            &objects.cluster_network_policies,
            Kind::AntreaClusterNetworkPolicy,
            c.recorded_cluster.of(&table),
            &|p, out| validate::antrea_cluster_network_policy(p, &table, out),
            build,
            &mut kept,
            &mut out.validated,
        );
        check_recorded(
            &objects.network_policies,
            Kind::AntreaNetworkPolicy,
            c.recorded_namespaced.of(&table),
            &|p, out| validate::antrea_network_policy(p, &table, out),
            build,
            &mut kept,
            &mut out.validated,
        );
    }
    for g in ghosts {
        let name = g.metadata.name.clone().unwrap_or_default();
        let users: Vec<String> = kept
            .iter()
            .filter(|(r, _)| tier_of(objects, r).as_deref() == Some(name.as_str()))
            .map(|(r, _)| r.to_string())
            .collect();
        if users.is_empty() {
            continue;
        }
        out.lines.push((
            Level::Warn,
            format!(
                "{}: deleted while policies name it (Antrea refuses that); its last good \
                 version (priority {}) stays in force for the recorded versions of {}",
                ObjectRef::cluster(Kind::AntreaTier, name),
                g.spec.priority,
                users.join(", ")
            ),
        ));
        objects.tiers.push(g);
    }

    // What has no valid version is left out.
    let gone: HashSet<&ObjectRef> =
        invalid.iter().filter(|r| !kept.iter().any(|(k, _)| k == *r)).collect();
    if !gone.is_empty() {
        objects
            .cluster_network_policies
            .retain(|o| !gone.contains(&key_of(Kind::AntreaClusterNetworkPolicy, &**o)));
        objects
            .network_policies
            .retain(|o| !gone.contains(&key_of(Kind::AntreaNetworkPolicy, &**o)));
        out.left_out.extend(gone.into_iter().cloned());
    }
    for r in &out.left_out {
        if r.kind != Kind::AntreaTier {
            out.lines.push((
                Level::Error,
                format!("{r}: left out: none of its rules apply (no valid version is recorded)"),
            ));
        }
    }
    out.kept = kept_tiers;
    out.kept.append(&mut kept);
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::cluster::lastgood::Record;

    fn tier(name: &str, uid: &str, priority: i32) -> Arc<antrea::Tier> {
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "crd.antrea.io/v1beta1", "kind": "Tier",
                "metadata": {"name": name, "uid": uid, "generation": 1},
                "spec": {"priority": priority}
            }))
            .unwrap(),
        )
    }

    /// An ACNP `name` in Tier `tier` that drops all ingress of every pod.
    fn acnp(name: &str, tier: &str, generation: i64) -> Arc<antrea::ClusterNetworkPolicy> {
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "crd.antrea.io/v1beta1", "kind": "ClusterNetworkPolicy",
                "metadata": {"name": name, "uid": format!("uid-{name}"), "generation": generation},
                "spec": {"tier": tier, "priority": 5, "appliedTo": [{"podSelector": {}}],
                         "ingress": [{"action": "Drop", "from": [{"namespaceSelector": {}}]}]}
            }))
            .unwrap(),
        )
    }

    /// An ANNP `ns/name` in Tier `tier`.
    fn annp(ns: &str, name: &str, tier: &str) -> Arc<antrea::NetworkPolicy> {
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "crd.antrea.io/v1beta1", "kind": "NetworkPolicy",
                "metadata": {"name": name, "namespace": ns, "uid": format!("uid-{name}"),
                             "generation": 1},
                "spec": {"tier": tier, "priority": 5, "appliedTo": [{"podSelector": {}}],
                         "egress": [{"action": "Reject"}]}
            }))
            .unwrap(),
        )
    }

    /// The record of `o`'s current version.
    fn record<K: Resource, S: serde::Serialize>(o: &K, spec: &S) -> Record {
        Record {
            uid: o.meta().uid.clone(),
            generation: o.meta().generation,
            spec: serde_json::to_value(spec).unwrap(),
        }
    }

    fn objects(
        tiers: &[&Arc<antrea::Tier>],
        acnps: &[&Arc<antrea::ClusterNetworkPolicy>],
        annps: &[&Arc<antrea::NetworkPolicy>],
    ) -> antrea::Objects {
        antrea::Objects {
            tiers: tiers.iter().map(|t| Arc::clone(t)).collect(),
            cluster_network_policies: acnps.iter().map(|p| Arc::clone(p)).collect(),
            network_policies: annps.iter().map(|p| Arc::clone(p)).collect(),
        }
    }

    fn names<T: Resource>(list: &[Arc<T>]) -> Vec<String> {
        list.iter().map(|o| o.meta().name.clone().unwrap_or_default()).collect()
    }

    fn errors_of<'a>(a: &'a Admitted, r: &ObjectRef) -> Vec<&'a str> {
        a.problems
            .iter()
            .filter(|p| p.is_error() && p.object == *r)
            .map(|p| p.field.as_str())
            .collect()
    }

    fn acnp_ref(name: &str) -> ObjectRef {
        ObjectRef::cluster(Kind::AntreaClusterNetworkPolicy, name)
    }

    fn tier_ref(name: &str) -> ObjectRef {
        ObjectRef::cluster(Kind::AntreaTier, name)
    }

    /// A policy's validity follows the Tier it names: invalid (left out, `spec.tier`)
    /// while the Tier does not exist, valid once it does, invalid again once it is gone.
    /// The policy itself never changes: the change of the Tier table validates it again.
    #[test]
    fn a_policy_follows_the_tier_it_names_in_and_out() {
        let mut c = Caches::default();
        let p = acnp("p", "dev", 1);
        let dev = tier("dev", "t1", 10);
        let r = acnp_ref("p");

        let mut o = objects(&[], &[&p], &[]);
        let a = admit(&mut c, &mut o, None, 1);
        assert_eq!(errors_of(&a, &r), ["spec.tier"]);
        assert!(o.cluster_network_policies.is_empty(), "left out");
        assert_eq!(a.left_out, std::slice::from_ref(&r));
        assert!(a.lines.iter().any(|(l, s)| *l == Level::Error && s.contains("left out")));

        let mut o = objects(&[&dev], &[&p], &[]);
        let a = admit(&mut c, &mut o, None, 2);
        assert!(a.problems.iter().all(|p| !p.is_error()), "{:?}", a.problems);
        assert_eq!(names(&o.cluster_network_policies), ["p"]);
        assert_eq!(names(&o.tiers), ["dev"]);
        assert_eq!(a.validated, 2, "the new Tier, and the policy against the new table");
        assert_eq!(a.valid.get(&r), Some(&Some(1)));
        assert_eq!(a.valid.get(&tier_ref("dev")), Some(&Some(1)));

        // Nothing changed: nothing validated.
        let mut o = objects(&[&dev], &[&p], &[]);
        assert_eq!(admit(&mut c, &mut o, None, 3).validated, 0);

        // The Tier is deleted (Antrea's webhook would refuse; a cluster without it does
        // not): with no record, the policy is invalid and left out.
        let mut o = objects(&[], &[&p], &[]);
        let a = admit(&mut c, &mut o, None, 4);
        assert_eq!(errors_of(&a, &r), ["spec.tier"]);
        assert!(o.cluster_network_policies.is_empty() && o.tiers.is_empty());
    }

    /// "Fails closed as its API says": Antrea's API never deletes a Tier a policy names,
    /// so a Tier deleted anyway keeps the policies' recorded versions in force, with the
    /// Tier at its recorded priority; the policy is reported (its Tier does not exist),
    /// and the Tier's deletion is said once. A Tier created again under the name is another
    /// object: the policies are validated against it, not the record.
    #[test]
    fn a_tier_deleted_under_its_policies_keeps_their_recorded_versions_in_force() {
        let mut c = Caches::default();
        let dev = tier("dev", "t1", 10);
        let p = acnp("p", "dev", 3);
        let q = annp("shop", "q", "dev");
        let records = Records(
            [
                (tier_ref("dev"), record(&*dev, &dev.spec)),
                (acnp_ref("p"), record(&*p, &p.spec)),
                (
                    ObjectRef::namespaced(Kind::AntreaNetworkPolicy, "shop", "q"),
                    record(&*q, &q.spec),
                ),
            ]
            .into(),
        );
        let mut o = objects(&[], &[&p], &[&q]);
        let a = admit(&mut c, &mut o, Some(&records), 1);
        assert_eq!(errors_of(&a, &acnp_ref("p")), ["spec.tier"], "reported");
        assert_eq!(names(&o.cluster_network_policies), ["p"], "its recorded version in force");
        assert_eq!(names(&o.network_policies), ["q"]);
        assert_eq!(names(&o.tiers), ["dev"], "the Tier, as recorded, for the compiler");
        assert_eq!(o.tiers[0].spec.priority, 10);
        assert_eq!(a.kept.len(), 2, "{:?}", a.kept);
        assert!(a.kept.contains(&(acnp_ref("p"), Some(3))));
        assert!(a.left_out.is_empty());
        assert!(!a.valid.contains_key(&acnp_ref("p")), "never recorded as good");
        let said: Vec<&String> =
            a.lines.iter().filter(|(l, _)| *l == Level::Warn).map(|(_, s)| s).collect();
        assert_eq!(said.len(), 1, "{said:?}");
        assert!(said[0].contains("Tier.crd.antrea.io dev") && said[0].contains("priority 10"));

        // Without the Tier's record, the policies' records are invalid too: left out.
        let mut without = records.clone();
        without.0.remove(&tier_ref("dev"));
        let mut o = objects(&[], &[&p], &[&q]);
        let a = admit(&mut c, &mut o, Some(&without), 2);
        assert!(o.cluster_network_policies.is_empty() && o.network_policies.is_empty());
        assert!(a.kept.is_empty() && a.left_out.len() == 2);

        // Created again at another priority: the policies are valid against the new
        // Tier, the record is not used.
        let again = tier("dev", "t2", 30);
        let mut o = objects(&[&again], &[&p], &[&q]);
        let a = admit(&mut c, &mut o, Some(&records), 3);
        assert!(a.problems.iter().all(|p| !p.is_error()), "{:?}", a.problems);
        assert!(a.kept.is_empty());
        assert_eq!(o.tiers.len(), 1);
        assert_eq!(o.tiers[0].spec.priority, 30);
    }

    /// A Tier whose current version is invalid (its priority changed to a reserved one,
    /// which Antrea refuses) is replaced by its recorded version, and the policies naming
    /// it stay valid; a record of another object of that name (another uid) is not used.
    #[test]
    fn an_invalid_tier_is_admitted_as_its_record_of_the_same_object() {
        let mut c = Caches::default();
        let good = tier("dev", "t1", 10);
        let bad = tier("dev", "t1", 251);
        let p = acnp("p", "dev", 1);
        let records = Records([(tier_ref("dev"), record(&*good, &good.spec))].into());
        let mut o = objects(&[&bad], &[&p], &[]);
        let a = admit(&mut c, &mut o, Some(&records), 1);
        assert_eq!(errors_of(&a, &tier_ref("dev")), ["spec.priority"]);
        assert_eq!(a.kept, [(tier_ref("dev"), Some(1))]);
        assert_eq!(o.tiers[0].spec.priority, 10);
        assert_eq!(names(&o.cluster_network_policies), ["p"]);
        assert!(errors_of(&a, &acnp_ref("p")).is_empty());

        let other = Records(
            [(tier_ref("dev"), Record { uid: Some("t0".into()), ..record(&*good, &good.spec) })]
                .into(),
        );
        let mut o = objects(&[&bad], &[&p], &[]);
        let a = admit(&mut c, &mut o, Some(&other), 2);
        assert!(a.kept.is_empty());
        assert!(o.tiers.is_empty() && o.cluster_network_policies.is_empty());
        assert_eq!(errors_of(&a, &acnp_ref("p")), ["spec.tier"]);
        assert!(
            a.lines.iter().any(|(l, s)| *l == Level::Error && s.contains("Tier.crd.antrea.io dev"))
        );
    }

    /// Of two Tiers with one priority the one created first is admitted, as Antrea's
    /// webhook admitted it, whatever the input order and the names; without timestamps
    /// (manifests), by name.
    #[test]
    fn of_two_tiers_with_one_priority_the_first_created_wins() {
        let created = |name: &str, uid: &str, at: &str| {
            let mut t = (*tier(name, uid, 10)).clone();
            t.metadata.creation_timestamp = Some(serde_json::from_value(json!(at)).unwrap());
            Arc::new(t)
        };
        let mut c = Caches::default();
        let z = created("z-first", "t1", "2026-11-01T00:00:00Z");
        let a = created("a-second", "t2", "2026-11-02T00:00:00Z");
        let mut o = objects(&[&a, &z], &[], &[]);
        let out = admit(&mut c, &mut o, None, 1);
        assert_eq!(names(&o.tiers), ["z-first"]);
        assert_eq!(errors_of(&out, &tier_ref("a-second")), ["spec.priority"]);

        let (y, b) = (tier("y", "t3", 10), tier("b", "t4", 10));
        let mut o = objects(&[&y, &b], &[], &[]);
        admit(&mut c, &mut o, None, 2);
        assert_eq!(names(&o.tiers), ["b"]);
    }

    /// An invalid policy's recorded version is validated against the Tiers too: a record
    /// naming a Tier that exists neither as an object nor as a record is left out.
    #[test]
    fn an_invalid_policy_is_admitted_as_its_record_when_that_is_valid() {
        let mut c = Caches::default();
        let was = acnp("p", "application", 1);
        let mut now = (*acnp("p", "application", 2)).clone();
        now.spec.priority = 0.5;
        let now = Arc::new(now);
        let records = Records([(acnp_ref("p"), record(&*was, &was.spec))].into());
        let mut o = objects(&[], &[&now], &[]);
        let a = admit(&mut c, &mut o, Some(&records), 1);
        assert_eq!(errors_of(&a, &acnp_ref("p")), ["spec.priority"]);
        assert_eq!(a.kept, [(acnp_ref("p"), Some(1))]);
        assert_eq!(o.cluster_network_policies[0].spec.priority, 5.0);
        assert_eq!(o.cluster_network_policies[0].metadata.generation, Some(2));

        let gone = acnp("p", "nowhere", 1);
        let records = Records([(acnp_ref("p"), record(&*gone, &gone.spec))].into());
        let mut o = objects(&[], &[&now], &[]);
        let a = admit(&mut c, &mut o, Some(&records), 2);
        assert!(a.kept.is_empty() && o.cluster_network_policies.is_empty());
    }
}
