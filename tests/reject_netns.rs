//! Refusals of rejected flows on real packets (issue #22, "Reject, a third verdict"):
//! `proxy::reject` answering the first packets a real NFQUEUE hands over, between real
//! network namespaces, IPv4 and IPv6.
//!
//! Topology: a client namespace, a router namespace (the "node": it forwards, queues the
//! first packet of every flow from the client and answers each from a reader thread) and a
//! server namespace that listens on every port used. The reader decides by destination
//! port alone ([`REJECTED`] is refused, [`DENIED`] dropped, the rest accepted): these
//! tests are about what a rejected packet's client sees, which the policy engine does not
//! change (`datapath_netns` and `lab_netns` do the same through real Antrea policies).
//! A router DNAT from a "ClusterIP" to the rejected port shows the refusal comes from the
//! address the client used: the agent's own answer built from the queue's `NFQA_CT`, or,
//! where the kernel passes none (CONFIG_NETFILTER_NETLINK_GLUE_CT unset, as on these
//! machines), the kernel's reject in the ruleset's refusal chains
//! (`tierproxy::redirect::refusal_table`), which the reader hands such packets to.
//!
//! Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN, CAP_NET_RAW) and `ip`, `iptables`,
//! `ip6tables`, `nft`; without them each test prints `SKIPPED: ...`, or fails with
//! `TIERPROXY_REQUIRE_NETNS=1`. Namespaces are named `tprj-<pid>-<n>` and removed on drop.

use std::io::ErrorKind;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tierproxy::config::RedirectConfig;
use tierproxy::lab::sctp::{self, Chunk, Packet};
use tierproxy::proxy::conntrack::original_tuple;
use tierproxy::proxy::nfqueue::{Answer, NfVerdict, Queue};
use tierproxy::proxy::packet;
use tierproxy::proxy::reject::{KernelRefusal, Refuser, Sent};

mod common;

/// Destination port the reader rejects.
const REJECTED: u16 = 81;
/// Destination port the reader denies (drops silently).
const DENIED: u16 = 82;
/// Destination port the reader allows.
const ALLOWED: u16 = 80;
/// The "ClusterIP" port the router DNATs to the server's [`REJECTED`] port.
const SERVICE_PORT: u16 = 8080;
/// How long a probe waits for an answer: far longer than a refusal takes, short enough
/// for a deny's timeout to be the observable.
const WAIT: Duration = Duration::from_millis(1500);

/// A named network namespace, deleted on drop.
struct Netns(String);

impl Netns {
    fn new() -> Netns {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let name = format!("tprj-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        run(&["ip", "netns", "add", &name]);
        let ns = Netns(name);
        ns.sh(&["ip", "link", "set", "lo", "up"]);
        ns
    }

    fn sh(&self, args: &[&str]) {
        let mut full = vec!["ip", "netns", "exec", &self.0];
        full.extend_from_slice(args);
        run(&full);
    }

    /// Runs `f` on a thread inside this namespace.
    fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        std::thread::scope(|s| {
            s.spawn(|| {
                tierproxy::lab::netns::enter(&self.0).expect("setns");
                f()
            })
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
        })
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

fn run(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().expect("runs");
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

const CLIENT4: &str = "10.71.1.2";
const SERVER4: &str = "10.71.2.2";
const SERVICE4: &str = "10.71.9.9";
const CLIENT6: &str = "fd71:1::2";
const SERVER6: &str = "fd71:2::2";
const SERVICE6: &str = "fd71:9::9";

/// The three namespaces and the reader answering the router's queue until dropped.
struct Topology {
    client: Netns,
    _listeners: Vec<(TcpListener, UdpSocket)>,
    _server: Netns,
    _router: Netns,
    stop: Arc<AtomicBool>,
    reader: Option<std::thread::JoinHandle<()>>,
    /// Rejected packets queued, refusals sent (by the reader or, `kernel` of them, handed
    /// to the kernel's reject), and rejected packets that got none.
    rejected: Arc<AtomicU64>,
    sent: Arc<AtomicU64>,
    kernel: Arc<AtomicU64>,
    unsent: Arc<AtomicU64>,
    /// Whether a queued packet came with its conntrack entry (`NFQA_CT`: kernels with
    /// CONFIG_NETFILTER_NETLINK_GLUE_CT).
    conntrack: Arc<AtomicBool>,
}

impl Drop for Topology {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

fn topology(queue: u16) -> Topology {
    let (client, router, server) = (Netns::new(), Netns::new(), Netns::new());
    let link = |a: &Netns, ai: &str, b: &Netns, bi: &str| {
        run(&["ip", "link", "add", ai, "netns", &a.0, "type", "veth", "peer", bi, "netns", &b.0]);
        a.sh(&["ip", "link", "set", ai, "up"]);
        b.sh(&["ip", "link", "set", bi, "up"]);
    };
    link(&client, "c0", &router, "r1");
    link(&server, "s0", &router, "r2");
    for (ns, dev, v4, v6) in [
        (&client, "c0", "10.71.1.2/24", "fd71:1::2/64"),
        (&router, "r1", "10.71.1.1/24", "fd71:1::1/64"),
        (&router, "r2", "10.71.2.1/24", "fd71:2::1/64"),
        (&server, "s0", "10.71.2.2/24", "fd71:2::2/64"),
    ] {
        ns.sh(&["ip", "addr", "add", v4, "dev", dev]);
        ns.sh(&["ip", "-6", "addr", "add", v6, "dev", dev, "nodad"]);
    }
    client.sh(&["ip", "route", "add", "default", "via", "10.71.1.1"]);
    client.sh(&["ip", "-6", "route", "add", "default", "via", "fd71:1::1"]);
    server.sh(&["ip", "route", "add", "default", "via", "10.71.2.1"]);
    server.sh(&["ip", "-6", "route", "add", "default", "via", "fd71:2::1"]);
    router.sh(&["sysctl", "-qw", "net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"]);
    // The first packet of every flow from the client to the server, as the agent's rule 7
    // queues it (TCP SYN, SCTP `ctstate NEW`, UDP unconfirmed), in mangle FORWARD after
    // the DNAT of the "ClusterIP".
    let q = queue.to_string();
    for (tool, client_ip, server_ip, service_ip) in
        [("iptables", CLIENT4, SERVER4, SERVICE4), ("ip6tables", CLIENT6, SERVER6, SERVICE6)]
    {
        for proto in ["tcp", "udp"] {
            let to = format!("{server_ip}:{REJECTED}");
            let to = if server_ip.contains(':') { format!("[{server_ip}]:{REJECTED}") } else { to };
            let port = SERVICE_PORT.to_string();
            router.sh(&[
                tool,
                "-t",
                "nat",
                "-A",
                "PREROUTING",
                "-d",
                service_ip,
                "-p",
                proto,
                "--dport",
                &port,
                "-j",
                "DNAT",
                "--to-destination",
                &to,
            ]);
        }
        let queue_rule = |extra: &[&str]| {
            let mut rule = vec![tool, "-t", "mangle", "-A", "FORWARD", "-s", client_ip];
            rule.extend_from_slice(extra);
            rule.extend_from_slice(&["-j", "NFQUEUE", "--queue-num", &q]);
            router.sh(&rule);
        };
        queue_rule(&["-p", "tcp", "--syn"]);
        queue_rule(&["-p", "udp", "-m", "conntrack", "!", "--ctstatus", "CONFIRMED"]);
        queue_rule(&["-p", "sctp", "-m", "conntrack", "--ctstate", "NEW"]);
    }
    // The ruleset's refusal chains, right after the queue in the forward hook.
    let refusals = tierproxy::redirect::refusal_table(&RedirectConfig::default(), "tprj");
    let mut nft = Command::new("ip")
        .args(["netns", "exec", &router.0, "nft", "-j", "-f", "-"])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("runs nft");
    use std::io::Write as _;
    nft.stdin.take().expect("stdin").write_all(refusals.as_bytes()).expect("to nft");
    assert!(nft.wait().expect("nft ends").success(), "nft took the refusal chains");
    // Every port listens on the server (TCP) or is bound (UDP, no answer): whatever the
    // client hears about REJECTED and DENIED comes from the router, not from a closed port.
    let listeners: Vec<(TcpListener, UdpSocket)> = server.run(|| {
        [SERVER4, SERVER6]
            .iter()
            .flat_map(|ip| [ALLOWED, REJECTED, DENIED].map(|port| (*ip, port)))
            .map(|(ip, port)| {
                let at = SocketAddr::new(ip.parse().unwrap(), port);
                (TcpListener::bind(at).expect("listen"), UdpSocket::bind(at).expect("bind"))
            })
            .collect()
    });
    let stop = Arc::new(AtomicBool::new(false));
    let (rejected, sent, unsent) = (Arc::default(), Arc::default(), Arc::default());
    let kernel: Arc<AtomicU64> = Arc::default();
    let conntrack = Arc::new(AtomicBool::new(false));
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let reader = {
        let (router_name, stop, conntrack) = (router.0.clone(), stop.clone(), conntrack.clone());
        let (rejected, sent, unsent): (Arc<AtomicU64>, Arc<AtomicU64>, Arc<AtomicU64>) =
            (Arc::clone(&rejected), Arc::clone(&sent), Arc::clone(&unsent));
        let kernel = Arc::clone(&kernel);
        std::thread::spawn(move || {
            tierproxy::lab::netns::enter(&router_name).expect("setns");
            let mut q = Queue::bind(queue, 256, 64, false).expect("bind the queue");
            ready_tx.send(()).unwrap();
            let refusal = KernelRefusal::new(RedirectConfig::default().reject_mark);
            refusal.arm();
            let mut refuser = Refuser::new(0).with_kernel(Some(refusal));
            while !stop.load(Ordering::Relaxed) {
                let _ = q.process(64, |p| {
                    let port = packet::parse(p.payload).map(|k| k.dst.port());
                    match port {
                        Ok(REJECTED) => {
                            rejected.fetch_add(1, Ordering::Relaxed);
                            let original = original_tuple(p.conntrack);
                            if original.is_some() {
                                conntrack.store(true, Ordering::Relaxed);
                            }
                            let (answer, mark) =
                                refuser.refuse_queued(p.payload, p.mark, original.as_ref(), false);
                            match answer {
                                Sent::Sent(_) => sent.fetch_add(1, Ordering::Relaxed),
                                _ => unsent.fetch_add(1, Ordering::Relaxed),
                            };
                            match mark {
                                Some(mark) => {
                                    kernel.fetch_add(1, Ordering::Relaxed);
                                    Answer { verdict: NfVerdict::Accept, mark: Some(mark) }
                                }
                                None => Answer { verdict: NfVerdict::Drop, mark: None },
                            }
                        }
                        Ok(DENIED) | Err(_) => Answer { verdict: NfVerdict::Drop, mark: None },
                        Ok(_) => Answer { verdict: NfVerdict::Accept, mark: None },
                    }
                });
            }
        })
    };
    ready_rx.recv_timeout(Duration::from_secs(10)).expect("the queue reader is bound");
    Topology {
        client,
        _listeners: listeners,
        _server: server,
        _router: router,
        stop,
        reader: Some(reader),
        rejected,
        sent,
        kernel,
        unsent,
        conntrack,
    }
}

impl Topology {
    /// Every probe's rejected packet got exactly one refusal (a refused client sends no
    /// second one). Where the queue passed no conntrack entry, the `kernel` ones of them
    /// were the kernel's: TCP and UDP (`by_kernel` says whether this test's protocol is
    /// one the kernel answers); else the reader sent each.
    fn assert_one_refusal_each(&self, probes: u64, by_kernel: bool) {
        let rejected = self.rejected.load(Ordering::Relaxed);
        assert_eq!(rejected, probes, "rejected packets queued");
        assert_eq!(self.sent.load(Ordering::Relaxed), rejected, "one refusal each");
        assert_eq!(self.unsent.load(Ordering::Relaxed), 0);
        let kernel = self.kernel.load(Ordering::Relaxed);
        if self.conntrack.load(Ordering::Relaxed) || !by_kernel {
            assert_eq!(kernel, 0, "the reader answers what it knows the original tuple of");
        } else {
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "NOTE: no NFQA_CT from this kernel (CONFIG_NETFILTER_NETLINK_GLUE_CT unset): the kernel's reject answered"
            );
            assert_eq!(kernel, rejected, "handed to the kernel's reject");
        }
    }
}

fn available(test: &str) -> bool {
    common::tools_available(test, &["iptables", "ip6tables", "nft"])
}

/// A TCP connect from the client to `to`: `Ok` or the error's kind, with the time it took.
fn connect(t: &Topology, to: SocketAddr) -> (Result<(), ErrorKind>, Duration) {
    t.client.run(|| {
        let start = Instant::now();
        let r = TcpStream::connect_timeout(&to, WAIT).map(|_| ()).map_err(|e| e.kind());
        (r, start.elapsed())
    })
}

/// What a connected UDP socket of the client hears after one datagram to `to`: `Ok` for
/// an answer (none of these servers answers), else the error (`WouldBlock`: nothing).
fn datagram(t: &Topology, to: SocketAddr) -> std::io::Error {
    t.client.run(|| {
        let s = UdpSocket::bind(SocketAddr::new(client_of(to), 0)).unwrap();
        s.connect(to).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        s.send(b"anyone there?").unwrap();
        let mut buf = [0u8; 64];
        common::retrying(|| s.recv(&mut buf)).expect_err("no server here answers")
    })
}

fn client_of(to: SocketAddr) -> IpAddr {
    if to.is_ipv4() { CLIENT4.parse().unwrap() } else { CLIENT6.parse().unwrap() }
}

/// The client's SCTP INIT to `to` on a raw socket: the answer from `to` to that INIT, if
/// any came within [`WAIT`].
fn sctp_init(t: &Topology, to: SocketAddr) -> Option<Packet> {
    t.client.run(|| {
        let s = sctp::raw_socket(client_of(to)).unwrap();
        s.connect(&SocketAddr::new(to.ip(), 0).into()).unwrap();
        let (port, tag) = (50_123, 0x5eed_0001);
        s.send(&Packet::init(port, to.port(), tag).to_bytes()).unwrap();
        let deadline = Instant::now() + WAIT;
        let mut buf = vec![0u8; 65_535];
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            s.set_read_timeout(Some(left.max(Duration::from_millis(1)))).unwrap();
            match sctp::recv(&s, &mut buf) {
                Ok(Some((from, p))) if from == to.ip() && p.dst_port == port => return Some(p),
                Ok(_) => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(e) => panic!("SCTP probe to {to}: {e}"),
            }
        }
        None
    })
}

fn at(ip: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip.parse().unwrap(), port)
}

#[test]
fn a_rejected_tcp_connect_is_refused_at_once_and_a_denied_one_times_out() {
    if !available("a_rejected_tcp_connect_is_refused_at_once_and_a_denied_one_times_out") {
        return;
    }
    let t = topology(7101);
    for server in [SERVER4, SERVER6] {
        assert_eq!(connect(&t, at(server, ALLOWED)).0, Ok(()), "the path works ({server})");
        let (r, took) = connect(&t, at(server, REJECTED));
        assert_eq!(r, Err(ErrorKind::ConnectionRefused), "rejected: RST ({server}, {took:?})");
        let (r, _) = connect(&t, at(server, DENIED));
        assert_eq!(r, Err(ErrorKind::TimedOut), "denied: silence ({server})");
    }
    // Through the "ClusterIP": the RST must come from the address the client connected
    // to, or the client ignores it and times out.
    for service in [SERVICE4, SERVICE6] {
        let (r, took) = connect(&t, at(service, SERVICE_PORT));
        assert_eq!(r, Err(ErrorKind::ConnectionRefused), "DNAT'd ({service}, {took:?})");
    }
    t.assert_one_refusal_each(4, true);
}

#[test]
fn a_rejected_udp_datagram_gets_administratively_prohibited_and_a_denied_one_nothing() {
    if !available(
        "a_rejected_udp_datagram_gets_administratively_prohibited_and_a_denied_one_nothing",
    ) {
        return;
    }
    let t = topology(7102);
    // IPv4 code 10 is EHOSTUNREACH, ICMPv6 code 1 EACCES (Linux icmp_err_convert,
    // icmpv6_err_convert): not ECONNREFUSED, which a closed port's port unreachable gives.
    for (server, service, kind) in [
        (SERVER4, SERVICE4, ErrorKind::HostUnreachable),
        (SERVER6, SERVICE6, ErrorKind::PermissionDenied),
    ] {
        let e = datagram(&t, at(server, REJECTED));
        assert_eq!(e.kind(), kind, "rejected ({server}): {e}");
        let e = datagram(&t, at(service, SERVICE_PORT));
        assert_eq!(e.kind(), kind, "DNAT'd ({service}): {e}");
        let e = datagram(&t, at(server, DENIED));
        assert_eq!(e.kind(), ErrorKind::WouldBlock, "denied ({server}): {e}");
        let e = datagram(&t, at(server, ALLOWED));
        assert_eq!(e.kind(), ErrorKind::WouldBlock, "allowed, nobody answers ({server}): {e}");
    }
    t.assert_one_refusal_each(4, true);
}

#[test]
fn a_rejected_sctp_init_is_aborted_and_a_denied_one_unanswered() {
    if !available("a_rejected_sctp_init_is_aborted_and_a_denied_one_unanswered") {
        return;
    }
    let t = topology(7103);
    for server in [SERVER4, SERVER6] {
        let answer = sctp_init(&t, at(server, REJECTED)).expect("an answer to the rejected INIT");
        assert_eq!(answer.chunk, Chunk::Abort { reflected: false }, "{answer:?}");
        assert_eq!(answer.verification_tag, 0x5eed_0001, "the INIT's initiate tag");
        assert_eq!(answer.src_port, REJECTED);
        assert_eq!(sctp_init(&t, at(server, DENIED)), None, "denied ({server})");
    }
    t.assert_one_refusal_each(2, false);
}
