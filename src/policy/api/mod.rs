//! Serde types of the policy APIs tierproxy reads.
//!
//! - [`v1alpha1`]: `policy.networking.k8s.io/v1alpha1` AdminNetworkPolicy and
//!   BaselineAdminNetworkPolicy, as network-policy-api `release-0.1` (v0.1.7/v0.1.8) defines
//!   them, experimental fields included.
//! - [`v1alpha2`]: `policy.networking.k8s.io/v1alpha2` ClusterNetworkPolicy
//!   (network-policy-api v0.2.0+).
//! - NetworkPolicy, Namespace, Pod and Node come from `k8s-openapi` (re-exported here).
//!
//! These types mirror the wire format field for field and carry no defaults beyond what
//! serde needs; defaulting and validation (the CRD schemas' `Minimum`, `MaxItems`,
//! `MinProperties`/`MaxProperties` unions and CEL rules) live in [`crate::policy::validate`].
//! A field these types do not know is ignored by serde and reported as a warning by the
//! manifest loader, because newer upstream versions add fields.

pub mod v1alpha1;
pub mod v1alpha2;

pub use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
pub use k8s_openapi::api::networking::v1::NetworkPolicy;
pub use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};

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
