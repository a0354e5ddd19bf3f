//! Antrea-native policies (`crd.antrea.io/v1beta1` Tier, ClusterNetworkPolicy,
//! NetworkPolicy) as Antrea's API server admits them: the CRD schemas and the
//! antrea-controller admission webhook.
//!
//! Sources (antrea-io/antrea): CRDs `build/charts/antrea/crds/tier.yaml`,
//! `clusternetworkpolicy.yaml`, `networkpolicy.yaml`; webhook
//! `pkg/controller/networkpolicy/validate.go` (`antreaPolicyValidator.validatePolicy` and
//! the functions it calls, quoted above each check); mutating webhook `mutate.go`
//! (rule names, default tier); `crd_utils.go` (`toAntreaPeerForCRD`, for what Antrea does
//! with a peer the webhook lets through). The Tier rules that involve other Tiers are in
//! [`crate::policy::antrea_tiers`].
//!
//! Severities follow the module rule: what the CRD or the webhook refuses is an error;
//! what Antrea stores but the operator should know about is a warning. Two kinds of
//! warning are specific to these kinds:
//! - [`ProblemKind::OutsideSchema`]: ACNP and ANNP share Go types, but each CRD schema
//!   allows a subset per position (an ANNP peer has no `namespaces`, an ingress rule no
//!   `to`). Such a field decodes here; the API server would prune it (or refuse the object
//!   under strict field validation).
//! - [`ProblemKind::Unsupported`]: fields within the schema that tierproxy does not
//!   evaluate (ClusterGroup/Group, `serviceAccount`, `externalEntitySelector`,
//!   `toServices`, `l7Protocols`, `sourcePort`, `fqdn`, `scope: ClusterSet`, appliedTo
//!   `nodeSelector` / `service`).

use std::collections::HashSet;
use std::net::IpAddr;

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::policy::antrea_tiers::{BASELINE_TIER, MAX_TIER_PRIORITY, TierTable};
use crate::policy::api::antrea::{
    self, AppliedTo, IcmpProtocol, IgmpProtocol, IpBlock, L7Protocol, NetworkPolicyPeer,
    NetworkPolicyPort, NetworkPolicyProtocol, PeerNamespaces, PeerScope, PolicySpecRef, Rule,
    RuleAction,
};
use crate::policy::cidr;
use crate::policy::model::Direction;
use crate::policy::problem::{Kind, Problem, ProblemKind};

use super::apimachinery::{NameRule, object_meta, qualified_name_errors};
use super::crd::check_named_port;
use super::selectors::antrea_selector;
use super::{MAX_PORT, PROTOCOLS, Path, Sink, invalid, set_count, set_names};

/// Lowest `spec.priority` of an ACNP or ANNP. Source: CRD `priority: {type: number,
/// minimum: 1.0, maximum: 10000.0}` ("Ensure that Spec.Priority field is between 1 and
/// 10000").
pub const MIN_POLICY_PRIORITY: f64 = 1.0;

/// Highest `spec.priority` of an ACNP or ANNP (CRD `maximum: 10000.0`).
pub const MAX_POLICY_PRIORITY: f64 = 10000.0;

/// Longest `logLabel` of a Node policy's logged rule before Antrea truncates it in kernel
/// logs. Source: `validate.go checkLogLabel` (a warning there too).
const MAX_NODE_LOG_LABEL: usize = 12;

/// ACNP or ANNP: one Go type, two CRD schemas.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Flavor {
    Cluster,
    Namespaced,
}

/// Where an `appliedTo` list sits.
#[derive(Clone, Copy, PartialEq, Eq)]
enum At {
    Spec,
    Rule(Direction),
}

/// Validates a Tier on its own: metadata and the CRD's `priority` range 0–255. The rules
/// that involve other Tiers (reserved and taken priorities, static Tiers) are
/// [`TierTable::build`]'s.
///
/// Source: CRD `tier.yaml` (`minimum: 0`, `maximum: 255`).
pub fn antrea_tier(obj: &antrea::Tier, out: &mut Vec<Problem>) {
    let mut s = Sink::new(Kind::AntreaTier, &obj.metadata, out);
    object_meta(&mut s, &obj.metadata, NameRule::Subdomain, false);
    let antrea::TierSpec { priority, description: _ } = &obj.spec;
    if !(0..=MAX_TIER_PRIORITY).contains(priority) {
        s.error(
            &Path::root("spec.priority"),
            ProblemKind::OutOfRange {
                value: (*priority).into(),
                min: 0,
                max: MAX_TIER_PRIORITY.into(),
            },
        );
    }
}

/// Validates an Antrea ClusterNetworkPolicy against its CRD schema and Antrea's webhook,
/// with `tiers` the Tiers that exist (for `spec.tier`). See the module docs for what is
/// an error and what a warning.
pub fn antrea_cluster_network_policy(
    obj: &antrea::ClusterNetworkPolicy,
    tiers: &TierTable,
    out: &mut Vec<Problem>,
) {
    let mut s = Sink::new(Kind::AntreaClusterNetworkPolicy, &obj.metadata, out);
    object_meta(&mut s, &obj.metadata, NameRule::Subdomain, false);
    policy(&mut s, (&obj.spec).into(), Flavor::Cluster, tiers);
}

/// [`antrea_cluster_network_policy`] for an Antrea NetworkPolicy (namespaced; its CRD
/// schema is narrower).
pub fn antrea_network_policy(
    obj: &antrea::NetworkPolicy,
    tiers: &TierTable,
    out: &mut Vec<Problem>,
) {
    let mut s = Sink::new(Kind::AntreaNetworkPolicy, &obj.metadata, out);
    object_meta(&mut s, &obj.metadata, NameRule::Subdomain, true);
    policy(&mut s, (&obj.spec).into(), Flavor::Namespaced, tiers);
}

fn forbidden(reason: impl Into<String>) -> ProblemKind {
    ProblemKind::Forbidden { reason: reason.into() }
}

fn dir_root(d: Direction) -> &'static str {
    match d {
        Direction::Ingress => "spec.ingress",
        Direction::Egress => "spec.egress",
    }
}

/// What `validate.go validateMulticastIGMP` has seen so far: its flags are set once per
/// policy, not reset per rule, so an IGMP rule makes every later rule with ports or peers
/// invalid, and an ICMP rule every later IGMP rule. Mirrored as the webhook refuses.
#[derive(Default)]
struct IgmpSeen {
    igmp: bool,
    icmp: bool,
}

fn policy(s: &mut Sink<'_>, spec: PolicySpecRef<'_>, flavor: Flavor, tiers: &TierTable) {
    let PolicySpecRef { tier, priority, applied_to, ingress, egress } = spec;
    // validateTierForPolicy: "tier %s does not exist" (empty and the legacy static
    // spellings excepted); no other case folding.
    if tiers.get(tier).is_none() {
        s.error(
            &Path::root("spec.tier"),
            invalid(tier, "tier does not exist: no static Tier and no Tier object has this name"),
        );
    }
    // CRD: "Ensure that Spec.Priority field is between 1 and 10000". NaN fails too.
    if !(MIN_POLICY_PRIORITY..=MAX_POLICY_PRIORITY).contains(&priority) {
        s.error(
            &Path::root("spec.priority"),
            invalid(priority.to_string(), "must be between 1 and 10000"),
        );
    }
    rule_names(s, ingress, egress);
    applied_to_placement(s, applied_to, ingress, egress);
    applied_to_list(
        s,
        &Path::root("spec.appliedTo"),
        applied_to,
        flavor,
        At::Spec,
        !egress.is_empty(),
    );
    // validateTierForPassAction compares `strings.ToLower(tier)` with "baseline".
    let baseline = tier.to_ascii_lowercase() == BASELINE_TIER;
    // validateAppliedToServiceIngressPeer looks at the first entry only.
    let spec_on_service = applied_to.first().is_some_and(|a| a.service.is_some());
    // checkLogLabel: a policy whose spec appliedTo has a nodeSelector is a Node policy.
    let node_policy = applied_to.iter().any(|a| a.node_selector.is_some());
    let mut igmp = IgmpSeen::default();
    for (d, rules) in [(Direction::Ingress, ingress), (Direction::Egress, egress)] {
        let root = Path::root(dir_root(d));
        for (i, r) in rules.iter().enumerate() {
            let ctx = RuleCtx { flavor, d, baseline, spec_on_service, node_policy };
            rule(s, &root.index(i), r, &ctx, &mut igmp);
        }
    }
}

/// `validate.go validateRuleName`: "rules names must be unique within the policy", one set
/// across ingress and egress. Unnamed rules are named first by the mutating webhook
/// (`mutate.go generateRuleNames`: `<direction>-<action>-<hash of the rule's JSON>`), so
/// two equal unnamed rules of one direction get one name.
fn rule_names(s: &mut Sink<'_>, ingress: &[Rule], egress: &[Rule]) {
    let mut seen: HashSet<&str> = HashSet::new();
    for (d, rules) in [(Direction::Ingress, ingress), (Direction::Egress, egress)] {
        let root = Path::root(dir_root(d));
        for (i, r) in rules.iter().enumerate() {
            let path = root.index(i);
            if r.name.is_empty() {
                if let Some(j) = rules[..i].iter().position(|o| o == r) {
                    s.error(
                        &path,
                        forbidden(format!(
                            "equal to {}[{j}] and unnamed: Antrea's mutating webhook gives both \
                             the name {}-{}-<hash of the rule>, and rule names must be unique \
                             within the policy",
                            dir_root(d),
                            d.as_str(),
                            r.action.as_str().to_ascii_lowercase()
                        )),
                    );
                }
            } else if !seen.insert(&r.name) {
                s.error(
                    &path.field("name"),
                    invalid(&r.name, "rule names must be unique within the policy"),
                );
            }
        }
    }
}

/// `validate.go validateAppliedTo`, first part: appliedTo in the spec or in every rule,
/// never both, never neither.
fn applied_to_placement(s: &mut Sink<'_>, spec: &[AppliedTo], ingress: &[Rule], egress: &[Rule]) {
    let in_rules = ingress.iter().chain(egress).filter(|r| !r.applied_to.is_empty()).count();
    let spec_path = Path::root("spec.appliedTo");
    if !spec.is_empty() && in_rules > 0 {
        s.error(&spec_path, forbidden("appliedTo should not be set in both spec and rules"));
    } else if spec.is_empty() && in_rules == 0 {
        s.error(&spec_path, forbidden("appliedTo needs to be set in either spec or rules"));
    } else if in_rules > 0 && in_rules != ingress.len() + egress.len() {
        for (d, rules) in [(Direction::Ingress, ingress), (Direction::Egress, egress)] {
            let root = Path::root(dir_root(d));
            for (i, r) in rules.iter().enumerate() {
                if r.applied_to.is_empty() {
                    s.error(
                        &root.index(i).field("appliedTo"),
                        forbidden(
                            "appliedTo field should either be set in all rules or in none of them",
                        ),
                    );
                }
            }
        }
    }
}

/// The `appliedTo` fields a CRD schema has at `at` (`clusternetworkpolicy.yaml`,
/// `networkpolicy.yaml`), and the schema's name for messages.
fn applied_to_schema(flavor: Flavor, at: At) -> (&'static [&'static str], &'static str) {
    match (flavor, at) {
        (Flavor::Cluster, At::Spec) => (
            &[
                "podSelector",
                "namespaceSelector",
                "group",
                "serviceAccount",
                "service",
                "nodeSelector",
            ],
            "Antrea ClusterNetworkPolicy spec.appliedTo",
        ),
        (Flavor::Cluster, At::Rule(Direction::Ingress)) => (
            &["podSelector", "namespaceSelector", "group", "serviceAccount", "service"],
            "Antrea ClusterNetworkPolicy ingress rule appliedTo",
        ),
        (Flavor::Cluster, At::Rule(Direction::Egress)) => (
            &["podSelector", "namespaceSelector", "group", "serviceAccount"],
            "Antrea ClusterNetworkPolicy egress rule appliedTo",
        ),
        (Flavor::Namespaced, At::Spec) => (
            &["podSelector", "externalEntitySelector", "group"],
            "Antrea NetworkPolicy spec.appliedTo",
        ),
        (Flavor::Namespaced, At::Rule(_)) => {
            (&["podSelector", "group"], "Antrea NetworkPolicy rule appliedTo")
        }
    }
}

/// What tierproxy does not evaluate, by field name, for [`ProblemKind::Unsupported`].
fn unsupported_feature(field: &str) -> Option<&'static str> {
    Some(match field {
        "group" => "a ClusterGroup/Group reference",
        "serviceAccount" => "selection by ServiceAccount",
        "externalEntitySelector" => "selection of ExternalEntities",
        "service" => "applying a policy to a NodePort Service",
        "nodeSelector" => "applying a policy to Nodes (Node policies)",
        "fqdn" => "an FQDN peer",
        "toServices" => "toServices",
        "l7Protocols" => "layer-7 matching (l7Protocols)",
        "sourcePort" | "sourceEndPort" => "matching source ports",
        _ => return None,
    })
}

/// Reports each set field that is outside `schema` (warning) or that tierproxy does not
/// evaluate (warning). `fields`: (name, set), in the Go type's order.
fn schema_and_scope(
    s: &mut Sink<'_>,
    path: &Path<'_>,
    fields: &[(&'static str, bool)],
    (allowed, schema): (&[&str], &'static str),
    is_applied_to: bool,
) {
    for &(name, set) in fields {
        if !set {
            continue;
        }
        if !allowed.contains(&name) {
            s.warning(&path.field(name), ProblemKind::OutsideSchema { schema });
        } else if let Some(feature) = unsupported_feature(name)
            // A peer's nodeSelector (Node IPs) is evaluated; an appliedTo's is not.
            && (is_applied_to || name != "nodeSelector")
        {
            s.warning(&path.field(name), ProblemKind::Unsupported { feature });
        }
    }
}

/// The entries of one `appliedTo` list: `validate.go validateAppliedTo` (`checkAppliedTo`),
/// `checkSelectorsLabels`, and the schema of the position.
fn applied_to_list(
    s: &mut Sink<'_>,
    path: &Path<'_>,
    entries: &[AppliedTo],
    flavor: Flavor,
    at: At,
    policy_has_egress: bool,
) {
    let mut services = 0usize;
    for (k, a) in entries.iter().enumerate() {
        let p = path.index(k);
        let AppliedTo {
            pod_selector,
            namespace_selector,
            external_entity_selector,
            group,
            service_account,
            service,
            node_selector,
        } = a;
        let fields = [
            ("podSelector", pod_selector.is_some()),
            ("namespaceSelector", namespace_selector.is_some()),
            ("externalEntitySelector", external_entity_selector.is_some()),
            ("group", !group.is_empty()),
            ("serviceAccount", service_account.is_some()),
            ("service", service.is_some()),
            ("nodeSelector", node_selector.is_some()),
        ];
        let n = set_count(&fields);
        // checkAppliedTo: "<field> cannot be set with other peers in appliedTo", the first
        // that applies of group, nodeSelector, serviceAccount, service.
        if n > 1
            && let Some((name, _)) = [
                ("group", !group.is_empty()),
                ("nodeSelector", node_selector.is_some()),
                ("serviceAccount", service_account.is_some()),
                ("service", service.is_some()),
            ]
            .into_iter()
            .find(|f| f.1)
        {
            s.error(
                &p,
                forbidden(format!(
                    "{name} cannot be set with other peers in appliedTo (set: {})",
                    set_names(&fields)
                )),
            );
        }
        if service.is_some() {
            // "egress rule cannot be applied to Services"
            if at == At::Rule(Direction::Egress) || (at == At::Spec && policy_has_egress) {
                s.error(
                    &p.field("service"),
                    forbidden("egress rule cannot be applied to Services"),
                );
            }
            services += 1;
        }
        for (name, sel) in [
            ("podSelector", pod_selector),
            ("namespaceSelector", namespace_selector),
            ("externalEntitySelector", external_entity_selector),
            ("nodeSelector", node_selector),
        ] {
            if let Some(sel) = sel {
                antrea_selector(s, sel, &p.field(name));
            }
        }
        schema_and_scope(s, &p, &fields, applied_to_schema(flavor, at), true);
    }
    if services > 0 && services < entries.len() {
        s.error(
            path,
            forbidden(
                "a rule/policy cannot be applied to Services and other peers at the same time",
            ),
        );
    }
}

/// What one rule's checks need of its policy.
struct RuleCtx {
    flavor: Flavor,
    d: Direction,
    /// The policy is in the baseline Tier.
    baseline: bool,
    /// The policy's first spec appliedTo entry is a Service.
    spec_on_service: bool,
    /// The policy's spec appliedTo has a nodeSelector.
    node_policy: bool,
}

fn rule(s: &mut Sink<'_>, path: &Path<'_>, r: &Rule, ctx: &RuleCtx, igmp_seen: &mut IgmpSeen) {
    let Rule {
        action,
        ports,
        protocols,
        l7_protocols,
        from,
        to,
        to_services,
        name: _,
        enable_logging,
        log_label,
        applied_to,
    } = r;
    let d = ctx.d;
    // validateTierForPassAction: "`Pass` action should not be set for Baseline Tier policy
    // rules".
    if ctx.baseline && *action == RuleAction::Pass {
        s.error(
            &path.field("action"),
            forbidden("`Pass` action should not be set for Baseline Tier policy rules"),
        );
    }
    applied_to_list(s, &path.field("appliedTo"), applied_to, ctx.flavor, At::Rule(d), false);
    // The CRD schemas: an ingress rule has `from` and no `to` / `toServices`, an egress
    // rule `to` and `toServices` and no `from`. A field outside the schema is reported
    // and not checked further (the API server would not keep it).
    let (peers, peers_name, other, other_name) = match d {
        Direction::Ingress => (from, "from", to, "to"),
        Direction::Egress => (to, "to", from, "from"),
    };
    let rule_schema = match (ctx.flavor, d) {
        (Flavor::Cluster, Direction::Ingress) => "Antrea ClusterNetworkPolicy ingress rule",
        (Flavor::Cluster, Direction::Egress) => "Antrea ClusterNetworkPolicy egress rule",
        (Flavor::Namespaced, Direction::Ingress) => "Antrea NetworkPolicy ingress rule",
        (Flavor::Namespaced, Direction::Egress) => "Antrea NetworkPolicy egress rule",
    };
    if !other.is_empty() {
        s.warning(&path.field(other_name), ProblemKind::OutsideSchema { schema: rule_schema });
    }
    let peers_path = path.field(peers_name);
    let on_service = d == Direction::Ingress
        && (ctx.spec_on_service || applied_to.first().is_some_and(|a| a.service.is_some()));
    for (j, peer) in peers.iter().enumerate() {
        peer_checked(s, &peers_path.index(j), peer, ctx.flavor, d, on_service);
    }
    if d == Direction::Egress {
        multicast(s, path, *action, to);
    }
    if !to_services.is_empty() {
        if d == Direction::Ingress {
            s.warning(
                &path.field("toServices"),
                ProblemKind::OutsideSchema { schema: rule_schema },
            );
        } else {
            // validatePeers: "`toServices` cannot be used with `to`, `ports` or
            // `protocols`" (Antrea also refuses an empty `ports: []` here, which decodes
            // as no ports).
            if !to.is_empty() || !ports.is_empty() || !protocols.is_empty() {
                s.error(
                    path,
                    forbidden("`toServices` cannot be used with `to`, `ports` or `protocols`"),
                );
            }
            s.warning(
                &path.field("toServices"),
                ProblemKind::Unsupported { feature: "toServices" },
            );
        }
    }
    let ports_path = path.field("ports");
    for (k, port) in ports.iter().enumerate() {
        port_checked(s, &ports_path.index(k), port);
    }
    protocols_checked(s, path, r, d, igmp_seen);
    if !l7_protocols.is_empty() {
        l7(s, path, r);
    }
    // checkLogLabel (a warning in Antrea too).
    if ctx.node_policy && *enable_logging && log_label.len() > MAX_NODE_LOG_LABEL {
        s.warning(
            &path.field("logLabel"),
            invalid(
                log_label,
                "LogLabels for Node NetworkPolicies are limited to 12 characters; Antrea \
                 truncates this one in kernel logs",
            ),
        );
    }
}

/// The peer fields a CRD schema has (`from` / `to` items), and its name for messages.
/// Which fields of `peer` are set, by their manifest names.
fn peer_fields(peer: &NetworkPolicyPeer) -> [(&'static str, bool); 10] {
    [
        ("ipBlock", peer.ip_block.is_some()),
        ("podSelector", peer.pod_selector.is_some()),
        ("namespaceSelector", peer.namespace_selector.is_some()),
        ("namespaces", peer.namespaces.is_some()),
        ("externalEntitySelector", peer.external_entity_selector.is_some()),
        ("group", !peer.group.is_empty()),
        ("fqdn", !peer.fqdn.is_empty()),
        ("serviceAccount", peer.service_account.is_some()),
        ("nodeSelector", peer.node_selector.is_some()),
        ("scope", peer.scope.is_some()),
    ]
}

/// Whether `peer`, in an ANNP (`namespaced`) or an ACNP rule of direction `d`, holds a key
/// outside that position's CRD schema (a key no peer has, `namespaces` in an ANNP, `scope`
/// in an egress peer, `fqdn` in an ingress one): the API server would prune it, so the
/// peer cannot be evaluated as written and fails closed
/// (`shared/reference/antrea-model.md` §9). Validation warns about each such key.
pub fn peer_outside_schema(peer: &NetworkPolicyPeer, namespaced: bool, d: Direction) -> bool {
    let flavor = if namespaced { Flavor::Namespaced } else { Flavor::Cluster };
    let (allowed, _) = peer_schema(flavor, d);
    !peer.unknown.is_empty()
        || peer_fields(peer).iter().any(|(name, set)| *set && !allowed.contains(name))
}

fn peer_schema(flavor: Flavor, d: Direction) -> (&'static [&'static str], &'static str) {
    match (flavor, d) {
        (Flavor::Cluster, Direction::Ingress) => (
            &[
                "ipBlock",
                "podSelector",
                "namespaceSelector",
                "namespaces",
                "group",
                "serviceAccount",
                "nodeSelector",
                "scope",
            ],
            "Antrea ClusterNetworkPolicy ingress peer",
        ),
        (Flavor::Cluster, Direction::Egress) => (
            &[
                "ipBlock",
                "podSelector",
                "namespaceSelector",
                "namespaces",
                "group",
                "fqdn",
                "serviceAccount",
                "nodeSelector",
            ],
            "Antrea ClusterNetworkPolicy egress peer",
        ),
        (Flavor::Namespaced, Direction::Ingress) => (
            &[
                "ipBlock",
                "podSelector",
                "namespaceSelector",
                "externalEntitySelector",
                "group",
                "nodeSelector",
                "scope",
            ],
            "Antrea NetworkPolicy ingress peer",
        ),
        (Flavor::Namespaced, Direction::Egress) => (
            &[
                "ipBlock",
                "podSelector",
                "namespaceSelector",
                "externalEntitySelector",
                "group",
                "fqdn",
                "nodeSelector",
            ],
            "Antrea NetworkPolicy egress peer",
        ),
    }
}

/// One `from` / `to` peer: `validate.go validatePeers` (`checkPeers`), `validateIPBlock`,
/// `checkSelectorsLabels`, `validateFQDNSelectors`, `validateAppliedToServiceIngressPeer`,
/// the CRD schema of the position, and what tierproxy does not evaluate.
fn peer_checked(
    s: &mut Sink<'_>,
    p: &Path<'_>,
    peer: &NetworkPolicyPeer,
    flavor: Flavor,
    d: Direction,
    on_service: bool,
) {
    let NetworkPolicyPeer {
        ip_block,
        pod_selector,
        namespace_selector,
        namespaces,
        external_entity_selector,
        group,
        fqdn,
        service_account,
        node_selector,
        scope,
        unknown,
    } = peer;
    // numFieldsSetInStruct counts every non-zero field, scope included.
    let fields = peer_fields(peer);
    for key in unknown.keys() {
        s.warning(&p.unknown(key), ProblemKind::OutsideSchema { schema: peer_schema(flavor, d).1 });
    }
    let n = set_count(&fields);
    let schema = peer_schema(flavor, d);
    let in_schema = |name: &str| schema.0.contains(&name);
    // "namespaces and namespaceSelector cannot be set at the same time for a single
    // NetworkPolicyPeer"
    if namespaces.is_some() && namespace_selector.is_some() && in_schema("namespaces") {
        s.error(
            p,
            forbidden(
                "namespaces and namespaceSelector cannot be set at the same time for a single \
                 NetworkPolicyPeer",
            ),
        );
    }
    if let Some(ns) = namespaces.as_ref().filter(|_| in_schema("namespaces")) {
        peer_namespaces(s, &p.field("namespaces"), ns);
    }
    if let Some(block) = ip_block {
        ip_block_checked(s, &p.field("ipBlock"), block);
    }
    // "<field> cannot be set with other peers in rules", the first that applies.
    if n > 1
        && let Some((name, _)) = [
            ("group", !group.is_empty()),
            ("serviceAccount", service_account.is_some()),
            ("nodeSelector", node_selector.is_some()),
        ]
        .into_iter()
        .find(|f| f.1)
    {
        s.error(
            p,
            forbidden(format!(
                "{name} cannot be set with other peers in rules (set: {})",
                set_names(&fields)
            )),
        );
    } else if ip_block.is_some() || !fqdn.is_empty() {
        // Not refused, but toAntreaPeerForCRD reads only the first of ipBlock, group,
        // fqdn, serviceAccount, nodeSelector and ignores the rest of the peer.
        let first = if ip_block.is_some() { "ipBlock" } else { "fqdn" };
        let ignored: Vec<&str> = fields
            .iter()
            .filter(|(name, set)| {
                *set && matches!(
                    *name,
                    "podSelector" | "namespaceSelector" | "namespaces" | "externalEntitySelector"
                ) || (*set && first == "ipBlock" && *name == "fqdn")
            })
            .map(|f| f.0)
            .collect();
        if !ignored.is_empty() {
            s.warning(
                p,
                invalid(
                    set_names(&fields),
                    format!(
                        "Antrea reads only the {first} of this peer and ignores {}",
                        ignored.join(", ")
                    ),
                ),
            );
        }
    }
    for (name, sel) in [
        ("podSelector", pod_selector),
        ("namespaceSelector", namespace_selector),
        ("externalEntitySelector", external_entity_selector),
        ("nodeSelector", node_selector),
    ] {
        if let Some(sel) = sel {
            antrea_selector(s, sel, &p.field(name));
        }
    }
    // validateFQDNSelectors (egress): `^[-0-9a-zA-Z.*]+$`.
    if d == Direction::Egress
        && !fqdn.is_empty()
        && !fqdn.bytes().all(|b| b.is_ascii_alphanumeric() || b"-.*".contains(&b))
    {
        s.error(&p.field("fqdn"), invalid(fqdn, "invalid characters in egress rule fqdn field"));
    }
    // validateAppliedToServiceIngressPeer.
    if on_service && (ip_block.is_none() || n > 1) {
        s.error(
            p,
            forbidden(
                "a rule/policy that is applied to Services can only use ipBlock to select \
                 workloads",
            ),
        );
    }
    schema_and_scope(s, p, &fields, schema, false);
    if *scope == Some(PeerScope::ClusterSet) && in_schema("scope") {
        s.warning(
            &p.field("scope"),
            ProblemKind::Unsupported { feature: "multi-cluster scope ClusterSet" },
        );
    }
}

/// `namespaces`: CRD `minProperties: 1`, `maxProperties: 1` ("only one matching criteria
/// can be specified in a single peer namespaces field"); `sameLabels` keys are label keys
/// ("Invalid label key in sameLabels rule").
fn peer_namespaces(s: &mut Sink<'_>, p: &Path<'_>, ns: &PeerNamespaces) {
    let PeerNamespaces { match_, same_labels } = ns;
    let members = [("match", match_.is_some()), ("sameLabels", same_labels.is_some())];
    if set_count(&members) != 1 {
        let found = if set_count(&members) == 0 { "none".to_owned() } else { set_names(&members) };
        s.error(p, ProblemKind::NotExactlyOne { fields: "match, sameLabels", found });
    }
    let labels_path = p.field("sameLabels");
    if same_labels.as_ref().is_some_and(Vec::is_empty) {
        // The CRD has no minItems; Antrea's `splitPeersByScope` drops such a peer.
        s.warning(
            &labels_path,
            invalid(
                "[]",
                "names no label: Antrea ignores this peer; tierproxy cannot evaluate it and \
                 fails closed (an Allow matches nothing through it, other actions apply to \
                 all the traffic the rule's ports select)",
            ),
        );
    }
    for (k, key) in same_labels.iter().flatten().enumerate() {
        let errs = qualified_name_errors(key);
        if !errs.is_empty() {
            s.error(&labels_path.index(k), invalid(key, errs.join("; ")));
        }
    }
}

/// `validateIPBlock`: "field 'cidr' is required in an ipBlock", CIDR syntax (also the
/// CRD's `format: cidr`), and "except CIDR %s is not a strict subset of CIDR %s".
fn ip_block_checked(s: &mut Sink<'_>, p: &Path<'_>, block: &IpBlock) {
    let IpBlock { cidr: block_cidr, except } = block;
    if block_cidr.is_empty() {
        s.error(&p.field("cidr"), ProblemKind::Required);
        return;
    }
    let net = match cidr::parse(block_cidr) {
        Ok(net) => net,
        Err(e) => {
            s.error(&p.field("cidr"), invalid(block_cidr, e.to_string()));
            return;
        }
    };
    let except_path = p.field("except");
    for (i, ex) in except.iter().enumerate() {
        match cidr::parse(ex) {
            Err(e) => s.error(&except_path.index(i), invalid(ex, e.to_string())),
            Ok(ex_net) if !net.contains(&ex_net) || ex_net.prefix_len() <= net.prefix_len() => s
                .error(
                    &except_path.index(i),
                    invalid(ex, format!("is not a strict subset of CIDR {block_cidr}")),
                ),
            Ok(_) => {}
        }
    }
}

/// `validateEgressMulticastAddress`, per egress rule: an ipBlock whose address (as
/// written, before masking) is multicast refuses Pass and Reject, unicast ipBlocks in the
/// same rule, and selectors beside an ipBlock in the same rule.
fn multicast(s: &mut Sink<'_>, path: &Path<'_>, action: RuleAction, to: &[NetworkPolicyPeer]) {
    let (mut multicast, mut unicast, mut others) = (false, false, false);
    for peer in to {
        let Some(block) = &peer.ip_block else { continue };
        // An unparsable cidr is reported by ip_block_checked.
        let Some(addr) = block.cidr.split_once('/').and_then(|(a, _)| a.parse::<IpAddr>().ok())
        else {
            continue;
        };
        if addr.is_multicast() {
            multicast = true;
        } else {
            unicast = true;
        }
        let NetworkPolicyPeer {
            pod_selector,
            namespace_selector,
            namespaces,
            external_entity_selector,
            service_account,
            node_selector,
            ..
        } = peer;
        others |= pod_selector.is_some()
            || namespace_selector.is_some()
            || namespaces.is_some()
            || external_entity_selector.is_some()
            || service_account.is_some()
            || node_selector.is_some();
    }
    if multicast && matches!(action, RuleAction::Pass | RuleAction::Reject) {
        s.error(
            &path.field("action"),
            forbidden("multicast does not support action Pass or Reject"),
        );
    }
    if multicast && unicast {
        s.error(
            &path.field("to"),
            forbidden("can not set multicast groupAddress and unicast ip address at the same time"),
        );
    }
    if multicast && others {
        s.error(
            &path.field("to"),
            forbidden("can not set multicast groupAddress and selectors at the same time"),
        );
    }
}

/// One `ports` item: the CRD's protocol enum, `validate.go validatePort`, and warnings for
/// what the CRD accepts but cannot match.
fn port_checked(s: &mut Sink<'_>, p: &Path<'_>, port: &NetworkPolicyPort) {
    let NetworkPolicyPort { protocol, port, end_port, source_port, source_end_port } = port;
    // CRD: `protocol: {enum: [TCP, UDP, SCTP]}`.
    if let Some(proto) = protocol
        && !matches!(proto.as_str(), "TCP" | "UDP" | "SCTP")
    {
        s.error(
            &p.field("protocol"),
            ProblemKind::NotInEnum { value: proto.clone(), allowed: PROTOCOLS },
        );
    }
    let end_path = p.field("endPort");
    if let Some(end) = end_port {
        match port {
            None => s.error(
                &end_path,
                invalid(end.to_string(), "if `endPort` is specified `port` must be specified"),
            ),
            Some(IntOrString::String(_)) => s.error(
                &end_path,
                invalid(end.to_string(), "if `port` is a string `endPort` cannot be specified"),
            ),
            Some(IntOrString::Int(n)) if end < n => s.error(
                &end_path,
                invalid(end.to_string(), "`endPort` should be greater than or equal to `port`"),
            ),
            Some(IntOrString::Int(_)) => {}
        }
    }
    if let Some(end) = source_end_port {
        match source_port {
            None => s.error(
                &p.field("sourceEndPort"),
                invalid(
                    end.to_string(),
                    "if `sourceEndPort` is specified `sourcePort` must be specified",
                ),
            ),
            Some(start) if end < start => s.error(
                &p.field("sourceEndPort"),
                invalid(
                    end.to_string(),
                    "`sourceEndPort` should be greater than or equal to `sourcePort`",
                ),
            ),
            Some(_) => {}
        }
    }
    // Neither the CRD (`x-kubernetes-int-or-string`, `integer`) nor the webhook bounds
    // port numbers.
    let beyond = "outside 1..65535: Antrea accepts it, but no TCP, UDP or SCTP port has it";
    match port {
        Some(IntOrString::Int(n)) if !(1..=MAX_PORT).contains(n) => {
            s.warning(&p.field("port"), invalid(n.to_string(), beyond));
        }
        Some(IntOrString::String(name)) => check_named_port(s, &p.field("port"), name),
        _ => {}
    }
    if let Some(end) = end_port
        && !(1..=MAX_PORT).contains(end)
    {
        s.warning(&end_path, invalid(end.to_string(), beyond));
    }
    if source_port.is_some() {
        s.warning(
            &p.field("sourcePort"),
            ProblemKind::Unsupported { feature: "matching source ports" },
        );
    } else if source_end_port.is_some() {
        s.warning(
            &p.field("sourceEndPort"),
            ProblemKind::Unsupported { feature: "matching source ports" },
        );
    }
}

/// IGMP types the CRD allows: ingress `enum: [0x11]` (query), egress `[0x12, 0x16, 0x22]`
/// (reports v1, v2, v3).
fn igmp_types(d: Direction) -> (&'static [i32], &'static str) {
    match d {
        Direction::Ingress => (&[0x11], "17 (0x11)"),
        Direction::Egress => (&[0x12, 0x16, 0x22], "18, 22, 34 (0x12, 0x16, 0x22)"),
    }
}

/// `protocols`: the CRD (`oneOf` icmp/igmp, ICMP type and code 0–255, the IGMP type
/// enum, `groupAddress` an IP) and `validate.go validateMulticastIGMP` /
/// `validateIGMPProtocol`.
fn protocols_checked(
    s: &mut Sink<'_>,
    path: &Path<'_>,
    r: &Rule,
    d: Direction,
    seen: &mut IgmpSeen,
) {
    let protocols_path = path.field("protocols");
    for (k, proto) in r.protocols.iter().enumerate() {
        let p = protocols_path.index(k);
        let NetworkPolicyProtocol { icmp, igmp } = proto;
        let members = [("icmp", icmp.is_some()), ("igmp", igmp.is_some())];
        if set_count(&members) != 1 {
            let found =
                if set_count(&members) == 0 { "none".to_owned() } else { set_names(&members) };
            s.error(&p, ProblemKind::NotExactlyOne { fields: "icmp, igmp", found });
        }
        if let Some(IcmpProtocol { icmp_type, icmp_code }) = icmp {
            seen.icmp = true;
            for (name, v) in [("icmpType", icmp_type), ("icmpCode", icmp_code)] {
                if let Some(v) = v
                    && !(0..=255).contains(v)
                {
                    s.error(
                        &p.field("icmp").field(name),
                        ProblemKind::OutOfRange { value: (*v).into(), min: 0, max: 255 },
                    );
                }
            }
        }
        if let Some(IgmpProtocol { igmp_type, group_address }) = igmp {
            seen.igmp = true;
            let (allowed, names) = igmp_types(d);
            if let Some(t) = igmp_type
                && !allowed.contains(t)
            {
                s.error(
                    &p.field("igmp").field("igmpType"),
                    ProblemKind::NotInEnum { value: t.to_string(), allowed: names },
                );
            }
            if let Some(addr) = group_address.as_deref().filter(|a| !a.is_empty()) {
                match addr.parse::<IpAddr>() {
                    // CRD: `oneOf: [{format: ipv4}, {format: ipv6}]`.
                    Err(_) => s.error(
                        &p.field("igmp").field("groupAddress"),
                        invalid(addr, "must be an IPv4 or IPv6 address"),
                    ),
                    Ok(ip) if !ip.is_multicast() => s.error(
                        &p.field("igmp").field("groupAddress"),
                        invalid(addr, "groupAddress is not a multicast address"),
                    ),
                    Ok(_) => {}
                }
            }
            if matches!(r.action, RuleAction::Pass | RuleAction::Reject) {
                s.error(
                    &path.field("action"),
                    forbidden("protocol IGMP does not support Pass or Reject"),
                );
            }
        }
    }
    // The flags carry over from earlier rules (see IgmpSeen).
    if seen.igmp
        && (!r.ports.is_empty()
            || !r.to_services.is_empty()
            || !r.from.is_empty()
            || !r.to.is_empty()
            || seen.icmp)
    {
        s.error(
            path,
            forbidden(
                "protocol IGMP can not be used with other protocols or other properties like \
                 from, to (Antrea checks this across the policy's rules in order, ingress \
                 first)",
            ),
        );
    }
}

/// `l7Protocols`: the CRD's `oneOf` http/tls and `validate.go validateL7Protocols`; then
/// a warning that tierproxy does not evaluate it (Antrea also needs its alpha
/// `L7NetworkPolicy` feature gate for it).
fn l7(s: &mut Sink<'_>, path: &Path<'_>, r: &Rule) {
    let l7_path = path.field("l7Protocols");
    let mut http = false;
    for (k, proto) in r.l7_protocols.iter().enumerate() {
        let L7Protocol { http: h, tls } = proto;
        let members = [("http", h.is_some()), ("tls", tls.is_some())];
        if set_count(&members) != 1 {
            let found =
                if set_count(&members) == 0 { "none".to_owned() } else { set_names(&members) };
            s.error(&l7_path.index(k), ProblemKind::NotExactlyOne { fields: "http, tls", found });
        }
        http |= h.is_some();
    }
    if r.action != RuleAction::Allow {
        s.error(&path.field("action"), forbidden("layer 7 protocols only support Allow"));
    }
    if !r.to_services.is_empty() {
        s.error(path, forbidden("layer 7 protocols can not be used with toServices"));
    }
    if http {
        for (k, port) in r.ports.iter().enumerate() {
            if port.protocol.as_deref().is_some_and(|p| p != "TCP") {
                s.error(
                    &path.field("ports").index(k).field("protocol"),
                    forbidden(
                        "HTTP protocol can only be used when layer 4 protocol is TCP or unset",
                    ),
                );
            }
        }
        for (k, proto) in r.protocols.iter().enumerate() {
            if proto.icmp.is_some() || proto.igmp.is_some() {
                s.error(
                    &path.field("protocols").index(k),
                    forbidden("HTTP protocol can not be used with protocol IGMP or ICMP"),
                );
            }
        }
    }
    s.warning(&l7_path, ProblemKind::Unsupported { feature: "layer-7 matching (l7Protocols)" });
}

#[cfg(test)]
pub(super) mod tests {
    use serde_json::json;

    use super::*;
    use crate::policy::validate::table::*;

    const IN_ACNP_INGRESS: &str = "Antrea ClusterNetworkPolicy ingress peer";

    fn outside(schema: &'static str) -> ProblemKind {
        ProblemKind::OutsideSchema { schema }
    }

    fn unsupported(feature: &'static str) -> ProblemKind {
        ProblemKind::Unsupported { feature }
    }

    fn forb(reason: &str) -> ProblemKind {
        forbidden(reason)
    }

    /// This file's rows of the table (one per rule); each row's name and comment cite the
    /// Antrea source of the rule.
    pub(in crate::policy::validate) fn rows() -> Vec<Row> {
        use ProblemKind as P;
        use Target::*;
        vec![
            // ---- Tier (tier.yaml) --------------------------------------------------------
            // CRD tier.yaml: priority minimum 0, maximum 255.
            row(
                "antrea_tier_priority_max_255",
                Tier,
                |v| v["spec"]["priority"] = json!(256),
                vec![err("spec.priority", range(256, 0, 255))],
            ),
            row(
                "antrea_tier_priority_min_0",
                Tier,
                |v| v["spec"]["priority"] = json!(-1),
                vec![err("spec.priority", range(-1, 0, 255))],
            ),
            // apimachinery ValidateObjectMeta: cluster-scoped kinds drop the namespace.
            row(
                "antrea_tier_cluster_scoped",
                Tier,
                |v| v["metadata"]["namespace"] = json!("x"),
                vec![warn(
                    "metadata.namespace",
                    inv(
                        "x",
                        "this kind is cluster-scoped; the API server drops metadata.namespace",
                    ),
                )],
            ),
            // ---- ACNP / ANNP: spec ----------------------------------------------------------
            // validate.go validateTierForPolicy: "tier %s does not exist".
            row(
                "antrea_unknown_tier",
                Acnp,
                |v| v["spec"]["tier"] = json!("nope"),
                vec![err(
                    "spec.tier",
                    inv(
                        "nope",
                        "tier does not exist: no static Tier and no Tier object has this name",
                    ),
                )],
            ),
            // tier.go staticTierSet: only the six legacy spellings are case-folded.
            row(
                "antrea_tier_no_case_folding",
                Annp,
                |v| v["spec"]["tier"] = json!("EMERGENCY"),
                vec![err(
                    "spec.tier",
                    inv(
                        "EMERGENCY",
                        "tier does not exist: no static Tier and no Tier object has this name",
                    ),
                )],
            ),
            row(
                "antrea_tier_legacy_spelling_ok",
                Acnp,
                |v| v["spec"]["tier"] = json!("SecurityOps"),
                vec![],
            ),
            // A custom Tier of the table (the table rows run with Tier "dev").
            row("antrea_tier_custom_ok", Annp, |v| v["spec"]["tier"] = json!("dev"), vec![]),
            // mutate.go: an omitted tier is application.
            row(
                "antrea_tier_omitted_ok",
                Acnp,
                |v| {
                    v["spec"].as_object_mut().unwrap().remove("tier");
                },
                vec![],
            ),
            // CRD: priority minimum 1.0, maximum 10000.0 (a float).
            row(
                "antrea_priority_min_1",
                Acnp,
                |v| v["spec"]["priority"] = json!(0.5),
                vec![err("spec.priority", inv("0.5", "must be between 1 and 10000"))],
            ),
            row(
                "antrea_priority_max_10000",
                Annp,
                |v| v["spec"]["priority"] = json!(10000.5),
                vec![err("spec.priority", inv("10000.5", "must be between 1 and 10000"))],
            ),
            row("antrea_priority_float_ok", Acnp, |v| v["spec"]["priority"] = json!(10000), vec![]),
            // validate.go validateTierForPassAction.
            row(
                "antrea_pass_refused_in_baseline_tier",
                Acnp,
                |v| {
                    v["spec"]["tier"] = json!("baseline");
                    v["spec"]["egress"][0]["action"] = json!("Pass");
                },
                vec![err(
                    "spec.egress[0].action",
                    forb("`Pass` action should not be set for Baseline Tier policy rules"),
                )],
            ),
            row(
                "antrea_pass_refused_in_legacy_baseline_tier",
                Annp,
                |v| {
                    v["spec"]["tier"] = json!("Baseline");
                    v["spec"]["ingress"][0]["action"] = json!("Pass");
                },
                vec![err(
                    "spec.ingress[0].action",
                    forb("`Pass` action should not be set for Baseline Tier policy rules"),
                )],
            ),
            row(
                "antrea_reject_ok_in_baseline_tier",
                Acnp,
                |v| {
                    v["spec"]["tier"] = json!("baseline");
                    v["spec"]["egress"][0]["action"] = json!("Reject");
                },
                vec![],
            ),
            // ---- appliedTo (validate.go validateAppliedTo) ------------------------------
            row(
                "antrea_applied_to_in_spec_and_rules",
                Acnp,
                |v| {
                    v["spec"]["ingress"][0]["appliedTo"] = json!([{"podSelector": {}}]);
                },
                vec![err(
                    "spec.appliedTo",
                    forb("appliedTo should not be set in both spec and rules"),
                )],
            ),
            row(
                "antrea_applied_to_neither",
                Annp,
                |v| {
                    v["spec"].as_object_mut().unwrap().remove("appliedTo");
                },
                vec![err(
                    "spec.appliedTo",
                    forb("appliedTo needs to be set in either spec or rules"),
                )],
            ),
            row(
                "antrea_applied_to_in_some_rules",
                Acnp,
                |v| {
                    v["spec"].as_object_mut().unwrap().remove("appliedTo");
                    v["spec"]["ingress"][0]["appliedTo"] = json!([{"podSelector": {}}]);
                },
                vec![err(
                    "spec.egress[0].appliedTo",
                    forb("appliedTo field should either be set in all rules or in none of them"),
                )],
            ),
            row(
                "antrea_applied_to_in_every_rule_ok",
                Acnp,
                |v| {
                    v["spec"].as_object_mut().unwrap().remove("appliedTo");
                    v["spec"]["ingress"][0]["appliedTo"] = json!([{"podSelector": {}}]);
                    v["spec"]["egress"][0]["appliedTo"] = json!([{"namespaceSelector": {}}]);
                },
                vec![],
            ),
            // checkAppliedTo: "nodeSelector cannot be set with other peers in appliedTo".
            row(
                "antrea_applied_to_node_selector_alone",
                Acnp,
                |v| {
                    v["spec"]["appliedTo"][0]["nodeSelector"] = json!({});
                },
                vec![
                    err(
                        "spec.appliedTo[0]",
                        forb(
                            "nodeSelector cannot be set with other peers in appliedTo (set: podSelector, namespaceSelector, nodeSelector)",
                        ),
                    ),
                    warn(
                        "spec.appliedTo[0].nodeSelector",
                        unsupported("applying a policy to Nodes (Node policies)"),
                    ),
                ],
            ),
            // checkAppliedTo: "egress rule cannot be applied to Services".
            row(
                "antrea_applied_to_service_not_with_egress",
                Acnp,
                |v| {
                    v["spec"]["appliedTo"] = json!([{"service": {"name": "s", "namespace": "n"}}]);
                    v["spec"]["ingress"][0]["from"] = json!([{"podSelector": {}}]);
                },
                vec![
                    err(
                        "spec.appliedTo[0].service",
                        forb("egress rule cannot be applied to Services"),
                    ),
                    warn(
                        "spec.appliedTo[0].service",
                        unsupported("applying a policy to a NodePort Service"),
                    ),
                    err(
                        "spec.ingress[0].from[0]",
                        forb(
                            "a rule/policy that is applied to Services can only use ipBlock to select workloads",
                        ),
                    ),
                ],
            ),
            // checkSelectorsLabels: matchLabels keys and values (errors); the rest of
            // ValidateLabelSelector is not run on CRDs (warnings), the operator enum is the
            // CRD's (error).
            row(
                "antrea_applied_to_match_labels_checked",
                Annp,
                |v| {
                    v["spec"]["appliedTo"][0]["podSelector"]["matchLabels"] =
                        json!({"app": "bad value"});
                },
                vec![err(
                    "spec.appliedTo[0].podSelector.matchLabels[app]",
                    inv(
                        "bad value",
                        "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character",
                    ),
                )],
            ),
            row(
                "antrea_selector_operator_enum",
                Acnp,
                |v| {
                    v["spec"]["ingress"][0]["from"][0]["podSelector"] = json!({"matchExpressions": [{"key": "a", "operator": "Gt", "values": ["1"]}]});
                },
                vec![err(
                    "spec.ingress[0].from[0].podSelector.matchExpressions[0].operator",
                    not_in("Gt", "In, NotIn, Exists, DoesNotExist"),
                )],
            ),
            row(
                "antrea_selector_expression_values_warned",
                Acnp,
                |v| {
                    v["spec"]["ingress"][0]["from"][0]["podSelector"] = json!({"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["1"]}]});
                },
                vec![warn(
                    "spec.ingress[0].from[0].podSelector.matchExpressions[0].values",
                    inv("1", "may not be specified when `operator` is 'Exists' or 'DoesNotExist'"),
                )],
            ),
            // Schemas: the ANNP appliedTo has no namespaceSelector (§11.5 of the model).
            row(
                "antrea_annp_applied_to_namespace_selector_outside_schema",
                Annp,
                |v| {
                    v["spec"]["appliedTo"][0]["namespaceSelector"] = json!({});
                },
                vec![warn(
                    "spec.appliedTo[0].namespaceSelector",
                    outside("Antrea NetworkPolicy spec.appliedTo"),
                )],
            ),
            row(
                "antrea_applied_to_group_unsupported",
                Annp,
                |v| {
                    v["spec"]["appliedTo"] = json!([{"group": "g"}]);
                },
                vec![warn(
                    "spec.appliedTo[0].group",
                    unsupported("a ClusterGroup/Group reference"),
                )],
            ),
            // ---- rules --------------------------------------------------------------------
            // validate.go validateRuleName: one name set across directions.
            row(
                "antrea_rule_names_unique",
                Acnp,
                |v| v["spec"]["egress"][0]["name"] = json!("allow-web"),
                vec![err(
                    "spec.egress[0].name",
                    inv("allow-web", "rule names must be unique within the policy"),
                )],
            ),
            // mutate.go generateRuleNames: equal unnamed rules get equal names.
            row(
                "antrea_equal_unnamed_rules_collide",
                Annp,
                |v| {
                    let r = v["spec"]["egress"][0].clone();
                    v["spec"]["egress"] = json!([r, r]);
                },
                vec![err(
                    "spec.egress[1]",
                    forb(
                        "equal to spec.egress[0] and unnamed: Antrea's mutating webhook gives both the name egress-drop-<hash of the rule>, and rule names must be unique within the policy",
                    ),
                )],
            ),
            // CRD schema: an ingress rule has no `to`, an egress rule no `from`.
            row(
                "antrea_ingress_to_outside_schema",
                Acnp,
                |v| v["spec"]["ingress"][0]["to"] = json!([{"podSelector": {}}]),
                vec![warn(
                    "spec.ingress[0].to",
                    outside("Antrea ClusterNetworkPolicy ingress rule"),
                )],
            ),
            row(
                "antrea_egress_from_outside_schema",
                Annp,
                |v| v["spec"]["egress"][0]["from"] = json!([{"podSelector": {}}]),
                vec![warn("spec.egress[0].from", outside("Antrea NetworkPolicy egress rule"))],
            ),
            // ---- peers (validate.go validatePeers) ---------------------------------------
            row(
                "antrea_namespaces_with_namespace_selector",
                Acnp,
                |v| {
                    v["spec"]["ingress"][0]["from"][1] =
                        json!({"namespaces": {"match": "Self"}, "namespaceSelector": {}});
                },
                vec![err(
                    "spec.ingress[0].from[1]",
                    forb(
                        "namespaces and namespaceSelector cannot be set at the same time for a single NetworkPolicyPeer",
                    ),
                )],
            ),
            // CRD namespaces minProperties 1 / maxProperties 1.
            row(
                "antrea_namespaces_exactly_one_criterion",
                Acnp,
                |v| {
                    v["spec"]["ingress"][0]["from"][1] =
                        json!({"namespaces": {"match": "Self", "sameLabels": ["t"]}});
                },
                vec![err(
                    "spec.ingress[0].from[1].namespaces",
                    one_of("match, sameLabels", "match, sameLabels"),
                )],
            ),
            row(
                "antrea_namespaces_empty",
                Acnp,
                |v| v["spec"]["ingress"][0]["from"][1] = json!({"namespaces": {}}),
                vec![err(
                    "spec.ingress[0].from[1].namespaces",
                    one_of("match, sameLabels", "none"),
                )],
            ),
            // "Invalid label key in sameLabels rule".
            row(
                "antrea_same_labels_keys_qualified",
                Acnp,
                |v| {
                    v["spec"]["ingress"][0]["from"][1] =
                        json!({"namespaces": {"sameLabels": ["-x"]}})
                },
                vec![err(
                    "spec.ingress[0].from[1].namespaces.sameLabels[0]",
                    inv(
                        "-x",
                        "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character",
                    ),
                )],
            ),
            // ANNP schema: no namespaces in peers (docs "Key differences").
            row(
                "antrea_annp_namespaces_outside_schema",
                Annp,
                |v| v["spec"]["ingress"][0]["from"][0] = json!({"namespaces": {"match": "Self"}}),
                vec![warn(
                    "spec.ingress[0].from[0].namespaces",
                    outside("Antrea NetworkPolicy ingress peer"),
                )],
            ),
            // validateIPBlock.
            row(
                "antrea_ip_block_cidr_required",
                Acnp,
                |v| v["spec"]["egress"][0]["to"][0]["ipBlock"] = json!({"except": []}),
                vec![err("spec.egress[0].to[0].ipBlock.cidr", P::Required)],
            ),
            row(
                "antrea_ip_block_cidr_syntax",
                Acnp,
                |v| v["spec"]["egress"][0]["to"][0]["ipBlock"]["cidr"] = json!("10.0.0.0"),
                vec![err(
                    "spec.egress[0].to[0].ipBlock.cidr",
                    inv("10.0.0.0", "missing /prefix length"),
                )],
            ),
            row(
                "antrea_except_strictly_inside_cidr",
                Acnp,
                |v| {
                    v["spec"]["egress"][0]["to"][0]["ipBlock"]["except"] =
                        json!(["10.0.0.0/8", "192.168.0.0/16"])
                },
                vec![
                    err(
                        "spec.egress[0].to[0].ipBlock.except[0]",
                        inv("10.0.0.0/8", "is not a strict subset of CIDR 10.0.0.0/8"),
                    ),
                    err(
                        "spec.egress[0].to[0].ipBlock.except[1]",
                        inv("192.168.0.0/16", "is not a strict subset of CIDR 10.0.0.0/8"),
                    ),
                ],
            ),
            // "group cannot be set with other peers in rules" (scope counts as a field).
            row(
                "antrea_group_alone_in_peer",
                Acnp,
                |v| v["spec"]["ingress"][0]["from"][0] = json!({"group": "g", "scope": "Cluster"}),
                vec![
                    err(
                        "spec.ingress[0].from[0]",
                        forb("group cannot be set with other peers in rules (set: group, scope)"),
                    ),
                    warn(
                        "spec.ingress[0].from[0].group",
                        unsupported("a ClusterGroup/Group reference"),
                    ),
                ],
            ),
            row(
                "antrea_node_selector_alone_in_peer",
                Annp,
                |v| {
                    v["spec"]["egress"][0]["to"][0] = json!({"nodeSelector": {}, "podSelector": {}})
                },
                vec![err(
                    "spec.egress[0].to[0]",
                    forb(
                        "nodeSelector cannot be set with other peers in rules (set: podSelector, nodeSelector)",
                    ),
                )],
            ),
            // crd_utils.go toAntreaPeerForCRD: ipBlock wins over the selectors beside it.
            row(
                "antrea_ip_block_with_selector_ignores_it",
                Acnp,
                |v| v["spec"]["egress"][0]["to"][0]["podSelector"] = json!({}),
                vec![warn(
                    "spec.egress[0].to[0]",
                    inv(
                        "ipBlock, podSelector",
                        "Antrea reads only the ipBlock of this peer and ignores podSelector",
                    ),
                )],
            ),
            // validateFQDNSelectors, and fqdn not in the ingress schema.
            row(
                "antrea_fqdn_characters",
                Acnp,
                |v| v["spec"]["egress"][0]["to"][0] = json!({"fqdn": "exa mple.com"}),
                vec![
                    err(
                        "spec.egress[0].to[0].fqdn",
                        inv("exa mple.com", "invalid characters in egress rule fqdn field"),
                    ),
                    warn("spec.egress[0].to[0].fqdn", unsupported("an FQDN peer")),
                ],
            ),
            row(
                "antrea_fqdn_unsupported",
                Annp,
                |v| v["spec"]["egress"][0]["to"][0] = json!({"fqdn": "*.example.com"}),
                vec![warn("spec.egress[0].to[0].fqdn", unsupported("an FQDN peer"))],
            ),
            row(
                "antrea_ingress_fqdn_outside_schema",
                Acnp,
                |v| v["spec"]["ingress"][0]["from"][0] = json!({"fqdn": "example.com"}),
                vec![warn("spec.ingress[0].from[0].fqdn", outside(IN_ACNP_INGRESS))],
            ),
            row(
                "antrea_service_account_unsupported",
                Acnp,
                |v| {
                    v["spec"]["ingress"][0]["from"][0] =
                        json!({"serviceAccount": {"name": "a", "namespace": "b"}})
                },
                vec![warn(
                    "spec.ingress[0].from[0].serviceAccount",
                    unsupported("selection by ServiceAccount"),
                )],
            ),
            row(
                "antrea_acnp_external_entity_outside_schema",
                Acnp,
                |v| v["spec"]["ingress"][0]["from"][0] = json!({"externalEntitySelector": {}}),
                vec![warn(
                    "spec.ingress[0].from[0].externalEntitySelector",
                    outside(IN_ACNP_INGRESS),
                )],
            ),
            row(
                "antrea_annp_external_entity_unsupported",
                Annp,
                |v| v["spec"]["ingress"][0]["from"][0] = json!({"externalEntitySelector": {}}),
                vec![warn(
                    "spec.ingress[0].from[0].externalEntitySelector",
                    unsupported("selection of ExternalEntities"),
                )],
            ),
            row(
                "antrea_scope_cluster_set_unsupported",
                Acnp,
                |v| v["spec"]["ingress"][0]["from"][0]["scope"] = json!("ClusterSet"),
                vec![warn(
                    "spec.ingress[0].from[0].scope",
                    unsupported("multi-cluster scope ClusterSet"),
                )],
            ),
            row(
                "antrea_egress_scope_outside_schema",
                Acnp,
                |v| v["spec"]["egress"][0]["to"][1]["scope"] = json!("Cluster"),
                vec![warn(
                    "spec.egress[0].to[1].scope",
                    outside("Antrea ClusterNetworkPolicy egress peer"),
                )],
            ),
            // validatePeers: toServices excludes to, ports and protocols.
            row(
                "antrea_to_services_alone",
                Acnp,
                |v| v["spec"]["egress"][0]["toServices"] = json!([{"name": "s", "namespace": "n"}]),
                vec![
                    err(
                        "spec.egress[0]",
                        forb("`toServices` cannot be used with `to`, `ports` or `protocols`"),
                    ),
                    warn("spec.egress[0].toServices", unsupported("toServices")),
                ],
            ),
            // ---- ports (validate.go validatePort, CRD protocol enum) ----------------------
            row(
                "antrea_port_protocol_enum",
                Acnp,
                |v| v["spec"]["ingress"][0]["ports"][0]["protocol"] = json!("ICMP"),
                vec![err("spec.ingress[0].ports[0].protocol", not_in("ICMP", "TCP, UDP, SCTP"))],
            ),
            row(
                "antrea_end_port_requires_port",
                Acnp,
                |v| v["spec"]["ingress"][0]["ports"][0] = json!({"endPort": 90}),
                vec![err(
                    "spec.ingress[0].ports[0].endPort",
                    inv("90", "if `endPort` is specified `port` must be specified"),
                )],
            ),
            row(
                "antrea_end_port_needs_numeric_port",
                Annp,
                |v| v["spec"]["ingress"][0]["ports"][0] = json!({"port": "http", "endPort": 90}),
                vec![err(
                    "spec.ingress[0].ports[0].endPort",
                    inv("90", "if `port` is a string `endPort` cannot be specified"),
                )],
            ),
            row(
                "antrea_end_port_not_below_port",
                Acnp,
                |v| v["spec"]["ingress"][0]["ports"][0]["endPort"] = json!(79),
                vec![err(
                    "spec.ingress[0].ports[0].endPort",
                    inv("79", "`endPort` should be greater than or equal to `port`"),
                )],
            ),
            row(
                "antrea_end_port_equal_ok",
                Acnp,
                |v| v["spec"]["ingress"][0]["ports"][0]["endPort"] = json!(80),
                vec![],
            ),
            row(
                "antrea_port_beyond_65535_warned",
                Acnp,
                |v| v["spec"]["ingress"][0]["ports"][0]["port"] = json!(70000),
                vec![warn(
                    "spec.ingress[0].ports[0].port",
                    inv(
                        "70000",
                        "outside 1..65535: Antrea accepts it, but no TCP, UDP or SCTP port has it",
                    ),
                )],
            ),
            row(
                "antrea_source_port_unsupported",
                Acnp,
                |v| v["spec"]["ingress"][0]["ports"][0]["sourcePort"] = json!(1000),
                vec![warn(
                    "spec.ingress[0].ports[0].sourcePort",
                    unsupported("matching source ports"),
                )],
            ),
            row(
                "antrea_source_end_port_not_below",
                Acnp,
                |v| {
                    v["spec"]["ingress"][0]["ports"][0]["sourcePort"] = json!(1000);
                    v["spec"]["ingress"][0]["ports"][0]["sourceEndPort"] = json!(999);
                },
                vec![
                    err(
                        "spec.ingress[0].ports[0].sourceEndPort",
                        inv(
                            "999",
                            "`sourceEndPort` should be greater than or equal to `sourcePort`",
                        ),
                    ),
                    warn(
                        "spec.ingress[0].ports[0].sourcePort",
                        unsupported("matching source ports"),
                    ),
                ],
            ),
            // ---- protocols (CRD, validateMulticastIGMP) -----------------------------------
            row(
                "antrea_protocol_one_of_icmp_igmp",
                Acnp,
                |v| v["spec"]["ingress"][0]["protocols"] = json!([{}]),
                vec![err("spec.ingress[0].protocols[0]", one_of("icmp, igmp", "none"))],
            ),
            row(
                "antrea_icmp_type_max_255",
                Acnp,
                |v| v["spec"]["ingress"][0]["protocols"] = json!([{"icmp": {"icmpType": 256}}]),
                vec![err("spec.ingress[0].protocols[0].icmp.icmpType", range(256, 0, 255))],
            ),
            row(
                "antrea_igmp_type_enum_egress",
                Acnp,
                |v| {
                    v["spec"]["egress"][0] =
                        json!({"action": "Allow", "protocols": [{"igmp": {"igmpType": 17}}]})
                },
                vec![err(
                    "spec.egress[0].protocols[0].igmp.igmpType",
                    not_in("17", "18, 22, 34 (0x12, 0x16, 0x22)"),
                )],
            ),
            row(
                "antrea_igmp_group_multicast",
                Acnp,
                |v| v["spec"]["egress"][0] = json!({"action": "Allow", "protocols": [{"igmp": {"groupAddress": "10.0.0.1"}}]}),
                vec![err(
                    "spec.egress[0].protocols[0].igmp.groupAddress",
                    inv("10.0.0.1", "groupAddress is not a multicast address"),
                )],
            ),
            row(
                "antrea_igmp_not_with_peers",
                Acnp,
                |v| v["spec"]["egress"][0]["protocols"] = json!([{"igmp": {}}]),
                vec![err(
                    "spec.egress[0]",
                    forb(
                        "protocol IGMP can not be used with other protocols or other properties like from, to (Antrea checks this across the policy's rules in order, ingress first)",
                    ),
                )],
            ),
            row(
                "antrea_igmp_not_pass",
                Acnp,
                |v| v["spec"]["egress"][0] = json!({"action": "Pass", "protocols": [{"igmp": {}}]}),
                vec![err(
                    "spec.egress[0].action",
                    forb("protocol IGMP does not support Pass or Reject"),
                )],
            ),
            // validateEgressMulticastAddress.
            row(
                "antrea_multicast_not_reject",
                Acnp,
                |v| {
                    v["spec"]["egress"][0] =
                        json!({"action": "Reject", "to": [{"ipBlock": {"cidr": "224.0.0.0/4"}}]})
                },
                vec![err(
                    "spec.egress[0].action",
                    forb("multicast does not support action Pass or Reject"),
                )],
            ),
            row(
                "antrea_multicast_not_with_unicast",
                Acnp,
                |v| v["spec"]["egress"][0]["to"][1] = json!({"ipBlock": {"cidr": "224.0.0.0/4"}}),
                vec![err(
                    "spec.egress[0].to",
                    forb(
                        "can not set multicast groupAddress and unicast ip address at the same time",
                    ),
                )],
            ),
            // ---- l7Protocols (validateL7Protocols) ---------------------------------------
            row(
                "antrea_l7_only_allow",
                Acnp,
                |v| v["spec"]["egress"][0]["l7Protocols"] = json!([{"tls": {"sni": "a"}}]),
                vec![
                    err("spec.egress[0].action", forb("layer 7 protocols only support Allow")),
                    warn(
                        "spec.egress[0].l7Protocols",
                        unsupported("layer-7 matching (l7Protocols)"),
                    ),
                ],
            ),
            row(
                "antrea_l7_http_needs_tcp",
                Acnp,
                |v| {
                    v["spec"]["egress"][0]["action"] = json!("Allow");
                    v["spec"]["egress"][0]["l7Protocols"] = json!([{"http": {"path": "/"}}]);
                },
                vec![
                    err(
                        "spec.egress[0].ports[0].protocol",
                        forb(
                            "HTTP protocol can only be used when layer 4 protocol is TCP or unset",
                        ),
                    ),
                    warn(
                        "spec.egress[0].l7Protocols",
                        unsupported("layer-7 matching (l7Protocols)"),
                    ),
                ],
            ),
            // checkLogLabel (a warning in Antrea too).
            row(
                "antrea_node_policy_log_label_12",
                Acnp,
                |v| {
                    v["spec"]["appliedTo"] = json!([{"nodeSelector": {}}]);
                    v["spec"]["egress"][0]["enableLogging"] = json!(true);
                    v["spec"]["egress"][0]["logLabel"] = json!("thirteen-char");
                },
                vec![
                    warn(
                        "spec.appliedTo[0].nodeSelector",
                        unsupported("applying a policy to Nodes (Node policies)"),
                    ),
                    warn(
                        "spec.egress[0].logLabel",
                        inv(
                            "thirteen-char",
                            "LogLabels for Node NetworkPolicies are limited to 12 characters; Antrea truncates this one in kernel logs",
                        ),
                    ),
                ],
            ),
        ]
    }

    #[test]
    fn each_rule_reports_exactly_its_problem() {
        check(rows());
    }

    /// The quirk of `validateMulticastIGMP`: its flags are not reset per rule, so an IGMP
    /// ingress rule makes a later egress rule with peers invalid.
    #[test]
    fn igmp_flag_carries_over_to_later_rules() {
        let mut v = Target::Acnp.base();
        v["spec"]["ingress"] = json!([{"action": "Allow", "protocols": [{"igmp": {}}]}]);
        let problems: Vec<_> = Target::Acnp.run(v).into_iter().map(|p| p.field).collect();
        assert_eq!(problems, ["spec.egress[0]"]);
    }
}
