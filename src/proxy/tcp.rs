//! The transparent TCP proxy: accepts the connections TPROXY hands it, attaches the
//! first-packet decision, connects to the original destination from the client's own
//! address, and relays.
//!
//! - Listener: `IP_TRANSPARENT` (`IPV6_TRANSPARENT`) socket on the TPROXY port; TPROXY
//!   delivers connections for any destination to it, and `getsockname()` of an accepted
//!   socket is the connection's original destination (kernel
//!   Documentation/networking/tproxy.rst).
//! - Upstream: `SO_MARK` = the bypass mark (the ruleset never touches these packets, and
//!   the mark differs from the routing mark so the SYN does not loop back to us);
//!   `IP_TRANSPARENT` and bound to the client's IP (port chosen by the kernel), so the
//!   server sees the client's address. The replies match the ruleset's `socket
//!   --transparent` rule and come back to this socket.
//! - System calls per connection are kept few (issue #7): sockets are created
//!   non-blocking (`SOCK_NONBLOCK`, no `fcntl`), accepted sockets inherit `TCP_NODELAY`
//!   from the listener (Linux clones the listening socket into each accepted one,
//!   `sk_clone_lock`; `tests/datapath_netns.rs` checks that small writes are not held
//!   back), and relay pipes are reused ([`super::relay::PipePool`]).
//! - A bounded number of connections: at the limit the proxy stops accepting (new SYNs
//!   wait in the listen backlog); reaching it is counted and logged, rate-limited
//!   ([`crate::limits`]). The limit is what the open files limit allows
//!   ([`crate::host::FdPlan`]), so the proxy meets it before the kernel's `EMFILE`.
//! - Each connection goes through one [`super::lifecycle::Lifecycle`]: registered, then
//!   decided, and exactly one end record however its task ends.
//! - Shutdown: stop accepting, let live connections finish for a grace period, then stop
//!   them (both sides reset); the drain is woken by the last connection leaving the
//!   registry, not by polling it.
//!
//! Source: issue #3 "The proxy"; DESIGN §3.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context;
use socket2::{Domain, Socket, Type};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};

use super::decider::Decider;
use super::handover::{self, Connection, Giver, Outcome, Outgoing};
use super::lifecycle::Lifecycle;
use super::registry::{Registry, StopReason};
use super::relay::{self, RelayConfig, RelayEnd, Relayed, Resume};
use crate::audit::CloseReason;
use crate::policy::FlowKey;
use crate::policy::ports::Protocol;

/// Proxy settings.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// `SO_MARK` of upstream sockets (the ruleset's bypass mark).
    pub bypass_mark: u32,
    /// Connect upstream from the client's IP (`IP_TRANSPARENT` bind); when false, from
    /// the node's own address.
    pub preserve_source: bool,
    /// This node's own addresses. A connection to one of them is made from the node's
    /// address even when `preserve_source` is set: the server's replies would be routed
    /// locally straight to the client's address, never passing the `socket --transparent`
    /// rule that brings them back to the upstream socket (a hostNetwork server on the
    /// client's own node then sees the node's address).
    pub local_addrs: std::sync::Arc<[IpAddr]>,
    /// Upstream connect timeout.
    pub connect_timeout: Duration,
    /// Most live connections.
    pub max_connections: usize,
    /// Byte relay.
    pub relay: RelayConfig,
    /// How long live connections may finish after shutdown begins.
    pub drain_grace: Duration,
    /// Where live connections go when the next agent asks for them (issue #23); `None`:
    /// no hand-over, a stop drains.
    pub handover: Option<Arc<Giver>>,
}

/// How [`serve`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Served {
    /// Shutdown: live connections were drained, then stopped.
    Drained,
    /// The listeners and every live connection went to the next agent
    /// ([`super::handover`]); nothing was reset.
    HandedOver,
}

/// Binds the transparent listeners on `addrs` (the addresses TPROXY looks listeners up
/// on, `--on-ip`, with the TPROXY port, and with the port of TCP between local pods,
/// `RedirectConfig::local_pods_port`), each with `SO_MARK` = `mark_of(addr)` where that
/// is `Some` (the local pods' listener: its request and accepted sockets take its mark,
/// by which the ruleset leaves their packets untracked). IPv4 listeners are required;
/// IPv6 ones are skipped with a warning when they cannot be bound (a node without IPv6).
///
/// # Errors
/// When an IPv4 listener cannot be created, made transparent or marked (both need
/// CAP_NET_ADMIN) or bound. Must be called inside a tokio runtime.
pub fn bind(
    addrs: &[SocketAddr],
    mark_of: impl Fn(SocketAddr) -> Option<u32>,
) -> anyhow::Result<Vec<TcpListener>> {
    let mut out = Vec::new();
    for &addr in addrs {
        match listener(addr, mark_of(addr)) {
            Ok(l) => out.push(l),
            Err(e) if addr.is_ipv4() => {
                return Err(e).with_context(|| format!("transparent listener on {addr}"));
            }
            Err(e) => tracing::warn!(error = %e, %addr, "transparent listener skipped"),
        }
    }
    Ok(out)
}

fn listener(addr: SocketAddr, mark: Option<u32>) -> io::Result<TcpListener> {
    let s = Socket::new(
        Domain::for_address(addr),
        Type::STREAM.nonblocking(),
        Some(socket2::Protocol::TCP),
    )?;
    if let Some(mark) = mark {
        s.set_mark(mark)?;
    }
    match addr {
        SocketAddr::V4(_) => s.set_ip_transparent_v4(true)?,
        SocketAddr::V6(_) => {
            s.set_only_v6(true)?;
            s.set_ip_transparent_v6(true)?;
        }
    }
    s.set_reuse_address(true)?;
    // Inherited by every accepted connection: bytes are relayed as they come, and a small
    // request must not wait for the ACK of the previous one (Nagle).
    s.set_tcp_nodelay(true)?;
    s.bind(&addr.into())?;
    s.listen(4096)?;
    TcpListener::from_std(s.into())
}

/// Accepts and proxies connections on `listeners` until `shutdown` turns true, then
/// drains ([`drain`]): waits up to `config.drain_grace` for live connections, stops the
/// rest, and returns when they are gone (or after one more second).
///
/// `adopted`: connections the previous agent handed over ([`super::handover::take`]),
/// relayed from where they stopped once decided again ([`adopt`]).
///
/// With `config.handover`, a next agent that asks gets the listeners and every live TCP
/// connection ([`hand_over`]); [`Served::HandedOver`] is returned once it acknowledged.
/// A hand-over that fails part-way resets the connections not sent and accepting
/// resumes.
pub async fn serve(
    listeners: Vec<TcpListener>,
    config: ProxyConfig,
    decider: Arc<Decider>,
    registry: Arc<Registry>,
    mut shutdown: watch::Receiver<bool>,
    adopted: Vec<Connection>,
) -> Served {
    // One accept loop over every listener, a permit taken before each accept: with a loop
    // per listener, each would hold a permit while waiting, and a limit below the number
    // of listeners would never let a connection through.
    let limit = Arc::new(Semaphore::new(config.max_connections));
    // Shared by every connection's task, which would otherwise hold a copy (104 bytes).
    let config = Arc::new(config);
    for c in adopted {
        // Over the limit (the next agent's is lower), a handed-over connection is still
        // taken: it holds no permit then.
        let permit = limit.clone().try_acquire_owned().ok();
        let (decider, registry, config) = (decider.clone(), registry.clone(), config.clone());
        tokio::spawn(async move {
            adopt(c, &config, &decider, &registry).await;
            drop(permit);
        });
    }
    let listeners = Arc::new(listeners);
    loop {
        let accepting = accept_loop(&listeners, &limit, &config, &decider, &registry);
        let handover = handover::asked(config.handover.as_ref(), Protocol::Tcp);
        tokio::select! {
            () = async { let _ = shutdown.wait_for(|stop| *stop).await; } => {
                accepting.abort();
                drain(&registry, config.drain_grace).await;
                return Served::Drained;
            }
            () = handover => {
                accepting.abort();
                let _ = accepting.await;
                let giver = config.handover.as_ref().expect("asked through it");
                match hand_over(&listeners, &registry, giver).await {
                    Outcome::Completed => {
                        decider.retire();
                        return Served::HandedOver;
                    }
                    Outcome::Failed => continue,
                }
            }
        }
    }
}

/// Gives the next agent (through `giver`) a duplicate of each listener's descriptor,
/// then stops every live TCP connection of `registry` for a hand-over (each one's task
/// gives it on, [`proxy`]) and waits until none is left; the caller has stopped
/// accepting. Returns how the hand-over ended.
pub async fn hand_over(listeners: &[TcpListener], registry: &Registry, giver: &Giver) -> Outcome {
    let given = listeners
        .iter()
        .map(|l| handover::duplicate(l, l.local_addr()).map(|(a, fd)| Outgoing::Listener(a, fd)))
        .collect();
    giver.hand_over_proxy(registry, Protocol::Tcp, given).await
}

/// The accept loop over `listeners`, on a task of its own.
fn accept_loop(
    listeners: &Arc<Vec<TcpListener>>,
    limit: &Arc<Semaphore>,
    config: &Arc<ProxyConfig>,
    decider: &Arc<Decider>,
    registry: &Arc<Registry>,
) -> tokio::task::JoinHandle<()> {
    let owns: Vec<Option<SocketAddr>> = listeners.iter().map(|l| l.local_addr().ok()).collect();
    let (listeners, limit) = (listeners.clone(), limit.clone());
    {
        let (decider, registry, config) = (decider.clone(), registry.clone(), config.clone());
        tokio::spawn(async move {
            let limits = &crate::limits::LIMITS;
            loop {
                let permit = match limit.clone().try_acquire_owned() {
                    Ok(p) => p,
                    Err(_) => {
                        // Counted each time the proxy reaches the limit (from then on new
                        // connections wait in the listen backlog); logged rate-limited.
                        if let Some(n) = limits.connections.hit() {
                            tracing::warn!(
                                max = config.max_connections,
                                hits = n,
                                "connection limit reached; not accepting until one closes \
                                 (new connections wait in the listen backlog)"
                            );
                        }
                        match limit.clone().acquire_owned().await {
                            Ok(p) => p,
                            Err(_) => return,
                        }
                    }
                };
                let (accepted, own) = std::future::poll_fn(|cx| {
                    for (l, own) in listeners.iter().zip(&owns) {
                        if let std::task::Poll::Ready(r) = l.poll_accept(cx) {
                            return std::task::Poll::Ready((r, *own));
                        }
                    }
                    std::task::Poll::Pending
                })
                .await;
                let (client, peer) = match accepted {
                    Ok(c) => c,
                    Err(e) => {
                        // EMFILE and friends: back off instead of spinning; the connection
                        // stays in the backlog for the next try.
                        let hits = if crate::limits::is_out_of_files(&e) {
                            &limits.open_files
                        } else {
                            &limits.accept_errors
                        };
                        if let Some(n) = hits.hit() {
                            tracing::warn!(error = %e, hits = n, "accept failed; retrying in 50 ms");
                        }
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                // Registered here, not in its task: a hand-over, which stops this loop and then
                // walks the registry, must find every connection accepted.
                let Some(registration) = register(&client, peer, own, &registry) else {
                    continue;
                };
                tokio::spawn(connection_task(
                    client,
                    registration,
                    config.clone(),
                    decider.clone(),
                    permit,
                ));
            }
        })
    }
}

/// The task of one accepted connection: [`proxy`], then its `permit` back. An idle
/// connection is this future and its two sockets, so its size is most of what each live
/// connection costs the agent in memory (`agent_rss_per_idle_conn_kib` in loadtest, issue
/// #20: at most 4 KiB in all).
async fn connection_task(
    client: TcpStream,
    registration: super::registry::Registration,
    config: Arc<ProxyConfig>,
    decider: Arc<Decider>,
    permit: tokio::sync::OwnedSemaphorePermit,
) {
    proxy(client, registration, &config, &decider).await;
    drop(permit);
}

/// How long stopped connections get to reset their sockets and write their end records
/// after the drain grace.
const STOPPED_GRACE: Duration = Duration::from_secs(1);

/// Waits up to `grace` for the live connections and UDP flows of `registry` to end, tells
/// the rest to stop, and waits up to [`STOPPED_GRACE`] for them. Woken by the registry
/// when its last flow leaves ([`Registry::wait_empty`]), so a drain ends as soon as the
/// last end record is written.
pub async fn drain(registry: &Registry, grace: Duration) {
    if tokio::time::timeout(grace, registry.wait_empty()).await.is_ok() {
        return;
    }
    tracing::info!(live = registry.len(), "drain grace over; stopping live connections");
    registry.stop_all();
    if tokio::time::timeout(STOPPED_GRACE, registry.wait_empty()).await.is_err() {
        tracing::warn!(live = registry.len(), "connections still live after being stopped");
    }
}

/// Registers the connection `client` from `peer`, accepted on `listener`, under its
/// original destination (`getsockname`). `None` (the connection closed, reset for a direct
/// connection to the listener) when it has none or is not TPROXY's.
fn register(
    client: &TcpStream,
    peer: SocketAddr,
    listener: Option<SocketAddr>,
    registry: &Arc<Registry>,
) -> Option<super::registry::Registration> {
    let original = match client.local_addr() {
        Ok(a) => a,
        Err(e) => {
            tracing::warn!(error = %e, %peer, "no original destination");
            return None;
        }
    };
    // A connection made to the listener itself, not delivered by TPROXY: its "original
    // destination" is the proxy, and proxying it would connect the proxy to itself.
    if Some(original) == listener {
        tracing::warn!(%peer, "direct connection to the proxy listener refused");
        reset(client);
        return None;
    }
    let key = FlowKey { src: unmap(peer), dst: unmap(original), protocol: Protocol::Tcp };
    Some(registry.register(key))
}

/// Proxies one accepted connection, registered already ([`register`]), to its end, through
/// its [`Lifecycle`]: decided, opened, relayed, and one end record however the task ends.
async fn proxy(
    client: TcpStream,
    registration: super::registry::Registration,
    config: &ProxyConfig,
    decider: &Arc<Decider>,
) {
    let key = registration.tracked.key;
    // Denied or rejected alike: the handshake is done, so a reset is all that is left
    // (for a reject, the client sees `ECONNRESET` after its connect, not `ECONNREFUSED`).
    let mut flow = match Lifecycle::admit_registered(decider, registration) {
        Ok(flow) => flow,
        Err(verdict) => {
            tracing::warn!(src = %key.src, dst = %key.dst, verdict = verdict.as_str(), "connection reached the proxy but policy does not allow it; reset");
            reset(&client);
            return;
        }
    };
    // Admitted under an older snapshot than the one now in force (and registered too late
    // for the re-decision walk: decided again as it opens), or stopped already.
    if !flow.open() {
        reset(&client);
        let reason = flow.stop_reason();
        flow.end(reason);
        return;
    }
    let to_self = key.dst.ip().is_loopback() || config.local_addrs.contains(&key.dst.ip());
    let source = (config.preserve_source && !to_self).then_some(key.src.ip());
    let server = match connect(source, key.dst, config).await {
        Ok(s) => s,
        Err(e) if crate::limits::is_out_of_files(&e) => {
            if let Some(n) = crate::limits::LIMITS.open_files.hit() {
                tracing::warn!(error = %e, hits = n, "open files limit: upstream socket not created; clients reset");
            }
            reset(&client);
            flow.end(CloseReason::ResourceLimit);
            return;
        }
        Err(e) => {
            tracing::debug!(error = %e, dst = %key.dst, "upstream connect failed");
            reset(&client);
            flow.end(CloseReason::UpstreamUnreachable);
            return;
        }
    };
    run(flow, client, server, Resume::default(), config).await;
}

/// Takes in a connection the previous agent handed over: registered with its age and
/// bytes, decided again on the snapshot in force ([`Lifecycle::adopt`]; a denied one is
/// reset and ends `policy-change`), then relayed from where it stopped.
pub async fn adopt(
    c: Connection,
    config: &ProxyConfig,
    decider: &Arc<Decider>,
    registry: &Arc<Registry>,
) {
    let Connection { key, flow: handed, to_server, to_client, relay: suspended } = c;
    let counters = relay::Counters { to_server: to_server.into(), to_client: to_client.into() };
    let (flow, allowed) = Lifecycle::adopt(decider, registry, key, &handed, counters);
    if !allowed {
        tracing::info!(src = %key.src, dst = %key.dst, "a handed-over connection is denied by the snapshot in force; reset");
        suspended.abort();
        let reason = flow.stop_reason();
        flow.end(reason);
        return;
    }
    let (client, server, resume) = suspended.into_resume();
    let streams = TcpStream::from_std(client).and_then(|c| Ok((c, TcpStream::from_std(server)?)));
    match streams {
        Ok((client, server)) => run(flow, client, server, resume, config).await,
        Err(e) => {
            tracing::warn!(error = %e, src = %key.src, dst = %key.dst, "a handed-over connection could not be registered with the runtime");
            flow.end(CloseReason::Reset);
        }
    }
}

/// Relays an open connection from `resume` to its end record, or hands it over when it
/// was stopped for that.
async fn run(
    flow: Lifecycle,
    client: TcpStream,
    server: TcpStream,
    resume: Resume,
    config: &ProxyConfig,
) {
    let tracked = flow.tracked().clone();
    let key = tracked.key;
    let relayed = relay::relay(
        client,
        server,
        &config.relay,
        &tracked.counters,
        &tracked.stop,
        resume,
        &|| tracked.stop_reason() == Some(StopReason::HandOver) && config.handover.is_some(),
    )
    .await;
    let (to_server, to_client) = (
        tracked.counters.to_server.load(Ordering::Relaxed),
        tracked.counters.to_client.load(Ordering::Relaxed),
    );
    let ended = match relayed {
        Relayed::Ended(end) => end,
        // Only for a hand-over (`keep` above): the connection goes to the next agent.
        Relayed::Stopped(relay) => {
            let Some(giver) = &config.handover else {
                relay.abort();
                return flow.end(CloseReason::Shutdown);
            };
            let mut flow = flow;
            let handed = flow.hand_over();
            giver.give(Outgoing::Connection(Connection {
                key,
                flow: handed,
                to_server,
                to_client,
                relay,
            }));
            // Only now out of the registry: the hand-over waits for it to be empty, then
            // sends `done`; leaving before the connection is given would send `done`
            // without it.
            drop(flow);
            return;
        }
    };
    tracing::debug!(
        src = %key.src,
        dst = %key.dst,
        reason = ended.as_str(),
        to_server,
        to_client,
        "connection closed"
    );
    let reason = match ended {
        RelayEnd::Normal => CloseReason::Normal,
        RelayEnd::Reset => CloseReason::Reset,
        RelayEnd::Timeout => CloseReason::Timeout,
        RelayEnd::Stopped => flow.stop_reason(),
    };
    flow.end(reason);
}

/// `a` with an IPv4-mapped IPv6 address (`::ffff:a.b.c.d`) written as IPv4: policy and
/// audit see the client as the IPv4 address it is.
pub(crate) fn unmap(a: SocketAddr) -> SocketAddr {
    match a {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), v6.port()),
            None => a,
        },
        v4 => v4,
    }
}

/// Connects to `dst` with the bypass mark and `TCP_NODELAY`, from `source` when given,
/// within `config.connect_timeout` (an error of kind `TimedOut` past it).
///
/// A connection to a pod of this node, or of a node one veth or bridge away, is most often
/// established when `connect(2)` returns `EINPROGRESS`: the SYN, the server's SYN-ACK and
/// the ACK are all processed in this thread's own softirq before the call returns. A
/// socket that has its peer then (`getpeername(2)`) is used at once; one that failed inside
/// the call returns its `SO_ERROR`. Waiting for the writable event instead cost every
/// connection a turn of the runtime's event loop (an `epoll_wait` and a task wake-up), and
/// arming the timeout's timer an `eventfd` write whenever it was the runtime's earliest
/// timer (tokio wakes its driver to re-arm the wheel), both before the relay could start
/// (issue #18). Only a socket still in `SYN_SENT` waits, under the timeout. Sources:
/// connect(2), `EINPROGRESS` (a non-blocking connect completes when the socket turns
/// writable, its outcome in `SO_ERROR`), getpeername(2) (`ENOTCONN` until connected).
async fn connect(
    source: Option<IpAddr>,
    dst: SocketAddr,
    config: &ProxyConfig,
) -> io::Result<TcpStream> {
    let s = Socket::new(
        Domain::for_address(dst),
        Type::STREAM.nonblocking(),
        Some(socket2::Protocol::TCP),
    )?;
    // 0 is no mark (the agent's configuration never has it, `RedirectConfig::validate`):
    // the component tests connect without CAP_NET_ADMIN, which `SO_MARK` needs.
    if config.bypass_mark != 0 {
        s.set_mark(config.bypass_mark)?;
    }
    s.set_tcp_nodelay(true)?;
    if let Some(ip) = source {
        match ip {
            IpAddr::V4(_) => s.set_ip_transparent_v4(true)?,
            IpAddr::V6(_) => s.set_ip_transparent_v6(true)?,
        }
        // The port is chosen at connect time, unique for the 4-tuple, not reserved at
        // bind: without this, upstream connections from one client address exhaust the
        // ephemeral range (each bind reserves a port for every destination) under
        // connection churn (ip(7), IP_BIND_ADDRESS_NO_PORT).
        nix::sys::socket::setsockopt(&s, nix::sys::socket::sockopt::IpBindAddressNoPort, &true)?;
        s.bind(&SocketAddr::new(ip, 0).into())?;
    }
    match s.connect(&dst.into()) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(nix::libc::EINPROGRESS) => {}
        Err(e) => return Err(e),
    }
    // Connected: a peer (one system call, the usual case). Else failed already (an RST
    // inside the call: `SO_ERROR`), or still in SYN_SENT.
    if s.peer_addr().is_ok() {
        return TcpStream::from_std(s.into());
    }
    if let Some(e) = s.take_error()? {
        return Err(e);
    }
    let stream = TcpStream::from_std(s.into())?;
    let connected = async {
        stream.writable().await?;
        match stream.take_error()? {
            Some(e) => Err(e),
            None => Ok(()),
        }
    };
    match tokio::time::timeout(config.connect_timeout, connected).await {
        Ok(Ok(())) => Ok(stream),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(io::Error::new(io::ErrorKind::TimedOut, "upstream connect timed out")),
    }
}

/// Closes with an RST: the client sees the same as from a server that refused.
fn reset(s: &TcpStream) {
    let _ = socket2::SockRef::from(s).set_linger(Some(Duration::ZERO));
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpSocket;

    use super::*;
    use crate::audit::event::attr;
    use crate::proxy::decider::testing;
    use crate::proxy::handover;
    use crate::proxy::relay::{PipePool, RelayMode};

    fn config() -> ProxyConfig {
        config_with(RelayMode::Copy)
    }

    /// Polls `connect` once, as the runtime first does: `Some` when it is done without
    /// waiting for any event.
    fn connect_at_first_poll(
        to: SocketAddr,
        config: &ProxyConfig,
    ) -> Option<io::Result<TcpStream>> {
        let mut fut = std::pin::pin!(connect(None, to, config));
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match fut.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(r) => Some(r),
            std::task::Poll::Pending => None,
        }
    }

    /// A connection whose handshake completes inside `connect(2)` (a listener on this
    /// host) is used at once: its first poll returns it, with no timer armed and no wait for
    /// the runtime's writable event (which the first poll has not seen: before the change
    /// it returned `Pending`).
    #[tokio::test]
    async fn a_connect_established_inside_the_call_needs_no_wait() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let to = listener.local_addr().unwrap();
        let stream = connect_at_first_poll(to, &config())
            .expect("done at the first poll")
            .expect("established inside connect(2)");
        assert_eq!(stream.peer_addr().unwrap(), to);
        assert!(stream.nodelay().unwrap(), "TCP_NODELAY set");
        let (mut accepted, _) = listener.accept().await.unwrap();
        let mut stream = stream;
        stream.write_all(b"ping").await.unwrap();
        let mut got = [0u8; 4];
        accepted.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");
    }

    /// A refusal that arrives inside `connect(2)` (an RST from this host) is the connect's
    /// error, `ConnectionRefused`, at the first poll.
    #[tokio::test]
    async fn a_connect_refused_inside_the_call_fails_at_once() {
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let err = connect_at_first_poll(closed, &config())
            .expect("done at the first poll")
            .expect_err("nothing listens");
        assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused, "{err}");
    }

    fn config_with(mode: RelayMode) -> ProxyConfig {
        ProxyConfig {
            bypass_mark: 0,
            preserve_source: false,
            local_addrs: Arc::new([]),
            connect_timeout: Duration::from_secs(5),
            max_connections: 16,
            relay: RelayConfig {
                mode,
                pipes: Arc::new(PipePool::new(1 << 16, 2, 16)),
                idle_timeout: Duration::from_secs(60),
            },
            drain_grace: Duration::from_secs(1),
            handover: None,
        }
    }

    /// The task of an accepted connection, which is most of what an idle connection costs
    /// the agent (issue #20's budget: 4 KiB per idle connection in all, beside its two
    /// sockets' runtime registrations and its registry entry), stays within 3 KiB. It was
    /// 3.4 KiB in a release build while `drive` took its two directions by value (an
    /// `async fn` keeps such an argument twice, rust-lang/rust #62958), each direction's
    /// waits carried a `readable()` / `writable()` future, and the task held a copy of the
    /// whole `ProxyConfig`; about 2.3 KiB without (debug and release builds alike).
    #[tokio::test]
    async fn an_accepted_connection_task_stays_within_3_kib() {
        let dir = tempfile::tempdir().unwrap();
        let t = testing::decider(testing::LOOPBACK_CLUSTER, dir.path());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (_client, accepted) =
            tokio::join!(TcpStream::connect(listener.local_addr().unwrap()), listener.accept());
        let (accepted, peer) = accepted.unwrap();
        let registry = Arc::new(Registry::default());
        let registration = register(&accepted, peer, None, &registry).unwrap();
        let permit = Arc::new(Semaphore::new(1)).try_acquire_owned().unwrap();
        let task =
            connection_task(accepted, registration, Arc::new(config()), t.decider.clone(), permit);
        let bytes = std::mem::size_of_val(&task);
        assert!(bytes <= 3 << 10, "an accepted connection's task is {bytes} bytes");
    }

    /// A connection task dropped in the middle of its relay (aborted; a runtime shutting
    /// down drops its tasks the same way) still writes its end record, once: in the
    /// metrics and, its decision being audited, in audit.
    #[tokio::test]
    async fn a_connection_task_dropped_mid_relay_writes_one_end_record() {
        let dir = tempfile::tempdir().unwrap();
        let t = testing::decider(testing::LOOPBACK_CLUSTER, dir.path());
        // The server's listener is the connection's original destination as well: the
        // proxy, handed the accepted socket, connects upstream to its local address.
        let listener = TcpListener::bind("127.0.0.3:0").await.unwrap();
        let server_addr = listener.local_addr().unwrap();
        let socket = TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        let (client, accepted) = tokio::join!(socket.connect(server_addr), listener.accept());
        let (mut client, (accepted, peer)) = (client.unwrap(), accepted.unwrap());
        let registry = Arc::new(Registry::default());
        let task = {
            let (decider, registry) = (t.decider.clone(), registry.clone());
            tokio::spawn(async move {
                let registration = register(&accepted, peer, None, &registry).unwrap();
                proxy(accepted, registration, &config(), &decider).await;
            })
        };
        let (mut server, _) =
            tokio::time::timeout(Duration::from_secs(5), listener.accept()).await.unwrap().unwrap();
        client.write_all(b"ping").await.unwrap();
        let mut got = [0; 4];
        tokio::time::timeout(Duration::from_secs(5), server.read_exact(&mut got))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&got, b"ping");
        assert_eq!((registry.len(), t.closed_total()), (1, 0));
        task.abort();
        assert!(task.await.unwrap_err().is_cancelled());
        assert_eq!(registry.len(), 0);
        assert_eq!(t.closed_total(), 1);
        assert_eq!(t.end_events(), ["shutdown"]);
    }

    /// Bytes of a bulk connection in the hand-over test: more than every socket buffer on
    /// its path holds (loopback's `tcp_wmem`/`tcp_rmem` maxima are 4 and 6 MiB), so its
    /// relay is stopped with bytes in flight.
    const BULK: usize = 24 << 20;

    /// The byte at `i` of a bulk stream: a pattern a lost, repeated or reordered chunk
    /// breaks.
    fn pattern(i: usize) -> u8 {
        (i % 251) as u8
    }

    /// One proxied loopback connection through `proxy` (the old agent): the client's and
    /// the server application's ends.
    async fn proxied(
        listener: &TcpListener,
        config: &ProxyConfig,
        decider: &Arc<Decider>,
        registry: &Arc<Registry>,
    ) -> (TcpStream, TcpStream) {
        let socket = TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        let (client, accepted) =
            tokio::join!(socket.connect(listener.local_addr().unwrap()), listener.accept());
        let (client, (accepted, peer)) = (client.unwrap(), accepted.unwrap());
        let (config, decider, registry) = (config.clone(), decider.clone(), registry.clone());
        tokio::spawn(async move {
            let registration = register(&accepted, peer, None, &registry).unwrap();
            proxy(accepted, registration, &config, &decider).await
        });
        let (server, _) =
            tokio::time::timeout(Duration::from_secs(5), listener.accept()).await.unwrap().unwrap();
        (client, server)
    }

    /// Waits (up to 10 s) until `cond` holds, checking every millisecond.
    async fn until(what: &str, cond: impl Fn() -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !cond() {
            assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Issue #23: an agent hands its listener and live connections to the next one over the
    /// hand-over socket, and nothing is lost or reset: bulk connections stopped with bytes
    /// in flight arrive whole and in order, a half-closed connection keeps its half-close,
    /// an idle one works on, a connection waiting in the listener's backlog is accepted by
    /// the next agent. The old agent writes no end record; the new one writes one per
    /// connection, with its whole duration and bytes, after deciding each again.
    async fn hand_over_round(mode: RelayMode) {
        let dir = tempfile::tempdir().unwrap();
        let old = testing::decider(testing::LOOPBACK_CLUSTER, &dir.path().join("old"));
        let new = testing::decider(testing::LOOPBACK_CLUSTER, &dir.path().join("new"));
        let giver = Arc::new(Giver::new(0));
        let socket_path = dir.path().join("handover.sock");
        giver.serve(&socket_path).unwrap();
        let old_config = ProxyConfig { handover: Some(giver.clone()), ..config_with(mode) };
        let new_config = config_with(mode);
        let (old_registry, new_registry) =
            (Arc::new(Registry::default()), Arc::new(Registry::default()));
        let server = TcpListener::bind("127.0.0.3:0").await.unwrap();

        // Bulk: the client writes BULK bytes; the server reads none until after the
        // hand-over.
        let mut bulk = Vec::new();
        for _ in 0..4 {
            let (mut client, server_end) =
                proxied(&server, &old_config, &old.decider, &old_registry).await;
            let writer = tokio::spawn(async move {
                let chunk: Vec<u8> = (0..1 << 16).map(pattern).collect();
                let mut sent = 0;
                while sent < BULK {
                    let n = (BULK - sent).min(chunk.len());
                    // The pattern's period (251) does not divide 65,536: start where we are.
                    let off = sent % 251;
                    let piece: Vec<u8> = (off..off + n).map(pattern).collect();
                    client.write_all(&piece).await.unwrap();
                    sent += n;
                }
                client.shutdown().await.unwrap();
                client
            });
            bulk.push((writer, server_end));
        }
        // Half-closed: the client said all and shut down its side before the hand-over;
        // the server answers after it.
        let (mut half_client, mut half_server) =
            proxied(&server, &old_config, &old.decider, &old_registry).await;
        half_client.write_all(b"request").await.unwrap();
        half_client.shutdown().await.unwrap();
        let mut got = Vec::new();
        half_server.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"request");
        // Idle.
        let (mut idle_client, mut idle_server) =
            proxied(&server, &old_config, &old.decider, &old_registry).await;
        // A transparent listener of the old agent, with a connection in its backlog.
        let listener = TcpListener::bind("127.0.0.4:0").await.unwrap();
        let waiting = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();

        until("the bulk relays to move bytes", || {
            old_registry
                .connections()
                .iter()
                .filter(|t| t.counters.to_server.load(Ordering::Relaxed) > 0)
                .count()
                >= 5
        })
        .await;
        assert_eq!(old_registry.len(), 6);

        let giving = {
            let (giver, registry) = (giver.clone(), old_registry.clone());
            tokio::spawn(async move {
                giver.requested(Protocol::Tcp).await;
                hand_over(&[listener], &registry, &giver).await
            })
        };
        let mut taken = handover::testing::take_over(&socket_path).await;
        assert_eq!(
            (taken.version, taken.listeners.len(), taken.connections.len()),
            (handover::VERSION, 1, 6)
        );
        let in_flight =
            taken.connections.iter().filter(|c| c.relay.to_server.in_flight.is_some()).count();
        assert!(in_flight > 0, "no bulk connection was stopped with bytes in flight");
        let half = taken.connections.iter().filter(|c| c.relay.to_server.done).count();
        assert_eq!(half, 1, "the half-closed connection's client side is over");
        for c in std::mem::take(&mut taken.connections) {
            let (config, decider, registry) =
                (new_config.clone(), new.decider.clone(), new_registry.clone());
            tokio::spawn(async move { adopt(c, &config, &decider, &registry).await });
        }
        let (_, next_listener) = taken.listeners.pop().unwrap();
        taken.ack().unwrap();
        assert_eq!(giving.await.unwrap(), Outcome::Completed);
        assert_eq!(old_registry.len(), 0);
        assert_eq!(old.closed_total(), 0, "the old agent wrote an end record");

        // The next agent's listener accepts the connection that waited in the backlog.
        let next_listener = TcpListener::from_std(next_listener).unwrap();
        let (mut accepted, _) = next_listener.accept().await.unwrap();
        let mut waiting = waiting;
        waiting.write_all(b"waited").await.unwrap();
        let mut buf = [0u8; 6];
        accepted.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"waited");

        // Every connection goes on through the new agent.
        half_server.write_all(b"response").await.unwrap();
        half_server.shutdown().await.unwrap();
        let mut got = Vec::new();
        half_client.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"response");
        idle_client.write_all(b"ping").await.unwrap();
        let mut buf = [0u8; 4];
        idle_server.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"ping");
        drop((idle_client, idle_server));
        for (writer, mut server_end) in bulk {
            let mut got = Vec::with_capacity(BULK);
            server_end.read_to_end(&mut got).await.unwrap();
            assert_eq!(got.len(), BULK, "bytes lost or repeated");
            assert!(got.iter().enumerate().all(|(i, &b)| b == pattern(i)), "bytes out of order");
            drop(server_end);
            let mut client = writer.await.unwrap();
            let mut rest = Vec::new();
            client.read_to_end(&mut rest).await.unwrap();
            assert!(rest.is_empty());
        }
        until("the new agent's connections to end", || new_registry.is_empty()).await;
        // Each agent counts what it did (review finding 19 of #23): the old one opened and
        // handed over the six, the new one adopted and closed them; the relayed bytes are
        // split between them, each agent's own share, and add up to the end records'.
        assert_eq!((old.opened(), old.metric("tierproxy_connections_handed_over_total")), (6, 6));
        assert_eq!((new.opened(), new.metric("tierproxy_connections_adopted_total")), (0, 6));
        assert_eq!(new.closed_total(), 6);
        let relayed = |t: &testing::TestDecider, d: &str| {
            t.metric(&format!("tierproxy_relayed_bytes_total{{direction=\"{d}\"}}"))
        };
        let before = relayed(&old, "to_server");
        // The half-closed connection's request and some of the bulk moved before.
        assert!(before > 7, "the old agent counts the bytes it relayed: {before}");
        let events = new.events();
        let bytes = |k: &str| testing::end_bytes(&events, k);
        let b = BULK as u64;
        assert_eq!(bytes(attr::BYTES_TO_SERVER), [4, 7, b, b, b, b]);
        assert_eq!(bytes(attr::BYTES_TO_CLIENT), [0, 0, 0, 0, 0, 8]);
        assert_eq!(before + relayed(&new, "to_server"), 4 + 7 + 4 * b);
        assert_eq!(relayed(&old, "to_client") + relayed(&new, "to_client"), 8);
        assert_eq!(testing::end_reasons(&events), ["normal"; 6]);
        // Allowed again: not audited again (the old agent audited each admission).
        assert!(testing::decision_points(&events).is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn live_connections_are_handed_over_without_a_byte_lost_auto() {
        hand_over_round(RelayMode::Auto).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn live_connections_are_handed_over_without_a_byte_lost_splice() {
        hand_over_round(RelayMode::Splice).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn live_connections_are_handed_over_without_a_byte_lost_copy() {
        hand_over_round(RelayMode::Copy).await;
    }

    /// Issue #23: the next agent decides every handed-over connection again before it
    /// relays a byte; a policy that changed during the hand-over cuts it there (both sides
    /// reset), and the end record, from the next agent, says `policy-change`.
    #[tokio::test]
    async fn a_handed_over_connection_the_new_snapshot_denies_is_cut() {
        let dir = tempfile::tempdir().unwrap();
        let old = testing::decider(testing::LOOPBACK_CLUSTER, &dir.path().join("old"));
        let new = testing::decider(testing::LOOPBACK_CLUSTER, &dir.path().join("new"));
        new.decider.publish(testing::current(&testing::loopback_cluster_denying(), 2));
        let giver = Arc::new(Giver::new(0));
        let socket_path = dir.path().join("handover.sock");
        giver.serve(&socket_path).unwrap();
        let old_config = ProxyConfig { handover: Some(giver.clone()), ..config() };
        let (old_registry, new_registry) =
            (Arc::new(Registry::default()), Arc::new(Registry::default()));
        let server = TcpListener::bind("127.0.0.3:0").await.unwrap();
        let (mut client, mut server_end) =
            proxied(&server, &old_config, &old.decider, &old_registry).await;
        client.write_all(b"ping").await.unwrap();
        let mut buf = [0u8; 4];
        server_end.read_exact(&mut buf).await.unwrap();
        let giving = {
            let (giver, registry) = (giver.clone(), old_registry.clone());
            tokio::spawn(async move {
                giver.requested(Protocol::Tcp).await;
                hand_over(&[], &registry, &giver).await
            })
        };
        let mut taken = handover::testing::take_over(&socket_path).await;
        let c = taken.connections.pop().unwrap();
        taken.ack().unwrap();
        assert_eq!(giving.await.unwrap(), Outcome::Completed);
        adopt(c, &config(), &new.decider, &new_registry).await;
        assert!(new_registry.is_empty());
        let mut rest = Vec::new();
        let read = client.read_to_end(&mut rest).await;
        assert_eq!(read.unwrap_err().kind(), io::ErrorKind::ConnectionReset);
        let read = server_end.read_to_end(&mut rest).await;
        assert_eq!(read.unwrap_err().kind(), io::ErrorKind::ConnectionReset);
        assert_eq!(old.closed_total(), 0);
        let events = new.events();
        assert_eq!(testing::end_reasons(&events), ["policy-change"]);
        assert_eq!(new.closed(CloseReason::PolicyChange), 1);
        assert!(testing::decision_points(&events).iter().all(|p| p == "hand-over"));
    }
}
