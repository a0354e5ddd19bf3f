//! The indexes a snapshot decides with, built over the ordered policies: each policy's
//! rule-mask [`Matcher`]s, the port and external-address indexes, and the per-pod policy
//! lists, interned.

use std::collections::HashMap;
use std::sync::Arc;

use roaring::RoaringBitmap;

use super::parallel::{par_map_claimed, par_ranges, workers_for};
use crate::policy::matcher::{
    AddrIndex, FlatSets, MAX_RULES, Matcher, PodAddrs, PodSets, PortIndex, Scratch, block_ranges,
    protocol_index,
};
use crate::policy::model::{Direction, PodEntry, Rule, Tier};
use crate::policy::ports::{PortSpec, Protocol};
use crate::policy::problem::Kind;
use crate::policy::snapshot::{PodPolicies, Policy, PolicyLists};

/// A policy's place in the evaluation order: by tier, then inside each tier by rank
/// (Antrea's global order: Antrea Tiers, CNP Admin, ANP; Antrea `baseline`, then
/// BANP/CNP Baseline), then priority, then name, then kind, then namespace: "ties broken
/// deterministically by name" (DESIGN §2); `check` reports the ties
/// ([`priority_conflicts`](super::priority_conflicts)). Antrea policies of one rank and
/// priority are then interleaved rule by rule when deciding, this order breaking only
/// ties of rule index. Distinct objects have distinct places. The one definition of the
/// order: the full compile sorts by it, and a patch that moves a policy inserts it into
/// the per-pod lists by it.
pub(crate) fn place(p: &Policy) -> (Tier, u8, Priority, &str, Kind, Option<&str>) {
    (
        p.tier,
        p.rank,
        Priority(p.priority),
        &p.object.name,
        p.object.kind,
        p.object.namespace.as_deref(),
    )
}

/// A policy priority ordered numerically (`f64::total_cmp`; validation admits only
/// finite values).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Priority(pub(crate) f64);

impl PartialEq for Priority {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other).is_eq()
    }
}

impl Eq for Priority {}

impl PartialOrd for Priority {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Priority {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// Orders `policies` for evaluation ([`place`]). After a full compile policy ids are
/// positions in this order; a patch that moves a policy keeps its id (ids are then slots,
/// and only the per-pod lists carry the order).
pub(super) fn evaluation_order(policies: &mut [Policy]) {
    policies.sort_by(|a, b| place(a).cmp(&place(b)));
}

/// The indexes a policy list is searched with: reads the ordered `policies` (their rules),
/// the interned pod `sets`, the single-address pods `addrs` and the `pods`' declared
/// ports; sets every policy's [`Policy::matchers`] and returns the port and address
/// indexes.
///
/// The matchers on worker threads, and beside them (a third thread on a small machine,
/// which the OS interleaves) the port and address indexes: independent sweeps over every
/// rule.
pub(super) fn matchers_and_indexes(
    policies: &mut [Policy],
    sets: &[Arc<RoaringBitmap>],
    addrs: &PodAddrs,
    pods: &[PodEntry],
    workers: usize,
) -> ([[PortIndex; 3]; 2], [AddrIndex; 2]) {
    let (matchers, indexes) = std::thread::scope(|scope| {
        let policies = &*policies;
        let indexes = (workers > 1 && policies.len() >= 64)
            .then(|| scope.spawn(|| (port_index(policies, pods), addr_index(policies))));
        let matchers = build_matchers(policies, sets, addrs, pods.len(), workers);
        let indexes = match indexes {
            Some(h) => h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)),
            None => (port_index(policies, pods), addr_index(policies)),
        };
        (matchers, indexes)
    });
    for (p, m) in policies.iter_mut().zip(matchers) {
        p.matchers = m.map(|m| m.map(Arc::new));
    }
    indexes
}

/// Per pod (`pods` of them), the ids of the ordered `policies` (sorted by [`place`]) that
/// apply to it, per tier and direction, in evaluation order; the distinct lists interned.
/// Returns the index into the distinct lists by pod id, and the distinct lists (ids in
/// order of first use, by pod id).
///
/// The lists are never built per pod. Each pod holds a *list class*: the id of the
/// sequence of (policy, direction) steps that applied to it so far, nodes of a trie whose
/// root is the empty list. A step moves every pod of the policy's subject from its class
/// to that class's child for the step, made once per class and step; pods of one
/// namespace move together, so a visit is two array reads and a write. Two pods end in
/// one class exactly when their lists are equal, so each distinct list is then read off
/// the trie once, on a walk down from the root. The trie has at most a node per visit
/// (20 bytes with its move, 16 more while the lists are read off), against 4 bytes a visit
/// for per-pod lists; with the bench's Antrea set, 155,631 nodes for 1.24 M visits.
///
/// The pod ids are split into up to `workers` ranges, each walked on a thread of its own
/// with a trie of its own; the ranges' distinct lists are then interned in range order,
/// so the result does not depend on the number of ranges. (On the calling thread alone
/// the walk was the longest part of a compile with no second thread at work: with the
/// bench's Antrea set, 12.7-13.9 ms of its 250-300; on two, 9.1-11.2 ms, the merge
/// included.)
pub(super) fn per_pod_policies(
    policies: &[Policy],
    pods: usize,
    workers: usize,
) -> (Vec<u32>, Vec<PodPolicies>) {
    let visits = policies.iter().map(|p| {
        let directions = p.applies.iter().filter(|&&a| a).count();
        directions * p.subject.len() as usize
    });
    let workers = workers_for(visits.sum(), workers).min(pods.max(1));
    let ranges: Vec<std::ops::Range<u32>> = (0..workers)
        .map(|w| (pods * w / workers) as u32..(pods * (w + 1) / workers) as u32)
        .collect();
    let each: Vec<std::ops::Range<usize>> = (0..workers).map(|w| w..w + 1).collect();
    let mut parts = par_ranges(&ranges, &each, |_, r| lists_in(policies, r[0].clone()));
    if parts.len() == 1 {
        return parts.pop().expect("one range");
    }
    let mut per_pod = Vec::with_capacity(pods);
    let mut lists: Vec<PodPolicies> = Vec::new();
    // foldhash, seeded per process: a list is policy ids, in an order policy authors set.
    let mut ids: HashMap<PodPolicies, u32, foldhash::fast::RandomState> = HashMap::default();
    for (classes, distinct) in parts {
        let global: Vec<u32> = distinct
            .into_iter()
            .map(|l| {
                *ids.entry(l).or_insert_with_key(|l| {
                    lists.push(l.clone());
                    lists.len() as u32 - 1
                })
            })
            .collect();
        per_pod.extend(classes.iter().map(|&c| global[c as usize]));
    }
    (per_pod, lists)
}

/// [`per_pod_policies`] for the pods of one range of ids: per pod of the range (by id
/// from its start), the index of its lists among the range's distinct lists, numbered in
/// order of first use.
fn lists_in(policies: &[Policy], range: std::ops::Range<u32>) -> (Vec<u32>, Vec<PodPolicies>) {
    /// A trie node: its parent class and the step that made it from its parent.
    struct Node {
        parent: u32,
        policy: u32,
        direction: Direction,
    }
    let mut class = vec![0u32; range.len()];
    let root = Node { parent: u32::MAX, policy: u32::MAX, direction: Direction::Ingress };
    let mut nodes = vec![root];
    // Per class: the last step that moved it, and the child it moved to then (side by
    // side: one line per visit).
    let mut moved = vec![(0u32, 0u32); 1];
    let mut step = 0u32;
    for (pid, p) in policies.iter().enumerate() {
        for direction in Direction::BOTH {
            if !p.applies[direction as usize] {
                continue;
            }
            step += 1;
            // `for_each`: roaring's `fold` walks container by container, where `next`
            // re-checks which container it is in for every pod.
            p.subject.range(range.clone()).for_each(|pod| {
                let pod = (pod - range.start) as usize;
                let from = class[pod] as usize;
                if moved[from].0 != step {
                    moved[from] = (step, nodes.len() as u32);
                    nodes.push(Node { parent: from as u32, policy: pid as u32, direction });
                    moved.push((0, 0));
                }
                class[pod] = moved[from].1;
            });
        }
    }

    // Final classes numbered in order of first use by pod id.
    let mut number = vec![u32::MAX; nodes.len()];
    let mut classes = 0u32;
    let per_pod = class
        .into_iter()
        .map(|c| {
            let n = &mut number[c as usize];
            if *n == u32::MAX {
                *n = classes;
                classes += 1;
            }
            *n
        })
        .collect();

    // Each final class's lists, read off the trie depth first from the root with the
    // path's steps on a stack. Read up from each class instead, a list's every step was a
    // load that waited on the one before (the parent links jump back through the trie):
    // with the bench's Antrea set the phase took 21-22 ms that way on a 2-core VM, 16-18
    // this way (docs/architecture.md, "Measured: with Antrea's tiers", stop 55).
    let mut first_child = vec![0u32; nodes.len() + 1];
    for n in &nodes[1..] {
        first_child[n.parent as usize + 1] += 1;
    }
    for i in 1..first_child.len() {
        first_child[i] += first_child[i - 1];
    }
    let mut children = vec![0u32; nodes.len().saturating_sub(1)];
    let mut filled = first_child.clone();
    for (id, n) in nodes.iter().enumerate().skip(1) {
        let at = &mut filled[n.parent as usize];
        children[*at as usize] = id as u32;
        *at += 1;
    }
    let tiers: Vec<usize> = policies.iter().map(|p| p.tier.index()).collect();
    let mut lists = PolicyLists::default();
    let mut made: Vec<(u32, PodPolicies)> = Vec::with_capacity(classes as usize);
    // (node, its next child to visit); a node's step is on `lists` while it is open.
    let mut open: Vec<(u32, u32)> = vec![(0, first_child[0])];
    if number[0] != u32::MAX {
        made.push((number[0], PodPolicies::new(&lists)));
    }
    while let Some(&mut (node, ref mut next)) = open.last_mut() {
        if *next == first_child[node as usize + 1] {
            open.pop();
            if node != 0 {
                let n = &nodes[node as usize];
                lists[tiers[n.policy as usize]][n.direction as usize].pop();
            }
            continue;
        }
        let child = children[*next as usize];
        *next += 1;
        let n = &nodes[child as usize];
        lists[tiers[n.policy as usize]][n.direction as usize].push(n.policy);
        if number[child as usize] != u32::MAX {
            made.push((number[child as usize], PodPolicies::new(&lists)));
        }
        open.push((child, first_child[child as usize]));
    }
    debug_assert_eq!(made.len(), classes as usize, "every node is under the root");
    made.sort_unstable_by_key(|&(n, _)| n);
    let policy_sets = made.into_iter().map(|(_, lists)| lists).collect();
    (per_pod, policy_sets)
}

/// The [`Matcher`]s of every policy direction with at most [`MAX_RULES`] rules, by
/// policy, built on worker threads (each depends only on its policy's rules and the
/// interned pod sets).
fn build_matchers(
    policies: &[Policy],
    sets: &[Arc<RoaringBitmap>],
    addrs: &PodAddrs,
    pods: usize,
    workers: usize,
) -> Vec<[Option<Matcher>; 2]> {
    let weight = policies.iter().flat_map(|p| p.rules.iter().flatten());
    let workers = workers_for(weight.map(|r| 1 + r.peers.pod_sets.len()).sum(), workers);
    let sets = &FlatSets::new(sets, pods);
    // Claimed in batches: a policy's weight foretells its build badly (ranges of equal
    // weight finished 30 % apart on the bench's Antrea set).
    par_map_claimed(
        policies,
        workers,
        MATCHER_BATCH,
        || Scratch::new(pods),
        |scratch, p| {
            let mut build = |r: &Vec<Rule>| matcher(r, sets, addrs, scratch);
            [build(&p.rules[0]), build(&p.rules[1])]
        },
    )
}

/// Policies a matcher worker claims at a time: small enough that the workers finish
/// together, large enough that claiming costs nothing next to the builds.
const MATCHER_BATCH: usize = 8;

/// The [`Matcher`] of one policy direction's `rules`, or `None` when they are evaluated
/// rule by rule: above [`MAX_RULES`] of them, or when their masks need more classes than a
/// matcher numbers ([`Matcher::build`]'s error). `scratch` covers every pod id, empty.
pub(super) fn matcher(
    rules: &[Rule],
    sets: &(impl PodSets + ?Sized),
    addrs: &PodAddrs,
    scratch: &mut Scratch,
) -> Option<Matcher> {
    if rules.len() > MAX_RULES {
        return None;
    }
    Matcher::build(rules, sets, addrs, scratch).ok()
}

/// Per named port, the (protocol, number) pairs some pod declares under that name.
pub(super) type DeclaredPorts = HashMap<String, Vec<(Protocol, u16)>>;

/// The named ports the `pods` declare ([`DeclaredPorts`]).
pub(super) fn declared_ports(pods: &[PodEntry]) -> DeclaredPorts {
    let mut declared: DeclaredPorts = HashMap::new();
    for np in pods.iter().flat_map(|p| &p.ports) {
        let e = declared.entry(np.name.clone()).or_default();
        if !e.contains(&(np.protocol, np.port)) {
            e.push((np.protocol, np.port));
        }
    }
    declared
}

/// The inclusive port ranges the `rules` of one policy direction have, each handed to
/// `push` as (protocol index: TCP 0, UDP 1, SCTP 2; first port; last port). Named ports
/// count as every port number some pod declares under that name (and protocol): a
/// superset, so the [`PortIndex`] never hides a policy that could match.
pub(super) fn port_ranges(
    rules: &[Rule],
    declared: &DeclaredPorts,
    mut push: impl FnMut(usize, u32, u32),
) {
    for r in rules {
        if r.ports.0.is_empty() {
            for proto in 0..3 {
                push(proto, 0, u16::MAX as u32);
            }
        }
        for m in &r.ports.0 {
            match (&m.ports, m.protocol) {
                (PortSpec::Any, Some(proto)) => push(protocol_index(proto), 0, u16::MAX as u32),
                (PortSpec::Range(lo, hi), Some(proto)) => {
                    push(protocol_index(proto), *lo as u32, *hi as u32)
                }
                (PortSpec::Named(name), want) => {
                    for &(proto, port) in declared.get(name.as_str()).into_iter().flatten() {
                        if want.is_none_or(|w| w == proto) {
                            push(protocol_index(proto), port as u32, port as u32);
                        }
                    }
                }
                (_, None) => {}
            }
        }
    }
}

/// Builds the [`PortIndex`] of every direction and protocol ([`port_ranges`]).
fn port_index(policies: &[Policy], pods: &[PodEntry]) -> [[PortIndex; 3]; 2] {
    let declared = declared_ports(pods);
    let mut out: [[PortIndex; 3]; 2] = Default::default();
    for d in Direction::BOTH {
        let mut ranges: [Vec<(u32, u32, u32)>; 3] = Default::default();
        for (pid, p) in policies.iter().enumerate() {
            let pid = pid as u32;
            port_ranges(&p.rules[d as usize], &declared, |proto, lo, hi| {
                ranges[proto].push((lo, hi, pid))
            });
        }
        out[d as usize] = ranges.map(|mut r| PortIndex::build(&mut r, policies.len()));
    }
    out
}

/// The address ranges `rules` (one policy direction) can match an external peer with:
/// every `networks`/`ipBlock` range, and the whole address space for a rule that
/// matches every peer; each inclusive range handed to `push` as (is IPv4, first, last).
pub(super) fn addr_ranges(rules: &[Rule], mut push: impl FnMut(bool, u128, u128)) {
    let mut scratch = Vec::new();
    for r in rules {
        if r.peers.all {
            push(true, 0, u32::MAX as u128);
            push(false, 0, u128::MAX);
        }
        for b in &r.peers.blocks {
            block_ranges(b, &mut scratch);
            let v4 = b.net.addr().is_ipv4();
            for (lo, hi) in scratch.drain(..) {
                push(v4, lo, hi);
            }
        }
    }
}

/// Builds the [`AddrIndex`] of each direction ([`addr_ranges`]).
fn addr_index(policies: &[Policy]) -> [AddrIndex; 2] {
    Direction::BOTH.map(|d| {
        let (mut v4, mut v6) = (Vec::new(), Vec::new());
        for (pid, p) in policies.iter().enumerate() {
            let pid = pid as u32;
            addr_ranges(&p.rules[d as usize], |is_v4, lo, hi| {
                if is_v4 { v4.push((lo, hi, pid)) } else { v6.push((lo, hi, pid)) }
            });
        }
        AddrIndex::build(&mut v4, &mut v6, policies.len())
    })
}
