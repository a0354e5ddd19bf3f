//! The live proxied connections of this node, each with the decision that admitted it.
//!
//! A connection is registered as soon as it is accepted — before its decision is
//! attached — and removed by a guard when its task ends, however it ends. Shutdown (and,
//! later, re-decision on policy change) walks the registry and tells connections to stop.
//!
//! Source: issue #3 "The proxy" (registry), DESIGN §5.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use tokio::sync::Notify;

use super::packet::FlowKey;
use super::relay::Counters;
use crate::policy::eval::Decision;

/// One live connection.
#[derive(Debug)]
pub struct Tracked {
    /// Registry id, unique for the life of the process.
    pub id: u64,
    /// Client address and original destination.
    pub key: FlowKey,
    /// When it was accepted.
    pub accepted: Instant,
    /// The decision that admitted it; set once, right after registration.
    pub decision: OnceLock<Arc<Decision>>,
    /// Bytes moved each way so far.
    pub counters: Counters,
    /// Notified to make the relay end (reason `Stopped`, both sides reset); see
    /// [`Tracked::stop_reason`] for why.
    pub stop: Notify,
    /// Why it was told to stop: [`STOP_SHUTDOWN`] or [`STOP_POLICY_CHANGE`]; 0 if not.
    pub stop_why: AtomicU8,
}

/// [`Tracked::stop_why`]: the agent is shutting down.
pub const STOP_SHUTDOWN: u8 = 1;
/// [`Tracked::stop_why`]: a new snapshot denies the connection (issue #5).
pub const STOP_POLICY_CHANGE: u8 = 2;

impl Tracked {
    /// Tells the connection to stop, for `why` ([`STOP_SHUTDOWN`], [`STOP_POLICY_CHANGE`]).
    pub fn stop(&self, why: u8) {
        let _ = self.stop_why.compare_exchange(0, why, Ordering::Relaxed, Ordering::Relaxed);
        self.stop.notify_one();
    }

    /// The audited reason of a stop: `shutdown` or `policy-change` (`None` if not told
    /// to stop).
    pub fn stop_reason(&self) -> Option<crate::audit::CloseReason> {
        match self.stop_why.load(Ordering::Relaxed) {
            STOP_SHUTDOWN => Some(crate::audit::CloseReason::Shutdown),
            STOP_POLICY_CHANGE => Some(crate::audit::CloseReason::PolicyChange),
            _ => None,
        }
    }
}

/// The registry. Cheap to share (`Arc`); a mutex-guarded map touched twice per
/// connection.
#[derive(Debug, Default)]
pub struct Registry {
    live: Mutex<HashMap<u64, Arc<Tracked>>>,
    next: AtomicU64,
}

/// Removes its connection from the registry when dropped.
#[derive(Debug)]
pub struct Registration {
    registry: Arc<Registry>,
    /// The registered connection.
    pub tracked: Arc<Tracked>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.registry.lock().remove(&self.tracked.id);
    }
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Tracked>>> {
        // A panic while holding the lock cannot leave the map inconsistent (single
        // insert/remove), so a poisoned lock is still usable.
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a connection just accepted.
    pub fn register(self: &Arc<Self>, key: FlowKey) -> Registration {
        let tracked = Arc::new(Tracked {
            id: self.next.fetch_add(1, Ordering::Relaxed),
            key,
            accepted: Instant::now(),
            decision: OnceLock::new(),
            counters: Counters::default(),
            stop: Notify::new(),
            stop_why: AtomicU8::new(0),
        });
        self.lock().insert(tracked.id, tracked.clone());
        Registration { registry: self.clone(), tracked }
    }

    /// Number of live connections.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no connection is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The live connections now (a copy: the registry is not held while the caller works).
    pub fn connections(&self) -> Vec<Arc<Tracked>> {
        self.lock().values().cloned().collect()
    }

    /// Tells every live connection to stop (shutdown). A connection whose relay has not
    /// started yet stops as soon as it does (the notification is stored).
    pub fn stop_all(&self) {
        for t in self.connections() {
            t.stop(STOP_SHUTDOWN);
        }
    }
}
