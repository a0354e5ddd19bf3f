//! One proxied connection or UDP flow, from its admission to its end record: the order
//! every flow the proxy terminates goes through, for TCP ([`super::tcp`]) and UDP on the
//! proxy path ([`super::udp`]) alike.
//!
//! 1. **Register** the flow in the [`Registry`], before anything is decided: a re-decision
//!    walk ([`Decider::redecide`]) that starts from here on sees it.
//! 2. **Decide**: the first packet's decision when the queue kept one, else a decision
//!    made now ([`Decider::take_or_decide`]). A denied flow ends here: it never opened,
//!    its decision is its record, and it writes no end record.
//! 3. **Open** ([`Lifecycle::open`]): counted as opened, and decided again when a
//!    snapshot newer than its decision's is in force ([`Decider::recheck`]; a walk that
//!    began before step 1 missed it). From here on exactly one end record is due.
//! 4. **End**: the end record ([`record_end`]: the metrics always, audit when the
//!    decision was audited or a policy change cut the flow), written by
//!    [`Lifecycle::end`], or when the [`Lifecycle`] is dropped without it — the task was
//!    aborted, its runtime dropped it at shutdown, or it panicked. Only then does the
//!    flow leave the registry, so a drain that sees the registry empty
//!    ([`Registry::wait_empty`]) knows every end record has been handed to audit.
//!
//! Kernel-forwarded UDP flows ([`super::forwarded`]) have no task and no registration
//! (conntrack's events start and end them) but write their end through the same
//! [`record_end`].
//!
//! Source: issue #21 item 4; STYLE "Register before you decide" (ztunnel registers a
//! connection before its policy check and writes one final record per connection, also
//! when its task is dropped).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::decider::{Admission, Decider};
use super::registry::{Registration, Registry, StopReason, Tracked};
use crate::audit::{Admitted, CloseReason, ConnectionEnd, DecisionPoint, FlowInfo};
use crate::policy::FlowKey;
use crate::policy::eval::Verdict;

/// What the next agent learns of a flow handed over (issue #23), besides its sockets and
/// bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HandedFlow {
    /// How long ago it was accepted.
    pub age: std::time::Duration,
    /// Revision of the snapshot whose decision admitted it.
    pub revision: crate::policy::Revision,
    /// Whether its admission was audited (its end is audited then).
    pub audited: bool,
    /// When its admitting decision was made.
    pub decided: std::time::SystemTime,
}

/// An admitted flow, registered and allowed; its end record is due once it is
/// [opened](Lifecycle::open), and written exactly once: by [`Lifecycle::end`], else when
/// it is dropped.
pub struct Lifecycle {
    decider: Arc<Decider>,
    admission: Admission,
    /// Counted as opened and its end record not written yet.
    open: bool,
    /// Dropped after [`Lifecycle::drop`] has written the end record.
    registration: Registration,
    /// Bytes (to the server, to the client) the previous agent relayed before it handed
    /// the flow over: in its end record, not in this agent's relayed-bytes metric.
    inherited: (u64, u64),
}

impl std::fmt::Debug for Lifecycle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lifecycle")
            .field("tracked", self.tracked())
            .field("admission", &self.admission)
            .field("open", &self.open)
            .finish_non_exhaustive()
    }
}

impl Lifecycle {
    /// Registers the flow `key` in `registry`, then takes or makes its decision
    /// ([`Decider::take_or_decide`]). `Err` with the verdict when that decision denies or
    /// rejects it: the flow is gone from the registry again and has no end record (it
    /// never opened); the caller drops it, or refuses it (a TCP reset, an ICMP error).
    pub fn admit(
        decider: &Arc<Decider>,
        registry: &Arc<Registry>,
        key: FlowKey,
    ) -> Result<Self, Verdict> {
        Lifecycle::admit_registered(decider, registry.register(key))
    }

    /// [`Lifecycle::admit`] for a flow registered already (the TCP accept loop registers
    /// each connection before it spawns its task, so that a hand-over's walk of the
    /// registry never misses one, issue #23).
    pub fn admit_registered(
        decider: &Arc<Decider>,
        registration: Registration,
    ) -> Result<Self, Verdict> {
        let key = registration.tracked.key;
        let admission = decider.take_or_decide(key);
        let _ = registration.tracked.decision.set(admission.decision.clone());
        if !admission.decision.verdict.is_allow() {
            return Err(admission.decision.verdict);
        }
        Ok(Lifecycle {
            decider: decider.clone(),
            admission,
            open: false,
            registration,
            inherited: (0, 0),
        })
    }

    /// Counts the flow as opened (`tierproxy_connections_opened_total`); from now on its
    /// end record is written exactly once. Returns `false` when the flow is to stop at
    /// once ([`Lifecycle::stop_reason`] says why): a snapshot newer than its decision's
    /// denies it (that decision is audited and the flow told to stop for a policy change,
    /// [`Decider::recheck`]), or it was told to stop since it registered (a re-decision
    /// walk cut it, which audited its decision already, or the drain stopped it).
    pub fn open(&mut self) -> bool {
        self.decider.metrics().connections_opened.inc();
        self.open = true;
        let tracked = &self.registration.tracked;
        // A connection told to hand over before it opened opens: its relay stops at once
        // and hands it over with nothing in flight.
        tracked.stop_reason().is_none_or(|r| r == StopReason::HandOver)
            && self.decider.recheck(&self.admission, tracked)
    }

    /// Takes in a live connection the previous agent handed over (issue #23): registers it
    /// with its start and its byte counts so far, decides it again on the snapshot in
    /// force ([`Decider::adopt`]) and counts it as adopted
    /// (`tierproxy_connections_adopted_total`; the previous agent counted it opened): its
    /// end record, written here, gives its whole duration and bytes, and is audited when
    /// the previous agent audited its admission (`handed.audited`); this agent's
    /// relayed-bytes metric counts only the bytes it relays. Returns the flow and whether
    /// that decision allows it; when it does not, the flow is told to stop for a policy
    /// change (the caller resets it and ends it with [`Lifecycle::stop_reason`]).
    pub fn adopt(
        decider: &Arc<Decider>,
        registry: &Arc<Registry>,
        key: FlowKey,
        handed: &HandedFlow,
        counters: crate::proxy::relay::Counters,
    ) -> (Self, bool) {
        let now = std::time::Instant::now();
        let accepted = now.checked_sub(handed.age).unwrap_or(now);
        let inherited = (
            counters.to_server.load(Ordering::Relaxed),
            counters.to_client.load(Ordering::Relaxed),
        );
        let registration = registry.register_at(key, accepted, counters);
        let decision = decider.adopt(&registration.tracked);
        let _ = registration.tracked.decision.set(decision.clone());
        decider.metrics().connections_adopted.inc();
        let allowed = decision.verdict == Verdict::Allow;
        let admission = Admission {
            decision,
            audited: handed.audited,
            time: handed.decided,
            point: DecisionPoint::HandOver,
        };
        let flow =
            Lifecycle { decider: decider.clone(), admission, open: true, registration, inherited };
        (flow, allowed)
    }

    /// Hands the flow over to the next agent: this agent writes no end record for it (the
    /// next one will, [`Lifecycle::adopt`]); it counts it handed over
    /// (`tierproxy_connections_handed_over_total`) and the bytes it relayed of it
    /// (`tierproxy_relayed_bytes_total`). It leaves the registry when the caller drops it,
    /// which must be after the flow is given on: a hand-over is over once no flow of its
    /// protocol is left in the registry ([`Registry::wait_none`]).
    pub fn hand_over(&mut self) -> HandedFlow {
        if self.open {
            let metrics = self.decider.metrics();
            metrics.connections_handed_over.inc();
            let (to_server, to_client) = self.relayed_here();
            metrics.relayed(to_server, to_client);
        }
        self.open = false;
        HandedFlow {
            age: self.tracked().accepted.elapsed(),
            revision: self.admission.decision.revision,
            audited: self.admission.audited,
            decided: self.admission.time,
        }
    }

    /// The registry's entry: key, counters, stop notification.
    pub fn tracked(&self) -> &Arc<Tracked> {
        &self.registration.tracked
    }

    /// The audited reason of a stop: `policy-change` or `shutdown` as the flow was told,
    /// `shutdown` if it was not (a relay ends `Stopped` only when told).
    pub fn stop_reason(&self) -> CloseReason {
        self.tracked().stop_reason().map_or(CloseReason::Shutdown, CloseReason::from)
    }

    /// Writes the end record for `reason` (if the flow was opened) and removes the flow
    /// from the registry.
    pub fn end(mut self, reason: CloseReason) {
        self.write_end(reason);
    }

    fn write_end(&mut self, reason: CloseReason) {
        if !std::mem::replace(&mut self.open, false) {
            return;
        }
        let t = &self.registration.tracked;
        let end = ConnectionEnd {
            reason,
            to_server: t.counters.to_server.load(Ordering::Relaxed),
            to_client: t.counters.to_client.load(Ordering::Relaxed),
            duration: t.accepted.elapsed(),
        };
        let here = self.relayed_here();
        count_and_audit(&self.decider, Some(&self.admission), t.key, end, here);
    }

    /// Bytes (to the server, to the client) this agent relayed: the flow's counts less
    /// what it inherited from the previous agent.
    fn relayed_here(&self) -> (u64, u64) {
        let c = &self.registration.tracked.counters;
        (
            c.to_server.load(Ordering::Relaxed).saturating_sub(self.inherited.0),
            c.to_client.load(Ordering::Relaxed).saturating_sub(self.inherited.1),
        )
    }
}

impl Drop for Lifecycle {
    /// The end record of a flow whose owner did not write it: its task was dropped (an
    /// abort, or the runtime going away at shutdown: reason `shutdown`, or the stop reason
    /// it was told) or panicked (`reset`: its sockets were closed under it).
    fn drop(&mut self) {
        let reason = if std::thread::panicking() { CloseReason::Reset } else { self.stop_reason() };
        self.write_end(reason);
    }
}

/// Writes the end record of the flow `key`: counted in the metrics
/// (`tierproxy_connections_closed_total` by reason, `tierproxy_relayed_bytes_total`), and
/// audited ([`crate::audit::Auditor::connection_end`], the `tierproxy.connection.end`
/// event) when `admission`, the decision that admitted it, was audited, or when a policy
/// change cut it. `None`: a flow whose admission was not kept (a kernel-forwarded UDP flow
/// whose decision was not audited, [`super::forwarded`]): the metrics only. Never waits
/// on audit (ends are dropped, and counted, when its queue is full).
pub fn record_end(
    decider: &Decider,
    admission: Option<&Admission>,
    key: FlowKey,
    end: ConnectionEnd,
) {
    count_and_audit(decider, admission, key, end, (end.to_server, end.to_client));
}

/// [`record_end`], counting `relayed` (to the server, to the client) as this agent's
/// relayed bytes: all of them, or for a flow the previous agent handed over, those since.
fn count_and_audit(
    decider: &Decider,
    admission: Option<&Admission>,
    key: FlowKey,
    end: ConnectionEnd,
    relayed: (u64, u64),
) {
    decider.metrics().closed(end.reason);
    decider.metrics().relayed(relayed.0, relayed.1);
    let Some(admission) = admission else { return };
    let auditor = decider.auditor();
    if !auditor.enabled() || !(admission.audited || end.reason == CloseReason::PolicyChange) {
        return;
    }
    let admitted = Admitted {
        flow: FlowInfo { key, time: admission.time, point: admission.point },
        decision: admission.decision.clone(),
    };
    auditor.connection_end(&decider.current().snapshot, &admitted, end);
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::policy::Protocol;
    use crate::proxy::decider::testing::{self, LOOPBACK_CLUSTER, TestDecider};

    fn key(port: u16) -> FlowKey {
        FlowKey {
            src: std::net::SocketAddr::from(([127, 0, 0, 2], port)),
            dst: std::net::SocketAddr::from(([127, 0, 0, 3], 8080)),
            protocol: Protocol::Tcp,
        }
    }

    fn setup(manifests: &str) -> (tempfile::TempDir, TestDecider, Arc<Registry>) {
        let dir = tempfile::tempdir().unwrap();
        let t = testing::decider(manifests, dir.path());
        (dir, t, Arc::new(Registry::default()))
    }

    /// A snapshot denying the flows of [`key`] comes into force.
    fn publish_denying(t: &TestDecider) {
        t.decider.publish(testing::current(&testing::loopback_cluster_denying(), 2));
    }

    #[test]
    fn an_allowed_flow_that_ends_writes_one_end_record_with_its_bytes() {
        let (_dir, t, registry) = setup(LOOPBACK_CLUSTER);
        let mut flow = Lifecycle::admit(&t.decider, &registry, key(1)).expect("allowed");
        assert_eq!(registry.len(), 1);
        assert!(flow.tracked().decision.get().is_some());
        assert!(flow.open());
        flow.tracked().counters.to_server.fetch_add(10, Ordering::Relaxed);
        flow.tracked().counters.to_client.fetch_add(20, Ordering::Relaxed);
        flow.end(CloseReason::Normal);
        assert!(registry.is_empty());
        assert_eq!((t.opened(), t.closed(CloseReason::Normal), t.closed_total()), (1, 1, 1));
        assert_eq!(t.metric(r#"tierproxy_relayed_bytes_total{direction="to_server"}"#), 10);
        assert_eq!(t.metric(r#"tierproxy_relayed_bytes_total{direction="to_client"}"#), 20);
        let events = t.events();
        assert_eq!(testing::end_reasons(&events), ["normal"]);
        let end = events.iter().find(|v| v["event"] == crate::audit::event::CONNECTION_END);
        assert_eq!(
            end.unwrap()["attributes"][crate::audit::event::attr::BYTES_TO_SERVER],
            10,
            "{events:?}"
        );
    }

    /// A denied flow never opens: its decision is its record, and it writes no end record
    /// (as before the lifecycle type: the proxy resets a TCP client, drops a datagram).
    #[test]
    fn a_denied_flow_leaves_the_registry_without_an_end_record() {
        let (_dir, t, registry) = setup(&testing::loopback_cluster_denying());
        assert_eq!(Lifecycle::admit(&t.decider, &registry, key(1)).err(), Some(Verdict::Deny));
        assert!(registry.is_empty());
        assert_eq!((t.opened(), t.closed_total()), (0, 0));
        let events = t.events();
        assert_eq!(testing::decision_points(&events), ["accept", "accept"]);
        assert!(testing::end_reasons(&events).is_empty(), "{events:?}");
    }

    /// The first packet's decision, kept by the queue, is the one the flow takes.
    #[test]
    fn a_flow_the_queue_decided_takes_the_first_packets_decision() {
        let (_dir, t, registry) = setup(LOOPBACK_CLUSTER);
        t.decider.first_packet(key(1), true, false);
        let mut flow = Lifecycle::admit(&t.decider, &registry, key(1)).expect("allowed");
        assert!(flow.open());
        drop(flow);
        let events = t.events();
        assert_eq!(testing::decision_points(&events), ["first-packet", "first-packet"]);
        assert_eq!(testing::end_reasons(&events), ["shutdown"]);
    }

    /// A flow admitted under the old snapshot and opened after a denying one came into
    /// force (too late for the re-decision walk) is decided again as it opens: cut, with
    /// one audited re-decision and one end record.
    #[test]
    fn a_flow_opened_under_a_newer_denying_snapshot_is_cut_once() {
        let (_dir, t, registry) = setup(LOOPBACK_CLUSTER);
        let mut flow = Lifecycle::admit(&t.decider, &registry, key(1)).expect("allowed");
        publish_denying(&t);
        assert!(!flow.open());
        assert_eq!(flow.stop_reason(), CloseReason::PolicyChange);
        let reason = flow.stop_reason();
        flow.end(reason);
        assert!(registry.is_empty());
        assert_eq!((t.closed(CloseReason::PolicyChange), t.closed_total()), (1, 1));
        let events = t.events();
        assert_eq!(
            testing::decision_points(&events),
            ["accept", "accept", "re-decision", "re-decision"]
        );
        assert_eq!(testing::end_reasons(&events), ["policy-change"]);
    }

    /// Registered before its decision, a flow is seen by a re-decision walk that runs
    /// before it opens; the walk's cut is audited once (opening does not decide again).
    #[test]
    fn a_flow_cut_by_the_walk_before_it_opens_is_audited_and_ended_once() {
        let (_dir, t, registry) = setup(LOOPBACK_CLUSTER);
        let mut flow = Lifecycle::admit(&t.decider, &registry, key(1)).expect("allowed");
        publish_denying(&t);
        assert_eq!(t.decider.redecide(&registry).cut, 1);
        assert!(!flow.open());
        drop(flow);
        assert_eq!((t.closed(CloseReason::PolicyChange), t.closed_total()), (1, 1));
        let events = t.events();
        assert_eq!(
            testing::decision_points(&events),
            ["accept", "accept", "re-decision", "re-decision"]
        );
        assert_eq!(testing::end_reasons(&events), ["policy-change"]);
    }

    /// A live flow the walk cuts ends with reason `policy-change`, once, whichever way its
    /// task ends.
    #[test]
    fn a_live_flow_cut_by_a_policy_change_writes_one_end_record() {
        let (_dir, t, registry) = setup(LOOPBACK_CLUSTER);
        let mut flow = Lifecycle::admit(&t.decider, &registry, key(1)).expect("allowed");
        assert!(flow.open());
        publish_denying(&t);
        assert_eq!(t.decider.redecide(&registry).cut, 1);
        let reason = flow.stop_reason();
        flow.end(reason);
        assert_eq!((t.closed(CloseReason::PolicyChange), t.closed_total()), (1, 1));
        assert_eq!(t.end_events(), ["policy-change"]);
    }

    /// Stopped by the drain: `shutdown`, once, whether the owner ends it or drops it.
    #[test]
    fn a_flow_stopped_at_shutdown_writes_one_end_record() {
        let (_dir, t, registry) = setup(LOOPBACK_CLUSTER);
        let mut ended = Lifecycle::admit(&t.decider, &registry, key(1)).expect("allowed");
        let mut dropped = Lifecycle::admit(&t.decider, &registry, key(2)).expect("allowed");
        assert!(ended.open() && dropped.open());
        registry.stop_all();
        let reason = ended.stop_reason();
        ended.end(reason);
        drop(dropped);
        assert!(registry.is_empty());
        assert_eq!((t.closed(CloseReason::Shutdown), t.closed_total()), (2, 2));
        assert_eq!(t.end_events(), ["shutdown", "shutdown"]);
    }

    /// Admitted, but never opened (a UDP flow whose sockets could not be made): no end
    /// record, as before.
    #[test]
    fn a_flow_dropped_before_it_opens_writes_no_end_record() {
        let (_dir, t, registry) = setup(LOOPBACK_CLUSTER);
        drop(Lifecycle::admit(&t.decider, &registry, key(1)).expect("allowed"));
        assert!(registry.is_empty());
        assert_eq!((t.opened(), t.closed_total()), (0, 0));
        assert!(t.end_events().is_empty());
    }

    /// The task that owns a flow is aborted (as the runtime drops its tasks at the end
    /// of a shutdown): the end record is written as the flow is dropped, once, and before
    /// the flow leaves the registry (the drain, woken by that, flushes audit next).
    #[tokio::test]
    async fn a_flow_whose_task_is_aborted_writes_one_end_record() {
        let (_dir, t, registry) = setup(LOOPBACK_CLUSTER);
        let (opened_tx, opened) = tokio::sync::oneshot::channel();
        let task = {
            let (decider, registry) = (t.decider.clone(), registry.clone());
            tokio::spawn(async move {
                let mut flow = Lifecycle::admit(&decider, &registry, key(1)).expect("allowed");
                assert!(flow.open());
                opened_tx.send(()).unwrap();
                std::future::pending::<()>().await;
                flow.end(CloseReason::Normal);
            })
        };
        tokio::time::timeout(Duration::from_secs(5), opened).await.unwrap().unwrap();
        assert_eq!((registry.len(), t.closed_total()), (1, 0));
        task.abort();
        assert!(task.await.unwrap_err().is_cancelled());
        tokio::time::timeout(Duration::from_secs(5), registry.wait_empty()).await.unwrap();
        assert_eq!((t.closed(CloseReason::Shutdown), t.closed_total()), (1, 1));
        assert_eq!(t.end_events(), ["shutdown"]);
    }

    /// A task that panics with a live flow: its end record says `reset`, once.
    #[tokio::test]
    async fn a_flow_whose_task_panics_writes_one_end_record() {
        let (_dir, t, registry) = setup(LOOPBACK_CLUSTER);
        let task = {
            let (decider, registry) = (t.decider.clone(), registry.clone());
            tokio::spawn(async move {
                let mut flow = Lifecycle::admit(&decider, &registry, key(1)).expect("allowed");
                assert!(flow.open());
                panic!("a bug in the relay");
            })
        };
        assert!(task.await.unwrap_err().is_panic());
        assert!(registry.is_empty());
        assert_eq!((t.closed(CloseReason::Reset), t.closed_total()), (1, 1));
        assert_eq!(t.end_events(), ["reset"]);
    }

    /// A flow as the previous agent hands it over: an hour old, admitted at revision 1,
    /// audited or not.
    fn handed(audited: bool) -> HandedFlow {
        HandedFlow {
            age: Duration::from_secs(3600),
            revision: crate::policy::Revision(1),
            audited,
            decided: std::time::SystemTime::now() - Duration::from_secs(3600),
        }
    }

    /// Issue #23: a connection the previous agent handed over with an unaudited admission
    /// gets no audited end here either (its metrics still count it).
    #[test]
    fn an_adopted_connection_whose_admission_was_not_audited_ends_unaudited() {
        let (_dir, t, registry) = setup(LOOPBACK_CLUSTER);
        let (flow, allowed) =
            Lifecycle::adopt(&t.decider, &registry, key(1), &handed(false), Default::default());
        assert!(allowed);
        flow.end(CloseReason::Normal);
        assert_eq!(t.closed(CloseReason::Normal), 1);
        assert!(t.end_events().is_empty());
    }

    /// Issue #23: a connection taken from the previous agent keeps its start and its bytes,
    /// so its end record, written here, gives its whole duration and byte counts.
    #[test]
    fn an_adopted_connection_ends_with_its_whole_duration_and_bytes() {
        let (_dir, t, registry) = setup(LOOPBACK_CLUSTER);
        let counters =
            crate::proxy::relay::Counters { to_server: 100.into(), to_client: 200.into() };
        let (flow, allowed) =
            Lifecycle::adopt(&t.decider, &registry, key(1), &handed(true), counters);
        assert!(allowed);
        flow.tracked().counters.to_server.fetch_add(1, Ordering::Relaxed);
        flow.end(CloseReason::Normal);
        let events = t.events();
        let end =
            events.iter().find(|v| v["event"] == crate::audit::event::CONNECTION_END).unwrap();
        let attrs = &end["attributes"];
        assert_eq!(attrs[crate::audit::event::attr::BYTES_TO_SERVER], 101);
        assert_eq!(attrs[crate::audit::event::attr::BYTES_TO_CLIENT], 200);
        assert!(attrs[crate::audit::event::attr::DURATION_MS].as_u64().unwrap() >= 3_600_000);
        // An allowed hand-over is not audited again: the previous agent audited its
        // admission.
        assert!(testing::decision_points(&events).is_empty());
    }

    /// A flow handed over leaves the registry without an end record here.
    #[test]
    fn a_flow_handed_over_writes_no_end_record() {
        let (_dir, t, registry) = setup(LOOPBACK_CLUSTER);
        let mut flow = Lifecycle::admit(&t.decider, &registry, key(1)).expect("allowed");
        assert!(flow.open());
        let handed = flow.hand_over();
        assert_eq!(registry.len(), 1, "in the registry until dropped");
        drop(flow);
        assert_eq!((handed.revision, handed.audited), (crate::policy::Revision(1), true));
        assert!(registry.is_empty());
        assert_eq!(t.closed_total(), 0);
        assert!(t.end_events().is_empty());
    }
}
