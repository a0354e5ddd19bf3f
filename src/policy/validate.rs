//! Admission-time validation of the API objects tierproxy reads from manifests: what the
//! Kubernetes API server would enforce before storing them.
//!
//! tierproxy can read policies from files instead of a cluster, so nothing upstream has
//! checked them. Every function here mirrors one upstream validator and pushes
//! [`Problem`]s onto `out`; none of them panics, whatever the input.
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

use std::borrow::Cow;
use std::collections::BTreeSet;
use std::fmt;
use std::net::IpAddr;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelectorRequirement, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::api::{self, LabelSelector, NamespacedPod, SelectorRef, v1alpha1, v1alpha2};
use super::cidr;
use super::compile::Direction;
use super::labels::LabelSet;
use super::problem::{Kind, ObjectRef, Problem, ProblemKind, Severity};

// ---------------------------------------------------------------------------------------
// Limits
// ---------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------
// Object references and metadata
// ---------------------------------------------------------------------------------------

/// `true` for the kinds that live in a namespace (Pod, NetworkPolicy); every policy CRD,
/// Namespace and Node are cluster-scoped. Source: the kinds' API scope
/// (`+genclient:nonNamespaced` / `scope=Cluster` for the policy CRDs).
pub fn is_namespaced(kind: Kind) -> bool {
    matches!(kind, Kind::Pod | Kind::NetworkPolicy)
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

/// Which name syntax `metadata.name` must follow.
#[derive(Clone, Copy)]
enum NameRule {
    /// `NameIsDNSLabel` (namespaces).
    Label,
    /// `NameIsDNSSubdomain` (everything else here).
    Subdomain,
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

/// apimachinery `ValidateObjectMeta`, the parts that apply to objects read from files.
fn object_meta(s: &mut Sink<'_>, meta: &ObjectMeta, rule: NameRule, namespaced: bool) {
    // "name or generateName is required"; a file has no server to expand generateName.
    match meta.name.as_deref() {
        None | Some("") => s.error(&Path::root("metadata.name"), ProblemKind::Required),
        Some(name) => {
            let errs = match rule {
                NameRule::Label => dns1123_label_errors(name),
                NameRule::Subdomain => dns1123_subdomain_errors(name),
            };
            if !errs.is_empty() {
                s.error(&Path::root("metadata.name"), invalid(name, errs.join("; ")));
            }
        }
    }
    match (namespaced, meta.namespace.as_deref()) {
        (true, None | Some("")) => {
            s.error(&Path::root("metadata.namespace"), ProblemKind::Required)
        }
        // ValidateNamespaceName is NameIsDNSLabel.
        (true, Some(ns)) => {
            let errs = dns1123_label_errors(ns);
            if !errs.is_empty() {
                s.error(&Path::root("metadata.namespace"), invalid(ns, errs.join("; ")));
            }
        }
        (false, None | Some("")) => {}
        // apiserver rest.EnsureObjectNamespaceMatchesRequestNamespace: "cluster-scoped,
        // clear namespace": the field is dropped, not rejected.
        (false, Some(ns)) => s.warning(
            &Path::root("metadata.namespace"),
            invalid(ns, "this kind is cluster-scoped; the API server drops metadata.namespace"),
        ),
    }
    if let Some(labels) = &meta.labels {
        // ValidateLabels: "ValidateLabelName" for keys, "IsValidLabelValue" for values.
        labels_map(s, &Path::root("metadata.labels"), labels, Severity::Error);
    }
    if let Some(annotations) = &meta.annotations {
        // ValidateAnnotations: keys are qualified names ("strings.ToLower(k)"), and
        // "annotations: Too long: must have at most 262144 bytes" in total.
        let path = Path::root("metadata.annotations");
        let mut total = 0usize;
        for (k, v) in annotations {
            total = total.saturating_add(k.len()).saturating_add(v.len());
            let lower = if k.bytes().any(|b| b.is_ascii_uppercase()) {
                Cow::Owned(k.to_ascii_lowercase())
            } else {
                Cow::Borrowed(k.as_str())
            };
            let errs = qualified_name_errors(&lower);
            if !errs.is_empty() {
                s.error(&path.key(k), invalid(k, errs.join("; ")));
            }
        }
        if total > MAX_ANNOTATIONS_BYTES {
            s.error(&path, ProblemKind::TooLong { len: total, max: MAX_ANNOTATIONS_BYTES });
        }
    }
}

fn labels_map(s: &mut Sink<'_>, path: &Path<'_>, labels: &impl LabelSet, sev: Severity) {
    for (k, v) in labels.pairs() {
        // Valid entries, nearly all of them, are checked without building messages.
        if !is_qualified_name(k) || !is_label_value(v) {
            label_problems(s, &path.key(k), k, v, sev);
        }
    }
}

/// The problems of one `labels` entry: its key's, then its value's.
#[cold]
fn label_problems(s: &mut Sink<'_>, field: &Path<'_>, k: &str, v: &str, sev: Severity) {
    let errs = qualified_name_errors(k);
    if !errs.is_empty() {
        s.push(sev, field, invalid(k, errs.join("; ")));
    }
    let errs = label_value_errors(v);
    if !errs.is_empty() {
        s.push(sev, field, invalid(v, errs.join("; ")));
    }
}

// ---------------------------------------------------------------------------------------
// Label selectors
// ---------------------------------------------------------------------------------------

/// Validates a label selector as apimachinery `ValidateLabelSelector` does (with
/// `AllowInvalidLabelValueInSelector: false`, as on create): `matchLabels` keys are
/// qualified names and values valid label values; each `matchExpressions` entry has a
/// qualified-name key, an operator of `In`, `NotIn`, `Exists`, `DoesNotExist`, at least
/// one value for `In`/`NotIn`, none for `Exists`/`DoesNotExist`, and valid label values.
///
/// Problems are errors, as for built-in kinds (NetworkPolicy). Inside the policy CRDs the
/// validators here use [`CRD_SELECTOR_SEVERITY`] instead, because the API server does not
/// run this check on custom resources.
///
/// `sel` is either kind of selector (`&api::LabelSelector` or k8s-openapi's).
pub fn label_selector<'a>(
    sel: impl Into<SelectorRef<'a>>,
    object: &ObjectRef,
    path: &str,
    out: &mut Vec<Problem>,
) {
    let mut s = Sink { object: Object::Given(object), out };
    selector(&mut s, sel, &Path::root(path), Severity::Error);
}

fn selector<'a>(s: &mut Sink<'_>, sel: impl Into<SelectorRef<'a>>, path: &Path<'_>, sev: Severity) {
    let sel = sel.into();
    // Valid selectors, nearly all of them, are checked without building messages.
    if !is_valid_selector(sel) {
        selector_problems(s, sel, path, sev);
    }
}

/// `true` iff [`selector`] finds no problem in `sel`.
#[inline]
fn is_valid_selector(sel: SelectorRef<'_>) -> bool {
    let SelectorRef { match_expressions, match_labels } = sel;
    match_labels
        .iter()
        .flat_map(|l| l.pairs())
        .all(|(k, v)| is_qualified_name(k) && is_label_value(v))
        && match_expressions.into_iter().flatten().all(is_valid_requirement)
}

/// `true` iff [`requirement`] finds no problem in `req`.
fn is_valid_requirement(req: &LabelSelectorRequirement) -> bool {
    let LabelSelectorRequirement { key, operator, values } = req;
    let values: &[String] = values.as_deref().unwrap_or_default();
    let operator_ok = match operator.as_str() {
        "In" | "NotIn" => !values.is_empty(),
        "Exists" | "DoesNotExist" => values.is_empty(),
        _ => false,
    };
    operator_ok && is_qualified_name(key) && values.iter().all(|v| is_label_value(v))
}

/// The problems of a selector, in the order [`selector`] reports them.
#[cold]
#[inline(never)]
fn selector_problems(s: &mut Sink<'_>, sel: SelectorRef<'_>, path: &Path<'_>, sev: Severity) {
    let SelectorRef { match_expressions, match_labels } = sel;
    if let Some(labels) = match_labels {
        labels_map(s, &path.field("matchLabels"), &labels, sev);
    }
    if let Some(reqs) = match_expressions {
        let path = path.field("matchExpressions");
        for (i, req) in reqs.iter().enumerate() {
            requirement(s, req, &path.index(i), sev);
        }
    }
}

/// apimachinery `ValidateLabelSelectorRequirement`.
fn requirement(s: &mut Sink<'_>, req: &LabelSelectorRequirement, path: &Path<'_>, sev: Severity) {
    let LabelSelectorRequirement { key, operator, values } = req;
    let values: &[String] = values.as_deref().unwrap_or_default();
    match operator.as_str() {
        // "must be specified when `operator` is 'In' or 'NotIn'"
        "In" | "NotIn" => {
            if values.is_empty() {
                s.push(sev, &path.field("values"), ProblemKind::Required);
            }
        }
        // "may not be specified when `operator` is 'Exists' or 'DoesNotExist'"
        "Exists" | "DoesNotExist" => {
            if !values.is_empty() {
                s.push(
                    sev,
                    &path.field("values"),
                    invalid(
                        values.join(","),
                        "may not be specified when `operator` is 'Exists' or 'DoesNotExist'",
                    ),
                );
            }
        }
        // "not a valid selector operator"
        _ => s.push(
            sev,
            &path.field("operator"),
            ProblemKind::NotInEnum { value: operator.clone(), allowed: SELECTOR_OPERATORS },
        ),
    }
    let errs = qualified_name_errors(key);
    if !errs.is_empty() {
        s.push(sev, &path.field("key"), invalid(key, errs.join("; ")));
    }
    for (j, v) in values.iter().enumerate() {
        let errs = label_value_errors(v);
        if !errs.is_empty() {
            s.push(sev, &path.field("values").index(j), invalid(v, errs.join("; ")));
        }
    }
}

fn namespaced_pod(s: &mut Sink<'_>, pods: &NamespacedPod, path: &Path<'_>) {
    let NamespacedPod { namespace_selector, pod_selector } = pods;
    selector(s, namespace_selector, &path.field("namespaceSelector"), CRD_SELECTOR_SEVERITY);
    selector(s, pod_selector, &path.field("podSelector"), CRD_SELECTOR_SEVERITY);
}

// ---------------------------------------------------------------------------------------
// Pieces shared by the policy CRDs
// ---------------------------------------------------------------------------------------

/// What "fail closed" means for a rule holding a peer of an unknown kind.
///
/// Source (v1alpha1 and v1alpha2 peer docs): "If an implementation sees no fields are set
/// then it can infer that the deployed CRD is of an incompatible version with an unknown
/// field. In that case it should fail closed. For "Allow" rules, "fail closed" means:
/// "treat the rule as matching no traffic". For "Deny" and "Pass" rules, "fail closed"
/// means: "treat the rule as a 'Deny all' rule"."
#[derive(Clone, Copy)]
enum FailClosed {
    /// Allow / Accept rules.
    MatchNothing,
    /// Deny / Pass rules.
    DenyAll,
}

impl FailClosed {
    fn effect(self) -> &'static str {
        match self {
            FailClosed::MatchNothing => "matches nothing",
            FailClosed::DenyAll => "denies all traffic the rule applies to",
        }
    }
}

fn anp_fail(action: v1alpha1::AdminNetworkPolicyRuleAction) -> FailClosed {
    match action {
        v1alpha1::AdminNetworkPolicyRuleAction::Allow => FailClosed::MatchNothing,
        v1alpha1::AdminNetworkPolicyRuleAction::Deny
        | v1alpha1::AdminNetworkPolicyRuleAction::Pass => FailClosed::DenyAll,
    }
}

fn banp_fail(action: v1alpha1::BaselineAdminNetworkPolicyRuleAction) -> FailClosed {
    match action {
        v1alpha1::BaselineAdminNetworkPolicyRuleAction::Allow => FailClosed::MatchNothing,
        v1alpha1::BaselineAdminNetworkPolicyRuleAction::Deny => FailClosed::DenyAll,
    }
}

fn cnp_fail(action: v1alpha2::ClusterNetworkPolicyRuleAction) -> FailClosed {
    match action {
        v1alpha2::ClusterNetworkPolicyRuleAction::Accept => FailClosed::MatchNothing,
        v1alpha2::ClusterNetworkPolicyRuleAction::Deny
        | v1alpha2::ClusterNetworkPolicyRuleAction::Pass => FailClosed::DenyAll,
    }
}

/// `MinItems` / `MaxItems` of a list.
fn item_count(s: &mut Sink<'_>, path: &Path<'_>, len: usize, min: usize, max: usize) {
    if len < min {
        s.error(path, ProblemKind::TooFewItems { len, min });
    } else if len > max {
        s.error(path, ProblemKind::TooManyItems { len, max });
    }
}

/// `+kubebuilder:validation:Minimum=0`, `Maximum=1000` on `priority`.
fn priority(s: &mut Sink<'_>, value: i32) {
    if !(0..=MAX_PRIORITY).contains(&value) {
        s.error(
            &Path::root("spec.priority"),
            ProblemKind::OutOfRange { value: value.into(), min: 0, max: MAX_PRIORITY.into() },
        );
    }
}

/// `+kubebuilder:validation:MaxLength=100` on a rule's `name`. OpenAPI `maxLength`
/// counts characters (the API server uses `utf8.RuneCountInString`), not bytes.
fn rule_name(s: &mut Sink<'_>, rule_path: &Path<'_>, name: &str) {
    // A string has no more characters than bytes: short names need no counting.
    if name.len() <= MAX_RULE_NAME {
        return;
    }
    let len = name.chars().count();
    if len > MAX_RULE_NAME {
        s.error(&rule_path.field("name"), ProblemKind::TooLong { len, max: MAX_RULE_NAME });
    }
}

/// How many of a union's `members` are set.
fn set_count(members: &[(&str, bool)]) -> usize {
    members.iter().filter(|m| m.1).count()
}

/// The names of a union's `members` that are set, comma-separated.
fn set_names(members: &[(&str, bool)]) -> String {
    members.iter().filter(|m| m.1).map(|m| m.0).collect::<Vec<_>>().join(", ")
}

/// A `MinProperties=1`, `MaxProperties=1` union that is not a peer: none set or several
/// set are both errors.
fn union_exactly_one(
    s: &mut Sink<'_>,
    path: &Path<'_>,
    fields: &'static str,
    members: &[(&str, bool)],
) {
    let count = set_count(members);
    if count != 1 {
        let found = if count == 0 { "none".to_owned() } else { set_names(members) };
        s.error(path, ProblemKind::NotExactlyOne { fields, found });
    }
}

/// A peer union: several members set is an error (`MaxProperties=1`); none of the known
/// members set means a peer kind newer than this engine, which fails closed (a warning:
/// a CRD of that newer version accepted the object).
fn peer_union(
    s: &mut Sink<'_>,
    path: &Path<'_>,
    fields: &'static str,
    members: &[(&str, bool)],
    fail: FailClosed,
) {
    match set_count(members) {
        0 => s.warning(path, ProblemKind::UnknownPeer { effect: fail.effect() }),
        1 => {}
        _ => s.error(path, ProblemKind::NotExactlyOne { fields, found: set_names(members) }),
    }
}

/// A port number with `Minimum=1`, `Maximum=65535`.
fn check_port(s: &mut Sink<'_>, path: &Path<'_>, value: i32) {
    if !(1..=MAX_PORT).contains(&value) {
        s.error(
            path,
            ProblemKind::OutOfRange { value: value.into(), min: 1, max: MAX_PORT.into() },
        );
    }
}

/// `networks`: "+listType=set", "MinItems=1", "MaxItems=25"; each item a `CIDR`:
/// "+kubebuilder:validation:XValidation:rule="isCIDR(self)",message="Invalid CIDR format
/// provided"" and "+kubebuilder:validation:MaxLength=43".
fn check_networks(s: &mut Sink<'_>, path: &Path<'_>, nets: &[String]) {
    item_count(s, path, nets.len(), 1, MAX_NETWORKS);
    let mut seen = Seen::new();
    for (k, net) in nets.iter().enumerate() {
        let field = path.index(k);
        // A string has no more characters than bytes: short ones need no counting.
        if net.len() > MAX_CIDR_LEN {
            let len = net.chars().count();
            if len > MAX_CIDR_LEN {
                s.error(&field, ProblemKind::TooLong { len, max: MAX_CIDR_LEN });
            }
        }
        if let Err(e) = cidr::parse(net) {
            s.error(&field, invalid(net, format!("Invalid CIDR format provided: {e}")));
        }
        // listType=set: the API server rejects repeated items ("Duplicate value").
        if !seen.insert(net.as_str()) {
            s.error(&field, invalid(net, "duplicate entry in a list of type set"));
        }
    }
}

/// `domainNames`: "+listType=set", "MinItems=1", "MaxItems=25"; each item a `DomainName`
/// with `+kubebuilder:validation:Pattern` (see [`is_domain_name`]).
fn check_domain_names(s: &mut Sink<'_>, path: &Path<'_>, names: &[String]) {
    item_count(s, path, names.len(), 1, MAX_NETWORKS);
    let mut seen = Seen::new();
    for (k, name) in names.iter().enumerate() {
        let field = path.index(k);
        if !is_domain_name(name) {
            s.error(
                &field,
                invalid(
                    name,
                    "must be a domain name of at least two labels, optionally prefixed by \
                     '*.' and followed by one '.' (DomainName pattern)",
                ),
            );
        }
        if !seen.insert(name.as_str()) {
            s.error(&field, invalid(name, "duplicate entry in a list of type set"));
        }
    }
}

/// A named port that can never equal a container port's name, which must be an
/// IANA_SVC_NAME (core `validateContainerPorts`). The CRDs accept any string.
fn check_named_port(s: &mut Sink<'_>, path: &Path<'_>, name: &str) {
    let errs = port_name_errors(name);
    if !errs.is_empty() {
        s.warning(
            path,
            ProblemKind::NeverMatches {
                reason: format!(
                    "named port {name:?} is not a valid IANA_SVC_NAME ({}), so no container \
                     port can have it",
                    errs.join("; ")
                ),
            },
        );
    }
}

/// A v1alpha1 `protocol` (type `v1.Protocol`): documented as "TCP, UDP, or SCTP", defaulted
/// to TCP when absent ("+kubebuilder:default=TCP"), but without an enum in the CRD schema,
/// so other values are stored; rules holding them cannot match traffic.
fn v1alpha1_protocol(s: &mut Sink<'_>, path: &Path<'_>, protocol: Option<&str>) {
    if let Some(p) = protocol
        && !matches!(p, "TCP" | "UDP" | "SCTP")
    {
        s.warning(path, ProblemKind::NotInEnum { value: p.to_owned(), allowed: PROTOCOLS });
    }
}

fn subject(s: &mut Sink<'_>, namespaces: Option<&LabelSelector>, pods: Option<&NamespacedPod>) {
    // AdminNetworkPolicySubject / ClusterNetworkPolicySubject: "Exactly one field must be
    // set." (+kubebuilder:validation:MaxProperties=1, MinProperties=1)
    let path = Path::root("spec.subject");
    union_exactly_one(
        s,
        &path,
        "namespaces, pods",
        &[("namespaces", namespaces.is_some()), ("pods", pods.is_some())],
    );
    if let Some(sel) = namespaces {
        selector(s, sel, &path.field("namespaces"), CRD_SELECTOR_SEVERITY);
    }
    if let Some(p) = pods {
        namespaced_pod(s, p, &path.field("pods"));
    }
}

// ---------------------------------------------------------------------------------------
// v1alpha1: AdminNetworkPolicy and BaselineAdminNetworkPolicy
// ---------------------------------------------------------------------------------------

/// Validates an AdminNetworkPolicy as the v0.1.7 experimental-channel CRD does: metadata,
/// `priority` 0–1000, a one-of `subject`, ≤100 rules per direction, rule names ≤100
/// characters, 1–100 peers and (when present) 1–100 ports per rule, one-of peers and
/// ports, `networks` and `domainNames` syntax and counts, port numbers, and the egress CEL
/// rule against named ports with networks/nodes/domainNames peers.
///
/// Warnings: unknown peer kinds (fail closed), `domainNames` (never resolved by this
/// engine, and documented for Allow rules only), protocols outside TCP/UDP/SCTP, empty
/// port ranges, named ports no container can have, malformed label selectors.
///
/// Source: network-policy-api `apis/v1alpha1/adminnetworkpolicy_types.go`,
/// `shared_types.go` (v0.1.7).
pub fn admin_network_policy(obj: &v1alpha1::AdminNetworkPolicy, out: &mut Vec<Problem>) {
    admin_network_policy_each_rule(obj, out, &mut |_, _| {});
}

/// [`admin_network_policy`], calling `after_rule` with each rule's direction and index
/// right after the rule is validated (whatever was found), in order: ingress rules, then
/// egress rules. A compiler builds each rule there, while its peers are still in cache
/// (`compile::prepare_admin`). Problems are the same as [`admin_network_policy`]'s.
pub fn admin_network_policy_each_rule(
    obj: &v1alpha1::AdminNetworkPolicy,
    out: &mut Vec<Problem>,
    after_rule: &mut dyn FnMut(Direction, usize),
) {
    let mut s = Sink::new(Kind::AdminNetworkPolicy, &obj.metadata, out);
    object_meta(&mut s, &obj.metadata, NameRule::Subdomain, false);
    let v1alpha1::AdminNetworkPolicySpec { priority: prio, subject: subj, ingress, egress } =
        &obj.spec;
    priority(&mut s, *prio);
    let v1alpha1::AdminNetworkPolicySubject { namespaces, pods } = subj;
    subject(&mut s, namespaces.as_ref(), pods.as_ref());
    let (ingress_path, egress_path) = (Path::root("spec.ingress"), Path::root("spec.egress"));
    // "+kubebuilder:validation:MaxItems=100" on Ingress and Egress.
    item_count(&mut s, &ingress_path, ingress.len(), 0, V1ALPHA1_MAX_ITEMS);
    item_count(&mut s, &egress_path, egress.len(), 0, V1ALPHA1_MAX_ITEMS);
    for (i, rule) in ingress.iter().enumerate() {
        let v1alpha1::AdminNetworkPolicyIngressRule { name, action, from, ports } = rule;
        let path = ingress_path.index(i);
        rule_name(&mut s, &path, name);
        let from_path = path.field("from");
        v1alpha1_peers_count(&mut s, &from_path, from.len());
        for (j, peer) in from.iter().enumerate() {
            v1alpha1_ingress_peer(&mut s, &from_path.index(j), peer, anp_fail(*action));
        }
        v1alpha1_ports(&mut s, &path, ports.as_deref());
        after_rule(Direction::Ingress, i);
    }
    for (i, rule) in egress.iter().enumerate() {
        let v1alpha1::AdminNetworkPolicyEgressRule { name, action, to, ports } = rule;
        let path = egress_path.index(i);
        rule_name(&mut s, &path, name);
        let to_path = path.field("to");
        v1alpha1_peers_count(&mut s, &to_path, to.len());
        let fail = anp_fail(*action);
        let mut has_domain_names = false;
        let mut without_named_ports = false;
        for (j, peer) in to.iter().enumerate() {
            let v1alpha1::AdminNetworkPolicyEgressPeer {
                namespaces,
                pods,
                nodes,
                networks: nets,
                domain_names,
            } = peer;
            let peer_path = to_path.index(j);
            // AdminNetworkPolicyEgressPeer: "Exactly one of the fields must be set for a
            // given peer" (+kubebuilder:validation:MaxProperties=1, MinProperties=1).
            peer_union(
                &mut s,
                &peer_path,
                "namespaces, pods, nodes, networks, domainNames",
                &[
                    ("namespaces", namespaces.is_some()),
                    ("pods", pods.is_some()),
                    ("nodes", nodes.is_some()),
                    ("networks", nets.is_some()),
                    ("domainNames", domain_names.is_some()),
                ],
                fail,
            );
            common_egress_peer(&mut s, &peer_path, namespaces, pods, nodes, nets);
            if let Some(names) = domain_names {
                check_domain_names(&mut s, &peer_path.field("domainNames"), names);
                has_domain_names = true;
            }
            without_named_ports |= nodes.is_some() || nets.is_some() || domain_names.is_some();
        }
        if has_domain_names {
            // "DomainNames is only supported for ALLOW rules." The v0.1.7 CRD has no CEL
            // rule for it, so the object is stored; in a Deny/Pass rule the peer is inert
            // here (this engine resolves no names).
            if *action != v1alpha1::AdminNetworkPolicyRuleAction::Allow {
                s.warning(
                    &path.field("action"),
                    invalid(
                        format!("{action:?}"),
                        "domainNames peers are only supported in Allow rules",
                    ),
                );
            }
            s.warning(&path, ProblemKind::DomainNamesUnresolved);
        }
        v1alpha1_ports(&mut s, &path, ports.as_deref());
        // <network-policy-api:experimental:validation>
        // +kubebuilder:validation:XValidation:rule="!(self.to.exists(peer,
        // has(peer.networks) || has(peer.nodes) || has(peer.domainNames)) &&
        // has(self.ports) && self.ports.exists(port, has(port.namedPort)))"
        v1alpha1_named_port_cel(
            &mut s,
            &path,
            without_named_ports,
            ports.as_deref(),
            "networks/nodes/domainNames peer cannot be set with namedPorts since there are \
             no namedPorts for networks/nodes/domainNames",
        );
        after_rule(Direction::Egress, i);
    }
}

/// Validates the BaselineAdminNetworkPolicy as the v0.1.7 experimental-channel CRD does:
/// like [`admin_network_policy`] without `priority` and `domainNames`, with actions Allow
/// and Deny only (enforced by serde), and the singleton rule "Only one baseline admin
/// network policy with metadata.name="default" can be created in the cluster".
///
/// Source: network-policy-api `apis/v1alpha1/baselineadminnetworkpolicy_types.go`,
/// `shared_types.go` (v0.1.7).
pub fn baseline_admin_network_policy(
    obj: &v1alpha1::BaselineAdminNetworkPolicy,
    out: &mut Vec<Problem>,
) {
    baseline_admin_network_policy_each_rule(obj, out, &mut |_, _| {});
}

/// [`baseline_admin_network_policy`], calling `after_rule` with each rule's direction and index
/// right after the rule is validated (whatever was found), in order: ingress rules, then
/// egress rules. A compiler builds each rule there, while its peers are still in cache
/// (`compile::prepare_admin`). Problems are the same as [`baseline_admin_network_policy`]'s.
pub fn baseline_admin_network_policy_each_rule(
    obj: &v1alpha1::BaselineAdminNetworkPolicy,
    out: &mut Vec<Problem>,
    after_rule: &mut dyn FnMut(Direction, usize),
) {
    let mut s = Sink::new(Kind::BaselineAdminNetworkPolicy, &obj.metadata, out);
    object_meta(&mut s, &obj.metadata, NameRule::Subdomain, false);
    // +kubebuilder:validation:XValidation:rule="self.metadata.name == 'default'",
    // message="Only one baseline admin network policy with metadata.name=\"default\" can
    // be created in the cluster"
    if let Some(name) = obj.metadata.name.as_deref().filter(|n| !n.is_empty())
        && name != "default"
    {
        s.error(
            &Path::root("metadata.name"),
            invalid(
                name,
                "Only one baseline admin network policy with metadata.name=\"default\" \
                     can be created in the cluster",
            ),
        );
    }
    let v1alpha1::BaselineAdminNetworkPolicySpec { subject: subj, ingress, egress } = &obj.spec;
    let v1alpha1::AdminNetworkPolicySubject { namespaces, pods } = subj;
    subject(&mut s, namespaces.as_ref(), pods.as_ref());
    let (ingress_path, egress_path) = (Path::root("spec.ingress"), Path::root("spec.egress"));
    item_count(&mut s, &ingress_path, ingress.len(), 0, V1ALPHA1_MAX_ITEMS);
    item_count(&mut s, &egress_path, egress.len(), 0, V1ALPHA1_MAX_ITEMS);
    for (i, rule) in ingress.iter().enumerate() {
        let v1alpha1::BaselineAdminNetworkPolicyIngressRule { name, action, from, ports } = rule;
        let path = ingress_path.index(i);
        rule_name(&mut s, &path, name);
        let from_path = path.field("from");
        v1alpha1_peers_count(&mut s, &from_path, from.len());
        for (j, peer) in from.iter().enumerate() {
            v1alpha1_ingress_peer(&mut s, &from_path.index(j), peer, banp_fail(*action));
        }
        v1alpha1_ports(&mut s, &path, ports.as_deref());
        after_rule(Direction::Ingress, i);
    }
    for (i, rule) in egress.iter().enumerate() {
        let v1alpha1::BaselineAdminNetworkPolicyEgressRule { name, action, to, ports } = rule;
        let path = egress_path.index(i);
        rule_name(&mut s, &path, name);
        let to_path = path.field("to");
        v1alpha1_peers_count(&mut s, &to_path, to.len());
        let mut without_named_ports = false;
        for (j, peer) in to.iter().enumerate() {
            let v1alpha1::BaselineAdminNetworkPolicyEgressPeer {
                namespaces,
                pods,
                nodes,
                networks: nets,
            } = peer;
            let peer_path = to_path.index(j);
            // BaselineAdminNetworkPolicyEgressPeer: "Exactly one of the fields must be set
            // for a given peer".
            peer_union(
                &mut s,
                &peer_path,
                "namespaces, pods, nodes, networks",
                &[
                    ("namespaces", namespaces.is_some()),
                    ("pods", pods.is_some()),
                    ("nodes", nodes.is_some()),
                    ("networks", nets.is_some()),
                ],
                banp_fail(*action),
            );
            common_egress_peer(&mut s, &peer_path, namespaces, pods, nodes, nets);
            without_named_ports |= nodes.is_some() || nets.is_some();
        }
        v1alpha1_ports(&mut s, &path, ports.as_deref());
        // <network-policy-api:experimental:validation>
        // +kubebuilder:validation:XValidation:rule="!(self.to.exists(peer,
        // has(peer.networks) || has(peer.nodes)) && has(self.ports) &&
        // self.ports.exists(port, has(port.namedPort)))"
        v1alpha1_named_port_cel(
            &mut s,
            &path,
            without_named_ports,
            ports.as_deref(),
            "networks/nodes peer cannot be set with namedPorts since there are no namedPorts \
             for networks/nodes",
        );
        after_rule(Direction::Egress, i);
    }
}

/// `From`/`To`: "+kubebuilder:validation:MinItems=1", "MaxItems=100".
fn v1alpha1_peers_count(s: &mut Sink<'_>, path: &Path<'_>, len: usize) {
    item_count(s, path, len, 1, V1ALPHA1_MAX_ITEMS);
}

/// The peer kinds ANP/BANP egress peers share: namespaces, pods, nodes, networks.
fn common_egress_peer(
    s: &mut Sink<'_>,
    peer_path: &Path<'_>,
    namespaces: &Option<LabelSelector>,
    pods: &Option<NamespacedPod>,
    nodes: &Option<LabelSelector>,
    nets: &Option<Vec<String>>,
) {
    if let Some(sel) = namespaces {
        selector(s, sel, &peer_path.field("namespaces"), CRD_SELECTOR_SEVERITY);
    }
    if let Some(p) = pods {
        namespaced_pod(s, p, &peer_path.field("pods"));
    }
    if let Some(sel) = nodes {
        selector(s, sel, &peer_path.field("nodes"), CRD_SELECTOR_SEVERITY);
    }
    if let Some(n) = nets {
        check_networks(s, &peer_path.field("networks"), n);
    }
}

fn v1alpha1_ingress_peer(
    s: &mut Sink<'_>,
    path: &Path<'_>,
    peer: &v1alpha1::AdminNetworkPolicyIngressPeer,
    fail: FailClosed,
) {
    let v1alpha1::AdminNetworkPolicyIngressPeer { namespaces, pods } = peer;
    // AdminNetworkPolicyIngressPeer: "Exactly one of the fields must be set for a given
    // peer" (+kubebuilder:validation:MaxProperties=1, MinProperties=1).
    peer_union(
        s,
        path,
        "namespaces, pods",
        &[("namespaces", namespaces.is_some()), ("pods", pods.is_some())],
        fail,
    );
    if let Some(sel) = namespaces {
        selector(s, sel, &path.field("namespaces"), CRD_SELECTOR_SEVERITY);
    }
    if let Some(p) = pods {
        namespaced_pod(s, p, &path.field("pods"));
    }
}

/// `Ports *[]AdminNetworkPolicyPort`: "+optional", "MinItems=1", "MaxItems=100".
fn v1alpha1_ports(
    s: &mut Sink<'_>,
    rule_path: &Path<'_>,
    ports: Option<&[v1alpha1::AdminNetworkPolicyPort]>,
) {
    let Some(ports) = ports else { return };
    let path = rule_path.field("ports");
    item_count(s, &path, ports.len(), 1, V1ALPHA1_MAX_ITEMS);
    for (k, port) in ports.iter().enumerate() {
        let path = path.index(k);
        let v1alpha1::AdminNetworkPolicyPort { port_number, named_port: named, port_range } = port;
        // AdminNetworkPolicyPort: "Exactly one field must be set."
        union_exactly_one(
            s,
            &path,
            "portNumber, namedPort, portRange",
            &[
                ("portNumber", port_number.is_some()),
                ("namedPort", named.is_some()),
                ("portRange", port_range.is_some()),
            ],
        );
        if let Some(v1alpha1::Port { protocol, port }) = port_number {
            let number_path = path.field("portNumber");
            v1alpha1_protocol(s, &number_path.field("protocol"), protocol.as_deref());
            check_port(s, &number_path.field("port"), *port);
        }
        if let Some(name) = named {
            check_named_port(s, &path.field("namedPort"), name);
        }
        if let Some(v1alpha1::PortRange { protocol, start, end }) = port_range {
            let range_path = path.field("portRange");
            v1alpha1_protocol(s, &range_path.field("protocol"), protocol.as_deref());
            check_port(s, &range_path.field("start"), *start);
            check_port(s, &range_path.field("end"), *end);
            // "Start defines a network port that is the start of a port range, the Start
            // value must be less than End." Documented only: the v0.1.7 CRD has no CEL
            // rule on v1alpha1 PortRange (v1alpha2 added one), so it is stored.
            if start > end {
                s.warning(
                    &range_path,
                    ProblemKind::NeverMatches {
                        reason: format!(
                            "start {start} is greater than end {end}: the range is empty"
                        ),
                    },
                );
            } else if start == end {
                s.warning(
                    &range_path,
                    invalid(
                        format!("{start}-{end}"),
                        "the Start value must be less than End (field doc; not enforced by \
                         the v0.1.7 CRD); the range holds one port",
                    ),
                );
            }
        }
    }
}

/// The egress CEL rule against named ports next to peers that have none.
fn v1alpha1_named_port_cel(
    s: &mut Sink<'_>,
    rule_path: &Path<'_>,
    without_named_ports: bool,
    ports: Option<&[v1alpha1::AdminNetworkPolicyPort]>,
    message: &'static str,
) {
    if !without_named_ports {
        return;
    }
    if let Some(name) = ports.into_iter().flatten().find_map(|p| p.named_port.as_ref()) {
        s.error(rule_path, invalid(name, message));
    }
}

// ---------------------------------------------------------------------------------------
// v1alpha2: ClusterNetworkPolicy
// ---------------------------------------------------------------------------------------

/// Validates a ClusterNetworkPolicy as the v1alpha2 experimental-channel CRD does:
/// metadata, `priority` 0–1000, a one-of `subject`, ≤25 rules per direction, rule names
/// ≤100 characters, 1–25 peers and (when present) 1–25 protocols per rule, one-of peers,
/// protocols and destination ports, port numbers and ranges ("Start port must be less than
/// End port"), `networks` and `domainNames`, and the egress CEL rule against
/// `destinationNamedPort` with networks/nodes/domainNames peers. `tier` and `action` enums
/// are enforced by serde.
///
/// Warnings as for [`admin_network_policy`].
///
/// Source: network-policy-api `apis/v1alpha2/clusternetworkpolicy_types.go`.
pub fn cluster_network_policy(obj: &v1alpha2::ClusterNetworkPolicy, out: &mut Vec<Problem>) {
    cluster_network_policy_each_rule(obj, out, &mut |_, _| {});
}

/// [`cluster_network_policy`], calling `after_rule` with each rule's direction and index
/// right after the rule is validated (whatever was found), in order: ingress rules, then
/// egress rules. A compiler builds each rule there, while its peers are still in cache
/// (`compile::prepare_admin`). Problems are the same as [`cluster_network_policy`]'s.
pub fn cluster_network_policy_each_rule(
    obj: &v1alpha2::ClusterNetworkPolicy,
    out: &mut Vec<Problem>,
    after_rule: &mut dyn FnMut(Direction, usize),
) {
    let mut s = Sink::new(Kind::ClusterNetworkPolicy, &obj.metadata, out);
    object_meta(&mut s, &obj.metadata, NameRule::Subdomain, false);
    let v1alpha2::ClusterNetworkPolicySpec {
        tier: _,
        priority: prio,
        subject: subj,
        ingress,
        egress,
    } = &obj.spec;
    priority(&mut s, *prio);
    let v1alpha2::ClusterNetworkPolicySubject { namespaces, pods } = subj;
    subject(&mut s, namespaces.as_ref(), pods.as_ref());
    let (ingress_path, egress_path) = (Path::root("spec.ingress"), Path::root("spec.egress"));
    // "A maximum of 25 rules is allowed in this block." (MaxItems=25)
    item_count(&mut s, &ingress_path, ingress.len(), 0, V1ALPHA2_MAX_ITEMS);
    item_count(&mut s, &egress_path, egress.len(), 0, V1ALPHA2_MAX_ITEMS);
    for (i, rule) in ingress.iter().enumerate() {
        let v1alpha2::ClusterNetworkPolicyIngressRule { name, action, from, protocols } = rule;
        let path = ingress_path.index(i);
        rule_name(&mut s, &path, name);
        let from_path = path.field("from");
        // From: "+kubebuilder:validation:MinItems=1", "MaxItems=25".
        item_count(&mut s, &from_path, from.len(), 1, V1ALPHA2_MAX_ITEMS);
        for (j, peer) in from.iter().enumerate() {
            let v1alpha2::ClusterNetworkPolicyIngressPeer { namespaces, pods } = peer;
            let peer_path = from_path.index(j);
            peer_union(
                &mut s,
                &peer_path,
                "namespaces, pods",
                &[("namespaces", namespaces.is_some()), ("pods", pods.is_some())],
                cnp_fail(*action),
            );
            if let Some(sel) = namespaces {
                selector(&mut s, sel, &peer_path.field("namespaces"), CRD_SELECTOR_SEVERITY);
            }
            if let Some(p) = pods {
                namespaced_pod(&mut s, p, &peer_path.field("pods"));
            }
        }
        cnp_protocols(&mut s, &path, protocols.as_deref());
        after_rule(Direction::Ingress, i);
    }
    for (i, rule) in egress.iter().enumerate() {
        let v1alpha2::ClusterNetworkPolicyEgressRule { name, action, to, protocols } = rule;
        let path = egress_path.index(i);
        rule_name(&mut s, &path, name);
        let to_path = path.field("to");
        item_count(&mut s, &to_path, to.len(), 1, V1ALPHA2_MAX_ITEMS);
        let mut has_domain_names = false;
        let mut without_named_ports = false;
        for (j, peer) in to.iter().enumerate() {
            let v1alpha2::ClusterNetworkPolicyEgressPeer {
                namespaces,
                pods,
                nodes,
                networks: nets,
                domain_names,
            } = peer;
            let peer_path = to_path.index(j);
            // ClusterNetworkPolicyEgressPeer: "Exactly one of the fields must be set for a
            // given peer"; none set: "For "Accept" rules, "fail closed" means: "treat the
            // rule as matching no traffic". For "Deny" and "Pass" rules, ... 'Deny all'".
            peer_union(
                &mut s,
                &peer_path,
                "namespaces, pods, nodes, networks, domainNames",
                &[
                    ("namespaces", namespaces.is_some()),
                    ("pods", pods.is_some()),
                    ("nodes", nodes.is_some()),
                    ("networks", nets.is_some()),
                    ("domainNames", domain_names.is_some()),
                ],
                cnp_fail(*action),
            );
            common_egress_peer(&mut s, &peer_path, namespaces, pods, nodes, nets);
            if let Some(names) = domain_names {
                check_domain_names(&mut s, &peer_path.field("domainNames"), names);
                has_domain_names = true;
            }
            without_named_ports |= nodes.is_some() || nets.is_some() || domain_names.is_some();
        }
        if has_domain_names {
            // "DomainNames is only supported for Accept rules." Documented, not a CEL rule
            // in this version of the CRD.
            if *action != v1alpha2::ClusterNetworkPolicyRuleAction::Accept {
                s.warning(
                    &path.field("action"),
                    invalid(
                        format!("{action:?}"),
                        "domainNames peers are only supported in Accept rules",
                    ),
                );
            }
            s.warning(&path, ProblemKind::DomainNamesUnresolved);
        }
        cnp_protocols(&mut s, &path, protocols.as_deref());
        // <network-policy-api:experimental:validation>
        // +kubebuilder:validation:XValidation:rule="!(self.to.exists(peer,
        // has(peer.networks) || has(peer.nodes) || has(peer.domainNames)) &&
        // has(self.protocols) && self.protocols.exists(protocol,
        // has(protocol.destinationNamedPort)))"
        if without_named_ports
            && let Some(name) =
                protocols.iter().flatten().find_map(|p| p.destination_named_port.as_ref())
        {
            s.error(
                &path,
                invalid(
                    name,
                    "networks/nodes/domainNames peer cannot be set with namedPorts since \
                         there are no namedPorts for networks/nodes/domainNames",
                ),
            );
        }
        after_rule(Direction::Egress, i);
    }
}

/// `Protocols []ClusterNetworkPolicyProtocol`: "+optional", "MinItems=1", "MaxItems=25".
fn cnp_protocols(
    s: &mut Sink<'_>,
    rule_path: &Path<'_>,
    protocols: Option<&[v1alpha2::ClusterNetworkPolicyProtocol]>,
) {
    let Some(protocols) = protocols else { return };
    let path = rule_path.field("protocols");
    item_count(s, &path, protocols.len(), 1, V1ALPHA2_MAX_ITEMS);
    for (k, proto) in protocols.iter().enumerate() {
        let path = path.index(k);
        let v1alpha2::ClusterNetworkPolicyProtocol { tcp, udp, sctp, destination_named_port } =
            proto;
        // ClusterNetworkPolicyProtocol: "Exactly one field must be set."
        union_exactly_one(
            s,
            &path,
            "tcp, udp, sctp, destinationNamedPort",
            &[
                ("tcp", tcp.is_some()),
                ("udp", udp.is_some()),
                ("sctp", sctp.is_some()),
                ("destinationNamedPort", destination_named_port.is_some()),
            ],
        );
        for (member, value) in [("tcp", tcp), ("udp", udp), ("sctp", sctp)] {
            if let Some(v1alpha2::ProtocolPort { destination_port }) = value {
                let member_path = path.field(member);
                let port_path = member_path.field("destinationPort");
                match destination_port {
                    // ClusterNetworkPolicyProtocolTCP/UDP/SCTP:
                    // "+kubebuilder:validation:MinProperties=1"; destinationPort is the
                    // only property.
                    None => s.error(&port_path, ProblemKind::Required),
                    Some(dp) => destination_port_checked(s, &port_path, dp),
                }
            }
        }
        if let Some(name) = destination_named_port {
            check_named_port(s, &path.field("destinationNamedPort"), name);
        }
    }
}

fn destination_port_checked(s: &mut Sink<'_>, path: &Path<'_>, dp: &v1alpha2::DestinationPort) {
    let v1alpha2::DestinationPort { number, range } = dp;
    // Port: "You must specify either Port or Range." (MaxProperties=1, MinProperties=1)
    union_exactly_one(
        s,
        path,
        "number, range",
        &[("number", number.is_some()), ("range", range.is_some())],
    );
    if let Some(n) = number {
        check_port(s, &path.field("number"), *n);
    }
    if let Some(v1alpha2::PortRange { start, end }) = range {
        let range_path = path.field("range");
        check_port(s, &range_path.field("start"), *start);
        check_port(s, &range_path.field("end"), *end);
        // +kubebuilder:validation:XValidation:rule="self.start < self.end",
        // message="Start port must be less than End port"
        if start >= end {
            s.error(
                &range_path,
                invalid(format!("{start}-{end}"), "Start port must be less than End port"),
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// networking.k8s.io/v1 NetworkPolicy
// ---------------------------------------------------------------------------------------

/// Validates a NetworkPolicy as kubernetes `ValidateNetworkPolicy` does on create:
/// metadata (DNS-1123 subdomain name, namespace required), `podSelector` and every peer
/// selector ([`label_selector`]), ports (protocol TCP/UDP/SCTP; `port` a number 1–65535 or
/// an IANA_SVC_NAME; `endPort` only with a numeric port, ≥ `port`, ≤ 65535), peers (at
/// least one of podSelector/namespaceSelector/ipBlock; ipBlock alone), ipBlock (`cidr`
/// required and valid; each `except` valid and a strict subset of `cidr`), and
/// `policyTypes` (at most two, each Ingress or Egress).
///
/// Upstream does not reject a repeated policy type (`[Ingress, Ingress]`); that is a
/// warning here.
///
/// Source: kubernetes `pkg/apis/networking/validation/validation.go`.
pub fn network_policy(obj: &api::NetworkPolicy, out: &mut Vec<Problem>) {
    let mut s = Sink::new(Kind::NetworkPolicy, &obj.metadata, out);
    object_meta(&mut s, &obj.metadata, NameRule::Subdomain, true);
    let Some(spec) = &obj.spec else { return };
    let k8s_openapi::api::networking::v1::NetworkPolicySpec {
        egress,
        ingress,
        pod_selector,
        policy_types,
    } = spec;
    if let Some(sel) = pod_selector {
        selector(&mut s, sel, &Path::root("spec.podSelector"), Severity::Error);
    }
    let ingress_path = Path::root("spec.ingress");
    for (i, rule) in ingress.iter().flatten().enumerate() {
        let k8s_openapi::api::networking::v1::NetworkPolicyIngressRule { from, ports } = rule;
        let path = ingress_path.index(i);
        let ports_path = path.field("ports");
        for (k, port) in ports.iter().flatten().enumerate() {
            np_port(&mut s, &ports_path.index(k), port);
        }
        let from_path = path.field("from");
        for (j, peer) in from.iter().flatten().enumerate() {
            np_peer(&mut s, &from_path.index(j), peer);
        }
    }
    let egress_path = Path::root("spec.egress");
    for (i, rule) in egress.iter().flatten().enumerate() {
        let k8s_openapi::api::networking::v1::NetworkPolicyEgressRule { ports, to } = rule;
        let path = egress_path.index(i);
        let ports_path = path.field("ports");
        for (k, port) in ports.iter().flatten().enumerate() {
            np_port(&mut s, &ports_path.index(k), port);
        }
        let to_path = path.field("to");
        for (j, peer) in to.iter().flatten().enumerate() {
            np_peer(&mut s, &to_path.index(j), peer);
        }
    }
    if let Some(types) = policy_types {
        let path = Path::root("spec.policyTypes");
        // "may not specify more than two policyTypes"
        if types.len() > 2 {
            s.error(&path, invalid(types.join(","), "may not specify more than two policyTypes"));
            return;
        }
        for (i, t) in types.iter().enumerate() {
            let field = path.index(i);
            if t != "Ingress" && t != "Egress" {
                s.error(&field, ProblemKind::NotInEnum { value: t.clone(), allowed: POLICY_TYPES });
            } else if types.get(..i).is_some_and(|before| before.contains(t)) {
                s.warning(&field, invalid(t, "listed twice; the API server accepts the repeat"));
            }
        }
    }
}

/// kubernetes `ValidateNetworkPolicyPort`.
fn np_port(
    s: &mut Sink<'_>,
    path: &Path<'_>,
    port: &k8s_openapi::api::networking::v1::NetworkPolicyPort,
) {
    let k8s_openapi::api::networking::v1::NetworkPolicyPort { end_port, port, protocol } = port;
    // SetDefaults_NetworkPolicyPort sets TCP only when the pointer is nil, so "" is
    // rejected like any other value outside the enum.
    if let Some(p) = protocol
        && !matches!(p.as_str(), "TCP" | "UDP" | "SCTP")
    {
        s.error(
            &path.field("protocol"),
            ProblemKind::NotInEnum { value: p.clone(), allowed: PROTOCOLS },
        );
    }
    let end_path = path.field("endPort");
    match port {
        Some(IntOrString::Int(n)) => {
            check_port(s, &path.field("port"), *n);
            if let Some(end) = end_port {
                // "must be greater than or equal to `port`"
                if end < n {
                    s.error(
                        &end_path,
                        invalid(end.to_string(), "must be greater than or equal to `port`"),
                    );
                }
                check_port(s, &end_path, *end);
            }
        }
        Some(IntOrString::String(name)) => {
            if let Some(end) = end_port {
                s.error(
                    &end_path,
                    invalid(end.to_string(), "may not be specified when `port` is non-numeric"),
                );
            }
            let errs = port_name_errors(name);
            if !errs.is_empty() {
                s.error(&path.field("port"), invalid(name, errs.join("; ")));
            }
        }
        None => {
            if let Some(end) = end_port {
                s.error(
                    &end_path,
                    invalid(end.to_string(), "may not be specified when `port` is not specified"),
                );
            }
        }
    }
}

/// kubernetes `ValidateNetworkPolicyPeer` and `ValidateIPBlock`.
fn np_peer(
    s: &mut Sink<'_>,
    path: &Path<'_>,
    peer: &k8s_openapi::api::networking::v1::NetworkPolicyPeer,
) {
    let k8s_openapi::api::networking::v1::NetworkPolicyPeer {
        ip_block,
        namespace_selector,
        pod_selector,
    } = peer;
    if let Some(sel) = pod_selector {
        selector(s, sel, &path.field("podSelector"), Severity::Error);
    }
    if let Some(sel) = namespace_selector {
        selector(s, sel, &path.field("namespaceSelector"), Severity::Error);
    }
    if let Some(block) = ip_block {
        ip_block_checked(s, &path.field("ipBlock"), block);
    }
    let selectors = [
        ("podSelector", pod_selector.is_some()),
        ("namespaceSelector", namespace_selector.is_some()),
    ];
    let has_selector = set_count(&selectors) > 0;
    if !has_selector && ip_block.is_none() {
        // field.Required(peerPath, "must specify a peer")
        s.error(path, ProblemKind::Required);
    } else if ip_block.is_some() && has_selector {
        // field.Forbidden(peerPath, "may not specify both ipBlock and another peer")
        s.error(
            path,
            ProblemKind::NotExactlyOne {
                fields: "ipBlock, podSelector/namespaceSelector",
                found: format!("ipBlock, {}", set_names(&selectors)),
            },
        );
    }
}

fn ip_block_checked(
    s: &mut Sink<'_>,
    path: &Path<'_>,
    block: &k8s_openapi::api::networking::v1::IPBlock,
) {
    let k8s_openapi::api::networking::v1::IPBlock { cidr: block_cidr, except } = block;
    if block_cidr.is_empty() {
        s.error(&path.field("cidr"), ProblemKind::Required);
        return;
    }
    let net = match cidr::parse(block_cidr) {
        Ok(net) => net,
        Err(e) => {
            s.error(&path.field("cidr"), invalid(block_cidr, e.to_string()));
            return;
        }
    };
    let except_path = path.field("except");
    for (i, ex) in except.iter().flatten().enumerate() {
        let field = except_path.index(i);
        match cidr::parse(ex) {
            Err(e) => s.error(&field, invalid(ex, e.to_string())),
            // "!cidrIPNet.Contains(exceptCIDR.IP) || cidrMaskLen >= exceptMaskLen":
            // "must be a strict subset of `cidr`"
            Ok(ex_net) => {
                if !net.contains(&ex_net) || ex_net.prefix_len() <= net.prefix_len() {
                    s.error(&field, invalid(ex, "must be a strict subset of `cidr`"));
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// v1 Namespace, Pod, Node
// ---------------------------------------------------------------------------------------

/// Validates a Namespace: metadata with a DNS-1123 label name (`ValidateNamespace`), and
/// the `kubernetes.io/metadata.name` label. The API server does not reject a mismatching
/// label: `SetDefaults_Namespace` overwrites it ("obj.Labels[v1.LabelMetadataName] =
/// obj.Name"), so a mismatch is a warning and the loader must overwrite the label too.
///
/// Source: kubernetes `pkg/apis/core/validation` `ValidateNamespace`,
/// `pkg/apis/core/v1/defaults.go` `SetDefaults_Namespace`.
pub fn namespace(obj: &api::Namespace, out: &mut Vec<Problem>) {
    let mut s = Sink::new(Kind::Namespace, &obj.metadata, out);
    object_meta(&mut s, &obj.metadata, NameRule::Label, false);
    let name = obj.metadata.name.as_deref().unwrap_or_default();
    if let Some(value) = obj.metadata.labels.as_ref().and_then(|l| l.get(NAMESPACE_NAME_LABEL))
        && !name.is_empty()
        && value != name
    {
        s.warning(
            &Path::root("metadata.labels").key(NAMESPACE_NAME_LABEL),
            invalid(
                value,
                format!(
                    "differs from the name {name:?}; the API server overwrites it with the name"
                ),
            ),
        );
    }
}

/// Validates the parts of a Pod the policy engine reads: metadata (DNS-1123 subdomain
/// name, namespace required), `status.podIP` and `status.podIPs` (valid IPs, at most one
/// per family, no repeats: `validatePodIPs`), and container ports of `containers` and
/// `initContainers` (`validateContainerPorts`: `containerPort` 1–65535, `hostPort`
/// 1–65535 when set, protocol TCP/UDP/SCTP, `name` an IANA_SVC_NAME unique in its
/// container).
///
/// `status.podIP` differing from `status.podIPs[0]` is a warning: the API server's v1
/// conversion keeps it ("PodIP is authoritative for compatibility with older kubelets") and
/// replaces `podIPs` with `[podIP]`.
///
/// Source: kubernetes `pkg/apis/core/validation/validation.go`, `pkg/apis/core/v1/
/// conversion.go` `Convert_v1_PodStatus_To_core_PodStatus`.
pub fn pod(obj: &api::Pod, out: &mut Vec<Problem>) {
    let mut s = Sink::new(Kind::Pod, &obj.metadata, out);
    object_meta(&mut s, &obj.metadata, NameRule::Subdomain, true);
    if let Some(spec) = &obj.spec {
        let path = Path::root("spec.containers");
        for (i, c) in spec.containers.iter().enumerate() {
            container_ports(&mut s, &path.index(i).field("ports"), c.ports.as_deref());
        }
        let path = Path::root("spec.initContainers");
        for (i, c) in spec.init_containers.iter().flatten().enumerate() {
            container_ports(&mut s, &path.index(i).field("ports"), c.ports.as_deref());
        }
    }
    let Some(status) = &obj.status else { return };
    let pod_ip_path = Path::root("status.podIP");
    let pod_ip = status.pod_ip.as_deref().filter(|ip| !ip.is_empty());
    if let Some(ip) = pod_ip
        && let Err(reason) = parse_ip(ip)
    {
        s.error(&pod_ip_path, invalid(ip, reason));
    }
    let pod_ips_path = Path::root("status.podIPs");
    let pod_ips = status.pod_ips.as_deref().unwrap_or_default();
    // How many entries parse, and how many of those are IPv4.
    let (mut parsed, mut v4) = (0usize, 0usize);
    for (i, entry) in pod_ips.iter().enumerate() {
        match parse_ip(&entry.ip) {
            Ok(ip) => {
                parsed += 1;
                v4 += usize::from(ip.is_ipv4());
            }
            Err(reason) => s.error(&pod_ips_path.index(i).field("ip"), invalid(&entry.ip, reason)),
        }
    }
    if pod_ips.len() > 1 && parsed == pod_ips.len() {
        // "may specify no more than one IP for each IP family"
        let v6 = parsed - v4;
        if v4 == 0 || v6 == 0 || parsed > 2 {
            let all: Vec<&str> = pod_ips.iter().map(|p| p.ip.as_str()).collect();
            s.error(
                &pod_ips_path,
                invalid(all.join(","), "may specify no more than one IP for each IP family"),
            );
        }
        // "There should be no duplicates in list of Pod.PodIPs"
        let mut seen = Seen::new();
        for (i, entry) in pod_ips.iter().enumerate() {
            if !seen.insert(entry.ip.as_str()) {
                s.error(&pod_ips_path.index(i).field("ip"), invalid(&entry.ip, "duplicate value"));
            }
        }
    }
    if let (Some(ip), Some(first)) = (pod_ip, pod_ips.first())
        && first.ip != ip
    {
        s.warning(
            &pod_ip_path,
            invalid(
                ip,
                format!(
                    "differs from status.podIPs[0] ({:?}); the API server keeps podIP and \
                         replaces podIPs with [podIP]",
                    first.ip
                ),
            ),
        );
    }
}

/// kubernetes `validateContainerPorts` (after `SetDefaults_ContainerPort`, which turns an
/// empty protocol into TCP).
fn container_ports(
    s: &mut Sink<'_>,
    path: &Path<'_>,
    ports: Option<&[k8s_openapi::api::core::v1::ContainerPort]>,
) {
    let mut names = Seen::new();
    for (j, port) in ports.unwrap_or_default().iter().enumerate() {
        let path = path.index(j);
        let k8s_openapi::api::core::v1::ContainerPort {
            container_port,
            host_ip: _,
            host_port,
            name,
            protocol,
        } = port;
        if let Some(name) = name.as_deref().filter(|n| !n.is_empty()) {
            let errs = port_name_errors(name);
            if !errs.is_empty() {
                s.error(&path.field("name"), invalid(name, errs.join("; ")));
            } else if !names.insert(name) {
                s.error(
                    &path.field("name"),
                    invalid(name, "duplicate port name in this container"),
                );
            }
        }
        if *container_port == 0 {
            s.error(&path.field("containerPort"), ProblemKind::Required);
        } else {
            check_port(s, &path.field("containerPort"), *container_port);
        }
        if let Some(hp) = host_port.filter(|hp| *hp != 0) {
            check_port(s, &path.field("hostPort"), hp);
        }
        if let Some(p) = protocol.as_deref().filter(|p| !p.is_empty())
            && !matches!(p, "TCP" | "UDP" | "SCTP")
        {
            s.error(
                &path.field("protocol"),
                ProblemKind::NotInEnum { value: p.to_owned(), allowed: PROTOCOLS },
            );
        }
    }
}

/// Validates a Node: metadata with a DNS-1123 subdomain name (`ValidateNodeName`), and the
/// `InternalIP`/`ExternalIP` entries of `status.addresses`, which tierproxy matches
/// against `nodes` peers. The API server does not parse node addresses (it only rejects
/// exact duplicates on update), so an address that is not an IP is a warning: it is
/// ignored. `Hostname`, `InternalDNS` and `ExternalDNS` entries are not read.
///
/// Source: kubernetes `pkg/apis/core/validation` `ValidateNode`, `ValidateNodeUpdate`.
pub fn node(obj: &api::Node, out: &mut Vec<Problem>) {
    let mut s = Sink::new(Kind::Node, &obj.metadata, out);
    object_meta(&mut s, &obj.metadata, NameRule::Subdomain, false);
    let addresses = obj.status.as_ref().and_then(|st| st.addresses.as_deref()).unwrap_or_default();
    let path = Path::root("status.addresses");
    for (i, a) in addresses.iter().enumerate() {
        if matches!(a.type_.as_str(), "InternalIP" | "ExternalIP")
            && let Err(reason) = parse_ip(&a.address)
        {
            s.warning(
                &path.index(i).field("address"),
                invalid(&a.address, format!("{reason}; the address is ignored")),
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// Syntax helpers (apimachinery pkg/util/validation, network-policy-api patterns)
// ---------------------------------------------------------------------------------------

/// Parses an IP as `IsValidIPForLegacyField` does with strict validation (the
/// `StrictIPCIDRValidation` behaviour): no leading zeros in IPv4 octets, no zones, no
/// IPv4-mapped IPv6 addresses.
fn parse_ip(s: &str) -> Result<IpAddr, &'static str> {
    let ip: IpAddr = s.parse().map_err(|_| "must be a valid IP address")?;
    if let IpAddr::V6(v6) = ip
        && v6.to_ipv4_mapped().is_some()
    {
        return Err("must not be an IPv4-mapped IPv6 address");
    }
    Ok(ip)
}

fn is_lower_alnum(b: u8) -> bool {
    b.is_ascii_lowercase() || b.is_ascii_digit()
}

/// `[a-z0-9]([-a-z0-9]*[a-z0-9])?`
fn matches_dns1123_label(s: &str) -> bool {
    let b = s.as_bytes();
    match (b.first(), b.last()) {
        (Some(&f), Some(&l)) => {
            is_lower_alnum(f)
                && is_lower_alnum(l)
                && b.iter().all(|&c| is_lower_alnum(c) || c == b'-')
        }
        _ => false,
    }
}

/// `IsDNS1123Label`.
fn dns1123_label_errors(s: &str) -> Vec<String> {
    let mut errs = Vec::new();
    if s.len() > MAX_LABEL_LEN {
        errs.push(format!("must be no more than {MAX_LABEL_LEN} characters"));
    }
    if !matches_dns1123_label(s) {
        errs.push(
            "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or \
             '-', and must start and end with an alphanumeric character"
                .to_owned(),
        );
    }
    errs
}

/// `IsDNS1123Subdomain`.
fn dns1123_subdomain_errors(s: &str) -> Vec<String> {
    let mut errs = Vec::new();
    if s.len() > MAX_SUBDOMAIN_LEN {
        errs.push(format!("must be no more than {MAX_SUBDOMAIN_LEN} characters"));
    }
    if !s.split('.').all(matches_dns1123_label) {
        errs.push(
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric \
             characters, '-' or '.', and must start and end with an alphanumeric character"
                .to_owned(),
        );
    }
    errs
}

/// `([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]`
fn matches_qualified_name_part(s: &str) -> bool {
    let b = s.as_bytes();
    match (b.first(), b.last()) {
        (Some(f), Some(l)) => {
            f.is_ascii_alphanumeric()
                && l.is_ascii_alphanumeric()
                && b.iter().all(|&c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        }
        _ => false,
    }
}

/// [`qualified_name_errors`] is empty: checked without building messages.
fn is_qualified_name(s: &str) -> bool {
    // The common case, a name without prefix: the name part's character class has no '/'.
    if s.len() <= MAX_LABEL_LEN && matches_qualified_name_part(s) {
        return true;
    }
    let name = match s.bytes().position(|c| c == b'/') {
        None => s,
        Some(i) => {
            let prefix = &s[..i];
            if prefix.is_empty()
                || prefix.len() > MAX_SUBDOMAIN_LEN
                || !prefix.split('.').all(matches_dns1123_label)
            {
                return false;
            }
            // A second '/' fails the name part's character class.
            &s[i + 1..]
        }
    };
    name.len() <= MAX_LABEL_LEN && matches_qualified_name_part(name)
}

/// `IsQualifiedName`: label keys and annotation keys.
fn qualified_name_errors(s: &str) -> Vec<String> {
    if is_qualified_name(s) { Vec::new() } else { qualified_name_messages(s) }
}

/// The messages of [`qualified_name_errors`], worked out in full.
fn qualified_name_messages(s: &str) -> Vec<String> {
    let mut errs = Vec::new();
    // `s.split('/')` has one part (a name), two (prefix and name) or more (invalid).
    let name = match s.split_once('/') {
        None => s,
        Some((prefix, name)) if !name.contains('/') => {
            if prefix.is_empty() {
                errs.push("prefix part must be non-empty".to_owned());
            } else {
                errs.extend(
                    dns1123_subdomain_errors(prefix)
                        .into_iter()
                        .map(|m| format!("prefix part {m}")),
                );
            }
            name
        }
        Some(_) => {
            errs.push(
                "a qualified name must consist of alphanumeric characters, '-', '_' or '.', and \
                 must start and end with an alphanumeric character, with an optional DNS \
                 subdomain prefix and '/'"
                    .to_owned(),
            );
            return errs;
        }
    };
    if name.is_empty() {
        errs.push("name part must be non-empty".to_owned());
    } else if name.len() > MAX_LABEL_LEN {
        errs.push(format!("name part must be no more than {MAX_LABEL_LEN} characters"));
    }
    if !matches_qualified_name_part(name) {
        errs.push(
            "name part must consist of alphanumeric characters, '-', '_' or '.', and must start \
             and end with an alphanumeric character"
                .to_owned(),
        );
    }
    errs
}

/// [`label_value_errors`] is empty.
fn is_label_value(s: &str) -> bool {
    s.len() <= MAX_LABEL_LEN && (s.is_empty() || matches_qualified_name_part(s))
}

/// `IsValidLabelValue`: empty, or a qualified-name part of at most 63 characters.
fn label_value_errors(s: &str) -> Vec<String> {
    let mut errs = Vec::new();
    if s.len() > MAX_LABEL_LEN {
        errs.push(format!("must be no more than {MAX_LABEL_LEN} characters"));
    }
    if !s.is_empty() && !matches_qualified_name_part(s) {
        errs.push(
            "a valid label must be an empty string or consist of alphanumeric characters, '-', \
             '_' or '.', and must start and end with an alphanumeric character"
                .to_owned(),
        );
    }
    errs
}

/// `IsValidPortName` (IANA_SVC_NAME, RFC 6335): at most 15 characters of `[-a-z0-9]`, at
/// least one letter, no `--`, no leading or trailing `-`.
fn port_name_errors(s: &str) -> Vec<String> {
    let mut errs = Vec::new();
    if s.len() > MAX_PORT_NAME_LEN {
        errs.push(format!("must be no more than {MAX_PORT_NAME_LEN} characters"));
    }
    if s.is_empty() || !s.bytes().all(|c| is_lower_alnum(c) || c == b'-') {
        errs.push(
            "must contain only alpha-numeric characters (a-z, 0-9), and hyphens (-)".to_owned(),
        );
    }
    if !s.bytes().any(|c| c.is_ascii_lowercase()) {
        errs.push("must contain at least one letter (a-z)".to_owned());
    }
    if s.contains("--") {
        errs.push("must not contain consecutive hyphens".to_owned());
    }
    if s.starts_with('-') || s.ends_with('-') {
        errs.push("must not begin or end with a hyphen".to_owned());
    }
    errs
}

/// The `DomainName` pattern of network-policy-api (v1alpha1 and v1alpha2):
/// `^(\*\.)?([a-zA-z0-9]([-a-zA-Z0-9_]*[a-zA-Z0-9])?\.)+[a-zA-z0-9]([-a-zA-Z0-9_]*[a-zA-Z0-9])?\.?$`
///
/// Mirrored exactly, including upstream's `A-z` range in the first-character class, which
/// also admits `[ \ ] ^ _` and `` ` `` as the first character of a label.
pub fn is_domain_name(s: &str) -> bool {
    fn first(c: u8) -> bool {
        c.is_ascii_lowercase() || (b'A'..=b'z').contains(&c) || c.is_ascii_digit()
    }
    fn label(l: &str) -> bool {
        match l.as_bytes() {
            [] => false,
            [only] => first(*only),
            [f, mid @ .., last] => {
                first(*f)
                    && mid.iter().all(|&c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
                    && last.is_ascii_alphanumeric()
            }
        }
    }
    let s = s.strip_prefix("*.").unwrap_or(s);
    let s = s.strip_suffix('.').unwrap_or(s);
    let mut labels = 0usize;
    for l in s.split('.') {
        if !label(l) {
            return false;
        }
        labels += 1;
    }
    labels >= 2
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    /// The kind a table row validates, with a valid manifest of that kind.
    #[derive(Clone, Copy, Debug)]
    enum Target {
        Anp,
        Banp,
        Cnp,
        Np,
        Ns,
        Pod,
        Node,
    }

    impl Target {
        fn base(self) -> Value {
            match self {
                Target::Anp => json!({
                    "apiVersion": "policy.networking.k8s.io/v1alpha1",
                    "kind": "AdminNetworkPolicy",
                    "metadata": {"name": "anp"},
                    "spec": {
                        "priority": 10,
                        "subject": {"namespaces": {"matchLabels": {"team": "a"}}},
                        "ingress": [{
                            "name": "allow-from-b",
                            "action": "Allow",
                            "from": [
                                {"namespaces": {"matchLabels": {"team": "b"}}},
                                {"pods": {
                                    "namespaceSelector": {},
                                    "podSelector": {"matchExpressions": [
                                        {"key": "app", "operator": "In", "values": ["web"]}
                                    ]}
                                }}
                            ],
                            "ports": [
                                {"portNumber": {"protocol": "TCP", "port": 80}},
                                {"namedPort": "http"},
                                {"portRange": {"protocol": "UDP", "start": 1000, "end": 2000}}
                            ]
                        }],
                        "egress": [
                            {
                                "name": "deny-net",
                                "action": "Deny",
                                "to": [
                                    {"networks": ["10.0.0.0/8", "2001:db8::/32"]},
                                    {"nodes": {"matchExpressions": [{
                                        "key": "node-role.kubernetes.io/control-plane",
                                        "operator": "Exists"
                                    }]}}
                                ],
                                "ports": [{"portNumber": {"port": 443}}]
                            },
                            {
                                "name": "pass-dns",
                                "action": "Pass",
                                "to": [{"pods": {
                                    "namespaceSelector": {"matchLabels": {
                                        "kubernetes.io/metadata.name": "kube-system"
                                    }},
                                    "podSelector": {}
                                }}],
                                "ports": [{"namedPort": "dns"}]
                            }
                        ]
                    }
                }),
                Target::Banp => json!({
                    "apiVersion": "policy.networking.k8s.io/v1alpha1",
                    "kind": "BaselineAdminNetworkPolicy",
                    "metadata": {"name": "default"},
                    "spec": {
                        "subject": {"pods": {"namespaceSelector": {}, "podSelector": {}}},
                        "ingress": [{
                            "action": "Deny",
                            "from": [{"namespaces": {}}]
                        }],
                        "egress": [{
                            "name": "deny-all",
                            "action": "Deny",
                            "to": [
                                {"networks": ["0.0.0.0/0", "::/0"]},
                                {"nodes": {}}
                            ],
                            "ports": [{"portRange": {"start": 1, "end": 1024}}]
                        }]
                    }
                }),
                Target::Cnp => json!({
                    "apiVersion": "policy.networking.k8s.io/v1alpha2",
                    "kind": "ClusterNetworkPolicy",
                    "metadata": {"name": "cnp"},
                    "spec": {
                        "tier": "Admin",
                        "priority": 5,
                        "subject": {"namespaces": {}},
                        "ingress": [{
                            "name": "accept-monitoring",
                            "action": "Accept",
                            "from": [{"namespaces": {"matchLabels": {"role": "monitoring"}}}],
                            "protocols": [
                                {"tcp": {"destinationPort": {"number": 9090}}},
                                {"destinationNamedPort": "metrics"}
                            ]
                        }],
                        "egress": [{
                            "name": "deny-external",
                            "action": "Deny",
                            "to": [{"networks": ["192.0.2.0/24"]}, {"nodes": {}}],
                            "protocols": [
                                {"udp": {"destinationPort": {"range": {"start": 1000, "end": 2000}}}},
                                {"sctp": {"destinationPort": {"number": 36412}}}
                            ]
                        }]
                    }
                }),
                Target::Np => json!({
                    "apiVersion": "networking.k8s.io/v1",
                    "kind": "NetworkPolicy",
                    "metadata": {"name": "np", "namespace": "prod"},
                    "spec": {
                        "podSelector": {"matchLabels": {"app": "db"}},
                        "policyTypes": ["Ingress", "Egress"],
                        "ingress": [{
                            "from": [
                                {"podSelector": {"matchLabels": {"app": "web"}},
                                 "namespaceSelector": {"matchLabels": {"env": "prod"}}},
                                {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}
                            ],
                            "ports": [
                                {"protocol": "TCP", "port": 5432},
                                {"port": "metrics"},
                                {"port": 8000, "endPort": 8100}
                            ]
                        }],
                        "egress": [{
                            "to": [{"namespaceSelector": {}}],
                            "ports": [{"protocol": "UDP", "port": 53}]
                        }]
                    }
                }),
                Target::Ns => json!({
                    "apiVersion": "v1",
                    "kind": "Namespace",
                    "metadata": {
                        "name": "prod",
                        "labels": {"kubernetes.io/metadata.name": "prod", "env": "prod"}
                    }
                }),
                Target::Pod => json!({
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": "db-0", "namespace": "prod", "labels": {"app": "db"}},
                    "spec": {"containers": [{
                        "name": "db",
                        "ports": [
                            {"name": "postgres", "containerPort": 5432, "protocol": "TCP"},
                            {"name": "metrics", "containerPort": 9187}
                        ]
                    }]},
                    "status": {
                        "podIP": "10.0.0.5",
                        "podIPs": [{"ip": "10.0.0.5"}, {"ip": "fd00::5"}]
                    }
                }),
                Target::Node => json!({
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {"name": "node-1"},
                    "status": {"addresses": [
                        {"type": "InternalIP", "address": "192.168.1.10"},
                        {"type": "ExternalIP", "address": "2001:db8::10"},
                        {"type": "Hostname", "address": "node-1"}
                    ]}
                }),
            }
        }

        fn run(self, v: Value) -> Vec<Problem> {
            let mut out = Vec::new();
            match self {
                Target::Anp => admin_network_policy(&de(v), &mut out),
                Target::Banp => baseline_admin_network_policy(&de(v), &mut out),
                Target::Cnp => cluster_network_policy(&de(v), &mut out),
                Target::Np => network_policy(&de(v), &mut out),
                Target::Ns => namespace(&de(v), &mut out),
                Target::Pod => pod(&de(v), &mut out),
                Target::Node => node(&de(v), &mut out),
            }
            out
        }
    }

    fn de<T: serde::de::DeserializeOwned>(v: Value) -> T {
        serde_json::from_value(v).expect("test manifest deserializes")
    }

    type Want = (Severity, &'static str, ProblemKind);

    fn err(field: &'static str, kind: ProblemKind) -> Want {
        (Severity::Error, field, kind)
    }

    fn warn(field: &'static str, kind: ProblemKind) -> Want {
        (Severity::Warning, field, kind)
    }

    fn inv(value: &str, reason: &str) -> ProblemKind {
        invalid(value, reason)
    }

    fn range(value: i64, min: i64, max: i64) -> ProblemKind {
        ProblemKind::OutOfRange { value, min, max }
    }

    fn one_of(fields: &'static str, found: &str) -> ProblemKind {
        ProblemKind::NotExactlyOne { fields, found: found.to_owned() }
    }

    fn too_many(len: usize, max: usize) -> ProblemKind {
        ProblemKind::TooManyItems { len, max }
    }

    fn too_few(len: usize, min: usize) -> ProblemKind {
        ProblemKind::TooFewItems { len, min }
    }

    fn not_in(value: &str, allowed: &'static str) -> ProblemKind {
        ProblemKind::NotInEnum { value: value.to_owned(), allowed }
    }

    fn repeat(v: &mut Value, n: usize) {
        let first = v[0].clone();
        *v = Value::Array(vec![first; n]);
    }

    /// One rule, one row.
    struct Row {
        rule: &'static str,
        target: Target,
        edit: fn(&mut Value),
        want: Vec<Want>,
    }

    fn row(rule: &'static str, target: Target, edit: fn(&mut Value), want: Vec<Want>) -> Row {
        Row { rule, target, edit, want }
    }

    const EGRESS_PEER: &str = "namespaces, pods, nodes, networks, domainNames";
    const CEL_ANP: &str = "networks/nodes/domainNames peer cannot be set with namedPorts since \
                           there are no namedPorts for networks/nodes/domainNames";
    const CEL_BANP: &str = "networks/nodes peer cannot be set with namedPorts since there are \
                            no namedPorts for networks/nodes";
    const DENY_ALL: &str = "denies all traffic the rule applies to";
    const DUP: &str = "duplicate entry in a list of type set";

    fn rows() -> Vec<Row> {
        use ProblemKind as P;
        use Target::*;
        vec![
            // ---- metadata ------------------------------------------------------------
            row("metadata_name_required", Anp, |v| v["metadata"] = json!({}), vec![
                err("metadata.name", P::Required),
            ]),
            row("metadata_name_dns1123_subdomain", Anp, |v| v["metadata"]["name"] = json!("Bad_Name"), vec![
                err("metadata.name", inv("Bad_Name", "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character")),
            ]),
            row("metadata_name_max_253", Cnp, |v| v["metadata"]["name"] = json!("a".repeat(254)), vec![
                err("metadata.name", inv(&"a".repeat(254), "must be no more than 253 characters")),
            ]),
            row("metadata_namespace_dropped_for_cluster_scoped", Anp, |v| v["metadata"]["namespace"] = json!("prod"), vec![
                warn("metadata.namespace", inv("prod", "this kind is cluster-scoped; the API server drops metadata.namespace")),
            ]),
            row("metadata_label_key_qualified_name", Anp, |v| v["metadata"]["labels"] = json!({"-x": "y"}), vec![
                err("metadata.labels[-x]", inv("-x", "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character")),
            ]),
            row("metadata_annotation_key_qualified_name", Np, |v| v["metadata"]["annotations"] = json!({"a/b/c": "y"}), vec![
                err("metadata.annotations[a/b/c]", inv("a/b/c", "a qualified name must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character, with an optional DNS subdomain prefix and '/'")),
            ]),
            row("metadata_annotations_total_256k", Np, |v| v["metadata"]["annotations"] = json!({"big": "x".repeat(MAX_ANNOTATIONS_BYTES)}), vec![
                err("metadata.annotations", P::TooLong { len: MAX_ANNOTATIONS_BYTES + 3, max: MAX_ANNOTATIONS_BYTES }),
            ]),
            // ---- AdminNetworkPolicy ---------------------------------------------------
            row("anp_priority_max_1000", Anp, |v| v["spec"]["priority"] = json!(1001), vec![
                err("spec.priority", range(1001, 0, 1000)),
            ]),
            row("anp_priority_min_0", Anp, |v| v["spec"]["priority"] = json!(-1), vec![
                err("spec.priority", range(-1, 0, 1000)),
            ]),
            row("anp_subject_exactly_one_of_two", Anp, |v| v["spec"]["subject"]["pods"] = json!({"namespaceSelector": {}, "podSelector": {}}), vec![
                err("spec.subject", one_of("namespaces, pods", "namespaces, pods")),
            ]),
            row("anp_subject_exactly_one_of_none", Anp, |v| v["spec"]["subject"] = json!({}), vec![
                err("spec.subject", one_of("namespaces, pods", "none")),
            ]),
            row("anp_ingress_max_100", Anp, |v| repeat(&mut v["spec"]["ingress"], 101), vec![
                err("spec.ingress", too_many(101, 100)),
            ]),
            row("anp_egress_max_100", Anp, |v| repeat(&mut v["spec"]["egress"], 101), vec![
                err("spec.egress", too_many(101, 100)),
            ]),
            row("anp_rule_name_max_100_chars", Anp, |v| v["spec"]["ingress"][0]["name"] = json!("é".repeat(101)), vec![
                err("spec.ingress[0].name", P::TooLong { len: 101, max: 100 }),
            ]),
            row("anp_rule_name_100_chars_ok", Anp, |v| v["spec"]["ingress"][0]["name"] = json!("é".repeat(100)), vec![]),
            row("anp_from_min_1", Anp, |v| v["spec"]["ingress"][0]["from"] = json!([]), vec![
                err("spec.ingress[0].from", too_few(0, 1)),
            ]),
            row("anp_to_max_100", Anp, |v| repeat(&mut v["spec"]["egress"][1]["to"], 101), vec![
                err("spec.egress[1].to", too_many(101, 100)),
            ]),
            row("anp_ports_min_1", Anp, |v| v["spec"]["egress"][0]["ports"] = json!([]), vec![
                err("spec.egress[0].ports", too_few(0, 1)),
            ]),
            row("anp_ports_max_100", Anp, |v| repeat(&mut v["spec"]["ingress"][0]["ports"], 101), vec![
                err("spec.ingress[0].ports", too_many(101, 100)),
            ]),
            row("anp_ingress_peer_exactly_one", Anp, |v| v["spec"]["ingress"][0]["from"][0]["pods"] = json!({"namespaceSelector": {}, "podSelector": {}}), vec![
                err("spec.ingress[0].from[0]", one_of("namespaces, pods", "namespaces, pods")),
            ]),
            row("anp_egress_peer_exactly_one", Anp, |v| v["spec"]["egress"][0]["to"][0]["nodes"] = json!({}), vec![
                err("spec.egress[0].to[0]", one_of(EGRESS_PEER, "nodes, networks")),
            ]),
            row("anp_unknown_peer_allow_matches_nothing", Anp, |v| v["spec"]["ingress"][0]["from"][0] = json!({"futurePeer": {}}), vec![
                warn("spec.ingress[0].from[0]", P::UnknownPeer { effect: "matches nothing" }),
            ]),
            row("anp_unknown_peer_deny_denies_all", Anp, |v| v["spec"]["egress"][0]["to"][1] = json!({}), vec![
                warn("spec.egress[0].to[1]", P::UnknownPeer { effect: DENY_ALL }),
            ]),
            row("anp_unknown_peer_pass_denies_all", Anp, |v| v["spec"]["egress"][1]["to"][0] = json!({}), vec![
                warn("spec.egress[1].to[0]", P::UnknownPeer { effect: DENY_ALL }),
            ]),
            row("anp_networks_min_1", Anp, |v| v["spec"]["egress"][0]["to"][0]["networks"] = json!([]), vec![
                err("spec.egress[0].to[0].networks", too_few(0, 1)),
            ]),
            row("anp_networks_max_25", Anp, |v| v["spec"]["egress"][0]["to"][0]["networks"] = json!((0..26).map(|i| format!("10.0.{i}.0/24")).collect::<Vec<_>>()), vec![
                err("spec.egress[0].to[0].networks", too_many(26, 25)),
            ]),
            row("anp_networks_is_cidr", Anp, |v| v["spec"]["egress"][0]["to"][0]["networks"][1] = json!("10.0.0.1"), vec![
                err("spec.egress[0].to[0].networks[1]", inv("10.0.0.1", "Invalid CIDR format provided: missing /prefix length")),
            ]),
            row("anp_networks_no_ipv4_mapped", Anp, |v| v["spec"]["egress"][0]["to"][0]["networks"][1] = json!("::ffff:10.0.0.0/104"), vec![
                err("spec.egress[0].to[0].networks[1]", inv("::ffff:10.0.0.0/104", "Invalid CIDR format provided: IPv4-mapped IPv6 addresses are not allowed")),
            ]),
            row("anp_networks_max_length_43", Anp, |v| v["spec"]["egress"][0]["to"][0]["networks"][1] = json!("1111:2222:3333:4444:5555:6666:255.255.255.255/128"), vec![
                err("spec.egress[0].to[0].networks[1]", P::TooLong { len: 49, max: 43 }),
            ]),
            row("anp_networks_list_type_set", Anp, |v| v["spec"]["egress"][0]["to"][0]["networks"][1] = json!("10.0.0.0/8"), vec![
                err("spec.egress[0].to[0].networks[1]", inv("10.0.0.0/8", DUP)),
            ]),
            row("anp_domain_names_unresolved", Anp, |v| {
                v["spec"]["egress"][0]["action"] = json!("Allow");
                v["spec"]["egress"][0]["to"][0] = json!({"domainNames": ["*.example.com", "kubernetes.io."]});
            }, vec![
                warn("spec.egress[0]", P::DomainNamesUnresolved),
            ]),
            row("anp_domain_names_pattern", Anp, |v| {
                v["spec"]["egress"][0]["action"] = json!("Allow");
                v["spec"]["egress"][0]["to"][0] = json!({"domainNames": ["localhost"]});
            }, vec![
                err("spec.egress[0].to[0].domainNames[0]", inv("localhost", "must be a domain name of at least two labels, optionally prefixed by '*.' and followed by one '.' (DomainName pattern)")),
                warn("spec.egress[0]", P::DomainNamesUnresolved),
            ]),
            row("anp_domain_names_min_1", Anp, |v| {
                v["spec"]["egress"][0]["action"] = json!("Allow");
                v["spec"]["egress"][0]["to"][0] = json!({"domainNames": []});
            }, vec![
                err("spec.egress[0].to[0].domainNames", too_few(0, 1)),
                warn("spec.egress[0]", P::DomainNamesUnresolved),
            ]),
            row("anp_domain_names_list_type_set", Anp, |v| {
                v["spec"]["egress"][0]["action"] = json!("Allow");
                v["spec"]["egress"][0]["to"][0] = json!({"domainNames": ["a.io", "a.io"]});
            }, vec![
                err("spec.egress[0].to[0].domainNames[1]", inv("a.io", DUP)),
                warn("spec.egress[0]", P::DomainNamesUnresolved),
            ]),
            row("anp_domain_names_allow_only_documented", Anp, |v| v["spec"]["egress"][0]["to"][0] = json!({"domainNames": ["example.com"]}), vec![
                warn("spec.egress[0].action", inv("Deny", "domainNames peers are only supported in Allow rules")),
                warn("spec.egress[0]", P::DomainNamesUnresolved),
            ]),
            row("anp_port_exactly_one_of_several", Anp, |v| v["spec"]["ingress"][0]["ports"][0]["namedPort"] = json!("http"), vec![
                err("spec.ingress[0].ports[0]", one_of("portNumber, namedPort, portRange", "portNumber, namedPort")),
            ]),
            row("anp_port_exactly_one_of_none", Anp, |v| v["spec"]["ingress"][0]["ports"][0] = json!({}), vec![
                err("spec.ingress[0].ports[0]", one_of("portNumber, namedPort, portRange", "none")),
            ]),
            row("anp_port_number_1_to_65535", Anp, |v| v["spec"]["ingress"][0]["ports"][0]["portNumber"]["port"] = json!(0), vec![
                err("spec.ingress[0].ports[0].portNumber.port", range(0, 1, 65535)),
            ]),
            row("anp_port_protocol_documented_enum", Anp, |v| v["spec"]["ingress"][0]["ports"][0]["portNumber"]["protocol"] = json!("ICMP"), vec![
                warn("spec.ingress[0].ports[0].portNumber.protocol", not_in("ICMP", "TCP, UDP, SCTP")),
            ]),
            row("anp_port_range_bounds", Anp, |v| v["spec"]["ingress"][0]["ports"][2]["portRange"] = json!({"start": 0, "end": 65536}), vec![
                err("spec.ingress[0].ports[2].portRange.start", range(0, 1, 65535)),
                err("spec.ingress[0].ports[2].portRange.end", range(65536, 1, 65535)),
            ]),
            row("anp_port_range_start_after_end_is_empty", Anp, |v| v["spec"]["ingress"][0]["ports"][2]["portRange"] = json!({"start": 2000, "end": 1000}), vec![
                warn("spec.ingress[0].ports[2].portRange", P::NeverMatches { reason: "start 2000 is greater than end 1000: the range is empty".to_owned() }),
            ]),
            row("anp_port_range_start_less_than_end_documented", Anp, |v| v["spec"]["ingress"][0]["ports"][2]["portRange"] = json!({"start": 80, "end": 80}), vec![
                warn("spec.ingress[0].ports[2].portRange", inv("80-80", "the Start value must be less than End (field doc; not enforced by the v0.1.7 CRD); the range holds one port")),
            ]),
            row("anp_named_port_must_be_iana_svc_name", Anp, |v| v["spec"]["ingress"][0]["ports"][1]["namedPort"] = json!("HTTP"), vec![
                warn("spec.ingress[0].ports[1].namedPort", P::NeverMatches { reason: "named port \"HTTP\" is not a valid IANA_SVC_NAME (must contain only alpha-numeric characters (a-z, 0-9), and hyphens (-); must contain at least one letter (a-z)), so no container port can have it".to_owned() }),
            ]),
            row("anp_cel_networks_nodes_without_named_ports", Anp, |v| v["spec"]["egress"][0]["ports"] = json!([{"namedPort": "https"}]), vec![
                err("spec.egress[0]", inv("https", CEL_ANP)),
            ]),
            row("anp_cel_domain_names_without_named_ports", Anp, |v| {
                v["spec"]["egress"][1]["action"] = json!("Allow");
                v["spec"]["egress"][1]["to"] = json!([{"domainNames": ["example.com"]}]);
            }, vec![
                warn("spec.egress[1]", P::DomainNamesUnresolved),
                err("spec.egress[1]", inv("dns", CEL_ANP)),
            ]),
            row("anp_selector_problems_are_warnings", Anp, |v| v["spec"]["subject"]["namespaces"]["matchLabels"] = json!({"team": "a b"}), vec![
                warn("spec.subject.namespaces.matchLabels[team]", inv("a b", "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character")),
            ]),
            row("anp_selector_operator_in_peer_pods", Anp, |v| v["spec"]["ingress"][0]["from"][1]["pods"]["podSelector"]["matchExpressions"][0]["operator"] = json!("in"), vec![
                warn("spec.ingress[0].from[1].pods.podSelector.matchExpressions[0].operator", not_in("in", SELECTOR_OPERATORS)),
            ]),
            row("anp_selector_nodes_exists_without_values", Anp, |v| v["spec"]["egress"][0]["to"][1]["nodes"]["matchExpressions"][0]["values"] = json!(["x"]), vec![
                warn("spec.egress[0].to[1].nodes.matchExpressions[0].values", inv("x", "may not be specified when `operator` is 'Exists' or 'DoesNotExist'")),
            ]),
            // ---- BaselineAdminNetworkPolicy -------------------------------------------
            row("banp_name_must_be_default", Banp, |v| v["metadata"]["name"] = json!("baseline"), vec![
                err("metadata.name", inv("baseline", "Only one baseline admin network policy with metadata.name=\"default\" can be created in the cluster")),
            ]),
            row("banp_ingress_max_100", Banp, |v| repeat(&mut v["spec"]["ingress"], 101), vec![
                err("spec.ingress", too_many(101, 100)),
            ]),
            row("banp_from_min_1", Banp, |v| v["spec"]["ingress"][0]["from"] = json!([]), vec![
                err("spec.ingress[0].from", too_few(0, 1)),
            ]),
            row("banp_egress_peer_exactly_one", Banp, |v| v["spec"]["egress"][0]["to"][1]["namespaces"] = json!({}), vec![
                err("spec.egress[0].to[1]", one_of("namespaces, pods, nodes, networks", "namespaces, nodes")),
            ]),
            row("banp_unknown_peer_deny_denies_all", Banp, |v| v["spec"]["egress"][0]["to"][0] = json!({"domainNames": ["example.com"]}), vec![
                warn("spec.egress[0].to[0]", P::UnknownPeer { effect: DENY_ALL }),
            ]),
            row("banp_unknown_peer_allow_matches_nothing", Banp, |v| {
                v["spec"]["ingress"][0]["action"] = json!("Allow");
                v["spec"]["ingress"][0]["from"][0] = json!({});
            }, vec![
                warn("spec.ingress[0].from[0]", P::UnknownPeer { effect: "matches nothing" }),
            ]),
            row("banp_cel_networks_nodes_without_named_ports", Banp, |v| v["spec"]["egress"][0]["ports"] = json!([{"namedPort": "ssh"}]), vec![
                err("spec.egress[0]", inv("ssh", CEL_BANP)),
            ]),
            row("banp_networks_is_cidr", Banp, |v| v["spec"]["egress"][0]["to"][0]["networks"][0] = json!("0.0.0.0/33"), vec![
                err("spec.egress[0].to[0].networks[0]", inv("0.0.0.0/33", "Invalid CIDR format provided: not an IPv4 or IPv6 CIDR")),
            ]),
            // ---- ClusterNetworkPolicy -------------------------------------------------
            row("cnp_priority_max_1000", Cnp, |v| v["spec"]["priority"] = json!(5000), vec![
                err("spec.priority", range(5000, 0, 1000)),
            ]),
            row("cnp_subject_exactly_one", Cnp, |v| v["spec"]["subject"] = json!({}), vec![
                err("spec.subject", one_of("namespaces, pods", "none")),
            ]),
            row("cnp_ingress_max_25", Cnp, |v| repeat(&mut v["spec"]["ingress"], 26), vec![
                err("spec.ingress", too_many(26, 25)),
            ]),
            row("cnp_egress_max_25", Cnp, |v| repeat(&mut v["spec"]["egress"], 26), vec![
                err("spec.egress", too_many(26, 25)),
            ]),
            row("cnp_from_max_25", Cnp, |v| repeat(&mut v["spec"]["ingress"][0]["from"], 26), vec![
                err("spec.ingress[0].from", too_many(26, 25)),
            ]),
            row("cnp_to_min_1", Cnp, |v| v["spec"]["egress"][0]["to"] = json!([]), vec![
                err("spec.egress[0].to", too_few(0, 1)),
            ]),
            row("cnp_rule_name_max_100", Cnp, |v| v["spec"]["egress"][0]["name"] = json!("x".repeat(101)), vec![
                err("spec.egress[0].name", P::TooLong { len: 101, max: 100 }),
            ]),
            row("cnp_protocols_min_1", Cnp, |v| v["spec"]["ingress"][0]["protocols"] = json!([]), vec![
                err("spec.ingress[0].protocols", too_few(0, 1)),
            ]),
            row("cnp_protocols_max_25", Cnp, |v| repeat(&mut v["spec"]["ingress"][0]["protocols"], 26), vec![
                err("spec.ingress[0].protocols", too_many(26, 25)),
            ]),
            row("cnp_protocol_exactly_one_of_several", Cnp, |v| v["spec"]["ingress"][0]["protocols"][0]["udp"] = json!({"destinationPort": {"number": 53}}), vec![
                err("spec.ingress[0].protocols[0]", one_of("tcp, udp, sctp, destinationNamedPort", "tcp, udp")),
            ]),
            row("cnp_protocol_exactly_one_of_none", Cnp, |v| v["spec"]["ingress"][0]["protocols"][0] = json!({}), vec![
                err("spec.ingress[0].protocols[0]", one_of("tcp, udp, sctp, destinationNamedPort", "none")),
            ]),
            row("cnp_protocol_tcp_min_properties_1", Cnp, |v| v["spec"]["ingress"][0]["protocols"][0]["tcp"] = json!({}), vec![
                err("spec.ingress[0].protocols[0].tcp.destinationPort", P::Required),
            ]),
            row("cnp_destination_port_exactly_one", Cnp, |v| v["spec"]["ingress"][0]["protocols"][0]["tcp"]["destinationPort"]["range"] = json!({"start": 1, "end": 2}), vec![
                err("spec.ingress[0].protocols[0].tcp.destinationPort", one_of("number, range", "number, range")),
            ]),
            row("cnp_destination_port_number_1_to_65535", Cnp, |v| v["spec"]["ingress"][0]["protocols"][0]["tcp"]["destinationPort"]["number"] = json!(0), vec![
                err("spec.ingress[0].protocols[0].tcp.destinationPort.number", range(0, 1, 65535)),
            ]),
            row("cnp_range_bounds", Cnp, |v| v["spec"]["egress"][0]["protocols"][0]["udp"]["destinationPort"]["range"]["end"] = json!(70000), vec![
                err("spec.egress[0].protocols[0].udp.destinationPort.range.end", range(70000, 1, 65535)),
            ]),
            row("cnp_range_start_less_than_end", Cnp, |v| v["spec"]["egress"][0]["protocols"][0]["udp"]["destinationPort"]["range"] = json!({"start": 2000, "end": 2000}), vec![
                err("spec.egress[0].protocols[0].udp.destinationPort.range", inv("2000-2000", "Start port must be less than End port")),
            ]),
            row("cnp_cel_networks_nodes_domain_names_without_named_ports", Cnp, |v| v["spec"]["egress"][0]["protocols"][1] = json!({"destinationNamedPort": "s1ap"}), vec![
                err("spec.egress[0]", inv("s1ap", CEL_ANP)),
            ]),
            row("cnp_named_port_must_be_iana_svc_name", Cnp, |v| v["spec"]["ingress"][0]["protocols"][1]["destinationNamedPort"] = json!(""), vec![
                warn("spec.ingress[0].protocols[1].destinationNamedPort", P::NeverMatches { reason: "named port \"\" is not a valid IANA_SVC_NAME (must contain only alpha-numeric characters (a-z, 0-9), and hyphens (-); must contain at least one letter (a-z)), so no container port can have it".to_owned() }),
            ]),
            row("cnp_unknown_peer_accept_matches_nothing", Cnp, |v| v["spec"]["ingress"][0]["from"][0] = json!({}), vec![
                warn("spec.ingress[0].from[0]", P::UnknownPeer { effect: "matches nothing" }),
            ]),
            row("cnp_unknown_peer_pass_denies_all", Cnp, |v| {
                v["spec"]["egress"][0]["action"] = json!("Pass");
                v["spec"]["egress"][0]["to"][1] = json!({"externalNetworkSet": "x"});
            }, vec![
                warn("spec.egress[0].to[1]", P::UnknownPeer { effect: DENY_ALL }),
            ]),
            row("cnp_egress_peer_exactly_one", Cnp, |v| v["spec"]["egress"][0]["to"][0]["pods"] = json!({"namespaceSelector": {}, "podSelector": {}}), vec![
                err("spec.egress[0].to[0]", one_of(EGRESS_PEER, "pods, networks")),
            ]),
            row("cnp_domain_names_accept_only_documented", Cnp, |v| v["spec"]["egress"][0]["to"][0] = json!({"domainNames": ["example.com"]}), vec![
                warn("spec.egress[0].action", inv("Deny", "domainNames peers are only supported in Accept rules")),
                warn("spec.egress[0]", P::DomainNamesUnresolved),
            ]),
            row("cnp_networks_max_25", Cnp, |v| v["spec"]["egress"][0]["to"][0]["networks"] = json!((0..26).map(|i| format!("fd00:{i}::/32")).collect::<Vec<_>>()), vec![
                err("spec.egress[0].to[0].networks", too_many(26, 25)),
            ]),
            // ---- NetworkPolicy ------------------------------------------------------
            row("np_namespace_required", Np, |v| v["metadata"] = json!({"name": "np"}), vec![
                err("metadata.namespace", P::Required),
            ]),
            row("np_namespace_dns1123_label", Np, |v| v["metadata"]["namespace"] = json!("a.b"), vec![
                err("metadata.namespace", inv("a.b", "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character")),
            ]),
            row("np_selector_key_qualified_name", Np, |v| v["spec"]["podSelector"]["matchLabels"] = json!({"/app": "db"}), vec![
                err("spec.podSelector.matchLabels[/app]", inv("/app", "prefix part must be non-empty")),
            ]),
            row("np_selector_key_name_part_max_63", Np, |v| v["spec"]["podSelector"]["matchLabels"] = json!({"example.com/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa": "x"}), vec![
                err("spec.podSelector.matchLabels[example.com/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa]", inv("example.com/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "name part must be no more than 63 characters")),
            ]),
            row("np_selector_value_max_63", Np, |v| v["spec"]["podSelector"]["matchLabels"]["app"] = json!("a".repeat(64)), vec![
                err("spec.podSelector.matchLabels[app]", inv(&"a".repeat(64), "must be no more than 63 characters")),
            ]),
            row("np_selector_operator_enum", Np, |v| v["spec"]["podSelector"] = json!({"matchExpressions": [{"key": "app", "operator": "Equals", "values": ["db"]}]}), vec![
                err("spec.podSelector.matchExpressions[0].operator", not_in("Equals", SELECTOR_OPERATORS)),
            ]),
            row("np_selector_in_requires_values", Np, |v| v["spec"]["ingress"][0]["from"][0]["podSelector"] = json!({"matchExpressions": [{"key": "app", "operator": "NotIn"}]}), vec![
                err("spec.ingress[0].from[0].podSelector.matchExpressions[0].values", P::Required),
            ]),
            row("np_selector_exists_forbids_values", Np, |v| v["spec"]["egress"][0]["to"][0]["namespaceSelector"] = json!({"matchExpressions": [{"key": "env", "operator": "DoesNotExist", "values": ["a", "b"]}]}), vec![
                err("spec.egress[0].to[0].namespaceSelector.matchExpressions[0].values", inv("a,b", "may not be specified when `operator` is 'Exists' or 'DoesNotExist'")),
            ]),
            row("np_selector_expression_values_are_label_values", Np, |v| v["spec"]["podSelector"] = json!({"matchExpressions": [{"key": "app", "operator": "In", "values": ["ok", "not ok"]}]}), vec![
                err("spec.podSelector.matchExpressions[0].values[1]", inv("not ok", "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character")),
            ]),
            row("np_policy_types_enum", Np, |v| v["spec"]["policyTypes"] = json!(["Ingress", "egress"]), vec![
                err("spec.policyTypes[1]", not_in("egress", "Ingress, Egress")),
            ]),
            row("np_policy_types_at_most_two", Np, |v| v["spec"]["policyTypes"] = json!(["Ingress", "Egress", "Ingress"]), vec![
                err("spec.policyTypes", inv("Ingress,Egress,Ingress", "may not specify more than two policyTypes")),
            ]),
            row("np_policy_types_repeat_is_accepted", Np, |v| v["spec"]["policyTypes"] = json!(["Egress", "Egress"]), vec![
                warn("spec.policyTypes[1]", inv("Egress", "listed twice; the API server accepts the repeat")),
            ]),
            row("np_port_protocol_enum", Np, |v| v["spec"]["ingress"][0]["ports"][0]["protocol"] = json!("tcp"), vec![
                err("spec.ingress[0].ports[0].protocol", not_in("tcp", "TCP, UDP, SCTP")),
            ]),
            row("np_port_number_1_to_65535", Np, |v| v["spec"]["egress"][0]["ports"][0]["port"] = json!(65536), vec![
                err("spec.egress[0].ports[0].port", range(65536, 1, 65535)),
            ]),
            row("np_port_name_iana_svc_name", Np, |v| v["spec"]["ingress"][0]["ports"][1]["port"] = json!("my--port"), vec![
                err("spec.ingress[0].ports[1].port", inv("my--port", "must not contain consecutive hyphens")),
            ]),
            row("np_port_name_max_15", Np, |v| v["spec"]["ingress"][0]["ports"][1]["port"] = json!("abcdefghijklmnop"), vec![
                err("spec.ingress[0].ports[1].port", inv("abcdefghijklmnop", "must be no more than 15 characters")),
            ]),
            row("np_port_name_needs_a_letter", Np, |v| v["spec"]["ingress"][0]["ports"][1]["port"] = json!("8080"), vec![
                err("spec.ingress[0].ports[1].port", inv("8080", "must contain at least one letter (a-z)")),
            ]),
            row("np_end_port_only_with_numeric_port", Np, |v| v["spec"]["ingress"][0]["ports"][1]["endPort"] = json!(9000), vec![
                err("spec.ingress[0].ports[1].endPort", inv("9000", "may not be specified when `port` is non-numeric")),
            ]),
            row("np_end_port_requires_port", Np, |v| v["spec"]["ingress"][0]["ports"][2] = json!({"endPort": 9000}), vec![
                err("spec.ingress[0].ports[2].endPort", inv("9000", "may not be specified when `port` is not specified")),
            ]),
            row("np_end_port_not_below_port", Np, |v| v["spec"]["ingress"][0]["ports"][2]["endPort"] = json!(7999), vec![
                err("spec.ingress[0].ports[2].endPort", inv("7999", "must be greater than or equal to `port`")),
            ]),
            row("np_end_port_max_65535", Np, |v| v["spec"]["ingress"][0]["ports"][2]["endPort"] = json!(65536), vec![
                err("spec.ingress[0].ports[2].endPort", range(65536, 1, 65535)),
            ]),
            row("np_end_port_equal_to_port_ok", Np, |v| v["spec"]["ingress"][0]["ports"][2]["endPort"] = json!(8000), vec![]),
            row("np_peer_must_specify_a_peer", Np, |v| v["spec"]["egress"][0]["to"][0] = json!({}), vec![
                err("spec.egress[0].to[0]", P::Required),
            ]),
            row("np_peer_ip_block_alone", Np, |v| v["spec"]["ingress"][0]["from"][1]["namespaceSelector"] = json!({}), vec![
                err("spec.ingress[0].from[1]", one_of("ipBlock, podSelector/namespaceSelector", "ipBlock, namespaceSelector")),
            ]),
            row("np_ip_block_cidr_required", Np, |v| v["spec"]["ingress"][0]["from"][1]["ipBlock"] = json!({"cidr": ""}), vec![
                err("spec.ingress[0].from[1].ipBlock.cidr", P::Required),
            ]),
            row("np_ip_block_cidr_valid", Np, |v| v["spec"]["ingress"][0]["from"][1]["ipBlock"]["cidr"] = json!("10.0.0.0/33"), vec![
                err("spec.ingress[0].from[1].ipBlock.cidr", inv("10.0.0.0/33", "not an IPv4 or IPv6 CIDR")),
            ]),
            row("np_ip_block_except_valid", Np, |v| v["spec"]["ingress"][0]["from"][1]["ipBlock"]["except"] = json!(["10.1.0.0"]), vec![
                err("spec.ingress[0].from[1].ipBlock.except[0]", inv("10.1.0.0", "missing /prefix length")),
            ]),
            row("np_ip_block_except_strict_subset", Np, |v| v["spec"]["ingress"][0]["from"][1]["ipBlock"]["except"] = json!(["10.0.0.0/8", "192.168.0.0/16", "fd00::/64", "10.2.0.0/16"]), vec![
                err("spec.ingress[0].from[1].ipBlock.except[0]", inv("10.0.0.0/8", "must be a strict subset of `cidr`")),
                err("spec.ingress[0].from[1].ipBlock.except[1]", inv("192.168.0.0/16", "must be a strict subset of `cidr`")),
                err("spec.ingress[0].from[1].ipBlock.except[2]", inv("fd00::/64", "must be a strict subset of `cidr`")),
            ]),
            row("np_ip_block_host_bits_masked", Np, |v| v["spec"]["ingress"][0]["from"][1]["ipBlock"] = json!({"cidr": "10.9.9.9/8", "except": ["10.1.2.3/16"]}), vec![]),
            // ---- Namespace ----------------------------------------------------------
            row("ns_name_dns1123_label", Ns, |v| v["metadata"] = json!({"name": "a.b"}), vec![
                err("metadata.name", inv("a.b", "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character")),
            ]),
            row("ns_name_max_63", Ns, |v| v["metadata"] = json!({"name": "n".repeat(64)}), vec![
                err("metadata.name", inv(&"n".repeat(64), "must be no more than 63 characters")),
            ]),
            row("ns_metadata_name_label_overwritten", Ns, |v| v["metadata"]["labels"]["kubernetes.io/metadata.name"] = json!("dev"), vec![
                warn("metadata.labels[kubernetes.io/metadata.name]", inv("dev", "differs from the name \"prod\"; the API server overwrites it with the name")),
            ]),
            row("ns_label_value", Ns, |v| v["metadata"]["labels"]["env"] = json!("-prod"), vec![
                err("metadata.labels[env]", inv("-prod", "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character")),
            ]),
            // ---- Pod ----------------------------------------------------------------
            row("pod_namespace_required", Pod, |v| v["metadata"]["namespace"] = json!(""), vec![
                err("metadata.namespace", P::Required),
            ]),
            row("pod_ip_valid", Pod, |v| {
                v["status"]["podIP"] = json!("10.0.0.300");
                v["status"]["podIPs"][0]["ip"] = json!("10.0.0.300");
            }, vec![
                err("status.podIP", inv("10.0.0.300", "must be a valid IP address")),
                err("status.podIPs[0].ip", inv("10.0.0.300", "must be a valid IP address")),
            ]),
            row("pod_ips_valid", Pod, |v| v["status"]["podIPs"][1]["ip"] = json!("fd00::5%eth0"), vec![
                err("status.podIPs[1].ip", inv("fd00::5%eth0", "must be a valid IP address")),
            ]),
            row("pod_ip_no_leading_zeros", Pod, |v| {
                v["status"]["podIP"] = json!("10.0.0.05");
                v["status"]["podIPs"][0]["ip"] = json!("10.0.0.05");
            }, vec![
                err("status.podIP", inv("10.0.0.05", "must be a valid IP address")),
                err("status.podIPs[0].ip", inv("10.0.0.05", "must be a valid IP address")),
            ]),
            row("pod_ips_no_ipv4_mapped", Pod, |v| v["status"]["podIPs"][1]["ip"] = json!("::ffff:10.0.0.6"), vec![
                err("status.podIPs[1].ip", inv("::ffff:10.0.0.6", "must not be an IPv4-mapped IPv6 address")),
            ]),
            row("pod_ips_one_per_family", Pod, |v| v["status"]["podIPs"][1]["ip"] = json!("10.0.0.6"), vec![
                err("status.podIPs", inv("10.0.0.5,10.0.0.6", "may specify no more than one IP for each IP family")),
            ]),
            row("pod_ips_no_duplicates", Pod, |v| v["status"]["podIPs"][1]["ip"] = json!("10.0.0.5"), vec![
                err("status.podIPs", inv("10.0.0.5,10.0.0.5", "may specify no more than one IP for each IP family")),
                err("status.podIPs[1].ip", inv("10.0.0.5", "duplicate value")),
            ]),
            row("pod_ips_at_most_two", Pod, |v| v["status"]["podIPs"] = json!([{"ip": "10.0.0.5"}, {"ip": "fd00::5"}, {"ip": "fd00::6"}]), vec![
                err("status.podIPs", inv("10.0.0.5,fd00::5,fd00::6", "may specify no more than one IP for each IP family")),
            ]),
            row("pod_ip_equals_first_pod_ips", Pod, |v| v["status"]["podIP"] = json!("10.0.0.7"), vec![
                warn("status.podIP", inv("10.0.0.7", "differs from status.podIPs[0] (\"10.0.0.5\"); the API server keeps podIP and replaces podIPs with [podIP]")),
            ]),
            row("pod_container_port_1_to_65535", Pod, |v| v["spec"]["containers"][0]["ports"][0]["containerPort"] = json!(70000), vec![
                err("spec.containers[0].ports[0].containerPort", range(70000, 1, 65535)),
            ]),
            row("pod_container_port_required", Pod, |v| v["spec"]["containers"][0]["ports"][1]["containerPort"] = json!(0), vec![
                err("spec.containers[0].ports[1].containerPort", P::Required),
            ]),
            row("pod_host_port_1_to_65535", Pod, |v| v["spec"]["containers"][0]["ports"][1]["hostPort"] = json!(-1), vec![
                err("spec.containers[0].ports[1].hostPort", range(-1, 1, 65535)),
            ]),
            row("pod_container_port_protocol_enum", Pod, |v| v["spec"]["containers"][0]["ports"][0]["protocol"] = json!("ICMP"), vec![
                err("spec.containers[0].ports[0].protocol", not_in("ICMP", "TCP, UDP, SCTP")),
            ]),
            row("pod_container_port_name_iana_svc_name", Pod, |v| v["spec"]["containers"][0]["ports"][0]["name"] = json!("-pg"), vec![
                err("spec.containers[0].ports[0].name", inv("-pg", "must not begin or end with a hyphen")),
            ]),
            row("pod_container_port_name_unique", Pod, |v| v["spec"]["containers"][0]["ports"][1]["name"] = json!("postgres"), vec![
                err("spec.containers[0].ports[1].name", inv("postgres", "duplicate port name in this container")),
            ]),
            row("pod_init_container_ports", Pod, |v| v["spec"]["initContainers"] = json!([{"name": "sidecar", "ports": [{"containerPort": 0}]}]), vec![
                err("spec.initContainers[0].ports[0].containerPort", P::Required),
            ]),
            // ---- Node ---------------------------------------------------------------
            row("node_name_dns1123_subdomain", Node, |v| v["metadata"]["name"] = json!("node_1"), vec![
                err("metadata.name", inv("node_1", "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character")),
            ]),
            row("node_internal_ip_is_ip", Node, |v| v["status"]["addresses"][0]["address"] = json!("node-1.example"), vec![
                warn("status.addresses[0].address", inv("node-1.example", "must be a valid IP address; the address is ignored")),
            ]),
            row("node_external_ip_is_ip", Node, |v| v["status"]["addresses"][1]["address"] = json!("2001:db8::zz"), vec![
                warn("status.addresses[1].address", inv("2001:db8::zz", "must be a valid IP address; the address is ignored")),
            ]),
            row("node_dns_addresses_ignored", Node, |v| v["status"]["addresses"] = json!([
                {"type": "Hostname", "address": "not an ip"},
                {"type": "InternalDNS", "address": "node-1.internal"},
                {"type": "ExternalDNS", "address": "node-1.example.com"}
            ]), vec![]),
        ]
    }

    /// The `_each_rule` variants report what the plain validators report and visit every
    /// rule once, ingress rules then egress rules, on every admin row of the table.
    #[test]
    fn each_rule_variants_visit_every_rule_in_order() {
        for Row { rule, target, edit, .. } in rows() {
            let mut v = target.base();
            edit(&mut v);
            let count = |dir: &str| v["spec"][dir].as_array().map_or(0, Vec::len);
            let want_visits: Vec<(Direction, usize)> = (0..count("ingress"))
                .map(|i| (Direction::Ingress, i))
                .chain((0..count("egress")).map(|i| (Direction::Egress, i)))
                .collect();
            let mut visits = Vec::new();
            let mut visit = |d: Direction, i: usize| visits.push((d, i));
            let mut out = Vec::new();
            match target {
                Target::Anp => admin_network_policy_each_rule(&de(v.clone()), &mut out, &mut visit),
                Target::Banp => {
                    baseline_admin_network_policy_each_rule(&de(v.clone()), &mut out, &mut visit)
                }
                Target::Cnp => {
                    cluster_network_policy_each_rule(&de(v.clone()), &mut out, &mut visit)
                }
                _ => continue,
            }
            assert_eq!(out, target.run(v), "{rule}: problems differ");
            assert_eq!(visits, want_visits, "{rule}: visits");
        }
    }

    #[test]
    fn each_rule_reports_exactly_its_problem() {
        let mut failures = Vec::new();
        for Row { rule, target, edit, want } in rows() {
            let mut v = target.base();
            edit(&mut v);
            let got: Vec<(Severity, String, ProblemKind)> =
                target.run(v).into_iter().map(|p| (p.severity, p.field, p.kind)).collect();
            let want: Vec<(Severity, String, ProblemKind)> =
                want.into_iter().map(|(s, f, k)| (s, f.to_owned(), k)).collect();
            if got != want {
                failures.push(format!("{rule} ({target:?}):\n   got  {got:?}\n   want {want:?}"));
            }
        }
        assert!(failures.is_empty(), "{} rule(s) failed:\n{}", failures.len(), failures.join("\n"));
    }

    #[test]
    fn rule_names_are_unique() {
        let mut seen = BTreeSet::new();
        for r in rows() {
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
        ] {
            let problems = target.run(target.base());
            assert!(problems.is_empty(), "{target:?}: {problems:#?}");
        }
    }

    #[test]
    fn minimal_network_policy_without_spec_is_valid() {
        let problems = Target::Np.run(json!({"metadata": {"name": "np", "namespace": "default"}}));
        assert!(problems.is_empty(), "{problems:#?}");
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

    #[test]
    fn public_label_selector_reports_errors() {
        let sel: LabelSelector =
            de(json!({"matchExpressions": [{"key": "a", "operator": "Gt", "values": ["1"]}]}));
        let object = ObjectRef::cluster(Kind::Namespace, "x");
        let mut out = Vec::new();
        label_selector(&sel, &object, "spec.sel", &mut out);
        assert_eq!(
            out,
            vec![Problem::error(
                &object,
                "spec.sel.matchExpressions[0].operator",
                not_in("Gt", SELECTOR_OPERATORS)
            )]
        );
    }

    #[test]
    fn domain_name_pattern_matches_upstream_regex() {
        for ok in [
            "kubernetes.io",
            "blog.kubernetes.io",
            "*.kubernetes.io",
            "kubernetes.io.",
            "a.b",
            "x_y.example.com",
            "1.2",
            // Upstream's `[a-zA-z0-9]` admits these as a label's first character.
            "_sip.example.com",
            "^a.example.com",
        ] {
            assert!(is_domain_name(ok), "{ok} should match");
        }
        for bad in [
            "",
            "localhost",
            "*.com.",
            "*",
            "*.",
            ".example.com",
            "example..com",
            "example.com..",
            "*.*.example.com",
            "-a.example.com",
            "a-.example.com",
            "a.example.com-",
            "www.*.example.com",
            "exa mple.com",
            "exämple.com",
            "a_.example.com",
        ] {
            assert!(!is_domain_name(bad), "{bad} should not match");
        }
    }

    #[test]
    fn qualified_names_and_label_values() {
        for ok in ["app", "app.kubernetes.io/name", "A_b.c-D", "example.com/X", "a"] {
            assert!(qualified_name_errors(ok).is_empty(), "{ok}");
        }
        for bad in ["", "/a", "a/", "a/b/c", "-a", "a_", "Example.com/a", "a b", &"a".repeat(64)] {
            assert!(!qualified_name_errors(bad).is_empty(), "{bad}");
        }
        for ok in ["", "a", "a.b_c-d", &"a".repeat(63)] {
            assert!(label_value_errors(ok).is_empty(), "{ok}");
        }
        for bad in ["-", "a-", "a b", &"a".repeat(64)] {
            assert!(!label_value_errors(bad).is_empty(), "{bad}");
        }
    }

    proptest::proptest! {
        /// No input string makes a syntax helper panic (byte slicing, empty strings,
        /// multi-byte characters).
        #[test]
        fn syntax_helpers_never_panic(s in "\\PC{0,80}") {
            let _ = is_domain_name(&s);
            let _ = qualified_name_errors(&s);
            let _ = label_value_errors(&s);
            let _ = port_name_errors(&s);
            let _ = dns1123_label_errors(&s);
            let _ = dns1123_subdomain_errors(&s);
            let _ = parse_ip(&s);
        }

        /// Arbitrary labels, selectors and names in a NetworkPolicy never panic the
        /// validator.
        #[test]
        fn network_policy_validation_never_panics(
            name in "\\PC{0,20}",
            key in "\\PC{0,20}",
            value in "\\PC{0,20}",
            op in "\\PC{0,8}",
            cidr in "[0-9a-f:./]{0,20}",
            port in proptest::prelude::any::<i32>(),
            end in proptest::prelude::any::<i32>(),
        ) {
            let v = json!({
                "metadata": {"name": name, "namespace": name, "labels": {key.clone(): value.clone()}},
                "spec": {
                    "podSelector": {"matchExpressions": [{"key": key, "operator": op, "values": [value]}]},
                    "ingress": [{
                        "from": [{"ipBlock": {"cidr": cidr, "except": [cidr]}}],
                        "ports": [{"port": port, "endPort": end}]
                    }]
                }
            });
            let _ = Target::Np.run(v);
        }
    }

    proptest::proptest! {
        /// The fast checks valid input takes agree with the full checks that report
        /// problems: the same inputs pass.
        #[test]
        fn fast_checks_agree_with_full_checks(
            key in "[a-zA-Z0-9./_-]{0,6}(/[a-zA-Z0-9._-]{0,4})?",
            value in "[a-zA-Z0-9._ -]{0,5}",
            long in 60usize..70,
            op in proptest::sample::select(vec!["In", "NotIn", "Exists", "DoesNotExist", "Gt", ""]),
            values in proptest::collection::vec("[a-z0-9._-]{0,3}", 0..3),
            labels in proptest::collection::btree_map("[a-z0-9/_.-]{0,4}", "[a-z0-9_.-]{0,3}", 0..3),
        ) {
            let long_name = "a".repeat(long);
            for k in [key.as_str(), value.as_str(), long_name.as_str()] {
                proptest::prop_assert_eq!(is_qualified_name(k), qualified_name_messages(k).is_empty(), "{}", k);
                proptest::prop_assert_eq!(is_label_value(k), label_value_errors(k).is_empty(), "{}", k);
            }
            let sel: LabelSelector = de(json!({
                "matchLabels": labels,
                "matchExpressions": [{"key": key, "operator": op, "values": values}],
            }));
            let object = ObjectRef::cluster(Kind::Namespace, "x");
            let mut out = Vec::new();
            selector_problems(&mut Sink { object: Object::Given(&object), out: &mut out }, (&sel).into(), &Path::root("p"), Severity::Error);
            proptest::prop_assert_eq!(is_valid_selector((&sel).into()), out.is_empty(), "{:?}", sel);
            // NetworkPolicy's k8s-openapi selector from the same JSON: the same problems.
            let map: k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector =
                de(serde_json::to_value(&sel).unwrap());
            let mut from_map = Vec::new();
            selector_problems(&mut Sink { object: Object::Given(&object), out: &mut from_map }, (&map).into(), &Path::root("p"), Severity::Error);
            proptest::prop_assert_eq!(out, from_map);
        }
    }
}
