//! The lab's echo servers (`tierproxy lab serve`, run inside a namespace by `lab up`).
//!
//! Protocol, so a client learns what the server saw:
//! - TCP: on accept the server writes one line `tierproxy-lab <peer-ip> <peer-port>\n`, then
//!   echoes everything it reads until EOF, then shuts down its write side (so a half-close
//!   is visible end to end) and closes.
//! - TCP, close-first ports (`--tcp-close-first`; a Pod `containerPort` named
//!   [`super::plan::CLOSE_FIRST_PORT_NAME`]): the server closes first, as an HTTP/1.0 server
//!   answering `Connection: close` does. On accept it writes the greeting, makes one read
//!   of up to [`BUFFER`] bytes (the request), echoes it, and shuts down its write side: its
//!   FIN leaves before the client's. It then reads and discards until the client's EOF (or
//!   [`CLOSE_FIRST_LINGER`]) before it closes the socket: a socket closed with unread bytes
//!   sends an RST instead of a FIN (RFC 9293 §3.6, "Reset generation"; Linux
//!   `tcp_close`), so a late byte must be read, not left. See [`close_first`].
//! - UDP: every datagram is answered with the same line followed by the datagram's payload.
//! - SCTP, where the kernel has no SCTP sockets (these machines: CONFIG_IP_SCTP unset): one
//!   raw IP socket (protocol 132) per bound address receives every SCTP packet sent to
//!   that address. An INIT to a served port is answered with an INIT ACK whose State Cookie
//!   is the greeting line (see [`super::sctp`]); an INIT to another port with an ABORT,
//!   as an SCTP stack answers an INIT nobody listens for (the client reports `refused`).
//!   Nothing else is answered, and no association is set up.
//! - SCTP where the kernel has SCTP sockets: one-to-one (`SOCK_STREAM`) SCTP sockets that
//!   behave as the TCP server does (greeting, then echo). Untested: no machine of this
//!   project has an SCTP kernel.

use std::io::{Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use socket2::{Domain, Socket, Type};

use super::LabError;
use super::sctp::{self, IPPROTO_SCTP};

/// First word of the greeting line.
pub const GREETING_WORD: &str = "tierproxy-lab";
/// Most TCP connections one server process handles at once (one thread each). Far above
/// what probes need; it keeps a runaway load test from exhausting threads. Connections over
/// it are closed at once, and the first such event is logged.
pub const MAX_CONNECTIONS: usize = 4096;
/// Read buffer per TCP connection and UDP socket, in bytes (64 KiB: copies at this size
/// run near memory bandwidth, see DESIGN §7).
const BUFFER: usize = 64 << 10;
/// How long a close-first connection waits, after its FIN, for the client's EOF before it
/// closes anyway: a client that sent its request closes at once on the server's FIN, so
/// this only bounds how long a stuck client holds a thread.
pub const CLOSE_FIRST_LINGER: Duration = Duration::from_secs(10);
/// Stack of a connection thread: it only holds a heap buffer and a few frames.
const CONNECTION_STACK: usize = 128 << 10;
/// Receive buffer of a raw SCTP socket, in bytes: the largest IP packet.
const RAW_BUFFER: usize = 65_535;
/// Pause after a failed receive on a raw socket, so a persistent error cannot spin a core.
const RAW_ERROR_PAUSE: Duration = Duration::from_millis(100);
/// Listen backlog of a kernel SCTP socket (as for TCP: far above what probes need).
const SCTP_BACKLOG: i32 = 1024;

/// The greeting line for a client seen as `peer`, newline included.
pub fn greeting(peer: SocketAddr) -> String {
    format!("{GREETING_WORD} {} {}\n", peer.ip(), peer.port())
}

/// Parses a greeting line (with or without its newline) back into the peer address.
pub fn parse_greeting(line: &str) -> Option<SocketAddr> {
    let mut words = line.trim_end_matches('\n').split(' ');
    if words.next()? != GREETING_WORD {
        return None;
    }
    let ip: IpAddr = words.next()?.parse().ok()?;
    let port: u16 = words.next()?.parse().ok()?;
    words.next().is_none().then_some(SocketAddr::new(ip, port))
}

/// Serves one TCP connection: greeting, echo until EOF, half-close.
fn echo(mut stream: TcpStream) {
    let Ok(peer) = stream.peer_addr() else { return };
    if stream.write_all(greeting(peer).as_bytes()).is_err() {
        return;
    }
    let mut buf = vec![0u8; BUFFER];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if stream.write_all(&buf[..n]).is_err() {
                    return;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
    let _ = stream.shutdown(Shutdown::Write);
}

/// Serves one TCP connection whose server closes first: greeting, one read (the request)
/// echoed, FIN, then reads until the client's EOF (at most [`CLOSE_FIRST_LINGER`]) so the
/// close sends no RST.
///
/// One read is the whole request for `tierproxy loadgen --server-closes`: its request
/// (64 bytes by default, at most a few KiB) is one `write` on a `TCP_NODELAY` socket after
/// the greeting was read, so it leaves as one segment, below any MSS, and every proxy on
/// the lab's paths reads and forwards it whole (with buffers of 64 KiB and more). Were it
/// ever split, loadgen would see the EOF before the whole echo and report an error, never
/// a wrong figure.
fn close_first(mut stream: TcpStream) {
    let Ok(peer) = stream.peer_addr() else { return };
    if stream.write_all(greeting(peer).as_bytes()).is_err() {
        return;
    }
    let mut buf = vec![0u8; BUFFER];
    let n = loop {
        match stream.read(&mut buf) {
            Ok(n) => break n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    };
    if n > 0 && stream.write_all(&buf[..n]).is_err() {
        return;
    }
    if stream.shutdown(Shutdown::Write).is_err() || n == 0 {
        return;
    }
    // Drain, so that close(2) finds nothing unread and sends no RST.
    let _ = stream.set_read_timeout(Some(CLOSE_FIRST_LINGER));
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

/// How a TCP port serves its connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TcpStyle {
    /// Greeting, echo until the client's EOF, then the server's FIN ([`echo`]).
    Echo,
    /// Greeting, one request echoed, the server's FIN first ([`close_first`]).
    CloseFirst,
}

/// Accepts connections on `listener` forever, one thread per connection, at most
/// [`MAX_CONNECTIONS`] at once, each served the plain echo way.
pub fn serve_tcp(listener: TcpListener) {
    serve_tcp_as(listener, TcpStyle::Echo);
}

/// Accepts connections on `listener` forever, one thread per connection, at most
/// [`MAX_CONNECTIONS`] at once, each served as `style` says.
pub fn serve_tcp_as(listener: TcpListener, style: TcpStyle) {
    let live = Arc::new(AtomicUsize::new(0));
    let warned = AtomicBool::new(false);
    let local = listener.local_addr().map(|a| a.to_string()).unwrap_or_default();
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        if live.load(Ordering::Relaxed) >= MAX_CONNECTIONS {
            if !warned.swap(true, Ordering::Relaxed) {
                eprintln!("{local}: {MAX_CONNECTIONS} connections open; closing new ones");
            }
            continue;
        }
        live.fetch_add(1, Ordering::Relaxed);
        let guard = Live(Arc::clone(&live));
        let spawned = std::thread::Builder::new().stack_size(CONNECTION_STACK).spawn(move || {
            let _guard = guard;
            match style {
                TcpStyle::Echo => echo(stream),
                TcpStyle::CloseFirst => close_first(stream),
            }
        });
        if let Err(e) = spawned {
            eprintln!("{local}: cannot start a connection thread: {e}");
        }
    }
}

/// Decrements the live-connection count when a connection thread ends (or never starts).
struct Live(Arc<AtomicUsize>);

impl Drop for Live {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Answers every datagram on `socket` with the greeting line plus its payload, forever.
pub fn serve_udp(socket: UdpSocket) {
    let mut buf = vec![0u8; BUFFER];
    loop {
        let Ok((n, peer)) = socket.recv_from(&mut buf) else { continue };
        let mut reply = greeting(peer).into_bytes();
        // Largest UDP payload over IPv4; a longer echo would not fit one datagram.
        let room = 65_507usize.saturating_sub(reply.len());
        reply.extend_from_slice(&buf[..n.min(room)]);
        let _ = socket.send_to(&reply, peer);
    }
}

/// Answers SCTP INITs arriving on raw socket `socket` (bound to one address) forever: an
/// INIT to one of `ports` gets an INIT ACK carrying the greeting for the sender's address
/// and source port, an INIT to another port an ABORT. Everything else is ignored.
pub fn serve_sctp_raw(socket: Socket, ports: &[u16]) {
    let mut buf = vec![0u8; RAW_BUFFER];
    loop {
        let (from, packet) = match sctp::recv(&socket, &mut buf) {
            Ok(Some(received)) => received,
            Ok(None) => continue,
            Err(e) => {
                eprintln!("raw SCTP socket: {e}");
                std::thread::sleep(RAW_ERROR_PAUSE);
                continue;
            }
        };
        let reply = if ports.contains(&packet.dst_port) {
            let Ok(tag) = sctp::random_tag() else { continue };
            packet.init_ack(tag, greeting(SocketAddr::new(from, packet.src_port)).as_bytes())
        } else {
            packet.abort()
        };
        if let Some(reply) = reply {
            let _ = socket.send_to(&reply.to_bytes(), &SocketAddr::new(from, 0).into());
        }
    }
}

/// A listening one-to-one SCTP socket on `addr`, for kernels with SCTP sockets; served by
/// [`serve_tcp`] (the calls are the same).
fn sctp_listener(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = Socket::new(
        Domain::for_address(addr),
        Type::STREAM,
        Some(socket2::Protocol::from(IPPROTO_SCTP)),
    )?;
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(SCTP_BACKLOG)?;
    Ok(socket.into())
}

/// Binds every TCP (plain echo and close-first), UDP and SCTP port on every address,
/// writes `ready_file` (containing the pid) once all are bound, then serves forever. SCTP uses kernel SCTP sockets where
/// the kernel has them, else one raw socket per address ([`serve_sctp_raw`]).
///
/// # Errors
/// [`LabError::Bind`] naming the address and port (0 for a raw socket) that could not be
/// bound, [`LabError::State`] if the ready file cannot be written.
pub fn run(
    bind: &[IpAddr],
    tcp: &[u16],
    tcp_close_first: &[u16],
    udp: &[u16],
    sctp_ports: &[u16],
    ready_file: Option<&Path>,
) -> Result<(), LabError> {
    let mut tcp_listeners = Vec::new();
    let mut udp_sockets = Vec::new();
    let mut raw_sockets = Vec::new();
    let kernel_sctp = sctp::kernel_has_sctp();
    for ip in bind {
        let styled = tcp
            .iter()
            .map(|p| (p, TcpStyle::Echo))
            .chain(tcp_close_first.iter().map(|p| (p, TcpStyle::CloseFirst)));
        for (port, style) in styled {
            let addr = SocketAddr::new(*ip, *port);
            let l = TcpListener::bind(addr).map_err(|source| LabError::Bind {
                addr,
                protocol: "TCP",
                source,
            })?;
            tcp_listeners.push((l, style));
        }
        for port in udp {
            let addr = SocketAddr::new(*ip, *port);
            let s = UdpSocket::bind(addr).map_err(|source| LabError::Bind {
                addr,
                protocol: "UDP",
                source,
            })?;
            udp_sockets.push(s);
        }
        if kernel_sctp {
            for port in sctp_ports {
                let addr = SocketAddr::new(*ip, *port);
                let l = sctp_listener(addr).map_err(|source| LabError::Bind {
                    addr,
                    protocol: "SCTP",
                    source,
                })?;
                tcp_listeners.push((l, TcpStyle::Echo));
            }
        } else if !sctp_ports.is_empty() {
            let s = sctp::raw_socket(*ip).map_err(|source| LabError::Bind {
                addr: SocketAddr::new(*ip, 0),
                protocol: "raw IP protocol 132 (SCTP)",
                source,
            })?;
            raw_sockets.push(s);
        }
    }
    let how = if kernel_sctp { "SCTP sockets" } else { "raw sockets" };
    eprintln!(
        "serving TCP {tcp:?} TCP close-first {tcp_close_first:?} UDP {udp:?} SCTP {sctp_ports:?} \
         ({how}) on {bind:?}"
    );
    let mut threads = Vec::new();
    for (l, style) in tcp_listeners {
        threads.push(std::thread::spawn(move || serve_tcp_as(l, style)));
    }
    for s in udp_sockets {
        threads.push(std::thread::spawn(move || serve_udp(s)));
    }
    let sctp_ports: Arc<[u16]> = sctp_ports.into();
    for s in raw_sockets {
        let ports = Arc::clone(&sctp_ports);
        threads.push(std::thread::spawn(move || serve_sctp_raw(s, &ports)));
    }
    if let Some(path) = ready_file {
        std::fs::write(path, format!("{}\n", std::process::id()))
            .map_err(|source| LabError::State { path: path.to_path_buf(), source })?;
    }
    for t in threads {
        let _ = t.join();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn greeting_round_trips_for_both_families() {
        for a in ["10.0.0.1:4321", "[fd00::1]:80"] {
            let a: SocketAddr = a.parse().unwrap();
            assert_eq!(parse_greeting(&greeting(a)), Some(a));
        }
        assert_eq!(greeting("10.0.0.1:4321".parse().unwrap()), "tierproxy-lab 10.0.0.1 4321\n");
        for bad in [
            "",
            "hello 1.2.3.4 5",
            "tierproxy-lab 1.2.3.4",
            "tierproxy-lab x 1",
            "tierproxy-lab 1.2.3.4 5 6",
        ] {
            assert_eq!(parse_greeting(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn tcp_greets_echoes_and_half_closes() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || serve_tcp(l));
        let mut c = TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        c.write_all(b"ping").unwrap();
        c.shutdown(Shutdown::Write).unwrap();
        let mut all = String::new();
        c.read_to_string(&mut all).unwrap();
        let (line, rest) = all.split_once('\n').unwrap();
        assert_eq!(parse_greeting(line), Some(c.local_addr().unwrap()));
        assert_eq!(rest, "ping");
    }

    #[test]
    fn close_first_answers_one_request_then_closes_before_the_client() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || serve_tcp_as(l, TcpStyle::CloseFirst));
        let mut c = TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut r = std::io::BufReader::new(c.try_clone().unwrap());
        let mut line = String::new();
        std::io::BufRead::read_line(&mut r, &mut line).unwrap();
        assert_eq!(parse_greeting(&line), Some(c.local_addr().unwrap()));
        c.write_all(b"GET / HTTP/1.0").unwrap();
        // Without shutting down its own side, the client reads the echo and then EOF: the
        // server's FIN came first. A reset instead would fail read_to_end.
        let mut rest = Vec::new();
        r.read_to_end(&mut rest).unwrap();
        assert_eq!(rest, b"GET / HTTP/1.0");
        // The server drains what comes after its FIN: a late byte draws no RST, the
        // connection still ends with the client's close.
        c.write_all(b"late").unwrap();
        c.shutdown(Shutdown::Write).unwrap();
    }

    #[test]
    fn run_serves_echo_and_close_first_ports_each_their_way() {
        // Two free ports, released for run() to bind (a race with another binder only
        // fails the test, it cannot make it pass wrongly).
        let free = || TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let (plain, first) = (free(), free());
        let dir = tempfile::tempdir().unwrap();
        let ready = dir.path().join("ready");
        let r = ready.clone();
        std::thread::spawn(move || {
            let _ = run(&["127.0.0.1".parse().unwrap()], &[plain], &[first], &[], &[], Some(&r));
        });
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !ready.exists() {
            assert!(std::time::Instant::now() < deadline, "server not ready within 10 s");
            std::thread::sleep(Duration::from_millis(10));
        }
        let talk = |port: u16| {
            let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut r = std::io::BufReader::new(c.try_clone().unwrap());
            let mut line = String::new();
            std::io::BufRead::read_line(&mut r, &mut line).unwrap();
            c.write_all(b"x").unwrap();
            let mut one = [0u8; 1];
            r.read_exact(&mut one).unwrap();
            // A second request: the echo port answers it, the close-first port has sent
            // its FIN after the first.
            c.write_all(b"y").unwrap();
            r.read(&mut one).unwrap()
        };
        assert_eq!(talk(first), 0, "the close-first port closes after one request");
        assert_eq!(talk(plain), 1, "the echo port answers until the client's EOF");
    }

    #[test]
    fn udp_answers_with_greeting_and_payload() {
        let s = UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = s.local_addr().unwrap();
        std::thread::spawn(move || serve_udp(s));
        let c = UdpSocket::bind("127.0.0.1:0").unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        c.send_to(b"dns?", addr).unwrap();
        let mut buf = [0u8; 256];
        let (n, from) = c.recv_from(&mut buf).unwrap();
        assert_eq!(from, addr);
        let text = std::str::from_utf8(&buf[..n]).unwrap();
        assert_eq!(text, format!("{}dns?", greeting(c.local_addr().unwrap())));
    }
}
