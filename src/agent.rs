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
//! alike on every node ([`cluster::builder`] validates each object once per version, admits,
//! compiles); what a build finds is logged once ([`ProblemLog`]).
//!
//! Shutdown: stop accepting, let live connections finish for the drain grace period, stop
//! the rest, then remove the ruleset (unless configured to keep it: with fail-closed
//! queues a node then stays closed while the agent is away).
//!
//! Hand-over (issue #23, `--handover-socket`): between steps 1 and 2 a starting agent asks
//! the running one, if any, for its NFQUEUE sockets, listeners, live connections and UDP
//! flows of the proxy path ([`crate::proxy::handover`]); it reads and serves them before
//! installing its ruleset, acknowledges, turns ready, and serves the socket for the agent
//! after it. The agent that handed over drains nothing, leaves the ruleset, the sysctls
//! and the Node's annotation to the next one, and idles until SIGTERM (a supervisor would
//! restart one that exited).
//!
//! Sources: issues #3, #5 and #6; DESIGN §3 (data path), §5 (shared state).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};

use crate::audit::{self, Auditor};
use crate::cluster::builder::{Builder, Level, ProblemLog, gather, needs_records};
use crate::cluster::{self, manifest};
use crate::config::{AgentOptions, KubeOptions};
use crate::config::{RedirectConfig, UdpPath};
use crate::host::{
    CONNTRACK_ACCT, HostSysctl, TCP_TW_REUSE, enter_netns, keep_only_capabilities, peak_rss_mib,
    plan_descriptors, raise_fd_limit, rss_mib, trim_heap,
};
use crate::metrics::Metrics;
use crate::metrics::scrape::{Sources, scraped};
use crate::policy::{Revision, Snapshot};
use crate::proxy::decider::{Current, Decider, DeciderLimits};
use crate::proxy::handover::{self, Giver};
use crate::proxy::queue::{self, QueueConfig};
use crate::proxy::registry::Registry;
use crate::proxy::reject::KernelRefusal;
use crate::proxy::relay::{PipePool, RelayConfig};
use crate::proxy::tcp::{self, ProxyConfig};
use crate::proxy::udp::{self, UdpConfig};
use crate::proxy::{conntrack, forwarded};
use crate::redirect::{self, RulesetSpec};

/// Packets each kernel queue holds while the reader is busy.
pub const QUEUE_MAX_LEN: u32 = 4096;

/// One in how many new flows of a cached UDP class the ruleset lets the agent see through
/// conntrack's new events ([`RulesetSpec::with_cached_udp_sample`]; issue #20): where the
/// backend can spare the others' events ([`redirect::Backend::spares_new_events`]) on the
/// kernel UDP path, audit's `--audit-allow-sample` (0 when no audit sink is configured:
/// nothing is audited), so the kernel samples the cached classes' flows for audit and the
/// agent reads only those it audits; 1 (every flow) elsewhere.
fn cached_udp_sample(opts: &AgentOptions, backend: &dyn redirect::Backend) -> u32 {
    if opts.redirect.udp_path != UdpPath::Kernel || !backend.spares_new_events() {
        1
    } else if opts.audit.sinks.is_empty() {
        0
    } else {
        opts.audit.defaults.allow_sample
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

/// One build of the node's snapshot.
#[derive(Debug)]
pub struct Built {
    /// What the deciders use.
    pub current: Current,
    /// Each policy's acceptance, for the status writer.
    pub report: cluster::status::Report,
    /// Objects the build validated ([`cluster::builder::Built::validated`]).
    pub validated: usize,
    /// Compiled in full or patched ([`cluster::builder::Built::pass`]).
    pub pass: crate::policy::compile::Pass,
}

/// Builds the node's snapshot from `loaded` as `revision` with `builder`
/// ([`cluster::builder`]), logs what the build found (once each, `log`) and adds the
/// node's audit plan.
///
/// # Errors
/// A file that could not be read or parsed, or a node missing from the Nodes. Invalid
/// objects are not errors: they are logged, left out or replaced by their record, and named
/// in [`Built::report`].
pub fn build(
    builder: &mut Builder,
    loaded: manifest::Loaded,
    node: &str,
    revision: Revision,
    audit_defaults: audit::Defaults,
    records: Option<&cluster::lastgood::Records>,
    log: &mut ProblemLog,
) -> anyhow::Result<Built> {
    let built = builder.build(loaded, revision, records)?;
    let mut lines = built.lines;
    let snapshot = Arc::new(built.snapshot);
    let Some(node_id) = snapshot.find_node(node) else {
        log.log(lines);
        bail!("node {node:?} is not among the Nodes (manifests, API server)");
    };
    let (plan, errors) = audit::Selection::new(&snapshot, audit_defaults);
    lines.extend(errors.into_iter().map(|e| (Level::Warn, e.to_string())));
    log.log(lines);
    let current = Current { snapshot, node: node_id, audit: plan, problems: built.problems.into() };
    Ok(Built { current, report: built.report, validated: built.validated, pass: built.pass })
}

/// What the agent would install for `opts`, without touching the node: the backend, why
/// it was chosen, and the exact input of every command ([`redirect::Backend::render`]).
///
/// # Errors
/// Invalid configuration, manifests that cannot be read, a node missing from them.
pub fn dry_run(opts: &AgentOptions) -> anyhow::Result<String> {
    opts.validate().context("configuration")?;
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
        &mut Builder::new(),
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
    let spec = spec.with_cached_udp_sample(cached_udp_sample(opts, &*selection.backend));
    Ok(format!(
        "# backend: {} ({})\n{}",
        selection.backend.name(),
        selection.reason,
        selection.backend.render(&spec)
    ))
}

/// Runs the agent until SIGTERM or SIGINT, or until a queue reader gives up.
///
/// # Errors
/// Start-up failures (manifests, queues, listeners, ruleset), each naming what failed. The
/// ruleset is removed again if start-up fails after installing it. A queue reader that
/// gave up ([`queue::QueueFailed`]) after the agent stopped as on SIGTERM (drained, the
/// ruleset removed unless kept, the sysctls restored).
pub fn run(opts: AgentOptions) -> anyhow::Result<()> {
    opts.validate().context("configuration")?;
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
    let mut tw_reuse = HostSysctl::start(&opts.state_dir, TCP_TW_REUSE, opts.tcp_tw_reuse);
    let udp_kernel = opts.redirect.udp_path == UdpPath::Kernel;
    let mut ct_acct =
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
    let runtime = runtime(opts.busy_poll)?;
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
    // Live change: the manifests are watched (and the API server, by the watchers); each
    // change becomes a new snapshot. Watched before they are first read: a change written
    // while the agent starts (a `lab upgrade` racing a `lab apply`) queues a trigger, which
    // the reloader, once it runs, compares against what was read. Watched only once it
    // enforced, such a change was never applied (issue #23).
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
    let initial_fingerprint = manifest::fingerprint(&opts.manifests);
    let initial_generation = kube.as_ref().map_or(0, |k| k.source.generation());
    let initial_records = kube.as_ref().map_or(0, |k| k.records.version());
    let mut problem_log = ProblemLog::default();
    let mut builder = Builder::new();
    let built = build(
        &mut builder,
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
    let cached_udp_sample = cached_udp_sample(&opts, &*backend);
    let spec = RulesetSpec::new(opts.redirect.clone(), local, node_addrs)
        .context("redirect configuration")?
        .with_pod_interfaces(interfaces)
        .with_enforced_pods(enforced)
        .with_cached_udp_sample(cached_udp_sample);
    tracing::info!(
        enforced_pods = spec.enforced_pods().len(),
        "pods on other enforcing nodes: their connections here are decided on the first packet, not proxied again"
    );
    let decider = Arc::new(
        Decider::new(
            current,
            // Kernel-forwarded flows hold no descriptor: the option alone bounds them. On the
            // proxy path no conntrack event ends them: none is tracked.
            DeciderLimits {
                forwarded_flows: if udp_kernel { opts.max_udp_flows } else { 0 },
                ..DeciderLimits::default()
            },
            auditor.clone(),
            metrics.data_path.clone(),
        )
        .with_cached_udp_sample(cached_udp_sample),
    );
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
        // The proxy path: the kernel forwards only UDP to the node's own addresses (a
        // hostNetwork server, a node port), marked by rule 5; a new snapshot cuts those it
        // denies by their conntrack entries, where ctnetlink is there (no end records:
        // nothing tracks them).
        match Sweeper::open() {
            Ok(s) => Some(s.only(opts.redirect.route_mark)),
            Err(e) => {
                tracing::warn!(error = %e, "no ctnetlink: UDP flows to the node's own addresses (hostNetwork servers, node ports) are not cut by a policy change");
                None
            }
        }
    };
    let r = &opts.redirect;
    // Armed once this agent's ruleset, with the refusal chains, is installed.
    let kernel_refusal = backend.refuses().then(|| KernelRefusal::new(r.reject_mark));
    let queue_activity = queue::QueueActivity::default();
    // A reader that gives up is reported here; the agent then stops as on SIGTERM, its
    // guards run, and `run` returns the failure (exit status 70, `QueueFailed::EXIT_CODE`).
    let (fatal, mut queue_failed) = tokio::sync::mpsc::unbounded_channel();
    let queue_config = QueueConfig {
        first: r.queue_first,
        count: r.queue_count,
        decided_value: r.decided_mark.value,
        decided_mask: r.decided_mark.mask,
        reject_mark: r.reject_mark,
        fail_open: r.queue_bypass,
        max_len: QUEUE_MAX_LEN,
        udp_kernel,
        refusal_mark: r.bypass_mark.value,
        tproxy_mark: r.route_mark,
        kernel_refusal: kernel_refusal.clone(),
    };
    // Issue #23: the running agent, if any, hands its queues, listeners, connections and
    // (`--udp-path proxy`) UDP flows over now; from here on this agent must serve them
    // without delay.
    let handover_socket = opts.handover_socket.as_ref();
    let giver = handover_socket.map(|_| {
        Arc::new(Giver::new(queue::queue_count(&queue_config)).with_udp_proxy(!udp_kernel))
    });
    let mut taken = handover_socket.and_then(|path| take_over(path));
    queue::start(
        queue_config,
        decider.clone(),
        &queue_activity,
        &fatal,
        giver.clone(),
        taken.as_mut().map(|t| std::mem::take(&mut t.queues)).unwrap_or_default(),
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
        handover: giver.clone(),
    };
    let addrs = [
        SocketAddr::new(IpAddr::V4(r.tproxy_addr_v4), r.tproxy_port),
        SocketAddr::new(IpAddr::V6(r.tproxy_addr_v6), r.tproxy_port),
    ];
    // The listeners of TCP between local pods, marked (`RedirectConfig::local_pods_port`;
    // validated: the port exists). A previous agent that had none hands over only the two.
    let local_port = r.local_pods_port().unwrap_or(r.tproxy_port);
    let local_addrs = addrs.map(|a| SocketAddr::new(a.ip(), local_port));
    let tcp_addrs = [addrs[0], local_addrs[0], addrs[1], local_addrs[1]];
    let handed_listeners = taken.as_mut().map(|t| std::mem::take(&mut t.listeners));
    let listeners = runtime.block_on(async {
        let mark = r.bypass_mark.value;
        reuse_or_bind(&tcp_addrs, handed_listeners, tokio::net::TcpListener::from_std, |a| {
            tcp::bind(a, |addr| local_addrs.contains(&addr).then_some(mark))
        })
    })?;
    let adopted = taken.as_mut().map(|t| std::mem::take(&mut t.connections)).unwrap_or_default();
    let handed_udp = taken.as_mut().map(|t| std::mem::take(&mut t.udp_listeners));
    // On the kernel path no UDP listener: one handed over (the previous agent relayed UDP
    // on the proxy path) is closed; its flows are relayed on until they end.
    let udp_addrs: &[SocketAddr] = if udp_kernel { &[] } else { &addrs };
    let udp_listeners = runtime.block_on(async {
        reuse_or_bind(udp_addrs, handed_udp, tokio::net::UdpSocket::from_std, udp::bind)
    })?;
    let adopted_udp = taken.as_mut().map(|t| std::mem::take(&mut t.udp_flows)).unwrap_or_default();
    let udp_config = UdpConfig {
        bypass_mark: r.bypass_mark.value,
        preserve_source: opts.preserve_source,
        local_addrs: proxy.local_addrs.clone(),
        idle_timeout: opts.udp_idle_timeout,
        max_flows: fds.max_udp_flows,
        handover: giver.clone(),
    };
    // Serving starts now, before the ruleset is installed: with no previous agent nothing
    // reaches the listeners before it is, and after a hand-over the handed-over connections
    // resume and the handed-over listeners accept at once, while the previous agent's
    // ruleset (the same) stays in force (issue #23: the longest stall of a live connection).
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let udp_serving = runtime.spawn(udp::serve(
        udp_listeners,
        udp_config,
        decider.clone(),
        registry.clone(),
        udp_stats.clone(),
        stop_rx.clone(),
        adopted_udp,
    ));
    let serving = runtime.spawn(tcp::serve(
        listeners,
        proxy,
        decider.clone(),
        registry.clone(),
        stop_rx,
        adopted,
    ));

    let handed_over_to_us = taken.is_some();
    if let Some(t) = taken.take() {
        // The queues, listeners and connections are this agent's now (its readers read
        // the queues, its relays resume): the previous agent retires. Acked before the
        // ruleset and the sweep, which take their time; a previous agent not acked in
        // time would read the queues again beside this one, so a failed ack stops this
        // agent (its readers must not go on reading them).
        t.ack().context("acknowledging the hand-over to the previous agent")?;
        tracing::info!("hand-over acknowledged; the previous agent retires");
    }

    // The guard first: an apply that fails half-way is cleaned up too. A ruleset taken
    // over is kept whatever happens: it was the previous agent's, and removing it would
    // leave the node unenforced.
    let mut installed = Installed {
        backend: &*backend,
        config: r,
        keep: r.keep_rules_on_exit || handed_over_to_us,
    };
    backend.apply(&spec).with_context(|| format!("installing the {} ruleset", backend.name()))?;
    if let Some(k) = &kernel_refusal {
        k.arm();
    }
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
    // `manifests`: which contents this first snapshot was built from (`lab apply` tells an
    // agent that read its change from one that read the contents before it).
    tracing::info!(
        node = %opts.node,
        audit = auditor.enabled(),
        manifests = %manifest::FingerprintHex(initial_fingerprint),
        "enforcing"
    );

    // The reloader ends when every sender is gone: the manifest forwarder's (when the
    // watch is dropped), the API-server side's (when it stops), and this one.
    drop(triggers);
    let failed = std::thread::scope(|scope| {
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
            builder,
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
        let failed = runtime.block_on(async {
            if let (Some(g), Some(path)) = (&giver, handover_socket) {
                // For the next agent; replaces the previous agent's socket file.
                if let Err(e) = g.serve(path) {
                    tracing::error!(error = %e, path = %path.display(), "cannot serve the hand-over socket: the next agent will start without a hand-over");
                }
            }
            let mut serving = serving;
            let (failed, mut served) = tokio::select! {
                () = wait_for_signal() => (None, None),
                Some(failed) = queue_failed.recv() => (Some(failed), None),
                served = &mut serving => (None, served.ok()),
            };
            if let Some(g) = giver.as_ref().filter(|g| served.is_none() && g.committed()) {
                // Stopped during a hand-over: the next agent may hold the queues, listeners
                // and connections already; see it through rather than drain. One that fails
                // ends in the drain below.
                tracing::info!("stop asked during a hand-over: finishing it first");
                tokio::select! {
                    s = &mut serving => served = s.ok(),
                    outcome = g.outcome() => {
                        if outcome == handover::Outcome::Completed {
                            served = (&mut serving).await.ok();
                        }
                    }
                }
            }
            let handed_over = served == Some(tcp::Served::HandedOver);
            // Not ready from here on: a load balancer or probe stops counting on this node,
            // and the other nodes proxy this node's pods' connections again.
            ready.store(false, std::sync::atomic::Ordering::Relaxed);
            if handed_over {
                // The next agent enforces and keeps the Node's annotation.
                tracing::info!("handed over to the next agent: exiting without a drain");
            } else {
                if let Some(k) = &kube {
                    k.set_enforcing(false);
                }
                tracing::info!("shutting down: no new connections; draining");
            }
            let _ = stop_tx.send(true);
            if served.is_none() {
                served = serving.await.ok();
            }
            let _ = udp_serving.await;
            let late = !handed_over && served == Some(tcp::Served::HandedOver);
            if late {
                // The hand-over completed as the stop came: what was not undone yet is
                // left to the next agent (the Node's annotation may be gone already: the
                // other nodes then proxy this node's pods' connections once more, until
                // the next agent's restart announces it again).
                tracing::warn!("handed over while stopping: leaving the ruleset and sysctls to the next agent");
            }
            (failed, handed_over || late)
        });
        // Ends the watch and the API-server side; the reloader's channel closes and it
        // returns.
        drop(watch);
        if let Some(k) = &kube {
            if failed.1 {
                // The next agent enforces: the Node's annotation stays.
                k.hand_over();
            }
            k.stop();
        }
        failed
    });
    let (failed, handed_over) = failed;
    if handed_over {
        // The next agent owns the ruleset and the sysctls now, and reports the
        // kernel-forwarded UDP flows' ends.
        installed.keep = true;
        tw_reuse.hand_over();
        ct_acct.hand_over();
    } else if udp_kernel {
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
    if handed_over {
        // Everything this agent served is the next one's; its runtime (the metrics
        // endpoint among it) goes. It stays a process until told to stop: one that exited
        // would be restarted by its supervisor (a DaemonSet's pod restarts its container)
        // and take everything back.
        drop(runtime);
        if STOP_SIGNALLED.load(std::sync::atomic::Ordering::SeqCst) {
            tracing::info!("handed over; stopped during the hand-over: exiting");
        } else {
            tracing::info!("handed over: idle until SIGTERM");
        }
        let idle = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        idle.block_on(wait_for_signal());
    }
    match failed {
        Some(failed) => Err(failed.into()),
        None => Ok(()),
    }
}

/// Asks the agent serving the hand-over socket at `path` for its queues, listeners, live
/// connections and UDP flows (issue #23). `None` when there is none, when it refuses (no
/// common protocol version, or UDP flows this one's version cannot take: it drains when
/// stopped) or when the exchange fails; each is logged.
fn take_over(path: &std::path::Path) -> Option<handover::Taken> {
    match handover::take(path) {
        Ok(handover::Take::Nobody) => {
            tracing::info!(path = %path.display(), "no agent to take over from");
            None
        }
        Ok(handover::Take::Refused(reason)) => {
            tracing::warn!(%reason, "the running agent refused the hand-over: starting without; its connections are drained when it stops");
            None
        }
        Ok(handover::Take::Taken(t)) => {
            tracing::info!(
                version = t.version,
                queues = t.queues.len(),
                listeners = t.listeners.len(),
                connections = t.connections.len(),
                udp_listeners = t.udp_listeners.len(),
                udp_flows = t.udp_flows.len(),
                "took over from the running agent"
            );
            Some(t)
        }
        Err(e) => {
            tracing::warn!(error = %e, "hand-over from the running agent failed: starting without");
            None
        }
    }
}

/// The transparent listeners (TCP or UDP) on `addrs`: the previous agent's where it
/// handed one over for that address (issue #23; registered with the runtime by `adopt`),
/// else bound anew by `bind` ([`tcp::bind`], [`udp::bind`]). A handed-over listener for an
/// address this agent does not listen on is closed, with a warning.
///
/// # Errors
/// When a handed-over listener cannot be registered, or `bind` fails.
fn reuse_or_bind<S, L>(
    addrs: &[SocketAddr],
    handed: Option<Vec<(SocketAddr, S)>>,
    adopt: impl Fn(S) -> std::io::Result<L>,
    bind: impl FnOnce(&[SocketAddr]) -> anyhow::Result<Vec<L>>,
) -> anyhow::Result<Vec<L>> {
    let mut handed = handed.unwrap_or_default();
    let mut out = Vec::new();
    let mut unbound = Vec::new();
    for &addr in addrs {
        match handed.iter().position(|(a, _)| *a == addr) {
            Some(i) => {
                let (_, l) = handed.swap_remove(i);
                out.push(adopt(l).with_context(|| format!("the handed-over listener on {addr}"))?);
            }
            None => unbound.push(addr),
        }
    }
    for (addr, _) in handed {
        tracing::warn!(%addr, "the previous agent handed over a listener this agent does not use: closed");
    }
    if !unbound.is_empty() {
        out.extend(bind(&unbound)?);
    }
    Ok(out)
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
    /// This agent handed over to the next one (issue #23), which enforces now: the Node's
    /// annotation is left as it is (the announcer ends without a write when its channel
    /// closes).
    fn hand_over(&self) {
        drop(self.enforcing.lock().unwrap_or_else(|e| e.into_inner()).take());
    }

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
    /// The snapshot builder (validation results carried from build to build).
    builder: Builder,
    /// The ruleset's drop counters and pod interfaces, as last read.
    drops: &'a RulesetDrops,
    /// When [`Reloader::tick`] last ran.
    ticked: std::time::Instant,
    /// The queue readers' batches, for emptying the kernel-side cache of allowed classes.
    queue_activity: &'a queue::QueueActivity,
    /// Kernel-forwarded UDP flows' sweeps ([`forwarded::sweep`]); on the proxy path, of
    /// the flows to the node's own addresses only, and `None` without ctnetlink there.
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
    /// The connection mark an entry must carry to be swept (the proxy path's flows to the
    /// node, [`Sweeper::only`]); `None`: every UDP entry of zone 0.
    only: Option<crate::config::Mark>,
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
            only: None,
        })
    }

    /// This sweeper, for entries whose connection mark carries `mark` only (see
    /// [`forwarded::sweep`]).
    pub fn only(mut self, mark: crate::config::Mark) -> Sweeper {
        self.only = Some(mark);
        self
    }

    /// One [`forwarded::sweep`], logged: with `redecide`, after a new snapshot (every live
    /// flow decided again, the denied ones' entries deleted); without, to forget flows that
    /// never started. Returns how many entries it deleted.
    pub fn sweep(&mut self, decider: &Decider, redecide: bool) -> usize {
        self.swept = std::time::Instant::now();
        self.lost =
            decider.forwarded().stats.events_lost.load(std::sync::atomic::Ordering::Relaxed);
        match forwarded::sweep(decider, &mut self.dump, &mut self.delete, redecide, self.only) {
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
    /// Rule 6's stray TCP drop and rule 3's untracked TCP between local pods handed to the
    /// listener (packets).
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
            if self.decider.retired() {
                // Handed over (issue #23): the ruleset and the live flows are the next
                // agent's; a write of this agent's (an older layout, a staler snapshot)
                // would undo its work.
                return;
            }
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
        if self.decider.retired() {
            return;
        }
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
                "TCP packets of pod flows belonged to no allowed connection (scans, stale segments); dropped, or between local pods reset or discarded by the listener",
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
        if self.decider.retired() {
            return;
        }
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
            &mut self.builder,
            gather(&self.opts.manifests, self.kube.map(|k| &k.source)),
            &self.opts.node,
            next,
            self.opts.audit.defaults,
            self.kube.map(|k| k.records.records()).as_ref(),
            &mut self.problem_log,
        );
        let (current, validated, pass) = match loaded {
            Ok(b) => {
                self.needs_records = needs_records(&b.report);
                if let Some(k) = self.kube {
                    k.reports.send_replace(Arc::new(b.report));
                }
                (b.current, b.validated, b.pass)
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
            Ok(s) => s
                .with_enforced_pods(enforced)
                .with_cached_udp_sample(self.decider.cached_udp_sample()),
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
            validated,
            compile = %pass,
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

/// Set once SIGTERM or SIGINT has come, at any time after the first [`wait_for_signal`]:
/// a tokio listener sees only the signals that come while it exists, and the agent has
/// two in turn (the serving runtime's, then the idle one's after a hand-over). Without
/// it, a stop asked during a hand-over was taken by the first and the agent then idled
/// until a second one (review finding 18 of issue #23).
static STOP_SIGNALLED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Records SIGTERM and SIGINT in [`STOP_SIGNALLED`] from now on (once per process), beside
/// tokio's own handlers (both are actions of `signal-hook-registry`, which runs every
/// action registered for a signal).
fn record_stop_signals() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        for sig in [nix::libc::SIGTERM, nix::libc::SIGINT] {
            // SAFETY: the action only stores to an atomic, which is async-signal-safe.
            let registered = unsafe {
                signal_hook_registry::register(sig, || {
                    STOP_SIGNALLED.store(true, std::sync::atomic::Ordering::SeqCst)
                })
            };
            if let Err(e) = registered {
                tracing::warn!(error = %e, signal = sig, "cannot record stop signals; a stop during a hand-over then needs a second one");
            }
        }
    });
}

/// Returns when SIGTERM or SIGINT comes, or at once when one came already since the first
/// call ([`STOP_SIGNALLED`]).
async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    record_stop_signals();
    match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(mut term), Ok(mut int)) => {
            // A stop that came before these listeners: one taken by an earlier wait (a stop
            // during a hand-over, taken by the serving runtime before the agent idles), or
            // one that came between two waits, which no listener saw.
            if STOP_SIGNALLED.load(std::sync::atomic::Ordering::SeqCst) {
                return;
            }
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

/// The agent's runtime: tokio's multi-threaded one, and with a non-zero `busy_poll` its
/// workers poll its epoll instance for up to that long before they park
/// ([`crate::proxy::busy_poll`]); where it is not found, busy polling stays off and a
/// warning says why.
///
/// # Errors
/// The runtime cannot start (threads, an epoll instance, an eventfd).
fn runtime(busy_poll: Duration) -> anyhow::Result<tokio::runtime::Runtime> {
    use crate::proxy::busy_poll::{self, BusyPoll};
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.enable_all().thread_name("tierproxy");
    if busy_poll.is_zero() {
        return builder.build().context("starting the async runtime");
    }
    let spin: Arc<std::sync::OnceLock<BusyPoll>> = Arc::default();
    let on_park = spin.clone();
    builder.on_thread_park(move || {
        if let Some(b) = on_park.get() {
            b.spin();
        }
    });
    let before = busy_poll::epoll_fds();
    let runtime = builder.build().context("starting the async runtime")?;
    let found = match (before, busy_poll::epoll_fds()) {
        (Ok(before), Ok(after)) => BusyPoll::find(&before, &after, busy_poll),
        (Err(e), _) | (_, Err(e)) => Err(format!("cannot list /proc/self/fd: {e}")),
    };
    match found {
        Ok(b) => {
            let us = b.budget().as_micros() as u64;
            tracing::info!(budget_us = us, "busy polling before a runtime worker parks");
            busy_poll::STATS.budget_us.store(us, std::sync::atomic::Ordering::Relaxed);
            let _ = spin.set(b);
        }
        Err(why) => tracing::warn!(%why, "--busy-poll-us: busy polling stays off"),
    }
    Ok(runtime)
}
