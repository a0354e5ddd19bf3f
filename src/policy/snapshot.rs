//! The compiled form: [`Snapshot`], the policies it holds, and what it says about the
//! cluster it was compiled from.
//!
//! Built by [`compile`](super::compile), read by [`eval`](super::eval) (deciding) and by
//! the checks that run on a compiled snapshot. Each [`Policy`] carries its rule-mask
//! [`Matcher`]s, so this file sits above [`matcher`](super::matcher), which sits above
//! [`model`](super::model).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use roaring::RoaringBitmap;

use super::matcher::{AddrIndex, Matcher, PortIndex};
use super::model::{
    ANNOTATION_ENFORCING, Endpoint, NamespaceEntry, NodeEntry, PodEntry, Revision, Rule, SetId,
    Tier,
};
use super::problem::ObjectRef;
use super::selector::LabelIndex;

/// One compiled policy of any kind. Its large parts are shared (`Arc`): a snapshot
/// patched after a change ([`Compiler`](super::compile::Compiler)) copies a policy whose
/// matcher or subject changed without copying its rules, and a snapshot's clone copies
/// no string of any policy.
#[derive(Debug, Clone)]
pub(crate) struct Policy {
    pub(crate) object: Arc<ObjectRef>,
    pub(crate) tier: Tier,
    /// Place among the admin-level tiers ([`rank`](super::model::rank)); an Antrea
    /// policy's Tier priority.
    pub(crate) rank: u8,
    /// `spec.priority` (Antrea's is a float); NetworkPolicy has none (0); the BANP has
    /// none and ranks at 1 among the Baseline CNPs, as in Antrea (`BANP_PRIORITY`).
    pub(crate) priority: f64,
    /// The Antrea Tier's name (`securityops`, a custom Tier's); `None` for upstream kinds.
    /// Antrea policies of one rank and priority interleave rule by rule.
    pub(crate) antrea_tier: Option<Arc<str>>,
    /// Rules by [`Direction`](super::model::Direction) index.
    pub(crate) rules: Arc<[Vec<Rule>; 2]>,
    /// Precompiled rule masks per direction; `None` above
    /// [`MAX_RULES`](super::matcher::MAX_RULES) rules (linear evaluation then).
    pub(crate) matchers: [Option<Arc<Matcher>>; 2],
    /// Pods the subject selects: the interned pod set `subject_set` (the same allocation).
    pub(crate) subject: Arc<RoaringBitmap>,
    /// The interned pod set of the subject; `None` when the subject selects nothing by
    /// construction (no selector, or a NetworkPolicy in a namespace nobody declared).
    pub(crate) subject_set: Option<SetId>,
    /// Directions the policy applies to (NetworkPolicy: its defaulted `policyTypes`;
    /// others: directions with rules).
    pub(crate) applies: [bool; 2],
    /// The object's annotations whose key starts with
    /// [`ANNOTATION_PREFIX`](super::model::ANNOTATION_PREFIX) (others are not kept:
    /// `kubectl.kubernetes.io/last-applied-configuration` alone can be large).
    pub(crate) annotations: Arc<[(String, String)]>,
}

/// The policies that apply to a pod, per tier and direction, in evaluation order, as
/// lists a compile or a patch builds and edits: by [`Tier::index`] (position in
/// [`Tier::ORDER`]), then by [`Direction`](super::model::Direction) index.
pub(crate) type PolicyLists = [[Vec<u32>; 2]; Tier::COUNT];

/// Per pod, tier and direction, the policies that apply, in evaluation order
/// ([`PolicyLists`], frozen). Pods with the same labels in the same kind of namespace
/// share one (interned), so the few distinct sets stay in cache while deciding.
///
/// One allocation: [`LISTS`](Self::LISTS) end offsets, then the ids, direction by
/// direction and, within one, tier by tier. A direction's lists are one run of memory that
/// `decide` reads front to back, right after the offsets. As six `Vec`s behind an `Arc`,
/// the header lines and each list's data were misses of their own: loading them was ~44 %
/// of the samples in `decide`'s direction walk on the bench's Antrea set (`perf`), and
/// one allocation took the simulated last-level misses of those flows to 0.92× and the
/// first-level ones to 0.96× (callgrind, docs/architecture.md "Measured: with Antrea's
/// tiers").
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct PodPolicies(Arc<[u32]>);

impl PodPolicies {
    /// Lists held: one per tier and direction.
    const LISTS: usize = 2 * Tier::COUNT;

    /// Freezes `lists`.
    pub(crate) fn new(lists: &PolicyLists) -> Self {
        let ids: usize = lists.iter().flatten().map(Vec::len).sum();
        let mut out = Vec::with_capacity(Self::LISTS + ids);
        out.resize(Self::LISTS, 0);
        for d in 0..2 {
            for (t, by_direction) in lists.iter().enumerate() {
                out.extend_from_slice(&by_direction[d]);
                out[d * Tier::COUNT + t] = out.len() as u32;
            }
        }
        PodPolicies(out.into())
    }

    /// The first line of the lists (their end offsets, then the first ids), to prefetch.
    #[inline]
    pub(crate) fn head(&self) -> *const u32 {
        self.0.as_ptr()
    }

    /// The policy ids of tier `tier` ([`Tier::index`]) in direction `d`, in evaluation
    /// order.
    ///
    /// # Panics
    /// If `tier` ≥ [`Tier::COUNT`] or `d` ≥ 2.
    #[inline]
    pub(crate) fn list(&self, tier: usize, d: usize) -> &[u32] {
        let k = d * Tier::COUNT + tier;
        let start = if k == 0 { Self::LISTS } else { self.0[k - 1] as usize };
        &self.0[start..self.0[k] as usize]
    }

    /// The lists, to be edited and frozen again ([`PodPolicies::new`]).
    pub(crate) fn thaw(&self) -> PolicyLists {
        std::array::from_fn(|t| std::array::from_fn(|d| self.list(t, d).to_vec()))
    }
}

impl Default for PodPolicies {
    /// No policy in any list.
    fn default() -> Self {
        PodPolicies::new(&PolicyLists::default())
    }
}

/// What each pod and node address is. Every `decide` looks up both ends of the flow
/// here, so the hash is foldhash (seeded per process) rather than SipHash, which took
/// about 180 instructions a lookup, 6 % of `decide`'s on the bench's Antrea set
/// (callgrind). The keys are the cluster's own addresses; a pod can choose the address it
/// looks up, not what the table holds.
pub(crate) type AddrMap = HashMap<IpAddr, Endpoint, foldhash::fast::RandomState>;

/// A compiled, immutable view of policies and cluster state, ready to decide flows.
/// Build it with [`Snapshot::compile`] (or a [`Compiler`](super::compile::Compiler),
/// which patches the previous one after a small change); share it behind an `Arc` and
/// swap it whole. Its parts are shared (`Arc`) with the snapshot it was patched from, so
/// a clone copies only the per-policy headers and the lists of shared parts.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub(crate) revision: Revision,
    pub(crate) pods: Arc<Vec<PodEntry>>,
    pub(crate) namespaces: Arc<Vec<NamespaceEntry>>,
    pub(crate) nodes: Arc<Vec<NodeEntry>>,
    pub(crate) by_ip: Arc<AddrMap>,
    /// Node addresses by node id.
    pub(crate) node_addrs: Arc<Vec<Vec<IpAddr>>>,
    /// Pod IPs by pod id.
    pub(crate) pod_ips: Arc<Vec<Vec<IpAddr>>>,
    /// The interned pod sets, by [`SetId`].
    pub(crate) pod_sets: Vec<Arc<RoaringBitmap>>,
    pub(crate) policies: Vec<Policy>,
    /// Index into `policy_sets` by pod id.
    pub(crate) per_pod: Arc<Vec<u32>>,
    /// The distinct per-pod policy lists (a patched snapshot may hold lists no pod uses
    /// any more, until the next full compile).
    pub(crate) policy_sets: Vec<PodPolicies>,
    /// Per direction and protocol: which policies have a rule for a port.
    pub(crate) port_index: Arc<[[PortIndex; 3]; 2]>,
    /// Per direction: which policies can match an external address.
    pub(crate) addr_index: Arc<[AddrIndex; 2]>,
    /// Pod labels, inverted ([`Snapshot::pod_label_values`]).
    pub(crate) pod_index: Arc<LabelIndex>,
}

impl Snapshot {
    /// The revision this snapshot was compiled with.
    pub fn revision(&self) -> Revision {
        self.revision
    }

    /// The id of pod-network pod `namespace/name`, if the snapshot has it.
    pub fn find_pod(&self, namespace: &str, name: &str) -> Option<u32> {
        self.pods
            .iter()
            .position(|p| p.name == name && self.namespaces[p.namespace as usize].name == namespace)
            .map(|i| i as u32)
    }

    /// The IPs of pod `id` (IPv4 and/or IPv6).
    pub fn pod_ips(&self, id: u32) -> &[IpAddr] {
        &self.pod_ips[id as usize]
    }

    /// The addresses of node `id`: `status.addresses` InternalIP/ExternalIP, plus the IPs of
    /// its hostNetwork pods.
    pub fn node_addrs(&self, id: u32) -> &[IpAddr] {
        &self.node_addrs[id as usize]
    }

    /// The id of node `name`, if known.
    pub fn find_node(&self, name: &str) -> Option<u32> {
        self.nodes.iter().position(|n| n.name == name).map(|i| i as u32)
    }

    /// The addresses of the pod-network pods that run on node `node` (a node id from
    /// [`Snapshot::find_node`]): the addresses a node agent intercepts. hostNetwork pods
    /// are not included (they hold their node's addresses). Order: by pod id, then as in
    /// `status.podIPs`.
    pub fn local_pod_ips(&self, node: u32) -> Vec<IpAddr> {
        (0..self.pods.len() as u32)
            .filter(|&p| self.pods[p as usize].node == Some(node))
            .flat_map(|p| self.pod_ips(p).iter().copied())
            .collect()
    }

    /// Whether node `id` carries [`ANNOTATION_ENFORCING`] with the value `"true"`.
    pub fn node_enforcing(&self, id: u32) -> bool {
        self.nodes.get(id as usize).is_some_and(|n| {
            n.annotations.iter().any(|(k, v)| k == ANNOTATION_ENFORCING && v == "true")
        })
    }

    /// The addresses of the pod-network pods whose node `node_matches` accepts (a node id
    /// from [`Snapshot::find_node`]), in one pass over the pods: e.g. the enforced pods of
    /// the ruleset (pods on every other node whose agent enforces). Order as
    /// [`Snapshot::local_pod_ips`].
    pub fn pod_ips_on(&self, mut node_matches: impl FnMut(u32) -> bool) -> Vec<IpAddr> {
        (0..self.pods.len() as u32)
            .filter(|&p| self.pods[p as usize].node.is_some_and(&mut node_matches))
            .flat_map(|p| self.pod_ips(p).iter().copied())
            .collect()
    }

    /// Number of pod-network pods, namespaces, nodes and compiled policies.
    pub fn counts(&self) -> (usize, usize, usize, usize) {
        (self.pods.len(), self.namespaces.len(), self.nodes.len(), self.policies.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Frozen lists read back as they were built, empty ones included, each direction's
    /// tiers in order; equal lists are equal (and hash alike) frozen.
    #[test]
    fn pod_policies_read_back_each_tier_and_direction() {
        let lists: PolicyLists =
            [[vec![3, 1, 4], vec![]], [vec![], vec![1, 5]], [vec![9, 2, 6, 5], vec![3]]];
        let frozen = PodPolicies::new(&lists);
        for (t, by_direction) in lists.iter().enumerate() {
            for (d, list) in by_direction.iter().enumerate() {
                assert_eq!(frozen.list(t, d), list.as_slice(), "tier {t}, direction {d}");
            }
        }
        assert_eq!(frozen.thaw(), lists);
        assert_eq!(frozen, PodPolicies::new(&frozen.thaw()));
        let interned: std::collections::HashSet<PodPolicies> =
            [frozen.clone(), PodPolicies::new(&lists)].into_iter().collect();
        assert_eq!(interned.len(), 1, "equal lists hash alike");
        assert_ne!(frozen, PodPolicies::default());
        let empty = PodPolicies::default();
        assert!(
            (0..Tier::COUNT).all(|t| empty.list(t, 0).is_empty() && empty.list(t, 1).is_empty())
        );
    }
}
