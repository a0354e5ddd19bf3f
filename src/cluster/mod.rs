//! Where cluster state and policies come from: manifest files ([`manifest`], issue #5) and
//! the API server ([`apiserver`], kube-rs watchers with reflector stores, issue #6). Both
//! feed the same [`crate::policy::Inputs`] and one snapshot builder (the agent's reloader);
//! [`status`] writes back, from the one agent [`lease`] elects, whether each policy was
//! accepted; [`announce`] keeps the agent's own Node annotated while it enforces.
//!
//! This module is the only user of the kube client (DESIGN §4).
pub mod announce;
pub mod apiserver;
pub mod lease;
pub mod manifest;
pub mod status;

use std::sync::Arc;

use crate::policy::compile::meta_namespace;
use crate::policy::{Inputs, Kind, ObjectRef};

/// The policies of the last snapshot in force: what a change falls back on for a policy
/// whose new version is invalid ([`keep_last_good`]). Only the four policy kinds are kept
/// (shared with the inputs they came from, not copied); a Pod, Namespace or
/// Node that turns invalid is left out as any invalid object is.
#[derive(Debug, Clone, Default)]
pub struct LastGood {
    network_policies: Vec<Arc<crate::policy::api::NetworkPolicy>>,
    admin_network_policies: Vec<Arc<crate::policy::api::v1alpha1::AdminNetworkPolicy>>,
    baseline_admin_network_policies:
        Vec<Arc<crate::policy::api::v1alpha1::BaselineAdminNetworkPolicy>>,
    cluster_network_policies: Vec<Arc<crate::policy::api::v1alpha2::ClusterNetworkPolicy>>,
}

impl LastGood {
    /// The policies of `inputs` other than those named in `invalid` (an invalid object is
    /// not a good version, even when it is the first one seen).
    pub fn new(inputs: &Inputs, invalid: &[ObjectRef]) -> LastGood {
        fn valid<T: kube::Resource>(
            items: &[Arc<T>],
            kind: Kind,
            bad: &[ObjectRef],
        ) -> Vec<Arc<T>> {
            items.iter().filter(|o| !bad.iter().any(|r| names(&***o, kind, r))).cloned().collect()
        }
        LastGood {
            network_policies: valid(&inputs.network_policies, Kind::NetworkPolicy, invalid),
            admin_network_policies: valid(
                &inputs.admin_network_policies,
                Kind::AdminNetworkPolicy,
                invalid,
            ),
            baseline_admin_network_policies: valid(
                &inputs.baseline_admin_network_policies,
                Kind::BaselineAdminNetworkPolicy,
                invalid,
            ),
            cluster_network_policies: valid(
                &inputs.cluster_network_policies,
                Kind::ClusterNetworkPolicy,
                invalid,
            ),
        }
    }
}

/// Whether `o`, of kind `kind`, is the object `r` names.
fn names<T: kube::Resource>(o: &T, kind: Kind, r: &ObjectRef) -> bool {
    r.kind == kind
        && o.meta().name.as_deref().unwrap_or("") == r.name
        && r.namespace.as_deref().is_none_or(|ns| meta_namespace(o.meta()) == ns)
}

/// Puts back, in `inputs`, the last good version of each policy named in `invalid` (an
/// object the loader could not decode, or one validation rejects), as an API server would
/// have refused the update that made it invalid: a policy never silently disappears on a
/// bad edit. Returns the objects put back; an invalid policy with no good version is left
/// as it is (the snapshot leaves it out, failing closed as its API says).
///
/// Source: issue #5 "Live change"; DESIGN §1 ("the daemon keeps running on the last good
/// state").
pub fn keep_last_good(
    inputs: &mut Inputs,
    last: &LastGood,
    invalid: &[ObjectRef],
) -> Vec<ObjectRef> {
    fn put_back<T: kube::Resource>(
        list: &mut Vec<Arc<T>>,
        good: &[Arc<T>],
        kind: Kind,
        r: &ObjectRef,
    ) -> bool {
        let Some(old) = good.iter().find(|o| names(&***o, kind, r)) else { return false };
        list.retain(|o| !names(&**o, kind, r));
        list.push(old.clone());
        true
    }
    let mut kept = Vec::new();
    for r in invalid {
        let done = match r.kind {
            Kind::NetworkPolicy => {
                put_back(&mut inputs.network_policies, &last.network_policies, r.kind, r)
            }
            Kind::AdminNetworkPolicy => put_back(
                &mut inputs.admin_network_policies,
                &last.admin_network_policies,
                r.kind,
                r,
            ),
            Kind::BaselineAdminNetworkPolicy => put_back(
                &mut inputs.baseline_admin_network_policies,
                &last.baseline_admin_network_policies,
                r.kind,
                r,
            ),
            Kind::ClusterNetworkPolicy => put_back(
                &mut inputs.cluster_network_policies,
                &last.cluster_network_policies,
                r.kind,
                r,
            ),
            _ => false,
        };
        if done && !kept.contains(r) {
            kept.push(r.clone());
        }
    }
    kept
}
