//! ClusterNetworkPolicy (`v1alpha2`), as its experimental-channel CRD validates it.
//!
//! Source: network-policy-api `apis/v1alpha2/clusternetworkpolicy_types.go`.

use crate::policy::api::v1alpha2;
use crate::policy::model::Direction;
use crate::policy::problem::{Kind, Problem, ProblemKind};

use super::apimachinery::{NameRule, check_port, object_meta};
use super::crd::{
    FailClosed, check_domain_names, check_named_port, common_egress_peer, item_count, peer_union,
    priority, rule_name, subject, union_exactly_one,
};
use super::selectors::{namespaced_pod, selector};
use super::{CRD_SELECTOR_SEVERITY, Path, Rules, Sink, V1ALPHA2_MAX_ITEMS, invalid};

fn cnp_fail(action: v1alpha2::ClusterNetworkPolicyRuleAction) -> FailClosed {
    match action {
        v1alpha2::ClusterNetworkPolicyRuleAction::Accept => FailClosed::MatchNothing,
        v1alpha2::ClusterNetworkPolicyRuleAction::Deny
        | v1alpha2::ClusterNetworkPolicyRuleAction::Pass => FailClosed::DenyAll,
    }
}

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
    for _ in cluster_network_policy_rules(obj, out) {}
}

/// [`cluster_network_policy`] of `obj`, an edit of `was`, which validated to
/// `was_problems`, reusing the problems of each rule equal to the rule at the same
/// position of `was`, as [`admin_network_policy_edited`](super::admin_network_policy_edited)
/// does. Reports what [`cluster_network_policy`] reports.
///
/// Returns whether `obj` has `was`'s rules, each in its place (then only the object's
/// own fields can differ).
pub fn cluster_network_policy_edited(
    obj: &v1alpha2::ClusterNetworkPolicy,
    was: &v1alpha2::ClusterNetworkPolicy,
    was_problems: &[Problem],
    out: &mut Vec<Problem>,
) -> bool {
    use super::AdminEdit;
    let rules = cluster_network_policy_rules(obj, out);
    rules.finish_reusing(was_problems, |d, i| obj.same_rule(was, d, i)) && obj.same_counts(was)
}

/// [`cluster_network_policy`] rule by rule: checks the object's own fields now and each
/// rule as the [`Rules`] iterator reaches it. Run to the end, it reports what
/// [`cluster_network_policy`] reports.
pub fn cluster_network_policy_rules<'a>(
    obj: &'a v1alpha2::ClusterNetworkPolicy,
    out: &'a mut Vec<Problem>,
) -> Rules<'a, v1alpha2::ClusterNetworkPolicy> {
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
    Rules::new(s, obj, [ingress.len(), egress.len()], cnp_rule)
}

/// Checks rule `i` of direction `d` of `obj` (for [`cluster_network_policy_rules`]).
fn cnp_rule(s: &mut Sink<'_>, obj: &v1alpha2::ClusterNetworkPolicy, d: Direction, i: usize) {
    match d {
        Direction::Ingress => {
            let rule = &obj.spec.ingress[i];
            let v1alpha2::ClusterNetworkPolicyIngressRule { name, action, from, protocols } = rule;
            let ingress_path = Path::root("spec.ingress");
            let path = ingress_path.index(i);
            rule_name(s, &path, name);
            let from_path = path.field("from");
            // From: "+kubebuilder:validation:MinItems=1", "MaxItems=25".
            item_count(s, &from_path, from.len(), 1, V1ALPHA2_MAX_ITEMS);
            for (j, peer) in from.iter().enumerate() {
                let v1alpha2::ClusterNetworkPolicyIngressPeer { namespaces, pods } = peer;
                let peer_path = from_path.index(j);
                peer_union(
                    s,
                    &peer_path,
                    "namespaces, pods",
                    &[("namespaces", namespaces.is_some()), ("pods", pods.is_some())],
                    cnp_fail(*action),
                );
                if let Some(sel) = namespaces {
                    selector(s, sel, &peer_path.field("namespaces"), CRD_SELECTOR_SEVERITY);
                }
                if let Some(p) = pods {
                    namespaced_pod(s, p, &peer_path.field("pods"));
                }
            }
            cnp_protocols(s, &path, protocols.as_deref());
        }
        Direction::Egress => {
            let rule = &obj.spec.egress[i];
            let v1alpha2::ClusterNetworkPolicyEgressRule { name, action, to, protocols } = rule;
            let egress_path = Path::root("spec.egress");
            let path = egress_path.index(i);
            rule_name(s, &path, name);
            let to_path = path.field("to");
            item_count(s, &to_path, to.len(), 1, V1ALPHA2_MAX_ITEMS);
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
                    cnp_fail(*action),
                );
                common_egress_peer(s, &peer_path, namespaces, pods, nodes, nets);
                if let Some(names) = domain_names {
                    check_domain_names(s, &peer_path.field("domainNames"), names);
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
            cnp_protocols(s, &path, protocols.as_deref());
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
        }
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

#[cfg(test)]
pub(super) mod tests {
    use serde_json::json;

    use super::*;
    use crate::policy::validate::table::*;

    /// This file's rows of the table (one per rule).
    pub(in crate::policy::validate) fn rows() -> Vec<Row> {
        use ProblemKind as P;
        use Target::*;
        vec![
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
        ]
    }

    #[test]
    fn each_rule_reports_exactly_its_problem() {
        check(rows());
    }
}
