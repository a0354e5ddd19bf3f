//! Where cluster state and policies come from: manifest files ([`manifest`], issue #5) and
//! the API server ([`apiserver`], kube-rs watchers with reflector stores, issue #6). Both
//! feed the same [`crate::policy::Inputs`] and one snapshot [`builder`] (run by the agent's reloader);
//! [`status`] writes back, from the one agent [`lease`] elects, whether each policy was
//! accepted, and [`lastgood`] what every agent enforces in place of a policy whose new
//! version is invalid; [`announce`] keeps the agent's own Node annotated while it enforces.
//!
//! This module is the only user of the kube client (DESIGN §4).
pub mod announce;
pub mod apiserver;
pub mod builder;
pub mod lastgood;
pub mod lease;
pub mod manifest;
pub mod status;
