//! AdminNetworkPolicy and BaselineAdminNetworkPolicy (`v1alpha1`), as the v0.1.7
//! experimental-channel CRDs validate them.
//!
//! Source: network-policy-api `apis/v1alpha1` (`adminnetworkpolicy_types.go`,
//! `baselineadminnetworkpolicy_types.go`, `shared_types.go`), `release-0.1` / v0.1.7.

use crate::policy::api::v1alpha1;
use crate::policy::model::Direction;
use crate::policy::problem::{Kind, Problem, ProblemKind};

use super::apimachinery::{NameRule, check_port, object_meta};
use super::crd::{
    FailClosed, check_domain_names, check_named_port, common_egress_peer, item_count, peer_union,
    priority, rule_name, subject, union_exactly_one,
};
use super::selectors::{namespaced_pod, selector};
use super::{CRD_SELECTOR_SEVERITY, PROTOCOLS, Path, Rules, Sink, V1ALPHA1_MAX_ITEMS, invalid};

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
    for _ in admin_network_policy_rules(obj, out) {}
}

/// [`admin_network_policy`] of `obj`, an edit of `was`, which validated to `was_problems`
/// (the same object: same kind and name): the object's own fields are checked, and each
/// rule equal to the rule at the same position of `was` takes its problems from
/// `was_problems` instead of being checked again. Reports what [`admin_network_policy`]
/// reports; an edit of one rule of a 100-rule policy costs one rule's check.
///
/// Returns whether `obj` has `was`'s rules, each in its place (then only the object's
/// own fields can differ).
pub fn admin_network_policy_edited(
    obj: &v1alpha1::AdminNetworkPolicy,
    was: &v1alpha1::AdminNetworkPolicy,
    was_problems: &[Problem],
    out: &mut Vec<Problem>,
) -> bool {
    use super::AdminEdit;
    let rules = admin_network_policy_rules(obj, out);
    rules.finish_reusing(was_problems, |d, i| obj.same_rule(was, d, i)) && obj.same_counts(was)
}

/// [`admin_network_policy`] rule by rule: checks the object's own fields now and each
/// rule as the [`Rules`] iterator reaches it. Run to the end, it reports what
/// [`admin_network_policy`] reports.
pub fn admin_network_policy_rules<'a>(
    obj: &'a v1alpha1::AdminNetworkPolicy,
    out: &'a mut Vec<Problem>,
) -> Rules<'a, v1alpha1::AdminNetworkPolicy> {
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
    Rules::new(s, obj, [ingress.len(), egress.len()], anp_rule)
}

/// Checks rule `i` of direction `d` of `obj` (for [`admin_network_policy_rules`]).
fn anp_rule(s: &mut Sink<'_>, obj: &v1alpha1::AdminNetworkPolicy, d: Direction, i: usize) {
    match d {
        Direction::Ingress => {
            let rule = &obj.spec.ingress[i];
            let v1alpha1::AdminNetworkPolicyIngressRule { name, action, from, ports } = rule;
            let ingress_path = Path::root("spec.ingress");
            let path = ingress_path.index(i);
            rule_name(s, &path, name);
            let from_path = path.field("from");
            v1alpha1_peers_count(s, &from_path, from.len());
            for (j, peer) in from.iter().enumerate() {
                v1alpha1_ingress_peer(s, &from_path.index(j), peer, anp_fail(*action));
            }
            v1alpha1_ports(s, &path, ports.as_deref());
        }
        Direction::Egress => {
            let rule = &obj.spec.egress[i];
            let v1alpha1::AdminNetworkPolicyEgressRule { name, action, to, ports } = rule;
            let egress_path = Path::root("spec.egress");
            let path = egress_path.index(i);
            rule_name(s, &path, name);
            let to_path = path.field("to");
            v1alpha1_peers_count(s, &to_path, to.len());
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
                    s,
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
                common_egress_peer(s, &peer_path, namespaces, pods, nodes, nets);
                if let Some(names) = domain_names {
                    check_domain_names(s, &peer_path.field("domainNames"), names);
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
            v1alpha1_ports(s, &path, ports.as_deref());
            // <network-policy-api:experimental:validation>
            // +kubebuilder:validation:XValidation:rule="!(self.to.exists(peer,
            // has(peer.networks) || has(peer.nodes) || has(peer.domainNames)) &&
            // has(self.ports) && self.ports.exists(port, has(port.namedPort)))"
            v1alpha1_named_port_cel(
                s,
                &path,
                without_named_ports,
                ports.as_deref(),
                "networks/nodes/domainNames peer cannot be set with namedPorts since there are \
                 no namedPorts for networks/nodes/domainNames",
            );
        }
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
    for _ in baseline_admin_network_policy_rules(obj, out) {}
}

/// [`baseline_admin_network_policy`] of `obj`, an edit of `was`, which validated to
/// `was_problems`, reusing the problems of each rule equal to the rule at the same
/// position of `was`, as [`admin_network_policy_edited`] does. Reports what
/// [`baseline_admin_network_policy`] reports.
///
/// Returns whether `obj` has `was`'s rules, each in its place (then only the object's
/// own fields can differ).
pub fn baseline_admin_network_policy_edited(
    obj: &v1alpha1::BaselineAdminNetworkPolicy,
    was: &v1alpha1::BaselineAdminNetworkPolicy,
    was_problems: &[Problem],
    out: &mut Vec<Problem>,
) -> bool {
    use super::AdminEdit;
    let rules = baseline_admin_network_policy_rules(obj, out);
    rules.finish_reusing(was_problems, |d, i| obj.same_rule(was, d, i)) && obj.same_counts(was)
}

/// [`baseline_admin_network_policy`] rule by rule: checks the object's own fields now and each
/// rule as the [`Rules`] iterator reaches it. Run to the end, it reports what
/// [`baseline_admin_network_policy`] reports.
pub fn baseline_admin_network_policy_rules<'a>(
    obj: &'a v1alpha1::BaselineAdminNetworkPolicy,
    out: &'a mut Vec<Problem>,
) -> Rules<'a, v1alpha1::BaselineAdminNetworkPolicy> {
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
    Rules::new(s, obj, [ingress.len(), egress.len()], banp_rule)
}

/// Checks rule `i` of direction `d` of `obj` (for [`baseline_admin_network_policy_rules`]).
fn banp_rule(s: &mut Sink<'_>, obj: &v1alpha1::BaselineAdminNetworkPolicy, d: Direction, i: usize) {
    match d {
        Direction::Ingress => {
            let rule = &obj.spec.ingress[i];
            let v1alpha1::BaselineAdminNetworkPolicyIngressRule { name, action, from, ports } =
                rule;
            let ingress_path = Path::root("spec.ingress");
            let path = ingress_path.index(i);
            rule_name(s, &path, name);
            let from_path = path.field("from");
            v1alpha1_peers_count(s, &from_path, from.len());
            for (j, peer) in from.iter().enumerate() {
                v1alpha1_ingress_peer(s, &from_path.index(j), peer, banp_fail(*action));
            }
            v1alpha1_ports(s, &path, ports.as_deref());
        }
        Direction::Egress => {
            let rule = &obj.spec.egress[i];
            let v1alpha1::BaselineAdminNetworkPolicyEgressRule { name, action, to, ports } = rule;
            let egress_path = Path::root("spec.egress");
            let path = egress_path.index(i);
            rule_name(s, &path, name);
            let to_path = path.field("to");
            v1alpha1_peers_count(s, &to_path, to.len());
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
                    s,
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
                common_egress_peer(s, &peer_path, namespaces, pods, nodes, nets);
                without_named_ports |= nodes.is_some() || nets.is_some();
            }
            v1alpha1_ports(s, &path, ports.as_deref());
            // <network-policy-api:experimental:validation>
            // +kubebuilder:validation:XValidation:rule="!(self.to.exists(peer,
            // has(peer.networks) || has(peer.nodes)) && has(self.ports) &&
            // self.ports.exists(port, has(port.namedPort)))"
            v1alpha1_named_port_cel(
                s,
                &path,
                without_named_ports,
                ports.as_deref(),
                "networks/nodes peer cannot be set with namedPorts since there are no namedPorts \
                 for networks/nodes",
            );
        }
    }
}

/// `From`/`To`: "+kubebuilder:validation:MinItems=1", "MaxItems=100".
fn v1alpha1_peers_count(s: &mut Sink<'_>, path: &Path<'_>, len: usize) {
    item_count(s, path, len, 1, V1ALPHA1_MAX_ITEMS);
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

#[cfg(test)]
pub(super) mod tests {
    use serde_json::json;

    use super::*;
    use crate::policy::validate::SELECTOR_OPERATORS;
    use crate::policy::validate::table::*;

    /// This file's rows of the table (one per rule).
    pub(in crate::policy::validate) fn rows() -> Vec<Row> {
        use ProblemKind as P;
        use Target::*;
        vec![
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
        ]
    }

    #[test]
    fn each_rule_reports_exactly_its_problem() {
        check(rows());
    }
}
