//! ClusterIP and NodePort Services in the lab: `v1` Service objects read from the lab's
//! manifests and installed in every node namespace as kube-proxy-like nftables DNAT (issues
//! #6 and #22).
//!
//! What a real node does, and the lab copies: kube-proxy (nftables mode) rewrites the
//! destination of a connection to `spec.clusterIP:port` into one backend pod's
//! `podIP:targetPort`, chosen at random per connection (`numgen random mod N vmap`), in a
//! `nat` chain at priority `dstnat` (-100) of the `prerouting` hook (traffic from pods) and
//! the `output` hook (traffic from the node itself). A NodePort Service's
//! `spec.ports[].nodePort` on any of the node's own addresses (`fib daddr type local`,
//! loopback excepted) is rewritten the same way (kube-proxy's `nodeports` chain, its
//! default `--nodeport-addresses`). Conntrack un-NATs the replies, so the client sees them
//! come from the ClusterIP or the node's address and node port. tierproxy's interception
//! (mangle, -150) runs before that DNAT and its decision (mangle INPUT / FORWARD) after it,
//! so a Service flow is decided on the backend pod and its target port: see the module docs
//! of `redirect`.
//!
//! Read here, from the same files the policy loader reads (which skips Services with a
//! note, leaving the policy inputs unchanged):
//! - `spec.type`: `ClusterIP` (or absent) or `NodePort`; other types (`LoadBalancer`,
//!   `ExternalName`) are skipped with a note (a LoadBalancer's ClusterIP part would work,
//!   its load balancer would not be there).
//! - `spec.clusterIPs` (else `spec.clusterIP`); `None` (headless) is skipped.
//! - `spec.selector`: equality on every key, against Running pods of the Service's namespace
//!   that the lab built in a pod namespace (hostNetwork pods are not backends here). No
//!   selector: no backends (a real cluster's manual EndpointSlices are not read).
//! - `spec.ports[]`: `port`, `protocol` (default TCP), `targetPort` (default `port`; a number,
//!   or a name looked up in the backend pod's `containers[].ports[].name` with the same
//!   protocol, per pod, as kube-proxy resolves it from the EndpointSlice), `nodePort` (type
//!   `NodePort` only; the lab allocates none, so a port without one gets its ClusterIP
//!   part only, with a note).
//!
//! Not copied: sessionAffinity, internal/external traffic policy, hairpin masquerade (a pod
//! reaching itself through its Service), the reject rule kube-proxy adds for Services without
//! endpoints (here such a port has no rule, and the packet goes on to the fabric), and the
//! masquerade of node-port traffic (kube-proxy SNATs it to the node's address under
//! `externalTrafficPolicy: Cluster`; here the client's address is kept, as under `Local`).
//! Without that SNAT a backend's replies must pass the node that DNAT'd the connection to
//! be un-NATed, so a node port is for clients on the node it names or on the backend's.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use k8s_openapi::api::core::v1::{Service, ServicePort};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::cluster::manifest::{self, LoadError};
use crate::policy::Protocol;
use crate::policy::api::Pod;

/// The nftables table (family `inet`) holding the lab's Service DNAT in each node namespace.
pub const TABLE: &str = "tierproxy-lab-svc";

/// A Service the lab cannot use.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// A manifest file could not be read.
    #[error("reading Services")]
    Load(#[from] LoadError),
    /// A field of a Service is invalid.
    #[error("Service {service}: {field}: {problem}")]
    Field {
        /// `namespace/name`.
        service: String,
        /// The field, e.g. `spec.ports[0].targetPort`.
        field: String,
        /// What is wrong with it.
        problem: String,
    },
}

/// One backend of a Service port: a pod and the address kube-proxy would DNAT to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceBackend {
    /// `namespace/name` of the pod.
    pub pod: String,
    /// Its address of the ClusterIP's family and the resolved target port.
    pub addr: SocketAddr,
}

/// One port of one ClusterIP of a Service, with its backends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServicePortPlan {
    /// `spec.ports[].name` (empty when unnamed).
    pub name: String,
    /// `spec.ports[].protocol` (in the state file: `TCP`, `UDP` or `SCTP`).
    #[serde(with = "protocol_name")]
    pub protocol: Protocol,
    /// The ClusterIP (one of `spec.clusterIPs`).
    pub cluster_ip: IpAddr,
    /// `spec.ports[].port`.
    pub port: u16,
    /// `spec.ports[].nodePort` of a NodePort Service, on every local address of the node
    /// of the ClusterIP's family; `None` for a ClusterIP Service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_port: Option<u16>,
    /// Running, selected pods of the ClusterIP's family, in manifest order.
    pub backends: Vec<ServiceBackend>,
}

/// [`Protocol`] as its Kubernetes spelling in the state file.
mod protocol_name {
    use serde::{Deserialize, Deserializer, Serializer};

    use crate::policy::Protocol;

    pub fn serialize<S: Serializer>(p: &Protocol, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(p.as_str())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Protocol, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

/// A ClusterIP or NodePort Service as the lab installs it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServicePlan {
    /// `metadata.namespace` (default `default`).
    pub namespace: String,
    /// `metadata.name`.
    pub name: String,
    /// Every (ClusterIP, port) pair, with its node port if any.
    pub ports: Vec<ServicePortPlan>,
}

/// A Service, or a part of one, that the lab does not build (not of type ClusterIP or
/// NodePort, headless, a node port it would have to allocate), and why; the plan lists it
/// among what it left out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unbuilt {
    /// `namespace/name`.
    pub service: String,
    /// Why.
    pub reason: String,
}

/// Every `v1` Service in the files of `paths` (directories walked as the policy loader
/// walks them; `List` objects flattened), with the file each came from.
///
/// # Errors
/// [`ServiceError::Load`] for a file that cannot be read or parsed; [`ServiceError::Field`]
/// for a Service that does not decode.
pub fn read(paths: &[PathBuf]) -> Result<Vec<Service>, ServiceError> {
    let mut errors = Vec::new();
    let files: Vec<PathBuf> = paths.iter().flat_map(|p| manifest::files(p, &mut errors)).collect();
    if let Some(e) = errors.into_iter().next() {
        return Err(e.into());
    }
    let mut out = Vec::new();
    for file in files {
        for doc in manifest::documents(&file)? {
            collect(doc, &mut out)?;
        }
    }
    Ok(out)
}

fn collect(doc: Value, out: &mut Vec<Service>) -> Result<(), ServiceError> {
    let kind = doc.get("kind").and_then(Value::as_str).unwrap_or_default();
    let api_version = doc.get("apiVersion").and_then(Value::as_str).unwrap_or_default();
    if kind == "List" || kind.ends_with("List") {
        if let Some(Value::Array(items)) = doc.get("items") {
            for item in items.clone() {
                collect(item, out)?;
            }
        }
        return Ok(());
    }
    if kind != "Service" || api_version != "v1" {
        return Ok(());
    }
    let name = doc.pointer("/metadata/name").and_then(Value::as_str).unwrap_or("?").to_owned();
    let service: Service = serde_json::from_value(doc).map_err(|e| ServiceError::Field {
        service: name,
        field: "(document)".into(),
        problem: e.to_string(),
    })?;
    out.push(service);
    Ok(())
}

/// Whether `pod` is Running in `namespace` and carries every label of `selector`.
fn selects(pod: &Pod, namespace: &str, selector: &BTreeMap<String, String>) -> bool {
    let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
    let running = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
    let labels = pod.metadata.labels.as_ref();
    ns == namespace
        && running
        && selector.iter().all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v))
}

/// The target port of `port` on `pod`: a number as given, a name looked up in the pod's
/// container ports of the same protocol; `None` when the pod has no such named port (kube-
/// proxy then leaves the pod out of that port's endpoints).
fn target_port(port: &ServicePort, protocol: Protocol, pod: &Pod) -> Option<u16> {
    match &port.target_port {
        None => u16::try_from(port.port).ok(),
        Some(IntOrString::Int(n)) => u16::try_from(*n).ok(),
        Some(IntOrString::String(name)) => {
            let containers = pod.spec.as_ref().map(|s| s.containers.as_slice()).unwrap_or_default();
            containers.iter().flat_map(|c| c.ports.iter().flatten()).find_map(|p| {
                let proto = p.protocol.as_deref().unwrap_or("TCP").parse::<Protocol>().ok()?;
                (p.name.as_deref() == Some(name.as_str()) && proto == protocol)
                    .then(|| u16::try_from(p.container_port).ok())
                    .flatten()
            })
        }
    }
}

/// Plans `services` against the pods of the manifests (`pods`); `built` gives the
/// addresses of a pod (namespace, name) the lab built, `None` for one it did not build (only
/// built pods are backends). Part of [`Plan::build`](super::plan::Plan::build), which passes
/// the pods it has just planned. Services that are not of type ClusterIP or NodePort, or
/// headless, and NodePort ports without a `nodePort`, are returned second, as [`Unbuilt`].
///
/// # Errors
/// [`ServiceError::Field`] for an invalid ClusterIP, port, target port, node port or
/// protocol.
pub fn plan<'a>(
    services: &[Service],
    pods: &[std::sync::Arc<Pod>],
    built: impl Fn(&str, &str) -> Option<&'a [IpAddr]>,
) -> Result<(Vec<ServicePlan>, Vec<Unbuilt>), ServiceError> {
    let mut planned = Vec::new();
    let mut skipped = Vec::new();
    for svc in services {
        let namespace = svc.metadata.namespace.clone().unwrap_or_else(|| "default".into());
        let name = svc.metadata.name.clone().unwrap_or_default();
        let what = format!("{namespace}/{name}");
        let field = |field: String, problem: String| ServiceError::Field {
            service: what.clone(),
            field,
            problem,
        };
        let skip = |skipped: &mut Vec<Unbuilt>, reason: String| {
            skipped.push(Unbuilt { service: what.clone(), reason });
        };
        let Some(spec) = svc.spec.as_ref() else {
            skip(&mut skipped, "no spec".into());
            continue;
        };
        let node_ports = match spec.type_.as_deref() {
            None | Some("ClusterIP") => false,
            Some("NodePort") => true,
            Some(other) => {
                skip(
                    &mut skipped,
                    format!("spec.type {other}: the lab builds ClusterIP and NodePort only"),
                );
                continue;
            }
        };
        let ip_texts: Vec<String> = match (&spec.cluster_ips, &spec.cluster_ip) {
            (Some(ips), _) if !ips.is_empty() => ips.clone(),
            (_, Some(ip)) => vec![ip.clone()],
            _ => Vec::new(),
        };
        if ip_texts.is_empty() || ip_texts.iter().any(|i| i == "None" || i.is_empty()) {
            skip(&mut skipped, "no spec.clusterIP (headless or unallocated)".into());
            continue;
        }
        let cluster_ips = ip_texts
            .iter()
            .enumerate()
            .map(|(i, t)| {
                t.parse::<IpAddr>()
                    .map_err(|e| field(format!("spec.clusterIPs[{i}]"), format!("{t:?}: {e}")))
            })
            .collect::<Result<Vec<IpAddr>, _>>()?;
        let selector = spec.selector.clone().unwrap_or_default();
        let backends: Vec<(&Pod, String, &[IpAddr])> = if selector.is_empty() {
            Vec::new()
        } else {
            pods.iter()
                .filter(|p| selects(p, &namespace, &selector))
                .filter_map(|p| {
                    let pod_name = p.metadata.name.as_deref().unwrap_or_default();
                    let ips = built(&namespace, pod_name)?;
                    Some((&**p, format!("{namespace}/{pod_name}"), ips))
                })
                .collect()
        };
        let mut ports = Vec::new();
        for (i, sp) in spec.ports.iter().flatten().enumerate() {
            let protocol = sp
                .protocol
                .as_deref()
                .unwrap_or("TCP")
                .parse::<Protocol>()
                .map_err(|e| field(format!("spec.ports[{i}].protocol"), e.to_string()))?;
            let port = u16::try_from(sp.port).ok().filter(|p| *p != 0).ok_or_else(|| {
                field(format!("spec.ports[{i}].port"), format!("{} is not 1-65535", sp.port))
            })?;
            match &sp.target_port {
                Some(IntOrString::Int(n)) if !(1..=65535).contains(n) => {
                    return Err(field(
                        format!("spec.ports[{i}].targetPort"),
                        format!("{n} is not 1-65535"),
                    ));
                }
                Some(IntOrString::String(s)) if s.is_empty() => {
                    return Err(field(format!("spec.ports[{i}].targetPort"), "empty name".into()));
                }
                _ => {}
            }
            let node_port = match sp.node_port {
                _ if !node_ports => None,
                None | Some(0) => {
                    skip(
                        &mut skipped,
                        format!(
                            "spec.ports[{i}].nodePort: none given, and the lab allocates none \
                             (its ClusterIP part is built)"
                        ),
                    );
                    None
                }
                Some(n) => Some(u16::try_from(n).ok().filter(|p| *p != 0).ok_or_else(|| {
                    field(format!("spec.ports[{i}].nodePort"), format!("{n} is not 1-65535"))
                })?),
            };
            for &cluster_ip in &cluster_ips {
                let backends = backends
                    .iter()
                    .filter_map(|(pod, pod_name, ips)| {
                        let ip = ips.iter().find(|a| a.is_ipv4() == cluster_ip.is_ipv4())?;
                        let tp = target_port(sp, protocol, pod)?;
                        Some(ServiceBackend {
                            pod: pod_name.clone(),
                            addr: SocketAddr::new(*ip, tp),
                        })
                    })
                    .collect();
                ports.push(ServicePortPlan {
                    name: sp.name.clone().unwrap_or_default(),
                    protocol,
                    cluster_ip,
                    port,
                    node_port,
                    backends,
                });
            }
        }
        planned.push(ServicePlan { namespace, name, ports });
    }
    Ok((planned, skipped))
}

fn l4(protocol: Protocol) -> &'static str {
    match protocol {
        Protocol::Tcp => "tcp",
        Protocol::Udp => "udp",
        Protocol::Sctp => "sctp",
    }
}

/// The `nft -f` script that replaces table `inet` [`TABLE`] with DNAT for `services`, in
/// kube-proxy's nftables shape: base chains at `prerouting` and `output`, priority
/// `dstnat`, jump to `services`, which sends each (ClusterIP, protocol, port) to a chain
/// that picks a backend with `numgen random mod N vmap` and `goto`s its `dnat` chain, and
/// last sends packets to a local address but loopback to `nodeports`, which sends each
/// (family, protocol, node port) to the same chain as its ClusterIP port. Ports without
/// backends get no rule. One transaction: the `add` + `delete` of the table make re-running
/// it a replacement.
pub fn nft_script(services: &[ServicePlan]) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "add table inet {TABLE}");
    let _ = writeln!(o, "delete table inet {TABLE}");
    let _ = writeln!(o, "table inet {TABLE} {{");
    // -100 is `dstnat`; nft accepts that name at prerouting only, so both use the number.
    for hook in ["prerouting", "output"] {
        let _ = writeln!(
            o,
            "  chain {hook} {{\n    type nat hook {hook} priority -100; policy accept;\n    jump services\n  }}"
        );
    }
    let mut chains = String::new();
    let mut node_ports = String::new();
    let _ = writeln!(o, "  chain services {{");
    for (s, svc) in services.iter().enumerate() {
        for (p, port) in svc.ports.iter().enumerate() {
            if port.backends.is_empty() {
                continue;
            }
            let (fam, chain) =
                (if port.cluster_ip.is_ipv4() { "ip" } else { "ip6" }, format!("svc{s}-{p}"));
            let _ = writeln!(
                o,
                "    {fam} daddr {} {} dport {} jump {chain} comment \"{}/{} {}\"",
                port.cluster_ip,
                l4(port.protocol),
                port.port,
                svc.namespace,
                svc.name,
                if port.name.is_empty() { port.port.to_string() } else { port.name.clone() }
            );
            if let Some(np) = port.node_port {
                let _ = writeln!(
                    node_ports,
                    "    meta nfproto {} {} dport {np} jump {chain} comment \"{}/{} node port\"",
                    if port.cluster_ip.is_ipv4() { "ipv4" } else { "ipv6" },
                    l4(port.protocol),
                    svc.namespace,
                    svc.name,
                );
            }
            let n = port.backends.len();
            let map: Vec<String> = (0..n).map(|e| format!("{e} : goto {chain}-e{e}")).collect();
            let _ = writeln!(
                chains,
                "  chain {chain} {{\n    numgen random mod {n} vmap {{ {} }}\n  }}",
                map.join(", ")
            );
            for (e, b) in port.backends.iter().enumerate() {
                let to = match b.addr {
                    SocketAddr::V4(a) => format!("ip to {a}"),
                    SocketAddr::V6(a) => format!("ip6 to {a}"),
                };
                // A port mapping needs the protocol matched first (kube-proxy writes
                // `meta l4proto tcp dnat ip to ...` too).
                let _ = writeln!(
                    chains,
                    "  chain {chain}-e{e} {{\n    meta l4proto {} dnat {to} comment \"{}\"\n  }}",
                    l4(port.protocol),
                    b.pod
                );
            }
        }
    }
    if !node_ports.is_empty() {
        let _ = writeln!(o, "    fib daddr type local ip daddr != 127.0.0.0/8 jump nodeports");
        let _ = writeln!(o, "    fib daddr type local ip6 daddr != ::1 jump nodeports");
    }
    let _ = writeln!(o, "  }}");
    if !node_ports.is_empty() {
        let _ = write!(o, "  chain nodeports {{\n{node_ports}  }}\n");
    }
    o.push_str(&chains);
    o.push_str("}\n");
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(yaml: &str) -> Pod {
        serde_saphyr::from_str(yaml).expect("pod")
    }

    fn service(yaml: &str) -> Service {
        serde_saphyr::from_str(yaml).expect("service")
    }

    /// The pods a lab built: (namespace, name, addresses).
    struct Built(Vec<(&'static str, &'static str, Vec<IpAddr>)>);

    impl Built {
        fn new(pods: &[(&'static str, &'static str, &str)]) -> Self {
            Built(pods.iter().map(|(ns, n, ip)| (*ns, *n, vec![ip.parse().expect("ip")])).collect())
        }

        fn ips<'a>(&'a self) -> impl Fn(&str, &str) -> Option<&'a [IpAddr]> + 'a {
            |ns, name| {
                self.0.iter().find(|(n, p, _)| *n == ns && *p == name).map(|(_, _, ips)| &ips[..])
            }
        }
    }

    const WEB_A: &str = "metadata: {name: a, namespace: web, labels: {app: web}}\n\
        spec: {containers: [{name: c, ports: [{name: http, containerPort: 8080}, {name: dns, containerPort: 5353, protocol: UDP}]}]}\n\
        status: {phase: Running, podIP: 10.0.0.1}\n";
    const WEB_B: &str = "metadata: {name: b, namespace: web, labels: {app: web}}\n\
        spec: {containers: [{name: c, ports: [{name: http, containerPort: 9090}]}]}\n\
        status: {phase: Running, podIP: 10.0.0.2}\n";
    const PENDING: &str = "metadata: {name: p, namespace: web, labels: {app: web}}\n\
        spec: {containers: [{name: c}]}\nstatus: {phase: Pending, podIP: 10.0.0.3}\n";

    #[test]
    fn named_target_ports_resolve_per_pod_and_protocol() {
        let pods = [pod(WEB_A).into(), pod(WEB_B).into(), pod(PENDING).into()];
        let lab = Built::new(&[
            ("web", "a", "10.0.0.1"),
            ("web", "b", "10.0.0.2"),
            ("web", "p", "10.0.0.3"),
        ]);
        let svc = service(
            "apiVersion: v1\nkind: Service\nmetadata: {name: s, namespace: web}\n\
             spec: {clusterIP: 10.96.0.10, selector: {app: web}, ports: [\
             {name: h, port: 80, targetPort: http}, {port: 53, protocol: UDP, targetPort: dns}, {port: 81}]}\n",
        );
        let (planned, skipped) = plan(&[svc], &pods, lab.ips()).expect("plan");
        assert!(skipped.is_empty());
        let ports = &planned[0].ports;
        let backends = |i: usize| -> Vec<String> {
            ports[i].backends.iter().map(|b| format!("{} {}", b.pod, b.addr)).collect()
        };
        // The Pending pod is no backend; each pod's own "http" number is used.
        assert_eq!(backends(0), ["web/a 10.0.0.1:8080", "web/b 10.0.0.2:9090"]);
        // Only a has a UDP port named dns.
        assert_eq!(backends(1), ["web/a 10.0.0.1:5353"]);
        // No targetPort: the port itself.
        assert_eq!(backends(2), ["web/a 10.0.0.1:81", "web/b 10.0.0.2:81"]);
        let script = nft_script(&planned);
        assert!(
            script.contains("ip daddr 10.96.0.10 tcp dport 80 jump svc0-0 comment \"web/s h\""),
            "{script}"
        );
        assert!(
            script.contains("numgen random mod 2 vmap { 0 : goto svc0-0-e0, 1 : goto svc0-0-e1 }"),
            "{script}"
        );
        assert!(
            script.contains("meta l4proto tcp dnat ip to 10.0.0.2:9090 comment \"web/b\""),
            "{script}"
        );
        assert!(script.contains("ip daddr 10.96.0.10 udp dport 53 jump svc0-1"), "{script}");
    }

    #[test]
    fn dual_stack_cluster_ips_take_backends_of_their_own_family() {
        let mut lab = Built::new(&[("web", "a", "10.0.0.1")]);
        lab.0[0].2.push("fd00::1".parse().expect("ip"));
        let svc = service(
            "metadata: {name: s, namespace: web}\n\
             spec: {clusterIPs: [10.96.0.10, 'fd00:96::10'], selector: {app: web}, \
             ports: [{port: 80, targetPort: 8080, protocol: SCTP}]}\n",
        );
        let (planned, _) = plan(&[svc], &[pod(WEB_A).into()], lab.ips()).expect("plan");
        let ports = &planned[0].ports;
        assert_eq!(ports.len(), 2);
        assert_eq!(ports[0].backends[0].addr, "10.0.0.1:8080".parse().expect("addr"));
        assert_eq!(ports[1].backends[0].addr, "[fd00::1]:8080".parse().expect("addr"));
        let script = nft_script(&planned);
        assert!(script.contains("ip6 daddr fd00:96::10 sctp dport 80 jump svc0-1"), "{script}");
        assert!(script.contains("meta l4proto sctp dnat ip6 to [fd00::1]:8080"), "{script}");
    }

    #[test]
    fn node_ports_send_local_addresses_to_their_cluster_ip_port_chain() {
        let mut lab = Built::new(&[("web", "a", "10.0.0.1")]);
        lab.0[0].2.push("fd00::1".parse().expect("ip"));
        let svc = service(
            "metadata: {name: s, namespace: web}\n\
             spec: {type: NodePort, clusterIPs: [10.96.0.10, 'fd00:96::10'], selector: {app: web}, \
             ports: [{name: h, port: 80, targetPort: 8080, nodePort: 30080}, \
             {port: 53, protocol: UDP, targetPort: 5353}]}\n",
        );
        let (planned, skipped) = plan(&[svc], &[pod(WEB_A).into()], lab.ips()).expect("plan");
        let ports = &planned[0].ports;
        let node_ports: Vec<_> =
            ports.iter().map(|p| (p.cluster_ip.is_ipv4(), p.node_port)).collect();
        assert_eq!(
            node_ports,
            [(true, Some(30080)), (false, Some(30080)), (true, None), (false, None)]
        );
        // The UDP port has no nodePort: the lab allocates none and says so.
        assert_eq!(skipped.len(), 1, "{skipped:?}");
        assert!(skipped[0].reason.starts_with("spec.ports[1].nodePort: none given"), "{skipped:?}");
        let script = nft_script(&planned);
        for line in [
            "fib daddr type local ip daddr != 127.0.0.0/8 jump nodeports",
            "fib daddr type local ip6 daddr != ::1 jump nodeports",
            "meta nfproto ipv4 tcp dport 30080 jump svc0-0 comment \"web/s node port\"",
            "meta nfproto ipv6 tcp dport 30080 jump svc0-1 comment \"web/s node port\"",
        ] {
            assert!(script.contains(line), "{line}: {script}");
        }
        // The ClusterIP rules come first; the node ports last, in a chain of their own.
        let cluster_ip = script.find("ip daddr 10.96.0.10 tcp dport 80 jump svc0-0").expect("rule");
        assert!(cluster_ip < script.find("jump nodeports").expect("jump"), "{script}");
        assert!(!script.contains("udp dport 30080"), "{script}");
        // Without node ports, no `nodeports` chain and no jump to it.
        let (planned, _) = plan(
            &[service("metadata: {name: c, namespace: web}\nspec: {clusterIP: 10.96.0.11, selector: {app: web}, ports: [{port: 80}]}\n")],
            &[pod(WEB_A).into()],
            lab.ips(),
        )
        .expect("plan");
        assert!(!nft_script(&planned).contains("nodeports"));
    }

    #[test]
    fn other_types_and_headless_are_skipped_bad_fields_are_errors() {
        let lab = Built::new(&[]);
        let lb = service(
            "metadata: {name: lb}\nspec: {type: LoadBalancer, clusterIP: 10.96.0.1, ports: [{port: 80}]}\n",
        );
        let headless =
            service("metadata: {name: h}\nspec: {clusterIP: None, ports: [{port: 80}]}\n");
        let (planned, skipped) = plan(&[lb, headless], &[], lab.ips()).expect("plan");
        assert!(planned.is_empty());
        assert_eq!(skipped.len(), 2);
        assert!(skipped[0].reason.contains("LoadBalancer"), "{skipped:?}");
        assert!(skipped[1].reason.contains("headless"), "{skipped:?}");
        let bad = service(
            "metadata: {name: b}\nspec: {type: NodePort, clusterIP: 10.96.0.3, ports: [{port: 80, nodePort: 65536}]}\n",
        );
        let e = plan(&[bad], &[], lab.ips()).unwrap_err().to_string();
        assert_eq!(e, "Service default/b: spec.ports[0].nodePort: 65536 is not 1-65535");
        let bad =
            service("metadata: {name: b}\nspec: {clusterIP: 10.96.0.300, ports: [{port: 80}]}\n");
        let e = plan(&[bad], &[], lab.ips()).unwrap_err().to_string();
        assert!(e.starts_with("Service default/b: spec.clusterIPs[0]: \"10.96.0.300\""), "{e}");
        let bad = service(
            "metadata: {name: b}\nspec: {clusterIP: 10.96.0.3, ports: [{port: 80, targetPort: 70000}]}\n",
        );
        let e = plan(&[bad], &[], lab.ips()).unwrap_err().to_string();
        assert_eq!(e, "Service default/b: spec.ports[0].targetPort: 70000 is not 1-65535");
    }
}
