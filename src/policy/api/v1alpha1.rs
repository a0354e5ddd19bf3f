//! `policy.networking.k8s.io/v1alpha1`: AdminNetworkPolicy (ANP) and
//! BaselineAdminNetworkPolicy (BANP).
//!
//! Source: kubernetes-sigs/network-policy-api `apis/v1alpha1`, `release-0.1` line
//! (v0.1.7/v0.1.8), standard and experimental channels. Field docs below paraphrase the
//! upstream ones; limits are enforced by [`crate::policy::validate`].

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Condition, LabelSelector, NamespacedPod};

/// Spec of an AdminNetworkPolicy: cluster-scoped rules that take precedence over
/// NetworkPolicy.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "policy.networking.k8s.io",
    version = "v1alpha1",
    kind = "AdminNetworkPolicy",
    doc = "AdminNetworkPolicy: cluster-scoped rules that take precedence over NetworkPolicy (policy.networking.k8s.io/v1alpha1).",
    plural = "adminnetworkpolicies",
    shortname = "anp",
    status = "AdminNetworkPolicyStatus",
    printcolumn = r#"{"name":"Priority","type":"string","jsonPath":".spec.priority"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct AdminNetworkPolicySpec {
    /// 0–1000; lower values take precedence. Upstream: "The behavior is undefined if two ANP
    /// objects have same priority"; tierproxy orders ties by name and reports a conflict.
    #[schemars(range(min = 0, max = 1000))]
    pub priority: i32,
    /// The pods this policy applies to.
    pub subject: AdminNetworkPolicySubject,
    /// Ingress rules (≤ 100), evaluated in written order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 100))]
    pub ingress: Vec<AdminNetworkPolicyIngressRule>,
    /// Egress rules (≤ 100), evaluated in written order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 100))]
    pub egress: Vec<AdminNetworkPolicyEgressRule>,
}

/// Status of an ANP: conditions written by implementations.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct AdminNetworkPolicyStatus {
    /// `metav1.Condition`s, keyed by `type`.
    #[serde(default)]
    #[schemars(transform = super::condition_list)]
    pub conditions: Vec<Condition>,
}

/// The pods a policy applies to. Exactly one field must be set (`MinProperties=1`,
/// `MaxProperties=1`). Host-network pods are never selected.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("minProperties" = 1, "maxProperties" = 1))]
pub struct AdminNetworkPolicySubject {
    /// All pods in the namespaces this selector matches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<LabelSelector>,
    /// Pods matching a namespace selector AND a pod selector.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<NamespacedPod>,
}

/// Action of an ANP rule.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum AdminNetworkPolicyRuleAction {
    /// Allow the traffic; no lower-precedence rule is consulted.
    Allow,
    /// Drop the traffic; no lower-precedence rule is consulted.
    Deny,
    /// Skip the rest of the admin tier; NetworkPolicy (then BANP) decides.
    Pass,
}

/// An ANP ingress rule.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AdminNetworkPolicyIngressRule {
    /// Optional rule name (≤ 100 characters), used in audit and `explain`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(max = 100))]
    pub name: String,
    /// What to do with matching traffic.
    pub action: AdminNetworkPolicyRuleAction,
    /// Sources (1–100); the rule matches if any matches.
    #[schemars(length(min = 1, max = 100))]
    pub from: Vec<AdminNetworkPolicyIngressPeer>,
    /// Destination ports on the subject (≤ 100); absent matches all ports and protocols.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 100))]
    pub ports: Option<Vec<AdminNetworkPolicyPort>>,
}

/// An ANP egress rule.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = super::anp_egress_rule_cel)]
pub struct AdminNetworkPolicyEgressRule {
    /// Optional rule name (≤ 100 characters).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(max = 100))]
    pub name: String,
    /// What to do with matching traffic.
    pub action: AdminNetworkPolicyRuleAction,
    /// Destinations (1–100); the rule matches if any matches.
    #[schemars(length(min = 1, max = 100))]
    pub to: Vec<AdminNetworkPolicyEgressPeer>,
    /// Destination ports on the peer (≤ 100); absent matches all ports and protocols.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 100))]
    pub ports: Option<Vec<AdminNetworkPolicyPort>>,
}

/// A source of ingress traffic. Exactly one field must be set; if none of the known fields
/// is set a consumer "must assume an unknown option has been specified and fail closed".
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("minProperties" = 1, "maxProperties" = 1))]
pub struct AdminNetworkPolicyIngressPeer {
    /// All pods in matching namespaces (never host-network pods).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<LabelSelector>,
    /// Matching pods in matching namespaces (never host-network pods).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<NamespacedPod>,
}

/// A destination of egress traffic. Exactly one field must be set; none known ⇒ fail closed.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("minProperties" = 1, "maxProperties" = 1))]
pub struct AdminNetworkPolicyEgressPeer {
    /// All pods in matching namespaces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<LabelSelector>,
    /// Matching pods in matching namespaces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<NamespacedPod>,
    /// Nodes by label; matches the IPs in the nodes' `status.addresses` (experimental).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<LabelSelector>,
    /// CIDRs (1–25); match any address in them, pod and node IPs included.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = super::cidr_list)]
    pub networks: Option<Vec<String>>,
    /// Domain names (1–25), `*.` prefix allowed; Allow rules only (experimental).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = super::domain_name_list)]
    pub domain_names: Option<Vec<String>>,
}

/// A port selector. Exactly one field must be set.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("minProperties" = 1, "maxProperties" = 1))]
pub struct AdminNetworkPolicyPort {
    /// One protocol and port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port_number: Option<Port>,
    /// A container port name, resolved on the destination pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub named_port: Option<String>,
    /// An inclusive port range.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port_range: Option<PortRange>,
}

/// One protocol and port.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Port {
    /// `TCP`, `UDP` or `SCTP`; the CRD defaults it to `TCP`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "TCP"))]
    pub protocol: Option<String>,
    /// 1–65535.
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,
}

/// An inclusive range of ports; the CRD requires `start < end`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PortRange {
    /// `TCP`, `UDP` or `SCTP`; the CRD defaults it to `TCP`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "TCP"))]
    pub protocol: Option<String>,
    /// First port, 1–65535.
    #[schemars(range(min = 1, max = 65535))]
    pub start: i32,
    /// Last port (inclusive), 1–65535.
    #[schemars(range(min = 1, max = 65535))]
    pub end: i32,
}

/// Spec of the BaselineAdminNetworkPolicy: the cluster default that NetworkPolicy can
/// override. A singleton: its name must be `default`.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "policy.networking.k8s.io",
    version = "v1alpha1",
    kind = "BaselineAdminNetworkPolicy",
    doc = "BaselineAdminNetworkPolicy: the cluster default that NetworkPolicy can override; a singleton named default (policy.networking.k8s.io/v1alpha1).",
    plural = "baselineadminnetworkpolicies",
    shortname = "banp",
    status = "BaselineAdminNetworkPolicyStatus",
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct BaselineAdminNetworkPolicySpec {
    /// The pods this policy applies to.
    pub subject: AdminNetworkPolicySubject,
    /// Ingress rules (≤ 100), evaluated in written order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 100))]
    pub ingress: Vec<BaselineAdminNetworkPolicyIngressRule>,
    /// Egress rules (≤ 100), evaluated in written order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 100))]
    pub egress: Vec<BaselineAdminNetworkPolicyEgressRule>,
}

/// Status of the BANP.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct BaselineAdminNetworkPolicyStatus {
    /// `metav1.Condition`s, keyed by `type`.
    #[serde(default)]
    #[schemars(transform = super::condition_list)]
    pub conditions: Vec<Condition>,
}

/// Action of a BANP rule (no Pass: there is no lower tier but the default).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum BaselineAdminNetworkPolicyRuleAction {
    /// Allow the traffic.
    Allow,
    /// Drop the traffic.
    Deny,
}

/// A BANP ingress rule.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BaselineAdminNetworkPolicyIngressRule {
    /// Optional rule name (≤ 100 characters).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(max = 100))]
    pub name: String,
    /// What to do with matching traffic.
    pub action: BaselineAdminNetworkPolicyRuleAction,
    /// Sources (1–100).
    #[schemars(length(min = 1, max = 100))]
    pub from: Vec<AdminNetworkPolicyIngressPeer>,
    /// Destination ports (≤ 100); absent matches all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 100))]
    pub ports: Option<Vec<AdminNetworkPolicyPort>>,
}

/// A BANP egress rule.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = super::banp_egress_rule_cel)]
pub struct BaselineAdminNetworkPolicyEgressRule {
    /// Optional rule name (≤ 100 characters).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(max = 100))]
    pub name: String,
    /// What to do with matching traffic.
    pub action: BaselineAdminNetworkPolicyRuleAction,
    /// Destinations (1–100).
    #[schemars(length(min = 1, max = 100))]
    pub to: Vec<BaselineAdminNetworkPolicyEgressPeer>,
    /// Destination ports (≤ 100); absent matches all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 100))]
    pub ports: Option<Vec<AdminNetworkPolicyPort>>,
}

/// A BANP egress destination: like [`AdminNetworkPolicyEgressPeer`] without `domainNames`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("minProperties" = 1, "maxProperties" = 1))]
pub struct BaselineAdminNetworkPolicyEgressPeer {
    /// All pods in matching namespaces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<LabelSelector>,
    /// Matching pods in matching namespaces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<NamespacedPod>,
    /// Nodes by label (experimental).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<LabelSelector>,
    /// CIDRs (1–25).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = super::cidr_list)]
    pub networks: Option<Vec<String>>,
}
