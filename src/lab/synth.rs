//! `tierproxy lab synth`: a lab's manifests plus a large synthetic policy set that the lab
//! does not build, for load tests "with a large policy set loaded" (issue #7).
//!
//! The output directory gets two files:
//! - `traffic.json`: the given manifests' objects (the pods that carry the test's traffic),
//!   their Namespaces labelled `env=prod`, so that the synthetic admin policies selecting
//!   every `env=prod` namespace (one in ten) have them as subjects and a decision walks
//!   real rule lists;
//! - `synthetic.json`: [`crate::synth::cluster`] of the chosen shape (the CLI's:
//!   [`Shape::LOAD_TEST`]: 10,000 pods on 100 nodes, 1,000 NetworkPolicies, 100
//!   AdminNetworkPolicies × 100 rules of up to 10 peers, a BaselineAdminNetworkPolicy), every Pod and Node
//!   annotated [`INSTANTIATE_ANNOTATION`]`: "false"`, so `lab up` builds only the traffic
//!   pods while the agents and `explain` read everything.
//!
//! Synthetic addresses (pods 10.128.0.0/9, nodes 172.16.0.0/12) must not collide with the
//! given manifests'; a collision is refused naming both objects.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use super::LabError;
use super::plan::INSTANTIATE_ANNOTATION;
use crate::cluster::manifest;
use crate::policy::{Inputs, Snapshot};
use crate::synth::Shape;

/// What [`write()`] produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// `traffic.json` and `synthetic.json` under the output directory.
    pub files: Vec<PathBuf>,
    /// Pods written, both files together.
    pub pods: usize,
    /// NetworkPolicies written.
    pub network_policies: usize,
    /// AdminNetworkPolicies written.
    pub admin_policies: usize,
}

/// Reads `manifests` (the traffic cluster), generates the synthetic cluster of `shape`
/// from `seed`, and writes both to `out` (created if missing).
///
/// # Errors
/// [`LabError::Invalid`] for manifests that cannot be read or parsed, or an address both
/// use; [`LabError::State`] when a file cannot be written.
pub fn write(
    manifests: &[PathBuf],
    out: &Path,
    shape: Shape,
    seed: u64,
) -> Result<Written, LabError> {
    let loaded = manifest::load(manifests);
    if let Some(e) = loaded.errors.first() {
        return Err(LabError::Invalid(crate::error::chain(e)));
    }
    let mut traffic = loaded.inputs;
    for ns in &mut traffic.namespaces {
        let ns = std::sync::Arc::make_mut(ns);
        ns.metadata.labels.get_or_insert_with(Default::default).insert("env".into(), "prod".into());
    }
    let mut synthetic = crate::synth::cluster(shape, seed);
    let annotate = |m: &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta| {
        m.annotations
            .get_or_insert_with(Default::default)
            .insert(INSTANTIATE_ANNOTATION.into(), "false".into());
    };
    synthetic.pods.iter_mut().for_each(|p| annotate(&mut std::sync::Arc::make_mut(p).metadata));
    synthetic.nodes.iter_mut().for_each(|n| annotate(&mut std::sync::Arc::make_mut(n).metadata));
    check_disjoint(&traffic, &synthetic)?;
    std::fs::create_dir_all(out).map_err(|source| LabError::State { path: out.into(), source })?;
    let mut files = Vec::new();
    for (name, inputs) in [("traffic.json", &traffic), ("synthetic.json", &synthetic)] {
        let path = out.join(name);
        write_compact(&path, inputs)
            .map_err(|source| LabError::State { path: path.clone(), source })?;
        files.push(path);
    }
    Ok(Written {
        files,
        pods: traffic.pods.len() + synthetic.pods.len(),
        network_policies: traffic.network_policies.len() + synthetic.network_policies.len(),
        admin_policies: traffic.admin_network_policies.len()
            + synthetic.admin_network_policies.len(),
    })
}

/// Writes every object of `inputs` to `path` as compact JSON, one object per line (the
/// manifest loader reads concatenated JSON objects; pretty-printing would triple the size).
fn write_compact(path: &Path, inputs: &Inputs) -> std::io::Result<()> {
    use std::io::Write;
    fn put<T: serde::Serialize>(w: &mut impl Write, items: &[T]) -> std::io::Result<()> {
        for item in items {
            serde_json::to_writer(&mut *w, item)?;
            w.write_all(b"\n")?;
        }
        Ok(())
    }
    let mut w = std::io::BufWriter::new(std::fs::File::create(path)?);
    put(&mut w, &inputs.namespaces)?;
    put(&mut w, &inputs.nodes)?;
    put(&mut w, &inputs.pods)?;
    put(&mut w, &inputs.network_policies)?;
    put(&mut w, &inputs.admin_network_policies)?;
    put(&mut w, &inputs.baseline_admin_network_policies)?;
    put(&mut w, &inputs.cluster_network_policies)?;
    w.flush()
}

/// Refuses addresses held by an object of each input.
fn check_disjoint(traffic: &Inputs, synthetic: &Inputs) -> Result<(), LabError> {
    let owners = |inputs: &Inputs| -> BTreeMap<IpAddr, String> {
        let s = Snapshot::compile(inputs, crate::policy::Revision(1)).snapshot;
        let mut out = BTreeMap::new();
        for p in &inputs.pods {
            let (ns, name) = (
                p.metadata.namespace.clone().unwrap_or_else(|| "default".into()),
                p.metadata.name.clone().unwrap_or_default(),
            );
            if let Some(id) = s.find_pod(&ns, &name) {
                for a in s.pod_ips(id) {
                    out.insert(*a, format!("pod {ns}/{name}"));
                }
            }
        }
        for n in &inputs.nodes {
            let name = n.metadata.name.clone().unwrap_or_default();
            if let Some(id) = s.find_node(&name) {
                for a in s.node_addrs(id) {
                    out.insert(*a, format!("node {name}"));
                }
            }
        }
        out
    };
    let mine = owners(traffic);
    let theirs = owners(synthetic);
    for (a, who) in &mine {
        if let Some(other) = theirs.get(a) {
            return Err(LabError::Invalid(format!(
                "{who} and synthetic {other} both use {a}: pick other addresses for {who}"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const TINY: Shape = Shape {
        namespaces: 3,
        pods: 12,
        nodes: 2,
        network_policies: 4,
        admin_policies: 3,
        rules_per_admin_policy: 4,
        max_peers: 3,
        admin_selects_all: false,
    };

    const TRAFFIC: &str = "apiVersion: v1\nkind: Namespace\nmetadata: {name: a}\n---\napiVersion: v1\nkind: Node\nmetadata: {name: n1}\nstatus: {addresses: [{type: InternalIP, address: 172.31.0.2}]}\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: client, namespace: a}\nspec: {nodeName: n1, containers: [{name: c}]}\nstatus: {podIP: 10.60.1.2}\n";

    #[test]
    fn writes_both_files_with_the_synthetic_objects_left_out_of_the_lab() {
        let dir = tempfile::tempdir().unwrap();
        let traffic = dir.path().join("t.yaml");
        std::fs::write(&traffic, TRAFFIC).unwrap();
        let out = dir.path().join("out");
        let w = write(&[traffic], &out, TINY, 7).unwrap();
        assert_eq!((w.pods, w.network_policies, w.admin_policies), (13, 4, 3));
        let loaded = manifest::load(&[out]);
        assert!(loaded.errors.is_empty() && loaded.problems.is_empty(), "{:?}", loaded.problems);
        let a = loaded.inputs.namespaces.iter().find(|n| n.metadata.name.as_deref() == Some("a"));
        assert_eq!(a.unwrap().metadata.labels.as_ref().unwrap()["env"], "prod");
        let left_out = |m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta| {
            m.annotations.as_ref().is_some_and(|a| a[INSTANTIATE_ANNOTATION] == "false")
        };
        for p in &loaded.inputs.pods {
            let synthetic = p.metadata.name.as_deref() != Some("client");
            assert_eq!(left_out(&p.metadata), synthetic, "{:?}", p.metadata.name);
        }
        assert!(loaded.inputs.nodes.iter().filter(|n| left_out(&n.metadata)).count() == 2);
    }

    #[test]
    fn an_address_both_use_is_refused_naming_both() {
        let dir = tempfile::tempdir().unwrap();
        let traffic = dir.path().join("t.yaml");
        // 10.128.0.1 is synthetic pod 0's address.
        std::fs::write(&traffic, TRAFFIC.replace("10.60.1.2", "10.128.0.1")).unwrap();
        let e = write(&[traffic], &dir.path().join("out"), TINY, 7).unwrap_err();
        let text = e.to_string();
        assert!(text.contains("pod a/client") && text.contains("synthetic pod"), "{text}");
    }
}
