//! A small load generator for the lab's echo servers (`tierproxy loadgen`, run inside a
//! pod's namespace with `tierproxy lab exec`): request/response latency over one
//! connection, whole connect–request–response–close cycles, UDP request/response over one
//! socket per client, and DNS-like UDP queries each from a new socket.
//!
//! The lab's TCP servers greet each connection with one line (`tierproxy-lab <ip> <port>`)
//! and then echo; the TCP modes read the greeting first. crr closes first by default; with
//! [`LoadOptions::server_closes`] it runs against a close-first port, where the server
//! sends its FIN first after answering one request. The UDP server answers each
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
    /// DNS-like UDP queries (issue #20): each `size`-byte request from a new socket, so a
    /// new ephemeral source port, a new flow for every proxy on the path, and a new
    /// conntrack entry unless that port's entry to the same server from an earlier query
    /// is still live (the kernel picks ports at random, and UDP entries live 30 s: about
    /// half of the ports hold one after 20,000 queries with the default port range; see
    /// loadtest/README.md); it waits for the echo's answer up to [`UDP_REPLY_TIMEOUT`] as
    /// [`Mode::UdpRr`] does (a lost answer counts in `timeouts`, never waited on longer)
    /// and the socket is closed after the query.
    UdpFlows,
    /// A half-open flood (issue #17): TCP SYNs to `to` from random source ports, at
    /// [`LoadOptions::rate`] per second, never completing a handshake; with
    /// [`LoadOptions::forge_sources`] each from a random source address too. IPv4 only;
    /// needs CAP_NET_RAW. Counts SYNs sent; see [`syn_flood`].
    SynFlood,
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
    /// syn-flood: SYNs per second (0: as fast as the socket takes them).
    pub rate: u64,
    /// syn-flood: a random source address per SYN, not the pod's own.
    pub forge_sources: bool,
    /// crr: a transaction that fails (connect refused or timed out, greeting or echo not
    /// within [`LoadOptions::timeout`]) is counted in `errors` and the client goes on,
    /// instead of ending the run: how a load test under attack measures what still works.
    pub count_errors: bool,
    /// crr: how long a connect, and then each read, may take.
    pub timeout: Duration,
    /// crr against a server that closes first (a lab port served close-first, see
    /// [`crate::lab::serve`]): after the echo the client reads the server's EOF without
    /// having shut down its own side, then closes. Without it the client shuts down
    /// first and then reads the server's EOF.
    pub server_closes: bool,
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
    /// Requests that got no answer within [`UDP_REPLY_TIMEOUT`] (udp-rr and udp-flows;
    /// always 0 for the TCP modes, where a lost answer is an error).
    pub timeouts: u64,
    /// crr with [`LoadOptions::count_errors`]: transactions that failed (a connect refused
    /// or timed out, a greeting or an echo that did not come within the timeout).
    pub errors: u64,
}

/// What one client thread measured: latencies of answered transactions (µs), the number
/// of requests that timed out and of transactions that failed.
struct ClientResult {
    latencies: Vec<u32>,
    timeouts: u64,
    errors: u64,
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

/// How long a connect, and each read after it, may take by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

fn connect(to: SocketAddr) -> anyhow::Result<TcpStream> {
    connect_within(to, DEFAULT_TIMEOUT)
}

fn connect_within(to: SocketAddr, timeout: Duration) -> anyhow::Result<TcpStream> {
    let s =
        TcpStream::connect_timeout(&to, timeout).with_context(|| format!("connecting to {to}"))?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(timeout))?;
    Ok(s)
}

/// A UDP socket on an ephemeral port (the kernel picks it at bind(2)) of the wildcard
/// address of `to`'s family, connected to `to`, so that it receives only `to`'s datagrams
/// and an ICMP error for what it sent (port unreachable) surfaces on its next call.
fn udp_connected(to: SocketAddr) -> anyhow::Result<UdpSocket> {
    let bind: SocketAddr = if to.is_ipv4() {
        SocketAddr::from(([0, 0, 0, 0], 0))
    } else {
        SocketAddr::from(([0u16; 8], 0))
    };
    let s = UdpSocket::bind(bind).context("binding a UDP socket")?;
    s.connect(to).with_context(|| format!("connecting a UDP socket to {to}"))?;
    Ok(s)
}

/// The error for a datagram that met a closed port at `to` (ECONNREFUSED, the ICMP port
/// unreachable of RFC 1122 §4.1.3.1 reported on the connected socket).
fn udp_refused(to: SocketAddr) -> anyhow::Error {
    anyhow::anyhow!("{to}: UDP port unreachable (is the lab's UDP echo served there?)")
}

/// Sends `req` on the connected socket `s` and waits up to [`UDP_REPLY_TIMEOUT`] for the
/// echo's answer that ends with `req` (its sequence tag tells it apart from a late answer
/// to an earlier request, which is skipped). `Ok(false)`: no answer in time, a loss.
/// `buf` holds an answer: greeting line (≤ ~70 bytes for an IPv6 peer) plus `req`.
fn udp_query(s: &UdpSocket, to: SocketAddr, req: &[u8], buf: &mut [u8]) -> anyhow::Result<bool> {
    // Past the run's deadline too: an answer in flight then is not a loss.
    let give_up = Instant::now() + UDP_REPLY_TIMEOUT;
    match s.send(req) {
        Ok(_) => {}
        // A previous datagram's ICMP error (port unreachable) surfaces on a later call.
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => return Err(udp_refused(to)),
        Err(e) => return Err(e).context("sending a UDP request"),
    }
    loop {
        let left = give_up.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(false);
        }
        s.set_read_timeout(Some(left))?;
        match s.recv(buf) {
            Ok(m) => {
                let got = &buf[..m];
                if !got.starts_with(b"tierproxy-lab ") {
                    bail!("not a lab echo server: answer {:?}", String::from_utf8_lossy(got));
                }
                if got.ends_with(req) {
                    return Ok(true);
                }
                // An answer to an earlier request that had timed out: keep waiting.
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Ok(false);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            // This request's own ICMP error: with a socket per query (udp-flows) it can
            // only surface here.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                return Err(udp_refused(to));
            }
            Err(e) => return Err(e).context("receiving a UDP answer"),
        }
    }
}

/// One UDP client, number `client` of the run: `size`-byte requests (the first
/// [`SEQ_BYTES`] carry the client's number and a sequence number when `size` allows), each
/// answered or lost (see [`udp_query`]). udp-rr sends them all over one connected socket;
/// udp-flows opens a new one for each request and closes it after the answer or the loss,
/// so every request leaves from a new ephemeral port. The client's number in the tag keeps
/// a late answer to another client's query, arriving at a port that client has freed and
/// this one has been given, from passing for this client's answer.
fn udp_client(
    o: LoadOptions,
    client: u64,
    deadline: Instant,
    max: u64,
) -> anyhow::Result<ClientResult> {
    let kept = if o.mode == Mode::UdpFlows { None } else { Some(udp_connected(o.to)?) };
    let mut req = vec![b'x'; o.size];
    let mut buf = vec![0u8; o.size + 256];
    let mut lat = Vec::new();
    let mut timeouts = 0u64;
    let mut seq = 0u64;
    while Instant::now() < deadline && (lat.len() as u64) + timeouts < max {
        seq += 1;
        let tag = ((client << 48) | seq).to_be_bytes();
        let n = SEQ_BYTES.min(req.len());
        req[..n].copy_from_slice(&tag[..n]);
        let t = Instant::now();
        let answered = match &kept {
            Some(s) => udp_query(s, o.to, &req, &mut buf)?,
            // The socket is dropped, and so closed, right after its query.
            None => udp_query(&udp_connected(o.to)?, o.to, &req, &mut buf)?,
        };
        if answered {
            lat.push(t.elapsed().as_micros() as u32);
        } else {
            timeouts += 1;
        }
    }
    Ok(ClientResult { latencies: lat, timeouts, errors: 0 })
}

fn one_client(
    o: LoadOptions,
    client: u64,
    deadline: Instant,
    max: u64,
) -> anyhow::Result<ClientResult> {
    if matches!(o.mode, Mode::UdpRr | Mode::UdpFlows) {
        return udp_client(o, client, deadline, max);
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
        Mode::UdpRr | Mode::UdpFlows => {
            bail!("udp-rr and udp-flows are run by loadgen::udp_client")
        }
        Mode::SynFlood => bail!("syn-flood is run by loadgen::syn_flood"),
        Mode::Crr => {
            let mut errors = 0u64;
            while Instant::now() < deadline && (lat.len() as u64) + errors < max {
                let t = Instant::now();
                let mut one = || -> anyhow::Result<()> {
                    let mut s = connect_within(o.to, o.timeout)?;
                    let mut r = greeting(&s)?;
                    s.write_all(&req)?;
                    r.read_exact(&mut resp).context("reading the echo")?;
                    if !o.server_closes {
                        s.shutdown(std::net::Shutdown::Write)?;
                    }
                    let mut rest = [0u8; 1];
                    // With server_closes this waits for the server's FIN (at most the read
                    // timeout): a server that does not close first fails the transaction.
                    let n = r.read(&mut rest).context(if o.server_closes {
                        "waiting for the server to close first"
                    } else {
                        "waiting for the server's EOF"
                    })?;
                    if n != 0 {
                        bail!("the echo server sent more than the echo");
                    }
                    Ok(())
                };
                match one() {
                    Ok(()) => lat.push(t.elapsed().as_micros() as u32),
                    Err(_) if o.count_errors => errors += 1,
                    Err(e) => return Err(e),
                }
            }
            return Ok(ClientResult { latencies: lat, timeouts: 0, errors });
        }
    }
    Ok(ClientResult { latencies: lat, timeouts: 0, errors: 0 })
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
            .map(|i| s.spawn(move || one_client(o, i as u64, deadline, per_client)))
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("client panicked"))))
            .collect()
    });
    let seconds = start.elapsed().as_secs_f64();
    let mut lat = Vec::new();
    let (mut timeouts, mut errors) = (0, 0);
    for r in results {
        let r = r?;
        lat.extend(r.latencies);
        timeouts += r.timeouts;
        errors += r.errors;
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
        errors,
    })
}

/// What [`syn_flood`] sent.
#[derive(Debug, Clone, Serialize)]
pub struct FloodReport {
    /// SYNs sent.
    pub sent: u64,
    /// Seconds it took.
    pub seconds: f64,
    /// SYNs per second.
    pub per_second: f64,
    /// Sends the socket refused (buffer full): counted, not retried.
    pub refused: u64,
}

/// The Internet checksum of `chunks` (RFC 1071), one's complement of the one's-complement
/// sum of 16-bit words.
fn checksum(chunks: &[&[u8]]) -> u16 {
    let mut acc: u32 = 0;
    for c in chunks {
        for pair in c.chunks(2) {
            acc += u32::from(u16::from_be_bytes([pair[0], *pair.get(1).unwrap_or(&0)]));
        }
    }
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    !(acc as u16)
}

/// A TCP SYN (RFC 9293 §3.1, no options) from `src` to `dst`, checksummed over the IPv4
/// pseudo-header.
fn syn_segment(src: std::net::SocketAddrV4, dst: std::net::SocketAddrV4, seq: u32) -> [u8; 20] {
    let mut t = [0u8; 20];
    t[0..2].copy_from_slice(&src.port().to_be_bytes());
    t[2..4].copy_from_slice(&dst.port().to_be_bytes());
    t[4..8].copy_from_slice(&seq.to_be_bytes());
    t[12] = 5 << 4;
    t[13] = 0x02; // SYN
    t[14..16].copy_from_slice(&64240u16.to_be_bytes());
    let pseudo = [&src.ip().octets()[..], &dst.ip().octets()[..], &[0, 6, 0, 20]].concat();
    let sum = checksum(&[&pseudo, &t]);
    t[16..18].copy_from_slice(&sum.to_be_bytes());
    t
}

/// An IPv4 header (RFC 791, no options) for a 20-byte TCP segment from `src` to `dst`.
fn ipv4_header(src: std::net::Ipv4Addr, dst: std::net::Ipv4Addr, id: u16) -> [u8; 20] {
    let mut h = [0u8; 20];
    h[0] = 0x45;
    h[2..4].copy_from_slice(&40u16.to_be_bytes());
    h[4..6].copy_from_slice(&id.to_be_bytes());
    h[8] = 64;
    h[9] = 6;
    h[12..16].copy_from_slice(&src.octets());
    h[16..20].copy_from_slice(&dst.octets());
    let sum = checksum(&[&h]);
    h[10..12].copy_from_slice(&sum.to_be_bytes());
    h
}

/// Sends TCP SYNs to `o.to` (IPv4) for `o.duration` or `o.max_count` SYNs, at `o.rate`
/// per second (0: unpaced), each from a random source port of this namespace's own source
/// address for `o.to` (with `o.forge_sources`: from a random address in 10.0.0.0/8, which
/// a reverse-path check drops). No handshake is ever completed: each SYN leaves a
/// half-open connection at whatever answers it. Pacing: every millisecond, the SYNs due
/// by then.
///
/// # Errors
/// No raw socket (CAP_NET_RAW), an IPv6 target, or no route to `o.to`.
pub fn syn_flood(o: LoadOptions) -> anyhow::Result<FloodReport> {
    use socket2::{Domain, Protocol, Socket, Type};
    let std::net::SocketAddr::V4(dst) = o.to else { bail!("syn-flood: IPv4 targets only") };
    // The source address the kernel would pick for this destination.
    let own = {
        let probe = UdpSocket::bind("0.0.0.0:0")?;
        probe.connect(o.to).with_context(|| format!("no route to {}", o.to))?;
        match probe.local_addr()?.ip() {
            std::net::IpAddr::V4(a) => a,
            std::net::IpAddr::V6(_) => bail!("syn-flood: no IPv4 source"),
        }
    };
    let (proto, hdrincl) = if o.forge_sources {
        (Protocol::from(nix::libc::IPPROTO_RAW), true)
    } else {
        (Protocol::TCP, false)
    };
    let s =
        Socket::new(Domain::IPV4, Type::RAW, Some(proto)).context("raw socket (CAP_NET_RAW)")?;
    if hdrincl {
        s.set_header_included_v4(true)?;
    }
    s.set_nonblocking(true)?;
    let target: socket2::SockAddr = o.to.into();
    let start = Instant::now();
    let deadline = start + o.duration;
    let (mut sent, mut refused) = (0u64, 0u64);
    let mut rng =
        start.elapsed().as_nanos() as u64 ^ 0x9e37_79b9_7f4a_7c15 ^ u64::from(std::process::id());
    let mut next = || {
        // xorshift64*: enough for ports, addresses and sequence numbers.
        rng ^= rng >> 12;
        rng ^= rng << 25;
        rng ^= rng >> 27;
        rng.wrapping_mul(0x2545_f491_4f6c_dd1d)
    };
    let mut packet = Vec::with_capacity(40);
    while Instant::now() < deadline && sent < o.max_count {
        let due = if o.rate == 0 {
            sent + 64
        } else {
            (start.elapsed().as_secs_f64() * o.rate as f64) as u64 + 1
        };
        while sent < due.min(o.max_count) {
            let r = next();
            let port = 1024 + (r % 64_000) as u16;
            let src_ip = if o.forge_sources {
                std::net::Ipv4Addr::from(0x0a00_0000 | ((r >> 16) as u32 & 0x00ff_ffff))
            } else {
                own
            };
            let seg = syn_segment(std::net::SocketAddrV4::new(src_ip, port), dst, (r >> 32) as u32);
            packet.clear();
            if hdrincl {
                packet.extend_from_slice(&ipv4_header(src_ip, *dst.ip(), r as u16));
            }
            packet.extend_from_slice(&seg);
            match s.send_to(&packet, &target) {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => refused += 1,
                Err(e) => return Err(e).context("sending a SYN"),
            }
            sent += 1;
        }
        if o.rate != 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    Ok(FloodReport { sent, seconds, per_second: sent as f64 / seconds.max(1e-9), refused })
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

    #[test]
    fn syn_segments_and_headers_check_out() {
        let src: std::net::SocketAddrV4 = "10.60.1.2:40000".parse().unwrap();
        let dst: std::net::SocketAddrV4 = "10.60.1.3:8080".parse().unwrap();
        let seg = syn_segment(src, dst, 7);
        let pseudo = [&src.ip().octets()[..], &dst.ip().octets()[..], &[0, 6, 0, 20]].concat();
        // A correct checksum sums to zero with the data it covers.
        assert_eq!(checksum(&[&pseudo, &seg]), 0);
        assert_eq!(seg[13], 0x02, "SYN only");
        let h = ipv4_header(*src.ip(), *dst.ip(), 1);
        assert_eq!(checksum(&[&h]), 0);
        assert_eq!(u16::from_be_bytes([h[2], h[3]]), 40);
    }

    fn opts(mode: Mode, to: SocketAddr, max_count: u64, concurrency: usize) -> LoadOptions {
        LoadOptions {
            mode,
            to,
            size: 64,
            duration: Duration::from_secs(5),
            max_count,
            concurrency,
            rate: 0,
            forge_sources: false,
            count_errors: false,
            timeout: DEFAULT_TIMEOUT,
            server_closes: false,
        }
    }

    /// A lab TCP server on loopback, served `style` (it serves until the test ends).
    fn tcp_server(style: crate::lab::serve::TcpStyle) -> SocketAddr {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || crate::lab::serve::serve_tcp_as(l, style));
        addr
    }

    #[test]
    fn crr_with_server_closes_completes_cycles_on_a_close_first_port() {
        let to = tcp_server(crate::lab::serve::TcpStyle::CloseFirst);
        let r = run(LoadOptions { server_closes: true, ..opts(Mode::Crr, to, 200, 2) }).unwrap();
        assert_eq!((r.count, r.errors), (200, 0));
        assert!(r.p50_us > 0.0 && r.p99_us >= r.p50_us);
    }

    #[test]
    fn crr_with_server_closes_fails_on_a_server_that_waits_for_the_client() {
        // The plain echo closes only after the client: the client's wait for the server's
        // FIN times out, an error, not a completed cycle.
        let to = tcp_server(crate::lab::serve::TcpStyle::Echo);
        let o = LoadOptions {
            server_closes: true,
            timeout: Duration::from_millis(300),
            ..opts(Mode::Crr, to, 1, 1)
        };
        let e = run(o).unwrap_err();
        assert!(format!("{e:#}").contains("waiting for the server to close first"), "{e:#}");
        // And the default crr completes against the close-first port too (it shuts down
        // first; the server's FIN follows the echo either way).
        let to = tcp_server(crate::lab::serve::TcpStyle::CloseFirst);
        assert_eq!(run(opts(Mode::Crr, to, 20, 1)).unwrap().count, 20);
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

    /// A lab UDP echo on loopback that records the source port of every datagram it
    /// answers (before answering, so a run's answered requests are all recorded when it
    /// returns).
    fn udp_echo_recording_ports() -> (SocketAddr, std::sync::Arc<std::sync::Mutex<Vec<u16>>>) {
        let s = UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = s.local_addr().unwrap();
        let ports = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = ports.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 2048];
            while let Ok((n, peer)) = s.recv_from(&mut buf) {
                seen.lock().unwrap().push(peer.port());
                let mut reply = crate::lab::serve::greeting(peer).into_bytes();
                reply.extend_from_slice(&buf[..n]);
                let _ = s.send_to(&reply, peer);
            }
        });
        (addr, ports)
    }

    fn distinct(ports: &std::sync::Mutex<Vec<u16>>) -> usize {
        ports.lock().unwrap().iter().collect::<std::collections::HashSet<_>>().len()
    }

    #[test]
    fn udp_flows_sends_each_query_from_a_new_source_port() {
        let (to, ports) = udp_echo_recording_ports();
        let r = run(opts(Mode::UdpFlows, to, 100, 2)).unwrap();
        assert_eq!((r.count, r.timeouts), (100, 0));
        assert!(r.p50_us > 0.0 && r.p99_us >= r.p50_us);
        assert_eq!(ports.lock().unwrap().len(), 100);
        // The kernel picks each ephemeral port at random, so a port freed by an earlier
        // query may come back now and then (about one pair in 100 queries over the
        // 28,000-port range), never a fixed one per client.
        let n = distinct(&ports);
        assert!(n >= 90, "100 queries from {n} source ports");
        // udp-rr, by contrast, keeps one socket per client.
        let (to, ports) = udp_echo_recording_ports();
        assert_eq!(run(opts(Mode::UdpRr, to, 100, 2)).unwrap().count, 100);
        assert_eq!(distinct(&ports), 2);
    }

    #[test]
    fn udp_flows_counts_a_silent_server_as_timeouts_and_ends() {
        let silent = UdpSocket::bind("127.0.0.1:0").unwrap();
        let t = Instant::now();
        let r = run(opts(Mode::UdpFlows, silent.local_addr().unwrap(), 3, 1)).unwrap();
        assert_eq!((r.count, r.timeouts), (0, 3));
        assert!(t.elapsed() < UDP_REPLY_TIMEOUT * 3 + Duration::from_secs(1));
    }

    #[test]
    fn udp_flows_and_udp_rr_name_a_closed_port() {
        // Bound, then closed: the loopback answers with an ICMP port unreachable (never
        // rate-limited on loopback), which the query's own socket reports on its recv.
        let to = UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        for mode in [Mode::UdpFlows, Mode::UdpRr] {
            let e = run(opts(mode, to, 5, 1)).unwrap_err();
            assert!(format!("{e:#}").contains("UDP port unreachable"), "{mode:?}: {e:#}");
        }
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
