//! Relaying the bytes of one proxied TCP connection, both ways.
//!
//! The hot path is `splice(2)`: socket → pipe → socket, the data never copied to user
//! space, one pipe per direction (DESIGN §7: with a 1 MiB pipe this used 2–4× less CPU per
//! GB than tokio copies on these machines). [`RelayMode::Copy`] is the fallback through
//! user-space buffers (64 KiB per direction) for where splice is not available.
//!
//! Pipes come from a [`PipePool`]: a connection that ends normally leaves its two pipes
//! empty, and the next connection takes them instead of creating and sizing two new ones
//! (`pipe2` and `F_SETPIPE_SZ` twice, four `close`s: 8 of the ~51 system calls a proxied
//! connection cost, issue #7).
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
}

/// Relay settings.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// Splice or copy.
    pub mode: RelayMode,
    /// Where splice mode takes its pipes from, and how large they are.
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

/// Why a relay ended (the close reasons audit reports).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseReason {
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

impl CloseReason {
    /// `normal`, `reset`, `timeout`, `stopped`.
    pub fn as_str(self) -> &'static str {
        match self {
            CloseReason::Normal => "normal",
            CloseReason::Reset => "reset",
            CloseReason::Timeout => "timeout",
            CloseReason::Stopped => "stopped",
        }
    }
}

/// Relays between `client` and `server` until both directions end, one side fails, the
/// connection is idle for `config.idle_timeout`, or `stop` is notified.
///
/// In splice mode the two pipes are taken from `config.pipes` and given back when the
/// relay ends normally (then both are empty); after any other end they are closed. When
/// no pipe can be had (file descriptor limit) the connection is relayed by copy, with a
/// warning.
pub async fn relay(
    client: TcpStream,
    server: TcpStream,
    config: &RelayConfig,
    counters: &Counters,
    stop: &Notify,
) -> CloseReason {
    let (client, server) = (&client, &server);
    let start = Instant::now();
    let last = AtomicU64::new(0);
    let pool = &config.pipes;
    let pipes = match config.mode {
        RelayMode::Splice => match pool.take().and_then(|up| Ok((up, pool.take()?))) {
            Ok(pair) => Some(pair),
            Err(e) => {
                tracing::warn!(error = %e, "no pipe for splice; relaying by copy");
                None
            }
        },
        RelayMode::Copy => None,
    };
    let (to_server, to_client) = (&counters.to_server, &counters.to_client);
    let reason = match &pipes {
        Some((up, down)) => {
            let a = pump(client, server, up, to_server, &last, start);
            let b = pump(server, client, down, to_client, &last, start);
            drive(a, b, config.idle_timeout, &last, start, stop).await
        }
        None => {
            let a = copy_pump(client, server, to_server, &last, start);
            let b = copy_pump(server, client, to_client, &last, start);
            drive(a, b, config.idle_timeout, &last, start, stop).await
        }
    };
    if reason == CloseReason::Normal {
        // Both directions read EOF after writing out all they had read: the pipes are empty.
        if let Some((up, down)) = pipes {
            pool.give(up);
            pool.give(down);
        }
    } else {
        // A pipe may still hold bytes that were never written out: closed with `pipes`.
        abort(client);
        abort(server);
    }
    reason
}

/// How many empty pipes a [`PipePool`] of the agent keeps: enough for 8 connections
/// opening and closing at once. Kept pipes count against the kernel's per-user pipe
/// budget (`/proc/sys/fs/pipe-user-pages-soft`, 64 MiB by default, shared by every process
/// of the user, uid 0 on a node): at 1 MiB each these keep a quarter of it, so other root
/// processes on the node still get full-size pipes (pipe(7), "/proc files").
pub const POOLED_PIPES: usize = 16;

/// Empty pipes kept between connections, all of one requested size.
///
/// [`relay`] takes two per spliced connection and gives them back when the connection
/// ended normally; at most `keep` are kept, the rest are closed. Source: pipe(7)
/// (`F_SETPIPE_SZ`), splice(2).
#[derive(Debug)]
pub struct PipePool {
    bytes: usize,
    keep: usize,
    idle: std::sync::Mutex<Vec<Pipe>>,
}

impl PipePool {
    /// A pool of pipes of `bytes` each (the kernel rounds up to a power of two pages; a
    /// size it refuses, above `/proc/sys/fs/pipe-max-size` or over the user's pipe budget
    /// without CAP_SYS_RESOURCE, leaves the default 64 KiB), keeping at most `keep` idle.
    /// `keep` = 0 creates and closes pipes per connection.
    pub fn new(bytes: usize, keep: usize) -> PipePool {
        PipePool { bytes, keep, idle: std::sync::Mutex::new(Vec::with_capacity(keep)) }
    }

    /// Idle pipes now kept.
    pub fn idle(&self) -> usize {
        self.lock().len()
    }

    /// A kept pipe, or a new one.
    ///
    /// # Errors
    /// `pipe2(2)`'s: the process or system is out of file descriptors.
    fn take(&self) -> io::Result<Pipe> {
        match self.lock().pop() {
            Some(p) => Ok(p),
            None => Pipe::new(self.bytes),
        }
    }

    /// Keeps `pipe`, which must be empty, or closes it when the pool is full.
    fn give(&self, pipe: Pipe) {
        let mut idle = self.lock();
        if idle.len() < self.keep {
            idle.push(pipe);
        }
    }

    /// The idle list; a panic while it was held left it intact (a push or a pop).
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Pipe>> {
        self.idle.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
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
            Err(_) => 65_536,
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
) -> CloseReason {
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
    tokio::pin!(idle_clock);
    while !(a_done && b_done) {
        tokio::select! {
            r = &mut a, if !a_done => match r {
                Ok(()) => a_done = true,
                Err(_) => return CloseReason::Reset,
            },
            r = &mut b, if !b_done => match r {
                Ok(()) => b_done = true,
                Err(_) => return CloseReason::Reset,
            },
            () = &mut idle_clock => return CloseReason::Timeout,
            () = stop.notified() => return CloseReason::Stopped,
        }
    }
    CloseReason::Normal
}

/// Moves `from` → `to` through `pipe` until EOF on `from`, then shuts down `to`'s write
/// side.
async fn pump(
    from: &TcpStream,
    to: &TcpStream,
    pipe: &Pipe,
    count: &AtomicU64,
    last: &AtomicU64,
    start: Instant,
) -> io::Result<()> {
    let flags = SpliceFFlags::SPLICE_F_MOVE | SpliceFFlags::SPLICE_F_NONBLOCK;
    loop {
        let n = loop {
            from.readable().await?;
            match from.try_io(Interest::READABLE, || {
                splice(from.as_fd(), None, pipe.write.as_fd(), None, pipe.capacity, flags)
                    .map_err(io::Error::from)
            }) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        };
        if n == 0 {
            return shutdown_write(to);
        }
        let mut left = n;
        while left > 0 {
            to.writable().await?;
            match to.try_io(Interest::WRITABLE, || {
                splice(pipe.read.as_fd(), None, to.as_fd(), None, left, flags)
                    .map_err(io::Error::from)
            }) {
                Ok(m) => left -= m,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
        count.fetch_add(n as u64, Ordering::Relaxed);
        last.store(millis(start), Ordering::Relaxed);
    }
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
        let mut done = 0;
        while done < n {
            to.writable().await?;
            match to.try_write(&buf[done..n]) {
                Ok(m) => done += m,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
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
    ) -> (TcpStream, TcpStream, tokio::task::JoinHandle<CloseReason>) {
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

    /// Read ends of the pool's idle pipes.
    fn idle_fds(pool: &PipePool) -> Vec<i32> {
        pool.lock().iter().map(|p| p.read.as_raw_fd()).collect()
    }

    #[tokio::test]
    async fn pipes_go_back_to_the_pool_empty_after_a_normal_end_and_are_reused() {
        let pool = Arc::new(PipePool::new(1 << 16, 4));
        let config = splice(&pool);
        let mut kept = Vec::new();
        for round in 0..3 {
            let (mut c, mut s, relay) = start(config.clone()).await;
            c.write_all(b"ping").await.unwrap();
            let mut b = [0u8; 4];
            s.read_exact(&mut b).await.unwrap();
            s.write_all(b"pong").await.unwrap();
            c.read_exact(&mut b).await.unwrap();
            assert_eq!(&b, b"pong");
            c.shutdown().await.unwrap();
            s.shutdown().await.unwrap();
            assert_eq!(s.read(&mut b).await.unwrap(), 0, "EOF at the server");
            assert_eq!(c.read(&mut b).await.unwrap(), 0, "EOF at the client");
            assert_eq!(relay.await.unwrap(), CloseReason::Normal);
            assert_eq!(pool.idle(), 2, "round {round}: both pipes kept");
            for p in pool.lock().iter() {
                let e = nix::unistd::read(&p.read, &mut [0u8; 1]).expect_err("an empty pipe");
                assert_eq!(e, nix::errno::Errno::EAGAIN, "round {round}: the pipe is empty");
            }
            let mut fds = idle_fds(&pool);
            fds.sort_unstable();
            if round > 0 {
                assert_eq!(fds, kept, "round {round}: the same two pipes, not new ones");
            }
            kept = fds;
        }
    }

    #[tokio::test]
    async fn pipes_are_closed_after_a_reset_and_beyond_what_the_pool_keeps() {
        let pool = Arc::new(PipePool::new(1 << 16, 1));
        let config = splice(&pool);
        let (mut c, mut s, relay) = start(config.clone()).await;
        c.write_all(b"x").await.unwrap();
        c.shutdown().await.unwrap();
        let mut got = Vec::new();
        s.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"x");
        s.shutdown().await.unwrap();
        assert_eq!(c.read(&mut [0u8; 1]).await.unwrap(), 0, "EOF at the client");
        assert_eq!(relay.await.unwrap(), CloseReason::Normal);
        assert_eq!(pool.idle(), 1, "at most `keep` pipes are kept");

        // A reset: the pipe taken from the pool is closed with the other.
        let (mut c, s, relay) = start(config).await;
        c.write_all(b"x").await.unwrap();
        socket2::SockRef::from(&s).set_linger(Some(Duration::ZERO)).unwrap();
        drop(s);
        assert_eq!(relay.await.unwrap(), CloseReason::Reset);
        assert_eq!(pool.idle(), 0, "pipes of a reset connection are not kept");
    }
}
