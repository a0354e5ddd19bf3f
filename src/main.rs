//! The `tierproxy` command: parse the command line, run one subcommand, exit.
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tierproxy::explain::{self, Format, Probe, ProbeSource};

/// Node-level tiered network policy enforcer: AdminNetworkPolicy → NetworkPolicy →
/// BaselineAdminNetworkPolicy (and ClusterNetworkPolicy v1alpha2).
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Decide probes against manifests and show which tier, policy and rule decided.
    ///
    /// Exit status: 0 decided, 1 an `expect` in the probes was not met, 2 invalid input.
    Explain {
        /// Manifest files or directories (recursive: .yaml, .yml, .json).
        #[arg(long, short = 'm', required = true, num_args = 1..)]
        manifests: Vec<PathBuf>,
        /// JSON Lines probes: {"from": "ns/pod"|IP, "to": ..., "port": N, "protocol": "TCP"}.
        #[arg(long, conflicts_with_all = ["from", "to"])]
        probes: Option<PathBuf>,
        /// Source: namespace/pod, node/<name> or an IP address.
        #[arg(long, requires_all = ["to", "port"])]
        from: Option<String>,
        /// Destination: namespace/pod, node/<name> or an IP address.
        #[arg(long, requires = "from")]
        to: Option<String>,
        /// Destination port.
        #[arg(long, requires = "from")]
        port: Option<u16>,
        /// TCP, UDP or SCTP.
        #[arg(long, default_value = "TCP")]
        protocol: String,
        /// Output format.
        #[arg(long, short = 'o', value_enum, default_value_t = Format::Table)]
        output: Format,
    },
    /// Report invalid objects, priority conflicts and rules that can never match.
    ///
    /// Exit status: 0 no errors (warnings allowed), 2 invalid input.
    Check {
        /// Manifest files or directories (recursive: .yaml, .yml, .json).
        #[arg(long, short = 'm', required = true, num_args = 1..)]
        manifests: Vec<PathBuf>,
        /// Output format.
        #[arg(long, short = 'o', value_enum, default_value_t = Format::Table)]
        output: Format,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut out = std::io::stdout().lock();
    let mut err = std::io::stderr().lock();
    let code = match cli.command {
        Command::Explain { manifests, probes, from, to, port, protocol, output } => {
            let source = match (probes, from, to, port) {
                (Some(path), ..) => ProbeSource::File(path),
                (None, Some(from), Some(to), Some(port)) => {
                    ProbeSource::One(Probe { from, to, port, protocol, expect: None, note: None })
                }
                _ => {
                    let _ = writeln!(err, "error: give --probes FILE or --from X --to Y --port N");
                    return ExitCode::from(explain::EXIT_INVALID);
                }
            };
            explain::explain(&manifests, source, output, &mut out, &mut err)
        }
        Command::Check { manifests, output } => explain::check(&manifests, output, &mut out),
    };
    let _ = out.flush();
    ExitCode::from(code)
}
