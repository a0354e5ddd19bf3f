//! Leader election on a `coordination.k8s.io/v1` Lease: which one agent writes policy status
//! ([`super::status`]). Every agent with `--kube` is a candidate; at most one leads.
//!
//! - **Taking and renewing.** A candidate reads the Lease and replaces it with itself as
//!   `holderIdentity` and `renewTime` now, carrying the `resourceVersion` it read: of two
//!   candidates racing for a free Lease the API server takes one write and answers the other
//!   409 Conflict. A missing Lease is created the same way. The leader renews every third
//!   of the lease duration, and [`RETRY`] after a failed renewal.
//! - **Leading ends with the lease, not with a failed read.** A leader leads until one lease
//!   duration after it *sent* its last successful renewal ([`Leadership`]). When renewals
//!   fail (the API server unreachable, its permission to the Lease revoked, a conflict), it
//!   stops on its own, and it leads again only after a renewal succeeds. Another candidate
//!   takes a held Lease only once it has seen the Lease's record (holder, `renewTime`,
//!   duration) unchanged for a whole lease duration on its own monotonic clock, and it can
//!   only have seen the last renewal after it was sent: the old leader has stopped by then,
//!   whatever the skew between the nodes' wall clocks.
//! - **Watching, not polling.** Candidates watch the one Lease (a field selector on its
//!   name) and read it only when it is free or due to expire: a release is taken over at
//!   once, and an idle candidate costs the API server a watch, not a request every few
//!   seconds per node (there is one candidate per node).
//! - **Release.** A stopping leader stops writing, then clears `holderIdentity`,
//!   `acquireTime`, `renewTime` and `leaseDurationSeconds` (within [`RELEASE_TIMEOUT`]):
//!   the next candidate takes over at once instead of after the lease duration.
//!
//! Why not a library: kube-lease-manager (used before, issue #19 item 2) reports
//! leadership from its last successful read of the Lease, so a leader whose renewals fail
//! goes on believing it leads until a read succeeds again, after backoff of up to 30 s; and
//! its candidates sleep until the lease expires, so a release is seen only then.
//! kube-leader-election, which reports each attempt's outcome, is built on kube 4.
//!
//! Sources: client-go `tools/leaderelection` (`tryAcquireOrRenew`: the observed record
//! and its local observation time decide expiry; the release that clears the holder);
//! the Lease API (`coordination.k8s.io/v1` `LeaseSpec`); Kubernetes API concepts, "Resource
//! versions" (a replace with an outdated `resourceVersion` is refused with 409 Conflict);
//! RBAC, "Referring to resources" (a `list`/`watch` limited by `resourceNames` needs the
//! `metadata.name` field selector).
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::watch;
use tokio::time::Instant;

/// How soon a failed attempt (to take or renew the Lease) is tried again.
pub const RETRY: Duration = Duration::from_secs(1);
/// How long a stopping leader tries to release the Lease (the agent waits at most its stop
/// grace for it, see `agent`).
pub const RELEASE_TIMEOUT: Duration = Duration::from_secs(3);
/// Largest random delay before a candidate takes a free or expired Lease: candidates that
/// see a release at the same moment do not all write at once; the first write wins and the
/// watch shows it to most others before their turn.
const TAKE_JITTER: Duration = Duration::from_millis(500);

/// Which Lease, as whom, for how long.
#[derive(Debug, Clone)]
pub struct LeaseOptions {
    /// Namespace of the Lease.
    pub namespace: String,
    /// Name of the Lease.
    pub name: String,
    /// This candidate's `holderIdentity`.
    pub identity: String,
    /// `leaseDurationSeconds` (whole seconds, at least 1): how long the Lease stays this
    /// candidate's after a renewal.
    pub duration: Duration,
    /// Field manager of the writes.
    pub field_manager: String,
}

/// Until when this agent may act as the leader, as [`run`] publishes it (`None`: it does
/// not lead). Read it with [`leading_until`]: the instant passes without a new message
/// when renewals fail.
pub type Leadership = watch::Receiver<Option<Instant>>;

/// The instant until which `lead` lets this agent act as the leader, if it is still ahead.
pub fn leading_until(lead: &Leadership) -> Option<Instant> {
    (*lead.borrow()).filter(|until| Instant::now() < *until)
}

/// Takes part in the election until `stop` completes, publishing on `leading` until when
/// this agent leads; then releases the Lease if this agent holds it. Errors are logged and
/// retried ([`RETRY`]); none ends the election.
pub async fn run(
    client: kube::Client,
    options: LeaseOptions,
    leading: watch::Sender<Option<Instant>>,
    stop: impl Future<Output = ()>,
) {
    let api: Api<Lease> = Api::namespaced(client, &options.namespace);
    let config = watcher::Config::default().fields(&format!("metadata.name={}", options.name));
    let mut events = watcher(api.clone(), config).default_backoff().boxed();
    let mut e = Elector::new(api, options);
    tokio::pin!(stop);
    loop {
        let next = e.next_attempt();
        let lapse = e.until.filter(|u| !e.lapsed && *u > Instant::now());
        tokio::select! {
            biased;
            () = &mut stop => break,
            Some(event) = events.next() => match event {
                Ok(event) => e.on_event(event),
                Err(err) => tracing::debug!(lease = %e.options.name, error = %err, "watching the Lease"),
            },
            () = tokio::time::sleep_until(next) => {
                let timeout = e.options.duration / 3;
                let result = tokio::select! {
                    biased;
                    () = &mut stop => break,
                    r = tokio::time::timeout(timeout, e.attempt()) => r,
                };
                e.after_attempt(result);
            }
            () = tokio::time::sleep_until(lapse.unwrap_or_else(Instant::now)), if lapse.is_some() => {
                e.lapsed = true;
                tracing::warn!(lease = %e.options.name, "the Lease was not renewed within its duration: no longer writing policy status until a renewal succeeds");
            }
        }
        leading.send_if_modified(|l| {
            let changed = *l != e.until;
            *l = e.until;
            changed
        });
    }
    leading.send_replace(None);
    e.release().await;
}

/// The part of a Lease whose change shows that its holder is alive.
#[derive(Debug, Clone, PartialEq)]
struct Record {
    holder: Option<String>,
    renew_time: Option<MicroTime>,
    duration_seconds: Option<i32>,
}

/// The Lease as last seen.
#[derive(Debug)]
struct Seen {
    record: Record,
    /// When this record was first seen (the local clock).
    since: Instant,
}

struct Elector {
    api: Api<Lease>,
    options: LeaseOptions,
    /// `None`: absent, or not seen yet.
    seen: Option<Seen>,
    /// While the watcher relists: whether the list held the Lease.
    listing: Option<bool>,
    /// Until when this agent leads: its last successful take or renewal's start plus the
    /// lease duration.
    until: Option<Instant>,
    /// Whether `until` passed without a renewal (logged once).
    lapsed: bool,
    /// No attempt before this: the next renewal, or a retry after a failure.
    not_before: Instant,
    /// Whether the last attempt failed (the first failure of a run is logged as a warning).
    failing: bool,
    /// This candidate's delay before taking a free Lease.
    jitter: Duration,
}

impl Elector {
    fn new(api: Api<Lease>, options: LeaseOptions) -> Elector {
        let mut b = [0u8; 2];
        let jitter = match getrandom::fill(&mut b) {
            Ok(()) => TAKE_JITTER.mul_f64(f64::from(u16::from_le_bytes(b)) / f64::from(u16::MAX)),
            Err(_) => Duration::ZERO,
        };
        Elector {
            api,
            options,
            seen: None,
            listing: None,
            until: None,
            lapsed: false,
            not_before: Instant::now(),
            failing: false,
            jitter,
        }
    }

    fn leads(&self, now: Instant) -> bool {
        self.until.is_some_and(|u| now < u)
    }

    fn holder(&self) -> Option<&str> {
        self.seen.as_ref().and_then(|s| s.record.holder.as_deref()).filter(|h| !h.is_empty())
    }

    /// When to try to take or renew the Lease next.
    fn next_attempt(&self) -> Instant {
        let now = Instant::now();
        if self.leads(now) {
            return self.not_before;
        }
        let when = match (&self.seen, self.holder()) {
            (_, Some(h)) if h == self.options.identity => now,
            (Some(s), Some(_)) => s.since + self.expiry_of(&s.record) + self.jitter,
            _ => now + self.jitter,
        };
        when.max(self.not_before)
    }

    /// How long `record` holds the Lease after it was first seen.
    fn expiry_of(&self, record: &Record) -> Duration {
        match record.duration_seconds {
            Some(s) if s > 0 => Duration::from_secs(s as u64),
            _ => self.options.duration,
        }
    }

    /// Records what `lease` says. `fresh`: it comes from this candidate's own read or write,
    /// not from the watch, which may still deliver changes older than the last write.
    fn observe(&mut self, lease: &Lease, fresh: bool) {
        if lease.metadata.name.as_deref() != Some(&self.options.name) {
            return;
        }
        let spec = lease.spec.clone().unwrap_or_default();
        let record = Record {
            holder: spec.holder_identity,
            renew_time: spec.renew_time,
            duration_seconds: spec.lease_duration_seconds,
        };
        if self.seen.as_ref().is_none_or(|s| s.record != record) {
            self.seen = Some(Seen { record, since: Instant::now() });
        }
        if self.until.is_some()
            && let Some(h) = self.holder()
            && h != self.options.identity
        {
            if fresh {
                tracing::warn!(lease = %self.options.name, holder = %h, "the Lease was taken by another agent: no longer writing policy status");
                self.until = None;
            } else {
                // Possibly an old change: read the Lease now to know.
                self.not_before = Instant::now();
            }
        }
    }

    fn on_event(&mut self, event: watcher::Event<Lease>) {
        match event {
            watcher::Event::Init => self.listing = Some(false),
            watcher::Event::InitApply(l) => {
                self.listing = Some(true);
                self.observe(&l, false);
            }
            watcher::Event::InitDone => {
                if self.listing.take() == Some(false) {
                    self.seen = None;
                }
            }
            watcher::Event::Apply(l) => self.observe(&l, false),
            watcher::Event::Delete(l) => {
                if l.metadata.name.as_deref() == Some(&self.options.name) {
                    self.seen = None;
                }
            }
        }
    }

    /// `spec` taken or renewed by this candidate, at `now`.
    fn taken(&self, spec: Option<LeaseSpec>, now: MicroTime) -> LeaseSpec {
        let mut spec = spec.unwrap_or_default();
        if spec.holder_identity.as_deref() != Some(&self.options.identity) {
            spec.acquire_time = Some(now.clone());
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        }
        spec.holder_identity = Some(self.options.identity.clone());
        spec.renew_time = Some(now);
        spec.lease_duration_seconds =
            Some(i32::try_from(self.options.duration.as_secs().max(1)).unwrap_or(i32::MAX));
        spec
    }

    fn post_params(&self) -> PostParams {
        PostParams { dry_run: false, field_manager: Some(self.options.field_manager.clone()) }
    }

    /// Reads the Lease and, if it is free, expired or this candidate's, takes or renews it.
    /// `Ok(true)`: this candidate leads for another lease duration from the attempt's start.
    async fn attempt(&mut self) -> Result<bool, kube::Error> {
        let start = Instant::now();
        let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
        let written = match self.api.get_opt(&self.options.name).await? {
            None => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.options.name.clone()),
                        namespace: Some(self.options.namespace.clone()),
                        ..ObjectMeta::default()
                    },
                    spec: Some(self.taken(None, now)),
                };
                self.api.create(&self.post_params(), &lease).await
            }
            Some(mut lease) => {
                self.observe(&lease, true);
                let free = match (&self.seen, self.holder()) {
                    (_, None) => true,
                    (_, Some(h)) if h == self.options.identity => true,
                    (Some(s), Some(_)) => s.since + self.expiry_of(&s.record) <= Instant::now(),
                    (None, Some(_)) => false,
                };
                if !free {
                    return Ok(false);
                }
                lease.spec = Some(self.taken(lease.spec.take(), now));
                self.api.replace(&self.options.name, &self.post_params(), &lease).await
            }
        };
        match written {
            Ok(lease) => {
                self.observe(&lease, true);
                if !self.leads(start) {
                    tracing::info!(lease = %self.options.name, identity = %self.options.identity, "took the Lease: writing policy status");
                } else if self.failing {
                    tracing::info!(lease = %self.options.name, "renewed the Lease again");
                }
                self.until = Some(start + self.options.duration);
                self.lapsed = false;
                self.not_before = start + self.options.duration / 3;
                Ok(true)
            }
            // Another candidate wrote first; the watch shows the result.
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn after_attempt(
        &mut self,
        result: Result<Result<bool, kube::Error>, tokio::time::error::Elapsed>,
    ) {
        let error = match result {
            Ok(Ok(true)) => {
                self.failing = false;
                return;
            }
            Ok(Ok(false)) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(_) => Some("no answer".to_string()),
        };
        self.not_before = Instant::now() + RETRY;
        let Some(error) = error else {
            self.failing = false;
            return;
        };
        if self.leads(Instant::now()) && !self.failing {
            let left = self.until.map(|u| u.saturating_duration_since(Instant::now()));
            tracing::warn!(lease = %self.options.name, error = %error, left_secs = left.map(|d| d.as_secs_f32()), "cannot renew the Lease: policy status writes stop when it runs out, unless a renewal succeeds first");
        } else {
            tracing::debug!(lease = %self.options.name, error = %error, "cannot take or renew the Lease");
        }
        self.failing = true;
    }

    /// Clears the Lease if this candidate holds it, so that another takes over at once.
    async fn release(&mut self) {
        let held = self.until.is_some() || self.holder() == Some(&self.options.identity);
        self.until = None;
        if !held {
            return;
        }
        let release = async {
            // A conflict means the Lease changed since it was read: read it again.
            for _ in 0..3 {
                let Some(mut lease) = self.api.get_opt(&self.options.name).await? else {
                    return Ok(false);
                };
                let mut spec = lease.spec.take().unwrap_or_default();
                if spec.holder_identity.as_deref() != Some(&self.options.identity) {
                    return Ok(false);
                }
                spec.holder_identity = None;
                spec.acquire_time = None;
                spec.renew_time = None;
                spec.lease_duration_seconds = None;
                lease.spec = Some(spec);
                match self.api.replace(&self.options.name, &self.post_params(), &lease).await {
                    Ok(_) => return Ok(true),
                    Err(kube::Error::Api(s)) if s.code == 409 => continue,
                    Err(e) => return Err(e),
                }
            }
            Ok(false)
        };
        match tokio::time::timeout(RELEASE_TIMEOUT, release).await {
            Ok(Ok(true)) => tracing::info!(lease = %self.options.name, "released the Lease"),
            Ok(Ok(false)) => {}
            Ok(Err(e)) => {
                tracing::warn!(lease = %self.options.name, error = %e, "cannot release the Lease; another agent takes it when it expires")
            }
            Err(_) => {
                tracing::warn!(lease = %self.options.name, "the Lease's release got no answer; another agent takes it when it expires")
            }
        }
    }
}
