//! Serde types of the policy APIs tierproxy reads.
//!
//! - [`v1alpha1`]: `policy.networking.k8s.io/v1alpha1` AdminNetworkPolicy and
//!   BaselineAdminNetworkPolicy, as network-policy-api `release-0.1` (v0.1.7/v0.1.8) defines
//!   them, experimental fields included.
//! - [`v1alpha2`]: `policy.networking.k8s.io/v1alpha2` ClusterNetworkPolicy
//!   (network-policy-api v0.2.0+).
//! - [`antrea`]: Antrea's `crd.antrea.io/v1beta1` Tier, ClusterNetworkPolicy and
//!   NetworkPolicy (read from manifests, validated and compiled into Antrea's global order).
//! - NetworkPolicy, Namespace, Pod and Node come from `k8s-openapi` (re-exported here).
//!
//! These types mirror the wire format field for field and carry no defaults beyond what
//! serde needs; defaulting and validation (the CRD schemas' `Minimum`, `MaxItems`,
//! `MinProperties`/`MaxProperties` unions and CEL rules) live in [`crate::policy::validate`].
//! The same limits and rules are also written on the types as `schemars` attributes, for
//! the JSON schema only: they shape the CRDs [`crate::crds`] builds (`tierproxy crds`) and
//! change nothing in decoding.
//! A field these types do not know is ignored by serde and reported as a warning by the
//! manifest loader, because newer upstream versions add fields.

pub mod antrea;
pub mod v1alpha1;
pub mod v1alpha2;

pub use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
pub use k8s_openapi::api::networking::v1::NetworkPolicy;
pub use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelectorRequirement};

use super::labels::{Labels, LabelsRef};

/// `metav1.LabelSelector` as the policy CRDs hold it: the same wire format and schema as
/// k8s-openapi's `LabelSelector` (which NetworkPolicy keeps), with `matchLabels` stored
/// as compact [`Labels`] (see [`crate::policy::labels`] for why: a large AdminNetworkPolicy
/// set holds hundreds of thousands of selectors).
///
/// Source: apimachinery `LabelSelector`: "The result of matchLabels and matchExpressions are
/// ANDed. An empty label selector matches all objects. A null label selector matches no
/// objects."
#[derive(serde::Serialize, serde::Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LabelSelector {
    /// Requirements, ANDed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub match_expressions: Option<Vec<LabelSelectorRequirement>>,
    /// `{key: value}` pairs, each equivalent to an `In` requirement with one value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub match_labels: Option<Labels>,
}

/// The CRDs' schema is apimachinery's, exactly as k8s-openapi states it.
impl schemars::JsonSchema for LabelSelector {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        <k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector as schemars::JsonSchema>::schema_name()
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        <k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector as schemars::JsonSchema>::json_schema(generator)
    }
}

/// A borrowed label selector of either kind: the policy CRDs' [`LabelSelector`] or
/// NetworkPolicy's k8s-openapi one. What [`crate::policy::selector::Selector::compile`],
/// validation and the compiler read.
#[derive(Debug, Clone, Copy)]
pub struct SelectorRef<'a> {
    /// `matchLabels`; `None` when absent.
    pub match_labels: Option<LabelsRef<'a>>,
    /// `matchExpressions`; `None` when absent.
    pub match_expressions: Option<&'a [LabelSelectorRequirement]>,
}

impl<'a> From<&'a LabelSelector> for SelectorRef<'a> {
    fn from(s: &'a LabelSelector) -> Self {
        SelectorRef {
            match_labels: s.match_labels.as_ref().map(LabelsRef::Compact),
            match_expressions: s.match_expressions.as_deref(),
        }
    }
}

impl<'a> From<&'a k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector>
    for SelectorRef<'a>
{
    fn from(s: &'a k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector) -> Self {
        SelectorRef {
            match_labels: s.match_labels.as_ref().map(LabelsRef::Map),
            match_expressions: s.match_expressions.as_deref(),
        }
    }
}

/// The API group of AdminNetworkPolicy, BaselineAdminNetworkPolicy and
/// ClusterNetworkPolicy.
pub const POLICY_GROUP: &str = "policy.networking.k8s.io";

/// A pod selection across namespaces: pods that match `podSelector` in namespaces that
/// match `namespaceSelector` (AND).
///
/// Source: network-policy-api `NamespacedPod` (v1alpha1 and v1alpha2 define it alike).
#[derive(
    serde::Serialize, serde::Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub struct NamespacedPod {
    /// Selects namespaces; empty selects all namespaces. Optional in v1alpha2 ("if empty,
    /// it selects all Namespaces"), so an absent one decodes as empty.
    #[serde(default)]
    pub namespace_selector: LabelSelector,
    /// Selects pods within the selected namespaces; empty selects all pods.
    pub pod_selector: LabelSelector,
}

// ---------------------------------------------------------------------------------------
// Schema transforms for the CRDs (`tierproxy crds`)
//
// They shape only the JSON schema the `JsonSchema` derives produce (and so the CRDs that
// `kube::CustomResourceExt::crd()` builds from them); serde and `policy::validate`, which
// checks the same limits on manifests, do not use them.
// ---------------------------------------------------------------------------------------

/// The `DomainName` pattern of network-policy-api (v1alpha1 and v1alpha2), which
/// [`crate::policy::validate::is_domain_name`] implements.
pub const DOMAIN_NAME_PATTERN: &str = r"^(\*\.)?([a-zA-z0-9]([-a-zA-Z0-9_]*[a-zA-Z0-9])?\.)+[a-zA-z0-9]([-a-zA-Z0-9_]*[a-zA-Z0-9])?\.?$";

/// Appends one CEL rule (`x-kubernetes-validations`, apiextensions `ValidationRule`) to a
/// schema.
fn add_cel_rule(schema: &mut schemars::Schema, rule: &str, message: &str) {
    let entry = serde_json::json!({"rule": rule, "message": message});
    match schema.get_mut("x-kubernetes-validations").and_then(|v| v.as_array_mut()) {
        Some(rules) => rules.push(entry),
        None => {
            schema.insert("x-kubernetes-validations".to_owned(), serde_json::json!([entry]));
        }
    }
}

/// `networks` (`[]CIDR`): `+listType=set`, `MinItems=1`, `MaxItems=25`; each item
/// `MaxLength=43` with the CEL rule `isCIDR(self)` ("Invalid CIDR format provided";
/// `isCIDR` needs Kubernetes 1.31+).
fn cidr_list(schema: &mut schemars::Schema) {
    schema.insert("minItems".to_owned(), 1.into());
    schema.insert("maxItems".to_owned(), 25.into());
    schema.insert("x-kubernetes-list-type".to_owned(), "set".into());
    if let Some(item) = schema.get_mut("items").and_then(|i| i.as_object_mut()) {
        item.insert("maxLength".to_owned(), 43.into());
        item.insert(
            "x-kubernetes-validations".to_owned(),
            serde_json::json!([{"rule": "isCIDR(self)", "message": "Invalid CIDR format provided"}]),
        );
    }
}

/// `domainNames` (`[]DomainName`): `+listType=set`, `MinItems=1`, `MaxItems=25`; each item
/// matches [`DOMAIN_NAME_PATTERN`].
fn domain_name_list(schema: &mut schemars::Schema) {
    schema.insert("minItems".to_owned(), 1.into());
    schema.insert("maxItems".to_owned(), 25.into());
    schema.insert("x-kubernetes-list-type".to_owned(), "set".into());
    if let Some(item) = schema.get_mut("items").and_then(|i| i.as_object_mut()) {
        item.insert("pattern".to_owned(), DOMAIN_NAME_PATTERN.into());
    }
}

/// `status.conditions`: `+listType=map`, `+listMapKey=type` (one condition per type).
fn condition_list(schema: &mut schemars::Schema) {
    schema.insert("x-kubernetes-list-type".to_owned(), "map".into());
    schema.insert("x-kubernetes-list-map-keys".to_owned(), serde_json::json!(["type"]));
}

/// The CEL rule of an AdminNetworkPolicy egress rule: named ports cannot go with peers
/// that have none (networks, nodes, domainNames).
fn anp_egress_rule_cel(schema: &mut schemars::Schema) {
    add_cel_rule(
        schema,
        "!(self.to.exists(peer, has(peer.networks) || has(peer.nodes) || has(peer.domainNames)) \
         && has(self.ports) && self.ports.exists(port, has(port.namedPort)))",
        "networks/nodes/domainNames peer cannot be set with namedPorts since there are no \
         namedPorts for networks/nodes/domainNames",
    );
}

/// The same rule for a BaselineAdminNetworkPolicy egress rule (no domainNames peers).
fn banp_egress_rule_cel(schema: &mut schemars::Schema) {
    add_cel_rule(
        schema,
        "!(self.to.exists(peer, has(peer.networks) || has(peer.nodes)) && has(self.ports) && \
         self.ports.exists(port, has(port.namedPort)))",
        "networks/nodes peer cannot be set with namedPorts since there are no namedPorts for \
         networks/nodes",
    );
}

/// The same rule for a ClusterNetworkPolicy egress rule, on `destinationNamedPort`.
fn cnp_egress_rule_cel(schema: &mut schemars::Schema) {
    add_cel_rule(
        schema,
        "!(self.to.exists(peer, has(peer.networks) || has(peer.nodes) || has(peer.domainNames)) \
         && has(self.protocols) && self.protocols.exists(protocol, \
         has(protocol.destinationNamedPort)))",
        "networks/nodes/domainNames peer cannot be set with namedPorts since there are no \
         namedPorts for networks/nodes/domainNames",
    );
}

/// v1alpha2 `PortRange`: `self.start < self.end` ("Start port must be less than End port").
fn port_range_cel(schema: &mut schemars::Schema) {
    add_cel_rule(schema, "self.start < self.end", "Start port must be less than End port");
}
