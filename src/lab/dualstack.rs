//! `lab up --dual-stack`: every pod and node that the manifests give IPv4 addresses only
//! gets an IPv6 address too, derived from its IPv4 address, so one set of IPv4 manifests
//! yields a dual-stack lab.
//!
//! Mapping: `fd74:6972::/96` + the 32 bits of the IPv4 address (10.50.1.2 →
//! `fd74:6972::a32:102`). `fd74:6972::/96` lies in the unique-local range (RFC 4193,
//! `fc00::/7`; "tir" in ASCII), so it is never a real cluster's global address; a mapped
//! address that a pod or node already holds in the manifests is refused
//! ([`DualStackError::Collision`], naming both objects).
//!
//! What gets an address (the objects' effective addresses, as the policy engine reads
//! them):
//! - a Pod, hostNetwork pods included (their IPs are their node's), not terminated (phase
//!   Succeeded/Failed), whose `status.podIP`/`podIPs` hold an IPv4 address and no IPv6
//!   one: the mapping of its first IPv4 address is appended to `status.podIPs` (`podIP`
//!   stays, and stays `podIPs[0]`);
//! - a Node whose `status.addresses` of type InternalIP/ExternalIP hold IPv4 addresses and
//!   no IPv6 one: each of those IPv4 addresses' mapping is appended, with the same type.
//!
//! Policies are left as they are: an `ipBlock`/`networks` of one family never matches the
//! other, so IPv4 flows decide as before and IPv6 flows as the policies say for IPv6.
//!
//! The augmented objects are written as one JSON manifest file (a stream of objects, which
//! the manifest loader reads) in the lab's state directory, and everything reads that file:
//! the plan, the probes given to `lab up`, the agents and `lab probe`'s `explain`.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{NodeAddress, PodIP};
use serde::Serialize;

use crate::cluster::manifest::{self, Loaded};
use crate::policy::api::{Node, Pod};
use crate::policy::{Compiled, Inputs, Revision, Snapshot};

/// The /96 the IPv6 addresses are made in: `fd74:6972::/96`.
pub const PREFIX: Ipv6Addr = Ipv6Addr::new(0xfd74, 0x6972, 0, 0, 0, 0, 0, 0);
/// Length of [`PREFIX`], in bits: the remaining 32 hold the IPv4 address.
pub const PREFIX_LEN: u8 = 96;
/// Name of the augmented manifest file in the lab's state directory.
pub const FILE: &str = "dual-stack.json";

/// Why the manifests cannot be made dual-stack.
#[derive(Debug, thiserror::Error)]
pub enum DualStackError {
    /// A mapped address is already an address of a pod or node in the manifests.
    #[error(
        "--dual-stack: {object} would get {ipv6} ({PREFIX}/{PREFIX_LEN} + {ipv4}), which {holder} already has in the manifests"
    )]
    Collision {
        /// The object that would get the address (`pod ns/name`, `node name`).
        object: String,
        /// Its IPv4 address.
        ipv4: Ipv4Addr,
        /// The mapped address.
        ipv6: Ipv6Addr,
        /// The object holding it already.
        holder: String,
    },
    /// An object could not be written as JSON (a bug: the objects were just read).
    #[error("--dual-stack: cannot write {object} as JSON")]
    Encode {
        /// The object.
        object: String,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// The written manifests do not read back as valid objects (a bug).
    #[error("--dual-stack: the augmented manifests do not read back cleanly: {0}")]
    ReadBack(String),
}

/// One address added.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Added {
    /// `pod ns/name` or `node name`.
    pub object: String,
    /// The IPv4 address it was made from.
    pub ipv4: Ipv4Addr,
    /// The address added.
    pub ipv6: Ipv6Addr,
}

/// `ipv4`'s address in [`PREFIX`]: `fd74:6972::<32 bits of ipv4>`.
pub fn mapped(ipv4: Ipv4Addr) -> Ipv6Addr {
    Ipv6Addr::from(u128::from(PREFIX) | u128::from(u32::from(ipv4)))
}

fn pod_name(pod: &Pod) -> String {
    let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
    format!("pod {ns}/{}", pod.metadata.name.as_deref().unwrap_or(""))
}

fn node_name(node: &Node) -> String {
    format!("node {}", node.metadata.name.as_deref().unwrap_or(""))
}

/// A pod's IPs as the policy engine reads them (`Snapshot::compile`): none when
/// terminated; `podIP` alone when `podIPs[0]` disagrees with it, else `podIP` then
/// `podIPs`; unparsable entries skipped, duplicates dropped. As strings, as written.
fn effective_pod_ips(pod: &Pod) -> Vec<(String, IpAddr)> {
    let Some(st) = pod.status.as_ref() else { return Vec::new() };
    if matches!(st.phase.as_deref(), Some("Succeeded" | "Failed")) {
        return Vec::new();
    }
    let listed: Vec<String> = st.pod_ips.iter().flatten().map(|p| p.ip.clone()).collect();
    let all: Vec<String> = match &st.pod_ip {
        Some(ip) if listed.first().is_some_and(|first| first != ip) => vec![ip.clone()],
        Some(ip) => std::iter::once(ip.clone()).chain(listed).collect(),
        None => listed,
    };
    let mut out: Vec<(String, IpAddr)> = Vec::new();
    for s in all {
        if let Ok(ip) = s.parse::<IpAddr>()
            && !out.iter().any(|(_, seen)| *seen == ip)
        {
            out.push((s, ip));
        }
    }
    out
}

/// A node's InternalIP/ExternalIP addresses, parsed.
fn node_ips(node: &Node) -> Vec<IpAddr> {
    node.status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .into_iter()
        .flatten()
        .filter(|a| a.type_ == "InternalIP" || a.type_ == "ExternalIP")
        .filter_map(|a| a.address.parse().ok())
        .collect()
}

fn first_v4(ips: impl IntoIterator<Item = IpAddr>) -> Option<Ipv4Addr> {
    ips.into_iter().find_map(|ip| match ip {
        IpAddr::V4(v4) => Some(v4),
        IpAddr::V6(_) => None,
    })
}

/// `inputs` with an IPv6 address added to every IPv4-only pod and node (see the module
/// docs), and the list of what was added, in input order (nodes, then pods). Pure.
///
/// # Errors
/// [`DualStackError::Collision`] when a mapped address is one a pod or node already holds.
pub fn augment(inputs: &Inputs) -> Result<(Inputs, Vec<Added>), DualStackError> {
    // Who holds each IPv6 address of the manifests.
    let mut holders: BTreeMap<Ipv6Addr, String> = BTreeMap::new();
    for node in &inputs.nodes {
        for ip in node_ips(node) {
            if let IpAddr::V6(v6) = ip {
                holders.entry(v6).or_insert_with(|| node_name(node));
            }
        }
    }
    for pod in &inputs.pods {
        for (_, ip) in effective_pod_ips(pod) {
            if let IpAddr::V6(v6) = ip {
                holders.entry(v6).or_insert_with(|| pod_name(pod));
            }
        }
    }
    let claim = |object: String, ipv4: Ipv4Addr| -> Result<Added, DualStackError> {
        let ipv6 = mapped(ipv4);
        match holders.get(&ipv6) {
            Some(holder) => {
                Err(DualStackError::Collision { object, ipv4, ipv6, holder: holder.clone() })
            }
            None => Ok(Added { object, ipv4, ipv6 }),
        }
    };

    let mut out = inputs.clone();
    let mut added = Vec::new();
    for node in &mut out.nodes {
        if node_ips(node).iter().any(IpAddr::is_ipv6) {
            continue;
        }
        let object = node_name(node);
        let node = std::sync::Arc::make_mut(node);
        let Some(addresses) = node.status.as_mut().and_then(|s| s.addresses.as_mut()) else {
            continue;
        };
        let mut extra = Vec::new();
        for a in addresses.iter().filter(|a| a.type_ == "InternalIP" || a.type_ == "ExternalIP") {
            let Ok(IpAddr::V4(v4)) = a.address.parse::<IpAddr>() else { continue };
            let new = claim(object.clone(), v4)?;
            extra.push(NodeAddress { address: new.ipv6.to_string(), type_: a.type_.clone() });
            added.push(new);
        }
        addresses.extend(extra);
    }
    for pod in &mut out.pods {
        let ips = effective_pod_ips(pod);
        if ips.iter().any(|(_, ip)| ip.is_ipv6()) {
            continue;
        }
        let Some(v4) = first_v4(ips.iter().map(|(_, ip)| *ip)) else { continue };
        let new = claim(pod_name(pod), v4)?;
        let pod = std::sync::Arc::make_mut(pod);
        if let Some(st) = pod.status.as_mut() {
            let mut listed: Vec<PodIP> = ips.into_iter().map(|(ip, _)| PodIP { ip }).collect();
            listed.push(PodIP { ip: new.ipv6.to_string() });
            st.pod_ips = Some(listed);
        }
        added.push(new);
    }
    Ok((out, added))
}

/// Every object of `inputs` as one JSON manifest: the objects one after another (a stream,
/// as `kubectl get -o json` of several objects gives), in the order namespaces, nodes,
/// pods, NetworkPolicies, AdminNetworkPolicies, BaselineAdminNetworkPolicies,
/// ClusterNetworkPolicies, then Antrea's Tiers, ClusterNetworkPolicies and NetworkPolicies.
///
/// # Errors
/// [`DualStackError::Encode`] naming the object.
pub fn manifest_text(inputs: &Inputs) -> Result<String, DualStackError> {
    fn put<T: Serialize + kube::Resource>(
        out: &mut Vec<u8>,
        items: &[std::sync::Arc<T>],
        kind: &str,
    ) -> Result<(), DualStackError> {
        for item in items {
            serde_json::to_writer_pretty(&mut *out, item).map_err(|source| {
                let meta = item.meta();
                let name = meta.name.as_deref().unwrap_or("");
                let object = match meta.namespace.as_deref() {
                    Some(ns) => format!("{kind} {ns}/{name}"),
                    None => format!("{kind} {name}"),
                };
                DualStackError::Encode { object, source }
            })?;
            out.push(b'\n');
        }
        Ok(())
    }
    let mut out = Vec::new();
    put(&mut out, &inputs.namespaces, "namespace")?;
    put(&mut out, &inputs.nodes, "node")?;
    put(&mut out, &inputs.pods, "pod")?;
    put(&mut out, &inputs.network_policies, "networkpolicy")?;
    put(&mut out, &inputs.admin_network_policies, "adminnetworkpolicy")?;
    put(&mut out, &inputs.baseline_admin_network_policies, "baselineadminnetworkpolicy")?;
    put(&mut out, &inputs.cluster_network_policies, "clusternetworkpolicy")?;
    let antrea = &inputs.antrea;
    put(&mut out, &antrea.tiers, "tier.crd.antrea.io")?;
    put(&mut out, &antrea.cluster_network_policies, "clusternetworkpolicy.crd.antrea.io")?;
    put(&mut out, &antrea.network_policies, "networkpolicy.crd.antrea.io")?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// A dual-stack lab's manifests: the file to write, and what it reads back as.
#[derive(Debug)]
pub struct DualStack {
    /// Where the file goes: `<state dir>/`[`FILE`].
    pub path: PathBuf,
    /// Its contents ([`manifest_text`] of the augmented objects).
    pub text: String,
    /// The addresses added.
    pub added: Vec<Added>,
    /// `text` read back by the manifest loader (what agents and `lab probe` will read).
    pub loaded: Loaded,
    /// `loaded` compiled.
    pub compiled: Compiled,
}

impl DualStack {
    /// Augments `inputs` ([`augment`]), renders the manifest ([`manifest_text`]) for
    /// `<state_dir>/`[`FILE`] and reads the text back, so the lab is planned from exactly
    /// what its agents will read. Writes nothing: `lab up` writes `text` to `path`.
    ///
    /// # Errors
    /// [`DualStackError`]: a collision, an object that cannot be encoded, or text that
    /// does not read back without errors.
    pub fn new(inputs: &Inputs, state_dir: &Path) -> Result<DualStack, DualStackError> {
        let (augmented, added) = augment(inputs)?;
        let text = manifest_text(&augmented)?;
        let path = state_dir.join(FILE);
        let loaded = manifest::parse_str(&path, &text)
            .map_err(|e| DualStackError::ReadBack(crate::error::chain(&e)))?;
        let compiled = Snapshot::compile(&loaded.inputs, Revision(1));
        let errors: Vec<String> = loaded
            .problems
            .iter()
            .chain(&compiled.problems)
            .filter(|p| p.is_error())
            .map(ToString::to_string)
            .collect();
        if !errors.is_empty() {
            return Err(DualStackError::ReadBack(errors.join("; ")));
        }
        Ok(DualStack { path, text, added, loaded, compiled })
    }

    /// A note for people: how many addresses were added, and where the manifests are.
    pub fn note(&self, err: &mut dyn Write) {
        let _ = writeln!(
            err,
            "note: lab: --dual-stack: {} IPv6 addresses added ({PREFIX}/{PREFIX_LEN} + IPv4 address); manifests: {}",
            self.added.len(),
            self.path.display()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::explain;

    const CLUSTER: &str = r#"
apiVersion: v1
kind: Node
metadata: {name: n1}
status: {addresses: [{type: InternalIP, address: 172.18.0.2}, {type: Hostname, address: n1}, {type: ExternalIP, address: 198.51.100.2}]}
---
apiVersion: v1
kind: Node
metadata: {name: n2}
status: {addresses: [{type: InternalIP, address: 172.18.0.3}, {type: InternalIP, address: "fd00::3"}]}
---
apiVersion: v1
kind: Pod
metadata: {name: a, namespace: x}
spec: {nodeName: n1, containers: [{name: c}]}
status: {podIP: 10.0.1.2}
---
apiVersion: v1
kind: Pod
metadata: {name: listed, namespace: x}
spec: {nodeName: n1, containers: [{name: c}]}
status: {podIP: 10.0.1.3, podIPs: [{ip: 10.0.1.3}]}
---
apiVersion: v1
kind: Pod
metadata: {name: both, namespace: x}
spec: {nodeName: n2, containers: [{name: c}]}
status: {podIP: 10.0.2.2, podIPs: [{ip: 10.0.2.2}, {ip: "fd00::2:2"}]}
---
apiVersion: v1
kind: Pod
metadata: {name: host, namespace: y}
spec: {nodeName: n1, hostNetwork: true, containers: [{name: c}]}
status: {podIP: 172.18.0.2}
---
apiVersion: v1
kind: Pod
metadata: {name: done, namespace: x}
spec: {nodeName: n1, containers: [{name: c}]}
status: {phase: Succeeded, podIP: 10.0.1.9}
---
apiVersion: v1
kind: Pod
metadata: {name: pending, namespace: x}
spec: {nodeName: n1, containers: [{name: c}]}
"#;

    fn inputs(text: &str) -> Inputs {
        manifest::parse_str(Path::new("t.yaml"), text).unwrap().inputs
    }

    fn pod_ips(inputs: &Inputs, name: &str) -> Vec<String> {
        let pod = inputs.pods.iter().find(|p| p.metadata.name.as_deref() == Some(name)).unwrap();
        pod.status.iter().flat_map(|s| s.pod_ips.iter().flatten()).map(|p| p.ip.clone()).collect()
    }

    fn node_addrs(inputs: &Inputs, name: &str) -> Vec<(String, String)> {
        let node = inputs.nodes.iter().find(|n| n.metadata.name.as_deref() == Some(name)).unwrap();
        let addrs = node.status.as_ref().and_then(|s| s.addresses.as_ref()).unwrap();
        addrs.iter().map(|a| (a.type_.clone(), a.address.clone())).collect()
    }

    #[test]
    fn the_ipv4_address_is_the_low_32_bits_of_the_ula_prefix() {
        assert_eq!(mapped(Ipv4Addr::new(10, 50, 1, 2)).to_string(), "fd74:6972::a32:102");
        assert_eq!(mapped(Ipv4Addr::new(172, 18, 0, 3)).to_string(), "fd74:6972::ac12:3");
        assert_eq!(mapped(Ipv4Addr::UNSPECIFIED), PREFIX);
        assert!(PREFIX.segments()[0] & 0xfe00 == 0xfc00, "unique local (fc00::/7)");
    }

    #[test]
    fn ipv4_only_pods_and_nodes_get_the_mapped_address_the_others_stay() {
        let before = inputs(CLUSTER);
        let (after, added) = augment(&before).unwrap();
        let s = |v: &[&str]| v.iter().map(ToString::to_string).collect::<Vec<_>>();
        // A node: each IPv4 InternalIP/ExternalIP gets its mapping, of the same type.
        assert_eq!(
            node_addrs(&after, "n1"),
            [
                ("InternalIP", "172.18.0.2"),
                ("Hostname", "n1"),
                ("ExternalIP", "198.51.100.2"),
                ("InternalIP", "fd74:6972::ac12:2"),
                ("ExternalIP", "fd74:6972::c633:6402"),
            ]
            .map(|(t, a)| (t.to_string(), a.to_string()))
        );
        assert_eq!(node_addrs(&after, "n2"), node_addrs(&before, "n2"), "has IPv6 already");
        assert_eq!(pod_ips(&after, "a"), s(&["10.0.1.2", "fd74:6972::a00:102"]));
        assert_eq!(pod_ips(&after, "listed"), s(&["10.0.1.3", "fd74:6972::a00:103"]));
        assert_eq!(pod_ips(&after, "both"), pod_ips(&before, "both"));
        // A hostNetwork pod is its node: the node's mapped address.
        assert_eq!(pod_ips(&after, "host"), s(&["172.18.0.2", "fd74:6972::ac12:2"]));
        assert!(pod_ips(&after, "done").is_empty() && pod_ips(&after, "pending").is_empty());
        let objects: Vec<&str> = added.iter().map(|a| a.object.as_str()).collect();
        assert_eq!(objects, ["node n1", "node n1", "pod x/a", "pod x/listed", "pod y/host"]);
        // podIP is untouched and still podIPs[0].
        let a = after.pods.iter().find(|p| p.metadata.name.as_deref() == Some("a")).unwrap();
        assert_eq!(a.status.as_ref().unwrap().pod_ip.as_deref(), Some("10.0.1.2"));
    }

    #[test]
    fn a_mapped_address_another_object_holds_is_refused_naming_both() {
        let text = format!(
            "{CLUSTER}---\napiVersion: v1\nkind: Pod\nmetadata: {{name: squatter, namespace: z}}\nspec: {{nodeName: n2, containers: [{{name: c}}]}}\nstatus: {{podIP: 10.0.2.9, podIPs: [{{ip: 10.0.2.9}}, {{ip: \"fd74:6972::a00:102\"}}]}}\n"
        );
        let e = augment(&inputs(&text)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--dual-stack: pod x/a would get fd74:6972::a00:102 (fd74:6972::/96 + 10.0.1.2), which pod z/squatter already has in the manifests"
        );
    }

    #[test]
    fn the_examples_read_back_and_decide_every_ipv4_probe_as_before() {
        let dir = explain_examples();
        let (manifests, probes) = super::super::example_inputs(&dir);
        let (loaded, compiled, invalid) = explain::load_and_compile(&manifests, &mut Vec::new());
        assert!(!invalid);
        let ds = DualStack::new(&loaded.inputs, Path::new("/state")).unwrap();
        assert_eq!(ds.path, Path::new("/state/dual-stack.json"));
        let counts = |i: &Inputs| {
            (
                i.namespaces.len(),
                i.nodes.len(),
                i.pods.len(),
                i.network_policies.len(),
                i.admin_network_policies.len(),
                i.baseline_admin_network_policies.len(),
                i.cluster_network_policies.len(),
                i.antrea.tiers.len(),
                i.antrea.cluster_network_policies.len(),
                i.antrea.network_policies.len(),
            )
        };
        assert_eq!(counts(&ds.loaded.inputs), counts(&loaded.inputs), "every object written");
        assert!(ds.loaded.problems.is_empty() && ds.loaded.notes.is_empty(), "{:?}", ds.loaded);
        let (old, new) = (&compiled.snapshot, &ds.compiled.snapshot);
        let list = explain::read_probes(&probes).unwrap();
        for (line, p) in &list {
            let before = explain::resolve(old, &loaded, *line, p).unwrap();
            let after = explain::resolve(new, &ds.loaded, *line, p).unwrap();
            assert_eq!(after, before, "line {line}: IPv4 stays the first family");
            assert_eq!(
                new.decide(&after).verdict,
                old.decide(&before).verdict,
                "line {line}: {p:?}"
            );
        }
        // Every pod-network pod and node of the examples is dual-stack now, and an IPv6
        // probe naming the mapped address resolves the other end to its IPv6 address.
        assert!(ds.added.iter().any(|a| a.object == "pod tenant2/app"));
        let probe: explain::Probe = serde_json::from_str(
            r#"{"from": "foo-ns-1/client", "to": "fd74:6972::af4:205", "port": 38412, "protocol": "SCTP"}"#,
        )
        .unwrap();
        let flow = explain::resolve(new, &ds.loaded, 1, &probe).unwrap();
        assert_eq!(flow.src.to_string(), "fd74:6972::af4:104");
    }

    fn explain_examples() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("examples")
    }
}
