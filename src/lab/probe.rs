//! Real connections for probes: from inside a namespace, bound to the probe's source
//! address, with a timeout. No process per probe: worker threads enter the namespace with
//! `setns(CLONE_NEWNET)` and open their sockets there.
//!
//! SCTP, on kernels without SCTP sockets (these machines'), is probed on a raw IP socket
//! ([`probe_sctp_raw`]): an INIT from a random source port, answered by the lab's server
//! with an INIT ACK that names the address it saw ([`super::sctp`]). On kernels with SCTP
//! sockets a one-to-one SCTP socket is used as a TCP socket is (untested here).

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpStream, UdpSocket};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use socket2::{Domain, Socket, Type};

use super::netns;
use super::sctp::{self, Chunk, IPPROTO_SCTP, Packet};
use super::serve::parse_greeting;
use crate::policy::{Flow, Protocol};

/// Default time a probe waits for a connection (and then for each read), in milliseconds:
/// a dropped SYN is retransmitted after 1 s, so 2 s lets one retransmission through while
/// keeping a denied probe short.
pub const DEFAULT_TIMEOUT_MS: u64 = 2000;
/// Most probes in flight at once: 16 threads finish the 72 example probes, about half of
/// them denied (each waiting out its timeout), in a few seconds.
pub const MAX_PARALLEL: usize = 16;
/// What a probe sends to the echo server, and expects back.
const PAYLOAD: &[u8] = b"tierproxy-lab probe\n";
/// Longest greeting line read, in bytes (an IPv6 address and a port fit easily).
const MAX_GREETING: usize = 128;
/// How often an SCTP probe sends its INIT again while it waits: RFC 9260's initial RTO
/// (§15: RTO.Initial 1 s), as a TCP probe relies on the kernel resending its SYN after 1 s.
const INIT_RESEND: Duration = Duration::from_secs(1);
/// Receive buffer of an SCTP probe's raw socket, in bytes: the largest IP packet.
const RAW_BUFFER: usize = 65_535;

/// What happened on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Observed {
    /// Connected and the echo server answered.
    Allow,
    /// No answer within the timeout: the connection was silently dropped.
    Deny,
    /// Refused at once: a TCP RST to the connect (`ECONNREFUSED`), an ICMP error to the
    /// UDP datagram (port unreachable, administratively prohibited: `ECONNREFUSED`,
    /// `EHOSTUNREACH`, `EACCES`), an ABORT or an ICMP error to the SCTP INIT. What an
    /// Antrea `Reject` rule gives (issue #22); where `explain` says allow or deny, the bug
    /// it is. (The lab reports a refusal by a port it does not serve as an error.)
    Reject,
    /// Anything else (reset after connecting, unreachable, a broken echo): never a valid
    /// outcome of policy, which drops or refuses before any handshake.
    Error,
    /// Not tried. Nothing produces it since SCTP is probed too (issue #5); kept for
    /// reports of a protocol the lab cannot probe.
    Untested,
}

impl Observed {
    /// `allow`, `deny`, `reject`, `error` or `untested`.
    pub fn as_str(self) -> &'static str {
        match self {
            Observed::Allow => "allow",
            Observed::Deny => "deny",
            Observed::Reject => "reject",
            Observed::Error => "error",
            Observed::Untested => "untested",
        }
    }
}

/// The result of one probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observation {
    /// The outcome.
    pub observed: Observed,
    /// For people: `connected`, `timeout`, `refused` (TCP RST, SCTP ABORT, ICMP port or
    /// protocol unreachable), `prohibited` (ICMP administratively prohibited), `reset`, or
    /// what went wrong.
    pub detail: String,
    /// The client address the server saw (from its greeting), when it answered.
    pub seen_source: Option<SocketAddr>,
}

impl Observation {
    fn new(observed: Observed, detail: impl Into<String>) -> Self {
        Observation { observed, detail: detail.into(), seen_source: None }
    }
}

/// One probe to make: from namespace `netns` (None: no namespace of the lab holds the
/// source address, reported as an error with `why`).
#[derive(Debug, Clone)]
pub struct Job {
    /// The namespace holding `flow.src`.
    pub netns: Result<String, String>,
    /// Source, destination, protocol and port.
    pub flow: Flow,
}

fn error_word(e: &std::io::Error) -> String {
    match e.kind() {
        ErrorKind::ConnectionRefused => "refused".into(),
        ErrorKind::ConnectionReset => "reset".into(),
        ErrorKind::HostUnreachable | ErrorKind::NetworkUnreachable => format!("unreachable ({e})"),
        _ => e.to_string(),
    }
}

/// The observation of a datagram's ICMP error, as a connected socket reports it: a
/// refusal ([`Observed::Reject`]) for port or protocol unreachable (`ECONNREFUSED`,
/// `ENOPROTOOPT`, `EPROTO`) and administratively prohibited (IPv4 codes 9, 10, 13:
/// `ENETUNREACH`/`EHOSTUNREACH`; ICMPv6 code 1: `EACCES`; Linux `icmp_err_convert`,
/// `icmpv6_err_convert`); `None` for any other error.
fn icmp_refusal(e: &std::io::Error) -> Option<Observation> {
    use nix::errno::Errno;
    let detail = match Errno::from_raw(e.raw_os_error()?) {
        Errno::ECONNREFUSED | Errno::ENOPROTOOPT | Errno::EPROTO => "refused",
        Errno::EHOSTUNREACH | Errno::ENETUNREACH | Errno::EACCES => "prohibited",
        _ => return None,
    };
    Some(Observation::new(Observed::Reject, format!("{detail} ({e})")))
}

fn timed_out(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock)
}

/// Reads until a newline (or [`MAX_GREETING`] bytes); returns the line without it.
fn read_line(stream: &mut TcpStream) -> std::io::Result<String> {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.len() < MAX_GREETING {
        match stream.read(&mut byte)? {
            0 => return Err(std::io::Error::new(ErrorKind::UnexpectedEof, "closed")),
            _ if byte[0] == b'\n' => return Ok(String::from_utf8_lossy(&line).into_owned()),
            _ => line.push(byte[0]),
        }
    }
    Err(std::io::Error::new(ErrorKind::InvalidData, "greeting line too long"))
}

/// A TCP probe in the calling thread's namespace: bind `src`, connect to `dst` within
/// `timeout`, read the greeting, send a payload, half-close, expect the payload back and
/// the server's half-close.
pub fn probe_tcp(src: IpAddr, dst: SocketAddr, timeout: Duration) -> Observation {
    probe_stream(src, dst, timeout, None)
}

/// [`probe_tcp`] on a `SOCK_STREAM` socket of `protocol` (None: TCP; SCTP: a one-to-one
/// SCTP socket, which gets no half-close: SCTP has none, it only reads the echo back).
fn probe_stream(
    src: IpAddr,
    dst: SocketAddr,
    timeout: Duration,
    protocol: Option<socket2::Protocol>,
) -> Observation {
    let half_close = protocol.is_none();
    let socket = match Socket::new(Domain::for_address(dst), Type::STREAM, protocol) {
        Ok(s) => s,
        Err(e) => return Observation::new(Observed::Error, format!("socket: {e}")),
    };
    if let Err(e) = socket.bind(&SocketAddr::new(src, 0).into()) {
        return Observation::new(Observed::Error, format!("cannot bind source {src}: {e}"));
    }
    if let Err(e) = socket.connect_timeout(&dst.into(), timeout) {
        return if timed_out(&e) {
            Observation::new(Observed::Deny, "timeout")
        } else if e.kind() == ErrorKind::ConnectionRefused {
            // A RST to the SYN (an SCTP socket: an ABORT to the INIT).
            Observation::new(Observed::Reject, "refused")
        } else {
            Observation::new(Observed::Error, error_word(&e))
        };
    }
    let mut stream: TcpStream = socket.into();
    let _ = stream.set_read_timeout(Some(timeout));
    let _ = stream.set_write_timeout(Some(timeout));
    let ms = timeout.as_millis();
    let seen = match read_line(&mut stream) {
        Ok(line) => match parse_greeting(&line) {
            Some(a) => a,
            None => {
                return Observation::new(Observed::Error, format!("not a lab greeting: {line:?}"));
            }
        },
        Err(e) if timed_out(&e) => {
            return Observation::new(Observed::Error, format!("connected, no greeting in {ms} ms"));
        }
        Err(e) if e.kind() == ErrorKind::UnexpectedEof => {
            return Observation::new(Observed::Error, "connected, closed before the greeting");
        }
        Err(e) => {
            return Observation::new(
                Observed::Error,
                format!("connected, then {}", error_word(&e)),
            );
        }
    };
    let obs = |observed, detail: String| Observation { observed, detail, seen_source: Some(seen) };
    let sent = stream
        .write_all(PAYLOAD)
        .and_then(|()| if half_close { stream.shutdown(Shutdown::Write) } else { Ok(()) });
    if let Err(e) = sent {
        return obs(Observed::Error, format!("greeted, send failed: {}", error_word(&e)));
    }
    let mut echo = Vec::new();
    // With a half-close, read to the server's (one byte more shows a longer echo).
    let limit = PAYLOAD.len() as u64 + u64::from(half_close);
    match (&mut stream).take(limit).read_to_end(&mut echo) {
        Ok(_) if echo == PAYLOAD => obs(Observed::Allow, format!("connected; server saw {seen}")),
        Ok(_) => {
            obs(Observed::Error, format!("echo differs: {:?}", String::from_utf8_lossy(&echo)))
        }
        Err(e) if timed_out(&e) => {
            obs(Observed::Error, format!("greeted, no echo and half-close in {ms} ms"))
        }
        Err(e) => obs(Observed::Error, format!("greeted, then {}", error_word(&e))),
    }
}

/// A UDP probe in the calling thread's namespace: one datagram from `src` to `dst`; the
/// answer must be the greeting plus the payload. A connected socket, so an ICMP error
/// shows: port unreachable as `refused`, administratively prohibited as `prohibited`, both
/// [`Observed::Reject`].
pub fn probe_udp(src: IpAddr, dst: SocketAddr, timeout: Duration) -> Observation {
    let socket = match UdpSocket::bind(SocketAddr::new(src, 0)) {
        Ok(s) => s,
        Err(e) => {
            return Observation::new(Observed::Error, format!("cannot bind source {src}: {e}"));
        }
    };
    let sent = socket
        .connect(dst)
        .and_then(|()| socket.set_read_timeout(Some(timeout)))
        .and_then(|()| socket.send(PAYLOAD));
    if let Err(e) = sent {
        return Observation::new(Observed::Error, error_word(&e));
    }
    let mut buf = [0u8; 512];
    match socket.recv(&mut buf) {
        Ok(n) => {
            let text = String::from_utf8_lossy(&buf[..n]);
            let parsed = text
                .split_once('\n')
                .and_then(|(line, rest)| Some((parse_greeting(line)?, rest.as_bytes() == PAYLOAD)));
            match parsed {
                Some((seen, true)) => Observation {
                    observed: Observed::Allow,
                    detail: format!("answered; server saw {seen}"),
                    seen_source: Some(seen),
                },
                _ => Observation::new(Observed::Error, format!("not a lab answer: {text:?}")),
            }
        }
        Err(e) if timed_out(&e) => Observation::new(Observed::Deny, "timeout"),
        Err(e) => {
            icmp_refusal(&e).unwrap_or_else(|| Observation::new(Observed::Error, error_word(&e)))
        }
    }
}

/// An SCTP probe in the calling thread's namespace: with kernel SCTP sockets as
/// [`probe_tcp`] does (greeting, echo; no half-close), else [`probe_sctp_raw`].
pub fn probe_sctp(src: IpAddr, dst: SocketAddr, timeout: Duration) -> Observation {
    if sctp::kernel_has_sctp() {
        probe_stream(src, dst, timeout, Some(socket2::Protocol::from(IPPROTO_SCTP)))
    } else {
        probe_sctp_raw(src, dst, timeout)
    }
}

/// An SCTP probe on a raw IP socket (protocol 132) in the calling thread's namespace,
/// bound to `src` and connected to `dst`'s address (the kernel then passes up only packets
/// from it, and reports ICMP errors about it). Sends an INIT from a random source port
/// with a random initiate tag, again every second (`INIT_RESEND`), and waits up to
/// `timeout` for the answer from `dst` to that port carrying that tag (other SCTP packets
/// the socket sees are skipped):
/// - an INIT ACK whose State Cookie is the lab's greeting: `allow`, with `seen_source`;
/// - an ABORT (nothing serves the port, or a Reject rule), ICMP protocol or port
///   unreachable (nothing serves SCTP at that address), ICMP administratively
///   prohibited: `reject` (`refused`, `prohibited`);
/// - nothing: `deny`, `timeout`.
pub fn probe_sctp_raw(src: IpAddr, dst: SocketAddr, timeout: Duration) -> Observation {
    let socket = match sctp::raw_socket(src) {
        Ok(s) => s,
        Err(e) => {
            return Observation::new(
                Observed::Error,
                format!("raw SCTP socket bound to {src}: {e}"),
            );
        }
    };
    if let Err(e) = socket.connect(&SocketAddr::new(dst.ip(), 0).into()) {
        return Observation::new(Observed::Error, error_word(&e));
    }
    let (port, tag) = match sctp::random_port().and_then(|p| Ok((p, sctp::random_tag()?))) {
        Ok(pt) => pt,
        Err(e) => return Observation::new(Observed::Error, format!("random source: {e}")),
    };
    let init = Packet::init(port, dst.port(), tag).to_bytes();
    let deadline = Instant::now() + timeout;
    let mut next_send = Instant::now();
    let mut buf = vec![0u8; RAW_BUFFER];
    loop {
        let now = Instant::now();
        if now >= deadline {
            return Observation::new(Observed::Deny, "timeout");
        }
        if now >= next_send {
            if let Err(e) = socket.send(&init) {
                return sctp_error(&e);
            }
            next_send = now + INIT_RESEND;
        }
        let wait = deadline.min(next_send).saturating_duration_since(now);
        if let Err(e) = socket.set_read_timeout(Some(wait.max(Duration::from_millis(1)))) {
            return Observation::new(Observed::Error, format!("socket: {e}"));
        }
        let packet = match sctp::recv(&socket, &mut buf) {
            Ok(Some((from, p)))
                if from == dst.ip()
                    && p.src_port == dst.port()
                    && p.dst_port == port
                    && p.verification_tag == tag =>
            {
                p
            }
            Ok(_) => continue,
            Err(e) if timed_out(&e) => continue,
            Err(e) => return sctp_error(&e),
        };
        return match packet.chunk {
            Chunk::InitAck { cookie, .. } => {
                let text = String::from_utf8_lossy(&cookie);
                match parse_greeting(&text) {
                    Some(seen) => Observation {
                        observed: Observed::Allow,
                        detail: format!("answered (INIT ACK); server saw {seen}"),
                        seen_source: Some(seen),
                    },
                    None => Observation::new(
                        Observed::Error,
                        format!("INIT ACK without a lab greeting: {text:?}"),
                    ),
                }
            }
            Chunk::Abort { .. } => Observation::new(Observed::Reject, "refused"),
            other => Observation::new(Observed::Error, format!("unexpected answer {other:?}")),
        };
    }
}

/// The observation of an error on a raw SCTP socket: an ICMP error about the INIT
/// ([`icmp_refusal`]: protocol unreachable, IPv4 ENOPROTOOPT, or unknown next header,
/// IPv6 EPROTO, means no SCTP endpoint at the address, which an SCTP stack would answer
/// with an ABORT: `refused`, as TCP's reset), else an error.
fn sctp_error(e: &std::io::Error) -> Observation {
    icmp_refusal(e).unwrap_or_else(|| Observation::new(Observed::Error, error_word(e)))
}

/// Makes one probe in the calling thread, which is first moved into the job's namespace.
pub fn observe(job: &Job, timeout: Duration) -> Observation {
    let ns = match &job.netns {
        Ok(ns) => ns,
        Err(why) => return Observation::new(Observed::Error, why.clone()),
    };
    if let Err(e) = netns::enter(ns) {
        return Observation::new(Observed::Error, crate::error::chain(&e));
    }
    let dst = SocketAddr::new(job.flow.dst, job.flow.dst_port);
    match job.flow.protocol {
        Protocol::Tcp => probe_tcp(job.flow.src, dst, timeout),
        Protocol::Udp => probe_udp(job.flow.src, dst, timeout),
        Protocol::Sctp => probe_sctp(job.flow.src, dst, timeout),
    }
}

/// Makes every probe, at most [`MAX_PARALLEL`] at once, on threads that enter the probes'
/// namespaces (the calling thread never changes namespace). Probes not started when
/// `stop` is set are reported as errors (`interrupted`). Results are in `jobs` order.
pub fn run_all(jobs: &[Job], timeout: Duration, stop: &AtomicBool) -> Vec<Observation> {
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Observation>>> = Mutex::new(vec![None; jobs.len()]);
    std::thread::scope(|s| {
        for _ in 0..MAX_PARALLEL.min(jobs.len()) {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(job) = jobs.get(i) else { break };
                    let o = if stop.load(Ordering::Relaxed) {
                        Observation::new(Observed::Error, "interrupted")
                    } else {
                        observe(job, timeout)
                    };
                    if let Ok(mut r) = results.lock() {
                        r[i] = Some(o);
                    }
                }
            });
        }
    });
    results
        .into_inner()
        .unwrap_or_default()
        .into_iter()
        .map(|o| o.unwrap_or_else(|| Observation::new(Observed::Error, "not run")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, UdpSocket};

    const T: Duration = Duration::from_secs(5);

    fn localhost() -> IpAddr {
        "127.0.0.1".parse().unwrap()
    }

    #[test]
    fn tcp_probe_reports_allow_with_the_source_the_server_saw() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || super::super::serve::serve_tcp(l));
        let o = probe_tcp(localhost(), addr, T);
        assert_eq!(o.observed, Observed::Allow, "{o:?}");
        assert_eq!(o.seen_source.map(|a| a.ip()), Some(localhost()));
        assert!(o.detail.starts_with("connected; server saw 127.0.0.1:"), "{}", o.detail);
    }

    #[test]
    fn tcp_probe_to_a_closed_port_is_refused_a_reject_not_a_deny() {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let o = probe_tcp(localhost(), SocketAddr::new(localhost(), port), T);
        assert_eq!((o.observed, o.detail.as_str()), (Observed::Reject, "refused"));
    }

    #[test]
    fn udp_probe_to_a_closed_port_is_refused_a_reject() {
        let port = UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let o = probe_udp(localhost(), SocketAddr::new(localhost(), port), T);
        assert_eq!(o.observed, Observed::Reject, "{o:?}");
        assert!(o.detail.starts_with("refused ("), "{}", o.detail);
    }

    #[test]
    fn icmp_errors_are_refusals_by_their_errno() {
        use nix::errno::Errno;
        let of = |errno: Errno| {
            icmp_refusal(&std::io::Error::from_raw_os_error(errno as i32))
                .map(|o| (o.observed, o.detail.split(' ').next().unwrap().to_string()))
        };
        for (errno, word) in [
            (Errno::ECONNREFUSED, "refused"),
            (Errno::ENOPROTOOPT, "refused"),
            (Errno::EPROTO, "refused"),
            (Errno::EHOSTUNREACH, "prohibited"),
            (Errno::EACCES, "prohibited"),
        ] {
            assert_eq!(of(errno), Some((Observed::Reject, word.to_string())), "{errno}");
        }
        assert_eq!(of(Errno::EMSGSIZE), None);
    }

    #[test]
    fn tcp_probe_rejects_a_server_that_is_not_the_lab_echo() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.write_all(b"SSH-2.0-OpenSSH\n").unwrap();
        });
        let o = probe_tcp(localhost(), addr, T);
        assert_eq!(o.observed, Observed::Error, "{o:?}");
        assert!(o.detail.contains("not a lab greeting"), "{}", o.detail);
    }

    #[test]
    fn udp_probe_allows_on_answer_and_denies_on_silence() {
        let s = UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = s.local_addr().unwrap();
        std::thread::spawn(move || super::super::serve::serve_udp(s));
        let o = probe_udp(localhost(), addr, T);
        assert_eq!(o.observed, Observed::Allow, "{o:?}");
        // A bound socket that never answers: the probe times out (a deny).
        let silent = UdpSocket::bind("127.0.0.1:0").unwrap();
        let o = probe_udp(localhost(), silent.local_addr().unwrap(), Duration::from_millis(200));
        assert_eq!((o.observed, o.detail.as_str()), (Observed::Deny, "timeout"));
    }

    #[test]
    fn jobs_without_a_namespace_are_reported_not_run() {
        let flow =
            Flow { src: localhost(), dst: localhost(), protocol: Protocol::Sctp, dst_port: 1 };
        let jobs = [Job { netns: Err("no namespace holds 10.9.9.9".into()), flow }];
        let o = run_all(&jobs, T, &AtomicBool::new(false));
        assert_eq!(
            (o[0].observed, o[0].detail.as_str()),
            (Observed::Error, "no namespace holds 10.9.9.9")
        );
        let stopped = run_all(&jobs, T, &AtomicBool::new(true));
        assert_eq!(stopped[0].detail, "interrupted");
    }

    /// Whether this process may open raw sockets (CAP_NET_RAW); prints the skip line, or
    /// panics when network tests are required (`TIERPROXY_REQUIRE_NETNS=1`, as in CI).
    fn raw_sockets(test: &str) -> bool {
        crate::testing::capable(test, "CAP_NET_RAW", sctp::raw_socket(localhost()))
    }

    /// A raw SCTP server on loopback address `ip` (each test its own: every raw socket
    /// bound to an address sees every SCTP packet sent to it) serving `ports`.
    fn sctp_server(ip: &str, ports: &'static [u16]) -> IpAddr {
        let ip: IpAddr = ip.parse().unwrap();
        let s = sctp::raw_socket(ip).unwrap();
        std::thread::spawn(move || super::super::serve::serve_sctp_raw(s, ports));
        ip
    }

    #[test]
    fn sctp_probe_is_answered_by_the_raw_server_with_the_source_it_saw() {
        if !raw_sockets("sctp_probe_is_answered_by_the_raw_server_with_the_source_it_saw") {
            return;
        }
        let server = sctp_server("127.0.0.11", &[38412]);
        let o = probe_sctp_raw(localhost(), SocketAddr::new(server, 38412), T);
        assert_eq!(o.observed, Observed::Allow, "{o:?}");
        let seen = o.seen_source.unwrap();
        assert_eq!(seen.ip(), localhost());
        assert!(seen.port() >= 49_152, "a dynamic source port: {seen}");
        assert_eq!(o.detail, format!("answered (INIT ACK); server saw {seen}"));
        // Another port on the same address: the server aborts, the probe is refused.
        let o = probe_sctp_raw(localhost(), SocketAddr::new(server, 38413), T);
        assert_eq!((o.observed, o.detail.as_str()), (Observed::Reject, "refused"), "{o:?}");
    }

    #[test]
    fn sctp_probe_over_ipv6_loopback() {
        if !raw_sockets("sctp_probe_over_ipv6_loopback") {
            return;
        }
        // ::1 is the only IPv6 loopback address: this test alone uses it.
        let server = sctp_server("::1", &[9899]);
        let o = probe_sctp_raw(server, SocketAddr::new(server, 9899), T);
        assert_eq!(o.observed, Observed::Allow, "{o:?}");
        assert_eq!(o.seen_source.map(|a| a.ip()), Some(server));
        let o = probe_sctp_raw(server, SocketAddr::new(server, 9898), T);
        assert_eq!((o.observed, o.detail.as_str()), (Observed::Reject, "refused"), "{o:?}");
    }

    #[test]
    fn sctp_probe_denies_on_silence_and_is_refused_where_nothing_takes_sctp() {
        if !raw_sockets("sctp_probe_denies_on_silence_and_is_refused_where_nothing_takes_sctp") {
            return;
        }
        // A raw socket that takes the INIT and never answers (as a policy drop looks):
        // the probe waits out its timeout, resending once.
        let silent = sctp::raw_socket("127.0.0.12".parse().unwrap()).unwrap();
        let start = Instant::now();
        let o = probe_sctp_raw(
            localhost(),
            "127.0.0.12:38412".parse().unwrap(),
            Duration::from_millis(1300),
        );
        assert_eq!((o.observed, o.detail.as_str()), (Observed::Deny, "timeout"), "{o:?}");
        assert!(start.elapsed() < Duration::from_secs(3), "{:?}", start.elapsed());
        let mut buf = vec![0u8; RAW_BUFFER];
        silent.set_read_timeout(Some(T)).unwrap();
        let mut inits = Vec::new();
        while let Ok(Some((from, p))) = sctp::recv(&silent, &mut buf) {
            inits.push((from, p));
            if inits.len() == 2 {
                break;
            }
        }
        assert_eq!(inits.len(), 2, "the INIT and its resend after 1 s");
        let (from, p) = &inits[0];
        assert_eq!((*from, p.dst_port, p.verification_tag), (localhost(), 38412, 0));
        assert!(matches!(p.chunk, Chunk::Init(f) if f.initiate_tag != 0), "{p:?}");
        assert_eq!(inits[0].1, inits[1].1, "the resend is the same INIT");
        // No raw socket at all on 127.0.0.13: the kernel answers ICMP protocol unreachable.
        let o = probe_sctp_raw(localhost(), "127.0.0.13:38412".parse().unwrap(), T);
        assert_eq!(o.observed, Observed::Reject, "{o:?}");
        assert!(o.detail.starts_with("refused ("), "{o:?}");
    }
}
