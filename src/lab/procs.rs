//! Background processes of the lab (echo servers, agents): how they are started, how `lab
//! up` knows they are ready, how `lab down` stops them; and Ctrl-C handling.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nix::sys::signal::{SigSet, SigmaskHow, sigprocmask};
use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{WaitPidFlag, waitpid};
use nix::unistd::Pid;

use super::LabError;
use super::plan::ServerPlan;

/// How long `lab up` waits for every echo server to have bound its ports: they bind at
/// once, so 10 s only guards against a stuck machine.
pub const SERVER_READY_TIMEOUT: Duration = Duration::from_secs(10);
/// How long `lab up` waits for each agent's ready file: an agent compiles the manifests and
/// installs its ruleset, well under a second on the examples; 30 s leaves room for a slow
/// CI machine and a large manifest set.
pub const AGENT_READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long `lab down` waits after SIGTERM before SIGKILL (agents remove their rules on
/// exit and need a moment).
pub const STOP_GRACE: Duration = Duration::from_secs(3);
/// Poll interval of the waits above.
const POLL: Duration = Duration::from_millis(20);
/// Bytes of a log shown in an error.
const LOG_TAIL: usize = 2000;

/// Set once SIGINT, SIGTERM or SIGHUP arrived (after [`handle_signals`]).
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// The flag [`handle_signals`] sets: long steps check it and stop early.
pub fn interrupted() -> &'static AtomicBool {
    &INTERRUPTED
}

/// Routes SIGINT/SIGTERM/SIGHUP to a watcher thread that sets [`interrupted`] (a second
/// signal exits at once with 130). Call from the main thread before starting other
/// threads: the signals are blocked in the caller and so in every thread it starts.
/// Children get an empty mask back (see [`spawn_detached`]).
///
/// # Errors
/// If the mask cannot be set or the thread cannot start.
pub fn handle_signals() -> std::io::Result<()> {
    let mut set = SigSet::empty();
    for s in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
        set.add(s);
    }
    set.thread_block().map_err(std::io::Error::from)?;
    std::thread::Builder::new().name("signals".into()).spawn(move || {
        while let Ok(sig) = set.wait() {
            if INTERRUPTED.swap(true, Ordering::SeqCst) {
                eprintln!("{sig}: again; exiting without cleaning up (run `tierproxy lab down`)");
                std::process::exit(130);
            }
            eprintln!("{sig}: stopping; cleaning up (press Ctrl-C again to skip that)");
        }
    })?;
    Ok(())
}

/// The echo server command for one namespace (`ip netns exec <ns> <exe> lab serve ...`).
pub fn serve_command(exe: &Path, server: &ServerPlan, ready: &Path) -> Command {
    let join = |v: &[u16]| v.iter().map(u16::to_string).collect::<Vec<_>>().join(",");
    let mut c = Command::new("ip");
    c.args(["netns", "exec", &server.netns]).arg(exe).args(["lab", "serve"]);
    let bind: Vec<String> = server.bind.iter().map(ToString::to_string).collect();
    c.arg("--bind").arg(bind.join(","));
    let echo: Vec<u16> =
        server.tcp.iter().copied().filter(|p| !server.tcp_close_first.contains(p)).collect();
    if !echo.is_empty() {
        c.arg("--tcp").arg(join(&echo));
    }
    if !server.tcp_close_first.is_empty() {
        c.arg("--tcp-close-first").arg(join(&server.tcp_close_first));
    }
    if !server.udp.is_empty() {
        c.arg("--udp").arg(join(&server.udp));
    }
    if !server.sctp.is_empty() {
        c.arg("--sctp").arg(join(&server.sctp));
    }
    c.arg("--ready-file").arg(ready);
    c
}

/// Deny aggregation window of the lab's agents (milliseconds): short, so a demo's denies
/// are printed soon after its probes.
pub const LAB_DENY_WINDOW_MS: u64 = 1000;

/// The agent's audit file in state directory `dir`.
pub fn audit_file(dir: &Path, node: &str) -> PathBuf {
    dir.join(format!("audit-{node}.jsonl"))
}

/// The files of one lab agent, in the lab's state directory.
#[derive(Debug, Clone)]
pub struct AgentFiles {
    /// Its log (`--log`).
    pub log: PathBuf,
    /// Created once it enforces (`--ready-file`).
    pub ready: PathBuf,
    /// Its audit events, JSON Lines (`--audit-json`; [`audit_file`]); `None`: no audit.
    pub audit: Option<PathBuf>,
    /// Its hand-over socket (`--handover-socket`; [`handover_socket`]): `lab upgrade`
    /// starts the next agent of the node on it.
    pub handover: PathBuf,
}

/// The hand-over socket of node `node`'s agents in state directory `dir`.
pub fn handover_socket(dir: &Path, node: &str) -> PathBuf {
    dir.join(format!("handover-{node}.sock"))
}

/// The capabilities a lab agent keeps: the DaemonSet's (`deploy/daemonset.yaml`), so that
/// what the lab and `loadtest/` measure is what a node runs (issue #17: with all of root's
/// capabilities the per-user pipe budget never applied in the lab).
pub const AGENT_CAPABILITIES: &str = "NET_ADMIN,NET_RAW,NET_BIND_SERVICE";

/// The agent command for one node: `<exe> agent --netns <netns> --node <node> --manifests
/// <paths...> --log <log> --ready-file <ready> --handover-socket <socket>
/// --capabilities NET_ADMIN,NET_RAW,NET_BIND_SERVICE
/// [--enforcing-node=<other node>...] --audit-json <audit> --audit-allow-sample 1
/// --audit-deny-window-ms 1000 <extra...>` (`enforcing`: the nodes the lab starts an agent
/// on; each agent names the others, so a connection between pods on two nodes is proxied
/// once, at the client's node; the audit options unless `lab up --no-audit`; `extra`:
/// `lab up --agent-arg`, e.g.
/// `--max-connections=10` or `--capabilities=all`; a later option overrides an earlier
/// one). Each agent takes the share of the per-user pipe budget a node's agent takes,
/// although the lab's agents share one machine's budget: at most half of it each, so only
/// when both use every pipe they may have do they spend it all.
///
/// The agent starts in the host's namespace and enters the node's after starting its
/// audit sinks, as a hostNetwork pod's sockets live on the node: an OTLP endpoint on the
/// host (`OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318`, inherited from the
/// environment of `lab up`) is reached from every node. Every decision is audited to
/// `audit` (JSON Lines; `lab probe` prints what the probes caused).
///
/// Contract with `tierproxy agent`: it enforces policy for node `node` from the manifests
/// (absolute paths), logs to `log`, and creates `ready` (`<state dir>/agent-<node>.ready`)
/// once its ruleset is installed and it decides flows; `lab up` waits for that file at most
/// [`AGENT_READY_TIMEOUT`]. `lab down` stops it with SIGTERM, then SIGKILL after
/// [`STOP_GRACE`]. Its stdout and stderr go to `<state dir>/agent-<node>.out`.
pub fn agent_command(
    exe: &Path,
    netns: &str,
    node: &str,
    manifests: &[PathBuf],
    files: &AgentFiles,
    enforcing: &[String],
    extra: &[String],
) -> Command {
    let AgentFiles { log, ready, audit, handover } = files;
    let mut c = Command::new(exe);
    c.args(["agent", "--netns", netns, "--node", node, "--manifests"]);
    c.args(manifests);
    c.arg("--log").arg(log).arg("--ready-file").arg(ready);
    c.arg("--handover-socket").arg(handover);
    c.arg(format!("--capabilities={AGENT_CAPABILITIES}"));
    for other in enforcing.iter().filter(|n| *n != node) {
        c.arg(format!("--enforcing-node={other}"));
    }
    if let Some(audit) = audit {
        c.arg("--audit-json").arg(audit);
        c.args(["--audit-allow-sample", "1"]);
        c.args(["--audit-deny-window-ms", &LAB_DENY_WINDOW_MS.to_string()]);
    }
    // After `--`-free flags only: each extra argument is one `tierproxy agent` option.
    c.args(extra);
    c
}

/// Starts `command` detached: a new session (no terminal signals reach it), stdin from
/// `/dev/null`, stdout and stderr appended to `log`, an empty signal mask.
///
/// # Errors
/// [`LabError::State`] if the log cannot be opened, [`LabError::Spawn`].
pub fn spawn_detached(mut command: Command, log: &Path) -> Result<Child, LabError> {
    let out = File::options()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|source| LabError::State { path: log.to_path_buf(), source })?;
    let err =
        out.try_clone().map_err(|source| LabError::State { path: log.to_path_buf(), source })?;
    command.stdin(Stdio::null()).stdout(out).stderr(err);
    // SAFETY: between fork and exec only async-signal-safe calls are allowed; setsid(2) and
    // sigprocmask(2) are, and nothing here allocates.
    unsafe {
        command.pre_exec(|| {
            nix::unistd::setsid().map_err(std::io::Error::from)?;
            sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None)
                .map_err(std::io::Error::from)
        });
    }
    let shown = format!("{command:?}");
    command.spawn().map_err(|source| LabError::Spawn { command: shown, source })
}

/// The last `LOG_TAIL` (2,000) bytes of `log`, for error messages.
pub fn log_tail(log: &Path) -> String {
    let text = match std::fs::read(log) {
        Ok(t) => t,
        Err(e) => return format!("{}: {e}", log.display()),
    };
    let start = text.len().saturating_sub(LOG_TAIL);
    let tail = String::from_utf8_lossy(&text[start..]).trim().to_string();
    if tail.is_empty() { format!("{} is empty", log.display()) } else { tail }
}

/// A process `lab up` waits for.
pub struct Pending<'a> {
    /// What it is, for errors: `echo server in netns X`, `agent on node N`.
    pub what: String,
    /// The file it creates when ready.
    pub ready: PathBuf,
    /// Its log (shown when it fails).
    pub logs: Vec<PathBuf>,
    /// The process.
    pub child: &'a mut Child,
}

/// Waits until every pending process has created its ready file.
///
/// # Errors
/// [`LabError::Start`] naming the first process that exited or was not ready within
/// `timeout` (with its log), [`LabError::Interrupted`].
pub fn wait_ready(pending: &mut [Pending<'_>], timeout: Duration) -> Result<(), LabError> {
    let deadline = Instant::now() + timeout;
    let tails = |p: &Pending<'_>| {
        p.logs.iter().map(|l| format!("{}:\n{}", l.display(), log_tail(l))).collect::<Vec<_>>()
    };
    loop {
        let mut waiting = false;
        for p in pending.iter_mut() {
            if p.ready.exists() {
                continue;
            }
            if let Ok(Some(status)) = p.child.try_wait() {
                return Err(LabError::Start {
                    what: p.what.clone(),
                    reason: format!("exited ({status}) before it was ready"),
                    log: tails(p).join("\n"),
                });
            }
            waiting = true;
        }
        if !waiting {
            return Ok(());
        }
        if INTERRUPTED.load(Ordering::Relaxed) {
            return Err(LabError::Interrupted);
        }
        if Instant::now() >= deadline {
            let p = pending.iter().find(|p| !p.ready.exists()).expect("one is waiting");
            return Err(LabError::Start {
                what: p.what.clone(),
                reason: format!("not ready after {timeout:?} (no {})", p.ready.display()),
                log: tails(p).join("\n"),
            });
        }
        std::thread::sleep(POLL);
    }
}

/// Whether process `pid` has a thread that has not exited (`/proc/<pid>/task/*/stat`,
/// proc(5)): false once the process is gone or every thread is a zombie or dead.
///
/// The first thread's state alone is not enough: when a multi-threaded process is
/// killed, or its first thread calls `pthread_exit`, that thread can be a zombie while
/// the others still run, and they hold the process's files and `flock(2)` locks until
/// the last of them exits. A caller that took the zombie for the end could start the
/// next agent while the killed one's state-file lock was still held.
pub fn alive(pid: i32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return false };
    tasks.flatten().any(|t| !matches!(state(&t.path().join("stat")), None | Some('Z' | 'X')))
}

/// The state letter of a `/proc/.../stat` file (`R`, `S`, `Z`, ...; proc(5)), if it can
/// be read: "pid (comm) S ...", where comm may hold spaces and parentheses, so the state
/// follows the last ')'.
fn state(stat: &Path) -> Option<char> {
    let stat = std::fs::read_to_string(stat).ok()?;
    stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next())
}

/// Stops `pids`: SIGTERM, up to [`STOP_GRACE`] to exit, then SIGKILL and up to 1 s more.
/// Reaps those that are this process's children. Returns the pids still alive after that.
pub fn stop(pids: &[i32]) -> Vec<i32> {
    let me = std::process::id() as i32;
    let pids: Vec<i32> = pids.iter().copied().filter(|p| *p != me && *p > 1).collect();
    let reap = |pids: &[i32]| {
        for p in pids {
            let _ = waitpid(Pid::from_raw(*p), Some(WaitPidFlag::WNOHANG));
        }
    };
    let wait = |pids: &[i32], limit: Duration| {
        let deadline = Instant::now() + limit;
        loop {
            reap(pids);
            let left: Vec<i32> = pids.iter().copied().filter(|p| alive(*p)).collect();
            if left.is_empty() || Instant::now() >= deadline {
                return left;
            }
            std::thread::sleep(POLL);
        }
    };
    for p in &pids {
        let _ = kill(Pid::from_raw(*p), Signal::SIGTERM);
    }
    let left = wait(&pids, STOP_GRACE);
    for p in &left {
        let _ = kill(Pid::from_raw(*p), Signal::SIGKILL);
    }
    wait(&left, Duration::from_secs(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pending<'a>(what: &str, ready: &Path, log: &Path, child: &'a mut Child) -> Pending<'a> {
        Pending {
            what: what.into(),
            ready: ready.to_path_buf(),
            logs: vec![log.to_path_buf()],
            child,
        }
    }

    fn sh(script: &str, log: &Path) -> Child {
        let mut c = Command::new("sh");
        c.args(["-c", script]);
        spawn_detached(c, log).expect("sh starts")
    }

    #[test]
    fn serve_command_passes_close_first_ports_apart_from_the_echo_ports() {
        // A state file written before close-first ports existed still loads: none.
        let old = r#"{"netns": "t_pod_b_x", "bind": ["10.0.0.2"], "tcp": [80, 8081], "udp": []}"#;
        let mut server: ServerPlan = serde_json::from_str(old).unwrap();
        assert!(server.tcp_close_first.is_empty());
        let args = |s: &ServerPlan| -> Vec<String> {
            let c = serve_command(Path::new("/bin/tp"), s, Path::new("/r"));
            c.get_args().map(|a| a.to_string_lossy().into_owned()).collect()
        };
        let a = args(&server);
        assert!(a.windows(2).any(|w| w == ["--tcp", "80,8081"]), "{a:?}");
        assert!(!a.iter().any(|x| x == "--tcp-close-first"), "{a:?}");
        server.tcp_close_first = vec![8081];
        let a = args(&server);
        assert!(a.windows(2).any(|w| w == ["--tcp", "80"]), "{a:?}");
        assert!(a.windows(2).any(|w| w == ["--tcp-close-first", "8081"]), "{a:?}");
    }

    #[test]
    fn ready_files_end_the_wait() {
        let dir = tempfile::tempdir().unwrap();
        let (ready, log) = (dir.path().join("a.ready"), dir.path().join("a.log"));
        let mut child = sh(&format!("sleep 0.1; touch {}; sleep 5", ready.display()), &log);
        let mut list = [pending("agent on node a", &ready, &log, &mut child)];
        wait_ready(&mut list, Duration::from_secs(5)).expect("ready");
        assert!(stop(&[child.id() as i32]).is_empty());
    }

    #[test]
    fn an_exit_before_ready_names_the_process_and_shows_its_log() {
        let dir = tempfile::tempdir().unwrap();
        let (ready, log) = (dir.path().join("b.ready"), dir.path().join("b.log"));
        let mut child = sh("echo bad flag >&2; exit 3", &log);
        let mut list = [pending("agent on node b", &ready, &log, &mut child)];
        let e = wait_ready(&mut list, Duration::from_secs(5)).unwrap_err().to_string();
        assert!(
            e.starts_with("agent on node b: exited (exit status: 3) before it was ready"),
            "{e}"
        );
        assert!(e.contains("bad flag"), "{e}");
    }

    /// A process whose first thread has exited while another still runs is alive: the
    /// running thread holds its files and locks (the killed agent's state-file lock, which
    /// made `the_next_agent_restores_tcp_tw_reuse_a_crashed_one_left_set` flaky).
    #[test]
    fn a_process_is_alive_while_any_thread_runs_after_its_first_one_exited() {
        let dir = tempfile::tempdir().unwrap();
        // python3's main thread leaves with pthread_exit; its other thread sleeps on.
        let script = "import ctypes, threading, time\n\
            threading.Thread(target=time.sleep, args=(30,)).start()\n\
            ctypes.CDLL(None).pthread_exit(None)\n";
        let mut c = Command::new("python3");
        c.args(["-c", script]);
        let mut child = spawn_detached(c, &dir.path().join("py.log")).expect("python3 starts");
        let pid = child.id() as i32;
        let leader = PathBuf::from(format!("/proc/{pid}/stat"));
        let deadline = Instant::now() + Duration::from_secs(10);
        while state(&leader) != Some('Z') {
            assert!(Instant::now() < deadline, "the first thread did not exit");
            std::thread::sleep(POLL);
        }
        assert!(alive(pid), "the sleeping thread still runs");
        assert!(stop(&[pid]).is_empty());
        assert!(!alive(pid));
        let _ = child.wait(); // `stop` reaped it already
    }

    #[test]
    fn a_process_that_never_gets_ready_times_out_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let (ready, log) = (dir.path().join("c.ready"), dir.path().join("c.log"));
        let mut child = sh("sleep 5", &log);
        let pid = child.id() as i32;
        let mut list = [pending("agent on node c", &ready, &log, &mut child)];
        let e = wait_ready(&mut list, Duration::from_millis(200)).unwrap_err().to_string();
        assert!(e.starts_with("agent on node c: not ready after 200ms (no "), "{e}");
        assert!(e.contains("c.ready"), "{e}");
        // Detached in its own session, and SIGTERM (unblocked in the child) stops it.
        assert_eq!(nix::unistd::getsid(Some(Pid::from_raw(pid))).ok(), Some(Pid::from_raw(pid)));
        assert!(stop(&[pid]).is_empty());
        assert!(!alive(pid));
    }
}
