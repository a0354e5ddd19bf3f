//! tierproxy: a node-level network policy enforcer for Kubernetes clusters without eBPF.
//!
//! # Layout
//!
//! - [`policy`]: pure policy engine: API types, validation, compiled snapshots, `decide`
//!   (no tokio, no kube client, no netfilter, no OTel).
//! - [`cluster`]: where cluster state comes from (manifest files, the API server) and the
//!   policy status written back.
//! - [`redirect`]: the netfilter ruleset as a value and its backends; decides nothing.
//! - [`proxy`]: NFQUEUE first-packet decisions, the transparent proxy and its relay, the
//!   registry of live connections, the one lifecycle each proxied flow goes through.
//! - [`audit`]: OpenTelemetry audit events, their selection, limits and sinks; the data
//!   path never waits on it in lossy mode.
//! - [`metrics`]: Prometheus metrics and health endpoints; [`debug`]: the read-only debug
//!   endpoints beside them (what the snapshot in force decides and holds, loopback-only by
//!   default); [`limits`]: the limits an agent can reach, counted and logged at most once
//!   per 10 s.
//! - [`agent`]: the wiring of one node's enforcement; [`config`] its typed settings;
//!   [`host`] what it sets and reads on the node (sysctls, open files, capabilities).
//! - [`error`]: an error and its causes on one line, for logs and commands.
//! - [`explain`]: `explain` and `check`; [`lab`]: the network-namespace lab; [`loadgen`]
//!   and [`synth`]: load and synthetic clusters for measurements.
//!
//! `docs/architecture.md` has the data flow and the decisions behind it.
pub mod agent;
pub mod audit;
pub mod cluster;
pub mod config;
pub mod crds;
pub mod debug;
pub mod error;
pub mod explain;
pub mod host;
#[cfg(feature = "lab")]
pub mod lab;
pub mod limits;
#[cfg(feature = "lab")]
pub mod loadgen;
pub mod metrics;
pub mod policy;
pub mod proxy;
pub mod redirect;
pub mod synth;
#[cfg(test)]
pub(crate) mod testing;
