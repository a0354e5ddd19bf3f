//! `tierproxy agent` audit and metrics options, and their translation into an
//! [`AuditConfig`].
//!
//! The OTLP sink is on when `--audit-otlp` is given, or an endpoint is (by
//! `--audit-otlp-endpoint`, `OTEL_EXPORTER_OTLP_LOGS_ENDPOINT` or
//! `OTEL_EXPORTER_OTLP_ENDPOINT`); the JSON Lines sink when `--audit-json` is. Flags win
//! over the standard `OTEL_EXPORTER_OTLP_*` variables, which fill in the rest.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context as _, bail};

use super::Mode;
use super::limit::Limits;
use super::otlp::{OtlpConfig, OtlpProtocol};
use super::pipeline::{AuditConfig, DEFAULT_DENY_WINDOW, DEFAULT_QUEUE_CAPACITY};
use super::select::Defaults;
use super::sink::{JsonTarget, SinkConfig};

/// `on` / `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Switch {
    /// Logged.
    On,
    /// Not logged.
    Off,
}

/// Audit options of `tierproxy agent` (docs/audit.md).
#[derive(Debug, Clone, clap::Args)]
pub struct AuditArgs {
    /// Send audit events over OTLP (endpoint, headers, protocol, compression, timeout and
    /// CA default to the standard OTEL_EXPORTER_OTLP_* variables). Implied by an
    /// endpoint given by flag or variable.
    #[arg(long)]
    pub audit_otlp: bool,
    /// OTLP base endpoint, e.g. http://collector:4318 (http/protobuf; /v1/logs is
    /// appended) or http://collector:4317 (grpc).
    #[arg(long)]
    pub audit_otlp_endpoint: Option<String>,
    /// OTLP protocol: grpc or http/protobuf (default: OTEL_EXPORTER_OTLP_PROTOCOL, else
    /// http/protobuf).
    #[arg(long)]
    pub audit_otlp_protocol: Option<String>,
    /// An OTLP request header (gRPC metadata), NAME=VALUE; repeatable.
    #[arg(long, value_name = "NAME=VALUE")]
    pub audit_otlp_header: Vec<String>,
    /// OTLP compression: gzip or none.
    #[arg(long)]
    pub audit_otlp_compression: Option<String>,
    /// PEM file of CA certificates to trust for an https OTLP endpoint.
    #[arg(long)]
    pub audit_otlp_ca: Option<PathBuf>,
    /// Deadline of one OTLP export attempt, milliseconds, above 0 (default:
    /// OTEL_EXPORTER_OTLP_[LOGS_]TIMEOUT, else 10000). An attempt unanswered by then is
    /// abandoned, and retried (lossless) or counted as failed (lossy).
    #[arg(long)]
    pub audit_otlp_timeout_ms: Option<u64>,
    /// Write audit events as JSON Lines to this file (rotated by size), or `-` for
    /// standard output.
    #[arg(long, value_name = "PATH|-")]
    pub audit_json: Option<PathBuf>,
    /// Size at which the JSON file is rotated (bytes).
    #[arg(long, default_value_t = 100 << 20)]
    pub audit_json_max_bytes: usize,
    /// Rotated JSON files kept (PATH.1 is the newest).
    #[arg(long, default_value_t = 5)]
    pub audit_json_keep: usize,
    /// lossy: full queues drop events (counted) and the data path never waits;
    /// lossless: nothing is dropped, new flows wait while a sink holds --audit-queue
    /// undelivered events (other sinks go on).
    #[arg(long, default_value = "lossy")]
    pub audit_mode: String,
    /// Records the audit thread's queue holds, and undelivered events each sink holds
    /// before lossy drops for it or lossless makes new flows wait.
    #[arg(long, default_value_t = DEFAULT_QUEUE_CAPACITY)]
    pub audit_queue: usize,
    /// Log one allowed flow in N where no policy annotation says (0: none, 1: all).
    #[arg(long, default_value_t = Defaults::default().allow_sample)]
    pub audit_allow_sample: u32,
    /// Log denies (and Antrea rejects) where no policy annotation or Antrea
    /// `enableLogging` says.
    #[arg(long, value_enum, default_value = "on")]
    pub audit_deny: Switch,
    /// Log decisions that took a Pass rule where no policy annotation says.
    #[arg(long, value_enum, default_value = "on")]
    pub audit_pass: Switch,
    /// Log the end of each proxied connection whose decision was logged (a connection cut
    /// by a policy change is reported either way).
    #[arg(long, value_enum, default_value = "on")]
    pub audit_close: Switch,
    /// Identical denies or rejects (same flow but source port) within this window become
    /// one event with a count (milliseconds; 0: every deny is an event).
    #[arg(long, default_value_t = DEFAULT_DENY_WINDOW.as_millis() as u64)]
    pub audit_deny_window_ms: u64,
    /// Most events per second per rule (0: no limit); the rest are counted.
    #[arg(long, default_value_t = Limits::default().per_rule)]
    pub audit_rate_per_rule: f64,
    /// Most events per second for the node (0: no limit); the rest are counted.
    #[arg(long, default_value_t = Limits::default().node)]
    pub audit_rate_node: f64,
    /// Pod label keys reported for both ends, comma-separated (e.g. app,team).
    #[arg(long, value_delimiter = ',')]
    pub audit_pod_labels: Vec<String>,
    /// Seconds shutdown waits for the sinks to deliver what is queued.
    #[arg(long, default_value_t = 10)]
    pub audit_flush_timeout_secs: u64,
}

fn env_endpoint() -> bool {
    ["OTEL_EXPORTER_OTLP_LOGS_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"]
        .iter()
        .any(|v| std::env::var_os(v).is_some_and(|s| !s.is_empty()))
}

impl AuditArgs {
    /// The pipeline configuration for node `node`.
    ///
    /// # Errors
    /// A value that does not parse, naming the flag.
    pub fn config(&self, node: &str) -> anyhow::Result<AuditConfig> {
        let mut sinks = Vec::new();
        if self.audit_otlp || self.audit_otlp_endpoint.is_some() || env_endpoint() {
            let mut o = OtlpConfig::from_env();
            o.protocol = self
                .audit_otlp_protocol
                .as_deref()
                .map(OtlpProtocol::parse)
                .transpose()
                .context("--audit-otlp-protocol")?;
            o.endpoint = self.audit_otlp_endpoint.clone();
            for h in &self.audit_otlp_header {
                let Some((k, v)) = h.split_once('=') else {
                    bail!("--audit-otlp-header {h:?}: expected NAME=VALUE");
                };
                o.headers.push((k.trim().to_string(), v.trim().to_string()));
            }
            o.gzip = match self.audit_otlp_compression.as_deref() {
                None => None,
                Some("gzip") => Some(true),
                Some("none") => Some(false),
                Some(other) => bail!("--audit-otlp-compression {other:?}: expected gzip or none"),
            };
            o.ca_file = self.audit_otlp_ca.clone();
            if self.audit_otlp_timeout_ms == Some(0) {
                bail!("--audit-otlp-timeout-ms 0: the export deadline must be above 0");
            }
            o.timeout = self.audit_otlp_timeout_ms.map(Duration::from_millis);
            sinks.push(SinkConfig::Otlp(o));
        }
        if let Some(p) = &self.audit_json {
            sinks.push(SinkConfig::Json(if p.as_os_str() == "-" {
                JsonTarget::Stdout
            } else {
                JsonTarget::File {
                    path: p.clone(),
                    max_bytes: self.audit_json_max_bytes,
                    keep: self.audit_json_keep,
                }
            }));
        }
        let mut c = AuditConfig::new(node, sinks);
        c.mode = Mode::parse(&self.audit_mode).context("--audit-mode")?;
        c.queue_capacity = self.audit_queue;
        c.defaults = Defaults {
            allow_sample: self.audit_allow_sample,
            deny: self.audit_deny == Switch::On,
            pass: self.audit_pass == Switch::On,
            close: self.audit_close == Switch::On,
        };
        c.deny_window = Duration::from_millis(self.audit_deny_window_ms);
        if !(self.audit_rate_per_rule >= 0.0 && self.audit_rate_node >= 0.0) {
            bail!("--audit-rate-per-rule and --audit-rate-node must be 0 or more");
        }
        c.limits = Limits { per_rule: self.audit_rate_per_rule, node: self.audit_rate_node };
        let keys = self.audit_pod_labels.iter().map(|s| s.trim().to_string());
        c.context = super::event::Context::new(node, keys.filter(|s| !s.is_empty()).collect());
        c.flush_timeout = Duration::from_secs(self.audit_flush_timeout_secs);
        Ok(c)
    }
}
