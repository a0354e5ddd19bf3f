//! `tierproxy lab ...`: the command line of the lab (clap), and what each subcommand runs.

use std::io::Write;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Subcommand};

use super::probe::DEFAULT_TIMEOUT_MS;
use super::state::DEFAULT_STATE_ROOT;
use super::{DEFAULT_PREFIX, EXIT_LAB, LabError, Output, ProbeOptions, UpOptions};
use crate::explain::Format;

/// Arguments of `tierproxy lab`: a subcommand, or none for the built-in example (whose
/// options are then accepted). The help text is the `Lab` command's in `main.rs`.
#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct LabArgs {
    #[command(subcommand)]
    command: Option<LabCommand>,
    #[command(flatten)]
    example: ExampleArgs,
}

/// Options every lab subcommand takes.
#[derive(Args, Debug, Clone)]
struct Common {
    /// Prefix of the lab's namespace names (several labs can run side by side).
    #[arg(long, default_value = DEFAULT_PREFIX)]
    prefix: String,
    /// Directory of the labs' state directories.
    #[arg(long, default_value = DEFAULT_STATE_ROOT, hide = true)]
    state_root: PathBuf,
    /// Do not install missing tools (ip, nft, iptables, ipset) with apt-get: fail, naming
    /// them and the command that installs them.
    #[arg(long)]
    no_install: bool,
}

/// Options of the built-in example.
#[derive(Args, Debug)]
struct ExampleArgs {
    /// Example directory (default: $TIERPROXY_EXAMPLES, else the source tree's examples/).
    #[arg(long)]
    examples: Option<PathBuf>,
    /// Start no agents: plain kernel forwarding, every probe should connect.
    #[arg(long)]
    no_agents: bool,
    /// Connect and read timeout of each probe, in milliseconds.
    #[arg(long, default_value_t = DEFAULT_TIMEOUT_MS)]
    timeout_ms: u64,
    /// `table`: the connectivity matrix; `json`: one line per probe.
    #[arg(long, short = 'o', value_enum, default_value_t = Format::Table)]
    output: Format,
    #[command(flatten)]
    common: Common,
}

#[derive(Subcommand, Debug)]
enum LabCommand {
    /// Build the lab: namespaces, links, routes, echo servers, agents; then return.
    Up {
        /// Manifest files or directories (Nodes, Namespaces, Pods, policies).
        #[arg(long, short = 'm', required = true, num_args = 1..)]
        manifests: Vec<PathBuf>,
        /// Probes to serve: their ports and external addresses are set up too.
        #[arg(long)]
        probes: Option<PathBuf>,
        /// Start no agents: plain kernel forwarding.
        #[arg(long)]
        no_agents: bool,
        /// One more `tierproxy agent` option for every agent, as one argument
        /// (`--agent-arg=--max-connections=10`); repeatable.
        #[arg(long = "agent-arg", allow_hyphen_values = true)]
        agent_args: Vec<String>,
        /// Start the agents without audit (by default each audits every decision to
        /// `<state dir>/audit-<node>.jsonl`, and `lab probe` prints what its probes caused).
        #[arg(long)]
        no_audit: bool,
        /// Give every pod and node with only IPv4 addresses an IPv6 address too:
        /// fd74:6972::/96 + its IPv4 address (10.0.1.2 → fd74:6972::a00:102). Agents and
        /// `lab probe` read the augmented manifests (`<state dir>/dual-stack.json`).
        #[arg(long)]
        dual_stack: bool,
        #[command(flatten)]
        common: Common,
    },
    /// Replace a running lab's manifests: its agents apply the change live (cutting live
    /// connections the new policies deny) and `lab probe` explains against them. Waits
    /// until every agent reports the new snapshot. Exit status: 0 every agent applied it,
    /// 1 some agent kept its last good snapshot or did not answer, 3 no such lab.
    Apply {
        /// Manifest files or directories (as `lab up -m`).
        #[arg(long, short = 'm', required = true, num_args = 1..)]
        manifests: Vec<PathBuf>,
        #[command(flatten)]
        common: Common,
    },
    /// Write a lab's manifests plus a large synthetic policy set the lab does not build
    /// (10,000 pods, 1,000 NetworkPolicies, 100 AdminNetworkPolicies × 100 rules): load
    /// tests "with a large policy set loaded" run `lab up -m OUT`.
    Synth {
        /// The lab's own manifests (the pods that carry traffic).
        #[arg(long, short = 'm', required = true, num_args = 1..)]
        manifests: Vec<PathBuf>,
        /// Directory to write `traffic.json` and `synthetic.json` to.
        #[arg(long)]
        out: PathBuf,
        /// Seed of the synthetic cluster (the same seed, the same cluster).
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Remove the lab: processes, namespaces, state (also after a crash).
    Down {
        #[command(flatten)]
        common: Common,
    },
    /// Replace each node's agent with a new one (this build, or `TIERPROXY_LAB_AGENT`)
    /// that takes over its queues, listeners and live connections through the node's
    /// hand-over socket (issue #23), then stop the old one. One JSON line per node:
    /// `node`, `old_pid`, `new_pid`, `handed_over`, `ready_ms`.
    Upgrade {
        /// Only this node's agent.
        #[arg(long)]
        node: Option<String>,
        #[command(flatten)]
        common: Common,
    },
    /// Make every probe for real and show it beside explain's verdict.
    Probe {
        /// JSON Lines probes, explain's format.
        #[arg(long, required = true)]
        probes: PathBuf,
        /// Output format.
        #[arg(long, short = 'o', value_enum, default_value_t = Format::Table)]
        output: Format,
        /// Connect and read timeout of each probe, in milliseconds.
        #[arg(long, default_value_t = DEFAULT_TIMEOUT_MS)]
        timeout_ms: u64,
        #[command(flatten)]
        common: Common,
    },
    /// Run a command in a pod's network namespace (namespace/pod, node/<name>, fabric).
    Exec {
        /// namespace/pod, node/<name> or fabric.
        target: String,
        /// The command and its arguments, after `--`.
        #[arg(last = true, required = true)]
        command: Vec<String>,
        #[command(flatten)]
        common: Common,
    },
    /// Up, probe, down in one command (down also on error and Ctrl-C).
    Run {
        /// Manifest files or directories.
        #[arg(long, short = 'm', required = true, num_args = 1..)]
        manifests: Vec<PathBuf>,
        /// JSON Lines probes, explain's format.
        #[arg(long, required = true)]
        probes: PathBuf,
        /// Output format.
        #[arg(long, short = 'o', value_enum, default_value_t = Format::Table)]
        output: Format,
        /// Start no agents: plain kernel forwarding.
        #[arg(long)]
        no_agents: bool,
        /// Connect and read timeout of each probe, in milliseconds.
        #[arg(long, default_value_t = DEFAULT_TIMEOUT_MS)]
        timeout_ms: u64,
        #[command(flatten)]
        common: Common,
    },
    /// Echo server run by `lab up` inside a namespace.
    #[command(hide = true)]
    Serve {
        /// Addresses to bind, comma-separated.
        #[arg(long, value_delimiter = ',', required = true)]
        bind: Vec<IpAddr>,
        /// TCP ports, comma-separated.
        #[arg(long, value_delimiter = ',')]
        tcp: Vec<u16>,
        /// TCP ports served close-first, comma-separated: greeting, one request echoed,
        /// then the server closes before the client (HTTP/1.0 `Connection: close` style).
        #[arg(long, value_delimiter = ',')]
        tcp_close_first: Vec<u16>,
        /// UDP ports, comma-separated.
        #[arg(long, value_delimiter = ',')]
        udp: Vec<u16>,
        /// SCTP ports, comma-separated (kernel SCTP sockets, else raw IP sockets that
        /// answer INITs).
        #[arg(long, value_delimiter = ',')]
        sctp: Vec<u16>,
        /// File written once every port is bound.
        #[arg(long)]
        ready_file: Option<PathBuf>,
    },
    /// A minimal terminating TCP relay, the floor of any userspace proxy's cost, which
    /// `loadtest/run` measures beside kernel forwarding and tierproxy. Runs until killed.
    Relay {
        /// `LISTEN=TO` (`0.0.0.0:18080=10.60.1.3:8080`): relay every connection accepted
        /// on LISTEN to TO; repeatable.
        #[arg(long = "map", required = true)]
        maps: Vec<super::relay::Mapping>,
        /// Move bytes with read(2)/write(2) instead of splice(2).
        #[arg(long)]
        copy: bool,
    },
}

/// An agent log line without its timestamp and level.
fn log_message(line: &str) -> &str {
    line.split_once("tierproxy::agent: ").map_or(line, |(_, m)| m)
}

fn report_error(err: &mut dyn Write, e: &LabError) -> u8 {
    let _ = writeln!(err, "error: {}", crate::error::chain(e));
    e.exit_code()
}

fn install_signals(err: &mut dyn Write) {
    if let Err(e) = super::procs::handle_signals() {
        let _ = writeln!(
            err,
            "warning: no Ctrl-C handling ({e}); run `tierproxy lab down` after an interruption"
        );
    }
}

/// Runs `tierproxy lab ...`; returns the exit code.
pub fn main(args: LabArgs, out: &mut dyn Write, err: &mut dyn Write) -> u8 {
    let table_or = |f: Format, other: Output| if f == Format::Json { Output::Json } else { other };
    match args.command {
        None => {
            let a = args.example;
            install_signals(err);
            let dir = a.examples.unwrap_or_else(super::examples_dir);
            let (manifests, probes) = super::example_inputs(&dir);
            let opts = UpOptions {
                prefix: a.common.prefix,
                state_root: a.common.state_root,
                manifests,
                probes: Some(probes),
                agents: !a.no_agents,
                agent_args: Vec::new(),
                audit: true,
                dual_stack: false,
                install_tools: !a.common.no_install,
            };
            let timeout = Duration::from_millis(a.timeout_ms);
            super::run(&opts, timeout, table_or(a.output, Output::Matrix), out, err)
        }
        Some(LabCommand::Up {
            manifests,
            probes,
            no_agents,
            agent_args,
            no_audit,
            dual_stack,
            common,
        }) => {
            install_signals(err);
            let opts = UpOptions {
                prefix: common.prefix,
                state_root: common.state_root,
                manifests,
                probes,
                agents: !no_agents,
                agent_args,
                audit: !no_audit,
                dual_stack,
                install_tools: !common.no_install,
            };
            match super::up(&opts, err) {
                Ok(state) => {
                    let _ = writeln!(out, "{}", super::up_summary(&state));
                    0
                }
                Err(e) => report_error(err, &e),
            }
        }
        Some(LabCommand::Apply { manifests, common }) => {
            match super::apply(&common.state_root, &common.prefix, &manifests, err) {
                Ok(applied) => {
                    let mut code = 0;
                    if applied.is_empty() {
                        let _ = writeln!(
                            out,
                            "lab {:?}: manifests replaced (no agents)",
                            common.prefix
                        );
                    }
                    for a in applied {
                        match a.outcome {
                            Ok(line) => {
                                let _ = writeln!(out, "{}: {}", a.node, log_message(&line));
                            }
                            Err(why) => {
                                code = 1;
                                let _ =
                                    writeln!(out, "{}: NOT APPLIED: {}", a.node, log_message(&why));
                            }
                        }
                    }
                    code
                }
                Err(e) => report_error(err, &e),
            }
        }
        Some(LabCommand::Synth { manifests, out: dir, seed }) => {
            match super::synth::write(&manifests, &dir, crate::synth::Shape::LOAD_TEST, seed) {
                Ok(w) => {
                    let _ = writeln!(
                        out,
                        "wrote {} ({} pods, {} NetworkPolicies, {} AdminNetworkPolicies); `lab up -m {}` builds only the given manifests' pods",
                        w.files
                            .iter()
                            .map(|f| f.display().to_string())
                            .collect::<Vec<_>>()
                            .join(", "),
                        w.pods,
                        w.network_policies,
                        w.admin_policies,
                        dir.display()
                    );
                    0
                }
                Err(e) => report_error(err, &e),
            }
        }
        Some(LabCommand::Upgrade { node, common }) => {
            install_signals(err);
            let exe = match std::env::var_os("TIERPROXY_LAB_AGENT") {
                Some(a) => Ok(PathBuf::from(a)),
                None => std::env::current_exe(),
            };
            let exe = match exe {
                Ok(e) => e,
                Err(e) => {
                    let _ = writeln!(err, "error: this program's path: {e}");
                    return 2;
                }
            };
            match super::upgrade(&common.state_root, &common.prefix, &exe, node.as_deref()) {
                Ok(done) => {
                    for u in &done {
                        let _ = writeln!(out, "{}", serde_json::to_string(u).unwrap_or_default());
                    }
                    u8::from(done.iter().any(|u| !u.handed_over))
                }
                Err(e) => report_error(err, &e),
            }
        }
        Some(LabCommand::Down { common }) => {
            match super::down(&common.state_root, &common.prefix) {
                Ok(r) if r.netns.is_empty() => {
                    let _ = writeln!(out, "lab {:?}: nothing to remove", common.prefix);
                    0
                }
                Ok(r) => {
                    let _ = writeln!(
                        out,
                        "lab {:?} down: removed {} namespaces, stopped {} processes",
                        common.prefix,
                        r.netns.len(),
                        r.processes
                    );
                    0
                }
                Err(e) => report_error(err, &e),
            }
        }
        Some(LabCommand::Probe { probes, output, timeout_ms, common }) => {
            install_signals(err);
            let opts = ProbeOptions {
                prefix: common.prefix,
                state_root: common.state_root,
                probes,
                timeout: Duration::from_millis(timeout_ms),
                output: table_or(output, Output::Table),
            };
            match super::probe_lab(&opts, out, err) {
                Ok((_, code)) => code,
                Err(e) => report_error(err, &e),
            }
        }
        Some(LabCommand::Exec { target, command, common }) => {
            match super::exec(&common.state_root, &common.prefix, &target, &command) {
                Ok(code) => code,
                Err(e) => report_error(err, &e),
            }
        }
        Some(LabCommand::Run { manifests, probes, output, no_agents, timeout_ms, common }) => {
            install_signals(err);
            let opts = UpOptions {
                prefix: common.prefix,
                state_root: common.state_root,
                manifests,
                probes: Some(probes),
                agents: !no_agents,
                agent_args: Vec::new(),
                audit: true,
                dual_stack: false,
                install_tools: !common.no_install,
            };
            let timeout = Duration::from_millis(timeout_ms);
            super::run(&opts, timeout, table_or(output, Output::Table), out, err)
        }
        Some(LabCommand::Relay { maps, copy }) => {
            let mode = if copy { super::relay::Mode::Copy } else { super::relay::Mode::Splice };
            match super::relay::run(&maps, mode) {
                Ok(()) => 0,
                Err(e) => {
                    let _ = writeln!(err, "error: {e}");
                    EXIT_LAB
                }
            }
        }
        Some(LabCommand::Serve { bind, tcp, tcp_close_first, udp, sctp, ready_file }) => {
            let ready = ready_file.as_deref();
            match super::serve::run(&bind, &tcp, &tcp_close_first, &udp, &sctp, ready) {
                Ok(()) => 0,
                Err(e) => {
                    let _ = writeln!(err, "error: {}", crate::error::chain(&e));
                    EXIT_LAB
                }
            }
        }
    }
}
