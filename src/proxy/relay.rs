//! Relaying the bytes of one proxied TCP connection, both ways.
//!
//! The hot path is `splice(2)`: socket → pipe → socket, the data never copied to user
//! space, one pipe per direction (DESIGN §7: with a 1 MiB pipe this used 2–4× less CPU per
//! GB than tokio copies on these machines). [`RelayMode::Copy`] is the fallback through
//! user-space buffers (64 KiB per direction) for where splice is not available.
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
#[derive(Debug, Clone, Copy)]
pub struct RelayConfig {
    /// Splice or copy.
    pub mode: RelayMode,
    /// Pipe size per direction in bytes (splice mode); the kernel rounds it up to a power
    /// of two pages. If the kernel refuses it (above `/proc/sys/fs/pipe-max-size` without
    /// CAP_SYS_RESOURCE) the default pipe size (64 KiB) is used.
    pub pipe_bytes: usize,
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
    let pipes = match config.mode {
        RelayMode::Splice => match (Pipe::new(config.pipe_bytes), Pipe::new(config.pipe_bytes)) {
            (Ok(up), Ok(down)) => Some((up, down)),
            (Err(e), _) | (_, Err(e)) => {
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
    if reason != CloseReason::Normal {
        abort(client);
        abort(server);
    }
    reason
}

/// One pipe: the in-kernel buffer a spliced direction goes through.
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
