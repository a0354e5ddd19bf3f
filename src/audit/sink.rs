//! Where audit events go: OTLP (gRPC or HTTP/protobuf, through `opentelemetry-otlp`) and
//! JSON Lines (stdout, or a file rotated by size).
//!
//! Each sink runs on its own thread behind its own bounded queue, so a slow sink never
//! holds up another. The OTLP sink batches records (up to [`OtlpConfig::batch_size`], or
//! what arrived within [`OtlpConfig::batch_delay`]) and calls the exporter itself rather
//! than through the SDK's batch processor: the processor drops silently when its queue is
//! full, and tierproxy must count every drop (lossy) or never drop (lossless).
//!
//! Sources: OpenTelemetry Protocol Exporter specification (`OTEL_EXPORTER_OTLP_ENDPOINT`,
//! `_PROTOCOL`, `_HEADERS`, `_COMPRESSION`, `_TIMEOUT`, `_CERTIFICATE`, their `_LOGS_`
//! variants; default protocol `http/protobuf`; HTTP path `/v1/logs`).

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use crossbeam_channel::{Receiver, RecvTimeoutError};
use opentelemetry::logs::{AnyValue, LogRecord as _, Logger as _, LoggerProvider as _};
use opentelemetry::{InstrumentationScope, Key};
use opentelemetry_sdk::logs::{LogBatch, LogExporter as _, SdkLogRecord, SdkLogger};

use super::Mode;
use super::event::{self, Event, Severity, Value};
use super::pipeline::SinkStats;

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

    /// `OTEL_EXPORTER_OTLP_LOGS_PROTOCOL`, else `OTEL_EXPORTER_OTLP_PROTOCOL`, else
    /// `http/protobuf`.
    ///
    /// # Errors
    /// A set variable with an unsupported value.
    pub fn from_env() -> anyhow::Result<Self> {
        for var in ["OTEL_EXPORTER_OTLP_LOGS_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"] {
            if let Ok(v) = std::env::var(var) {
                return Self::parse(&v).with_context(|| format!("${var}"));
            }
        }
        Ok(OtlpProtocol::HttpProtobuf)
    }
}

/// The OTLP sink. Unset fields come from the standard environment variables, read by
/// `opentelemetry-otlp` (endpoint, headers, compression, timeout) or here (protocol, CA).
#[derive(Debug, Clone, Default)]
pub struct OtlpConfig {
    /// Transport; `None`: [`OtlpProtocol::from_env`].
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
    /// Timeout of one export request; `None`: the environment, else 10 s.
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

/// Installs rustls' process-wide crypto provider (ring) unless one is installed. The
/// exporters' dependencies enable both of rustls' providers (ring for tonic, aws-lc-rs for
/// reqwest), and rustls then refuses to guess: without this, the first TLS connection
/// panics.
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

/// Starts the OTLP sink reading `rx`. Returns once the exporter is built, so a bad
/// configuration fails the start.
pub(crate) fn start_otlp(
    config: OtlpConfig,
    node: &str,
    mode: Mode,
    rx: Receiver<Arc<Event>>,
    stats: Arc<SinkStats>,
    flush_deadline: Arc<std::sync::Mutex<Option<Instant>>>,
) -> anyhow::Result<Running> {
    ensure_crypto_provider();
    let protocol = match config.protocol {
        Some(p) => p,
        None => OtlpProtocol::from_env()?,
    };
    let ca = match &config.ca_file {
        Some(p) => Some(p.clone()),
        None => std::env::var_os("OTEL_EXPORTER_OTLP_LOGS_CERTIFICATE")
            .or_else(|| std::env::var_os("OTEL_EXPORTER_OTLP_CERTIFICATE"))
            .map(PathBuf::from),
    };
    let ca_pem = match &ca {
        Some(p) => Some(
            std::fs::read(p).with_context(|| format!("reading OTLP CA file {}", p.display()))?,
        ),
        None => None,
    };
    let resource = opentelemetry_sdk::Resource::builder()
        .with_attributes(
            resource_attrs(node).into_iter().map(|(k, v)| opentelemetry::KeyValue::new(k, v)),
        )
        .build();
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
            let built = rt.block_on(async { build_exporter(&config, protocol, ca_pem) });
            let mut exporter = match built {
                Ok(e) => e,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            opentelemetry_sdk::logs::LogExporter::set_resource(&mut exporter, &resource);
            let _ = ready_tx.send(Ok(()));
            let provider = opentelemetry_sdk::logs::SdkLoggerProvider::builder().build();
            let scope = InstrumentationScope::builder("tierproxy.audit")
                .with_version(env!("CARGO_PKG_VERSION"))
                .build();
            let logger = provider.logger_with_scope(scope.clone());
            run_otlp(&rt, &exporter, &logger, &scope, &config, mode, &rx, &stats, &flush_deadline);
            let _ = opentelemetry_sdk::logs::LogExporter::shutdown(&exporter);
        })
        .context("starting the OTLP sink thread")?;
    match ready_rx.recv() {
        Ok(Ok(())) => Ok(Running { thread }),
        Ok(Err(e)) => Err(e),
        Err(_) => bail!("the OTLP sink thread ended while starting"),
    }
}

fn build_exporter(
    config: &OtlpConfig,
    protocol: OtlpProtocol,
    ca_pem: Option<Vec<u8>>,
) -> anyhow::Result<opentelemetry_otlp::LogExporter> {
    use opentelemetry_otlp::{WithExportConfig, WithHttpConfig, WithTonicConfig};
    let compression = config.gzip.map(|g| g.then_some(opentelemetry_otlp::Compression::Gzip));
    let e = match protocol {
        OtlpProtocol::Grpc => {
            let mut b = opentelemetry_otlp::LogExporter::builder().with_tonic();
            if let Some(ep) = &config.endpoint {
                b = b.with_endpoint(ep.clone());
            }
            if let Some(t) = config.timeout {
                b = b.with_timeout(t);
            }
            if let Some(Some(c)) = compression {
                b = b.with_compression(c);
            }
            if !config.headers.is_empty() {
                let mut md = tonic::metadata::MetadataMap::new();
                for (k, v) in &config.headers {
                    let key =
                        tonic::metadata::MetadataKey::from_bytes(k.to_ascii_lowercase().as_bytes())
                            .with_context(|| format!("OTLP header name {k:?}"))?;
                    let val = v.parse().with_context(|| format!("OTLP header {k:?} value"))?;
                    md.insert(key, val);
                }
                b = b.with_metadata(md);
            }
            if let Some(pem) = ca_pem {
                b = b.with_tls_config(
                    tonic::transport::ClientTlsConfig::new()
                        .ca_certificate(tonic::transport::Certificate::from_pem(pem)),
                );
            }
            b.build()
        }
        OtlpProtocol::HttpProtobuf => {
            let mut b = opentelemetry_otlp::LogExporter::builder()
                .with_http()
                .with_protocol(opentelemetry_otlp::Protocol::HttpBinary);
            if let Some(ep) = &config.endpoint {
                b = b.with_endpoint(format!("{}/v1/logs", ep.trim_end_matches('/')));
            }
            if let Some(t) = config.timeout {
                b = b.with_timeout(t);
            }
            if let Some(Some(c)) = compression {
                b = b.with_compression(c);
            }
            if !config.headers.is_empty() {
                b = b.with_headers(config.headers.iter().cloned().collect::<HashMap<_, _>>());
            }
            if ca_pem.is_some() {
                bail!(
                    "a CA file is supported for OTLP over gRPC only; for http/protobuf add the \
                     CA to the system's trust store"
                );
            }
            b.build()
        }
    };
    e.context("building the OTLP log exporter")
}

fn any_value(v: &Value) -> AnyValue {
    match v {
        Value::Static(s) => AnyValue::String((*s).into()),
        Value::Str(s) => AnyValue::String(s.clone().into()),
        Value::Int(i) => AnyValue::Int(*i),
        Value::List(l) => AnyValue::ListAny(Box::new(
            l.iter().map(|s| AnyValue::String(s.clone().into())).collect(),
        )),
    }
}

/// The OpenTelemetry log record of `e`.
pub(crate) fn to_record(logger: &SdkLogger, e: &Event) -> SdkLogRecord {
    let mut r = logger.create_log_record();
    r.set_event_name(e.name);
    r.set_timestamp(e.time);
    r.set_observed_timestamp(std::time::SystemTime::now());
    let (number, text) = match e.severity {
        Severity::Info => (opentelemetry::logs::Severity::Info, "INFO"),
        Severity::Warn => (opentelemetry::logs::Severity::Warn, "WARN"),
    };
    r.set_severity_number(number);
    r.set_severity_text(text);
    r.set_body(AnyValue::String(e.body.clone().into()));
    for (k, v) in &e.attributes {
        r.add_attribute(Key::from_static_str(k), any_value(v));
    }
    r
}

/// Gathers a batch: blocks for the first event (or until the flush deadline passes),
/// then takes what arrives within `delay`, up to `max`. `None` when the queue is closed
/// and empty.
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

#[allow(clippy::too_many_arguments)]
fn run_otlp(
    rt: &tokio::runtime::Runtime,
    exporter: &opentelemetry_otlp::LogExporter,
    logger: &SdkLogger,
    scope: &InstrumentationScope,
    config: &OtlpConfig,
    mode: Mode,
    rx: &Receiver<Arc<Event>>,
    stats: &SinkStats,
    flush_deadline: &std::sync::Mutex<Option<Instant>>,
) {
    let mut warned = Instant::now() - Duration::from_secs(3600);
    let deadline = || *flush_deadline.lock().unwrap_or_else(|p| p.into_inner());
    while let Some(batch) = gather(rx, config.batch_size.max(1), config.batch_delay) {
        let records: Vec<SdkLogRecord> = batch.iter().map(|e| to_record(logger, e)).collect();
        let refs: Vec<(&SdkLogRecord, &InstrumentationScope)> =
            records.iter().map(|r| (r, scope)).collect();
        let mut backoff = Duration::from_millis(100);
        loop {
            match rt.block_on(exporter.export(LogBatch::new(&refs))) {
                Ok(()) => {
                    stats.exported.fetch_add(batch.len() as u64, Ordering::Relaxed);
                    break;
                }
                Err(e) => {
                    if warned.elapsed() >= Duration::from_secs(10) {
                        warned = Instant::now();
                        tracing::warn!(error = %e, events = batch.len(), "OTLP export failed");
                    }
                    let past_deadline = deadline().is_some_and(|d| Instant::now() >= d);
                    if mode == Mode::Lossy || past_deadline {
                        stats.failed.fetch_add(batch.len() as u64, Ordering::Relaxed);
                        break;
                    }
                    // Lossless: keep the batch and try again; the queue behind fills and
                    // new-flow decisions wait.
                    stats.retries.fetch_add(1, Ordering::Relaxed);
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_secs(5));
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
