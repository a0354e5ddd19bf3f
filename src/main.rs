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
    /// Decide probes against manifests (or the API server's objects, --kube) and show
    /// which tier, policy and rule decided.
    ///
    /// Exit status: 0 decided, 1 an `expect` in the probes was not met, 2 invalid input.
    Explain {
        /// Manifest files or directories (recursive: .yaml, .yml, .json). With --kube,
        /// their objects are merged with the API server's (the API server's win).
        #[arg(long, short = 'm', required_unless_present = "kube", num_args = 1..)]
        manifests: Vec<PathBuf>,
        /// Read Pods, Namespaces, Nodes, NetworkPolicies, AdminNetworkPolicies,
        /// BaselineAdminNetworkPolicies and ClusterNetworkPolicies from the Kubernetes API
        /// server, as the agent's --kube does (in-cluster service account, else KUBECONFIG
        /// or ~/.kube/config); waits at most 30 s for the lists.
        #[arg(long)]
        kube: bool,
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
    /// Enforce policy on this node: NFQUEUE first-packet decisions, TPROXY into the
    /// transparent proxy, splice relay. Runs until SIGTERM/SIGINT, then drains and removes
    /// its ruleset. Needs CAP_NET_ADMIN (and root for the ruleset tools).
    ///
    /// Exit status: 0 stopped by a signal, 70 a queue reader failed for good (after the
    /// same drain and clean-up), 1 any other failure.
    #[command(args_override_self = true)]
    Agent(Box<AgentArgs>),
    /// Receive OTLP logs (a stand-in collector for trying audit out and for load tests):
    /// prints each record as one JSON object per line, until SIGTERM/SIGINT.
    #[cfg(feature = "lab")]
    OtlpReceive {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:4318")]
        listen: std::net::SocketAddr,
        /// grpc or http/protobuf.
        #[arg(long, default_value = "http/protobuf")]
        protocol: String,
        /// Print nothing per record; on exit print the number of records received.
        #[arg(long)]
        count_only: bool,
    },
    /// Measure request/response latency or connection rate against a lab echo server
    /// (run inside a pod with `tierproxy lab exec`). Prints one JSON object.
    #[command(hide = true)]
    #[cfg(feature = "lab")]
    Loadgen {
        /// rr: request/response over one connection; crr: a connection per request; hold:
        /// open --max-count connections and report when they are cut; udp-rr: UDP
        /// request/response over a connected socket per client (lost answers are counted
        /// as timeouts); udp-flows: as udp-rr, but each request from a new socket (a new
        /// source port, a new flow), closed after its answer or loss; syn-flood:
        /// half-open TCP SYNs at --rate per second (needs CAP_NET_RAW; bounded by
        /// --seconds and --max-count).
        #[arg(long, value_enum)]
        mode: tierproxy::loadgen::Mode,
        /// The echo server, IP:PORT.
        #[arg(long)]
        to: std::net::SocketAddr,
        /// Request and response size in bytes.
        #[arg(long, default_value_t = 64)]
        size: usize,
        /// Seconds to run.
        #[arg(long, default_value_t = 5.0)]
        seconds: f64,
        /// Most transactions.
        #[arg(long, default_value_t = 1_000_000)]
        max_count: u64,
        /// Parallel clients.
        #[arg(long, default_value_t = 1)]
        concurrency: usize,
        /// syn-flood: SYNs per second (0: as fast as possible).
        #[arg(long, default_value_t = 1000)]
        rate: u64,
        /// syn-flood: each SYN from a random address of 10.0.0.0/8, not this pod's.
        #[arg(long)]
        forge_sources: bool,
        /// crr: count failed transactions (connect, greeting or echo not within
        /// --timeout-ms) in "errors" and go on, instead of stopping at the first.
        #[arg(long)]
        count_errors: bool,
        /// crr: how long a connect, and each read, may take (milliseconds).
        #[arg(long, default_value_t = tierproxy::loadgen::DEFAULT_TIMEOUT.as_millis() as u64)]
        timeout_ms: u64,
        /// crr against a close-first port (`lab serve --tcp-close-first`, a containerPort
        /// named close-first): read the server's EOF after the echo, then close, instead
        /// of shutting down first.
        #[arg(long)]
        server_closes: bool,
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
    /// A local multi-node cluster of network namespaces built from manifests: real
    /// connections beside explain's verdicts. Needs root.
    ///
    /// Without a subcommand: the built-in example (examples/cluster.yaml,
    /// examples/policies/, examples/probes.jsonl): up, probe, connectivity matrix, down.
    ///
    /// Exit status: 0 every observation agrees with explain, 1 some does not (a refused or
    /// reset connection counts: policy only drops), 2 invalid input, 3 the lab could not be
    /// built or used (needs CAP_NET_ADMIN, CAP_SYS_ADMIN and CAP_NET_RAW, and iproute2's `ip`).
    #[cfg(feature = "lab")]
    Lab(tierproxy::lab::cli::LabArgs),
    /// Print the CustomResourceDefinitions of AdminNetworkPolicy, BaselineAdminNetworkPolicy
    /// (v1alpha1) and ClusterNetworkPolicy (v1alpha2), built from tierproxy's own types, as
    /// one multi-document YAML stream (what `deploy/crds/` holds).
    ///
    /// With --antrea: the CRDs of Antrea's Tier, ClusterNetworkPolicy and NetworkPolicy
    /// (crd.antrea.io/v1beta1) instead, for a cluster without Antrea only (a cluster running
    /// Antrea has Antrea's own, which these would replace).
    ///
    /// Exit status: 0 written, 1 the files could not be written.
    Crds {
        /// Write one file per CRD into this directory (`<group>_<plural>.yaml`) instead of
        /// printing them.
        #[arg(long)]
        out_dir: Option<PathBuf>,
        /// Antrea's policy kinds (crd.antrea.io/v1beta1) instead of the upstream ones.
        #[arg(long)]
        antrea: bool,
    },
}

/// `tierproxy agent` options; defaults are `tierproxy::config` and `tierproxy::agent`
/// constants.
#[derive(clap::Args)]
struct AgentArgs {
    /// This node's name (`metadata.name` of its Node; on a cluster, `spec.nodeName` from
    /// the downward API). Only pods with this `spec.nodeName` are intercepted.
    #[arg(long, env = "NODE_NAME")]
    node: String,
    /// Manifest files or directories: cluster state and policies. With --kube, their
    /// objects are merged with the API server's (the API server's win).
    #[arg(long, short = 'm', required_unless_present = "kube", num_args = 1..)]
    manifests: Vec<PathBuf>,
    /// Read Pods, Namespaces, Nodes, NetworkPolicies, AdminNetworkPolicies,
    /// BaselineAdminNetworkPolicies and ClusterNetworkPolicies from the Kubernetes API
    /// server (in-cluster service account, else KUBECONFIG or ~/.kube/config).
    #[arg(long)]
    kube: bool,
    /// With --kube: never write policy status. By default the agent holding the Lease
    /// writes the `tierproxy.io/Accepted` condition on each ANP/BANP/CNP and an Event for
    /// each invalid one.
    #[arg(long, requires = "kube")]
    no_policy_status: bool,
    /// Namespace of the status writer's Lease (the agent's own).
    #[arg(long, env = "POD_NAMESPACE", default_value = "kube-system")]
    lease_namespace: String,
    /// Name of the status writer's Lease.
    #[arg(long, default_value = tierproxy::cluster::status::DEFAULT_LEASE_NAME)]
    lease_name: String,
    /// This agent's identity in the Lease (default: the node name).
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// Longest retry delay of a failing API-server watch, milliseconds; also the longest
    /// time before a CRD installed later is noticed.
    #[arg(long, default_value_t = tierproxy::cluster::apiserver::DEFAULT_BACKOFF_MAX.as_millis() as u64)]
    kube_retry_max_ms: u64,
    /// Without it, lists of the API server come whole from its watch cache
    /// (resourceVersion=0). With it, they are quorum reads from etcd in pages of this many
    /// objects: less memory per list in the agent, more load on etcd when every node
    /// relists.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    kube_list_page_size: Option<u32>,
    /// Create this (empty) file once the node is enforcing; removed on exit.
    #[arg(long)]
    ready_file: Option<PathBuf>,
    /// Hand-over socket (a Unix socket on a hostPath every agent pod of the node mounts,
    /// e.g. /run/tierproxy/handover.sock): at start, take the queues, listeners, live
    /// connections and UDP flows (`--udp-path proxy`) of the agent serving it, which then
    /// exits without resetting any; then serve it for the next agent. Without it, a stop
    /// drains and resets.
    #[arg(long)]
    handover_socket: Option<PathBuf>,
    /// Append logs to this file instead of standard error.
    #[arg(long)]
    log: Option<PathBuf>,
    /// Ruleset backend: auto (probe the kernel), iptables or nftables.
    #[arg(long, default_value = "auto")]
    redirect_backend: tierproxy::config::BackendChoice,
    /// Fail open: while no agent reads the queues, the kernel lets new flows through
    /// (NFQUEUE --queue-bypass). Default: fail closed.
    #[arg(long)]
    fail_open: bool,
    /// Keep the ruleset installed on exit (with fail-closed, the node stays closed until
    /// the agent is back).
    #[arg(long)]
    keep_rules: bool,
    /// Number of NFQUEUE queues (one reader thread each).
    #[arg(long, default_value_t = tierproxy::config::DEFAULT_QUEUE_COUNT)]
    queues: u16,
    /// Port of the transparent listener TPROXY delivers to.
    #[arg(long, default_value_t = tierproxy::config::DEFAULT_TPROXY_PORT)]
    tproxy_port: u16,
    /// Conntrack zone of the proxy's upstream connections, apart from the clients'
    /// (else the two legs can collide on one 4-tuple and a SYN is dropped); 0 = no zone
    /// rules.
    #[arg(long, default_value_t = tierproxy::config::DEFAULT_UPSTREAM_ZONE)]
    upstream_zone: u16,
    /// Do not check the sources of local pods' packets. By default a packet arriving on a
    /// local pod's interface whose source the node does not route back through that
    /// interface (another pod's, the node's or any foreign address) is dropped
    /// (reverse-path check), so a pod cannot act under another's identity.
    #[arg(long)]
    no_source_check: bool,
    /// A node whose agent enforces (repeatable), besides Nodes annotated
    /// `tierproxy.io/enforcing: "true"`: TCP from its pods was proxied and decided there, so
    /// it is decided here on the first packet and forwarded by the kernel, not proxied a
    /// second time. Name only nodes that run an enforcing agent.
    #[arg(long = "enforcing-node", value_name = "NODE")]
    enforcing_nodes: Vec<String>,
    /// How the proxy moves bytes: `auto` copies small reads through a per-thread buffer and
    /// splices bursts (a read that fills 16 KiB) through a pipe; `splice` splices every read;
    /// `copy` never splices.
    #[arg(long, value_enum, default_value_t = tierproxy::proxy::relay::RelayMode::Auto)]
    relay: tierproxy::proxy::relay::RelayMode,
    /// Connect upstream from the node's address instead of the client's. Servers then see
    /// the node, and so does the ingress policy of a server on another node: use only where
    /// every server's node trusts this node's address.
    #[arg(long)]
    no_preserve_source: bool,
    /// Close a proxied connection after this many seconds without a byte either way.
    #[arg(long, default_value_t = tierproxy::config::DEFAULT_IDLE_TIMEOUT.as_secs())]
    idle_timeout_secs: u64,
    /// Upstream connect timeout in milliseconds.
    #[arg(long, default_value_t = tierproxy::config::DEFAULT_CONNECT_TIMEOUT.as_millis() as u64)]
    connect_timeout_ms: u64,
    /// Most live proxied connections; at the limit new ones wait in the listen backlog.
    #[arg(long, default_value_t = tierproxy::config::DEFAULT_MAX_CONNECTIONS)]
    max_connections: usize,
    /// Before a runtime worker sleeps, poll for up to this many microseconds (0: off, at
    /// most 1000). Saves a message the wake-up of a halted CPU where idle CPUs halt at once
    /// (VMs without guest halt polling), at the cost of CPU spent spinning: see
    /// docs/architecture.md, "Busy polling".
    #[arg(long, default_value_t = 0)]
    busy_poll_us: u64,
    /// With `--udp-path proxy`: close a UDP flow after this many seconds without a datagram
    /// either way (on the kernel path conntrack's UDP timeouts end a flow).
    #[arg(long, default_value_t = tierproxy::config::DEFAULT_UDP_IDLE_TIMEOUT.as_secs())]
    udp_idle_timeout_secs: u64,
    /// How allowed UDP flows are carried: `kernel` decides a flow's first datagram and lets
    /// the kernel forward the flow on its conntrack entry (the server sees the client's
    /// address and port; a policy change deletes the entries it denies; the end record
    /// comes from conntrack's destroy event); `proxy` relays every flow through the agent's
    /// UDP proxy (the server sees the client's address, not its port).
    #[arg(long, value_enum, default_value_t = tierproxy::config::UdpPath::Kernel)]
    udp_path: tierproxy::config::UdpPath,
    /// Most live UDP flows. `--udp-path proxy`: at the limit the first datagram of a new
    /// flow is dropped. `kernel`: the most audited flows held for their end record; a flow
    /// over it is still decided and forwarded, its end not written.
    #[arg(long, default_value_t = tierproxy::config::DEFAULT_MAX_UDP_FLOWS)]
    max_udp_flows: usize,
    /// Leave net.netfilter.nf_conntrack_acct as it is (by default the agent sets it to 1
    /// while it runs with `--udp-path kernel`, so the end records of UDP flows carry their
    /// bytes; without it they say 0).
    #[arg(long)]
    no_conntrack_acct: bool,
    /// Leave net.ipv4.tcp_tw_reuse as it is (by default the agent sets it to 1 in the node's
    /// namespace while it runs: upstream connections carry client addresses, and their
    /// TIME_WAITs slow every connect under connection churn).
    #[arg(long)]
    no_tcp_tw_reuse: bool,
    /// Directory of the state the agent must undo after a crash (the old value of
    /// net.ipv4.tcp_tw_reuse, per network namespace); on tmpfs, so a reboot clears it with
    /// the sysctl.
    #[arg(long, default_value = tierproxy::config::DEFAULT_STATE_DIR)]
    state_dir: PathBuf,
    /// Seconds live connections may finish after shutdown begins.
    #[arg(long, default_value_t = tierproxy::config::DEFAULT_DRAIN_GRACE.as_secs())]
    drain_grace_secs: u64,
    /// Print the ruleset the agent would install (every command's input) and exit;
    /// changes nothing on the node.
    #[arg(long)]
    dry_run: bool,
    /// Serve /metrics (Prometheus), /healthz, /readyz and the debug endpoints
    /// /debug/explain?from=X&to=Y&port=N[&protocol=P] and /debug/snapshot (the snapshot in
    /// force) on this address.
    #[arg(long)]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Answer /debug/explain and /debug/snapshot for every peer that reaches the metrics
    /// address. By default only requests from a loopback address are answered (others get
    /// 403): the answers name every pod, policy and rule.
    #[arg(long, requires = "metrics_addr")]
    debug_endpoints_from_anywhere: bool,
    /// Keep only these capabilities once started (comma-separated, e.g. NET_ADMIN,NET_RAW,
    /// the DaemonSet's); the rest are dropped from every set, the bounding set included, so
    /// the commands the agent runs have no more. `all` (the default): keep what it was
    /// started with. The lab passes NET_ADMIN,NET_RAW so that its agents run as on a node.
    #[arg(long, value_delimiter = ',', default_value = "all")]
    capabilities: Vec<String>,
    /// Percent of the kernel's per-user pipe budget (pipe-user-pages-soft, shared by every
    /// process of the agent's user) the relay's pipes take, where it applies (no
    /// CAP_SYS_RESOURCE or CAP_SYS_ADMIN).
    #[arg(long, default_value_t = tierproxy::proxy::relay::PIPE_BUDGET_SHARE_PERCENT as u8,
          value_parser = clap::value_parser!(u8).range(1..=100))]
    pipe_budget_percent: u8,
    /// Enforce in this network namespace (a path, or a name under /run/netns), entered
    /// after the audit sinks start: they keep the agent's starting namespace, as a
    /// hostNetwork pod's would. The lab uses it.
    #[arg(long)]
    netns: Option<PathBuf>,
    #[command(flatten)]
    audit: tierproxy::audit::cli::AuditArgs,
}

/// A load generator's report as one JSON line on `out` (exit 0), or its error on `err`
/// (exit 1).
#[cfg(feature = "lab")]
fn print_report<T: serde::Serialize>(
    report: anyhow::Result<T>,
    out: &mut dyn std::io::Write,
    err: &mut dyn std::io::Write,
) -> ExitCode {
    match report {
        Ok(r) => {
            let _ = writeln!(out, "{}", serde_json::to_string(&r).unwrap_or_default());
            ExitCode::SUCCESS
        }
        Err(e) => {
            let _ = writeln!(err, "error: {e:#}");
            ExitCode::from(1)
        }
    }
}

/// `--capabilities`: `None` for `all`, else each name, with or without `CAP_`, any case
/// (`net_admin`, `CAP_NET_RAW`).
fn parse_capabilities(names: &[String]) -> Result<Option<Vec<caps::Capability>>, String> {
    if names.iter().any(|n| n.trim().eq_ignore_ascii_case("all")) {
        return Ok(None);
    }
    let one = |s: &String| {
        let upper = s.trim().to_ascii_uppercase();
        let name = if upper.starts_with("CAP_") { upper } else { format!("CAP_{upper}") };
        name.parse().map_err(|_| format!("{s:?} is not a capability name (capabilities(7))"))
    };
    names.iter().map(one).collect::<Result<Vec<_>, _>>().map(Some)
}

/// Where kube's client logs every failed request at ERROR (its tower `TraceLayer`), one
/// line per request and retry while the API server is down; the watchers report each
/// failure themselves, with the resource and the backoff, at most every 30 s.
const KUBE_REQUEST_ERRORS: &str = "kube_client::client::builder";

/// The agent's log filter (`tracing_subscriber::EnvFilter` syntax): `TIERPROXY_LOG`, else
/// `info`, with [`KUBE_REQUEST_ERRORS`] off unless the filter names that target or one
/// that contains it (a directive's target matches the targets it begins, so `kube=debug`
/// names it too).
fn log_filter(from_env: Option<&str>) -> String {
    let filter = from_env.map(str::trim).filter(|f| !f.is_empty()).unwrap_or("info");
    // A bare level (`info`) is no target's prefix.
    let names_it = filter.split(',').any(|directive| {
        let target = directive.split(['[', '=']).next().unwrap_or("").trim();
        !target.is_empty() && KUBE_REQUEST_ERRORS.starts_with(target)
    });
    if names_it { filter.to_string() } else { format!("{filter},{KUBE_REQUEST_ERRORS}=off") }
}

fn run_agent(a: AgentArgs) -> ExitCode {
    use std::time::Duration;
    let writer = match &a.log {
        Some(path) => match std::fs::File::options().create(true).append(true).open(path) {
            Ok(f) => tracing_subscriber::fmt::writer::BoxMakeWriter::new(std::sync::Mutex::new(f)),
            Err(e) => {
                eprintln!("error: opening the log file {}: {e}", path.display());
                return ExitCode::from(2);
            }
        },
        None => tracing_subscriber::fmt::writer::BoxMakeWriter::new(std::io::stderr),
    };
    let filter = log_filter(std::env::var("TIERPROXY_LOG").ok().as_deref());
    let filter = tracing_subscriber::EnvFilter::try_new(&filter).unwrap_or_else(|e| {
        eprintln!("warning: TIERPROXY_LOG {filter:?}: {e}; logging at info");
        tracing_subscriber::EnvFilter::new(log_filter(None))
    });
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(writer).with_ansi(false).init();
    let audit = match a.audit.config(&a.node) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::from(2);
        }
    };
    let mut opts = tierproxy::config::AgentOptions::new(a.node, a.manifests);
    opts.audit = audit;
    opts.metrics_addr = a.metrics_addr;
    opts.debug_from_anywhere = a.debug_endpoints_from_anywhere;
    opts.netns = a.netns;
    opts.keep_capabilities = match parse_capabilities(&a.capabilities) {
        Ok(keep) => keep,
        Err(e) => {
            eprintln!("error: --capabilities: {e}");
            return ExitCode::from(2);
        }
    };
    opts.pipe_budget_percent = usize::from(a.pipe_budget_percent);
    opts.ready_file = a.ready_file;
    opts.handover_socket = a.handover_socket;
    opts.redirect.backend = a.redirect_backend;
    opts.redirect.queue_bypass = a.fail_open;
    opts.redirect.keep_rules_on_exit = a.keep_rules;
    opts.redirect.queue_count = a.queues;
    opts.redirect.tproxy_port = a.tproxy_port;
    opts.redirect.upstream_zone = a.upstream_zone;
    opts.redirect.source_check = !a.no_source_check;
    opts.relay = a.relay;
    opts.preserve_source = !a.no_preserve_source;
    opts.idle_timeout = Duration::from_secs(a.idle_timeout_secs);
    opts.connect_timeout = Duration::from_millis(a.connect_timeout_ms);
    opts.max_connections = a.max_connections;
    opts.busy_poll = Duration::from_micros(a.busy_poll_us);
    opts.drain_grace = Duration::from_secs(a.drain_grace_secs);
    opts.udp_idle_timeout = Duration::from_secs(a.udp_idle_timeout_secs);
    opts.max_udp_flows = a.max_udp_flows;
    opts.tcp_tw_reuse = !a.no_tcp_tw_reuse;
    opts.redirect.udp_path = a.udp_path;
    opts.conntrack_acct = !a.no_conntrack_acct;
    opts.enforcing_nodes = a.enforcing_nodes;
    opts.state_dir = a.state_dir;
    if a.kube {
        use tierproxy::cluster::{apiserver, status};
        let max = Duration::from_millis(a.kube_retry_max_ms.max(1));
        opts.kube = Some(tierproxy::config::KubeOptions {
            source: apiserver::SourceConfig {
                backoff_max: max,
                backoff_initial: apiserver::DEFAULT_BACKOFF_INITIAL.min(max),
                page_size: a.kube_list_page_size,
                ..apiserver::SourceConfig::default()
            },
            status: (!a.no_policy_status).then(|| status::StatusOptions {
                lease_namespace: a.lease_namespace.clone(),
                lease_name: a.lease_name.clone(),
                identity: a.identity.clone().unwrap_or_else(|| opts.node.clone()),
                lease_seconds: status::DEFAULT_LEASE_SECONDS,
                leader: Default::default(),
            }),
            namespace: a.lease_namespace.clone(),
        });
    }
    if a.dry_run {
        return match tierproxy::agent::dry_run(&opts) {
            Ok(text) => {
                print!("{text}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::from(2)
            }
        };
    }
    match tierproxy::agent::run(opts) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("error: {e:#}");
            // A queue that failed for good: the status a supervisor restarts on.
            let failed = e.downcast_ref::<tierproxy::proxy::queue::QueueFailed>();
            ExitCode::from(failed.map_or(1, |_| tierproxy::proxy::queue::QueueFailed::EXIT_CODE))
        }
    }
}

#[cfg(feature = "lab")]
fn otlp_receive(listen: std::net::SocketAddr, protocol: &str, count_only: bool) -> ExitCode {
    use tierproxy::audit::receiver::{OnRecords, Receiver};
    let protocol = match tierproxy::audit::OtlpProtocol::parse(protocol) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::from(2);
        }
    };
    let print: Option<OnRecords> = (!count_only).then(|| {
        Box::new(|recs: &[tierproxy::audit::receiver::Received]| {
            let mut o = std::io::stdout().lock();
            for r in recs {
                let _ = writeln!(o, "{}", r.to_json());
            }
            let _ = o.flush();
        }) as OnRecords
    });
    let receiver = match Receiver::start_with(protocol, listen, print, false) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::from(1);
        }
    };
    eprintln!("receiving OTLP ({protocol:?}) on {}", receiver.addr);
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(1);
        }
    };
    rt.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        if let (Ok(mut term), Ok(mut int)) =
            (signal(SignalKind::terminate()), signal(SignalKind::interrupt()))
        {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
    });
    if count_only {
        println!("{}", receiver.count());
    }
    ExitCode::SUCCESS
}

/// `tierproxy crds`: the upstream CRDs (or with `antrea` Antrea's) to standard output, or
/// one file each under `out_dir`.
fn crds(
    out_dir: Option<&std::path::Path>,
    antrea: bool,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> u8 {
    let result = (|| -> anyhow::Result<()> {
        use anyhow::Context as _;
        let all = if antrea { tierproxy::crds::antrea_crds() } else { tierproxy::crds::crds() };
        match out_dir {
            None => out.write_all(tierproxy::crds::yaml_stream(&all)?.as_bytes())?,
            Some(dir) => {
                for crd in all {
                    let path = dir.join(&crd.file_name);
                    std::fs::write(&path, tierproxy::crds::to_yaml(&crd)?)
                        .with_context(|| format!("writing {}", path.display()))?;
                    writeln!(out, "wrote {}", path.display())?;
                }
            }
        }
        Ok(())
    })();
    match result {
        Ok(()) => 0,
        Err(e) => {
            let _ = writeln!(err, "error: {e:#}");
            1
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut out = std::io::stdout().lock();
    let mut err = std::io::stderr().lock();
    let code = match cli.command {
        Command::Explain { manifests, kube, probes, from, to, port, protocol, output } => {
            let source = match (probes, from, to, port) {
                (Some(path), ..) => ProbeSource::File(path),
                (None, Some(from), Some(to), Some(port)) => ProbeSource::One(Probe {
                    from,
                    to,
                    port,
                    protocol,
                    family: None,
                    expect: None,
                    note: None,
                }),
                _ => {
                    let _ = writeln!(err, "error: give --probes FILE or --from X --to Y --port N");
                    return ExitCode::from(explain::EXIT_INVALID);
                }
            };
            if !kube {
                explain::explain(&manifests, source, output, &mut out, &mut err)
            } else {
                match explain::read_api_server(&manifests, explain::KUBE_LIST_TIMEOUT) {
                    Ok(loaded) => {
                        explain::explain_loaded(loaded, source, output, &mut out, &mut err)
                    }
                    Err(e) => {
                        let _ = writeln!(err, "error: {}", tierproxy::error::chain(&e));
                        explain::EXIT_INVALID
                    }
                }
            }
        }
        Command::Check { manifests, output } => explain::check(&manifests, output, &mut out),
        #[cfg(feature = "lab")]
        Command::Loadgen {
            mode,
            to,
            size,
            seconds,
            max_count,
            concurrency,
            rate,
            forge_sources,
            count_errors,
            timeout_ms,
            server_closes,
        } => {
            let opts = tierproxy::loadgen::LoadOptions {
                mode,
                to,
                size,
                duration: std::time::Duration::from_secs_f64(seconds.clamp(0.0, 3600.0)),
                max_count,
                concurrency,
                rate,
                forge_sources,
                count_errors,
                timeout: std::time::Duration::from_millis(timeout_ms.max(1)),
                server_closes,
            };
            if mode == tierproxy::loadgen::Mode::SynFlood {
                return print_report(tierproxy::loadgen::syn_flood(opts), &mut out, &mut err);
            }
            if mode == tierproxy::loadgen::Mode::Hold {
                let count = usize::try_from(max_count).unwrap_or(usize::MAX).min(100_000);
                tierproxy::host::raise_fd_limit();
                let held = tierproxy::loadgen::hold(to, count, opts.duration, &mut out);
                return print_report(held, &mut out, &mut err);
            }
            match tierproxy::loadgen::run(opts) {
                Ok(r) => {
                    let _ = writeln!(out, "{}", serde_json::to_string(&r).unwrap_or_default());
                    0
                }
                Err(e) => {
                    let _ = writeln!(err, "error: {e:#}");
                    1
                }
            }
        }
        Command::Agent(args) => {
            drop((out, err));
            return run_agent(*args);
        }
        #[cfg(feature = "lab")]
        Command::OtlpReceive { listen, protocol, count_only } => {
            drop((out, err));
            return otlp_receive(listen, &protocol, count_only);
        }
        #[cfg(feature = "lab")]
        Command::Lab(args) => tierproxy::lab::cli::main(args, &mut out, &mut err),
        Command::Crds { out_dir, antrea } => crds(out_dir.as_deref(), antrea, &mut out, &mut err),
    };
    let _ = out.flush();
    ExitCode::from(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kube_request_errors_stay_off_unless_the_filter_names_them() {
        let off = ",kube_client::client::builder=off";
        assert_eq!(log_filter(None), format!("info{off}"));
        assert_eq!(log_filter(Some(" ")), format!("info{off}"));
        assert_eq!(log_filter(Some("info")), format!("info{off}"));
        assert_eq!(
            log_filter(Some("debug,tierproxy::proxy=trace")),
            format!("debug,tierproxy::proxy=trace{off}")
        );
        for named in ["kube_client=debug", "info,kube=trace", "kube_client::client::builder=error"]
        {
            assert_eq!(log_filter(Some(named)), named);
        }
        assert_eq!(log_filter(Some("kube_runtime=debug")), format!("kube_runtime=debug{off}"));
    }
}
