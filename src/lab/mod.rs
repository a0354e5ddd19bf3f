//! The lab: a local multi-node "cluster" of network namespaces built from ordinary
//! Kubernetes manifests, with echo servers in every pod, real probes, and (unless
//! `--no-agents`) a tierproxy agent on every node.
//!
//! Layout:
//! - [`plan`]: manifests (+ probes) → topology value and its `ip -batch` scripts (pure).
//! - [`dualstack`]: `lab up --dual-stack`: IPv6 addresses for IPv4-only pods and nodes.
//! - [`netns`]: privileges, `ip`, namespaces, `setns`, sysctls.
//! - [`procs`]: background processes (echo servers, agents: [`procs::agent_command`]),
//!   readiness, stopping, Ctrl-C.
//! - [`serve`]: the echo server protocol (`tierproxy lab serve`).
//! - [`service`]: ClusterIP and NodePort Services from the manifests → kube-proxy-like
//!   nftables DNAT in every node namespace.
//! - [`synth`]: `lab synth`: a lab's manifests plus a large policy set it does not build.
//! - [`sctp`]: SCTP INIT / INIT ACK / ABORT packets on raw sockets (kernels without SCTP).
//! - [`probe`]: real connections from inside namespaces.
//! - [`report`]: table, matrix and JSON output.
//! - [`state`]: the state file (`/run/tierproxy-lab/<prefix>/state.json`).
//! - this file: the commands — [`up`], [`down`], [`probe_lab`], [`exec`], [`run`].
//!
//! Names: every namespace is `<prefix>_fabric`, `<prefix>_node_<node>` or
//! `<prefix>_pod_<namespace>_<pod>`; `_` never occurs in a prefix or a Kubernetes name, so
//! `lab down` finds a lab's namespaces by name alone, also without its state file.
//!
//! Agents and `lab probe` read a staged copy of the manifests, `<state dir>/manifests/`
//! ([`stage_manifests`]); `lab apply` ([`apply`]) replaces it, and the agents apply the
//! change live (issue #5).

pub mod cli;
pub mod dualstack;
pub mod netns;
pub mod plan;
pub mod probe;
pub mod procs;
pub mod relay;
pub mod report;
pub mod sctp;
pub mod serve;
pub mod service;
pub mod state;
pub mod synth;

use std::collections::BTreeMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::explain::{self, Probe};
use crate::policy::Flow;
use plan::{Plan, PlanError, netns_prefix, validate_prefix};
use probe::{Job, Observed};
use procs::{Pending, interrupted};
use report::Row;
use state::{ProcessRecord, Role, STATE_VERSION, State, state_dir, state_file};

/// Default prefix of a lab's namespace names ("tierproxy lab").
pub const DEFAULT_PREFIX: &str = "tpl";
/// Exit code: the lab could not be built or used (privileges, `ip`, a namespace
/// operation, a server or agent that did not start, no lab up). Codes 0–2 are `explain`'s.
pub const EXIT_LAB: u8 = 3;

/// Why a lab command failed.
#[derive(Debug, thiserror::Error)]
pub enum LabError {
    /// Missing capabilities.
    #[error("the lab needs {missing} (run as root)")]
    Privileges {
        /// Capability names, `and`-joined.
        missing: String,
    },
    /// No `ip` command.
    #[error("`ip` (iproute2) is not installed or not on PATH; the lab needs it")]
    IpMissing,
    /// Programs the lab runs are not installed (and were not installed for it).
    #[error(
        "the lab needs {tools}, which this machine lacks; install them with `{command}` (Debian, Ubuntu)"
    )]
    ToolsMissing {
        /// The programs, comma-joined.
        tools: String,
        /// The command that installs them.
        command: String,
    },
    /// A command could not be started.
    #[error("cannot run {command}")]
    Spawn {
        /// The command.
        command: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A command failed.
    #[error("{command} failed: {stderr}")]
    Command {
        /// The command (and the failing batch line).
        command: String,
        /// Its stderr.
        stderr: String,
    },
    /// A namespace could not be opened, entered or configured.
    #[error("netns {netns}: {what}")]
    Netns {
        /// The namespace.
        netns: String,
        /// What failed.
        what: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A state, log or ready file could not be read or written.
    #[error("{path}")]
    State {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// An echo server could not bind.
    #[error("cannot bind {protocol} {addr}")]
    Bind {
        /// The address and port.
        addr: SocketAddr,
        /// `TCP` or `UDP`.
        protocol: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A server or agent did not become ready.
    #[error("{what}: {reason}\n{log}")]
    Start {
        /// `echo server in netns X` or `agent on node N`.
        what: String,
        /// Why.
        reason: String,
        /// The end of its logs.
        log: String,
    },
    /// Interrupted by a signal.
    #[error("interrupted")]
    Interrupted,
    /// No state file for the prefix.
    #[error("lab {prefix:?} is not up (no {path}); start it with `tierproxy lab up`")]
    NotUp {
        /// The prefix.
        prefix: String,
        /// The missing state file.
        path: PathBuf,
    },
    /// The prefix is in use.
    #[error(
        "lab {prefix:?} is already up ({what}); run `tierproxy lab down --prefix {prefix}` first"
    )]
    AlreadyUp {
        /// The prefix.
        prefix: String,
        /// What was found.
        what: String,
    },
    /// The topology cannot be planned.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// Invalid manifests or probes (details were printed to stderr).
    #[error("{0}")]
    Invalid(String),
    /// `lab exec` target not in the lab.
    #[error("no {target} in lab {prefix:?} (give namespace/pod, node/<name> or fabric)")]
    UnknownTarget {
        /// The target given.
        target: String,
        /// The lab.
        prefix: String,
    },
    /// `lab down` could not remove everything.
    #[error("lab {prefix:?} not fully removed: {problems}")]
    Leftovers {
        /// The prefix.
        prefix: String,
        /// What is left, `; `-joined.
        problems: String,
    },
}

impl LabError {
    /// The process exit code for this error: [`explain::EXIT_INVALID`] for bad input
    /// (manifests, probes, prefix, target), [`EXIT_LAB`] otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            LabError::Invalid(_) | LabError::Plan(_) | LabError::UnknownTarget { .. } => {
                explain::EXIT_INVALID
            }
            _ => EXIT_LAB,
        }
    }
}

/// What `lab up` builds.
#[derive(Debug, Clone)]
pub struct UpOptions {
    /// Namespace name prefix ([`DEFAULT_PREFIX`]).
    pub prefix: String,
    /// Directory of state directories ([`state::DEFAULT_STATE_ROOT`]).
    pub state_root: PathBuf,
    /// Manifest files or directories.
    pub manifests: Vec<PathBuf>,
    /// Probes whose ports and external addresses the lab should serve.
    pub probes: Option<PathBuf>,
    /// Start an agent per node (false: plain kernel forwarding).
    pub agents: bool,
    /// Extra `tierproxy agent` options for every agent (`--agent-arg`).
    pub agent_args: Vec<String>,
    /// Agents audit every decision to `<state dir>/audit-<node>.jsonl`.
    pub audit: bool,
    /// Give every IPv4-only pod and node an IPv6 address too (`--dual-stack`: the plan,
    /// the agents and `lab probe` read the augmented manifests; see [`dualstack`]).
    pub dual_stack: bool,
    /// Install the programs the lab needs with `apt-get` when they are missing
    /// ([`netns::ensure_tools`]); `false` (`--no-install`): fail, naming them.
    pub install_tools: bool,
}

fn absolute(p: &Path) -> Result<PathBuf, LabError> {
    p.canonicalize().map_err(|source| LabError::State { path: p.to_path_buf(), source })
}

/// Reads, resolves and pairs probes with their flows, as `explain` does.
fn resolve_probes(
    loaded: &crate::cluster::manifest::Loaded,
    snapshot: &crate::policy::Snapshot,
    path: &Path,
) -> Result<Vec<(Probe, Flow)>, LabError> {
    let probes = explain::read_probes(path).map_err(|e| {
        LabError::Invalid(format!("{}: {}", path.display(), crate::error::chain(&e)))
    })?;
    probes
        .into_iter()
        .map(|(line, p)| {
            explain::resolve(snapshot, loaded, line, &p)
                .map(|f| (p, f))
                .map_err(|e| LabError::Invalid(format!("{}: {e}", path.display())))
        })
        .collect()
}

fn stop_requested() -> Result<(), LabError> {
    if interrupted().load(Ordering::Relaxed) { Err(LabError::Interrupted) } else { Ok(()) }
}

/// Builds a lab: namespaces, links, addresses and routes, echo servers and (with
/// `agents`) one agent per node; waits until servers listen and agents are ready. Notes
/// (skipped pods, manifest problems) go to `err`. On failure everything built is removed.
///
/// # Errors
/// [`LabError`]: environment, an existing lab with this prefix, invalid input, a failed
/// `ip` command, a server or agent that did not start, an interruption.
pub fn up(opts: &UpOptions, err: &mut dyn Write) -> Result<State, LabError> {
    netns::check_environment()?;
    netns::ensure_tools(opts.agents, opts.install_tools, err)?;
    validate_prefix(&opts.prefix)?;
    let dir = state_dir(&opts.state_root, &opts.prefix);
    if state_file(&dir).exists() {
        let what = format!("{} exists", state_file(&dir).display());
        return Err(LabError::AlreadyUp { prefix: opts.prefix.clone(), what });
    }
    let existing = netns::list_netns(&netns_prefix(&opts.prefix))?;
    if !existing.is_empty() {
        let what = format!("namespaces {} exist", existing.join(", "));
        return Err(LabError::AlreadyUp { prefix: opts.prefix.clone(), what });
    }
    let manifests = opts.manifests.iter().map(|p| absolute(p)).collect::<Result<Vec<_>, _>>()?;
    let probes = opts.probes.as_deref().map(absolute).transpose()?;
    let (loaded, compiled, invalid) = explain::load_and_compile(&manifests, err);
    if invalid {
        return Err(LabError::Invalid("invalid manifests (see above); no lab built".into()));
    }
    // `--dual-stack`: from here on, the manifests with IPv6 addresses added.
    let (loaded, compiled, dual_stack) = if opts.dual_stack {
        let d = dualstack::DualStack::new(&loaded.inputs, &dir)
            .map_err(|e| LabError::Invalid(crate::error::chain(&e)))?;
        d.note(err);
        (d.loaded, d.compiled, Some((d.path, d.text)))
    } else {
        (loaded, compiled, None)
    };
    let flows: Vec<Flow> = match &probes {
        Some(p) => {
            resolve_probes(&loaded, &compiled.snapshot, p)?.into_iter().map(|(_, f)| f).collect()
        }
        None => Vec::new(),
    };
    // Services are read from the files given (a `--dual-stack` copy holds the policy
    // inputs only); the policy loader skips them.
    let services =
        service::read(&manifests).map_err(|e| LabError::Invalid(crate::error::chain(&e)))?;
    let plan = Plan::build(&opts.prefix, &loaded, &compiled.snapshot, &flows, &services)?;
    for s in &plan.skipped {
        let _ = writeln!(err, "note: lab: skipped {}: {}", s.object, s.reason);
    }
    let u = plan.uninstantiated;
    if u.pods + u.nodes > 0 {
        let _ = writeln!(
            err,
            "note: lab: {} pods and {} nodes not built ({}: \"false\"); the agents still see them",
            u.pods,
            u.nodes,
            plan::INSTANTIATE_ANNOTATION
        );
    }
    std::fs::create_dir_all(&dir)
        .map_err(|source| LabError::State { path: dir.clone(), source })?;
    let is_dual_stack = dual_stack.is_some();
    let manifests = match dual_stack {
        Some((path, text)) => {
            std::fs::write(&path, text)
                .map_err(|source| LabError::State { path: path.clone(), source })?;
            vec![path]
        }
        None => manifests,
    };
    // Agents and `lab probe` read a copy that `lab apply` replaces.
    let staged = stage_manifests(&manifests, &dir)?;
    let mut state = State {
        version: STATE_VERSION,
        dir,
        manifests: vec![staged],
        probes,
        agents: opts.agents,
        dual_stack: is_dual_stack,
        plan,
        processes: Vec::new(),
    };
    let mut children = Vec::new();
    match build(&mut state, &mut children, &opts.agent_args, opts.audit) {
        Ok(()) => Ok(state),
        Err(e) => {
            if let Err(d) = down(&opts.state_root, &opts.prefix) {
                let _ = writeln!(err, "error: cleaning up after a failed `lab up`: {d}");
            }
            Err(e)
        }
    }
}

/// Sysctls of every namespace: no reverse-path filter (transparently proxied flows and
/// asymmetric lab routes would fail it), no duplicate address detection (addresses usable
/// at once). Set before links exist, so `default` applies to every interface.
const SYSCTLS_ALL: [(&str, &str); 4] = [
    ("net.ipv4.conf.all.rp_filter", "0"),
    ("net.ipv4.conf.default.rp_filter", "0"),
    ("net.ipv6.conf.all.accept_dad", "0"),
    ("net.ipv6.conf.default.accept_dad", "0"),
];
/// Sysctls of node namespaces: they are routers.
const SYSCTLS_NODE: [(&str, &str); 2] =
    [("net.ipv4.ip_forward", "1"), ("net.ipv6.conf.all.forwarding", "1")];

fn build(
    state: &mut State,
    children: &mut Vec<Child>,
    agent_args: &[String],
    audit: bool,
) -> Result<(), LabError> {
    // Saved first: a crash from here on leaves a state file naming what was planned.
    state.save()?;
    let plan = state.plan.clone();
    let all = plan.all_netns();
    let adds: Vec<String> = all.iter().map(|n| format!("netns add {n}")).collect();
    netns::ip_batch(None, &adds)?;
    for ns in &all {
        let is_node = plan.nodes.iter().any(|n| &n.netns == ns);
        netns::in_netns(ns, || {
            for (k, v) in SYSCTLS_ALL {
                netns::sysctl(ns, k, v)?;
            }
            if is_node {
                for (k, v) in SYSCTLS_NODE {
                    netns::sysctl(ns, k, v)?;
                }
            }
            Ok(())
        })?;
    }
    stop_requested()?;
    netns::ip_batch(None, &plan.link_script())?;
    for (ns, script) in plan.netns_scripts() {
        netns::ip_batch(Some(&ns), &script)?;
    }
    // kube-proxy's part: ClusterIP DNAT on every node, before anything sends.
    if !plan.services.is_empty() {
        let script = service::nft_script(&plan.services);
        for node in &plan.nodes {
            netns::ip(&["netns", "exec", &node.netns, "nft", "-f", "-"], Some(&script))?;
        }
    }
    stop_requested()?;

    let exe = std::env::current_exe()
        .map_err(|source| LabError::Spawn { command: "current executable".into(), source })?;
    let mut pending = Vec::new();
    for server in &plan.servers {
        let ready = state.dir.join(format!("serve-{}.ready", server.netns));
        let log = state.dir.join(format!("serve-{}.log", server.netns));
        remove_stale(&ready)?;
        let child = procs::spawn_detached(procs::serve_command(&exe, server, &ready), &log)?;
        state.processes.push(ProcessRecord {
            pid: child.id(),
            netns: server.netns.clone(),
            role: Role::Server,
            log: log.clone(),
        });
        children.push(child);
        pending.push((format!("echo server in netns {}", server.netns), ready, vec![log]));
    }
    state.save()?;
    wait_for(&pending, children, procs::SERVER_READY_TIMEOUT)?;

    if state.agents {
        let first = children.len();
        let mut pending = Vec::new();
        let enforcing: Vec<String> = plan.nodes.iter().map(|n| n.name.clone()).collect();
        // `TIERPROXY_LAB_AGENT`: another build of tierproxy to run as the agents, such as
        // the agent image's (built without the lab, `--no-default-features`), so that the
        // lab and loadtest/ measure the binary nodes run.
        let agent_exe =
            std::env::var_os("TIERPROXY_LAB_AGENT").map_or_else(|| exe.clone(), PathBuf::from);
        for node in &plan.nodes {
            let ready = state.dir.join(format!("agent-{}.ready", node.name));
            let log = state.dir.join(format!("agent-{}.log", node.name));
            let out = state.dir.join(format!("agent-{}.out", node.name));
            remove_stale(&ready)?;
            let cmd = procs::agent_command(
                &agent_exe,
                &node.netns,
                &node.name,
                &state.manifests,
                &procs::AgentFiles {
                    log: log.clone(),
                    ready: ready.clone(),
                    audit: audit.then(|| procs::audit_file(&state.dir, &node.name)),
                    handover: procs::handover_socket(&state.dir, &node.name),
                },
                &enforcing,
                agent_args,
            );
            let child = procs::spawn_detached(cmd, &out)?;
            state.processes.push(ProcessRecord {
                pid: child.id(),
                netns: node.netns.clone(),
                role: Role::Agent,
                log: out.clone(),
            });
            children.push(child);
            pending.push((format!("agent on node {}", node.name), ready, vec![log, out]));
        }
        state.save()?;
        wait_for(&pending, &mut children[first..], procs::AGENT_READY_TIMEOUT)?;
    }
    Ok(())
}

/// Removes a ready file left by an earlier run, so only a fresh one counts.
fn remove_stale(ready: &Path) -> Result<(), LabError> {
    match std::fs::remove_file(ready) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(LabError::State { path: ready.to_path_buf(), source: e })
        }
        _ => Ok(()),
    }
}

fn wait_for(
    pending: &[(String, PathBuf, Vec<PathBuf>)],
    children: &mut [Child],
    timeout: Duration,
) -> Result<(), LabError> {
    let mut list: Vec<Pending<'_>> = pending
        .iter()
        .zip(children.iter_mut())
        .map(|((what, ready, logs), child)| Pending {
            what: what.clone(),
            ready: ready.clone(),
            logs: logs.clone(),
            child,
        })
        .collect();
    procs::wait_ready(&mut list, timeout)
}

/// What `lab down` removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DownReport {
    /// Namespaces deleted.
    pub netns: Vec<String>,
    /// Processes stopped.
    pub processes: usize,
}

/// Removes lab `prefix`: stops every process in its namespaces, deletes the namespaces
/// (found by name, so this works without the state file, after a crash), removes the state
/// directory. Removing nothing is not an error.
///
/// # Errors
/// Environment errors, [`LabError::Leftovers`] naming what could not be removed.
pub fn down(state_root: &Path, prefix: &str) -> Result<DownReport, LabError> {
    netns::check_environment()?;
    validate_prefix(prefix)?;
    let names = netns::list_netns(&netns_prefix(prefix))?;
    let pids: Vec<i32> = names.iter().flat_map(|n| netns::netns_pids(n)).collect();
    let survivors = procs::stop(&pids);
    let mut problems = Vec::new();
    if !survivors.is_empty() {
        problems.push(format!("processes {survivors:?} survived SIGKILL"));
    }
    for n in &names {
        if let Err(e) = netns::ip(&["netns", "del", n], None) {
            problems.push(e.to_string());
        }
    }
    let dir = state_dir(state_root, prefix);
    match std::fs::remove_dir_all(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => problems.push(format!("{}: {e}", dir.display())),
    }
    if problems.is_empty() {
        Ok(DownReport { netns: names, processes: pids.len() })
    } else {
        Err(LabError::Leftovers { prefix: prefix.to_string(), problems: problems.join("; ") })
    }
}

/// One node's agent replaced by `lab upgrade`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Upgraded {
    /// The node.
    pub node: String,
    /// The agent that ran.
    pub old_pid: u32,
    /// The agent that runs now.
    pub new_pid: u32,
    /// Whether the old agent handed its queues, listeners and connections over (its log
    /// says so); `false`: it was stopped and drained instead.
    pub handed_over: bool,
    /// From the new agent's start until it was ready, milliseconds.
    pub ready_ms: u64,
}

/// `lab upgrade`: starts a new agent on each node of lab `prefix` (only `node`, when
/// given), running `exe` with the old agent's own arguments (new log and ready files),
/// waits until it is ready — it takes over from the old agent through the node's
/// hand-over socket (issue #23) — then stops the old one (SIGTERM; after a hand-over it
/// only waits for that) and records the new one in the lab's state.
///
/// # Errors
/// [`LabError`]: no such lab or node, the old agent's arguments unreadable, the new agent
/// not ready in [`procs::AGENT_READY_TIMEOUT`] (it is stopped again; the old one runs on).
pub fn upgrade(
    state_root: &Path,
    prefix: &str,
    exe: &Path,
    node: Option<&str>,
) -> Result<Vec<Upgraded>, LabError> {
    netns::check_environment()?;
    let mut state = State::load(state_root, prefix)?;
    let nodes: Vec<plan::NodePlan> = state
        .plan
        .nodes
        .iter()
        .filter(|n| node.is_none_or(|want| n.name == want))
        .cloned()
        .collect();
    if nodes.is_empty() {
        return Err(LabError::UnknownTarget {
            target: format!("node/{}", node.unwrap_or("")),
            prefix: prefix.to_string(),
        });
    }
    let mut done = Vec::new();
    for n in nodes {
        let Some(i) = state.processes.iter().position(|p| {
            p.role == Role::Agent && p.netns == n.netns && procs::alive(p.pid as i32)
        }) else {
            return Err(LabError::Start {
                what: format!("upgrade of node {}", n.name),
                reason: "no agent runs on it (a lab without agents, or its agent exited)".into(),
                log: String::new(),
            });
        };
        let old = state.processes[i].clone();
        let cmdline_path = PathBuf::from(format!("/proc/{}/cmdline", old.pid));
        let cmdline = std::fs::read(&cmdline_path)
            .map_err(|e| LabError::State { path: cmdline_path.clone(), source: e })?;
        // Each agent its own files: an old agent removes its ready file as it exits.
        let generation = (2..)
            .find(|g| !state.dir.join(format!("agent-{}.{g}.log", n.name)).exists())
            .expect("a free generation");
        let file = |ext: &str| state.dir.join(format!("agent-{}.{generation}.{ext}", n.name));
        let (log, ready, out) = (file("log"), file("ready"), file("out"));
        remove_stale(&ready)?;
        let mut args: Vec<std::ffi::OsString> = cmdline
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .skip(1)
            .map(|a| <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(a).to_owned())
            .collect();
        // The old agent's own log: it says whether it handed over.
        let old_log =
            args.iter().position(|a| a == "--log").and_then(|k| args.get(k + 1)).map(PathBuf::from);
        for (flag, value) in [("--log", &log), ("--ready-file", &ready)] {
            if let Some(v) = args.iter().position(|a| a == flag).and_then(|k| args.get_mut(k + 1)) {
                *v = value.clone().into_os_string();
            }
        }
        let mut cmd = std::process::Command::new(exe);
        cmd.args(&args);
        let started = std::time::Instant::now();
        let mut child = procs::spawn_detached(cmd, &out)?;
        let what = format!("new agent on node {}", n.name);
        if let Err(e) = wait_for(
            &[(what, ready.clone(), vec![log.clone(), out.clone()])],
            std::slice::from_mut(&mut child),
            procs::AGENT_READY_TIMEOUT,
        ) {
            procs::stop(&[child.id() as i32]);
            return Err(e);
        }
        let ready_ms = started.elapsed().as_millis() as u64;
        procs::stop(&[old.pid as i32]);
        let handed_over = old_log.is_some_and(|l| {
            std::fs::read_to_string(l).is_ok_and(|t| t.contains("handed over to the next agent"))
        });
        state.processes[i] =
            ProcessRecord { pid: child.id(), netns: n.netns.clone(), role: Role::Agent, log: out };
        state.save()?;
        done.push(Upgraded {
            node: n.name.clone(),
            old_pid: old.pid,
            new_pid: child.id(),
            handed_over,
            ready_ms,
        });
    }
    Ok(done)
}

/// Output of `lab probe`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// One row per probe.
    Table,
    /// JSON Lines.
    Json,
    /// Connectivity matrix.
    Matrix,
}

/// Probes a running lab.
#[derive(Debug, Clone)]
pub struct ProbeOptions {
    /// The lab's prefix.
    pub prefix: String,
    /// Directory of state directories.
    pub state_root: PathBuf,
    /// JSON Lines probe file (`explain`'s format).
    pub probes: PathBuf,
    /// Connect (and per-read) timeout.
    pub timeout: Duration,
    /// Output format.
    pub output: Output,
}

/// Makes every probe of `opts.probes` for real in lab `opts.prefix` and writes the result
/// beside `explain`'s verdict. Returns the rows (for callers that want them) and the exit
/// code: 0 every observation agrees with `explain`, 1 otherwise (errors included).
///
/// # Errors
/// [`LabError`]: environment, no such lab, invalid manifests or probes.
pub fn probe_lab(
    opts: &ProbeOptions,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<(Vec<Row>, u8), LabError> {
    netns::check_environment()?;
    let state = State::load(&opts.state_root, &opts.prefix)?;
    let (loaded, compiled, invalid) = explain::load_and_compile(&state.manifests, err);
    if invalid {
        return Err(LabError::Invalid("invalid manifests (see above); nothing probed".into()));
    }
    let s = &compiled.snapshot;
    let pairs = resolve_probes(&loaded, s, &opts.probes)?;
    let jobs: Vec<Job> = pairs
        .iter()
        .map(|(_, flow)| {
            let unheld = |end: &str, addr| {
                format!(
                    "no namespace of the lab holds {end} {addr} (a skipped pod, or an address not in the probes given to `lab up`)"
                )
            };
            let netns = match (state.plan.owner(flow.src), state.plan.owner(flow.dst)) {
                (Some(ns), Some(_)) => Ok(ns.to_string()),
                (None, _) => Err(unheld("source", flow.src)),
                (_, None) => Err(unheld("destination", flow.dst)),
            };
            Job { netns, flow: *flow }
        })
        .collect();
    let audit_files: Vec<(PathBuf, u64)> = if state.agents {
        state
            .plan
            .nodes
            .iter()
            .map(|n| procs::audit_file(&state.dir, &n.name))
            .filter_map(|f| {
                let len = std::fs::metadata(&f).ok()?.len();
                Some((f, len))
            })
            .collect()
    } else {
        Vec::new()
    };
    let observations = probe::run_all(&jobs, opts.timeout, interrupted());
    let rows: Vec<Row> = pairs
        .into_iter()
        .zip(observations)
        .map(|((p, flow), mut observation)| {
            // A refusal by a port the lab does not serve says nothing of policy: the
            // lab's setup is short of a server, an error.
            if observation.observed == Observed::Reject
                && !state.plan.serves(flow.dst, flow.protocol, flow.dst_port)
            {
                let word = observation.detail.split(' ').next().unwrap_or("refused").to_owned();
                observation.observed = Observed::Error;
                observation.detail = format!(
                    "{word} (nothing in the lab serves {}/{}: give the probes to `lab up`)",
                    SocketAddr::new(flow.dst, flow.dst_port),
                    flow.protocol
                );
            }
            Row { explained: explain::probe_json(s, &p, &flow), probe: p, flow, observation }
        })
        .collect();
    let written = match opts.output {
        Output::Json => report::write_json(&rows, out),
        Output::Table => report::write_table(&rows, out),
        Output::Matrix => report::write_matrix(&rows, out),
    };
    let _ = written;
    if opts.output != Output::Json && !audit_files.is_empty() {
        let _ = write_audit(&audit_files, out);
    }
    stop_requested()?;
    let code = report::Summary::of(&rows).exit_code();
    Ok((rows, code))
}

/// Prints what the agents audited while the probes ran: the JSON Lines appended to each
/// agent's audit file since `files`' lengths were taken. Waits for the deny aggregation
/// window first, so the probes' denies are in.
fn write_audit(files: &[(PathBuf, u64)], out: &mut dyn Write) -> std::io::Result<()> {
    std::thread::sleep(Duration::from_millis(procs::LAB_DENY_WINDOW_MS + 400));
    writeln!(out, "\naudit events (JSON Lines from each agent; docs/audit.md):")?;
    for (f, from) in files {
        let Ok(bytes) = std::fs::read(f) else { continue };
        let new = bytes.get(*from as usize..).unwrap_or_default();
        out.write_all(new)?;
    }
    Ok(())
}

/// Runs `command` (program and arguments) inside the namespace of `target` (`namespace/pod`,
/// `node/<name>`, `fabric`) of lab `prefix`, with this process's stdio; returns its exit
/// code (128 + signal number if a signal ended it).
///
/// # Errors
/// [`LabError::NotUp`], [`LabError::UnknownTarget`], [`LabError::Spawn`].
pub fn exec(
    state_root: &Path,
    prefix: &str,
    target: &str,
    command: &[String],
) -> Result<u8, LabError> {
    netns::check_environment()?;
    let state = State::load(state_root, prefix)?;
    let ns = state.plan.netns_of_target(target).ok_or_else(|| LabError::UnknownTarget {
        target: target.to_string(),
        prefix: prefix.to_string(),
    })?;
    let status = std::process::Command::new("ip")
        .args(["netns", "exec", ns])
        .args(command)
        .status()
        .map_err(|source| LabError::Spawn { command: format!("ip netns exec {ns} ..."), source })?;
    use std::os::unix::process::ExitStatusExt;
    Ok(match (status.code(), status.signal()) {
        (Some(c), _) => u8::try_from(c).unwrap_or(1),
        (None, Some(sig)) => 128u8.saturating_add(u8::try_from(sig).unwrap_or(0)),
        (None, None) => 1,
    })
}

/// `lab up`, probe, `lab down` in one go; `down` runs also when `up` or probing fails or
/// is interrupted. Returns the exit code (a `down` failure turns success into
/// [`EXIT_LAB`]).
pub fn run(
    up_opts: &UpOptions,
    timeout: Duration,
    output: Output,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> u8 {
    let Some(probes) = up_opts.probes.clone() else {
        let _ = writeln!(err, "error: `lab run` needs --probes");
        return explain::EXIT_INVALID;
    };
    let code = match up(up_opts, err) {
        Err(e) => {
            let _ = writeln!(err, "error: {}", crate::error::chain(&e));
            // `up` cleaned up after itself.
            return e.exit_code();
        }
        Ok(state) => {
            let _ = writeln!(err, "{}", up_summary(&state));
            let opts = ProbeOptions {
                prefix: up_opts.prefix.clone(),
                state_root: up_opts.state_root.clone(),
                probes,
                timeout,
                output,
            };
            // `up` already printed the manifests' notes.
            match probe_lab(&opts, out, &mut std::io::sink()) {
                Ok((_, code)) => code,
                Err(e) => {
                    let _ = writeln!(err, "error: {}", crate::error::chain(&e));
                    e.exit_code()
                }
            }
        }
    };
    match down(&up_opts.state_root, &up_opts.prefix) {
        Ok(_) => code,
        Err(e) => {
            let _ = writeln!(err, "error: {}", crate::error::chain(&e));
            if code == 0 { EXIT_LAB } else { code }
        }
    }
}

/// One line describing a lab that is up.
pub fn up_summary(state: &State) -> String {
    let p = &state.plan;
    format!(
        "lab {:?} up: {} nodes, {} pods, {} hostNetwork pods, {} external addresses, {} servers, {}; state in {}",
        p.prefix,
        p.nodes.len(),
        p.pods.len(),
        p.host_pods.len(),
        p.external.len(),
        p.servers.len(),
        if state.agents { "agents on every node" } else { "no agents (kernel forwarding)" },
        state.dir.display()
    ) + &if p.services.is_empty() {
        String::new()
    } else {
        format!(
            "; {} Services, ClusterIP and NodePort (nftables table inet {})",
            p.services.len(),
            service::TABLE
        )
    }
}

/// Where the built-in example lives: `$TIERPROXY_EXAMPLES`, else `examples/` of the source
/// tree this binary was built from.
pub fn examples_dir() -> PathBuf {
    std::env::var_os("TIERPROXY_EXAMPLES")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("examples"))
}

/// The built-in example's manifests and probes under `dir`: `cluster.yaml`, `policies/`,
/// `probes.jsonl`.
pub fn example_inputs(dir: &Path) -> (Vec<PathBuf>, PathBuf) {
    (vec![dir.join("cluster.yaml"), dir.join("policies")], dir.join("probes.jsonl"))
}

/// Name of the directory in a lab's state directory that holds the manifests its agents
/// read (and `lab probe` explains against): copies of the files given to `lab up`, replaced
/// by `lab apply`.
pub const STAGED_MANIFESTS: &str = "manifests";

/// Copies every manifest file under `paths` (as the manifest loader finds them) into
/// `dir/manifests/` as `NNNN-<file name>`, keeping the loader's order, and removes what
/// else was there. Files are written under temporary names the loader skips and then
/// renamed into place, and stale files are removed last, so a watcher sees complete files
/// only. Returns the directory.
///
/// # Errors
/// A path that cannot be read, or the staging directory that cannot be written.
pub fn stage_manifests(paths: &[PathBuf], dir: &Path) -> Result<PathBuf, LabError> {
    let staged = dir.join(STAGED_MANIFESTS);
    std::fs::create_dir_all(&staged)
        .map_err(|source| LabError::State { path: staged.clone(), source })?;
    let mut errors = Vec::new();
    let files: Vec<PathBuf> =
        paths.iter().flat_map(|p| crate::cluster::manifest::files(p, &mut errors)).collect();
    if let Some(e) = errors.into_iter().next() {
        return Err(LabError::Invalid(crate::error::chain(&e)));
    }
    let mut keep = std::collections::BTreeSet::new();
    for (i, file) in files.iter().enumerate() {
        let name = file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        // The loader reads a named file whatever its extension, a directory's files only
        // with a manifest extension: keep one it will read.
        let ext = if name.ends_with(".yaml") || name.ends_with(".yml") || name.ends_with(".json") {
            ""
        } else {
            ".yaml"
        };
        let target = format!("{i:04}-{name}{ext}");
        let text =
            std::fs::read(file).map_err(|source| LabError::State { path: file.clone(), source })?;
        let tmp = staged.join(format!(".{target}.tmp"));
        std::fs::write(&tmp, text)
            .map_err(|source| LabError::State { path: tmp.clone(), source })?;
        std::fs::rename(&tmp, staged.join(&target))
            .map_err(|source| LabError::State { path: tmp.clone(), source })?;
        keep.insert(target);
    }
    let entries = std::fs::read_dir(&staged)
        .map_err(|source| LabError::State { path: staged.clone(), source })?;
    for e in entries.flatten() {
        if !keep.contains(&*e.file_name().to_string_lossy()) {
            let _ = std::fs::remove_file(e.path());
        }
    }
    Ok(staged)
}

/// How long `lab apply` waits for every agent to report the new snapshot.
pub const APPLY_TIMEOUT: Duration = Duration::from_secs(15);

/// One agent's answer to `lab apply`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    /// The node.
    pub node: String,
    /// The agent's log line for the new snapshot (`snapshot applied ...`), or why there is
    /// none (the manifests could not be used, or no answer within [`APPLY_TIMEOUT`]).
    pub outcome: Result<String, String>,
}

/// Replaces a running lab's manifests with those under `manifests` (`tierproxy lab apply`):
/// the agents watch them and apply the change live (issue #5), cutting connections the new
/// policies deny; `lab probe` explains against them from then on. Waits until every agent
/// logged the new snapshot, or its refusal. The topology is not rebuilt: pods added here
/// have no namespace (the agents still intercept their addresses).
///
/// # Errors
/// [`LabError`]: no such lab, manifests that cannot be read (parse errors are not refused:
/// the agents keep their last good snapshot, which is what a user may want to see).
pub fn apply(
    state_root: &Path,
    prefix: &str,
    manifests: &[PathBuf],
    err: &mut dyn Write,
) -> Result<Vec<Applied>, LabError> {
    let state = State::load(state_root, prefix)?;
    let manifests = manifests.iter().map(|p| absolute(p)).collect::<Result<Vec<_>, _>>()?;
    let (loaded, _compiled, invalid) = explain::load_and_compile(&manifests, err);
    if invalid {
        let _ = writeln!(
            err,
            "note: lab apply: the manifests have errors (above); agents report what they cannot use"
        );
    }
    let planned: std::collections::BTreeSet<(String, String)> =
        state.plan.pods.iter().map(|p| (p.namespace.clone(), p.name.clone())).collect();
    for pod in &loaded.inputs.pods {
        let key = (
            pod.metadata.namespace.clone().unwrap_or_else(|| "default".into()),
            pod.metadata.name.clone().unwrap_or_default(),
        );
        if !planned.contains(&key) {
            let _ = writeln!(
                err,
                "note: lab apply: pod {}/{} is new: the agents intercept its addresses, but it has no namespace until `lab up` is run again",
                key.0, key.1
            );
        }
    }
    // Per node, every agent log there is (`lab upgrade` starts each agent with its own) and
    // how many answers each held before the change.
    let logs: Vec<(String, BTreeMap<PathBuf, Seen>)> = if state.agents {
        state
            .plan
            .nodes
            .iter()
            .map(|n| {
                let seen = agent_logs(&state.dir, &n.name)
                    .into_iter()
                    .map(|log| {
                        let seen = Seen {
                            answers: reload_lines(&log).len(),
                            enforcing: enforcing_line(&log).is_some(),
                        };
                        (log, seen)
                    })
                    .collect();
                (n.name.clone(), seen)
            })
            .collect()
    } else {
        Vec::new()
    };
    // A dual-stack lab gets the IPv6 addresses of `lab up --dual-stack` added again.
    let manifests = if state.dual_stack {
        let d = dualstack::DualStack::new(&loaded.inputs, &state.dir)
            .map_err(|e| LabError::Invalid(crate::error::chain(&e)))?;
        std::fs::write(&d.path, &d.text)
            .map_err(|source| LabError::State { path: d.path.clone(), source })?;
        if invalid {
            let _ = writeln!(
                err,
                "note: lab apply: dual-stack lab: only the objects that could be read are applied"
            );
        }
        vec![d.path]
    } else {
        manifests
    };
    let staged = state.dir.join(STAGED_MANIFESTS);
    use crate::cluster::manifest::{FingerprintHex, fingerprint};
    let before = fingerprint(std::slice::from_ref(&staged));
    stage_manifests(&manifests, &state.dir)?;
    let changed = FingerprintHex(fingerprint(std::slice::from_ref(&staged)));
    if changed.0 == before {
        // The agents skip a change that changes nothing; there is nothing to wait for.
        return Ok(logs
            .into_iter()
            .map(|(node, ..)| Applied { node, outcome: Ok("manifests unchanged".into()) })
            .collect());
    }
    let deadline = std::time::Instant::now() + APPLY_TIMEOUT;
    let mut out = Vec::new();
    for (node, seen) in logs {
        let outcome = loop {
            if let Some(answer) = answer(&state.dir, &node, &seen, changed) {
                break answer;
            }
            if std::time::Instant::now() >= deadline {
                break Err(format!("no answer within {} s", APPLY_TIMEOUT.as_secs()));
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        out.push(Applied { node, outcome });
    }
    Ok(out)
}

/// The logs of every agent started on `node` in the lab directory `dir`: `lab up`'s
/// `agent-<node>.log`, and `agent-<node>.<generation>.log` of each `lab upgrade`.
fn agent_logs(dir: &Path, node: &str) -> Vec<PathBuf> {
    let first = dir.join(format!("agent-{node}.log"));
    let upgraded = (2..).map(|g| dir.join(format!("agent-{node}.{g}.log")));
    std::iter::once(first)
        .chain(upgraded.take_while(|log| log.exists()))
        .filter(|log| log.exists())
        .collect()
}

/// What `lab apply` saw in one agent log before the change.
#[derive(Debug, Clone, Copy)]
struct Seen {
    /// Answers ([`reload_lines`]) it held.
    answers: usize,
    /// Whether its agent was enforcing yet.
    enforcing: bool,
}

/// An agent's answer on `node` to a manifest change, given what each of its logs held
/// before (`seen`): a new answer in one of them (applied, or refused); or the `enforcing`
/// line of an agent that was not enforcing yet (a `lab upgrade` meanwhile) and whose first
/// snapshot was built from the changed contents (`changed`, the line's `manifests`). Such
/// an agent watches the manifests before it reads them: if it read them before the change,
/// its reloader compares against what it read and applies the change once it enforces,
/// logging it as usual. An agent whose `enforcing` line names no `manifests` (a build from
/// before this field) is taken at its word.
fn answer(
    dir: &Path,
    node: &str,
    seen: &BTreeMap<PathBuf, Seen>,
    changed: crate::cluster::manifest::FingerprintHex,
) -> Option<Result<String, String>> {
    for log in agent_logs(dir, node) {
        let before = seen.get(&log).copied().unwrap_or(Seen { answers: 0, enforcing: false });
        if let Some(line) = reload_lines(&log).get(before.answers) {
            return Some(as_answer(line));
        }
        if !before.enforcing
            && let Some(line) = enforcing_line(&log)
            && field(&line, "manifests").is_none_or(|read| read == changed.to_string())
        {
            return Some(Ok(format!("{line} (an agent started during the change)")));
        }
    }
    None
}

/// The value of `name=value` in a log line of the agent's (tracing's text format, values
/// without spaces), if there.
fn field<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    line.split_whitespace().find_map(|w| w.strip_prefix(name)?.strip_prefix('='))
}

/// The `enforcing` line of an agent log, once its agent enforces.
fn enforcing_line(log: &Path) -> Option<String> {
    let text = std::fs::read_to_string(log).ok()?;
    text.lines().find(|l| l.contains("tierproxy::agent: enforcing")).map(str::to_string)
}

/// A reload line ([`reload_lines`]) as an answer: applied, or refused.
fn as_answer(line: &str) -> Result<String, String> {
    if line.contains("snapshot applied") { Ok(line.to_string()) } else { Err(line.to_string()) }
}

/// The lines of an agent's log that answer a manifest change: applied, or refused.
fn reload_lines(log: &Path) -> Vec<String> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("snapshot applied") || l.contains("the last good snapshot stays"))
        .map(str::to_string)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::manifest::FingerprintHex;

    const ENFORCING: &str =
        "2026-11-27T01:27:24.5Z  INFO tierproxy::agent: enforcing node=n1 audit=true";

    /// The answers `lab apply` takes from an agent started during the change (issue #23):
    /// its `enforcing` line only if it read the changed contents, else its reload.
    #[test]
    fn an_agent_started_during_a_change_answers_once_it_read_the_change() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("agent-n1.log");
        let changed = FingerprintHex(0xfeed);
        let seen = BTreeMap::new();
        let ask = || answer(dir.path(), "n1", &seen, changed);
        assert_eq!(ask(), None, "no log yet");

        std::fs::write(&log, format!("{ENFORCING} manifests={}\n", FingerprintHex(0xbeef)))
            .unwrap();
        assert_eq!(ask(), None, "it read the contents before the change: not an answer yet");

        let applied = "2026-11-27T01:27:24.6Z  INFO tierproxy::agent: revision=2 snapshot applied";
        std::fs::write(
            &log,
            format!("{ENFORCING} manifests={}\n{applied}\n", FingerprintHex(0xbeef)),
        )
        .unwrap();
        assert_eq!(ask(), Some(Ok(applied.to_string())), "its reload answers");

        std::fs::write(&log, format!("{ENFORCING} manifests={changed}\n")).unwrap();
        assert!(matches!(ask(), Some(Ok(l)) if l.contains("started during the change")));

        std::fs::write(&log, format!("{ENFORCING}\n")).unwrap();
        assert!(
            matches!(ask(), Some(Ok(l)) if l.contains("started during the change")),
            "an agent that does not say what it read is taken at its word"
        );
    }

    #[test]
    fn a_log_field_is_found_by_its_whole_name() {
        let line = "INFO tierproxy::agent: enforcing node=n1 manifests=00ab premanifests=x";
        assert_eq!(field(line, "manifests"), Some("00ab"));
        assert_eq!(field(line, "node"), Some("n1"));
        assert_eq!(field(line, "manifest"), None);
    }
}
