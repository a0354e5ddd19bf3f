//! Where cluster state and policies come from. Today: manifest files ([`manifest`]); the
//! kube-rs watchers (issue #6) will feed the same [`crate::policy::Inputs`].
pub mod manifest;
