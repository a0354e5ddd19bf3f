//! The transparent UDP proxy: receives the datagrams TPROXY hands it with their original
//! destination, attaches the first datagram's decision, and relays each flow through a pair
//! of sockets until it goes idle.
//!
//! - Listener: an `IP_TRANSPARENT` (`IPV6_TRANSPARENT`) socket on the TPROXY address and
//!   port with `IP_RECVORIGDSTADDR` (`IPV6_RECVORIGDSTADDR`): each datagram arrives with
//!   its original destination in an `IP_ORIGDSTADDR` control message (kernel
//!   Documentation/networking/tproxy.rst; ip(7)).
//! - A flow is (client address, original destination). Its first datagram creates:
//!   - an **upstream socket**: `SO_MARK` = the bypass mark, `IP_TRANSPARENT`, bound to the
//!     client's IP (port chosen by the kernel) and connected to the original destination,
//!     so the server sees the client's address; the server's replies match the ruleset's
//!     `socket --transparent` rule and come back to it;
//!   - a **reply socket**: `IP_TRANSPARENT` and `SO_REUSEADDR`, bound to the original
//!     destination and connected to the client, so replies leave from the address the
//!     client sent to. The client's later datagrams match `socket --transparent` on this
//!     socket and arrive on it directly, not through the listener.
//! - A flow ends when no datagram crossed it either way for the idle timeout, when it is
//!   told to stop (shutdown, or a new snapshot denies it), or when the destination answers
//!   with ICMP port unreachable (`ECONNREFUSED` on the connected upstream socket; the
//!   proxy passes the error on to the client, [`super::icmp`]). Its
//!   sockets close; a later datagram of the same 4-tuple is queued and decided again (the
//!   ruleset queues UDP whenever no proxy socket takes it).
//! - Datagrams are relayed without a buffer per flow: a task waits for readiness, then
//!   reads into its thread's scratch buffer and sends at once; a datagram the other socket
//!   cannot take now (`EWOULDBLOCK`) is dropped, as a congested router would.
//! - Each flow goes through one [`super::lifecycle::Lifecycle`], as a TCP connection
//!   does: registered before its first datagram's decision is taken (or made), opened once
//!   its sockets are, and exactly one end record however its task ends.
//! - The flow table is bounded: at the limit, the first datagram of a new flow is dropped
//!   and counted, and the limit is logged once per episode.
//! - Hand-over to the next agent (issue #23, [`super::handover`] version 2): the proxy
//!   stops reading its listeners and gives a duplicate of each, then each flow's task
//!   gives its two sockets with the flow's age, bytes, idle time and admitting decision.
//!   Nothing is read and not sent, so the datagrams waiting in those sockets' queues are
//!   all that is in flight, and they pass with the sockets. The next agent decides each
//!   flow again ([`super::lifecycle::Lifecycle::adopt`]) and relays it on from the same
//!   sockets: the server goes on seeing the same source port, and the client the same
//!   peer.
//!
//! UDP to the node's own addresses is not proxied (the proxy cannot bind a hostNetwork
//! server's address and port): the ruleset lets the kernel forward it after its first
//! datagram's decision (`redirect`, rule 5).
//!
//! Source: issue #5 "Protocols"; DESIGN §3.

use std::cell::RefCell;
use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use socket2::{Domain, Socket, Type};
use tokio::io::Interest;
use tokio::net::UdpSocket;
use tokio::sync::watch;

use super::decider::Decider;
use super::handover::{self, Giver, Outcome, Outgoing, UdpFlow};
use super::lifecycle::Lifecycle;
use super::registry::{Registry, StopReason, Tracked};
use super::tcp::unmap;
use crate::audit::CloseReason;
use crate::policy::FlowKey;
use crate::policy::ports::Protocol;

/// Largest datagram relayed, in bytes (the largest UDP payload over IPv4; IPv6 jumbograms
/// are not supported). A larger one is dropped.
pub const MAX_DATAGRAM: usize = 65_507;

/// UDP proxy settings.
#[derive(Debug, Clone)]
pub struct UdpConfig {
    /// `SO_MARK` of upstream sockets (the ruleset's bypass mark).
    pub bypass_mark: u32,
    /// Send upstream from the client's IP (`IP_TRANSPARENT` bind); when false, from the
    /// node's own address.
    pub preserve_source: bool,
    /// This node's own addresses: upstream to one of them is sent from the node's address
    /// (as for TCP, see [`super::tcp::ProxyConfig::local_addrs`]).
    pub local_addrs: Arc<[IpAddr]>,
    /// A flow with no datagram either way for this long is closed.
    pub idle_timeout: Duration,
    /// Most live flows; the first datagram of a flow over it is dropped.
    pub max_flows: usize,
    /// Where the listeners and live flows go when the next agent asks for them (issue
    /// #23); `None`: no hand-over, a stop ends every flow.
    pub handover: Option<Arc<Giver>>,
}

/// Counters of the UDP proxy since start.
#[derive(Debug, Default)]
pub struct UdpStats {
    /// Flows opened.
    pub flows: AtomicU64,
    /// Datagrams dropped: flow table full, socket setup failed, too large, or the other
    /// socket could not take them.
    pub dropped: AtomicU64,
}

/// One live flow, as the listener sees it.
#[derive(Debug)]
struct Flow {
    upstream: Arc<UdpSocket>,
    tracked: Arc<Tracked>,
    /// Milliseconds since the table's epoch of the last datagram either way.
    last: AtomicU64,
}

/// The flow table: (client, original destination) → flow.
#[derive(Debug)]
struct Table {
    flows: Mutex<HashMap<(SocketAddr, SocketAddr), Arc<Flow>>>,
    /// Zero of the flows' `last` times: an idle timeout before the table was made, so
    /// that a handed-over flow's last datagram, up to an idle timeout ago, has a time.
    epoch: Instant,
    stats: Arc<UdpStats>,
}

impl Table {
    fn new(idle_timeout: Duration, stats: Arc<UdpStats>) -> Table {
        let now = Instant::now();
        Table {
            flows: Mutex::new(HashMap::new()),
            epoch: now.checked_sub(idle_timeout).unwrap_or(now),
            stats,
        }
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(SocketAddr, SocketAddr), Arc<Flow>>> {
        // Single inserts and removes: a panic elsewhere cannot leave the map inconsistent.
        self.flows.lock().unwrap_or_else(|p| p.into_inner())
    }
}

thread_local! {
    /// Scratch buffer of each runtime thread: datagrams are read and sent without an await
    /// in between, so one buffer per thread serves every flow.
    static SCRATCH: RefCell<Vec<u8>> = RefCell::new(vec![0; MAX_DATAGRAM + 1]);
}

/// Binds the transparent UDP listeners on `addrs` (the TPROXY `--on-ip` addresses with the
/// TPROXY port). The first address is required; the others are skipped with a warning when
/// they cannot be bound (a node without IPv6).
///
/// # Errors
/// When the first listener cannot be created, made transparent (needs CAP_NET_ADMIN),
/// asked for original destinations, or bound. Must be called inside a tokio runtime.
pub fn bind(addrs: &[SocketAddr]) -> anyhow::Result<Vec<UdpSocket>> {
    let mut out = Vec::new();
    for (i, &addr) in addrs.iter().enumerate() {
        match listener(addr) {
            Ok(l) => out.push(l),
            Err(e) if i == 0 => {
                return Err(e).with_context(|| format!("transparent UDP listener on {addr}"));
            }
            Err(e) => tracing::warn!(error = %e, %addr, "transparent UDP listener skipped"),
        }
    }
    Ok(out)
}

fn listener(addr: SocketAddr) -> io::Result<UdpSocket> {
    use nix::sys::socket::{setsockopt, sockopt};
    let s = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(socket2::Protocol::UDP))?;
    match addr {
        SocketAddr::V4(_) => {
            s.set_ip_transparent_v4(true)?;
            setsockopt(&s, sockopt::Ipv4OrigDstAddr, &true)?;
        }
        SocketAddr::V6(_) => {
            s.set_only_v6(true)?;
            s.set_ip_transparent_v6(true)?;
            setsockopt(&s, sockopt::Ipv6OrigDstAddr, &true)?;
        }
    }
    s.set_reuse_address(true)?;
    s.set_nonblocking(true)?;
    s.bind(&addr.into())?;
    UdpSocket::from_std(s.into())
}

/// Relays the flows of datagrams arriving on `listeners` until `shutdown` turns true; then
/// stops taking new flows and returns. Live flows end on their own (idle), or when the
/// registry tells them to stop (the TCP proxy's drain does so for every registered flow).
/// Counts in `stats`.
///
/// `adopted`: flows the previous agent handed over ([`super::handover::take`]), decided
/// again and relayed on from their sockets ([`adopt`]). With `config.handover`, a next
/// agent that asks gets the listeners and every live flow ([`hand_over`]); serving then
/// ends once it acknowledged. A hand-over that fails part-way closes the flows not sent
/// (their next datagram is decided again and opens a new flow) and reading resumes.
pub async fn serve(
    listeners: Vec<UdpSocket>,
    config: UdpConfig,
    decider: Arc<Decider>,
    registry: Arc<Registry>,
    stats: Arc<UdpStats>,
    shutdown: watch::Receiver<bool>,
    adopted: Vec<UdpFlow>,
) {
    let table = Arc::new(Table::new(config.idle_timeout, stats));
    serve_table(&table, listeners, Arc::new(config), decider, registry, shutdown, adopted).await;
}

/// [`serve`] with the flow table `table`.
async fn serve_table(
    table: &Arc<Table>,
    listeners: Vec<UdpSocket>,
    config: Arc<UdpConfig>,
    decider: Arc<Decider>,
    registry: Arc<Registry>,
    mut shutdown: watch::Receiver<bool>,
    adopted: Vec<UdpFlow>,
) {
    for f in adopted {
        adopt(f, table, &config, &decider, &registry);
    }
    let listeners: Vec<Arc<UdpSocket>> = listeners.into_iter().map(Arc::new).collect();
    loop {
        let tasks: Vec<_> = listeners
            .iter()
            .map(|l| {
                let (l, table, config, decider, registry) =
                    (l.clone(), table.clone(), config.clone(), decider.clone(), registry.clone());
                tokio::spawn(async move {
                    listen(&l, &table, &config, &decider, &registry).await;
                })
            })
            .collect();
        let handover = handover::asked(config.handover.as_ref(), Protocol::Udp);
        tokio::select! {
            () = async { let _ = shutdown.wait_for(|stop| *stop).await; } => {
                for t in tasks {
                    t.abort();
                }
                return;
            }
            () = handover => {
                // No datagram is read from here on: a listener's queue passes whole.
                for t in &tasks {
                    t.abort();
                }
                for t in tasks {
                    let _ = t.await;
                }
                let giver = config.handover.as_ref().expect("asked through it");
                if hand_over(&listeners, &registry, giver).await == Outcome::Completed {
                    return;
                }
            }
        }
    }
}

/// Gives the next agent (through `giver`) a duplicate of each listener's descriptor, then
/// stops every live UDP flow of `registry` for a hand-over (each one's task gives it on)
/// and waits until none is left; the caller has stopped reading the listeners. Returns
/// how the hand-over ended.
async fn hand_over(listeners: &[Arc<UdpSocket>], registry: &Registry, giver: &Giver) -> Outcome {
    let given = listeners
        .iter()
        .map(|l| {
            handover::duplicate(&**l, l.local_addr()).map(|(a, fd)| Outgoing::UdpListener(a, fd))
        })
        .collect();
    giver.hand_over_proxy(registry, Protocol::Udp, given).await
}

/// Takes in a flow the previous agent handed over: registered with its age and bytes,
/// decided again on the snapshot in force ([`Lifecycle::adopt`]; a denied one's sockets
/// are closed and it ends `policy-change`), then relayed on from its sockets with the idle
/// time it had.
fn adopt(
    f: UdpFlow,
    table: &Arc<Table>,
    config: &Arc<UdpConfig>,
    decider: &Arc<Decider>,
    registry: &Arc<Registry>,
) {
    let UdpFlow { key, flow: handed, to_server, to_client, idle, upstream, reply } = f;
    let counters =
        super::relay::Counters { to_server: to_server.into(), to_client: to_client.into() };
    let (life, allowed) = Lifecycle::adopt(decider, registry, key, &handed, counters);
    if !allowed {
        tracing::info!(src = %key.src, dst = %key.dst, "a handed-over UDP flow is denied by the snapshot in force; closed");
        drop((upstream, reply));
        let reason = life.stop_reason();
        return life.end(reason);
    }
    let sockets = UdpSocket::from_std(upstream).and_then(|u| Ok((u, UdpSocket::from_std(reply)?)));
    let (upstream, reply) = match sockets {
        Ok(pair) => pair,
        Err(e) => {
            tracing::warn!(error = %e, src = %key.src, dst = %key.dst, "a handed-over UDP flow could not be registered with the runtime");
            return life.end(CloseReason::Reset);
        }
    };
    let last = table.now_ms().saturating_sub(idle.as_millis() as u64);
    let flow = Arc::new(Flow {
        upstream: Arc::new(upstream),
        tracked: life.tracked().clone(),
        last: AtomicU64::new(last),
    });
    table.lock().insert((key.src, key.dst), flow.clone());
    spawn_relay(Entry { table: table.clone(), key: (key.src, key.dst), flow }, reply, life, config);
}

/// Reads datagrams from one listener for ever.
async fn listen(
    listener: &UdpSocket,
    table: &Arc<Table>,
    config: &Arc<UdpConfig>,
    decider: &Arc<Decider>,
    registry: &Arc<Registry>,
) {
    let fd = listener.as_raw_fd();
    loop {
        if let Err(e) = listener.readable().await {
            tracing::error!(error = %e, "UDP listener failed");
            return;
        }
        // Drain what is queued; `try_io` clears readiness on EWOULDBLOCK.
        loop {
            let got = SCRATCH.with_borrow_mut(|buf| {
                let r = listener.try_io(Interest::READABLE, || recv_original(fd, buf));
                r.map(|(src, dst, n)| {
                    datagram(src, dst, &buf[..n], table, config, decider, registry);
                })
            });
            match got {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                    table.stats.dropped.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(error = %e, "UDP datagram dropped");
                }
                Err(e) => {
                    tracing::warn!(error = %e, "UDP receive failed");
                    break;
                }
            }
        }
    }
}

/// One datagram from the listener: to its flow, or the first of a new flow.
fn datagram(
    src: SocketAddr,
    dst: SocketAddr,
    payload: &[u8],
    table: &Arc<Table>,
    config: &Arc<UdpConfig>,
    decider: &Arc<Decider>,
    registry: &Arc<Registry>,
) {
    let (src, dst) = (unmap(src), unmap(dst));
    let (existing, live) = {
        let flows = table.lock();
        (flows.get(&(src, dst)).cloned(), flows.len())
    };
    if let Some(flow) = existing {
        forward(&flow.upstream, payload, &flow.tracked.counters.to_server, table);
        flow.last.store(table.now_ms(), Ordering::Relaxed);
        return;
    }
    if live >= config.max_flows {
        table.stats.dropped.fetch_add(1, Ordering::Relaxed);
        if let Some(n) = crate::limits::LIMITS.udp_flows.hit() {
            tracing::warn!(
                max = config.max_flows,
                hits = n,
                "UDP flow limit reached; the first datagrams of new flows are dropped until flows end"
            );
        }
        return;
    }
    let key = FlowKey { src, dst, protocol: Protocol::Udp };
    let mut life = match Lifecycle::admit(decider, registry, key) {
        Ok(life) => life,
        Err(verdict) => {
            // A datagram the queue rejected and let on (it came without its conntrack
            // entry: delivered, the entry is confirmed, and NAT un-does a ClusterIP's DNAT
            // on this refusal; `queue`'s reader), one it did not decide (a full queue
            // failing open, a decision that aged out) or decided under an older snapshot:
            // dropped, and refused as the queue refuses, when rejected.
            table.stats.dropped.fetch_add(1, Ordering::Relaxed);
            if verdict == crate::policy::eval::Verdict::Reject {
                let refusal = super::reject::datagram_refusal(src, dst, payload.len());
                let sent = super::reject::Refuser::new(config.bypass_mark).send_limited(&refusal);
                super::queue::count_refusal(&key, sent, &decider.stats);
            }
            return;
        }
    };
    let (upstream, reply) = match open(src, dst, config) {
        Ok(pair) => pair,
        Err(e) => {
            // Not opened: no end record (the lifecycle is dropped before `open`).
            table.stats.dropped.fetch_add(1, Ordering::Relaxed);
            let limits = &crate::limits::LIMITS;
            if crate::limits::is_out_of_files(&e) {
                if let Some(n) = limits.open_files.hit() {
                    tracing::warn!(error = %e, hits = n, "open files limit: UDP flows not opened, datagrams dropped");
                }
            } else {
                tracing::warn!(error = %e, %src, %dst, "UDP flow not opened; datagram dropped");
            }
            return;
        }
    };
    let flow = Arc::new(Flow {
        upstream: Arc::new(upstream),
        tracked: life.tracked().clone(),
        last: AtomicU64::new(table.now_ms()),
    });
    table.lock().insert((src, dst), flow.clone());
    table.stats.flows.fetch_add(1, Ordering::Relaxed);
    // Admitted under an older snapshot than the one now in force, or stopped already: the
    // relay sees the stop at once and the flow ends with its reason (`policy-change`).
    if life.open() {
        forward(&flow.upstream, payload, &flow.tracked.counters.to_server, table);
    }
    spawn_relay(Entry { table: table.clone(), key: (src, dst), flow }, reply, life, config);
}

/// Relays the flow of `entry` on a task of its own until it ends (its end record), or
/// until it is stopped for a hand-over (given on, [`give_on`]).
fn spawn_relay(entry: Entry, reply: UdpSocket, life: Lifecycle, config: &Arc<UdpConfig>) {
    let config = config.clone();
    tokio::spawn(async move {
        let (src, dst) = entry.key;
        match relay(&entry.flow, &reply, &entry.table, &config).await {
            Relayed::Ended(reason) => {
                drop(entry);
                tracing::debug!(%src, %dst, reason = reason.as_str(), "UDP flow closed");
                life.end(reason);
            }
            Relayed::HandOver(giver) => give_on(entry, reply, life, &giver),
        }
    });
}

/// Gives a flow stopped for a hand-over to the next agent: its two sockets (the datagrams
/// queued on them pass with them), its age, bytes and idle time. It leaves the table and
/// then the registry only after it was given, so the hand-over's `done` follows it.
fn give_on(entry: Entry, reply: UdpSocket, mut life: Lifecycle, giver: &Giver) {
    let flow = &entry.flow;
    let idle = entry.table.now_ms().saturating_sub(flow.last.load(Ordering::Relaxed));
    let handed = life.hand_over();
    let counters = &flow.tracked.counters;
    let (to_server, to_client) =
        (counters.to_server.load(Ordering::Relaxed), counters.to_client.load(Ordering::Relaxed));
    let sockets = std::os::fd::AsFd::as_fd(&*flow.upstream)
        .try_clone_to_owned()
        .map(std::net::UdpSocket::from)
        .and_then(|upstream| Ok((upstream, reply.into_std()?)));
    match sockets {
        Ok((upstream, reply)) => giver.give(Outgoing::UdpFlow(UdpFlow {
            key: flow.tracked.key,
            flow: handed,
            to_server,
            to_client,
            idle: Duration::from_millis(idle),
            upstream,
            reply,
        })),
        // Out of descriptors: closed here, its next datagram is decided again and opens
        // a new flow in the next agent.
        Err(e) => {
            tracing::warn!(error = %e, src = %flow.tracked.key.src, dst = %flow.tracked.key.dst, "a UDP flow could not be handed over; closed")
        }
    }
    drop(entry);
    drop(life);
}

/// A flow's place in the table, held by its task: the entry leaves the table when the task
/// ends, however it ends (a panic in the relay, or the runtime dropping the task, included),
/// so later datagrams of its 4-tuple open a new flow instead of going to a dead one. An
/// entry that a newer flow of the same 4-tuple replaced is left alone.
struct Entry {
    table: Arc<Table>,
    key: (SocketAddr, SocketAddr),
    flow: Arc<Flow>,
}

impl Drop for Entry {
    fn drop(&mut self) {
        let mut flows = self.table.lock();
        if flows.get(&self.key).is_some_and(|f| Arc::ptr_eq(f, &self.flow)) {
            flows.remove(&self.key);
        }
    }
}

/// Sends `payload` on `to` now, or drops it; counts what was sent in `bytes`. The send is
/// made straight on the non-blocking socket, not through tokio's readiness (which a socket
/// just created does not have yet, and a UDP send does not need).
fn forward(to: &UdpSocket, payload: &[u8], bytes: &AtomicU64, table: &Table) {
    match socket2::SockRef::from(to).send(payload) {
        Ok(n) => {
            bytes.fetch_add(n as u64, Ordering::Relaxed);
        }
        Err(e) => {
            table.stats.dropped.fetch_add(1, Ordering::Relaxed);
            tracing::trace!(error = %e, "UDP datagram not sent");
        }
    }
}

/// The destination `server` refused a datagram of `client`'s flow (ICMP port unreachable):
/// the client gets the same error from the proxy ([`super::icmp`]).
fn refused(client: SocketAddr, server: SocketAddr) {
    if let Err(e) = super::icmp::port_unreachable(client, server, 0) {
        tracing::debug!(error = %e, %client, %server, "ICMP port unreachable not passed on");
    }
}

/// How a flow's [`relay`] ended.
enum Relayed {
    /// The flow ended, for this reason.
    Ended(CloseReason),
    /// Stopped for a hand-over, its sockets untouched: to give to the next agent.
    HandOver(Arc<Giver>),
}

impl From<CloseReason> for Relayed {
    fn from(reason: CloseReason) -> Relayed {
        Relayed::Ended(reason)
    }
}

/// Relays one flow until it ends or is stopped for a hand-over; returns which.
async fn relay(flow: &Flow, reply: &UdpSocket, table: &Table, config: &UdpConfig) -> Relayed {
    let client = flow.tracked.key.src;
    let counters = &flow.tracked.counters;
    let idle_ms = config.idle_timeout.as_millis() as u64;
    loop {
        let last = flow.last.load(Ordering::Relaxed);
        let idle_at = table.epoch + Duration::from_millis(last.saturating_add(idle_ms));
        tokio::select! {
            // ERROR too: an ICMP error on a UDP socket is reported as EPOLLERR alone
            // (datagram_poll), which `readable()` never wakes for, so the flow would wait
            // for its idle timeout instead of ending on "port unreachable".
            r = flow.upstream.ready(Interest::READABLE | Interest::ERROR) => {
                let Ok(ready) = r else { return CloseReason::Reset.into() };
                // The socket's pending error (`try_recv` would not see it: it is tried only
                // on READABLE readiness).
                if ready.is_error() {
                    match flow.upstream.take_error() {
                        // ICMP port unreachable from the destination: passed on to the
                        // client, which would have received it without the proxy.
                        Ok(Some(e)) if e.kind() == io::ErrorKind::ConnectionRefused => {
                            refused(client, flow.tracked.key.dst);
                            return CloseReason::UpstreamUnreachable.into();
                        }
                        Ok(Some(_)) | Err(_) => return CloseReason::Reset.into(),
                        // Taken already (a send on the socket reports and clears it): the
                        // readiness is cleared, or `ready` would answer at once again.
                        Ok(None) => {
                            let _ = flow.upstream.try_io(Interest::ERROR, || {
                                Err::<(), _>(io::Error::from(io::ErrorKind::WouldBlock))
                            });
                        }
                    }
                }
                // Replies from the original destination → the client.
                loop {
                    let r = SCRATCH.with_borrow_mut(|buf| {
                        flow.upstream.try_recv(buf).map(|n| {
                            if n <= MAX_DATAGRAM {
                                forward(reply, &buf[..n], &counters.to_client, table);
                            }
                        })
                    });
                    match r {
                        Ok(()) => flow.last.store(table.now_ms(), Ordering::Relaxed),
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                            refused(client, flow.tracked.key.dst);
                            return CloseReason::UpstreamUnreachable.into();
                        }
                        Err(_) => return CloseReason::Reset.into(),
                    }
                }
            }
            r = reply.readable() => {
                if r.is_err() {
                    return CloseReason::Reset.into();
                }
                // The client's later datagrams, delivered to this socket by the ruleset's
                // `socket --transparent` rule → the original destination.
                loop {
                    let r = SCRATCH.with_borrow_mut(|buf| {
                        reply.try_recv_from(buf).map(|(n, from)| {
                            // Before `connect` the bound socket could take another client's
                            // datagram; only the flow's own are relayed.
                            if unmap(from) == client && n <= MAX_DATAGRAM {
                                forward(&flow.upstream, &buf[..n], &counters.to_server, table);
                            }
                        })
                    });
                    match r {
                        Ok(()) => flow.last.store(table.now_ms(), Ordering::Relaxed),
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        // The client's port is closed (ICMP from the client): nothing more
                        // to deliver to it.
                        Err(_) => return CloseReason::Reset.into(),
                    }
                }
            }
            _ = tokio::time::sleep_until(idle_at.into()) => {
                if table.now_ms().saturating_sub(flow.last.load(Ordering::Relaxed)) >= idle_ms {
                    return CloseReason::Timeout.into();
                }
            }
            _ = flow.tracked.stop.notified() => {
                let why = flow.tracked.stop_reason();
                if let (Some(StopReason::HandOver), Some(giver)) = (why, &config.handover) {
                    return Relayed::HandOver(giver.clone());
                }
                return why.map_or(CloseReason::Shutdown, CloseReason::from).into();
            }
        }
    }
}

/// The upstream and reply sockets of the flow `client` → `original`.
fn open(
    client: SocketAddr,
    original: SocketAddr,
    config: &UdpConfig,
) -> io::Result<(UdpSocket, UdpSocket)> {
    let transparent = |s: &Socket, ip: IpAddr| match ip {
        IpAddr::V4(_) => s.set_ip_transparent_v4(true),
        IpAddr::V6(_) => s.set_ip_transparent_v6(true),
    };
    let domain = Domain::for_address(original);
    let upstream = Socket::new(domain, Type::DGRAM, Some(socket2::Protocol::UDP))?;
    upstream.set_mark(config.bypass_mark)?;
    upstream.set_nonblocking(true)?;
    let to_self = original.ip().is_loopback() || config.local_addrs.contains(&original.ip());
    if config.preserve_source && !to_self {
        transparent(&upstream, client.ip())?;
        upstream.bind(&SocketAddr::new(client.ip(), 0).into())?;
    }
    upstream.connect(&original.into())?;
    let reply =
        Socket::new(Domain::for_address(client), Type::DGRAM, Some(socket2::Protocol::UDP))?;
    transparent(&reply, original.ip())?;
    reply.set_reuse_address(true)?;
    reply.set_nonblocking(true)?;
    reply.bind(&original.into())?;
    reply.connect(&client.into())?;
    Ok((UdpSocket::from_std(upstream.into())?, UdpSocket::from_std(reply.into())?))
}

/// `recvmsg(2)` one datagram into `buf`: (source, original destination, length).
///
/// # Errors
/// `WouldBlock` when nothing is queued; `InvalidData` for a datagram without an original
/// destination or larger than [`MAX_DATAGRAM`]; other socket errors as they come.
fn recv_original(fd: i32, buf: &mut [u8]) -> io::Result<(SocketAddr, SocketAddr, usize)> {
    use nix::sys::socket::{
        ControlMessageOwned, MsgFlags, SockaddrIn, SockaddrIn6, SockaddrStorage, recvmsg,
    };
    let mut iov = [io::IoSliceMut::new(buf)];
    let mut cmsg = nix::cmsg_space!(nix::libc::sockaddr_in6);
    let msg = recvmsg::<SockaddrStorage>(fd, &mut iov, Some(&mut cmsg), MsgFlags::MSG_DONTWAIT)
        .map_err(io::Error::from)?;
    let invalid = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_string());
    if msg.flags.contains(MsgFlags::MSG_TRUNC) || msg.bytes > MAX_DATAGRAM {
        return Err(invalid("datagram larger than the relay's limit"));
    }
    let src = msg
        .address
        .and_then(|a| {
            a.as_sockaddr_in()
                .map(|v4| SocketAddr::from(*v4))
                .or_else(|| a.as_sockaddr_in6().map(|v6| SocketAddr::from(*v6)))
        })
        .ok_or_else(|| invalid("datagram without a source address"))?;
    let mut dst = None;
    for c in msg.cmsgs().map_err(io::Error::from)? {
        match c {
            ControlMessageOwned::Ipv4OrigDstAddr(a) => dst = Some(SockaddrIn::from(a).into()),
            ControlMessageOwned::Ipv6OrigDstAddr(a) => dst = Some(SockaddrIn6::from(a).into()),
            _ => {}
        }
    }
    let dst = dst.ok_or_else(|| invalid("datagram without an original destination"))?;
    Ok((src, dst, msg.bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A datagram the proxy decides itself (no queue decision) that an Antrea Reject rule
    /// refuses: dropped, and the client's connected socket gets the ICMP error the queue
    /// would have sent (administratively prohibited: `EHOSTUNREACH`), counted. Needs
    /// CAP_NET_RAW (raw socket), as the agent has; skipped without it unless
    /// `TIERPROXY_REQUIRE_NETNS=1`.
    #[tokio::test]
    async fn a_rejected_datagram_decided_by_the_proxy_gets_its_client_an_icmp_error() {
        let raw = socket2::Socket::new(
            socket2::Domain::IPV4,
            socket2::Type::RAW,
            Some(socket2::Protocol::from(255)),
        );
        let test = "a_rejected_datagram_decided_by_the_proxy_gets_its_client_an_icmp_error";
        if !crate::testing::capable(test, "CAP_NET_RAW", raw) {
            return;
        }
        let manifests = r#"
apiVersion: v1
kind: Node
metadata: {name: n1}
status: {addresses: [{type: InternalIP, address: 172.31.0.2}]}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: a, labels: {app: client}}
spec: {nodeName: n1, containers: [{name: c}]}
status: {podIP: 127.0.0.62}
---
apiVersion: v1
kind: Pod
metadata: {name: dns, namespace: a, labels: {app: dns}}
spec: {nodeName: n1, containers: [{name: c}]}
status: {podIP: 127.0.0.63}
---
apiVersion: crd.antrea.io/v1beta1
kind: ClusterNetworkPolicy
metadata: {name: reject-dns}
spec:
  priority: 1
  appliedTo: [{podSelector: {matchLabels: {app: dns}}}]
  ingress: [{action: Reject, ports: [{protocol: UDP, port: 5353}]}]
"#;
        let dir = tempfile::tempdir().unwrap();
        let t = super::super::decider::testing::decider(manifests, dir.path());
        let client = std::net::UdpSocket::bind("127.0.0.62:0").unwrap();
        let server: SocketAddr = "127.0.0.63:5353".parse().unwrap();
        client.connect(server).unwrap();
        client.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let table = Arc::new(Table::new(Duration::from_secs(5), Arc::default()));
        let config = test_config(None);
        let registry = Arc::new(Registry::default());
        let from = client.local_addr().unwrap();
        datagram(from, server, b"query", &table, &config, &t.decider, &registry);
        let e = client.recv(&mut [0u8; 16]).expect_err("no answer but the refusal");
        assert_eq!(e.kind(), io::ErrorKind::HostUnreachable, "{e}");
        assert_eq!(table.stats.dropped.load(Ordering::Relaxed), 1);
        assert!(table.lock().is_empty(), "no flow opened");
        let sent = &t.decider.stats.refusals[super::super::reject::Answer::IcmpProhibited.index()];
        assert_eq!(sent.load(Ordering::Relaxed), 1);
    }

    /// A flow whose task panics leaves the table (the bug: its entry stayed, and later
    /// datagrams of its 4-tuple went to the dead flow until shutdown); a newer flow of the
    /// same 4-tuple is not removed by an older one's end.
    #[tokio::test]
    async fn a_flow_whose_task_panics_leaves_the_table() {
        let table = Arc::new(Table::new(Duration::from_secs(5), Arc::default()));
        let (src, dst): (SocketAddr, SocketAddr) =
            ("127.0.0.1:40000".parse().unwrap(), "127.0.0.1:53".parse().unwrap());
        let registry = Arc::new(Registry::default());
        let flow = || async {
            Arc::new(Flow {
                upstream: Arc::new(UdpSocket::bind("127.0.0.1:0").await.expect("loopback")),
                tracked: registry
                    .register(FlowKey { src, dst, protocol: Protocol::Udp })
                    .tracked
                    .clone(),
                last: AtomicU64::new(0),
            })
        };
        let first = flow().await;
        table.lock().insert((src, dst), first.clone());
        let entry = Entry { table: table.clone(), key: (src, dst), flow: first };
        let task = tokio::spawn(async move {
            let _entry = entry;
            panic!("a relay that panics");
        });
        assert!(task.await.expect_err("the task panicked").is_panic());
        assert!(table.lock().is_empty(), "the panicked flow's entry stayed in the table");

        let (older, newer) = (flow().await, flow().await);
        table.lock().insert((src, dst), newer.clone());
        drop(Entry { table: table.clone(), key: (src, dst), flow: older });
        assert!(table.lock().get(&(src, dst)).is_some_and(|f| Arc::ptr_eq(f, &newer)));
    }

    /// The proxy's settings in these tests: no marks, source not kept, a minute's idle
    /// timeout, 16 flows, and `handover`.
    fn test_config(handover: Option<Arc<Giver>>) -> Arc<UdpConfig> {
        Arc::new(UdpConfig {
            bypass_mark: 0,
            preserve_source: false,
            local_addrs: Arc::new([]),
            idle_timeout: Duration::from_secs(60),
            max_flows: 16,
            handover,
        })
    }

    /// The server of the hand-over test: answers each datagram with its payload, `@` and
    /// the source port it came from (the flow's upstream socket), for 30 s at most.
    fn echo_server() -> (std::net::UdpSocket, SocketAddr) {
        let s = Socket::new(Domain::IPV4, Type::DGRAM, None).unwrap();
        // The flows' reply sockets bind this address too, as they bind a remote server's.
        s.set_reuse_address(true).unwrap();
        s.bind(&"127.0.0.3:0".parse::<SocketAddr>().unwrap().into()).unwrap();
        let s: std::net::UdpSocket = s.into();
        let addr = s.local_addr().unwrap();
        let echo = s.try_clone().unwrap();
        echo.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        std::thread::spawn(move || {
            let mut buf = [0u8; 512];
            while let Ok((n, from)) = echo.recv_from(&mut buf) {
                let mut answer = buf[..n].to_vec();
                answer.extend_from_slice(format!("@{}", from.port()).as_bytes());
                let _ = echo.send_to(&answer, from);
            }
        });
        (s, addr)
    }

    /// A client pod's socket, connected to `server`.
    fn client(server: SocketAddr) -> std::net::UdpSocket {
        let c = std::net::UdpSocket::bind("127.0.0.2:0").unwrap();
        c.connect(server).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        c
    }

    /// `c`'s next datagram, as text.
    fn answer(c: &std::net::UdpSocket) -> String {
        let mut buf = [0u8; 512];
        let n = c.recv(&mut buf).expect("an answer");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    /// Issue #23: live UDP flows of the proxy path pass to the next agent with their two
    /// sockets. A datagram the client sends and one the server sends while the flow is
    /// between the agents wait in those sockets and arrive; the server goes on seeing the
    /// same source port (the same upstream socket, not a new flow); the old agent writes
    /// no end record, the new one one per flow with its whole bytes. Before version 2 the
    /// agent refused to hand over at all with `--udp-path proxy`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn live_flows_pass_to_the_next_agent_with_their_sockets_and_queued_datagrams() {
        let test = "live_flows_pass_to_the_next_agent_with_their_sockets_and_queued_datagrams";
        let s = Socket::new(Domain::IPV4, Type::DGRAM, None).unwrap();
        if !crate::testing::capable(test, "CAP_NET_ADMIN", s.set_ip_transparent_v4(true)) {
            return;
        }
        use super::super::decider::testing;
        let dir = tempfile::tempdir().unwrap();
        let old = testing::decider(testing::LOOPBACK_CLUSTER, &dir.path().join("old"));
        let new = testing::decider(testing::LOOPBACK_CLUSTER, &dir.path().join("new"));
        let giver = Arc::new(Giver::new(0).with_udp_proxy(true));
        let socket_path = dir.path().join("handover.sock");
        giver.serve(&socket_path).unwrap();
        let (old_config, new_config) = (test_config(Some(giver.clone())), test_config(None));
        let (old_registry, new_registry) =
            (Arc::new(Registry::default()), Arc::new(Registry::default()));
        let (server, server_addr) = echo_server();

        // The old agent: a listener (a stand-in: nothing is sent to it) and two flows, each
        // opened by its first datagram as the listener hands it over, then relayed.
        let old_table = Arc::new(Table::new(Duration::from_secs(60), Arc::default()));
        let (_stop_old, stop_rx) = watch::channel(false);
        let listener = UdpSocket::bind("127.0.0.4:0").await.unwrap();
        let listener_addr = listener.local_addr().unwrap();
        let old_serving = tokio::spawn({
            let (table, config) = (old_table.clone(), old_config.clone());
            let (decider, registry) = (old.decider.clone(), old_registry.clone());
            async move {
                serve_table(&table, vec![listener], config, decider, registry, stop_rx, vec![])
                    .await;
            }
        });
        let clients = [client(server_addr), client(server_addr)];
        let mut ports = Vec::new();
        for (i, c) in clients.iter().enumerate() {
            let first = format!("first{i}");
            let src = c.local_addr().unwrap();
            datagram(
                src,
                server_addr,
                first.as_bytes(),
                &old_table,
                &old_config,
                &old.decider,
                &old_registry,
            );
            let got = answer(c);
            let (payload, port) = got.split_once('@').expect("payload@port");
            assert_eq!(payload, first);
            ports.push(port.to_string());
            // The client's later datagrams reach the flow's reply socket.
            c.send(b"second").unwrap();
            assert_eq!(answer(c), format!("second@{port}"));
        }
        assert_eq!(old_registry.len(), 2);

        // The TCP proxy's part (nothing to give), as the agent runs it beside this one.
        let tcp_part = {
            let (giver, registry) = (giver.clone(), old_registry.clone());
            tokio::spawn(async move {
                giver.requested(Protocol::Tcp).await;
                super::super::tcp::hand_over(&[], &registry, &giver).await
            })
        };
        let mut taken = handover::testing::take_over(&socket_path).await;
        assert_eq!(
            (taken.version, taken.udp_listeners.len(), taken.udp_flows.len()),
            (handover::VERSION, 1, 2)
        );
        assert_eq!(taken.udp_listeners[0].0, listener_addr);
        // Between the agents: the first client says something, and the server sends the
        // second client something unasked; both wait in the flows' sockets.
        clients[0].send(b"between").unwrap();
        let second_src = clients[1].local_addr().unwrap();
        let upstream = taken
            .udp_flows
            .iter()
            .find(|f| f.key.src == second_src)
            .map(|f| f.upstream.local_addr().unwrap())
            .expect("the second client's flow");
        server.send_to(b"pushed", upstream).unwrap();

        let new_table = Arc::new(Table::new(Duration::from_secs(60), Arc::default()));
        let (stop_new, stop_rx) = watch::channel(false);
        let listeners: Vec<UdpSocket> = std::mem::take(&mut taken.udp_listeners)
            .into_iter()
            .map(|(_, l)| UdpSocket::from_std(l).unwrap())
            .collect();
        let adopted = std::mem::take(&mut taken.udp_flows);
        let new_serving = tokio::spawn({
            let (table, decider, registry) =
                (new_table.clone(), new.decider.clone(), new_registry.clone());
            async move {
                serve_table(&table, listeners, new_config, decider, registry, stop_rx, adopted)
                    .await;
            }
        });
        taken.ack().unwrap();
        assert_eq!(tcp_part.await.unwrap(), Outcome::Completed);
        tokio::time::timeout(Duration::from_secs(5), old_serving)
            .await
            .expect("the old agent's UDP proxy returns once it handed over")
            .unwrap();
        assert!(old_registry.is_empty() && old_table.lock().is_empty());
        assert_eq!(old.closed_total(), 0, "the old agent wrote an end record");

        // Both flows go on through the new agent, from the same upstream sockets.
        assert_eq!(answer(&clients[0]), format!("between@{}", ports[0]));
        assert_eq!(answer(&clients[1]), "pushed");
        for (c, port) in clients.iter().zip(&ports) {
            c.send(b"after").unwrap();
            assert_eq!(answer(c), format!("after@{port}"));
        }
        assert_eq!(new_table.lock().len(), 2);

        assert_eq!((old.opened(), old.metric("tierproxy_connections_handed_over_total")), (2, 2));
        assert_eq!((new.opened(), new.metric("tierproxy_connections_adopted_total")), (0, 2));
        new_registry.stop_all();
        let _ = stop_new.send(true);
        new_serving.await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !new_registry.is_empty() {
            assert!(Instant::now() < deadline, "the new agent's flows did not end");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let events = new.events();
        let bytes = |k: &str| testing::end_bytes(&events, k);
        use crate::audit::event::attr;
        // Client 0: first0, second, between, after; client 1: first1, second, after.
        assert_eq!(bytes(attr::BYTES_TO_SERVER), [6 + 6 + 5, 6 + 6 + 7 + 5]);
        // The answers carry `@port`; client 1's pushed datagram has none.
        let p = |i: usize| ports[i].len() as u64 + 1;
        let mut to_client = vec![6 + 6 + 7 + 5 + 4 * p(0), 6 + 6 + 6 + 5 + 3 * p(1)];
        to_client.sort_unstable();
        assert_eq!(bytes(attr::BYTES_TO_CLIENT), to_client);
        assert_eq!(testing::end_reasons(&events), ["shutdown"; 2]);
    }

    /// Issue #23: a flow handed over that the next agent's snapshot denies (a policy
    /// changed meanwhile) is not relayed: its sockets are closed, its re-decision is
    /// audited (decision point `hand-over`), and its end is `policy-change` with the bytes
    /// it had moved.
    #[tokio::test]
    async fn a_handed_over_flow_the_next_snapshot_denies_is_closed_and_ends_policy_change() {
        use super::super::decider::testing;
        let dir = tempfile::tempdir().unwrap();
        let new = testing::decider(&testing::loopback_cluster_denying(), dir.path());
        let upstream = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let reply = std::net::UdpSocket::bind("127.0.0.3:0").unwrap();
        let (upstream_addr, reply_addr) =
            (upstream.local_addr().unwrap(), reply.local_addr().unwrap());
        let flow = UdpFlow {
            key: FlowKey {
                src: "127.0.0.2:40000".parse().unwrap(),
                dst: reply_addr,
                protocol: Protocol::Udp,
            },
            flow: super::super::lifecycle::HandedFlow {
                age: Duration::from_secs(3),
                revision: crate::policy::Revision(1),
                audited: true,
                decided: std::time::SystemTime::now(),
            },
            to_server: 12,
            to_client: 34,
            idle: Duration::from_millis(10),
            upstream,
            reply,
        };
        let table = Arc::new(Table::new(Duration::from_secs(60), Arc::default()));
        let config = test_config(None);
        let registry = Arc::new(Registry::default());
        adopt(flow, &table, &config, &new.decider, &registry);
        assert!(registry.is_empty() && table.lock().is_empty(), "the denied flow is not relayed");
        // Its sockets are closed: their addresses are free again.
        std::net::UdpSocket::bind(upstream_addr).expect("the upstream socket was closed");
        std::net::UdpSocket::bind(reply_addr).expect("the reply socket was closed");
        assert_eq!(new.closed(CloseReason::PolicyChange), 1);
        assert_eq!(new.metric("tierproxy_connections_adopted_total"), 1);
        let events = new.events();
        assert_eq!(testing::decision_points(&events), ["hand-over", "hand-over"]);
        assert_eq!(testing::end_reasons(&events), ["policy-change"]);
        let end = events.iter().find(|v| v["event"] == crate::audit::event::CONNECTION_END);
        let attributes = &end.expect("an end record")["attributes"];
        assert_eq!(attributes[crate::audit::event::attr::BYTES_TO_SERVER], 12);
        assert_eq!(attributes[crate::audit::event::attr::BYTES_TO_CLIENT], 34);
    }
}
