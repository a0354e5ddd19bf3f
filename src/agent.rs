//! The node agent: the wiring of one node's enforcement (issue #3).
//!
//! Start-up, in an order that never leaves a node's pods without a decider:
//! 0. start audit and, with `--kube`, the API-server watchers (both keep the namespace the
//!    agent started in); serve `/metrics`, `/healthz` (live), `/readyz` (not yet) and the
//!    debug endpoints ([`crate::debug`]: 503 until the first snapshot);
//! 1. with `--kube`, wait for every watcher's initial list; read and compile the manifests
//!    and the API server's objects (invalid objects are reported by name and field and
//!    fail closed as their API says; a file that cannot be read or parsed stops the start);
//! 2. bind the NFQUEUE queues (reader threads) and the transparent listeners;
//! 3. install the ruleset (iptables or nftables backend) and policy routing;
//! 4. signal readiness (an optional ready file), then serve until SIGTERM or SIGINT.
//!
//! While serving, the manifests and the API server are watched (issues #5, #6): each
//! change is loaded and compiled as the next revision on a reloader thread, published to
//! the deciders, every
//! live connection and UDP flow is decided again (those now denied are cut), and the pod
//! sets of the ruleset follow the node's pods. A change that cannot be used leaves the last
//! good snapshot in force; an admin policy whose new version is invalid is enforced as the
//! last good version recorded for it in the API ([`cluster::lastgood`]), else left out,
//! alike on every node; what a build finds is logged once ([`ProblemLog`]).
//!
//! Shutdown: stop accepting, let live connections finish for the drain grace period, stop
//! the rest, then remove the ruleset (unless configured to keep it: with fail-closed
//! queues a node then stays closed while the agent is away).
//!
//! Sources: issues #3, #5 and #6; DESIGN §3 (data path), §5 (shared state).

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};

use crate::audit::{self, AuditConfig, Auditor};
use crate::cluster::{self, manifest};
use crate::config::{RedirectConfig, UdpPath};
use crate::metrics::{Metrics, Sample, Scraped};
use crate::policy::{ObjectRef, Revision, Snapshot};
use crate::proxy::decider::{Current, Decider, DeciderLimits};
use crate::proxy::queue::{self, QueueConfig};
use crate::proxy::registry::Registry;
use crate::proxy::relay::{PipeBudget, PipePool, RelayConfig, RelayMode};
use crate::proxy::tcp::{self, ProxyConfig};
use crate::proxy::udp::{self, UdpConfig};
use crate::proxy::{conntrack, forwarded};
use crate::redirect::{self, RulesetSpec};

/// A field of `/proc/self/status` in MiB (0 if it cannot be read).
fn status_mib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with(field))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or(0, |kib| kib / 1024)
}

/// Gives the heap's free memory back to the kernel (glibc's `malloc_trim`): after the
/// initial lists and after each build, the transient memory of list pages and of the
/// compile is free but would otherwise stay resident. A no-op on other C libraries.
fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks glibc's own heap; it takes no pointer of ours.
    unsafe {
        nix::libc::malloc_trim(0);
    }
}

/// This process's resident memory in MiB (`VmRSS`), for the log lines that follow a build.
fn rss_mib() -> u64 {
    status_mib("VmRSS:")
}

/// This process's peak resident memory in MiB (`VmHWM`, since its `exec`).
fn peak_rss_mib() -> u64 {
    status_mib("VmHWM:")
}

/// Default upstream connect timeout.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default idle timeout of a proxied connection (no byte either way). One hour, as
/// kube-proxy's and Envoy's defaults for TCP idle are of that order; long-lived quiet
/// connections (databases) should not be cut by the enforcer.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(3600);
/// Default most live proxied connections, where the open files limit allows them
/// ([`FdPlan`]): two descriptors each.
pub const DEFAULT_MAX_CONNECTIONS: usize = 65_536;
/// Default idle timeout of a UDP flow: 60 s, Envoy's UDP proxy default, between the
/// kernel's conntrack timeouts for unreplied (30 s) and replied (120 s) UDP.
pub const DEFAULT_UDP_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Default most live UDP flows (two sockets each).
pub const DEFAULT_MAX_UDP_FLOWS: usize = 16_384;
/// Default drain grace on shutdown.
pub const DEFAULT_DRAIN_GRACE: Duration = Duration::from_secs(5);
/// Default relay pipe size per direction (DESIGN §7: 1 MiB measured best here).
pub const DEFAULT_PIPE_BYTES: usize = crate::proxy::relay::DEFAULT_PIPE_BYTES;
/// Most relay pipes open at once (in use or kept idle) where the open files limit allows
/// them: 256 connections moving bytes both ways at the same moment (a direction holds a
/// pipe only while it has bytes in flight); a burst beyond is copied through user space.
pub const DEFAULT_MAX_PIPES: usize = 512;
/// Descriptors kept for everything but connections, UDP flows and pipes: listeners, queues,
/// the metrics server and its clients, audit sinks, the API-server client, the manifest
/// watch, the pipes of the commands the agent runs, log files.
pub const RESERVED_FDS: usize = 512;
/// The open files limit the agent needs for its defaults: two descriptors per connection,
/// UDP flow and pipe, and [`RESERVED_FDS`] (deploy/ sets it, `TIERPROXY_NOFILE`).
pub const NEEDED_FDS: usize =
    2 * (DEFAULT_MAX_CONNECTIONS + DEFAULT_MAX_UDP_FLOWS + DEFAULT_MAX_PIPES) + RESERVED_FDS;
/// Packets each kernel queue holds while the reader is busy.
pub const QUEUE_MAX_LEN: u32 = 4096;

/// Everything the agent needs.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    /// This node's `metadata.name` (the downward API's `spec.nodeName` on a cluster).
    pub node: String,
    /// Manifest files or directories: cluster state and policies (may be empty with
    /// [`AgentOptions::kube`]; given with it, their objects are merged in, the API server's
    /// winning where both have an object).
    pub manifests: Vec<PathBuf>,
    /// Read cluster state and policies from the API server too (issue #6); `None`: from
    /// the manifests only.
    pub kube: Option<KubeOptions>,
    /// Created (empty) once the node is enforcing; removed on exit.
    pub ready_file: Option<PathBuf>,
    /// Redirection (marks, queues, ports, backend, fail-open, keep rules).
    pub redirect: RedirectConfig,
    /// Auto (copy small reads, splice bursts; the default), splice or copy.
    pub relay: RelayMode,
    /// Connect upstream from the client's IP.
    pub preserve_source: bool,
    /// Upstream connect timeout.
    pub connect_timeout: Duration,
    /// Idle timeout of a proxied connection.
    pub idle_timeout: Duration,
    /// Most live proxied connections.
    pub max_connections: usize,
    /// Drain grace on shutdown.
    pub drain_grace: Duration,
    /// Idle timeout of a UDP flow on the proxy path ([`crate::config::UdpPath::Proxy`]).
    pub udp_idle_timeout: Duration,
    /// Most live UDP flows.
    pub max_udp_flows: usize,
    /// Audit: what is logged, where to, lossy or lossless (no sinks: off).
    pub audit: AuditConfig,
    /// Where to serve `/metrics`, `/healthz`, `/readyz` and the debug endpoints
    /// ([`crate::debug`]) (`None`: not served).
    pub metrics_addr: Option<SocketAddr>,
    /// Answer the debug endpoints for every peer that reaches the metrics address; by
    /// default only for loopback peers (their answers name every pod, policy and rule).
    pub debug_from_anywhere: bool,
    /// Set `net.ipv4.tcp_tw_reuse` to 1 in the enforcing namespace while running (the old
    /// value is put back on exit); see [`TCP_TW_REUSE`].
    pub tcp_tw_reuse: bool,
    /// Set `net.netfilter.nf_conntrack_acct` to 1 while running (the old value is put back
    /// on exit), so that kernel-forwarded UDP flows' end records carry their bytes; see
    /// [`CONNTRACK_ACCT`]. Only with [`crate::config::UdpPath::Kernel`].
    pub conntrack_acct: bool,
    /// Where the agent keeps what it must undo after a crash ([`DEFAULT_STATE_DIR`]).
    pub state_dir: PathBuf,
    /// A network namespace (a path such as `/run/netns/NAME`, or a name under
    /// `/run/netns`) to enforce in, entered after the audit sinks are started: the sinks
    /// keep the namespace the agent started in, as a hostNetwork pod's would, while the
    /// data path works in this one. The lab uses it to reach an OTLP endpoint on the host.
    pub netns: Option<PathBuf>,
    /// Capabilities to keep once started (after entering [`AgentOptions::netns`]); the
    /// others are dropped from every set, the bounding set included, so the agent and the
    /// commands it runs have only these, as in a container granted exactly them. `None`:
    /// keep what the agent was started with. The lab keeps the DaemonSet's:
    /// [`crate::lab::procs::AGENT_CAPABILITIES`].
    pub keep_capabilities: Option<Vec<caps::Capability>>,
    /// Percent of the kernel's per-user pipe budget the relay takes where that budget
    /// applies ([`PipeBudget::unprivileged`]).
    pub pipe_budget_percent: usize,
    /// Nodes whose agents enforce, by name, besides those whose Node carries
    /// [`crate::policy::compile::ANNOTATION_ENFORCING`]: their pods' TCP connections to
    /// this node's pods were proxied and decided at their own node, so this node decides
    /// them on the first packet and lets the kernel forward them (issue #18). The lab
    /// names every node it starts an agent on.
    pub enforcing_nodes: Vec<String>,
}

impl AgentOptions {
    /// Options with every default, for node `node` and `manifests`.
    pub fn new(node: String, manifests: Vec<PathBuf>) -> Self {
        let audit = AuditConfig::new(&node, Vec::new());
        AgentOptions {
            node,
            manifests,
            kube: None,
            ready_file: None,
            redirect: RedirectConfig::default(),
            relay: RelayMode::Auto,
            preserve_source: true,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            drain_grace: DEFAULT_DRAIN_GRACE,
            udp_idle_timeout: DEFAULT_UDP_IDLE_TIMEOUT,
            max_udp_flows: DEFAULT_MAX_UDP_FLOWS,
            audit,
            metrics_addr: None,
            debug_from_anywhere: false,
            tcp_tw_reuse: true,
            conntrack_acct: true,
            state_dir: PathBuf::from(DEFAULT_STATE_DIR),
            netns: None,
            keep_capabilities: None,
            pipe_budget_percent: crate::proxy::relay::PIPE_BUDGET_SHARE_PERCENT,
            enforcing_nodes: Vec::new(),
        }
    }
}

/// The addresses of the pods on every other node whose agent enforces (its Node carries
/// [`crate::policy::compile::ANNOTATION_ENFORCING`], or it is one of `also`, by name):
/// the ruleset's enforced pods ([`RulesetSpec::with_enforced_pods`]).
fn enforced_pod_ips(snapshot: &Snapshot, here: u32, also: &[String]) -> Vec<IpAddr> {
    snapshot.pod_ips_on(|n| {
        n != here && (snapshot.node_enforcing(n) || also.iter().any(|a| a == snapshot.node_name(n)))
    })
}

/// The API-server side of the agent (issue #6).
#[derive(Debug, Clone, Default)]
pub struct KubeOptions {
    /// Debounce, backoff and paging of the watchers.
    pub source: cluster::apiserver::SourceConfig,
    /// Take part in the election of the policy status writer (`None`: never write status).
    pub status: Option<cluster::status::StatusOptions>,
    /// The agents' namespace (`POD_NAMESPACE`): where the Lease and the recorded last good
    /// policy versions ([`cluster::lastgood::CONFIGMAP`]) live.
    pub namespace: String,
}

/// One build of the node's snapshot.
#[derive(Debug)]
pub struct Built {
    /// What the deciders use.
    pub current: Current,
    /// Each policy's acceptance, for the status writer.
    pub report: cluster::status::Report,
}

/// How bad a logged line is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Level {
    /// INFO.
    Info,
    /// WARN.
    Warn,
    /// ERROR.
    Error,
}

/// Logs what builds find (invalid objects, warnings, notes) once each: a line the previous
/// build logged too is not logged again, and a problem that went away is said once at INFO.
/// Every rebuild repeated the ERROR lines of every invalid policy before (issue #19, item
/// 8); a persistent problem now shows once, then only when it changes.
#[derive(Debug, Default)]
pub struct ProblemLog {
    seen: std::collections::HashSet<(Level, String)>,
}

impl ProblemLog {
    /// Logs the `lines` of one build that the previous build did not log; forgets the rest.
    pub fn log(&mut self, lines: Vec<(Level, String)>) {
        let now: std::collections::HashSet<(Level, String)> = lines.into_iter().collect();
        for seen @ (level, line) in &now {
            if self.seen.contains(seen) {
                continue;
            }
            match level {
                Level::Info => tracing::info!("{line}"),
                Level::Warn => tracing::warn!("{line}"),
                Level::Error => tracing::error!("{line}"),
            }
        }
        for old @ (level, line) in &self.seen {
            if *level != Level::Info && !now.contains(old) {
                tracing::info!("no longer the case: {line}");
            }
        }
        self.seen = now;
    }
}

/// Reads `manifests` and adds the API server's objects from `kube` (an object in both: the
/// API server's wins), as one [`manifest::Loaded`].
pub fn gather(
    manifests: &[PathBuf],
    kube: Option<&cluster::apiserver::ApiSource>,
) -> manifest::Loaded {
    /// `api` added to `files`, replacing a file's object of the same namespace and name.
    fn merge<T: kube::Resource>(files: &mut Vec<Arc<T>>, api: Vec<Arc<T>>) {
        if !files.is_empty() {
            let key = |o: &Arc<T>| (o.meta().namespace.clone(), o.meta().name.clone());
            let theirs: std::collections::HashSet<_> = api.iter().map(key).collect();
            files.retain(|o| !theirs.contains(&key(o)));
        }
        files.extend(api);
    }
    // Compact: pods as views, as the API source keeps them (issue #17: 10,000 pods from a
    // file took 4x the memory they take from the API server).
    let mut loaded = manifest::load_as(manifests, manifest::Form::Compact);
    if let Some(source) = kube {
        let api = source.inputs();
        let i = &mut loaded.inputs;
        merge(&mut i.namespaces, api.namespaces);
        merge(&mut i.nodes, api.nodes);
        // The API server's pods come as views; a file's pod of the same name gives way.
        if !i.pods.is_empty() || !i.pod_views.is_empty() {
            let theirs: std::collections::HashSet<(&str, &str)> =
                api.pod_views.iter().map(|v| (v.namespace.as_str(), v.name.as_str())).collect();
            i.pods.retain(|p| {
                let ns = crate::policy::compile::meta_namespace(&p.metadata);
                !theirs.contains(&(ns.as_str(), p.metadata.name.as_deref().unwrap_or("")))
            });
            i.pod_views.retain(|v| !theirs.contains(&(v.namespace.as_str(), v.name.as_str())));
        }
        merge(&mut i.pods, api.pods);
        i.pod_views.extend(api.pod_views);
        merge(&mut i.network_policies, api.network_policies);
        merge(&mut i.admin_network_policies, api.admin_network_policies);
        merge(&mut i.baseline_admin_network_policies, api.baseline_admin_network_policies);
        merge(&mut i.cluster_network_policies, api.cluster_network_policies);
    }
    loaded
}

/// Compiles `loaded` (manifests and API-server objects) for node `node` as `revision`.
/// An admin policy whose version as given is invalid is compiled as the last good version
/// `records` holds for it ([`cluster::lastgood`], recorded by the status writer), else left
/// out. What the build finds goes to `log`.
///
/// # Errors
/// A file that could not be read or parsed, or a node missing from the Nodes. Invalid
/// objects are not errors: they are logged, left out or replaced by their record, and named
/// in [`Built::report`].
pub fn build(
    loaded: manifest::Loaded,
    node: &str,
    revision: Revision,
    audit_defaults: audit::Defaults,
    records: Option<&cluster::lastgood::Records>,
    log: &mut ProblemLog,
) -> anyhow::Result<Built> {
    if let Some(e) = loaded.errors.first() {
        bail!("{}", crate::error::chain(e));
    }
    let mut lines: Vec<(Level, String)> =
        loaded.notes.iter().map(|n| (Level::Info, n.to_string())).collect();
    let mut inputs = loaded.inputs;
    let mut compiled = Snapshot::compile(&inputs, revision);
    for p in loaded.problems.iter().chain(&compiled.problems) {
        lines.push((if p.is_error() { Level::Error } else { Level::Warn }, p.to_string()));
    }
    // The problems of the objects as given (a recompile with recorded versions put back no
    // longer sees the invalid ones).
    let mut problems = loaded.problems;
    problems.append(&mut compiled.problems);
    let mut invalid: Vec<ObjectRef> =
        problems.iter().filter(|p| p.is_error()).map(|p| p.object.clone()).collect();
    invalid.sort();
    invalid.dedup();
    let valid = valid_generations(&inputs, &invalid);
    let mut kept = match records {
        Some(records) => cluster::lastgood::put_back(&mut inputs, records, &invalid),
        None => Vec::new(),
    };
    if !kept.is_empty() {
        compiled = Snapshot::compile(&inputs, revision);
        // A recorded version that is itself invalid is left out after all.
        kept.retain(|(r, _)| !compiled.problems.iter().any(|p| p.is_error() && p.object == *r));
        for (r, generation) in &kept {
            lines.push((
                Level::Warn,
                format!(
                    "{r}: the new version is invalid (see above); the last good version recorded{} stays in force",
                    generation.map(|g| format!(" (generation {g})")).unwrap_or_default()
                ),
            ));
        }
    }
    for r in invalid.iter().filter(|r| !kept.iter().any(|(k, _)| k == *r)) {
        if cluster::status::carries_status(r.kind) || r.kind == crate::policy::Kind::NetworkPolicy {
            lines.push((
                Level::Error,
                format!("{r}: left out: none of its rules apply (no valid version is recorded)"),
            ));
        }
    }
    drop(inputs);
    let snapshot = Arc::new(compiled.snapshot);
    let Some(node_id) = snapshot.find_node(node) else {
        log.log(lines);
        bail!("node {node:?} is not among the Nodes (manifests, API server)");
    };
    let (plan, errors) = audit::Plan::new(&snapshot, audit_defaults);
    lines.extend(errors.into_iter().map(|e| (Level::Warn, e.to_string())));
    log.log(lines);
    problems.extend(crate::policy::compile::priority_conflicts(&snapshot));
    let mut report = cluster::status::Report::new(revision.0, &problems, &kept);
    report.valid = valid;
    let current = Current { snapshot, node: node_id, audit: plan, problems: problems.into() };
    Ok(Built { current, report })
}

/// The admin policies of `inputs` (the three status-carrying kinds) not named in
/// `invalid`, with their `metadata.generation`: the versions the leader may record.
fn valid_generations(
    inputs: &crate::policy::Inputs,
    invalid: &[ObjectRef],
) -> std::collections::BTreeMap<ObjectRef, Option<i64>> {
    use crate::policy::Kind;
    fn each<T: kube::Resource>(
        items: &[Arc<T>],
        kind: Kind,
        invalid: &[ObjectRef],
        out: &mut std::collections::BTreeMap<ObjectRef, Option<i64>>,
    ) {
        for o in items {
            let r = ObjectRef::cluster(kind, o.meta().name.clone().unwrap_or_default());
            if invalid.binary_search(&r).is_err() {
                out.insert(r, o.meta().generation);
            }
        }
    }
    let mut out = std::collections::BTreeMap::new();
    each(&inputs.admin_network_policies, Kind::AdminNetworkPolicy, invalid, &mut out);
    each(
        &inputs.baseline_admin_network_policies,
        Kind::BaselineAdminNetworkPolicy,
        invalid,
        &mut out,
    );
    each(&inputs.cluster_network_policies, Kind::ClusterNetworkPolicy, invalid, &mut out);
    out
}

/// Whether `report` names an invalid admin policy: one a change of the recorded last good
/// versions could put back (or take out).
fn needs_records(report: &cluster::status::Report) -> bool {
    report.policies.values().any(|a| {
        matches!(
            a,
            cluster::status::Acceptance::Invalid(_)
                | cluster::status::Acceptance::InvalidUpdate(..)
        )
    })
}

/// What the agent would install for `opts`, without touching the node: the backend, why
/// it was chosen, and the exact input of every command ([`redirect::Backend::render`]).
///
/// # Errors
/// Invalid configuration, manifests that cannot be read, a node missing from them.
pub fn dry_run(opts: &AgentOptions) -> anyhow::Result<String> {
    opts.redirect.validate().context("redirect configuration")?;
    let (triggers, _) = std::sync::mpsc::channel();
    // A dry run writes nothing: no node annotation, no status writer (no Lease, no
    // conditions, no Events); the watchers only read.
    let kube = opts
        .kube
        .as_ref()
        .map(|k| {
            KubeSide::start(&KubeOptions { status: None, ..k.clone() }, &opts.node, false, triggers)
        })
        .transpose()?;
    if let Some(k) = &kube {
        k.wait_initialized();
        trim_heap();
        tracing::info!(rss_mib = rss_mib(), "initial lists done");
    }
    let loaded = gather(&opts.manifests, kube.as_ref().map(|k| &k.source));
    tracing::info!(rss_mib = rss_mib(), "inputs gathered");
    let records = kube.as_ref().map(|k| k.records.records());
    let current = build(
        loaded,
        &opts.node,
        Revision(1),
        opts.audit.defaults,
        records.as_ref(),
        &mut ProblemLog::default(),
    )?
    .current;
    tracing::info!(rss_mib = rss_mib(), peak_rss_mib = peak_rss_mib(), "snapshot compiled");
    let spec = RulesetSpec::new(
        opts.redirect.clone(),
        current.snapshot.local_pod_ips(current.node),
        current.snapshot.node_addrs(current.node).to_vec(),
    )
    .context("redirect configuration")?
    .with_enforced_pods(enforced_pod_ips(
        &current.snapshot,
        current.node,
        &opts.enforcing_nodes,
    ));
    let selection = redirect::select(opts.redirect.backend);
    Ok(format!(
        "# backend: {} ({})\n{}",
        selection.backend.name(),
        selection.reason,
        selection.backend.render(&spec)
    ))
}

/// Runs the agent until SIGTERM or SIGINT.
///
/// # Errors
/// Start-up failures (manifests, queues, listeners, ruleset), each naming what failed. The
/// ruleset is removed again if start-up fails after installing it.
pub fn run(opts: AgentOptions) -> anyhow::Result<()> {
    opts.redirect.validate().context("redirect configuration")?;
    let nofile = raise_fd_limit();
    // Audit sinks first: their threads (and sockets) stay in the namespace the agent
    // started in.
    let mut audit_config = opts.audit.clone();
    audit_config.context =
        audit::event::Context::new(&opts.node, audit_config.context.label_keys().to_vec());
    let auditor = Arc::new(Auditor::start(audit_config).context("starting audit")?);
    // Every source of change (manifest watch, API-server watchers) wakes the reloader
    // through this channel.
    let (triggers, changes) = std::sync::mpsc::channel::<()>();
    // The API-server side, like audit, keeps the namespace the agent started in.
    let kube = opts
        .kube
        .as_ref()
        .map(|k| KubeSide::start(k, &opts.node, true, triggers.clone()))
        .transpose()?;
    if let Some(ns) = &opts.netns {
        enter_netns(ns)?;
    }
    let _tw_reuse = HostSysctl::start(&opts.state_dir, TCP_TW_REUSE, opts.tcp_tw_reuse);
    let udp_kernel = opts.redirect.udp_path == UdpPath::Kernel;
    let _ct_acct =
        HostSysctl::start(&opts.state_dir, CONNTRACK_ACCT, udp_kernel && opts.conntrack_acct);
    if udp_kernel && std::fs::read_to_string(CONNTRACK_ACCT.path()).is_ok_and(|v| v.trim() == "0") {
        tracing::warn!(
            "net.netfilter.nf_conntrack_acct is 0: the end records of UDP flows will say 0 bytes each way (set it to 1 on the node)"
        );
    }
    if let Some(keep) = &opts.keep_capabilities {
        keep_only_capabilities(keep)?;
    }
    let (fds, pipe_budget) = plan_descriptors(&opts, nofile);
    let registry = Arc::new(Registry::default());
    let decider_slot: Arc<std::sync::OnceLock<Arc<Decider>>> = Arc::default();
    let udp_stats = Arc::new(udp::UdpStats::default());
    let ruleset_drops = Arc::new(RulesetDrops::default());
    let pipes_slot: Arc<std::sync::OnceLock<Arc<PipePool>>> = Arc::default();
    let metrics = Arc::new(Metrics::new(scraped(
        Sources {
            auditor: auditor.clone(),
            registry: registry.clone(),
            decider: decider_slot.clone(),
            udp: udp_stats.clone(),
            drops: ruleset_drops.clone(),
            pipes: pipes_slot.clone(),
            kube: kube.as_ref().map(|k| k.source.clone()),
            leader: opts.kube.as_ref().and_then(|k| k.status.as_ref()).map(|s| s.leader.clone()),
        },
        &opts.audit,
    )));
    let ready = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("tierproxy")
        .build()
        .context("starting the async runtime")?;
    // /healthz answers from here on, /readyz once the node enforces: a probe can tell a
    // live agent waiting for the API server's initial lists from a dead one.
    if let Some(addr) = opts.metrics_addr {
        let slot = decider_slot.clone();
        let debug =
            crate::debug::router(move || slot.get().map(|d| d.current()), opts.debug_from_anywhere);
        // A stale agent stays ready: it enforces its last good snapshot, as it would
        // after a restart; /readyz's text says which resources are stale.
        let source = kube.as_ref().map(|k| k.source.clone());
        let detail = move || source.as_ref().and_then(|s| s.staleness());
        let addr = runtime.block_on(crate::metrics::serve(
            addr,
            metrics.clone(),
            ready.clone(),
            detail,
            debug,
        ))?;
        tracing::info!(
            %addr,
            debug_from_anywhere = opts.debug_from_anywhere,
            "serving /metrics, /healthz, /readyz, /debug/explain, /debug/snapshot"
        );
    }
    if let Some(k) = &kube {
        k.wait_initialized();
        trim_heap();
        tracing::info!(rss_mib = rss_mib(), "initial lists done");
    }
    let initial_fingerprint = manifest::fingerprint(&opts.manifests);
    let initial_generation = kube.as_ref().map_or(0, |k| k.source.generation());
    let initial_records = kube.as_ref().map_or(0, |k| k.records.version());
    let mut problem_log = ProblemLog::default();
    let built = build(
        gather(&opts.manifests, kube.as_ref().map(|k| &k.source)),
        &opts.node,
        Revision(1),
        opts.audit.defaults,
        kube.as_ref().map(|k| k.records.records()).as_ref(),
        &mut problem_log,
    )?;
    let mut needs_records = needs_records(&built.report);
    if let Some(k) = &kube {
        k.reports.send_replace(Arc::new(built.report));
    }
    let current = built.current;
    let local: Vec<IpAddr> = current.snapshot.local_pod_ips(current.node);
    let node_addrs: Vec<IpAddr> = current.snapshot.node_addrs(current.node).to_vec();
    trim_heap();
    tracing::info!(
        node = %opts.node,
        local_pods = local.len(),
        revision = %current.snapshot.revision(),
        rss_mib = rss_mib(),
        peak_rss_mib = peak_rss_mib(),
        "first snapshot compiled"
    );
    let selection = redirect::select(opts.redirect.backend);
    let backend = selection.backend;
    tracing::info!(backend = backend.name(), reason = %selection.reason, "redirect backend");
    let interfaces = pod_interfaces(&*backend, &local);
    let enforced = enforced_pod_ips(&current.snapshot, current.node, &opts.enforcing_nodes);
    let spec = RulesetSpec::new(opts.redirect.clone(), local, node_addrs)
        .context("redirect configuration")?
        .with_pod_interfaces(interfaces)
        .with_enforced_pods(enforced);
    tracing::info!(
        enforced_pods = spec.enforced_pods().len(),
        "pods on other enforcing nodes: their connections here are decided on the first packet, not proxied again"
    );
    let decider = Arc::new(Decider::new(
        current,
        // Kernel-forwarded flows hold no descriptor: the option alone bounds them. On the
        // proxy path no conntrack event ends them: none is tracked.
        DeciderLimits {
            forwarded_flows: if udp_kernel { opts.max_udp_flows } else { 0 },
            ..DeciderLimits::default()
        },
        auditor.clone(),
        metrics.data_path.clone(),
    ));
    let _ = decider_slot.set(decider.clone());

    // Kernel-forwarded UDP: destroy events are watched before the first flow is admitted,
    // so none of their ends is missed; the sweeper's sockets re-decide live flows.
    let sweeper = if udp_kernel {
        let events = conntrack::Events::subscribe(CONNTRACK_EVENTS_RCVBUF, conntrack::UDP)
            .context("subscribing to conntrack events (needs CAP_NET_ADMIN and nf_conntrack_netlink; --udp-path proxy does without)")?;
        let watcher = decider.clone();
        let cached = (opts.redirect.decided_mark.value, opts.redirect.decided_mark.mask);
        std::thread::Builder::new()
            .name("tierproxy-ctevents".into())
            .spawn(move || forwarded::watch(&watcher, events, cached))
            .context("starting the conntrack event thread")?;
        Some(Sweeper::open().context("opening ctnetlink sockets (--udp-path proxy does without)")?)
    } else {
        None
    };
    let r = &opts.redirect;
    let queue_activity = queue::QueueActivity::default();
    queue::start(
        QueueConfig {
            first: r.queue_first,
            count: r.queue_count,
            decided_value: r.decided_mark.value,
            decided_mask: r.decided_mark.mask,
            fail_open: r.queue_bypass,
            max_len: QUEUE_MAX_LEN,
            udp_kernel,
        },
        decider.clone(),
        &queue_activity,
    )?;

    let pipes = Arc::new(PipePool::with_budget(pipe_budget));
    let _ = pipes_slot.set(pipes.clone());
    let mut local_addrs: Vec<IpAddr> = spec.node_addrs().iter().copied().collect();
    match nix::ifaddrs::getifaddrs() {
        Ok(ifs) => local_addrs.extend(ifs.filter_map(|i| {
            let a = i.address?;
            a.as_sockaddr_in()
                .map(|v4| IpAddr::V4(v4.ip()))
                .or_else(|| a.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip())))
        })),
        Err(e) => tracing::warn!(error = %e, "cannot list this node's addresses"),
    }
    local_addrs.sort();
    local_addrs.dedup();
    let proxy = ProxyConfig {
        local_addrs: local_addrs.into(),
        bypass_mark: r.bypass_mark.value,
        preserve_source: opts.preserve_source,
        connect_timeout: opts.connect_timeout,
        max_connections: fds.max_connections,
        relay: RelayConfig {
            mode: opts.relay,
            pipes: pipes.clone(),
            idle_timeout: opts.idle_timeout,
        },
        drain_grace: opts.drain_grace,
    };
    let addrs = [
        SocketAddr::new(IpAddr::V4(r.tproxy_addr_v4), r.tproxy_port),
        SocketAddr::new(IpAddr::V6(r.tproxy_addr_v6), r.tproxy_port),
    ];
    let listeners = runtime.block_on(async { tcp::bind(&addrs) })?;
    let udp_listeners =
        if udp_kernel { Vec::new() } else { runtime.block_on(async { udp::bind(&addrs) })? };
    let udp_config = UdpConfig {
        bypass_mark: r.bypass_mark.value,
        preserve_source: opts.preserve_source,
        local_addrs: proxy.local_addrs.clone(),
        idle_timeout: opts.udp_idle_timeout,
        max_flows: fds.max_udp_flows,
    };

    // The guard first: an apply that fails half-way is cleaned up too.
    let installed = Installed { backend: &*backend, config: r, keep: r.keep_rules_on_exit };
    backend.apply(&spec).with_context(|| format!("installing the {} ruleset", backend.name()))?;
    let mut sweeper = sweeper;
    if let Some(s) = sweeper.as_mut() {
        // UDP flows a previous agent admitted are forwarded on their conntrack entries:
        // decided again under this snapshot like after a change.
        let cut = s.sweep(&decider, true);
        if cut > 0 {
            tracing::info!(
                cut,
                "UDP flows admitted before this agent started and denied now were cut"
            );
        }
    }

    if let Some(path) = &opts.ready_file {
        std::fs::write(path, b"")
            .with_context(|| format!("writing the ready file {}", path.display()))?;
    }
    ready.store(true, std::sync::atomic::Ordering::Relaxed);
    if let Some(k) = &kube {
        k.set_enforcing(true);
    }
    tracing::info!(node = %opts.node, audit = auditor.enabled(), "enforcing");

    // Live change: the manifests are watched (and the API server, by the watchers); each
    // change becomes a new snapshot.
    let watch = if opts.manifests.is_empty() {
        None
    } else {
        match manifest::watch(&opts.manifests, manifest::DEFAULT_DEBOUNCE) {
            Ok((w, rx)) => {
                let triggers = triggers.clone();
                // Forwards until the watch is dropped and its channel closes.
                let forward = std::thread::Builder::new()
                    .name("tierproxy-mwatch".into())
                    .spawn(move || {
                        while let Ok(paths) = rx.recv() {
                            tracing::debug!(paths = paths.len(), first = ?paths.first(), "manifests changed");
                            if triggers.send(()).is_err() {
                                return;
                            }
                        }
                    });
                if let Err(e) = forward {
                    tracing::error!(error = %e, "cannot start the manifest watch");
                }
                Some(w)
            }
            Err(e) => {
                tracing::error!(
                    error = %crate::error::chain(&e),
                    "cannot watch the manifests; their changes are not seen until restarted"
                );
                None
            }
        }
    };
    // The reloader ends when every sender is gone: the manifest forwarder's (when the
    // watch is dropped), the API-server side's (when it stops), and this one.
    drop(triggers);
    std::thread::scope(|scope| {
        let reloader = Reloader {
            opts: &opts,
            decider: &decider,
            registry: &registry,
            backend: &*backend,
            kube: kube.as_ref(),
            spec: spec.clone(),
            revision: 1,
            fingerprint: initial_fingerprint,
            generation: initial_generation,
            records: initial_records,
            needs_records: std::mem::take(&mut needs_records),
            problem_log,
            drops: &ruleset_drops,
            ticked: std::time::Instant::now(),
            queue_activity: &queue_activity,
            sweeper,
        };
        let spawned = std::thread::Builder::new()
            .name("tierproxy-reload".into())
            .spawn_scoped(scope, move || reloader.run(&changes));
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start the reloader; enforcing revision 1");
        }
        runtime.block_on(async {
            let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
            let udp_serving = tokio::spawn(udp::serve(
                udp_listeners,
                udp_config,
                decider.clone(),
                registry.clone(),
                udp_stats.clone(),
                stop_rx.clone(),
            ));
            let serving = tokio::spawn(tcp::serve(
                listeners,
                proxy,
                decider.clone(),
                registry.clone(),
                stop_rx,
            ));
            wait_for_signal().await;
            // Not ready from here on: a load balancer or probe stops counting on this node,
            // and the other nodes proxy this node's pods' connections again.
            ready.store(false, std::sync::atomic::Ordering::Relaxed);
            if let Some(k) = &kube {
                k.set_enforcing(false);
            }
            tracing::info!("shutting down: no new connections; draining");
            let _ = stop_tx.send(true);
            let _ = serving.await;
            let _ = udp_serving.await;
        });
        // Ends the watch and the API-server side; the reloader's channel closes and it
        // returns.
        drop(watch);
        if let Some(k) = &kube {
            k.stop();
        }
    });
    if udp_kernel {
        // The kernel goes on forwarding them; this agent stops reporting them.
        let ended =
            conntrack::Conntrack::open().and_then(|mut ct| forwarded::shut_down(&decider, &mut ct));
        if let Err(e) = ended {
            tracing::warn!(error = %e, "listing conntrack at shutdown failed: the kernel-forwarded UDP flows' ends were reported without bytes");
        }
    }
    // Connection ends are queued by now: flush them with the rest.
    auditor.shutdown();
    if let Some(path) = &opts.ready_file {
        let _ = std::fs::remove_file(path);
    }
    drop(installed);
    Ok(())
}

/// How long a stopping agent waits for its node annotation's removal
/// ([`cluster::announce::REMOVE_ATTEMPTS`] writes with backoff) and, at the same time, for
/// the status writer's release of its Lease ([`cluster::lease::RELEASE_TIMEOUT`]).
const ANNOUNCE_STOP_GRACE: Duration = Duration::from_secs(5);

/// The API-server side of the agent: a thread with its own single-threaded runtime running
/// the watchers ([`cluster::apiserver`]) and, if enabled, the status writer
/// ([`cluster::status`]). Started before the agent enters another network namespace
/// (`--netns`, the lab), so that its connections keep the namespace the agent started in,
/// as audit's do; and apart from the proxy's runtime, so the data path never waits on it.
struct KubeSide {
    source: cluster::apiserver::ApiSource,
    /// The recorded last good policy versions ([`cluster::lastgood`]).
    records: Arc<cluster::lastgood::RecordStore>,
    /// Each build's policy report, for the status writer.
    reports: tokio::sync::watch::Sender<Arc<cluster::status::Report>>,
    stop: std::sync::Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
    thread: std::sync::Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Whether this node's agent enforces, for [`cluster::announce`] (dropped on stop).
    enforcing: std::sync::Mutex<Option<tokio::sync::watch::Sender<bool>>>,
}

impl KubeSide {
    /// Connects (in-cluster configuration, else `KUBECONFIG` / `~/.kube/config`; requests
    /// name `node` in their User-Agent) and starts the watchers; each debounced change
    /// sends `()` on `changes`. With `announce` (this node's agent, not a dry run),
    /// [`KubeSide::set_enforcing`] is written to the Node's annotation
    /// ([`cluster::announce`]); a dry run writes nothing.
    ///
    /// # Errors
    /// No usable client configuration, or the thread cannot start. An API server that
    /// does not answer is not an error here: the watchers retry.
    fn start(
        opts: &KubeOptions,
        node: &str,
        announce: bool,
        changes: std::sync::mpsc::Sender<()>,
    ) -> anyhow::Result<KubeSide> {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (enforcing, enforcing_rx) = tokio::sync::watch::channel(false);
        let node = node.to_owned();
        let announce_as = announce.then(|| node.clone());
        let (reports, reports_rx) =
            tokio::sync::watch::channel(Arc::new(cluster::status::Report::default()));
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let opts = opts.clone();
        let records = Arc::new(cluster::lastgood::RecordStore::default());
        let records_in = records.clone();
        let thread = std::thread::Builder::new()
            .name("tierproxy-kube".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(anyhow::Error::new(e)));
                        return;
                    }
                };
                rt.block_on(async move {
                    let client = match cluster::apiserver::client(None, &node).await {
                        Ok(c) => c,
                        Err(e) => {
                            // kube's message already holds its causes; a chain would
                            // repeat them.
                            let e = anyhow::anyhow!(
                                "configuring the API-server client (in-cluster service \
                                 account, else KUBECONFIG or ~/.kube/config): {e}"
                            );
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    let records_changed = changes.clone();
                    let source = cluster::apiserver::ApiSource::start(
                        client.clone(),
                        opts.source,
                        move || {
                            let _ = changes.send(());
                        },
                    );
                    tokio::spawn(cluster::lastgood::watch(
                        client.clone(),
                        opts.namespace.clone(),
                        records_in.clone(),
                        move || {
                            let _ = records_changed.send(());
                        },
                    ));
                    let _ = ready_tx.send(Ok(source.clone()));
                    let announcer = announce_as.map(|node| {
                        tokio::spawn(cluster::announce::run(client.clone(), node, enforcing_rx))
                    });
                    let (stop_status, status_stopped) = tokio::sync::oneshot::channel::<()>();
                    let status = opts.status.map(|status| {
                        tokio::spawn(cluster::status::run(
                            client,
                            source,
                            status,
                            reports_rx,
                            records_in,
                            async move {
                                let _ = status_stopped.await;
                            },
                        ))
                    });
                    let _ = stop_rx.await;
                    drop(stop_status);
                    // The annotation's removal, begun when the agent stopped enforcing, and
                    // the Lease's release are let finish (bounded: the agent is exiting).
                    let _ = tokio::time::timeout(ANNOUNCE_STOP_GRACE, async {
                        if let Some(a) = announcer {
                            let _ = a.await;
                        }
                        if let Some(s) = status {
                            let _ = s.await;
                        }
                    })
                    .await;
                });
            })
            .context("starting the API-server thread")?;
        let source = ready_rx.recv().context("the API-server thread ended")??;
        Ok(KubeSide {
            source,
            records,
            reports,
            stop: std::sync::Mutex::new(Some(stop_tx)),
            thread: std::sync::Mutex::new(Some(thread)),
            enforcing: std::sync::Mutex::new(Some(enforcing)),
        })
    }

    /// Announces on this node's Node object whether the agent enforces
    /// ([`cluster::announce`]): `true` once its ruleset is installed, `false` as soon as it
    /// stops (SIGTERM), before the drain.
    fn set_enforcing(&self, on: bool) {
        if let Some(tx) = self.enforcing.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            let _ = tx.send(on);
        }
    }

    /// Blocks until every watcher has finished its initial list, logging the kinds still
    /// missing every 10 s (the node is not enforcing yet: no ruleset, not ready).
    fn wait_initialized(&self) {
        let started = std::time::Instant::now();
        let mut next_log = Duration::from_secs(10);
        while !self.source.initialized() || !self.records.initialized() {
            std::thread::sleep(Duration::from_millis(20));
            if started.elapsed() >= next_log {
                next_log += Duration::from_secs(10);
                let pending: Vec<String> =
                    self.source.pending().iter().map(|k| k.to_string()).collect();
                tracing::warn!(
                    waiting_secs = started.elapsed().as_secs(),
                    pending = %pending.join(","),
                    "waiting for the API server's initial lists before the first snapshot"
                );
            }
        }
    }

    /// Stops the watchers and the status writer and waits for the thread (and, at most
    /// [`ANNOUNCE_STOP_GRACE`], for the node annotation's removal and the Lease's release).
    fn stop(&self) {
        if let Some(tx) = self.enforcing.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = tx.send(false);
        }
        if let Some(tx) = self.stop.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }
}

impl Drop for KubeSide {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Applies manifest changes: each batch of changed paths becomes a new snapshot (the next
/// revision), which is published to the deciders, every live connection is decided again
/// (those now denied are cut), and the interception sets follow the node's pods.
struct Reloader<'a> {
    opts: &'a AgentOptions,
    decider: &'a Decider,
    registry: &'a Registry,
    backend: &'a dyn redirect::Backend,
    /// The API-server side, if the agent reads it.
    kube: Option<&'a KubeSide>,
    /// The ruleset installed now.
    spec: RulesetSpec,
    /// The revision in force.
    revision: u64,
    /// [`manifest::fingerprint`] of the manifests the revision in force was built from.
    fingerprint: u64,
    /// [`cluster::apiserver::ApiSource::generation`] the revision in force was built from.
    generation: u64,
    /// [`cluster::lastgood::RecordStore::version`] the revision in force was built with.
    records: u64,
    /// Whether the revision in force has an invalid admin policy, which a change of the
    /// recorded last good versions can change.
    needs_records: bool,
    /// What builds found, logged once each.
    problem_log: ProblemLog,
    /// The ruleset's drop counters and pod interfaces, as last read.
    drops: &'a RulesetDrops,
    /// When [`Reloader::tick`] last ran.
    ticked: std::time::Instant,
    /// The queue readers' batches, for emptying the kernel-side cache of allowed classes.
    queue_activity: &'a queue::QueueActivity,
    /// Kernel-forwarded UDP flows' sweeps ([`forwarded::sweep`]); `None` on the proxy path.
    sweeper: Option<Sweeper>,
}

/// Receive buffer of the conntrack event socket: 8 MiB, about 30,000 events (a
/// destroy event of an IPv4 UDP entry is ~250 bytes, charged as its skb's true size).
pub const CONNTRACK_EVENTS_RCVBUF: usize = 8 << 20;

/// How often the reloader sweeps the kernel-forwarded UDP flows without a policy change
/// (to forget flows whose first datagram never made a conntrack entry); at the next tick
/// already after destroy events were lost.
pub const SWEEP_EVERY: Duration = Duration::from_secs(60);

/// The two ctnetlink sockets of [`forwarded::sweep`] (one lists the table while the other
/// deletes entries), and when it last ran.
pub struct Sweeper {
    dump: conntrack::Conntrack,
    delete: conntrack::Conntrack,
    swept: std::time::Instant,
    /// [`forwarded::ForwardedStats::events_lost`] at the last sweep.
    lost: u64,
}

impl Sweeper {
    /// Opens the sockets.
    ///
    /// # Errors
    /// [`conntrack::Conntrack::open`]'s.
    pub fn open() -> std::io::Result<Sweeper> {
        Ok(Sweeper {
            dump: conntrack::Conntrack::open()?,
            delete: conntrack::Conntrack::open()?,
            swept: std::time::Instant::now(),
            lost: 0,
        })
    }

    /// One [`forwarded::sweep`], logged: with `redecide`, after a new snapshot (every live
    /// flow decided again, the denied ones' entries deleted); without, to forget flows that
    /// never started. Returns how many entries it deleted.
    pub fn sweep(&mut self, decider: &Decider, redecide: bool) -> usize {
        self.swept = std::time::Instant::now();
        self.lost =
            decider.forwarded().stats.events_lost.load(std::sync::atomic::Ordering::Relaxed);
        match forwarded::sweep(decider, &mut self.dump, &mut self.delete, redecide) {
            Ok(s) => {
                tracing::debug!(
                    checked = s.checked,
                    cut = s.cut,
                    forgotten = s.forgotten,
                    tracked = decider.forwarded().len(),
                    took_us = self.swept.elapsed().as_micros() as u64,
                    "kernel-forwarded UDP flows swept"
                );
                s.cut
            }
            Err(e) => {
                tracing::error!(
                    error = %e,
                    "sweeping the kernel-forwarded UDP flows failed: flows a new snapshot denies may live on until their conntrack entries expire; retried at the next change or tick"
                );
                0
            }
        }
    }

    /// Whether a sweep without a policy change is due: [`SWEEP_EVERY`] passed, or destroy
    /// events were lost since the last one.
    fn due(&self, decider: &Decider) -> bool {
        let lost = decider.forwarded().stats.events_lost.load(std::sync::atomic::Ordering::Relaxed);
        lost != self.lost || self.swept.elapsed() >= SWEEP_EVERY
    }
}

/// How often the reloader reads the ruleset's drop counters and the routes to the local
/// pods (a pod whose network is set up after its address was known, or whose interface was
/// replaced, is checked from the next tick on).
pub const RULESET_TICK: Duration = Duration::from_secs(10);

/// What the reloader last read of the ruleset: its drop counters ([`redirect::DropCounts`])
/// and how many pod interfaces it checks sources on; exported as metrics.
#[derive(Debug, Default)]
pub struct RulesetDrops {
    /// Chain S, rule 2 (packets).
    pub node_source: std::sync::atomic::AtomicU64,
    /// Chain S, rule 3 (packets).
    pub pod_source: std::sync::atomic::AtomicU64,
    /// Rule 6's stray TCP drop (packets).
    pub stray_tcp: std::sync::atomic::AtomicU64,
    /// Interfaces in the pod interface sets.
    pub interfaces: std::sync::atomic::AtomicU64,
    /// Addresses in the enforced pod sets (pods on other enforcing nodes).
    pub enforced: std::sync::atomic::AtomicU64,
}

/// The interfaces of `addrs` ([`redirect::Backend::pod_interfaces`]); none, with a warning,
/// when they cannot be read (sources are then not checked until the next tick).
fn pod_interfaces(
    backend: &dyn redirect::Backend,
    addrs: &[IpAddr],
) -> std::collections::BTreeSet<String> {
    match backend.pod_interfaces(addrs) {
        Ok(set) => set,
        Err(e) => {
            tracing::warn!(
                error = %crate::error::chain(&e),
                "cannot read the routes to the local pods; their sources are not checked until the next try"
            );
            Default::default()
        }
    }
}

impl Reloader<'_> {
    /// Reloads on every change until the channel closes (every source stopped), and every
    /// [`RULESET_TICK`] refreshes the pod interfaces and reads the drop counters.
    fn run(mut self, changes: &std::sync::mpsc::Receiver<()>) {
        use std::sync::mpsc::RecvTimeoutError;
        self.tick();
        loop {
            let wait = RULESET_TICK.saturating_sub(self.ticked.elapsed());
            match changes.recv_timeout(wait) {
                Ok(()) => {
                    // Changes that queued up while the last reload ran are covered by this one.
                    let more = changes.try_iter().count();
                    tracing::debug!(queued = more, "change reported");
                    self.reload();
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
            if self.ticked.elapsed() >= RULESET_TICK {
                self.tick();
            }
        }
    }

    /// Refreshes the pod interface sets from the routes to the local pods, and reads the
    /// ruleset's drop counters: each reason that dropped packets since the last tick gets
    /// one WARN line (so at most one per [`RULESET_TICK`]).
    fn tick(&mut self) {
        use std::sync::atomic::Ordering::Relaxed;
        self.ticked = std::time::Instant::now();
        let local: Vec<IpAddr> = self.spec.local_pods().iter().copied().collect();
        let interfaces = pod_interfaces(self.backend, &local);
        if &interfaces != self.spec.pod_interfaces() {
            match self.backend.set_pod_interfaces(self.spec.config(), &interfaces) {
                Ok(()) => {
                    tracing::info!(interfaces = interfaces.len(), "pod interfaces updated");
                    self.spec = self.spec.clone().with_pod_interfaces(interfaces);
                }
                Err(e) => tracing::error!(
                    error = %crate::error::chain(&e),
                    "updating the pod interface sets failed; retried at the next tick"
                ),
            }
        }
        self.drops.interfaces.store(self.spec.pod_interfaces().len() as u64, Relaxed);
        self.drops.enforced.store(self.spec.enforced_pods().len() as u64, Relaxed);
        // What a burst (a flood of new flows, many connections at once) freed goes back to
        // the kernel: glibc keeps freed memory in its arenas otherwise, and the agent's RSS
        // stayed ~200 MiB higher after a flood for good (issue #17). The caches free their
        // expired entries first.
        self.decider.maintain();
        if let Some(s) = self.sweeper.as_mut().filter(|s| s.due(self.decider)) {
            s.sweep(self.decider, false);
        }
        trim_heap();
        let counts = match self.backend.drop_counts(self.spec.config()) {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(error = %e, "cannot read the ruleset's counters");
                return;
            }
        };
        for (now, seen, what) in [
            (
                counts.node_source,
                &self.drops.node_source,
                "packets from outside the node carried one of its own addresses as their source (forged); dropped",
            ),
            (
                counts.pod_source,
                &self.drops.pod_source,
                "packets from a pod's interface carried a source that is not the pod's (forged); dropped",
            ),
            (
                counts.stray_tcp,
                &self.drops.stray_tcp,
                "TCP packets of pod flows belonged to no allowed connection (scans, stale segments); dropped",
            ),
        ] {
            // A re-applied ruleset starts its counters at 0 again.
            let before = seen.swap(now, Relaxed);
            let new = if now >= before { now - before } else { now };
            if new > 0 {
                tracing::warn!(packets = new, total = now, "{what}");
            }
        }
    }

    /// One reload. A manifest set that cannot be read or parsed, or that lost this node,
    /// leaves the last good snapshot in force (and says so); invalid objects are reported
    /// by [`build`] and fail closed as their API says.
    fn reload(&mut self) {
        let started = std::time::Instant::now();
        let fingerprint = manifest::fingerprint(&self.opts.manifests);
        // Read before the stores are: a change after this point triggers another reload.
        let generation = self.kube.map_or(0, |k| k.source.generation());
        let records = self.kube.map_or(0, |k| k.records.version());
        let records_matter = records != self.records && self.needs_records;
        if fingerprint == self.fingerprint && generation == self.generation && !records_matter {
            tracing::debug!(revision = self.revision, "inputs unchanged; nothing to apply");
            return;
        }
        let next = Revision(self.revision + 1);
        let loaded = build(
            gather(&self.opts.manifests, self.kube.map(|k| &k.source)),
            &self.opts.node,
            next,
            self.opts.audit.defaults,
            self.kube.map(|k| k.records.records()).as_ref(),
            &mut self.problem_log,
        );
        let current = match loaded {
            Ok(b) => {
                self.needs_records = needs_records(&b.report);
                if let Some(k) = self.kube {
                    k.reports.send_replace(Arc::new(b.report));
                }
                b.current
            }
            Err(e) => {
                self.decider.stats.reload_errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tracing::error!(
                    error = %format!("{e:#}"),
                    revision = self.revision,
                    "the inputs changed but cannot be used; the last good snapshot stays in force"
                );
                return;
            }
        };
        let local = current.snapshot.local_pod_ips(current.node);
        let node_addrs = current.snapshot.node_addrs(current.node).to_vec();
        let enforced =
            enforced_pod_ips(&current.snapshot, current.node, &self.opts.enforcing_nodes);
        self.decider.publish(current);
        self.flush_allowed();
        self.revision = next.0;
        self.fingerprint = fingerprint;
        self.generation = generation;
        self.records = records;
        let compiled = started.elapsed();
        let redecided = self.decider.redecide(self.registry);
        let udp_cut = self.sweeper.as_mut().map_or(0, |s| s.sweep(self.decider, true));
        let spec = match RulesetSpec::new(self.opts.redirect.clone(), local, node_addrs) {
            Ok(s) => s.with_enforced_pods(enforced),
            Err(e) => {
                tracing::error!(error = %e, "ruleset for the new snapshot is invalid; kept the old one");
                self.spec.clone()
            }
        };
        let (added, removed) = (
            spec.local_pods().difference(self.spec.local_pods()).copied().collect::<Vec<_>>(),
            self.spec.local_pods().difference(spec.local_pods()).copied().collect::<Vec<_>>(),
        );
        let spec = if added.is_empty() && removed.is_empty() {
            spec.with_pod_interfaces(self.spec.pod_interfaces().iter().cloned())
        } else {
            let local: Vec<IpAddr> = spec.local_pods().iter().copied().collect();
            let interfaces = pod_interfaces(self.backend, &local);
            spec.with_pod_interfaces(interfaces)
        };
        let outcome = if spec.node_addrs() != self.spec.node_addrs() {
            self.backend.apply(&spec)
        } else {
            let pods = if !added.is_empty() || !removed.is_empty() {
                self.backend.update_pods(spec.config(), &added, &removed).and_then(|()| {
                    if spec.pod_interfaces() == self.spec.pod_interfaces() {
                        Ok(())
                    } else {
                        self.backend.set_pod_interfaces(spec.config(), spec.pod_interfaces())
                    }
                })
            } else {
                Ok(())
            };
            pods.and_then(|()| {
                if spec.enforced_pods() == self.spec.enforced_pods() {
                    Ok(())
                } else {
                    self.backend.set_enforced_pods(spec.config(), spec.enforced_pods())
                }
            })
        };
        match outcome {
            Ok(()) => self.spec = spec,
            Err(e) => tracing::error!(
                error = %crate::error::chain(&e),
                "updating the interception sets failed; they will be retried on the next change"
            ),
        }
        trim_heap();
        tracing::info!(
            revision = self.revision,
            compile_us = compiled.as_micros() as u64,
            total_us = started.elapsed().as_micros() as u64,
            live = redecided.checked,
            cut = redecided.cut,
            udp_cut,
            rss_mib = rss_mib(),
            pods_added = added.len(),
            pods_removed = removed.len(),
            enforced_pods = self.spec.enforced_pods().len(),
            "snapshot applied"
        );
    }
}

impl Reloader<'_> {
    /// Empties the kernel-side cache of allowed TCP classes (`redirect` rule 7) after a new
    /// snapshot is published: at once, and again once every queue reader that was deciding
    /// has answered its batch (a verdict of the old snapshot adds its class as the kernel
    /// reinjects the packet). A failure is logged; the cache's entries then expire on
    /// their own ([`redirect::ALLOWED_CACHE_SECS`]) and the ruleset is not otherwise
    /// affected.
    fn flush_allowed(&self) {
        let config = self.spec.config();
        let first = self.backend.flush_allowed(config);
        let settled = self.queue_activity.wait_for_batches(Duration::from_secs(1));
        let second = self.backend.flush_allowed(config);
        if let Err(e) = first.and(second) {
            tracing::error!(
                error = %crate::error::chain(&e),
                "emptying the cache of allowed classes failed: SYNs of classes the old snapshot allowed skip the queue until their entries expire ({} s)",
                redirect::ALLOWED_CACHE_SECS
            );
        } else if !settled {
            tracing::warn!(
                "a queue reader did not answer its batch within 1 s of a new snapshot; a class it allowed under the old snapshot may stay cached until it expires"
            );
        }
    }
}

/// A sysctl of the agent's network namespace (the node's) that the agent sets to 1 while
/// it runs ([`HostSysctl`]).
#[derive(Debug, Clone, Copy)]
pub struct Sysctl {
    /// Dotted name, e.g. `net.ipv4.tcp_tw_reuse`.
    pub name: &'static str,
    /// What setting it does, for the log line (with the flag that leaves it alone).
    pub why: &'static str,
}

impl Sysctl {
    fn path(&self) -> PathBuf {
        PathBuf::from("/proc/sys").join(self.name.replace('.', "/"))
    }

    /// The state file's name: the last component of the name.
    fn leaf(&self) -> &'static str {
        self.name.rsplit('.').next().unwrap_or(self.name)
    }
}

/// `net.ipv4.tcp_tw_reuse = 1`.
///
/// Why: the proxy's upstream connections carry their client's address, so when clients
/// close first, the upstream legs' TIME_WAITs (60 s each) pile up per client and
/// destination, and the kernel's search for a free source port at every connect grows
/// with them. Measured in the lab at 8 connecting clients: 2,659 connections/s over 2 s
/// fell to 1,167/s over 8 s (p99 25 ms); with reuse on, 2,802/s over 8 s (p99 2.4 ms).
/// Reuse (value 1) lets an outgoing connection take a TIME_WAIT's 4-tuple once it is
/// older than 1 s, with TCP timestamps guarding against old segments (ip-sysctl.rst,
/// `tcp_tw_reuse`); the kernel's default (2) allows it on loopback only. It applies to
/// every outgoing connection of the node, which is why the agent says so in its log and
/// `--no-tcp-tw-reuse` leaves the setting alone.
pub const TCP_TW_REUSE: Sysctl = Sysctl {
    name: "net.ipv4.tcp_tw_reuse",
    why: "for this node's outgoing connections while the agent runs (upstream legs carry client addresses; --no-tcp-tw-reuse leaves it alone)",
};

/// `net.netfilter.nf_conntrack_acct = 1`: conntrack counts packets and bytes of every
/// entry created from now on, so that a kernel-forwarded UDP flow's end record has its
/// bytes each way ([`crate::proxy::forwarded`]; nf_conntrack-sysctl.rst). It costs every
/// new conntrack entry of the node 32 bytes and every packet two counter updates;
/// `--no-conntrack-acct` leaves it alone (ends are then reported with 0 bytes).
pub const CONNTRACK_ACCT: Sysctl = Sysctl {
    name: "net.netfilter.nf_conntrack_acct",
    why: "so that the end records of kernel-forwarded UDP flows carry their bytes (--no-conntrack-acct leaves it alone)",
};

/// A [`Sysctl`] set to 1 while the agent runs; the old value is written back when this
/// is dropped.
///
/// A crash (SIGKILL, OOM) skips the restore, so the old value is also written to a state
/// file (`<state dir>/<last name component>.<network namespace cookie>`, e.g.
/// `tcp_tw_reuse.cookie-42`) before the sysctl is changed, and removed once it is
/// restored: the next agent started in the same namespace finds it and restores that
/// value first, whether or not it sets the sysctl again (issue #17: `tcp_tw_reuse` stayed
/// 1 for good after a crash). The namespace cookie (`SO_NETNS_COOKIE`) is unique for the
/// boot, so the file of a namespace that is gone never applies to another; the state
/// directory is on tmpfs (`/run`), which a reboot, like the sysctl, resets.
pub struct HostSysctl {
    sysctl: Sysctl,
    old: Option<String>,
    file: Option<PathBuf>,
}

/// Default directory of the agent's state files ([`HostSysctl`]): `/run/tierproxy`
/// (tmpfs; the DaemonSet mounts an emptyDir there).
pub const DEFAULT_STATE_DIR: &str = "/run/tierproxy";

/// The calling thread's network namespace, as a string unique for the boot: its cookie
/// (`SO_NETNS_COOKIE`, Linux 5.14, include/uapi/asm-generic/socket.h), else the inode of
/// /proc/thread-self/ns/net (which a later namespace may reuse).
fn netns_id() -> Option<String> {
    const SO_NETNS_COOKIE: nix::libc::c_int = 71;
    let s = std::net::UdpSocket::bind("127.0.0.1:0")
        .or_else(|_| std::net::UdpSocket::bind("[::1]:0"))
        .ok();
    if let Some(s) = s {
        let mut cookie: u64 = 0;
        let mut len = std::mem::size_of::<u64>() as nix::libc::socklen_t;
        // SAFETY: `cookie` and `len` outlive the call and `len` is `cookie`'s size.
        let r = unsafe {
            nix::libc::getsockopt(
                std::os::fd::AsRawFd::as_raw_fd(&s),
                nix::libc::SOL_SOCKET,
                SO_NETNS_COOKIE,
                (&mut cookie as *mut u64).cast(),
                &mut len,
            )
        };
        if r == 0 {
            return Some(format!("cookie-{cookie}"));
        }
    }
    let link = std::fs::read_link("/proc/thread-self/ns/net").ok()?;
    let text = link.to_string_lossy();
    let inode = text.strip_prefix("net:[")?.strip_suffix(']')?;
    Some(format!("inode-{inode}"))
}

impl HostSysctl {
    /// Restores a value a crashed agent left in `state_dir` for this namespace, then, if
    /// `enable`, sets `sysctl` to 1 if it is not, remembering the old value there.
    /// Failures are logged (the agent runs on without it).
    pub fn start(state_dir: &std::path::Path, sysctl: Sysctl, enable: bool) -> HostSysctl {
        let (name, path) = (sysctl.name, sysctl.path());
        let file = netns_id().map(|id| state_dir.join(format!("{}.{id}", sysctl.leaf())));
        if let Some(f) = &file
            && let Ok(left) = std::fs::read_to_string(f)
        {
            let left = left.trim().to_string();
            match std::fs::write(&path, &left) {
                Ok(()) => {
                    tracing::warn!(
                        value = %left,
                        file = %f.display(),
                        "restored {name}, which an agent that did not exit cleanly left set"
                    );
                    let _ = std::fs::remove_file(f);
                }
                Err(e) => tracing::warn!(error = %e, "cannot restore {name}={left}"),
            }
        }
        let none = HostSysctl { sysctl, old: None, file: None };
        if !enable {
            return none;
        }
        let old = match std::fs::read_to_string(&path) {
            Ok(v) => v.trim().to_string(),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read {name}");
                return none;
            }
        };
        if old == "1" {
            return none;
        }
        // The old value first: a crash right after the write below must still find it.
        let file = file.filter(|f| {
            let saved = std::fs::create_dir_all(state_dir).and_then(|()| std::fs::write(f, &old));
            if let Err(e) = &saved {
                tracing::warn!(
                    error = %e,
                    file = %f.display(),
                    "cannot record {name}'s old value; a crash would leave it at 1"
                );
            }
            saved.is_ok()
        });
        match std::fs::write(&path, "1") {
            Ok(()) => {
                tracing::info!(was = %old, "set {name}=1 {}", sysctl.why);
                HostSysctl { sysctl, old: Some(old), file }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot set {name}=1");
                if let Some(f) = file {
                    let _ = std::fs::remove_file(f);
                }
                none
            }
        }
    }
}

impl Drop for HostSysctl {
    fn drop(&mut self) {
        let Some(old) = &self.old else { return };
        match std::fs::write(self.sysctl.path(), old) {
            Ok(()) => {
                if let Some(f) = &self.file {
                    let _ = std::fs::remove_file(f);
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot restore {}={old}", self.sysctl.name),
        }
    }
}

/// Raises the soft limit of open files to the hard limit (no capability needed) and
/// returns the limit in force: a proxied TCP connection holds two descriptors (and two
/// pipes, four more, while it moves bytes) and a UDP flow two, so the usual soft limit of
/// 1,024 would cap the proxy near 500 connections (getrlimit(2)). Unreadable: 1,024.
pub fn raise_fd_limit() -> usize {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let clamp = |n: u64| usize::try_from(n).unwrap_or(usize::MAX);
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => {
                tracing::debug!(from = soft, to = hard, "open files limit raised");
                clamp(hard)
            }
            Err(e) => {
                tracing::warn!(error = %e, soft, "cannot raise the open files limit");
                clamp(soft)
            }
        },
        Ok((soft, _)) => clamp(soft),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the open files limit");
            1024
        }
    }
}

/// What the open files limit allows: how many connections, UDP flows and relay pipes the
/// agent takes so that it meets its own limits before the kernel's `EMFILE` (issue #17:
/// with six descriptors per connection the agent broke at 3,334 connections under a
/// 20,000-descriptor limit while `--max-connections` said 65,536).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FdPlan {
    /// The open files limit (`RLIMIT_NOFILE`, soft, after raising it to the hard one).
    pub limit: usize,
    /// Most live proxied connections (two descriptors each).
    pub max_connections: usize,
    /// Most live UDP flows (two descriptors each).
    pub max_udp_flows: usize,
    /// Most relay pipes open at once (two descriptors each).
    pub max_pipes: usize,
}

impl FdPlan {
    /// Fits `connections`, `udp_flows` and `pipes` (two descriptors each) into `limit`
    /// less [`RESERVED_FDS`]. What does not fit is cut: pipes to at most an eighth of the
    /// descriptors available, connections and UDP flows to the rest, in the ratio asked.
    /// Each is at least 1.
    pub fn fit(limit: usize, connections: usize, udp_flows: usize, pipes: usize) -> FdPlan {
        let avail = limit.saturating_sub(RESERVED_FDS) / 2;
        if connections.saturating_add(udp_flows).saturating_add(pipes) <= avail {
            return FdPlan {
                limit,
                max_connections: connections,
                max_udp_flows: udp_flows,
                max_pipes: pipes,
            };
        }
        let max_pipes = pipes.min(avail / 8).max(1);
        let rest = avail.saturating_sub(max_pipes);
        let asked = connections.saturating_add(udp_flows).max(1);
        let max_connections = (rest as u128 * connections as u128 / asked as u128) as usize;
        let max_udp_flows = rest.saturating_sub(max_connections).min(udp_flows);
        FdPlan {
            limit,
            max_connections: max_connections.max(1),
            max_udp_flows: max_udp_flows.max(1),
            max_pipes,
        }
    }
}

/// The descriptor plan ([`FdPlan`]) and the relay's pipe budget ([`PipeBudget`]) for
/// `opts` under the open files limit `nofile`, logged: what the agent takes, and when that
/// is less than the options ask, which limit to raise.
fn plan_descriptors(opts: &AgentOptions, nofile: usize) -> (FdPlan, PipeBudget) {
    let mut budget = PipeBudget::for_process(DEFAULT_MAX_PIPES, opts.pipe_budget_percent);
    let plan = FdPlan::fit(nofile, opts.max_connections, opts.max_udp_flows, budget.max_pipes);
    budget.max_pipes = plan.max_pipes;
    if plan.max_connections < opts.max_connections || plan.max_udp_flows < opts.max_udp_flows {
        tracing::warn!(
            open_files_limit = nofile,
            max_connections = plan.max_connections,
            max_udp_flows = plan.max_udp_flows,
            max_pipes = plan.max_pipes,
            asked_connections = opts.max_connections,
            asked_udp_flows = opts.max_udp_flows,
            needed =
                2 * (opts.max_connections + opts.max_udp_flows + DEFAULT_MAX_PIPES) + RESERVED_FDS,
            "the open files limit is too low for --max-connections and --max-udp-flows; taking fewer (raise RLIMIT_NOFILE)"
        );
    } else {
        tracing::info!(
            open_files_limit = nofile,
            max_connections = plan.max_connections,
            max_udp_flows = plan.max_udp_flows,
            max_pipes = plan.max_pipes,
            "descriptors planned (2 per connection, UDP flow and pipe)"
        );
    }
    match budget.user_limit {
        Some(limit) => tracing::info!(
            pipe_bytes = budget.pipe_bytes,
            max_pipes = budget.max_pipes,
            user_pipe_budget = limit,
            share_percent = opts.pipe_budget_percent,
            "relay pipes sized within the per-user pipe budget (no CAP_SYS_RESOURCE or CAP_SYS_ADMIN)"
        ),
        None => tracing::info!(
            pipe_bytes = budget.pipe_bytes,
            max_pipes = budget.max_pipes,
            "relay pipes (privileged: no per-user pipe budget)"
        ),
    }
    (plan, budget)
}

/// Keeps only `keep` of the calling thread's capabilities: drops the others from the
/// bounding set (so no command the agent runs gets them back), then sets the inheritable,
/// effective and permitted sets to `keep` (what the process has of it). Threads started
/// afterwards inherit the result; threads started before keep theirs (the audit sinks and
/// the API-server thread, which make no pipes and run no commands). Source:
/// capabilities(7), "Capability bounding set" and "Transformation of capabilities during
/// execve()" (a root process's permitted set after exec is its inheritable set plus its
/// bounding set).
///
/// # Errors
/// A capability call failed (it needs CAP_SETPCAP to drop from the bounding set).
pub fn keep_only_capabilities(keep: &[caps::Capability]) -> anyhow::Result<()> {
    use caps::{CapSet, CapsHashSet};
    let permitted = caps::read(None, CapSet::Permitted).context("reading capabilities")?;
    let keep: CapsHashSet = keep.iter().copied().filter(|c| permitted.contains(c)).collect();
    for cap in caps::all() {
        if !keep.contains(&cap) && caps::has_cap(None, CapSet::Bounding, cap).unwrap_or(false) {
            caps::drop(None, CapSet::Bounding, cap)
                .with_context(|| format!("dropping {cap} from the bounding set"))?;
        }
    }
    caps::set(None, CapSet::Inheritable, &keep).context("setting the inheritable set")?;
    caps::set(None, CapSet::Effective, &keep).context("setting the effective set")?;
    caps::set(None, CapSet::Permitted, &keep).context("setting the permitted set")?;
    let mut names: Vec<String> = keep.iter().map(ToString::to_string).collect();
    names.sort();
    tracing::info!(kept = %names.join(","), "capabilities dropped to these");
    Ok(())
}

/// Moves the calling thread (the agent's main thread, before it starts any other) into
/// network namespace `ns`: a path, or a name under `/run/netns`.
fn enter_netns(ns: &std::path::Path) -> anyhow::Result<()> {
    let path = if ns.components().count() == 1 && !ns.is_absolute() {
        std::path::Path::new("/run/netns").join(ns)
    } else {
        ns.to_path_buf()
    };
    let f = std::fs::File::open(&path)
        .with_context(|| format!("opening network namespace {}", path.display()))?;
    nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWNET)
        .with_context(|| format!("entering network namespace {}", path.display()))?;
    Ok(())
}

/// The values read at each scrape: audit counters and queue depths, live connections,
/// kernel queue drops, the snapshot revision, decision cache hits.
/// What [`scraped`] reads at each scrape; the deciders and the pipe pool are set once
/// they exist.
struct Sources {
    auditor: Arc<Auditor>,
    registry: Arc<Registry>,
    decider: Arc<std::sync::OnceLock<Arc<Decider>>>,
    udp: Arc<udp::UdpStats>,
    drops: Arc<RulesetDrops>,
    pipes: Arc<std::sync::OnceLock<Arc<PipePool>>>,
    kube: Option<cluster::apiserver::ApiSource>,
    /// Whether the policy status writer leads (`None`: it does not run).
    leader: Option<Arc<cluster::status::LeaderState>>,
}

fn scraped(sources: Sources, config: &AuditConfig) -> Scraped {
    use std::sync::atomic::Ordering::Relaxed;
    let Sources { auditor, registry, decider, udp, drops, pipes, kube, leader } = sources;
    let sink_names: Vec<&'static str> = config.sinks.iter().map(|s| s.name()).collect();
    Scraped(Box::new(move || {
        let st = auditor.stats();
        let c = |name, help, labels: Vec<(&'static str, String)>, value| Sample {
            name,
            help,
            counter: true,
            labels,
            value,
        };
        let g =
            |name, help, labels, value| Sample { counter: false, ..c(name, help, labels, value) };
        let ev = "Audit events, by outcome: emitted, aggregated (folded into another deny's \
                  count), rate_limited_rule, rate_limited_node, dropped_queue (lossy, queue full)";
        let mut out: Vec<Sample> = [
            ("emitted", &st.emitted),
            ("aggregated", &st.aggregated),
            ("rate_limited_rule", &st.rate_limited_rule),
            ("rate_limited_node", &st.rate_limited_node),
            ("dropped_queue", &st.dropped_queue),
        ]
        .into_iter()
        .map(|(o, n)| c("audit_events", ev, vec![("outcome", o.to_string())], n.load(Relaxed)))
        .collect();
        out.extend([
            c(
                "audit_lossless_waits",
                "New-flow decisions that waited because an audit sink was full (lossless)",
                vec![],
                st.waits.load(Relaxed),
            ),
            g(
                "audit_queue_depth",
                "Audit records waiting for the audit thread",
                vec![],
                auditor.queue_depth() as u64,
            ),
            g(
                "connections_active",
                "Live proxied connections and UDP flows",
                vec![],
                registry.len() as u64,
            ),
            c(
                "udp_flows",
                "UDP flows opened by the proxy (--udp-path proxy)",
                vec![],
                udp.flows.load(Relaxed),
            ),
            c(
                "udp_datagrams_dropped",
                "UDP datagrams the proxy dropped: flow table full, flow setup failed, too \
                 large, or the other socket could not take them",
                vec![],
                udp.dropped.load(Relaxed),
            ),
        ]);
        let sk = "Audit events per sink, by outcome: exported, dropped_queue (lossy), failed";
        for ((s, name), depth) in st.sinks.iter().zip(&sink_names).zip(auditor.sink_depths()) {
            let l = |o: &str| vec![("sink", (*name).to_string()), ("outcome", o.to_string())];
            out.push(c("audit_sink_events", sk, l("exported"), s.exported.load(Relaxed)));
            out.push(c("audit_sink_events", sk, l("dropped_queue"), s.dropped_queue.load(Relaxed)));
            out.push(c("audit_sink_events", sk, l("failed"), s.failed.load(Relaxed)));
            out.push(c(
                "audit_sink_retries",
                "Failed exports retried (lossless)",
                vec![("sink", (*name).to_string())],
                s.retries.load(Relaxed),
            ));
            out.push(c(
                "audit_sink_timeouts",
                "Export attempts abandoned at their deadline with no answer (a hung collector)",
                vec![("sink", (*name).to_string())],
                s.timeouts.load(Relaxed),
            ));
            out.push(g(
                "audit_sink_queue_depth",
                "Audit events waiting for a sink",
                vec![("sink", (*name).to_string())],
                depth as u64,
            ));
        }
        if let Some(d) = decider.get() {
            let f = d.forwarded();
            out.extend([
                c(
                    "udp_forwarded_flows",
                    "UDP flows allowed on their first datagram (or by the kernel-side cache) \
                     and forwarded by the kernel (--udp-path kernel)",
                    vec![],
                    f.stats.flows.load(Relaxed),
                ),
                g(
                    "udp_forwarded_active",
                    "Kernel-forwarded UDP flows held for their end record now (those whose \
                     decision was audited, until their conntrack entry goes; at most \
                     --max-udp-flows)",
                    vec![],
                    f.len() as u64,
                ),
                c(
                    "udp_forwarded_cut",
                    "Conntrack entries of kernel-forwarded UDP flows deleted because a new \
                     snapshot denies them",
                    vec![],
                    f.stats.cut.load(Relaxed),
                ),
            ]);
        }
        let dr = "Packets the ruleset dropped, by reason: node_source (a node address as the \
                  source, not from the node itself), pod_source (from a local pod's interface, \
                  a source not routed back through it), stray_tcp (TCP of a pod flow that no \
                  decision allowed: not a SYN, new or invalid to conntrack); read every 10 s";
        for (reason, n) in [
            ("node_source", &drops.node_source),
            ("pod_source", &drops.pod_source),
            ("stray_tcp", &drops.stray_tcp),
        ] {
            out.push(c("ruleset_dropped", dr, vec![("reason", reason.into())], n.load(Relaxed)));
        }
        out.push(g(
            "pod_interfaces",
            "Interfaces of local pods whose sources are checked (the routes to their addresses)",
            vec![],
            drops.interfaces.load(Relaxed),
        ));
        out.push(g(
            "enforced_pods",
            "Addresses of pods on other nodes whose agent enforces: their TCP connections to \
             this node's pods are decided on the first packet and forwarded by the kernel, \
             not proxied again",
            vec![],
            drops.enforced.load(Relaxed),
        ));
        let lh = "Times the agent hit one of its limits, by limit: connections (--max-connections, \
                  new connections wait), udp_flows (--max-udp-flows: a new flow's datagram dropped on the \
                  proxy path, its end not reported on the kernel path), \
                  open_files (EMFILE/ENFILE), pipes (relay pipe budget: burst copied, or a pipe \
                  refused its size), accept_errors, nfqueue_overrun (an NFQUEUE reader fell \
                  behind), icmp_errors (ICMP errors passed on to UDP proxy clients per second), \
                  conntrack_events (conntrack destroy events lost: UDP flow ends not \
                  reported); each is logged at most once per 10 s";
        for (limit, hits) in crate::limits::LIMITS.each() {
            out.push(c("limit_hits", lh, vec![("limit", limit.into())], hits.get()));
        }
        if let Some(p) = pipes.get() {
            out.push(g(
                "relay_pipes_open",
                "Relay pipes open (leased or kept idle)",
                vec![],
                p.open() as u64,
            ));
            out.push(c(
                "relay_pipes_undersized",
                "Relay pipes the kernel refused their size (per-user pipe budget); used once",
                vec![],
                p.stats.undersized.load(Relaxed),
            ));
            out.push(c(
                "relay_copied_bursts",
                "Relay bursts copied through user space because no pipe could be had",
                vec![],
                p.stats.copied_bursts.load(Relaxed),
            ));
        }
        let tcp = crate::metrics::tcp_ext();
        for (name, help, v) in [
            (
                "tcp_syncookies_sent",
                "SYN cookies the node's kernel sent (a listener's SYN queue was full: TcpExt SyncookiesSent)",
                tcp.syncookies_sent,
            ),
            (
                "tcp_syncookies_received",
                "Connections completed by a SYN cookie (TcpExt SyncookiesRecv)",
                tcp.syncookies_recv,
            ),
            (
                "tcp_syncookies_failed",
                "ACKs whose SYN cookie did not check out (TcpExt SyncookiesFailed)",
                tcp.syncookies_failed,
            ),
            (
                "tcp_listen_overflows",
                "Connections dropped because a listener's accept queue was full (TcpExt ListenOverflows)",
                tcp.listen_overflows,
            ),
        ] {
            out.push(c(name, help, vec![], v));
        }
        let nq = "Packets the kernel dropped at an NFQUEUE, by reason: queue_full, undeliverable";
        for (q, full, undeliverable) in crate::metrics::nfqueue_drops() {
            out.push(c(
                "nfqueue_dropped",
                nq,
                vec![("queue", q.to_string()), ("reason", "queue_full".into())],
                full,
            ));
            out.push(c(
                "nfqueue_dropped",
                nq,
                vec![("queue", q.to_string()), ("reason", "undeliverable".into())],
                undeliverable,
            ));
        }
        if let Some(k) = &kube {
            out.push(g(
                "kube_stale_seconds",
                "Seconds some API-server watcher has been failing (0: all healthy); the \
                 snapshot in force may miss changes made since",
                vec![],
                k.stale_for().map_or(0, |d| d.as_secs()),
            ));
            out.push(c(
                "kube_watch_errors",
                "API-server watch errors (each retried with backoff)",
                vec![],
                k.errors(),
            ));
            for (kind, h) in k.health() {
                out.push(g(
                    "kube_resource_served",
                    "Whether the API server serves the resource (0: its CRD is not installed)",
                    vec![("resource", kind.plural().to_string())],
                    u64::from(h.initialized && !h.absent),
                ));
            }
        }
        if let Some(l) = &leader {
            out.push(g(
                "policy_status_leader",
                "1 while this agent holds the policy status Lease (writes status, Events and \
                 the last good policy versions); summed over the cluster, 1 (0 for at most a \
                 lease duration after a leader dies without releasing it)",
                vec![],
                u64::from(l.leading()),
            ));
        }
        if let Some(d) = decider.get() {
            out.push(g(
                "snapshot_revision",
                "Revision of the snapshot in force",
                vec![],
                d.current().snapshot.revision().0,
            ));
            out.push(c(
                "decision_cache_hits",
                "First packets decided from the cache",
                vec![],
                d.stats.cache_hits.load(Relaxed),
            ));
            out.push(c(
                "policy_change_cuts",
                "Live connections and UDP flows closed because a new snapshot denies them",
                vec![],
                d.stats.policy_cuts.load(Relaxed),
            ));
            out.push(c(
                "decisions_at_accept",
                "Connections and UDP flows the proxy decided as it took them, without a \
                 first-packet decision (a TCP SYN whose allowed class the kernel cached, a \
                 full queue failing open, a decision that aged out)",
                vec![],
                d.stats.decided_at_accept.load(Relaxed),
            ));
            out.push(c(
                "manifest_reload_errors",
                "Manifest changes that could not be used (the last good snapshot stayed)",
                vec![],
                d.stats.reload_errors.load(Relaxed),
            ));
        }
        out
    }))
}

/// Removes the ruleset when dropped (start-up failure, or the end of `run`), unless it is
/// to be kept.
struct Installed<'a> {
    backend: &'a dyn redirect::Backend,
    config: &'a RedirectConfig,
    keep: bool,
}

impl Drop for Installed<'_> {
    fn drop(&mut self) {
        if self.keep {
            tracing::info!("ruleset kept (keep rules on exit)");
            return;
        }
        match self.backend.remove(self.config) {
            Ok(()) => tracing::info!("ruleset removed"),
            Err(e) => tracing::error!(error = %e, "removing the ruleset failed"),
        }
    }
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        _ => {
            tracing::error!("cannot watch for SIGTERM/SIGINT; stopping on Ctrl-C only");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
