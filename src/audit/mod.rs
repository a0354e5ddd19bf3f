//! Audit: one OpenTelemetry log event per audited decision of a new flow and per end of a
//! proxied connection, naming the tier, policy and rule that decided, streamed over OTLP
//! or written as JSON Lines for a SIEM.
//!
//! - [`select`]: what is logged (node defaults per action; the `tierproxy.io/audit`
//!   annotation per policy, per action or per rule name);
//! - [`event`]: the event names and attributes (docs/audit.md), rendered from a
//!   [`Decision`](crate::policy::Decision);
//! - [`limit`]: deny aggregation and token-bucket rate limits;
//! - [`pipeline`]: the bounded queue from the data path, the worker, lossy and lossless
//!   modes;
//! - [`sink`]: OTLP (gRPC, HTTP/protobuf) and JSON Lines outputs, each on its own thread;
//! - [`otlp`]: the OTLP encoding, transports and configuration (imported by `sink`, which
//!   `pipeline` imports; never the other way round);
//! - [`receiver`]: a small OTLP receiver on the official protobuf types (tests, benches,
//!   the lab).
//!
//! The data path never waits on audit in lossy mode (the default); see [`pipeline`].
//!
//! Sources: KEP-2091 "Future work: Audit Logging"; issue #4; OpenTelemetry Logs Data
//! Model and OTLP exporter specification.

pub mod cli;
pub mod event;
pub mod limit;
pub mod otlp;
pub mod pipeline;
#[cfg(any(test, feature = "lab"))]
pub mod receiver;
pub mod select;
pub mod sink;

pub use event::{CloseReason, ConnectionEnd, DecisionPoint, Event, FlowInfo};
pub use otlp::{OtlpConfig, OtlpProtocol};
pub use pipeline::{Admitted, AuditConfig, Auditor, Stats};
pub use select::{Defaults, Sampling, Selection};
pub use sink::{JsonTarget, SinkConfig};

/// What the pipeline does when a queue is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Drop the event and count it; the data path never waits (default).
    #[default]
    Lossy,
    /// Never drop: new-flow decisions wait for room; failed exports are retried.
    Lossless,
}

impl Mode {
    /// Parses `lossy` or `lossless`.
    ///
    /// # Errors
    /// Any other value, naming it.
    pub fn parse(s: &str) -> anyhow::Result<Self> {
        match s {
            "lossy" => Ok(Mode::Lossy),
            "lossless" => Ok(Mode::Lossless),
            other => anyhow::bail!("audit mode {other:?} is not lossy or lossless"),
        }
    }
}
