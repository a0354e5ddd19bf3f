//! The cluster passes of a compile: namespaces, nodes and pods get dense ids, their label
//! indexes are built, and every address gets its owner.
//!
//! Each pass reads its kind of [`Inputs`], validates it unless told the objects were
//! validated already, reports problems in input order per kind, and fills the compile-time
//! [`Cluster`] that the policy passes ([`super::admin`], [`super::network`]) read.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::hash::BuildHasher;
use std::net::IpAddr;
use std::sync::Arc;

use roaring::RoaringBitmap;

use super::parallel::{balanced_ranges, par_ranges};
use super::{
    Inputs, dedup_keyed, meta_name, meta_namespace, own_annotations, port_u16, protocol_or_tcp,
    valid_sorted,
};
use crate::policy::api::Pod;
use crate::policy::labels::{Labels, LabelsRef};
use crate::policy::matcher::PodAddrs;
use crate::policy::model::{Endpoint, NamespaceEntry, NodeEntry, PodEntry, SetId};
use crate::policy::ports::NamedPort;
use crate::policy::problem::{Kind, ObjectRef, Problem, ProblemKind};
use crate::policy::selector::{LabelIndex, Selector};
use crate::policy::snapshot::AddrMap;
use crate::policy::validate::{self, NAMESPACE_NAME_LABEL};

/// Interns pod sets by the selector(s) that produced them.
#[derive(Default)]
pub(super) struct Interner {
    /// Each key with its set's id, by [`Interner::hash`]. A table keyed by hashes the
    /// caller may bring ([`Cluster::intern_hashed`]): the compile's workers hash the keys
    /// they made while those are in their cache. Hashing them all itself, the calling
    /// thread read their strings from the other core's cache: with the `decide` bench's
    /// Antrea set, its samples in the interning while no worker ran went from 265 to 172
    /// (perf at 4 kHz, six compiles).
    pub(super) ids: hashbrown::HashTable<(SetKey, SetId)>,
    /// foldhash, seeded per interner: a key is the selectors of a policy someone wrote, so
    /// the hash must not be one they can aim collisions at (as FxHash could be), and
    /// SipHash cost about a twentieth of a large compile here.
    hasher: foldhash::fast::RandomState,
    /// The pod sets, by [`SetId`]: the snapshot's pod sets (shared with it).
    pub(super) sets: Vec<Arc<RoaringBitmap>>,
}

impl Interner {
    /// The hash of `key` in this interner's table (seeded per interner: a hash is good
    /// only for the interner that computed it).
    pub(super) fn hash(&self, key: &SetKey) -> u64 {
        self.hasher.hash_one(key)
    }

    /// A hasher equal to this interner's, for threads that hash keys ahead
    /// ([`super::set_dict::SetDict`]).
    pub(super) fn hasher(&self) -> foldhash::fast::RandomState {
        self.hasher.clone()
    }
}

/// What an interned pod set was resolved from.
#[derive(Hash, PartialEq, Eq)]
pub(super) enum SetKey {
    /// Pods in namespaces matching the selector.
    Namespaces(Selector),
    /// Pods matching the pod selector in namespaces matching the namespace selector.
    Pods(Selector, Selector),
    /// Pods matching the selector in one namespace (NetworkPolicy `podSelector`).
    InNamespace(u32, Selector),
    /// The union of interned sets, sorted and distinct (an Antrea `appliedTo` list). The
    /// incremental compiler does not patch it: inputs with Antrea objects compile in full.
    Union(Vec<SetId>),
}

/// Ids by name (namespaces', nodes'), hashed with foldhash as the other maps a compile
/// fills for every pod.
pub(super) type NameIds = HashMap<String, u32, foldhash::fast::RandomState>;

/// Compile-time state: the cluster's objects by dense id and the indexes over them. The
/// passes of this file fill it in order ([`Cluster::namespaces`], [`Cluster::nodes`],
/// [`Cluster::pods`], [`Cluster::label_indexes`]); the policy passes then read it and
/// intern pod sets in it; its parts end up in the [`Snapshot`](crate::policy::Snapshot),
/// shared (`Arc`), and a [`Compiler`](super::Compiler) keeps it to patch them.
#[derive(Default)]
pub(super) struct Cluster {
    /// See [`Cluster::pods_in_namespaces`].
    pub(super) ns_pods: HashMap<Selector, RoaringBitmap, foldhash::fast::RandomState>,
    pub(super) pods: Arc<Vec<PodEntry>>,
    /// Pod IPs by pod id (`status.podIPs`).
    pub(super) pod_ips: Arc<Vec<Vec<IpAddr>>>,
    pub(super) namespaces: Arc<Vec<NamespaceEntry>>,
    pub(super) ns_ids: NameIds,
    pub(super) nodes: Arc<Vec<NodeEntry>>,
    node_ids: NameIds,
    /// Node addresses by node id: InternalIP/ExternalIP, then its hostNetwork pods' IPs.
    pub(super) node_addrs: Arc<Vec<Vec<IpAddr>>>,
    pub(super) pod_index: Arc<LabelIndex>,
    pub(super) ns_index: LabelIndex,
    pub(super) node_index: LabelIndex,
    pub(super) interner: Interner,
    /// Single-address pods sorted by address, for folding address matches into pod classes.
    pub(super) addrs: PodAddrs,
}

impl Cluster {
    fn namespaces_matching(&self, sel: &Selector) -> RoaringBitmap {
        self.ns_index.resolve(sel)
    }

    fn pods_in(&self, namespaces: &RoaringBitmap) -> RoaringBitmap {
        let mut out = RoaringBitmap::new();
        for ns in namespaces {
            out |= &self.namespaces[ns as usize].pods;
        }
        out
    }

    /// The pods of the namespaces `ns` selects, memoised: the few namespace selectors of a
    /// large policy set recur in many `pods` peers.
    fn pods_in_namespaces(&mut self, ns: &Selector) -> &RoaringBitmap {
        if !self.ns_pods.contains_key(ns) {
            let pods = self.pods_in(&self.namespaces_matching(ns));
            self.ns_pods.insert(ns.clone(), pods);
        }
        &self.ns_pods[ns]
    }

    /// The id of the pod set `key` names, resolving and storing the set the first time.
    pub(super) fn intern(&mut self, key: SetKey) -> SetId {
        let hash = self.interner.hash(&key);
        self.intern_hashed(hash, key)
    }

    /// [`Cluster::intern`] of a key whose hash is known: `hash` is
    /// `self.interner.hash(&key)` (checked in debug builds; a wrong one would intern a key
    /// twice).
    pub(super) fn intern_hashed(&mut self, hash: u64, key: SetKey) -> SetId {
        debug_assert_eq!(hash, self.interner.hash(&key), "a hash of another interner");
        if let Some(&(_, id)) = self.interner.ids.find(hash, |(k, _)| *k == key) {
            return id;
        }
        let set = match &key {
            SetKey::Namespaces(ns) => self.pods_in_namespaces(ns).clone(),
            SetKey::Pods(ns, pods) => {
                self.pods_in_namespaces(ns); // memoised in `ns_pods`
                self.pod_index.resolve_in(&self.ns_pods[ns], pods)
            }
            SetKey::InNamespace(ns, pods) => {
                self.pod_index.resolve_in(&self.namespaces[*ns as usize].pods, pods)
            }
            SetKey::Union(ids) => {
                let mut out = RoaringBitmap::new();
                for &id in ids {
                    out |= &*self.interner.sets[id as usize];
                }
                out
            }
        };
        let Interner { ids, hasher, sets } = &mut self.interner;
        let id = sets.len() as SetId;
        sets.push(Arc::new(set));
        ids.insert_unique(hash, (key, id), |(k, _)| hasher.hash_one(k));
        id
    }
}

impl Cluster {
    /// Namespaces pass: reads `inputs.namespaces`; gives each valid one an id and its
    /// labels with `kubernetes.io/metadata.name` set. Namespaces that pods name but that
    /// are missing are added by [`Cluster::pods`].
    pub(super) fn namespaces(
        &mut self,
        inputs: &Inputs,
        validate: bool,
        problems: &mut Vec<Problem>,
    ) {
        let namespaces = valid_sorted(
            &inputs.namespaces,
            |n| ObjectRef::cluster(Kind::Namespace, meta_name(&n.metadata)),
            validate::namespace,
            validate,
            problems,
        );
        for (r, ns) in namespaces {
            let mut labels = ns.metadata.labels.clone().unwrap_or_default();
            // SetDefaults_Namespace: the API server sets `kubernetes.io/metadata.name` to the
            // name, overwriting any other value (KEP-2161), so selectors on it always work.
            labels.insert(NAMESPACE_NAME_LABEL.to_string(), r.name.clone());
            self.ns_ids.insert(r.name.clone(), self.namespaces.len() as u32);
            Arc::make_mut(&mut self.namespaces).push(NamespaceEntry {
                name: r.name,
                labels,
                pods: RoaringBitmap::new(),
            });
        }
    }

    /// Nodes pass: reads `inputs.nodes`; gives each valid one an id, its labels, its
    /// [`ANNOTATION_PREFIX`](crate::policy::model::ANNOTATION_PREFIX) annotations and its
    /// addresses (`status.addresses` InternalIP / ExternalIP). Nodes that pods name but
    /// that are missing are added by [`Cluster::pods`].
    pub(super) fn nodes(&mut self, inputs: &Inputs, validate: bool, problems: &mut Vec<Problem>) {
        let nodes = valid_sorted(
            &inputs.nodes,
            |n| ObjectRef::cluster(Kind::Node, meta_name(&n.metadata)),
            validate::node,
            validate,
            problems,
        );
        for (r, node) in nodes {
            // Node IPs: status.addresses of type InternalIP / ExternalIP.
            let addrs = node
                .status
                .as_ref()
                .and_then(|s| s.addresses.as_ref())
                .map(|a| {
                    parse_ips(
                        a.iter()
                            .filter(|a| a.type_ == "InternalIP" || a.type_ == "ExternalIP")
                            .map(|a| a.address.clone()),
                    )
                })
                .unwrap_or_default();
            let id = self.nodes.len() as u32;
            self.node_ids.insert(r.name.clone(), id);
            Arc::make_mut(&mut self.nodes).push(NodeEntry {
                name: r.name,
                labels: node.metadata.labels.clone().unwrap_or_default(),
                annotations: own_annotations(&node.metadata),
            });
            Arc::make_mut(&mut self.node_addrs).push(addrs);
        }
    }

    /// Pods pass: reads `inputs.pods` (validated on worker threads) and `inputs.pod_views`
    /// (a view wins over a Pod of the same name); gives each pod-network pod that is
    /// valid and not terminated an id, its namespace (created with only its name label if
    /// missing), its node (created bare if missing) and its IPs. A hostNetwork pod is its
    /// node for policy: its IPs join the node's addresses. Returns the pods' labels by pod
    /// id, for [`Cluster::label_indexes`].
    pub(super) fn pods<'a>(
        &mut self,
        inputs: &'a Inputs,
        validate: bool,
        workers: usize,
        problems: &mut Vec<Problem>,
    ) -> Vec<LabelsRef<'a>> {
        // Each Pod's key, validation, view and declared namespace and node ids on worker
        // threads, in input order: the first read of a large input's Pods is scattered over
        // its heap and waits on the memory for each (10,000 Pods: 17–34 ms on one thread on
        // a 2-core VM), so every read of a Pod happens there. Then duplicates are dropped,
        // the last kept, and the views a source gave are added (they win over a Pod of the
        // same name), in key order.
        let all: Vec<&'a Pod> = inputs.pods.iter().map(|p| &**p).collect();
        let ranges = balanced_ranges(&vec![1; all.len()], workers);
        let (ns_ids, node_ids) = (&self.ns_ids, &self.node_ids);
        let prepared = par_ranges(&all, &ranges, |_, chunk| {
            chunk
                .iter()
                .map(|&pod| {
                    let m = &pod.metadata;
                    let r = ObjectRef::namespaced(Kind::Pod, meta_namespace(m), meta_name(m));
                    let (found, mut item) = prepare_pod(pod, validate);
                    item.known_ids(r.namespace.as_deref().unwrap_or_default(), ns_ids, node_ids);
                    (r, (found, item))
                })
                .collect::<Vec<_>>()
        });
        let pods = dedup_keyed(prepared.into_iter().flatten().collect(), problems);
        let mut pod_labels: Vec<LabelsRef<'_>> = Vec::new();
        // hostNetwork pods' IPs are their node's: gathered to add to node addresses.
        let mut host_ips: Vec<(u32, Vec<IpAddr>)> = Vec::new();
        let mut items = Vec::with_capacity(pods.len() + inputs.pod_views.len());
        for (r, (found, item)) in pods {
            problems.extend(found);
            items.push((r, item));
        }
        if !inputs.pod_views.is_empty() {
            let mut by_ref: BTreeMap<ObjectRef, PodItem<'_>> = items.into_iter().collect();
            for v in &inputs.pod_views {
                let r = v.object_ref();
                let item = PodItem {
                    labels: LabelsRef::Compact(&v.labels),
                    fields: pod_fields(v),
                    namespace: None,
                };
                if by_ref.insert(r.clone(), item).is_some() {
                    problems.push(Problem::warning(&r, "", ProblemKind::Duplicate));
                }
            }
            items = by_ref.into_iter().collect();
        }
        for (r, item) in items {
            let Some(PodFields { node, node_id, ips, host_network, ports }) = item.fields else {
                continue;
            };
            let node =
                node.map(|n| match node_id.or_else(|| self.node_ids.get(n.as_str()).copied()) {
                    Some(id) => id,
                    None => {
                        // A node known only from pods: no labels, no addresses but its
                        // hostNetwork pods'.
                        let id = self.nodes.len() as u32;
                        Arc::make_mut(&mut self.nodes).push(NodeEntry {
                            name: n.clone(),
                            labels: BTreeMap::new(),
                            annotations: Box::default(),
                        });
                        Arc::make_mut(&mut self.node_addrs).push(Vec::new());
                        self.node_ids.insert(n.clone(), id);
                        id
                    }
                });
            if host_network {
                // "Note that host-networked pods are not included in subject selection" /
                // "in this type of peer": such a pod is its node, for policy.
                if let Some(n) = node {
                    host_ips.push((n, ips));
                }
                continue;
            }
            let namespace = r.namespace.as_deref().unwrap_or_default();
            let ns = match item.namespace.or_else(|| self.ns_ids.get(namespace).copied()) {
                Some(id) => id,
                None => {
                    let name = r.namespace.clone().unwrap_or_default();
                    let labels = BTreeMap::from([(NAMESPACE_NAME_LABEL.to_string(), name.clone())]);
                    let id = self.namespaces.len() as u32;
                    self.ns_ids.insert(name.clone(), id);
                    Arc::make_mut(&mut self.namespaces).push(NamespaceEntry {
                        name,
                        labels,
                        pods: RoaringBitmap::new(),
                    });
                    id
                }
            };
            let id = self.pods.len() as u32;
            Arc::make_mut(&mut self.namespaces)[ns as usize].pods.insert(id);
            Arc::make_mut(&mut self.pods).push(PodEntry {
                namespace: ns,
                name: r.name,
                node,
                ports,
            });
            Arc::make_mut(&mut self.pod_ips).push(ips);
            pod_labels.push(item.labels);
        }
        self.addrs = PodAddrs::new(&self.pod_ips);
        for (n, ips) in host_ips {
            let addrs = &mut Arc::make_mut(&mut self.node_addrs)[n as usize];
            for ip in ips {
                if !addrs.contains(&ip) {
                    addrs.push(ip);
                }
            }
        }
        pod_labels
    }

    /// Label indexes pass: reads `pod_labels` (by pod id, from [`Cluster::pods`]) and the
    /// namespaces' and nodes' labels, once every pass that adds to them has run; builds
    /// the pod, namespace and node [`LabelIndex`]es that selectors resolve against.
    ///
    /// The pods' index is built in ranges of pod ids on `workers` threads and merged: its
    /// first read of each Pod's labels waits on the memory as the pods pass's did (10,000
    /// Pods: 12–15 ms on one thread on a 2-core VM).
    pub(super) fn label_indexes(&mut self, pod_labels: &[LabelsRef<'_>], workers: usize) {
        let ranges = balanced_ranges(&vec![1; pod_labels.len()], workers);
        let parts = par_ranges(pod_labels, &ranges, |w, chunk| {
            let mut part = LabelIndex::default();
            for (i, labels) in chunk.iter().enumerate() {
                part.insert((ranges[w].start + i) as u32, labels);
            }
            part
        });
        let pod_index = Arc::make_mut(&mut self.pod_index);
        for part in parts {
            pod_index.merge(part);
        }
        for (i, ns) in self.namespaces.iter().enumerate() {
            self.ns_index.insert(i as u32, &ns.labels);
        }
        for (i, n) in self.nodes.iter().enumerate() {
            self.node_index.insert(i as u32, &n.labels);
        }
    }

    /// Addresses pass: reads the node addresses and pod IPs; returns what each address is.
    /// Nodes first, then pods; the first claimant keeps an address, and each later one is
    /// warned about ([`ProblemKind::AddressConflict`]). The map it returns is its own record
    /// of first claimants: an object's [`ObjectRef`] is made only for a conflict (one per
    /// pod, its namespace and name copied, was most of this pass).
    pub(super) fn addresses(&self, problems: &mut Vec<Problem>) -> AddrMap {
        let mut by_ip = AddrMap::default();
        let claims = self
            .node_addrs
            .iter()
            .enumerate()
            .flat_map(|(i, a)| a.iter().map(move |ip| (*ip, Endpoint::Node(i as u32))))
            .chain(
                self.pod_ips
                    .iter()
                    .enumerate()
                    .flat_map(|(i, a)| a.iter().map(move |ip| (*ip, Endpoint::Pod(i as u32)))),
            );
        for (ip, ep) in claims {
            match by_ip.entry(ip) {
                // Ids name one object each (pods and nodes are deduplicated by name first),
                // so the same endpoint is the same object listing an address twice.
                Entry::Occupied(first) if *first.get() != ep => {
                    let (who, other) = (self.object_ref(ep), self.object_ref(*first.get()));
                    if let (Some(who), Some(other)) = (who, other) {
                        let conflict = ProblemKind::AddressConflict { addr: ip, other };
                        problems.push(Problem::warning(&who, "status", conflict));
                    }
                }
                Entry::Occupied(_) => {}
                Entry::Vacant(slot) => {
                    slot.insert(ep);
                }
            }
        }
        by_ip
    }

    /// The object behind a node or pod endpoint; `None` for [`Endpoint::External`], which
    /// is no object.
    fn object_ref(&self, ep: Endpoint) -> Option<ObjectRef> {
        Some(match ep {
            Endpoint::Node(n) => {
                ObjectRef::cluster(Kind::Node, self.nodes[n as usize].name.clone())
            }
            Endpoint::Pod(p) => {
                let pod = &self.pods[p as usize];
                ObjectRef::namespaced(
                    Kind::Pod,
                    self.namespaces[pod.namespace as usize].name.clone(),
                    pod.name.clone(),
                )
            }
            Endpoint::External => return None,
        })
    }
}

fn parse_ips(values: impl IntoIterator<Item = String>) -> Vec<IpAddr> {
    let mut out: Vec<IpAddr> = Vec::new();
    for v in values {
        if let Ok(ip) = v.parse::<IpAddr>()
            && !out.contains(&ip)
        {
            out.push(ip);
        }
    }
    out
}

/// A Pod as the engine reads it: what a store of many pods keeps instead of the whole
/// object. Its struct is about 150 bytes, against 4.8 kB for a k8s-openapi `Pod` with
/// one `Container` before any string; stored with its labels and key, about 1.2 kB of RSS
/// per pod of the synthetic clusters against 5.4 kB.
///
/// Source: the fields the engine reads of `v1` Pod: `metadata.{namespace,name,labels}`,
/// `spec.nodeName`, `spec.hostNetwork`, the named ports of `spec.containers[*].ports`,
/// `status.phase`, `status.podIP` and `status.podIPs`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PodView {
    /// `metadata.namespace` (`default` when empty).
    pub namespace: String,
    /// `metadata.name`.
    pub name: String,
    /// `metadata.labels`.
    pub labels: Labels,
    /// `spec.nodeName`.
    pub node_name: Option<String>,
    /// `spec.hostNetwork`.
    pub host_network: bool,
    /// `status.phase` is Succeeded or Failed: the pod holds no IP and takes no traffic.
    /// A source that validates pods itself (the manifest source's compact form) sets it
    /// for an invalid pod too, which the compiler would leave out the same way.
    pub terminated: bool,
    /// `status.podIP` and `status.podIPs`, parsed, without duplicates, podIP first; where
    /// podIPs\[0\] disagrees with podIP, podIPs is dropped (as the v1 conversion does).
    pub ips: Vec<IpAddr>,
    /// The named ports of `spec.containers` (named ports resolve on them).
    pub named_ports: Vec<NamedPort>,
}

impl PodView {
    /// The view of `pod`. Unparseable IPs are left out (validation reports them).
    pub fn from_pod(pod: &Pod) -> PodView {
        let spec = pod.spec.as_ref();
        PodView {
            namespace: meta_namespace(&pod.metadata),
            name: meta_name(&pod.metadata),
            labels: pod.metadata.labels.as_ref().map(Labels::from).unwrap_or_default(),
            node_name: spec.and_then(|s| s.node_name.clone()),
            host_network: spec.and_then(|s| s.host_network).unwrap_or(false),
            terminated: terminated(pod),
            ips: pod_ips(pod),
            named_ports: named_ports(pod),
        }
    }

    pub(super) fn object_ref(&self) -> ObjectRef {
        ObjectRef::namespaced(Kind::Pod, self.namespace.clone(), self.name.clone())
    }
}

struct PodFields<'a> {
    /// `spec.nodeName`.
    node: Option<&'a String>,
    /// The id of `node` when it was known as the pod was read ([`PodItem::known_ids`]).
    node_id: Option<u32>,
    /// `status.podIP` / `status.podIPs`, parsed.
    ips: Vec<IpAddr>,
    host_network: bool,
    /// Named container ports.
    ports: Vec<NamedPort>,
}

/// `status.phase` is Succeeded or Failed: the pod holds no IP and takes no traffic.
fn terminated(pod: &Pod) -> bool {
    matches!(pod.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Succeeded" | "Failed"))
}

/// `status.podIP` and `status.podIPs`, parsed, podIP first. "podIPs ... If this field is
/// specified, the 0th entry must match the podIP field"; where they disagree, the v1
/// conversion keeps podIP and drops podIPs.
fn pod_ips(pod: &Pod) -> Vec<IpAddr> {
    let Some(st) = pod.status.as_ref() else { return Vec::new() };
    let listed: Vec<String> = st.pod_ips.iter().flatten().map(|p| p.ip.clone()).collect();
    match &st.pod_ip {
        Some(ip) if listed.first().is_some_and(|first| first != ip) => parse_ips([ip.clone()]),
        Some(ip) => parse_ips(std::iter::once(ip.clone()).chain(listed)),
        None => parse_ips(listed),
    }
}

/// The named ports of `spec.containers`.
fn named_ports(pod: &Pod) -> Vec<NamedPort> {
    pod.spec
        .iter()
        .flat_map(|s| s.containers.iter())
        .flat_map(|ctr| ctr.ports.iter().flatten())
        .filter_map(|p| {
            Some(NamedPort {
                name: p.name.clone().filter(|n| !n.is_empty())?,
                protocol: protocol_or_tcp(p.protocol.as_deref()),
                port: port_u16(p.container_port),
            })
        })
        .collect()
}

/// Labels of a pod without any.
pub(super) static NO_LABELS: BTreeMap<String, String> = BTreeMap::new();

/// One pod as the compile loop reads it, borrowed from a whole Pod or from a view.
struct PodItem<'a> {
    labels: LabelsRef<'a>,
    /// `None`: terminated or invalid (no IP, no traffic).
    fields: Option<PodFields<'a>>,
    /// The id of the pod's namespace when it was known as the pod was read.
    namespace: Option<u32>,
}

impl PodItem<'_> {
    /// Looks up the ids of the pod's namespace and node among those the namespaces and
    /// nodes passes gave, on the worker that read the pod (the strings are in its cache
    /// there, cold on the calling thread). Those the pods pass adds are looked up there.
    fn known_ids(&mut self, namespace: &str, ns_ids: &NameIds, node_ids: &NameIds) {
        self.namespace = ns_ids.get(namespace).copied();
        if let Some(f) = self.fields.as_mut() {
            f.node_id = f.node.and_then(|n| node_ids.get(n.as_str()).copied());
        }
    }
}

/// Validates a whole `pod` (with `validate`) and reads its fields without copying its
/// labels or names.
fn prepare_pod(pod: &Pod, validate: bool) -> (Vec<Problem>, PodItem<'_>) {
    let mut problems = Vec::new();
    if validate {
        validate::pod(pod, &mut problems);
    }
    let usable = !terminated(pod) && !problems.iter().any(Problem::is_error);
    let spec = pod.spec.as_ref();
    let fields = usable.then(|| PodFields {
        node: spec.and_then(|s| s.node_name.as_ref()),
        node_id: None,
        ips: pod_ips(pod),
        host_network: spec.and_then(|s| s.host_network).unwrap_or(false),
        ports: named_ports(pod),
    });
    let labels = LabelsRef::Map(pod.metadata.labels.as_ref().unwrap_or(&NO_LABELS));
    (problems, PodItem { labels, fields, namespace: None })
}

/// The per-pod fields the snapshot keeps; `None` for a terminated pod.
fn pod_fields(view: &PodView) -> Option<PodFields<'_>> {
    (!view.terminated).then(|| PodFields {
        node: view.node_name.as_ref(),
        node_id: None,
        ips: view.ips.clone(),
        host_network: view.host_network,
        ports: view.named_ports.clone(),
    })
}
