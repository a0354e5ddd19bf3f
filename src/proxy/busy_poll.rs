//! Busy polling before a runtime worker parks (`--busy-poll-us`, off by default).
//!
//! Where a node's idle CPUs halt at once (a VM whose guest does not poll before halting:
//! cpuidle `haltpoll` with `guest_halt_poll_ns` = 0), every message a proxy relays wakes a
//! halted CPU: the sender's softirq sends an inter-processor interrupt, the hypervisor
//! wakes the vCPU, and the woken thread then runs slower on a CPU that was away. Measured
//! on such a VM (docs/architecture.md, "A connection step by step"; loadtest/README.md,
//! "Idle vCPUs"): 19–25 µs from a wake-up to the woken proxy thread running, against
//! 3–5 µs where the guest polls, for every proxy alike.
//! HAProxy's answer is its `busy-polling` option (the poller never sleeps); this is the
//! same idea, bounded: before a worker of the agent's runtime parks, it polls the
//! runtime's epoll instance with a zero timeout for up to the budget, and parks only if
//! nothing became ready by then. A message that arrives within the budget finds its CPU
//! running: no interrupt, no halt, no cold start.
//!
//! The cost is CPU: a worker spins up to the budget each time it runs out of work, so an
//! agent relaying at low load burns up to the budget per message (measured with 50 µs:
//! +15–24 % agent CPU per connection at one connection at a time, +29–57 % per 64-byte
//! request/response), and under CPU-bound load the spinning takes CPU from the work
//! (connections/s at eight at a time 0.95–0.99×). A timer due
//! during a spin fires up to the budget late. Worth it only where CPUs halt at once and
//! latency at low load matters more than CPU; see docs/architecture.md, "Busy polling".
//!
//! The runtime's epoll instance is not exposed by tokio; [`BusyPoll::find`] takes the
//! `anon_inode:[eventpoll]` descriptors that appeared in the process while the runtime
//! was built (tokio's I/O driver makes one instance, with two descriptors). None leaves
//! busy polling off, with a warning; one that another thread made at the same moment is
//! watched too and can only end spins early. The spin waits on an epoll instance of its
//! own that watches the runtime's (epoll(7): an epoll file descriptor is itself pollable,
//! readable while it has events ready), so it consumes none of the runtime's events.

use std::collections::BTreeSet;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};

/// Most busy-poll budget `--busy-poll-us` takes: 1 ms (a budget beyond it is a CPU spent
/// to save a wake-up that costs tens of µs).
pub const MAX_BUDGET: Duration = Duration::from_millis(1);

/// How busy polling went, process-wide: exported as
/// `tierproxy_busy_poll_spins_total{outcome}` while it is on.
#[derive(Debug, Default)]
pub struct Stats {
    /// The budget in µs (0: busy polling is off).
    pub budget_us: AtomicU64,
    /// Spins that ended because the runtime had work (the wake-up they saved).
    pub ready: AtomicU64,
    /// Spins that ran their whole budget before the worker parked (CPU spent for nothing).
    pub exhausted: AtomicU64,
}

/// The process's busy-poll counters.
pub static STATS: Stats =
    Stats { budget_us: AtomicU64::new(0), ready: AtomicU64::new(0), exhausted: AtomicU64::new(0) };

/// A runtime's epoll instance, watched, and the budget of a spin.
#[derive(Debug)]
pub struct BusyPoll {
    watch: Epoll,
    budget: Duration,
}

/// The descriptors of this process that are epoll instances (`anon_inode:[eventpoll]`
/// in `/proc/self/fd`, proc(5)).
///
/// # Errors
/// `/proc/self/fd` cannot be read.
pub fn epoll_fds() -> std::io::Result<BTreeSet<RawFd>> {
    let mut out = BTreeSet::new();
    for entry in std::fs::read_dir("/proc/self/fd")? {
        let entry = entry?;
        let Some(fd) = entry.file_name().to_str().and_then(|n| n.parse::<RawFd>().ok()) else {
            continue;
        };
        // A descriptor closed since the listing reads as an error: not an epoll.
        if std::fs::read_link(entry.path())
            .is_ok_and(|target| target.as_os_str() == "anon_inode:[eventpoll]")
        {
            out.insert(fd);
        }
    }
    Ok(out)
}

impl BusyPoll {
    /// Busy polling of the epoll descriptors that are in `after` and not in `before` (the
    /// process's, listed by [`epoll_fds`] around building a runtime), for up to `budget` a
    /// spin. tokio's I/O driver makes two such descriptors for its one instance (mio's
    /// registry keeps a duplicate); all are watched, so one another thread made at the same
    /// moment only ends some spins early.
    ///
    /// # Errors
    /// A sentence saying why busy polling stays off: no epoll descriptor appeared, or the
    /// watching instance cannot be made.
    pub fn find(
        before: &BTreeSet<RawFd>,
        after: &BTreeSet<RawFd>,
        budget: Duration,
    ) -> Result<BusyPoll, String> {
        let new: Vec<RawFd> = after.difference(before).copied().collect();
        if new.is_empty() {
            return Err("no epoll instance appeared while the runtime was built".into());
        }
        // SAFETY: each descriptor is open (listed in /proc/self/fd after the build) and
        // stays open while the runtime lives, which outlives its workers' park callbacks;
        // it is only borrowed to add it to the watching instance, which then holds its own
        // reference to the file.
        let runtime: Vec<BorrowedFd<'_>> =
            new.iter().map(|&fd| unsafe { BorrowedFd::borrow_raw(fd) }).collect();
        Self::watching(&runtime, budget)
    }

    /// Busy polling of the epoll instances `runtime`, for up to `budget` a spin.
    ///
    /// # Errors
    /// A sentence saying why the watching instance cannot be made.
    pub fn watching(runtime: &[BorrowedFd<'_>], budget: Duration) -> Result<BusyPoll, String> {
        let watch = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)
            .map_err(|e| format!("cannot create an epoll instance: {e}"))?;
        for fd in runtime {
            watch
                .add(fd, EpollEvent::new(EpollFlags::EPOLLIN, fd.as_raw_fd() as u64))
                .map_err(|e| format!("cannot watch the runtime's epoll instance: {e}"))?;
        }
        Ok(BusyPoll { watch, budget: budget.min(MAX_BUDGET) })
    }

    /// The spin budget.
    pub fn budget(&self) -> Duration {
        self.budget
    }

    /// Polls the runtime's epoll instance until it has an event ready (`true`) or the
    /// budget is spent (`false`). Counted in [`STATS`]. Call right before a worker parks
    /// (`tokio::runtime::Builder::on_thread_park`).
    pub fn spin(&self) -> bool {
        let start = Instant::now();
        let mut events = [EpollEvent::empty()];
        loop {
            // A failed poll (EINTR) counts as nothing ready; the budget still bounds it.
            if self.watch.wait(&mut events, EpollTimeout::ZERO).is_ok_and(|n| n > 0) {
                STATS.ready.fetch_add(1, Ordering::Relaxed);
                return true;
            }
            if start.elapsed() >= self.budget {
                STATS.exhausted.fetch_add(1, Ordering::Relaxed);
                return false;
            }
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::eventfd::{EfdFlags, EventFd};
    use std::os::fd::AsFd;

    /// An epoll instance with an eventfd in it, as the runtime's driver has its waker.
    fn runtime_like() -> (Epoll, EventFd) {
        let ep = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).unwrap();
        let ev = EventFd::from_flags(EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC).unwrap();
        ep.add(ev.as_fd(), EpollEvent::new(EpollFlags::EPOLLIN, 1)).unwrap();
        (ep, ev)
    }

    /// A spin returns as soon as the runtime's instance has an event ready, whatever the
    /// budget left, and leaves the event for the runtime; with nothing ready it returns
    /// after its budget.
    #[test]
    fn a_spin_ends_when_the_runtime_has_work_and_leaves_it_the_event() {
        let (ep, ev) = runtime_like();
        let bp = BusyPoll::watching(&[ep.0.as_fd()], Duration::from_millis(1)).unwrap();
        assert!(!bp.spin(), "nothing ready: the budget runs out");
        ev.write(1).unwrap();
        // A budget far beyond the deadline below: only readiness can end the spin in time.
        let mut long = BusyPoll::watching(&[ep.0.as_fd()], MAX_BUDGET).unwrap();
        long.budget = Duration::from_secs(30);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(long.spin()).unwrap());
        let ended = rx.recv_timeout(Duration::from_secs(10));
        assert_eq!(ended, Ok(true), "the spin saw the ready event within 10 s");
        let mut events = [EpollEvent::empty()];
        assert_eq!(ep.wait(&mut events, EpollTimeout::ZERO).unwrap(), 1, "still the runtime's");
    }

    /// `epoll_fds` lists the process's epoll instances; `find` watches every one that
    /// appeared (a spin ends when any has work) and refuses none (sets given here: other
    /// tests make runtimes meanwhile; the agent's own is checked by
    /// `datapath_netns::a_busy_polling_agent_relays_and_counts_the_spins_that_found_work`).
    #[test]
    fn find_watches_the_epoll_instances_that_appeared() {
        let (ep, _ev) = runtime_like();
        let (ep2, ev2) = runtime_like();
        let (a, b) = (ep.0.as_raw_fd(), ep2.0.as_raw_fd());
        let listed = epoll_fds().unwrap();
        assert!(listed.contains(&a) && listed.contains(&b), "{listed:?} lists {a} and {b}");
        let both = BusyPoll::find(&BTreeSet::new(), &BTreeSet::from([a, b]), MAX_BUDGET).unwrap();
        assert!(!both.spin(), "nothing ready");
        ev2.write(1).unwrap();
        assert!(both.spin(), "the second instance's event ends the spin");
        let e = BusyPoll::find(&listed, &listed, MAX_BUDGET).unwrap_err();
        assert!(e.starts_with("no epoll instance"), "{e}");
    }

    /// The budget is capped at [`MAX_BUDGET`].
    #[test]
    fn the_budget_is_capped() {
        let (ep, _ev) = runtime_like();
        let bp = BusyPoll::watching(&[ep.0.as_fd()], Duration::from_secs(1)).unwrap();
        assert_eq!(bp.budget(), MAX_BUDGET);
    }
}
