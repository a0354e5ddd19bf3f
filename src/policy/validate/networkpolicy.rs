//! `networking.k8s.io/v1` NetworkPolicy, as the API server validates it on create.
//!
//! Source: kubernetes `pkg/apis/networking/validation/validation.go`
//! (`ValidateNetworkPolicy`).

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::policy::problem::{Kind, Problem, ProblemKind, Severity};
use crate::policy::{api, cidr};

use super::apimachinery::{NameRule, check_port, object_meta, port_name_errors};
use super::selectors::selector;
use super::{POLICY_TYPES, PROTOCOLS, Path, Sink, invalid, set_count, set_names};

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
            // ---- NetworkPolicy ------------------------------------------------------
            row(
                "np_namespace_required",
                Np,
                |v| v["metadata"] = json!({"name": "np"}),
                vec![err("metadata.namespace", P::Required)],
            ),
            row(
                "np_namespace_dns1123_label",
                Np,
                |v| v["metadata"]["namespace"] = json!("a.b"),
                vec![err(
                    "metadata.namespace",
                    inv(
                        "a.b",
                        "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character",
                    ),
                )],
            ),
            row(
                "np_selector_key_qualified_name",
                Np,
                |v| v["spec"]["podSelector"]["matchLabels"] = json!({"/app": "db"}),
                vec![err(
                    "spec.podSelector.matchLabels[/app]",
                    inv("/app", "prefix part must be non-empty"),
                )],
            ),
            row(
                "np_selector_key_name_part_max_63",
                Np,
                |v| v["spec"]["podSelector"]["matchLabels"] = json!({"example.com/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa": "x"}),
                vec![err(
                    "spec.podSelector.matchLabels[example.com/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa]",
                    inv(
                        "example.com/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
                        "name part must be no more than 63 characters",
                    ),
                )],
            ),
            row(
                "np_selector_value_max_63",
                Np,
                |v| v["spec"]["podSelector"]["matchLabels"]["app"] = json!("a".repeat(64)),
                vec![err(
                    "spec.podSelector.matchLabels[app]",
                    inv(&"a".repeat(64), "must be no more than 63 characters"),
                )],
            ),
            row(
                "np_selector_operator_enum",
                Np,
                |v| v["spec"]["podSelector"] = json!({"matchExpressions": [{"key": "app", "operator": "Equals", "values": ["db"]}]}),
                vec![err(
                    "spec.podSelector.matchExpressions[0].operator",
                    not_in("Equals", SELECTOR_OPERATORS),
                )],
            ),
            row(
                "np_selector_in_requires_values",
                Np,
                |v| {
                    v["spec"]["ingress"][0]["from"][0]["podSelector"] =
                        json!({"matchExpressions": [{"key": "app", "operator": "NotIn"}]})
                },
                vec![err(
                    "spec.ingress[0].from[0].podSelector.matchExpressions[0].values",
                    P::Required,
                )],
            ),
            row(
                "np_selector_exists_forbids_values",
                Np,
                |v| v["spec"]["egress"][0]["to"][0]["namespaceSelector"] = json!({"matchExpressions": [{"key": "env", "operator": "DoesNotExist", "values": ["a", "b"]}]}),
                vec![err(
                    "spec.egress[0].to[0].namespaceSelector.matchExpressions[0].values",
                    inv(
                        "a,b",
                        "may not be specified when `operator` is 'Exists' or 'DoesNotExist'",
                    ),
                )],
            ),
            row(
                "np_selector_expression_values_are_label_values",
                Np,
                |v| v["spec"]["podSelector"] = json!({"matchExpressions": [{"key": "app", "operator": "In", "values": ["ok", "not ok"]}]}),
                vec![err(
                    "spec.podSelector.matchExpressions[0].values[1]",
                    inv(
                        "not ok",
                        "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character",
                    ),
                )],
            ),
            row(
                "np_policy_types_enum",
                Np,
                |v| v["spec"]["policyTypes"] = json!(["Ingress", "egress"]),
                vec![err("spec.policyTypes[1]", not_in("egress", "Ingress, Egress"))],
            ),
            row(
                "np_policy_types_at_most_two",
                Np,
                |v| v["spec"]["policyTypes"] = json!(["Ingress", "Egress", "Ingress"]),
                vec![err(
                    "spec.policyTypes",
                    inv("Ingress,Egress,Ingress", "may not specify more than two policyTypes"),
                )],
            ),
            row(
                "np_policy_types_repeat_is_accepted",
                Np,
                |v| v["spec"]["policyTypes"] = json!(["Egress", "Egress"]),
                vec![warn(
                    "spec.policyTypes[1]",
                    inv("Egress", "listed twice; the API server accepts the repeat"),
                )],
            ),
            row(
                "np_port_protocol_enum",
                Np,
                |v| v["spec"]["ingress"][0]["ports"][0]["protocol"] = json!("tcp"),
                vec![err("spec.ingress[0].ports[0].protocol", not_in("tcp", "TCP, UDP, SCTP"))],
            ),
            row(
                "np_port_number_1_to_65535",
                Np,
                |v| v["spec"]["egress"][0]["ports"][0]["port"] = json!(65536),
                vec![err("spec.egress[0].ports[0].port", range(65536, 1, 65535))],
            ),
            row(
                "np_port_name_iana_svc_name",
                Np,
                |v| v["spec"]["ingress"][0]["ports"][1]["port"] = json!("my--port"),
                vec![err(
                    "spec.ingress[0].ports[1].port",
                    inv("my--port", "must not contain consecutive hyphens"),
                )],
            ),
            row(
                "np_port_name_max_15",
                Np,
                |v| v["spec"]["ingress"][0]["ports"][1]["port"] = json!("abcdefghijklmnop"),
                vec![err(
                    "spec.ingress[0].ports[1].port",
                    inv("abcdefghijklmnop", "must be no more than 15 characters"),
                )],
            ),
            row(
                "np_port_name_needs_a_letter",
                Np,
                |v| v["spec"]["ingress"][0]["ports"][1]["port"] = json!("8080"),
                vec![err(
                    "spec.ingress[0].ports[1].port",
                    inv("8080", "must contain at least one letter (a-z)"),
                )],
            ),
            row(
                "np_end_port_only_with_numeric_port",
                Np,
                |v| v["spec"]["ingress"][0]["ports"][1]["endPort"] = json!(9000),
                vec![err(
                    "spec.ingress[0].ports[1].endPort",
                    inv("9000", "may not be specified when `port` is non-numeric"),
                )],
            ),
            row(
                "np_end_port_requires_port",
                Np,
                |v| v["spec"]["ingress"][0]["ports"][2] = json!({"endPort": 9000}),
                vec![err(
                    "spec.ingress[0].ports[2].endPort",
                    inv("9000", "may not be specified when `port` is not specified"),
                )],
            ),
            row(
                "np_end_port_not_below_port",
                Np,
                |v| v["spec"]["ingress"][0]["ports"][2]["endPort"] = json!(7999),
                vec![err(
                    "spec.ingress[0].ports[2].endPort",
                    inv("7999", "must be greater than or equal to `port`"),
                )],
            ),
            row(
                "np_end_port_max_65535",
                Np,
                |v| v["spec"]["ingress"][0]["ports"][2]["endPort"] = json!(65536),
                vec![err("spec.ingress[0].ports[2].endPort", range(65536, 1, 65535))],
            ),
            row(
                "np_end_port_equal_to_port_ok",
                Np,
                |v| v["spec"]["ingress"][0]["ports"][2]["endPort"] = json!(8000),
                vec![],
            ),
            row(
                "np_peer_must_specify_a_peer",
                Np,
                |v| v["spec"]["egress"][0]["to"][0] = json!({}),
                vec![err("spec.egress[0].to[0]", P::Required)],
            ),
            row(
                "np_peer_ip_block_alone",
                Np,
                |v| v["spec"]["ingress"][0]["from"][1]["namespaceSelector"] = json!({}),
                vec![err(
                    "spec.ingress[0].from[1]",
                    one_of("ipBlock, podSelector/namespaceSelector", "ipBlock, namespaceSelector"),
                )],
            ),
            row(
                "np_ip_block_cidr_required",
                Np,
                |v| v["spec"]["ingress"][0]["from"][1]["ipBlock"] = json!({"cidr": ""}),
                vec![err("spec.ingress[0].from[1].ipBlock.cidr", P::Required)],
            ),
            row(
                "np_ip_block_cidr_valid",
                Np,
                |v| v["spec"]["ingress"][0]["from"][1]["ipBlock"]["cidr"] = json!("10.0.0.0/33"),
                vec![err(
                    "spec.ingress[0].from[1].ipBlock.cidr",
                    inv("10.0.0.0/33", "not an IPv4 or IPv6 CIDR"),
                )],
            ),
            row(
                "np_ip_block_except_valid",
                Np,
                |v| v["spec"]["ingress"][0]["from"][1]["ipBlock"]["except"] = json!(["10.1.0.0"]),
                vec![err(
                    "spec.ingress[0].from[1].ipBlock.except[0]",
                    inv("10.1.0.0", "missing /prefix length"),
                )],
            ),
            row(
                "np_ip_block_except_strict_subset",
                Np,
                |v| {
                    v["spec"]["ingress"][0]["from"][1]["ipBlock"]["except"] =
                        json!(["10.0.0.0/8", "192.168.0.0/16", "fd00::/64", "10.2.0.0/16"])
                },
                vec![
                    err(
                        "spec.ingress[0].from[1].ipBlock.except[0]",
                        inv("10.0.0.0/8", "must be a strict subset of `cidr`"),
                    ),
                    err(
                        "spec.ingress[0].from[1].ipBlock.except[1]",
                        inv("192.168.0.0/16", "must be a strict subset of `cidr`"),
                    ),
                    err(
                        "spec.ingress[0].from[1].ipBlock.except[2]",
                        inv("fd00::/64", "must be a strict subset of `cidr`"),
                    ),
                ],
            ),
            row(
                "np_ip_block_host_bits_masked",
                Np,
                |v| {
                    v["spec"]["ingress"][0]["from"][1]["ipBlock"] =
                        json!({"cidr": "10.9.9.9/8", "except": ["10.1.2.3/16"]})
                },
                vec![],
            ),
        ]
    }

    #[test]
    fn each_rule_reports_exactly_its_problem() {
        check(rows());
    }

    #[test]
    fn minimal_network_policy_without_spec_is_valid() {
        let problems = Target::Np.run(json!({"metadata": {"name": "np", "namespace": "default"}}));
        assert!(problems.is_empty(), "{problems:#?}");
    }

    proptest::proptest! {
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
}
