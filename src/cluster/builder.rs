//! Store → admitted objects → snapshot: the one snapshot builder of an agent (DESIGN §5,
//! issue #21 item 1).
//!
//! [`gather`] reads what the sources hold (the manifest files and the API server's
//! stores) as one [`Loaded`]; a [`Builder`] turns it into the next [`Snapshot`] in three
//! stages:
//!
//! 1. **Validate** each object once per version. Validation results are kept per kind,
//!    namespace and name; an object is validated again only when it changed. "Unchanged"
//!    means the same allocation (the API server's reflector stores hand out the same
//!    `Arc` until an object changes) or, failing that, equal content (manifest files are
//!    parsed again on every change, so their objects are new allocations), in what
//!    validation reads. Content is compared rather than `metadata.resourceVersion`: a
//!    manifest exported with `kubectl get -o yaml` and then edited keeps its old
//!    resourceVersion, and a status write changes it without changing the result.
//! 2. **Admit.** A valid object is admitted as it is. An AdminNetworkPolicy,
//!    BaselineAdminNetworkPolicy or ClusterNetworkPolicy whose version is invalid is
//!    admitted as the last good version recorded for it ([`super::lastgood`]) when that
//!    version is valid (validated once too); every other invalid object is left out,
//!    which fails closed as its API says (none of a left-out policy's rules apply; a
//!    left-out pod, namespace or node is as if it did not exist).
//! 3. **Compile** the admitted objects, once, with a [`Compiler`]: it patches the
//!    previous snapshot when only pod or namespace labels or policies' specs changed, and
//!    otherwise compiles in full ([`Snapshot::compile_validated`]). Before this module the
//!    agent compiled everything, validation included, and compiled again when a last good
//!    version had to be put back.
//!
//! An admin policy (ANP, BANP, CNP) that changed is validated rule by rule against the
//! version validated last: a rule equal to the one in its place keeps its problems, and
//! the same pass tells whether anything changed at all (`Versioned::REVALIDATE`).
//!
//! What a build finds (errors, warnings, notes) comes back as lines, logged once each by
//! a [`ProblemLog`]; each policy's acceptance as a [`Report`] for the status writer.
//!
//! Sources: DESIGN §5 (one store, one builder, immutable snapshots); issue #19 item 1 (last
//! good versions); issue #21 item 1 (stages, validation once per change).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::bail;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;

use super::lastgood::{self, Records};
use super::manifest::{self, Loaded};
use super::status::{self, Report};
use crate::policy::api::{self, v1alpha1, v1alpha2};
use crate::policy::compile::{Compiler, Pass, meta_namespace};
use crate::policy::{Inputs, Kind, ObjectRef, Problem, Revision, Snapshot, validate};

/// Reads `manifests` and adds the API server's objects from `kube` (an object in both: the
/// API server's wins), as one [`Loaded`]. Pods come as views
/// ([`manifest::Form::Compact`]), as the API source keeps them.
pub fn gather(manifests: &[PathBuf], kube: Option<&super::apiserver::ApiSource>) -> Loaded {
    /// `api` added to `files`, replacing a file's object of the same namespace and name.
    fn merge<T: Resource>(files: &mut Vec<Arc<T>>, api: Vec<Arc<T>>) {
        if !files.is_empty() {
            let key = |o: &Arc<T>| (o.meta().namespace.clone(), o.meta().name.clone());
            let theirs: HashSet<_> = api.iter().map(key).collect();
            files.retain(|o| !theirs.contains(&key(o)));
        }
        files.extend(api);
    }
    // Compact: pods as views, as the API source keeps them (issue #17: 10,000 pods from a
    // file took 4x the memory they take from the API server).
    let mut loaded = manifest::load_as(manifests, manifest::Form::Compact);
    if let Some(source) = kube {
        let api = source.inputs();
        let i = &mut loaded.inputs;
        merge(&mut i.namespaces, api.namespaces);
        merge(&mut i.nodes, api.nodes);
        // The API server's pods come as views; a file's pod of the same name gives way.
        if !i.pods.is_empty() || !i.pod_views.is_empty() {
            let theirs: HashSet<(&str, &str)> =
                api.pod_views.iter().map(|v| (v.namespace.as_str(), v.name.as_str())).collect();
            i.pods.retain(|p| {
                let ns = meta_namespace(&p.metadata);
                !theirs.contains(&(ns.as_str(), p.metadata.name.as_deref().unwrap_or("")))
            });
            i.pod_views.retain(|v| !theirs.contains(&(v.namespace.as_str(), v.name.as_str())));
        }
        merge(&mut i.pods, api.pods);
        i.pod_views.extend(api.pod_views);
        merge(&mut i.network_policies, api.network_policies);
        merge(&mut i.admin_network_policies, api.admin_network_policies);
        merge(&mut i.baseline_admin_network_policies, api.baseline_admin_network_policies);
        merge(&mut i.cluster_network_policies, api.cluster_network_policies);
    }
    loaded
}

/// How bad a logged line is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Level {
    /// INFO.
    Info,
    /// WARN.
    Warn,
    /// ERROR.
    Error,
}

/// Logs what builds find (invalid objects, warnings, notes) once each: a line the previous
/// build logged too is not logged again, and a problem that went away is said once at INFO.
/// Every rebuild repeated the ERROR lines of every invalid policy before (issue #19, item
/// 8); a persistent problem now shows once, then only when it changes.
#[derive(Debug, Default)]
pub struct ProblemLog {
    seen: HashSet<(Level, String)>,
}

impl ProblemLog {
    /// Logs the `lines` of one build that the previous build did not log; forgets the rest.
    pub fn log(&mut self, lines: Vec<(Level, String)>) {
        let now: HashSet<(Level, String)> = lines.into_iter().collect();
        for seen @ (level, line) in &now {
            if self.seen.contains(seen) {
                continue;
            }
            match level {
                Level::Info => tracing::info!("{line}"),
                Level::Warn => tracing::warn!("{line}"),
                Level::Error => tracing::error!("{line}"),
            }
        }
        for old @ (level, line) in &self.seen {
            if *level != Level::Info && !now.contains(old) {
                tracing::info!("no longer the case: {line}");
            }
        }
        self.seen = now;
    }
}

/// One build's result.
#[derive(Debug)]
pub struct Built {
    /// The snapshot compiled from the admitted objects.
    pub snapshot: Snapshot,
    /// The problems of the objects as given (decoding, validation of the current versions,
    /// compile warnings, priority conflicts); the problems of a recorded last good version
    /// put back are not among them.
    pub problems: Vec<Problem>,
    /// Each policy's acceptance, for the status writer ([`status`]).
    pub report: Report,
    /// What to log, once each ([`ProblemLog::log`]).
    pub lines: Vec<(Level, String)>,
    /// Objects validated by this build (changed since the previous build, or new; with
    /// the recorded versions put back): 0 when no object changed or came, only went.
    pub validated: usize,
    /// Whether the snapshot was compiled in full (and why) or patched.
    pub pass: Pass,
}

/// Validation results of one kind by object, with the version validated.
struct Cache<T> {
    entries: HashMap<ObjectRef, Checked<T>>,
    /// The last list of this kind checked and what [`check_kind`] made of it: a list of
    /// the same allocations in the same order (a build where this kind did not change)
    /// gives the same result without a key or a lookup per object.
    last: Option<LastList<T>>,
}

/// One kind's list as given to [`check_kind`], and its result.
struct LastList<T> {
    given: Vec<Arc<T>>,
    kept: Vec<Arc<T>>,
    problems: Vec<Problem>,
    invalid: Vec<ObjectRef>,
}

/// One object's validation result.
struct Checked<T> {
    /// The version validated (the newest equal one seen).
    object: Arc<T>,
    problems: Arc<[Problem]>,
    /// Whether the validation found an error.
    invalid: bool,
    /// The build that last saw it.
    seen: u64,
}

impl<T> Default for Cache<T> {
    fn default() -> Self {
        Cache { entries: HashMap::new(), last: None }
    }
}

/// Objects whose versions [`Cache`] tells apart.
trait Versioned: Resource {
    /// Whether `self` and `other` validate alike: equal in everything validation reads
    /// (`metadata.name`, `.namespace`, `.labels`, `.annotations`, `spec`, and `status` for
    /// the kinds whose status is validated). `metadata.resourceVersion` and the rest of the
    /// metadata are not compared: a status write by the status writer changes them, not
    /// the result.
    fn validates_as(&self, other: &Self) -> bool;

    /// For the kinds validated rule by rule: validates `self`, a new version of `was` (same
    /// kind, namespace and name) that is not the same allocation, which validated to
    /// `was_problems`, into `out` (the same problems as validating `self` alone), reusing
    /// the problems of its unchanged rules; returns [`Versioned::validates_as`]`(was)`,
    /// found by the same pass (each rule compared once, where comparing first and then
    /// validating compared the rules twice). `None`: the kind is validated whole (its
    /// objects are small).
    const REVALIDATE: Option<Revalidate<Self>> = None;
}

/// [`Versioned::REVALIDATE`]: `(new, was, was_problems, out) -> new validates as was`.
type Revalidate<T> = fn(&T, &T, &[Problem], &mut Vec<Problem>) -> bool;

/// [`Versioned::REVALIDATE`] of the admin kinds: the rules revalidated and compared in
/// one pass ([`validate::AdminEdit::validate_edited`]), then the metadata and the spec's
/// head (tier, priority, subject).
fn revalidate_admin<T: validate::AdminEdit + Resource>(
    new: &T,
    was: &T,
    was_problems: &[Problem],
    out: &mut Vec<Problem>,
) -> bool {
    new.validate_edited(was, was_problems, out)
        && same_meta(new.meta(), was.meta())
        && new.same_head(was)
}

/// [`Versioned::validates_as`] for the metadata.
fn same_meta(a: &ObjectMeta, b: &ObjectMeta) -> bool {
    a.name == b.name
        && a.namespace == b.namespace
        && a.labels == b.labels
        && a.annotations == b.annotations
}

macro_rules! versioned {
    ($($t:ty => $($field:ident),* $([revalidate $re:path])?;)*) => {$(
        impl Versioned for $t {
            fn validates_as(&self, other: &Self) -> bool {
                same_meta(&self.metadata, &other.metadata) $(&& self.$field == other.$field)*
            }
            $(const REVALIDATE: Option<Revalidate<Self>> = Some($re);)?
        }
    )*};
}

versioned! {
    api::Namespace => spec;
    api::Node => spec, status;
    api::Pod => spec, status;
    api::NetworkPolicy => spec;
    v1alpha1::AdminNetworkPolicy => spec [revalidate revalidate_admin];
    v1alpha1::BaselineAdminNetworkPolicy => spec [revalidate revalidate_admin];
    v1alpha2::ClusterNetworkPolicy => spec [revalidate revalidate_admin];
}

impl<T: Versioned> Cache<T> {
    /// The problems of `object` (named `r`), validated with `validate` unless the version
    /// cached for `r` is the same allocation or equal; counts validations in `validated`.
    fn check(
        &mut self,
        r: &ObjectRef,
        object: &Arc<T>,
        validate: fn(&T, &mut Vec<Problem>),
        build: u64,
        validated: &mut usize,
    ) -> &Checked<T> {
        /// What the cached entry says of `object`.
        enum Found {
            /// The same allocation, or equal in what validation reads: the same problems.
            Same,
            /// Changed, and revalidated rule by rule against the cached version.
            Revalidated(Vec<Problem>),
            /// New, or changed in a kind validated whole.
            Unknown,
        }
        let found = match self.entries.get(r) {
            Some(c) if Arc::ptr_eq(&c.object, object) => Found::Same,
            Some(c) => match T::REVALIDATE {
                // Compared and validated in one pass.
                Some(revalidate) => {
                    let mut problems = Vec::new();
                    match revalidate(object, &c.object, &c.problems, &mut problems) {
                        true => Found::Same,
                        false => Found::Revalidated(problems),
                    }
                }
                None if c.object.validates_as(object) => Found::Same,
                None => Found::Unknown,
            },
            None => Found::Unknown,
        };
        let problems = match found {
            Found::Same => {
                if let Some(c) = self.entries.get_mut(r) {
                    // Hold the current allocation, so an older equal one can be freed.
                    c.object = Arc::clone(object);
                    c.seen = build;
                }
                return &self.entries[r];
            }
            Found::Revalidated(problems) => problems,
            Found::Unknown => {
                let mut problems = Vec::new();
                validate(object, &mut problems);
                problems
            }
        };
        *validated += 1;
        let invalid = problems.iter().any(Problem::is_error);
        let checked =
            Checked { object: Arc::clone(object), problems: problems.into(), invalid, seen: build };
        self.entries.insert(r.clone(), checked);
        &self.entries[r]
    }

    /// Drops the results of objects the build `build` did not see (deleted objects).
    fn forget_unseen(&mut self, build: u64) {
        self.entries.retain(|_, c| c.seen == build);
    }
}

/// The validation caches of every validated kind.
#[derive(Default)]
struct Caches {
    namespaces: Cache<api::Namespace>,
    nodes: Cache<api::Node>,
    pods: Cache<api::Pod>,
    network_policies: Cache<api::NetworkPolicy>,
    admin: Cache<v1alpha1::AdminNetworkPolicy>,
    baseline: Cache<v1alpha1::BaselineAdminNetworkPolicy>,
    cluster: Cache<v1alpha2::ClusterNetworkPolicy>,
    /// The recorded last good versions put back, by policy (a version recorded and the
    /// current one are two versions of one object: kept apart, each validated once).
    recorded_admin: Cache<v1alpha1::AdminNetworkPolicy>,
    recorded_baseline: Cache<v1alpha1::BaselineAdminNetworkPolicy>,
    recorded_cluster: Cache<v1alpha2::ClusterNetworkPolicy>,
}

/// The agent's snapshot builder: validation results and the compiler's state carried
/// from build to build.
#[derive(Default)]
pub struct Builder {
    caches: Caches,
    /// Patches the previous snapshot after small changes (issue #21 item 2).
    compiler: Compiler,
    /// Builds so far.
    builds: u64,
}

/// The key an object is deduplicated and cached by: the compiler's ([`ObjectRef`] with a
/// missing namespace read as `default`, as `kubectl apply` does).
fn key_of<T: Resource>(kind: Kind, o: &T) -> ObjectRef {
    let name = o.meta().name.clone().unwrap_or_default();
    if validate::is_namespaced(kind) {
        ObjectRef::namespaced(kind, meta_namespace(o.meta()), name)
    } else {
        ObjectRef::cluster(kind, name)
    }
}

/// One kind's stage 1: keeps the last object of each key in `list` (reporting the others
/// as duplicates, as the compiler would), validates each (through `cache`), and reports
/// its problems; the keys of invalid objects go to `invalid` (the objects stay in `list`
/// for [`lastgood::put_back`]). A list of the same allocations as the last one, in the
/// same order, gives the last result again.
fn check_kind<T: Versioned>(
    list: &mut Vec<Arc<T>>,
    kind: Kind,
    cache: &mut Cache<T>,
    validate: fn(&T, &mut Vec<Problem>),
    build: u64,
    out: &mut Stage,
) {
    if let Some(last) = &cache.last
        && last.given.len() == list.len()
        && last.given.iter().zip(list.iter()).all(|(a, b)| Arc::ptr_eq(a, b))
    {
        out.problems.extend(last.problems.iter().cloned());
        out.invalid.extend(last.invalid.iter().cloned());
        list.clone_from(&last.kept);
        return;
    }
    let given = list.clone();
    let problems_before = out.problems.len();
    let mut invalid = Vec::new();
    let mut by_key: BTreeMap<ObjectRef, Arc<T>> = BTreeMap::new();
    for o in list.drain(..) {
        let r = key_of(kind, &*o);
        if by_key.insert(r.clone(), o).is_some() {
            out.problems.push(Problem::warning(&r, "", crate::policy::ProblemKind::Duplicate));
        }
    }
    for (r, o) in by_key {
        let checked = cache.check(&r, &o, validate, build, &mut out.validated);
        out.problems.extend(checked.problems.iter().cloned());
        if checked.invalid {
            invalid.push(r);
        }
        list.push(o);
    }
    cache.forget_unseen(build);
    out.invalid.extend(invalid.iter().cloned());
    let problems = out.problems[problems_before..].to_vec();
    cache.last = Some(LastList { given, kept: list.clone(), problems, invalid });
}

/// Whether the recorded version put back for each key in `kept` of this kind (now in
/// `list`) is valid; the invalid ones are taken out of `kept`.
fn check_recorded<T: Versioned>(
    list: &[Arc<T>],
    kind: Kind,
    cache: &mut Cache<T>,
    validate: fn(&T, &mut Vec<Problem>),
    build: u64,
    kept: &mut Vec<(ObjectRef, Option<i64>)>,
    validated: &mut usize,
) {
    for o in list {
        let r = key_of(kind, &**o);
        if !kept.iter().any(|(k, _)| *k == r) {
            continue;
        }
        if cache.check(&r, o, validate, build, validated).invalid {
            kept.retain(|(k, _)| *k != r);
        }
    }
    cache.forget_unseen(build);
}

/// What stage 1 found.
#[derive(Default)]
struct Stage {
    problems: Vec<Problem>,
    invalid: BTreeSet<ObjectRef>,
    validated: usize,
}

impl Builder {
    /// A builder with nothing validated yet.
    pub fn new() -> Builder {
        Builder::default()
    }

    /// How the last build compiled: patched, or in full and why.
    pub fn last_pass(&self) -> &Pass {
        self.compiler.last_pass()
    }

    /// Builds the snapshot of `loaded` as `revision`: validates what changed since the
    /// previous build, admits (an invalid admin policy as its last good version in
    /// `records`, if valid), compiles once.
    ///
    /// # Errors
    /// A file that could not be read or parsed (the first [`Loaded::errors`]). Invalid
    /// objects are not errors: they are reported in [`Built::problems`], [`Built::lines`]
    /// and [`Built::report`], and left out or replaced by their record.
    pub fn build(
        &mut self,
        loaded: Loaded,
        revision: Revision,
        records: Option<&Records>,
    ) -> anyhow::Result<Built> {
        if let Some(e) = loaded.errors.first() {
            bail!("{}", crate::error::chain(e));
        }
        self.builds += 1;
        let build = self.builds;
        let mut lines: Vec<(Level, String)> =
            loaded.notes.iter().map(|n| (Level::Info, n.to_string())).collect();
        let mut inputs = loaded.inputs;
        let mut stage = Stage { problems: loaded.problems, ..Stage::default() };

        // Stage 1: validate what changed.
        let c = &mut self.caches;
        let i = &mut inputs;
        check_kind(
            &mut i.namespaces,
            Kind::Namespace,
            &mut c.namespaces,
            validate::namespace,
            build,
            &mut stage,
        );
        check_kind(&mut i.nodes, Kind::Node, &mut c.nodes, validate::node, build, &mut stage);
        check_kind(&mut i.pods, Kind::Pod, &mut c.pods, validate::pod, build, &mut stage);
        check_kind(
            &mut i.admin_network_policies,
            Kind::AdminNetworkPolicy,
            &mut c.admin,
            validate::admin_network_policy,
            build,
            &mut stage,
        );
        check_kind(
            &mut i.cluster_network_policies,
            Kind::ClusterNetworkPolicy,
            &mut c.cluster,
            validate::cluster_network_policy,
            build,
            &mut stage,
        );
        check_kind(
            &mut i.baseline_admin_network_policies,
            Kind::BaselineAdminNetworkPolicy,
            &mut c.baseline,
            validate::baseline_admin_network_policy,
            build,
            &mut stage,
        );
        check_kind(
            &mut i.network_policies,
            Kind::NetworkPolicy,
            &mut c.network_policies,
            validate::network_policy,
            build,
            &mut stage,
        );
        let Stage { mut problems, invalid, mut validated } = stage;
        // Antrea's objects are validated against each other (a policy's Tier must exist):
        // the valid ones are admitted, every build, and invalid ones left out.
        inputs.antrea = crate::policy::compile::admit_antrea(&inputs.antrea, &mut problems);

        // Stage 2: admit. Decoding problems name objects too (a spec that does not decode
        // is an error of that object).
        let invalid: BTreeSet<ObjectRef> = invalid
            .into_iter()
            .chain(problems.iter().filter(|p| p.is_error()).map(|p| p.object.clone()))
            .collect();
        let invalid: Vec<ObjectRef> = invalid.into_iter().collect();
        let valid = valid_generations(&inputs, &invalid);
        let mut kept = match records {
            Some(records) => lastgood::put_back(&mut inputs, records, &invalid),
            None => Vec::new(),
        };
        if !kept.is_empty() {
            // A recorded version that is itself invalid is left out after all.
            let i = &inputs;
            let k = &mut kept;
            check_recorded(
                &i.admin_network_policies,
                Kind::AdminNetworkPolicy,
                &mut c.recorded_admin,
                validate::admin_network_policy,
                build,
                k,
                &mut validated,
            );
            check_recorded(
                &i.cluster_network_policies,
                Kind::ClusterNetworkPolicy,
                &mut c.recorded_cluster,
                validate::cluster_network_policy,
                build,
                k,
                &mut validated,
            );
            check_recorded(
                &i.baseline_admin_network_policies,
                Kind::BaselineAdminNetworkPolicy,
                &mut c.recorded_baseline,
                validate::baseline_admin_network_policy,
                build,
                k,
                &mut validated,
            );
        }
        let out: HashSet<&ObjectRef> =
            invalid.iter().filter(|r| !kept.iter().any(|(k, _)| k == *r)).collect();
        if !out.is_empty() {
            fn retain<T: Resource>(list: &mut Vec<Arc<T>>, kind: Kind, out: &HashSet<&ObjectRef>) {
                list.retain(|o| !out.contains(&key_of(kind, &**o)));
            }
            let i = &mut inputs;
            retain(&mut i.namespaces, Kind::Namespace, &out);
            retain(&mut i.nodes, Kind::Node, &out);
            retain(&mut i.pods, Kind::Pod, &out);
            retain(&mut i.network_policies, Kind::NetworkPolicy, &out);
            retain(&mut i.admin_network_policies, Kind::AdminNetworkPolicy, &out);
            retain(&mut i.baseline_admin_network_policies, Kind::BaselineAdminNetworkPolicy, &out);
            retain(&mut i.cluster_network_policies, Kind::ClusterNetworkPolicy, &out);
        }

        // Stage 3: compile what was admitted, patching the previous snapshot where the
        // change allows it.
        let mut compiled = self.compiler.compile(&inputs, revision);
        let pass = self.compiler.last_pass().clone();
        drop(inputs);
        problems.append(&mut compiled.problems);
        for p in &problems {
            lines.push((if p.is_error() { Level::Error } else { Level::Warn }, p.to_string()));
        }
        for (r, generation) in &kept {
            lines.push((
                Level::Warn,
                format!(
                    "{r}: the new version is invalid (see above); the last good version recorded{} stays in force",
                    generation.map(|g| format!(" (generation {g})")).unwrap_or_default()
                ),
            ));
        }
        for r in out {
            if status::carries_status(r.kind) || r.kind == Kind::NetworkPolicy {
                lines.push((
                    Level::Error,
                    format!(
                        "{r}: left out: none of its rules apply (no valid version is recorded)"
                    ),
                ));
            }
        }
        problems.extend(crate::policy::compile::priority_conflicts(&compiled.snapshot));
        let mut report = Report::new(revision.0, &problems, &kept);
        report.valid = valid;
        Ok(Built { snapshot: compiled.snapshot, problems, report, lines, validated, pass })
    }
}

/// The admin policies of `inputs` (the three status-carrying kinds) not named in
/// `invalid` (sorted), with their `metadata.generation`: the versions the leader may
/// record.
fn valid_generations(inputs: &Inputs, invalid: &[ObjectRef]) -> BTreeMap<ObjectRef, Option<i64>> {
    fn each<T: Resource>(
        items: &[Arc<T>],
        kind: Kind,
        invalid: &[ObjectRef],
        out: &mut BTreeMap<ObjectRef, Option<i64>>,
    ) {
        for o in items {
            let r = ObjectRef::cluster(kind, o.meta().name.clone().unwrap_or_default());
            if invalid.binary_search(&r).is_err() {
                out.insert(r, o.meta().generation);
            }
        }
    }
    let mut out = BTreeMap::new();
    each(&inputs.admin_network_policies, Kind::AdminNetworkPolicy, invalid, &mut out);
    each(
        &inputs.baseline_admin_network_policies,
        Kind::BaselineAdminNetworkPolicy,
        invalid,
        &mut out,
    );
    each(&inputs.cluster_network_policies, Kind::ClusterNetworkPolicy, invalid, &mut out);
    out
}

/// Whether `report` names an invalid admin policy: one a change of the recorded last good
/// versions could put back (or take out).
pub fn needs_records(report: &Report) -> bool {
    report.policies.values().any(|a| {
        matches!(a, status::Acceptance::Invalid(_) | status::Acceptance::InvalidUpdate(..))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::lastgood::Record;
    use crate::cluster::status::Acceptance;

    const CLUSTER: &str = r#"
apiVersion: v1
kind: Namespace
metadata: {name: a}
---
apiVersion: v1
kind: Node
metadata: {name: n1}
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: a, labels: {app: web}}
spec: {nodeName: n1, containers: [{name: c, image: i}]}
status: {podIP: 10.0.0.2, podIPs: [{ip: 10.0.0.2}]}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: web, namespace: a}
spec: {podSelector: {matchLabels: {app: web}}, policyTypes: [Ingress]}
"#;

    fn anp(priority: i64, resource_version: &str) -> String {
        format!(
            r#"
---
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {{name: deny-all, uid: u1, generation: 3, resourceVersion: "{resource_version}"}}
spec:
  priority: {priority}
  subject: {{namespaces: {{}}}}
  ingress: [{{action: Deny, from: [{{namespaces: {{}}}}]}}]
"#
        )
    }

    fn loaded(text: &str) -> Loaded {
        manifest::parse_str(std::path::Path::new("test.yaml"), text).expect("parses")
    }

    fn policy_names(s: &Snapshot) -> Vec<String> {
        (0..s.policy_count()).map(|i| s.policy_ref(i).to_string()).collect()
    }

    /// Revalidating an admin policy against a version of it finds what validating it whole
    /// finds, and says whether the two validate alike exactly when `validates_as` does:
    /// for every ordered pair of versions that differ in labels, priority, tier, subject,
    /// one rule (into an invalid one), a rule more or a rule less.
    #[test]
    fn revalidating_an_admin_policy_finds_what_validating_it_whole_finds() {
        use serde_json::{Value, json};
        fn versions(base: Value, tiered: bool) -> Vec<Value> {
            let mut out = vec![base.clone()];
            let mut edit = |f: &dyn Fn(&mut Value)| {
                let mut v = base.clone();
                f(&mut v);
                out.push(v);
            };
            edit(&|v| v["metadata"]["labels"] = json!({"team": "x"}));
            edit(&|v| v["spec"]["subject"] = json!({"namespaces": {"matchLabels": {"a": "b"}}}));
            edit(&|v| v["spec"]["egress"][0]["to"][0] = json!({"networks": ["10.0.0.1/8"]}));
            edit(&|v| {
                let rule = v["spec"]["egress"][0].clone();
                v["spec"]["egress"].as_array_mut().unwrap().push(rule);
            });
            edit(&|v| v["spec"]["egress"] = json!([]));
            if !base["spec"]["priority"].is_null() {
                edit(&|v| v["spec"]["priority"] = json!(7));
            }
            if tiered {
                edit(&|v| v["spec"]["tier"] = json!("Baseline"));
            }
            out
        }
        fn pairs<T: Versioned + serde::de::DeserializeOwned>(
            versions: Vec<Value>,
            validate: fn(&T, &mut Vec<Problem>),
        ) {
            let objects: Vec<T> =
                versions.into_iter().map(|v| serde_json::from_value(v).unwrap()).collect();
            let revalidate = T::REVALIDATE.expect("an admin kind");
            for (i, was) in objects.iter().enumerate() {
                for (j, new) in objects.iter().enumerate() {
                    let (mut was_problems, mut whole, mut again) = (vec![], vec![], vec![]);
                    validate(was, &mut was_problems);
                    validate(new, &mut whole);
                    let alike = revalidate(new, was, &was_problems, &mut again);
                    assert_eq!(alike, new.validates_as(was), "version {j} after {i}");
                    assert_eq!(again, whole, "version {j} after {i}");
                }
            }
        }
        let rules = json!({
            "ingress": [{"action": "Deny", "from": [{"namespaces": {}}]}],
            "egress": [{"action": "Deny", "to": [{"networks": ["10.0.0.0/8"]}]}],
        });
        let spec = |extra: Value| {
            let mut s = rules.clone();
            s["subject"] = json!({"namespaces": {}});
            for (k, v) in extra.as_object().unwrap() {
                s[k] = v.clone();
            }
            s
        };
        let object = |api: &str, kind: &str, name: &str, spec: Value| json!({"apiVersion": api, "kind": kind, "metadata": {"name": name}, "spec": spec});
        let v1alpha1 = "policy.networking.k8s.io/v1alpha1";
        pairs::<v1alpha1::AdminNetworkPolicy>(
            versions(
                object(v1alpha1, "AdminNetworkPolicy", "a", spec(json!({"priority": 3}))),
                false,
            ),
            validate::admin_network_policy,
        );
        pairs::<v1alpha1::BaselineAdminNetworkPolicy>(
            versions(
                object(v1alpha1, "BaselineAdminNetworkPolicy", "default", spec(json!({}))),
                false,
            ),
            validate::baseline_admin_network_policy,
        );
        let cnp = spec(json!({"priority": 3, "tier": "Admin"}));
        let mut cnp_versions = versions(
            object("policy.networking.k8s.io/v1alpha2", "ClusterNetworkPolicy", "c", cnp),
            true,
        );
        for v in &mut cnp_versions {
            // v1alpha2 says Accept where v1alpha1 says Allow; these rules Deny.
            v["spec"]["ingress"][0]["action"] = json!("Deny");
        }
        pairs::<v1alpha2::ClusterNetworkPolicy>(cnp_versions, validate::cluster_network_policy);
    }

    #[test]
    fn each_object_is_validated_once_per_version() {
        let mut b = Builder::new();
        let built = b.build(loaded(&(CLUSTER.to_string() + &anp(10, "1"))), Revision(1), None);
        assert_eq!(built.expect("builds").validated, 5, "namespace, node, pod, two policies");
        // Parsed again (new allocations), same content.
        let built = b.build(loaded(&(CLUSTER.to_string() + &anp(10, "1"))), Revision(2), None);
        assert_eq!(built.expect("builds").validated, 0);
        // A status write: only the resourceVersion moved.
        let built = b.build(loaded(&(CLUSTER.to_string() + &anp(10, "2"))), Revision(3), None);
        assert_eq!(built.expect("builds").validated, 0);
        // One policy edited.
        let built = b.build(loaded(&(CLUSTER.to_string() + &anp(11, "3"))), Revision(4), None);
        let built = built.expect("builds");
        assert_eq!(built.validated, 1);
        assert_eq!(built.snapshot.policy_count(), 2);
        // Deleted and created again: validated again.
        b.build(loaded(CLUSTER), Revision(5), None).expect("builds");
        let built = b.build(loaded(&(CLUSTER.to_string() + &anp(11, "3"))), Revision(6), None);
        assert_eq!(built.expect("builds").validated, 1);
    }

    #[test]
    fn an_invalid_admin_policy_is_admitted_as_its_valid_record_or_else_left_out() {
        let invalid = CLUSTER.to_string() + &anp(5000, "7");
        let record = |priority: i64| {
            let spec = serde_json::json!({
                "priority": priority, "subject": {"namespaces": {}},
                "ingress": [{"action": "Deny", "from": [{"namespaces": {}}]}]
            });
            let r = ObjectRef::cluster(Kind::AdminNetworkPolicy, "deny-all".to_string());
            Records(BTreeMap::from([(
                r,
                Record { uid: Some("u1".into()), generation: Some(2), spec },
            )]))
        };
        let r = ObjectRef::cluster(Kind::AdminNetworkPolicy, "deny-all".to_string());
        let mut b = Builder::new();

        let built = b.build(loaded(&invalid), Revision(1), Some(&record(10))).expect("builds");
        assert!(policy_names(&built.snapshot).contains(&r.to_string()), "the record is in force");
        assert!(
            matches!(built.report.policies.get(&r), Some(Acceptance::InvalidUpdate(_, Some(2)))),
            "{:?}",
            built.report.policies.get(&r)
        );
        assert!(built.problems.iter().any(|p| p.is_error() && p.object == r), "reported");
        assert!(built.lines.iter().any(|(l, s)| *l == Level::Warn && s.contains("stays in force")));
        assert!(!built.report.valid.contains_key(&r), "never recorded as good");
        assert_eq!(built.validated, 6, "five objects and the record");
        let again = b.build(loaded(&invalid), Revision(2), Some(&record(10))).expect("builds");
        assert_eq!(again.validated, 0);

        // The record is itself invalid: left out, none of its rules apply.
        let built = b.build(loaded(&invalid), Revision(3), Some(&record(9999))).expect("builds");
        assert_eq!(built.validated, 1, "the new record");
        assert!(!policy_names(&built.snapshot).contains(&r.to_string()));
        assert!(matches!(built.report.policies.get(&r), Some(Acceptance::Invalid(_))));
        assert!(built.lines.iter().any(|(l, s)| *l == Level::Error && s.contains("left out")));

        // No records at all: left out.
        let built = b.build(loaded(&invalid), Revision(4), None).expect("builds");
        assert!(!policy_names(&built.snapshot).contains(&r.to_string()));
    }

    #[test]
    fn a_duplicate_is_reported_and_the_later_one_is_used_even_when_invalid() {
        let np = |cidr: &str| {
            format!(
                r#"
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {{name: twice, namespace: a}}
spec:
  podSelector: {{}}
  ingress: [{{from: [{{ipBlock: {{cidr: "{cidr}"}}}}]}}]
"#
            )
        };
        let r = ObjectRef::namespaced(Kind::NetworkPolicy, "a".to_string(), "twice".to_string());
        let mut b = Builder::new();
        let text = CLUSTER.to_string() + &np("10.0.0.0/8") + &np("not-a-cidr");
        let built = b.build(loaded(&text), Revision(1), None).expect("builds");
        assert!(
            built
                .problems
                .iter()
                .any(|p| p.object == r && matches!(p.kind, crate::policy::ProblemKind::Duplicate))
        );
        assert!(built.problems.iter().any(|p| p.object == r && p.is_error()));
        assert!(
            !policy_names(&built.snapshot).contains(&r.to_string()),
            "the earlier one is not used"
        );
        let text = CLUSTER.to_string() + &np("not-a-cidr") + &np("10.0.0.0/8");
        let built = b.build(loaded(&text), Revision(2), None).expect("builds");
        assert!(policy_names(&built.snapshot).contains(&r.to_string()));
        assert!(!built.problems.iter().any(|p| p.is_error()));
    }

    #[test]
    fn a_file_that_cannot_be_read_is_an_error_and_nothing_is_built() {
        let mut b = Builder::new();
        let mut l = loaded(CLUSTER);
        l.errors.push(manifest::LoadError::Syntax {
            path: "bad.yaml".into(),
            message: "expected a mapping".into(),
        });
        let e = b.build(l, Revision(1), None).expect_err("file errors stop the build");
        assert!(e.to_string().contains("bad.yaml"), "{e}");
    }
}
