//! tierproxy: a node-level network policy enforcer.
pub mod agent;
pub mod audit;
pub mod cluster;
pub mod config;
pub mod explain;
pub mod lab;
pub mod loadgen;
pub mod metrics;
pub mod policy;
pub mod proxy;
pub mod redirect;
pub mod synth;
