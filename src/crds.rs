//! The CustomResourceDefinitions of the policy APIs tierproxy reads, built from its own
//! types in [`crate::policy::api`] (`tierproxy crds`; committed under `deploy/crds/`).
//!
//! - `adminnetworkpolicies` and `baselineadminnetworkpolicies`
//!   (`policy.networking.k8s.io/v1alpha1`): network-policy-api v0.1.7, experimental channel.
//! - `clusternetworkpolicies` (`policy.networking.k8s.io/v1alpha2`): network-policy-api
//!   v0.2.x, experimental channel (`protocols` with `tcp`/`udp`/`sctp`/`destinationNamedPort`).
//!
//! With `--antrea` ([`antrea_crds`]), instead: `tiers`, `clusternetworkpolicies` and
//! `networkpolicies` of `crd.antrea.io/v1beta1` (Antrea v2.x), the fields tierproxy reads,
//! for a cluster without Antrea. They are not committed under `deploy/crds/`: applied on a
//! cluster running Antrea, they would replace Antrea's own CRDs (stricter per position,
//! Antrea's to upgrade); see deploy/README.md, "Antrea's kinds".
//!
//! Beyond what `kube::CustomResourceExt::crd()` gives (names, short names, printer columns,
//! the status subresource and the schema of the types with their limits and CEL rules),
//! this module adds what Kubernetes needs or upstream has and the types cannot say:
//! - the `api-approved.kubernetes.io` annotation, without which the API server refuses a
//!   CRD in a `*.k8s.io` group (KEP-1111 "protected groups"); it names upstream's approval;
//! - the BaselineAdminNetworkPolicy singleton rule (`self.metadata.name == 'default'`);
//! - no `nullable`: kube marks every `Option` field nullable, upstream's schemas have none,
//!   and a nullable field would let `{"namespaces": null}` satisfy a one-of
//!   (`minProperties: 1`) peer.
use anyhow::Context as _;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, JSONSchemaProps, JSONSchemaPropsOrArray, ValidationRule,
};
use kube::CustomResourceExt;

use crate::policy::api::{antrea, v1alpha1, v1alpha2};

/// The annotation of a CRD in a protected group, naming the approval (KEP-1111).
pub const API_APPROVED_ANNOTATION: &str = "api-approved.kubernetes.io";

/// Upstream's approval of the v1alpha1 API (network-policy-api PR 30).
pub const V1ALPHA1_APPROVAL: &str = "https://github.com/kubernetes-sigs/network-policy-api/pull/30";

/// Upstream's approval of the v1alpha2 API (network-policy-api PR 300).
pub const V1ALPHA2_APPROVAL: &str =
    "https://github.com/kubernetes-sigs/network-policy-api/pull/300";

/// The annotation saying which upstream release and channel a CRD corresponds to.
pub const UPSTREAM_ANNOTATION: &str = "tierproxy.io/upstream";

/// What [`UPSTREAM_ANNOTATION`] says of the Antrea CRDs.
pub const ANTREA_UPSTREAM: &str =
    "Antrea v2.x crd.antrea.io/v1beta1 (the fields tierproxy reads; for clusters without Antrea)";

/// One CRD and the file name it is committed (or, for Antrea's, written) under.
#[derive(Debug, Clone)]
pub struct Crd {
    /// `<group>_<plural>.yaml`, as upstream names its files
    /// (`policy.networking.k8s.io_adminnetworkpolicies.yaml`, `crd.antrea.io_tiers.yaml`).
    pub file_name: String,
    /// The CRD object.
    pub crd: CustomResourceDefinition,
}

/// The three CRDs, in a fixed order: AdminNetworkPolicy, BaselineAdminNetworkPolicy,
/// ClusterNetworkPolicy.
pub fn crds() -> Vec<Crd> {
    let mut anp = v1alpha1::AdminNetworkPolicy::crd();
    annotate(&mut anp, V1ALPHA1_APPROVAL, "network-policy-api v0.1.7 (experimental channel)");
    let mut banp = v1alpha1::BaselineAdminNetworkPolicy::crd();
    annotate(&mut banp, V1ALPHA1_APPROVAL, "network-policy-api v0.1.7 (experimental channel)");
    // BaselineAdminNetworkPolicy is a singleton: "Only one baseline admin network policy
    // with metadata.name="default" can be created in the cluster".
    for v in &mut banp.spec.versions {
        if let Some(root) = v.schema.as_mut().and_then(|s| s.open_api_v3_schema.as_mut()) {
            root.x_kubernetes_validations.get_or_insert_with(Vec::new).push(ValidationRule {
                rule: "self.metadata.name == 'default'".to_owned(),
                message: Some(
                    "Only one baseline admin network policy with metadata.name=\"default\" \
                         can be created in the cluster"
                        .to_owned(),
                ),
                ..Default::default()
            });
        }
    }
    let mut cnp = v1alpha2::ClusterNetworkPolicy::crd();
    annotate(&mut cnp, V1ALPHA2_APPROVAL, "network-policy-api v0.2.x (experimental channel)");
    finish([anp, banp, cnp])
}

/// The three Antrea CRDs (`tierproxy crds --antrea`), in a fixed order: Tier,
/// ClusterNetworkPolicy (ACNP), NetworkPolicy (ANNP), all `crd.antrea.io/v1beta1`.
///
/// For a cluster without Antrea only (Antrea installs its own). The schemas are those of
/// [`crate::policy::api::antrea`]: one Go-shaped rule and peer type for every position, so
/// they admit a field Antrea's schema has only elsewhere (`to` in an ingress rule,
/// `namespaces` in an ANNP peer); `tierproxy check` reports those, and every limit the
/// schemas carry is one it enforces too.
pub fn antrea_crds() -> Vec<Crd> {
    let mut all =
        [antrea::Tier::crd(), antrea::ClusterNetworkPolicy::crd(), antrea::NetworkPolicy::crd()];
    for crd in &mut all {
        let ann = crd.metadata.annotations.get_or_insert_with(Default::default);
        ann.insert(UPSTREAM_ANNOTATION.to_owned(), ANTREA_UPSTREAM.to_owned());
    }
    finish(all)
}

/// Drops `nullable` everywhere and names the files.
fn finish(crds: [CustomResourceDefinition; 3]) -> Vec<Crd> {
    crds.into_iter()
        .map(|mut crd| {
            for v in &mut crd.spec.versions {
                if let Some(root) = v.schema.as_mut().and_then(|s| s.open_api_v3_schema.as_mut()) {
                    drop_nullable(root);
                }
            }
            Crd { file_name: format!("{}_{}.yaml", crd.spec.group, crd.spec.names.plural), crd }
        })
        .collect()
}

/// Adds the approval and upstream-release annotations.
fn annotate(crd: &mut CustomResourceDefinition, approval: &str, upstream: &str) {
    let ann = crd.metadata.annotations.get_or_insert_with(Default::default);
    ann.insert(API_APPROVED_ANNOTATION.to_owned(), approval.to_owned());
    ann.insert(UPSTREAM_ANNOTATION.to_owned(), upstream.to_owned());
}

/// Removes `nullable` from a schema and every property and item schema under it.
fn drop_nullable(s: &mut JSONSchemaProps) {
    s.nullable = None;
    for p in s.properties.iter_mut().flat_map(|m| m.values_mut()) {
        drop_nullable(p);
    }
    if let Some(JSONSchemaPropsOrArray::Schema(i)) = s.items.as_mut() {
        drop_nullable(i);
    }
}

/// One CRD as a YAML document (no leading `---`), with a header comment saying it is
/// generated (and, for an Antrea CRD, that it is for clusters without Antrea).
///
/// Errors: serialization failures (none are expected for these types).
pub fn to_yaml(crd: &Crd) -> anyhow::Result<String> {
    let body = serde_saphyr::to_string(&crd.crd)
        .with_context(|| format!("serializing the CRD {}", crd.file_name))?;
    if crd.crd.spec.group == antrea::GROUP {
        return Ok(format!(
            "# Generated by `tierproxy crds --antrea` from the types in src/policy/api/antrea.rs; \
             do not edit.\n\
             # Only for a cluster WITHOUT Antrea: a cluster running Antrea already has Antrea's own\n\
             # CRDs, and applying this one would replace Antrea's. Details: deploy/README.md.\n\
             # Regenerate: cargo run -- crds --antrea --out-dir DIR\n{body}"
        ));
    }
    Ok(format!(
        "# Generated by `tierproxy crds` from the types in src/policy/api/; do not edit.\n\
         # Regenerate: cargo run -- crds --out-dir deploy/crds\n{body}"
    ))
}

/// All three CRDs of [`crds`] as one multi-document YAML stream (`---` between documents).
///
/// Errors: as [`to_yaml`].
pub fn to_yaml_stream() -> anyhow::Result<String> {
    yaml_stream(&crds())
}

/// `crds` as one multi-document YAML stream (`---` before each document), e.g.
/// [`antrea_crds`] for `tierproxy crds --antrea`.
///
/// Errors: as [`to_yaml`].
pub fn yaml_stream(crds: &[Crd]) -> anyhow::Result<String> {
    let mut out = String::new();
    for crd in crds {
        out.push_str("---\n");
        out.push_str(&to_yaml(crd)?);
    }
    Ok(out)
}
