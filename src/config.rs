//! Typed configuration of tierproxy's subsystems, with defaults as `pub const`s and a
//! `validate()` that names what is wrong.
//!
//! Two sections: the agent's options ([`AgentOptions`], with the API-server side in
//! [`KubeOptions`]) and redirection ([`RedirectConfig`], issue #3 "Redirection", DESIGN
//! §3). Every field says what it bounds and why its default was chosen.
//!
//! # Packet marks
//!
//! tierproxy uses four single-bit marks, each with its own mask, so it only ever reads and
//! writes its own bits of `skb->mark` and leaves every other bit to whoever owns it:
//!
//! | mark | default | set by | read by |
//! |---|---|---|---|
//! | decided | `0x1000` | the NFQUEUE verdict (REPEAT with this bit) | the queue rule (skip), the TPROXY rule |
//! | route | `0x2000` | TPROXY `--tproxy-mark`, the `socket --transparent` rule | `ip rule fwmark … lookup TABLE` |
//! | bypass | `0x0080` | `SO_MARK` of the proxy's upstream sockets | the first rule (return untouched) |
//! | reject | `0x0040` | the NFQUEUE verdict (ACCEPT with this bit) on a rejected packet the kernel refuses | the refusal chains (`refuse_input`, `refuse_forward`) |
//!
//! Decided and reject together (the REPEAT verdict on an allowed UDP datagram whose class
//! must stay out of the kernel-side cache, `proxy::queue`) mean "allowed, not cached": the
//! cache rule wants the decided bits without the reject ones, the refusal chains the
//! reject bits without the decided ones.
//!
//! Why these bits: kube-proxy owns `0x4000` (masquerade) and `0x8000` (drop); Calico's
//! default `iptablesMarkMask` is `0xffff0000` and it allocates every bit of it; Cilium uses
//! `0x0f00` plus the upper 16 bits for identities; Weave and kube-router use bits 16–18.
//! Bits 12 and 13 (`0x1000`, `0x2000`) are owned by none of them, and bits 6 and 7
//! (`0x0040`, `0x0080`) only fall under Istio ambient's `0xfff` mask, which is not expected
//! on the same node. All four are configurable; [`RedirectConfig::validate`] insists they
//! are non-zero and pairwise disjoint (a route mark equal to the bypass mark would send the
//! proxy's own upstream SYNs back into the proxy).

use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::audit::AuditConfig;
use crate::cluster;
use crate::proxy::relay::RelayMode;

// ---- The agent -------------------------------------------------------------------

/// Default directory of the agent's state files ([`crate::host::HostSysctl`]): `/run/tierproxy`
/// (tmpfs; the DaemonSet mounts an emptyDir there).
pub const DEFAULT_STATE_DIR: &str = "/run/tierproxy";

/// Default upstream connect timeout.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default idle timeout of a proxied connection (no byte either way). One hour, as
/// kube-proxy's and Envoy's defaults for TCP idle are of that order; long-lived quiet
/// connections (databases) should not be cut by the enforcer.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(3600);
/// Default most live proxied connections, where the open files limit allows them
/// ([`crate::host::FdPlan`]): two descriptors each.
pub const DEFAULT_MAX_CONNECTIONS: usize = 65_536;
/// Default idle timeout of a UDP flow: 60 s, Envoy's UDP proxy default, between the
/// kernel's conntrack timeouts for unreplied (30 s) and replied (120 s) UDP.
pub const DEFAULT_UDP_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Default most live UDP flows (two sockets each).
pub const DEFAULT_MAX_UDP_FLOWS: usize = 16_384;
/// Default drain grace on shutdown.
pub const DEFAULT_DRAIN_GRACE: Duration = Duration::from_secs(5);
/// Default relay pipe size per direction (DESIGN §7: 1 MiB measured best here).
pub const DEFAULT_PIPE_BYTES: usize = crate::proxy::relay::DEFAULT_PIPE_BYTES;
/// Most relay pipes open at once (in use or kept idle) where the open files limit allows
/// them: 256 connections moving bytes both ways at the same moment (a direction holds a
/// pipe only while it has bytes in flight); a burst beyond is copied through user space.
pub const DEFAULT_MAX_PIPES: usize = 512;
/// Descriptors kept for everything but connections, UDP flows and pipes: listeners, queues,
/// the metrics server and its clients, audit sinks, the API-server client, the manifest
/// watch, the pipes of the commands the agent runs, log files.
pub const RESERVED_FDS: usize = 512;
/// The open files limit the agent needs for its defaults: two descriptors per connection,
/// UDP flow and pipe, and [`RESERVED_FDS`] (deploy/ sets it, `TIERPROXY_NOFILE`).
pub const NEEDED_FDS: usize =
    2 * (DEFAULT_MAX_CONNECTIONS + DEFAULT_MAX_UDP_FLOWS + DEFAULT_MAX_PIPES) + RESERVED_FDS;

/// Everything the agent needs.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    /// This node's `metadata.name` (the downward API's `spec.nodeName` on a cluster).
    pub node: String,
    /// Manifest files or directories: cluster state and policies (may be empty with
    /// [`AgentOptions::kube`]; given with it, their objects are merged in, the API server's
    /// winning where both have an object).
    pub manifests: Vec<PathBuf>,
    /// Read cluster state and policies from the API server too (issue #6); `None`: from
    /// the manifests only.
    pub kube: Option<KubeOptions>,
    /// Created (empty) once the node is enforcing; removed on exit.
    pub ready_file: Option<PathBuf>,
    /// The hand-over socket (issue #23): at start, the agent asks the one serving it for
    /// its queues, listeners, live connections and UDP flows (proxy path); then it serves
    /// it for the next agent.
    /// `None`: no hand-over, a stop drains.
    pub handover_socket: Option<PathBuf>,
    /// Redirection (marks, queues, ports, backend, fail-open, keep rules).
    pub redirect: RedirectConfig,
    /// Auto (copy small reads, splice bursts; the default), splice or copy.
    pub relay: RelayMode,
    /// Connect upstream from the client's IP.
    pub preserve_source: bool,
    /// Upstream connect timeout.
    pub connect_timeout: Duration,
    /// Idle timeout of a proxied connection.
    pub idle_timeout: Duration,
    /// Most live proxied connections.
    pub max_connections: usize,
    /// Busy polling before a runtime worker parks, up to this long a spin (`ZERO`: off,
    /// the default; at most [`crate::proxy::busy_poll::MAX_BUDGET`]; see
    /// [`crate::proxy::busy_poll`]).
    pub busy_poll: Duration,
    /// Drain grace on shutdown.
    pub drain_grace: Duration,
    /// Idle timeout of a UDP flow on the proxy path ([`crate::config::UdpPath::Proxy`]).
    pub udp_idle_timeout: Duration,
    /// Most live UDP flows.
    pub max_udp_flows: usize,
    /// Audit: what is logged, where to, lossy or lossless (no sinks: off).
    pub audit: AuditConfig,
    /// Where to serve `/metrics`, `/healthz`, `/readyz` and the debug endpoints
    /// ([`crate::debug`]) (`None`: not served).
    pub metrics_addr: Option<SocketAddr>,
    /// Answer the debug endpoints for every peer that reaches the metrics address; by
    /// default only for loopback peers (their answers name every pod, policy and rule).
    pub debug_from_anywhere: bool,
    /// Set `net.ipv4.tcp_tw_reuse` to 1 in the enforcing namespace while running (the old
    /// value is put back on exit); see [`crate::host::TCP_TW_REUSE`].
    pub tcp_tw_reuse: bool,
    /// Set `net.netfilter.nf_conntrack_acct` to 1 while running (the old value is put back
    /// on exit), so that kernel-forwarded UDP flows' end records carry their bytes; see
    /// [`crate::host::CONNTRACK_ACCT`]. Only with [`crate::config::UdpPath::Kernel`].
    pub conntrack_acct: bool,
    /// Where the agent keeps what it must undo after a crash ([`DEFAULT_STATE_DIR`]).
    pub state_dir: PathBuf,
    /// A network namespace (a path such as `/run/netns/NAME`, or a name under
    /// `/run/netns`) to enforce in, entered after the audit sinks are started: the sinks
    /// keep the namespace the agent started in, as a hostNetwork pod's would, while the
    /// data path works in this one. The lab uses it to reach an OTLP endpoint on the host.
    pub netns: Option<PathBuf>,
    /// Capabilities to keep once started (after entering [`AgentOptions::netns`]); the
    /// others are dropped from every set, the bounding set included, so the agent and the
    /// commands it runs have only these, as in a container granted exactly them. `None`:
    /// keep what the agent was started with. The lab keeps the DaemonSet's:
    /// [`crate::lab::procs::AGENT_CAPABILITIES`].
    pub keep_capabilities: Option<Vec<caps::Capability>>,
    /// Percent of the kernel's per-user pipe budget the relay takes where that budget
    /// applies ([`crate::proxy::relay::PipeBudget::unprivileged`]).
    pub pipe_budget_percent: usize,
    /// Nodes whose agents enforce, by name, besides those whose Node carries
    /// [`crate::policy::compile::ANNOTATION_ENFORCING`]: their pods' TCP connections to
    /// this node's pods were proxied and decided at their own node, so this node decides
    /// them on the first packet and lets the kernel forward them (issue #18). The lab
    /// names every node it starts an agent on.
    pub enforcing_nodes: Vec<String>,
}

impl AgentOptions {
    /// Options with every default, for node `node` and `manifests`.
    pub fn new(node: String, manifests: Vec<PathBuf>) -> Self {
        let audit = AuditConfig::new(&node, Vec::new());
        AgentOptions {
            node,
            manifests,
            kube: None,
            ready_file: None,
            handover_socket: None,
            redirect: RedirectConfig::default(),
            relay: RelayMode::Auto,
            preserve_source: true,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            busy_poll: Duration::ZERO,
            drain_grace: DEFAULT_DRAIN_GRACE,
            udp_idle_timeout: DEFAULT_UDP_IDLE_TIMEOUT,
            max_udp_flows: DEFAULT_MAX_UDP_FLOWS,
            audit,
            metrics_addr: None,
            debug_from_anywhere: false,
            tcp_tw_reuse: true,
            conntrack_acct: true,
            state_dir: PathBuf::from(DEFAULT_STATE_DIR),
            netns: None,
            keep_capabilities: None,
            pipe_budget_percent: crate::proxy::relay::PIPE_BUDGET_SHARE_PERCENT,
            enforcing_nodes: Vec::new(),
        }
    }

    /// Checks what the agent cannot run with: an empty node name, no source of cluster
    /// state (neither manifests nor the API server), a redirection section that
    /// [`RedirectConfig::validate`] refuses, a connection limit of 0 (every connection
    /// would wait forever), zero timeouts (every connection would end at once), a busy-poll
    /// budget over 1 ms, a pipe budget share outside 1–100 %.
    ///
    /// # Errors
    /// The first problem found, naming the option.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.node.is_empty() {
            return Err(ConfigError::Required { option: "node" });
        }
        if self.manifests.is_empty() && self.kube.is_none() {
            return Err(ConfigError::Required { option: "manifests (or kube)" });
        }
        self.redirect.validate()?;
        let at_least_one = |option: &'static str, value: u128| {
            if value == 0 {
                Err(ConfigError::OutOfRange { option, value, range: "at least 1" })
            } else {
                Ok(())
            }
        };
        at_least_one("max_connections", self.max_connections as u128)?;
        at_least_one("connect_timeout (ms)", self.connect_timeout.as_millis())?;
        at_least_one("idle_timeout (ms)", self.idle_timeout.as_millis())?;
        at_least_one("udp_idle_timeout (ms)", self.udp_idle_timeout.as_millis())?;
        if self.busy_poll > crate::proxy::busy_poll::MAX_BUDGET {
            return Err(ConfigError::OutOfRange {
                option: "busy_poll (us)",
                value: self.busy_poll.as_micros(),
                range: "0..=1000",
            });
        }
        if !(1..=100).contains(&self.pipe_budget_percent) {
            return Err(ConfigError::OutOfRange {
                option: "pipe_budget_percent",
                value: self.pipe_budget_percent as u128,
                range: "1..=100",
            });
        }
        Ok(())
    }
}

/// The API-server side of the agent (issue #6).
#[derive(Debug, Clone, Default)]
pub struct KubeOptions {
    /// Debounce, backoff and paging of the watchers.
    pub source: cluster::apiserver::SourceConfig,
    /// Take part in the election of the policy status writer (`None`: never write status).
    pub status: Option<cluster::status::StatusOptions>,
    /// The agents' namespace (`POD_NAMESPACE`): where the Lease and the recorded last good
    /// policy versions ([`cluster::lastgood::CONFIGMAP`]) live.
    pub namespace: String,
}

// ---- Redirection -------------------------------------------------------------------

/// Default port of the proxy's `IP_TRANSPARENT` listener that TPROXY delivers to
/// (DESIGN §3). 15001 is the port Istio uses for the same purpose, familiar to operators and
/// outside the ephemeral range (32768–60999 on Linux by default).
pub const DEFAULT_TPROXY_PORT: u16 = 15001;

/// Default IPv4 address TPROXY looks the listener up on (`--on-ip`). Loopback, so the
/// listener can be bound to `127.0.0.1` and is reachable from pods only through TPROXY.
pub const DEFAULT_TPROXY_ADDR_V4: Ipv4Addr = Ipv4Addr::LOCALHOST;

/// Default IPv6 address TPROXY looks the listener up on (`--on-ip`); see
/// [`DEFAULT_TPROXY_ADDR_V4`].
pub const DEFAULT_TPROXY_ADDR_V6: Ipv6Addr = Ipv6Addr::LOCALHOST;

/// Default first NFQUEUE queue number. Queue numbers are a per-network-namespace 16-bit
/// space; 0 is the conventional first queue.
pub const DEFAULT_QUEUE_FIRST: u16 = 0;

/// Default number of NFQUEUE queues: one per core of the 2-core machines this runs on; the
/// kernel balances flows over them by a flow hash (`--queue-balance`).
pub const DEFAULT_QUEUE_COUNT: u16 = 2;

/// Default of the queue bypass switch: `false` = fail-closed (packets of new pod flows are
/// dropped while no program reads the queue), as policy enforcement requires.
pub const DEFAULT_QUEUE_BYPASS: bool = false;

/// Default "decided" mark bit: set by the NFQUEUE REPEAT verdict on an allowed first packet
/// so that the queue rule skips it on its second walk and the TPROXY rule takes it.
pub const DEFAULT_DECIDED_MARK: Mark = Mark::bit(12);

/// Default "route" mark bit: set by TPROXY and by the `socket --transparent` rule; the
/// policy-routing rule sends packets carrying it to the local table.
pub const DEFAULT_ROUTE_MARK: Mark = Mark::bit(13);

/// Default "bypass" mark bit: the `SO_MARK` of the proxy's own upstream sockets; the
/// ruleset returns such packets untouched.
pub const DEFAULT_BYPASS_MARK: Mark = Mark::bit(7);

/// Default "reject" mark bit: set by the NFQUEUE verdict (ACCEPT) on a rejected first
/// packet that the kernel's reject answers (the refusal chains right after the decision;
/// `proxy::reject`, "Addresses after a DNAT").
pub const DEFAULT_REJECT_MARK: Mark = Mark::bit(6);

/// Default routing table holding `local default dev lo` for route-marked packets. Any
/// number other than the kernel's reserved 0, 253, 254, 255 works; 1501 has no well-known
/// user.
pub const DEFAULT_ROUTE_TABLE: u32 = 1501;

/// Default priority of the `ip rule fwmark … lookup TABLE` rule: after the `local` rule
/// (priority 0), well before `main` (32766), so route-marked packets reach the local table
/// before any ordinary routing.
pub const DEFAULT_RULE_PRIORITY: u32 = 1501;

/// Default prefix of every name tierproxy creates (iptables chains in upper case, ipsets,
/// the nftables table).
pub const DEFAULT_NAME_PREFIX: &str = "tierproxy";

/// Longest accepted [`RedirectConfig::name_prefix`]: the longest derived name,
/// `<prefix>-nodes-v4-tmp`, must fit ipset's 31-character limit, and `<PREFIX>-DIVERT` the
/// 28-character limit of iptables chain names.
pub const MAX_NAME_PREFIX_LEN: usize = 16;

/// Default of the keep-rules-on-exit switch: `false` = the daemon removes its ruleset when it
/// stops. `true` keeps it, so with fail-closed queues the node stays closed across restarts.
pub const DEFAULT_KEEP_RULES_ON_EXIT: bool = false;

/// Default conntrack zone of the proxy's upstream legs (0x7470, "tp"): see
/// [`RedirectConfig::upstream_zone`].
pub const DEFAULT_UPSTREAM_ZONE: u16 = 0x7470;

/// Default of the source check switch: `true` = packets that arrive on a local pod's
/// interface with a source address the node does not route back through that interface are
/// dropped in raw PREROUTING (a pod forging another pod's, the node's or any other address);
/// see [`RedirectConfig::source_check`].
pub const DEFAULT_SOURCE_CHECK: bool = true;

/// A packet mark: the bits tierproxy sets or tests (`value`) within the bits it owns
/// (`mask`), as in iptables' `--mark value/mask` (iptables-extensions(8), "mark").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mark {
    /// Bits that must be set (a match) or are set (a mark action). Must lie within `mask`.
    pub value: u32,
    /// Bits tierproxy owns for this mark; every other bit of `skb->mark` is left alone.
    pub mask: u32,
}

impl Mark {
    /// A single-bit mark whose value and mask are both `1 << bit`. `bit` above 31 yields an
    /// empty mark, which [`RedirectConfig::validate`] rejects.
    pub const fn bit(bit: u32) -> Mark {
        let v = if bit < 32 { 1u32 << bit } else { 0 };
        Mark { value: v, mask: v }
    }
}

impl fmt::Display for Mark {
    /// `0xVALUE/0xMASK`, the notation of iptables, `ip rule` and this crate's errors.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}/{:#x}", self.value, self.mask)
    }
}

/// Which of the four marks an error or a rule is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MarkRole {
    /// [`RedirectConfig::decided_mark`].
    Decided,
    /// [`RedirectConfig::route_mark`].
    Route,
    /// [`RedirectConfig::bypass_mark`].
    Bypass,
    /// [`RedirectConfig::reject_mark`].
    Reject,
}

impl fmt::Display for MarkRole {
    /// The field name without `_mark`: `decided`, `route`, `bypass`, `reject`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MarkRole::Decided => "decided",
            MarkRole::Route => "route",
            MarkRole::Bypass => "bypass",
            MarkRole::Reject => "reject",
        })
    }
}

/// Which path allowed UDP flows take (`--udp-path kernel|proxy`, issue #20).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum UdpPath {
    /// The first datagram of a flow (its conntrack entry not yet confirmed) is queued and
    /// decided; the kernel forwards an allowed flow on its conntrack entry, keeping the
    /// client's address and port. Live cut deletes the entry, the end record comes from its
    /// destroy event (`proxy::forwarded`).
    #[default]
    Kernel,
    /// Every UDP flow is TPROXY'd to the agent's UDP proxy, which relays it through a pair
    /// of sockets (`proxy::udp`): the server sees the client's address but a port the
    /// node picked.
    Proxy,
}

/// Which redirection backend to use (`--redirect-backend iptables|nftables|auto`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendChoice {
    /// Probe the kernel: nftables where it can queue natively, iptables otherwise.
    #[default]
    Auto,
    /// iptables/ip6tables + ipset (xt NFQUEUE, TPROXY, socket).
    Iptables,
    /// One `inet` nftables table (needs CONFIG_NFT_QUEUE and CONFIG_NFT_TPROXY).
    Nftables,
}

impl FromStr for BackendChoice {
    type Err = ConfigError;

    /// Parses `auto`, `iptables` or `nftables` (exactly these lower-case words).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(BackendChoice::Auto),
            "iptables" => Ok(BackendChoice::Iptables),
            "nftables" => Ok(BackendChoice::Nftables),
            other => Err(ConfigError::UnknownBackend { name: other.to_owned() }),
        }
    }
}

impl fmt::Display for BackendChoice {
    /// The word [`BackendChoice::from_str`] accepts.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendChoice::Auto => "auto",
            BackendChoice::Iptables => "iptables",
            BackendChoice::Nftables => "nftables",
        })
    }
}

/// A configuration value that [`RedirectConfig::validate`] (or a parser) rejects.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// `tproxy_port` is 0, which TPROXY reads as "keep the destination port".
    #[error("redirect.tproxy_port must not be 0")]
    TproxyPortZero,
    /// `tproxy_port` is 65,535: the port after it, the listener for TCP between local pods
    /// ([`RedirectConfig::local_pods_port`]), does not exist.
    #[error(
        "redirect.tproxy_port must be below 65535 (the next port is the listener for TCP between local pods)"
    )]
    TproxyPortLast,
    /// `queue_count` is 0: no queue to send first packets to.
    #[error("redirect.queue_count must be at least 1")]
    QueueCountZero,
    /// `queue_first + queue_count` (the last balanced queue and the kernel-forwarded
    /// flows' queue after it) does not fit the 16-bit queue number space.
    #[error("redirect queues {first}..={first}+{count} exceed the largest queue number 65535")]
    QueueRangeOverflow {
        /// `queue_first`.
        first: u16,
        /// `queue_count`.
        count: u16,
    },
    /// A mark's value is 0, so marked and unmarked packets would look the same.
    #[error("redirect.{role}_mark value must not be 0")]
    MarkZero {
        /// Which mark.
        role: MarkRole,
    },
    /// A mark's value has bits outside its mask.
    #[error("redirect.{role}_mark {mark} sets bits outside its mask")]
    MarkOutsideMask {
        /// Which mark.
        role: MarkRole,
        /// The offending mark.
        mark: Mark,
    },
    /// Two marks share bits of their masks.
    #[error("redirect.{a}_mark and redirect.{b}_mark share mask bits {shared:#x}")]
    MarksOverlap {
        /// The first mark.
        a: MarkRole,
        /// The second mark.
        b: MarkRole,
        /// The shared bits.
        shared: u32,
    },
    /// The routing table number is one of the kernel's reserved tables.
    #[error(
        "redirect.route_table {table} is reserved (0 unspec, 253 default, 254 main, 255 local)"
    )]
    RouteTableReserved {
        /// The table number.
        table: u32,
    },
    /// The `ip rule` priority is not strictly between the `local` rule (0) and `main`
    /// (32766).
    #[error("redirect.rule_priority {priority} must lie in 1..=32765 (between local and main)")]
    RulePriorityOutOfRange {
        /// The priority.
        priority: u32,
    },
    /// The name prefix is empty, too long or has characters outside `[a-z0-9-]`.
    #[error(
        "redirect.name_prefix {prefix:?} must be 1..={MAX_NAME_PREFIX_LEN} characters of \
         [a-z0-9-], starting with a letter"
    )]
    InvalidNamePrefix {
        /// The prefix.
        prefix: String,
    },
    /// An agent option that must be given is missing or empty.
    #[error("agent option {option} is required")]
    Required {
        /// The option.
        option: &'static str,
    },
    /// An agent option's value is outside what the agent can run with.
    #[error("agent option {option} is {value}; it must be {range}")]
    OutOfRange {
        /// The option (with its unit).
        option: &'static str,
        /// The value given.
        value: u128,
        /// What it must be.
        range: &'static str,
    },
    /// A backend name other than `auto`, `iptables`, `nftables`.
    #[error("unknown redirect backend {name:?} (expected auto, iptables or nftables)")]
    UnknownBackend {
        /// The name given.
        name: String,
    },
}

/// Configuration of traffic redirection (issue #3 "Redirection", DESIGN §3).
///
/// Build it with [`RedirectConfig::default`] and change fields; call
/// [`RedirectConfig::validate`] before use (the redirect module does so when it builds a
/// ruleset).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RedirectConfig {
    /// Backend choice; [`BackendChoice::Auto`] probes the kernel.
    pub backend: BackendChoice,
    /// Port of the proxy's transparent listener TPROXY delivers to; the next port is the
    /// listener for TCP between local pods ([`RedirectConfig::local_pods_port`]). Default
    /// [`DEFAULT_TPROXY_PORT`].
    pub tproxy_port: u16,
    /// IPv4 address TPROXY looks the listener up on. Default [`DEFAULT_TPROXY_ADDR_V4`].
    pub tproxy_addr_v4: Ipv4Addr,
    /// IPv6 address TPROXY looks the listener up on. Default [`DEFAULT_TPROXY_ADDR_V6`].
    pub tproxy_addr_v6: Ipv6Addr,
    /// First NFQUEUE queue number. Default [`DEFAULT_QUEUE_FIRST`].
    pub queue_first: u16,
    /// Number of consecutive queues new flows are balanced over (by flow hash, so every
    /// packet of a flow lands on the same queue). Default [`DEFAULT_QUEUE_COUNT`].
    pub queue_count: u16,
    /// Queue bypass: `true` = fail-open (the kernel accepts packets while no program is bound
    /// to the queue), `false` = fail-closed (it drops them). Default [`DEFAULT_QUEUE_BYPASS`].
    /// Source: iptables-extensions(8), NFQUEUE `--queue-bypass`.
    pub queue_bypass: bool,
    /// Mark set by the queue's REPEAT verdict on allowed first packets. Default
    /// [`DEFAULT_DECIDED_MARK`].
    pub decided_mark: Mark,
    /// Mark that policy routing sends to the local table. Default [`DEFAULT_ROUTE_MARK`].
    pub route_mark: Mark,
    /// `SO_MARK` of the proxy's upstream sockets, never touched by the ruleset. Default
    /// [`DEFAULT_BYPASS_MARK`].
    pub bypass_mark: Mark,
    /// Mark of a rejected first packet accepted for the kernel's reject to answer: where
    /// the queue passes no conntrack entry, only the kernel knows the address a DNAT'd
    /// client used (`proxy::reject`). Default [`DEFAULT_REJECT_MARK`].
    pub reject_mark: Mark,
    /// Routing table with the `local` default route. Default [`DEFAULT_ROUTE_TABLE`].
    pub route_table: u32,
    /// Priority of the fwmark `ip rule`. Default [`DEFAULT_RULE_PRIORITY`].
    pub rule_priority: u32,
    /// Prefix of chain, set and table names. Default [`DEFAULT_NAME_PREFIX`].
    pub name_prefix: String,
    /// Keep the ruleset installed when the daemon exits. Default
    /// [`DEFAULT_KEEP_RULES_ON_EXIT`].
    pub keep_rules_on_exit: bool,
    /// Conntrack zone of the proxy's source-preserving upstream legs (their packets and
    /// the replies to them); 0 = the default zone, no zone rules. Default
    /// [`DEFAULT_UPSTREAM_ZONE`].
    ///
    /// An upstream leg is bound to the client's address with a port the node's kernel
    /// picks, unaware of the ports the client's own kernel picks: the two legs of
    /// different connections can then share a 4-tuple, and conntrack, which sees both
    /// legs in the node's namespace, drops the second one's SYN (`insert_failed`), which
    /// the client retransmits a second later. A zone of their own keeps the legs apart
    /// (`CT --zone`, nft `ct zone set`; iptables-extensions(8), "CT").
    pub upstream_zone: u16,
    /// Reverse-path check of the packets local pods send: a packet arriving on an
    /// interface through which the node routes a local pod's address (the pod's veth, or
    /// the bridge of bridged CNIs) must carry a source address the node routes back
    /// through that same interface, i.e. one of that pod's addresses (of the bridge's
    /// pods); otherwise it is dropped in raw PREROUTING, before conntrack and before any
    /// decision (iptables-extensions(8) "rpfilter", nft(8) "fib"; the interfaces are the
    /// kernel's routes to the local pods' addresses). Without it a pod with CAP_NET_RAW
    /// sends under another pod's identity. Default [`DEFAULT_SOURCE_CHECK`].
    pub source_check: bool,
    /// The path allowed UDP flows take. Default [`UdpPath::Kernel`].
    pub udp_path: UdpPath,
}

impl Default for RedirectConfig {
    fn default() -> Self {
        RedirectConfig {
            backend: BackendChoice::Auto,
            tproxy_port: DEFAULT_TPROXY_PORT,
            tproxy_addr_v4: DEFAULT_TPROXY_ADDR_V4,
            tproxy_addr_v6: DEFAULT_TPROXY_ADDR_V6,
            queue_first: DEFAULT_QUEUE_FIRST,
            queue_count: DEFAULT_QUEUE_COUNT,
            queue_bypass: DEFAULT_QUEUE_BYPASS,
            decided_mark: DEFAULT_DECIDED_MARK,
            route_mark: DEFAULT_ROUTE_MARK,
            bypass_mark: DEFAULT_BYPASS_MARK,
            reject_mark: DEFAULT_REJECT_MARK,
            route_table: DEFAULT_ROUTE_TABLE,
            rule_priority: DEFAULT_RULE_PRIORITY,
            name_prefix: DEFAULT_NAME_PREFIX.to_owned(),
            keep_rules_on_exit: DEFAULT_KEEP_RULES_ON_EXIT,
            upstream_zone: DEFAULT_UPSTREAM_ZONE,
            source_check: DEFAULT_SOURCE_CHECK,
            udp_path: UdpPath::Kernel,
        }
    }
}

impl RedirectConfig {
    /// Checks every field; returns the first problem found, in field order.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field and the bound it breaks.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.tproxy_port == 0 {
            return Err(ConfigError::TproxyPortZero);
        }
        if self.local_pods_port().is_none() {
            return Err(ConfigError::TproxyPortLast);
        }
        if self.queue_count == 0 {
            return Err(ConfigError::QueueCountZero);
        }
        if self.kernel_forwarded_queue().is_none() {
            return Err(ConfigError::QueueRangeOverflow {
                first: self.queue_first,
                count: self.queue_count,
            });
        }
        let marks = self.marks();
        for (role, mark) in marks {
            if mark.value == 0 {
                return Err(ConfigError::MarkZero { role });
            }
            if mark.value & !mark.mask != 0 {
                return Err(ConfigError::MarkOutsideMask { role, mark });
            }
        }
        for (i, (a, ma)) in marks.iter().enumerate() {
            for (b, mb) in &marks[i + 1..] {
                let shared = ma.mask & mb.mask;
                if shared != 0 {
                    return Err(ConfigError::MarksOverlap { a: *a, b: *b, shared });
                }
            }
        }
        if matches!(self.route_table, 0 | 253 | 254 | 255) {
            return Err(ConfigError::RouteTableReserved { table: self.route_table });
        }
        if !(1..=32765).contains(&self.rule_priority) {
            return Err(ConfigError::RulePriorityOutOfRange { priority: self.rule_priority });
        }
        let p = &self.name_prefix;
        let well_formed = (1..=MAX_NAME_PREFIX_LEN).contains(&p.len())
            && p.starts_with(|c: char| c.is_ascii_lowercase())
            && p.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
        if !well_formed {
            return Err(ConfigError::InvalidNamePrefix { prefix: p.clone() });
        }
        Ok(())
    }

    /// The last queue number, `queue_first + queue_count - 1`; `None` when `queue_count` is 0
    /// or the sum overflows `u16`.
    pub fn queue_last(&self) -> Option<u16> {
        self.queue_count.checked_sub(1).and_then(|c| self.queue_first.checked_add(c))
    }

    /// Port of the proxy's second transparent listener, [`RedirectConfig::tproxy_port`] + 1
    /// (`None` past 65,535), on the same addresses: TPROXY delivers TCP between two local
    /// pods there, the connections whose both legs the ruleset leaves untracked. Its
    /// sockets carry [`RedirectConfig::bypass_mark`] as `SO_MARK`, from the SYN-ACK on (a
    /// request socket and an accepted one take their listener's mark), by which raw OUTPUT
    /// untracks their packets as it does the upstream legs' (`redirect`, rule 0). A
    /// connection to a ClusterIP goes to the first listener even when its backend is a
    /// local pod: its packets from the proxy need conntrack's reverse NAT.
    pub fn local_pods_port(&self) -> Option<u16> {
        self.tproxy_port.checked_add(1)
    }

    /// The queue of the first packets of flows the kernel forwards once decided (SCTP, UDP to
    /// the node's own addresses): `queue_first + queue_count`, after the balanced queues;
    /// `None` when that overflows `u16`. It never fails open when it is full, even with
    /// [`RedirectConfig::queue_bypass`]: nothing decides those flows later, so a packet the
    /// kernel let through undecided would be an association or flow no policy was asked
    /// about (issue #17: `--fail-open` let denied SCTP through under a SYN flood). The
    /// balanced queues fail open when full in that mode: their TCP and UDP go to the proxy,
    /// which decides each flow as it takes it.
    pub fn kernel_forwarded_queue(&self) -> Option<u16> {
        self.queue_first.checked_add(self.queue_count)
    }

    /// The decided mark's bits without the reject mark's: an allowed packet whose class may
    /// enter the kernel-side cache (the queue's "allowed, not cached" sets both; module
    /// docs, the mark table).
    pub fn cacheable_mark(&self) -> Mark {
        Mark {
            value: self.decided_mark.value,
            mask: self.decided_mark.mask | self.reject_mark.mask,
        }
    }

    /// The reject mark's bits without the decided mark's: a rejected packet the refusal
    /// chains refuse (module docs, the mark table).
    pub fn refused_mark(&self) -> Mark {
        Mark { value: self.reject_mark.value, mask: self.reject_mark.mask | self.decided_mark.mask }
    }

    /// The four marks with their roles, in the order decided, route, bypass, reject.
    pub fn marks(&self) -> [(MarkRole, Mark); 4] {
        [
            (MarkRole::Decided, self.decided_mark),
            (MarkRole::Route, self.route_mark),
            (MarkRole::Bypass, self.bypass_mark),
            (MarkRole::Reject, self.reject_mark),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn invalid(f: impl FnOnce(&mut RedirectConfig)) -> ConfigError {
        let mut c = RedirectConfig::default();
        f(&mut c);
        c.validate().expect_err("config should be rejected")
    }

    #[test]
    fn defaults_are_valid() {
        assert_eq!(RedirectConfig::default().validate(), Ok(()));
    }

    #[test]
    fn agent_options_name_what_the_agent_cannot_run_with() {
        let ok = AgentOptions::new("n1".into(), vec![PathBuf::from("cluster.yaml")]);
        assert_eq!(ok.validate(), Ok(()));
        let bad = |f: &dyn Fn(&mut AgentOptions)| {
            let mut o = ok.clone();
            f(&mut o);
            o.validate().expect_err("options should be rejected").to_string()
        };
        assert_eq!(bad(&|o| o.node.clear()), "agent option node is required");
        assert!(bad(&|o| o.manifests.clear()).contains("manifests (or kube)"));
        let with_kube =
            AgentOptions { manifests: vec![], kube: Some(KubeOptions::default()), ..ok.clone() };
        assert_eq!(with_kube.validate(), Ok(()));
        assert_eq!(
            bad(&|o| o.max_connections = 0),
            "agent option max_connections is 0; it must be at least 1"
        );
        assert!(bad(&|o| o.connect_timeout = Duration::ZERO).contains("connect_timeout"));
        assert!(bad(&|o| o.idle_timeout = Duration::from_micros(10)).contains("idle_timeout"));
        assert!(bad(&|o| o.udp_idle_timeout = Duration::ZERO).contains("udp_idle_timeout"));
        assert_eq!(
            bad(&|o| o.busy_poll = Duration::from_micros(1001)),
            "agent option busy_poll (us) is 1001; it must be 0..=1000"
        );
        let busy = AgentOptions { busy_poll: Duration::from_millis(1), ..ok.clone() };
        assert_eq!(busy.validate(), Ok(()));
        assert!(bad(&|o| o.pipe_budget_percent = 101).contains("1..=100"));
        assert!(bad(&|o| o.pipe_budget_percent = 0).contains("1..=100"));
        assert_eq!(bad(&|o| o.redirect.queue_count = 0), "redirect.queue_count must be at least 1");
    }

    #[test]
    fn default_marks_avoid_kube_proxy_calico_and_cilium_bits() {
        // kube-proxy 0x4000/0x8000, Calico 0xffff0000, Cilium 0x0f00.
        for (role, m) in RedirectConfig::default().marks() {
            assert_eq!(m.mask & (0x4000 | 0x8000 | 0xffff_0000 | 0x0f00), 0, "{role}");
            assert_eq!(m.value, m.mask, "{role} is a single bit");
            assert_eq!(m.mask.count_ones(), 1, "{role} is a single bit");
        }
    }

    #[test]
    fn port_zero() {
        assert_eq!(invalid(|c| c.tproxy_port = 0), ConfigError::TproxyPortZero);
    }

    #[test]
    fn last_port_leaves_no_room_for_the_local_pods_listener() {
        assert_eq!(invalid(|c| c.tproxy_port = u16::MAX), ConfigError::TproxyPortLast);
        let c = RedirectConfig { tproxy_port: 15001, ..RedirectConfig::default() };
        assert_eq!(c.local_pods_port(), Some(15002));
    }

    #[test]
    fn queue_count_zero() {
        assert_eq!(invalid(|c| c.queue_count = 0), ConfigError::QueueCountZero);
    }

    #[test]
    fn queue_range_must_fit_u16() {
        let e = invalid(|c| {
            c.queue_first = 65534;
            c.queue_count = 2;
        });
        assert_eq!(e, ConfigError::QueueRangeOverflow { first: 65534, count: 2 });
        let mut c = RedirectConfig { queue_first: 65533, queue_count: 2, ..Default::default() };
        assert_eq!(c.validate(), Ok(()));
        assert_eq!(c.queue_last(), Some(65534));
        assert_eq!(c.kernel_forwarded_queue(), Some(65535));
        c.queue_count = 1;
        assert_eq!(c.queue_last(), Some(65533));
    }

    #[test]
    fn mark_zero() {
        let e = invalid(|c| c.route_mark = Mark { value: 0, mask: 0x2000 });
        assert_eq!(e, ConfigError::MarkZero { role: MarkRole::Route });
        assert_eq!(
            invalid(|c| c.bypass_mark = Mark::bit(40)),
            ConfigError::MarkZero { role: MarkRole::Bypass }
        );
    }

    #[test]
    fn mark_outside_mask() {
        let mark = Mark { value: 0x3000, mask: 0x1000 };
        let e = invalid(|c| c.decided_mark = mark);
        assert_eq!(e, ConfigError::MarkOutsideMask { role: MarkRole::Decided, mark });
    }

    #[test]
    fn route_and_bypass_marks_must_differ() {
        let e = invalid(|c| c.bypass_mark = c.route_mark);
        assert_eq!(
            e,
            ConfigError::MarksOverlap { a: MarkRole::Route, b: MarkRole::Bypass, shared: 0x2000 }
        );
    }

    #[test]
    fn the_reject_mark_shares_no_bit_with_the_others() {
        assert_eq!(RedirectConfig::default().validate(), Ok(()));
        let e = invalid(|c| c.reject_mark = Mark { value: 0x40, mask: 0xc0 });
        assert_eq!(
            e,
            ConfigError::MarksOverlap { a: MarkRole::Bypass, b: MarkRole::Reject, shared: 0x80 }
        );
        assert_eq!(
            invalid(|c| c.reject_mark = Mark::bit(32)),
            ConfigError::MarkZero { role: MarkRole::Reject }
        );
    }

    #[test]
    fn masks_must_be_disjoint_even_when_values_differ() {
        let e = invalid(|c| c.decided_mark = Mark { value: 0x1000, mask: 0x3000 });
        assert_eq!(
            e,
            ConfigError::MarksOverlap { a: MarkRole::Decided, b: MarkRole::Route, shared: 0x2000 }
        );
    }

    #[test]
    fn reserved_tables() {
        for t in [0, 253, 254, 255] {
            assert_eq!(
                invalid(|c| c.route_table = t),
                ConfigError::RouteTableReserved { table: t }
            );
        }
    }

    #[test]
    fn rule_priority_bounds() {
        for p in [0, 32766, 40000] {
            assert_eq!(
                invalid(|c| c.rule_priority = p),
                ConfigError::RulePriorityOutOfRange { priority: p }
            );
        }
    }

    #[test]
    fn name_prefix() {
        for p in ["", "Tierproxy", "1tp", "tp_x", "abcdefghijklmnopq"] {
            assert_eq!(
                invalid(|c| c.name_prefix = p.to_owned()),
                ConfigError::InvalidNamePrefix { prefix: p.to_owned() },
                "{p:?}"
            );
        }
        let c = RedirectConfig { name_prefix: "tp-2".into(), ..Default::default() };
        assert_eq!(c.validate(), Ok(()));
    }

    #[test]
    fn backend_choice_parses_and_displays() {
        for s in ["auto", "iptables", "nftables"] {
            assert_eq!(s.parse::<BackendChoice>().map(|b| b.to_string()).as_deref(), Ok(s));
        }
        assert_eq!(
            "nft".parse::<BackendChoice>(),
            Err(ConfigError::UnknownBackend { name: "nft".into() })
        );
    }

    #[test]
    fn deserializes_with_defaults_and_rejects_unknown_fields() {
        let c: RedirectConfig =
            serde_json::from_str(r#"{"queue_bypass": true, "backend": "iptables"}"#).unwrap();
        assert!(c.queue_bypass);
        assert_eq!(c.backend, BackendChoice::Iptables);
        assert_eq!(c.tproxy_port, DEFAULT_TPROXY_PORT);
        assert!(serde_json::from_str::<RedirectConfig>(r#"{"queue_bypas": true}"#).is_err());
    }
}
