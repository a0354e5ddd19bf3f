//! The TCP relay in isolation: `tierproxy::proxy::relay::relay` between two loopback
//! socket pairs, splice against copy mode, next to a direct loopback connection (the
//! baseline, measured in the same run).
//!
//! ```text
//! writer ─► client pair ─► relay (thread "relay", its own current-thread runtime) ─► server pair ─► reader
//! ```
//!
//! A second group, `relay_connection`, times one short connection through the relay (64
//! bytes each way, then FIN each way) with pipes from a pool that keeps them
//! (`pooled`, the agent's [`POOLED_PIPES`]) against new pipes per connection (`fresh`):
//! the per-connection cost of creating and sizing two pipes.
//!
//! Run: `cargo bench --bench relay` (`-- splice`, `-- copy`, `-- direct`, `-- pooled` or
//! `-- fresh` for one).
//! Before criterion's timings of one [`CHUNK`] through each path it prints, per path, one
//! bounded bulk transfer ([`REPORT_BYTES`], at most [`REPORT_SECONDS`]): throughput, and CPU
//! seconds per GB of the relay thread alone (utime + stime from `/proc/self/task`; the
//! kernel's TCP work on the relay's sockets is counted where it runs, mostly on that
//! thread for splice) and of the whole process (writer, reader and relay together), so the
//! relay's share can be read against the baseline's.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group};
use tierproxy::proxy::relay::{
    CloseReason, Counters, POOLED_PIPES, PipePool, RelayConfig, RelayMode, relay,
};
use tokio::sync::Notify;

/// Bytes per criterion iteration: large enough that connection set-up and thread hand-off
/// do not show, small enough for ten samples in a few seconds.
const CHUNK: u64 = 64 << 20;
/// Bytes of the reported bulk transfer.
const REPORT_BYTES: u64 = 4 << 30;
/// Longest a reported transfer runs: it stops at whichever of the two comes first
/// (checked between [`CHUNK`]s).
const REPORT_SECONDS: f64 = 10.0;
/// Bytes per write(2) and read(2) of the writer and reader (iperf3's default is 128 KiB).
const IO_BYTES: usize = 128 << 10;
/// Longest a single read or write may block: a stuck relay fails the bench, never hangs it.
const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// The agent's pipe size ([`tierproxy::agent::DEFAULT_PIPE_BYTES`]).
const PIPE_BYTES: usize = tierproxy::agent::DEFAULT_PIPE_BYTES;

/// A path from a writer socket to a reader socket: direct, or through a relay.
struct Path {
    writer: TcpStream,
    reader: TcpStream,
    relay: Option<std::thread::JoinHandle<CloseReason>>,
}

/// A connected loopback pair: (the end `connect` returned, the end `accept` returned).
fn pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    let a = TcpStream::connect(l.local_addr().expect("local addr")).expect("connect");
    let (b, _) = l.accept().expect("accept");
    for s in [&a, &b] {
        s.set_nodelay(true).expect("nodelay");
        s.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
        s.set_write_timeout(Some(IO_TIMEOUT)).expect("timeout");
    }
    (a, b)
}

impl Path {
    fn direct() -> Path {
        let (writer, reader) = pair();
        Path { writer, reader, relay: None }
    }

    /// Starts a relay in `mode` on a thread named `relay`, between the accepted end of
    /// the writer's pair and the connecting end of the reader's pair (as the agent holds
    /// an accepted client and an upstream it connected).
    fn relayed(mode: RelayMode) -> Path {
        let (writer, client) = pair();
        let (server, reader) = pair();
        let relay = std::thread::Builder::new()
            .name("relay".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                rt.block_on(async move {
                    for s in [&client, &server] {
                        s.set_nonblocking(true).expect("nonblocking");
                    }
                    let client = tokio::net::TcpStream::from_std(client).expect("client");
                    let server = tokio::net::TcpStream::from_std(server).expect("server");
                    let config = RelayConfig {
                        mode,
                        pipes: Arc::new(PipePool::new(PIPE_BYTES, 0, 1024)),
                        idle_timeout: Duration::from_secs(60),
                    };
                    let counters = Counters::default();
                    let stop = Arc::new(Notify::new());
                    relay(client, server, &config, &counters, &stop).await
                })
            })
            .expect("relay thread");
        Path { writer, reader, relay: Some(relay) }
    }

    /// Moves exactly `bytes` from the writer (on a thread of its own) to the reader;
    /// returns the wall time.
    fn transfer(&self, bytes: u64) -> Duration {
        let mut w = self.writer.try_clone().expect("clone writer");
        let mut r = &self.reader;
        let t = Instant::now();
        std::thread::scope(|s| {
            s.spawn(move || {
                let buf = vec![0x5au8; IO_BYTES];
                let mut sent = 0u64;
                while sent < bytes {
                    let n = (bytes - sent).min(IO_BYTES as u64) as usize;
                    w.write_all(&buf[..n]).expect("write");
                    sent += n as u64;
                }
            });
            let mut buf = vec![0u8; IO_BYTES];
            let mut got = 0u64;
            while got < bytes {
                let want = (bytes - got).min(IO_BYTES as u64) as usize;
                let n = r.read(&mut buf[..want]).expect("read");
                assert!(n > 0, "the path closed after {got} of {bytes} bytes");
                got += n as u64;
            }
        });
        t.elapsed()
    }

    /// Moves [`CHUNK`]s until `bytes` have moved or `seconds` have passed (checked
    /// between chunks); returns the bytes moved and the wall time.
    fn bulk(&self, bytes: u64, seconds: f64) -> (u64, Duration) {
        let t = Instant::now();
        let mut moved = 0;
        while moved < bytes && t.elapsed().as_secs_f64() < seconds {
            self.transfer(CHUNK.min(bytes - moved));
            moved += CHUNK.min(bytes - moved);
        }
        (moved, t.elapsed())
    }

    /// Closes both ends' write sides and checks the relay ended normally (FIN each way).
    fn close(self) {
        self.writer.shutdown(Shutdown::Write).expect("shutdown writer");
        self.reader.shutdown(Shutdown::Write).expect("shutdown reader");
        let mut rest = Vec::new();
        let _ = (&self.reader).read_to_end(&mut rest);
        let _ = (&self.writer).read_to_end(&mut rest);
        if let Some(h) = self.relay {
            assert_eq!(h.join().expect("relay thread"), CloseReason::Normal);
        }
    }
}

/// CPU seconds (user + system) of this process's threads named `name`, or of all of its
/// threads when `name` is `None`.
fn cpu_seconds(name: Option<&str>) -> f64 {
    let tick = 100.0; // USER_HZ on Linux
    let mut total = 0u64;
    for t in std::fs::read_dir("/proc/self/task").into_iter().flatten().flatten() {
        if let Some(name) = name {
            let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
            if comm.trim_end() != name {
                continue;
            }
        }
        let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
        // Fields after the command name (which ends with ')'): utime is the 14th field of
        // the line, stime the 15th.
        let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
        let f: Vec<&str> = rest.split_whitespace().collect();
        let utime: u64 = f.get(11).and_then(|s| s.parse().ok()).unwrap_or(0);
        let stime: u64 = f.get(12).and_then(|s| s.parse().ok()).unwrap_or(0);
        total += utime + stime;
    }
    total as f64 / tick
}

/// Whether the path `name` was asked for: `cargo bench --bench relay -- [WORD...]` runs
/// the paths whose name contains a word (all without words).
fn wanted(name: &str) -> bool {
    let words: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    words.is_empty() || words.iter().any(|w| name.contains(w.as_str()))
}

fn new_path(name: &str) -> Path {
    match name {
        "splice" => Path::relayed(RelayMode::Splice),
        "copy" => Path::relayed(RelayMode::Copy),
        _ => Path::direct(),
    }
}

const PATHS: [&str; 3] = ["direct", "splice", "copy"];

fn report() {
    println!(
        "relay: one bulk transfer per path ({} GiB or {REPORT_SECONDS} s, {} KiB writes)",
        REPORT_BYTES >> 30,
        IO_BYTES >> 10
    );
    for name in PATHS {
        if !wanted(name) {
            continue;
        }
        let path = new_path(name);
        // Warm up: socket buffers grown, pages touched.
        path.transfer(CHUNK);
        let (relay0, all0) = (cpu_seconds(Some("relay")), cpu_seconds(None));
        let (bytes, wall) = path.bulk(REPORT_BYTES, REPORT_SECONDS);
        let (relay1, all1) = (cpu_seconds(Some("relay")), cpu_seconds(None));
        path.close();
        let gb = bytes as f64 / 1e9;
        let relay_cpu = if name == "direct" {
            "         -".to_string()
        } else {
            format!("{:>10.3}", (relay1 - relay0) / gb)
        };
        println!(
            "{name:<7} {:>7.2} Gbit/s  relay thread {relay_cpu} CPU-s/GB  whole process {:>6.3} CPU-s/GB  ({:.2} GB in {:.2} s)",
            bytes as f64 * 8.0 / wall.as_secs_f64() / 1e9,
            (all1 - all0) / gb,
            gb,
            wall.as_secs_f64()
        );
    }
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("relay");
    g.throughput(Throughput::Bytes(CHUNK));
    g.sample_size(10);
    g.warm_up_time(Duration::from_secs(1));
    g.measurement_time(Duration::from_secs(5));
    for name in PATHS {
        if !wanted(name) {
            continue;
        }
        let path = new_path(name);
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                // Bounded by criterion's iteration count; each transfer by IO_TIMEOUT
                // per read and write.
                (0..iters).map(|_| path.transfer(CHUNK)).sum()
            })
        });
        path.close();
    }
    g.finish();
}

/// A connected loopback pair on the current runtime: (connecting end, accepted end).
async fn tokio_pair() -> (tokio::net::TcpStream, tokio::net::TcpStream) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind loopback");
    let a =
        tokio::net::TcpStream::connect(l.local_addr().expect("local addr")).await.expect("connect");
    let (b, _) = l.accept().await.expect("accept");
    (a, b)
}

/// One short connection through [`relay`] with pipes from `pipes`: 64 bytes each way,
/// then FIN each way. Returns the wall time from handing the sockets to the relay to its
/// return (the sockets' set-up is not timed). Bounded by [`IO_TIMEOUT`].
async fn short_connection(pipes: &Arc<PipePool>) -> Duration {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut client_app, client) = tokio_pair().await;
    let (server, mut server_app) = tokio_pair().await;
    let config = RelayConfig {
        mode: RelayMode::Splice,
        pipes: pipes.clone(),
        idle_timeout: Duration::from_secs(60),
    };
    let (counters, stop) = (Counters::default(), Notify::new());
    let t = Instant::now();
    let apps = async {
        let mut b = [0u8; 64];
        client_app.write_all(&[1; 64]).await.expect("request");
        server_app.read_exact(&mut b).await.expect("request arrives");
        server_app.write_all(&b).await.expect("response");
        client_app.read_exact(&mut b).await.expect("response arrives");
        client_app.shutdown().await.expect("client FIN");
        server_app.shutdown().await.expect("server FIN");
        assert_eq!(server_app.read(&mut b).await.expect("EOF"), 0);
        assert_eq!(client_app.read(&mut b).await.expect("EOF"), 0);
    };
    let both = async { tokio::join!(relay(client, server, &config, &counters, &stop), apps) };
    let (reason, ()) = tokio::time::timeout(IO_TIMEOUT, both).await.expect("connection done");
    assert_eq!(reason, CloseReason::Normal);
    t.elapsed()
}

fn bench_connection(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let mut g = c.benchmark_group("relay_connection");
    g.throughput(Throughput::Elements(1));
    g.warm_up_time(Duration::from_secs(1));
    g.measurement_time(Duration::from_secs(5));
    for (name, keep) in [("pooled", POOLED_PIPES), ("fresh", 0)] {
        if !wanted(name) {
            continue;
        }
        let pipes = Arc::new(PipePool::new(PIPE_BYTES, keep, 1024));
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        total += short_connection(&pipes).await;
                    }
                    total
                })
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench, bench_connection);

fn main() {
    report();
    benches();
    Criterion::default().configure_from_args().final_summary();
}
