//! The iptables backend: ipset sets, tierproxy's own chains in the mangle table of both
//! families, one jump from `mangle PREROUTING`, and policy routing.
//!
//! * Sets (`hash:ip`, family `inet`/`inet6`; ipset(8)) are filled under a temporary name and
//!   exchanged with `swap`, which is atomic: a packet never sees a half-filled set. All set
//!   commands go through one `ipset restore -exist`.
//! * Chains are replaced by `iptables-restore --noflush`: declaring `:CHAIN - [0:0]` flushes
//!   tierproxy's chain and the rules that follow refill it, in one transaction, while every
//!   other chain keeps its rules (iptables-restore(8)).
//! * The jump `-I PREROUTING 1 -j TIERPROXY` is inserted at the top only when
//!   `iptables -C` finds it missing, so re-applying never duplicates it.
//!
//! Rules are written in `iptables-save`'s canonical order (`-p` first, matches in order,
//! comments quoted), so the rendered lines equal what `iptables-save` prints back; the netns
//! tests compare them.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::IpAddr;

use super::exec::Cmd;
use super::{
    Backend, BackendKind, Names, QUEUED_PROTOCOLS, QueueWhen, RedirectError, RulesetSpec,
    TPROXY_PROTOCOLS, by_family, routing,
};
use crate::config::RedirectConfig;

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
        IptablesBackend { cmds }
    }

    /// The tools this backend runs.
    pub fn commands(&self) -> &IptablesCommands {
        &self.cmds
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

    fn save_cmd(&self, fam: Family) -> Cmd {
        let program = match fam {
            Family::V4 => &self.cmds.iptables_save,
            Family::V6 => &self.cmds.ip6tables_save,
        };
        Cmd::new(program, ["-t", "mangle"])
    }

    fn ipset_restore_cmd(&self) -> Cmd {
        Cmd::new(&self.cmds.ipset, ["restore", "-exist"])
    }

    fn jump_cmd(&self, fam: Family, op: &str, names: &Names) -> Cmd {
        let mut args = vec!["-w", "-t", "mangle", op, "PREROUTING"];
        if op == "-I" {
            args.push("1");
        }
        args.extend(["-j", names.chain.as_str()]);
        Cmd::new(self.iptables(fam), args)
    }

    /// Whether the jump from `mangle PREROUTING` exists (`iptables -C`, exit status 1 =
    /// missing).
    fn has_jump(&self, fam: Family, names: &Names) -> Result<bool, RedirectError> {
        let cmd = self.jump_cmd(fam, "-C", names);
        let out = cmd.output(None)?;
        match out.status.code() {
            Some(0) => Ok(true),
            Some(1) => Ok(false),
            _ => Err(cmd.failed(&out)),
        }
    }
}

/// The `ipset restore` input that makes the four sets hold exactly the spec's addresses:
/// each set is created if missing, a temporary set is filled and swapped in, and the
/// temporary set (now holding the old members) destroyed.
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
        let tmp = format!("{set}-tmp");
        let family = fam.ipset_family();
        let _ = writeln!(out, "create {set} hash:ip family {family}");
        let _ = writeln!(out, "create {tmp} hash:ip family {family}");
        // A temporary set left by a crash may hold stale members.
        let _ = writeln!(out, "flush {tmp}");
        for addr in members {
            let _ = writeln!(out, "add {tmp} {addr}");
        }
        let _ = writeln!(out, "swap {tmp} {set}");
        let _ = writeln!(out, "destroy {tmp}");
    }
    out
}

/// The `iptables-restore --noflush` input declaring and filling tierproxy's chains for one
/// family, in `iptables-save`'s canonical form.
fn restore_input(spec: &RulesetSpec, fam: Family) -> String {
    let c = spec.config();
    let n = spec.names();
    let (pods, nodes, on_ip) = match fam {
        Family::V4 => (&n.pods_v4, &n.nodes_v4, c.tproxy_addr_v4.to_string()),
        Family::V6 => (&n.pods_v6, &n.nodes_v6, c.tproxy_addr_v6.to_string()),
    };
    let (chain, divert, queue) = (&n.chain, &n.divert_chain, &n.queue_chain);
    let (bypass, decided, route) = (c.bypass_mark, c.decided_mark, c.route_mark);
    let mut o = String::from("*mangle\n");
    for ch in [chain, divert, queue] {
        let _ = writeln!(o, ":{ch} - [0:0]");
    }
    // Rule 1: the proxy's own upstream packets are never touched.
    let _ = writeln!(
        o,
        "-A {chain} -m comment --comment \"tierproxy: proxy upstream sockets (bypass mark)\" \
         -m mark --mark {bypass} -j RETURN"
    );
    // Rule 2: established transparent sockets (proxied flows, upstream replies) → local.
    let _ = writeln!(
        o,
        "-A {chain} -m comment --comment \"tierproxy: established transparent socket\" \
         -m socket --transparent -j {divert}"
    );
    // Rule 3: traffic from the node itself is always allowed.
    let _ = writeln!(
        o,
        "-A {chain} -m comment --comment \"tierproxy: from the node itself\" \
         -m set --match-set {nodes} src -j RETURN"
    );
    // Rule 4: UDP to the node's own addresses is forwarded by the kernel after its first
    // packet's decision (the proxy cannot take a hostNetwork server's address and port).
    let _ = writeln!(
        o,
        "-A {chain} -p udp -m comment --comment \"tierproxy: UDP to the node itself, decided\" \
         -m set --match-set {nodes} dst -m conntrack ! --ctstate NEW -j RETURN"
    );
    // Rule 5: packets of pod flows not owned by a proxy socket, egress then ingress → the
    // queue chain, which queues by protocol ([`QueueWhen`]).
    for (dir, words) in [("src", "from"), ("dst", "to")] {
        let _ = writeln!(
            o,
            "-A {chain} -m comment --comment \"tierproxy: flow {words} a local pod\" \
             -m mark ! --mark {decided} -m set --match-set {pods} {dir} -j {queue}"
        );
    }
    // Rule 6: decided packets of terminated protocols → the proxy's listener (UDP: not to
    // the node's own addresses, see rule 4).
    for proto in TPROXY_PROTOCOLS {
        let not_node = if *proto == "udp" {
            format!(" -m set ! --match-set {nodes} dst")
        } else {
            String::new()
        };
        let _ = writeln!(
            o,
            "-A {chain} -p {proto} -m comment --comment \"tierproxy: decided, to the proxy\" \
             -m mark --mark {decided}{not_node} -j TPROXY --on-port {port} --on-ip {on_ip} \
             --tproxy-mark {route}",
            port = c.tproxy_port
        );
    }
    let _ = writeln!(o, "-A {divert} -j MARK --set-xmark {route}");
    let _ = writeln!(o, "-A {divert} -j ACCEPT");
    let queue_target = match c.queue_last() {
        Some(last) if last != c.queue_first => {
            format!("--queue-balance {}:{last}", c.queue_first)
        }
        _ => format!("--queue-num {}", c.queue_first),
    };
    let bypass_flag = if c.queue_bypass { " --queue-bypass" } else { "" };
    for proto in QUEUED_PROTOCOLS {
        let new_only = match super::queue_when(proto) {
            QueueWhen::Syn => " -m tcp --tcp-flags FIN,SYN,RST,ACK SYN",
            QueueWhen::Always => "",
            QueueWhen::New => " -m conntrack --ctstate NEW",
        };
        let _ =
            writeln!(o, "-A {queue} -p {proto}{new_only} -j NFQUEUE {queue_target}{bypass_flag}");
    }
    o.push_str("COMMIT\n");
    o
}

/// What of tierproxy's `iptables-save -t mangle` shows: jumps from PREROUTING and which of
/// its chains exist.
#[derive(Debug, Default, PartialEq, Eq)]
struct Installed {
    jumps: usize,
    chains: Vec<String>,
}

fn parse_save(save: &str, names: &Names) -> Installed {
    let ours = [&names.chain, &names.divert_chain, &names.queue_chain];
    let jump = format!("-A PREROUTING -j {}", names.chain);
    let mut found = Installed::default();
    for line in save.lines() {
        if line == jump {
            found.jumps += 1;
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
/// found in `installed`, or `None` when nothing is installed.
fn removal_input(installed: &Installed, names: &Names) -> Option<String> {
    if installed.jumps == 0 && installed.chains.is_empty() {
        return None;
    }
    let mut o = String::from("*mangle\n");
    for _ in 0..installed.jumps {
        let _ = writeln!(o, "-D PREROUTING -j {}", names.chain);
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

    fn render(&self, spec: &RulesetSpec) -> String {
        let names = spec.names();
        let mut o = String::new();
        let _ = writeln!(o, "### {}", self.ipset_restore_cmd().line());
        o.push_str(&ipset_input(spec));
        for fam in [Family::V4, Family::V6] {
            let _ = writeln!(o, "### {}", self.restore_cmd(fam).line());
            o.push_str(&restore_input(spec, fam));
        }
        for line in routing::render(spec.config(), &self.cmds.ip) {
            let _ = writeln!(o, "### {line}");
        }
        for fam in [Family::V4, Family::V6] {
            let _ = writeln!(
                o,
                "### {}   (only when `{}` fails)",
                self.jump_cmd(fam, "-I", &names).line(),
                self.jump_cmd(fam, "-C", &names).line()
            );
        }
        o
    }

    fn apply(&self, spec: &RulesetSpec) -> Result<(), RedirectError> {
        let names = spec.names();
        // Sets first: the rules refer to them by name.
        self.ipset_restore_cmd().run(Some(&ipset_input(spec)))?;
        for fam in [Family::V4, Family::V6] {
            self.restore_cmd(fam).run(Some(&restore_input(spec, fam)))?;
        }
        // Routing before the jump: once the jump exists, TPROXY'd packets need the route.
        routing::install(spec.config(), &self.cmds.ip)?;
        for fam in [Family::V4, Family::V6] {
            if !self.has_jump(fam, &names)? {
                self.jump_cmd(fam, "-I", &names).run(None)?;
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
        Ok(())
    }

    fn remove(&self, config: &RedirectConfig) -> Result<(), RedirectError> {
        config.validate()?;
        let names = Names::new(config);
        // Jumps and chains first: a set referenced by a rule cannot be destroyed.
        for fam in [Family::V4, Family::V6] {
            let save = self.save_cmd(fam).run(None)?;
            if let Some(input) = removal_input(&parse_save(&save, &names), &names) {
                self.restore_cmd(fam).run(Some(&input))?;
            }
        }
        let list_cmd = Cmd::new(&self.cmds.ipset, ["list", "-n"]);
        let existing = list_cmd.run(None)?;
        let ours: Vec<String> = [&names.pods_v4, &names.pods_v6, &names.nodes_v4, &names.nodes_v6]
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
                    :TIERPROXY-QUEUE - [0:0]\n:TIERPROXYX - [0:0]\n\
                    -A PREROUTING -j TIERPROXY\n-A PREROUTING -j TIERPROXY\n\
                    -A PREROUTING -j TIERPROXYX\nCOMMIT\n";
        let found = parse_save(save, &names);
        assert_eq!(found.jumps, 2);
        assert_eq!(found.chains, ["TIERPROXY", "TIERPROXY-QUEUE"]);
        assert_eq!(
            removal_input(&found, &names).unwrap(),
            "*mangle\n-D PREROUTING -j TIERPROXY\n-D PREROUTING -j TIERPROXY\n\
             :TIERPROXY - [0:0]\n:TIERPROXY-QUEUE - [0:0]\n-X TIERPROXY\n-X TIERPROXY-QUEUE\n\
             COMMIT\n"
        );
        assert_eq!(removal_input(&Installed::default(), &names), None);
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
    fn single_queue_uses_queue_num() {
        let config = RedirectConfig { queue_count: 1, queue_first: 7, ..Default::default() };
        let spec = RulesetSpec::new(config, [], []).unwrap();
        let text = restore_input(&spec, Family::V4);
        assert!(text.contains("-A TIERPROXY-QUEUE -p udp -j NFQUEUE --queue-num 7\n"), "{text}");
        assert!(!text.contains("--queue-bypass"), "{text}");
    }
}
