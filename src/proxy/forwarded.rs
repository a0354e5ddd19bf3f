//! UDP flows the kernel forwards once their first datagram is decided (the default UDP
//! path, issue #20): the table of those whose end this node reports, the watcher of
//! conntrack's events that starts (for cached classes) and ends them, and the sweep that
//! re-decides the live ones when a new snapshot is published.
//!
//! - **Decision.** The ruleset queues a UDP datagram of a pod flow when its conntrack
//!   entry is not confirmed yet (the first of its 5-tuple, or the first after the flow's
//!   entry went); the decider decides it and answers allow (the kernel then forwards the
//!   flow on its conntrack entry, both ways) or drop (no entry is confirmed, so the next
//!   datagram is queued again). [`Forwarded::admit`] records the allowed ones here.
//! - **End.** Conntrack destroys the entry when the flow has been quiet for
//!   `nf_conntrack_udp_timeout` (30 s) or, once it has seen traffic both ways and lasted,
//!   `nf_conntrack_udp_timeout_stream` (120 s), or when [`sweep`] deletes it. Its destroy
//!   event carries the entry's counters (with `net.netfilter.nf_conntrack_acct = 1`,
//!   which the agent sets while it runs), from which the end record gets the flow's bytes
//!   each way; the duration is from the first datagram's decision to the event. The kernel
//!   reaps an expired entry when its garbage collector comes by (its interval adapts to
//!   the table, up to 60 s) or when a listing meets it (the sweep, at least every
//!   [`crate::agent::SWEEP_EVERY`]), so an end record comes up to about a minute after the
//!   timeout.
//! - **Cached classes.** The first datagram of a flow whose class (client, protocol and
//!   port, server) the snapshot in force allowed before skips the queue (`redirect` rule
//!   7, the same kernel-side cache as TCP's, emptied at every new snapshot); its entry is
//!   marked, and conntrack's new event for it makes [`watch`] decide, audit (decision point
//!   `conntrack`) and track it. Where the ruleset can spare new events
//!   (`Decider::with_cached_udp_sample` n ≠ 1), only one cached flow in n reports its new
//!   event (none with n = 0: nothing audited): the kernel's audit sample, which the agent
//!   audits as sampled and tracks; every other one reaches the agent only with its destroy
//!   event, where [`destroyed`] counts its decision. A flow decided at the queue reports
//!   no new event there either (the agent knows it). A class whose flows audit logs in
//!   full is then never cached (`proxy::queue`), so each of its flows is decided and
//!   audited at the queue. A new event costs the kernel a netlink message and the agent a
//!   read per DNS-like query: sparing them gave 1.01–1.18× DNS-like flows per second in
//!   11 of 12 loadtest pairs (one and eight clients, one node and across; the twelfth
//!   0.90×; docs/architecture.md, "New events spared").
//! - **Live change.** After a new snapshot is published (and every queue reader that was
//!   deciding under the old one has answered), [`sweep`] lists the table's UDP entries,
//!   decides each again and deletes the entries of those now denied: their next datagram
//!   has no confirmed entry, so it is queued and dropped. A denying re-decision is audited
//!   like the proxy's, and the end follows with reason `policy-change`. The sweep lists
//!   every entry, so it cuts the cached flows the agent never saw start too: a datagram
//!   that passed the cache just before the cache was emptied is confirmed within its own
//!   pass through the hooks (one softirq), long before the sweep lists the table, which
//!   comes after a second emptying and the queue readers' answers.
//! - **Memory.** Only flows whose decision was audited (and, where the kernel samples the
//!   cached flows, the ones it sampled) are held for their end record (it names that
//!   decision); the end of every other flow a local pod takes part in is
//!   counted in the metrics from its destroy event alone (a DNS-heavy node makes a flow
//!   per query: holding every one cost a lab agent 6 MiB of its peak RSS). At most
//!   [`Forwarded::new`]'s `max` flows are held; an audited flow over it is still decided
//!   and forwarded, but its end is not written (counted as the limit `udp_flows`, logged
//!   once per episode); a flow of the kernel's sample over it is counted at its new event,
//!   and its entry loses the cache's mark bits (a ctnetlink update) so that its destroy
//!   event does not count it again as one the agent never saw. An entry whose destroy
//!   event never comes (the
//!   datagram was dropped after the decision, so no conntrack entry was confirmed) is
//!   removed by the next sweep ([`UNCONFIRMED_AFTER`]).
//!
//! Source: issue #20; netfilter conntrack (Documentation/networking/nf_conntrack-sysctl.rst:
//! `nf_conntrack_acct`, `nf_conntrack_udp_timeout`, `nf_conntrack_udp_timeout_stream`).

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::conntrack::{self, Conntrack, Entry, Event, Events};
use super::decider::{Admission, Decider};
use super::lifecycle::record_end;
use crate::audit::{CloseReason, ConnectionEnd};
use crate::policy::FlowKey;
use crate::policy::eval::Verdict;
use crate::policy::ports::Protocol;

/// Most event datagrams (one event each) [`watch`] reads per wake-up before it looks at
/// the retirement flag again.
pub const EVENT_BATCH: usize = 1024;

/// How long [`watch`] pauses after a batch of events before it waits for the next one:
/// the events of that time are then read in one wake-up. The latency this adds to a cached
/// flow's audit record and end record (at most this much) buys the reader's wake-ups: one
/// per event cost the agent 7.6 µs of CPU per DNS-like flow, 63 % of it switching to the
/// thread (issue #20; measured in `docs/architecture.md`, "Measured: UDP through the
/// kernel, DNS-like churn").
pub const EVENT_PAUSE: Duration = Duration::from_millis(1);

/// A tracked flow with no conntrack entry for this long at a sweep is taken as never
/// started (its first datagram was dropped after the decision) and forgotten.
pub const UNCONFIRMED_AFTER: Duration = Duration::from_secs(5);

/// Headers conntrack's byte counters include and a UDP payload count does not: IPv4 (20
/// bytes, no options) + UDP (8).
const HEADERS_V4: u64 = 28;
/// IPv6 (40 bytes, no extension headers) + UDP (8).
const HEADERS_V6: u64 = 48;

/// One tracked flow.
#[derive(Debug)]
struct Flow {
    admission: Admission,
    started: Instant,
    /// A sweep denied it and deleted its entry: its end is a policy change.
    cut: bool,
}

/// Counters of the kernel-forwarded UDP flows since start.
#[derive(Debug, Default)]
pub struct ForwardedStats {
    /// Flows allowed (on their first datagram, or by the cache) and forwarded.
    pub flows: AtomicU64,
    /// Of those, flows tracked for their end record (their decision was audited).
    pub tracked: AtomicU64,
    /// Flows whose decision was audited but that were not tracked (the table was full):
    /// their end record is not written.
    pub untracked: AtomicU64,
    /// Tracked flows ended by their destroy event.
    pub ended: AtomicU64,
    /// Entries deleted because a new snapshot denies them.
    pub cut: AtomicU64,
    /// Times destroy events were lost (ENOBUFS) and a sweep had to make up for them.
    pub events_lost: AtomicU64,
    /// Datagrams of conntrack events read (one event each), counted as each is read,
    /// before its events are handled ([`Events::count_into`]).
    pub event_datagrams: Arc<AtomicU64>,
    /// Times the event reader woke and read what had come ([`watch`]): `event_datagrams`
    /// over this is how many events a wake-up took on average.
    pub event_batches: AtomicU64,
}

/// The kernel-forwarded UDP flows this node decided and whose end it writes to audit, by
/// the 5-tuple their first datagram was decided on. Only flows whose decision was audited
/// are held (their end record names that decision); the others' ends are counted in the
/// metrics from the destroy event alone. An untracked flow a sweep cut is remembered by
/// its key until its destroy event, so that its end is counted as a policy change.
#[derive(Debug)]
pub struct Forwarded {
    flows: Mutex<HashMap<FlowKey, Flow>>,
    cut_untracked: Mutex<HashSet<FlowKey>>,
    max: usize,
    /// Counters, for metrics, logs and tests.
    pub stats: ForwardedStats,
}

impl Forwarded {
    /// An empty table tracking at most `max` flows; 0 tracks none (the UDP proxy path,
    /// where no conntrack event would ever end them).
    pub fn new(max: usize) -> Forwarded {
        Forwarded {
            flows: Mutex::default(),
            cut_untracked: Mutex::default(),
            max,
            stats: ForwardedStats::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<FlowKey, Flow>> {
        // Single inserts and removes: a panic elsewhere cannot leave the map inconsistent.
        self.flows.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records the allowed first datagram of `key` (UDP, forwarded by the kernel from now
    /// on) with its `admission`: counted, and tracked when its decision was audited. A key
    /// tracked already (a flow whose first datagram was queued again) takes the new
    /// admission.
    pub fn admit(&self, key: FlowKey, admission: Admission) {
        let track = admission.audited;
        self.admit_as(key, admission, track);
    }

    /// [`Forwarded::admit`] for a flow of a cached class whose new event the kernel let
    /// through as its sample (`Decider::with_cached_udp_sample` n ≠ 1): tracked whether
    /// audited or not, so that its end is not taken for one the agent never saw
    /// ([`destroyed`] counts those). Returns `false` when the table was full: then the
    /// flow is counted but not tracked, and its end would be counted again unless its
    /// entry loses the cache's mark bits ([`confirmed`] clears them).
    fn admit_seen(&self, key: FlowKey, admission: Admission) -> bool {
        self.admit_as(key, admission, true)
    }

    /// Counts the flow and, with `track`, tracks it. Returns `false` when it was to be
    /// tracked and the table was full.
    fn admit_as(&self, key: FlowKey, admission: Admission, track: bool) -> bool {
        if self.max == 0 {
            return true;
        }
        self.stats.flows.fetch_add(1, Ordering::Relaxed);
        if !track {
            return true;
        }
        let mut flows = self.lock();
        if flows.len() >= self.max && !flows.contains_key(&key) {
            drop(flows);
            self.stats.untracked.fetch_add(1, Ordering::Relaxed);
            if let Some(n) = crate::limits::LIMITS.udp_flows.hit() {
                tracing::warn!(
                    limit = self.max,
                    hits = n,
                    "kernel-forwarded UDP flow table full: new flows are decided and forwarded, but their end is not reported (--max-udp-flows)"
                );
            }
            return false;
        }
        flows.insert(key, Flow { admission, started: Instant::now(), cut: false });
        self.stats.tracked.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Number of flows tracked now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no flow is tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The flow key of a conntrack entry, as the decision saw it ([`Entry::decided`]).
fn key_of(e: &Entry) -> FlowKey {
    let (src, dst) = e.decided();
    FlowKey { src, dst, protocol: Protocol::Udp }
}

/// UDP payload bytes of `c` (conntrack counts whole packets).
fn payload(c: conntrack::Counters, dst: SocketAddr) -> u64 {
    let per = if dst.is_ipv4() { HEADERS_V4 } else { HEADERS_V6 };
    c.bytes.saturating_sub(c.packets.saturating_mul(per))
}

/// Ends the flow of the destroyed entry `e`: a tracked one is counted and audited with
/// its payload bytes each way; another this node decided (a pod's end) is counted in the
/// metrics. Returns whether it was tracked.
///
/// Where the ruleset spares the new events of cached UDP flows
/// ([`Decider::with_cached_udp_sample`] n ≠ 1), an untracked entry whose mark has the bits
/// of `cached` (`value`, `mask`: the kernel-side cache let it through) is a flow the agent
/// never saw: its decision is counted now (verdict, tier, `udp_forwarded_flows`), as the
/// snapshot in force decides it, when that allows it (one a sweep cut was counted as cut).
pub fn destroyed(decider: &Decider, e: &Entry, cached: (u32, u32)) -> bool {
    let key = key_of(e);
    let tracked = decider.forwarded().lock().remove(&key);
    if let Some(flow) = tracked {
        let reason = if flow.cut { CloseReason::PolicyChange } else { CloseReason::Timeout };
        end(decider, key, &flow, reason, e);
        return true;
    }
    let cut =
        decider.forwarded().cut_untracked.lock().unwrap_or_else(|p| p.into_inner()).remove(&key);
    let d = decider.decide(key.flow());
    let (value, mask) = cached;
    if !cut
        && decider.cached_udp_sample() != 1
        && e.zone == 0
        && e.mark & mask == value
        && d.verdict == Verdict::Allow
    {
        decider.count(&d);
        decider.forwarded().stats.flows.fetch_add(1, Ordering::Relaxed);
    }
    if cut || d.egress.is_some() || d.ingress.is_some() {
        let reason = if cut { CloseReason::PolicyChange } else { CloseReason::Timeout };
        // Its start is not known: the duration is not recorded (the metrics do not read it).
        record_end(decider, None, key, end_of(e, key, reason, Duration::ZERO));
    }
    false
}

/// The end of the flow `key` as the conntrack entry `e` saw it.
fn end_of(e: &Entry, key: FlowKey, reason: CloseReason, duration: Duration) -> ConnectionEnd {
    ConnectionEnd {
        reason,
        to_server: payload(e.orig_counters, key.dst),
        to_client: payload(e.reply_counters, key.dst),
        duration,
    }
}

fn end(decider: &Decider, key: FlowKey, flow: &Flow, reason: CloseReason, e: &Entry) {
    decider.forwarded().stats.ended.fetch_add(1, Ordering::Relaxed);
    let end = end_of(e, key, reason, flow.started.elapsed());
    record_end(decider, Some(&flow.admission), key, end);
}

/// A flow whose first datagram skipped the queue (its class was in the kernel-side cache
/// of allowed classes, which marked its entry with the bits of `cached_mask`): decided
/// now, on the snapshot in force, audited with the decision point `conntrack`, and
/// tracked. If that snapshot denies it (a new one came between the cache's answer and
/// this event; the denying decision is the one audited), its entry is deleted through
/// `ct`, if there is one, and counted as a policy cut.
///
/// Where the kernel samples the cached flows and the table is full, the flow is counted
/// now but not tracked: its entry loses the cache's bits through `ct`, so that
/// [`destroyed`] does not take its end for that of a flow the agent never saw and count
/// it a second time. Without `ct`, or if the update fails (the entry is gone already), it
/// is counted again at its end (a debug log line says so; the full table itself is logged
/// and counted as the limit `udp_flows`).
fn confirmed(decider: &Decider, ct: Option<&mut Conntrack>, e: &Entry, cached_mask: u32) {
    let key = key_of(e);
    let admission = decider.decide_cached(key);
    if admission.decision.verdict == Verdict::Allow {
        if decider.cached_udp_sample() == 1 {
            decider.forwarded().admit(key, admission);
        } else if !decider.forwarded().admit_seen(key, admission) {
            let cleared = ct.map(|ct| ct.clear_mark(e, cached_mask));
            if !matches!(cleared, Some(Ok(true))) {
                tracing::debug!(result = ?cleared, flow = ?key, "a sampled UDP flow the full table could not track keeps its cached mark: its end is counted again");
            }
        }
        return;
    }
    decider.stats.policy_cuts.fetch_add(1, Ordering::Relaxed);
    let Some(ct) = ct else { return };
    if let Err(err) = ct.delete(e) {
        tracing::warn!(error = %err, flow = ?key, "deleting the conntrack entry of a denied UDP flow failed; the next sweep retries");
    } else {
        decider.forwarded().stats.cut.fetch_add(1, Ordering::Relaxed);
    }
}

/// Reads conntrack's events until the socket fails for good: a new entry whose mark has
/// the bits of `cached` (`value`, `mask`: a UDP flow whose first datagram the kernel-side
/// cache let through, `redirect` rule 7) is decided and tracked; a destroyed entry ends the
/// tracked flow it names. Lost events (ENOBUFS) are counted and logged (rate-limited); the
/// next [`sweep`] forgets the flows whose entries are gone (their ends are not reported).
/// Runs on its own thread.
///
/// Events are read in batches: after waking for one, the reader takes every datagram
/// queued by then (up to [`EVENT_BATCH`]), then pauses [`EVENT_PAUSE`] before it waits
/// again, so that a stream of events (a new flow per DNS query, each a new event) wakes it
/// at most about once per pause instead of once per event.
///
/// # Errors
/// None returned: failures are logged; after 100 in a row the thread ends.
pub fn watch(decider: &Decider, mut events: Events, cached: (u32, u32)) {
    let (value, mask) = cached;
    let mut delete = match Conntrack::open() {
        Ok(c) => Some(c),
        Err(e) => {
            tracing::error!(error = %e, "cannot open a ctnetlink socket: UDP flows the kernel-side cache let through are tracked but never deleted if a new snapshot raced them");
            None
        }
    };
    let stats = &decider.forwarded().stats;
    events.count_into(Arc::clone(&stats.event_datagrams));
    let mut failures = 0u32;
    loop {
        if decider.retired() {
            // Handed over (issue #23): the next agent watches and cuts these flows.
            return;
        }
        let mut each = |kind, e: Entry| match kind {
            Event::New if e.zone == 0 && e.mark & mask == value => {
                confirmed(decider, delete.as_mut(), &e, mask);
            }
            Event::New => {}
            Event::Destroy => {
                destroyed(decider, &e, cached);
            }
        };
        let read = events
            .next(conntrack::UDP, &mut each)
            .and_then(|_| events.drain(conntrack::UDP, EVENT_BATCH - 1, &mut each));
        match read {
            Ok(more) => {
                failures = 0;
                stats.event_batches.fetch_add(1, Ordering::Relaxed);
                if more + 1 < EVENT_BATCH {
                    std::thread::sleep(EVENT_PAUSE);
                }
            }
            Err(e) if e.raw_os_error() == Some(nix::libc::ENOBUFS) => {
                decider.forwarded().stats.events_lost.fetch_add(1, Ordering::Relaxed);
                if let Some(n) = crate::limits::LIMITS.conntrack_events.hit() {
                    tracing::warn!(
                        times = n,
                        "conntrack destroy events were lost (the agent fell behind): the ends of some kernel-forwarded UDP flows are not reported"
                    );
                }
            }
            Err(e) => {
                failures += 1;
                tracing::warn!(error = %e, "reading conntrack destroy events");
                if failures >= 100 {
                    tracing::error!(
                        "conntrack destroy events keep failing; kernel-forwarded UDP flows are no longer ended in audit"
                    );
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// What one [`sweep`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Swept {
    /// UDP entries of the conntrack table decided again.
    pub checked: usize,
    /// Entries deleted because the snapshot in force denies their flow.
    pub cut: usize,
    /// Tracked flows with no entry, forgotten without an end record (their first datagram
    /// never made a conntrack entry, or their destroy event was lost).
    pub forgotten: usize,
}

/// Lists the conntrack table's UDP entries (zone 0: the pods' flows; the proxy's upstream
/// legs have their own zone; with `only`, just the entries whose connection mark carries
/// it), and with `redecide` decides each against the snapshot in force, deleting the
/// entries of the flows it denies (their tracked flows end with reason `policy-change`
/// when the destroy event comes); then forgets tracked flows with no entry that are older
/// than [`UNCONFIRMED_AFTER`]. Call with `redecide` after a new snapshot is published and
/// the queue readers have answered their batches, and without it after lost events.
///
/// `only` serves the proxy path (`--udp-path proxy`), where the kernel forwards just the
/// UDP flows to the node's own addresses, which `redirect` rule 5 marks with the route
/// mark; every other UDP flow there is the proxy's, which cuts and audits its own.
///
/// # Errors
/// The dump's or a delete's netlink errors; entries not yet visited are then left.
pub fn sweep(
    decider: &Decider,
    dump: &mut Conntrack,
    delete: &mut Conntrack,
    redecide: bool,
    only: Option<crate::config::Mark>,
) -> std::io::Result<Swept> {
    let mut out = Swept::default();
    let mut present = HashSet::new();
    let tracked = decider.forwarded();
    let mut failed = None;
    dump.dump(conntrack::UDP, |e| {
        if e.zone != 0 || failed.is_some() || only.is_some_and(|m| e.mark & m.mask != m.value) {
            return;
        }
        let key = key_of(&e);
        if redecide {
            out.checked += 1;
            if decider.decide(key.flow()).verdict != Verdict::Allow {
                let mut flows = tracked.lock();
                match flows.get_mut(&key) {
                    Some(f) => f.cut = true,
                    None => {
                        let mut cut =
                            tracked.cut_untracked.lock().unwrap_or_else(|p| p.into_inner());
                        cut.insert(key);
                    }
                }
                drop(flows);
                decider.cut_forwarded(key);
                match delete.delete(&e) {
                    Ok(_) => {
                        out.cut += 1;
                        tracked.stats.cut.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(err) => failed = Some(err),
                }
                return;
            }
        }
        if tracked.lock().contains_key(&key) {
            present.insert(key);
        }
    })?;
    if let Some(err) = failed {
        return Err(err);
    }
    let mut flows = tracked.lock();
    let gone: Vec<FlowKey> = flows
        .iter()
        .filter(|(k, f)| !present.contains(k) && !f.cut && f.started.elapsed() >= UNCONFIRMED_AFTER)
        .map(|(k, _)| *k)
        .collect();
    for k in &gone {
        flows.remove(k);
    }
    out.forgotten = gone.len();
    drop(flows);
    if !redecide {
        // A cut's destroy event comes as the entry is deleted, long before this periodic
        // sweep; what is left here lost its event.
        tracked.cut_untracked.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
    Ok(out)
}

/// Ends every tracked flow with reason `shutdown`, with the counters of its entry where
/// the table still has one (the kernel goes on forwarding the flow; this agent stops
/// reporting it).
///
/// # Errors
/// The dump's netlink errors (the flows are then ended without byte counts).
pub fn shut_down(decider: &Decider, dump: &mut Conntrack) -> std::io::Result<()> {
    let tracked = decider.forwarded();
    let listed = dump.dump(conntrack::UDP, |e| {
        let key = key_of(&e);
        let flow = tracked.lock().remove(&key);
        if let Some(f) = flow {
            end(decider, key, &f, CloseReason::Shutdown, &e);
        }
    });
    let left: Vec<(FlowKey, Flow)> = tracked.lock().drain().collect();
    for (key, f) in left {
        let none = Entry {
            orig: conntrack::Tuple { src: key.src, dst: key.dst, protocol: conntrack::UDP },
            reply: conntrack::Tuple { src: key.dst, dst: key.src, protocol: conntrack::UDP },
            zone: 0,
            mark: 0,
            id: None,
            orig_counters: conntrack::Counters::default(),
            reply_counters: conntrack::Counters::default(),
        };
        end(decider, key, &f, CloseReason::Shutdown, &none);
    }
    listed
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::SystemTime;

    use super::*;
    use crate::audit::DecisionPoint;

    fn admission() -> Admission {
        Admission {
            decision: Arc::new(crate::policy::eval::Decision {
                verdict: Verdict::Allow,
                egress: None,
                ingress: None,
                revision: crate::policy::Revision(1),
            }),
            audited: true,
            time: SystemTime::now(),
            point: DecisionPoint::FirstPacket,
        }
    }

    fn key(port: u16) -> FlowKey {
        FlowKey {
            src: SocketAddr::from(([10, 0, 0, 1], port)),
            dst: SocketAddr::from(([10, 0, 0, 2], 53)),
            protocol: Protocol::Udp,
        }
    }

    /// Only flows whose decision was audited are held (their end record names it). Over
    /// the limit such a flow is still forwarded (the caller allowed it) but not tracked;
    /// that is counted, and a flow tracked already is replaced, not refused.
    #[test]
    fn the_table_tracks_up_to_its_limit_and_counts_the_rest() {
        let off = Forwarded::new(0);
        off.admit(key(1), admission());
        assert_eq!((off.len(), off.stats.untracked.load(Ordering::Relaxed)), (0, 0));
        let quiet = Forwarded::new(2);
        quiet.admit(key(1), Admission { audited: false, ..admission() });
        assert_eq!((quiet.len(), quiet.stats.flows.load(Ordering::Relaxed)), (0, 1));
        let t = Forwarded::new(2);
        let before = crate::limits::LIMITS.udp_flows.get();
        t.admit(key(1), admission());
        t.admit(key(2), admission());
        t.admit(key(2), admission());
        assert_eq!((t.len(), t.stats.untracked.load(Ordering::Relaxed)), (2, 0));
        t.admit(key(3), admission());
        assert_eq!((t.len(), t.stats.untracked.load(Ordering::Relaxed)), (2, 1));
        assert!(crate::limits::LIMITS.udp_flows.get() > before);
        assert_eq!(t.stats.tracked.load(Ordering::Relaxed), 3);
    }

    /// Issue #20: where the kernel spares the new events of cached UDP flows (sample ≠ 1),
    /// the end of a cached flow the agent never saw counts its decision once; a flow whose
    /// new event came (the kernel's sample) is tracked even when audit did not take it, so
    /// its end is not counted again; a flow decided at the queue (no cached mark) is not
    /// counted at its end; and where every cached flow reports, nothing is counted at the
    /// end.
    #[test]
    fn a_cached_flow_the_agent_never_saw_is_counted_once_at_its_end() {
        use crate::proxy::decider::{DeciderLimits, testing};
        let dir = tempfile::tempdir().unwrap();
        let t = testing::decider(testing::LOOPBACK_CLUSTER, dir.path());
        let decider = |n: u32| {
            let mut current = testing::current(testing::LOOPBACK_CLUSTER, 1);
            let quiet = crate::audit::Defaults { allow_sample: 0, ..testing::every_decision() };
            current.audit = crate::audit::Selection::new(&current.snapshot, quiet).0;
            let metrics = crate::metrics::Metrics::new(crate::metrics::Scraped(Box::new(Vec::new)));
            let limits = DeciderLimits { forwarded_flows: 16, ..DeciderLimits::default() };
            Decider::new(current, limits, t.auditor.clone(), metrics.data_path)
                .with_cached_udp_sample(n)
        };
        let entry = |port: u16, mark: u32| {
            let (src, dst) =
                (SocketAddr::from(([127, 0, 0, 2], port)), "127.0.0.3:53".parse().unwrap());
            Entry {
                orig: conntrack::Tuple { src, dst, protocol: conntrack::UDP },
                reply: conntrack::Tuple { src: dst, dst: src, protocol: conntrack::UDP },
                zone: 0,
                mark,
                id: None,
                orig_counters: conntrack::Counters::default(),
                reply_counters: conntrack::Counters::default(),
            }
        };
        const CACHED: (u32, u32) = (0x1000, 0x1000);
        let flows = |d: &Decider| d.forwarded().stats.flows.load(Ordering::Relaxed);
        let d = decider(4);
        assert!(!destroyed(&d, &entry(1000, 0x1000), CACHED));
        assert_eq!((flows(&d), d.stats.allowed.load(Ordering::Relaxed)), (1, 1));
        confirmed(&d, None, &entry(1001, 0x1000), CACHED.1);
        assert_eq!((d.forwarded().len(), flows(&d)), (1, 2), "the sample is tracked");
        assert!(destroyed(&d, &entry(1001, 0x1000), CACHED));
        assert!(!destroyed(&d, &entry(1002, 0), CACHED));
        assert_eq!((flows(&d), d.stats.allowed.load(Ordering::Relaxed)), (2, 2));
        let every = decider(1);
        assert!(!destroyed(&every, &entry(1000, 0x1000), CACHED));
        assert_eq!(flows(&every), 0);
    }

    /// Conntrack counts whole packets; the end record counts UDP payload, as the proxy did.
    #[test]
    fn payload_bytes_leave_out_the_ip_and_udp_headers() {
        let c = conntrack::Counters { packets: 2, bytes: 2 * 28 + 100 };
        assert_eq!(payload(c, "10.0.0.2:53".parse().unwrap()), 100);
        let c = conntrack::Counters { packets: 1, bytes: 48 + 7 };
        assert_eq!(payload(c, "[fd00::2]:53".parse().unwrap()), 7);
        assert_eq!(payload(conntrack::Counters::default(), "10.0.0.2:53".parse().unwrap()), 0);
    }
}
