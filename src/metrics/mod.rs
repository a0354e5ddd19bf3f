//! Prometheus metrics and health endpoints of the agent.
//!
//! The data path updates pre-resolved counters ([`DataPathMetrics`]: one atomic add per
//! event, no label lookup); values that already exist elsewhere (audit counters, live
//! connections, kernel queue drops) are read at scrape time by a [`Scraped`] collector
//! ([`scrape`]).
//! [`serve`] answers `GET /metrics` (Prometheus text format), `/healthz` (the process
//! serves) and `/readyz` (the node is enforcing; its text names the stale API-server
//! resources, if any), and the routes the agent adds: the debug endpoints of
//! [`crate::debug`].
//!
//! Sources: issue #4 "Delivery" (the metric list); Prometheus exposition format;
//! `/proc/net/netfilter/nfnetlink_queue` columns (net/netfilter/nfnetlink_queue.c,
//! `seq_show`: queue, peer port id, queue total, copy mode, copy range, queue dropped,
//! user dropped, id sequence, 1).

pub mod scrape;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context as _;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::policy::compile::{Direction, Tier};
use crate::policy::eval::{Basis, Decision, Verdict};

type Labels = Vec<(&'static str, &'static str)>;

/// Counters the data path updates.
#[derive(Debug)]
pub struct DataPathMetrics {
    /// By `[direction][verdict][tier]` (verdicts as [`VERDICTS`], tiers as [`TIERS`]).
    directions: [[[Counter; TIERS.len()]; VERDICTS.len()]; 2],
    /// By verdict (as [`VERDICTS`]).
    flows: [Counter; VERDICTS.len()],
    /// Seconds to decide a first packet (cache and audit hand-over included).
    pub decision_seconds: Histogram,
    /// Proxied connections accepted.
    pub connections_opened: Counter,
    /// Live connections taken from the previous agent at a hand-over (issue #23; that
    /// agent counted them opened).
    pub connections_adopted: Counter,
    /// Live connections given to the next agent at a hand-over (issue #23; that agent
    /// counts their close).
    pub connections_handed_over: Counter,
    /// Proxied connections closed, by reason (as `CLOSE_REASONS`).
    closed: [Counter; 7],
    /// Bytes relayed client → server and server → client.
    pub bytes: [Counter; 2],
}

/// The `verdict` label values, by [`verdict_index`].
const VERDICTS: [Verdict; 3] = [Verdict::Allow, Verdict::Deny, Verdict::Reject];

/// Position of `v` in [`VERDICTS`].
fn verdict_index(v: Verdict) -> usize {
    match v {
        Verdict::Allow => 0,
        Verdict::Deny => 1,
        Verdict::Reject => 2,
    }
}

/// The `tier` label values: the tiers in [`Tier::ORDER`], then `default` (no tier
/// decided).
const TIERS: [&str; Tier::COUNT + 1] = {
    let mut out = ["default"; Tier::COUNT + 1];
    let mut i = 0;
    while i < Tier::COUNT {
        out[i] = Tier::ORDER[i].as_str();
        i += 1;
    }
    out
};
const CLOSE_REASONS: [crate::audit::CloseReason; 7] = {
    use crate::audit::CloseReason as R;
    [
        R::Normal,
        R::Reset,
        R::Timeout,
        R::PolicyChange,
        R::Shutdown,
        R::UpstreamUnreachable,
        R::ResourceLimit,
    ]
};

/// Position of the deciding tier in [`TIERS`]: isolation is the NetworkPolicy tier's; no
/// policy and the own node count as `default`.
fn tier_index(basis: &Basis) -> usize {
    match basis {
        Basis::Rule { tier, .. } => tier.index(),
        Basis::Isolated { .. } => Tier::NetworkPolicy.index(),
        Basis::NoPolicy | Basis::OwnNode => Tier::COUNT,
    }
}

impl DataPathMetrics {
    /// Counts one decided flow: each direction by verdict and deciding tier, the flow
    /// by verdict.
    pub fn decision(&self, d: &Decision) {
        for (dir, o) in [(Direction::Ingress, &d.ingress), (Direction::Egress, &d.egress)] {
            if let Some(o) = o {
                let v = verdict_index(o.verdict);
                let t = tier_index(&o.basis);
                self.directions[dir as usize][v][t].inc();
            }
        }
        self.flows[verdict_index(d.verdict)].inc();
    }

    /// Counts a closed connection.
    pub fn closed(&self, reason: crate::audit::CloseReason) {
        if let Some(i) = CLOSE_REASONS.iter().position(|r| *r == reason) {
            self.closed[i].inc();
        }
    }

    /// Counts bytes relayed to the server and to the client.
    pub fn relayed(&self, to_server: u64, to_client: u64) {
        self.bytes[0].inc_by(to_server);
        self.bytes[1].inc_by(to_client);
    }
}

/// The agent's metrics: a registry and the data path's counters in it.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// What the data path updates.
    pub data_path: Arc<DataPathMetrics>,
}

impl Metrics {
    /// A registry with every data-path metric and `scraped` (values read per scrape).
    pub fn new(scraped: impl prometheus_client::collector::Collector) -> Self {
        let mut registry = Registry::with_prefix("tierproxy");
        let directions: Family<Labels, Counter> = Family::default();
        let flows: Family<Labels, Counter> = Family::default();
        let closed: Family<Labels, Counter> = Family::default();
        let bytes: Family<Labels, Counter> = Family::default();
        let decision_seconds = Histogram::new(exponential_buckets(1e-7, 2.0, 20));
        let connections_opened = Counter::default();
        let connections_adopted = Counter::default();
        let connections_handed_over = Counter::default();
        let dir_counters = [Direction::Ingress, Direction::Egress].map(|dir| {
            VERDICTS.map(|verdict| {
                TIERS.map(|tier| {
                    directions
                        .get_or_create(&vec![
                            ("direction", dir.as_str()),
                            ("verdict", verdict.as_str()),
                            ("tier", tier),
                        ])
                        .clone()
                })
            })
        });
        let flow_counters =
            VERDICTS.map(|v| flows.get_or_create(&vec![("verdict", v.as_str())]).clone());
        let closed_counters =
            CLOSE_REASONS.map(|r| closed.get_or_create(&vec![("reason", r.as_str())]).clone());
        let byte_counters = ["to_server", "to_client"]
            .map(|d| bytes.get_or_create(&vec![("direction", d)]).clone());
        registry.register(
            "direction_decisions",
            "Decided directions of new flows, by direction, verdict and deciding tier",
            directions,
        );
        registry.register("decisions", "Decided new flows, by verdict", flows);
        registry.register(
            "decision_duration_seconds",
            "Time to decide a new flow's first packet (cache and audit hand-over included)",
            decision_seconds.clone(),
        );
        registry.register(
            "connections_opened",
            "Proxied connections accepted",
            connections_opened.clone(),
        );
        registry.register(
            "connections_adopted",
            "Live connections taken from the previous agent at a hand-over",
            connections_adopted.clone(),
        );
        registry.register(
            "connections_handed_over",
            "Live connections given to the next agent at a hand-over",
            connections_handed_over.clone(),
        );
        registry.register("connections_closed", "Proxied connections closed, by reason", closed);
        registry.register("relayed_bytes", "Bytes relayed, by direction", bytes);
        registry.register_collector(Box::new(scraped));
        Metrics {
            registry,
            data_path: Arc::new(DataPathMetrics {
                directions: dir_counters,
                flows: flow_counters,
                decision_seconds,
                connections_opened,
                connections_adopted,
                connections_handed_over,
                closed: closed_counters,
                bytes: byte_counters,
            }),
        }
    }

    /// The registry in the Prometheus text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// One value read at scrape time.
#[derive(Debug, Clone)]
pub struct Sample {
    /// Metric name without the `tierproxy_` prefix (counters without `_total`).
    pub name: &'static str,
    /// Help text.
    pub help: &'static str,
    /// Counter or gauge.
    pub counter: bool,
    /// Labels.
    pub labels: Vec<(&'static str, String)>,
    /// The value.
    pub value: u64,
}

/// A collector whose samples come from a closure run at each scrape.
pub struct Scraped(pub Box<dyn Fn() -> Vec<Sample> + Send + Sync>);

impl std::fmt::Debug for Scraped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Scraped")
    }
}

impl prometheus_client::collector::Collector for Scraped {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut samples = (self.0)();
        samples.sort_by_key(|s| s.name);
        let mut i = 0;
        while i < samples.len() {
            let j = i + samples[i..].iter().take_while(|s| s.name == samples[i].name).count();
            let first = &samples[i];
            // The registry adds its `tierproxy_` prefix.
            let ty = if first.counter { MetricType::Counter } else { MetricType::Gauge };
            let mut m = encoder.encode_descriptor(first.name, first.help, None, ty)?;
            for s in &samples[i..j] {
                let labels: Vec<(&str, &str)> =
                    s.labels.iter().map(|(k, v)| (*k, v.as_str())).collect();
                let f = m.encode_family(&labels)?;
                if s.counter {
                    ConstCounter::new(s.value).encode(f)?;
                } else {
                    ConstGauge::new(i64::try_from(s.value).unwrap_or(i64::MAX)).encode(f)?;
                }
            }
            i = j;
        }
        Ok(())
    }
}

/// Per kernel queue: (queue number, dropped because the queue was full, dropped because
/// the message could not be delivered to the reader), from
/// `/proc/net/netfilter/nfnetlink_queue` of the caller's network namespace.
pub fn nfqueue_drops() -> Vec<(u16, u64, u64)> {
    let Ok(text) = std::fs::read_to_string("/proc/net/netfilter/nfnetlink_queue") else {
        return Vec::new();
    };
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some((f.first()?.parse().ok()?, f.get(5)?.parse().ok()?, f.get(6)?.parse().ok()?))
        })
        .collect()
}

/// TCP counters of the calling thread's network namespace that tell about a SYN flood
/// (`TcpExt` of /proc/net/netstat, net/ipv4/proc.c); zeros where unreadable.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TcpExt {
    /// `SyncookiesSent`: SYNs answered with a cookie (a listener's SYN queue was full, or
    /// `tcp_syncookies=2`).
    pub syncookies_sent: u64,
    /// `SyncookiesRecv`: connections completed by a valid cookie.
    pub syncookies_recv: u64,
    /// `SyncookiesFailed`: ACKs that carried no valid cookie.
    pub syncookies_failed: u64,
    /// `ListenOverflows`: connections dropped because an accept queue was full.
    pub listen_overflows: u64,
}

/// Reads [`TcpExt`] from /proc/net/netstat.
pub fn tcp_ext() -> TcpExt {
    std::fs::read_to_string("/proc/net/netstat").map(|t| parse_tcp_ext(&t)).unwrap_or_default()
}

/// [`TcpExt`] of the text of /proc/net/netstat: a `TcpExt:` line of names, then one of
/// values (zeros for what is missing). Tests read another namespace's file with it.
pub fn parse_tcp_ext(text: &str) -> TcpExt {
    let mut lines = text.lines().filter(|l| l.starts_with("TcpExt:"));
    let (Some(names), Some(values)) = (lines.next(), lines.next()) else {
        return TcpExt::default();
    };
    let pairs: Vec<(&str, u64)> = names
        .split_whitespace()
        .zip(values.split_whitespace())
        .filter_map(|(n, v)| Some((n, v.parse().ok()?)))
        .collect();
    let get = |name: &str| pairs.iter().find(|(n, _)| *n == name).map_or(0, |(_, v)| *v);
    TcpExt {
        syncookies_sent: get("SyncookiesSent"),
        syncookies_recv: get("SyncookiesRecv"),
        syncookies_failed: get("SyncookiesFailed"),
        listen_overflows: get("ListenOverflows"),
    }
}

/// A listener on `addr` that the node's next agent can bind as well while this one still
/// serves (`SO_REUSEPORT`, socket(7); both must set it and run as the same user): during a
/// hand-over (issue #23) both agents run, and the next one must not fail to start because
/// the previous one holds the port. The previous agent closes its listener once it handed
/// over. Must be called inside a tokio runtime.
fn shared_listener(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let s = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM.nonblocking(),
        Some(socket2::Protocol::TCP),
    )?;
    s.set_reuse_address(true)?;
    s.set_reuse_port(true)?;
    s.bind(&addr.into())?;
    s.listen(1024)?;
    tokio::net::TcpListener::from_std(s.into())
}

/// Serves `/metrics`, `/healthz`, `/readyz` and the routes of `more` (the agent's debug
/// endpoints, [`crate::debug::router`]) on `addr` until the runtime stops; returns the
/// address bound (port 0 in `addr` takes a free one). `/readyz` answers 200 `ready` once
/// `ready` is set, else 503 `not enforcing yet`; either way followed by `detail`'s line if
/// it gives one (the agent's: which API-server resources are stale,
/// [`crate::cluster::apiserver::ApiSource::staleness`]). Handlers can read the peer's
/// address (`ConnectInfo<SocketAddr>`).
///
/// # Errors
/// The address cannot be bound.
pub async fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    ready: Arc<AtomicBool>,
    detail: impl Fn() -> Option<String> + Clone + Send + Sync + 'static,
    more: axum::Router,
) -> anyhow::Result<SocketAddr> {
    use axum::http::{StatusCode, header};
    let listener =
        shared_listener(addr).with_context(|| format!("binding the metrics address {addr}"))?;
    let bound = listener.local_addr().with_context(|| format!("the metrics address {addr}"))?;
    let app = axum::Router::new()
        .route(
            "/metrics",
            axum::routing::get(move || {
                let m = metrics.clone();
                async move {
                    (
                        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
                        m.encode(),
                    )
                }
            }),
        )
        .route("/healthz", axum::routing::get(|| async { "ok\n" }))
        .route(
            "/readyz",
            axum::routing::get(move || {
                let ready = ready.load(Ordering::Relaxed);
                let detail = detail();
                async move {
                    let (code, what) = if ready {
                        (StatusCode::OK, "ready")
                    } else {
                        (StatusCode::SERVICE_UNAVAILABLE, "not enforcing yet")
                    };
                    match detail {
                        Some(d) => (code, format!("{what}\n{d}\n")),
                        None => (code, format!("{what}\n")),
                    }
                }
            }),
        )
        .merge(more);
    tokio::spawn(async move {
        let app = app.into_make_service_with_connect_info::<SocketAddr>();
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "metrics server stopped");
        }
    });
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue #23: while an agent serves its metrics address, the next agent of the node
    /// binds it too (and is reachable there once the first closes its listener); a program
    /// that does not ask to share the port still cannot take it.
    #[tokio::test]
    async fn the_next_agent_binds_the_metrics_address_the_running_one_holds() {
        let first = shared_listener("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = first.local_addr().unwrap();
        let second = shared_listener(addr).expect("the next agent binds it too");
        let e = std::net::TcpListener::bind(addr).expect_err("a plain bind is refused");
        assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse);
        drop(first);
        let (accepted, connected) =
            tokio::join!(second.accept(), tokio::net::TcpStream::connect(addr));
        assert!(accepted.is_ok() && connected.is_ok());
    }

    /// `GET path` on `addr`: status code and body.
    async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).await.unwrap();
        let code = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_string();
        (code, body)
    }

    #[tokio::test]
    async fn readyz_says_what_is_stale_and_stays_ready() {
        let ready = Arc::new(AtomicBool::new(false));
        let stale = Arc::new(std::sync::Mutex::new(None::<String>));
        let s = stale.clone();
        let detail = move || s.lock().unwrap().clone();
        let metrics = Arc::new(Metrics::new(Scraped(Box::new(Vec::new))));
        let addr = serve(
            "127.0.0.1:0".parse().unwrap(),
            metrics,
            ready.clone(),
            detail,
            axum::Router::new(),
        )
        .await
        .unwrap();
        assert_eq!(get(addr, "/readyz").await, (503, "not enforcing yet\n".into()));
        ready.store(true, Ordering::Relaxed);
        assert_eq!(get(addr, "/readyz").await, (200, "ready\n".into()));
        *stale.lock().unwrap() = Some("stale: pods for 42 s (list: HTTP 503)".into());
        assert_eq!(
            get(addr, "/readyz").await,
            (200, "ready\nstale: pods for 42 s (list: HTTP 503)\n".into())
        );
    }

    #[test]
    fn tcp_ext_counters_are_read_by_name() {
        let text = "TcpExt: SyncookiesSent SyncookiesRecv SyncookiesFailed EmbryonicRsts ListenOverflows\n\
                    TcpExt: 12 7 1 0 3\n\
                    IpExt: InNoRoutes\nIpExt: 0\n";
        assert_eq!(
            parse_tcp_ext(text),
            TcpExt {
                syncookies_sent: 12,
                syncookies_recv: 7,
                syncookies_failed: 1,
                listen_overflows: 3
            }
        );
        assert_eq!(parse_tcp_ext("garbage"), TcpExt::default());
    }
}
