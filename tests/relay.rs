//! The byte relay over real loopback TCP sockets, in every mode: data arrives intact,
//! half-close and reset propagate, idle connections time out, and a stop resets both
//! sides.
//!
//! Layout of each test: `client ⇄ [client_side | relay | server_side] ⇄ server`, where each
//! `⇄` is a loopback TCP connection.

use std::sync::Arc;
use std::time::Duration;

use tierproxy::proxy::relay::{
    Counters, PipePool, RelayConfig, RelayEnd, RelayMode, Resume, relay,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

const MODES: [RelayMode; 3] = [RelayMode::Splice, RelayMode::Copy, RelayMode::Auto];

async fn pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind loopback");
    let addr = l.local_addr().expect("local addr");
    let (outer, inner) = tokio::join!(TcpStream::connect(addr), l.accept());
    (outer.expect("connect"), inner.expect("accept").0)
}

fn config(mode: RelayMode, idle: Duration) -> RelayConfig {
    RelayConfig { mode, pipes: Arc::new(PipePool::new(1 << 20, 16, 1024)), idle_timeout: idle }
}

struct Rig {
    client: TcpStream,
    server: TcpStream,
    relay: tokio::task::JoinHandle<(RelayEnd, u64, u64)>,
    stop: std::sync::Arc<Notify>,
}

async fn rig(mode: RelayMode, idle: Duration) -> Rig {
    let (client, client_side) = pair().await;
    let (server_side, server) = pair().await;
    let stop = std::sync::Arc::new(Notify::new());
    let s = stop.clone();
    let relay = tokio::spawn(async move {
        let counters = Counters::default();
        let reason = relay(
            client_side,
            server_side,
            &config(mode, idle),
            &counters,
            &s,
            Resume::default(),
            &|| false,
        )
        .await
        .end();
        use std::sync::atomic::Ordering::Relaxed;
        (reason, counters.to_server.load(Relaxed), counters.to_client.load(Relaxed))
    });
    Rig { client, server, relay, stop }
}

/// A deterministic byte pattern and its FNV-1a checksum.
fn pattern(len: usize) -> Vec<u8> {
    let mut x: u32 = 2091;
    (0..len)
        .map(|_| {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (x >> 24) as u8
        })
        .collect()
}

fn fnv(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf29ce484222325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100000001b3))
}

#[tokio::test]
async fn bytes_arrive_intact_both_ways_and_half_close_propagates() {
    for mode in MODES {
        let Rig { mut client, mut server, relay, .. } = rig(mode, Duration::from_secs(30)).await;
        let up = pattern(8 << 20);
        let down = pattern(3 << 20);
        let (up_sum, down_sum) = (fnv(&up), fnv(&down));
        let writer = tokio::spawn(async move {
            client.write_all(&up).await.expect("client writes");
            // Half-close: the client is done sending but still reads.
            client.shutdown().await.expect("client shuts down its write side");
            let mut got = Vec::new();
            client.read_to_end(&mut got).await.expect("client reads to EOF");
            got
        });
        let mut got = Vec::new();
        server.read_to_end(&mut got).await.expect("server reads to EOF");
        assert_eq!(fnv(&got), up_sum, "{mode:?}: client→server bytes differ");
        // After the client's FIN the server can still send.
        server.write_all(&down).await.expect("server writes after client FIN");
        server.shutdown().await.expect("server shuts down");
        let back = writer.await.expect("client task");
        assert_eq!(fnv(&back), down_sum, "{mode:?}: server→client bytes differ");
        let (reason, to_server, to_client) =
            tokio::time::timeout(Duration::from_secs(5), relay).await.expect("relay ends").unwrap();
        assert_eq!(reason, RelayEnd::Normal, "{mode:?}");
        assert_eq!((to_server, to_client), (8 << 20, 3 << 20), "{mode:?}: counters");
    }
}

#[tokio::test]
async fn reset_on_one_side_resets_the_other() {
    for mode in MODES {
        let Rig { mut client, server, relay, .. } = rig(mode, Duration::from_secs(30)).await;
        client.write_all(b"ping").await.expect("write");
        // The server aborts: linger 0 then close sends an RST.
        socket2::SockRef::from(&server).set_linger(Some(Duration::ZERO)).expect("linger");
        drop(server);
        let (reason, ..) =
            tokio::time::timeout(Duration::from_secs(5), relay).await.expect("relay ends").unwrap();
        assert_eq!(reason, RelayEnd::Reset, "{mode:?}");
        let mut buf = [0u8; 16];
        let r = tokio::time::timeout(Duration::from_secs(5), client.read(&mut buf))
            .await
            .expect("client learns the connection is gone");
        let e = r.expect_err("client sees a reset, not EOF");
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{mode:?}");
    }
}

#[tokio::test]
async fn idle_connection_times_out() {
    for mode in MODES {
        let Rig { client: _c, server: _s, relay, .. } = rig(mode, Duration::from_millis(300)).await;
        let started = std::time::Instant::now();
        let (reason, ..) =
            tokio::time::timeout(Duration::from_secs(5), relay).await.expect("relay ends").unwrap();
        assert_eq!(reason, RelayEnd::Timeout, "{mode:?}");
        assert!(started.elapsed() >= Duration::from_millis(250), "{mode:?}: ended too early");
    }
}

#[tokio::test]
async fn traffic_keeps_an_idle_timer_from_firing() {
    let Rig { mut client, mut server, relay, .. } =
        rig(RelayMode::Splice, Duration::from_millis(400)).await;
    for _ in 0..6 {
        client.write_all(b"x").await.expect("write");
        let mut b = [0u8; 1];
        server.read_exact(&mut b).await.expect("read");
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    assert!(!relay.is_finished(), "relay ended while bytes kept moving");
    drop((client, server));
}

#[tokio::test]
async fn stop_resets_both_sides() {
    for mode in MODES {
        let Rig { mut client, mut server, relay, stop } = rig(mode, Duration::from_secs(30)).await;
        stop.notify_one();
        let (reason, ..) =
            tokio::time::timeout(Duration::from_secs(5), relay).await.expect("relay ends").unwrap();
        assert_eq!(reason, RelayEnd::Stopped, "{mode:?}");
        let mut buf = [0u8; 4];
        for (who, s) in [("client", &mut client), ("server", &mut server)] {
            let r = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await;
            let e = r.expect("read ends").expect_err("reset, not EOF");
            assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{mode:?} {who}");
        }
    }
}
