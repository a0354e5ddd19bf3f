//! The limits an agent can hit, each counted and logged at most once per [`LOG_EVERY`].
//!
//! A hostile pod can drive the agent to any limit it has (open files, connections, UDP
//! flows, pipe memory, queue length); a limit reached silently looks like a network that
//! lost packets. So every limit has a [`Hits`] counter: every hit is counted (the counters
//! are exported as `tierproxy_limit_hits_total{limit}`), and the first hit after a quiet
//! [`LOG_EVERY`] returns the number of hits since the last log line, for one WARN line that
//! says which limit, how often, and what it costs. A flood therefore writes one line per
//! limit per 10 s, not one per packet (issue #17: `accept failed` was logged every 50 ms, an
//! NFQUEUE overflow once per dropped packet).
//!
//! What each limit is, its default, and what happens at it: `docs/architecture.md`,
//! "Limits".

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// At most one log line per limit per this interval.
pub const LOG_EVERY: Duration = Duration::from_secs(10);

/// Milliseconds since the first call in this process (a monotonic clock shared by every
/// counter; 0 is never returned, so 0 can mean "never logged").
fn now_ms() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64 + 1
}

/// Every limit the agent counts, process-wide (the agent is one per node; tests that run
/// several proxies in one process share them, which only merges their counts).
#[derive(Debug)]
pub struct Limits {
    /// `--max-connections` live proxied connections: the proxy stops accepting, new
    /// connections wait in the listen backlog until one closes.
    pub connections: Hits,
    /// `--max-udp-flows` live UDP flows: with `--udp-path proxy`, a new flow's first
    /// datagram is dropped; with the kernel path (the default), a new flow is still decided
    /// and forwarded, but its end is not reported ([`crate::proxy::forwarded`]).
    pub udp_flows: Hits,
    /// The open files limit (`EMFILE`, `ENFILE`): a socket or pipe could not be created; the
    /// connection or flow concerned fails (a pipe: relayed by copy instead).
    pub open_files: Hits,
    /// The relay's pipe budget ([`crate::proxy::relay::PipeBudget`]): no pipe could be had
    /// for a burst (relayed by copy through user space), or the kernel refused a pipe its
    /// size (the per-user pipe budget, pipe(7)); such a pipe is used once, never pooled.
    pub pipes: Hits,
    /// `accept` failed for another reason than the open files limit (`ENOMEM`,
    /// `ENOBUFS`): the connection stays in the backlog, the proxy retries after 50 ms.
    pub accept_errors: Hits,
    /// An NFQUEUE reader fell behind: the kernel could not deliver packet messages to it
    /// (`ENOBUFS`) and dropped those packets (fail-closed) or let them through undecided
    /// (fail-open).
    pub nfqueue_overrun: Hits,
    /// [`crate::proxy::icmp::MAX_PER_SECOND`] ICMP errors passed on to clients per second:
    /// the client of a refused UDP flow gets no "connection refused" and times out instead.
    pub icmp_errors: Hits,
    /// Conntrack destroy events lost (`ENOBUFS` on the event socket): the ends of some
    /// kernel-forwarded UDP flows are not reported ([`crate::proxy::forwarded::watch`]).
    pub conntrack_events: Hits,
    /// [`crate::proxy::reject::MAX_PER_SECOND`] refusals (TCP RST, ICMP administratively
    /// prohibited, SCTP ABORT) sent for rejected flows per second: the packet is still
    /// dropped, its client is not told and times out as for a deny.
    pub rejects: Hits,
}

impl Limits {
    /// Every limit with its name in metrics and logs.
    pub fn each(&self) -> [(&'static str, &Hits); 9] {
        [
            ("connections", &self.connections),
            ("udp_flows", &self.udp_flows),
            ("open_files", &self.open_files),
            ("pipes", &self.pipes),
            ("accept_errors", &self.accept_errors),
            ("nfqueue_overrun", &self.nfqueue_overrun),
            ("icmp_errors", &self.icmp_errors),
            ("conntrack_events", &self.conntrack_events),
            ("rejects", &self.rejects),
        ]
    }
}

/// The process's limit counters.
pub static LIMITS: Limits = Limits {
    connections: Hits::new(),
    udp_flows: Hits::new(),
    open_files: Hits::new(),
    pipes: Hits::new(),
    accept_errors: Hits::new(),
    nfqueue_overrun: Hits::new(),
    icmp_errors: Hits::new(),
    conntrack_events: Hits::new(),
    rejects: Hits::new(),
};

/// Whether `e` is the open files limit (`EMFILE`: this process's `RLIMIT_NOFILE`;
/// `ENFILE`: the system's `fs.file-max`).
pub fn is_out_of_files(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(nix::libc::EMFILE | nix::libc::ENFILE))
}

/// Hits of one limit: a counter, and when it was last logged.
#[derive(Debug, Default)]
pub struct Hits {
    count: AtomicU64,
    /// [`now_ms`] of the last hit that returned `Some` from [`Hits::add`]; 0: never.
    logged_at: AtomicU64,
    /// `count` at that moment.
    logged_count: AtomicU64,
}

impl Hits {
    /// A counter at zero.
    pub const fn new() -> Hits {
        Hits {
            count: AtomicU64::new(0),
            logged_at: AtomicU64::new(0),
            logged_count: AtomicU64::new(0),
        }
    }

    /// Counts `n` hits. Returns `Some(hits since the last log)` when the caller should log
    /// now: on the first hit, and then on the first hit at least [`LOG_EVERY`] after the
    /// last one that returned `Some`. Lock-free; of concurrent callers at most one gets
    /// `Some` for a given interval.
    pub fn add(&self, n: u64) -> Option<u64> {
        self.add_at(n, now_ms())
    }

    /// [`Hits::add`] at `now` ([`now_ms`]'s clock).
    fn add_at(&self, n: u64, now: u64) -> Option<u64> {
        let total = self.count.fetch_add(n, Ordering::Relaxed) + n;
        let last = self.logged_at.load(Ordering::Relaxed);
        let due = last == 0 || now.saturating_sub(last) >= LOG_EVERY.as_millis() as u64;
        if !due
            || self
                .logged_at
                .compare_exchange(last, now, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
        {
            return None;
        }
        let before = self.logged_count.swap(total, Ordering::Relaxed);
        Some(total.saturating_sub(before))
    }

    /// One hit: [`Hits::add`]`(1)`.
    pub fn hit(&self) -> Option<u64> {
        self.add(1)
    }

    /// Hits counted since start.
    pub fn get(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
}

/// At most `max` events per second of [`now_ms`]'s clock, all callers together: the
/// kernel's own way of bounding the ICMP errors it generates (`net.ipv4.icmp_msgs_per_sec`,
/// Documentation/networking/ip-sysctl.rst), without its burst allowance: up to `max` may
/// go at the start of a second.
#[derive(Debug)]
pub struct PerSecond {
    max: u64,
    /// The second (of [`now_ms`]) being counted.
    second: AtomicU64,
    /// Events asked for in it.
    count: AtomicU64,
}

impl PerSecond {
    /// A limit of `max` per second.
    pub const fn new(max: u64) -> PerSecond {
        PerSecond { max, second: AtomicU64::new(0), count: AtomicU64::new(0) }
    }

    /// Whether one more event may happen now (it is counted when it may).
    pub fn allow(&self) -> bool {
        self.allow_at(now_ms())
    }

    /// [`PerSecond::allow`] at `now` ([`now_ms`]'s clock).
    fn allow_at(&self, now: u64) -> bool {
        let second = now / 1000;
        let seen = self.second.load(Ordering::Relaxed);
        if seen != second
            && self
                .second
                .compare_exchange(seen, second, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            self.count.store(0, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed) < self.max
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_hit_logs_and_the_next_ones_within_the_interval_do_not() {
        let every = LOG_EVERY.as_millis() as u64;
        let h = Hits::new();
        assert_eq!(h.add_at(1, 5), Some(1));
        for t in 0..1000 {
            assert_eq!(h.add_at(1, 5 + t), None);
        }
        assert_eq!(h.add_at(5, 5 + every - 1), None);
        assert_eq!(h.get(), 1006);
        // From the interval on, the next hit logs what was suppressed since the last line.
        assert_eq!(h.add_at(1, 5 + every), Some(1006));
        assert_eq!(h.add_at(1, 6 + every), None);
        assert_eq!(h.add_at(2, 5 + 3 * every), Some(3));
    }

    #[test]
    fn per_second_allows_its_maximum_in_each_second() {
        let l = PerSecond::new(3);
        let allowed = |at: u64| (0..5).filter(|_| l.allow_at(at)).count();
        assert_eq!(allowed(1_000), 3);
        assert_eq!(allowed(1_999), 0, "the same second");
        assert_eq!(allowed(2_000), 3, "a new second starts over");
    }

    #[test]
    fn concurrent_hits_are_all_counted_and_logged_once() {
        let h = std::sync::Arc::new(Hits::new());
        let logged = std::sync::Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (h, logged) = (h.clone(), logged.clone());
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        if h.hit().is_some() {
                            logged.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(h.get(), 40_000);
        assert_eq!(logged.load(Ordering::Relaxed), 1);
    }
}
