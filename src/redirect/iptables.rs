//! The iptables backend: ipset sets, tierproxy's own chains in the mangle and raw tables of
//! both families, jumps from `mangle PREROUTING` (interception), from `mangle INPUT` and
//! `mangle FORWARD` (the decision) and from `raw PREROUTING` and `raw OUTPUT` (the
//! upstream legs' conntrack zone, rule 0), and policy routing.
//!
//! * Sets (`hash:ip`, family `inet`/`inet6`; ipset(8)) are filled under a temporary name and
//!   exchanged with `swap`, which is atomic: a packet never sees a half-filled set. All set
//!   commands go through one `ipset restore -exist`.
//! * Chains are replaced by `iptables-restore --noflush`: declaring `:CHAIN - [0:0]` flushes
//!   tierproxy's chain and the rules that follow refill it, in one transaction, while every
//!   other chain keeps its rules (iptables-restore(8)).
//! * The jumps `-I PREROUTING 1 -j TIERPROXY`, `-I INPUT 1 -j TIERPROXY-DECIDE` and
//!   `-I FORWARD 1 -j TIERPROXY-DECIDE` are inserted at the top only when `iptables -C`
//!   finds them missing, so re-applying never duplicates them.
//!
//! Rules are written in `iptables-save`'s canonical order (`-p` first, matches in order,
//! comments quoted), so the rendered lines equal what `iptables-save` prints back; the netns
//! tests compare them.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::IpAddr;

use super::exec::Cmd;
use super::{
    Backend, BackendKind, COMMENT_ENFORCED, COMMENT_ESTABLISHED_TCP, COMMENT_LOCAL_PODS_NO_SOCKET,
    COMMENT_LOCAL_PODS_SYN, COMMENT_NODE_SOURCE, COMMENT_POD_SOURCE, COMMENT_STRAY_TCP,
    COMMENT_TCP_PAST_SYN, COMMENT_UDP_TO_NODE, DropCounts, Names, QUEUED_PROTOCOLS, QueueWhen,
    RedirectError, RulesetSpec, by_family, routing, tproxy_protocols,
};
use crate::config::{RedirectConfig, UdpPath};

/// The programs the backend runs; [`IptablesCommands::default`] uses the distribution's
/// default `iptables` (on the development machines `iptables v1.8.9 (nf_tables)`),
/// [`IptablesCommands::legacy`] the `-legacy` variants. Use the flavour kube-proxy uses on
/// the node: both install hooks at the same priority, and mixing them makes the order
/// between tierproxy's and kube-proxy's mangle rules depend on registration order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IptablesCommands {
    /// `iptables`.
    pub iptables: String,
    /// `ip6tables`.
    pub ip6tables: String,
    /// `iptables-restore`.
    pub iptables_restore: String,
    /// `ip6tables-restore`.
    pub ip6tables_restore: String,
    /// `iptables-save`.
    pub iptables_save: String,
    /// `ip6tables-save`.
    pub ip6tables_save: String,
    /// `ipset`.
    pub ipset: String,
    /// `ip` (iproute2), for policy routing.
    pub ip: String,
}

impl Default for IptablesCommands {
    fn default() -> Self {
        IptablesCommands {
            iptables: "iptables".into(),
            ip6tables: "ip6tables".into(),
            iptables_restore: "iptables-restore".into(),
            ip6tables_restore: "ip6tables-restore".into(),
            iptables_save: "iptables-save".into(),
            ip6tables_save: "ip6tables-save".into(),
            ipset: "ipset".into(),
            ip: "ip".into(),
        }
    }
}

impl IptablesCommands {
    /// The `iptables-legacy` family of tools (x_tables, not nf_tables).
    pub fn legacy() -> Self {
        IptablesCommands {
            iptables: "iptables-legacy".into(),
            ip6tables: "ip6tables-legacy".into(),
            iptables_restore: "iptables-legacy-restore".into(),
            ip6tables_restore: "ip6tables-legacy-restore".into(),
            iptables_save: "iptables-legacy-save".into(),
            ip6tables_save: "ip6tables-legacy-save".into(),
            ..IptablesCommands::default()
        }
    }
}

/// The iptables + ipset backend (see the module docs of `redirect` for the rules).
#[derive(Debug, Clone, Default)]
pub struct IptablesBackend {
    cmds: IptablesCommands,
    /// `nft`, when the backend adds table `inet <prefix>-dnat`
    /// ([`IptablesBackend::with_nft_after_dnat`]).
    nft: Option<String>,
}

/// One IP family as the iptables backend sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    V4,
    V6,
}

impl Family {
    fn ipset_family(self) -> &'static str {
        match self {
            Family::V4 => "inet",
            Family::V6 => "inet6",
        }
    }
}

impl IptablesBackend {
    /// The backend with the default `iptables` tools.
    pub fn new() -> Self {
        IptablesBackend::default()
    }

    /// The backend with the given tools (e.g. [`IptablesCommands::legacy`]).
    pub fn with_commands(cmds: IptablesCommands) -> Self {
        IptablesBackend { cmds, nft: None }
    }

    /// This backend, also installing table `inet <prefix>-dnat` with `nft` (the program):
    /// rule 3 for connections a DNAT rewrote (a ClusterIP), in a chain right after the
    /// DNAT, where the socket lookup sees the rewritten header and `tproxy` can hand the
    /// ACK of a SYN cookie to the listener (xt TPROXY runs only in the mangle table, before
    /// the DNAT); the refusal chains ([`Backend::refuses`]; xt REJECT runs only in the
    /// filter table, after other programs' chains); and chains S and 0 (the source check,
    /// the upstream legs' zone) with their sets, in place of the raw table's xt rules,
    /// which applying removes (module docs of `redirect`). Needs CONFIG_NFT_TPROXY,
    /// CONFIG_NFT_SOCKET, CONFIG_NFT_REJECT_INET and CONFIG_NFT_FIB_INET
    /// ([`super::nft::check_tproxy_support`]), not CONFIG_NFT_QUEUE.
    pub fn with_nft_after_dnat(mut self, nft: &str) -> Self {
        self.nft = Some(nft.to_owned());
        self
    }

    /// The tools this backend runs.
    pub fn commands(&self) -> &IptablesCommands {
        &self.cmds
    }

    /// Applies the transaction `make` builds for table `inet <prefix>-dnat` (its name
    /// given), when this backend has that table ([`IptablesBackend::with_nft_after_dnat`]):
    /// the raw chains' sets follow the ipsets.
    fn update_nft(
        &self,
        config: &RedirectConfig,
        make: impl FnOnce(&str) -> ::nftables::schema::Nftables<'static>,
    ) -> Result<(), RedirectError> {
        if let Some(nft) = &self.nft {
            let batch = make(&Names::new(config).dnat_table);
            Cmd::new(nft, ["-j", "-f", "-"]).run(Some(&super::nft::json(&batch)))?;
        }
        Ok(())
    }

    /// Deletes tierproxy's jumps and chains from `table` of family `fam`, if any.
    fn remove_table(&self, fam: Family, table: &str, names: &Names) -> Result<(), RedirectError> {
        let save = self.save_cmd(fam, table).run(None)?;
        if let Some(input) = removal_input(&parse_save(&save, names, table), table) {
            self.restore_cmd(fam).run(Some(&input))?;
        }
        Ok(())
    }

    fn iptables(&self, fam: Family) -> &str {
        match fam {
            Family::V4 => &self.cmds.iptables,
            Family::V6 => &self.cmds.ip6tables,
        }
    }

    fn restore_cmd(&self, fam: Family) -> Cmd {
        let program = match fam {
            Family::V4 => &self.cmds.iptables_restore,
            Family::V6 => &self.cmds.ip6tables_restore,
        };
        Cmd::new(program, ["-w", "--noflush"])
    }

    fn save_cmd(&self, fam: Family, table: &str) -> Cmd {
        let program = match fam {
            Family::V4 => &self.cmds.iptables_save,
            Family::V6 => &self.cmds.ip6tables_save,
        };
        Cmd::new(program, ["-t", table])
    }

    fn ipset_restore_cmd(&self) -> Cmd {
        Cmd::new(&self.cmds.ipset, ["restore", "-exist"])
    }

    fn jump_cmd(&self, fam: Family, op: &str, (table, hook, target): Jump<'_>) -> Cmd {
        let mut args = vec!["-w", "-t", table, op, hook];
        if op == "-I" {
            args.push("1");
        }
        args.extend(["-j", target]);
        Cmd::new(self.iptables(fam), args)
    }

    /// Whether the jump exists (`iptables -C`, exit status 1 = missing).
    fn has_jump(&self, fam: Family, jump: Jump<'_>) -> Result<bool, RedirectError> {
        let cmd = self.jump_cmd(fam, "-C", jump);
        let out = cmd.output(None)?;
        match out.status.code() {
            Some(0) => Ok(true),
            Some(1) => Ok(false),
            _ => Err(cmd.failed(&out)),
        }
    }
}

/// A jump into one of tierproxy's chains: `(table, built-in chain, tierproxy's chain)`.
type Jump<'a> = (&'static str, &'static str, &'a str);

/// The tables tierproxy has chains in, in the order they are written and removed.
const TABLES: [&str; 2] = ["mangle", "raw"];

/// The jumps into tierproxy's chains: mangle PREROUTING intercepts, mangle INPUT and
/// FORWARD decide, raw PREROUTING and OUTPUT set the upstream legs' conntrack zone (see the
/// module docs of `redirect`).
/// Each jump is inserted at the top of its chain, so of two in one built-in chain the
/// later one ends up first: raw PREROUTING checks sources (chain S) before zones (rule 0).
fn hooks(names: &Names) -> [Jump<'_>; 6] {
    [
        ("mangle", "PREROUTING", names.chain.as_str()),
        ("mangle", "INPUT", names.decide_chain.as_str()),
        ("mangle", "FORWARD", names.decide_chain.as_str()),
        ("raw", "PREROUTING", names.zone_in_chain.as_str()),
        ("raw", "OUTPUT", names.zone_out_chain.as_str()),
        ("raw", "PREROUTING", names.source_chain.as_str()),
    ]
}

/// The jumps [`hooks`] this backend installs: all of them, or with the raw-priority chains
/// in nft (`native_raw`) the mangle table's only.
fn hooks_in_use(names: &Names, native_raw: bool) -> impl Iterator<Item = Jump<'_>> {
    hooks(names).into_iter().filter(move |(table, _, _)| !native_raw || *table != "raw")
}

/// tierproxy's chains in `table`.
fn own_chains<'a>(names: &'a Names, table: &str) -> Vec<&'a String> {
    match table {
        "raw" => vec![
            &names.pod_source_chain,
            &names.source_chain,
            &names.zone_in_chain,
            &names.zone_leg_chain,
            &names.zone_out_chain,
        ],
        _ => vec![
            &names.chain,
            &names.divert_chain,
            &names.intercept_chain,
            &names.decide_chain,
            &names.queue_chain,
        ],
    }
}

/// The `ipset restore` input that makes the six sets hold exactly the spec's addresses and
/// interfaces: each set is created if missing, a temporary set is filled and swapped in, and
/// the temporary set (now holding the old members) destroyed.
pub(crate) fn ipset_input(spec: &RulesetSpec) -> String {
    let names = spec.names();
    let (pods4, pods6) = by_family(spec.local_pods());
    let (nodes4, nodes6) = by_family(spec.node_addrs());
    let mut out = String::new();
    for (set, fam, members) in [
        (&names.pods_v4, Family::V4, &pods4),
        (&names.pods_v6, Family::V6, &pods6),
        (&names.nodes_v4, Family::V4, &nodes4),
        (&names.nodes_v6, Family::V6, &nodes6),
    ] {
        swap_in(&mut out, set, &format!("hash:ip family {}", fam.ipset_family()), members);
    }
    podif_input(&mut out, &names, spec.pod_interfaces());
    enforced_input(&mut out, &names, spec.enforced_pods());
    allowed_input(&mut out, &names, true);
    out
}

/// The kernel-side cache of allowed TCP classes (rule 7): `hash:ip,port,ip` per family
/// with a default timeout, created when missing; emptied when `flush`.
fn allowed_input(out: &mut String, names: &Names, flush: bool) {
    for (set, fam) in [(&names.allowed_v4, Family::V4), (&names.allowed_v6, Family::V6)] {
        let _ = writeln!(
            out,
            "create {set} hash:ip,port,ip family {} timeout {} maxelem {}",
            fam.ipset_family(),
            super::ALLOWED_CACHE_SECS,
            super::ALLOWED_CACHE_MAX
        );
        if flush {
            let _ = writeln!(out, "flush {set}");
        }
    }
}

/// The enforced pod sets (rule 6): `hash:ip` per family, swapped in whole.
fn enforced_input(out: &mut String, names: &Names, addrs: &BTreeSet<IpAddr>) {
    let (v4, v6) = by_family(addrs);
    for (set, fam, members) in
        [(&names.enforced_v4, Family::V4, &v4), (&names.enforced_v6, Family::V6, &v6)]
    {
        swap_in(out, set, &format!("hash:ip family {}", fam.ipset_family()), members);
    }
}

/// Appends the `ipset restore` lines that make `set` (created as `kind` if missing) hold
/// exactly `members`, swapped in whole through a temporary set.
fn swap_in<T: std::fmt::Display>(
    out: &mut String,
    set: &str,
    kind: &str,
    members: impl IntoIterator<Item = T>,
) {
    let tmp = format!("{set}-tmp");
    let _ = writeln!(out, "create {set} {kind}");
    let _ = writeln!(out, "create {tmp} {kind}");
    // A temporary set left by a crash may hold stale members.
    let _ = writeln!(out, "flush {tmp}");
    for m in members {
        let _ = writeln!(out, "add {tmp} {m}");
    }
    let _ = writeln!(out, "swap {tmp} {set}");
    let _ = writeln!(out, "destroy {tmp}");
}

/// The pod interface sets (chain S, rule 3): `hash:net,iface` with the any-network of the
/// family and each interface, so that `--match-set SET src,src` matches every packet that
/// came in on one of them (ipset(8): `hash:net,iface`, the `src` direction of the
/// interface is the incoming one; the /0 network is allowed for this type).
fn podif_input(out: &mut String, names: &Names, interfaces: &BTreeSet<String>) {
    for (set, fam, any) in
        [(&names.podif_v4, Family::V4, "0.0.0.0/0"), (&names.podif_v6, Family::V6, "::/0")]
    {
        let kind = format!("hash:net,iface family {}", fam.ipset_family());
        swap_in(out, set, &kind, interfaces.iter().map(|i| format!("{any},{i}")));
    }
}

/// The `iptables-restore --noflush` input declaring and filling tierproxy's chains for one
/// family, in `iptables-save`'s canonical form: the mangle table's and, unless
/// `native_raw` (the raw-priority chains are in table `inet <prefix>-dnat`,
/// [`IptablesBackend::with_nft_after_dnat`]), the raw table's ([`raw_input`]).
fn restore_input(spec: &RulesetSpec, fam: Family, native_raw: bool) -> String {
    let c = spec.config();
    let n = spec.names();
    let (pods, nodes, enforced, on_ip) = match fam {
        Family::V4 => (&n.pods_v4, &n.nodes_v4, &n.enforced_v4, c.tproxy_addr_v4.to_string()),
        Family::V6 => (&n.pods_v6, &n.nodes_v6, &n.enforced_v6, c.tproxy_addr_v6.to_string()),
    };
    let allowed = match fam {
        Family::V4 => &n.allowed_v4,
        Family::V6 => &n.allowed_v6,
    };
    let (chain, divert, intercept, decide, queue) =
        (&n.chain, &n.divert_chain, &n.intercept_chain, &n.decide_chain, &n.queue_chain);
    let (bypass, decided, route) = (c.bypass_mark, c.decided_mark, c.route_mark);
    const SYN: &str = "-m tcp --tcp-flags FIN,SYN,RST,ACK SYN";
    // Every rule's `-m comment` comes last, before its target: iptables-nft runs the
    // comment as an xt match of its own (`comment_mt`, through `nft_match_large_eval`),
    // evaluated in the order written, so a comment written first cost every packet that
    // the rule did not take one more match (measured with the goto rules of rules 6 and 7:
    // the chains' CPU 0.89× a datagram's, 0.83× a new flow's; docs/architecture.md, "The
    // rule walk's matches").
    let mut o = String::from("*mangle\n");
    // Declared, and their rules written, in name order: `iptables-save` lists chains so
    // (legacy sorts them; nf_tables lists them in creation order, which this is).
    for ch in [chain, decide, divert, intercept, queue] {
        let _ = writeln!(o, ":{ch} - [0:0]");
    }
    // PREROUTING, rule 1: the proxy's own upstream packets are never touched.
    let _ = writeln!(
        o,
        "-A {chain} -m mark --mark {bypass} \
         -m comment --comment \"tierproxy: proxy upstream sockets (bypass mark)\" -j RETURN"
    );
    if c.udp_path == UdpPath::Kernel {
        // Nothing below is for UDP on the kernel path (it is neither TPROXY'd nor owned by
        // a proxy socket): spare every datagram the socket lookups and set matches.
        let _ = writeln!(
            o,
            "-A {chain} -p udp \
             -m comment --comment \"tierproxy: UDP, decided in INPUT and FORWARD\" -j RETURN"
        );
    }
    // Rule 2: established transparent sockets (proxied flows, upstream replies) → local.
    // Not a TCP SYN: the socket match finds TIME_WAIT sockets too, and a SYN reusing the
    // 4-tuple of a client leg in TIME_WAIT must reach TPROXY (rule 6), which hands it to
    // the listener; delivered to the TIME_WAIT socket it is answered with a bare ACK.
    let _ = writeln!(
        o,
        "-A {chain} -p tcp -m tcp ! --tcp-flags FIN,SYN,RST,ACK SYN -m socket --transparent \
         -m comment --comment \"tierproxy: established transparent socket\" -j {divert}"
    );
    let _ = writeln!(
        o,
        "-A {chain} ! -p tcp -m socket --transparent \
         -m comment --comment \"tierproxy: established transparent socket\" -j {divert}"
    );
    let tproxy =
        format!("-j TPROXY --on-port {} --on-ip {on_ip} --tproxy-mark {route}", c.tproxy_port);
    // TCP between two local pods, untracked by table `inet <prefix>-dnat` (rule 0), goes to
    // the second listener, whose sockets carry the bypass mark (`local_pods_port`).
    let local_pods = native_raw && c.upstream_zone != 0;
    let tproxy_local = format!(
        "-j TPROXY --on-port {} --on-ip {on_ip} --tproxy-mark {route}",
        c.local_pods_port().unwrap_or(c.tproxy_port)
    );
    // Rule 3: later packets of a TCP connection whose SYN rule 6 TPROXY'd, that no socket
    // took in rule 2. Destination rewritten by a DNAT after this hook (a ClusterIP): rule 2
    // looked the socket up by the header as it is here, before the DNAT, and missed; after
    // the DNAT the kernel finds it.
    let _ = writeln!(
        o,
        "-A {chain} -p tcp -m tcp ! --tcp-flags FIN,SYN,RST,ACK SYN \
         -m conntrack --ctstate DNAT --ctdir ORIGINAL -m connmark --mark {route} \
         -m comment --comment \"tierproxy: proxied connection (conntrack mark)\" -j {divert}"
    );
    // Otherwise to the listener: the ACK that completes a SYN cookie has no socket yet.
    let _ = writeln!(
        o,
        "-A {chain} -p tcp -m tcp ! --tcp-flags FIN,SYN,RST,ACK SYN \
         -m conntrack ! --ctstate DNAT --ctdir ORIGINAL -m connmark --mark {route} \
         -m comment --comment \"tierproxy: no socket yet (SYN cookie)\" {tproxy}"
    );
    // Rule 3, untracked: TCP between two local pods past its SYN, which table
    // `inet <prefix>-dnat` untracks (rule 0), that no socket took in rule 2: a SYN cookie's
    // ACK, or a segment of no connection the proxy holds. To the listener, which completes
    // the cookie and resets or discards the rest (xt TPROXY drops it without a listener);
    // counted with rule 6's stray drops.
    if local_pods {
        let _ = writeln!(
            o,
            "-A {chain} -p tcp -m tcp ! --tcp-flags FIN,SYN,RST,ACK SYN \
             -m conntrack --ctstate UNTRACKED -m set --match-set {pods} src \
             -m set --match-set {pods} dst \
             -m comment --comment \"{COMMENT_LOCAL_PODS_NO_SOCKET}\" {tproxy_local}"
        );
    }
    // Rule 3a: a later packet of an established TCP connection that rules 2 and 3 did not
    // take: nothing below acts on it (rule 6 drops only new or invalid TCP past a SYN), so
    // it returns before rule 6's set lookups.
    let _ = writeln!(
        o,
        "-A {chain} -p tcp -m tcp ! --tcp-flags FIN,SYN,RST,ACK SYN \
         -m conntrack --ctstate RELATED,ESTABLISHED,UNTRACKED \
         -m comment --comment \"{COMMENT_ESTABLISHED_TCP}\" -j RETURN"
    );
    // Rule 4: traffic the node sends itself over loopback (chain S dropped every other
    // packet with a node address as its source).
    let _ = writeln!(
        o,
        "-A {chain} -i lo -m set --match-set {nodes} src \
         -m comment --comment \"tierproxy: from the node itself\" -j RETURN"
    );
    // Rule 5: UDP to the node's own addresses is forwarded by the kernel after its first
    // packet's decision (the proxy cannot take a hostNetwork server's address and port).
    // Its connection is marked on its first datagram, before any DNAT (the route bit,
    // which otherwise marks TCP connections only): a node port's flow is DNAT'd to a pod,
    // whose answers pass here from a local pod, and neither they nor the flow's later
    // datagrams are intercepted or queued.
    let _ = writeln!(
        o,
        "-A {chain} -p udp -m set --match-set {nodes} dst -m conntrack --ctstate NEW \
         -m comment --comment \"{COMMENT_UDP_TO_NODE}\" -j CONNMARK --set-xmark {route}"
    );
    let udp_to_node = format!(
        "-p udp -m connmark --mark {route} -m conntrack ! --ctstate NEW \
         -m comment --comment \"tierproxy: UDP to the node itself, decided\" -j RETURN"
    );
    let _ = writeln!(o, "-A {chain} {udp_to_node}");
    // Rule 6: packets of pod flows not owned by a proxy socket, egress then ingress → the
    // intercept chain, which TPROXYs TCP SYNs and UDP; the decision follows after
    // the DNAT, in INPUT. A goto (`-g`): what the intercept chain returns or lets fall
    // through is done with PREROUTING, so that a packet between two local pods walks it
    // once, not once for each end.
    for (dir, words) in [("src", "from"), ("dst", "to")] {
        let _ = writeln!(
            o,
            "-A {chain} -m set --match-set {pods} {dir} \
             -m comment --comment \"tierproxy: flow {words} a local pod\" -g {intercept}"
        );
    }
    // INPUT and FORWARD, rule 7: the decision, on the header after kube-proxy's DNAT (nat
    // PREROUTING, priority -100, after mangle's -150): a flow to a ClusterIP is decided on
    // the backend pod and its target port. Packets rule 2 or 3 took, and repeated ones, carry
    // the decided mark.
    let _ = writeln!(
        o,
        "-A {decide} -m mark --mark {bypass} \
         -m comment --comment \"tierproxy: proxy upstream sockets (bypass mark)\" -j RETURN"
    );
    // First: every later datagram of every UDP flow takes this chain.
    if c.udp_path == UdpPath::Kernel {
        // A datagram of a UDP flow whose conntrack entry exists (its first datagram was
        // allowed): forwarded by the kernel (see `QueueWhen::Unconfirmed`).
        let _ = writeln!(
            o,
            "-A {decide} -p udp -m conntrack --ctstatus CONFIRMED \
             -m comment --comment \"tierproxy: UDP flow, decided\" -j RETURN"
        );
    }
    // Every TCP rule below is for SYNs: a TCP packet past its connection's SYN returns.
    let _ = writeln!(
        o,
        "-A {decide} -p tcp -m tcp ! --tcp-flags FIN,SYN,RST,ACK SYN \
         -m comment --comment \"{COMMENT_TCP_PAST_SYN}\" -j RETURN"
    );
    // An allowed SYN, repeated with the decided mark: its class (client, port, server)
    // enters the kernel-side cache, so the class's next SYNs skip the queue (rule 7).
    let _ = writeln!(
        o,
        "-A {decide} -p tcp {SYN} -m mark --mark {decided} \
         -m comment --comment \"tierproxy: allowed class, cached\" \
         -j SET --add-set {allowed} src,dst,dst --exist"
    );
    if c.udp_path == UdpPath::Kernel {
        // The same for a UDP flow's first datagram (the set's port carries the protocol),
        // unless the queue answered "allowed, not cached": the decided and the reject bits
        // together (`proxy::queue`).
        let cacheable = c.cacheable_mark();
        let _ = writeln!(
            o,
            "-A {decide} -p udp -m mark --mark {cacheable} \
             -m comment --comment \"tierproxy: allowed class, cached\" \
             -j SET --add-set {allowed} src,dst,dst --exist"
        );
    }
    let _ = writeln!(
        o,
        "-A {decide} -m mark --mark {decided} \
         -m comment --comment \"tierproxy: decided\" -j RETURN"
    );
    let _ = writeln!(
        o,
        "-A {decide} -i lo -m set --match-set {nodes} src \
         -m comment --comment \"tierproxy: from the node itself\" -j RETURN"
    );
    let _ = writeln!(o, "-A {decide} {udp_to_node}");
    // A goto, as rule 6's: the queue chain's return (a cached class) ends the decision,
    // so a flow between two local pods looks its class up once, not once for each end.
    for (dir, words) in [("src", "from"), ("dst", "to")] {
        let _ = writeln!(
            o,
            "-A {decide} -m set --match-set {pods} {dir} \
             -m comment --comment \"tierproxy: flow {words} a local pod\" -g {queue}"
        );
    }
    let _ = writeln!(o, "-A {divert} -j MARK --set-xmark {route}");
    let _ = writeln!(o, "-A {divert} -j MARK --set-xmark {decided}");
    let _ = writeln!(o, "-A {divert} -j ACCEPT");
    // Rule 6, the intercept chain: TCP that no decision allowed (not a SYN, new or invalid
    // to conntrack) is dropped; TCP SYNs (their connection marked for rule 3) and UDP not
    // to the node's own addresses → the proxy's listener.
    let _ = writeln!(
        o,
        "-A {intercept} -p tcp -m tcp ! --tcp-flags FIN,SYN,RST,ACK SYN \
         -m conntrack --ctstate INVALID,NEW \
         -m comment --comment \"{COMMENT_STRAY_TCP}\" -j DROP"
    );
    // TCP from a pod whose own node's agent proxied and decided the connection: decided
    // here on its SYN (rule 7, the kernel-forwarded flows' queue), then forwarded by the
    // kernel, not proxied a second time.
    let _ = writeln!(
        o,
        "-A {intercept} -p tcp -m set --match-set {enforced} src \
         -m comment --comment \"{COMMENT_ENFORCED}\" -j RETURN"
    );
    // The SYN of TCP between two local pods (untracked, rule 0) → the second listener; no
    // connection mark (there is no entry), and rule 3's untracked form completes its cookie.
    if local_pods {
        let _ = writeln!(
            o,
            "-A {intercept} -p tcp {SYN} -m conntrack --ctstate UNTRACKED \
             -m set --match-set {pods} src -m set --match-set {pods} dst \
             -m comment --comment \"{COMMENT_LOCAL_PODS_SYN}\" {tproxy_local}"
        );
    }
    for proto in tproxy_protocols(c.udp_path) {
        match super::queue_when(proto, c.udp_path) {
            QueueWhen::Syn => {
                let _ =
                    writeln!(o, "-A {intercept} -p {proto} {SYN} -j CONNMARK --set-xmark {route}");
                let _ = writeln!(o, "-A {intercept} -p {proto} {SYN} {tproxy}");
            }
            _ => {
                let _ = writeln!(
                    o,
                    "-A {intercept} -p {proto} -m set ! --match-set {nodes} dst {tproxy}"
                );
            }
        }
    }
    let queue_target = match c.queue_last() {
        Some(last) if last != c.queue_first => {
            format!("--queue-balance {}:{last}", c.queue_first)
        }
        _ => format!("--queue-num {}", c.queue_first),
    };
    let bypass_flag = if c.queue_bypass { " --queue-bypass" } else { "" };
    // Flows the kernel forwards once decided (UDP to the node, SCTP) go to their own queue,
    // which never fails open when full (see `RedirectConfig::kernel_forwarded_queue`).
    let forwarded = format!("--queue-num {}", c.kernel_forwarded_queue().unwrap_or(u16::MAX));
    // A SYN of a class the snapshot in force allowed (the cache is emptied at each new
    // snapshot): no queue trip. The proxy decides and audits it when it accepts it; a
    // kernel-forwarded one (from an enforced pod) was decided at its client's node.
    let _ = writeln!(
        o,
        "-A {queue} -p tcp {SYN} -m set --match-set {allowed} src,dst,dst \
         -m comment --comment \"tierproxy: allowed class, cached\" -j RETURN"
    );
    for proto in QUEUED_PROTOCOLS {
        let when = super::queue_when(proto, c.udp_path);
        let (new_only, target) = match when {
            QueueWhen::Syn => {
                // A SYN without the route mark was not TPROXY'd: one rule 6 lets the
                // kernel forward (from an enforced pod). Its own queue: the balanced ones
                // may fail open, and what they let through undecided must reach the proxy.
                let _ = writeln!(
                    o,
                    "-A {queue} -p {proto} {SYN} -m mark ! --mark {route} -j NFQUEUE {forwarded}{bypass_flag}"
                );
                (format!(" {SYN}"), &queue_target)
            }
            QueueWhen::Always => {
                // After the DNAT: a node port's flow by its connection mark (rule 5).
                let _ = writeln!(
                    o,
                    "-A {queue} -p {proto} -m connmark --mark {route} -j NFQUEUE {forwarded}{bypass_flag}"
                );
                (String::new(), &queue_target)
            }
            // The decide chain returned confirmed UDP already. A flow of a class the
            // snapshot in force allowed is not queued (below); any other is, balanced over
            // the queues like TCP, unless they fail open: what they let through undecided
            // the kernel would forward, and no proxy would decide it later.
            QueueWhen::Unconfirmed => {
                let uncached = format!(" -m set ! --match-set {allowed} src,dst,dst");
                (uncached, if c.queue_bypass { &forwarded } else { &queue_target })
            }
            QueueWhen::New => (" -m conntrack --ctstate NEW".to_owned(), &forwarded),
        };
        let _ = writeln!(o, "-A {queue} -p {proto}{new_only} -j NFQUEUE {target}{bypass_flag}");
        if when == QueueWhen::Unconfirmed {
            // A UDP flow of a cached class, then: no queue trip either. Its conntrack
            // entry gets the decided mark's bits as its connection mark, by which the
            // agent, reading conntrack's new events, decides, audits and tracks the flow
            // (`proxy::forwarded::watch`). One class lookup a flow: the rule above
            // looked it up, and this one (falling through to the chain's end) needs none.
            let _ = writeln!(
                o,
                "-A {queue} -p {proto} -m comment --comment \"tierproxy: allowed class, cached\" \
                 -j CONNMARK --set-xmark {decided}"
            );
        }
    }
    o.push_str("COMMIT\n");
    if !native_raw {
        raw_input(spec, fam, &mut o);
    }
    o
}

/// The raw table's part of [`restore_input`]: rule 0, the upstream legs' conntrack zone.
/// The chains are declared (so flushed) also when the zone is 0, and then stay empty.
fn raw_input(spec: &RulesetSpec, fam: Family, o: &mut String) {
    let c = spec.config();
    let n = spec.names();
    let (pods, enforced) = match fam {
        Family::V4 => (&n.pods_v4, &n.enforced_v4),
        Family::V6 => (&n.pods_v6, &n.enforced_v6),
    };
    let (zin, zleg, zout) = (&n.zone_in_chain, &n.zone_leg_chain, &n.zone_out_chain);
    let bypass = c.bypass_mark;
    let (source, pod_source) = (&n.source_chain, &n.pod_source_chain);
    let (nodes, podif) = match fam {
        Family::V4 => (&n.nodes_v4, &n.podif_v4),
        Family::V6 => (&n.nodes_v6, &n.podif_v6),
    };
    o.push_str("*raw\n");
    // Declared in name order, as `iptables-save` lists them; rules chain by chain in it.
    for ch in [pod_source, source, zin, zleg, zout] {
        let _ = writeln!(o, ":{ch} - [0:0]");
    }
    // Chain S: sources a pod cannot own (see the module docs of `redirect`). With the
    // source check, a packet from a pod's interface goes to the reverse-path check and ends
    // the chain there: the check drops a node's own address as well (the reverse route to
    // a local address is not through the pod's interface; rpfilter without
    // `--accept-local`), so a pod's packet costs one set lookup here, not two.
    if c.source_check {
        let _ = writeln!(
            o,
            "-A {pod_source} -m rpfilter --invert -m comment --comment \"{COMMENT_POD_SOURCE}\" -j DROP"
        );
    }
    let _ = writeln!(
        o,
        "-A {source} -i lo -m comment --comment \"tierproxy: the node itself, over loopback\" -j RETURN"
    );
    if c.source_check {
        let _ = writeln!(
            o,
            "-A {source} -m set --match-set {podif} src,src \
             -m comment --comment \"tierproxy: from a local pod interface\" -g {pod_source}"
        );
    }
    let _ = writeln!(
        o,
        "-A {source} -m set --match-set {nodes} src \
         -m comment --comment \"{COMMENT_NODE_SOURCE}\" -j DROP"
    );
    if c.upstream_zone != 0 {
        let ct = format!("-j CT --zone {}", c.upstream_zone);
        // Packets over `lo` re-enter PREROUTING with their conntrack entry (CT would skip
        // them) and their bypass mark, which the rules below must not clear.
        let _ = writeln!(
            o,
            "-A {zin} -m mark --mark {bypass} \
             -m comment --comment \"tierproxy: proxy upstream sockets (bypass mark)\" -j RETURN"
        );
        // Replies to an upstream socket: `--restore-skmark` copies the found socket's
        // SO_MARK into the packet mark (a client leg's socket has none); ours is the bypass
        // mark. Egress legs' replies go to a local pod, ingress legs' come from one. Not
        // only transparent sockets: an upstream leg from the node's own address (to the
        // node itself, or `--no-preserve-source`) is an ordinary socket, and its replies
        // looked up in the default zone were INVALID there.
        // On the kernel UDP path no upstream leg is UDP: UDP is spared the socket lookup.
        let not_udp = if c.udp_path == UdpPath::Kernel { "! -p udp " } else { "" };
        // One socket lookup per packet: a packet from a local pod to another was looked up
        // by the first rule, so the second takes only those to a local pod from elsewhere.
        // A reply from a local pod belongs to a leg to that pod, which is untracked (below);
        // one from elsewhere goes on to the leg chain, which tells an enforcing node's pod
        // (untracked) from anything else (the zone) after this one socket lookup, so that
        // the packets the kernel forwards to a local pod are looked up once, as before.
        let to_leg = format!("-j {zleg}");
        for (dir, words, not_from_pod, what, target) in [
            ("src", "from", String::new(), ", untracked", "-j NOTRACK"),
            ("dst", "to", format!("-m set ! --match-set {pods} src "), "", to_leg.as_str()),
        ] {
            let _ = writeln!(
                o,
                "-A {zin} {not_udp}-m set --match-set {pods} {dir} {not_from_pod}\
                 -m socket --restore-skmark -m mark --mark {bypass} \
                 -m comment --comment \"tierproxy: upstream leg {words} a local pod{what}\" {target}"
            );
        }
        let _ = writeln!(
            o,
            "-A {zin} -m mark --mark {bypass} \
             -m comment --comment \"tierproxy: socket mark restored, cleared\" \
             -j MARK --set-xmark 0x0/{:#x}",
            bypass.mask
        );
        // The leg chain: replies from elsewhere to an upstream socket (above). Written
        // before OUTPUT's chain: `iptables-save` lists rules chain by chain, in name order.
        let _ = writeln!(
            o,
            "-A {zleg} -m set --match-set {enforced} src \
             -m comment --comment \"tierproxy: upstream leg from a pod of an enforcing node, untracked\" \
             -j NOTRACK"
        );
        let _ = writeln!(
            o,
            "-A {zleg} \
             -m comment --comment \"tierproxy: upstream leg from elsewhere, own zone\" {ct}"
        );
        // Not ICMP: the agent's own ICMP errors (refusals, relayed port unreachables) carry
        // the bypass mark too, but belong to the client's flow: in the default zone
        // conntrack finds it (RELATED) and NAT un-does a ClusterIP's DNAT on them. In the
        // same rule, so that an upstream packet costs no second one.
        let icmp = match fam {
            Family::V4 => "icmp",
            Family::V6 => "ipv6-icmp",
        };
        // A leg to a local pod, or to a pod of a node whose agent enforces, is untracked: it
        // needs no NAT (it goes to the pod itself, after any DNAT of the client's leg, and
        // no pod-to-pod traffic is NATed) and no state (nothing of the ruleset reads it),
        // and its entry was half the conntrack work of a connection on one node (issue #18).
        // The zone rule after them leaves a packet that has its conntrack information (here:
        // untracked) alone (xt CT: "previously seen"). Legs to anywhere else keep the zone:
        // external addresses may need the node's SNAT (masquerading), which needs conntrack.
        let _ = writeln!(
            o,
            "-A {zout} ! -p {icmp} -m mark --mark {bypass} -m set --match-set {pods} dst \
             -m comment --comment \"tierproxy: proxy upstream sockets to a local pod, untracked\" \
             -j NOTRACK"
        );
        let _ = writeln!(
            o,
            "-A {zout} ! -p {icmp} -m mark --mark {bypass} -m set --match-set {enforced} dst \
             -m comment --comment \"tierproxy: proxy upstream sockets to a pod of an enforcing node, untracked\" \
             -j NOTRACK"
        );
        let _ = writeln!(
            o,
            "-A {zout} ! -p {icmp} -m mark --mark {bypass} \
             -m comment --comment \"tierproxy: proxy upstream sockets, own zone\" {ct}"
        );
    }
    o.push_str("COMMIT\n");
}

/// What of tierproxy's `iptables-save -t mangle` shows: the jumps from the built-in chains
/// into its chains (as `-D` arguments, one per copy) and which of its chains exist.
#[derive(Debug, Default, PartialEq, Eq)]
struct Installed {
    jumps: Vec<String>,
    chains: Vec<String>,
}

fn parse_save(save: &str, names: &Names, table: &str) -> Installed {
    let ours = own_chains(names, table);
    let jumps: Vec<String> = hooks(names)
        .iter()
        .filter(|(t, _, _)| *t == table)
        .map(|(_, hook, target)| format!("{hook} -j {target}"))
        .collect();
    let mut found = Installed::default();
    for line in save.lines() {
        if let Some(rule) = line.strip_prefix("-A ").filter(|r| jumps.iter().any(|j| j == r)) {
            found.jumps.push(rule.to_owned());
        } else if let Some(decl) = line.strip_prefix(':') {
            let name = decl.split(' ').next().unwrap_or_default();
            if ours.iter().any(|o| o.as_str() == name) {
                found.chains.push(name.to_owned());
            }
        }
    }
    found
}

/// The `iptables-restore --noflush` input that deletes the jumps and tierproxy's chains
/// found in `installed` in `table`, or `None` when nothing is installed.
fn removal_input(installed: &Installed, table: &str) -> Option<String> {
    if installed.jumps.is_empty() && installed.chains.is_empty() {
        return None;
    }
    let mut o = format!("*{table}\n");
    for jump in &installed.jumps {
        let _ = writeln!(o, "-D {jump}");
    }
    // Declaring a chain flushes it, so no reference is left when the chains are deleted.
    for ch in &installed.chains {
        let _ = writeln!(o, ":{ch} - [0:0]");
    }
    for ch in &installed.chains {
        let _ = writeln!(o, "-X {ch}");
    }
    o.push_str("COMMIT\n");
    Some(o)
}

/// Adds the packet counters of the counted drop rules in `save` (`iptables-save -c`
/// output: `[packets:bytes] -A CHAIN ... --comment "..."`) to `counts`.
fn add_counts(save: &str, counts: &mut DropCounts) {
    for line in save.lines() {
        let Some(rest) = line.strip_prefix('[') else { continue };
        let Some((packets, _)) = rest.split_once(':') else { continue };
        let Ok(packets) = packets.parse::<u64>() else { continue };
        let field = if line.contains(COMMENT_NODE_SOURCE) {
            &mut counts.node_source
        } else if line.contains(COMMENT_POD_SOURCE) {
            &mut counts.pod_source
        } else if line.contains(COMMENT_STRAY_TCP) || line.contains(COMMENT_LOCAL_PODS_NO_SOCKET) {
            &mut counts.stray_tcp
        } else {
            continue;
        };
        *field += packets;
    }
}

fn update_input(names: &Names, add: &[IpAddr], remove: &[IpAddr]) -> String {
    let set_of = |a: &IpAddr| if a.is_ipv4() { &names.pods_v4 } else { &names.pods_v6 };
    let canon = |list: &[IpAddr]| list.iter().map(|a| a.to_canonical()).collect::<BTreeSet<_>>();
    let mut o = String::new();
    for a in canon(remove) {
        let _ = writeln!(o, "del {} {a}", set_of(&a));
    }
    for a in canon(add) {
        let _ = writeln!(o, "add {} {a}", set_of(&a));
    }
    o
}

impl Backend for IptablesBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Iptables
    }

    fn refuses(&self) -> bool {
        self.nft.is_some()
    }

    fn render(&self, spec: &RulesetSpec) -> String {
        let names = spec.names();
        let mut o = String::new();
        let _ = writeln!(o, "### {}", self.ipset_restore_cmd().line());
        o.push_str(&ipset_input(spec));
        let native_raw = self.nft.is_some();
        if let Some(nft) = &self.nft {
            let _ = writeln!(o, "### {nft} -j -f -");
            o.push_str(&super::nft::json(&super::nft::after_dnat_batch(spec)));
            o.push('\n');
        }
        for fam in [Family::V4, Family::V6] {
            let _ = writeln!(o, "### {}", self.restore_cmd(fam).line());
            o.push_str(&restore_input(spec, fam, native_raw));
            if native_raw {
                let _ = writeln!(
                    o,
                    "### {}   (deleting tierproxy's raw jumps and chains, only when `{}` lists some)",
                    self.restore_cmd(fam).line(),
                    self.save_cmd(fam, "raw").line()
                );
            }
        }
        for line in routing::render(spec.config(), &self.cmds.ip) {
            let _ = writeln!(o, "### {line}");
        }
        for fam in [Family::V4, Family::V6] {
            for jump in hooks_in_use(&names, native_raw) {
                let _ = writeln!(
                    o,
                    "### {}   (only when `{}` fails)",
                    self.jump_cmd(fam, "-I", jump).line(),
                    self.jump_cmd(fam, "-C", jump).line()
                );
            }
        }
        o
    }

    fn apply(&self, spec: &RulesetSpec) -> Result<(), RedirectError> {
        let names = spec.names();
        // Sets first: the rules refer to them by name.
        self.ipset_restore_cmd().run(Some(&ipset_input(spec)))?;
        // The nft table before the xt raw rules it replaces are removed (below), so that
        // no packet passes between the two without its source checked.
        let native_raw = self.nft.is_some();
        if let Some(nft) = &self.nft {
            let batch = super::nft::json(&super::nft::after_dnat_batch(spec));
            Cmd::new(nft, ["-j", "-f", "-"]).run(Some(&batch))?;
        }
        for fam in [Family::V4, Family::V6] {
            self.restore_cmd(fam).run(Some(&restore_input(spec, fam, native_raw)))?;
            if native_raw {
                // A previous agent's xt raw rules (one without nft, or an older version).
                self.remove_table(fam, "raw", &names)?;
            }
        }
        // Routing before the jump: once the jump exists, TPROXY'd packets need the route.
        routing::install(spec.config(), &self.cmds.ip)?;
        for fam in [Family::V4, Family::V6] {
            for jump in hooks_in_use(&names, native_raw) {
                if !self.has_jump(fam, jump)? {
                    self.jump_cmd(fam, "-I", jump).run(None)?;
                }
            }
        }
        Ok(())
    }

    fn update_pods(
        &self,
        config: &RedirectConfig,
        add: &[IpAddr],
        remove: &[IpAddr],
    ) -> Result<(), RedirectError> {
        config.validate()?;
        if add.is_empty() && remove.is_empty() {
            return Ok(());
        }
        let input = update_input(&Names::new(config), add, remove);
        self.ipset_restore_cmd().run(Some(&input))?;
        self.update_nft(config, |table| super::nft::update_batch(table, add, remove))
    }

    fn set_pod_interfaces(
        &self,
        config: &RedirectConfig,
        interfaces: &BTreeSet<String>,
    ) -> Result<(), RedirectError> {
        config.validate()?;
        let valid = super::valid_ifnames(interfaces.iter().cloned());
        let mut input = String::new();
        podif_input(&mut input, &Names::new(config), &valid);
        self.ipset_restore_cmd().run(Some(&input))?;
        self.update_nft(config, |table| super::nft::podif_batch(table, &valid))
    }

    fn set_enforced_pods(
        &self,
        config: &RedirectConfig,
        addrs: &BTreeSet<IpAddr>,
    ) -> Result<(), RedirectError> {
        config.validate()?;
        let mut input = String::new();
        enforced_input(&mut input, &Names::new(config), addrs);
        self.ipset_restore_cmd().run(Some(&input))?;
        self.update_nft(config, |table| super::nft::enforced_batch(table, addrs))
    }

    fn flush_allowed(&self, config: &RedirectConfig) -> Result<(), RedirectError> {
        config.validate()?;
        let mut input = String::new();
        allowed_input(&mut input, &Names::new(config), true);
        self.ipset_restore_cmd().run(Some(&input))?;
        Ok(())
    }

    fn pod_interfaces(&self, addrs: &[IpAddr]) -> Result<BTreeSet<String>, RedirectError> {
        routing::pod_interfaces(&self.cmds.ip, addrs)
    }

    fn drop_counts(&self, config: &RedirectConfig) -> Result<DropCounts, RedirectError> {
        config.validate()?;
        let mut counts = DropCounts::default();
        for fam in [Family::V4, Family::V6] {
            for table in TABLES {
                let program = match fam {
                    Family::V4 => &self.cmds.iptables_save,
                    Family::V6 => &self.cmds.ip6tables_save,
                };
                let save = Cmd::new(program, ["-c", "-t", table]).run(None)?;
                add_counts(&save, &mut counts);
            }
        }
        if let Some(nft) = &self.nft {
            // The source check's drops, counted by its nft rules.
            let native = super::nft::table_drop_counts(nft, &Names::new(config).dnat_table)?;
            counts.node_source += native.node_source;
            counts.pod_source += native.pod_source;
            counts.stray_tcp += native.stray_tcp;
        }
        Ok(counts)
    }

    fn remove(&self, config: &RedirectConfig) -> Result<(), RedirectError> {
        config.validate()?;
        let names = Names::new(config);
        // Jumps and chains first: a set referenced by a rule cannot be destroyed.
        for fam in [Family::V4, Family::V6] {
            for table in TABLES {
                self.remove_table(fam, table, &names)?;
            }
        }
        let list_cmd = Cmd::new(&self.cmds.ipset, ["list", "-n"]);
        let existing = list_cmd.run(None)?;
        let ours: Vec<String> = [
            &names.pods_v4,
            &names.pods_v6,
            &names.nodes_v4,
            &names.nodes_v6,
            &names.podif_v4,
            &names.podif_v6,
            &names.enforced_v4,
            &names.enforced_v6,
            &names.allowed_v4,
            &names.allowed_v6,
        ]
        .into_iter()
        .flat_map(|s| [s.clone(), format!("{s}-tmp")])
        .collect();
        let mut input = String::new();
        for set in existing.lines().map(str::trim).filter(|s| ours.iter().any(|o| o == s)) {
            let _ = writeln!(input, "destroy {set}");
        }
        if !input.is_empty() {
            self.ipset_restore_cmd().run(Some(&input))?;
        }
        // The table after the DNAT: an error counts when this backend adds it; else the
        // removal is a courtesy (an agent configured otherwise may have added it), and a
        // node without `nft` or nf_tables has none.
        let batch = super::nft::json(&super::nft::remove_table_batch(&names.dnat_table));
        let removed =
            Cmd::new(self.nft.as_deref().unwrap_or("nft"), ["-j", "-f", "-"]).run(Some(&batch));
        if self.nft.is_some() {
            removed?;
        }
        routing::uninstall(config, &self.cmds.ip)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_save_finds_jumps_and_own_chains_only() {
        let names = Names::new(&RedirectConfig::default());
        let save = "*mangle\n:PREROUTING ACCEPT [0:0]\n:TIERPROXY - [0:0]\n\
                    :TIERPROXY-QUEUE - [0:0]\n:TIERPROXY-DECIDE - [0:0]\n:TIERPROXYX - [0:0]\n\
                    -A PREROUTING -j TIERPROXY\n-A PREROUTING -j TIERPROXY\n\
                    -A PREROUTING -j TIERPROXYX\n-A INPUT -j TIERPROXY-DECIDE\n\
                    -A INPUT -j TIERPROXY\n-A FORWARD -j TIERPROXY-DECIDE\nCOMMIT\n";
        let found = parse_save(save, &names, "mangle");
        assert_eq!(
            found.jumps,
            [
                "PREROUTING -j TIERPROXY",
                "PREROUTING -j TIERPROXY",
                "INPUT -j TIERPROXY-DECIDE",
                "FORWARD -j TIERPROXY-DECIDE"
            ]
        );
        assert_eq!(found.chains, ["TIERPROXY", "TIERPROXY-QUEUE", "TIERPROXY-DECIDE"]);
        assert_eq!(
            removal_input(&found, "mangle").unwrap(),
            "*mangle\n-D PREROUTING -j TIERPROXY\n-D PREROUTING -j TIERPROXY\n\
             -D INPUT -j TIERPROXY-DECIDE\n-D FORWARD -j TIERPROXY-DECIDE\n\
             :TIERPROXY - [0:0]\n:TIERPROXY-QUEUE - [0:0]\n:TIERPROXY-DECIDE - [0:0]\n\
             -X TIERPROXY\n-X TIERPROXY-QUEUE\n-X TIERPROXY-DECIDE\nCOMMIT\n"
        );
        assert_eq!(removal_input(&Installed::default(), "mangle"), None);
        let raw = "*raw\n:PREROUTING ACCEPT [0:0]\n:TIERPROXY-ZONE-IN - [0:0]\n\
                   -A PREROUTING -j TIERPROXY-ZONE-IN\n-A OUTPUT -j TIERPROXY-ZONE-OUT\n\
                   -A PREROUTING -j TIERPROXY\nCOMMIT\n";
        let found = parse_save(raw, &names, "raw");
        assert_eq!(
            found.jumps,
            ["PREROUTING -j TIERPROXY-ZONE-IN", "OUTPUT -j TIERPROXY-ZONE-OUT"]
        );
        assert_eq!(found.chains, ["TIERPROXY-ZONE-IN"]);
        assert!(removal_input(&found, "raw").unwrap().starts_with("*raw\n"));
    }

    #[test]
    fn drop_counters_are_summed_by_rule() {
        let save = format!(
            "*raw\n:TIERPROXY-SOURCE - [0:0]\n\
             [3:180] -A TIERPROXY-SOURCE -m comment --comment \"{COMMENT_NODE_SOURCE}\" -j DROP\n\
             [7:420] -A TIERPROXY-SOURCE -m comment --comment \"{COMMENT_POD_SOURCE}\" -j DROP\n\
             [9:1] -A OTHER -j DROP\nCOMMIT\n*mangle\n\
             [2:80] -A TIERPROXY-INTERCEPT -p tcp -m comment --comment \"{COMMENT_STRAY_TCP}\" -j DROP\n"
        );
        let mut counts = DropCounts::default();
        add_counts(&save, &mut counts);
        add_counts(&save, &mut counts);
        assert_eq!(counts, DropCounts { node_source: 6, pod_source: 14, stray_tcp: 4 });
    }

    #[test]
    fn pod_interfaces_are_any_address_on_the_interface() {
        let spec = RulesetSpec::new(RedirectConfig::default(), [], [])
            .unwrap()
            .with_pod_interfaces(["pod1".to_string(), "bad name".to_string(), "cni0".to_string()]);
        let input = ipset_input(&spec);
        assert!(
            input.contains(
                "create tierproxy-podif-v4-tmp hash:net,iface family inet\n\
                 flush tierproxy-podif-v4-tmp\n\
                 add tierproxy-podif-v4-tmp 0.0.0.0/0,cni0\n\
                 add tierproxy-podif-v4-tmp 0.0.0.0/0,pod1\n\
                 swap tierproxy-podif-v4-tmp tierproxy-podif-v4\n"
            ),
            "{input}"
        );
        assert!(input.contains("add tierproxy-podif-v6-tmp ::/0,pod1\n"), "{input}");
        assert!(!input.contains("bad name"), "{input}");
        // No source check: no rpfilter rule, but the node-address drop stays.
        let no_check =
            RulesetSpec::new(RedirectConfig { source_check: false, ..Default::default() }, [], [])
                .unwrap();
        let text = restore_input(&no_check, Family::V6, false);
        assert!(!text.contains("rpfilter"), "{text}");
        assert!(text.contains(COMMENT_NODE_SOURCE), "{text}");
    }

    #[test]
    fn update_input_deletes_then_adds_by_family() {
        let names = Names::new(&RedirectConfig::default());
        let add: Vec<IpAddr> = vec!["fd00::1".parse().unwrap(), "10.0.0.1".parse().unwrap()];
        let remove: Vec<IpAddr> = vec!["::ffff:10.0.0.2".parse().unwrap()];
        assert_eq!(
            update_input(&names, &add, &remove),
            "del tierproxy-pods-v4 10.0.0.2\nadd tierproxy-pods-v4 10.0.0.1\n\
             add tierproxy-pods-v6 fd00::1\n"
        );
    }

    #[test]
    fn zone_zero_leaves_the_raw_chains_empty() {
        let rules = |zone| {
            let spec = RulesetSpec::new(
                RedirectConfig { upstream_zone: zone, ..Default::default() },
                [],
                [],
            )
            .unwrap();
            let text = restore_input(&spec, Family::V4, false);
            let raw = text.split_once("*raw\n").expect("a raw section").1.to_owned();
            raw.lines().filter(|l| l.starts_with("-A TIERPROXY-ZONE")).count()
        };
        assert_eq!(rules(0), 0);
        // Bypass mark, from a local pod (untracked), to a local pod (to the leg chain), mark
        // cleared; the leg chain: from an enforcing node's pod (untracked), else (zone);
        // OUTPUT: to a local pod, to an enforcing node's pod (untracked), elsewhere (zone).
        assert_eq!(rules(7), 9);
    }

    #[test]
    fn single_queue_uses_queue_num() {
        let config = RedirectConfig { queue_count: 1, queue_first: 7, ..Default::default() };
        let spec = RulesetSpec::new(config, [], []).unwrap();
        let text = restore_input(&spec, Family::V4, false);
        assert!(
            text.contains(
                "-A TIERPROXY-QUEUE -p tcp -m tcp --tcp-flags FIN,SYN,RST,ACK SYN -j NFQUEUE --queue-num 7\n"
            ),
            "{text}"
        );
        // UDP's first datagrams are balanced like SYNs (one queue here); the kernel-forwarded
        // flows' queue follows the balanced ones, SCTP goes there.
        assert!(
            text.contains(
                "-A TIERPROXY-QUEUE -p udp -m set ! --match-set tierproxy-allowed-v4 src,dst,dst \
                 -j NFQUEUE --queue-num 7\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "-A TIERPROXY-QUEUE -p sctp -m conntrack --ctstate NEW -j NFQUEUE --queue-num 8\n"
            ),
            "{text}"
        );
        assert!(!text.contains("--queue-bypass"), "{text}");
    }
}
