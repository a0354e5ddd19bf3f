//! Where audit events go: OTLP (gRPC or HTTP/protobuf, encoded and sent by [`super::otlp`])
//! and JSON Lines (stdout, or a file rotated by size).
//!
//! Each sink runs on its own thread behind its own queue (bounded by the pipeline's
//! worker), so a slow or stuck sink never holds up another. The OTLP sink batches records
//! (up to [`OtlpConfig::batch_size`], or what arrived within [`OtlpConfig::batch_delay`]).
//! Each export attempt has a deadline ([`otlp::Target::timeout`]): an attempt that gets no
//! answer by then is abandoned and counts as failed, so a collector that accepts
//! connections and never answers is handled as one that is down. The sink counts every
//! batch it gives up on (lossy: after one retry), and never gives up in lossless mode
//! before the flush deadline; once that has passed it gives up on what is left without
//! trying.
//!
//! Sources: OpenTelemetry Protocol Exporter specification (`OTEL_EXPORTER_OTLP_ENDPOINT`,
//! `_PROTOCOL`, `_HEADERS`, `_COMPRESSION`, `_TIMEOUT`, `_CERTIFICATE`, their `_LOGS_`
//! variants; default protocol `http/protobuf`; HTTP path `/v1/logs`).

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use crossbeam_channel::{Receiver, RecvTimeoutError};

use super::Mode;
use super::event::{self, Event};
use super::otlp;
use super::pipeline::{Gate, SinkStats};

/// OTLP transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OtlpProtocol {
    /// `grpc` (port 4317 by convention).
    Grpc,
    /// `http/protobuf` (port 4318 by convention; the specification's default).
    HttpProtobuf,
}

impl OtlpProtocol {
    /// Parses `grpc` or `http/protobuf`.
    ///
    /// # Errors
    /// Any other value (`http/json` is not supported), naming it.
    pub fn parse(s: &str) -> anyhow::Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "grpc" => Ok(OtlpProtocol::Grpc),
            "http/protobuf" => Ok(OtlpProtocol::HttpProtobuf),
            other => {
                bail!("OTLP protocol {other:?} is not supported (expected grpc or http/protobuf)")
            }
        }
    }
}

/// The OTLP sink. Unset fields come from the standard environment variables
/// ([`otlp::Target::resolve`]).
#[derive(Debug, Clone, Default)]
pub struct OtlpConfig {
    /// Transport; `None`: `OTEL_EXPORTER_OTLP_[LOGS_]PROTOCOL`, else `http/protobuf`.
    pub protocol: Option<OtlpProtocol>,
    /// Base endpoint (`http://collector:4318`; for HTTP `/v1/logs` is appended, as for
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`); `None`: the environment, else the default
    /// (`http://localhost:4317` for gRPC, `http://localhost:4318/v1/logs` for HTTP).
    pub endpoint: Option<String>,
    /// Extra headers (gRPC metadata), e.g. an API key.
    pub headers: Vec<(String, String)>,
    /// gzip compression; `None`: the environment.
    pub gzip: Option<bool>,
    /// PEM file of CA certificates to trust for `https` endpoints; `None`:
    /// `OTEL_EXPORTER_OTLP_CERTIFICATE`, else the system's roots.
    pub ca_file: Option<PathBuf>,
    /// Deadline of one export attempt (above zero); `None`:
    /// `OTEL_EXPORTER_OTLP_[LOGS_]TIMEOUT`, else [`otlp::DEFAULT_TIMEOUT`] (10 s).
    pub timeout: Option<Duration>,
    /// Most records in one export request.
    pub batch_size: usize,
    /// How long a batch waits to fill before it is sent.
    pub batch_delay: Duration,
}

impl OtlpConfig {
    /// The defaults: everything from the environment, batches of 512 or 200 ms.
    pub fn from_env() -> Self {
        OtlpConfig {
            batch_size: 512,
            batch_delay: Duration::from_millis(200),
            ..Default::default()
        }
    }
}

/// The JSON Lines sink's output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JsonTarget {
    /// Standard output.
    Stdout,
    /// A file, rotated when it passes `max_bytes`; `keep` rotated files are kept
    /// (`PATH.1` is the newest).
    File {
        /// The file.
        path: PathBuf,
        /// Size that starts a new file (bytes; a line is never split).
        max_bytes: usize,
        /// Rotated files kept.
        keep: usize,
    },
}

/// A sink and its configuration.
#[derive(Debug, Clone)]
pub enum SinkConfig {
    /// OpenTelemetry Protocol.
    Otlp(OtlpConfig),
    /// JSON Lines.
    Json(JsonTarget),
}

impl SinkConfig {
    /// `otlp` or `json`, for metrics labels.
    pub fn name(&self) -> &'static str {
        match self {
            SinkConfig::Otlp(_) => "otlp",
            SinkConfig::Json(_) => "json",
        }
    }
}

/// The resource every event is reported under: `service.name`, `service.version`,
/// `k8s.node.name` (and `OTEL_RESOURCE_ATTRIBUTES` for OTLP).
pub fn resource_attrs(node: &str) -> Vec<(&'static str, String)> {
    vec![
        ("service.name", "tierproxy".to_string()),
        ("service.version", env!("CARGO_PKG_VERSION").to_string()),
        ("k8s.node.name", node.to_string()),
    ]
}

/// Installs rustls' process-wide crypto provider (ring) unless one is installed. reqwest is
/// built without a provider of its own (`rustls-no-provider`: aws-lc-rs would add a second
/// crypto library to the binary), so it uses the process default: without this, its first
/// TLS connection panics.
pub(crate) fn ensure_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Losing a race to another thread installing it is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// A started sink thread.
pub(crate) struct Running {
    pub(crate) thread: JoinHandle<()>,
}

/// Starts the OTLP sink reading `rx`. Returns once the target is resolved and the client
/// built, so a bad configuration fails the start.
pub(crate) fn start_otlp(
    config: OtlpConfig,
    node: &str,
    mode: Mode,
    rx: Receiver<Arc<Event>>,
    stats: Arc<SinkStats>,
    flush_deadline: Arc<std::sync::Mutex<Option<Instant>>>,
    gate: Arc<Gate>,
) -> anyhow::Result<Running> {
    let target = otlp::Target::resolve(&config, &|v| std::env::var(v).ok())?;
    let resource = resource_attrs(node);
    let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel::<anyhow::Result<()>>(1);
    let thread = std::thread::Builder::new()
        .name("audit-otlp".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = ready_tx.send(Err(e).context("starting the OTLP runtime"));
                    return;
                }
            };
            let mut client = match rt.block_on(async { otlp::Client::new(target) }) {
                Ok(c) => c,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let _ = ready_tx.send(Ok(()));
            let out = Out { stats: &stats, flush_deadline: &flush_deadline, gate: &gate };
            run_otlp(&rt, &mut client, &resource, &config, mode, &rx, &out);
        })
        .context("starting the OTLP sink thread")?;
    match ready_rx.recv() {
        Ok(Ok(())) => Ok(Running { thread }),
        Ok(Err(e)) => Err(e),
        Err(_) => bail!("the OTLP sink thread ended while starting"),
    }
}

/// Gathers a batch: blocks for the first event, then takes what arrives within `delay`,
/// up to `max`. `None` when the queue is closed and empty.
fn gather(rx: &Receiver<Arc<Event>>, max: usize, delay: Duration) -> Option<Vec<Arc<Event>>> {
    let first = rx.recv().ok()?;
    let mut batch = Vec::with_capacity(max.min(1024));
    batch.push(first);
    let until = Instant::now() + delay;
    while batch.len() < max {
        match rx.recv_deadline(until) {
            Ok(e) => batch.push(e),
            Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => break,
        }
    }
    Some(batch)
}

/// What the OTLP sink reports to, and reads from, the pipeline.
struct Out<'a> {
    stats: &'a SinkStats,
    flush_deadline: &'a std::sync::Mutex<Option<Instant>>,
    gate: &'a Gate,
}

impl Out<'_> {
    fn flush_deadline(&self) -> Option<Instant> {
        *self.flush_deadline.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Least time between two warnings that exports fail.
const WARN_EVERY: Duration = Duration::from_secs(10);
/// First wait before a failed export is retried; it doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
/// Longest wait between retries. With the deadline of an attempt under way, it bounds how
/// late delivery resumes once the collector is back.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Sleeps `d`, or less if the flush deadline passes first.
fn pause(d: Duration, out: &Out<'_>) {
    let until = Instant::now() + d;
    loop {
        let now = Instant::now();
        let end = out.flush_deadline().map_or(until, |f| f.min(until));
        if now >= end {
            return;
        }
        // Slices, so that a shutdown starting during a long backoff is seen.
        std::thread::sleep((end - now).min(Duration::from_millis(50)));
    }
}

fn run_otlp(
    rt: &tokio::runtime::Runtime,
    client: &mut otlp::Client,
    resource: &[(&'static str, String)],
    config: &OtlpConfig,
    mode: Mode,
    rx: &Receiver<Arc<Event>>,
    out: &Out<'_>,
) {
    let stats = out.stats;
    let mut warned: Option<Instant> = None;
    let mut failing = 0u64;
    let mut encoder = otlp::Encoder::default();
    let mut body = Vec::new();
    while let Some(batch) = gather(rx, config.batch_size.max(1), config.batch_delay) {
        out.gate.after_recv();
        let n = batch.len() as u64;
        encoder.request(&batch, resource, env!("CARGO_PKG_VERSION"), &mut body);
        let mut backoff = FIRST_BACKOFF;
        // Lossy: one retry (a collector restarting); lossless: until delivered or the
        // flush deadline passes.
        let mut attempts = 0;
        loop {
            // Once shutdown has begun, no attempt outlives the flush deadline.
            let limit = match out.flush_deadline() {
                Some(d) => d.saturating_duration_since(Instant::now()).min(client.timeout()),
                None => client.timeout(),
            };
            if limit.is_zero() {
                stats.failed.fetch_add(n, Ordering::Relaxed);
                break;
            }
            attempts += 1;
            match rt.block_on(client.export(body.clone(), limit)) {
                Ok(()) => {
                    stats.exported.fetch_add(n, Ordering::Relaxed);
                    if failing > 0 {
                        tracing::info!(failed_attempts = failing, "OTLP export recovered");
                        failing = 0;
                    }
                    break;
                }
                Err(e) => {
                    failing += 1;
                    if matches!(e, otlp::ExportError::Timeout(_)) {
                        stats.timeouts.fetch_add(1, Ordering::Relaxed);
                    }
                    let give_up = mode == Mode::Lossy && attempts >= 2;
                    if warned.is_none_or(|w| w.elapsed() >= WARN_EVERY) {
                        warned = Some(Instant::now());
                        tracing::warn!(
                            error = %e,
                            events = n,
                            queued = rx.len(),
                            retrying = !give_up,
                            "OTLP export failed"
                        );
                    }
                    if give_up {
                        stats.failed.fetch_add(n, Ordering::Relaxed);
                        break;
                    }
                    // Keep the batch and try again. Lossless: the queue behind it grows
                    // until the gate makes new flows wait; other sinks go on.
                    stats.retries.fetch_add(1, Ordering::Relaxed);
                    pause(backoff, out);
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }
}

/// Starts the JSON Lines sink reading `rx`.
pub(crate) fn start_json(
    target: JsonTarget,
    node: &str,
    rx: Receiver<Arc<Event>>,
    stats: Arc<SinkStats>,
    gate: Arc<Gate>,
) -> anyhow::Result<Running> {
    let mut out: Box<dyn Write + Send> = match &target {
        JsonTarget::Stdout => Box::new(std::io::stdout()),
        JsonTarget::File { path, max_bytes, keep } => {
            if *max_bytes == 0 {
                bail!("audit JSON file {}: the rotation size must be above 0", path.display());
            }
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
            }
            // Opened here so a path that cannot be written fails the start.
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .with_context(|| format!("opening audit JSON file {}", path.display()))?;
            Box::new(file_rotate::FileRotate::new(
                path,
                file_rotate::suffix::AppendCount::new(*keep),
                file_rotate::ContentLimit::BytesSurpassed(*max_bytes),
                file_rotate::compression::Compression::None,
                None,
            ))
        }
    };
    let resource = event::resource_json(&resource_attrs(node));
    // Lines are written in chunks of whole lines; a file is rotated after the chunk that
    // takes it past its size, so chunks stay small against the size.
    let chunk = match &target {
        JsonTarget::Stdout => 64 << 10,
        JsonTarget::File { max_bytes, .. } => (max_bytes / 8).clamp(1, 64 << 10),
    };
    let thread = std::thread::Builder::new()
        .name("audit-json".into())
        .spawn(move || {
            let mut warned = false;
            let mut write = |buf: &mut Vec<u8>, lines: u64| {
                match out.write_all(buf).and_then(|()| out.flush()) {
                    Ok(()) => {
                        stats.exported.fetch_add(lines, Ordering::Relaxed);
                    }
                    Err(e) => {
                        stats.failed.fetch_add(lines, Ordering::Relaxed);
                        if !std::mem::replace(&mut warned, true) {
                            tracing::error!(error = %e, "writing audit JSON failed");
                        }
                    }
                }
                buf.clear();
            };
            let mut buf = Vec::with_capacity(chunk + 4096);
            while let Some(batch) = gather(&rx, 1024, Duration::ZERO) {
                gate.after_recv();
                let mut lines = 0;
                for e in &batch {
                    event::write_json(e, &resource, &mut buf);
                    buf.push(b'\n');
                    lines += 1;
                    if buf.len() >= chunk {
                        write(&mut buf, lines);
                        lines = 0;
                    }
                }
                if lines > 0 {
                    write(&mut buf, lines);
                }
            }
        })
        .context("starting the JSON sink thread")?;
    Ok(Running { thread })
}
