//! `crd.antrea.io/v1beta1`: Antrea's own policy kinds — Tier, ClusterNetworkPolicy (ACNP,
//! cluster-scoped) and NetworkPolicy (ANNP, namespaced).
//!
//! Source: antrea-io/antrea `pkg/apis/crd/v1beta1/types.go` (the Go types, which ACNP and
//! ANNP share: one `Rule`, one `NetworkPolicyPeer`, one `AppliedTo`) and the CRD schemas
//! `build/charts/antrea/crds/{tier,clusternetworkpolicy,networkpolicy}.yaml`. The kinds
//! share their names with upstream kinds (`networking.k8s.io/v1` NetworkPolicy,
//! `policy.networking.k8s.io/v1alpha2` ClusterNetworkPolicy): the manifest loader tells them
//! apart by `apiVersion`.
//!
//! Like Antrea's Go types, one Rust type serves every position: a rule holds both `from`
//! and `to`, a peer every selector either kind allows. The CRD schemas are narrower (an
//! ingress rule has no `to`, an ANNP peer no `namespaces`); what lies outside the schema of
//! the kind and position is reported by [`crate::policy::validate`], as are the CRD limits
//! and the admission webhook's rules. Fields tierproxy does not evaluate (ClusterGroup /
//! Group references, `serviceAccount`, `externalEntitySelector`, `toServices`,
//! `l7Protocols`, `sourcePort`, `fqdn`, `scope`, appliedTo `nodeSelector` / `service`) are
//! decoded all the same, so that they are reported by name and never dropped in silence.
//!
//! The schemars attributes shape the CRDs `tierproxy crds --antrea` prints
//! ([`crate::crds::antrea_crds`]); they change no decoding. Each limit they add is one
//! [`crate::policy::validate`] enforces as an error (priority ranges, the action, protocol
//! and IGMP type enums, ICMP type and code 0–255, one of `icmp`/`igmp` and of
//! `http`/`tls`, one `namespaces` criterion, a required CIDR).
//!
//! Defaults are only what serde needs: `tier` stays empty when omitted (Antrea's mutating
//! webhook writes `application`, see [`crate::policy::antrea_tiers`]) and rule names stay
//! empty (the webhook generates them).

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::LabelSelector;

/// The API group of the Antrea kinds read here.
pub const GROUP: &str = "crd.antrea.io";

/// The one version of [`GROUP`] read (`crd.antrea.io/v1beta1`); older ones
/// (`v1alpha1`, `v1alpha2`, and the pre-1.0 group `security.antrea.tanzu.vmware.com`) are
/// refused by the manifest loader.
pub const API_VERSION: &str = "crd.antrea.io/v1beta1";

/// The pre-1.0 API group of Antrea's policy kinds (Antrea 0.x), no longer served.
pub const LEGACY_GROUP: &str = "security.antrea.tanzu.vmware.com";

/// Spec of a Tier: a named priority that orders Antrea-native policies.
///
/// Source: `TierSpec`; CRD `tier.yaml`: `priority` integer, `minimum: 0`, `maximum: 255`,
/// required. The six static Tiers exist without any object
/// ([`crate::policy::antrea_tiers::STATIC_TIERS`]).
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "crd.antrea.io",
    version = "v1beta1",
    kind = "Tier",
    doc = "Tier: a named priority ordering Antrea-native policies (crd.antrea.io/v1beta1).",
    plural = "tiers",
    shortname = "tr",
    printcolumn = r#"{"name":"Priority","type":"integer","jsonPath":".spec.priority"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct TierSpec {
    /// 0–255; lower values come first. Reserved and static values are refused by the
    /// webhook (see [`crate::policy::antrea_tiers`]).
    #[schemars(range(min = 0, max = 255))]
    pub priority: i32,
    /// Free text.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub description: String,
}

/// Spec of an Antrea ClusterNetworkPolicy (ACNP).
///
/// Source: `ClusterNetworkPolicySpec` (the same fields as ANNP's `NetworkPolicySpec`).
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "crd.antrea.io",
    version = "v1beta1",
    kind = "ClusterNetworkPolicy",
    doc = "Antrea ClusterNetworkPolicy: cluster-wide rules in an Antrea Tier (crd.antrea.io/v1beta1).",
    plural = "clusternetworkpolicies",
    shortname = "acnp",
    status = "NetworkPolicyStatus",
    printcolumn = r#"{"name":"Tier","type":"string","jsonPath":".spec.tier"}"#,
    printcolumn = r#"{"name":"Priority","type":"number","jsonPath":".spec.priority"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct ClusterNetworkPolicySpec {
    /// The Tier, by object name; empty: `application` (Antrea's mutating webhook writes it).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub tier: String,
    /// Order within the Tier, lower first; a float, CRD range 1.0–10000.0.
    #[schemars(range(min = 1.0, max = 10000.0))]
    pub priority: f64,
    /// The workloads every rule applies to; set here or on every rule, never both.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub applied_to: Vec<AppliedTo>,
    /// Ingress rules, evaluated in written order (`from` peers).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ingress: Vec<Rule>,
    /// Egress rules, evaluated in written order (`to` peers).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub egress: Vec<Rule>,
}

/// Spec of an Antrea NetworkPolicy (ANNP): an ACNP confined to its Namespace.
///
/// Source: `NetworkPolicySpec`.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "crd.antrea.io",
    version = "v1beta1",
    kind = "NetworkPolicy",
    namespaced,
    doc = "Antrea NetworkPolicy: namespaced rules in an Antrea Tier (crd.antrea.io/v1beta1).",
    plural = "networkpolicies",
    shortname = "annp",
    status = "NetworkPolicyStatus",
    printcolumn = r#"{"name":"Tier","type":"string","jsonPath":".spec.tier"}"#,
    printcolumn = r#"{"name":"Priority","type":"number","jsonPath":".spec.priority"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct NetworkPolicySpec {
    /// As [`ClusterNetworkPolicySpec::tier`].
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub tier: String,
    /// As [`ClusterNetworkPolicySpec::priority`].
    #[schemars(range(min = 1.0, max = 10000.0))]
    pub priority: f64,
    /// Pods of the policy's Namespace (the ANNP schema has no `namespaceSelector` here).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub applied_to: Vec<AppliedTo>,
    /// Ingress rules.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ingress: Vec<Rule>,
    /// Egress rules.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub egress: Vec<Rule>,
}

/// The spec of an ACNP or ANNP, borrowed: what validation (and later compilation) reads of
/// either kind. Built by destructuring, so a field added to either spec breaks the build
/// here instead of being ignored.
#[derive(Debug, Clone, Copy)]
pub struct PolicySpecRef<'a> {
    /// `spec.tier`.
    pub tier: &'a str,
    /// `spec.priority`.
    pub priority: f64,
    /// `spec.appliedTo`.
    pub applied_to: &'a [AppliedTo],
    /// `spec.ingress`.
    pub ingress: &'a [Rule],
    /// `spec.egress`.
    pub egress: &'a [Rule],
}

impl<'a> From<&'a ClusterNetworkPolicySpec> for PolicySpecRef<'a> {
    fn from(s: &'a ClusterNetworkPolicySpec) -> Self {
        let ClusterNetworkPolicySpec { tier, priority, applied_to, ingress, egress } = s;
        PolicySpecRef { tier, priority: *priority, applied_to, ingress, egress }
    }
}

impl<'a> From<&'a NetworkPolicySpec> for PolicySpecRef<'a> {
    fn from(s: &'a NetworkPolicySpec) -> Self {
        let NetworkPolicySpec { tier, priority, applied_to, ingress, egress } = s;
        PolicySpecRef { tier, priority: *priority, applied_to, ingress, egress }
    }
}

/// Status Antrea's controller writes on ACNPs and ANNPs; read so that exported objects
/// (`kubectl get -o yaml`) decode without unknown-field warnings. Unused.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NetworkPolicyStatus {
    /// `Pending`, `Realizing`, `Realized` or `Failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// The generation the controller last processed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Nodes that realized the policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_nodes_realized: Option<i32>,
    /// Nodes that should realize it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired_nodes_realized: Option<i32>,
    /// `NetworkPolicyCondition`s (`type`, `status`, `lastTransitionTime`, `reason`,
    /// `message`), kept as given.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(transform = condition_items)]
    pub conditions: Vec<serde_json::Value>,
}

/// What a rule does with matching traffic.
///
/// Source: `RuleAction`; CRD `enum: [Allow, Drop, Reject, Pass]` (no `Deny`, although
/// one docs example uses it).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum RuleAction {
    /// Allow; final for this direction.
    Allow,
    /// Drop silently.
    Drop,
    /// Refuse: TCP RST, ICMP "administratively prohibited" for UDP/SCTP.
    Reject,
    /// Skip the remaining Antrea and admin rules; continue with NetworkPolicy.
    Pass,
}

impl RuleAction {
    /// The action as the CRD spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            RuleAction::Allow => "Allow",
            RuleAction::Drop => "Drop",
            RuleAction::Reject => "Reject",
            RuleAction::Pass => "Pass",
        }
    }
}

/// One ingress or egress rule.
///
/// Source: `Rule`. The CRD requires `action`; an ingress rule has no `to` or `toServices`,
/// an egress rule no `from` (reported by validation if present).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Rule {
    /// What to do with matching traffic.
    pub action: RuleAction,
    /// Ports and protocols; with `protocols` both empty, every port and protocol.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<NetworkPolicyPort>,
    /// ICMP / IGMP matches.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub protocols: Vec<NetworkPolicyProtocol>,
    /// Layer-7 matches (not supported by tierproxy; reported).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub l7_protocols: Vec<L7Protocol>,
    /// Sources of an ingress rule; empty: every address.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub from: Vec<NetworkPolicyPeer>,
    /// Destinations of an egress rule; empty (and no `toServices`): every address.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub to: Vec<NetworkPolicyPeer>,
    /// Destination Services of an egress rule (not supported by tierproxy; reported).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub to_services: Vec<PeerService>,
    /// Rule name, unique within the policy; empty: the webhook generates one.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    /// Whether Antrea logs matches (audit only).
    #[serde(default)]
    pub enable_logging: bool,
    /// A label Antrea prints in its policy log (audit only).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub log_label: String,
    /// Workloads this rule alone applies to; set on every rule or on none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub applied_to: Vec<AppliedTo>,
}

/// A port match.
///
/// Source: `NetworkPolicyPort`; CRD: `protocol` enum TCP/UDP/SCTP, `port` int-or-string,
/// `endPort`, `sourcePort`, `sourceEndPort` integers (no range in the schema).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NetworkPolicyPort {
    /// `TCP` (default), `UDP` or `SCTP`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("enum" = ["TCP", "UDP", "SCTP"]))]
    pub protocol: Option<String>,
    /// Number or container port name; absent: every port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<IntOrString>,
    /// Last port of an inclusive range; needs a numeric `port`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_port: Option<i32>,
    /// Source port (not supported by tierproxy; reported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_port: Option<i32>,
    /// Last source port (not supported by tierproxy; reported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_end_port: Option<i32>,
}

/// An ICMP or IGMP match; the CRD requires exactly one (`oneOf`).
///
/// Source: `NetworkPolicyProtocol`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("minProperties" = 1, "maxProperties" = 1))]
pub struct NetworkPolicyProtocol {
    /// ICMP, optionally by type and code.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub icmp: Option<IcmpProtocol>,
    /// IGMP, optionally by type and group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub igmp: Option<IgmpProtocol>,
}

/// Source: `ICMPProtocol`; CRD `icmpType`, `icmpCode` 0–255.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IcmpProtocol {
    /// ICMP type; absent: every type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 255))]
    pub icmp_type: Option<i32>,
    /// ICMP code; absent: every code.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 255))]
    pub icmp_code: Option<i32>,
}

/// Source: `IGMPProtocol`; CRD `igmpType` enum (ingress `0x11`, egress `0x12`, `0x16`,
/// `0x22`), `groupAddress` an IPv4 or IPv6 address.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IgmpProtocol {
    /// IGMP message type. The schema allows the types of either direction; validation
    /// allows 0x11 in ingress, 0x12, 0x16 and 0x22 in egress rules.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("enum" = [0x11, 0x12, 0x16, 0x22]))]
    pub igmp_type: Option<i32>,
    /// Multicast group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_address: Option<String>,
}

/// A layer-7 match (not supported by tierproxy). Source: `L7Protocol`; CRD `oneOf` http,
/// tls.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("minProperties" = 1, "maxProperties" = 1))]
pub struct L7Protocol {
    /// HTTP request match (`host`, `method`, `path`), kept as given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = http_schema)]
    pub http: Option<serde_json::Value>,
    /// TLS match (`sni`), kept as given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = tls_schema)]
    pub tls: Option<serde_json::Value>,
}

/// A Service by Namespace and name. Source: `NamespacedName` / `PeerService`; the CRD
/// requires both fields.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PeerService {
    /// Service name.
    pub name: String,
    /// Service Namespace.
    pub namespace: String,
    /// `Cluster` or `ClusterSet`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<PeerScope>,
}

/// An object by Namespace and name (`serviceAccount`, appliedTo `service`). Source:
/// `NamespacedName`; the CRD requires both fields.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NamespacedName {
    /// Name.
    pub name: String,
    /// Namespace.
    pub namespace: String,
}

/// Where a peer's selectors look. Source: `PeerScope`; CRD enum `Cluster`, `ClusterSet`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum PeerScope {
    /// This cluster (the default).
    Cluster,
    /// Every cluster of a multi-cluster ClusterSet (not supported by tierproxy).
    ClusterSet,
}

/// A peer of a rule (`from` / `to`): selectors within one peer AND, peers OR.
///
/// Source: `NetworkPolicyPeer`. A string field is set when non-empty, as Go's
/// `numFieldsSetInStruct` counts it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NetworkPolicyPeer {
    /// CIDR minus exceptions; exclusive with the other selectors.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip_block: Option<IpBlock>,
    /// Pods: of the ANNP's Namespace, of every Namespace for an ACNP, or of the Namespaces
    /// `namespaceSelector` / `namespaces` choose.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_selector: Option<LabelSelector>,
    /// All Pods (or the `podSelector` ones) of matching Namespaces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,
    /// Namespaces relative to the subject's (ACNP only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<PeerNamespaces>,
    /// ExternalEntities (not supported by tierproxy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_entity_selector: Option<LabelSelector>,
    /// A ClusterGroup (ACNP) or Group (ANNP) by name (not supported by tierproxy).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub group: String,
    /// Egress destination by domain name (not evaluated by tierproxy).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub fqdn: String,
    /// Pods by ServiceAccount (not supported by tierproxy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account: Option<NamespacedName>,
    /// The IPs of matching Nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<LabelSelector>,
    /// `Cluster` (default) or `ClusterSet` (not supported by tierproxy); ingress only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<PeerScope>,
    /// Keys no Antrea peer has (a misspelt `podSelectr`), kept rather than ignored: a
    /// peer holding one cannot be evaluated and fails closed
    /// (`shared/reference/antrea-model.md` §9); validation warns naming each. Not in the
    /// CRD schema (the API server prunes such keys).
    #[serde(flatten, default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    #[schemars(skip)]
    pub unknown: std::collections::BTreeMap<String, serde_json::Value>,
}

/// `ipBlock`. Source: `IPBlock`; CRD `format: cidr`; the webhook requires `cidr` and each
/// `except` strictly inside it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("required" = ["cidr"]))]
pub struct IpBlock {
    /// The network.
    #[serde(default)]
    #[schemars(transform = cidr_schema)]
    pub cidr: String,
    /// Networks carved out of `cidr`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(transform = cidr_items)]
    pub except: Vec<String>,
}

/// `namespaces`: Namespaces chosen relative to the subject's; exactly one criterion
/// (CRD `minProperties: 1`, `maxProperties: 1`).
///
/// Source: `PeerNamespaces`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("minProperties" = 1, "maxProperties" = 1))]
pub struct PeerNamespaces {
    /// `Self`: the subject's own Namespace.
    #[serde(default, rename = "match", skip_serializing_if = "Option::is_none")]
    pub match_: Option<NamespaceMatchType>,
    /// Label keys whose values the peer's Namespace must share with the subject's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub same_labels: Option<Vec<String>>,
}

/// Source: `NamespaceMatchType`; CRD enum `Self`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum NamespaceMatchType {
    /// The subject's own Namespace.
    #[serde(rename = "Self")]
    SelfNamespace,
}

/// One `appliedTo` entry: the workloads a policy or rule applies to; entries OR.
///
/// Source: `AppliedTo`. The ACNP schema allows `podSelector`, `namespaceSelector`,
/// `group`, `serviceAccount`, `service`, `nodeSelector` (spec level; rules fewer); the
/// ANNP schema `podSelector`, `externalEntitySelector`, `group` (rules: `podSelector`,
/// `group`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AppliedTo {
    /// Pods (of the ANNP's Namespace, or of every / the selected Namespaces for an ACNP).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_selector: Option<LabelSelector>,
    /// All Pods (or the `podSelector` ones) of matching Namespaces (ACNP).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,
    /// ExternalEntities (not supported by tierproxy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_entity_selector: Option<LabelSelector>,
    /// A ClusterGroup / Group by name (not supported by tierproxy).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub group: String,
    /// Pods by ServiceAccount (not supported by tierproxy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account: Option<NamespacedName>,
    /// A NodePort Service (not supported by tierproxy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<NamespacedName>,
    /// Nodes: a Node policy (not supported by tierproxy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<LabelSelector>,
}

/// Schema of `ipBlock.cidr`: `format: cidr` (as Antrea's CRD), and no `default`: serde's
/// `""` is no CIDR, and the API server refuses a CRD whose default fails its own schema.
fn cidr_schema(schema: &mut schemars::Schema) {
    schema.remove("default");
    schema.insert("format".to_owned(), "cidr".into());
}

/// Schema of `ipBlock.except`: items with `format: cidr`.
fn cidr_items(schema: &mut schemars::Schema) {
    if let Some(item) = schema.get_mut("items").and_then(|i| i.as_object_mut()) {
        item.insert("format".to_owned(), "cidr".into());
    }
}

/// Schema of `l7Protocols[].http`: Antrea's `HTTPProtocol` fields (`host`, `method`,
/// `path`; no method enum: tierproxy does not evaluate layer 7 and checks none). Typed, so
/// the schema stays structural without preserving unknown fields.
fn http_schema(schema: &mut schemars::Schema) {
    typed_object(schema, &["host", "method", "path"]);
}

/// Schema of `l7Protocols[].tls`: Antrea's `TLSProtocol` (`sni`).
fn tls_schema(schema: &mut schemars::Schema) {
    typed_object(schema, &["sni"]);
}

/// Schema of `status.conditions`: Antrea's `NetworkPolicyCondition` fields, all strings.
fn condition_items(schema: &mut schemars::Schema) {
    let mut item = schemars::Schema::default();
    typed_object(&mut item, &["type", "status", "lastTransitionTime", "reason", "message"]);
    schema.insert("items".to_owned(), item.into());
}

/// Makes `schema` an object of the string properties `fields`.
fn typed_object(schema: &mut schemars::Schema, fields: &[&str]) {
    schema.insert("type".to_owned(), "object".into());
    let props: serde_json::Map<String, serde_json::Value> =
        fields.iter().map(|f| ((*f).to_owned(), serde_json::json!({"type": "string"}))).collect();
    schema.insert("properties".to_owned(), props.into());
}

/// The Antrea-native objects of one input set, as the manifest loader keeps them: only
/// valid ones (checked against each other: Tiers, then policies against the Tiers).
#[derive(Debug, Clone, Default)]
pub struct Objects {
    /// Tier objects (static ones included when a manifest holds them).
    pub tiers: Vec<std::sync::Arc<Tier>>,
    /// ACNPs.
    pub cluster_network_policies: Vec<std::sync::Arc<ClusterNetworkPolicy>>,
    /// ANNPs.
    pub network_policies: Vec<std::sync::Arc<NetworkPolicy>>,
}

impl Objects {
    /// Moves everything of `other` to the end of `self`.
    pub fn append(&mut self, other: &mut Objects) {
        self.tiers.append(&mut other.tiers);
        self.cluster_network_policies.append(&mut other.cluster_network_policies);
        self.network_policies.append(&mut other.network_policies);
    }

    /// Whether no object is held.
    pub fn is_empty(&self) -> bool {
        self.tiers.is_empty()
            && self.cluster_network_policies.is_empty()
            && self.network_policies.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The wire format of Antrea's docs examples decodes field for field, including the
    /// fields tierproxy does not evaluate.
    #[test]
    fn antrea_wire_format_decodes() {
        let acnp: ClusterNetworkPolicy = serde_json::from_value(serde_json::json!({
            "apiVersion": "crd.antrea.io/v1beta1", "kind": "ClusterNetworkPolicy",
            "metadata": {"name": "acnp"},
            "spec": {
                "priority": 5,
                "tier": "securityops",
                "appliedTo": [{"podSelector": {"matchLabels": {"role": "db"}}}],
                "ingress": [{
                    "action": "Allow",
                    "from": [
                        {"namespaces": {"match": "Self"}},
                        {"namespaces": {"sameLabels": ["tenant"]}},
                        {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}},
                        {"group": "cg", "scope": "ClusterSet"}
                    ],
                    "ports": [{"protocol": "TCP", "port": 8080, "endPort": 8090, "sourcePort": 1}],
                    "protocols": [{"icmp": {"icmpType": 8, "icmpCode": 0}}],
                    "name": "AllowFromSelf", "enableLogging": true, "logLabel": "x"
                }],
                "egress": [{
                    "action": "Reject",
                    "to": [{"fqdn": "*.example.com"}, {"nodeSelector": {}}],
                    "toServices": [{"name": "s", "namespace": "n"}],
                    "l7Protocols": [{"http": {"path": "/a"}}]
                }]
            },
            "status": {"phase": "Realized", "observedGeneration": 1, "currentNodesRealized": 2,
                       "desiredNodesRealized": 2}
        }))
        .unwrap();
        assert_eq!(acnp.spec.priority, 5.0);
        let from = &acnp.spec.ingress[0].from;
        assert_eq!(
            from[0].namespaces.as_ref().unwrap().match_,
            Some(NamespaceMatchType::SelfNamespace)
        );
        assert_eq!(from[3].scope, Some(PeerScope::ClusterSet));
        assert_eq!(acnp.spec.ingress[0].ports[0].port, Some(IntOrString::Int(8080)));
        assert_eq!(acnp.spec.egress[0].action, RuleAction::Reject);
        assert_eq!(acnp.spec.egress[0].to[0].fqdn, "*.example.com");
        let r = PolicySpecRef::from(&acnp.spec);
        assert_eq!((r.tier, r.priority, r.egress.len()), ("securityops", 5.0, 1));
        let annp: NetworkPolicy = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns"},
            "spec": {"priority": 1.5, "appliedTo": [{"podSelector": {}}],
                     "ingress": [{"action": "Pass", "ports": [{"port": "http"}]}]}
        }))
        .unwrap();
        assert_eq!(annp.spec.priority, 1.5);
        assert_eq!(annp.spec.ingress[0].ports[0].port, Some(IntOrString::String("http".into())));
        let tier: Tier = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "t"}, "spec": {"priority": 10, "description": "d"}
        }))
        .unwrap();
        assert_eq!(tier.spec.priority, 10);
        // `Deny` is not an Antrea action (one docs example uses it; the CRD enum refuses it).
        let bad = serde_json::from_value::<Rule>(serde_json::json!({"action": "Deny"}));
        assert!(bad.is_err());
    }
}
