//! The API-server source: kube-rs watchers with reflector stores for the ten kinds the
//! engine reads (issue #6, "Cluster source"; issue #22 for Antrea's).
//!
//! - **What is watched.** Pods, Namespaces and Nodes (`v1`), NetworkPolicies
//!   (`networking.k8s.io/v1`), AdminNetworkPolicies and BaselineAdminNetworkPolicies
//!   (`policy.networking.k8s.io/v1alpha1`), ClusterNetworkPolicies
//!   (`policy.networking.k8s.io/v1alpha2`), and Antrea's Tiers, ClusterNetworkPolicies and
//!   NetworkPolicies (`crd.antrea.io/v1beta1`), cluster-wide: a pod anywhere may be a peer.
//!   The source only stores them: whether an Antrea policy is valid depends on the Tiers
//!   (a policy naming a Tier that does not exist is invalid), so the builder validates them
//!   together ([`super::builder`]); tierproxy writes nothing on Antrea's objects (their
//!   status is Antrea's controller's), it posts Events about the invalid ones
//!   ([`super::status`]).
//! - **Lists come from the API server's watch cache.** Every list (the first, and each
//!   relist) asks for `resourceVersion=0` with `resourceVersionMatch=NotOlderThan`
//!   (kube-runtime's `ListSemantic::Any`; client-go's informers list from the cache too),
//!   not for a quorum read from etcd: a thousand nodes relisting ten kinds after an
//!   API-server restart cost the API server copies from memory, not etcd reads. The
//!   price: such a list may be a little older than the newest write (the watch that
//!   follows catches up), and it comes whole, in one response: the watch cache ignores
//!   `limit` (kubernetes/kubernetes#96182, #118394), and kube leaves `resourceVersion=0`
//!   out of a list that has a `limit` (kube-rs/kube#1743), so these lists have none. The
//!   agent then receives and decodes a whole collection at once: for a few seconds after
//!   a (re)list, the pods' response and its decoded pods (before they are cut to views)
//!   are the agent's largest allocation, where pages of 500 held a page at a time. Pods
//!   are therefore decoded as [`SlimPod`]s (the fields a view is made of; serde skips the
//!   rest of the JSON), not as whole k8s-openapi `Pod`s. Where
//!   that is too much (a very large cluster, a small memory limit),
//!   [`SourceConfig::page_size`] (`--kube-list-page-size`) switches back to paged quorum
//!   reads from etcd. After each relist the source gives the freed heap back to the
//!   kernel (`malloc_trim`), as the agent does after a build: a relist that changes
//!   nothing builds nothing, and its transient memory would otherwise stay resident.
//! - **CRDs that are not installed.** The six policy kinds (three upstream, three of
//!   Antrea's) are custom resources. A list that the API server answers with 404 means the
//!   CRD (or that API version) is not installed: the kind counts as listed and empty
//!   ([`KindHealth::absent`]), and the watcher keeps retrying with backoff, so a CRD
//!   installed later is picked up at the next retry (at most [`SourceConfig::backoff_max`]
//!   later). No API version is required: a cluster without Antrea answers 404 for its three
//!   kinds, and one whose Antrea serves only an older version of them (before
//!   `crd.antrea.io/v1beta1`) does too.
//! - **Memory.** Each object is cut to the fields the engine reads before it is stored. A
//!   Pod is stored as a [`PodView`] (name, namespace, labels, node, hostNetwork, named
//!   container ports, phase and IPs: about 1.2 kB of RSS per pod stored, labels and key
//!   included, where a projected k8s-openapi `Pod` is 5.4 kB); the other kinds keep their
//!   type without `managedFields`, owner references, finalizers and annotations other than
//!   tierproxy's ([`project_meta`] and friends). Labels of views and the policy CRDs'
//!   `matchLabels` are [`crate::policy::labels::Labels`], not maps.
//! - **Initial lists.** [`ApiSource::initialized`] is true once every watcher has finished
//!   its first list (kube-runtime's `InitDone`, or 404 for a CRD); the agent builds its
//!   first snapshot only then.
//! - **Changes.** Every applied or deleted object the engine can see bumps
//!   [`ApiSource::generation`] and, after [`SourceConfig::debounce`] of quiet (at most
//!   [`SourceConfig::max_delay`] after the first change of a burst), calls the trigger the
//!   agent gave: one rebuild covers a burst such as a Deployment rollout. A relist bumps it
//!   once if its content differs from the store's (compared as for a single object:
//!   `resourceVersion`, and a policy's `status` and `generation`, do not count), and not at
//!   all if it does not: then the store keeps its objects (and the snapshot in force
//!   shares them), and ten relists after an API-server restart rebuild nothing. (A
//!   relist in which policies differ in their status only replaces the store, which the
//!   status writer reads, without a bump.)
//! - **Errors.** A watch error (API server unreachable, 4xx/5xx) leaves the stores as
//!   they were, so the snapshot in force stays the last good one; the watcher retries
//!   and relists. [`ApiSource::stale_for`] and [`ApiSource::staleness`] say for how long
//!   which watcher has been failing (a metric, `/readyz`'s text and a log line in the
//!   agent). 410 Gone (the watch's resourceVersion was compacted away) is a routine
//!   relist, not a failure.
//! - **Retries.** Each retry waits a random time up to the current backoff step (800 ms
//!   doubling to [`SourceConfig::backoff_max`], "full jitter"), so N agents whose watches
//!   broke at the same moment relist spread over the step, not in step; a relist after
//!   410 Gone waits a random time up to [`SourceConfig::backoff_initial`] for the same
//!   reason. While a watcher fails because the API server does not answer (a connection
//!   error, 502, 503 or 504), one prober per agent asks `GET /readyz` every
//!   [`SourceConfig::probe_interval`] (randomly 0.5 to 1.5 times it, so the agents'
//!   probes drift apart); the first answer (ready, or 401/403/404: the server serves but
//!   will not say) resets the waiting watchers' backoff and they relist at once. So an
//!   agent notices an API server that is back within 1.5 probe intervals plus a round
//!   trip (1.5 s by default), whatever the outage's length, and N agents' relists (ten
//!   each) arrive spread over about one probe interval, served from the watch cache; what
//!   API Priority and Fairness turns away (429) is retried with the exponential backoff,
//!   not the prober. Other errors (403, 500, 429) wait for the backoff alone.
//!
//! Sources: issue #6; kube-runtime `watcher` and `reflector` (kube 5); the Kubernetes API
//! concepts "Efficient detection of changes" (list, then watch from the list's
//! resourceVersion; 410 Gone means relist) and "Resource versions" (`resourceVersion=0`
//! lists: "Any" semantics, served from the watch cache); client-go's reflector (lists at
//! resourceVersion 0, jittered backoff).
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use kube::api::Api;
use kube::runtime::reflector::{self, Store};
use kube::runtime::utils::Backoff;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource};
use serde::de::DeserializeOwned;

use crate::policy::api::{Namespace, NetworkPolicy, Node, Pod, antrea, v1alpha1, v1alpha2};
use crate::policy::compile::ANNOTATION_PREFIX;
use crate::policy::{Inputs, PodView};

/// Default quiet time before a change is reported: 100 ms, as for the manifest source.
pub const DEFAULT_DEBOUNCE: Duration = Duration::from_millis(100);
/// Default longest wait from a burst's first change to its report: 1 s, so a steady churn
/// (a large rollout) cannot hold back new snapshots forever.
pub const DEFAULT_MAX_DELAY: Duration = Duration::from_secs(1);
/// Default first retry delay after a watch error (kube-runtime's default is 800 ms).
pub const DEFAULT_BACKOFF_INITIAL: Duration = Duration::from_millis(800);
/// Default longest retry delay after repeated watch errors (kube-runtime's default, 30 s).
/// Also the longest time before a CRD installed later is noticed. An API server that was
/// unreachable is noticed sooner, by the prober ([`DEFAULT_PROBE_INTERVAL`]).
pub const DEFAULT_BACKOFF_MAX: Duration = Duration::from_secs(30);
/// Default time between two `GET /readyz` of an unreachable API server: 1 s, so an agent
/// notices the server back within 1.5 s (each wait is 0.5 to 1.5 times this) while sending
/// it one small request a second during an outage, and N agents' relists after it spread
/// over about a second.
pub const DEFAULT_PROBE_INTERVAL: Duration = Duration::from_secs(1);

/// A client of the API server: `config` if given, else the in-cluster service account
/// (`KUBERNETES_SERVICE_HOST` and the mounted token), else `KUBECONFIG` or
/// `~/.kube/config` (kube's `Config::infer`), with kube's built-in retry of 429/503/504
/// off (the watchers back off themselves, and an outage must show as staleness). Every
/// request carries `User-Agent: tierproxy/VERSION (NODE)` ([`user_agent`]), so the API
/// server's audit log and API Priority and Fairness can tell the agents and their nodes
/// apart. TLS uses rustls with the `ring` provider, installed here as the process default
/// if none is.
///
/// # Errors
/// No usable configuration (not in a cluster and no kubeconfig), or a configuration the
/// client cannot use (bad certificates, an unsupported auth plugin).
pub async fn client(config: Option<kube::Config>, node: &str) -> Result<Client, kube::Error> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut config = match config {
        Some(c) => c,
        None => kube::Config::infer().await.map_err(kube::Error::InferConfig)?,
    };
    // kube's own retry of 429/503/504 (15 tries, minutes in all) would hide an outage from
    // the watchers: they retry with their own backoff and report staleness instead.
    config.default_retry = false;
    // kube sends no User-Agent of its own; `headers` are added to every request.
    config.headers.retain(|(name, _)| *name != http::header::USER_AGENT);
    config.headers.push((http::header::USER_AGENT, user_agent(node)));
    Client::try_from(config)
}

/// `tierproxy/VERSION (NODE)`, the agents' User-Agent (RFC 9110 §10.1.5: product/version,
/// then a comment). A node name is a DNS subdomain (RFC 1123) and fits a header as it is;
/// characters that do not (from a `--node` that is no node name) become `_`.
pub fn user_agent(node: &str) -> http::HeaderValue {
    let node: String = node
        .chars()
        .map(|c| if c.is_ascii_graphic() && c != '(' && c != ')' { c } else { '_' })
        .collect();
    let text = format!("tierproxy/{} ({node})", env!("CARGO_PKG_VERSION"));
    // Only visible ASCII is left: always a valid header value.
    http::HeaderValue::from_str(&text)
        .unwrap_or_else(|_| http::HeaderValue::from_static("tierproxy"))
}

/// One of the watched kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WatchedKind {
    /// `v1` Pod.
    Pod,
    /// `v1` Namespace.
    Namespace,
    /// `v1` Node.
    Node,
    /// `networking.k8s.io/v1` NetworkPolicy.
    NetworkPolicy,
    /// `policy.networking.k8s.io/v1alpha1` AdminNetworkPolicy (a CRD).
    AdminNetworkPolicy,
    /// `policy.networking.k8s.io/v1alpha1` BaselineAdminNetworkPolicy (a CRD).
    BaselineAdminNetworkPolicy,
    /// `policy.networking.k8s.io/v1alpha2` ClusterNetworkPolicy (a CRD).
    ClusterNetworkPolicy,
    /// `crd.antrea.io/v1beta1` Tier (Antrea's CRD).
    AntreaTier,
    /// `crd.antrea.io/v1beta1` ClusterNetworkPolicy (Antrea's CRD, ACNP).
    AntreaClusterNetworkPolicy,
    /// `crd.antrea.io/v1beta1` NetworkPolicy (Antrea's CRD, ANNP; namespaced).
    AntreaNetworkPolicy,
}

impl WatchedKind {
    /// Every kind, in the order they are reported.
    pub const ALL: [WatchedKind; KINDS] = [
        WatchedKind::Pod,
        WatchedKind::Namespace,
        WatchedKind::Node,
        WatchedKind::NetworkPolicy,
        WatchedKind::AdminNetworkPolicy,
        WatchedKind::BaselineAdminNetworkPolicy,
        WatchedKind::ClusterNetworkPolicy,
        WatchedKind::AntreaTier,
        WatchedKind::AntreaClusterNetworkPolicy,
        WatchedKind::AntreaNetworkPolicy,
    ];

    /// The resource's plural name, as in its API path and RBAC rules (two kinds share
    /// `clusternetworkpolicies` and two `networkpolicies`; [`WatchedKind::group`] tells
    /// them apart).
    pub fn plural(self) -> &'static str {
        match self {
            WatchedKind::Pod => "pods",
            WatchedKind::Namespace => "namespaces",
            WatchedKind::Node => "nodes",
            WatchedKind::NetworkPolicy | WatchedKind::AntreaNetworkPolicy => "networkpolicies",
            WatchedKind::AdminNetworkPolicy => "adminnetworkpolicies",
            WatchedKind::BaselineAdminNetworkPolicy => "baselineadminnetworkpolicies",
            WatchedKind::ClusterNetworkPolicy | WatchedKind::AntreaClusterNetworkPolicy => {
                "clusternetworkpolicies"
            }
            WatchedKind::AntreaTier => "tiers",
        }
    }

    /// The resource's API group, as in its RBAC rules (`""`: core `v1`).
    pub fn group(self) -> &'static str {
        match self {
            WatchedKind::Pod | WatchedKind::Namespace | WatchedKind::Node => "",
            WatchedKind::NetworkPolicy => "networking.k8s.io",
            WatchedKind::AdminNetworkPolicy
            | WatchedKind::BaselineAdminNetworkPolicy
            | WatchedKind::ClusterNetworkPolicy => "policy.networking.k8s.io",
            WatchedKind::AntreaTier
            | WatchedKind::AntreaClusterNetworkPolicy
            | WatchedKind::AntreaNetworkPolicy => antrea::GROUP,
        }
    }

    /// The name logs, `/readyz` and the `resource` label of metrics give the kind: its
    /// plural, qualified by its group for Antrea's kinds (`clusternetworkpolicies.crd.antrea.io`,
    /// kubectl's `resource.group`), whose plurals repeat upstream ones. The upstream kinds
    /// keep their bare plural, as before Antrea's were watched.
    pub fn resource(self) -> &'static str {
        match self {
            WatchedKind::AntreaTier => "tiers.crd.antrea.io",
            WatchedKind::AntreaClusterNetworkPolicy => "clusternetworkpolicies.crd.antrea.io",
            WatchedKind::AntreaNetworkPolicy => "networkpolicies.crd.antrea.io",
            other => other.plural(),
        }
    }

    /// Whether the kind is a custom resource that may not be installed.
    pub fn optional(self) -> bool {
        matches!(
            self,
            WatchedKind::AdminNetworkPolicy
                | WatchedKind::BaselineAdminNetworkPolicy
                | WatchedKind::ClusterNetworkPolicy
                | WatchedKind::AntreaTier
                | WatchedKind::AntreaClusterNetworkPolicy
                | WatchedKind::AntreaNetworkPolicy
        )
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// How many kinds are watched ([`WatchedKind::ALL`]).
pub const KINDS: usize = 10;

impl fmt::Display for WatchedKind {
    /// [`WatchedKind::resource`].
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.resource())
    }
}

/// Tunables of the source; [`Default`] gives the documented defaults.
#[derive(Debug, Clone)]
pub struct SourceConfig {
    /// Quiet time before a change is reported ([`DEFAULT_DEBOUNCE`]).
    pub debounce: Duration,
    /// Longest wait from a burst's first change to its report ([`DEFAULT_MAX_DELAY`]).
    pub max_delay: Duration,
    /// First retry delay after a watch error ([`DEFAULT_BACKOFF_INITIAL`]).
    pub backoff_initial: Duration,
    /// Longest retry delay ([`DEFAULT_BACKOFF_MAX`]).
    pub backoff_max: Duration,
    /// `None` (the default): lists ask for the API server's watch cache
    /// (`resourceVersion=0`), whole. `Some(n)`: lists are quorum reads from etcd in pages
    /// of `n` objects (the API server's `limit`; kube-runtime's default is 500): less
    /// memory per list in the agent, more load on etcd when every node relists.
    pub page_size: Option<u32>,
    /// Time between two `GET /readyz` while a watcher fails because the API server does
    /// not answer ([`DEFAULT_PROBE_INTERVAL`]; each wait is randomly 0.5 to 1.5 times it):
    /// the server is noticed back within 1.5 times this.
    pub probe_interval: Duration,
}

impl Default for SourceConfig {
    fn default() -> Self {
        SourceConfig {
            debounce: DEFAULT_DEBOUNCE,
            max_delay: DEFAULT_MAX_DELAY,
            backoff_initial: DEFAULT_BACKOFF_INITIAL,
            backoff_max: DEFAULT_BACKOFF_MAX,
            page_size: None,
            probe_interval: DEFAULT_PROBE_INTERVAL,
        }
    }
}

/// What one watcher has seen, for readiness, staleness and logs.
#[derive(Debug, Clone, Default)]
pub struct KindHealth {
    /// The first list finished (or was answered 404 for a CRD).
    pub initialized: bool,
    /// The API server answered 404 for the kind's list: its CRD (or this API version) is
    /// not installed; the kind contributes nothing.
    pub absent: bool,
    /// When the current run of errors began (`None`: the watcher is healthy).
    pub failing_since: Option<Instant>,
    /// The last error, as text.
    pub last_error: Option<String>,
    /// Errors seen since start.
    pub errors: u64,
    /// When the last WARN about this kind's failures was logged.
    last_warned: Option<Instant>,
}

/// State shared between the watcher tasks and the readers.
struct Shared {
    health: Mutex<[KindHealth; KINDS]>,
    generation: AtomicU64,
    initialized: AtomicBool,
    changed: tokio::sync::Notify,
    errors: AtomicU64,
    /// Wakes the prober: some watcher waits for the API server to answer.
    probe: tokio::sync::Notify,
    /// Counts the prober's successes: a watcher waiting for the API server subscribes and
    /// retries when it moves.
    answered: tokio::sync::watch::Sender<u64>,
}

impl Shared {
    fn health<R>(&self, f: impl FnOnce(&mut [KindHealth; KINDS]) -> R) -> R {
        let mut h = self.health.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut h)
    }

    fn bump(&self) {
        self.generation.fetch_add(1, Ordering::Release);
        self.changed.notify_one();
    }
}

/// The reflector stores of the ten kinds.
#[derive(Clone)]
struct Stores {
    pods: ViewStore,
    namespaces: Store<Namespace>,
    nodes: Store<Node>,
    network_policies: Store<NetworkPolicy>,
    admin_network_policies: Store<v1alpha1::AdminNetworkPolicy>,
    baseline_admin_network_policies: Store<v1alpha1::BaselineAdminNetworkPolicy>,
    cluster_network_policies: Store<v1alpha2::ClusterNetworkPolicy>,
    antrea_tiers: Store<antrea::Tier>,
    antrea_cluster_network_policies: Store<antrea::ClusterNetworkPolicy>,
    antrea_network_policies: Store<antrea::NetworkPolicy>,
}

/// A running API-server source. Cheap to clone; the watchers stop when the runtime they
/// were spawned on stops.
#[derive(Clone)]
pub struct ApiSource {
    stores: Stores,
    shared: Arc<Shared>,
}

impl fmt::Debug for ApiSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ApiSource")
            .field("generation", &self.generation())
            .field("initialized", &self.initialized())
            .finish_non_exhaustive()
    }
}

impl ApiSource {
    /// Starts the ten watchers (and the debouncer) on the current tokio runtime, with
    /// `client`. `on_change` is called, from a runtime task, after each debounced burst of
    /// changes once every watcher has finished its first list (and once when that
    /// happens); it must not block.
    ///
    /// Must be called from within a tokio runtime.
    pub fn start(
        client: Client,
        config: SourceConfig,
        on_change: impl Fn() + Send + Sync + 'static,
    ) -> ApiSource {
        let shared = Arc::new(Shared {
            health: Mutex::new(Default::default()),
            generation: AtomicU64::new(0),
            initialized: AtomicBool::new(false),
            changed: tokio::sync::Notify::new(),
            errors: AtomicU64::new(0),
            probe: tokio::sync::Notify::new(),
            answered: tokio::sync::watch::Sender::new(0),
        });
        let c = &config;
        let s = &shared;
        let client_for_probe = client.clone();
        let stores = Stores {
            pods: {
                let store = ViewStore::default();
                let sink = ViewSink { store: store.clone(), relist: None };
                // Decoded as what the view needs (SlimPod), not as whole Pods: a whole list
                // from the watch cache is decoded at once.
                let api: Api<SlimPod> = Api::all(client.clone());
                let page = c.page_size;
                let stream = move || watcher(api.clone(), watch_config(page));
                tokio::spawn(run_watch(stream, sink, WatchedKind::Pod, c.clone(), s.clone()));
                store
            },
            namespaces: spawn_watch(
                Api::all(client.clone()),
                WatchedKind::Namespace,
                project_namespace,
                c,
                s,
            ),
            nodes: spawn_watch(Api::all(client.clone()), WatchedKind::Node, project_node, c, s),
            network_policies: spawn_watch(
                Api::all(client.clone()),
                WatchedKind::NetworkPolicy,
                project_meta,
                c,
                s,
            ),
            admin_network_policies: spawn_watch(
                Api::all(client.clone()),
                WatchedKind::AdminNetworkPolicy,
                project_meta,
                c,
                s,
            ),
            baseline_admin_network_policies: spawn_watch(
                Api::all(client.clone()),
                WatchedKind::BaselineAdminNetworkPolicy,
                project_meta,
                c,
                s,
            ),
            cluster_network_policies: spawn_watch(
                Api::all(client.clone()),
                WatchedKind::ClusterNetworkPolicy,
                project_meta,
                c,
                s,
            ),
            antrea_tiers: spawn_watch(
                Api::all(client.clone()),
                WatchedKind::AntreaTier,
                project_meta,
                c,
                s,
            ),
            antrea_cluster_network_policies: spawn_watch(
                Api::all(client.clone()),
                WatchedKind::AntreaClusterNetworkPolicy,
                project_meta,
                c,
                s,
            ),
            antrea_network_policies: spawn_watch(
                Api::all(client),
                WatchedKind::AntreaNetworkPolicy,
                project_meta,
                c,
                s,
            ),
        };
        tokio::spawn(probe(client_for_probe, shared.clone(), config.probe_interval));
        tokio::spawn(debounce(shared.clone(), config, on_change));
        ApiSource { stores, shared }
    }

    /// Whether every watcher has finished its first list.
    pub fn initialized(&self) -> bool {
        self.shared.initialized.load(Ordering::Acquire)
    }

    /// The kinds whose first list has not finished yet.
    pub fn pending(&self) -> Vec<WatchedKind> {
        self.shared.health(|h| {
            WatchedKind::ALL.into_iter().filter(|k| !h[k.index()].initialized).collect()
        })
    }

    /// Increases with every change the watchers apply to the stores: equal values mean
    /// nothing changed in between.
    pub fn generation(&self) -> u64 {
        self.shared.generation.load(Ordering::Acquire)
    }

    /// Each kind's health, in [`WatchedKind::ALL`] order.
    pub fn health(&self) -> Vec<(WatchedKind, KindHealth)> {
        self.shared.health(|h| WatchedKind::ALL.into_iter().zip(h.iter().cloned()).collect())
    }

    /// How long the longest-failing watcher has been failing (`None`: all healthy). While
    /// it is `Some`, the stores (and the snapshot in force) may miss changes made since.
    pub fn stale_for(&self) -> Option<Duration> {
        self.shared.health(|h| h.iter().filter_map(|k| k.failing_since).min()).map(|t| t.elapsed())
    }

    /// The failing watchers, for `/readyz`'s text: `None` when all are healthy, else
    /// `stale: pods for 42 s (list: HTTP 503 ServiceUnavailable: ...), nodes for 41 s
    /// (...)`, in [`WatchedKind::ALL`] order. The snapshot in force may miss changes of
    /// those kinds made since.
    pub fn staleness(&self) -> Option<String> {
        let failing: Vec<String> = self
            .health()
            .into_iter()
            .filter_map(|(kind, h)| {
                let since = h.failing_since?;
                let error = h.last_error.as_deref().unwrap_or("no error recorded");
                Some(format!("{kind} for {} s ({error})", since.elapsed().as_secs()))
            })
            .collect();
        (!failing.is_empty()).then(|| format!("stale: {}", failing.join(", ")))
    }

    /// Watch errors seen since start, over all kinds.
    pub fn errors(&self) -> u64 {
        self.shared.errors.load(Ordering::Relaxed)
    }

    /// The stores' objects, as compiler input (shared with the stores, not copied). Kinds
    /// whose CRD is not installed contribute nothing. Antrea's objects come as stored,
    /// valid or not (their validity depends on each other: the builder checks them), the
    /// Tiers in the order Antrea's webhook admitted them ([`antrea_tier_order`]).
    pub fn inputs(&self) -> Inputs {
        fn all<K: Clone + Resource<DynamicType = ()> + 'static>(s: &Store<K>) -> Vec<Arc<K>> {
            s.state()
        }
        let absent = self.shared.health(|h| h.each_ref().map(|k| k.absent));
        let optional = |kind: WatchedKind| !absent[kind.index()];
        let s = &self.stores;
        Inputs {
            namespaces: all(&s.namespaces),
            nodes: all(&s.nodes),
            pods: Vec::new(),
            pod_views: s.pods.all(),
            network_policies: all(&s.network_policies),
            admin_network_policies: if optional(WatchedKind::AdminNetworkPolicy) {
                all(&s.admin_network_policies)
            } else {
                Vec::new()
            },
            baseline_admin_network_policies: if optional(WatchedKind::BaselineAdminNetworkPolicy) {
                all(&s.baseline_admin_network_policies)
            } else {
                Vec::new()
            },
            cluster_network_policies: if optional(WatchedKind::ClusterNetworkPolicy) {
                all(&s.cluster_network_policies)
            } else {
                Vec::new()
            },
            antrea: antrea::Objects {
                tiers: if optional(WatchedKind::AntreaTier) {
                    antrea_tier_order(all(&s.antrea_tiers))
                } else {
                    Vec::new()
                },
                cluster_network_policies: if optional(WatchedKind::AntreaClusterNetworkPolicy) {
                    all(&s.antrea_cluster_network_policies)
                } else {
                    Vec::new()
                },
                network_policies: if optional(WatchedKind::AntreaNetworkPolicy) {
                    all(&s.antrea_network_policies)
                } else {
                    Vec::new()
                },
            },
        }
    }

    /// The stored Antrea Tiers, in [`antrea_tier_order`] (for the status writer and the
    /// last good versions).
    pub fn antrea_tiers(&self) -> Vec<Arc<antrea::Tier>> {
        antrea_tier_order(self.stores.antrea_tiers.state())
    }

    /// The stored Antrea ClusterNetworkPolicies (for the status writer).
    pub fn antrea_cluster_network_policies(&self) -> Vec<Arc<antrea::ClusterNetworkPolicy>> {
        self.stores.antrea_cluster_network_policies.state()
    }

    /// The stored Antrea NetworkPolicies (for the status writer).
    pub fn antrea_network_policies(&self) -> Vec<Arc<antrea::NetworkPolicy>> {
        self.stores.antrea_network_policies.state()
    }

    /// The stored AdminNetworkPolicies (for the status writer).
    pub fn admin_network_policies(&self) -> Vec<Arc<v1alpha1::AdminNetworkPolicy>> {
        self.stores.admin_network_policies.state()
    }

    /// The stored BaselineAdminNetworkPolicies (for the status writer).
    pub fn baseline_admin_network_policies(
        &self,
    ) -> Vec<Arc<v1alpha1::BaselineAdminNetworkPolicy>> {
        self.stores.baseline_admin_network_policies.state()
    }

    /// The stored ClusterNetworkPolicies (for the status writer).
    pub fn cluster_network_policies(&self) -> Vec<Arc<v1alpha2::ClusterNetworkPolicy>> {
        self.stores.cluster_network_policies.state()
    }
}

/// `tiers` in the order Antrea's webhook admitted them
/// ([`crate::policy::antrea_tiers::creation_order`]; a store hands its objects out in no
/// order).
pub fn antrea_tier_order(mut tiers: Vec<Arc<antrea::Tier>>) -> Vec<Arc<antrea::Tier>> {
    crate::policy::antrea_tiers::creation_order(&mut tiers);
    tiers
}

/// Exponential backoff between watch retries: steps of `initial`, doubling up to `max`;
/// each delay is a random time up to the step ("full jitter"), so agents whose watches
/// broke together (an API-server restart) retry spread over the step instead of in step;
/// reset after a success or when the prober sees the API server answer again.
struct RetryBackoff {
    initial: Duration,
    max: Duration,
    next: Duration,
}

impl Iterator for RetryBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let step = self.next;
        self.next = (self.next * 2).min(self.max);
        Some(step.mul_f64(uniform()))
    }
}

impl Backoff for RetryBackoff {
    fn reset(&mut self) {
        self.next = self.initial;
    }
}

/// A random number in (0, 1]; 1 if the system's random source fails (no jitter then,
/// the plain backoff).
fn uniform() -> f64 {
    let mut b = [0u8; 4];
    match getrandom::fill(&mut b) {
        Ok(()) => (f64::from(u32::from_le_bytes(b)) + 1.0) / (f64::from(u32::MAX) + 1.0),
        Err(_) => 1.0,
    }
}

/// Whether `e` says the API server did not answer: no connection, a broken one, or 502,
/// 503 or 504 (a load balancer or an API server that is not serving). Then the prober's
/// first answer, not the backoff alone, decides when to retry.
fn unreachable(e: &watcher::Error) -> bool {
    let inner = match e {
        watcher::Error::InitialListFailed(i)
        | watcher::Error::WatchStartFailed(i)
        | watcher::Error::WatchFailed(i) => i,
        watcher::Error::WatchError(s) => return matches!(s.code, 502..=504),
        watcher::Error::NoResourceVersion => return false,
    };
    match inner {
        kube::Error::Api(s) => matches!(s.code, 502..=504),
        kube::Error::HyperError(_) | kube::Error::Service(_) | kube::Error::ReadEvents(_) => true,
        _ => false,
    }
}

/// The prober: while some watcher waits for an unreachable API server (it wakes
/// `shared.probe`), asks `GET /readyz` every `interval` (randomly 0.5 to 1.5 times it),
/// and counts the first answer in `shared.answered`, which wakes the waiting watchers.
/// `/readyz` is the API server's own readiness (200 once it serves); anyone may read it
/// (the `system:public-info-viewer` role), it sends no objects, and 401, 403 or 404
/// (an API server that does not let us ask) also count as an answer: the relist then
/// tells.
async fn probe(client: Client, shared: Arc<Shared>, interval: Duration) {
    loop {
        shared.probe.notified().await;
        loop {
            tokio::time::sleep(interval.mul_f64(0.5 + uniform())).await;
            // A server that drops packets would hold the probe for the connect timeout.
            let answer = tokio::time::timeout(interval, ready(&client)).await;
            if answer.unwrap_or(false) {
                tracing::debug!("the API server answers again");
                shared.answered.send_modify(|n| *n += 1);
                break;
            }
        }
    }
}

/// Whether the API server answers `GET /readyz` with 2xx, 401, 403 or 404.
async fn ready(client: &Client) -> bool {
    let Ok(request) = http::Request::get("/readyz").body(kube::client::Body::from(Vec::new()))
    else {
        return false;
    };
    match client.send(request).await {
        Ok(res) => res.status().is_success() || matches!(res.status().as_u16(), 401 | 403 | 404),
        Err(_) => false,
    }
}

/// Whether `e` is the API server saying the resource does not exist (404).
fn not_found(e: &watcher::Error) -> bool {
    match e {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s)) => s.code == 404,
        watcher::Error::WatchError(s) => s.code == 404,
        _ => false,
    }
}

/// Spawns one kind's watcher, projected by `project`, into a new store.
///
/// After an error the watcher is dropped and, after the backoff, started again from a
/// fresh list: the end of that list (`InitDone`) is the proof that the store is current
/// again, which a re-watch from the old resourceVersion could not give (an idle watch
/// sends nothing). The store keeps its content until the new list is complete (the
/// reflector swaps it in at `InitDone`). 410 Gone is handled inside kube's watcher (a
/// relist) and is no failure.
fn spawn_watch<K>(
    api: Api<K>,
    kind: WatchedKind,
    project: fn(&mut K),
    config: &SourceConfig,
    shared: &Arc<Shared>,
) -> Store<K>
where
    K: Resource<DynamicType = ()>
        + Clone
        + DeserializeOwned
        + serde::Serialize
        + fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let (store, writer) = reflector::store();
    let sink = Reflect { writer, reader: store.clone(), kind, relist: None };
    let page = config.page_size;
    let stream = move || watcher(api.clone(), watch_config(page)).modify(project);
    tokio::spawn(run_watch(stream, sink, kind, config.clone(), shared.clone()));
    store
}

/// kube-runtime's watcher configuration: without `page_size`, lists from the watch cache
/// (`ListSemantic::Any`, `resourceVersion=0`, and no `limit`, which would make kube leave
/// `resourceVersion=0` out); with it, quorum reads in pages of that many objects.
fn watch_config(page_size: Option<u32>) -> watcher::Config {
    match page_size {
        None => watcher::Config { page_size: None, ..watcher::Config::default() }.any_semantic(),
        Some(n) => watcher::Config::default().page_size(n),
    }
}

/// Where a watcher's events go.
trait Sink<K>: Send + 'static {
    /// Applies `event`. Returns, for `Apply` and `Delete`, whether the engine can see the
    /// change; for `InitDone`, whether the list's content differs from the store's (then
    /// the store takes the list; else it keeps its objects).
    fn apply(&mut self, event: &watcher::Event<K>) -> bool;
}

/// A reflector store of projected objects.
struct Reflect<K: Resource<DynamicType = ()> + Clone + 'static> {
    writer: reflector::store::Writer<K>,
    reader: Store<K>,
    kind: WatchedKind,
    /// The list under way (`Init` to `InitDone`), held here rather than in the writer, so
    /// that a list equal to the store leaves the store (and the `Arc`s the snapshot in
    /// force shares with it) as it was.
    relist: Option<Relist<K>>,
}

/// A list under way and how it differs from the store so far.
struct Relist<K> {
    objects: Vec<K>,
    /// Some object is new, or differs from the stored one for the engine.
    changed: bool,
    /// Some object differs from the stored one in anything but its resourceVersion (a
    /// policy's status, which the status writer reads from the store, included).
    differs: bool,
}

impl<K> Default for Relist<K> {
    fn default() -> Self {
        Relist { objects: Vec::new(), changed: false, differs: false }
    }
}

impl<K> Sink<K> for Reflect<K>
where
    K: Resource<DynamicType = ()> + Clone + serde::Serialize + Send + Sync + 'static,
{
    fn apply(&mut self, event: &watcher::Event<K>) -> bool {
        match event {
            watcher::Event::Init => {
                self.relist = Some(Relist::default());
                false
            }
            watcher::Event::InitApply(new) => {
                let likeness = match self.reader.get(&reflector::ObjectRef::from_obj(new)) {
                    Some(old) => likeness(&*old, new, self.kind),
                    None => Likeness::Different,
                };
                let r = self.relist.get_or_insert_with(Relist::default);
                r.changed |= likeness == Likeness::Different;
                r.differs |= likeness != Likeness::Equal;
                r.objects.push(new.clone());
                false
            }
            watcher::Event::InitDone => {
                let Relist { objects, changed, differs } = self.relist.take().unwrap_or_default();
                // Every listed object is in the store; the same number means nothing was
                // deleted either.
                let deleted = objects.len() != self.reader.len();
                if !differs && !deleted {
                    return false;
                }
                self.writer.apply_watcher_event(&watcher::Event::Init);
                for o in objects {
                    self.writer.apply_watcher_event(&watcher::Event::InitApply(o));
                }
                self.writer.apply_watcher_event(&watcher::Event::InitDone);
                changed || deleted
            }
            watcher::Event::Apply(new) => {
                // A change the engine cannot see (a policy's status) triggers no rebuild.
                let seen = self
                    .reader
                    .get(&reflector::ObjectRef::from_obj(new))
                    .is_none_or(|old| !same(&*old, new, self.kind));
                self.writer.apply_watcher_event(event);
                seen
            }
            watcher::Event::Delete(_) => {
                self.writer.apply_watcher_event(event);
                true
            }
        }
    }
}

/// The pods' store: [`PodView`]s (about 1.2 kB of RSS per pod with labels and key,
/// against 5.4 kB for a projected k8s-openapi `Pod`), keyed by namespace and name.
#[derive(Clone, Default)]
struct ViewStore(Arc<std::sync::RwLock<ViewMap>>);

type ViewMap = std::collections::HashMap<(String, String), Arc<PodView>>;

impl ViewStore {
    fn all(&self) -> Vec<Arc<PodView>> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).values().cloned().collect()
    }
}

/// A Pod as the pods' watcher decodes it: the fields a [`PodView`] is made of and the
/// metadata the watcher reads, nothing else (serde skips the rest of the JSON without
/// allocating it). A whole k8s-openapi `Pod` is several kB of structs even for a small
/// object, and a list from the watch cache is decoded whole (issue #19, item 7): decoded
/// this way, a list of 10,000 pods no longer holds 10,000 whole `Pod`s at once.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct SlimPod {
    /// `metadata`: name, namespace, labels, uid, resourceVersion only.
    #[serde(deserialize_with = "slim_meta")]
    pub metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    /// `spec`: nodeName, hostNetwork and the containers' ports.
    #[serde(default)]
    pub spec: Option<SlimPodSpec>,
    /// `status`: phase, podIP and podIPs.
    #[serde(default)]
    pub status: Option<SlimPodStatus>,
}

/// What [`SlimPod`] keeps of `spec`.
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SlimPodSpec {
    /// `spec.nodeName`.
    #[serde(default)]
    pub node_name: Option<String>,
    /// `spec.hostNetwork`.
    #[serde(default)]
    pub host_network: Option<bool>,
    /// `spec.containers[].ports`, per container.
    #[serde(default)]
    pub containers: Vec<SlimContainer>,
}

/// What [`SlimPod`] keeps of a container: its ports.
#[derive(Debug, Clone, Default, serde::Deserialize)]
pub struct SlimContainer {
    /// `ports`.
    #[serde(default)]
    pub ports: Option<Vec<k8s_openapi::api::core::v1::ContainerPort>>,
}

/// What [`SlimPod`] keeps of `status`.
#[derive(Debug, Clone, Default, serde::Deserialize)]
pub struct SlimPodStatus {
    /// `status.phase`.
    #[serde(default)]
    pub phase: Option<String>,
    /// `status.podIP`.
    #[serde(default, rename = "podIP")]
    pub pod_ip: Option<String>,
    /// `status.podIPs`.
    #[serde(default, rename = "podIPs")]
    pub pod_ips: Option<Vec<k8s_openapi::api::core::v1::PodIP>>,
}

/// The metadata fields a [`SlimPod`] keeps.
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct SlimMeta {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    labels: Option<std::collections::BTreeMap<String, String>>,
    #[serde(default)]
    uid: Option<String>,
    #[serde(default)]
    resource_version: Option<String>,
}

fn slim_meta<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta, D::Error> {
    let m = <SlimMeta as serde::Deserialize>::deserialize(d)?;
    Ok(k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        name: m.name,
        namespace: m.namespace,
        labels: m.labels,
        uid: m.uid,
        resource_version: m.resource_version,
        ..Default::default()
    })
}

impl SlimPod {
    /// Its [`PodView`], as [`PodView::from_pod`] gives for the whole Pod.
    pub fn view(&self) -> PodView {
        use k8s_openapi::api::core::v1::{Container, PodSpec, PodStatus};
        let pod = Pod {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                name: self.metadata.name.clone(),
                namespace: self.metadata.namespace.clone(),
                labels: self.metadata.labels.clone(),
                ..Default::default()
            },
            spec: self.spec.as_ref().map(|s| PodSpec {
                node_name: s.node_name.clone(),
                host_network: s.host_network,
                containers: s
                    .containers
                    .iter()
                    .map(|c| Container { ports: c.ports.clone(), ..Default::default() })
                    .collect(),
                ..Default::default()
            }),
            status: self.status.as_ref().map(|s| PodStatus {
                phase: s.phase.clone(),
                pod_ip: s.pod_ip.clone(),
                pod_ips: s.pod_ips.clone(),
                ..Default::default()
            }),
        };
        PodView::from_pod(&pod)
    }
}

impl kube::Resource for SlimPod {
    type DynamicType = ();
    type Scope = k8s_openapi::NamespaceResourceScope;

    fn kind(_: &()) -> std::borrow::Cow<'_, str> {
        "Pod".into()
    }

    fn group(_: &()) -> std::borrow::Cow<'_, str> {
        "".into()
    }

    fn version(_: &()) -> std::borrow::Cow<'_, str> {
        "v1".into()
    }

    fn plural(_: &()) -> std::borrow::Cow<'_, str> {
        "pods".into()
    }

    fn meta(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        &mut self.metadata
    }
}

/// Fills a [`ViewStore`]; a relist is buffered and swapped in at its end, as the
/// reflector does, so readers never see half a list, and only if it differs from the
/// store (else the store keeps its views, which the snapshot in force shares).
struct ViewSink {
    store: ViewStore,
    relist: Option<(ViewMap, bool)>,
}

fn view_key(v: &PodView) -> (String, String) {
    (v.namespace.clone(), v.name.clone())
}

impl Sink<SlimPod> for ViewSink {
    fn apply(&mut self, event: &watcher::Event<SlimPod>) -> bool {
        let read = || self.store.0.read().unwrap_or_else(|e| e.into_inner());
        let write = || self.store.0.write().unwrap_or_else(|e| e.into_inner());
        match event {
            watcher::Event::Init => {
                self.relist = Some((ViewMap::new(), false));
                false
            }
            watcher::Event::InitApply(p) => {
                let v = p.view();
                let key = view_key(&v);
                let changed = read().get(&key).is_none_or(|old| **old != v);
                let (map, c) = self.relist.get_or_insert_with(|| (ViewMap::new(), false));
                *c |= changed;
                map.insert(key, Arc::new(v));
                false
            }
            watcher::Event::InitDone => {
                let (map, changed) = self.relist.take().unwrap_or_default();
                if !changed && map.len() == read().len() {
                    return false;
                }
                *write() = map;
                true
            }
            // A pod's readiness and everything else the view leaves out: no change.
            watcher::Event::Apply(p) => {
                let v = p.view();
                let old = write().insert(view_key(&v), Arc::new(v.clone()));
                old.is_none_or(|o| *o != v)
            }
            watcher::Event::Delete(p) => write().remove(&view_key(&p.view())).is_some(),
        }
    }
}

/// Runs one kind's watcher into `sink` until the runtime stops.
///
/// After an error the watcher is dropped and, after the backoff, started again from a
/// fresh list: the end of that list (`InitDone`) is the proof that the store is current
/// again, which a re-watch from the old resourceVersion could not give (an idle watch
/// sends nothing). The store keeps its content until the new list is complete (swapped in
/// at `InitDone`, and only if it differs). 410 Gone is handled inside kube's watcher (a
/// relist) and is no failure. When the error says the API server did not answer, the
/// retry comes at the end of the backoff or as soon as the prober sees the server answer,
/// whichever is first.
async fn run_watch<K, S>(
    stream: impl Fn() -> S,
    mut sink: impl Sink<K>,
    kind: WatchedKind,
    config: SourceConfig,
    shared: Arc<Shared>,
) where
    S: futures_util::Stream<Item = watcher::Result<watcher::Event<K>>>,
{
    let mut backoff = RetryBackoff {
        initial: config.backoff_initial,
        max: config.backoff_max,
        next: config.backoff_initial,
    };
    loop {
        let mut events = std::pin::pin!(stream());
        let mut wait_for_server = false;
        while let Some(event) = events.next().await {
            match event {
                Ok(ev) => {
                    let seen = sink.apply(&ev);
                    match ev {
                        watcher::Event::Init | watcher::Event::InitApply(_) => {}
                        watcher::Event::InitDone => {
                            backoff.reset();
                            // A first list, or one after the CRD was absent, changes the
                            // inputs whatever the store held. Counted before `initialized`
                            // can turn true, so that the first build sees this generation.
                            let (first, was_absent) = shared
                                .health(|h| (!h[kind.index()].initialized, h[kind.index()].absent));
                            if seen || first || was_absent {
                                shared.bump();
                            }
                            recovered(&shared, kind);
                            if !first {
                                trim_heap();
                            }
                        }
                        watcher::Event::Apply(_) if !seen => {}
                        watcher::Event::Apply(_) | watcher::Event::Delete(_) => shared.bump(),
                    }
                }
                Err(watcher::Error::WatchError(s)) if s.code == 410 => {
                    // The watch's resourceVersion is older than the API server's
                    // history (etcd compaction, or a restarted API server's new watch
                    // cache): kube's watcher relists; no failure. The relist waits a
                    // random time up to the first backoff step, so the agents that got
                    // their 410 together do not all list at once.
                    tracing::debug!(kind = %kind, "resourceVersion expired (410 Gone); relisting");
                    tokio::time::sleep(config.backoff_initial.mul_f64(uniform())).await;
                }
                Err(e) if kind.optional() && not_found(&e) => {
                    absent(&shared, kind);
                    break;
                }
                Err(e) => {
                    failed(&shared, kind, &e);
                    wait_for_server = unreachable(&e);
                    break;
                }
            }
        }
        let delay = backoff.next().unwrap_or(DEFAULT_BACKOFF_MAX);
        if wait_for_server {
            let mut answered = shared.answered.subscribe();
            shared.probe.notify_one();
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                _ = answered.changed() => backoff.reset(),
            }
        } else {
            tokio::time::sleep(delay).await;
        }
    }
}

/// How a new version of a stored object compares with the stored one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Likeness {
    /// Equal but for `metadata.resourceVersion`.
    Equal,
    /// Equal for the engine: they differ in a policy's `status` (written by the status
    /// writer, read by it from the store) or `metadata.generation` only.
    SameForEngine,
    /// The engine can see the difference.
    Different,
}

/// How `new` compares with `old` (both projected).
fn likeness<K: serde::Serialize>(old: &K, new: &K, kind: WatchedKind) -> Likeness {
    let value = |o: &K| {
        let mut v = serde_json::to_value(o).unwrap_or(serde_json::Value::Null);
        if let Some(m) = v.get_mut("metadata").and_then(|m| m.as_object_mut()) {
            m.remove("resourceVersion");
        }
        v
    };
    let (mut old, mut new) = (value(old), value(new));
    if old == new {
        return Likeness::Equal;
    }
    for v in [&mut old, &mut new] {
        if let Some(m) = v.get_mut("metadata").and_then(|m| m.as_object_mut())
            && (kind.optional() || kind == WatchedKind::NetworkPolicy)
        {
            m.remove("generation");
        }
        if kind.optional()
            && let Some(o) = v.as_object_mut()
        {
            o.remove("status");
        }
    }
    if old == new { Likeness::SameForEngine } else { Likeness::Different }
}

/// Whether `old` and `new` (projected) are equal for the engine: equal but for
/// `metadata.resourceVersion`, and, for the policy kinds, `status` (written by the status
/// writer) and `metadata.generation`.
fn same<K: serde::Serialize>(old: &K, new: &K, kind: WatchedKind) -> bool {
    likeness(old, new, kind) != Likeness::Different
}

/// Gives the heap's free memory back to the kernel (glibc's `malloc_trim`) after a relist:
/// its response and decoded objects (a whole collection, from the watch cache) are
/// transient, and a relist that changes nothing triggers no build, after which the agent
/// trims; without this, each relist of a large collection left its size resident. (The
/// agent trims after the first lists itself.) A no-op on other C libraries.
fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks glibc's own heap; it takes no pointer of ours.
    unsafe {
        nix::libc::malloc_trim(0);
    }
}

/// Records that `kind` is not served (404: its CRD is not installed).
fn absent(shared: &Shared, kind: WatchedKind) {
    let newly = shared.health(|h| {
        let k = &mut h[kind.index()];
        let newly = !k.absent || !k.initialized;
        k.absent = true;
        k.initialized = true;
        k.failing_since = None;
        newly
    });
    if newly {
        tracing::info!(
            kind = %kind,
            "not served by the API server (its CRD is not installed); watching for it to appear"
        );
        update_initialized(shared);
        shared.bump();
    }
}

/// How often a watcher that keeps failing says so again at WARN (each retry logs at
/// DEBUG in between).
const FAILURE_LOG_EVERY: Duration = Duration::from_secs(30);

/// `e` in one line: `HTTP 503 ServiceUnavailable: message` for an API status, the error
/// chain otherwise.
fn describe(e: &watcher::Error) -> String {
    let (what, inner) = match e {
        watcher::Error::InitialListFailed(i) => ("list", i),
        watcher::Error::WatchStartFailed(i) => ("watch", i),
        watcher::Error::WatchFailed(i) => ("watch stream", i),
        watcher::Error::WatchError(s) => {
            return format!("watch: HTTP {} {}: {}", s.code, s.reason, s.message);
        }
        watcher::Error::NoResourceVersion => return e.to_string(),
    };
    match inner {
        kube::Error::Api(s) => format!("{what}: HTTP {} {}: {}", s.code, s.reason, s.message),
        other => format!("{what}: {}", crate::error::chain(other)),
    }
}

/// Records a watch error of `kind`: WARN on the first of a run and every
/// [`FAILURE_LOG_EVERY`] after, DEBUG otherwise.
fn failed(shared: &Shared, kind: WatchedKind, e: &watcher::Error) {
    shared.errors.fetch_add(1, Ordering::Relaxed);
    let text = describe(e);
    let (since, warn) = shared.health(|h| {
        let k = &mut h[kind.index()];
        k.errors += 1;
        k.last_error = Some(text.clone());
        let since = *k.failing_since.get_or_insert_with(Instant::now);
        let warn = k.last_warned.is_none_or(|t| t.elapsed() >= FAILURE_LOG_EVERY);
        if warn {
            k.last_warned = Some(Instant::now());
        }
        (since, warn)
    });
    if warn {
        tracing::warn!(
            kind = %kind,
            error = %text,
            stale_secs = since.elapsed().as_secs(),
            "watch failed; enforcing the last good snapshot and retrying with backoff"
        );
    } else {
        tracing::debug!(kind = %kind, error = %text, "watch failed again");
    }
}

/// Records the end of a (re)list of `kind`: its store is current.
fn recovered(shared: &Shared, kind: WatchedKind) {
    let (was_failing, was_absent) = shared.health(|h| {
        let k = &mut h[kind.index()];
        let was = (k.failing_since.take(), k.absent);
        k.last_warned = None;
        k.absent = false;
        k.initialized = true;
        was
    });
    if let Some(since) = was_failing {
        tracing::info!(
            kind = %kind,
            after_secs = since.elapsed().as_secs_f32(),
            "watch recovered; the store is current again"
        );
    }
    if was_absent {
        tracing::info!(kind = %kind, "now served by the API server; watching it");
    }
    update_initialized(shared);
}

fn update_initialized(shared: &Shared) {
    let all = shared.health(|h| h.iter().all(|k| k.initialized));
    if all && !shared.initialized.swap(true, Ordering::AcqRel) {
        tracing::info!("every watcher has finished its initial list");
    }
}

/// Reports bursts of changes: `on_change` after `debounce` of quiet, at most `max_delay`
/// after the burst's first change; nothing before every initial list is done.
async fn debounce(shared: Arc<Shared>, config: SourceConfig, on_change: impl Fn()) {
    loop {
        shared.changed.notified().await;
        let first = tokio::time::Instant::now();
        loop {
            let deadline =
                (tokio::time::Instant::now() + config.debounce).min(first + config.max_delay);
            match tokio::time::timeout_at(deadline, shared.changed.notified()).await {
                Ok(()) if tokio::time::Instant::now() < first + config.max_delay => continue,
                _ => break,
            }
        }
        if shared.initialized.load(Ordering::Acquire) {
            on_change();
        }
    }
}

/// Drops what no kind needs from `meta`: `managedFields` (often the largest part of an
/// object), and annotations other than tierproxy's own (policies' audit settings).
fn trim_meta(meta: &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) {
    meta.managed_fields = None;
    meta.owner_references = None;
    meta.finalizers = None;
    if let Some(a) = meta.annotations.as_mut() {
        a.retain(|k, _| k.starts_with(ANNOTATION_PREFIX));
        if a.is_empty() {
            meta.annotations = None;
        }
    }
}

/// The projection of a policy object: its metadata without `managedFields`, owner
/// references, finalizers, or annotations other than tierproxy's; spec and status kept
/// whole.
pub fn project_meta<K: Resource>(o: &mut K) {
    trim_meta(o.meta_mut());
}

/// The projection of a Namespace: name and labels.
pub fn project_namespace(n: &mut Namespace) {
    trim_meta(&mut n.metadata);
    n.metadata.annotations = None;
    n.spec = None;
    n.status = None;
}

/// The projection of a Node: name, labels, tierproxy's annotations (`tierproxy.io/enforcing`)
/// and `status.addresses`.
pub fn project_node(n: &mut Node) {
    use k8s_openapi::api::core::v1::NodeStatus;
    trim_meta(&mut n.metadata);
    n.spec = None;
    if let Some(status) = n.status.take() {
        n.status = Some(NodeStatus { addresses: status.addresses, ..NodeStatus::default() });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_is_stored_as_what_the_engine_reads() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": "web-1", "namespace": "shop", "labels": {"app": "web"},
                "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{...}"},
                "managedFields": [{"manager": "kubectl"}]
            },
            "spec": {
                "nodeName": "node-a",
                "containers": [
                    {"name": "app", "image": "nginx", "env": [{"name": "A", "value": "1"}],
                     "ports": [{"name": "http", "containerPort": 80}, {"containerPort": 9090}]},
                    {"name": "sidecar", "image": "envoy"}
                ],
                "volumes": [{"name": "v", "emptyDir": {}}]
            },
            "status": {"phase": "Running", "podIP": "10.0.0.5",
                       "podIPs": [{"ip": "10.0.0.5"}, {"ip": "fd00::5"}],
                       "conditions": [{"type": "Ready", "status": "True"}]}
        }))
        .unwrap();
        let v = PodView::from_pod(&pod);
        assert_eq!(
            v,
            PodView {
                namespace: "shop".into(),
                name: "web-1".into(),
                labels: [("app".to_string(), "web".to_string())].into(),
                node_name: Some("node-a".into()),
                host_network: false,
                terminated: false,
                ips: vec!["10.0.0.5".parse().unwrap(), "fd00::5".parse().unwrap()],
                named_ports: vec![crate::policy::ports::NamedPort {
                    name: "http".into(),
                    protocol: crate::policy::ports::Protocol::Tcp,
                    port: 80,
                }],
            }
        );
        // Decoded slim, as the watcher decodes pods: the same view.
        let json = serde_json::to_value(&pod).unwrap();
        let slim: SlimPod = serde_json::from_value(json).unwrap();
        assert_eq!(slim.view(), v);
        assert!(slim.metadata.annotations.is_none() && slim.metadata.managed_fields.is_none());
        // Readiness is not in the view: a condition change is no change.
        let mut unready = pod.clone();
        unready.status.as_mut().unwrap().conditions = None;
        assert_eq!(PodView::from_pod(&unready), v);
    }

    #[test]
    fn a_policy_keeps_its_own_annotations_only() {
        let mut np: NetworkPolicy = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "n", "annotations": {
                "tierproxy.io/audit": "all", "kubectl.kubernetes.io/last-applied-configuration": "{}"
            }, "managedFields": [{"manager": "kubectl"}]},
            "spec": {"podSelector": {}}
        }))
        .unwrap();
        project_meta(&mut np);
        assert_eq!(
            np.metadata.annotations,
            Some([("tierproxy.io/audit".to_string(), "all".to_string())].into())
        );
        assert!(np.metadata.managed_fields.is_none());
        assert!(np.spec.is_some());
    }

    /// Tiers come in the order Antrea's webhook admitted them, the store's order aside: by
    /// creation time, then name.
    #[test]
    fn antrea_tiers_come_in_creation_order() {
        let tier = |name: &str, created: Option<&str>| -> Arc<antrea::Tier> {
            let mut meta = serde_json::json!({"name": name});
            if let Some(t) = created {
                meta["creationTimestamp"] = t.into();
            }
            Arc::new(
                serde_json::from_value(
                    serde_json::json!({"metadata": meta, "spec": {"priority": 1}}),
                )
                .unwrap(),
            )
        };
        let got = antrea_tier_order(vec![
            tier("0-no-time", None),
            tier("a", Some("2026-11-02T00:00:00Z")),
            tier("c", Some("2026-11-01T00:00:00Z")),
            tier("b", Some("2026-11-01T00:00:00Z")),
        ]);
        let names: Vec<&str> = got.iter().map(|t| t.metadata.name.as_deref().unwrap()).collect();
        assert_eq!(names, ["b", "c", "a", "0-no-time"]);
    }

    #[test]
    fn every_kind_has_one_resource_name() {
        let names: std::collections::HashSet<&str> =
            WatchedKind::ALL.iter().map(|k| k.resource()).collect();
        assert_eq!(names.len(), KINDS, "the metrics' resource label tells every kind apart");
        assert_eq!(
            WatchedKind::AntreaClusterNetworkPolicy.to_string(),
            "clusternetworkpolicies.crd.antrea.io"
        );
    }

    #[test]
    fn backoff_doubles_to_its_limit_with_full_jitter_and_resets() {
        let mut b = RetryBackoff {
            initial: Duration::from_millis(100),
            max: Duration::from_millis(350),
            next: Duration::from_millis(100),
        };
        let got: Vec<Duration> = (0..4).map(|_| b.next().unwrap()).collect();
        // Each delay is a random time up to its step.
        for (g, step) in got.iter().zip([100u64, 200, 350, 350]) {
            assert!(*g > Duration::ZERO && *g <= Duration::from_millis(step), "{got:?}");
        }
        b.reset();
        assert!(b.next().unwrap() <= Duration::from_millis(100));
        // Spread over the whole step, not bunched at its end (as 10 % jitter was): of 200
        // first delays, some fall in each quarter of the step.
        let mut quarters = [0; 4];
        for _ in 0..200 {
            b.reset();
            let d = b.next().unwrap().as_secs_f64() / 0.1;
            quarters[((d * 4.0) as usize).min(3)] += 1;
        }
        assert!(quarters.iter().all(|&n| n > 0), "{quarters:?}");
    }

    #[test]
    fn the_user_agent_names_the_version_and_the_node() {
        let ua = user_agent("node-a.example");
        assert_eq!(
            ua.to_str().unwrap(),
            format!("tierproxy/{} (node-a.example)", env!("CARGO_PKG_VERSION"))
        );
        let odd = user_agent("nöde (x)\n");
        assert!(odd.to_str().unwrap().ends_with("(n_de__x__)"), "{odd:?}");
    }

    #[test]
    fn only_an_api_server_that_does_not_answer_waits_for_the_prober() {
        let api = |code: u16| {
            watcher::Error::InitialListFailed(kube::Error::Api(Box::new(
                kube::core::Status::failure("x", "y").with_code(code),
            )))
        };
        assert!(unreachable(&api(503)));
        assert!(unreachable(&api(504)));
        assert!(!unreachable(&api(403)));
        assert!(!unreachable(&api(429)));
        assert!(!unreachable(&api(500)));
        let cut = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        assert!(unreachable(&watcher::Error::WatchFailed(kube::Error::ReadEvents(cut))));
    }
}
