//! A small load generator for the lab's echo servers (`tierproxy loadgen`, run inside a
//! pod's namespace with `tierproxy lab exec`): request/response latency over one
//! connection, and whole connect–request–response–close cycles.
//!
//! The lab's servers greet each connection with one line (`tierproxy-lab <ip> <port>`)
//! and then echo; both modes read the greeting first. Every run is bounded by a duration
//! and a count. Output: one JSON object (figures in microseconds and per second).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::Serialize;

/// What to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
pub enum Mode {
    /// Request/response of `size` bytes each way over one connection.
    Rr,
    /// Connect, read the greeting, one request/response of `size` bytes, close.
    Crr,
    /// Open `max_count` connections, then hold them and record when each is cut (live
    /// re-decision measurements, issue #5); see [`hold`].
    Hold,
}

/// A run's settings.
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    /// Mode.
    pub mode: Mode,
    /// The echo server.
    pub to: SocketAddr,
    /// Request (and response) size in bytes.
    pub size: usize,
    /// Stop after this long.
    pub duration: Duration,
    /// Stop after this many transactions, whichever comes first.
    pub max_count: u64,
    /// Parallel clients (threads), each its own connection(s).
    pub concurrency: usize,
}

/// A run's figures.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Mode.
    pub mode: Mode,
    /// Transactions completed.
    pub count: u64,
    /// Transactions per second.
    pub per_second: f64,
    /// Latency percentiles of one transaction, in microseconds.
    pub p50_us: f64,
    /// 99th percentile, microseconds.
    pub p99_us: f64,
    /// Wall time of the run, seconds.
    pub seconds: f64,
}

fn greeting(s: &TcpStream) -> anyhow::Result<BufReader<TcpStream>> {
    let mut r = BufReader::new(s.try_clone()?);
    let mut line = String::new();
    r.read_line(&mut line).context("reading the greeting")?;
    if !line.starts_with("tierproxy-lab ") {
        bail!("not a lab echo server: greeting {line:?}");
    }
    Ok(r)
}

fn connect(to: SocketAddr) -> anyhow::Result<TcpStream> {
    let s = TcpStream::connect_timeout(&to, Duration::from_secs(5))
        .with_context(|| format!("connecting to {to}"))?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    Ok(s)
}

fn one_client(o: LoadOptions, deadline: Instant, max: u64) -> anyhow::Result<Vec<u32>> {
    let req = vec![b'x'; o.size];
    let mut resp = vec![0u8; o.size];
    let mut lat = Vec::new();
    match o.mode {
        Mode::Rr => {
            let mut s = connect(o.to)?;
            let mut r = greeting(&s)?;
            while Instant::now() < deadline && (lat.len() as u64) < max {
                let t = Instant::now();
                s.write_all(&req)?;
                r.read_exact(&mut resp)?;
                lat.push(t.elapsed().as_micros() as u32);
            }
        }
        Mode::Hold => bail!("hold is run by loadgen::hold"),
        Mode::Crr => {
            while Instant::now() < deadline && (lat.len() as u64) < max {
                let t = Instant::now();
                let mut s = connect(o.to)?;
                let mut r = greeting(&s)?;
                s.write_all(&req)?;
                r.read_exact(&mut resp)?;
                s.shutdown(std::net::Shutdown::Write)?;
                let mut rest = [0u8; 1];
                if r.read(&mut rest)? != 0 {
                    bail!("the echo server sent more than the echo");
                }
                lat.push(t.elapsed().as_micros() as u32);
            }
        }
    }
    Ok(lat)
}

/// Runs the load and reports.
///
/// # Errors
/// A connect, read or write that fails, or a server that is not a lab echo server.
pub fn run(o: LoadOptions) -> anyhow::Result<Report> {
    let start = Instant::now();
    let deadline = start + o.duration;
    let per_client = o.max_count.div_ceil(o.concurrency.max(1) as u64);
    let results: Vec<anyhow::Result<Vec<u32>>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..o.concurrency.max(1))
            .map(|_| s.spawn(move || one_client(o, deadline, per_client)))
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("client panicked"))))
            .collect()
    });
    let seconds = start.elapsed().as_secs_f64();
    let mut lat = Vec::new();
    for r in results {
        lat.extend(r?);
    }
    lat.sort_unstable();
    let at = |q: f64| {
        lat.get(((lat.len() as f64 * q) as usize).min(lat.len().saturating_sub(1)))
            .map_or(0.0, |v| f64::from(*v))
    };
    Ok(Report {
        mode: o.mode,
        count: lat.len() as u64,
        per_second: lat.len() as f64 / seconds,
        p50_us: at(0.50),
        p99_us: at(0.99),
        seconds,
    })
}

/// What [`hold`] saw.
#[derive(Debug, Clone, Serialize)]
pub struct HoldReport {
    /// Connections opened and held.
    pub held: usize,
    /// Connections cut (reset or closed by the other end) while held.
    pub cut: usize,
    /// Wall-clock time of the first cut, microseconds since the Unix epoch.
    pub first_cut_unix_us: Option<u64>,
    /// Wall-clock time of the last cut, microseconds since the Unix epoch.
    pub last_cut_unix_us: Option<u64>,
}

fn unix_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// Opens `count` connections to the lab echo server `to` (each past its greeting), writes
/// `{"held": N, "at_unix_us": T}` and a newline to `ready` once all are open, then waits
/// up to `duration` (or until every one is cut) and reports when they were cut. One thread
/// polls every socket (poll(2)); a cut is a socket that turns readable or hung up (an RST
/// or FIN from the proxy: the echo server never writes unasked).
///
/// # Errors
/// A connection that cannot be opened or greeted; a failing poll(2).
pub fn hold(
    to: SocketAddr,
    count: usize,
    duration: Duration,
    ready: &mut dyn Write,
) -> anyhow::Result<HoldReport> {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    use std::os::fd::AsFd;
    let mut conns = Vec::with_capacity(count);
    for i in 0..count {
        let s = connect(to).with_context(|| format!("connection {i}"))?;
        greeting(&s)?;
        conns.push(s);
    }
    writeln!(ready, "{{\"held\": {count}, \"at_unix_us\": {}}}", unix_us())?;
    ready.flush()?;
    let deadline = Instant::now() + duration;
    let mut live: Vec<bool> = vec![true; conns.len()];
    let (mut cut, mut first, mut last) = (0, None, None);
    while cut < conns.len() && Instant::now() < deadline {
        let idx: Vec<usize> = (0..conns.len()).filter(|&i| live[i]).collect();
        let mut fds: Vec<PollFd> =
            idx.iter().map(|&i| PollFd::new(conns[i].as_fd(), PollFlags::POLLIN)).collect();
        let left = deadline.saturating_duration_since(Instant::now());
        let ms = u16::try_from(left.as_millis().min(1000)).unwrap_or(1000);
        let n = poll(&mut fds, PollTimeout::from(ms)).context("poll")?;
        if n == 0 {
            continue;
        }
        let now = unix_us();
        for (k, fd) in fds.iter().enumerate() {
            if fd.revents().is_some_and(|r| !r.is_empty()) {
                live[idx[k]] = false;
                cut += 1;
                first.get_or_insert(now);
                last = Some(now);
            }
        }
    }
    Ok(HoldReport { held: conns.len(), cut, first_cut_unix_us: first, last_cut_unix_us: last })
}
