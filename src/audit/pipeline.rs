//! The audit pipeline: a bounded queue from the data path to one worker thread, which
//! renders events, aggregates denies, applies rate limits and fans events out to the
//! sinks' own queues.
//!
//! ```text
//! NFQUEUE threads ─ decision ─┐                     ┌─► OTLP sink thread ─► collector
//!                             ├─► queue ─► worker ──┤
//! proxy tasks ── connection end ┘  (bounded)          └─► JSON sink thread ─► stdout / file
//! ```
//!
//! [`Mode::Lossy`] (default): every queue is bounded; when one is full the event is dropped
//! and counted ([`Stats`]), and the data path never waits. [`Mode::Lossless`]: nothing is
//! dropped. The OTLP sink retries a failed export until it succeeds, and new flows wait
//! for audit while a sink is full (see [`Gate`]); established connections keep flowing
//! (connection ends never block a proxy task: they take an overflow list whose size is
//! bounded by the connections admitted). On shutdown the pipeline flushes within a
//! deadline and counts what it could not deliver.
//!
//! **The worker never waits on a sink.** It hands each event to every sink's queue at
//! once, so a sink that is stuck (a hung collector) or slow never holds up another: the
//! JSON file has every event the data path handed over within milliseconds, whatever the
//! OTLP sink does. The sinks' queues are therefore unbounded channels whose bound the
//! worker enforces: lossy drops an event for a sink holding `queue_capacity`; lossless
//! closes the [`Gate`] instead, and the data path stops handing over new flows until the
//! sink has room. (Before, the worker blocked on the first full sink's queue in lossless
//! mode, and the JSON file froze with the OTLP sink: issue #17.)
//!
//! Source: issue #4 "Delivery"; issue #17 item 7.

use std::collections::VecDeque;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context as _;
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TrySendError};

use super::Mode;
use super::event::{self, ConnectionEnd, Context, Event, FlowInfo, Names, Value};
use super::limit::{Admit, Aggregator, Limits, RateLimiter};
use super::select::{Defaults, Sampling, Selection};
use super::sink::{self, Gate, SinkConfig, SinkStats};
use crate::policy::compile::Direction;
use crate::policy::eval::Decision;
use crate::policy::{Protocol, Snapshot};

/// Everything the pipeline needs.
#[derive(Debug, Clone)]
pub struct AuditConfig {
    /// Node name and pod label keys reported.
    pub context: Context,
    /// What is logged where no annotation says.
    pub defaults: Defaults,
    /// Lossy or lossless.
    pub mode: Mode,
    /// Records the data-path queue holds, and undelivered events each sink may hold before
    /// lossy drops for it or lossless makes new flows wait.
    pub queue_capacity: usize,
    /// Identical denies (and rejects) within this window become one event
    /// (`Duration::ZERO`: none).
    pub deny_window: Duration,
    /// Rate limits.
    pub limits: Limits,
    /// Where events go; empty: auditing is off.
    pub sinks: Vec<SinkConfig>,
    /// How long shutdown waits for the sinks to deliver what is queued.
    pub flush_timeout: Duration,
}

impl AuditConfig {
    /// Defaults for node `node` with `sinks`.
    pub fn new(node: &str, sinks: Vec<SinkConfig>) -> Self {
        AuditConfig {
            context: Context::new(node, Vec::new()),
            defaults: Defaults::default(),
            mode: Mode::Lossy,
            queue_capacity: DEFAULT_QUEUE_CAPACITY,
            deny_window: DEFAULT_DENY_WINDOW,
            limits: Limits::default(),
            sinks,
            flush_timeout: Duration::from_secs(10),
        }
    }
}

/// Default capacity of each audit queue (events): about 0.15 s of the pipeline's
/// throughput, to absorb bursts of new connections. The data-path queue's slots are
/// allocated up front (16–24 bytes each); a sink's queue grows as events wait.
pub const DEFAULT_QUEUE_CAPACITY: usize = 16_384;
/// Default deny aggregation window.
pub const DEFAULT_DENY_WINDOW: Duration = Duration::from_secs(5);
/// Most deny windows open at once.
const MAX_DENY_WINDOWS: usize = 65_536;
/// How often the worker closes aggregation windows and reports suppressed events.
const TICK: Duration = Duration::from_millis(100);
/// How long the worker, and a sink gathering a batch, pause after taking what was queued
/// before they look again: a stream of records (a flood of denies, each a record) then
/// wakes each of them about once per pause instead of once per record. Records are that
/// much later on their way to the sinks.
pub const READ_PAUSE: Duration = Duration::from_millis(1);

/// Counters of the pipeline since start (for metrics and tests).
#[derive(Debug, Default)]
pub struct Stats {
    /// Records the data path handed over (decisions with at least one audited direction,
    /// connection ends).
    pub submitted: AtomicU64,
    /// Events handed to the sinks (each event once, whatever the number of sinks).
    pub emitted: AtomicU64,
    /// Denies and rejects folded into another event's count.
    pub aggregated: AtomicU64,
    /// Events suppressed by a per-rule limit.
    pub rate_limited_rule: AtomicU64,
    /// Events suppressed by the node limit.
    pub rate_limited_node: AtomicU64,
    /// Records dropped because the data-path queue was full (lossy), or handed over after
    /// shutdown had ended the worker.
    pub dropped_queue: AtomicU64,
    /// New-flow decisions that found a sink full and waited (lossless), counted as the
    /// wait begins.
    pub waits: AtomicU64,
    /// Times the worker woke to records and took every one queued by then
    /// ([`READ_PAUSE`] apart while they keep coming): `submitted` over this is how many
    /// records a wake-up took.
    pub wakeups: AtomicU64,
    /// Per sink, in [`AuditConfig::sinks`] order.
    pub sinks: Vec<Arc<SinkStats>>,
}

/// A record from the data path. Boxed: a bounded queue allocates (and touches) all its
/// slots up front, so a slot is kept to a pointer.
enum Pending {
    Decision(Box<PendingDecision>),
    End(Box<PendingEnd>),
    /// Finish: deliver what is queued and stop.
    Shutdown,
}

struct PendingDecision {
    flow: FlowInfo,
    decision: Arc<Decision>,
    snapshot: Arc<Snapshot>,
    dirs: [bool; 2],
}

struct PendingEnd {
    flow: FlowInfo,
    decision: Arc<Decision>,
    snapshot: Arc<Snapshot>,
    end: ConnectionEnd,
}

struct Shared {
    tx: Sender<Pending>,
    gate: Arc<Gate>,
    /// Lossless connection ends that found the queue full.
    overflow: Mutex<VecDeque<Pending>>,
    mode: Mode,
    stats: Arc<Stats>,
    close: bool,
}

/// The data path's handle on the pipeline. Cheap to share; every method returns without
/// waiting in lossy mode.
pub struct Auditor {
    shared: Option<Arc<Shared>>,
    worker: Mutex<Option<JoinHandle<()>>>,
    sinks: Mutex<Vec<sink::Running>>,
    gate: Option<Arc<Gate>>,
    flush_deadline: Arc<Mutex<Option<Instant>>>,
    flush_timeout: Duration,
    stats: Arc<Stats>,
    /// The sinks' queues, for their depth (a receiver does not keep a queue open).
    sink_rx: Vec<Receiver<Arc<Event>>>,
}

impl std::fmt::Debug for Auditor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auditor").field("enabled", &self.shared.is_some()).finish()
    }
}

/// Where a connection end came from: the flow and the decision that admitted it.
#[derive(Debug, Clone)]
pub struct Admitted {
    /// The flow.
    pub flow: FlowInfo,
    /// Its decision.
    pub decision: Arc<Decision>,
}

impl Auditor {
    /// An auditor that logs nothing.
    pub fn disabled() -> Self {
        Auditor {
            shared: None,
            worker: Mutex::new(None),
            sinks: Mutex::new(Vec::new()),
            gate: None,
            flush_deadline: Arc::new(Mutex::new(None)),
            flush_timeout: Duration::ZERO,
            stats: Arc::new(Stats::default()),
            sink_rx: Vec::new(),
        }
    }

    /// Starts the sinks and the worker. With no sinks, returns [`Auditor::disabled`].
    ///
    /// # Errors
    /// A sink that cannot start (an OTLP exporter that cannot be built from its
    /// configuration, a JSON file that cannot be opened), naming it.
    pub fn start(config: AuditConfig) -> anyhow::Result<Self> {
        if config.sinks.is_empty() {
            return Ok(Self::disabled());
        }
        let capacity = config.queue_capacity.max(1);
        let flush_deadline = Arc::new(Mutex::new(None));
        // Unbounded: the worker bounds them (module docs), so that it never waits on one.
        let (sink_tx, sink_rx): (Vec<_>, Vec<_>) =
            config.sinks.iter().map(|_| crossbeam_channel::unbounded::<Arc<Event>>()).unzip();
        let named = config.sinks.iter().zip(&sink_rx).map(|(s, rx)| (s.name(), rx.clone()));
        let gate = Arc::new(Gate::new(capacity, named.collect()));
        let mut outs = Vec::new();
        let mut running = Vec::new();
        let mut sink_stats = Vec::new();
        for ((s, tx), rx) in config.sinks.iter().zip(sink_tx).zip(sink_rx.iter().cloned()) {
            let stats = Arc::new(SinkStats { name: s.name(), ..SinkStats::default() });
            let r = match s {
                SinkConfig::Otlp(o) => sink::start_otlp(
                    o.clone(),
                    &config.context.node,
                    config.mode,
                    rx,
                    stats.clone(),
                    flush_deadline.clone(),
                    gate.clone(),
                ),
                SinkConfig::Json(t) => sink::start_json(
                    t.clone(),
                    &config.context.node,
                    rx,
                    stats.clone(),
                    gate.clone(),
                ),
            }
            .with_context(|| format!("audit sink {}", s.name()))?;
            running.push(r);
            outs.push((tx, stats.clone()));
            sink_stats.push(stats);
        }
        let stats = Arc::new(Stats { sinks: sink_stats, ..Stats::default() });
        let (tx, rx) = crossbeam_channel::bounded(capacity);
        let shared = Arc::new(Shared {
            tx,
            gate: gate.clone(),
            overflow: Mutex::new(VecDeque::new()),
            mode: config.mode,
            stats: stats.clone(),
            close: config.defaults.close,
        });
        let worker = Worker {
            ctx: config.context.clone(),
            mode: config.mode,
            rx,
            shared: Arc::downgrade(&shared),
            sinks: outs,
            capacity,
            gate: gate.clone(),
            stats: stats.clone(),
            names: Names::default(),
            aggregate: !config.deny_window.is_zero(),
            denies: Aggregator::new(config.deny_window, MAX_DENY_WINDOWS),
            limiter: RateLimiter::new(config.limits, Instant::now()),
        };
        let worker = std::thread::Builder::new()
            .name("audit".into())
            .spawn(move || worker.run())
            .context("starting the audit thread")?;
        Ok(Auditor {
            shared: Some(shared),
            worker: Mutex::new(Some(worker)),
            sinks: Mutex::new(running),
            gate: Some(gate),
            flush_deadline,
            flush_timeout: config.flush_timeout,
            stats,
            sink_rx,
        })
    }

    /// Whether any sink is configured.
    pub fn enabled(&self) -> bool {
        self.shared.is_some()
    }

    /// The counters.
    pub fn stats(&self) -> &Arc<Stats> {
        &self.stats
    }

    /// Events waiting in each sink's queue, in [`AuditConfig::sinks`] order.
    pub fn sink_depths(&self) -> Vec<usize> {
        self.sink_rx.iter().map(Receiver::len).collect()
    }

    /// Events waiting in the data-path queue.
    pub fn queue_depth(&self) -> usize {
        self.shared
            .as_ref()
            .map_or(0, |s| s.tx.len() + s.overflow.lock().unwrap_or_else(|p| p.into_inner()).len())
    }

    /// Audits the decision of a new flow's first packet under `plan` (built for
    /// `snapshot`). Returns whether the flow is audited (its connection's end is then
    /// audited too). Lossy: never waits. Lossless: waits while a sink is full (the
    /// [`Gate`] is closed) or the data-path queue is.
    pub fn decision(
        &self,
        plan: &Selection,
        snapshot: &Arc<Snapshot>,
        flow: FlowInfo,
        decision: &Arc<Decision>,
    ) -> bool {
        self.decision_as(plan, snapshot, flow, decision, Sampling::Count)
    }

    /// [`Auditor::decision`], with the flow's sampling decided as `sampling` says
    /// ([`Selection::select_as`]).
    pub fn decision_as(
        &self,
        plan: &Selection,
        snapshot: &Arc<Snapshot>,
        flow: FlowInfo,
        decision: &Arc<Decision>,
        sampling: Sampling,
    ) -> bool {
        let Some(s) = &self.shared else { return false };
        let dirs = plan.select_as(snapshot, decision, sampling);
        if dirs == [false, false] {
            return false;
        }
        let p = Pending::Decision(Box::new(PendingDecision {
            flow,
            decision: decision.clone(),
            snapshot: snapshot.clone(),
            dirs,
        }));
        if s.mode == Mode::Lossless && s.gate.is_closed() {
            // Counted as the wait begins, so a wait that lasts is seen.
            s.stats.waits.fetch_add(1, Ordering::Relaxed);
            s.gate.wait();
        }
        s.stats.submitted.fetch_add(1, Ordering::Relaxed);
        match s.mode {
            Mode::Lossy => {
                if s.tx.try_send(p).is_err() {
                    s.stats.dropped_queue.fetch_add(1, Ordering::Relaxed);
                }
            }
            Mode::Lossless => {
                // Fails only once shutdown has ended the worker: counted, not silent.
                if s.tx.send(p).is_err() {
                    s.stats.dropped_queue.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        true
    }

    /// Audits the end of a connection whose decision was audited (the caller checks), or
    /// any connection cut by a policy change. `snapshot` names its ends (the current one).
    /// Never waits.
    pub fn connection_end(
        &self,
        snapshot: &Arc<Snapshot>,
        admitted: &Admitted,
        end: ConnectionEnd,
    ) {
        let Some(s) = &self.shared else { return };
        // A cut by a policy change is always reported: it is enforcement acting on a live
        // connection.
        if !s.close && end.reason != super::CloseReason::PolicyChange {
            return;
        }
        let p = Pending::End(Box::new(PendingEnd {
            flow: admitted.flow,
            decision: admitted.decision.clone(),
            snapshot: snapshot.clone(),
            end,
        }));
        s.stats.submitted.fetch_add(1, Ordering::Relaxed);
        match s.tx.try_send(p) {
            Ok(()) => {}
            Err(TrySendError::Full(p) | TrySendError::Disconnected(p)) => match s.mode {
                Mode::Lossy => {
                    s.stats.dropped_queue.fetch_add(1, Ordering::Relaxed);
                }
                Mode::Lossless => s.overflow.lock().unwrap_or_else(|e| e.into_inner()).push_back(p),
            },
        }
    }

    /// Stops accepting events, lets the worker and the sinks deliver what is queued
    /// (within the flush timeout), and returns. An export still unanswered at the deadline
    /// is abandoned: its events, and those queued behind it, are counted as failed by
    /// their sink and logged. Later calls do nothing.
    pub fn shutdown(&self) {
        let deadline = Instant::now() + self.flush_timeout;
        *self.flush_deadline.lock().unwrap_or_else(|p| p.into_inner()) = Some(deadline);
        let failed_before: u64 =
            self.stats.sinks.iter().map(|s| s.failed.load(Ordering::Relaxed)).sum();
        // From here on nothing waits on audit: the gate no longer closes.
        if let Some(g) = &self.gate {
            g.release();
        }
        // The worker finishes what is queued before the marker, then the open deny
        // windows; the sinks finish when the worker drops their queues.
        let worker = self.worker.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(s) = &self.shared {
            let _ = s.tx.send_timeout(Pending::Shutdown, self.flush_timeout);
        }
        if let Some(w) = worker {
            join_until(w, deadline);
        }
        // A sink's attempts end by the deadline; the grace lets it count what it abandons.
        for r in self.sinks.lock().unwrap_or_else(|p| p.into_inner()).drain(..) {
            join_until(r.thread, deadline + SHUTDOWN_GRACE);
        }
        let failed: u64 = self.stats.sinks.iter().map(|s| s.failed.load(Ordering::Relaxed)).sum();
        let queued: usize = self.sink_depths().iter().sum::<usize>() + self.queue_depth();
        let failed = failed - failed_before;
        if failed > 0 || queued > 0 {
            tracing::warn!(
                failed,
                queued,
                "audit events not delivered by the flush deadline (failed: abandoned and \
                 counted; queued: left in a queue whose sink did not finish)"
            );
        }
    }
}

/// How long after the flush deadline shutdown waits for the sinks to count what they
/// abandoned (their attempts end by the deadline).
const SHUTDOWN_GRACE: Duration = Duration::from_millis(200);

fn join_until(h: JoinHandle<()>, deadline: Instant) {
    while !h.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    if h.is_finished() {
        let _ = h.join();
    }
}

/// The key under which identical denies and rejects are folded: direction and flow less
/// the source port, in one revision.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct DenyKey {
    dir: Direction,
    src: IpAddr,
    dst: IpAddr,
    dst_port: u16,
    protocol: Protocol,
    revision: u64,
}

/// The key of a rate limit: the rule (the policy's kind and apiVersion, `ruleset`,
/// `direction/rule`), `default` and the basis for decisions no policy made, or the event
/// name. The kind and apiVersion keep an Antrea policy's rule apart from the upstream
/// policy's of the same name (an Antrea NetworkPolicy `b/allow-a` beside the NetworkPolicy
/// `b/allow-a`, both with an unnamed `ingress[0]`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct RuleKey {
    /// Kind and apiVersion, both static strings of [`crate::policy::Kind`].
    policy: Option<(&'static str, &'static str)>,
    ruleset: Arc<str>,
    rule: Arc<str>,
}

struct Worker {
    ctx: Context,
    mode: Mode,
    rx: Receiver<Pending>,
    shared: std::sync::Weak<Shared>,
    sinks: Vec<(Sender<Arc<Event>>, Arc<SinkStats>)>,
    /// Most events a sink's queue holds before lossy drops for it (lossless: the gate).
    capacity: usize,
    gate: Arc<Gate>,
    stats: Arc<Stats>,
    names: Names,
    /// Deny aggregation is on (a window above zero).
    aggregate: bool,
    denies: Aggregator<DenyKey, Event>,
    limiter: RateLimiter<RuleKey>,
}

fn rule_key(e: &Event) -> RuleKey {
    let s = |k| match e.attr(k) {
        Some(Value::Str(s)) => s.clone(),
        Some(Value::Static(s)) => Arc::from(*s),
        _ => Arc::from(""),
    };
    let fixed = |k| match e.attr(k) {
        Some(Value::Static(s)) => Some(*s),
        _ => None,
    };
    match e.name {
        event::DECISION if e.str(event::attr::RULESET).is_some() => RuleKey {
            policy: fixed(event::attr::POLICY_KIND).zip(fixed(event::attr::POLICY_API_VERSION)),
            ruleset: s(event::attr::RULESET),
            rule: format!("{}/{}", s(event::attr::DIRECTION), s(event::attr::RULE_NAME)).into(),
        },
        event::DECISION => {
            RuleKey { policy: None, ruleset: Arc::from("default"), rule: s(event::attr::BASIS) }
        }
        _ => RuleKey { policy: None, ruleset: Arc::from(""), rule: Arc::from(e.name) },
    }
}

impl Worker {
    fn run(mut self) {
        let mut next_tick = Instant::now() + TICK;
        loop {
            // Lossless overflow first: those ends waited longest.
            self.drain_overflow();
            match self.rx.recv_deadline(next_tick) {
                Ok(Pending::Shutdown) => break,
                Ok(p) => {
                    self.stats.wakeups.fetch_add(1, Ordering::Relaxed);
                    self.handle(p);
                    // The rest of what is queued in this wake-up, then a pause.
                    if !self.handle_queued() {
                        break;
                    }
                    std::thread::sleep(READ_PAUSE);
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            let now = Instant::now();
            if now >= next_tick {
                self.tick(now);
                next_tick = now + TICK;
            }
        }
        // Shutdown: what is still queued, every open deny window, the last summaries.
        while let Ok(p) = self.rx.try_recv() {
            self.handle(p);
        }
        self.drain_overflow();
        let now = Instant::now();
        for a in self.denies.drain() {
            self.emit_counted(a, now);
        }
        self.summaries();
        // Dropping the sink senders lets the sinks finish.
    }

    /// Handles what is queued now, without waiting. `false` once it met the shutdown
    /// record (or the queue closed): the worker then stops.
    fn handle_queued(&mut self) -> bool {
        loop {
            match self.rx.try_recv() {
                Ok(Pending::Shutdown) | Err(crossbeam_channel::TryRecvError::Disconnected) => {
                    return false;
                }
                Ok(p) => self.handle(p),
                Err(crossbeam_channel::TryRecvError::Empty) => return true,
            }
        }
    }

    /// Handles the connection ends that found the queue full (lossless mode only: lossy
    /// drops them, so there is nothing to look at).
    fn drain_overflow(&mut self) {
        if self.mode != Mode::Lossless {
            return;
        }
        let Some(shared) = self.shared.upgrade() else { return };
        let rest: Vec<Pending> =
            shared.overflow.lock().unwrap_or_else(|p| p.into_inner()).drain(..).collect();
        drop(shared);
        for p in rest {
            self.handle(p);
        }
    }

    fn handle(&mut self, p: Pending) {
        let now = Instant::now();
        match p {
            Pending::Decision(p) => {
                let PendingDecision { flow, decision, snapshot, dirs } = *p;
                self.names.refresh(&snapshot, &self.ctx);
                for dir in Direction::BOTH {
                    if !dirs[dir as usize] {
                        continue;
                    }
                    let e = event::decision(
                        &self.ctx,
                        &snapshot,
                        &mut self.names,
                        &flow,
                        &decision,
                        dir,
                    );
                    // A Reject is folded as a deny is: a client retrying against a Reject
                    // makes as many identical records as one retrying against a Drop
                    // (docs/audit.md, "Deny aggregation"). The key needs no verdict: one
                    // revision gives one flow, whatever its source port, one verdict.
                    let denied = match dir {
                        Direction::Ingress => decision.ingress.as_ref(),
                        Direction::Egress => decision.egress.as_ref(),
                    }
                    .is_some_and(|o| !o.verdict.is_allow());
                    if denied && self.aggregate {
                        let k = DenyKey {
                            dir,
                            src: flow.key.src.ip(),
                            dst: flow.key.dst.ip(),
                            dst_port: flow.key.dst.port(),
                            protocol: flow.key.protocol,
                            revision: decision.revision.0,
                        };
                        if !self.denies.offer(k, e, now) {
                            self.stats.aggregated.fetch_add(1, Ordering::Relaxed);
                        }
                    } else if denied {
                        let mut e = e;
                        e.set_count(1, flow.time);
                        self.emit(e, now);
                    } else {
                        self.emit(e, now);
                    }
                }
            }
            Pending::End(p) => {
                let PendingEnd { flow, decision, snapshot, end } = *p;
                self.names.refresh(&snapshot, &self.ctx);
                let e = event::connection_end(
                    &self.ctx,
                    &snapshot,
                    &mut self.names,
                    &flow,
                    &decision,
                    &end,
                );
                self.emit(e, now);
            }
            Pending::Shutdown => {}
        }
    }

    fn tick(&mut self, now: Instant) {
        for a in self.denies.due(now) {
            self.emit_counted(a, now);
        }
        self.summaries();
    }

    fn emit_counted(&mut self, a: super::limit::Aggregated<Event>, now: Instant) {
        let mut e = a.item;
        let last = SystemTime::now() - now.saturating_duration_since(a.last);
        e.set_count(a.count, last.max(e.time));
        self.emit(e, now);
    }

    /// A summary event per rule (and for the node) that suppressed events since the last.
    fn summaries(&mut self) {
        let (by_rule, node) = self.limiter.take_suppressed();
        let now = SystemTime::now();
        for (k, n) in by_rule {
            self.stats.rate_limited_rule.fetch_add(n, Ordering::Relaxed);
            let rule =
                event::SuppressedRule { policy: k.policy, ruleset: &k.ruleset, rule: &k.rule };
            let e = event::suppressed(&self.ctx, now, "rule", Some(rule), n);
            self.send(e);
        }
        if node > 0 {
            self.stats.rate_limited_node.fetch_add(node, Ordering::Relaxed);
            let e = event::suppressed(&self.ctx, now, "node", None, node);
            self.send(e);
        }
    }

    fn emit(&mut self, e: Event, now: Instant) {
        match self.limiter.check(|| rule_key(&e), now) {
            Admit::Yes => self.send(e),
            // Counted by the limiter; reported by the next summary.
            Admit::RuleLimited | Admit::NodeLimited => {}
        }
    }

    fn send(&mut self, e: Event) {
        self.stats.emitted.fetch_add(1, Ordering::Relaxed);
        let e = Arc::new(e);
        // Never waits: the queues are unbounded (the receivers live as long as the
        // Auditor), and their bound is kept here.
        for (tx, stats) in &self.sinks {
            // The worker is the only sender, so the length can only fall before the send.
            if self.mode == Mode::Lossy && tx.len() >= self.capacity {
                stats.dropped_queue.fetch_add(1, Ordering::Relaxed);
            } else {
                let _ = tx.send(e.clone());
            }
        }
        if self.mode == Mode::Lossless {
            self.gate.after_send();
        }
    }
}
