//! `policy.networking.k8s.io/v1alpha2`: ClusterNetworkPolicy (CNP), which replaces ANP and
//! BANP with one kind and a `tier` field.
//!
//! Source: kubernetes-sigs/network-policy-api `apis/v1alpha2/clusternetworkpolicy_types.go`
//! (v0.2.0+). Limits are enforced by [`crate::policy::validate`].

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Condition, LabelSelector, NamespacedPod};

/// Spec of a ClusterNetworkPolicy.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "policy.networking.k8s.io",
    version = "v1alpha2",
    kind = "ClusterNetworkPolicy",
    doc = "ClusterNetworkPolicy: cluster-wide rules in tier Admin (before NetworkPolicy) or Baseline (after it) (policy.networking.k8s.io/v1alpha2).",
    plural = "clusternetworkpolicies",
    shortname = "cnp",
    status = "ClusterNetworkPolicyStatus",
    printcolumn = r#"{"name":"Tier","type":"string","jsonPath":".spec.tier"}"#,
    printcolumn = r#"{"name":"Priority","type":"string","jsonPath":".spec.priority"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct ClusterNetworkPolicySpec {
    /// `Admin` (before NetworkPolicy) or `Baseline` (after it).
    pub tier: Tier,
    /// 0–1000 within the tier; lower values take precedence.
    #[schemars(range(min = 0, max = 1000))]
    pub priority: i32,
    /// The pods this policy applies to.
    pub subject: ClusterNetworkPolicySubject,
    /// Ingress rules (≤ 25), evaluated in written order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 25))]
    pub ingress: Vec<ClusterNetworkPolicyIngressRule>,
    /// Egress rules (≤ 25), evaluated in written order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 25))]
    pub egress: Vec<ClusterNetworkPolicyEgressRule>,
}

/// The tier of a CNP.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum Tier {
    /// Evaluated before NetworkPolicy; cannot be overridden by it.
    Admin,
    /// Evaluated after NetworkPolicy, for pods it does not isolate.
    Baseline,
}

/// Status of a CNP.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct ClusterNetworkPolicyStatus {
    /// `metav1.Condition`s, keyed by `type`.
    #[serde(default)]
    #[schemars(transform = super::condition_list)]
    pub conditions: Vec<Condition>,
}

/// The pods a CNP applies to; exactly one field must be set.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("minProperties" = 1, "maxProperties" = 1))]
pub struct ClusterNetworkPolicySubject {
    /// All pods in matching namespaces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<LabelSelector>,
    /// Matching pods in matching namespaces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<NamespacedPod>,
}

/// Action of a CNP rule.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum ClusterNetworkPolicyRuleAction {
    /// Accept the traffic; no further rule in this direction is processed.
    Accept,
    /// Drop the traffic.
    Deny,
    /// Skip the rest of the current tier.
    Pass,
}

/// A CNP ingress rule.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterNetworkPolicyIngressRule {
    /// Optional rule name (≤ 100 characters).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(max = 100))]
    pub name: String,
    /// What to do with matching traffic.
    pub action: ClusterNetworkPolicyRuleAction,
    /// Sources (1–25).
    #[schemars(length(min = 1, max = 25))]
    pub from: Vec<ClusterNetworkPolicyIngressPeer>,
    /// Protocol/port matches (1–25 when present); absent matches all traffic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 25))]
    pub protocols: Option<Vec<ClusterNetworkPolicyProtocol>>,
}

/// A CNP egress rule.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = super::cnp_egress_rule_cel)]
pub struct ClusterNetworkPolicyEgressRule {
    /// Optional rule name (≤ 100 characters).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(max = 100))]
    pub name: String,
    /// What to do with matching traffic.
    pub action: ClusterNetworkPolicyRuleAction,
    /// Destinations (1–25).
    #[schemars(length(min = 1, max = 25))]
    pub to: Vec<ClusterNetworkPolicyEgressPeer>,
    /// Protocol/port matches (1–25 when present); absent matches all traffic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 25))]
    pub protocols: Option<Vec<ClusterNetworkPolicyProtocol>>,
}

/// A CNP ingress source; exactly one field. None known ⇒ fail closed ("For Accept rules
/// ... matching no traffic. For Deny and Pass rules ... a 'Deny all' rule").
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("minProperties" = 1, "maxProperties" = 1))]
pub struct ClusterNetworkPolicyIngressPeer {
    /// All pods in matching namespaces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<LabelSelector>,
    /// Matching pods in matching namespaces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<NamespacedPod>,
}

/// A CNP egress destination; exactly one field. None known ⇒ fail closed.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("minProperties" = 1, "maxProperties" = 1))]
pub struct ClusterNetworkPolicyEgressPeer {
    /// All pods in matching namespaces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<LabelSelector>,
    /// Matching pods in matching namespaces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<NamespacedPod>,
    /// Nodes by label; matches their `status.addresses` IPs (experimental).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<LabelSelector>,
    /// CIDRs (1–25); cluster-internal traffic is checked against them too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = super::cidr_list)]
    pub networks: Option<Vec<String>>,
    /// Domain names (1–25); Accept rules only (experimental).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = super::domain_name_list)]
    pub domain_names: Option<Vec<String>>,
}

/// A protocol match; exactly one field must be set.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("minProperties" = 1, "maxProperties" = 1))]
pub struct ClusterNetworkPolicyProtocol {
    /// TCP, optionally by destination port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp: Option<ProtocolPort>,
    /// UDP, optionally by destination port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub udp: Option<ProtocolPort>,
    /// SCTP, optionally by destination port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sctp: Option<ProtocolPort>,
    /// A container port name on the destination pod (any protocol of that port).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destination_named_port: Option<String>,
}

/// Protocol-specific matches (`ClusterNetworkPolicyProtocolTCP/UDP/SCTP`; `MinProperties=1`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("minProperties" = 1))]
pub struct ProtocolPort {
    /// The destination port; required by `MinProperties=1`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destination_port: Option<DestinationPort>,
}

/// A port number or range; exactly one field must be set.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("minProperties" = 1, "maxProperties" = 1))]
pub struct DestinationPort {
    /// One port, 1–65535.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub number: Option<i32>,
    /// An inclusive range; `start < end`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub range: Option<PortRange>,
}

/// An inclusive range of ports.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = super::port_range_cel)]
pub struct PortRange {
    /// First port, 1–65535.
    #[schemars(range(min = 1, max = 65535))]
    pub start: i32,
    /// Last port (inclusive), 1–65535, greater than `start`.
    #[schemars(range(min = 1, max = 65535))]
    pub end: i32,
}
