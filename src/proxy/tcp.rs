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
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{Semaphore, watch};

use super::decider::Decider;
use super::lifecycle::Lifecycle;
use super::registry::Registry;
use super::relay::{self, RelayConfig, RelayEnd};
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
}

/// Binds the transparent listeners on `addrs` (the addresses TPROXY looks listeners up
/// on, `--on-ip`, with the TPROXY port). The first address is required; the others are
/// skipped with a warning when they cannot be bound (a node without IPv6).
///
/// # Errors
/// When the first listener cannot be created, made transparent (needs CAP_NET_ADMIN) or
/// bound. Must be called inside a tokio runtime.
pub fn bind(addrs: &[SocketAddr]) -> anyhow::Result<Vec<TcpListener>> {
    let mut out = Vec::new();
    for (i, &addr) in addrs.iter().enumerate() {
        match listener(addr) {
            Ok(l) => out.push(l),
            Err(e) if i == 0 => {
                return Err(e).with_context(|| format!("transparent listener on {addr}"));
            }
            Err(e) => tracing::warn!(error = %e, %addr, "transparent listener skipped"),
        }
    }
    Ok(out)
}

fn listener(addr: SocketAddr) -> io::Result<TcpListener> {
    let s = Socket::new(
        Domain::for_address(addr),
        Type::STREAM.nonblocking(),
        Some(socket2::Protocol::TCP),
    )?;
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
pub async fn serve(
    listeners: Vec<TcpListener>,
    config: ProxyConfig,
    decider: Arc<Decider>,
    registry: Arc<Registry>,
    mut shutdown: watch::Receiver<bool>,
) {
    // One accept loop over every listener, a permit taken before each accept: with a loop
    // per listener, each would hold a permit while waiting, and a limit below the number
    // of listeners would never let a connection through.
    let limit = Arc::new(Semaphore::new(config.max_connections));
    let owns: Vec<Option<SocketAddr>> = listeners.iter().map(|l| l.local_addr().ok()).collect();
    let accepting = {
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
                let (decider, registry, config) =
                    (decider.clone(), registry.clone(), config.clone());
                tokio::spawn(async move {
                    proxy(client, peer, own, &config, &decider, &registry).await;
                    drop(permit);
                });
            }
        })
    };
    let _ = shutdown.wait_for(|stop| *stop).await;
    accepting.abort();
    drain(&registry, config.drain_grace).await;
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

/// Proxies one accepted connection to its end, through its [`Lifecycle`]: registered,
/// decided, opened, relayed, and one end record however the task ends.
async fn proxy(
    client: TcpStream,
    peer: SocketAddr,
    listener: Option<SocketAddr>,
    config: &ProxyConfig,
    decider: &Arc<Decider>,
    registry: &Arc<Registry>,
) {
    let original = match client.local_addr() {
        Ok(a) => a,
        Err(e) => {
            tracing::warn!(error = %e, %peer, "no original destination");
            return;
        }
    };
    // A connection made to the listener itself, not delivered by TPROXY: its "original
    // destination" is the proxy, and proxying it would connect the proxy to itself.
    if Some(original) == listener {
        tracing::warn!(%peer, "direct connection to the proxy listener refused");
        reset(&client);
        return;
    }
    let key = FlowKey { src: unmap(peer), dst: unmap(original), protocol: Protocol::Tcp };
    let Some(mut flow) = Lifecycle::admit(decider, registry, key) else {
        tracing::warn!(src = %key.src, dst = %key.dst, "connection reached the proxy but policy denies it; reset");
        reset(&client);
        return;
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
    let server = match tokio::time::timeout(
        config.connect_timeout,
        connect(source, key.dst, config),
    )
    .await
    {
        Ok(Ok(s)) => s,
        Ok(Err(e)) if crate::limits::is_out_of_files(&e) => {
            if let Some(n) = crate::limits::LIMITS.open_files.hit() {
                tracing::warn!(error = %e, hits = n, "open files limit: upstream socket not created; clients reset");
            }
            reset(&client);
            flow.end(CloseReason::ResourceLimit);
            return;
        }
        Ok(Err(e)) => {
            tracing::debug!(error = %e, dst = %key.dst, "upstream connect failed");
            reset(&client);
            flow.end(CloseReason::UpstreamUnreachable);
            return;
        }
        Err(_) => {
            tracing::debug!(dst = %key.dst, "upstream connect timed out");
            reset(&client);
            flow.end(CloseReason::UpstreamUnreachable);
            return;
        }
    };
    let tracked = flow.tracked();
    let ended = relay::relay(client, server, &config.relay, &tracked.counters, &tracked.stop).await;
    tracing::debug!(
        src = %key.src,
        dst = %key.dst,
        reason = ended.as_str(),
        to_server = tracked.counters.to_server.load(Ordering::Relaxed),
        to_client = tracked.counters.to_client.load(Ordering::Relaxed),
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

/// Connects to `dst` with the bypass mark and `TCP_NODELAY`, from `source` when given.
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
    let std: std::net::TcpStream = s.into();
    TcpSocket::from_std_stream(std).connect(dst).await
}

/// Closes with an RST: the client sees the same as from a server that refused.
fn reset(s: &TcpStream) {
    let _ = socket2::SockRef::from(s).set_linger(Some(Duration::ZERO));
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::proxy::decider::testing;
    use crate::proxy::relay::{PipePool, RelayMode};

    fn config() -> ProxyConfig {
        ProxyConfig {
            bypass_mark: 0,
            preserve_source: false,
            local_addrs: Arc::new([]),
            connect_timeout: Duration::from_secs(5),
            max_connections: 16,
            relay: RelayConfig {
                mode: RelayMode::Copy,
                pipes: Arc::new(PipePool::new(1 << 16, 2, 16)),
                idle_timeout: Duration::from_secs(60),
            },
            drain_grace: Duration::from_secs(1),
        }
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
                proxy(accepted, peer, None, &config(), &decider, &registry).await;
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
}
