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
pub async fn relay(
    client: TcpStream,
    server: TcpStream,
    config: &RelayConfig,
    counters: &Counters,
    stop: &Notify,
) -> RelayEnd {
    let (client, server) = (&client, &server);
    let start = Instant::now();
    let last = AtomicU64::new(0);
    let (to_server, to_client) = (&counters.to_server, &counters.to_client);
    let reason = match config.mode {
        RelayMode::Splice | RelayMode::Auto => {
            let pool = &config.pipes;
            let auto = config.mode == RelayMode::Auto;
            let a = pump(client, server, pool, auto, to_server, &last, start);
            let b = pump(server, client, pool, auto, to_client, &last, start);
            drive(a, b, config.idle_timeout, &last, start, stop).await
        }
        RelayMode::Copy => {
            let a = copy_pump(client, server, to_server, &last, start);
            let b = copy_pump(server, client, to_client, &last, start);
            drive(a, b, config.idle_timeout, &last, start, stop).await
        }
    };
    if reason != RelayEnd::Normal {
        // A pipe may still hold bytes that were never written out: its lease closed it.
        abort(client);
        abort(server);
    }
    reason
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
    a: impl Future<Output = io::Result<()>>,
    b: impl Future<Output = io::Result<()>>,
    idle: Duration,
    last: &AtomicU64,
    start: Instant,
    stop: &Notify,
) -> RelayEnd {
    tokio::pin!(a, b);
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
/// With `auto`, a burst starts only when a read through the thread's small buffer filled
/// it ([`copy_small`]); reads that do not stay in user space.
async fn pump(
    from: &TcpStream,
    to: &TcpStream,
    pool: &PipePool,
    auto: bool,
    count: &AtomicU64,
    last: &AtomicU64,
    start: Instant,
) -> io::Result<()> {
    let flags = SpliceFFlags::SPLICE_F_MOVE | SpliceFFlags::SPLICE_F_NONBLOCK;
    // Held while `from` keeps having bytes; dropped (given back empty) when it has none.
    let mut lease: Option<Lease<'_>> = None;
    // In auto mode: whether the next read splices: the last copy filled the small buffer,
    // or the last burst spliced at least as much (a stream: its next burst, once `from`
    // is readable again, is most likely as large, and starting it with a copy cost bulk
    // transfers CPU).
    let mut burst = !auto;
    let mut burst_bytes = 0usize;
    loop {
        from.readable().await?;
        if !burst {
            match copy_small(from, to).await? {
                None => {}
                Some(0) => return shutdown_write(to),
                Some(n) => {
                    burst = n == AUTO_COPY_BYTES;
                    count.fetch_add(n as u64, Ordering::Relaxed);
                    last.store(millis(start), Ordering::Relaxed);
                }
            }
            continue;
        }
        if lease.is_none() {
            lease = pool.lease();
        }
        let n = match lease.as_mut() {
            Some(l) => {
                let pipe = l.pipe();
                match from.try_io(Interest::READABLE, || {
                    splice(from.as_fd(), None, pipe.write.as_fd(), None, pipe.capacity, flags)
                        .map_err(io::Error::from)
                }) {
                    Ok(n) => {
                        l.in_flight = n;
                        n
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        // The burst is over: the pipe is empty, give it back.
                        lease = None;
                        burst = !auto || burst_bytes >= AUTO_COPY_BYTES;
                        burst_bytes = 0;
                        continue;
                    }
                    Err(e) => return Err(e),
                }
            }
            None => match copy_burst(from, to).await? {
                Some(n) => n,
                None => continue,
            },
        };
        if n == 0 {
            drop(lease);
            return shutdown_write(to);
        }
        if let Some(l) = lease.as_mut() {
            while l.in_flight > 0 {
                to.writable().await?;
                let pipe = l.pipe();
                match to.try_io(Interest::WRITABLE, || {
                    splice(pipe.read.as_fd(), None, to.as_fd(), None, l.in_flight, flags)
                        .map_err(io::Error::from)
                }) {
                    Ok(m) => l.in_flight -= m,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                    Err(e) => return Err(e),
                }
            }
        }
        burst_bytes = burst_bytes.saturating_add(n);
        count.fetch_add(n as u64, Ordering::Relaxed);
        last.store(millis(start), Ordering::Relaxed);
    }
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

/// One read of up to [`AUTO_COPY_BYTES`] from `from` through the thread's buffer, written
/// to `to` at once; what `to` does not take at once is kept in a buffer of its own until
/// written. `Some(0)` at EOF, `None` when `from` had nothing after all.
///
/// A short read leaves the socket's receive queue empty, so it clears `from`'s readiness
/// as tokio's own `poll_read` does (tcp(7) `recv` returns what is queued, up to the
/// length): the next wait goes to epoll instead of a `read` that would return `EAGAIN`.
/// The clearing happens inside `try_io`, against the readiness seen before the read, so
/// bytes that arrived meanwhile are not missed.
async fn copy_small(from: &TcpStream, to: &TcpStream) -> io::Result<Option<usize>> {
    use std::io::{Read, Write};
    let mut rest = Vec::new();
    let got = SCRATCH.with_borrow_mut(|buf| -> io::Result<Option<usize>> {
        let mut got = 0;
        let read = from.try_io(Interest::READABLE, || {
            got = (&*socket2::SockRef::from(from)).read(buf)?;
            if got > 0 && got < buf.len() {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            Ok(got)
        });
        match read {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && got == 0 => return Ok(None),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
        let mut done = 0;
        while done < got {
            match to.try_io(Interest::WRITABLE, || {
                (&*socket2::SockRef::from(to)).write(&buf[done..got])
            }) {
                Ok(m) => done += m,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        rest.extend_from_slice(&buf[done..got]);
        Ok(Some(got))
    })?;
    write_all(to, &rest).await?;
    Ok(got)
}

/// One burst without a pipe: reads what `from` has (up to [`COPY_BUFFER`]) and writes it
/// all to `to`. `Some(0)` at EOF, `None` when `from` had nothing after all.
async fn copy_burst(from: &TcpStream, to: &TcpStream) -> io::Result<Option<usize>> {
    let mut buf = vec![0u8; COPY_BUFFER];
    let n = match from.try_read(&mut buf) {
        Ok(n) => n,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
        Err(e) => return Err(e),
    };
    write_all(to, &buf[..n]).await?;
    Ok(Some(n))
}

/// Writes all of `bytes` to `to`, waiting for writability as needed.
async fn write_all(to: &TcpStream, bytes: &[u8]) -> io::Result<()> {
    let mut done = 0;
    while done < bytes.len() {
        to.writable().await?;
        match to.try_write(&bytes[done..]) {
            Ok(m) => done += m,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
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

/// User-space buffer per direction in copy mode (DESIGN §7: tokio copies need at least
/// 64 KiB buffers to keep up).
const COPY_BUFFER: usize = 65_536;

/// [`pump`] through a user-space buffer.
async fn copy_pump(
    from: &TcpStream,
    to: &TcpStream,
    count: &AtomicU64,
    last: &AtomicU64,
    start: Instant,
) -> io::Result<()> {
    let mut buf = vec![0u8; COPY_BUFFER];
    loop {
        from.readable().await?;
        let n = match from.try_read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        };
        if n == 0 {
            return shutdown_write(to);
        }
        write_all(to, &buf[..n]).await?;
        count.fetch_add(n as u64, Ordering::Relaxed);
        last.store(millis(start), Ordering::Relaxed);
    }
}

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
            relay(client_proxy, server_proxy, &config, &Counters::default(), &Notify::new()).await
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
