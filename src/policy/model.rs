//! The model the policy core shares: what validation, compiling, the matchers and
//! deciding all speak of.
//!
//! Plain data with no behaviour beyond naming itself: directions, tiers, actions,
//! endpoints, the compiled form of a rule and its peers, and the entries a snapshot keeps
//! per pod, namespace and node. Everything else in `policy` depends on this file and it
//! on nothing of theirs but [`cidr`](super::cidr) and [`ports`](super::ports):
//! validate, matcher and eval read it; compile builds it.
//! The compiled policies and the snapshot that holds them live in
//! [`snapshot`](super::snapshot), beside the matchers they carry.

use std::collections::BTreeMap;

use roaring::RoaringBitmap;

use super::cidr::Block;
use super::ports::{NamedPort, Ports};

/// A snapshot's version: increases by one with every snapshot a builder publishes.
/// Decision caches key on it; audit events carry it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Revision(pub u64);

impl std::fmt::Display for Revision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Traffic direction, seen from the subject pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Direction {
    /// Traffic into the subject; the peer is the source.
    Ingress = 0,
    /// Traffic out of the subject; the peer is the destination.
    Egress = 1,
}

impl Direction {
    /// Both directions, ingress first.
    pub const BOTH: [Direction; 2] = [Direction::Ingress, Direction::Egress];

    /// `ingress` / `egress`.
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Ingress => "ingress",
            Direction::Egress => "egress",
        }
    }
}

/// A policy tier (DESIGN §2). The order tiers are consulted in is [`Tier::ORDER`]; `Ord`
/// follows it. Antrea's Tiers sit inside the two admin-level tiers, each at its place in
/// Antrea's global order (a policy's `rank`, `shared/reference/antrea-model.md` §3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    /// Everything before NetworkPolicy: Antrea Tiers below 220, ClusterNetworkPolicy
    /// `tier: Admin` (220), Antrea Tiers 221–250 (`application`), AdminNetworkPolicy (251).
    Admin,
    /// `networking.k8s.io/v1` NetworkPolicy.
    NetworkPolicy,
    /// Everything after NetworkPolicy: Antrea's `baseline` Tier (253), then
    /// BaselineAdminNetworkPolicy and ClusterNetworkPolicy `tier: Baseline` (254).
    Baseline,
}

/// A policy's place among the admin-level tiers, lower first: Antrea's internal tier
/// priority (`shared/reference/antrea-model.md` §3). An Antrea policy's is its Tier's
/// `spec.priority`.
pub(crate) mod rank {
    /// ClusterNetworkPolicy `tier: Admin` (Antrea `cnpAdminTierPriority`).
    pub(crate) const CNP_ADMIN: u8 = 220;
    /// AdminNetworkPolicy (Antrea `adminnetworkpolicy.go`).
    pub(crate) const ANP: u8 = 251;
    /// NetworkPolicy, between the two admin-level lists.
    pub(crate) const NETWORK_POLICY: u8 = 252;
    /// Antrea's `baseline` Tier: the first rank after NetworkPolicy.
    pub(crate) const ANTREA_BASELINE: u8 = 253;
    /// BaselineAdminNetworkPolicy and ClusterNetworkPolicy `tier: Baseline`.
    pub(crate) const BASELINE: u8 = 254;
}

impl Tier {
    /// The order in which tiers are consulted — the only place in the code that says so.
    /// Everything else derives from it: [`Tier::index`] and `Ord` (so the compiled policies
    /// sort tier by tier in this order), the per-pod policy lists eval walks, the metrics'
    /// tier labels.
    ///
    /// Source: network-policy-api `ClusterNetworkPolicySpec.tier`: "Policy tiers are
    /// evaluated in the following order: Admin tier, NetworkPolicy tier, Baseline tier";
    /// KEP-2091.
    pub const ORDER: [Tier; 3] = [Tier::Admin, Tier::NetworkPolicy, Tier::Baseline];

    /// Number of tiers.
    pub const COUNT: usize = Self::ORDER.len();

    /// The position of the tier in [`Tier::ORDER`] (`0..Tier::COUNT`).
    pub const fn index(self) -> usize {
        let mut i = 0;
        while i < Self::COUNT {
            if Self::ORDER[i] as u8 == self as u8 {
                return i;
            }
            i += 1;
        }
        panic!("a tier missing from Tier::ORDER")
    }

    /// `admin`, `networkpolicy`, `baseline`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Tier::Admin => "admin",
            Tier::NetworkPolicy => "networkpolicy",
            Tier::Baseline => "baseline",
        }
    }
}

// Every tier is in `Tier::ORDER` exactly once, checked when the crate compiles: a tier left
// out would make `Tier::index` panic, a tier listed twice would shadow its second place.
// The match is exhaustive, so a new tier does not compile until it is named here (name it
// in the assertion as well).
const _: () = {
    const fn listed_once(t: Tier) -> bool {
        let mut seen = 0;
        let mut i = 0;
        while i < Tier::COUNT {
            if Tier::ORDER[i] as u8 == t as u8 {
                seen += 1;
            }
            i += 1;
        }
        seen == 1
    }
    const fn check(t: Tier) -> bool {
        match t {
            Tier::Admin | Tier::NetworkPolicy | Tier::Baseline => listed_once(t),
        }
    }
    assert!(check(Tier::Admin) && check(Tier::NetworkPolicy) && check(Tier::Baseline));
};

impl Ord for Tier {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.index().cmp(&other.index())
    }
}

impl PartialOrd for Tier {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// A rule's action, normalised across API versions (v1alpha2 `Accept` is `Allow`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Allow / Accept: the direction is allowed; no later rule or tier is consulted.
    Allow,
    /// Deny: the direction is denied; no later rule or tier is consulted.
    Deny,
    /// Pass: skip the rest of the current tier (an Antrea Pass: every later admin-level
    /// rule, straight to NetworkPolicy; `shared/reference/antrea-model.md` §5).
    Pass,
    /// Antrea `Reject`: the direction is refused and the client told at once (TCP RST,
    /// ICMP administratively prohibited); no later rule or tier is consulted. Only Antrea
    /// ClusterNetworkPolicy and NetworkPolicy rules carry it (antrea-model.md §5).
    Reject,
}

impl Action {
    /// `Allow`, `Deny`, `Pass`, `Reject`.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Allow => "Allow",
            Action::Deny => "Deny",
            Action::Pass => "Pass",
            Action::Reject => "Reject",
        }
    }
}

/// Index of an interned pod set in a snapshot's pod sets ([`Peers::pod_sets`] hold them).
pub(crate) type SetId = u32;

/// What a peer endpoint is, as far as policy is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// A pod-network pod (not hostNetwork, not terminated), by dense id.
    Pod(u32),
    /// A node address, or a hostNetwork pod (which shares its node's addresses).
    Node(u32),
    /// Anything else.
    External,
}

#[derive(Debug, Clone)]
pub(crate) struct PodEntry {
    pub(crate) namespace: u32,
    pub(crate) name: String,
    pub(crate) node: Option<u32>,
    pub(crate) ports: Vec<NamedPort>,
}

#[derive(Debug, Clone)]
pub(crate) struct NamespaceEntry {
    pub(crate) name: String,
    pub(crate) labels: BTreeMap<String, String>,
    /// Ids of the namespace's pod-network pods.
    pub(crate) pods: RoaringBitmap,
}

#[derive(Debug, Clone)]
pub(crate) struct NodeEntry {
    pub(crate) name: String,
    pub(crate) labels: BTreeMap<String, String>,
    /// The Node's annotations under [`ANNOTATION_PREFIX`] (e.g. [`ANNOTATION_ENFORCING`]).
    pub(crate) annotations: Box<[(String, String)]>,
}

/// The peers of one compiled rule: the rule matches a peer if any part does.
#[derive(Debug, Clone, Default)]
pub(crate) struct Peers {
    /// Matches every address (NetworkPolicy rule without `from`/`to`; a fail-closed
    /// Deny/Pass rule).
    pub(crate) all: bool,
    /// Interned pod sets (namespaces / pods / NetworkPolicy selector peers).
    pub(crate) pod_sets: Box<[SetId]>,
    /// Node ids (a `nodes` peer), matched against node addresses.
    pub(crate) nodes: Option<Box<RoaringBitmap>>,
    /// `networks` / `ipBlock` peers, matched against any address.
    pub(crate) blocks: Box<[Block]>,
    /// Peers relative to the subject's namespace (Antrea `namespaces.match: Self` and
    /// `namespaces.sameLabels`), matched against pod peers only.
    pub(crate) relative: Box<[Relative]>,
}

impl Peers {
    /// Replaces each pod set id by `f` of it, then sorts and dedups them (the ids of a
    /// rule prepared with worker-local ids, made the snapshot's). Reallocates only when
    /// two ids became one.
    pub(crate) fn map_pod_sets(&mut self, f: impl Fn(SetId) -> SetId) {
        let ids = &mut self.pod_sets;
        for id in ids.iter_mut() {
            *id = f(*id);
        }
        ids.sort_unstable();
        if ids.windows(2).any(|w| w[0] == w[1]) {
            let mut v = std::mem::take(ids).into_vec();
            v.dedup();
            *ids = v.into_boxed_slice();
        }
    }
}

/// A [`Peers`] being built from a rule's peer list: lists that grow, kept by a snapshot as
/// boxed slices with no spare capacity ([`PeersBuilder::build`]; a snapshot holds every
/// rule's peers for its whole life, 100,000 rules in a large cluster).
#[derive(Debug, Clone, Default)]
pub(crate) struct PeersBuilder {
    /// [`Peers::all`].
    pub(crate) all: bool,
    /// [`Peers::pod_sets`].
    pub(crate) pod_sets: Vec<SetId>,
    /// [`Peers::nodes`].
    pub(crate) nodes: Option<RoaringBitmap>,
    /// [`Peers::blocks`].
    pub(crate) blocks: Vec<Block>,
    /// [`Peers::relative`].
    pub(crate) relative: Vec<Relative>,
}

impl PeersBuilder {
    /// Matches every address.
    pub(crate) fn all() -> Self {
        PeersBuilder { all: true, ..PeersBuilder::default() }
    }

    /// The peers as a snapshot keeps them.
    pub(crate) fn build(self) -> Peers {
        Peers {
            all: self.all,
            pod_sets: self.pod_sets.into_boxed_slice(),
            nodes: self.nodes.map(Box::new),
            blocks: self.blocks.into_boxed_slice(),
            relative: self.relative.into_boxed_slice(),
        }
    }
}

/// An Antrea peer whose namespaces depend on the subject's namespace
/// (`shared/reference/antrea-model.md` §7): the pods of `pods` (the peer's `podSelector`
/// across all namespaces, or every pod) in the namespaces `same` picks.
#[derive(Debug, Clone)]
pub(crate) struct Relative {
    /// The interned pod set of the peer's `podSelector` in every namespace.
    pub(crate) pods: SetId,
    /// Which namespaces, relative to the subject's.
    pub(crate) same: SameNamespaces,
}

/// The namespaces a [`Relative`] peer picks, seen from the subject's namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SameNamespaces {
    /// `namespaces.match: Self`: the subject's own namespace.
    Own,
    /// `namespaces.sameLabels`: namespaces with every key, each with the subject's
    /// namespace's value; none when the subject's namespace lacks a key (Antrea
    /// `groupNamespacesByLabelValue`).
    Labels(Box<[String]>),
}

impl SameNamespaces {
    /// Whether the namespace with labels `peer` is picked for a subject whose namespace has
    /// labels `subject` and the same id (`same_ns`).
    pub(crate) fn picks(
        &self,
        same_ns: bool,
        subject: &BTreeMap<String, String>,
        peer: &BTreeMap<String, String>,
    ) -> bool {
        match self {
            SameNamespaces::Own => same_ns,
            SameNamespaces::Labels(keys) => {
                keys.iter().all(|k| subject.get(k).is_some_and(|v| peer.get(k) == Some(v)))
            }
        }
    }
}

/// One compiled rule.
#[derive(Debug, Clone)]
pub(crate) struct Rule {
    /// The rule's `name`, if it has one.
    pub(crate) name: Option<Box<str>>,
    /// Position in the policy's ingress or egress list.
    pub(crate) index: u32,
    pub(crate) action: Action,
    pub(crate) peers: Peers,
    pub(crate) ports: Ports,
    /// The rule holds a peer of an unknown kind and was turned into "deny all" (a Deny or
    /// Pass rule) as the API requires.
    pub(crate) fail_closed: bool,
    /// Antrea rule-level `appliedTo`: the rule applies only to subjects in this pod set.
    /// `None`: to every subject of the policy.
    pub(crate) applied_to: Option<SetId>,
    /// Antrea `enableLogging`: every decision of this rule is audited.
    pub(crate) enable_logging: bool,
    /// Antrea `logLabel`, an attribute of this rule's audit events.
    pub(crate) log_label: Option<std::sync::Arc<str>>,
}

/// Prefix of the annotations a [`Snapshot`](super::Snapshot) keeps for each policy
/// ([`Snapshot::policy_annotation`](super::Snapshot::policy_annotation)): tierproxy's own
/// settings on upstream objects, such as `tierproxy.io/audit` (docs/audit.md), which need
/// no change to the CRDs.
pub const ANNOTATION_PREFIX: &str = "tierproxy.io/";

/// The Node annotation an agent keeps on its own Node while it enforces (value `"true"`;
/// issue #18): the connections of that node's pods are proxied and decided, egress and the
/// server's ingress, at that node, so other nodes decide them on the first packet and let
/// the kernel forward them instead of proxying them a second time. Written by the agent
/// (`cluster::apiserver`), read here.
pub const ANNOTATION_ENFORCING: &str = "tierproxy.io/enforcing";

#[cfg(test)]
mod tests {
    use super::*;

    /// `Ord` and `index` are derived from `Tier::ORDER`: the compile sort, `check`'s
    /// priority groups and the metrics' labels all rely on them agreeing with it.
    #[test]
    fn tiers_index_and_sort_as_tier_order_says() {
        for (i, t) in Tier::ORDER.into_iter().enumerate() {
            assert_eq!(t.index(), i, "{t:?}");
            for (j, u) in Tier::ORDER.into_iter().enumerate() {
                assert_eq!(t.cmp(&u), i.cmp(&j), "{t:?} vs {u:?}");
            }
        }
    }
}
