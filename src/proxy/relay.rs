//! Relaying the bytes of one proxied TCP connection, both ways.
//!
//! The hot path is `splice(2)`: socket → pipe → socket, the data never copied to user
//! space, one pipe per direction (DESIGN §7: with a 1 MiB pipe this used 2–4× less CPU per
//! GB than tokio copies on these machines). [`RelayMode::Copy`] is the fallback through
//! user-space buffers (64 KiB per direction) for where splice is not available.
//! [`RelayMode::Auto`] copies small reads through a per-thread buffer and splices only the
//! bursts that fill it: a small message costs a `read` and a `write` instead of three
//! splices and a pipe lease (issue #18).
//!
//! A direction holds a pipe only while bytes are in flight (issue #17): it leases one from
//! the [`PipePool`] when its socket becomes readable and gives it back, empty, when the
//! socket has nothing more to read. An idle connection holds its two sockets and nothing
//! else (it held two pipes, four descriptors and up to 2 MiB of the pipe budget before, so
//! 3,334 idle connections exhausted a 20,000-descriptor limit). Pipes given back empty are
//! kept for the next burst, of this or another connection, instead of creating and sizing
//! new ones (`pipe2`, `F_SETPIPE_SZ`, `close`: 8 of the ~51 system calls a proxied
//! connection cost, issue #7). The pool is bounded by a [`PipeBudget`]: at most so many
//! pipes open at once, of a size within the kernel's per-user pipe budget; when none can be
//! had, the burst is relayed by copy through user space and counted
//! ([`crate::limits::Limits::pipes`]).
//!
//! Each direction ends on its own: EOF on one side shuts down the write side of the other
//! (half-close propagates, FIN each way independently). A reset or error on one side
//! resets the other (`SO_LINGER` 0 then close sends an RST). The relay also ends when the
//! connection is idle too long, or when it is told to stop (shutdown).
//!
//! Sources: splice(2), pipe(7) (`F_SETPIPE_SZ`, `/proc/sys/fs/pipe-max-size`), tcp(7)
//! (`SO_LINGER` with a zero timeout aborts the connection with an RST).

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nix::fcntl::{FcntlArg, OFlag, SpliceFFlags, fcntl, splice};
use tokio::io::Interest;
use tokio::net::TcpStream;
use tokio::sync::Notify;

/// How bytes are moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
pub enum RelayMode {
    /// `splice(2)` through a pipe per direction (zero-copy).
    Splice,
    /// User-space buffers, 64 KiB each way.
    Copy,
    /// Each read goes through a small user-space buffer ([`AUTO_COPY_BYTES`], one per
    /// thread) while the reads are small; a read that fills it starts a burst, spliced
    /// through a leased pipe until the socket has nothing more to read (HAProxy's
    /// `splice-auto` works the same way). A 64-byte message costs a `read` and a `write`
    /// instead of three splices and a pipe lease.
    Auto,
}

/// Relay settings.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// Auto, splice or copy.
    pub mode: RelayMode,
    /// Where splice and auto mode take their pipes from, and how large they are.
    pub pipes: std::sync::Arc<PipePool>,
    /// A connection with no byte moved either way for this long is closed.
    pub idle_timeout: Duration,
}

/// Bytes moved, per direction. Updated after each transfer (a splice moves up to a pipe
/// full), read by the registry and audit.
#[derive(Debug, Default)]
pub struct Counters {
    /// Client → server bytes.
    pub to_server: AtomicU64,
    /// Server → client bytes.
    pub to_client: AtomicU64,
}

/// How a relay ended, as the relay sees it. The close reason audit reports
/// ([`crate::audit::CloseReason`]) is made from it by the connection's
/// [`super::lifecycle::Lifecycle`], which knows why a `Stopped` relay was told to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RelayEnd {
    /// Both sides closed their write side (FIN each way).
    Normal,
    /// One side reset or failed; the other was reset.
    Reset,
    /// No byte moved for the idle timeout; both sides were reset.
    Timeout,
    /// Told to stop (shutdown after the drain grace period, or policy change); both sides
    /// were reset.
    Stopped,
}

impl RelayEnd {
    /// `normal`, `reset`, `timeout`, `stopped`.
    pub fn as_str(self) -> &'static str {
        match self {
            RelayEnd::Normal => "normal",
            RelayEnd::Reset => "reset",
            RelayEnd::Timeout => "timeout",
            RelayEnd::Stopped => "stopped",
        }
    }
}

/// Relays between `client` and `server` until both directions end, one side fails, the
/// connection is idle for `config.idle_timeout`, or `stop` is notified.
///
/// In splice mode each direction leases a pipe from `config.pipes` while it has bytes in
/// flight ([`PipePool::lease`]); a burst for which no pipe can be had is copied through a
/// user-space buffer instead.
///
/// `resume` is where a connection handed over by the previous agent left off (issue #23):
/// each direction first writes the bytes it had in flight, and a direction that had ended
/// stays ended; [`Resume::default`] for a new connection.
///
/// # Returns
/// [`Relayed::Ended`] with how it ended (both sockets closed; reset unless `Normal`), or,
/// when `stop` was notified and `keep()` says so (a hand-over, [`super::handover`]),
/// [`Relayed::Stopped`] with both sockets untouched and each direction's bytes in flight.
/// Nothing read is lost in such a stop: every direction keeps what it read and did not
/// write in a state that outlives its future. A stop `keep()` refuses resets both sides
/// (`RelayEnd::Stopped`), as does one whose bytes in flight find no pipe.
pub async fn relay(
    client: TcpStream,
    server: TcpStream,
    config: &RelayConfig,
    counters: &Counters,
    stop: &Notify,
    resume: Resume,
    keep: &(dyn Fn() -> bool + Sync),
) -> Relayed {
    let start = Instant::now();
    let last = AtomicU64::new(0);
    let (to_server, to_client) = (&counters.to_server, &counters.to_client);
    let mut up = Flight::resumed(resume.to_server);
    let mut down = Flight::resumed(resume.to_client);
    let reason = {
        let (client, server) = (&client, &server);
        let pool = &config.pipes;
        let mode = config.mode;
        let a = pump(client, server, pool, mode, to_server, &last, start, &mut up);
        let b = pump(server, client, pool, mode, to_client, &last, start, &mut down);
        // Pinned here and lent to `drive`: a future an `async fn` takes by value is kept
        // twice in its state (the argument and the local it is moved to, rust-lang/rust
        // #62958), which made an idle connection's task 900 bytes larger.
        tokio::pin!(a, b);
        drive(a, b, config.idle_timeout, &last, start, stop).await
    };
    match reason {
        RelayEnd::Normal => Relayed::Ended(RelayEnd::Normal),
        RelayEnd::Stopped if keep() => {
            // The directions first: a failure leaves both sockets here, to be reset.
            let directions = up.suspend().and_then(|u| Ok((u, down.suspend()?)));
            let (to_server, to_client) = match directions {
                Ok(d) => d,
                Err(e) => {
                    // No pipe for the bytes in flight (the pipe budget, open files).
                    tracing::warn!(error = %e, "a stopped connection's bytes in flight could not be kept; reset");
                    abort(&client);
                    abort(&server);
                    return Relayed::Ended(RelayEnd::Stopped);
                }
            };
            match (client.into_std(), server.into_std()) {
                (Ok(client), Ok(server)) => {
                    Relayed::Stopped(Suspended { client, server, to_server, to_client })
                }
                (c, s) => {
                    tracing::warn!(
                        "a stopped connection's sockets could not be taken from the runtime; reset"
                    );
                    for std in [c.ok(), s.ok()].into_iter().flatten() {
                        abort_std(&std);
                    }
                    Relayed::Ended(RelayEnd::Stopped)
                }
            }
        }
        reason => {
            // A pipe may still hold bytes that were never written out: its lease closed it.
            abort(&client);
            abort(&server);
            Relayed::Ended(reason)
        }
    }
}

/// What [`relay`] returns.
#[derive(Debug)]
pub enum Relayed {
    /// The relay ended; its sockets are closed.
    Ended(RelayEnd),
    /// `stop` was notified: the sockets are open and untouched, each direction's state kept.
    Stopped(Suspended),
}

impl Relayed {
    /// How it ended, a stopped relay's sockets reset first ([`Suspended::abort`]): for a
    /// caller that never hands a connection over.
    pub fn end(self) -> RelayEnd {
        match self {
            Relayed::Ended(end) => end,
            Relayed::Stopped(s) => {
                s.abort();
                RelayEnd::Stopped
            }
        }
    }
}

/// A relay stopped with its state: both sockets (non-blocking, out of the runtime) and
/// each direction's bytes in flight. Dropped, the sockets are closed with a FIN; see
/// [`Suspended::abort`] for a reset.
#[derive(Debug)]
pub struct Suspended {
    /// The client's connection (accepted from the transparent listener).
    pub client: std::net::TcpStream,
    /// The upstream connection to the original destination.
    pub server: std::net::TcpStream,
    /// Client → server.
    pub to_server: DirectionState,
    /// Server → client.
    pub to_client: DirectionState,
}

impl Suspended {
    /// Closes both sockets with an RST (`SO_LINGER` 0, tcp(7)), as a stopped relay does.
    pub fn abort(self) {
        abort_std(&self.client);
        abort_std(&self.server);
    }
}

/// One direction of a stopped relay, or where a resumed one starts.
#[derive(Debug, Default)]
pub struct DirectionState {
    /// Bytes read from the source and not yet written to the destination: the read end of
    /// a pipe holding exactly them, and their count.
    pub in_flight: Option<(OwnedFd, usize)>,
    /// The source's EOF was read; the destination's write side is shut down once the
    /// bytes in flight are written.
    pub eof: bool,
    /// The EOF was passed on (the destination's write side is shut down): the direction is
    /// over.
    pub done: bool,
}

/// Where a relay starts: [`Resume::default`] for a new connection, a [`Suspended`]'s
/// directions for one handed over.
#[derive(Debug, Default)]
pub struct Resume {
    /// Client → server.
    pub to_server: DirectionState,
    /// Server → client.
    pub to_client: DirectionState,
}

/// One direction's bytes read and not yet written, and how far it got: kept outside the
/// direction's future, so that dropping the future at any await (a stop) loses nothing.
#[derive(Debug, Default)]
struct Flight<'p> {
    /// A leased pipe and the bytes spliced into it.
    lease: Option<Lease<'p>>,
    /// A pipe the previous agent handed over and the bytes in it; written first.
    inherited: Option<(OwnedFd, usize)>,
    /// Bytes read through user space; `pending[sent..]` are not written yet.
    pending: Vec<u8>,
    sent: usize,
    /// EOF read from the source.
    eof: bool,
    /// EOF passed on: the destination's write side is shut down.
    done: bool,
}

impl<'p> Flight<'p> {
    fn resumed(state: DirectionState) -> Flight<'p> {
        Flight {
            inherited: state.in_flight.filter(|(_, n)| *n > 0),
            eof: state.eof,
            done: state.done,
            ..Flight::default()
        }
    }

    /// The bytes in flight, moved into a pipe of their own (the leased pipe leaves the
    /// pool), and how far the direction got.
    fn suspend(&mut self) -> io::Result<DirectionState> {
        let in_flight = if let Some((fd, n)) = self.inherited.take() {
            Some((fd, n))
        } else if let Some(lease) = self.lease.take().filter(|l| l.in_flight > 0) {
            let n = lease.in_flight;
            Some((lease.into_read_end(), n))
        } else if self.sent < self.pending.len() {
            let bytes = &self.pending[self.sent..];
            Some((pipe_holding(bytes)?, bytes.len()))
        } else {
            None
        };
        Ok(DirectionState { in_flight, eof: self.eof, done: self.done })
    }
}

/// The read end of a new pipe holding `bytes` (at most [`COPY_BUFFER`]: a pipe's default
/// size, pipe(7), so one write takes them all).
fn pipe_holding(bytes: &[u8]) -> io::Result<OwnedFd> {
    let (read, write) = nix::unistd::pipe2(OFlag::O_NONBLOCK | OFlag::O_CLOEXEC)?;
    if bytes.len() > COPY_BUFFER {
        let want = i32::try_from(bytes.len()).unwrap_or(i32::MAX);
        fcntl(&write, FcntlArg::F_SETPIPE_SZ(want))?;
    }
    let n = nix::unistd::write(&write, bytes)?;
    if n < bytes.len() {
        return Err(io::Error::other(format!("a pipe took {n} of {} bytes", bytes.len())));
    }
    Ok(read)
}

/// How many empty pipes a [`PipePool`] of the agent keeps: enough for 8 connections'
/// bursts at once without creating pipes. Kept pipes count against the kernel's per-user
/// pipe budget like pipes in use ([`PipeBudget`]).
pub const POOLED_PIPES: usize = 16;

/// Default relay pipe size per direction (DESIGN §7: 1 MiB measured best on these
/// machines), where the budget allows it ([`PipeBudget::for_process`]).
pub const DEFAULT_PIPE_BYTES: usize = 1 << 20;

/// Smallest pipe the budget shrinks pipes to: the kernel's default pipe size (16 pages),
/// which every process gets without asking.
pub const MIN_PIPE_BYTES: usize = 64 << 10;

/// How many pipes the budget keeps room for at least, by shrinking their size: 32
/// connections moving bytes both ways at once.
pub const MIN_BUDGET_PIPES: usize = 64;

/// The share of the per-user pipe budget (`pipe-user-pages-soft`) the agent takes, in
/// percent: every process of the agent's user (uid 0 on a node: the container runtime,
/// other root pods without a user namespace) shares that budget, and a pipe created past it
/// is 8 KiB and refuses to grow.
pub const PIPE_BUDGET_SHARE_PERCENT: usize = 50;

/// Where the relay's pipes may come from: how large each is and how many may be open at
/// once (in use or kept idle).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PipeBudget {
    /// The size each pipe is given (`F_SETPIPE_SZ`), bytes.
    pub pipe_bytes: usize,
    /// The most pipes open at once.
    pub max_pipes: usize,
    /// Whether the kernel's per-user pipe budget applies to this process (it lacks
    /// CAP_SYS_RESOURCE and CAP_SYS_ADMIN), and if so its soft limit in bytes.
    pub user_limit: Option<usize>,
}

impl PipeBudget {
    /// The budget of this process: `max_pipes` pipes (what its open files limit leaves, see
    /// [`crate::agent`]) of [`DEFAULT_PIPE_BYTES`], unless the kernel's per-user pipe budget
    /// applies ([`PipeBudget::unprivileged`], with `share_percent` of it). Source: pipe(7),
    /// "/proc files": `pipe-user-pages-soft` applies to a process without CAP_SYS_RESOURCE
    /// and CAP_SYS_ADMIN.
    pub fn for_process(max_pipes: usize, share_percent: usize) -> PipeBudget {
        let privileged = effective_capabilities().is_some_and(|caps| {
            caps & (1 << CAP_SYS_RESOURCE) != 0 || caps & (1 << CAP_SYS_ADMIN) != 0
        });
        let soft = std::fs::read_to_string("/proc/sys/fs/pipe-user-pages-soft")
            .ok()
            .and_then(|s| s.trim().parse::<usize>().ok());
        match soft {
            // 0 means no limit.
            Some(pages) if !privileged && pages > 0 => {
                PipeBudget::unprivileged(pages.saturating_mul(4096), share_percent, max_pipes)
            }
            _ => PipeBudget { pipe_bytes: DEFAULT_PIPE_BYTES, max_pipes, user_limit: None },
        }
    }

    /// The budget under a per-user pipe limit of `limit_bytes`: the agent takes
    /// `share_percent` of it (1 to 100; [`PIPE_BUDGET_SHARE_PERCENT`] by default); pipes
    /// keep [`DEFAULT_PIPE_BYTES`] while that share holds [`MIN_BUDGET_PIPES`] of them, else
    /// they are halved down to [`MIN_PIPE_BYTES`]; the count is what the share holds, at
    /// most `max_pipes`.
    pub fn unprivileged(limit_bytes: usize, share_percent: usize, max_pipes: usize) -> PipeBudget {
        let share = (limit_bytes as u128 * share_percent.clamp(1, 100) as u128 / 100) as usize;
        let mut pipe_bytes = DEFAULT_PIPE_BYTES;
        while pipe_bytes > MIN_PIPE_BYTES && share / pipe_bytes < MIN_BUDGET_PIPES {
            pipe_bytes /= 2;
        }
        PipeBudget {
            pipe_bytes,
            max_pipes: (share / pipe_bytes).clamp(1, max_pipes.max(1)),
            user_limit: Some(limit_bytes),
        }
    }
}

/// `CAP_SYS_ADMIN` (capabilities(7)).
const CAP_SYS_ADMIN: u32 = 21;
/// `CAP_SYS_RESOURCE`.
const CAP_SYS_RESOURCE: u32 = 24;

/// The calling thread's effective capabilities (`CapEff` of `/proc/thread-self/status`).
fn effective_capabilities() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/thread-self/status").ok()?;
    let hex = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
    u64::from_str_radix(hex.trim(), 16).ok()
}

/// Counters of a [`PipePool`].
#[derive(Debug, Default)]
pub struct PipeStats {
    /// Pipes created.
    pub created: AtomicU64,
    /// Pipes the kernel refused their size (left at its default or smaller): used for one
    /// burst, then closed.
    pub undersized: AtomicU64,
    /// Bursts relayed by copy because no pipe could be had (budget, open files).
    pub copied_bursts: AtomicU64,
}

/// Pipes for the relay: leased per burst ([`PipePool::lease`]), at most
/// [`PipeBudget::max_pipes`] open at once, empty ones of the full size kept for the next
/// burst (at most `keep`).
///
/// Source: pipe(7) (`F_SETPIPE_SZ`, the per-user budget), splice(2).
#[derive(Debug)]
pub struct PipePool {
    bytes: usize,
    keep: usize,
    max: usize,
    /// Pipes open now: leased plus idle.
    open: std::sync::atomic::AtomicUsize,
    idle: std::sync::Mutex<Vec<Pipe>>,
    /// Counters.
    pub stats: PipeStats,
}

impl PipePool {
    /// A pool of pipes of `bytes` each (the kernel rounds up to a power of two pages), at
    /// most `max` open at once, keeping at most `keep` idle. `keep` = 0 creates and closes
    /// a pipe per burst.
    pub fn new(bytes: usize, keep: usize, max: usize) -> PipePool {
        PipePool {
            bytes,
            keep,
            max,
            open: std::sync::atomic::AtomicUsize::new(0),
            idle: std::sync::Mutex::new(Vec::with_capacity(keep)),
            stats: PipeStats::default(),
        }
    }

    /// A pool within `budget`, keeping [`POOLED_PIPES`] idle.
    pub fn with_budget(budget: PipeBudget) -> PipePool {
        PipePool::new(budget.pipe_bytes, POOLED_PIPES.min(budget.max_pipes), budget.max_pipes)
    }

    /// Idle pipes now kept.
    pub fn idle(&self) -> usize {
        self.lock().len()
    }

    /// Pipes open now (leased or idle).
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// A pipe for one burst: a kept one, or a new one while fewer than `max` are open.
    /// `None` when the budget is used up or no pipe can be created (open files): the
    /// caller copies the burst instead. Both are counted and logged, rate-limited.
    pub fn lease(&self) -> Option<Lease<'_>> {
        if let Some(pipe) = self.lock().pop() {
            return Some(Lease { pool: self, pipe: Some(pipe), in_flight: 0 });
        }
        let limits = &crate::limits::LIMITS;
        if self.open.fetch_add(1, Ordering::Relaxed) >= self.max {
            self.open.fetch_sub(1, Ordering::Relaxed);
            self.stats.copied_bursts.fetch_add(1, Ordering::Relaxed);
            if let Some(n) = limits.pipes.hit() {
                tracing::warn!(
                    max_pipes = self.max,
                    hits = n,
                    "relay pipe budget used up: bursts are copied through user space until pipes come back"
                );
            }
            return None;
        }
        match Pipe::new(self.bytes) {
            Ok(pipe) => {
                self.stats.created.fetch_add(1, Ordering::Relaxed);
                if pipe.capacity < self.bytes {
                    self.stats.undersized.fetch_add(1, Ordering::Relaxed);
                    if let Some(n) = limits.pipes.hit() {
                        tracing::warn!(
                            asked = self.bytes,
                            got = pipe.capacity,
                            hits = n,
                            "the kernel refused a relay pipe its size (the per-user pipe budget, pipe-user-pages-soft, is spent); such pipes are used once"
                        );
                    }
                }
                Some(Lease { pool: self, pipe: Some(pipe), in_flight: 0 })
            }
            Err(e) => {
                self.open.fetch_sub(1, Ordering::Relaxed);
                self.stats.copied_bursts.fetch_add(1, Ordering::Relaxed);
                let hits = if crate::limits::is_out_of_files(&e) {
                    &limits.open_files
                } else {
                    &limits.pipes
                };
                if let Some(n) = hits.hit() {
                    tracing::warn!(error = %e, hits = n, "no pipe for splice; bursts are copied through user space");
                }
                None
            }
        }
    }

    /// Keeps `pipe` (empty, of the full size) when fewer than `keep` are idle; else closes it.
    fn give_back(&self, pipe: Pipe, empty: bool) {
        if empty && pipe.capacity >= self.bytes {
            let mut idle = self.lock();
            if idle.len() < self.keep {
                idle.push(pipe);
                return;
            }
        }
        drop(pipe);
        self.open.fetch_sub(1, Ordering::Relaxed);
    }

    /// The idle list; a panic while it was held left it intact (a push or a pop).
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Pipe>> {
        self.idle.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A pipe leased from a [`PipePool`] for one burst. Dropped, it goes back to the pool if it
/// is empty and of the pool's size, else it is closed (bytes still in it are lost with the
/// connection that failed).
#[derive(Debug)]
pub struct Lease<'a> {
    pool: &'a PipePool,
    pipe: Option<Pipe>,
    /// Bytes spliced in and not yet out.
    in_flight: usize,
}

impl Lease<'_> {
    fn pipe(&self) -> &Pipe {
        self.pipe.as_ref().expect("a lease holds its pipe until dropped")
    }

    /// The pipe's read end, out of the pool for good, with the bytes in it: a hand-over
    /// takes them to the next agent.
    fn into_read_end(mut self) -> OwnedFd {
        let pipe = self.pipe.take().expect("a lease holds its pipe until dropped");
        self.pool.open.fetch_sub(1, Ordering::Relaxed);
        pipe.read
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        if let Some(pipe) = self.pipe.take() {
            self.pool.give_back(pipe, self.in_flight == 0);
        }
    }
}

/// One pipe: the in-kernel buffer a spliced direction goes through.
#[derive(Debug)]
struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
    capacity: usize,
}

impl Pipe {
    fn new(bytes: usize) -> io::Result<Pipe> {
        let (read, write) = nix::unistd::pipe2(OFlag::O_NONBLOCK | OFlag::O_CLOEXEC)?;
        let want = i32::try_from(bytes).unwrap_or(i32::MAX);
        let capacity = match fcntl(&write, FcntlArg::F_SETPIPE_SZ(want)) {
            Ok(n) => n as usize,
            // Refused (over the per-user budget or pipe-max-size): whatever it has.
            Err(_) => fcntl(&write, FcntlArg::F_GETPIPE_SZ).map_or(4096, |n| n as usize),
        };
        Ok(Pipe { read, write, capacity })
    }
}

/// Milliseconds since `start`, for a coarse idle clock shared by both directions.
fn millis(start: Instant) -> u64 {
    start.elapsed().as_millis() as u64
}

/// Runs both directions until both end (Normal) or one fails, the idle clock runs out or
/// `stop` fires.
async fn drive(
    mut a: Pin<&mut impl Future<Output = io::Result<()>>>,
    mut b: Pin<&mut impl Future<Output = io::Result<()>>>,
    idle: Duration,
    last: &AtomicU64,
    start: Instant,
    stop: &Notify,
) -> RelayEnd {
    let (mut a_done, mut b_done) = (false, false);
    let idle_ms = idle.as_millis() as u64;
    let idle_clock = async {
        loop {
            let quiet = millis(start).saturating_sub(last.load(Ordering::Relaxed));
            if quiet >= idle_ms {
                return;
            }
            tokio::time::sleep(Duration::from_millis(idle_ms - quiet)).await;
        }
    };
    // One waiter for the whole relay: a `notified()` made anew in the loop would join and
    // leave the Notify's waiter list (a lock each) at every wake-up, that is every message.
    let stopped = stop.notified();
    tokio::pin!(idle_clock, stopped);
    while !(a_done && b_done) {
        tokio::select! {
            r = &mut a, if !a_done => match r {
                Ok(()) => a_done = true,
                Err(_) => return RelayEnd::Reset,
            },
            r = &mut b, if !b_done => match r {
                Ok(()) => b_done = true,
                Err(_) => return RelayEnd::Reset,
            },
            () = &mut idle_clock => return RelayEnd::Timeout,
            () = &mut stopped => return RelayEnd::Stopped,
        }
    }
    RelayEnd::Normal
}

/// Moves `from` → `to` until EOF on `from`, then shuts down `to`'s write side. Each burst
/// (from readable until it would block) goes through a pipe leased from `pool`, given back
/// empty when `from` has nothing more; without a pipe, through a user-space buffer.
///
/// In [`RelayMode::Auto`], a burst starts only when a read through the thread's small
/// buffer filled it ([`copy_read`]); reads that do not stay in user space.
/// [`RelayMode::Copy`] reads every time through a buffer of [`COPY_BUFFER`] bytes.
///
/// Everything read and not yet written is in `flight`, and the bytes counted are the bytes
/// written: the future can be dropped at any await and `flight` says exactly where it was.
#[allow(clippy::too_many_arguments)]
async fn pump<'p>(
    from: &TcpStream,
    to: &TcpStream,
    pool: &'p PipePool,
    mode: RelayMode,
    count: &AtomicU64,
    last: &AtomicU64,
    start: Instant,
    flight: &mut Flight<'p>,
) -> io::Result<()> {
    let flags = SpliceFFlags::SPLICE_F_MOVE | SpliceFFlags::SPLICE_F_NONBLOCK;
    // In auto mode: whether the next read splices: the last copy filled the small buffer,
    // or the last burst spliced at least as much (a stream: its next burst, once `from`
    // is readable again, is most likely as large, and starting it with a copy cost bulk
    // transfers CPU).
    let auto = mode == RelayMode::Auto;
    let mut burst = mode == RelayMode::Splice;
    let mut burst_bytes = 0usize;
    // Copy mode's buffer: it holds bytes only between a read and the write that follows.
    let mut copy_buf = Vec::new();
    loop {
        flush(flight, to, count, last, start).await?;
        if flight.done {
            return Ok(());
        }
        if flight.eof {
            flight.done = true;
            return shutdown_write(to);
        }
        readable(from).await?;
        if mode == RelayMode::Copy {
            if copy_buf.is_empty() {
                copy_buf = vec![0; COPY_BUFFER];
            }
            copy_read(from, to, &mut copy_buf, flight, count, last, start)?;
            continue;
        }
        if !burst {
            let got = SCRATCH
                .with_borrow_mut(|buf| copy_read(from, to, buf, flight, count, last, start))?;
            if let Some(n) = got {
                burst = n == AUTO_COPY_BYTES;
            }
            continue;
        }
        if flight.lease.is_none() {
            flight.lease = pool.lease();
        }
        match flight.lease.as_mut() {
            Some(l) => {
                let pipe = l.pipe();
                match from.try_io(Interest::READABLE, || {
                    splice(from.as_fd(), None, pipe.write.as_fd(), None, pipe.capacity, flags)
                        .map_err(io::Error::from)
                }) {
                    Ok(0) => {
                        flight.lease = None;
                        flight.eof = true;
                    }
                    Ok(n) => {
                        l.in_flight = n;
                        burst_bytes = burst_bytes.saturating_add(n);
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        // The burst is over: the pipe is empty, give it back.
                        flight.lease = None;
                        burst = !auto || burst_bytes >= AUTO_COPY_BYTES;
                        burst_bytes = 0;
                    }
                    Err(e) => return Err(e),
                }
            }
            None => {
                // No pipe: this burst through a user-space buffer of its own.
                let mut buf = vec![0u8; COPY_BUFFER];
                copy_read(from, to, &mut buf, flight, count, last, start)?;
            }
        }
    }
}

/// Writes what `flight` holds to `to`: the inherited pipe's bytes, the leased pipe's, then
/// the user-space ones, counting each write; a user-space buffer is freed once written
/// (an idle connection holds none). Cancel-safe: `flight` is updated after every write.
async fn flush(
    flight: &mut Flight<'_>,
    to: &TcpStream,
    count: &AtomicU64,
    last: &AtomicU64,
    start: Instant,
) -> io::Result<()> {
    let flags = SpliceFFlags::SPLICE_F_MOVE | SpliceFFlags::SPLICE_F_NONBLOCK;
    let wrote = |m: usize| {
        count.fetch_add(m as u64, Ordering::Relaxed);
        last.store(millis(start), Ordering::Relaxed);
    };
    if let Some((pipe, left)) = flight.inherited.as_mut() {
        while *left > 0 {
            writable(to).await?;
            match to.try_io(Interest::WRITABLE, || {
                splice(pipe.as_fd(), None, to.as_fd(), None, *left, flags).map_err(io::Error::from)
            }) {
                // The pipe holds fewer bytes than it was handed over with.
                Ok(0) => return Err(io::Error::other("a handed-over pipe ended early")),
                Ok(m) => {
                    *left -= m;
                    wrote(m);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
        flight.inherited = None;
    }
    if let Some(l) = flight.lease.as_mut() {
        while l.in_flight > 0 {
            writable(to).await?;
            let pipe = l.pipe();
            match to.try_io(Interest::WRITABLE, || {
                splice(pipe.read.as_fd(), None, to.as_fd(), None, l.in_flight, flags)
                    .map_err(io::Error::from)
            }) {
                Ok(m) => {
                    l.in_flight -= m;
                    wrote(m);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
    }
    while flight.sent < flight.pending.len() {
        writable(to).await?;
        match to.try_write(&flight.pending[flight.sent..]) {
            Ok(m) => {
                flight.sent += m;
                wrote(m);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    if !flight.pending.is_empty() {
        flight.pending = Vec::new();
        flight.sent = 0;
    }
    Ok(())
}

/// Waits until `s` is readable. Through `poll_read_ready`, which keeps the waker in the
/// socket's own reader slot, rather than `TcpStream::readable`, whose future carries a
/// waiter node (152 bytes) in every direction's state and joins and leaves the socket's
/// waiter list at each wait. One task reads each socket, so the one slot is enough.
async fn readable(s: &TcpStream) -> io::Result<()> {
    std::future::poll_fn(|cx| s.poll_read_ready(cx)).await
}

/// [`readable`] for writing: the socket's writer slot (`poll_write_ready`).
async fn writable(s: &TcpStream) -> io::Result<()> {
    std::future::poll_fn(|cx| s.poll_write_ready(cx)).await
}

/// Bytes a read takes through user space in [`RelayMode::Auto`] before the direction
/// switches to splice: a read that fills it is most likely part of a stream. HAProxy's
/// default buffer (`tune.bufsize`), whose fill decides its `splice-auto`; a request or
/// response of an RPC fits. One per thread, not per connection.
pub const AUTO_COPY_BYTES: usize = 16 << 10;

thread_local! {
    /// The small buffer of [`RelayMode::Auto`], one per thread: it is borrowed only between
    /// a read and the write that follows it, never across an await, so an idle connection
    /// holds no buffer.
    static SCRATCH: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(vec![0; AUTO_COPY_BYTES]);
}

/// One read of up to `buf.len()` bytes from `from`, written to `to` at once; what `to`
/// does not take at once is copied into `flight` (its pending bytes, written by
/// [`flush`]). At EOF `flight.eof` is set. Returns the bytes read: `Some(0)` at EOF, `None`
/// when `from` had nothing after all.
///
/// A short read leaves the socket's receive queue empty, so it clears `from`'s readiness
/// as tokio's own `poll_read` does (tcp(7) `recv` returns what is queued, up to the
/// length): the next wait goes to epoll instead of a `read` that would return `EAGAIN`.
/// The clearing happens inside `try_io`, against the readiness seen before the read, so
/// bytes that arrived meanwhile are not missed.
fn copy_read(
    from: &TcpStream,
    to: &TcpStream,
    buf: &mut [u8],
    flight: &mut Flight<'_>,
    count: &AtomicU64,
    last: &AtomicU64,
    start: Instant,
) -> io::Result<Option<usize>> {
    use std::io::{Read, Write};
    let mut got = 0;
    let read = from.try_io(Interest::READABLE, || {
        got = (&*socket2::SockRef::from(from)).read(buf)?;
        if got > 0 && got < buf.len() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(got)
    });
    match read {
        Ok(0) => {
            flight.eof = true;
            return Ok(Some(0));
        }
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::WouldBlock && got == 0 => return Ok(None),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
        Err(e) => return Err(e),
    }
    let mut done = 0;
    while done < got {
        match to
            .try_io(Interest::WRITABLE, || (&*socket2::SockRef::from(to)).write(&buf[done..got]))
        {
            Ok(m) => done += m,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) => return Err(e),
        }
    }
    if done > 0 {
        count.fetch_add(done as u64, Ordering::Relaxed);
        last.store(millis(start), Ordering::Relaxed);
    }
    flight.pending.extend_from_slice(&buf[done..got]);
    Ok(Some(got))
}

fn shutdown_write(s: &TcpStream) -> io::Result<()> {
    match socket2::SockRef::from(s).shutdown(std::net::Shutdown::Write) {
        // The peer may already be gone; its own direction reports that.
        Err(e) if e.kind() == io::ErrorKind::NotConnected => Ok(()),
        r => r,
    }
}

/// Makes the coming close send an RST instead of a FIN.
fn abort(s: &TcpStream) {
    let _ = socket2::SockRef::from(s).set_linger(Some(Duration::ZERO));
}

/// [`abort`] for a socket out of the runtime.
fn abort_std(s: &std::net::TcpStream) {
    let _ = socket2::SockRef::from(s).set_linger(Some(Duration::ZERO));
}

/// User-space buffer of a direction in copy mode, and of a burst that got no pipe (DESIGN
/// §7: tokio copies need at least 64 KiB buffers to keep up).
const COPY_BUFFER: usize = 65_536;
#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;
    use std::sync::Arc;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    /// A connected loopback pair: (the end `connect` returned, the end `accept` returned).
    async fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (b, _) = l.accept().await.unwrap();
        (a, b)
    }

    /// Starts a relay between two fresh pairs: (client app end, server app end, relay).
    async fn start(
        config: RelayConfig,
    ) -> (TcpStream, TcpStream, tokio::task::JoinHandle<RelayEnd>) {
        let (client_app, client_proxy) = pair().await;
        let (server_proxy, server_app) = pair().await;
        let relay = tokio::spawn(async move {
            let counters = Counters::default();
            let stop = Notify::new();
            match relay(
                client_proxy,
                server_proxy,
                &config,
                &counters,
                &stop,
                Resume::default(),
                &|| false,
            )
            .await
            {
                Relayed::Ended(end) => end,
                Relayed::Stopped(_) => unreachable!("never told to stop"),
            }
        });
        (client_app, server_app, relay)
    }

    /// Splice mode with pipes from `pool`.
    fn splice(pool: &Arc<PipePool>) -> RelayConfig {
        RelayConfig {
            mode: RelayMode::Splice,
            pipes: pool.clone(),
            idle_timeout: Duration::from_secs(10),
        }
    }

    /// Read ends of the pool's idle pipes, sorted.
    fn idle_fds(pool: &PipePool) -> Vec<i32> {
        let mut fds: Vec<i32> = pool.lock().iter().map(|p| p.read.as_raw_fd()).collect();
        fds.sort_unstable();
        fds
    }

    /// Waits up to 5 s for `cond`.
    async fn until(what: &str, cond: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !cond() {
            assert!(Instant::now() < deadline, "not within 5 s: {what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// One request and one response through the relay.
    async fn round_trip(c: &mut TcpStream, s: &mut TcpStream) {
        c.write_all(b"ping").await.unwrap();
        let mut b = [0u8; 4];
        s.read_exact(&mut b).await.unwrap();
        s.write_all(b"pong").await.unwrap();
        c.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"pong");
    }

    /// Both ends half-close; each sees the other's EOF through the relay, which ends
    /// normally.
    async fn close_both(
        mut c: TcpStream,
        mut s: TcpStream,
        relay: tokio::task::JoinHandle<RelayEnd>,
    ) {
        c.shutdown().await.unwrap();
        s.shutdown().await.unwrap();
        assert_eq!(s.read(&mut [0u8; 1]).await.unwrap(), 0, "EOF at the server");
        assert_eq!(c.read(&mut [0u8; 1]).await.unwrap(), 0, "EOF at the client");
        assert_eq!(relay.await.unwrap(), RelayEnd::Normal);
    }

    #[tokio::test]
    async fn an_idle_connection_holds_no_pipe_and_pipes_come_back_empty_for_reuse() {
        let pool = Arc::new(PipePool::new(1 << 16, 4, 64));
        let config = splice(&pool);
        let mut kept = Vec::new();
        for round in 0..3 {
            let (mut c, mut s, relay) = start(config.clone()).await;
            round_trip(&mut c, &mut s).await;
            // Between bursts the connection is idle: both directions gave their pipe back.
            until("the pipes are back in the pool", || pool.idle() == pool.open()).await;
            assert!(pool.open() <= 2, "round {round}: {} pipes open", pool.open());
            round_trip(&mut c, &mut s).await;
            close_both(c, s, relay).await;
            assert_eq!(pool.idle(), pool.open(), "round {round}: every pipe is back");
            for p in pool.lock().iter() {
                let e = nix::unistd::read(&p.read, &mut [0u8; 1]).expect_err("an empty pipe");
                assert_eq!(e, nix::errno::Errno::EAGAIN, "round {round}: the pipe is empty");
            }
            let fds = idle_fds(&pool);
            if round > 0 {
                assert_eq!(fds, kept, "round {round}: the same pipes, not new ones");
            }
            kept = fds;
        }
        assert!(pool.stats.created.load(Ordering::Relaxed) <= 2);
    }

    #[tokio::test]
    async fn many_idle_connections_hold_no_pipes() {
        let pool = Arc::new(PipePool::new(1 << 16, 2, 1024));
        let config = splice(&pool);
        let mut live = Vec::new();
        for _ in 0..20 {
            let (mut c, mut s, relay) = start(config.clone()).await;
            round_trip(&mut c, &mut s).await;
            live.push((c, s, relay));
        }
        until("the pipes are back", || pool.open() == pool.idle()).await;
        assert!(pool.open() <= 2, "20 idle connections, {} pipes open", pool.open());
    }

    #[tokio::test]
    async fn past_the_budget_bursts_are_copied_and_counted() {
        // One pipe for two directions: while the server is not reading, one direction
        // holds it with bytes in flight, and the other copies.
        let pool = Arc::new(PipePool::new(1 << 16, 1, 1));
        let config = splice(&pool);
        let (mut c, mut s, relay) = start(config).await;
        // Fill the client→server direction beyond the socket buffers so its pipe stays busy.
        let big = vec![7u8; 8 << 20];
        let writer = tokio::spawn(async move {
            c.write_all(&big).await.unwrap();
            c
        });
        until("the pipe is leased", || pool.open() == 1 && pool.idle() == 0).await;
        // The other direction gets no pipe and copies.
        s.write_all(b"pong").await.unwrap();
        until("a burst was copied", || pool.stats.copied_bursts.load(Ordering::Relaxed) > 0).await;
        let mut got = vec![0u8; 8 << 20];
        s.read_exact(&mut got).await.unwrap();
        assert!(got.iter().all(|b| *b == 7));
        let mut c = writer.await.unwrap();
        let mut b = [0u8; 4];
        c.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"pong");
        drop((c, s));
        assert_ne!(relay.await.unwrap(), RelayEnd::Stopped);
        assert!(pool.open() <= 1);
    }

    #[tokio::test]
    async fn pipes_with_bytes_in_flight_are_closed_on_a_reset() {
        let pool = Arc::new(PipePool::new(1 << 16, 4, 64));
        let config = splice(&pool);
        let (mut c, s, relay) = start(config).await;
        // The server never reads: bytes stay in the pipe; then it resets.
        c.write_all(&vec![1u8; 4 << 20]).await.unwrap_or(());
        until("a pipe is leased", || pool.open() > pool.idle()).await;
        socket2::SockRef::from(&s).set_linger(Some(Duration::ZERO)).unwrap();
        drop(s);
        assert_eq!(relay.await.unwrap(), RelayEnd::Reset);
        assert_eq!(pool.open(), pool.idle(), "the busy pipe was closed, not kept");
        for p in pool.lock().iter() {
            let e = nix::unistd::read(&p.read, &mut [0u8; 1]).expect_err("an empty pipe");
            assert_eq!(e, nix::errno::Errno::EAGAIN, "kept pipes are empty");
        }
    }

    #[tokio::test]
    async fn auto_mode_copies_small_messages_and_splices_bursts() {
        let pool = Arc::new(PipePool::new(1 << 16, 4, 64));
        let config = RelayConfig { mode: RelayMode::Auto, ..splice(&pool) };
        let (mut c, mut s, relay) = start(config).await;
        for _ in 0..20 {
            round_trip(&mut c, &mut s).await;
        }
        assert_eq!(pool.stats.created.load(Ordering::Relaxed), 0, "small messages took no pipe");
        // A stream larger than the socket buffers: reads fill the small buffer.
        let big: Vec<u8> = (0..8u32 << 20).map(|i| (i % 251) as u8).collect();
        let want = big.clone();
        let writer = tokio::spawn(async move {
            c.write_all(&big).await.unwrap();
            c
        });
        let mut got = vec![0u8; want.len()];
        s.read_exact(&mut got).await.unwrap();
        assert!(got == want, "the stream arrived intact");
        assert!(pool.stats.created.load(Ordering::Relaxed) > 0, "the stream was spliced");
        let mut c = writer.await.unwrap();
        round_trip(&mut c, &mut s).await;
        close_both(c, s, relay).await;
        assert_eq!(pool.idle(), pool.open(), "every pipe is back");
    }

    #[tokio::test]
    async fn auto_mode_relays_a_short_message_and_the_fin_queued_behind_it() {
        // A short read clears the socket's readiness; the FIN already queued behind the
        // bytes must still end the direction (its read-closed state is kept).
        let pool = Arc::new(PipePool::new(1 << 16, 4, 64));
        let config = RelayConfig { mode: RelayMode::Auto, ..splice(&pool) };
        for _ in 0..20 {
            let (mut c, mut s, relay) = start(config.clone()).await;
            c.write_all(b"last words").await.unwrap();
            c.shutdown().await.unwrap();
            let mut got = Vec::new();
            tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut got))
                .await
                .expect("the FIN arrived within 5 s")
                .unwrap();
            assert_eq!(got, b"last words");
            s.write_all(b"bye").await.unwrap();
            s.shutdown().await.unwrap();
            let mut back = Vec::new();
            c.read_to_end(&mut back).await.unwrap();
            assert_eq!(back, b"bye");
            assert_eq!(relay.await.unwrap(), RelayEnd::Normal);
        }
    }

    #[test]
    fn an_unprivileged_budget_shrinks_pipes_to_keep_enough_of_them() {
        // The kernel's default per-user budget: 16,384 pages = 64 MiB; half of it is 32 MiB.
        let b = PipeBudget::unprivileged(64 << 20, 50, 100_000);
        assert_eq!((b.pipe_bytes, b.max_pipes), (512 << 10, 64));
        // A quarter of it.
        let b = PipeBudget::unprivileged(64 << 20, 25, 100_000);
        assert_eq!((b.pipe_bytes, b.max_pipes), (256 << 10, 64));
        // A larger budget keeps 1 MiB pipes.
        let b = PipeBudget::unprivileged(1 << 30, 50, 100_000);
        assert_eq!((b.pipe_bytes, b.max_pipes), (1 << 20, 512));
        // The open files limit caps the count.
        assert_eq!(PipeBudget::unprivileged(1 << 30, 50, 40).max_pipes, 40);
        // A tiny budget: the smallest pipes, at least one.
        let b = PipeBudget::unprivileged(64 << 10, 50, 100);
        assert_eq!((b.pipe_bytes, b.max_pipes), (MIN_PIPE_BYTES, 1));
    }
}
