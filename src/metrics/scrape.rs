//! The values the agent's `/metrics` reads at each scrape ([`scraped`]): audit counters
//! and queue depths, live connections and UDP flows, kernel queue and ruleset drops, the
//! snapshot revision, decision cache hits, the API-server watchers and the status writer.
//! Values that exist elsewhere are read where they live rather than copied into counters
//! on the data path (module docs of [`super`]).

use std::sync::Arc;

use super::{Sample, Scraped};
use crate::agent::RulesetDrops;
use crate::audit::{AuditConfig, Auditor};
use crate::cluster;
use crate::proxy::decider::Decider;
use crate::proxy::registry::Registry;
use crate::proxy::relay::PipePool;
use crate::proxy::udp;

/// What [`scraped`] reads at each scrape; the deciders and the pipe pool are set once
/// they exist.
pub struct Sources {
    /// Audit counters and queue depths.
    pub auditor: Arc<Auditor>,
    /// Live connections.
    pub registry: Arc<Registry>,
    /// Decisions, caches, reloads (set once the first snapshot is built).
    pub decider: Arc<std::sync::OnceLock<Arc<Decider>>>,
    /// The UDP proxy path's flows.
    pub udp: Arc<udp::UdpStats>,
    /// The ruleset's drop counters.
    pub drops: Arc<RulesetDrops>,
    /// Relay pipes (set once the relay starts).
    pub pipes: Arc<std::sync::OnceLock<Arc<PipePool>>>,
    /// The API-server watchers, if any.
    pub kube: Option<cluster::apiserver::ApiSource>,
    /// Whether the policy status writer leads (`None`: it does not run).
    pub leader: Option<Arc<cluster::status::LeaderState>>,
}

/// The collector that reads `sources` at each scrape; `config` names the audit sinks.
pub fn scraped(sources: Sources, config: &AuditConfig) -> Scraped {
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
                    "UDP flows allowed on their first datagram (or by the kernel-side cache; \
                     a cached flow whose new conntrack event was spared is counted at its \
                     end) and forwarded by the kernel (--udp-path kernel)",
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
                c(
                    "conntrack_event_datagrams",
                    "Datagrams of conntrack new and destroy events of UDP entries read (one \
                     event each; --udp-path kernel)",
                    vec![],
                    f.stats.event_datagrams.load(Relaxed),
                ),
                c(
                    "conntrack_event_batches",
                    "Times the conntrack event reader woke and read the events queued by then \
                     (it pauses between batches); datagrams over batches is the events a \
                     wake-up took",
                    vec![],
                    f.stats.event_batches.load(Relaxed),
                ),
            ]);
        }
        let dr = "Packets the ruleset dropped, by reason: node_source (a node address as the \
                  source, not from the node itself), pod_source (from a local pod's interface, \
                  a source not routed back through it), stray_tcp (TCP of a pod flow that no \
                  decision allowed: not a SYN, new or invalid to conntrack; or, untracked \
                  between two local pods, no socket's, handed to the listener, which resets \
                  or discards it and completes a SYN cookie's ACK); read every 10 s";
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
                  reported), rejects (refusals of rejected flows per second: dropped \
                  unanswered); each is logged at most once per 10 s";
        for (limit, hits) in crate::limits::LIMITS.each() {
            out.push(c("limit_hits", lh, vec![("limit", limit.into())], hits.get()));
        }
        let bp = &crate::proxy::busy_poll::STATS;
        if bp.budget_us.load(Relaxed) > 0 {
            let help = "Busy-poll spins before a runtime worker parked (--busy-poll-us), by \
                        outcome: ready (the runtime had work within the budget: a wake-up \
                        saved), exhausted (the whole budget spun, then the worker parked)";
            for (outcome, n) in [("ready", &bp.ready), ("exhausted", &bp.exhausted)] {
                out.push(c(
                    "busy_poll_spins",
                    help,
                    vec![("outcome", outcome.into())],
                    n.load(Relaxed),
                ));
            }
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
                    vec![("resource", kind.resource().to_string())],
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
            for a in crate::proxy::reject::Answer::ALL {
                out.push(c(
                    "reject_answers",
                    "Refusals sent to the clients of rejected flows (an Antrea Reject rule), by \
                     answer: tcp_reset, icmp_prohibited (ICMP/ICMPv6 administratively \
                     prohibited, for UDP), sctp_abort",
                    vec![("answer", a.as_str().into())],
                    d.stats.refusals[a.index()].load(Relaxed),
                ));
            }
            out.push(c(
                "reject_unanswered",
                "Rejected packets dropped without a refusal (their clients time out): over \
                 the rate limit (limit_hits{limit=\"rejects\"}), a packet its protocol never \
                 answers, or a send that failed",
                vec![],
                d.stats.refusals_unsent.load(Relaxed),
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
