//! The live proxied connections and UDP flows of this node, each with the decision that
//! admitted it.
//!
//! A flow is registered before its decision is made ([`super::lifecycle`]) and removed
//! when its [`Registration`] is dropped, after its end record. Shutdown and re-decision
//! on policy change walk the registry and tell flows to stop; the drain waits until it is
//! empty ([`Registry::wait_empty`]).
//!
//! Source: issue #3 "The proxy" (registry), issue #21 item 4, DESIGN §5.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use tokio::sync::Notify;

use super::relay::Counters;
use crate::audit::CloseReason;
use crate::policy::FlowKey;
use crate::policy::eval::Decision;
use crate::policy::ports::Protocol;

/// `protocol`'s bit in [`Registry::handing_over`].
fn bit(protocol: Protocol) -> u8 {
    match protocol {
        Protocol::Tcp => 1,
        Protocol::Udp => 2,
        Protocol::Sctp => 4,
    }
}

/// Why a live flow was told to stop; audited as its close reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum StopReason {
    /// The agent is shutting down (after the drain grace).
    Shutdown = 1,
    /// A new snapshot denies the flow (issue #5).
    PolicyChange = 2,
    /// The flow goes to the next agent (issue #23): its relay stops without touching its
    /// sockets and the flow is handed over ([`super::handover`]). A flow that cannot be
    /// handed over (no hand-over under way) ends as at shutdown.
    HandOver = 3,
}

impl StopReason {
    fn from_u8(v: u8) -> Option<StopReason> {
        match v {
            1 => Some(StopReason::Shutdown),
            2 => Some(StopReason::PolicyChange),
            3 => Some(StopReason::HandOver),
            _ => None,
        }
    }
}

impl From<StopReason> for CloseReason {
    fn from(r: StopReason) -> CloseReason {
        match r {
            StopReason::Shutdown | StopReason::HandOver => CloseReason::Shutdown,
            StopReason::PolicyChange => CloseReason::PolicyChange,
        }
    }
}

/// One live flow.
#[derive(Debug)]
pub struct Tracked {
    /// Registry id, unique for the life of the process.
    pub id: u64,
    /// Client address and original destination.
    pub key: FlowKey,
    /// When it was registered.
    pub accepted: Instant,
    /// The decision that admitted it; set once, right after registration.
    pub decision: OnceLock<Arc<Decision>>,
    /// Bytes moved each way so far.
    pub counters: Counters,
    /// Notified to make the relay end (TCP: reason `Stopped`, both sides reset; UDP: its
    /// sockets closed); [`Tracked::stop_reason`] says why. A notification sent before the
    /// relay waits is kept for it.
    pub stop: Notify,
    /// The [`StopReason`] as a `u8` (0: not told to stop); the first one told stays.
    stop_why: AtomicU8,
}

impl Tracked {
    /// Tells the flow to stop for `why`. A flow told twice keeps the first reason.
    pub fn stop(&self, why: StopReason) {
        let _ = self.stop_why.compare_exchange(0, why as u8, Ordering::Relaxed, Ordering::Relaxed);
        self.stop.notify_one();
    }

    /// Why it was told to stop; `None` if it was not.
    pub fn stop_reason(&self) -> Option<StopReason> {
        StopReason::from_u8(self.stop_why.load(Ordering::Relaxed))
    }
}

/// The registry. Cheap to share (`Arc`); a mutex-guarded map touched twice per flow.
#[derive(Debug, Default)]
pub struct Registry {
    live: Mutex<HashMap<u64, Arc<Tracked>>>,
    next: AtomicU64,
    /// Notified (every waiter) when the last live flow leaves.
    emptied: Notify,
    /// The protocols whose flows are being handed over ([`bit`] of each): while any is,
    /// every flow that leaves notifies [`Registry::left`].
    handing_over: AtomicU8,
    /// Notified (every waiter) when a flow leaves during a hand-over.
    left: Notify,
}

/// Removes its flow from the registry when dropped.
#[derive(Debug)]
pub struct Registration {
    registry: Arc<Registry>,
    /// The registered flow.
    pub tracked: Arc<Tracked>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut live = self.registry.lock();
        live.remove(&self.tracked.id);
        let empty = live.is_empty();
        drop(live);
        if empty {
            self.registry.emptied.notify_waiters();
        }
        if self.registry.handing_over.load(Ordering::Relaxed) != 0 {
            self.registry.left.notify_waiters();
        }
    }
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Tracked>>> {
        // A panic while holding the lock cannot leave the map inconsistent (single
        // insert/remove), so a poisoned lock is still usable.
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a flow (before its decision: [`super::lifecycle`]).
    pub fn register(self: &Arc<Self>, key: FlowKey) -> Registration {
        self.register_at(key, Instant::now(), Counters::default())
    }

    /// Registers the flow `key` that began at `accepted` and has moved `counters` bytes
    /// already: a connection the previous agent handed over (issue #23), whose end record
    /// gives its whole duration and byte counts.
    pub fn register_at(
        self: &Arc<Self>,
        key: FlowKey,
        accepted: Instant,
        counters: Counters,
    ) -> Registration {
        let tracked = Arc::new(Tracked {
            id: self.next.fetch_add(1, Ordering::Relaxed),
            key,
            accepted,
            decision: OnceLock::new(),
            counters,
            stop: Notify::new(),
            stop_why: AtomicU8::new(0),
        });
        // Registered after its protocol's hand-over walk began: told at once, so the
        // walk's wait for no flow of it is not left waiting on it. Read under the lock the
        // walk sets the flag under: a flow is either in the walk's copy or sees the flag.
        let mut live = self.lock();
        if self.handing_over.load(Ordering::Relaxed) & bit(key.protocol) != 0 {
            tracked.stop(StopReason::HandOver);
        }
        live.insert(tracked.id, tracked.clone());
        drop(live);
        Registration { registry: self.clone(), tracked }
    }

    /// Tells every live flow of `protocol` (TCP connections, UDP flows of the proxy path)
    /// to stop for a hand-over ([`StopReason::HandOver`]): each relay stops where it is
    /// and its task hands the flow on. A flow of `protocol` registered from now on is told
    /// at once. Returns how many were told. From now on [`Registry::wait_none`] is woken
    /// as flows leave, until [`Registry::hand_over_ended`] for `protocol`.
    pub fn hand_over(&self, protocol: Protocol) -> usize {
        {
            // Under the lock registration reads the mask under: a flow is either in the
            // copy below or sees its protocol's bit.
            let _live = self.lock();
            self.handing_over.fetch_or(bit(protocol), Ordering::Relaxed);
        }
        let mut n = 0;
        for t in self.connections() {
            if t.key.protocol == protocol {
                t.stop(StopReason::HandOver);
                n += 1;
            }
        }
        n
    }

    /// Live flows of `protocol` now.
    pub fn len_of(&self, protocol: Protocol) -> usize {
        self.lock().values().filter(|t| t.key.protocol == protocol).count()
    }

    /// Returns once no flow of `protocol` is live (at once if none is); only during its
    /// hand-over ([`Registry::hand_over`]), which makes leaving flows wake it.
    pub async fn wait_none(&self, protocol: Protocol) {
        loop {
            let left = self.left.notified();
            tokio::pin!(left);
            left.as_mut().enable();
            if self.len_of(protocol) == 0 {
                return;
            }
            left.await;
        }
    }

    /// Ends the hand-over of `protocol`'s flows (given on, or a hand-over that did not
    /// complete): new flows of it are no longer told to stop, and once no protocol is
    /// handed over, leaving flows stop waking [`Registry::wait_none`].
    pub fn hand_over_ended(&self, protocol: Protocol) {
        self.handing_over.fetch_and(!bit(protocol), Ordering::Relaxed);
    }

    /// Number of live flows.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no flow is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The live flows now (a copy: the registry is not held while the caller works).
    pub fn connections(&self) -> Vec<Arc<Tracked>> {
        self.lock().values().cloned().collect()
    }

    /// Tells every live flow to stop (shutdown). A flow whose relay has not started yet
    /// stops as soon as it does (the notification is kept).
    pub fn stop_all(&self) {
        for t in self.connections() {
            t.stop(StopReason::Shutdown);
        }
    }

    /// Returns once no flow is live (at once if none is). Every flow that left wrote its
    /// end record first ([`super::lifecycle`]).
    pub async fn wait_empty(&self) {
        loop {
            let emptied = self.emptied.notified();
            tokio::pin!(emptied);
            // Listed as a waiter before the check: a last removal between the check and
            // the wait still wakes it.
            emptied.as_mut().enable();
            if self.is_empty() {
                return;
            }
            emptied.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};
    use std::time::Duration;

    use super::*;
    use crate::policy::Protocol;

    fn key(port: u16) -> FlowKey {
        FlowKey {
            src: std::net::SocketAddr::from(([10, 0, 0, 1], port)),
            dst: std::net::SocketAddr::from(([10, 0, 0, 2], 80)),
            protocol: Protocol::Tcp,
        }
    }

    #[test]
    fn a_flow_is_live_from_its_registration_until_it_is_dropped() {
        let r = Arc::new(Registry::default());
        let a = r.register(key(1));
        let b = r.register(key(2));
        assert_ne!(a.tracked.id, b.tracked.id);
        assert_eq!(r.len(), 2);
        let mut keys: Vec<u16> = r.connections().iter().map(|t| t.key.src.port()).collect();
        keys.sort_unstable();
        assert_eq!(keys, [1, 2]);
        drop(a);
        assert_eq!((r.len(), r.connections()[0].key.src.port()), (1, 2));
        drop(b);
        assert!(r.is_empty());
    }

    /// The first reason a flow is told stays: a policy cut during the drain is not
    /// reported as a shutdown.
    #[test]
    fn a_flow_keeps_the_first_stop_reason_it_was_told() {
        let r = Arc::new(Registry::default());
        let a = r.register(key(1));
        assert_eq!(a.tracked.stop_reason(), None);
        a.tracked.stop(StopReason::PolicyChange);
        r.stop_all();
        assert_eq!(a.tracked.stop_reason(), Some(StopReason::PolicyChange));
        assert_eq!(CloseReason::from(StopReason::PolicyChange), CloseReason::PolicyChange);
        assert_eq!(CloseReason::from(StopReason::Shutdown), CloseReason::Shutdown);
        let b = r.register(key(2));
        r.stop_all();
        assert_eq!(b.tracked.stop_reason(), Some(StopReason::Shutdown));
    }

    /// A flow told to stop before its relay waits (shutdown while it connects upstream)
    /// still stops when the relay starts waiting.
    #[tokio::test]
    async fn a_stop_told_before_the_relay_waits_is_kept_for_it() {
        let r = Arc::new(Registry::default());
        let a = r.register(key(1));
        r.stop_all();
        tokio::time::timeout(Duration::from_secs(5), a.tracked.stop.notified())
            .await
            .expect("the stored notification wakes the first waiter");
    }

    /// The drain's wait: pending while a flow is live, woken by the last one leaving (no
    /// polling), and at once when nothing is live.
    #[tokio::test]
    async fn wait_empty_returns_when_the_last_flow_leaves() {
        let r = Arc::new(Registry::default());
        tokio::time::timeout(Duration::from_secs(5), r.wait_empty()).await.unwrap();
        let a = r.register(key(1));
        let b = r.register(key(2));
        let wait = r.wait_empty();
        tokio::pin!(wait);
        let mut cx = Context::from_waker(Waker::noop());
        assert!(wait.as_mut().poll(&mut cx).is_pending());
        drop(a);
        assert!(wait.as_mut().poll(&mut cx).is_pending(), "one flow is still live");
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        let holder = tokio::spawn(async move {
            let _ = released.await;
            drop(b);
        });
        release.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(5), wait).await.expect("woken when emptied");
        holder.await.unwrap();
        assert!(matches!(
            std::pin::pin!(r.wait_empty()).poll(&mut Context::from_waker(Waker::noop())),
            Poll::Ready(())
        ));
    }
}
