//! The TCP relay in isolation: `tierproxy::proxy::relay::relay` between two loopback
//! socket pairs, splice, copy and auto mode, next to a direct loopback connection (the
//! baseline, measured in the same run), and an io_uring relay that is not the agent's
//! ([`uring_relay`], `uring`: recv/send on a ring per relay thread; left out, saying why,
//! where io_uring is not allowed) to tell whether one would be worth building.
//!
//! ```text
//! writer ─► client pair ─► relay (thread "relay", its own current-thread runtime) ─► server pair ─► reader
//! ```
//!
//! A second group, `relay_connection`, times one short connection through the relay (64
//! bytes each way, then FIN each way) in each mode with pipes from a pool that keeps them
//! (`*_pooled`, the agent's [`POOLED_PIPES`]), and in splice mode with new pipes per
//! connection (`splice_fresh`): the per-connection cost of creating and sizing two pipes.
//!
//! Run: `cargo bench --bench relay` (`-- splice`, `-- copy`, `-- auto`, `-- uring`, `-- direct`,
//! `-- pooled` or `-- fresh` for some; `RELAY_REPORTS_ONLY=1` for the reports below without
//! criterion's timings).
//!
//! Before criterion's timings it prints three reports, each of [`REPORT_ROUNDS`] rounds in
//! which the paths take turns (their order rotating), with per path the median over rounds
//! and, against the baseline's value in the same round, the median ratio and its range
//! (the machine is shared with builds; the range says how noisy the run was):
//! - request/response: [`RR_COUNT`] round trips of [`RR_BYTES`] each way over one
//!   connection (p50, p99, round trips per second), against the direct path;
//! - per connection: [`CONN_COUNT`] short connections per mode, median time each, against
//!   splice with pooled pipes (the agent's modes only: the relay runs on the applications'
//!   runtime thread, where a blocking io_uring loop cannot);
//! - bulk: one transfer ([`BULK_BYTES`], at most [`BULK_SECONDS`]) per path: throughput,
//!   and CPU seconds per GB of the relay thread alone (utime + stime from
//!   `/proc/self/task`; the kernel's TCP work on the relay's sockets is counted where it
//!   runs, mostly on that thread for splice) and of the whole process (writer, reader and
//!   relay together), against splice.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group};
use tierproxy::proxy::relay::{
    Counters, POOLED_PIPES, PipePool, RelayConfig, RelayEnd, RelayMode, Resume, relay,
};
use tokio::sync::Notify;

/// Bytes per criterion iteration: large enough that connection set-up and thread hand-off
/// do not show, small enough for ten samples in a few seconds.
const CHUNK: u64 = 64 << 20;
/// Longest the round trips of one path and round run (checked every 1,000 round trips),
/// and the connections of one mode and round.
const REPORT_SECONDS: f64 = 10.0;
/// Bytes per write(2) and read(2) of the writer and reader (iperf3's default is 128 KiB).
const IO_BYTES: usize = 128 << 10;
/// Longest a single read or write may block: a stuck relay fails the bench, never hangs it.
const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// Bytes of a request and of its response in the request/response report (netperf
/// TCP_RR's default is 1).
const RR_BYTES: usize = 64;
/// Round trips per path and round in the request/response report, bounded by
/// [`REPORT_SECONDS`].
const RR_COUNT: usize = 10_000;
/// Rounds of each report: the paths alternate within a round, and ratios are taken within
/// a round (the machine is shared).
const REPORT_ROUNDS: usize = 5;
/// Short connections per mode and round in the connection report.
const CONN_COUNT: u32 = 2_000;
/// Bytes of a bulk transfer per path and round.
const BULK_BYTES: u64 = 2 << 30;
/// Longest a bulk transfer runs per path and round (checked between [`CHUNK`]s).
const BULK_SECONDS: f64 = 5.0;
/// The agent's pipe size ([`tierproxy::config::DEFAULT_PIPE_BYTES`]).
const PIPE_BYTES: usize = tierproxy::config::DEFAULT_PIPE_BYTES;

/// A path from a writer socket to a reader socket: direct, or through a relay.
struct Path {
    writer: TcpStream,
    reader: TcpStream,
    relay: Option<std::thread::JoinHandle<RelayEnd>>,
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
                    relay(client, server, &config, &counters, &stop, Resume::default(), &|| false)
                        .await
                        .end()
                })
            })
            .expect("relay thread");
        Path { writer, reader, relay: Some(relay) }
    }

    /// Starts an io_uring relay ([`uring_relay`]) on a thread named `relay`, like
    /// [`Path::relayed`].
    fn uring() -> Path {
        let (writer, client) = pair();
        let (server, reader) = pair();
        let relay = std::thread::Builder::new()
            .name("relay".into())
            .spawn(move || {
                uring_relay(&client, &server).expect("io_uring relay");
                RelayEnd::Normal
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
                let n = match r.read(&mut buf[..want]) {
                    // Seen once with the io_uring path: the read returned EINTR.
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    r => r.expect("read"),
                };
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
            assert_eq!(h.join().expect("relay thread"), RelayEnd::Normal);
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
        "auto" => Path::relayed(RelayMode::Auto),
        "uring" => Path::uring(),
        _ => Path::direct(),
    }
}

const PATHS: [&str; 5] = ["direct", "splice", "copy", "auto", "uring"];

/// Bytes of each direction's buffer in [`uring_relay`] (the copy mode's).
const URING_BUFFER: usize = 64 << 10;

/// Whether this process may use io_uring: `Err` with the reason when the kernel has it
/// disabled (`kernel.io_uring_disabled`, `EPERM`), a seccomp filter refuses
/// `io_uring_setup` (container runtimes' default profiles: `EPERM`) or the kernel lacks it
/// (`ENOSYS`).
fn uring_available() -> Result<(), String> {
    io_uring::IoUring::new(2).map(|_| ()).map_err(|e| e.to_string())
}

/// A relay on io_uring, what the design card calls the "io_uring-style hot path" in its
/// simplest form: one ring per relay thread, both sockets registered (fixed files), per
/// direction a `recv` into its buffer and, when it completes, a `send` of what it got
/// (again until all is sent), then the next `recv`; EOF shuts down the other side's write
/// side. One `io_uring_enter` submits what the last completions asked for and waits for
/// the next. Blocking sockets: io_uring polls them itself. Ends when both directions saw
/// EOF; an error ends it with that error.
///
/// Source: io_uring_enter(2) (`IORING_OP_RECV`, `IORING_OP_SEND`, `IOSQE_FIXED_FILE`),
/// io_uring_register(2) (`IORING_REGISTER_FILES`).
fn uring_relay(a: &TcpStream, b: &TcpStream) -> std::io::Result<()> {
    use io_uring::{IoUring, opcode, squeue, types};
    use std::os::fd::AsRawFd;
    let mut ring = IoUring::new(8)?;
    ring.submitter().register_files(&[a.as_raw_fd(), b.as_raw_fd()])?;
    let socks = [a, b];
    // Freed only once no operation is in flight: an early return (an error) leaks them,
    // as the kernel may still write into a buffer of a `recv` it has not completed.
    let mut bufs = std::mem::ManuallyDrop::new([vec![0u8; URING_BUFFER], vec![0u8; URING_BUFFER]]);
    // Per direction (0: a → b, 1: b → a): bytes received and bytes of them sent.
    let mut got = [0usize; 2];
    let mut sent = [0usize; 2];
    // user_data: direction * 2 + (0 recv, 1 send).
    let recv = |d: usize, buf: &mut [u8]| -> squeue::Entry {
        opcode::Recv::new(types::Fixed(d as u32), buf.as_mut_ptr(), buf.len() as u32)
            .build()
            .user_data((d * 2) as u64)
    };
    let send = |d: usize, buf: &[u8]| -> squeue::Entry {
        opcode::Send::new(types::Fixed(1 - d as u32), buf.as_ptr(), buf.len() as u32)
            .build()
            .user_data((d * 2 + 1) as u64)
    };
    for (d, buf) in bufs.iter_mut().enumerate() {
        let e = recv(d, buf);
        // SAFETY: `bufs` is freed only when no operation is in flight (see above).
        unsafe { ring.submission().push(&e).expect("submission queue has room") };
    }
    let mut open = 2;
    let mut in_flight = 2;
    let mut done = Vec::with_capacity(4);
    while open > 0 {
        ring.submit_and_wait(1)?;
        done.clear();
        done.extend(ring.completion().map(|c| (c.user_data(), c.result())));
        for &(ud, res) in &done {
            in_flight -= 1;
            let (d, is_send) = ((ud / 2) as usize, ud % 2 == 1);
            if res < 0 {
                return Err(std::io::Error::from_raw_os_error(-res));
            }
            let e = if !is_send {
                if res == 0 {
                    socks[1 - d].shutdown(Shutdown::Write)?;
                    open -= 1;
                    continue;
                }
                (got[d], sent[d]) = (res as usize, 0);
                send(d, &bufs[d][..got[d]])
            } else {
                sent[d] += res as usize;
                if sent[d] < got[d] {
                    send(d, &bufs[d][sent[d]..got[d]])
                } else {
                    recv(d, &mut bufs[d])
                }
            };
            // SAFETY: as above.
            unsafe { ring.submission().push(&e).expect("submission queue has room") };
            in_flight += 1;
        }
    }
    if in_flight == 0 {
        // SAFETY: no operation uses them any more, and they are not used after this.
        unsafe { std::mem::ManuallyDrop::drop(&mut bufs) };
    }
    Ok(())
}

/// Round trips of [`RR_BYTES`] each way over `path` (the reader echoes), at most
/// [`RR_COUNT`] or [`REPORT_SECONDS`]: the latencies, sorted, and the wall time.
fn round_trips(path: &Path) -> (Vec<Duration>, Duration) {
    let mut w = &path.writer;
    let mut echo = path.reader.try_clone().expect("clone reader");
    let (tx, rx) = std::sync::mpsc::channel::<usize>();
    std::thread::scope(|s| {
        s.spawn(move || {
            let mut buf = [0u8; RR_BYTES];
            // Each batch's count comes first, so the echo ends when the sender is dropped.
            while let Ok(n) = rx.recv() {
                for _ in 0..n {
                    echo.read_exact(&mut buf).expect("request");
                    echo.write_all(&buf).expect("response");
                }
            }
        });
        let mut lat = Vec::with_capacity(RR_COUNT);
        let req = [0x5au8; RR_BYTES];
        let mut resp = [0u8; RR_BYTES];
        let t = Instant::now();
        // Sent in batches of 1,000 so the echo knows how many to answer.
        while lat.len() < RR_COUNT && t.elapsed().as_secs_f64() < REPORT_SECONDS {
            tx.send(1000).expect("echo alive");
            for _ in 0..1000 {
                let t0 = Instant::now();
                w.write_all(&req).expect("request");
                w.read_exact(&mut resp).expect("response");
                lat.push(t0.elapsed());
            }
        }
        drop(tx);
        let wall = t.elapsed();
        lat.sort_unstable();
        (lat, wall)
    })
}

/// The paths asked for, in an order that rotates with `round`, so that none always runs
/// first or last (the machine is shared: load drifts over a run).
fn rotated(round: usize) -> Vec<&'static str> {
    let uring = uring_available().is_ok();
    let mut names: Vec<&'static str> =
        PATHS.iter().copied().filter(|n| wanted(n) && (uring || *n != "uring")).collect();
    if !names.is_empty() {
        let k = round % names.len();
        names.rotate_left(k);
    }
    names
}

/// The median of `v` (the upper one of an even count).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Per path, per round: values of one measurement.
type Rounds = std::collections::BTreeMap<&'static str, Vec<Vec<f64>>>;

/// Prints, per path, the median over rounds of each value and, against `base`'s value in
/// the same round, the median ratio and its range over rounds.
fn print_rounds(rows: &Rounds, names: &[&str], base: &str, labels: &[&str]) {
    for &name in names {
        let Some(rounds) = rows.get(name) else { continue };
        let mut line = format!("{name:<7}");
        for (i, label) in labels.iter().enumerate() {
            let v: Vec<f64> = rounds.iter().map(|r| r[i]).collect();
            line += &format!("  {label} {:>9.3}", median(v));
        }
        if let Some(b) = rows.get(base) {
            line += &format!("  | against {base}:");
            for (i, label) in labels.iter().enumerate() {
                let ratios: Vec<f64> = rounds.iter().zip(b).map(|(r, b)| r[i] / b[i]).collect();
                let (lo, hi) = ratios
                    .iter()
                    .fold((f64::MAX, f64::MIN), |(lo, hi), x| (lo.min(*x), hi.max(*x)));
                line += &format!(" {label} {:.2}× [{lo:.2}–{hi:.2}]", median(ratios));
            }
        }
        println!("{line}");
    }
}

fn rr_report() {
    println!(
        "relay: request/response, {RR_BYTES} B each way, {REPORT_ROUNDS} rounds of up to {RR_COUNT} round trips or {REPORT_SECONDS} s per path (medians over rounds; ratio ranges in brackets)"
    );
    let mut rows = Rounds::new();
    for round in 0..REPORT_ROUNDS {
        for name in rotated(round) {
            let path = new_path(name);
            let (lat, wall) = round_trips(&path);
            path.close();
            let us = |q: f64| lat[((lat.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e6;
            let rate = lat.len() as f64 / wall.as_secs_f64();
            rows.entry(name).or_default().push(vec![us(0.5), us(0.99), rate]);
        }
    }
    print_rounds(&rows, &PATHS, "direct", &["p50_us", "p99_us", "rt_per_s"]);
}

fn report() {
    println!(
        "relay: bulk, {REPORT_ROUNDS} rounds of one transfer per path ({} GiB or {BULK_SECONDS} s, {} KiB writes); CPU-s/GB of the relay thread and of the whole process",
        BULK_BYTES >> 30,
        IO_BYTES >> 10
    );
    let mut rows = Rounds::new();
    for round in 0..REPORT_ROUNDS {
        for name in rotated(round) {
            let path = new_path(name);
            // Warm up: socket buffers grown, pages touched.
            path.transfer(CHUNK);
            let (relay0, all0) = (cpu_seconds(Some("relay")), cpu_seconds(None));
            let (bytes, wall) = path.bulk(BULK_BYTES, BULK_SECONDS);
            let (relay1, all1) = (cpu_seconds(Some("relay")), cpu_seconds(None));
            path.close();
            let gb = bytes as f64 / 1e9;
            let gbps = bytes as f64 * 8.0 / wall.as_secs_f64() / 1e9;
            rows.entry(name).or_default().push(vec![
                gbps,
                (relay1 - relay0) / gb,
                (all1 - all0) / gb,
            ]);
        }
    }
    print_rounds(&rows, &PATHS, "splice", &["Gbit/s", "relay_cpu", "all_cpu"]);
}

/// Per mode, [`REPORT_ROUNDS`] rounds of up to [`CONN_COUNT`] short connections
/// ([`short_connection`], at most [`REPORT_SECONDS`] each): median µs per connection.
fn conn_report() {
    println!(
        "relay_connection: {REPORT_ROUNDS} rounds of up to {CONN_COUNT} short connections per mode (64 B each way, FIN each way), median µs per connection"
    );
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let mut rows = Rounds::new();
    for round in 0..REPORT_ROUNDS {
        let mut modes = CONN_MODES.to_vec();
        let k = round % modes.len();
        modes.rotate_left(k);
        for (name, mode, keep) in modes {
            if !wanted(name) {
                continue;
            }
            let pipes = Arc::new(PipePool::new(PIPE_BYTES, keep, 1024));
            let t = Instant::now();
            let mut each = Vec::with_capacity(CONN_COUNT as usize);
            rt.block_on(async {
                let l = Listeners::new().await;
                while each.len() < CONN_COUNT as usize && t.elapsed().as_secs_f64() < REPORT_SECONDS
                {
                    each.push(short_connection(mode, &pipes, &l).await.as_secs_f64() * 1e6);
                }
            });
            rows.entry(name).or_default().push(vec![median(each)]);
        }
    }
    let names: Vec<&str> = CONN_MODES.iter().map(|m| m.0).collect();
    print_rounds(&rows, &names, "splice_pooled", &["us_per_conn"]);
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

/// The two listeners short connections are made to, kept for a whole measurement: a
/// listener bound anew per connection made `bind(0)` search an ephemeral range full of
/// TIME_WAIT sockets, slower with every connection.
struct Listeners {
    client: tokio::net::TcpListener,
    server: tokio::net::TcpListener,
}

impl Listeners {
    async fn new() -> Listeners {
        let bind = || tokio::net::TcpListener::bind("127.0.0.1:0");
        Listeners {
            client: bind().await.expect("bind loopback"),
            server: bind().await.expect("bind loopback"),
        }
    }
}

/// A connected loopback pair on the current runtime through `l`: (connecting end,
/// accepted end).
async fn tokio_pair(l: &tokio::net::TcpListener) -> (tokio::net::TcpStream, tokio::net::TcpStream) {
    let a =
        tokio::net::TcpStream::connect(l.local_addr().expect("local addr")).await.expect("connect");
    let (b, _) = l.accept().await.expect("accept");
    (a, b)
}

/// One short connection through [`relay`] with pipes from `pipes`: 64 bytes each way,
/// then FIN each way. Returns the wall time from handing the sockets to the relay to its
/// return (the sockets' set-up is not timed). Bounded by [`IO_TIMEOUT`].
async fn short_connection(mode: RelayMode, pipes: &Arc<PipePool>, l: &Listeners) -> Duration {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut client_app, client) = tokio_pair(&l.client).await;
    let (server, mut server_app) = tokio_pair(&l.server).await;
    let config = RelayConfig { mode, pipes: pipes.clone(), idle_timeout: Duration::from_secs(60) };
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
    let both = async {
        tokio::join!(
            async {
                relay(client, server, &config, &counters, &stop, Resume::default(), &|| false)
                    .await
                    .end()
            },
            apps
        )
    };
    let (reason, ()) = tokio::time::timeout(IO_TIMEOUT, both).await.expect("connection done");
    assert_eq!(reason, RelayEnd::Normal);
    t.elapsed()
}

fn bench_connection(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let mut g = c.benchmark_group("relay_connection");
    g.throughput(Throughput::Elements(1));
    g.warm_up_time(Duration::from_secs(1));
    g.measurement_time(Duration::from_secs(5));
    for (name, mode, keep) in CONN_MODES {
        if !wanted(name) {
            continue;
        }
        let pipes = Arc::new(PipePool::new(PIPE_BYTES, keep, 1024));
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let (l, mut total) = (Listeners::new().await, Duration::ZERO);
                    for _ in 0..iters {
                        total += short_connection(mode, &pipes, &l).await;
                    }
                    total
                })
            })
        });
    }
    g.finish();
}

/// The modes `relay_connection` compares: name, mode, idle pipes the pool keeps.
const CONN_MODES: [(&str, RelayMode, usize); 4] = [
    ("splice_pooled", RelayMode::Splice, POOLED_PIPES),
    ("splice_fresh", RelayMode::Splice, 0),
    ("copy_pooled", RelayMode::Copy, POOLED_PIPES),
    ("auto_pooled", RelayMode::Auto, POOLED_PIPES),
];

criterion_group!(benches, bench, bench_connection);

fn main() {
    if let Err(e) = uring_available() {
        println!("relay: no io_uring here ({e}): the uring path is left out");
    }
    rr_report();
    conn_report();
    report();
    // `RELAY_REPORTS_ONLY=1`: the interleaved reports above without criterion's timings.
    if std::env::var_os("RELAY_REPORTS_ONLY").is_some() {
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
