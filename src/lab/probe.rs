//! Real connections for probes: from inside a namespace, bound to the probe's source
//! address, with a timeout. No process per probe: worker threads enter the namespace with
//! `setns(CLONE_NEWNET)` and open their sockets there.

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpStream, UdpSocket};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use serde::Serialize;
use socket2::{Domain, Socket, Type};

use super::netns;
use super::serve::parse_greeting;
use crate::policy::{Flow, Protocol};

/// Default time a probe waits for a connection (and then for each read), in milliseconds:
/// a dropped SYN is retransmitted after 1 s, so 2 s lets one retransmission through while
/// keeping a denied probe short.
pub const DEFAULT_TIMEOUT_MS: u64 = 2000;
/// Most probes in flight at once: 16 threads finish the 68 example probes, about half of
/// them denied (each waiting out its timeout), in a few seconds.
pub const MAX_PARALLEL: usize = 16;
/// What a probe sends to the echo server, and expects back.
const PAYLOAD: &[u8] = b"tierproxy-lab probe\n";
/// Longest greeting line read, in bytes (an IPv6 address and a port fit easily).
const MAX_GREETING: usize = 128;

/// What happened on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Observed {
    /// Connected and the echo server answered.
    Allow,
    /// No answer within the timeout: the connection was silently dropped.
    Deny,
    /// Anything else (refused, reset, unreachable, a broken echo): never a valid outcome
    /// of policy, which denies by dropping.
    Error,
    /// Not tried (SCTP: the lab has no SCTP server).
    Untested,
}

impl Observed {
    /// `allow`, `deny`, `error` or `untested`.
    pub fn as_str(self) -> &'static str {
        match self {
            Observed::Allow => "allow",
            Observed::Deny => "deny",
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
    /// For people: `connected`, `timeout`, `refused`, `reset`, or what went wrong.
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
    let socket = match Socket::new(Domain::for_address(dst), Type::STREAM, None) {
        Ok(s) => s,
        Err(e) => return Observation::new(Observed::Error, format!("socket: {e}")),
    };
    if let Err(e) = socket.bind(&SocketAddr::new(src, 0).into()) {
        return Observation::new(Observed::Error, format!("cannot bind source {src}: {e}"));
    }
    if let Err(e) = socket.connect_timeout(&dst.into(), timeout) {
        return if timed_out(&e) {
            Observation::new(Observed::Deny, "timeout")
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
    if let Err(e) = stream.write_all(PAYLOAD).and_then(|()| stream.shutdown(Shutdown::Write)) {
        return obs(Observed::Error, format!("greeted, send failed: {}", error_word(&e)));
    }
    let mut echo = Vec::new();
    match (&mut stream).take(PAYLOAD.len() as u64 + 1).read_to_end(&mut echo) {
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
/// answer must be the greeting plus the payload. A connected socket, so an ICMP port
/// unreachable shows as `refused`.
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
        Err(e) => Observation::new(Observed::Error, error_word(&e)),
    }
}

/// Whether this kernel can open SCTP sockets (these machines' cannot: CONFIG_IP_SCTP unset).
fn kernel_has_sctp() -> bool {
    Socket::new(Domain::IPV4, Type::STREAM, Some(socket2::Protocol::from(132))).is_ok()
}

/// Makes one probe in the calling thread, which is first moved into the job's namespace.
pub fn observe(job: &Job, timeout: Duration) -> Observation {
    let ns = match &job.netns {
        Ok(ns) => ns,
        Err(why) => return Observation::new(Observed::Error, why.clone()),
    };
    if job.flow.protocol == Protocol::Sctp {
        let why = if kernel_has_sctp() {
            "the lab has no SCTP server yet"
        } else {
            "this kernel has no SCTP sockets"
        };
        return Observation::new(Observed::Untested, why);
    }
    if let Err(e) = netns::enter(ns) {
        return Observation::new(Observed::Error, crate::explain::error_chain(&e));
    }
    let dst = SocketAddr::new(job.flow.dst, job.flow.dst_port);
    match job.flow.protocol {
        Protocol::Tcp => probe_tcp(job.flow.src, dst, timeout),
        Protocol::Udp | Protocol::Sctp => probe_udp(job.flow.src, dst, timeout),
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
    fn tcp_probe_to_a_closed_port_is_refused_an_error_not_a_deny() {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let o = probe_tcp(localhost(), SocketAddr::new(localhost(), port), T);
        assert_eq!((o.observed, o.detail.as_str()), (Observed::Error, "refused"));
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
    fn jobs_without_a_namespace_and_sctp_jobs_are_reported_not_run() {
        let flow = |protocol| Flow { src: localhost(), dst: localhost(), protocol, dst_port: 1 };
        let jobs = [
            Job { netns: Err("no namespace holds 10.9.9.9".into()), flow: flow(Protocol::Tcp) },
            Job { netns: Ok("unused".into()), flow: flow(Protocol::Sctp) },
        ];
        let o = run_all(&jobs, T, &AtomicBool::new(false));
        assert_eq!(
            (o[0].observed, o[0].detail.as_str()),
            (Observed::Error, "no namespace holds 10.9.9.9")
        );
        assert_eq!(o[1].observed, Observed::Untested);
        let stopped = run_all(&jobs[..1], T, &AtomicBool::new(true));
        assert_eq!(stopped[0].detail, "interrupted");
    }
}
