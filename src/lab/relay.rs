//! A minimal terminating TCP relay (`tierproxy lab relay`): the floor of what any userspace
//! proxy on the path costs, measured by `loadtest/run`'s `relay` variant beside kernel
//! forwarding and tierproxy (issue #7: "if a target is physically out of reach on this
//! machine, show the measurement that proves it").
//!
//! It does only what every terminating proxy must: accept the client's connection, connect
//! to the destination, and move bytes both ways until each side's EOF, passed on as a
//! half-close. No policy decision, no TPROXY or NFQUEUE, no audit, no async runtime, no
//! connection tracking: each direction is a thread blocked in `splice(2)` (or `read(2)`
//! with `--copy`), so a message costs one wake-up and two system calls, the least a relay
//! can spend. Threads are kept and reused (a cached pool, as the new-connection rate of a
//! thread-per-connection relay would otherwise measure `clone(2)`), and so is each thread's
//! pipe. Every socket has `TCP_NODELAY`, as tierproxy's have.
//!
//! Not for production: one thread per direction of every live connection, no limits.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crossbeam_channel::{Receiver, Sender};
use nix::fcntl::{SpliceFFlags, splice};

/// Capacity asked for each thread's pipe, in bytes.
const PIPE_SIZE: i32 = 1 << 20;

/// One `LISTEN=TO` pair of `lab relay --map`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapping {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// Where each accepted connection is relayed to.
    pub to: SocketAddr,
}

impl std::str::FromStr for Mapping {
    type Err = String;

    /// `LISTEN=TO`, both `ip:port` (`[v6]:port`).
    fn from_str(s: &str) -> Result<Self, String> {
        let (l, t) = s.split_once('=').ok_or_else(|| format!("{s:?}: expected LISTEN=TO"))?;
        let parse = |a: &str, what: &str| {
            a.parse::<SocketAddr>().map_err(|e| format!("{s:?}: {what} {a:?}: {e}"))
        };
        Ok(Mapping { listen: parse(l, "listen address")?, to: parse(t, "destination")? })
    }
}

/// How bytes are moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `splice(2)` through a pipe per thread (tierproxy's hot path, DESIGN §7).
    Splice,
    /// `read(2)` into and `write(2)` from a 256 KiB buffer.
    Copy,
}

/// One direction of one connection.
struct Job {
    from: TcpStream,
    to: TcpStream,
}

/// Threads that each run one [`Job`] at a time, waiting for the next between jobs.
/// Every submitted job gets a thread at once (a new one if none is idle): the two
/// directions of a connection depend on each other, so a job must never wait for a
/// thread.
#[derive(Clone)]
struct Pool {
    tx: Sender<Job>,
    rx: Receiver<Job>,
    /// Threads waiting for a job and not yet promised one.
    idle: Arc<AtomicUsize>,
    mode: Mode,
}

impl Pool {
    fn new(mode: Mode) -> Pool {
        let (tx, rx) = crossbeam_channel::unbounded();
        Pool { tx, rx, idle: Arc::new(AtomicUsize::new(0)), mode }
    }

    fn submit(&self, job: Job) -> io::Result<()> {
        // Promise the job to an idle thread, or start one for it.
        if self
            .idle
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_err()
        {
            let pool = self.clone();
            std::thread::Builder::new().name("relay".into()).spawn(move || pool.work())?;
        }
        self.tx.send(job).map_err(|_| io::Error::other("relay pool closed"))
    }

    fn work(self) {
        let mut pipe: Option<(OwnedFd, OwnedFd)> = None;
        let mut buf = Vec::new();
        loop {
            let Ok(job) = self.rx.recv() else { return };
            let clean = match self.mode {
                Mode::Splice => {
                    if pipe.is_none() {
                        match nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC) {
                            Ok(p) => {
                                // As tierproxy's relay pipes (DESIGN §7); the default
                                // 64 KiB where the kernel refuses.
                                let _ = nix::fcntl::fcntl(
                                    &p.1,
                                    nix::fcntl::FcntlArg::F_SETPIPE_SZ(PIPE_SIZE),
                                );
                                pipe = Some(p);
                            }
                            Err(e) => {
                                eprintln!("relay: pipe2: {e}");
                                abort(&job);
                                return;
                            }
                        }
                    }
                    let (r, w) = pipe.as_ref().expect("set above");
                    splice_until_eof(&job, r, w)
                }
                Mode::Copy => {
                    buf.resize(256 << 10, 0);
                    copy_until_eof(&job, &mut buf)
                }
            };
            match clean {
                // Half-close: the other direction goes on.
                Ok(()) => {
                    let _ = job.to.shutdown(Shutdown::Write);
                }
                Err(_) => {
                    abort(&job);
                    // Bytes may be left in the pipe: it is not reused.
                    pipe = None;
                }
            }
            drop(job);
            self.idle.fetch_add(1, Ordering::AcqRel);
        }
    }
}

/// Ends both directions of a failed connection (the other direction's thread wakes up).
fn abort(job: &Job) {
    let _ = job.from.shutdown(Shutdown::Both);
    let _ = job.to.shutdown(Shutdown::Both);
}

/// Moves `job.from` to `job.to` through the pipe `r`/`w` until `from`'s EOF; the pipe is
/// empty again on `Ok`.
fn splice_until_eof(job: &Job, r: &OwnedFd, w: &OwnedFd) -> io::Result<()> {
    const CHUNK: usize = 1 << 20;
    let flags = SpliceFFlags::SPLICE_F_MOVE;
    loop {
        let n = splice(job.from.as_fd(), None, w, None, CHUNK, flags)?;
        if n == 0 {
            return Ok(());
        }
        let mut left = n;
        while left > 0 {
            let m = splice(r, None, job.to.as_fd(), None, left, flags)?;
            if m == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            left -= m;
        }
    }
}

/// Moves `job.from` to `job.to` through `buf` until `from`'s EOF.
fn copy_until_eof(job: &Job, buf: &mut [u8]) -> io::Result<()> {
    let (mut from, mut to) = (&job.from, &job.to);
    loop {
        let n = match from.read(buf) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        to.write_all(&buf[..n])?;
    }
}

/// Accepts on `listener` and relays each connection to `to` until the process ends.
fn serve(listener: TcpListener, to: SocketAddr, pool: Pool) {
    for client in listener.incoming() {
        let client = match client {
            Ok(c) => c,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                eprintln!("relay: accept for {to}: {e}");
                std::thread::sleep(std::time::Duration::from_millis(50));
                continue;
            }
        };
        let connected = TcpStream::connect(to).and_then(|upstream| {
            client.set_nodelay(true)?;
            upstream.set_nodelay(true)?;
            let there = Job { from: client.try_clone()?, to: upstream.try_clone()? };
            let back = Job { from: upstream, to: client.try_clone()? };
            pool.submit(there)?;
            pool.submit(back)
        });
        if let Err(e) = connected {
            eprintln!("relay: to {to}: {e}");
            let _ = client.shutdown(Shutdown::Both);
        }
    }
}

/// Binds every mapping's listen address (all before serving any, so a bad address fails
/// at once), prints `listening on ADDR ...` on stdout, then serves them all until the
/// process is killed.
///
/// # Errors
/// The first listen address that cannot be bound.
pub fn run(mappings: &[Mapping], mode: Mode) -> io::Result<()> {
    let mut listeners = Vec::new();
    for m in mappings {
        let l = TcpListener::bind(m.listen)
            .map_err(|e| io::Error::new(e.kind(), format!("bind {}: {e}", m.listen)))?;
        listeners.push((l, m.to));
    }
    let addrs: Vec<String> = mappings.iter().map(|m| m.listen.to_string()).collect();
    let mut out = io::stdout().lock();
    writeln!(out, "listening on {}", addrs.join(" "))?;
    out.flush()?;
    drop(out);
    let pool = Pool::new(mode);
    let threads: Vec<_> = listeners
        .into_iter()
        .map(|(l, to)| {
            let pool = pool.clone();
            std::thread::spawn(move || serve(l, to, pool))
        })
        .collect();
    for t in threads {
        let _ = t.join();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server that half-closes after the client's EOF; its address.
    fn echo() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for s in l.incoming().take(16) {
                let mut s = s.unwrap();
                std::thread::spawn(move || {
                    let mut r = s.try_clone().unwrap();
                    io::copy(&mut r, &mut s).unwrap();
                    s.shutdown(Shutdown::Write).unwrap();
                });
            }
        });
        addr
    }

    fn relay(mode: Mode, to: SocketAddr) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || serve(l, to, Pool::new(mode)));
        addr
    }

    #[test]
    fn relays_both_ways_with_half_close_and_reuses_threads() {
        let to = echo();
        for mode in [Mode::Splice, Mode::Copy] {
            let addr = relay(mode, to);
            // Sequential connections: the second and later reuse the first's threads.
            for size in [1usize, 64, 3 << 20] {
                let mut c = TcpStream::connect(addr).unwrap();
                c.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
                let data: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
                let mut w = c.try_clone().unwrap();
                let sent = data.clone();
                let writer = std::thread::spawn(move || {
                    w.write_all(&sent).unwrap();
                    w.shutdown(Shutdown::Write).unwrap();
                });
                let mut back = Vec::new();
                c.read_to_end(&mut back).unwrap();
                writer.join().unwrap();
                assert_eq!(back.len(), data.len(), "{mode:?} {size}");
                assert!(back == data, "{mode:?} {size}: the bytes differ");
            }
        }
    }

    #[test]
    fn a_refused_destination_closes_the_client() {
        // A port nobody listens on: bind one and drop it.
        let to = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let addr = relay(Mode::Splice, to);
        let mut c = TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
        let mut buf = [0u8; 1];
        // EOF or a reset, never a hang.
        assert!(matches!(c.read(&mut buf), Ok(0) | Err(_)));
    }

    #[test]
    fn mappings_parse_or_say_why() {
        let m: Mapping = "0.0.0.0:18080=10.60.1.3:8080".parse().unwrap();
        assert_eq!(m.listen, "0.0.0.0:18080".parse().unwrap());
        assert_eq!(m.to, "10.60.1.3:8080".parse().unwrap());
        assert!("[::]:1=[fd00::1]:2".parse::<Mapping>().is_ok());
        let e = "0.0.0.0:1".parse::<Mapping>().unwrap_err();
        assert!(e.contains("LISTEN=TO"), "{e}");
        let e = "0.0.0.0:1=nowhere".parse::<Mapping>().unwrap_err();
        assert!(e.contains("destination \"nowhere\""), "{e}");
    }
}
