//! NFQUEUE readers: one OS thread per queue number; each reads the first packets the
//! ruleset queues, decides them and answers with a verdict.
//!
//! - Deny: `NF_DROP`. No RST, no ICMP: the client times out, as upstream conformance
//!   requires of a denied connection.
//! - Reject (an Antrea `Reject` rule, issue #22): `NF_DROP` too, and the client is refused
//!   at once: a TCP RST, an ICMP "administratively prohibited" for UDP, an SCTP ABORT,
//!   built from the packet and sent on a raw socket ([`super::reject`], which says why
//!   the packet is never accepted for a later REJECT rule to refuse).
//! - Allow: `NF_REPEAT` with the decided mark added to the packet mark. The queue rule sits
//!   at the top of mangle INPUT / FORWARD (after the DNAT of a ClusterIP, see `redirect`),
//!   and an `NF_ACCEPT` would end the packet's walk through that table's chain there,
//!   skipping the rules other software has after tierproxy's jump; the repeated packet
//!   walks the chain again and skips the queue rule because it carries the decided mark
//!   (DESIGN §3). A kernel-path UDP datagram whose class must stay out of the kernel-side
//!   cache (audit logs its flows in full while the kernel samples the cached classes'
//!   flows, [`super::decider::FirstPacket::cache`]) gets the reject bits with the decided
//!   ones: "allowed, not cached" (`redirect` rule 7).
//! - A packet that cannot be named (truncated, fragment, not TCP/UDP/SCTP): dropped.
//!
//! Each reader waits for a packet, takes whatever else is already queued (up to
//! [`BATCH`]), decides them all and answers with one `send(2)` — one batch verdict when
//! every answer is the same ([`super::nfqueue`]).
//!
//! Sources: netfilter `nfnetlink_queue` (include/uapi/linux/netfilter/nfnetlink_queue.h:
//! `NFQA_CFG_F_FAIL_OPEN`, copy range, queue max length), iptables-extensions(8) NFQUEUE.

use std::sync::Arc;
use std::thread::JoinHandle;

use anyhow::Context;

use super::decider::{Decider, DecisionStats};
use super::handover::Giver;
use super::nfqueue::{Answer, NfVerdict, Queue};
use super::packet;
use super::reject::{KernelRefusal, Refuser, Sent};
use crate::policy::eval::Verdict;

/// How the queue readers are set up.
#[derive(Debug, Clone)]
pub struct QueueConfig {
    /// First queue number.
    pub first: u16,
    /// Number of queues (`first..first + count`), one reader thread each; the ruleset
    /// balances flows over them. Queue `first + count` is the kernel-forwarded flows' and
    /// gets a reader too ([`crate::config::RedirectConfig::kernel_forwarded_queue`]).
    pub count: u16,
    /// Mark given to allowed packets before `NF_REPEAT`: the bits of `decided_mask` are
    /// replaced with `decided_value`, every other bit of the packet mark is kept.
    pub decided_value: u32,
    /// The bits the decided mark owns.
    pub decided_mask: u32,
    /// The reject mark ([`crate::config::RedirectConfig::reject_mark`]). An allowed UDP
    /// datagram whose class must stay out of the kernel-side cache
    /// ([`super::decider::FirstPacket::cache`]) is repeated with the decided and the reject
    /// bits together, which the ruleset reads as "allowed, not cached" (`redirect` rule 7;
    /// the refusal chains refuse only the reject bits without the decided ones).
    pub reject_mark: crate::config::Mark,
    /// Fail-open when a balanced queue is full (`NFQA_CFG_F_FAIL_OPEN`): the kernel accepts
    /// instead of dropping, and the TCP and UDP it lets through reach the proxy, which
    /// decides them as it takes them. Set together with the ruleset's queue bypass. Never
    /// set on the kernel-forwarded flows' queue.
    pub fail_open: bool,
    /// Most packets waiting in each kernel queue.
    pub max_len: u32,
    /// UDP takes the kernel path ([`crate::config::UdpPath::Kernel`]): its first
    /// datagrams, queued on the balanced queues too, are decided as kernel-forwarded flows
    /// (never kept for the proxy).
    pub udp_kernel: bool,
    /// `SO_MARK` of the raw sockets that refuse rejected flows ([`super::reject`]): the
    /// bypass mark, so that the ruleset leaves a refusal to the node itself alone.
    pub refusal_mark: u32,
    /// The mark TPROXY gives the packets it hands to a listener (`redirect` rule 6,
    /// `--tproxy-mark`: [`crate::config::RedirectConfig::route_mark`]): a queued packet
    /// carrying it will reach the proxy once accepted; one without it goes on to its
    /// destination (a TCP SYN from an enforced pod, UDP to the node's own addresses or on
    /// the kernel path, SCTP).
    pub tproxy_mark: crate::config::Mark,
    /// The kernel's reject, where the ruleset has the refusal chains: it answers the
    /// rejected packets that came without their conntrack entry
    /// ([`Refuser::refuse_queued`]).
    pub kernel_refusal: Option<KernelRefusal>,
}

/// Bytes of each packet the kernel copies to us: the IP header, any IPv6 extension
/// headers and the ports. Small copies keep the queue cheap.
pub const COPY_RANGE: u32 = 256;

/// Most packets read and answered together.
pub const BATCH: usize = 64;

/// What the queue readers are doing, for the reloader's flush of the kernel-side cache of
/// allowed classes (`redirect` rule 7): a reader that decided packets under the snapshot
/// before a new one may still send their verdicts, and an allowed verdict adds its class
/// to the cache as the kernel reinjects the packet, inside that `sendmsg`. After
/// publishing a snapshot, the reloader empties the cache, waits with
/// [`QueueActivity::wait_for_batches`] until every reader busy at that moment has sent its
/// batch, and empties it again: no class allowed by an older snapshot stays cached.
#[derive(Debug, Default)]
pub struct QueueActivity {
    readers: std::sync::Mutex<Vec<std::sync::Arc<ReaderActivity>>>,
}

/// One reader's part of [`QueueActivity`].
#[derive(Debug, Default)]
struct ReaderActivity {
    /// Between its first decision of a batch and the batch's verdicts sent.
    busy: std::sync::atomic::AtomicBool,
    /// Batches answered.
    batches: std::sync::atomic::AtomicU64,
}

impl QueueActivity {
    fn reader(&self) -> std::sync::Arc<ReaderActivity> {
        let r = std::sync::Arc::new(ReaderActivity::default());
        self.readers.lock().unwrap_or_else(|e| e.into_inner()).push(r.clone());
        r
    }

    /// Waits, at most `limit`, until every reader that is in the middle of a batch now has
    /// answered it. Returns whether they all did.
    pub fn wait_for_batches(&self, limit: std::time::Duration) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        let busy: Vec<(std::sync::Arc<ReaderActivity>, u64)> = self
            .readers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|r| r.busy.load(SeqCst))
            .map(|r| (r.clone(), r.batches.load(SeqCst)))
            .collect();
        let deadline = std::time::Instant::now() + limit;
        for (r, seen) in busy {
            while r.busy.load(SeqCst) && r.batches.load(SeqCst) == seen {
                if std::time::Instant::now() >= deadline {
                    return false;
                }
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
        }
        true
    }
}

/// Consecutive failed reads or answers after which a reader gives up ([`QueueFailed`]).
const MAX_FAILURES: u32 = 100;

/// A queue reader gave up: [`MAX_FAILURES`] reads or answers failed in a row. A node whose
/// queue nobody reads is closed (or open) for good, so the agent stops (its guards remove
/// the ruleset and restore the sysctls) and exits with [`QueueFailed::EXIT_CODE`], for its
/// supervisor to restart it, rather than run degraded.
#[derive(Debug, thiserror::Error)]
#[error("NFQUEUE {queue} failed {MAX_FAILURES} times in a row")]
pub struct QueueFailed {
    /// The queue number.
    pub queue: u16,
    /// The last failure (of `recvmsg`/`sendmsg` on its netlink socket).
    #[source]
    pub error: std::io::Error,
}

impl QueueFailed {
    /// The agent's exit status after a queue failure: 70, `EX_SOFTWARE` (sysexits.h).
    pub const EXIT_CODE: u8 = 70;
}

/// Where a reader that gives up reports it; the agent stops on the first report.
pub type FatalSender = tokio::sync::mpsc::UnboundedSender<QueueFailed>;

/// How many queues [`start`] reads for `config`: the balanced ones and the
/// kernel-forwarded flows' queue.
pub fn queue_count(config: &QueueConfig) -> usize {
    usize::from(config.count) + 1
}

/// Binds every queue of `config` and starts its reader thread. Returns after all queues
/// are bound, so a caller can signal readiness. A reader that gives up sends a
/// [`QueueFailed`] on `fatal` and ends.
///
/// `handed`: queues the previous agent handed over (issue #23), read as they are instead
/// of bound; one of a number outside `config` is closed, with a warning. With `giver`, a
/// hand-over to the next agent parks every reader and gives its queue
/// ([`Giver::parked`]); the reader ends once the next agent has it.
///
/// # Errors
/// When a queue cannot be opened or bound (no CAP_NET_ADMIN, or another program holds the
/// queue number), naming the queue.
pub fn start(
    config: QueueConfig,
    decider: Arc<Decider>,
    activity: &QueueActivity,
    fatal: &FatalSender,
    giver: Option<Arc<Giver>>,
    mut handed: Vec<(u16, std::os::fd::OwnedFd)>,
) -> anyhow::Result<Vec<JoinHandle<()>>> {
    let mut threads = Vec::new();
    let forwarded = config.first.saturating_add(config.count);
    for num in config.first..=forwarded {
        let fail_open = config.fail_open && num != forwarded;
        let q = match handed.iter().position(|(n, _)| *n == num) {
            Some(i) => Queue::adopt(num, handed.swap_remove(i).1, COPY_RANGE)
                .with_context(|| format!("reading the handed-over NFQUEUE {num}"))?,
            None => Queue::bind(num, COPY_RANGE, config.max_len, fail_open)
                .with_context(|| format!("binding NFQUEUE {num}"))?,
        };
        let decider = decider.clone();
        let config = QueueConfig { fail_open, ..config.clone() };
        let kernel_forwarded = num == forwarded;
        let activity = activity.reader();
        let fatal = fatal.clone();
        let giver = giver.clone();
        let handle = std::thread::Builder::new()
            .name(format!("nfqueue-{num}"))
            .spawn(move || {
                let Some(failed) =
                    read(num, q, config, kernel_forwarded, &decider, &activity, giver.as_deref())
                else {
                    tracing::info!(queue = num, "NFQUEUE handed over to the next agent");
                    return;
                };
                tracing::error!(queue = num, error = %failed.error, "NFQUEUE keeps failing; stopping the agent");
                // No receiver: the agent is stopping already.
                let _ = fatal.send(failed);
            })
            .with_context(|| format!("starting the NFQUEUE {num} thread"))?;
        threads.push(handle);
    }
    for (num, _) in handed {
        tracing::warn!(
            queue = num,
            "the previous agent handed over NFQUEUE {num}, which this agent does not read (a changed --queue-first/--queue-count): closed"
        );
    }
    Ok(threads)
}

/// Reads queue `num` until the agent stops, until it fails [`MAX_FAILURES`] times in a
/// row (returned), or until a hand-over gave it to the next agent (`None`).
/// `kernel_forwarded`: the kernel-forwarded flows' queue, whose allowed flows the proxy
/// never accepts (their decisions are not kept for it).
///
/// A hand-over is noticed between batches (a read waits at most
/// [`super::nfqueue::PARK_CHECK`]): every packet read has its verdict before the reader
/// parks, so the two agents never read the same queue at once (a batch verdict covers
/// every lower packet id, read by whichever agent).
fn read(
    num: u16,
    mut q: Queue,
    config: QueueConfig,
    kernel_forwarded: bool,
    decider: &Decider,
    activity: &ReaderActivity,
    giver: Option<&Giver>,
) -> Option<QueueFailed> {
    use std::sync::atomic::Ordering::SeqCst;
    let allow = |mark: u32| Answer {
        verdict: NfVerdict::Repeat,
        mark: Some(mark & !config.decided_mask | config.decided_value),
    };
    let allow_uncached = |mark: u32| Answer {
        verdict: NfVerdict::Repeat,
        mark: Some(
            mark & !(config.decided_mask | config.reject_mark.mask)
                | config.decided_value
                | config.reject_mark.value,
        ),
    };
    let drop = Answer { verdict: NfVerdict::Drop, mark: None };
    let mut refuser = Refuser::new(config.refusal_mark).with_kernel(config.kernel_refusal.clone());
    let mut failures = 0;
    loop {
        if let Some(g) = giver.filter(|g| g.park()) {
            match q.duplicate() {
                Ok(fd) => {
                    if !g.parked(num, fd) {
                        return None;
                    }
                }
                Err(e) => {
                    tracing::warn!(queue = num, error = %e, "cannot hand over NFQUEUE {num}; reading it on");
                }
            }
        }
        let mut busy = false;
        let r = q.process(BATCH, |p| {
            // Busy before the batch's first decision loads the snapshot in force.
            if !busy {
                busy = true;
                activity.busy.store(true, SeqCst);
            }
            match packet::parse(p.payload) {
                Ok(key) => {
                    // UDP on the kernel path is forwarded by the kernel whichever queue
                    // it came through.
                    let udp_forwarded =
                        config.udp_kernel && key.protocol == crate::policy::Protocol::Udp;
                    let proxied = !(kernel_forwarded || udp_forwarded);
                    let tproxied = p.mark & config.tproxy_mark.mask == config.tproxy_mark.value;
                    // A rejected datagram that TPROXY hands to the proxy, queued without its
                    // conntrack entry, goes on to the proxy, which refuses it: delivered, its
                    // entry is confirmed, so NAT un-does a ClusterIP's DNAT on the refusal,
                    // which the agent cannot address itself (module docs of `reject`). Only
                    // one TPROXY'd: any other would go on to its server.
                    let hand_reject = proxied
                        && tproxied
                        && key.protocol == crate::policy::Protocol::Udp
                        && p.conntrack.is_empty();
                    let first = decider.first_packet(key, proxied, hand_reject);
                    match first.decision.verdict {
                        Verdict::Allow if first.cache => allow(p.mark),
                        Verdict::Allow => allow_uncached(p.mark),
                        Verdict::Deny => drop,
                        Verdict::Reject if hand_reject => allow(p.mark),
                        Verdict::Reject => {
                            if p.conntrack.is_empty() {
                                no_conntrack_warning(num, config.kernel_refusal.is_some());
                            }
                            let original = super::conntrack::original_tuple(p.conntrack);
                            let (sent, mark) = refuser.refuse_queued(
                                p.payload,
                                p.mark,
                                original.as_ref(),
                                tproxied,
                            );
                            count_refusal(&key, sent, &decider.stats);
                            match mark {
                                Some(mark) => {
                                    Answer { verdict: NfVerdict::Accept, mark: Some(mark) }
                                }
                                None => drop,
                            }
                        }
                    }
                }
                Err(e) => {
                    tracing::debug!(queue = num, error = %e, "queued packet dropped");
                    drop
                }
            }
        });
        activity.batches.fetch_add(1, SeqCst);
        activity.busy.store(false, SeqCst);
        match r {
            Ok(_) => failures = 0,
            Err(e) if e.raw_os_error() == Some(nix::libc::ENOBUFS) => {
                // The kernel could not deliver some messages: fail-closed, it dropped their
                // packets (`user_dropped` in /proc/net/netfilter/nfnetlink_queue; their
                // clients retransmit); fail-open (the balanced queues only), it let them
                // through undecided, counted nowhere by the kernel: they are TCP and UDP,
                // which reach the proxy, where `Decider::take_or_decide` decides, audits
                // and counts each.
                if let Some(n) = crate::limits::LIMITS.nfqueue_overrun.hit() {
                    if config.fail_open {
                        tracing::warn!(
                            queue = num,
                            overruns = n,
                            "NFQUEUE reader fell behind; the kernel passed new TCP and UDP flows on undecided (fail-open): the proxy decides each as it takes it"
                        );
                    } else {
                        tracing::warn!(
                            queue = num,
                            overruns = n,
                            "NFQUEUE reader fell behind; the kernel dropped new flows' first packets (their clients retransmit)"
                        );
                    }
                }
            }
            Err(e) => {
                failures += 1;
                if failures >= MAX_FAILURES {
                    return Some(QueueFailed { queue: num, error: e });
                }
                tracing::warn!(queue = num, error = %e, "NFQUEUE error; retrying");
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
    }
}

/// Refusals that could not be sent, for [`count_refusal`]'s log line (at most one per
/// [`crate::limits::LOG_EVERY`]; not a limit).
static UNSENT: crate::limits::Hits = crate::limits::Hits::new();

/// Says once per process that the kernel passes no conntrack entry with queued packets
/// (`NFQA_CT` needs CONFIG_NETFILTER_NETLINK_GLUE_CT; these machines' kernel lacks it), and
/// what that costs: with the refusal chains (`kernel_refusal`) the kernel's reject answers
/// TCP and UDP that was not TPROXY'd, and the proxy a TPROXY'd datagram (the reader lets
/// it on), so only SCTP to a ClusterIP or NodePort goes unanswered; without them every
/// rejected TCP flow or kernel-forwarded datagram to one does.
fn no_conntrack_warning(queue: u16, kernel_refusal: bool) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if kernel_refusal {
            tracing::warn!(
                queue,
                "rejected packet queued without its conntrack entry (kernel without CONFIG_NETFILTER_NETLINK_GLUE_CT): the kernel's reject refuses rejected TCP and UDP; rejected SCTP associations to a ClusterIP or NodePort are refused from the backend's address, which their clients ignore (they time out, as for a deny)"
            );
        } else {
            tracing::warn!(
                queue,
                "rejected packet queued without its conntrack entry (kernel without CONFIG_NETFILTER_NETLINK_GLUE_CT) and no refusal chains (the iptables backend without nft): rejected flows to a ClusterIP or NodePort, but --udp-path proxy datagrams, are refused from the backend's address, which their clients ignore (they time out, as for a deny)"
            );
        }
    });
}

/// Counts what became of the refusal of a rejected flow's packet (`key`), logging a
/// failure at most once per [`crate::limits::LOG_EVERY`].
pub fn count_refusal(key: &crate::policy::FlowKey, sent: Sent, stats: &DecisionStats) {
    use std::sync::atomic::Ordering::Relaxed;
    match sent {
        Sent::Sent(answer) => {
            stats.refusals[answer.index()].fetch_add(1, Relaxed);
        }
        Sent::Limited => {
            stats.refusals_unsent.fetch_add(1, Relaxed);
        }
        Sent::Unanswered(e) => {
            stats.refusals_unsent.fetch_add(1, Relaxed);
            tracing::debug!(src = %key.src, dst = %key.dst, error = %crate::error::chain(&e), "rejected packet not answered");
        }
        Sent::Failed(e) => {
            stats.refusals_unsent.fetch_add(1, Relaxed);
            if let Some(n) = UNSENT.hit() {
                tracing::warn!(src = %key.src, dst = %key.dst, error = %e, unsent = n, "rejected flow dropped without a refusal");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader's failure crosses the channel to the agent, which returns it from `run`
    /// (through any context added on the way); `main` finds it there and exits with 70.
    #[test]
    fn a_failed_reader_reaches_the_agent_as_an_error_that_names_its_queue_and_status() {
        let (fatal, mut failures) = tokio::sync::mpsc::unbounded_channel();
        let sender: FatalSender = fatal.clone();
        std::thread::spawn(move || {
            let error = std::io::Error::from_raw_os_error(nix::libc::ENOMEM);
            sender.send(QueueFailed { queue: 3, error }).unwrap();
        })
        .join()
        .unwrap();
        let failed = failures.blocking_recv().expect("reported");
        let e = anyhow::Error::from(failed).context("running the agent");
        let found = e.downcast_ref::<QueueFailed>().expect("found under the context");
        assert_eq!((found.queue, QueueFailed::EXIT_CODE), (3, 70));
        assert_eq!(found.to_string(), format!("NFQUEUE 3 failed {MAX_FAILURES} times in a row"));
        assert_eq!(found.error.raw_os_error(), Some(nix::libc::ENOMEM));
    }
}
