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
//! Each sink reports to its [`SinkStats`], and tells the lossless [`Gate`] when it took
//! events from its queue; both live here, beside the sinks that update them, so that the
//! audit files depend one way: `pipeline` → `sink` → `otlp` (the OTLP configuration,
//! [`OtlpConfig`], is [`otlp`]'s).
//!
//! Sources: OpenTelemetry Protocol Exporter specification (batching; the
//! `OTEL_EXPORTER_OTLP_*` variables are resolved in [`otlp::Target::resolve`]).

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use crossbeam_channel::{Receiver, RecvTimeoutError, TryRecvError};

use super::Mode;
use super::event::{self, Event};
use super::otlp::{self, OtlpConfig};
use super::pipeline::READ_PAUSE;

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

/// Counters of one sink.
#[derive(Debug, Default)]
pub struct SinkStats {
    /// `otlp` or `json`.
    pub name: &'static str,
    /// Events delivered (exported, or written).
    pub exported: AtomicU64,
    /// Events dropped because the sink's queue was full (lossy).
    pub dropped_queue: AtomicU64,
    /// Events whose export or write failed and were given up.
    pub failed: AtomicU64,
    /// Failed exports retried (lossless).
    pub retries: AtomicU64,
    /// Export attempts abandoned at their deadline with no answer (a hung collector); each
    /// also counts as a retry or, when given up, its events as failed.
    pub timeouts: AtomicU64,
}

/// How often a closed [`Gate`] is looked at again by a waiter, should a sink's wake-up
/// be missed: a bound on the extra wait, not a polling rate.
const GATE_RECHECK: Duration = Duration::from_millis(50);
/// Least time between two warnings that new flows wait.
const GATE_WARN_EVERY: Duration = Duration::from_secs(10);

/// Lossless back-pressure on new flows: closed while a sink holds `capacity` events or
/// more that it has not taken yet. While it is closed,
/// [`Auditor::decision`](super::Auditor::decision) waits (the NFQUEUE reader, hence new
/// flows, wait). Every other record goes on: connection ends (bounded by the connections
/// admitted), deny windows closing, suppression summaries; and so does every sink that has
/// room.
///
/// The worker re-checks after handing out an event; each sink after taking events from
/// its queue. A sink's queue thus holds at most `capacity` events plus what was already
/// admitted when the gate closed (the data-path queue: `capacity` records, two events
/// each at most) plus connection ends and summaries.
pub(crate) struct Gate {
    capacity: usize,
    queues: Vec<(&'static str, Receiver<Arc<Event>>)>,
    closed: AtomicBool,
    /// Shutdown: the gate stays open.
    released: AtomicBool,
    /// When the last "new flows wait" warning was logged.
    warned: Mutex<Option<Instant>>,
    opened: Condvar,
}

impl Gate {
    pub(super) fn new(capacity: usize, queues: Vec<(&'static str, Receiver<Arc<Event>>)>) -> Self {
        Gate {
            capacity,
            queues,
            closed: AtomicBool::new(false),
            released: AtomicBool::new(false),
            warned: Mutex::new(None),
            opened: Condvar::new(),
        }
    }

    /// The first sink holding `capacity` events or more, with their number.
    fn full(&self) -> Option<(&'static str, usize)> {
        self.queues.iter().map(|(n, q)| (*n, q.len())).find(|(_, len)| *len >= self.capacity)
    }

    /// Recomputes the state under the lock (so that the last of the worker's and a
    /// sink's updates sees both their changes), warns when it closes, wakes the waiters
    /// when it opens.
    fn update(&self) {
        let mut warned = self.warned.lock().unwrap_or_else(|p| p.into_inner());
        let full = if self.released.load(Ordering::SeqCst) { None } else { self.full() };
        let was = self.closed.swap(full.is_some(), Ordering::SeqCst);
        match full {
            Some((sink, events)) if !was => {
                if warned.is_none_or(|w| w.elapsed() >= GATE_WARN_EVERY) {
                    *warned = Some(Instant::now());
                    tracing::warn!(
                        sink,
                        events,
                        "audit sink full: new flows wait for it (lossless mode)"
                    );
                }
            }
            Some(_) => {}
            None => self.opened.notify_all(),
        }
    }

    /// After the worker handed out an event.
    pub(super) fn after_send(&self) {
        if self.full().is_some() != self.closed.load(Ordering::SeqCst) {
            self.update();
        }
    }

    /// After a sink took events from its queue.
    pub(crate) fn after_recv(&self) {
        if self.closed.load(Ordering::SeqCst) {
            self.update();
        }
    }

    pub(super) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Waits while the gate is closed.
    pub(super) fn wait(&self) {
        let mut g = self.warned.lock().unwrap_or_else(|p| p.into_inner());
        while self.closed.load(Ordering::SeqCst) {
            let (guard, timeout) =
                self.opened.wait_timeout(g, GATE_RECHECK).unwrap_or_else(|p| p.into_inner());
            g = guard;
            if timeout.timed_out() {
                let open = self.released.load(Ordering::SeqCst) || self.full().is_none();
                if open {
                    self.closed.store(false, Ordering::SeqCst);
                    self.opened.notify_all();
                }
            }
        }
    }

    /// Opens the gate for good (shutdown: nothing may wait on audit any more).
    pub(super) fn release(&self) {
        self.released.store(true, Ordering::SeqCst);
        self.update();
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
///
/// Woken by an event within the window, it takes every event queued then pauses
/// [`READ_PAUSE`] before it looks again, so that a stream of events (a deny flood's
/// records) wakes the thread about once per pause, not once per event; a lone event
/// costs one wake-up and the deadline's, as a plain wait would.
fn gather(rx: &Receiver<Arc<Event>>, max: usize, delay: Duration) -> Option<Vec<Arc<Event>>> {
    let first = rx.recv().ok()?;
    let mut batch = Vec::with_capacity(max.min(1024));
    batch.push(first);
    let until = Instant::now() + delay;
    loop {
        while batch.len() < max {
            match rx.try_recv() {
                Ok(e) => batch.push(e),
                Err(TryRecvError::Empty) => break,
                // Shutdown: the worker is gone, nothing more will come.
                Err(TryRecvError::Disconnected) => return Some(batch),
            }
        }
        if batch.len() >= max {
            return Some(batch);
        }
        match rx.recv_deadline(until) {
            Ok(e) => batch.push(e),
            Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => return Some(batch),
        }
        let left = until.saturating_duration_since(Instant::now());
        if !left.is_zero() {
            std::thread::sleep(READ_PAUSE.min(left));
        }
    }
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
