//! What the agent changes on, and reads from, the node it runs on: sysctls it sets while
//! running (and restores, even after a crash), the open files limit and how the agent
//! spends it, capabilities, the network namespace it enforces in, and its own memory.
//!
//! Split out of the agent's wiring (issue #21, item 1); the reasons for each setting are
//! on the items: [`TCP_TW_REUSE`] and [`CONNTRACK_ACCT`] (issues #17, #20), [`FdPlan`]
//! (issue #17), [`keep_only_capabilities`] (capabilities(7)).

use std::path::PathBuf;

use anyhow::Context;

use crate::config::{AgentOptions, DEFAULT_MAX_PIPES, RESERVED_FDS};
use crate::proxy::relay::PipeBudget;

/// A field of `/proc/self/status` in MiB (0 if it cannot be read).
fn status_mib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with(field))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or(0, |kib| kib / 1024)
}

/// Gives the heap's free memory back to the kernel (glibc's `malloc_trim`): after the
/// initial lists and after each build, the transient memory of list pages and of the
/// compile is free but would otherwise stay resident. A no-op on other C libraries.
pub fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks glibc's own heap; it takes no pointer of ours.
    unsafe {
        nix::libc::malloc_trim(0);
    }
}

/// This process's resident memory in MiB (`VmRSS`), for the log lines that follow a build.
pub fn rss_mib() -> u64 {
    status_mib("VmRSS:")
}

/// This process's peak resident memory in MiB (`VmHWM`, since its `exec`).
pub fn peak_rss_mib() -> u64 {
    status_mib("VmHWM:")
}

/// A sysctl of the agent's network namespace (the node's) that the agent sets to 1 while
/// it runs ([`HostSysctl`]).
#[derive(Debug, Clone, Copy)]
pub struct Sysctl {
    /// Dotted name, e.g. `net.ipv4.tcp_tw_reuse`.
    pub name: &'static str,
    /// What setting it does, for the log line (with the flag that leaves it alone).
    pub why: &'static str,
}

impl Sysctl {
    /// Its file under `/proc/sys`.
    pub fn path(&self) -> PathBuf {
        PathBuf::from("/proc/sys").join(self.name.replace('.', "/"))
    }

    /// The state file's name: the last component of the name.
    fn leaf(&self) -> &'static str {
        self.name.rsplit('.').next().unwrap_or(self.name)
    }
}

/// `net.ipv4.tcp_tw_reuse = 1`.
///
/// Why: the proxy's upstream connections carry their client's address, so when clients
/// close first, the upstream legs' TIME_WAITs (60 s each) pile up per client and
/// destination, and the kernel's search for a free source port at every connect grows
/// with them. Measured in the lab at 8 connecting clients: 2,659 connections/s over 2 s
/// fell to 1,167/s over 8 s (p99 25 ms); with reuse on, 2,802/s over 8 s (p99 2.4 ms).
/// Reuse (value 1) lets an outgoing connection take a TIME_WAIT's 4-tuple once it is
/// older than 1 s, with TCP timestamps guarding against old segments (ip-sysctl.rst,
/// `tcp_tw_reuse`); the kernel's default (2) allows it on loopback only. It applies to
/// every outgoing connection of the node, which is why the agent says so in its log and
/// `--no-tcp-tw-reuse` leaves the setting alone.
pub const TCP_TW_REUSE: Sysctl = Sysctl {
    name: "net.ipv4.tcp_tw_reuse",
    why: "for this node's outgoing connections while the agent runs (upstream legs carry client addresses; --no-tcp-tw-reuse leaves it alone)",
};

/// `net.netfilter.nf_conntrack_acct = 1`: conntrack counts packets and bytes of every
/// entry created from now on, so that a kernel-forwarded UDP flow's end record has its
/// bytes each way ([`crate::proxy::forwarded`]; nf_conntrack-sysctl.rst). It costs every
/// new conntrack entry of the node 32 bytes and every packet two counter updates;
/// `--no-conntrack-acct` leaves it alone (ends are then reported with 0 bytes).
pub const CONNTRACK_ACCT: Sysctl = Sysctl {
    name: "net.netfilter.nf_conntrack_acct",
    why: "so that the end records of kernel-forwarded UDP flows carry their bytes (--no-conntrack-acct leaves it alone)",
};

/// A [`Sysctl`] set to 1 while the agent runs; the old value is written back when this
/// is dropped.
///
/// A crash (SIGKILL, OOM) skips the restore, so the old value is also written to a state
/// file (`<state dir>/<last name component>.<network namespace cookie>`, e.g.
/// `tcp_tw_reuse.cookie-42`) before the sysctl is changed, and removed once it is
/// restored: the next agent started in the same namespace finds it and restores that
/// value first, whether or not it sets the sysctl again (issue #17: `tcp_tw_reuse` stayed
/// 1 for good after a crash). The namespace cookie (`SO_NETNS_COOKIE`) is unique for the
/// boot, so the file of a namespace that is gone never applies to another; the state
/// directory is on tmpfs (`/run`), which a reboot, like the sysctl, resets.
///
/// Two agents of one namespace run side by side during an upgrade (issue #23), so a
/// state file is not always a crash's: every agent that set or shares the setting holds a
/// shared `flock(2)` on its state file while it runs. An agent that finds the file locked
/// shares the setting (it restores nothing and takes the recorded old value as its own);
/// one that finds it unlocked restores it, as after a crash. On exit an agent restores
/// the old value only if no other agent holds the lock. Before this, the next agent of a
/// hand-over wrote the old value back while the running one still relied on the setting,
/// and warned of a crash that had not happened.
pub struct HostSysctl {
    sysctl: Sysctl,
    old: Option<String>,
    file: Option<PathBuf>,
    /// The shared lock on `file` while this agent owns or shares the setting.
    lock: Option<nix::fcntl::Flock<std::fs::File>>,
}

/// A shared lock on state file `f`, if it can be opened and locked.
fn share(f: &std::path::Path) -> Option<nix::fcntl::Flock<std::fs::File>> {
    let file = std::fs::OpenOptions::new().read(true).open(f).ok()?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockSharedNonblock).ok()
}

/// The calling thread's network namespace, as a string unique for the boot: its cookie
/// (`SO_NETNS_COOKIE`, Linux 5.14, include/uapi/asm-generic/socket.h), else the inode of
/// /proc/thread-self/ns/net (which a later namespace may reuse).
fn netns_id() -> Option<String> {
    const SO_NETNS_COOKIE: nix::libc::c_int = 71;
    let s = std::net::UdpSocket::bind("127.0.0.1:0")
        .or_else(|_| std::net::UdpSocket::bind("[::1]:0"))
        .ok();
    if let Some(s) = s {
        let mut cookie: u64 = 0;
        let mut len = std::mem::size_of::<u64>() as nix::libc::socklen_t;
        // SAFETY: `cookie` and `len` outlive the call and `len` is `cookie`'s size.
        let r = unsafe {
            nix::libc::getsockopt(
                std::os::fd::AsRawFd::as_raw_fd(&s),
                nix::libc::SOL_SOCKET,
                SO_NETNS_COOKIE,
                (&mut cookie as *mut u64).cast(),
                &mut len,
            )
        };
        if r == 0 {
            return Some(format!("cookie-{cookie}"));
        }
    }
    let link = std::fs::read_link("/proc/thread-self/ns/net").ok()?;
    let text = link.to_string_lossy();
    let inode = text.strip_prefix("net:[")?.strip_suffix(']')?;
    Some(format!("inode-{inode}"))
}

impl HostSysctl {
    /// Restores a value a crashed agent left in `state_dir` for this namespace, then, if
    /// `enable`, sets `sysctl` to 1 if it is not, remembering the old value there.
    /// Failures are logged (the agent runs on without it).
    pub fn start(state_dir: &std::path::Path, sysctl: Sysctl, enable: bool) -> HostSysctl {
        let (name, path) = (sysctl.name, sysctl.path());
        let file = netns_id().map(|id| state_dir.join(format!("{}.{id}", sysctl.leaf())));
        if let Some(f) = &file
            && let Ok(opened) = std::fs::OpenOptions::new().read(true).open(f)
        {
            use nix::fcntl::{Flock, FlockArg};
            match Flock::lock(opened, FlockArg::LockExclusiveNonblock) {
                // Nobody holds it: a crashed agent's.
                Ok(crashed) => {
                    let left = std::fs::read_to_string(f).unwrap_or_default().trim().to_string();
                    match std::fs::write(&path, &left) {
                        Ok(()) => {
                            tracing::warn!(
                                value = %left,
                                file = %f.display(),
                                "restored {name}, which an agent that did not exit cleanly left set"
                            );
                            let _ = std::fs::remove_file(f);
                        }
                        Err(e) => tracing::warn!(error = %e, "cannot restore {name}={left}"),
                    }
                    drop(crashed);
                }
                // An agent running beside this one set it (an upgrade): share it.
                Err(_) if enable => {
                    if let Some(lock) = share(f) {
                        let old = std::fs::read_to_string(f).unwrap_or_default().trim().to_string();
                        tracing::info!(
                            was = %old,
                            "{name}=1, shared with the agent running beside this one; the last to exit restores {old}"
                        );
                        return HostSysctl { sysctl, old: Some(old), file, lock: Some(lock) };
                    }
                }
                Err(_) => {}
            }
        }
        let none = HostSysctl { sysctl, old: None, file: None, lock: None };
        if !enable {
            return none;
        }
        let old = match std::fs::read_to_string(&path) {
            Ok(v) => v.trim().to_string(),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read {name}");
                return none;
            }
        };
        if old == "1" {
            return none;
        }
        // The old value first: a crash right after the write below must still find it.
        let file = file.filter(|f| {
            let saved = std::fs::create_dir_all(state_dir).and_then(|()| std::fs::write(f, &old));
            if let Err(e) = &saved {
                tracing::warn!(
                    error = %e,
                    file = %f.display(),
                    "cannot record {name}'s old value; a crash would leave it at 1"
                );
            }
            saved.is_ok()
        });
        let lock = file.as_deref().and_then(share);
        match std::fs::write(&path, "1") {
            Ok(()) => {
                tracing::info!(was = %old, "set {name}=1 {}", sysctl.why);
                HostSysctl { sysctl, old: Some(old), file, lock }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot set {name}=1");
                if let Some(f) = file {
                    let _ = std::fs::remove_file(f);
                }
                none
            }
        }
    }
}

impl HostSysctl {
    /// Leaves the sysctl as it is at exit, and its state file in place: the next agent,
    /// which took over from this one (issue #23), owns both now.
    pub fn hand_over(&mut self) {
        self.old = None;
    }
}

impl Drop for HostSysctl {
    fn drop(&mut self) {
        let Some(old) = &self.old else { return };
        // Another agent shares the setting (it holds the lock too): it restores it.
        if let Some(lock) = &self.lock
            && lock.relock(nix::fcntl::FlockArg::LockExclusiveNonblock).is_err()
        {
            return;
        }
        match std::fs::write(self.sysctl.path(), old) {
            Ok(()) => {
                if let Some(f) = &self.file {
                    let _ = std::fs::remove_file(f);
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot restore {}={old}", self.sysctl.name),
        }
    }
}

/// Raises the soft limit of open files to the hard limit (no capability needed) and
/// returns the limit in force: a proxied TCP connection holds two descriptors (and two
/// pipes, four more, while it moves bytes) and a UDP flow two, so the usual soft limit of
/// 1,024 would cap the proxy near 500 connections (getrlimit(2)). Unreadable: 1,024.
pub fn raise_fd_limit() -> usize {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let clamp = |n: u64| usize::try_from(n).unwrap_or(usize::MAX);
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => {
                tracing::debug!(from = soft, to = hard, "open files limit raised");
                clamp(hard)
            }
            Err(e) => {
                tracing::warn!(error = %e, soft, "cannot raise the open files limit");
                clamp(soft)
            }
        },
        Ok((soft, _)) => clamp(soft),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the open files limit");
            1024
        }
    }
}

/// What the open files limit allows: how many connections, UDP flows and relay pipes the
/// agent takes so that it meets its own limits before the kernel's `EMFILE` (issue #17:
/// with six descriptors per connection the agent broke at 3,334 connections under a
/// 20,000-descriptor limit while `--max-connections` said 65,536).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FdPlan {
    /// The open files limit (`RLIMIT_NOFILE`, soft, after raising it to the hard one).
    pub limit: usize,
    /// Most live proxied connections (two descriptors each).
    pub max_connections: usize,
    /// Most live UDP flows (two descriptors each).
    pub max_udp_flows: usize,
    /// Most relay pipes open at once (two descriptors each).
    pub max_pipes: usize,
}

impl FdPlan {
    /// Fits `connections`, `udp_flows` and `pipes` (two descriptors each) into `limit`
    /// less [`RESERVED_FDS`]. What does not fit is cut: pipes to at most an eighth of the
    /// descriptors available, connections and UDP flows to the rest, in the ratio asked.
    /// Each is at least 1.
    pub fn fit(limit: usize, connections: usize, udp_flows: usize, pipes: usize) -> FdPlan {
        let avail = limit.saturating_sub(RESERVED_FDS) / 2;
        if connections.saturating_add(udp_flows).saturating_add(pipes) <= avail {
            return FdPlan {
                limit,
                max_connections: connections,
                max_udp_flows: udp_flows,
                max_pipes: pipes,
            };
        }
        let max_pipes = pipes.min(avail / 8).max(1);
        let rest = avail.saturating_sub(max_pipes);
        let asked = connections.saturating_add(udp_flows).max(1);
        let max_connections = (rest as u128 * connections as u128 / asked as u128) as usize;
        let max_udp_flows = rest.saturating_sub(max_connections).min(udp_flows);
        FdPlan {
            limit,
            max_connections: max_connections.max(1),
            max_udp_flows: max_udp_flows.max(1),
            max_pipes,
        }
    }
}

/// The descriptor plan ([`FdPlan`]) and the relay's pipe budget ([`PipeBudget`]) for
/// `opts` under the open files limit `nofile`, logged: what the agent takes, and when that
/// is less than the options ask, which limit to raise.
pub fn plan_descriptors(opts: &AgentOptions, nofile: usize) -> (FdPlan, PipeBudget) {
    let mut budget = PipeBudget::for_process(DEFAULT_MAX_PIPES, opts.pipe_budget_percent);
    let plan = FdPlan::fit(nofile, opts.max_connections, opts.max_udp_flows, budget.max_pipes);
    budget.max_pipes = plan.max_pipes;
    if plan.max_connections < opts.max_connections || plan.max_udp_flows < opts.max_udp_flows {
        tracing::warn!(
            open_files_limit = nofile,
            max_connections = plan.max_connections,
            max_udp_flows = plan.max_udp_flows,
            max_pipes = plan.max_pipes,
            asked_connections = opts.max_connections,
            asked_udp_flows = opts.max_udp_flows,
            needed =
                2 * (opts.max_connections + opts.max_udp_flows + DEFAULT_MAX_PIPES) + RESERVED_FDS,
            "the open files limit is too low for --max-connections and --max-udp-flows; taking fewer (raise RLIMIT_NOFILE)"
        );
    } else {
        tracing::info!(
            open_files_limit = nofile,
            max_connections = plan.max_connections,
            max_udp_flows = plan.max_udp_flows,
            max_pipes = plan.max_pipes,
            "descriptors planned (2 per connection, UDP flow and pipe)"
        );
    }
    match budget.user_limit {
        Some(limit) => tracing::info!(
            pipe_bytes = budget.pipe_bytes,
            max_pipes = budget.max_pipes,
            user_pipe_budget = limit,
            share_percent = opts.pipe_budget_percent,
            "relay pipes sized within the per-user pipe budget (no CAP_SYS_RESOURCE or CAP_SYS_ADMIN)"
        ),
        None => tracing::info!(
            pipe_bytes = budget.pipe_bytes,
            max_pipes = budget.max_pipes,
            "relay pipes (privileged: no per-user pipe budget)"
        ),
    }
    (plan, budget)
}

/// Keeps only `keep` of the calling thread's capabilities: drops the others from the
/// bounding set (so no command the agent runs gets them back), then sets the inheritable,
/// effective and permitted sets to `keep` (what the process has of it). Threads started
/// afterwards inherit the result; threads started before keep theirs (the audit sinks and
/// the API-server thread, which make no pipes and run no commands). Source:
/// capabilities(7), "Capability bounding set" and "Transformation of capabilities during
/// execve()" (a root process's permitted set after exec is its inheritable set plus its
/// bounding set).
///
/// # Errors
/// A capability call failed (it needs CAP_SETPCAP to drop from the bounding set).
pub fn keep_only_capabilities(keep: &[caps::Capability]) -> anyhow::Result<()> {
    use caps::{CapSet, CapsHashSet};
    let permitted = caps::read(None, CapSet::Permitted).context("reading capabilities")?;
    let keep: CapsHashSet = keep.iter().copied().filter(|c| permitted.contains(c)).collect();
    for cap in caps::all() {
        if !keep.contains(&cap) && caps::has_cap(None, CapSet::Bounding, cap).unwrap_or(false) {
            caps::drop(None, CapSet::Bounding, cap)
                .with_context(|| format!("dropping {cap} from the bounding set"))?;
        }
    }
    caps::set(None, CapSet::Inheritable, &keep).context("setting the inheritable set")?;
    caps::set(None, CapSet::Effective, &keep).context("setting the effective set")?;
    caps::set(None, CapSet::Permitted, &keep).context("setting the permitted set")?;
    let mut names: Vec<String> = keep.iter().map(ToString::to_string).collect();
    names.sort();
    tracing::info!(kept = %names.join(","), "capabilities dropped to these");
    Ok(())
}

/// Moves the calling thread (the agent's main thread, before it starts any other) into
/// network namespace `ns`: a path, or a name under `/run/netns`.
pub fn enter_netns(ns: &std::path::Path) -> anyhow::Result<()> {
    let path = if ns.components().count() == 1 && !ns.is_absolute() {
        std::path::Path::new("/run/netns").join(ns)
    } else {
        ns.to_path_buf()
    };
    let f = std::fs::File::open(&path)
        .with_context(|| format!("opening network namespace {}", path.display()))?;
    nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWNET)
        .with_context(|| format!("entering network namespace {}", path.display()))?;
    Ok(())
}
