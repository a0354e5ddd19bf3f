//! Redirection in real network namespaces (issue #3 "Redirection" and "Tests").
//!
//! Each test creates its own namespaces, named `tpr-<pid>-<n>` and removed by a guard on drop
//! (also when the test panics), and runs the backend inside them from a thread that entered
//! the namespace with `setns(CLONE_NEWNET)`; the programs the backend spawns inherit it. Traffic
//! is only ever sent between namespaces the test created.
//!
//! Without CAP_NET_ADMIN and CAP_SYS_ADMIN (creating a named namespace mounts it) or without
//! the tools, a test prints `SKIPPED: <test>: <why>` to stderr and returns, unless
//! `TIERPROXY_REQUIRE_NETNS=1`, in which case it fails.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use nix::sched::{CloneFlags, setns};
use nix::sys::socket::{setsockopt, sockopt};
use tierproxy::config::RedirectConfig;
use tierproxy::redirect::{
    Backend, BackendKind, IptablesBackend, IptablesCommands, NftablesBackend, RulesetSpec, probe,
};

const CAP_NET_ADMIN: u32 = 12;
const CAP_SYS_ADMIN: u32 = 21;

fn effective_caps() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .unwrap_or(0)
}

fn on_path(tool: &str) -> bool {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).any(|dir| dir.join(tool).is_file())
}

/// Prints `SKIPPED: <what>` straight to the process's stderr: libtest captures `eprintln!`
/// of passing tests, and a skip must be seen.
fn skipped(what: &str) {
    let _ = writeln!(std::io::stderr(), "SKIPPED: {what}");
}

/// Whether `test` can run here; prints why not (or fails under `TIERPROXY_REQUIRE_NETNS=1`).
fn netns_available(test: &str, tools: &[&str]) -> bool {
    let caps = effective_caps();
    let has = |cap: u32| caps & (1 << cap) != 0;
    let reason = if !has(CAP_NET_ADMIN) || !has(CAP_SYS_ADMIN) {
        Some(format!(
            "needs CAP_NET_ADMIN (and CAP_SYS_ADMIN to create network namespaces; run as root), \
             effective capabilities are {caps:#x}"
        ))
    } else {
        let missing: Vec<&str> = tools.iter().copied().filter(|t| !on_path(t)).collect();
        (!missing.is_empty()).then(|| format!("needs {} on PATH", missing.join(", ")))
    };
    match reason {
        None => true,
        Some(why) if std::env::var_os("TIERPROXY_REQUIRE_NETNS").is_some_and(|v| v == "1") => {
            panic!("{test}: {why}, and TIERPROXY_REQUIRE_NETNS=1 requires this test to run")
        }
        Some(why) => {
            skipped(&format!("{test}: {why}"));
            false
        }
    }
}

const BASE_TOOLS: &[&str] =
    &["ip", "iptables", "ip6tables", "iptables-restore", "ip6tables-restore", "ipset"];

/// A named network namespace, deleted on drop.
struct Netns {
    name: String,
}

impl Netns {
    fn new() -> Netns {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let name = format!("tpr-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        check(Command::new("ip").args(["netns", "add", &name]));
        let ns = Netns { name };
        ns.sh(&["ip", "link", "set", "lo", "up"]);
        ns
    }

    fn output(&self, args: &[&str]) -> Output {
        Command::new("ip")
            .args(["netns", "exec", &self.name])
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("ip netns exec {} {args:?}: {e}", self.name))
    }

    /// Runs a command inside the namespace; panics with its stderr when it fails.
    fn sh(&self, args: &[&str]) -> String {
        let out = self.output(args);
        assert!(
            out.status.success(),
            "`{}` in {} failed: {}",
            args.join(" "),
            self.name,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Runs `f` on a thread that has entered this namespace.
    fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let path = format!("/run/netns/{}", self.name);
        std::thread::scope(|s| {
            s.spawn(|| {
                let file = File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
                setns(&file, CloneFlags::CLONE_NEWNET).unwrap_or_else(|e| panic!("setns: {e}"));
                f()
            })
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
        })
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).status();
    }
}

fn check(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
}

fn addrs(list: &[&str]) -> Vec<IpAddr> {
    list.iter().map(|a| a.parse().expect("test address")).collect()
}

fn spec(config: RedirectConfig, pods: &[&str], nodes: &[&str]) -> RulesetSpec {
    RulesetSpec::new(config, addrs(pods), addrs(nodes)).expect("valid spec")
}

/// Members of an ipset, sorted as strings.
fn members(ns: &Netns, set: &str) -> Vec<String> {
    let save = ns.sh(&["ipset", "save", set]);
    let mut m: Vec<String> = save
        .lines()
        .filter_map(|l| l.strip_prefix(&format!("add {set} ")))
        .map(str::to_owned)
        .collect();
    m.sort();
    m
}

/// Everything of the namespace's netfilter and routing state the tests compare, without
/// counters and timestamps.
fn state(ns: &Netns, cmds: &IptablesCommands) -> String {
    let mut s = String::new();
    for (save, table) in [&cmds.iptables_save, &cmds.ip6tables_save]
        .into_iter()
        .flat_map(|s| [(s, "mangle"), (s, "raw")])
    {
        for line in ns.sh(&[save, "-t", table]).lines() {
            if line.starts_with('#') {
                continue;
            }
            // Built-in chains carry policy counters: `:PREROUTING ACCEPT [12:720]`.
            s.push_str(line.split(" [").next().unwrap_or(line));
            s.push('\n');
        }
    }
    for line in ns.sh(&["ipset", "list", "-n"]).lines() {
        s.push_str(&format!("set {line}: {:?}\n", members(ns, line)));
    }
    for fam in ["-4", "-6"] {
        s.push_str(&ns.sh(&["ip", fam, "rule", "show"]));
        s.push_str(&ns.sh(&["ip", fam, "route", "show", "table", "all"]));
    }
    s
}

/// The `-A` lines of the section of a rendering whose header starts with `### <program> `.
fn rendered_rules<'a>(rendered: &'a str, program: &str) -> Vec<&'a str> {
    let header = format!("### {program} ");
    rendered
        .split_inclusive('\n')
        .skip_while(|l| !l.starts_with(&header))
        .skip(1)
        .take_while(|l| !l.starts_with("### "))
        .map(str::trim_end)
        .filter(|l| l.starts_with("-A "))
        .collect()
}

/// Checks, for each family, that the kernel holds exactly the `-A TIERPROXY` rules of
/// `rendered` (`count` of them, mangle and raw tables together); returns per family the
/// save program and its raw and mangle tables as it lists them.
fn installed_rules(
    ns: &Netns,
    cmds: &IptablesCommands,
    rendered: &str,
    count: usize,
) -> Vec<(String, String, String)> {
    let mut tables = Vec::new();
    for (restore, save) in [
        (&cmds.iptables_restore, &cmds.iptables_save),
        (&cmds.ip6tables_restore, &cmds.ip6tables_save),
    ] {
        let expected = rendered_rules(rendered, restore);
        assert_eq!(expected.len(), count, "{restore} section of:\n{rendered}");
        let raw = ns.sh(&[save, "-t", "raw"]);
        let saved = ns.sh(&[save, "-t", "mangle"]);
        let ours: Vec<&str> =
            saved.lines().chain(raw.lines()).filter(|l| l.starts_with("-A TIERPROXY")).collect();
        assert_eq!(ours, expected, "{save}");
        tables.push((save.clone(), raw, saved));
    }
    tables
}

/// The lines of a [`state`] that are not ipset members.
fn without_sets(s: &str) -> Vec<&str> {
    s.lines().filter(|l| !l.starts_with("set ")).collect()
}

fn iptables_lifecycle(test: &str, cmds: IptablesCommands) {
    let mut tools = BASE_TOOLS.to_vec();
    tools.extend([cmds.iptables.as_str(), cmds.iptables_restore.as_str(), "nft"]);
    if !netns_available(test, &tools) {
        return;
    }
    let ns = Netns::new();
    // Someone else's rules, chain, set and routing rule: tierproxy must leave them alone.
    for ipt in [&cmds.iptables, &cmds.ip6tables] {
        ns.sh(&[ipt, "-w", "-t", "mangle", "-A", "PREROUTING", "-p", "tcp", "-j", "RETURN"]);
        ns.sh(&[ipt, "-w", "-t", "mangle", "-N", "FOREIGN"]);
    }
    ns.sh(&["ipset", "create", "foreign", "hash:ip"]);
    ns.sh(&["ip", "rule", "add", "fwmark", "0x1", "lookup", "100", "priority", "100"]);
    let foreign = state(&ns, &cmds);

    let config = RedirectConfig::default();
    let pods = ["10.244.1.11", "10.244.1.12", "fd00:10:244:1::b"];
    let nodes = ["192.168.50.2", "fd00:50::2"];
    let first = spec(config.clone(), &pods, &nodes).with_pod_interfaces(["pod0".to_string()]);

    // Without nft: the source check and the upstream legs' zone are xt rules in the raw
    // table, sources checked first.
    let xt = IptablesBackend::with_commands(cmds.clone());
    ns.run(|| xt.apply(&first)).expect("apply without nft");
    // 35 rules in mangle, 13 in raw (4 checking sources, 9 for the upstream legs'
    // conntrack: untracked to and from a local pod or an enforcing node's, else a zone of
    // their own).
    for (save, raw, _) in installed_rules(&ns, &cmds, &xt.render(&first), 48) {
        for (hook, chains) in [
            ("PREROUTING", &["TIERPROXY-SOURCE", "TIERPROXY-ZONE-IN"][..]),
            ("OUTPUT", &["TIERPROXY-ZONE-OUT"][..]),
        ] {
            let jumps: Vec<&str> =
                raw.lines().filter(|l| l.starts_with(&format!("-A {hook} "))).collect();
            let want: Vec<String> = chains.iter().map(|c| format!("-A {hook} -j {c}")).collect();
            assert_eq!(jumps, want, "{save} -t raw: sources are checked first");
        }
    }

    // With the chain after the DNAT (nft tproxy, which these kernels have), the raw
    // chains are nft rules in its table; applying removes the xt ones above.
    let backend = IptablesBackend::with_commands(cmds.clone()).with_nft_after_dnat("nft");
    ns.run(|| backend.apply(&first)).expect("apply");

    // The kernel holds exactly the rendered rules, and one jump at the top of PREROUTING:
    // the 35 above and the two for TCP between local pods, which the nft table untracks
    // (its SYN, and past it without a socket, to the local pods' listener).
    for (save, raw, saved) in installed_rules(&ns, &cmds, &backend.render(&first), 37) {
        assert!(!raw.contains("TIERPROXY"), "{save} -t raw still holds tierproxy's: {raw}");
        let prerouting: Vec<&str> =
            saved.lines().filter(|l| l.starts_with("-A PREROUTING")).collect();
        assert_eq!(prerouting, ["-A PREROUTING -j TIERPROXY", "-A PREROUTING -p tcp -j RETURN"]);
        for hook in ["INPUT", "FORWARD"] {
            let jumps: Vec<&str> =
                saved.lines().filter(|l| l.starts_with(&format!("-A {hook} "))).collect();
            assert_eq!(jumps, [format!("-A {hook} -j TIERPROXY-DECIDE")], "{save}");
        }
        assert!(saved.contains(":FOREIGN - "), "{saved}");
    }
    assert_eq!(members(&ns, "tierproxy-pods-v4"), ["10.244.1.11", "10.244.1.12"]);
    assert_eq!(members(&ns, "tierproxy-pods-v6"), ["fd00:10:244:1::b"]);
    assert_eq!(members(&ns, "tierproxy-nodes-v4"), ["192.168.50.2"]);
    assert_eq!(members(&ns, "tierproxy-nodes-v6"), ["fd00:50::2"]);
    assert_eq!(members(&ns, "tierproxy-podif-v4"), ["0.0.0.0/0,pod0"]);
    assert_eq!(members(&ns, "tierproxy-podif-v6"), ["::/0,pod0"]);
    // The raw chains' own sets, in the nft table.
    assert_eq!(nft_dnat(&ns, "pods-v4"), ["10.244.1.11", "10.244.1.12"]);
    assert_eq!(nft_dnat(&ns, "pods-v6"), ["fd00:10:244:1::b"]);
    assert_eq!(nft_dnat(&ns, "nodes-v4"), ["192.168.50.2"]);
    assert_eq!(nft_dnat(&ns, "nodes-v6"), ["fd00:50::2"]);
    assert_eq!(nft_dnat(&ns, "podif"), ["pod0"]);
    assert_eq!(ns.run(|| backend.drop_counts(&config)).expect("counters"), Default::default());
    let after_dnat = ns.sh(&["nft", "list", "table", "inet", "tierproxy-dnat"]);
    for chain in [
        "chain source {\n\t\ttype filter hook prerouting priority raw - 10; policy accept;",
        "chain zone_in {\n\t\ttype filter hook prerouting priority raw; policy accept;",
        "chain zone_out {\n\t\ttype filter hook output priority raw; policy accept;",
    ] {
        assert!(after_dnat.contains(chain), "{chain}: {after_dnat}");
    }
    assert!(after_dnat.contains("fib saddr . iif oif missing"), "{after_dnat}");
    assert!(after_dnat.contains("ct status dnat socket transparent 1"), "{after_dnat}");
    assert!(after_dnat.contains("tproxy ip to 127.0.0.1:15001"), "{after_dnat}");
    // The refusal chains, right after the decision in mangle INPUT and FORWARD: a mark
    // test per packet (the reject bit without the decided one: both together are the
    // queue's "allowed, not cached"), the refusals in chain `refuse` (nft lists an ICMP
    // reject without the `meta nfproto` it implies). Then the new event of a UDP flow
    // decided at the queue is spared (issue #20; every cached flow reports its own with
    // the default sample, 1).
    for hook in ["input", "forward"] {
        let chain = format!(
            "chain refuse_{hook} {{\n\t\ttype filter hook {hook} priority mangle + 1; policy accept;\n\t\tmeta mark & 0x00001040 == 0x00000040 jump refuse comment \"tierproxy: rejected\"\n\t\tmeta l4proto udp ct state new meta mark & 0x00001000 == 0x00001000 ct event set destroy comment"
        );
        assert!(after_dnat.contains(&chain), "{after_dnat}");
    }
    assert!(!after_dnat.contains("cached class, new event spared"), "{after_dnat}");
    for refusal in [
        "meta l4proto tcp reject with tcp reset",
        "reject with icmp host-prohibited",
        "reject with icmpv6 admin-prohibited",
    ] {
        assert_eq!(after_dnat.matches(refusal).count(), 1, "{refusal}: {after_dnat}");
    }
    for fam in ["-4", "-6"] {
        let rules = ns.sh(&["ip", fam, "rule", "show"]);
        assert!(rules.contains("1501:\tfrom all fwmark 0x2000/0x2000 lookup 1501"), "{rules}");
        let routes = ns.sh(&["ip", fam, "route", "show", "table", "1501"]);
        assert!(routes.starts_with("local default dev lo"), "{routes}");
    }
    let sets = ns.sh(&["ipset", "list", "-n"]);
    assert!(!sets.contains("-tmp"), "temporary sets are destroyed: {sets}");

    // Applying the same spec again changes nothing (no second jump, rule or route).
    let installed = state(&ns, &cmds);
    ns.run(|| backend.apply(&first)).expect("second apply");
    assert_eq!(state(&ns, &cmds), installed);

    // Applying a spec with other pods replaces the set members, nothing else.
    let second = spec(config.clone(), &["10.244.1.13"], &nodes);
    ns.run(|| backend.apply(&second)).expect("apply with other pods");
    assert_eq!(members(&ns, "tierproxy-pods-v4"), ["10.244.1.13"]);
    assert!(members(&ns, "tierproxy-pods-v6").is_empty());
    let replaced = state(&ns, &cmds);
    assert_eq!(without_sets(&replaced), without_sets(&installed));

    // update_pods changes only set elements; removing an absent address is no error.
    ns.run(|| {
        backend.update_pods(
            &config,
            &addrs(&["10.244.1.14", "fd00:10:244:1::e", "10.244.1.14"]),
            &addrs(&["10.244.1.13", "10.244.1.99"]),
        )
    })
    .expect("update_pods");
    assert_eq!(members(&ns, "tierproxy-pods-v4"), ["10.244.1.14"]);
    assert_eq!(members(&ns, "tierproxy-pods-v6"), ["fd00:10:244:1::e"]);
    assert_eq!(nft_dnat(&ns, "pods-v4"), ["10.244.1.14"]);
    assert_eq!(nft_dnat(&ns, "pods-v6"), ["fd00:10:244:1::e"]);
    assert_eq!(without_sets(&state(&ns, &cmds)), without_sets(&installed));

    // set_pod_interfaces replaces the interface sets' members, nothing else.
    let ifaces = std::collections::BTreeSet::from(["pod1".to_string(), "pod2".to_string()]);
    ns.run(|| backend.set_pod_interfaces(&config, &ifaces)).expect("set_pod_interfaces");
    assert_eq!(members(&ns, "tierproxy-podif-v4"), ["0.0.0.0/0,pod1", "0.0.0.0/0,pod2"]);
    assert_eq!(members(&ns, "tierproxy-podif-v6"), ["::/0,pod1", "::/0,pod2"]);
    assert_eq!(nft_dnat(&ns, "podif"), ["pod1", "pod2"]);
    assert_eq!(without_sets(&state(&ns, &cmds)), without_sets(&installed));

    // set_enforced_pods replaces the enforced pod sets' members, nothing else.
    assert!(members(&ns, "tierproxy-enforced-v4").is_empty());
    let enforced = addrs(&["10.244.2.7", "fd00:10:244:2::7", "10.244.2.8"]);
    ns.run(|| backend.set_enforced_pods(&config, &enforced.iter().copied().collect()))
        .expect("set_enforced_pods");
    assert_eq!(members(&ns, "tierproxy-enforced-v4"), ["10.244.2.7", "10.244.2.8"]);
    assert_eq!(members(&ns, "tierproxy-enforced-v6"), ["fd00:10:244:2::7"]);
    assert_eq!(nft_dnat(&ns, "enforced-v4"), ["10.244.2.7", "10.244.2.8"]);
    assert_eq!(nft_dnat(&ns, "enforced-v6"), ["fd00:10:244:2::7"]);
    // The kernel-side cache of allowed classes: filled by the ruleset, emptied by
    // flush_allowed.
    ns.sh(&["ipset", "add", "tierproxy-allowed-v4", "10.244.1.14,tcp:8080,10.244.2.7"]);
    assert_eq!(members(&ns, "tierproxy-allowed-v4").len(), 1);
    ns.run(|| backend.flush_allowed(&config)).expect("flush_allowed");
    assert!(members(&ns, "tierproxy-allowed-v4").is_empty());
    let one = addrs(&["10.244.2.8"]).into_iter().collect();
    ns.run(|| backend.set_enforced_pods(&config, &one)).expect("set_enforced_pods again");
    assert_eq!(members(&ns, "tierproxy-enforced-v4"), ["10.244.2.8"]);
    assert!(members(&ns, "tierproxy-enforced-v6").is_empty());
    assert_eq!(without_sets(&state(&ns, &cmds)), without_sets(&installed));

    // remove leaves exactly what was there before, twice.
    ns.run(|| backend.remove(&config)).expect("remove");
    assert_eq!(state(&ns, &cmds), foreign);
    assert!(!ns.sh(&["nft", "list", "tables"]).contains("tierproxy"), "the nft table is gone");
    ns.run(|| backend.remove(&config)).expect("second remove");
    assert_eq!(state(&ns, &cmds), foreign);
}

#[test]
fn iptables_apply_update_remove() {
    iptables_lifecycle("iptables_apply_update_remove", IptablesCommands::default());
}

#[test]
fn iptables_legacy_apply_update_remove() {
    iptables_lifecycle("iptables_legacy_apply_update_remove", IptablesCommands::legacy());
}

#[test]
fn remove_with_nothing_installed_succeeds() {
    let test = "remove_with_nothing_installed_succeeds";
    let mut tools = BASE_TOOLS.to_vec();
    tools.push("nft");
    if !netns_available(test, &tools) {
        return;
    }
    let ns = Netns::new();
    let config = RedirectConfig::default();
    let before = state(&ns, &IptablesCommands::default());
    ns.run(|| IptablesBackend::new().remove(&config)).expect("iptables remove");
    ns.run(|| NftablesBackend::new().remove(&config)).expect("nftables remove");
    assert_eq!(state(&ns, &IptablesCommands::default()), before);
    assert!(!ns.sh(&["nft", "list", "tables"]).contains("tierproxy"));
}

/// Drops the queue rules from the nftables batch (for kernels without CONFIG_NFT_QUEUE).
fn without_queue_rules(json: &str) -> (String, usize) {
    let mut doc: serde_json::Value = serde_json::from_str(json).expect("ruleset JSON");
    let objects = doc["nftables"].as_array_mut().expect("nftables array");
    let before = objects.len();
    objects.retain(|o| {
        let expr = o.pointer("/add/rule/expr").and_then(|e| e.as_array());
        !expr.is_some_and(|e| e.iter().any(|s| s.get("queue").is_some()))
    });
    let dropped = before - objects.len();
    (doc.to_string(), dropped)
}

fn nft_elements(ns: &Netns, set: &str) -> BTreeSet<String> {
    nft_table_elements(ns, "tierproxy", set)
}

/// The members of set `set` of the iptables backend's nft table `inet tierproxy-dnat`.
fn nft_dnat(ns: &Netns, set: &str) -> Vec<String> {
    nft_table_elements(ns, "tierproxy-dnat", set).into_iter().collect()
}

/// The members of set `set` of nft table `inet <table>`.
fn nft_table_elements(ns: &Netns, table: &str, set: &str) -> BTreeSet<String> {
    let out = ns.sh(&["nft", "-j", "list", "set", "inet", table, set]);
    let doc: serde_json::Value = serde_json::from_str(&out).expect("nft JSON");
    doc["nftables"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|o| o.pointer("/set/elem").and_then(|e| e.as_array()))
        .flatten()
        .filter_map(|e| e.as_str().map(str::to_owned))
        .collect()
}

#[test]
fn nftables_apply_update_remove() {
    let test = "nftables_apply_update_remove";
    if !netns_available(test, &["ip", "nft"]) {
        return;
    }
    let ns = Netns::new();
    let config = RedirectConfig::default();
    let s = spec(config.clone(), &["10.244.1.11", "fd00:10:244:1::b"], &["192.168.50.2"])
        .with_pod_interfaces(["pod0".to_string()]);
    let backend = NftablesBackend::new();
    let probed = ns.run(probe);
    let cmds = IptablesCommands::default();
    let before = state(&ns, &cmds);

    if probed.kind == BackendKind::Nftables {
        ns.run(|| backend.apply(&s)).expect("apply");
        ns.run(|| backend.apply(&s)).expect("second apply");
        let listing = ns.sh(&["nft", "list", "table", "inet", "tierproxy"]);
        let queues = backend.ruleset_json(&s).matches("\"queue\":").count();
        assert_eq!(listing.lines().filter(|l| l.contains(" queue ")).count(), queues, "{listing}");
        assert_eq!(ns.sh(&["nft", "list", "tables"]).matches("tierproxy").count(), 1);
    } else {
        skipped(&format!(
            "{test} (full ruleset): the kernel cannot queue from nftables ({}); \
             checking that apply fails cleanly and that the ruleset without its queue rules \
             applies",
            probed.reason
        ));
        assert!(probed.reason.contains("nft -c -j -f -"), "{}", probed.reason);
        let err = ns.run(|| backend.apply(&s)).expect_err("apply must fail without nft queue");
        assert!(err.to_string().contains("`nft -j -f -` failed"), "{err}");
        // The failed transaction left no table behind.
        assert!(!ns.sh(&["nft", "list", "tables"]).contains("tierproxy"));
        let (json, dropped) = without_queue_rules(&backend.ruleset_json(&s));
        assert_eq!(
            dropped, 16,
            "(3 protocols + TCP not tproxied) × egress and ingress × 2 families"
        );
        let mut child = Command::new("ip")
            .args(["netns", "exec", &ns.name, "nft", "-j", "-f", "-"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .expect("spawn nft");
        child.stdin.take().expect("stdin").write_all(json.as_bytes()).expect("write");
        assert!(child.wait().expect("nft").success(), "ruleset without queue rules applies");
        let listing = ns.sh(&["nft", "list", "table", "inet", "tierproxy"]);
        for needle in [
            "socket transparent 1 socket wildcard 0 meta mark set meta mark | 0x00002000 \
             meta mark set meta mark | 0x00001000 accept",
            "ct direction original ct mark & 0x00002000 == 0x00002000",
            "ct mark set ct mark | 0x00002000 tproxy ip to 127.0.0.1:15001",
            "jump decide",
            "tproxy ip to 127.0.0.1:15001 meta mark set meta mark | 0x00002000 accept",
            "tproxy ip6 to [::1]:15001",
            "ip saddr @nodes-v4 return",
            "meta l4proto udp return comment \"tierproxy: UDP, no upstream leg on the kernel UDP \
             path\"",
            "ip daddr @pods-v4 ip saddr != @pods-v4 socket mark & 0x00000080 == 0x00000080 \
             jump zone_leg",
            "ip saddr @enforced-v4 notrack return",
            "ip6 saddr @enforced-v6 notrack return",
            "ct zone set 29808 comment \"tierproxy: upstream leg from elsewhere, own zone\"",
            "meta mark & 0x00000080 == 0x00000080 meta l4proto != { icmp, ipv6-icmp } \
             ip daddr @enforced-v4 notrack return",
            "ip saddr @pods-v4 socket mark & 0x00000080 == 0x00000080 notrack",
            "meta mark & 0x00000080 == 0x00000080 meta l4proto != { icmp, ipv6-icmp } \
             ip daddr @pods-v4 notrack return",
            "meta mark & 0x00000080 == 0x00000080 meta l4proto != { icmp, ipv6-icmp } \
             ip6 daddr @pods-v6 notrack return",
            "meta mark & 0x00000080 == 0x00000080 meta l4proto != { icmp, ipv6-icmp } ct zone \
             set 29808",
            "meta l4proto udp ip daddr @nodes-v4 ct state new ct mark set ct mark | 0x00002000",
            "meta l4proto udp ct mark & 0x00002000 == 0x00002000 ct state != new return",
            "iifname \"lo\" ip saddr @nodes-v4 return",
            "ip saddr @nodes-v4 counter packets 0 bytes 0 drop",
            "iifname @podif goto pod_source",
            "fib saddr . iif oif missing counter packets 0 bytes 0 drop",
            "ct status dnat socket transparent 1 socket wildcard 0 meta mark set",
            "ct status ! dnat tproxy ip to 127.0.0.1:15001",
            "ct state { invalid, new } counter packets 0 bytes 0 drop",
            "ip daddr @pods-v4 ip saddr @enforced-v4 meta l4proto tcp return",
            "meta l4proto != tcp socket transparent 1 socket wildcard 0",
            "tcp flags != syn / fin,syn,rst,ack socket transparent 1 socket wildcard 0",
            "update @allowed-v4 { ip saddr . meta l4proto . tcp dport . ip daddr }",
            "ip saddr . meta l4proto . tcp dport . ip daddr @allowed-v4 return",
            "ip6 saddr . meta l4proto . tcp dport . ip6 daddr @allowed-v6 return",
            "update @allowed-v4 { ip saddr . meta l4proto . udp dport . ip daddr }",
            "ip saddr . meta l4proto . udp dport . ip daddr @allowed-v4 ct mark set ct mark | \
             0x00001000 return",
            "meta l4proto udp ct status confirmed return",
        ] {
            assert!(listing.contains(needle), "{needle:?} missing from:\n{listing}");
        }
    }
    assert_eq!(nft_elements(&ns, "pods-v4"), BTreeSet::from(["10.244.1.11".to_owned()]));
    assert_eq!(nft_elements(&ns, "podif"), BTreeSet::from(["pod0".to_owned()]));
    assert_eq!(ns.run(|| backend.drop_counts(&config)).expect("counters"), Default::default());
    let ifaces = BTreeSet::from(["pod1".to_owned(), "pod2".to_owned()]);
    ns.run(|| backend.set_pod_interfaces(&config, &ifaces)).expect("set_pod_interfaces");
    assert_eq!(nft_elements(&ns, "podif"), ifaces);
    let enforced: BTreeSet<IpAddr> =
        addrs(&["10.244.2.7", "fd00:10:244:2::7"]).into_iter().collect();
    ns.run(|| backend.set_enforced_pods(&config, &enforced)).expect("set_enforced_pods");
    assert_eq!(nft_elements(&ns, "enforced-v4"), BTreeSet::from(["10.244.2.7".to_owned()]));
    assert_eq!(nft_elements(&ns, "enforced-v6"), BTreeSet::from(["fd00:10:244:2::7".to_owned()]));
    let one: BTreeSet<IpAddr> = addrs(&["10.244.2.8"]).into_iter().collect();
    ns.run(|| backend.set_enforced_pods(&config, &one)).expect("set_enforced_pods again");
    assert_eq!(nft_elements(&ns, "enforced-v4"), BTreeSet::from(["10.244.2.8".to_owned()]));
    assert!(nft_elements(&ns, "enforced-v6").is_empty());
    ns.run(|| {
        backend.update_pods(
            &config,
            &addrs(&["10.244.1.12", "fd00:10:244:1::c"]),
            &addrs(&["10.244.1.11", "10.244.1.99"]),
        )
    })
    .expect("update_pods");
    assert_eq!(nft_elements(&ns, "pods-v4"), BTreeSet::from(["10.244.1.12".to_owned()]));
    assert_eq!(
        nft_elements(&ns, "pods-v6"),
        BTreeSet::from(["fd00:10:244:1::b".to_owned(), "fd00:10:244:1::c".to_owned()])
    );
    ns.run(|| backend.remove(&config)).expect("remove");
    assert!(!ns.sh(&["nft", "list", "tables"]).contains("tierproxy"));
    assert_eq!(state(&ns, &cmds), before, "routing rules and routes are gone too");
    ns.run(|| backend.remove(&config)).expect("second remove");
}

/// The addresses of one IP family in the two-namespace topology.
#[derive(Debug, Clone, Copy)]
struct Family {
    name: &'static str,
    node_ip: &'static str,
    pod_ip: &'static str,
    prefix_len: u8,
    /// An address outside the topology, routed from the pod via the node.
    remote_ip: &'static str,
    loopback: &'static str,
    iptables: &'static str,
}

const V4: Family = Family {
    name: "IPv4",
    node_ip: "10.200.0.1",
    pod_ip: "10.200.0.2",
    prefix_len: 24,
    remote_ip: "10.200.9.9",
    loopback: "127.0.0.1",
    iptables: "iptables",
};

const V6: Family = Family {
    name: "IPv6",
    node_ip: "fd00:200::1",
    pod_ip: "fd00:200::2",
    prefix_len: 64,
    remote_ip: "fd00:209::9",
    loopback: "::1",
    iptables: "ip6tables",
};

fn sockaddr(ip: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip.parse().expect("test address"), port)
}

/// A node namespace and a pod namespace joined by a veth, dual-stack: the pod has
/// 10.200.0.2 and fd00:200::2 with default routes via the node's 10.200.0.1 and fd00:200::1.
struct Topology {
    node: Netns,
    pod: Netns,
}

impl Topology {
    fn new() -> Topology {
        let node = Netns::new();
        let pod = Netns::new();
        node.sh(&[
            "ip", "link", "add", "vn", "type", "veth", "peer", "name", "vp", "netns", &pod.name,
        ]);
        for fam in [V4, V6] {
            // `nodad`: usable at once, without waiting for duplicate address detection.
            let nodad = if fam.prefix_len == 64 { &["nodad"][..] } else { &[] };
            for (ns, dev, ip) in [(&node, "vn", fam.node_ip), (&pod, "vp", fam.pod_ip)] {
                let cidr = format!("{ip}/{}", fam.prefix_len);
                let mut args = vec!["ip", "addr", "add", cidr.as_str(), "dev", dev];
                args.extend_from_slice(nodad);
                ns.sh(&args);
            }
        }
        node.sh(&["ip", "link", "set", "vn", "up"]);
        pod.sh(&["ip", "link", "set", "vp", "up"]);
        pod.sh(&["ip", "-4", "route", "add", "default", "via", V4.node_ip]);
        pod.sh(&["ip", "-6", "route", "add", "default", "via", V6.node_ip]);
        Topology { node, pod }
    }

    fn spec(&self, config: RedirectConfig) -> RulesetSpec {
        spec(config, &[V4.pod_ip, V6.pod_ip], &[V4.node_ip, V6.node_ip])
    }

    fn connect(&self, to: SocketAddr, timeout: Duration) -> std::io::Result<TcpStream> {
        self.pod.run(|| TcpStream::connect_timeout(&to, timeout))
    }
}

fn queued_packets(ns: &Netns, fam: Family) -> u64 {
    let out =
        ns.sh(&[fam.iptables, "-w", "-t", "mangle", "-L", "TIERPROXY-QUEUE", "-v", "-x", "-n"]);
    out.lines()
        .filter(|l| l.contains("NFQUEUE"))
        .filter_map(|l| l.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// With nothing reading the queue, a new connection from a local pod is dropped when the
/// queue is fail-closed (the client times out, never refused) and passes when it is
/// fail-open (`--queue-bypass`): interception comes first (TPROXY in PREROUTING, the queue
/// in INPUT), so it passes to the transparent listener, here a stand-in for the agent's,
/// whose proxy then decides the flow itself. Without a listener, xt TPROXY drops the SYN
/// in either mode. Both families.
#[test]
fn fail_closed_drops_and_fail_open_passes_unread_queue() {
    let test = "fail_closed_drops_and_fail_open_passes_unread_queue";
    if !netns_available(test, BASE_TOOLS) {
        return;
    }
    let topo = Topology::new();
    let servers = [sockaddr(V4.node_ip, 8080), sockaddr(V6.node_ip, 8080)];
    let _listeners = topo
        .node
        .run(|| servers.map(|s| TcpListener::bind(s).unwrap_or_else(|e| panic!("{s}: {e}"))));
    let backend = IptablesBackend::new();
    let closed = topo.spec(RedirectConfig::default());
    let open = topo.spec(RedirectConfig { queue_bypass: true, ..Default::default() });
    let timeout = Duration::from_millis(1500);
    let connect_all = |phase: &str| {
        for server in servers {
            topo.connect(server, timeout).unwrap_or_else(|e| panic!("{phase}: {server}: {e}"));
        }
    };
    let times_out = |phase: &str, fam: Family, server: SocketAddr| {
        let started = Instant::now();
        let err = topo.connect(server, timeout).expect_err(phase);
        assert_eq!(
            err.kind(),
            ErrorKind::TimedOut,
            "{phase}, {}: a timeout, not a refusal",
            fam.name
        );
        assert!(started.elapsed() >= timeout, "{phase}, {}: dropped silently", fam.name);
    };

    connect_all("control, before any rule");

    topo.node.run(|| backend.apply(&open)).expect("apply fail-open");
    for (fam, server) in [V4, V6].into_iter().zip(servers) {
        times_out("no transparent listener: TPROXY drops", fam, server);
        assert_eq!(queued_packets(&topo.node, fam), 0, "{}: dropped before the queue", fam.name);
    }
    let stand_ins = topo.node.run(|| {
        [V4, V6].map(|fam| {
            let l = TcpListener::bind(sockaddr(fam.loopback, 15001))
                .unwrap_or_else(|e| panic!("{}: listener: {e}", fam.name));
            setsockopt(&l, sockopt::IpTransparent, &true)
                .unwrap_or_else(|e| panic!("{}: IP_TRANSPARENT: {e}", fam.name));
            l
        })
    });

    topo.node.run(|| backend.apply(&closed)).expect("apply fail-closed");
    for (fam, server) in [V4, V6].into_iter().zip(servers) {
        times_out("fail-closed must drop the SYN", fam, server);
        assert!(queued_packets(&topo.node, fam) >= 1, "{}: the SYN went to the queue", fam.name);
    }

    topo.node.run(|| backend.apply(&open)).expect("apply fail-open");
    connect_all("fail-open lets the SYN pass an unread queue");
    for (l, server) in stand_ins.iter().zip(servers) {
        let (conn, _) = l.accept().expect("the stand-in accepted the fail-open connection");
        assert_eq!(conn.local_addr().expect("local"), server, "original destination");
    }

    drop(stand_ins);
    topo.node.run(|| backend.remove(open.config())).expect("remove");
    connect_all("after remove");
}

/// A TCP SYN is TPROXY'd to the transparent listener; carrying the decided mark in INPUT (as
/// the queue's REPEAT verdict leaves it) it skips the queue and reaches the listener with its original destination intact, and
/// the rest of the flow reaches the accepted socket through the `socket --transparent` rule
/// and policy routing. Both families.
#[test]
fn decided_tcp_is_tproxied_to_the_listener() {
    let test = "decided_tcp_is_tproxied_to_the_listener";
    if !netns_available(test, BASE_TOOLS) {
        return;
    }
    let topo = Topology::new();
    let backend = IptablesBackend::new();
    let s = topo.spec(RedirectConfig::default());
    topo.node.run(|| backend.apply(&s)).expect("apply");
    for fam in [V4, V6] {
        tproxy_round_trip(&topo, fam);
    }
}

fn tproxy_round_trip(topo: &Topology, fam: Family) {
    // Stand-in for the decider: mark new TCP flows to port 9999 as decided, ahead of the jump
    // to the decide chain (INPUT: the flow is TPROXY'd, so delivered locally).
    topo.node.sh(&[
        fam.iptables,
        "-w",
        "-t",
        "mangle",
        "-I",
        "INPUT",
        "1",
        "-p",
        "tcp",
        "--dport",
        "9999",
        "-m",
        "conntrack",
        "--ctstate",
        "NEW",
        "-j",
        "MARK",
        "--set-xmark",
        "0x1000/0x1000",
    ]);
    let listener = topo
        .node
        .run(|| {
            let l = TcpListener::bind(sockaddr(fam.loopback, 15001))?;
            setsockopt(&l, sockopt::IpTransparent, &true)?;
            l.set_nonblocking(true)?;
            Ok::<_, std::io::Error>(l)
        })
        .unwrap_or_else(|e| panic!("{}: transparent listener: {e}", fam.name));
    let original = sockaddr(fam.remote_ip, 9999);

    std::thread::scope(|scope| {
        let server = scope.spawn(|| {
            let deadline = Instant::now() + Duration::from_secs(5);
            let (mut conn, peer) = loop {
                match listener.accept() {
                    Ok(accepted) => break accepted,
                    Err(e) if e.kind() == ErrorKind::WouldBlock && Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => panic!("{}: accept: {e}", fam.name),
                }
            };
            conn.set_nonblocking(false).expect("blocking");
            conn.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
            let mut buf = [0u8; 4];
            conn.read_exact(&mut buf).expect("read ping");
            conn.write_all(b"pong").expect("write pong");
            (conn.local_addr().expect("local addr"), peer, buf)
        });
        let mut client = topo
            .connect(original, Duration::from_secs(3))
            .unwrap_or_else(|e| panic!("{}: connect is TPROXY'd: {e}", fam.name));
        client.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        client.write_all(b"ping").expect("write ping");
        let mut reply = [0u8; 4];
        client.read_exact(&mut reply).expect("read pong through the transparent socket");
        assert_eq!(&reply, b"pong");
        let (local, peer, got) = server.join().expect("server thread");
        assert_eq!(local, original, "{}: getsockname() is the original destination", fam.name);
        assert_eq!(peer.ip(), fam.pod_ip.parse::<IpAddr>().expect("ip"), "client's own address");
        assert_eq!(&got, b"ping");
    });

    // Without the decided mark the same kind of flow is queued and, fail-closed, dropped.
    let other = sockaddr(fam.remote_ip, 9998);
    let err = topo.connect(other, Duration::from_millis(1500)).expect_err("queued and dropped");
    assert_eq!(err.kind(), ErrorKind::TimedOut, "{}: {err}", fam.name);
}

/// Feeds `input` to `nft -f -` (`json`: `nft -j -f -`) in `ns`; panics when it fails.
fn nft_apply(ns: &Netns, input: &str, json: bool) {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &ns.name, "nft"]);
    if json {
        cmd.arg("-j");
    }
    let mut child =
        cmd.args(["-f", "-"]).stdin(std::process::Stdio::piped()).spawn().expect("spawn nft");
    child.stdin.take().expect("stdin").write_all(input.as_bytes()).expect("write");
    assert!(child.wait().expect("nft").success(), "nft -f - failed for:\n{input}");
}

/// `TcpExt: SyncookiesRecv` in `ns`.
fn syncookies_received(ns: &Netns) -> u64 {
    tierproxy::metrics::parse_tcp_ext(&ns.sh(&["cat", "/proc/net/netstat"])).syncookies_recv
}

/// Issue #17, item 2, nftables backend: the ACK that completes a SYN cookie for a
/// connection to a ClusterIP reaches the listener. The kube-proxy-like DNAT runs after the
/// interception (priority -100 against -150), so only a rule after it sees the header the
/// connection's socket has; xt TPROXY cannot run there, nft's `tproxy` can (chain
/// `proxied`). `tcp_syncookies=2` answers every SYN with a cookie. The ruleset is applied
/// without its queue rules (these kernels lack nft's `queue`; nothing here needs a
/// decision), with the backend's policy routing added by hand.
#[test]
fn nftables_completes_a_syn_cookie_to_a_clusterip_after_its_dnat() {
    let test = "nftables_completes_a_syn_cookie_to_a_clusterip_after_its_dnat";
    if !netns_available(test, &["ip", "nft"]) {
        return;
    }
    let topo = Topology::new();
    let s = topo.spec(RedirectConfig::default());
    let (json, _) = without_queue_rules(&NftablesBackend::new().ruleset_json(&s));
    nft_apply(&topo.node, &json, true);
    topo.node.sh(&["ip", "rule", "add", "fwmark", "0x2000/0x2000", "lookup", "1501"]);
    topo.node.sh(&["ip", "route", "add", "local", "default", "dev", "lo", "table", "1501"]);
    // kube-proxy's nftables mode: ClusterIP 10.96.0.10:80 → the backend 10.200.9.9:9999.
    nft_apply(
        &topo.node,
        "table ip svc {\n chain pre {\n  type nat hook prerouting priority -100;\n  \
         ip daddr 10.96.0.10 tcp dport 80 dnat to 10.200.9.9:9999\n }\n}\n",
        false,
    );
    topo.node.sh(&["sysctl", "-q", "-w", "net.ipv4.tcp_syncookies=2"]);
    let cookies = syncookies_received(&topo.node);
    let listener = topo
        .node
        .run(|| {
            let l = TcpListener::bind(sockaddr(V4.loopback, 15001))?;
            setsockopt(&l, sockopt::IpTransparent, &true)?;
            l.set_nonblocking(true)?;
            Ok::<_, std::io::Error>(l)
        })
        .expect("transparent listener");
    std::thread::scope(|scope| {
        let server = scope.spawn(|| {
            let deadline = Instant::now() + Duration::from_secs(5);
            let (mut conn, _) = loop {
                match listener.accept() {
                    Ok(accepted) => break accepted,
                    Err(e) if e.kind() == ErrorKind::WouldBlock && Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => panic!("the cookie's ACK never reached the listener: {e}"),
                }
            };
            conn.set_nonblocking(false).expect("blocking");
            conn.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
            let mut buf = [0u8; 4];
            conn.read_exact(&mut buf).expect("read ping");
            conn.write_all(b"pong").expect("write pong");
            conn.local_addr().expect("local addr")
        });
        let mut client = topo
            .connect(sockaddr("10.96.0.10", 80), Duration::from_secs(3))
            .expect("connect to the ClusterIP");
        client.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        client.write_all(b"ping").expect("write ping");
        let mut reply = [0u8; 4];
        client.read_exact(&mut reply).expect("pong through the proxied connection");
        assert_eq!(&reply, b"pong");
        let local = server.join().expect("server thread");
        assert_eq!(local, sockaddr("10.200.9.9", 9999), "the original destination is the backend");
    });
    assert!(syncookies_received(&topo.node) > cookies, "the connection was a cookie's");
}
