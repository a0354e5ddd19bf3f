//! Admission-time validation of the API objects tierproxy reads from manifests: what the
//! Kubernetes API server would enforce before storing them.
//!
//! tierproxy can read policies from files instead of a cluster, so nothing upstream has
//! checked them. Every public function here mirrors one upstream validator and pushes
//! [`Problem`]s onto `out`; none of them panics, whatever the input.
//!
//! One file per upstream source: `apimachinery` (metadata, names, labels, ports),
//! `selectors` (label selectors), `crd` (what the policy CRDs share), `v1alpha1`
//! (ANP, BANP), `v1alpha2` (CNP), `networkpolicy` (v1 NetworkPolicy), `corev1`
//! (Namespace, Pod, Node), `antrea` (Antrea's Tier, ClusterNetworkPolicy and
//! NetworkPolicy, `crd.antrea.io/v1beta1`: CRD schemas and admission webhook). This file holds the limits, the field [`Path`] and the problem
//! sink they all write through, and [`Rules`], rule-by-rule validation of the admin kinds.
//!
//! Sources:
//! - AdminNetworkPolicy / BaselineAdminNetworkPolicy: network-policy-api `apis/v1alpha1`
//!   (`adminnetworkpolicy_types.go`, `baselineadminnetworkpolicy_types.go`,
//!   `shared_types.go`), `release-0.1` / v0.1.7, experimental channel: the CRD's OpenAPI
//!   schema (`Minimum`/`Maximum`, `MinItems`/`MaxItems`, `MaxLength`, `Pattern`,
//!   `MinProperties`/`MaxProperties` unions, `listType=set`), its CEL rules
//!   (`XValidation`) and its defaults (`protocol: TCP`).
//! - ClusterNetworkPolicy: network-policy-api `apis/v1alpha2/clusternetworkpolicy_types.go`.
//! - NetworkPolicy: kubernetes `pkg/apis/networking/validation/validation.go`
//!   (`ValidateNetworkPolicy`).
//! - Label selectors: apimachinery `pkg/apis/meta/v1/validation` (`ValidateLabelSelector`),
//!   names and label keys/values: apimachinery `pkg/util/validation` (`IsDNS1123Label`,
//!   `IsDNS1123Subdomain`, `IsQualifiedName`, `IsValidLabelValue`, `IsValidPortName`),
//!   object metadata: apimachinery `pkg/api/validation` (`ValidateObjectMeta`).
//! - Namespace, Pod, Node: kubernetes `pkg/apis/core/validation/validation.go`,
//!   `pkg/apis/core/v1/defaults.go` and `conversion.go`.
//! - Antrea-native kinds: antrea-io/antrea CRDs `build/charts/antrea/crds/` and the
//!   webhook `pkg/controller/networkpolicy/validate.go` (see `antrea`).
//!
//! Severity follows one rule: [`Severity::Error`] for what the API server rejects,
//! [`Severity::Warning`] for what it stores but the operator should know about. Two
//! consequences that surprise people:
//! - A CRD's embedded `metav1.LabelSelector` is checked only against its OpenAPI schema
//!   (strings and a list); the API server does not run `ValidateLabelSelector` on custom
//!   resources. Bad selector keys, values or operators in ANP/BANP/CNP are therefore
//!   warnings ([`CRD_SELECTOR_SEVERITY`]); the same mistakes in a NetworkPolicy are errors.
//! - Where upstream documents a constraint but the CRD does not enforce it (v1alpha1
//!   `portRange` `start < end`, `domainNames` only in Allow rules, the protocol enum of
//!   v1alpha1 ports), the finding is a warning that says so.

mod antrea;
mod apimachinery;
mod corev1;
mod crd;
mod networkpolicy;
mod selectors;
#[cfg(test)]
mod table;
mod v1alpha1;
mod v1alpha2;

pub use antrea::{
    MAX_POLICY_PRIORITY, MIN_POLICY_PRIORITY, antrea_cluster_network_policy, antrea_network_policy,
    antrea_tier, peer_outside_schema,
};
pub use corev1::{namespace, node, pod};
pub use crd::is_domain_name;
pub use networkpolicy::network_policy;
pub use selectors::label_selector;
pub use v1alpha1::{
    admin_network_policy, admin_network_policy_edited, admin_network_policy_rules,
    baseline_admin_network_policy, baseline_admin_network_policy_edited,
    baseline_admin_network_policy_rules,
};
pub use v1alpha2::{
    cluster_network_policy, cluster_network_policy_edited, cluster_network_policy_rules,
};

use std::collections::BTreeSet;
use std::fmt;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::model::Direction;
use super::problem::{Kind, ObjectRef, Problem, ProblemKind, Severity};

/// Largest `spec.priority` of an ANP or CNP. Source: `AdminNetworkPolicySpec.Priority` and
/// `ClusterNetworkPolicySpec.Priority`, `+kubebuilder:validation:Maximum=1000`
/// (`Minimum=0`).
pub const MAX_PRIORITY: i32 = 1000;

/// Most ingress (and, separately, egress) rules per ANP/BANP, and most peers per rule and
/// ports per rule. Source: v1alpha1 `Ingress`, `Egress`, `From`, `To`, `Ports`,
/// `+kubebuilder:validation:MaxItems=100`.
pub const V1ALPHA1_MAX_ITEMS: usize = 100;

/// Most rules per direction, peers per rule and protocols per rule of a CNP. Source:
/// v1alpha2 `Ingress`, `Egress`, `From`, `To`, `Protocols`,
/// `+kubebuilder:validation:MaxItems=25`.
pub const V1ALPHA2_MAX_ITEMS: usize = 25;

/// Longest rule `name`, in characters. Source: `+kubebuilder:validation:MaxLength=100` on
/// every rule's `Name` (v1alpha1 and v1alpha2).
pub const MAX_RULE_NAME: usize = 100;

/// Most CIDRs in one `networks` peer and most names in one `domainNames` peer. Source:
/// `Networks` / `DomainNames`, `+kubebuilder:validation:MaxItems=25` (`MinItems=1`).
pub const MAX_NETWORKS: usize = 25;

/// Longest `CIDR` string, in characters. Source: `type CIDR string`,
/// `+kubebuilder:validation:MaxLength=43` (the longest IPv6 CIDR in plain notation).
pub const MAX_CIDR_LEN: usize = 43;

/// Highest port number. Source: apimachinery `IsValidPortNum` ("must be between 1 and
/// 65535, inclusive") and the CRDs' `Minimum=1`, `Maximum=65535`.
pub const MAX_PORT: i32 = 65535;

/// Longest RFC 1123 label (namespace names, label-key name parts, label values). Source:
/// apimachinery `DNS1123LabelMaxLength`, `LabelValueMaxLength`, `qualifiedNameMaxLength`.
pub const MAX_LABEL_LEN: usize = 63;

/// Longest RFC 1123 subdomain (object names, label-key prefixes). Source: apimachinery
/// `DNS1123SubdomainMaxLength`.
pub const MAX_SUBDOMAIN_LEN: usize = 253;

/// Longest IANA service name (named ports). Source: apimachinery `IsValidPortName`
/// (RFC 6335: 15 characters).
pub const MAX_PORT_NAME_LEN: usize = 15;

/// Largest total size of an object's annotations (keys plus values, bytes). Source:
/// apimachinery `TotalAnnotationSizeLimitB = 256 * (1 << 10)`.
pub const MAX_ANNOTATIONS_BYTES: usize = 256 * 1024;

/// The label the API server keeps equal to a namespace's name. Source: core/v1
/// `LabelMetadataName`.
pub const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";

/// Severity of label-selector problems inside ANP/BANP/CNP objects. The API server does not
/// run `ValidateLabelSelector` on custom resources (their `LabelSelector` schema is just
/// strings), so it stores such selectors; Go consumers then fail to parse them
/// (`metav1.LabelSelectorAsSelector`). A warning, so the object is kept and the operator
/// told; flip to `Error` to drop such objects instead.
pub const CRD_SELECTOR_SEVERITY: Severity = Severity::Warning;

const PROTOCOLS: &str = "TCP, UDP, SCTP";

const SELECTOR_OPERATORS: &str = "In, NotIn, Exists, DoesNotExist";

const POLICY_TYPES: &str = "Ingress, Egress";

/// `true` for the kinds that live in a namespace (Pod, NetworkPolicy, Antrea
/// NetworkPolicy); the other policy CRDs, Namespace and Node are cluster-scoped. Source:
/// the kinds' API scope (`+genclient:nonNamespaced` / `scope: Cluster` for the policy
/// CRDs, `scope: Namespaced` for Antrea's NetworkPolicy CRD).
pub fn is_namespaced(kind: Kind) -> bool {
    matches!(kind, Kind::Pod | Kind::NetworkPolicy | Kind::AntreaNetworkPolicy)
}

/// The [`ObjectRef`] of an object: its kind, `metadata.namespace` (namespaced kinds only;
/// a missing one becomes `""`) and `metadata.name` (a missing one becomes `""`).
///
/// Pure: the validators below report a missing name or namespace (`metadata.name`
/// Required), so calling this and then a validator reports it once.
pub fn object_ref(kind: Kind, meta: &ObjectMeta) -> ObjectRef {
    let name = meta.name.clone().unwrap_or_default();
    if is_namespaced(kind) {
        ObjectRef::namespaced(kind, meta.namespace.clone().unwrap_or_default(), name)
    } else {
        ObjectRef::cluster(kind, name)
    }
}

/// A field path inside an object (`spec.egress[2].to[0].networks[1]`), built on the stack
/// as the validators descend and rendered to a `String` only when a [`Problem`] is
/// reported, so valid input (the common case) never pays for formatting it.
#[derive(Clone, Copy)]
struct Path<'a> {
    parent: Option<&'a Path<'a>>,
    seg: Seg<'a>,
}

/// One step of a [`Path`].
#[derive(Clone, Copy)]
enum Seg<'a> {
    /// The start of the path, written as given (`spec.ingress`, or a caller's path).
    Root(&'a str),
    /// `.name`: a field of the parent.
    Field(&'static str),
    /// `[i]`: an item of a list.
    Index(usize),
    /// `[key]`: an entry of a map (labels, annotations).
    Key(&'a str),
    /// `.name`: a field the input has and no schema names (an unknown key).
    Unknown(&'a str),
}

impl<'a> Path<'a> {
    /// A path that starts with `root`, written as given.
    fn root(root: &'a str) -> Self {
        Path { parent: None, seg: Seg::Root(root) }
    }

    /// `self.name`.
    fn field(&self, name: &'static str) -> Path<'_> {
        Path { parent: Some(self), seg: Seg::Field(name) }
    }

    /// `self[i]`.
    fn index(&self, i: usize) -> Path<'_> {
        Path { parent: Some(self), seg: Seg::Index(i) }
    }

    /// `self[key]`.
    fn key<'k>(&'k self, key: &'k str) -> Path<'k> {
        Path { parent: Some(self), seg: Seg::Key(key) }
    }

    /// `self.name` for a field name read from the input.
    fn unknown<'k>(&'k self, name: &'k str) -> Path<'k> {
        Path { parent: Some(self), seg: Seg::Unknown(name) }
    }
}

impl fmt::Display for Path<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(parent) = self.parent {
            parent.fmt(f)?;
        }
        match self.seg {
            Seg::Root(root) => f.write_str(root),
            Seg::Field(name) => write!(f, ".{name}"),
            Seg::Index(i) => write!(f, "[{i}]"),
            Seg::Key(key) => write!(f, "[{key}]"),
            Seg::Unknown(name) => write!(f, ".{name}"),
        }
    }
}

/// The object problems are about: given by the caller, or built from the object's
/// metadata by [`object_ref`] when the first problem is reported (valid objects never
/// need it).
enum Object<'a> {
    Given(&'a ObjectRef),
    Lazy { kind: Kind, meta: &'a ObjectMeta, built: Option<ObjectRef> },
}

/// Collects problems about one object.
struct Sink<'a> {
    object: Object<'a>,
    out: &'a mut Vec<Problem>,
}

impl<'a> Sink<'a> {
    /// Problems about the object of `kind` with metadata `meta`.
    fn new(kind: Kind, meta: &'a ObjectMeta, out: &'a mut Vec<Problem>) -> Self {
        Sink { object: Object::Lazy { kind, meta, built: None }, out }
    }

    fn push(&mut self, severity: Severity, field: &Path<'_>, kind: ProblemKind) {
        let object = match &mut self.object {
            Object::Given(object) => (*object).clone(),
            Object::Lazy { kind, meta, built } => {
                built.get_or_insert_with(|| object_ref(*kind, meta)).clone()
            }
        };
        self.out.push(Problem { object, field: field.to_string(), severity, kind });
    }

    fn error(&mut self, field: &Path<'_>, kind: ProblemKind) {
        self.push(Severity::Error, field, kind);
    }

    fn warning(&mut self, field: &Path<'_>, kind: ProblemKind) {
        self.push(Severity::Warning, field, kind);
    }
}

/// Most items [`Seen`] keeps inline; beyond it, the rest go to a set. The lists checked for
/// repeats are short: `networks` and `domainNames` hold at most 25 items in a valid object,
/// `status.podIPs` two, a container's ports a few.
const SEEN_INLINE: usize = MAX_NETWORKS;

/// The strings of a list seen so far, to report repeats as a `BTreeSet` would, without
/// allocating for lists of up to [`SEEN_INLINE`] items.
struct Seen<'a> {
    inline: [&'a str; SEEN_INLINE],
    len: usize,
    spill: BTreeSet<&'a str>,
}

impl<'a> Seen<'a> {
    fn new() -> Self {
        Seen { inline: [""; SEEN_INLINE], len: 0, spill: BTreeSet::new() }
    }

    /// `true` if `item` was not seen before (and remembers it), like `BTreeSet::insert`.
    fn insert(&mut self, item: &'a str) -> bool {
        if self.inline[..self.len].contains(&item) || self.spill.contains(item) {
            return false;
        }
        if self.len < SEEN_INLINE {
            self.inline[self.len] = item;
            self.len += 1;
        } else {
            self.spill.insert(item);
        }
        true
    }
}

fn invalid(value: impl Into<String>, reason: impl Into<String>) -> ProblemKind {
    ProblemKind::Invalid { value: value.into(), reason: reason.into() }
}

/// How many of a union's `members` are set.
fn set_count(members: &[(&str, bool)]) -> usize {
    members.iter().filter(|m| m.1).count()
}

/// The names of a union's `members` that are set, comma-separated.
fn set_names(members: &[(&str, bool)]) -> String {
    members.iter().filter(|m| m.1).map(|m| m.0).collect::<Vec<_>>().join(", ")
}

/// Validation of an admin object (ANP, BANP or CNP) rule by rule, from
/// [`admin_network_policy_rules`], [`baseline_admin_network_policy_rules`] or
/// [`cluster_network_policy_rules`]: the object's own fields are checked when it is made,
/// then each `next()` checks one rule (ingress rules, then egress rules) and yields its
/// direction and index once its problems are in `out`. A compiler builds each rule there,
/// while its peers are still in cache (`compile::admin`). Run to the end, it reports what
/// the object's plain validator reports, in the same order.
pub struct Rules<'a, T> {
    sink: Sink<'a>,
    object: &'a T,
    /// Ingress and egress rule counts.
    counts: [usize; 2],
    /// Checks rule `i` of a direction.
    check: fn(&mut Sink<'_>, &T, Direction, usize),
    /// The next rule: direction index and position.
    next: (usize, usize),
}

impl<'a, T> Rules<'a, T> {
    fn new(
        sink: Sink<'a>,
        object: &'a T,
        counts: [usize; 2],
        check: fn(&mut Sink<'_>, &T, Direction, usize),
    ) -> Self {
        Rules { sink, object, counts, check, next: (0, 0) }
    }
}

/// The admin kinds (ANP, BANP, CNP) as versions of one object: what the builder's
/// validation and the compiler compare when a new version arrives, each rule once
/// (issue #21 item 2).
pub trait AdminEdit {
    /// Whether rule `i` of direction `d` equals the rule at the same position of `was`
    /// (`false` when `was` has none).
    fn same_rule(&self, was: &Self, d: Direction, i: usize) -> bool;
    /// Whether `self` has as many rules per direction as `was`.
    fn same_counts(&self, was: &Self) -> bool;
    /// Whether the spec apart from its rules (tier, priority, subject) equals `was`'s.
    fn same_head(&self, was: &Self) -> bool;
    /// This kind's `*_edited` validator ([`admin_network_policy_edited`] and the like):
    /// the problems of `self`, reusing those `was` had in each rule still in its place;
    /// whether every rule is `was`'s, in its place.
    fn validate_edited(&self, was: &Self, was_problems: &[Problem], out: &mut Vec<Problem>)
    -> bool;
}

macro_rules! admin_edit {
    ($($t:ty => $edited:path, |$a:ident, $b:ident| $head:expr;)*) => {$(
        impl AdminEdit for $t {
            fn same_rule(&self, was: &Self, d: Direction, i: usize) -> bool {
                fn at<T: PartialEq>(a: &[T], b: &[T], i: usize) -> bool {
                    matches!((a.get(i), b.get(i)), (Some(x), Some(y)) if x == y)
                }
                match d {
                    Direction::Ingress => at(&self.spec.ingress, &was.spec.ingress, i),
                    Direction::Egress => at(&self.spec.egress, &was.spec.egress, i),
                }
            }

            fn same_counts(&self, was: &Self) -> bool {
                self.spec.ingress.len() == was.spec.ingress.len()
                    && self.spec.egress.len() == was.spec.egress.len()
            }

            fn same_head(&self, was: &Self) -> bool {
                let ($a, $b) = (&self.spec, &was.spec);
                $head
            }

            fn validate_edited(
                &self,
                was: &Self,
                was_problems: &[Problem],
                out: &mut Vec<Problem>,
            ) -> bool {
                $edited(self, was, was_problems, out)
            }
        }
    )*};
}

admin_edit! {
    crate::policy::api::v1alpha1::AdminNetworkPolicy => admin_network_policy_edited, |a, b| {
        let crate::policy::api::v1alpha1::AdminNetworkPolicySpec {
            priority, subject, ingress: _, egress: _,
        } = a;
        *priority == b.priority && *subject == b.subject
    };
    crate::policy::api::v1alpha1::BaselineAdminNetworkPolicy =>
        baseline_admin_network_policy_edited, |a, b| {
        let crate::policy::api::v1alpha1::BaselineAdminNetworkPolicySpec {
            subject, ingress: _, egress: _,
        } = a;
        *subject == b.subject
    };
    crate::policy::api::v1alpha2::ClusterNetworkPolicy => cluster_network_policy_edited, |a, b| {
        let crate::policy::api::v1alpha2::ClusterNetworkPolicySpec {
            tier, priority, subject, ingress: _, egress: _,
        } = a;
        *tier == b.tier && *priority == b.priority && *subject == b.subject
    };
}

impl<T> Rules<'_, T> {
    /// Checks the rules not checked yet, as iterating to the end would, except each rule
    /// `same(direction, position)` says is equal to the rule at the same position of an
    /// earlier version of the object, which validated to `was`: its problems are copied from
    /// `was` (those whose field lies within the rule, `spec.ingress[i]` or `spec.egress[i]`)
    /// instead of being found again. A rule's problems depend only on the rule and its
    /// position, so the result is what checking it would give (test
    /// `an_edit_revalidates_to_what_validating_it_whole_gives`). Returns whether every
    /// rule was reused.
    pub(crate) fn finish_reusing(
        mut self,
        was: &[Problem],
        same: impl Fn(Direction, usize) -> bool,
    ) -> bool {
        let (mut d, mut i) = self.next;
        let mut prefix = String::new();
        let mut all_reused = true;
        loop {
            while d < 2 && i >= self.counts[d] {
                (d, i) = (d + 1, 0);
            }
            let Some(&dir) = Direction::BOTH.get(d) else { return all_reused };
            if same(dir, i) {
                use std::fmt::Write;
                prefix.clear();
                let _ = write!(prefix, "spec.{}[{i}]", dir.as_str());
                let within = |field: &str| {
                    field
                        .strip_prefix(prefix.as_str())
                        .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
                };
                self.sink.out.extend(was.iter().filter(|p| within(&p.field)).cloned());
            } else {
                (self.check)(&mut self.sink, self.object, dir, i);
                all_reused = false;
            }
            i += 1;
        }
    }
}

impl<T> Iterator for Rules<'_, T> {
    type Item = (Direction, usize);

    fn next(&mut self) -> Option<(Direction, usize)> {
        let (mut d, mut i) = self.next;
        while d < 2 && i >= self.counts[d] {
            (d, i) = (d + 1, 0);
        }
        let dir = *Direction::BOTH.get(d)?;
        self.next = (d, i + 1);
        (self.check)(&mut self.sink, self.object, dir, i);
        Some((dir, i))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use serde_json::{Value, json};

    use super::table::*;
    use super::*;

    /// Every file's rows.
    fn all_rows() -> Vec<Row> {
        [
            apimachinery::tests::rows(),
            v1alpha1::tests::rows(),
            v1alpha2::tests::rows(),
            networkpolicy::tests::rows(),
            corev1::tests::rows(),
            antrea::tests::rows(),
        ]
        .into_iter()
        .flatten()
        .collect()
    }

    /// An edited admin object revalidated against its previous version (the problems of
    /// unchanged rules reused) reports exactly what validating it whole reports: every
    /// table row's manifest after and before the base manifest, after and before the base
    /// and itself with the first rule of a direction dropped (which moves the others up).
    #[test]
    fn an_edit_revalidates_to_what_validating_it_whole_gives() {
        /// `now` validated whole, and revalidated after `was`.
        fn both<T: serde::de::DeserializeOwned>(
            was: &Value,
            now: &Value,
            whole: fn(&T, &mut Vec<Problem>),
            edited: fn(&T, &T, &[Problem], &mut Vec<Problem>) -> bool,
        ) -> (Vec<Problem>, Vec<Problem>) {
            let (was, now): (T, T) = (de(was.clone()), de(now.clone()));
            let (mut was_problems, mut all, mut again) = (Vec::new(), Vec::new(), Vec::new());
            whole(&was, &mut was_problems);
            whole(&now, &mut all);
            edited(&now, &was, &was_problems, &mut again);
            (all, again)
        }
        let rows = all_rows();
        let mut pairs = 0;
        for target in [Target::Anp, Target::Banp, Target::Cnp] {
            let shifted = |v: &Value, d: &str| {
                let rules = v["spec"][d].as_array().filter(|r| !r.is_empty())?;
                let mut v = v.clone();
                v["spec"][d] = Value::Array(rules[1..].to_vec());
                Some(v)
            };
            let base = target.base();
            let bases: Vec<Value> = std::iter::once(base.clone())
                .chain(["ingress", "egress"].iter().filter_map(|d| shifted(&base, d)))
                .collect();
            let mut pairs_of_kind = Vec::new();
            for r in rows
                .iter()
                .filter(|r| std::mem::discriminant(&r.target) == std::mem::discriminant(&target))
            {
                let mut v = target.base();
                (r.edit)(&mut v);
                let mut others = bases.clone();
                others.extend(["ingress", "egress"].iter().filter_map(|d| shifted(&v, d)));
                for other in others {
                    pairs_of_kind.push((other.clone(), v.clone()));
                    pairs_of_kind.push((v.clone(), other));
                }
            }
            for (was, now) in &pairs_of_kind {
                let (whole, edited) = match target {
                    Target::Anp => {
                        both(was, now, admin_network_policy, admin_network_policy_edited)
                    }
                    Target::Banp => both(
                        was,
                        now,
                        baseline_admin_network_policy,
                        baseline_admin_network_policy_edited,
                    ),
                    _ => both(was, now, cluster_network_policy, cluster_network_policy_edited),
                };
                assert_eq!(edited, whole, "{target:?}: {now} after {was}");
                pairs += 1;
            }
        }
        assert!(pairs > 500, "only {pairs} pairs");
    }

    /// Rule-by-rule validation ([`Rules`]) reports what the plain validators report and
    /// visits every rule once, ingress rules then egress rules, on every admin row of the
    /// table.
    #[test]
    fn rule_by_rule_validation_visits_every_rule_in_order() {
        for Row { rule, target, edit, .. } in all_rows() {
            let mut v = target.base();
            edit(&mut v);
            let count = |dir: &str| v["spec"][dir].as_array().map_or(0, Vec::len);
            let want_visits: Vec<(Direction, usize)> = (0..count("ingress"))
                .map(|i| (Direction::Ingress, i))
                .chain((0..count("egress")).map(|i| (Direction::Egress, i)))
                .collect();
            let mut out = Vec::new();
            let visits: Vec<(Direction, usize)> = match target {
                Target::Anp => admin_network_policy_rules(&de(v.clone()), &mut out).collect(),
                Target::Banp => {
                    baseline_admin_network_policy_rules(&de(v.clone()), &mut out).collect()
                }
                Target::Cnp => cluster_network_policy_rules(&de(v.clone()), &mut out).collect(),
                _ => continue,
            };
            assert_eq!(out, target.run(v), "{rule}: problems differ");
            assert_eq!(visits, want_visits, "{rule}: visits");
        }
    }

    #[test]
    fn rule_names_are_unique() {
        let mut seen = BTreeSet::new();
        for r in all_rows() {
            assert!(seen.insert(r.rule), "duplicate row name {}", r.rule);
        }
    }

    #[test]
    fn valid_objects_have_no_problems() {
        for target in [
            Target::Anp,
            Target::Banp,
            Target::Cnp,
            Target::Np,
            Target::Ns,
            Target::Pod,
            Target::Node,
            Target::Tier,
            Target::Acnp,
            Target::Annp,
        ] {
            let problems = target.run(target.base());
            assert!(problems.is_empty(), "{target:?}: {problems:#?}");
        }
    }

    #[test]
    fn problems_name_the_object() {
        let mut v = Target::Np.base();
        v["spec"]["policyTypes"] = json!(["Sideways"]);
        let problems = Target::Np.run(v);
        assert_eq!(problems.len(), 1);
        assert_eq!(problems[0].object, ObjectRef::namespaced(Kind::NetworkPolicy, "prod", "np"));

        let mut v = Target::Anp.base();
        v["spec"]["priority"] = json!(2000);
        let problems = Target::Anp.run(v);
        assert_eq!(problems[0].object, ObjectRef::cluster(Kind::AdminNetworkPolicy, "anp"));
        assert_eq!(
            problems[0].to_string(),
            "error: AdminNetworkPolicy anp: spec.priority: 2000 is out of range 0..=1000"
        );
    }

    #[test]
    fn object_ref_of_a_nameless_object_is_empty_and_reported() {
        let meta = ObjectMeta::default();
        assert_eq!(object_ref(Kind::Pod, &meta), ObjectRef::namespaced(Kind::Pod, "", ""));
        assert_eq!(object_ref(Kind::Node, &meta), ObjectRef::cluster(Kind::Node, ""));
        let problems = Target::Node.run(json!({"metadata": {}}));
        assert_eq!(
            problems,
            vec![Problem::error(
                &ObjectRef::cluster(Kind::Node, ""),
                "metadata.name",
                ProblemKind::Required
            )]
        );
    }
}
