//! Problems found in input objects: validation errors, fail-closed notes and warnings.
//!
//! Every [`Problem`] names the object ([`ObjectRef`]: kind, namespace, name) and the field
//! path inside it (`spec.egress[2].to[0].networks[1]`), so an operator can find it without
//! guessing. The engine never panics on bad input: it reports a `Problem` and, for errors,
//! leaves the object out of the compiled snapshot (the caller decides whether to keep the
//! last good version of it; see `docs/architecture.md`, "Invalid input").

use std::fmt;

/// The Kubernetes kinds the engine reads.
///
/// Source: `networking.k8s.io/v1`, `v1` core, `policy.networking.k8s.io` `v1alpha1` /
/// `v1alpha2` (network-policy-api), and Antrea's `crd.antrea.io/v1beta1`. Two Antrea kinds
/// share their `kind` with upstream ones; [`Kind::api_group`] tells them apart, and their
/// `Display` names the group (`ClusterNetworkPolicy.crd.antrea.io`, kubectl's spelling).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// `v1` Namespace.
    Namespace,
    /// `v1` Node.
    Node,
    /// `v1` Pod.
    Pod,
    /// `networking.k8s.io/v1` NetworkPolicy.
    NetworkPolicy,
    /// `policy.networking.k8s.io/v1alpha1` AdminNetworkPolicy.
    AdminNetworkPolicy,
    /// `policy.networking.k8s.io/v1alpha1` BaselineAdminNetworkPolicy.
    BaselineAdminNetworkPolicy,
    /// `policy.networking.k8s.io/v1alpha2` ClusterNetworkPolicy.
    ClusterNetworkPolicy,
    /// `crd.antrea.io/v1beta1` Tier.
    AntreaTier,
    /// `crd.antrea.io/v1beta1` ClusterNetworkPolicy (ACNP).
    AntreaClusterNetworkPolicy,
    /// `crd.antrea.io/v1beta1` NetworkPolicy (ANNP), namespaced.
    AntreaNetworkPolicy,
}

impl Kind {
    /// The kind as spelled in a manifest's `kind` field.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Namespace => "Namespace",
            Kind::Node => "Node",
            Kind::Pod => "Pod",
            Kind::NetworkPolicy => "NetworkPolicy",
            Kind::AdminNetworkPolicy => "AdminNetworkPolicy",
            Kind::BaselineAdminNetworkPolicy => "BaselineAdminNetworkPolicy",
            Kind::ClusterNetworkPolicy => "ClusterNetworkPolicy",
            Kind::AntreaTier => "Tier",
            Kind::AntreaClusterNetworkPolicy => "ClusterNetworkPolicy",
            Kind::AntreaNetworkPolicy => "NetworkPolicy",
        }
    }

    /// The kind's `apiVersion` as tierproxy reads it (`v1`, `networking.k8s.io/v1`,
    /// `policy.networking.k8s.io/v1alpha1` or `v1alpha2`, `crd.antrea.io/v1beta1`).
    pub fn api_version(self) -> &'static str {
        match self {
            Kind::Namespace | Kind::Node | Kind::Pod => "v1",
            Kind::NetworkPolicy => "networking.k8s.io/v1",
            Kind::AdminNetworkPolicy | Kind::BaselineAdminNetworkPolicy => {
                "policy.networking.k8s.io/v1alpha1"
            }
            Kind::ClusterNetworkPolicy => "policy.networking.k8s.io/v1alpha2",
            Kind::AntreaTier | Kind::AntreaClusterNetworkPolicy | Kind::AntreaNetworkPolicy => {
                "crd.antrea.io/v1beta1"
            }
        }
    }

    /// The kind's API group (`""` for core `v1`).
    pub fn api_group(self) -> &'static str {
        match self {
            Kind::Namespace | Kind::Node | Kind::Pod => "",
            Kind::NetworkPolicy => "networking.k8s.io",
            Kind::AdminNetworkPolicy
            | Kind::BaselineAdminNetworkPolicy
            | Kind::ClusterNetworkPolicy => "policy.networking.k8s.io",
            Kind::AntreaTier | Kind::AntreaClusterNetworkPolicy | Kind::AntreaNetworkPolicy => {
                "crd.antrea.io"
            }
        }
    }
}

impl fmt::Display for Kind {
    /// The kind as a manifest spells it; the Antrea kinds as `Kind.crd.antrea.io`, so that
    /// an Antrea ClusterNetworkPolicy is never taken for the upstream one.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Kind::AntreaTier | Kind::AntreaClusterNetworkPolicy | Kind::AntreaNetworkPolicy => {
                write!(f, "{}.{}", self.as_str(), self.api_group())
            }
            _ => f.write_str(self.as_str()),
        }
    }
}

/// Names one API object: kind, namespace (for namespaced kinds) and name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectRef {
    /// The object's kind.
    pub kind: Kind,
    /// `metadata.namespace`; `None` for cluster-scoped kinds.
    pub namespace: Option<String>,
    /// `metadata.name`.
    pub name: String,
}

impl ObjectRef {
    /// A cluster-scoped object.
    pub fn cluster(kind: Kind, name: impl Into<String>) -> Self {
        ObjectRef { kind, namespace: None, name: name.into() }
    }

    /// A namespaced object.
    pub fn namespaced(kind: Kind, namespace: impl Into<String>, name: impl Into<String>) -> Self {
        ObjectRef { kind, namespace: Some(namespace.into()), name: name.into() }
    }
}

impl fmt::Display for ObjectRef {
    /// `Kind ns/name` or `Kind name`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.namespace {
            Some(ns) => write!(f, "{} {}/{}", self.kind, ns, self.name),
            None => write!(f, "{} {}", self.kind, self.name),
        }
    }
}

/// How serious a [`Problem`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Severity {
    /// The API server would have rejected the object; it is left out of the snapshot.
    Error,
    /// The object is used, but part of it behaves in a way the operator should know of
    /// (an unknown field, a fail-closed peer, a rule that can never match).
    Warning,
}

/// What is wrong, with the values that make it wrong. Messages never repeat the field path
/// or the object: [`Problem`]'s `Display` adds those.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProblemKind {
    /// A required field is missing or empty.
    #[error("required field is missing")]
    Required,
    /// A number outside the range the CRD schema allows.
    #[error("{value} is out of range {min}..={max}")]
    OutOfRange {
        /// The value given.
        value: i64,
        /// Smallest allowed value.
        min: i64,
        /// Largest allowed value.
        max: i64,
    },
    /// A list longer than the schema's `maxItems`.
    #[error("{len} items exceed the limit of {max}")]
    TooManyItems {
        /// Items given.
        len: usize,
        /// The schema's `maxItems`.
        max: usize,
    },
    /// A list shorter than the schema's `minItems`.
    #[error("{len} items are fewer than the minimum of {min}")]
    TooFewItems {
        /// Items given.
        len: usize,
        /// The schema's `minItems`.
        min: usize,
    },
    /// A string longer than the schema's `maxLength`.
    #[error("length {len} exceeds the limit of {max}")]
    TooLong {
        /// Characters given.
        len: usize,
        /// The schema's `maxLength`.
        max: usize,
    },
    /// A union (`MinProperties=1`, `MaxProperties=1`) with more than one member set.
    #[error("exactly one of {fields} must be set, found {found}")]
    NotExactlyOne {
        /// The union's members, comma separated.
        fields: &'static str,
        /// The members that were set, comma separated.
        found: String,
    },
    /// A value outside the schema's enum.
    #[error("{value:?} is not one of {allowed}")]
    NotInEnum {
        /// The value given.
        value: String,
        /// The allowed values, comma separated.
        allowed: &'static str,
    },
    /// A string that does not have the required syntax.
    #[error("{value:?} is invalid: {reason}")]
    Invalid {
        /// The value given.
        value: String,
        /// What the syntax requires.
        reason: String,
    },
    /// The object does not decode: a field has the wrong type (a string where a number
    /// belongs, a list where an object belongs) or a required field is missing.
    #[error("cannot decode: {reason}")]
    Decode {
        /// The decoder's message.
        reason: String,
    },
    /// A field this version of tierproxy does not know; it is ignored.
    #[error("unknown field, ignored (a newer API version may define it)")]
    UnknownField,
    /// A peer none of whose known fields is set: an unknown peer kind. Per the API it fails
    /// closed: it matches nothing in an Allow/Accept rule, and turns a Deny/Pass rule into
    /// "deny all" for the traffic it applies to.
    #[error("peer has no field this engine knows; the rule fails closed ({effect})")]
    UnknownPeer {
        /// What the rule does as a result.
        effect: &'static str,
    },
    /// `domainNames` peers cannot be resolved by this engine; Allow rules holding them match
    /// nothing for those peers (fail closed).
    #[error("domainNames peers are not resolved by this engine; they match no traffic")]
    DomainNamesUnresolved,
    /// A port reference that can never match.
    #[error("{reason}")]
    NeverMatches {
        /// Why.
        reason: String,
    },
    /// Two Antrea policies in one Tier with the same priority whose subjects overlap and
    /// that both have a rule at one index of one direction: their rules interleave by
    /// index, and at that index the order is undefined in Antrea (docs "Notes and
    /// constraints"); tierproxy breaks the tie by name (`shared/reference/antrea-model.md`
    /// §3). Reported on each policy, naming the other.
    #[error(
        "tier {tier} priority {priority} is shared with {other}, and their subjects overlap on {overlap} pod(s): their rules interleave by index, and at {direction}[{index}] both have one; evaluated in name order, {} first",
        if *.first { "this policy's" } else { "the other's" }
    )]
    RuleTie {
        /// The Tier's name.
        tier: String,
        /// The shared priority, as written.
        priority: String,
        /// The other policy.
        other: ObjectRef,
        /// How many pods both subjects select.
        overlap: usize,
        /// `ingress` or `egress`.
        direction: &'static str,
        /// The first rule index both policies have in that direction.
        index: u32,
        /// Whether this policy's rule is evaluated before the other's.
        first: bool,
    },
    /// Two admin-tier policies with the same priority whose subjects overlap (KEP-2091,
    /// "Risks and Mitigations": the behaviour is undefined upstream; tierproxy orders them
    /// by name).
    /// Reported on each policy of the tie, naming the other.
    #[error(
        "priority {priority} is shared with {other}, and their subjects overlap on {overlap} pod(s); evaluated in name order, {} first",
        if *.first { "this policy" } else { "the other" }
    )]
    PriorityConflict {
        /// The shared priority.
        priority: i32,
        /// The other policy.
        other: ObjectRef,
        /// How many pods both subjects select.
        overlap: usize,
        /// Whether this policy is evaluated before `other`.
        first: bool,
    },
    /// An object with the same kind, namespace and name was given twice; the later wins.
    #[error("duplicate object; the later definition replaces the earlier one")]
    Duplicate,
    /// A combination of fields or values an admission webhook refuses (Antrea's
    /// `validate.go`), in its words.
    #[error("{reason}")]
    Forbidden {
        /// What is refused and why.
        reason: String,
    },
    /// A field this engine decodes but does not evaluate (an Antrea feature outside
    /// tierproxy's scope: ClusterGroup/Group, serviceAccount, externalEntitySelector,
    /// toServices, l7Protocols, sourcePort, fqdn, scope ClusterSet, Node and Service
    /// appliedTo).
    #[error("{feature} is not supported by tierproxy")]
    Unsupported {
        /// What is not supported.
        feature: &'static str,
    },
    /// A field of the kind's Go type that the kind's CRD schema does not have at this
    /// position (`namespaces` in an Antrea NetworkPolicy, `to` in an ingress rule).
    #[error(
        "not in the {schema} schema here: the API server prunes it, or refuses the object under strict field validation"
    )]
    OutsideSchema {
        /// The schema (`Antrea ClusterNetworkPolicy ingress rule`).
        schema: &'static str,
    },
    /// An IP address claimed by more than one object.
    #[error("address {addr} is also claimed by {other}; it resolves to the first")]
    AddressConflict {
        /// The address.
        addr: std::net::IpAddr,
        /// The other claimant.
        other: ObjectRef,
    },
}

/// One problem in one object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The object the problem is in.
    pub object: ObjectRef,
    /// Field path inside the object, e.g. `spec.ingress[0].from[1].pods.podSelector`;
    /// empty for the object as a whole.
    pub field: String,
    /// Error (object rejected) or warning (object used).
    pub severity: Severity,
    /// What is wrong.
    pub kind: ProblemKind,
}

impl Problem {
    /// An error: the object is left out of the snapshot.
    pub fn error(object: &ObjectRef, field: impl Into<String>, kind: ProblemKind) -> Self {
        Problem { object: object.clone(), field: field.into(), severity: Severity::Error, kind }
    }

    /// A warning: the object is used.
    pub fn warning(object: &ObjectRef, field: impl Into<String>, kind: ProblemKind) -> Self {
        Problem { object: object.clone(), field: field.into(), severity: Severity::Warning, kind }
    }

    /// `true` for [`Severity::Error`].
    pub fn is_error(&self) -> bool {
        self.severity == Severity::Error
    }
}

impl fmt::Display for Problem {
    /// `error: AdminNetworkPolicy deny-all: spec.priority: 1001 is out of range 0..=1000`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sev = match self.severity {
            Severity::Error => "error",
            Severity::Warning => "warning",
        };
        if self.field.is_empty() {
            write!(f, "{sev}: {}: {}", self.object, self.kind)
        } else {
            write!(f, "{sev}: {}: {}: {}", self.object, self.field, self.kind)
        }
    }
}
