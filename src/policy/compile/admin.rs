//! The admin passes of a compile: AdminNetworkPolicy and BaselineAdminNetworkPolicy
//! (v1alpha1) and ClusterNetworkPolicy (v1alpha2) into [`Policy`]s of the Admin and
//! Baseline tiers.
//!
//! These objects hold nearly all of a large input's peers (a million peers naming a few
//! hundred distinct selectors), so the work is shaped around reading them once:
//! [`prepare_admin`] validates and compiles them rule by rule on worker threads, each
//! worker keying its selector peers in its own [`SetDict`] (and marking those a valid
//! object uses); [`intern_used`] then resolves each distinct used key once, in worker
//! order; [`keys_to_set_ids`] turns the rules' keys into sorted pod set ids on the workers
//! again; [`Cluster::admin_policy`] resolves each subject.

use std::sync::Arc;

use roaring::RoaringBitmap;

use super::cluster::{Cluster, SetKey};
use super::parallel::{balanced_ranges, par_for_each_mut, par_ranges};
use super::set_dict::{RawSet, SetDict, gather, intern_used};
use super::{
    Inputs, dedup_sorted, meta_name, own_annotations, port_u16, protocol_or_tcp, selector,
    touch_selector,
};
use crate::policy::api::{LabelSelector, NamespacedPod, v1alpha1, v1alpha2};
use crate::policy::cidr::{self, Block};
use crate::policy::model::{Action, Direction, PeersBuilder, Rule, SetId, Tier, rank};
use crate::policy::ports::{PortMatch, PortSpec, Ports, Protocol};
use crate::policy::problem::{Kind, ObjectRef, Problem};
use crate::policy::selector::LabelIndex;
use crate::policy::snapshot::Policy;
use crate::policy::validate::{self, AdminEdit};

/// Admin pass: reads `inputs`' ANPs, CNPs and BANP (validated unless `validate` is false)
/// and `c`'s node label index; returns the policies of the valid ones, kind by kind (ANP,
/// CNP, BANP) in name order, and interns their selectors in `c`. Problems come per kind in
/// input order, as for every other kind: a kind's duplicates, then its objects'
/// validation problems.
pub(super) fn admin_policies(
    c: &mut Cluster,
    inputs: &Inputs,
    validate: bool,
    workers: usize,
    problems: &mut Vec<Problem>,
) -> Vec<Policy> {
    let mut duplicates: [Vec<Problem>; 3] = Default::default();
    let items = admin_objects(inputs, &mut duplicates);
    let (mut prepared, dicts) = prepare_admin(&items, c, validate, workers);
    let key_sets = intern_used(c, dicts);
    keys_to_set_ids(&mut prepared, &key_sets, workers);
    let mut policies = Vec::new();
    let mut reported = 0;
    for ((r, obj), p) in items.into_iter().zip(prepared) {
        while reported <= obj.order() {
            problems.append(&mut duplicates[reported]);
            reported += 1;
        }
        problems.extend(p.problems);
        if let Some(body) = p.body {
            policies.push(c.admin_policy(r, body, own_annotations(obj.metadata())));
        }
    }
    for d in &mut duplicates[reported..] {
        problems.append(d);
    }
    policies
}

/// The new version `new` of an admin object compiled alone against `c` (an edit, issue
/// #21 item 2), as [`admin_policies`] would compile it: each rule equal to the rule at the
/// same position of the previous version `was` (same kind) reuses that rule as `old`
/// compiled it (`old`: the policy `was` compiled to, against the same cluster, whose pod
/// set ids stay valid because sets are interned for good); the other rules are compiled,
/// their selector peers interned. `new` must be valid (validated by the caller). A
/// 100-rule policy of which one rule changed costs one rule's compile, not a hundred.
///
/// Each rule is compared with `was`'s once, here: the caller passes any new allocation,
/// and [`Edited::Unchanged`] says when nothing the compile reads changed (a status write).
/// `None` when `new` and `was` are not of the same kind.
pub(super) fn admin_policy_edited(
    c: &mut Cluster,
    object: ObjectRef,
    new: AdminObject<'_>,
    was: AdminObject<'_>,
    old: &Policy,
) -> Option<Edited> {
    let counts = rule_counts(new);
    let mut same: [Vec<bool>; 2] = Default::default();
    for d in Direction::BOTH {
        for i in 0..counts[d as usize] {
            same[d as usize].push(same_rule(new, was, d, i)?);
        }
    }
    // Per direction, whether every rule is `was`'s, in its place.
    let kept = [0, 1].map(|d| same[d].iter().all(|&s| s) && counts[d] == rule_counts(was)[d]);
    if kept == [true; 2]
        && same_head(new, was)?
        && own_annotations(new.metadata()) == own_annotations(was.metadata())
    {
        return Some(Edited::Unchanged);
    }
    let mut dict = SetDict::new(&c.interner);
    let mut rules: [Vec<Rule>; 2] = counts.map(Vec::with_capacity);
    // Per direction, the positions of the rules compiled here (their peers are worker keys).
    let mut fresh: [Vec<usize>; 2] = Default::default();
    for d in Direction::BOTH {
        for (i, &same) in same[d as usize].iter().enumerate() {
            let reused = match same {
                true => old.rules[d as usize].get(i).cloned(),
                false => None,
            };
            let rule = reused.unwrap_or_else(|| {
                fresh[d as usize].push(i);
                admin_rule_at(new, d, i, &mut dict, &c.node_index)
            });
            rules[d as usize].push(rule);
        }
    }
    // Every key the dict holds with a pod set is in some fresh rule (a key without one
    // made its peer fail closed and is in none).
    let ids: Vec<SetId> = std::mem::take(&mut dict.sets)
        .into_iter()
        .map(|k| k.map_or(SetId::MAX, |k| c.intern(k)))
        .collect();
    for d in 0..2 {
        for &i in &fresh[d] {
            rules[d][i].peers.map_pod_sets(|id| ids[id as usize]);
        }
    }
    let (tier, priority, namespaces, pods) = admin_head(new);
    let body = AdminBody { tier, priority, namespaces, pods, rules };
    Some(Edited::Compiled(c.admin_policy(object, body, own_annotations(new.metadata())), kept))
}

/// What [`admin_policy_edited`] made of a new version.
pub(super) enum Edited {
    /// Equal to the previous version in everything the compile reads.
    Unchanged,
    /// The policy, with per direction whether each of its rules is the one the previous
    /// version has at the same position (nothing added, dropped or changed in that
    /// direction).
    Compiled(Policy, [bool; 2]),
}

/// Whether `a` and `b` have the same tier, priority and subject
/// ([`AdminEdit::same_head`]); `None` when they are not of the same kind.
fn same_head(a: AdminObject<'_>, b: AdminObject<'_>) -> Option<bool> {
    Some(match (a, b) {
        (AdminObject::Anp(a), AdminObject::Anp(b)) => a.same_head(b),
        (AdminObject::Banp(a), AdminObject::Banp(b)) => a.same_head(b),
        (AdminObject::Cnp(a), AdminObject::Cnp(b)) => a.same_head(b),
        _ => return None,
    })
}

/// Whether rule `i` of direction `d` of `a` equals the rule at the same position of `b`
/// ([`AdminEdit::same_rule`]); `None` when `a` and `b` are not of the same kind.
fn same_rule(a: AdminObject<'_>, b: AdminObject<'_>, d: Direction, i: usize) -> Option<bool> {
    Some(match (a, b) {
        (AdminObject::Anp(a), AdminObject::Anp(b)) => a.same_rule(b, d, i),
        (AdminObject::Banp(a), AdminObject::Banp(b)) => a.same_rule(b, d, i),
        (AdminObject::Cnp(a), AdminObject::Cnp(b)) => a.same_rule(b, d, i),
        _ => return None,
    })
}

/// The admin objects of `inputs`, each kind deduplicated (its duplicates reported in
/// `duplicates`, by [`AdminObject::order`]) and in name order, kinds in compile order.
fn admin_objects<'a>(
    inputs: &'a Inputs,
    duplicates: &mut [Vec<Problem>; 3],
) -> Vec<(ObjectRef, AdminObject<'a>)> {
    // Cluster-scoped admin objects of one kind, deduplicated, as `AdminObject`s.
    fn of_kind<'a, T: kube::Resource>(
        items: &'a [Arc<T>],
        kind: Kind,
        wrap: fn(&'a T) -> AdminObject<'a>,
        duplicates: &mut Vec<Problem>,
    ) -> impl Iterator<Item = (ObjectRef, AdminObject<'a>)> {
        let key = move |p: &T| ObjectRef::cluster(kind, meta_name(p.meta()));
        dedup_sorted(items, key, duplicates).into_iter().map(move |(r, p)| (r, wrap(p)))
    }
    let [anp_dups, cnp_dups, banp_dups] = duplicates;
    of_kind(&inputs.admin_network_policies, Kind::AdminNetworkPolicy, AdminObject::Anp, anp_dups)
        .chain(of_kind(
            &inputs.cluster_network_policies,
            Kind::ClusterNetworkPolicy,
            AdminObject::Cnp,
            cnp_dups,
        ))
        .chain(of_kind(
            &inputs.baseline_admin_network_policies,
            Kind::BaselineAdminNetworkPolicy,
            AdminObject::Banp,
            banp_dups,
        ))
        .collect()
}

/// Turns the worker keys in the rules of `prepared` into sorted, deduplicated pod set ids
/// (`key_sets`, from [`intern_used`]), on the workers again (a million ids to sort).
fn keys_to_set_ids(prepared: &mut [Prepared<'_>], key_sets: &[Vec<SetId>], workers: usize) {
    let weights: Vec<usize> = prepared
        .iter()
        .map(|p| p.body.iter().flat_map(|b| b.rules.iter().flatten()))
        .map(|rules| rules.map(|r| r.peers.pod_sets.len()).sum())
        .collect();
    par_for_each_mut(prepared, &balanced_ranges(&weights, workers), |p| {
        for rule in p.body.iter_mut().flat_map(|b| b.rules.iter_mut().flatten()) {
            rule.peers.map_pod_sets(|id| key_sets[p.worker][id as usize]);
        }
    });
}

/// ANP / BANP `ports` (v1alpha1 `AdminNetworkPolicyPort`).
fn anp_ports(ports: &Option<Vec<v1alpha1::AdminNetworkPolicyPort>>) -> Ports {
    let Some(ports) = ports else { return Ports::any() };
    // Sized for one entry a port, so that the boxed slice is this allocation (a
    // `filter_map` collected grows from nothing and is shrunk again).
    let mut out = Vec::with_capacity(ports.len());
    out.extend(ports.iter().filter_map(|p| {
        let v1alpha1::AdminNetworkPolicyPort { port_number, named_port, port_range } = p;
        if let Some(v1alpha1::Port { protocol, port }) = port_number {
            let port = port_u16(*port);
            Some(PortMatch {
                protocol: Some(protocol_or_tcp(protocol.as_deref())),
                ports: PortSpec::Range(port, port),
            })
        } else if let Some(v1alpha1::PortRange { protocol, start, end }) = port_range {
            Some(PortMatch {
                protocol: Some(protocol_or_tcp(protocol.as_deref())),
                ports: PortSpec::Range(port_u16(*start), port_u16(*end)),
            })
        } else {
            // "NamedPort selects a port on a pod(s) based on name." The protocol is
            // that of the named container port.
            named_port
                .as_ref()
                .map(|n| PortMatch { protocol: None, ports: PortSpec::Named(n.clone()) })
        }
    }));
    Ports(out.into_boxed_slice())
}

/// CNP `protocols` (v1alpha2 `ClusterNetworkPolicyProtocol`): "If unspecified,
/// protocol-specific attributes will not be used to match traffic."
fn cnp_ports(protocols: &Option<Vec<v1alpha2::ClusterNetworkPolicyProtocol>>) -> Ports {
    let Some(protocols) = protocols else { return Ports::any() };
    let spec = |pp: &v1alpha2::ProtocolPort| match &pp.destination_port {
        None => PortSpec::Any,
        Some(v1alpha2::DestinationPort { number: Some(n), .. }) => {
            PortSpec::Range(port_u16(*n), port_u16(*n))
        }
        Some(v1alpha2::DestinationPort { range: Some(r), .. }) => {
            PortSpec::Range(port_u16(r.start), port_u16(r.end))
        }
        Some(v1alpha2::DestinationPort { number: None, range: None }) => PortSpec::Any,
    };
    Ports(
        protocols
            .iter()
            .filter_map(|p| {
                let v1alpha2::ClusterNetworkPolicyProtocol {
                    tcp,
                    udp,
                    sctp,
                    destination_named_port,
                } = p;
                if let Some(pp) = tcp {
                    Some(PortMatch { protocol: Some(Protocol::Tcp), ports: spec(pp) })
                } else if let Some(pp) = udp {
                    Some(PortMatch { protocol: Some(Protocol::Udp), ports: spec(pp) })
                } else if let Some(pp) = sctp {
                    Some(PortMatch { protocol: Some(Protocol::Sctp), ports: spec(pp) })
                } else {
                    destination_named_port
                        .as_ref()
                        .map(|n| PortMatch { protocol: None, ports: PortSpec::Named(n.clone()) })
                }
            })
            .collect(),
    )
}

/// The peer kinds shared by ANP, BANP and CNP, gathered from one peer object.
struct PeerFields<'a> {
    namespaces: Option<&'a LabelSelector>,
    pods: Option<&'a NamespacedPod>,
    nodes: Option<&'a LabelSelector>,
    networks: Option<&'a Vec<String>>,
    domain_names: Option<&'a Vec<String>>,
}

impl<'a> PeerFields<'a> {
    fn anp_ingress(p: &'a v1alpha1::AdminNetworkPolicyIngressPeer) -> Self {
        let v1alpha1::AdminNetworkPolicyIngressPeer { namespaces, pods } = p;
        PeerFields {
            namespaces: namespaces.as_ref(),
            pods: pods.as_ref(),
            nodes: None,
            networks: None,
            domain_names: None,
        }
    }
    fn anp_egress(p: &'a v1alpha1::AdminNetworkPolicyEgressPeer) -> Self {
        let v1alpha1::AdminNetworkPolicyEgressPeer {
            namespaces,
            pods,
            nodes,
            networks,
            domain_names,
        } = p;
        PeerFields {
            namespaces: namespaces.as_ref(),
            pods: pods.as_ref(),
            nodes: nodes.as_ref(),
            networks: networks.as_ref(),
            domain_names: domain_names.as_ref(),
        }
    }
    fn banp_egress(p: &'a v1alpha1::BaselineAdminNetworkPolicyEgressPeer) -> Self {
        let v1alpha1::BaselineAdminNetworkPolicyEgressPeer { namespaces, pods, nodes, networks } =
            p;
        PeerFields {
            namespaces: namespaces.as_ref(),
            pods: pods.as_ref(),
            nodes: nodes.as_ref(),
            networks: networks.as_ref(),
            domain_names: None,
        }
    }
    fn cnp_ingress(p: &'a v1alpha2::ClusterNetworkPolicyIngressPeer) -> Self {
        let v1alpha2::ClusterNetworkPolicyIngressPeer { namespaces, pods } = p;
        PeerFields {
            namespaces: namespaces.as_ref(),
            pods: pods.as_ref(),
            nodes: None,
            networks: None,
            domain_names: None,
        }
    }
    fn cnp_egress(p: &'a v1alpha2::ClusterNetworkPolicyEgressPeer) -> Self {
        let v1alpha2::ClusterNetworkPolicyEgressPeer {
            namespaces,
            pods,
            nodes,
            networks,
            domain_names,
        } = p;
        PeerFields {
            namespaces: namespaces.as_ref(),
            pods: pods.as_ref(),
            nodes: nodes.as_ref(),
            networks: networks.as_ref(),
            domain_names: domain_names.as_ref(),
        }
    }
}

/// Compiles one ANP/BANP/CNP rule, at `index` in its direction, on a worker of
/// [`prepare_admin`]. Its selector peers are left as keys of `dict` in
/// `peers.pod_sets`, unsorted; [`keys_to_set_ids`] turns them into sorted pod set ids once
/// every worker's keys are interned.
///
/// Implements the fail-closed rule for unknown peers (network-policy-api
/// `ClusterNetworkPolicyEgressPeer`): "For Accept rules, 'fail closed' means: 'treat the
/// rule as matching no traffic'. For Deny and Pass rules, 'fail closed' means: 'treat the
/// rule as a Deny all rule'".
fn admin_rule<'a>(
    index: usize,
    name: &'a str,
    action: Action,
    peers: impl Iterator<Item = PeerFields<'a>> + Clone,
    ports: Ports,
    dict: &mut SetDict,
    node_index: &LabelIndex,
) -> Rule {
    // Each list sized exactly (selector peers, CIDRs), so that boxing it for the snapshot
    // is this allocation and not a shrinking second one.
    let (selectors, cidrs) = peers.clone().fold((0, 0), |(s, c), p| {
        // As the loop below reads a peer: selectors first, then nodes, then networks.
        let selects = p.namespaces.is_some() || p.pods.is_some();
        let nets = if selects || p.nodes.is_some() { 0 } else { p.networks.map_or(0, Vec::len) };
        (s + selects as usize, c + nets)
    });
    let mut out = PeersBuilder {
        pod_sets: Vec::with_capacity(selectors),
        blocks: Vec::with_capacity(cidrs),
        ..PeersBuilder::default()
    };
    let mut unknown = false;
    // A selector this engine cannot compile (an unknown operator; the API server does not
    // validate selectors inside custom resources) is treated like a peer of an unknown
    // kind: it fails closed.
    for p in peers {
        let key = match (p.namespaces, p.pods) {
            (Some(ns), _) => Some(dict.key(RawSet::Namespaces(ns.into()))),
            (None, Some(np)) => Some(
                dict.key(RawSet::Pods((&np.namespace_selector).into(), (&np.pod_selector).into())),
            ),
            (None, None) => None,
        };
        if let Some(k) = key {
            if dict.resolves(k) {
                out.pod_sets.push(k);
            } else {
                unknown = true;
            }
        } else if let Some(nodes) = p.nodes {
            match selector(nodes) {
                Some(s) => {
                    let set = node_index.resolve(&s);
                    *out.nodes.get_or_insert_with(RoaringBitmap::new) |= set;
                }
                None => unknown = true,
            }
        } else if let Some(nets) = p.networks {
            out.blocks.extend(nets.iter().filter_map(|n| cidr::parse(n).ok()).map(Block::new));
        } else if p.domain_names.is_some() {
            // Not resolvable by this engine: matches no traffic (warned by validate).
        } else {
            unknown = true;
        }
    }
    let (action, fail_closed) = match (action, unknown) {
        (Action::Deny | Action::Pass, true) => {
            out = PeersBuilder::all();
            (Action::Deny, true)
        }
        (a, _) => (a, false),
    };
    Rule {
        name: (!name.is_empty()).then(|| name.into()),
        index: index as u32,
        action,
        peers: out.build(),
        ports,
        fail_closed,
        applied_to: None,
        enable_logging: false,
        log_label: None,
    }
}

/// An admin-tier or baseline-tier policy object, before compiling.
#[derive(Clone, Copy)]
pub(super) enum AdminObject<'a> {
    Anp(&'a v1alpha1::AdminNetworkPolicy),
    Cnp(&'a v1alpha2::ClusterNetworkPolicy),
    Banp(&'a v1alpha1::BaselineAdminNetworkPolicy),
}

impl<'a> AdminObject<'a> {
    /// The object's `metadata`.
    fn metadata(self) -> &'a k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        match self {
            AdminObject::Anp(o) => &o.metadata,
            AdminObject::Cnp(o) => &o.metadata,
            AdminObject::Banp(o) => &o.metadata,
        }
    }

    /// Position of the kind in compile order (ANP, CNP, BANP), which is also the order
    /// problems are reported in.
    fn order(self) -> usize {
        match self {
            AdminObject::Anp(_) => 0,
            AdminObject::Cnp(_) => 1,
            AdminObject::Banp(_) => 2,
        }
    }

    /// Peers in all rules (plus one): the work of preparing the object.
    fn weight(self) -> usize {
        let [ingress, egress] = rule_counts(self);
        let peers = |d: Direction, rules: usize| -> usize {
            (0..rules).filter_map(|i| PeerSlice::of(self, d, i)).map(PeerSlice::len).sum()
        };
        1 + peers(Direction::Ingress, ingress) + peers(Direction::Egress, egress)
    }
}

/// An admin object that passed validation, ready for [`Cluster::admin_policy`].
struct AdminBody<'a> {
    tier: Tier,
    /// `spec.priority`; `None` for the BANP, which has none ([`BANP_PRIORITY`]).
    priority: Option<i32>,
    namespaces: &'a Option<LabelSelector>,
    pods: &'a Option<NamespacedPod>,
    /// Rules by [`Direction`] index; selector peers are worker keys (see [`admin_rule`])
    /// until [`keys_to_set_ids`] turns them into set ids.
    rules: [Vec<Rule>; 2],
}

/// What a worker made of one admin object.
struct Prepared<'a> {
    /// Validation problems, in the validator's order.
    problems: Vec<Problem>,
    /// `None` when validation found an error: the object is left out.
    body: Option<AdminBody<'a>>,
    /// The worker whose [`SetDict`] the rules' keys index.
    worker: usize,
}

/// Validates admin objects and keys every selector peer of their rules, spread over
/// worker threads: the one pass over a large input's million peers, whose cost is the
/// memory latency of reading them, so it scales with cores. Reads `c`'s node label index,
/// and hashes the keys for its interner. Returns, in input order, what each object became,
/// and each worker's distinct peers.
fn prepare_admin<'a>(
    items: &[(ObjectRef, AdminObject<'a>)],
    c: &Cluster,
    validate: bool,
    workers: usize,
) -> (Vec<Prepared<'a>>, Vec<SetDict>) {
    let weights: Vec<usize> = items.iter().map(|(_, o)| o.weight()).collect();
    let ranges = balanced_ranges(&weights, workers);
    let results = par_ranges(items, &ranges, |worker, chunk| {
        let mut dict = SetDict::new(&c.interner);
        let node_index = &c.node_index;
        let prepared: Vec<Prepared<'a>> =
            chunk
                .iter()
                .map(|&(_, obj)| {
                    let mut problems = Vec::new();
                    let mut rules = rule_counts(obj).map(Vec::with_capacity);
                    // Each rule is compiled right after it is validated, while its peers are
                    // in cache: reading them is the cost of a large input. Its peers are
                    // touched just before (`PeerSlice::touch`). An object found invalid is
                    // dropped whole (its peers' keys go unused).
                    if let Some(first) = PeerSlice::of(obj, Direction::Ingress, 0)
                        .or(PeerSlice::of(obj, Direction::Egress, 0))
                    {
                        first.touch();
                    }
                    let mut build = |d: Direction, i: usize| {
                        rules[d as usize].push(admin_rule_at(obj, d, i, &mut dict, node_index));
                        touch_next_rule(obj, d, i);
                    };
                    if validate {
                        let out = &mut problems;
                        match obj {
                            AdminObject::Anp(p) => validate::admin_network_policy_rules(p, out)
                                .for_each(|(d, i)| build(d, i)),
                            AdminObject::Cnp(p) => validate::cluster_network_policy_rules(p, out)
                                .for_each(|(d, i)| build(d, i)),
                            AdminObject::Banp(p) => {
                                validate::baseline_admin_network_policy_rules(p, out)
                                    .for_each(|(d, i)| build(d, i))
                            }
                        }
                    } else {
                        let [ingress, egress] = rule_counts(obj);
                        (0..ingress).for_each(|i| build(Direction::Ingress, i));
                        (0..egress).for_each(|i| build(Direction::Egress, i));
                    }
                    let body = (!problems.iter().any(Problem::is_error)).then(|| {
                        let (tier, priority, namespaces, pods) = admin_head(obj);
                        AdminBody { tier, priority, namespaces, pods, rules }
                    });
                    // Only keys that valid objects use get a pod set: a key whose
                    // selectors do not compile is in no rule (its peers failed closed), nor
                    // is a key only invalid objects used.
                    if let Some(b) = &body {
                        let rules = b.rules.iter().flatten();
                        dict.mark_used(rules.flat_map(|r| r.peers.pod_sets.iter().copied()));
                    }
                    Prepared { problems, body, worker }
                })
                .collect();
        (prepared, dict)
    });
    gather(results, items.len())
}

/// Tier, priority and subject (`namespaces`, `pods`) of an admin object.
fn admin_head<'a>(
    obj: AdminObject<'a>,
) -> (Tier, Option<i32>, &'a Option<LabelSelector>, &'a Option<NamespacedPod>) {
    match obj {
        AdminObject::Anp(p) => {
            let v1alpha1::AdminNetworkPolicySubject { namespaces, pods } = &p.spec.subject;
            (Tier::Admin, Some(p.spec.priority), namespaces, pods)
        }
        AdminObject::Cnp(p) => {
            let v1alpha2::ClusterNetworkPolicySubject { namespaces, pods } = &p.spec.subject;
            let tier = match p.spec.tier {
                v1alpha2::Tier::Admin => Tier::Admin,
                v1alpha2::Tier::Baseline => Tier::Baseline,
            };
            (tier, Some(p.spec.priority), namespaces, pods)
        }
        AdminObject::Banp(p) => {
            let v1alpha1::AdminNetworkPolicySubject { namespaces, pods } = &p.spec.subject;
            // BANP has no priority; Antrea ranks it at 1 among the Baseline-tier CNPs
            // ([`BANP_PRIORITY`]).
            (Tier::Baseline, None, namespaces, pods)
        }
    }
}

/// Number of ingress and egress rules of an admin object.
fn rule_counts(obj: AdminObject<'_>) -> [usize; 2] {
    match obj {
        AdminObject::Anp(p) => [p.spec.ingress.len(), p.spec.egress.len()],
        AdminObject::Cnp(p) => [p.spec.ingress.len(), p.spec.egress.len()],
        AdminObject::Banp(p) => [p.spec.ingress.len(), p.spec.egress.len()],
    }
}

/// The peers of one admin rule, whatever the object's kind.
#[derive(Clone, Copy)]
enum PeerSlice<'a> {
    AnpIngress(&'a [v1alpha1::AdminNetworkPolicyIngressPeer]),
    AnpEgress(&'a [v1alpha1::AdminNetworkPolicyEgressPeer]),
    BanpEgress(&'a [v1alpha1::BaselineAdminNetworkPolicyEgressPeer]),
    CnpIngress(&'a [v1alpha2::ClusterNetworkPolicyIngressPeer]),
    CnpEgress(&'a [v1alpha2::ClusterNetworkPolicyEgressPeer]),
}

impl<'a> PeerSlice<'a> {
    /// The peers of rule `i` of direction `d` (`None` past the last rule).
    fn of(obj: AdminObject<'a>, d: Direction, i: usize) -> Option<Self> {
        Some(match (obj, d) {
            (AdminObject::Anp(p), Direction::Ingress) => {
                PeerSlice::AnpIngress(&p.spec.ingress.get(i)?.from)
            }
            (AdminObject::Anp(p), Direction::Egress) => {
                PeerSlice::AnpEgress(&p.spec.egress.get(i)?.to)
            }
            (AdminObject::Banp(p), Direction::Ingress) => {
                PeerSlice::AnpIngress(&p.spec.ingress.get(i)?.from)
            }
            (AdminObject::Banp(p), Direction::Egress) => {
                PeerSlice::BanpEgress(&p.spec.egress.get(i)?.to)
            }
            (AdminObject::Cnp(p), Direction::Ingress) => {
                PeerSlice::CnpIngress(&p.spec.ingress.get(i)?.from)
            }
            (AdminObject::Cnp(p), Direction::Egress) => {
                PeerSlice::CnpEgress(&p.spec.egress.get(i)?.to)
            }
        })
    }

    fn len(self) -> usize {
        match self {
            PeerSlice::AnpIngress(s) => s.len(),
            PeerSlice::AnpEgress(s) => s.len(),
            PeerSlice::BanpEgress(s) => s.len(),
            PeerSlice::CnpIngress(s) => s.len(),
            PeerSlice::CnpEgress(s) => s.len(),
        }
    }

    /// Peer `j` (below [`PeerSlice::len`]).
    fn get(self, j: usize) -> PeerFields<'a> {
        match self {
            PeerSlice::AnpIngress(s) => PeerFields::anp_ingress(&s[j]),
            PeerSlice::AnpEgress(s) => PeerFields::anp_egress(&s[j]),
            PeerSlice::BanpEgress(s) => PeerFields::banp_egress(&s[j]),
            PeerSlice::CnpIngress(s) => PeerFields::cnp_ingress(&s[j]),
            PeerSlice::CnpEgress(s) => PeerFields::cnp_egress(&s[j]),
        }
    }

    fn iter(self) -> impl ExactSizeIterator<Item = PeerFields<'a>> + Clone {
        (0..self.len()).map(move |j| self.get(j))
    }

    /// Reads the first label of every selector peer (its `Labels` slice and the first
    /// bytes of its first key and value) and nothing else. Each peer's reads are
    /// independent of the others', so the CPU overlaps their cache misses, where validating
    /// peer after peer waits for each miss in turn: reading a million scattered peers took
    /// 66 ms after this pass against 98 ms without, on one thread.
    fn touch(self) {
        let mut acc = 0u8;
        for p in self.iter() {
            if let Some(ns) = p.namespaces {
                acc ^= touch_selector(ns);
            }
            if let Some(np) = p.pods {
                acc ^= touch_selector(&np.namespace_selector) ^ touch_selector(&np.pod_selector);
            }
        }
        std::hint::black_box(acc);
    }
}

/// Compiles rule `i` of direction `d` of an admin object (`i` below its [`rule_counts`]),
/// with [`admin_rule`].
fn admin_rule_at<'a>(
    obj: AdminObject<'a>,
    d: Direction,
    i: usize,
    dict: &mut SetDict,
    node_index: &LabelIndex,
) -> Rule {
    let (name, action, ports) = match (obj, d) {
        (AdminObject::Anp(p), Direction::Ingress) => {
            let r = &p.spec.ingress[i];
            (&r.name, anp_action(r.action), anp_ports(&r.ports))
        }
        (AdminObject::Anp(p), Direction::Egress) => {
            let r = &p.spec.egress[i];
            (&r.name, anp_action(r.action), anp_ports(&r.ports))
        }
        (AdminObject::Cnp(p), Direction::Ingress) => {
            let r = &p.spec.ingress[i];
            (&r.name, cnp_action(r.action), cnp_ports(&r.protocols))
        }
        (AdminObject::Cnp(p), Direction::Egress) => {
            let r = &p.spec.egress[i];
            (&r.name, cnp_action(r.action), cnp_ports(&r.protocols))
        }
        (AdminObject::Banp(p), Direction::Ingress) => {
            let r = &p.spec.ingress[i];
            (&r.name, banp_action(r.action), anp_ports(&r.ports))
        }
        (AdminObject::Banp(p), Direction::Egress) => {
            let r = &p.spec.egress[i];
            (&r.name, banp_action(r.action), anp_ports(&r.ports))
        }
    };
    match PeerSlice::of(obj, d, i) {
        Some(peers) => admin_rule(i, name, action, peers.iter(), ports, dict, node_index),
        None => admin_rule(i, name, action, std::iter::empty(), ports, dict, node_index),
    }
}

/// Runs [`PeerSlice::touch`] on the rule after rule `i` of direction `d` (ingress rules,
/// then egress rules), if there is one.
fn touch_next_rule(obj: AdminObject<'_>, d: Direction, i: usize) {
    let next = PeerSlice::of(obj, d, i + 1).or(match d {
        Direction::Ingress => PeerSlice::of(obj, Direction::Egress, 0),
        Direction::Egress => None,
    });
    if let Some(peers) = next {
        peers.touch();
    }
}

impl Cluster {
    /// The subject's pod set and its id (`None`: selects nothing).
    fn subject(
        &mut self,
        namespaces: &Option<LabelSelector>,
        pods: &Option<NamespacedPod>,
    ) -> (Arc<RoaringBitmap>, Option<SetId>) {
        let key = match (namespaces, pods) {
            (Some(ns), _) => selector(ns).map(SetKey::Namespaces),
            (None, Some(p)) => namespaced_pod_key(p),
            // Validation rejects an empty subject; it selects nothing.
            (None, None) => None,
        };
        match key {
            Some(k) => {
                let id = self.intern(k);
                (Arc::clone(&self.interner.sets[id as usize]), Some(id))
            }
            None => (Arc::default(), None),
        }
    }
}

fn anp_action(a: v1alpha1::AdminNetworkPolicyRuleAction) -> Action {
    match a {
        v1alpha1::AdminNetworkPolicyRuleAction::Allow => Action::Allow,
        v1alpha1::AdminNetworkPolicyRuleAction::Deny => Action::Deny,
        v1alpha1::AdminNetworkPolicyRuleAction::Pass => Action::Pass,
    }
}

fn banp_action(a: v1alpha1::BaselineAdminNetworkPolicyRuleAction) -> Action {
    match a {
        v1alpha1::BaselineAdminNetworkPolicyRuleAction::Allow => Action::Allow,
        v1alpha1::BaselineAdminNetworkPolicyRuleAction::Deny => Action::Deny,
    }
}

fn cnp_action(a: v1alpha2::ClusterNetworkPolicyRuleAction) -> Action {
    match a {
        v1alpha2::ClusterNetworkPolicyRuleAction::Accept => Action::Allow,
        v1alpha2::ClusterNetworkPolicyRuleAction::Deny => Action::Deny,
        v1alpha2::ClusterNetworkPolicyRuleAction::Pass => Action::Pass,
    }
}

/// Priority of the BaselineAdminNetworkPolicy, which has none, among the
/// ClusterNetworkPolicies `tier: Baseline` (rank 254): 1, as Antrea gives it
/// (`shared/reference/antrea-model.md` §3, "BANP vs CNP Baseline compare (priority 1) vs
/// spec.priority"; Antrea `adminnetworkpolicy.go`). A Baseline CNP of priority 0 goes
/// before it, one above 1 after it; at 1 the name decides and `check` reports the tie.
pub(super) const BANP_PRIORITY: f64 = 1.0;

impl Cluster {
    /// Finishes a validated admin object prepared by [`prepare_admin`], whose rules' peer
    /// keys are already pod set ids: resolves its subject. Its matchers come later
    /// ([`build_matchers`]).
    fn admin_policy(
        &mut self,
        object: ObjectRef,
        body: AdminBody<'_>,
        annotations: Box<[(String, String)]>,
    ) -> Policy {
        let AdminBody { tier, priority, namespaces, pods, rules } = body;
        let (subject, subject_set) = self.subject(namespaces, pods);
        // Antrea's global order (antrea-model.md §3): CNP Admin at 220, before every
        // ANP at 251, whatever their priorities.
        let rank = match (tier, object.kind) {
            (Tier::Admin, Kind::AdminNetworkPolicy) => rank::ANP,
            (Tier::Admin, _) => rank::CNP_ADMIN,
            _ => rank::BASELINE,
        };
        let priority = match priority {
            Some(p) => f64::from(p),
            None => BANP_PRIORITY,
        };
        // "ANPs with no ingress rules do not affect ingress traffic."
        let applies = [!rules[0].is_empty(), !rules[1].is_empty()];
        Policy {
            object: Arc::new(object),
            tier,
            rank,
            priority,
            antrea_tier: None,
            rules: Arc::new(rules),
            matchers: [None, None],
            subject,
            subject_set,
            applies,
            annotations: annotations.into(),
        }
    }
}

fn namespaced_pod_key(np: &NamespacedPod) -> Option<SetKey> {
    let NamespacedPod { namespace_selector, pod_selector } = np;
    Some(SetKey::Pods(selector(namespace_selector)?, selector(pod_selector)?))
}
