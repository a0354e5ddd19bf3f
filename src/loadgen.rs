//! A small load generator for the lab's echo servers (`tierproxy loadgen`, run inside a
//! pod's namespace with `tierproxy lab exec`): request/response latency over one
//! connection, whole connect–request–response–close cycles, and UDP request/response.
//!
//! The lab's TCP servers greet each connection with one line (`tierproxy-lab <ip> <port>`)
//! and then echo; the TCP modes read the greeting first. The UDP server answers each
//! datagram with that line followed by the datagram. Every run is bounded by a duration
//! and a count. Output: one JSON object (figures in microseconds and per second).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream, UdpSocket};
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
    /// Request/response of `size` bytes over a connected UDP socket per client: each
    /// request waits for the echo's answer (greeting line + payload) up to
    /// [`UDP_REPLY_TIMEOUT`]; a datagram lost either way counts in `timeouts`.
    UdpRr,
}

/// How long a UDP request waits for its answer before it counts as lost. The lab's round
/// trips take tens to hundreds of microseconds, so an answer this late is lost, not slow;
/// short enough that a few losses do not eat a run.
pub const UDP_REPLY_TIMEOUT: Duration = Duration::from_millis(200);

/// Bytes at the start of each UDP request that carry its sequence number, so a late
/// answer to an earlier request is told apart from the answer awaited.
const SEQ_BYTES: usize = 8;

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
    /// Requests that got no answer within [`UDP_REPLY_TIMEOUT`] (udp-rr only; always 0
    /// for the TCP modes, where a lost answer is an error).
    pub timeouts: u64,
}

/// What one client thread measured: latencies of answered transactions (µs) and the
/// number of requests that timed out.
struct ClientResult {
    latencies: Vec<u32>,
    timeouts: u64,
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

/// One UDP client: a connected socket, `size`-byte requests (the first [`SEQ_BYTES`]
/// carry a sequence number when `size` allows), each waiting for the answer that ends
/// with its own payload; answers to earlier (timed-out) requests are skipped.
fn udp_client(o: LoadOptions, deadline: Instant, max: u64) -> anyhow::Result<ClientResult> {
    let bind: SocketAddr = if o.to.is_ipv4() {
        SocketAddr::from(([0, 0, 0, 0], 0))
    } else {
        SocketAddr::from(([0u16; 8], 0))
    };
    let s = UdpSocket::bind(bind).context("binding a UDP socket")?;
    s.connect(o.to).with_context(|| format!("connecting a UDP socket to {}", o.to))?;
    let mut req = vec![b'x'; o.size];
    // Greeting (≤ ~70 bytes for an IPv6 peer) + payload.
    let mut buf = vec![0u8; o.size + 256];
    let mut lat = Vec::new();
    let mut timeouts = 0u64;
    let mut seq = 0u64;
    while Instant::now() < deadline && (lat.len() as u64) + timeouts < max {
        seq += 1;
        let tag = seq.to_be_bytes();
        let n = SEQ_BYTES.min(req.len());
        req[..n].copy_from_slice(&tag[..n]);
        let t = Instant::now();
        // Past the run's deadline too: an answer in flight then is not a loss.
        let give_up = t + UDP_REPLY_TIMEOUT;
        match s.send(&req) {
            Ok(_) => {}
            // A previous datagram's ICMP error (port unreachable) surfaces on a later call.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                bail!("{}: UDP port unreachable (is the lab's UDP echo served there?)", o.to)
            }
            Err(e) => return Err(e).context("sending a UDP request"),
        }
        let answered = loop {
            let left = give_up.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break false;
            }
            s.set_read_timeout(Some(left))?;
            match s.recv(&mut buf) {
                Ok(m) => {
                    let got = &buf[..m];
                    if !got.starts_with(b"tierproxy-lab ") {
                        bail!("not a lab echo server: answer {:?}", String::from_utf8_lossy(got));
                    }
                    if got.ends_with(&req) {
                        break true;
                    }
                    // An answer to an earlier request that had timed out: keep waiting.
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    break false;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e).context("receiving a UDP answer"),
            }
        };
        if answered {
            lat.push(t.elapsed().as_micros() as u32);
        } else {
            timeouts += 1;
        }
    }
    Ok(ClientResult { latencies: lat, timeouts })
}

fn one_client(o: LoadOptions, deadline: Instant, max: u64) -> anyhow::Result<ClientResult> {
    if o.mode == Mode::UdpRr {
        return udp_client(o, deadline, max);
    }
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
        Mode::UdpRr => bail!("udp-rr is run by loadgen::udp_client"),
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
    Ok(ClientResult { latencies: lat, timeouts: 0 })
}

/// Runs the load and reports.
///
/// # Errors
/// A connect, read or write that fails, or a server that is not a lab echo server.
pub fn run(o: LoadOptions) -> anyhow::Result<Report> {
    let start = Instant::now();
    let deadline = start + o.duration;
    let per_client = o.max_count.div_ceil(o.concurrency.max(1) as u64);
    let results: Vec<anyhow::Result<ClientResult>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..o.concurrency.max(1))
            .map(|_| s.spawn(move || one_client(o, deadline, per_client)))
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("client panicked"))))
            .collect()
    });
    let seconds = start.elapsed().as_secs_f64();
    let mut lat = Vec::new();
    let mut timeouts = 0;
    for r in results {
        let r = r?;
        lat.extend(r.latencies);
        timeouts += r.timeouts;
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
        timeouts,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(mode: Mode, to: SocketAddr, max_count: u64, concurrency: usize) -> LoadOptions {
        LoadOptions { mode, to, size: 64, duration: Duration::from_secs(5), max_count, concurrency }
    }

    /// A lab UDP echo on loopback (it serves until the test process ends).
    fn udp_echo() -> SocketAddr {
        let s = UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = s.local_addr().unwrap();
        std::thread::spawn(move || crate::lab::serve::serve_udp(s));
        addr
    }

    #[test]
    fn udp_rr_counts_answered_requests() {
        let r = run(opts(Mode::UdpRr, udp_echo(), 200, 2)).unwrap();
        assert_eq!((r.count, r.timeouts), (200, 0));
        assert!(r.p50_us > 0.0 && r.p99_us >= r.p50_us);
    }

    #[test]
    fn udp_rr_counts_a_silent_server_as_timeouts_and_ends() {
        // Bound, never read: every request is lost.
        let silent = UdpSocket::bind("127.0.0.1:0").unwrap();
        let t = Instant::now();
        let r = run(opts(Mode::UdpRr, silent.local_addr().unwrap(), 3, 1)).unwrap();
        assert_eq!((r.count, r.timeouts), (0, 3));
        assert!(t.elapsed() < UDP_REPLY_TIMEOUT * 3 + Duration::from_secs(1));
    }

    #[test]
    fn udp_rr_refuses_a_server_that_is_not_the_lab_echo() {
        let other = UdpSocket::bind("127.0.0.1:0").unwrap();
        let to = other.local_addr().unwrap();
        std::thread::spawn(move || {
            let mut buf = [0u8; 256];
            if let Ok((_, peer)) = other.recv_from(&mut buf) {
                let _ = other.send_to(b"hello", peer);
            }
        });
        let e = run(opts(Mode::UdpRr, to, 1, 1)).unwrap_err();
        assert!(format!("{e:#}").contains("not a lab echo server"), "{e:#}");
    }
}
