//! `v1` Namespace, Pod and Node: the fields the engine reads, as the API server validates
//! and defaults them.
//!
//! Source: kubernetes `pkg/apis/core/validation/validation.go`,
//! `pkg/apis/core/v1/defaults.go` and `conversion.go`.

use crate::policy::api;
use crate::policy::problem::{Kind, Problem, ProblemKind};

use super::apimachinery::{NameRule, check_port, object_meta, parse_ip, port_name_errors};
use super::{NAMESPACE_NAME_LABEL, PROTOCOLS, Path, Seen, Sink, invalid};

/// Validates a Namespace: metadata with a DNS-1123 label name (`ValidateNamespace`), and
/// the `kubernetes.io/metadata.name` label. The API server does not reject a mismatching
/// label: `SetDefaults_Namespace` overwrites it ("obj.Labels[v1.LabelMetadataName] =
/// obj.Name"), so a mismatch is a warning and the loader must overwrite the label too.
///
/// Source: kubernetes `pkg/apis/core/validation` `ValidateNamespace`,
/// `pkg/apis/core/v1/defaults.go` `SetDefaults_Namespace`.
pub fn namespace(obj: &api::Namespace, out: &mut Vec<Problem>) {
    let mut s = Sink::new(Kind::Namespace, &obj.metadata, out);
    object_meta(&mut s, &obj.metadata, NameRule::Label, false);
    let name = obj.metadata.name.as_deref().unwrap_or_default();
    if let Some(value) = obj.metadata.labels.as_ref().and_then(|l| l.get(NAMESPACE_NAME_LABEL))
        && !name.is_empty()
        && value != name
    {
        s.warning(
            &Path::root("metadata.labels").key(NAMESPACE_NAME_LABEL),
            invalid(
                value,
                format!(
                    "differs from the name {name:?}; the API server overwrites it with the name"
                ),
            ),
        );
    }
}

/// Validates the parts of a Pod the policy engine reads: metadata (DNS-1123 subdomain
/// name, namespace required), `status.podIP` and `status.podIPs` (valid IPs, at most one
/// per family, no repeats: `validatePodIPs`), and container ports of `containers` and
/// `initContainers` (`validateContainerPorts`: `containerPort` 1–65535, `hostPort`
/// 1–65535 when set, protocol TCP/UDP/SCTP, `name` an IANA_SVC_NAME unique in its
/// container).
///
/// `status.podIP` differing from `status.podIPs[0]` is a warning: the API server's v1
/// conversion keeps it ("PodIP is authoritative for compatibility with older kubelets") and
/// replaces `podIPs` with `[podIP]`.
///
/// Source: kubernetes `pkg/apis/core/validation/validation.go`, `pkg/apis/core/v1/
/// conversion.go` `Convert_v1_PodStatus_To_core_PodStatus`.
pub fn pod(obj: &api::Pod, out: &mut Vec<Problem>) {
    let mut s = Sink::new(Kind::Pod, &obj.metadata, out);
    object_meta(&mut s, &obj.metadata, NameRule::Subdomain, true);
    if let Some(spec) = &obj.spec {
        let path = Path::root("spec.containers");
        for (i, c) in spec.containers.iter().enumerate() {
            container_ports(&mut s, &path.index(i).field("ports"), c.ports.as_deref());
        }
        let path = Path::root("spec.initContainers");
        for (i, c) in spec.init_containers.iter().flatten().enumerate() {
            container_ports(&mut s, &path.index(i).field("ports"), c.ports.as_deref());
        }
    }
    let Some(status) = &obj.status else { return };
    let pod_ip_path = Path::root("status.podIP");
    let pod_ip = status.pod_ip.as_deref().filter(|ip| !ip.is_empty());
    if let Some(ip) = pod_ip
        && let Err(reason) = parse_ip(ip)
    {
        s.error(&pod_ip_path, invalid(ip, reason));
    }
    let pod_ips_path = Path::root("status.podIPs");
    let pod_ips = status.pod_ips.as_deref().unwrap_or_default();
    // How many entries parse, and how many of those are IPv4.
    let (mut parsed, mut v4) = (0usize, 0usize);
    for (i, entry) in pod_ips.iter().enumerate() {
        match parse_ip(&entry.ip) {
            Ok(ip) => {
                parsed += 1;
                v4 += usize::from(ip.is_ipv4());
            }
            Err(reason) => s.error(&pod_ips_path.index(i).field("ip"), invalid(&entry.ip, reason)),
        }
    }
    if pod_ips.len() > 1 && parsed == pod_ips.len() {
        // "may specify no more than one IP for each IP family"
        let v6 = parsed - v4;
        if v4 == 0 || v6 == 0 || parsed > 2 {
            let all: Vec<&str> = pod_ips.iter().map(|p| p.ip.as_str()).collect();
            s.error(
                &pod_ips_path,
                invalid(all.join(","), "may specify no more than one IP for each IP family"),
            );
        }
        // "There should be no duplicates in list of Pod.PodIPs"
        let mut seen = Seen::new();
        for (i, entry) in pod_ips.iter().enumerate() {
            if !seen.insert(entry.ip.as_str()) {
                s.error(&pod_ips_path.index(i).field("ip"), invalid(&entry.ip, "duplicate value"));
            }
        }
    }
    if let (Some(ip), Some(first)) = (pod_ip, pod_ips.first())
        && first.ip != ip
    {
        s.warning(
            &pod_ip_path,
            invalid(
                ip,
                format!(
                    "differs from status.podIPs[0] ({:?}); the API server keeps podIP and \
                         replaces podIPs with [podIP]",
                    first.ip
                ),
            ),
        );
    }
}

/// kubernetes `validateContainerPorts` (after `SetDefaults_ContainerPort`, which turns an
/// empty protocol into TCP).
fn container_ports(
    s: &mut Sink<'_>,
    path: &Path<'_>,
    ports: Option<&[k8s_openapi::api::core::v1::ContainerPort]>,
) {
    let mut names = Seen::new();
    for (j, port) in ports.unwrap_or_default().iter().enumerate() {
        let path = path.index(j);
        let k8s_openapi::api::core::v1::ContainerPort {
            container_port,
            host_ip: _,
            host_port,
            name,
            protocol,
        } = port;
        if let Some(name) = name.as_deref().filter(|n| !n.is_empty()) {
            let errs = port_name_errors(name);
            if !errs.is_empty() {
                s.error(&path.field("name"), invalid(name, errs.join("; ")));
            } else if !names.insert(name) {
                s.error(
                    &path.field("name"),
                    invalid(name, "duplicate port name in this container"),
                );
            }
        }
        if *container_port == 0 {
            s.error(&path.field("containerPort"), ProblemKind::Required);
        } else {
            check_port(s, &path.field("containerPort"), *container_port);
        }
        if let Some(hp) = host_port.filter(|hp| *hp != 0) {
            check_port(s, &path.field("hostPort"), hp);
        }
        if let Some(p) = protocol.as_deref().filter(|p| !p.is_empty())
            && !matches!(p, "TCP" | "UDP" | "SCTP")
        {
            s.error(
                &path.field("protocol"),
                ProblemKind::NotInEnum { value: p.to_owned(), allowed: PROTOCOLS },
            );
        }
    }
}

/// Validates a Node: metadata with a DNS-1123 subdomain name (`ValidateNodeName`), and the
/// `InternalIP`/`ExternalIP` entries of `status.addresses`, which tierproxy matches
/// against `nodes` peers. The API server does not parse node addresses (it only rejects
/// exact duplicates on update), so an address that is not an IP is a warning: it is
/// ignored. `Hostname`, `InternalDNS` and `ExternalDNS` entries are not read.
///
/// Source: kubernetes `pkg/apis/core/validation` `ValidateNode`, `ValidateNodeUpdate`.
pub fn node(obj: &api::Node, out: &mut Vec<Problem>) {
    let mut s = Sink::new(Kind::Node, &obj.metadata, out);
    object_meta(&mut s, &obj.metadata, NameRule::Subdomain, false);
    let addresses = obj.status.as_ref().and_then(|st| st.addresses.as_deref()).unwrap_or_default();
    let path = Path::root("status.addresses");
    for (i, a) in addresses.iter().enumerate() {
        if matches!(a.type_.as_str(), "InternalIP" | "ExternalIP")
            && let Err(reason) = parse_ip(&a.address)
        {
            s.warning(
                &path.index(i).field("address"),
                invalid(&a.address, format!("{reason}; the address is ignored")),
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
            // ---- Namespace ----------------------------------------------------------
            row(
                "ns_name_dns1123_label",
                Ns,
                |v| v["metadata"] = json!({"name": "a.b"}),
                vec![err(
                    "metadata.name",
                    inv(
                        "a.b",
                        "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character",
                    ),
                )],
            ),
            row(
                "ns_name_max_63",
                Ns,
                |v| v["metadata"] = json!({"name": "n".repeat(64)}),
                vec![err(
                    "metadata.name",
                    inv(&"n".repeat(64), "must be no more than 63 characters"),
                )],
            ),
            row(
                "ns_metadata_name_label_overwritten",
                Ns,
                |v| v["metadata"]["labels"]["kubernetes.io/metadata.name"] = json!("dev"),
                vec![warn(
                    "metadata.labels[kubernetes.io/metadata.name]",
                    inv(
                        "dev",
                        "differs from the name \"prod\"; the API server overwrites it with the name",
                    ),
                )],
            ),
            row(
                "ns_label_value",
                Ns,
                |v| v["metadata"]["labels"]["env"] = json!("-prod"),
                vec![err(
                    "metadata.labels[env]",
                    inv(
                        "-prod",
                        "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character",
                    ),
                )],
            ),
            // ---- Pod ----------------------------------------------------------------
            row(
                "pod_namespace_required",
                Pod,
                |v| v["metadata"]["namespace"] = json!(""),
                vec![err("metadata.namespace", P::Required)],
            ),
            row(
                "pod_ip_valid",
                Pod,
                |v| {
                    v["status"]["podIP"] = json!("10.0.0.300");
                    v["status"]["podIPs"][0]["ip"] = json!("10.0.0.300");
                },
                vec![
                    err("status.podIP", inv("10.0.0.300", "must be a valid IP address")),
                    err("status.podIPs[0].ip", inv("10.0.0.300", "must be a valid IP address")),
                ],
            ),
            row(
                "pod_ips_valid",
                Pod,
                |v| v["status"]["podIPs"][1]["ip"] = json!("fd00::5%eth0"),
                vec![err("status.podIPs[1].ip", inv("fd00::5%eth0", "must be a valid IP address"))],
            ),
            row(
                "pod_ip_no_leading_zeros",
                Pod,
                |v| {
                    v["status"]["podIP"] = json!("10.0.0.05");
                    v["status"]["podIPs"][0]["ip"] = json!("10.0.0.05");
                },
                vec![
                    err("status.podIP", inv("10.0.0.05", "must be a valid IP address")),
                    err("status.podIPs[0].ip", inv("10.0.0.05", "must be a valid IP address")),
                ],
            ),
            row(
                "pod_ips_no_ipv4_mapped",
                Pod,
                |v| v["status"]["podIPs"][1]["ip"] = json!("::ffff:10.0.0.6"),
                vec![err(
                    "status.podIPs[1].ip",
                    inv("::ffff:10.0.0.6", "must not be an IPv4-mapped IPv6 address"),
                )],
            ),
            row(
                "pod_ips_one_per_family",
                Pod,
                |v| v["status"]["podIPs"][1]["ip"] = json!("10.0.0.6"),
                vec![err(
                    "status.podIPs",
                    inv("10.0.0.5,10.0.0.6", "may specify no more than one IP for each IP family"),
                )],
            ),
            row(
                "pod_ips_no_duplicates",
                Pod,
                |v| v["status"]["podIPs"][1]["ip"] = json!("10.0.0.5"),
                vec![
                    err(
                        "status.podIPs",
                        inv(
                            "10.0.0.5,10.0.0.5",
                            "may specify no more than one IP for each IP family",
                        ),
                    ),
                    err("status.podIPs[1].ip", inv("10.0.0.5", "duplicate value")),
                ],
            ),
            row(
                "pod_ips_at_most_two",
                Pod,
                |v| {
                    v["status"]["podIPs"] =
                        json!([{"ip": "10.0.0.5"}, {"ip": "fd00::5"}, {"ip": "fd00::6"}])
                },
                vec![err(
                    "status.podIPs",
                    inv(
                        "10.0.0.5,fd00::5,fd00::6",
                        "may specify no more than one IP for each IP family",
                    ),
                )],
            ),
            row(
                "pod_ip_equals_first_pod_ips",
                Pod,
                |v| v["status"]["podIP"] = json!("10.0.0.7"),
                vec![warn(
                    "status.podIP",
                    inv(
                        "10.0.0.7",
                        "differs from status.podIPs[0] (\"10.0.0.5\"); the API server keeps podIP and replaces podIPs with [podIP]",
                    ),
                )],
            ),
            row(
                "pod_container_port_1_to_65535",
                Pod,
                |v| v["spec"]["containers"][0]["ports"][0]["containerPort"] = json!(70000),
                vec![err("spec.containers[0].ports[0].containerPort", range(70000, 1, 65535))],
            ),
            row(
                "pod_container_port_required",
                Pod,
                |v| v["spec"]["containers"][0]["ports"][1]["containerPort"] = json!(0),
                vec![err("spec.containers[0].ports[1].containerPort", P::Required)],
            ),
            row(
                "pod_host_port_1_to_65535",
                Pod,
                |v| v["spec"]["containers"][0]["ports"][1]["hostPort"] = json!(-1),
                vec![err("spec.containers[0].ports[1].hostPort", range(-1, 1, 65535))],
            ),
            row(
                "pod_container_port_protocol_enum",
                Pod,
                |v| v["spec"]["containers"][0]["ports"][0]["protocol"] = json!("ICMP"),
                vec![err("spec.containers[0].ports[0].protocol", not_in("ICMP", "TCP, UDP, SCTP"))],
            ),
            row(
                "pod_container_port_name_iana_svc_name",
                Pod,
                |v| v["spec"]["containers"][0]["ports"][0]["name"] = json!("-pg"),
                vec![err(
                    "spec.containers[0].ports[0].name",
                    inv("-pg", "must not begin or end with a hyphen"),
                )],
            ),
            row(
                "pod_container_port_name_unique",
                Pod,
                |v| v["spec"]["containers"][0]["ports"][1]["name"] = json!("postgres"),
                vec![err(
                    "spec.containers[0].ports[1].name",
                    inv("postgres", "duplicate port name in this container"),
                )],
            ),
            row(
                "pod_init_container_ports",
                Pod,
                |v| {
                    v["spec"]["initContainers"] =
                        json!([{"name": "sidecar", "ports": [{"containerPort": 0}]}])
                },
                vec![err("spec.initContainers[0].ports[0].containerPort", P::Required)],
            ),
            // ---- Node ---------------------------------------------------------------
            row(
                "node_name_dns1123_subdomain",
                Node,
                |v| v["metadata"]["name"] = json!("node_1"),
                vec![err(
                    "metadata.name",
                    inv(
                        "node_1",
                        "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character",
                    ),
                )],
            ),
            row(
                "node_internal_ip_is_ip",
                Node,
                |v| v["status"]["addresses"][0]["address"] = json!("node-1.example"),
                vec![warn(
                    "status.addresses[0].address",
                    inv("node-1.example", "must be a valid IP address; the address is ignored"),
                )],
            ),
            row(
                "node_external_ip_is_ip",
                Node,
                |v| v["status"]["addresses"][1]["address"] = json!("2001:db8::zz"),
                vec![warn(
                    "status.addresses[1].address",
                    inv("2001:db8::zz", "must be a valid IP address; the address is ignored"),
                )],
            ),
            row(
                "node_dns_addresses_ignored",
                Node,
                |v| {
                    v["status"]["addresses"] = json!([
                        {"type": "Hostname", "address": "not an ip"},
                        {"type": "InternalDNS", "address": "node-1.internal"},
                        {"type": "ExternalDNS", "address": "node-1.example.com"}
                    ])
                },
                vec![],
            ),
        ]
    }

    #[test]
    fn each_rule_reports_exactly_its_problem() {
        check(rows());
    }
}
