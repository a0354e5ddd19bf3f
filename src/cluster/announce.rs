//! The agent's own Node says whether the agent enforces (issue #18, "one proxy per
//! connection"): annotation [`ANNOTATION_ENFORCING`] = `"true"` while it does, removed when
//! it stops.
//!
//! Every agent decides, for the pods of its node, their egress and the server's ingress
//! wherever the server runs, and proxies their connections. A node whose pods' connections
//! come from a node that announces itself decides them on the first packet (the ingress
//! of its own pods, again) and lets the kernel forward them instead of terminating them a
//! second time. The annotation only saves that second termination: what a missing, stale
//! or forged annotation costs is written in docs/architecture.md ("Who decides what").
//!
//! Writes are JSON merge patches of `metadata.annotations` (RFC 7386; a `null` value
//! deletes the key), which touch no other field and need `patch` on `nodes` (deploy/'s
//! ClusterRole). A failed write is retried with backoff while the wanted state stays the
//! same; a denied one (403: the RBAC lacks `patch`) is logged once and not retried, and the
//! other nodes keep proxying this node's pods' connections a second time, as before the
//! annotation existed.

use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{Patch, PatchParams};
use tokio::sync::watch;

pub use crate::policy::compile::ANNOTATION_ENFORCING;

/// The field manager named on every write (server-side field ownership).
pub const FIELD_MANAGER: &str = "tierproxy-agent";

/// First and longest pause between failed writes.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(500), Duration::from_secs(30));

/// The merge patch that sets (`true`) or removes (`false`) the annotation.
pub fn patch_body(enforcing: bool) -> serde_json::Value {
    let value = if enforcing { serde_json::json!("true") } else { serde_json::Value::Null };
    serde_json::json!({"metadata": {"annotations": {ANNOTATION_ENFORCING: value}}})
}

/// Keeps Node `node`'s annotation equal to the value of `wanted` (initially `false`: the
/// annotation is left as it is until the agent first enforces). Returns once `wanted` is
/// `false` after having been `true` and the annotation is removed (or its removal failed
/// [`REMOVE_ATTEMPTS`] times), when a write is denied, or when the sender is dropped while
/// nothing is to be written.
pub async fn run(client: kube::Client, node: String, mut wanted: watch::Receiver<bool>) {
    let nodes: Api<Node> = Api::all(client);
    let mut announced = false;
    loop {
        let want = *wanted.borrow_and_update();
        if want != announced {
            match write(&nodes, &node, want, &mut wanted).await {
                Written::Done => announced = want,
                Written::Superseded => continue,
                Written::Stop => return,
            }
            if !announced {
                return;
            }
        }
        if wanted.changed().await.is_err() {
            return;
        }
    }
}

/// How [`write`] ended.
enum Written {
    /// The annotation is as wanted.
    Done,
    /// The wish changed while a set was being retried.
    Superseded,
    /// Denied, given up, or the sender is gone: stop announcing.
    Stop,
}

/// Writes `want`, retrying with backoff: a set until it succeeds or the wish changes, a
/// removal at most [`REMOVE_ATTEMPTS`] times (the agent is exiting).
async fn write(
    nodes: &Api<Node>,
    node: &str,
    want: bool,
    wanted: &mut watch::Receiver<bool>,
) -> Written {
    let params = PatchParams { field_manager: Some(FIELD_MANAGER.into()), ..Default::default() };
    let mut pause = BACKOFF.0;
    let mut attempt = 0u32;
    loop {
        attempt += 1;
        let e = match nodes.patch(node, &params, &Patch::Merge(patch_body(want))).await {
            Ok(_) => {
                tracing::info!(
                    node = %node,
                    annotation = ANNOTATION_ENFORCING,
                    enforcing = want,
                    "node annotation written: other nodes {} this node's pods' connections",
                    if want { "decide, and do not proxy again," } else { "proxy again" }
                );
                return Written::Done;
            }
            Err(kube::Error::Api(e)) if e.code == 403 => {
                tracing::warn!(
                    node = %node,
                    error = %e,
                    "cannot annotate this node (RBAC: patch nodes): other nodes keep proxying its pods' connections a second time"
                );
                return Written::Stop;
            }
            Err(e) => e,
        };
        if !want && attempt >= REMOVE_ATTEMPTS {
            tracing::warn!(
                node = %node,
                error = %e,
                "could not remove the enforcing annotation; until it is removed, other nodes forward this node's pods' connections after deciding them, unproxied"
            );
            return Written::Stop;
        }
        tracing::warn!(node = %node, error = %e, retry_in = ?pause, "writing the node annotation failed");
        if want {
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                changed = wanted.changed() => {
                    return if changed.is_err() { Written::Stop } else { Written::Superseded };
                }
            }
        } else {
            tokio::time::sleep(pause).await;
        }
        pause = (pause * 2).min(BACKOFF.1);
    }
}

/// Attempts at removing the annotation on stop before giving up (the agent is exiting).
pub const REMOVE_ATTEMPTS: u32 = 3;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patches_set_and_delete_only_the_annotation() {
        assert_eq!(
            patch_body(true),
            serde_json::json!({"metadata": {"annotations": {"tierproxy.io/enforcing": "true"}}})
        );
        assert_eq!(
            patch_body(false),
            serde_json::json!({"metadata": {"annotations": {"tierproxy.io/enforcing": null}}})
        );
    }
}
