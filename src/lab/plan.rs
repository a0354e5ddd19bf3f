//! The lab's topology as a value: which network namespaces, links, addresses, routes,
//! servers and ClusterIP and NodePort Services a set of manifests (and probes) asks for.
//! Pure: nothing here touches the system;
//! [`Plan::link_script`] and [`Plan::netns_scripts`] render it as `ip -batch` commands.
//!
//! Shape (one lab, prefix `P`):
//!
//! ```text
//!  P_pod_<ns>_<pod>          P_node_<node>                     P_fabric
//!  eth0 (podIP/32,/128) ──── pod<k> (no v4 addr; fe80::1)
//!                            fabric0 (node addrs /32, /128; ──── node<i> ── br0 (169.254.0.1, fe80::1)
//!                                     fe80::2:<i+1>)                      lo: external addresses
//! ```
//!
//! - A pod's default route goes to its node: IPv4 via the node's first IPv4 address (the
//!   node answers ARP for it on every interface), IPv6 via the link-local `fe80::1` the
//!   node holds on the pod's veth.
//! - Nodes route each remote pod's /32 (/128) via the owning node: IPv4 via its first IPv4
//!   address, IPv6 via its fabric link-local `fe80::2:<i+1>`, so IPv6 pods need no IPv6
//!   node address. Their default route leads to the fabric namespace.
//! - The fabric namespace is the L2 switch between the nodes and also plays "the outside
//!   world": it holds every probed address that is neither a pod's nor a node's, and serves
//!   it, so probes from and to external IPs are real connections too.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use k8s_openapi::api::core::v1::Service;
use serde::{Deserialize, Serialize};

use super::service::{self, ServiceError, ServicePlan};
use crate::cluster::manifest::Loaded;
use crate::policy::{Flow, Protocol, Snapshot};

/// The fabric namespace's IPv4 address on its bridge, the nodes' IPv4 default gateway.
/// Link-local (RFC 3927) so it cannot be a pod, node or external address of a real cluster;
/// a manifest or probe that uses it anyway is refused ([`PlanError::Reserved`]).
pub const FABRIC_GATEWAY_V4: Ipv4Addr = Ipv4Addr::new(169, 254, 0, 1);
/// The fabric namespace's IPv6 link-local address on its bridge (the nodes' IPv6 default
/// gateway), and the node's address on every pod veth (the pods' IPv6 default gateway).
pub const GATEWAY_V6: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);
/// Longest netns name built from Kubernetes names before it is replaced by a hash: the
/// names live as files in `/run/netns`, whose file names are at most 255 bytes.
const MAX_NETNS_NAME: usize = 200;
/// Longest prefix accepted: leaves room for the namespace and pod names in a netns name.
pub const MAX_PREFIX: usize = 32;

/// Why the manifests cannot become a lab.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The prefix is not lowercase letters, digits and `-`, starting with a letter or digit.
    #[error(
        "invalid prefix {prefix:?}: use 1 to {MAX_PREFIX} of a-z, 0-9 and '-', starting with a letter or digit"
    )]
    Prefix {
        /// The prefix given.
        prefix: String,
    },
    /// An address the lab reserves for itself appears in the manifests or probes.
    #[error("{what} uses {addr}, which the lab reserves for the fabric gateway")]
    Reserved {
        /// The object or probe end (`pod ns/name`, `node n`, `probe address`).
        what: String,
        /// The address.
        addr: IpAddr,
    },
    /// A Service has an invalid field ([`service::plan`]).
    #[error(transparent)]
    Service(#[from] ServiceError),
}

/// A node of the lab: a router namespace attached to the fabric.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodePlan {
    /// `metadata.name` of the Node.
    pub name: String,
    /// Its network namespace.
    pub netns: String,
    /// Its addresses (`status.addresses` InternalIP/ExternalIP, plus its hostNetwork pods'
    /// IPs), as the policy engine sees them; all held on `fabric0`.
    pub addrs: Vec<IpAddr>,
    /// Its first IPv4 address: the next hop other namespaces use for its IPv4 pods.
    pub next_hop_v4: Option<Ipv4Addr>,
    /// Its link-local address on the fabric: the next hop for its IPv6 pods and addresses.
    pub next_hop_v6: Ipv6Addr,
    /// Name of its veth end inside the node namespace (`fabric0`).
    pub fabric_if: String,
    /// Name of the other end, a bridge port in the fabric namespace (`node<i>`).
    pub bridge_port: String,
}

/// A pod-network pod of the lab: its own namespace, a veth to its node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodPlan {
    /// `metadata.namespace`.
    pub namespace: String,
    /// `metadata.name`.
    pub name: String,
    /// `spec.nodeName`.
    pub node: String,
    /// Its network namespace.
    pub netns: String,
    /// `status.podIP`/`podIPs`, as the policy engine reads them.
    pub ips: Vec<IpAddr>,
    /// Name of the veth end in the node namespace (`pod<k>`).
    pub host_if: String,
    /// Name of the veth end in the pod namespace (`eth0`).
    pub pod_if: String,
}

/// One echo server process: every port on every address of one namespace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerPlan {
    /// The namespace it runs in.
    pub netns: String,
    /// The addresses it binds (pod IPs, node addresses, or external addresses).
    pub bind: Vec<IpAddr>,
    /// TCP ports, ascending.
    pub tcp: Vec<u16>,
    /// UDP ports, ascending.
    pub udp: Vec<u16>,
    /// SCTP ports, ascending (absent in the state files of labs built before SCTP was
    /// served: none).
    #[serde(default)]
    pub sctp: Vec<u16>,
    /// The TCP ports of [`ServerPlan::tcp`] served close-first (the server answers one
    /// request and closes before the client: `lab serve --tcp-close-first`), ascending:
    /// ports a Pod declares with the name [`CLOSE_FIRST_PORT_NAME`]. Absent in the state
    /// files of labs built before them: none.
    #[serde(default)]
    pub tcp_close_first: Vec<u16>,
}

/// The `containerPort` name that asks the lab to serve a TCP port close-first: the echo
/// server answers one request and sends its FIN before the client does, as an HTTP/1.0
/// server with `Connection: close` does (see [`super::serve`]). A lab convention, valid as
/// a Kubernetes port name (an IANA_SVC_NAME: at most 15 lowercase letters, digits and
/// hyphens).
pub const CLOSE_FIRST_PORT_NAME: &str = "close-first";

/// Something in the manifests the lab left out, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Skipped {
    /// `pod ns/name` or `node name`.
    pub object: String,
    /// Why.
    pub reason: String,
}

/// The whole topology of one lab.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// Prefix of every namespace name (`<prefix>_...`).
    pub prefix: String,
    /// The fabric namespace (bridge `br0`, the outside world).
    pub fabric: String,
    /// Nodes, in manifest order; a node's index `i` names its bridge port `node<i>`.
    pub nodes: Vec<NodePlan>,
    /// Pod-network pods, in manifest order; index `k` names the node-side veth `pod<k>`.
    pub pods: Vec<PodPlan>,
    /// hostNetwork pods (`ns/name` → node name): they live in their node's namespace.
    pub host_pods: BTreeMap<String, String>,
    /// Addresses of the outside world held (and served) by the fabric namespace.
    pub external: Vec<IpAddr>,
    /// Echo servers, one per namespace that serves anything.
    pub servers: Vec<ServerPlan>,
    /// Pods and nodes left out, with the reason.
    pub skipped: Vec<Skipped>,
    /// Pods and nodes left out on purpose ([`INSTANTIATE_ANNOTATION`]): counted, not
    /// listed (a large synthetic policy set has thousands).
    #[serde(default)]
    pub uninstantiated: Uninstantiated,
    /// ClusterIP and NodePort Services, installed as DNAT in every node namespace
    /// ([`super::service`]), planned by [`Plan::build`] against the pods it built (absent
    /// in the state files of labs built before Services: none).
    #[serde(default)]
    pub services: Vec<ServicePlan>,
}

/// Annotation on a Pod or Node: `"false"` keeps the lab from building it (no namespace,
/// no veth, no server, no agent), while everything reading the manifests (agents,
/// `explain`) still sees it. Pods on a node left out are left out too. This is how a load
/// test loads a large policy set over 10,000 pods without building 10,000 namespaces
/// (`tierproxy lab synth`).
pub const INSTANTIATE_ANNOTATION: &str = "lab.tierproxy.io/instantiate";

/// How many pods and nodes [`INSTANTIATE_ANNOTATION`] left out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Uninstantiated {
    /// Pods left out (annotated, or on a node left out).
    pub pods: usize,
    /// Nodes left out.
    pub nodes: usize,
}

/// Whether `meta` asks the lab to leave its object out.
fn left_out(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> bool {
    meta.annotations.as_ref().and_then(|a| a.get(INSTANTIATE_ANNOTATION)).map(String::as_str)
        == Some("false")
}

/// The `<prefix>_` every namespace name of the lab starts with. `_` cannot occur in a
/// prefix, so one lab's names never start with another's.
pub fn netns_prefix(prefix: &str) -> String {
    format!("{prefix}_")
}

/// Checks a prefix: 1 to [`MAX_PREFIX`] of `a-z`, `0-9`, `-`, starting with a letter or
/// digit.
///
/// # Errors
/// [`PlanError::Prefix`].
pub fn validate_prefix(prefix: &str) -> Result<(), PlanError> {
    let ok = !prefix.is_empty()
        && prefix.len() <= MAX_PREFIX
        && !prefix.starts_with('-')
        && prefix.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if ok { Ok(()) } else { Err(PlanError::Prefix { prefix: prefix.to_string() }) }
}

/// A namespace name from `<prefix>_<kind>_<parts joined by _>`; Kubernetes names hold no
/// `_`, so the parts stay apart. Overlong names become a hash of themselves.
fn netns_name(prefix: &str, kind: &str, parts: &[&str]) -> String {
    let name = format!("{prefix}_{kind}_{}", parts.join("_"));
    if name.len() <= MAX_NETNS_NAME {
        return name;
    }
    // FNV-1a, 64 bits: stable across runs and builds (std's hasher is not).
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{prefix}_{kind}_{h:016x}")
}

fn host_len(ip: IpAddr) -> u8 {
    if ip.is_ipv4() { 32 } else { 128 }
}

fn first_v4(addrs: &[IpAddr]) -> Option<Ipv4Addr> {
    addrs.iter().find_map(|a| match a {
        IpAddr::V4(v4) => Some(*v4),
        IpAddr::V6(_) => None,
    })
}

/// Ports one namespace serves, by protocol.
#[derive(Debug, Default)]
struct Ports {
    tcp: BTreeSet<u16>,
    udp: BTreeSet<u16>,
    sctp: BTreeSet<u16>,
    /// Of `tcp`, the ports served close-first.
    tcp_close_first: BTreeSet<u16>,
}

impl Ports {
    fn insert(&mut self, protocol: Protocol, port: u16) {
        match protocol {
            Protocol::Tcp => self.tcp.insert(port),
            Protocol::Udp => self.udp.insert(port),
            Protocol::Sctp => self.sctp.insert(port),
        };
    }

    fn extend(&mut self, other: Ports) {
        self.tcp.extend(other.tcp);
        self.udp.extend(other.udp);
        self.sctp.extend(other.sctp);
        self.tcp_close_first.extend(other.tcp_close_first);
    }
}

/// Ports a pod declares in its containers, by protocol (unknown protocols left out).
fn declared_ports(pod: &crate::policy::api::Pod) -> Ports {
    let mut out = Ports::default();
    let containers = pod.spec.as_ref().map(|s| s.containers.as_slice()).unwrap_or_default();
    for port in containers.iter().flat_map(|c| c.ports.iter().flatten()) {
        let Ok(n) = u16::try_from(port.container_port) else { continue };
        if n == 0 {
            continue;
        }
        if let Ok(protocol) = port.protocol.as_deref().unwrap_or("TCP").parse::<Protocol>() {
            out.insert(protocol, n);
            if protocol == Protocol::Tcp && port.name.as_deref() == Some(CLOSE_FIRST_PORT_NAME) {
                out.tcp_close_first.insert(n);
            }
        }
    }
    out
}

impl Plan {
    /// Plans the lab for `loaded` (compiled into `snapshot`), the flows of the probes
    /// that will run on it (their ports are served; their addresses that belong to no pod or
    /// node become external addresses of the fabric namespace) and the `v1` Services of the
    /// manifests (read by [`service::read`]; the policy loader skips them), whose backends
    /// are the pods planned here.
    ///
    /// Pods that are not running, have no IP, are not scheduled, whose node is missing or
    /// has no usable address, or whose IP is already taken are left out and listed in
    /// [`Plan::skipped`]; so are Services the lab does not build (not ClusterIP, headless).
    ///
    /// # Errors
    /// [`PlanError`] for a bad prefix, a use of [`FABRIC_GATEWAY_V4`] or an invalid Service
    /// field.
    pub fn build(
        prefix: &str,
        loaded: &Loaded,
        snapshot: &Snapshot,
        flows: &[Flow],
        services: &[Service],
    ) -> Result<Plan, PlanError> {
        validate_prefix(prefix)?;
        let mut plan = Plan {
            prefix: prefix.to_string(),
            fabric: format!("{prefix}_fabric"),
            nodes: Vec::new(),
            pods: Vec::new(),
            host_pods: BTreeMap::new(),
            external: Vec::new(),
            servers: Vec::new(),
            skipped: Vec::new(),
            uninstantiated: Uninstantiated::default(),
            services: Vec::new(),
        };
        let reserved = IpAddr::V4(FABRIC_GATEWAY_V4);
        let mut left_out_nodes = BTreeSet::new();
        // Who owns each address so far: for conflicts, and to find external addresses.
        let mut owner: BTreeMap<IpAddr, String> = BTreeMap::new();
        let mut seen_nodes = BTreeSet::new();
        for node in &loaded.inputs.nodes {
            let name = node.metadata.name.clone().unwrap_or_default();
            if !seen_nodes.insert(name.clone()) {
                continue; // A duplicate: the compiler reported it, the first one counts.
            }
            if left_out(&node.metadata) {
                plan.uninstantiated.nodes += 1;
                left_out_nodes.insert(name);
                continue;
            }
            let addrs: Vec<IpAddr> = snapshot
                .find_node(&name)
                .map(|id| snapshot.node_addrs(id).to_vec())
                .unwrap_or_default();
            if let Some(a) = addrs.iter().find(|a| **a == reserved) {
                return Err(PlanError::Reserved { what: format!("node {name}"), addr: *a });
            }
            if addrs.is_empty() {
                plan.skipped.push(Skipped {
                    object: format!("node {name}"),
                    reason: "no InternalIP/ExternalIP address in status.addresses".into(),
                });
                continue;
            }
            if let Some(a) = addrs.iter().find(|a| owner.contains_key(a)) {
                plan.skipped.push(Skipped {
                    object: format!("node {name}"),
                    reason: format!("address {a} is already {}'s", owner[a]),
                });
                continue;
            }
            let i = plan.nodes.len();
            for a in &addrs {
                owner.insert(*a, format!("node {name}"));
            }
            plan.nodes.push(NodePlan {
                netns: netns_name(prefix, "node", &[&name]),
                next_hop_v4: first_v4(&addrs),
                next_hop_v6: Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 2, (i + 1) as u16),
                fabric_if: "fabric0".into(),
                bridge_port: format!("node{i}"),
                addrs,
                name,
            });
        }

        // Ports to serve, per namespace.
        let mut ports: BTreeMap<String, Ports> = BTreeMap::new();
        let mut seen_pods = BTreeSet::new();
        for pod in &loaded.inputs.pods {
            let ns = pod.metadata.namespace.clone().unwrap_or_else(|| "default".into());
            let name = pod.metadata.name.clone().unwrap_or_default();
            let what = format!("{ns}/{name}");
            if !seen_pods.insert(what.clone()) {
                continue;
            }
            let skip = |plan: &mut Plan, reason: String| {
                plan.skipped.push(Skipped { object: format!("pod {what}"), reason });
            };
            let spec = pod.spec.as_ref();
            let on_left_out_node =
                spec.and_then(|s| s.node_name.as_ref()).is_some_and(|n| left_out_nodes.contains(n));
            if left_out(&pod.metadata) || on_left_out_node {
                plan.uninstantiated.pods += 1;
                continue;
            }
            let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
            if let Some(p @ ("Succeeded" | "Failed")) = phase {
                skip(&mut plan, format!("not running (phase {p})"));
                continue;
            }
            let Some(node_name) = spec.and_then(|s| s.node_name.clone()) else {
                skip(&mut plan, "not scheduled (no spec.nodeName)".into());
                continue;
            };
            let Some(node) = plan.nodes.iter().find(|n| n.name == node_name) else {
                let why = if seen_nodes.contains(&node_name) {
                    format!("its node {node_name} is not in the lab (see above)")
                } else {
                    format!("its node {node_name} is not in the manifests")
                };
                skip(&mut plan, why);
                continue;
            };
            let (node_netns, node_v4) = (node.netns.clone(), node.next_hop_v4);
            let declared = declared_ports(pod);
            if spec.and_then(|s| s.host_network).unwrap_or(false) {
                plan.host_pods.insert(what.clone(), node_name.clone());
                ports.entry(node_netns).or_default().extend(declared);
                continue;
            }
            let ips: Vec<IpAddr> = snapshot
                .find_pod(&ns, &name)
                .map(|id| snapshot.pod_ips(id).to_vec())
                .unwrap_or_default();
            if ips.is_empty() {
                skip(&mut plan, "no IP (status.podIP)".into());
                continue;
            }
            if let Some(a) = ips.iter().find(|a| **a == reserved) {
                return Err(PlanError::Reserved { what: format!("pod {what}"), addr: *a });
            }
            if let Some(a) = ips.iter().find(|a| owner.contains_key(a)) {
                skip(&mut plan, format!("IP {a} is already {}'s", owner[a]));
                continue;
            }
            if ips.iter().any(IpAddr::is_ipv4) && node_v4.is_none() {
                skip(&mut plan, format!("it has an IPv4 address, its node {node_name} none"));
                continue;
            }
            for a in &ips {
                owner.insert(*a, format!("pod {what}"));
            }
            let k = plan.pods.len();
            let netns = netns_name(prefix, "pod", &[&ns, &name]);
            ports.entry(netns.clone()).or_default().extend(declared);
            plan.pods.push(PodPlan {
                namespace: ns,
                name,
                node: node_name,
                netns,
                ips,
                host_if: format!("pod{k}"),
                pod_if: "eth0".into(),
            });
        }
        // Addresses of pods the lab left out are not the outside world's.
        let left_out: BTreeSet<IpAddr> = loaded
            .inputs
            .pods
            .iter()
            .filter_map(|p| {
                snapshot.find_pod(p.metadata.namespace.as_deref()?, p.metadata.name.as_deref()?)
            })
            .flat_map(|id| snapshot.pod_ips(id).iter().copied())
            .filter(|a| !owner.contains_key(a))
            .collect();

        let mut external = BTreeSet::new();
        for f in flows {
            for a in [f.src, f.dst] {
                if a == reserved {
                    return Err(PlanError::Reserved { what: "a probe".into(), addr: a });
                }
                if !owner.contains_key(&a) && !left_out.contains(&a) {
                    external.insert(a);
                }
            }
        }
        plan.external = external.into_iter().collect();
        for f in flows {
            let Some(netns) = plan.owner(f.dst).map(str::to_string) else { continue };
            if f.dst_port == 0 {
                continue;
            }
            ports.entry(netns).or_default().insert(f.protocol, f.dst_port);
        }
        for (netns, Ports { tcp, udp, sctp, tcp_close_first }) in ports {
            if tcp.is_empty() && udp.is_empty() && sctp.is_empty() {
                continue;
            }
            let bind = plan.addresses_of(&netns);
            plan.servers.push(ServerPlan {
                netns,
                bind,
                tcp: tcp.into_iter().collect(),
                udp: udp.into_iter().collect(),
                sctp: sctp.into_iter().collect(),
                tcp_close_first: tcp_close_first.into_iter().collect(),
            });
        }
        let (services, skipped) = service::plan(services, &loaded.inputs.pods, |ns, name| {
            let p = plan.pods.iter().find(|p| p.namespace == ns && p.name == name)?;
            Some(p.ips.as_slice())
        })?;
        plan.services = services;
        plan.skipped.extend(
            skipped
                .into_iter()
                .map(|u| Skipped { object: format!("service {}", u.service), reason: u.reason }),
        );
        Ok(plan)
    }

    /// Every namespace of the lab: fabric, nodes, pods.
    pub fn all_netns(&self) -> Vec<String> {
        std::iter::once(self.fabric.clone())
            .chain(self.nodes.iter().map(|n| n.netns.clone()))
            .chain(self.pods.iter().map(|p| p.netns.clone()))
            .collect()
    }

    /// The addresses namespace `netns` holds (pod IPs, node addresses, external addresses).
    pub fn addresses_of(&self, netns: &str) -> Vec<IpAddr> {
        if netns == self.fabric {
            return self.external.clone();
        }
        if let Some(n) = self.nodes.iter().find(|n| n.netns == netns) {
            return n.addrs.clone();
        }
        self.pods.iter().find(|p| p.netns == netns).map(|p| p.ips.clone()).unwrap_or_default()
    }

    /// The namespace that holds `addr`, if any: a pod's, a node's, or the fabric for an
    /// external address.
    pub fn owner(&self, addr: IpAddr) -> Option<&str> {
        if let Some(p) = self.pods.iter().find(|p| p.ips.contains(&addr)) {
            return Some(&p.netns);
        }
        if let Some(n) = self.nodes.iter().find(|n| n.addrs.contains(&addr)) {
            return Some(&n.netns);
        }
        self.external.contains(&addr).then_some(self.fabric.as_str())
    }

    /// Whether some server of the lab listens on `addr`:`port` for `protocol`.
    pub fn serves(&self, addr: IpAddr, protocol: Protocol, port: u16) -> bool {
        self.servers.iter().any(|s| {
            s.bind.contains(&addr)
                && match protocol {
                    Protocol::Tcp => s.tcp.contains(&port),
                    Protocol::Udp => s.udp.contains(&port),
                    Protocol::Sctp => s.sctp.contains(&port),
                }
        })
    }

    /// The namespace of a `kubectl exec`-style target: `namespace/pod` (a hostNetwork pod
    /// is in its node's namespace), `node/<name>`, or `fabric`.
    pub fn netns_of_target(&self, target: &str) -> Option<&str> {
        if target == "fabric" {
            return Some(&self.fabric);
        }
        if let Some(node) = target.strip_prefix("node/") {
            return self.nodes.iter().find(|n| n.name == node).map(|n| n.netns.as_str());
        }
        let (ns, name) = target.split_once('/')?;
        if let Some(p) = self.pods.iter().find(|p| p.namespace == ns && p.name == name) {
            return Some(&p.netns);
        }
        let node = self.host_pods.get(target)?;
        self.nodes.iter().find(|n| &n.name == node).map(|n| n.netns.as_str())
    }

    fn node(&self, name: &str) -> Option<&NodePlan> {
        self.nodes.iter().find(|n| n.name == name)
    }

    fn uses_v6(&self) -> bool {
        self.pods.iter().flat_map(|p| &p.ips).chain(&self.external).any(IpAddr::is_ipv6)
            || self.nodes.iter().flat_map(|n| &n.addrs).any(IpAddr::is_ipv6)
    }

    /// `ip -batch` commands, run in the initial namespace, that create every veth pair with
    /// each end directly in its namespace (so no end ever shows up in the host's namespace).
    pub fn link_script(&self) -> Vec<String> {
        let mut out = Vec::new();
        for n in &self.nodes {
            out.push(format!(
                "link add {} netns {} type veth peer name {} netns {}",
                n.fabric_if, n.netns, n.bridge_port, self.fabric
            ));
        }
        for p in &self.pods {
            let Some(node) = self.node(&p.node) else { continue };
            out.push(format!(
                "link add {} netns {} type veth peer name {} netns {}",
                p.host_if, node.netns, p.pod_if, p.netns
            ));
        }
        out
    }

    /// Per namespace, the `ip -batch` commands that configure it once its links exist:
    /// links up, addresses, routes. Fabric first, then nodes, then pods.
    pub fn netns_scripts(&self) -> Vec<(String, Vec<String>)> {
        let v6 = self.uses_v6();
        let mut out = Vec::new();

        // The fabric: bridge, the outside world's addresses, routes to nodes and pods.
        let mut f = vec![
            "link set lo up".to_string(),
            // No multicast snooping: without a querier it can starve IPv6 neighbour discovery.
            "link add br0 type bridge mcast_snooping 0".into(),
            "link set br0 up".into(),
            format!("addr add {FABRIC_GATEWAY_V4}/32 dev br0"),
        ];
        if v6 {
            f.push(format!("addr add {GATEWAY_V6}/64 dev br0 nodad"));
        }
        for n in &self.nodes {
            f.push(format!("link set {} master br0", n.bridge_port));
            f.push(format!("link set {} up", n.bridge_port));
        }
        for a in &self.external {
            f.push(format!("addr add {a}/{} dev lo", host_len(*a)));
        }
        for n in &self.nodes {
            f.extend(routes_to_node(n, "br0"));
            for p in self.pods.iter().filter(|p| p.node == n.name) {
                f.extend(routes_via_node(n, &p.ips, "br0"));
            }
        }
        out.push((self.fabric.clone(), f));

        for n in &self.nodes {
            let mut s = vec!["link set lo up".to_string(), format!("link set {} up", n.fabric_if)];
            for a in &n.addrs {
                let nodad = if a.is_ipv6() { " nodad" } else { "" };
                s.push(format!("addr add {a}/{} dev {}{nodad}", host_len(*a), n.fabric_if));
            }
            s.push(format!("addr add {}/64 dev {} nodad", n.next_hop_v6, n.fabric_if));
            s.push(format!("route add {FABRIC_GATEWAY_V4}/32 dev {} scope link", n.fabric_if));
            s.push(format!("route add default via {FABRIC_GATEWAY_V4} dev {}", n.fabric_if));
            if v6 {
                s.push(format!("route add default via {GATEWAY_V6} dev {}", n.fabric_if));
            }
            for other in self.nodes.iter().filter(|o| o.name != n.name) {
                s.extend(routes_to_node(other, &n.fabric_if));
            }
            let src_v4 = n.next_hop_v4;
            let src_v6 = n.addrs.iter().find(|a| a.is_ipv6());
            for p in &self.pods {
                if p.node == n.name {
                    s.push(format!("link set {} up", p.host_if));
                    if p.ips.iter().any(IpAddr::is_ipv6) {
                        s.push(format!("addr add {GATEWAY_V6}/64 dev {} nodad", p.host_if));
                    }
                    for ip in &p.ips {
                        // Source pinned to the node's address: traffic from a pod's own
                        // node must carry the node's IP (DESIGN §2, kubelet probes).
                        let src = match ip {
                            IpAddr::V4(_) => src_v4.map(|a| format!(" src {a}")),
                            IpAddr::V6(_) => src_v6.map(|a| format!(" src {a}")),
                        };
                        s.push(format!(
                            "route add {ip}/{} dev {} scope link{}",
                            host_len(*ip),
                            p.host_if,
                            src.unwrap_or_default()
                        ));
                    }
                } else if let Some(owner) = self.node(&p.node) {
                    s.extend(routes_via_node(owner, &p.ips, &n.fabric_if));
                }
            }
            out.push((n.netns.clone(), s));
        }

        for p in &self.pods {
            let Some(node) = self.node(&p.node) else { continue };
            let mut s = vec!["link set lo up".to_string(), format!("link set {} up", p.pod_if)];
            for ip in &p.ips {
                let nodad = if ip.is_ipv6() { " nodad" } else { "" };
                s.push(format!("addr add {ip}/{} dev {}{nodad}", host_len(*ip), p.pod_if));
            }
            if let (Some(IpAddr::V4(own)), Some(gw)) =
                (p.ips.iter().find(|a| a.is_ipv4()), node.next_hop_v4)
            {
                s.push(format!("route add {gw}/32 dev {} scope link", p.pod_if));
                s.push(format!("route add default via {gw} dev {} src {own}", p.pod_if));
            }
            if p.ips.iter().any(IpAddr::is_ipv6) {
                s.push(format!("route add default via {GATEWAY_V6} dev {}", p.pod_if));
            }
            out.push((p.netns.clone(), s));
        }
        out
    }
}

/// Routes, on interface `dev`, to node `n`'s addresses: its first IPv4 address on the
/// link, the others via their family's next hop.
fn routes_to_node(n: &NodePlan, dev: &str) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(v4) = n.next_hop_v4 {
        out.push(format!("route add {v4}/32 dev {dev} scope link"));
    }
    for a in &n.addrs {
        match a {
            IpAddr::V4(v4) if Some(*v4) == n.next_hop_v4 => {}
            IpAddr::V4(_) => {
                if let Some(hop) = n.next_hop_v4 {
                    out.push(format!("route add {a}/32 via {hop} dev {dev}"));
                }
            }
            IpAddr::V6(_) => out.push(format!("route add {a}/128 via {} dev {dev}", n.next_hop_v6)),
        }
    }
    out
}

/// Routes, on interface `dev`, to `ips` (a pod's) via their node `n`.
fn routes_via_node(n: &NodePlan, ips: &[IpAddr], dev: &str) -> Vec<String> {
    ips.iter()
        .filter_map(|ip| match ip {
            IpAddr::V4(_) => {
                n.next_hop_v4.map(|hop| format!("route add {ip}/32 via {hop} dev {dev}"))
            }
            IpAddr::V6(_) => Some(format!("route add {ip}/128 via {} dev {dev}", n.next_hop_v6)),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::manifest;
    use crate::policy::Revision;
    use std::path::Path;

    const CLUSTER: &str = r#"
apiVersion: v1
kind: Node
metadata: {name: n1}
status: {addresses: [{type: InternalIP, address: 172.18.0.2}, {type: Hostname, address: n1}]}
---
apiVersion: v1
kind: Node
metadata: {name: n2}
status: {addresses: [{type: InternalIP, address: 172.18.0.3}]}
---
apiVersion: v1
kind: Node
metadata: {name: bare}
---
apiVersion: v1
kind: Pod
metadata: {name: a, namespace: x}
spec: {nodeName: n1, containers: [{name: c, ports: [{containerPort: 80}, {containerPort: 53, protocol: UDP}, {containerPort: 9, protocol: SCTP}, {containerPort: 81, name: close-first}]}]}
status: {podIP: 10.0.1.2, podIPs: [{ip: 10.0.1.2}, {ip: "fd00::1:2"}]}
---
apiVersion: v1
kind: Pod
metadata: {name: b, namespace: x}
spec: {nodeName: n2, containers: [{name: c}]}
status: {podIP: 10.0.2.2}
---
apiVersion: v1
kind: Pod
metadata: {name: host, namespace: y}
spec: {nodeName: n2, hostNetwork: true, containers: [{name: c, ports: [{containerPort: 9100}]}]}
status: {podIP: 172.18.0.3}
---
apiVersion: v1
kind: Pod
metadata: {name: noip, namespace: x}
spec: {nodeName: n1, containers: [{name: c}]}
---
apiVersion: v1
kind: Pod
metadata: {name: lost, namespace: x}
spec: {nodeName: n9, containers: [{name: c}]}
status: {podIP: 10.0.9.9}
---
apiVersion: v1
kind: Pod
metadata: {name: stranded, namespace: x}
spec: {nodeName: bare, containers: [{name: c}]}
status: {podIP: 10.0.8.8}
"#;

    fn plan(flows: &[Flow]) -> Plan {
        let loaded = manifest::parse_str(Path::new("t.yaml"), CLUSTER).unwrap();
        let compiled = Snapshot::compile(&loaded.inputs, Revision(1));
        Plan::build("t1", &loaded, &compiled.snapshot, flows, &[]).unwrap()
    }

    fn flow(src: &str, dst: &str, protocol: Protocol, port: u16) -> Flow {
        Flow { src: src.parse().unwrap(), dst: dst.parse().unwrap(), protocol, dst_port: port }
    }

    #[test]
    fn annotated_pods_and_nodes_are_counted_not_built() {
        let extra = r#"
---
apiVersion: v1
kind: Node
metadata: {name: far, annotations: {lab.tierproxy.io/instantiate: "false"}}
status: {addresses: [{type: InternalIP, address: 172.30.9.9}]}
---
apiVersion: v1
kind: Pod
metadata: {name: on-far, namespace: x}
spec: {nodeName: far, containers: [{name: c}]}
status: {podIP: 10.0.7.1}
---
apiVersion: v1
kind: Pod
metadata: {name: ghost, namespace: x, annotations: {lab.tierproxy.io/instantiate: "false"}}
spec: {nodeName: n1, containers: [{name: c}]}
status: {podIP: 10.0.7.2}
"#;
        let text = format!("{CLUSTER}{extra}");
        let loaded = manifest::parse_str(Path::new("t.yaml"), &text).unwrap();
        let compiled = Snapshot::compile(&loaded.inputs, Revision(1));
        let p = Plan::build("t1", &loaded, &compiled.snapshot, &[], &[]).unwrap();
        let base = plan(&[]);
        assert_eq!(p.uninstantiated, Uninstantiated { pods: 2, nodes: 1 });
        assert_eq!(p.nodes, base.nodes, "the annotated node is not built");
        assert_eq!(p.pods, base.pods, "neither annotated pod nor the far node's is built");
        assert_eq!(p.skipped, base.skipped, "left out on purpose, not reported one by one");
    }

    #[test]
    fn services_are_planned_with_the_built_pods_as_backends() {
        let extra = r#"
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: x, labels: {app: web}}
spec: {nodeName: n1, containers: [{name: c}]}
status: {phase: Running, podIP: 10.0.1.3}
---
apiVersion: v1
kind: Pod
metadata: {name: web-lost, namespace: x, labels: {app: web}}
spec: {nodeName: n9, containers: [{name: c}]}
status: {phase: Running, podIP: 10.0.9.3}
"#;
        let text = format!("{CLUSTER}{extra}");
        let loaded = manifest::parse_str(Path::new("t.yaml"), &text).unwrap();
        let compiled = Snapshot::compile(&loaded.inputs, Revision(1));
        let service = |yaml: &str| -> Service { serde_saphyr::from_str(yaml).unwrap() };
        let services = [
            service(
                "metadata: {name: web, namespace: x}\n\
                 spec: {clusterIP: 10.96.0.10, selector: {app: web}, ports: [{port: 80}]}\n",
            ),
            service("metadata: {name: lb}\nspec: {type: LoadBalancer, clusterIP: 10.96.0.11}\n"),
        ];
        let p = Plan::build("t1", &loaded, &compiled.snapshot, &[], &services).unwrap();
        assert_eq!(p.services.len(), 1);
        let backends: Vec<&str> =
            p.services[0].ports[0].backends.iter().map(|b| b.pod.as_str()).collect();
        // x/web-lost is selected but not built (its node is not in the manifests).
        assert_eq!(backends, ["x/web"]);
        let last = p.skipped.last().unwrap();
        assert_eq!(last.object, "service default/lb");
        assert!(last.reason.contains("LoadBalancer"), "{last:?}");

        let bad = [service("metadata: {name: b}\nspec: {clusterIP: 10.96.0.300}\n")];
        let e = Plan::build("t1", &loaded, &compiled.snapshot, &[], &bad).unwrap_err();
        assert!(matches!(e, PlanError::Service(_)), "{e}");
    }

    #[test]
    fn pods_without_ip_or_node_are_skipped_by_name() {
        let p = plan(&[]);
        let skipped: Vec<&str> = p.skipped.iter().map(|s| s.object.as_str()).collect();
        assert_eq!(skipped, ["node bare", "pod x/noip", "pod x/lost", "pod x/stranded"]);
        assert!(p.skipped[2].reason.contains("n9 is not in the manifests"), "{:?}", p.skipped);
        assert!(p.skipped[3].reason.contains("not in the lab"), "{:?}", p.skipped);
        let pods: Vec<&str> = p.pods.iter().map(|p| p.netns.as_str()).collect();
        assert_eq!(pods, ["t1_pod_x_a", "t1_pod_x_b"]);
        assert_eq!(p.host_pods.get("y/host").map(String::as_str), Some("n2"));
    }

    #[test]
    fn servers_cover_declared_and_probed_ports_on_the_owners_addresses() {
        let p = plan(&[
            flow("10.0.1.2", "10.0.2.2", Protocol::Tcp, 8080),
            flow("10.0.1.2", "172.18.0.3", Protocol::Tcp, 10250),
            flow("203.0.113.1", "10.0.1.2", Protocol::Udp, 5353),
            flow("10.0.2.2", "198.51.100.7", Protocol::Tcp, 443),
            flow("10.0.2.2", "10.0.9.9", Protocol::Tcp, 1),
            flow("10.0.2.2", "10.0.1.2", Protocol::Sctp, 38412),
        ]);
        let server = |ns: &str| p.servers.iter().find(|s| s.netns == ns).unwrap();
        let a = server("t1_pod_x_a");
        assert_eq!(a.bind, ["10.0.1.2".parse::<IpAddr>().unwrap(), "fd00::1:2".parse().unwrap()]);
        assert_eq!((a.tcp.as_slice(), a.udp.as_slice()), (&[80, 81][..], &[53, 5353][..]));
        // The TCP port named close-first is served close-first, and still served.
        assert_eq!(a.tcp_close_first, [81]);
        assert!(p.serves("10.0.1.2".parse().unwrap(), Protocol::Tcp, 81));
        // Declared SCTP port 9 on a; probed SCTP 38412 on a too.
        assert_eq!(a.sctp, [9, 38412]);
        assert!(p.serves("10.0.1.2".parse().unwrap(), Protocol::Sctp, 38412));
        assert!(!p.serves("10.0.1.2".parse().unwrap(), Protocol::Sctp, 80));
        assert_eq!(server("t1_pod_x_b").tcp, [8080]);
        assert!(server("t1_pod_x_b").tcp_close_first.is_empty());
        assert!(server("t1_pod_x_b").sctp.is_empty());
        let n2 = server("t1_node_n2");
        assert_eq!((n2.tcp.as_slice(), n2.bind.len()), (&[9100, 10250][..], 1));
        // External: probe ends nobody owns; a skipped pod's IP is not external.
        let ext: Vec<String> = p.external.iter().map(ToString::to_string).collect();
        assert_eq!(ext, ["198.51.100.7", "203.0.113.1"]);
        assert_eq!(server("t1_fabric").tcp, [443]);
        assert_eq!(p.owner("10.0.9.9".parse().unwrap()), None);
        assert!(p.serves("198.51.100.7".parse().unwrap(), Protocol::Tcp, 443));
        assert!(!p.serves("198.51.100.7".parse().unwrap(), Protocol::Tcp, 444));
    }

    #[test]
    fn scripts_wire_pods_to_nodes_and_nodes_to_each_other() {
        let p = plan(&[]);
        assert_eq!(
            p.link_script(),
            [
                "link add fabric0 netns t1_node_n1 type veth peer name node0 netns t1_fabric",
                "link add fabric0 netns t1_node_n2 type veth peer name node1 netns t1_fabric",
                "link add pod0 netns t1_node_n1 type veth peer name eth0 netns t1_pod_x_a",
                "link add pod1 netns t1_node_n2 type veth peer name eth0 netns t1_pod_x_b",
            ]
        );
        let scripts: BTreeMap<String, Vec<String>> = p.netns_scripts().into_iter().collect();
        let n1 = &scripts["t1_node_n1"];
        for line in [
            "addr add 172.18.0.2/32 dev fabric0",
            "route add 172.18.0.3/32 dev fabric0 scope link",
            "route add 10.0.1.2/32 dev pod0 scope link src 172.18.0.2",
            "route add fd00::1:2/128 dev pod0 scope link",
            "addr add fe80::1/64 dev pod0 nodad",
            "route add 10.0.2.2/32 via 172.18.0.3 dev fabric0",
            "route add default via 169.254.0.1 dev fabric0",
        ] {
            assert!(n1.iter().any(|l| l == line), "{line:?} missing from {n1:#?}");
        }
        let n2 = &scripts["t1_node_n2"];
        assert!(n2.iter().any(|l| l == "route add fd00::1:2/128 via fe80::2:1 dev fabric0"));
        let a = &scripts["t1_pod_x_a"];
        assert!(a.iter().any(|l| l == "route add default via 172.18.0.2 dev eth0 src 10.0.1.2"));
        assert!(a.iter().any(|l| l == "route add default via fe80::1 dev eth0"));
        let f = &scripts["t1_fabric"];
        assert!(f.iter().any(|l| l == "route add 10.0.2.2/32 via 172.18.0.3 dev br0"));
        // Interface names fit IFNAMSIZ (15 bytes) whatever the Kubernetes names.
        for l in p.link_script() {
            let words: Vec<&str> = l.split(' ').collect();
            assert!(words[2].len() <= 15 && words[8].len() <= 15, "{l}");
        }
    }

    #[test]
    fn prefixes_cannot_be_prefixes_of_each_other() {
        assert!(validate_prefix("tpl").is_ok());
        assert!(validate_prefix("t-1").is_ok());
        for bad in ["", "-x", "a_b", "A", "a/b", &"x".repeat(MAX_PREFIX + 1)] {
            assert!(validate_prefix(bad).is_err(), "{bad:?}");
        }
        assert!(!netns_name("t1", "pod", &["a", "b"]).starts_with(&netns_prefix("t")));
        let long = "p".repeat(250);
        let n = netns_name("t1", "pod", &["ns", &long]);
        assert!(n.len() < 40 && n.starts_with("t1_pod_"), "{n}");
    }

    #[test]
    fn the_gateway_address_is_refused() {
        let loaded = manifest::parse_str(Path::new("t.yaml"), CLUSTER).unwrap();
        let compiled = Snapshot::compile(&loaded.inputs, Revision(1));
        let e = Plan::build(
            "t1",
            &loaded,
            &compiled.snapshot,
            &[flow("10.0.1.2", "169.254.0.1", Protocol::Tcp, 1)],
            &[],
        )
        .unwrap_err();
        assert!(matches!(e, PlanError::Reserved { .. }), "{e}");
    }
}
