//! Golden tests of the rendered rulesets (issue #3 "Redirection"): the exact text each
//! backend applies for a fixed spec, compared with `tests/golden/`. Run with
//! `UPDATE_GOLDEN=1` to rewrite the files, then review the diff line by line.

use std::net::IpAddr;
use std::path::PathBuf;

use tierproxy::config::RedirectConfig;
use tierproxy::config::UdpPath;
use tierproxy::redirect::{Backend, IptablesBackend, NftablesBackend, RulesetSpec};

fn addrs(list: &[&str]) -> Vec<IpAddr> {
    list.iter().map(|a| a.parse().expect("test address")).collect()
}

/// Two IPv4 and one IPv6 pod (one given as IPv4-mapped, out of order), a dual-stack node.
fn fixed_spec(config: RedirectConfig) -> RulesetSpec {
    RulesetSpec::new(
        config,
        addrs(&["10.244.1.12", "fd00:10:244:1::c", "::ffff:10.244.1.11"]),
        addrs(&["192.168.50.2", "fd00:50::2"]),
    )
    .expect("valid spec")
    .with_enforced_pods(addrs(&["10.244.2.7", "fd00:10:244:2::7", "10.244.1.12"]))
}

fn check_golden(name: &str, actual: &str) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden").join(name);
    if std::env::var_os("UPDATE_GOLDEN").is_some_and(|v| v == "1") {
        std::fs::create_dir_all(path.parent().expect("golden dir")).expect("create golden dir");
        std::fs::write(&path, actual).expect("write golden file");
        eprintln!("rewrote {}", path.display());
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!("{}: {e}; run with UPDATE_GOLDEN=1 to create it", path.display())
    });
    if expected != actual {
        let first = expected
            .lines()
            .zip(actual.lines())
            .position(|(e, a)| e != a)
            .unwrap_or_else(|| expected.lines().count().min(actual.lines().count()));
        panic!(
            "{} differs from the rendering at line {}:\n  golden:   {:?}\n  rendered: {:?}\n\
             (UPDATE_GOLDEN=1 rewrites it)",
            path.display(),
            first + 1,
            expected.lines().nth(first),
            actual.lines().nth(first)
        );
    }
}

#[test]
fn iptables_golden() {
    let text = IptablesBackend::new().render(&fixed_spec(RedirectConfig::default()));
    check_golden("iptables.txt", &text);
}

/// `--udp-path proxy` (issue #20): UDP is TPROXY'd to the UDP proxy and every datagram no
/// proxy socket took is queued, as before the kernel path; nothing else differs.
#[test]
fn the_udp_proxy_path_tproxies_udp_and_queues_every_datagram() {
    let config = RedirectConfig { udp_path: UdpPath::Proxy, ..Default::default() };
    let text = IptablesBackend::new().render(&fixed_spec(config.clone()));
    check_golden("iptables-udp-proxy.txt", &text);
    let kernel = IptablesBackend::new().render(&fixed_spec(RedirectConfig::default()));
    let only = |a: &str, b: &str| -> Vec<String> {
        a.lines().filter(|l| !b.lines().any(|m| m == *l)).map(str::to_owned).collect()
    };
    // Only UDP rules differ (the kernel path also spares UDP the upstream legs' socket
    // lookup, which is for TCP and ICMP there).
    let zone_leg = |l: &str| l.contains("upstream leg");
    for l in only(&text, &kernel) {
        assert!(l.contains("-p udp") || zone_leg(&l), "only UDP rules differ: {l}");
    }
    for l in only(&kernel, &text) {
        assert!(l.contains("-p udp"), "only UDP rules differ: {l}");
    }
    let nft = NftablesBackend::new().ruleset_json(&fixed_spec(config));
    assert!(nft.contains("\"udp\""));
}

/// With nft's table after the DNAT (a kernel with nft `tproxy`, `socket`, `reject` and
/// `fib`), the raw-priority chains (the source check, the upstream legs' zone) are nft
/// rules in table `inet tierproxy-dnat`, with their sets: the iptables part has no raw
/// table and installs no jump into it.
#[test]
fn with_the_nft_table_the_raw_chains_are_nft_rules() {
    let spec = fixed_spec(RedirectConfig::default());
    let text = IptablesBackend::new().with_nft_after_dnat("nft").render(&spec);
    check_golden("iptables-nft.txt", &text);
    assert!(!text.contains("*raw"), "an xt raw table is still written");
    assert!(!text.contains(" -t raw "), "a raw jump is still installed");
    let nft = text.lines().find(|l| l.starts_with("{\"nftables\"")).expect("the nft batch");
    let batch: serde_json::Value = serde_json::from_str(nft).expect("nft JSON");
    let chains: Vec<&str> = batch["nftables"]
        .as_array()
        .expect("commands")
        .iter()
        .filter_map(|c| c["add"]["chain"]["name"].as_str())
        .collect();
    for chain in
        ["source", "pod_source", "zone_in", "zone_out", "zone_leg", "proxied", "refuse_forward"]
    {
        assert!(chains.contains(&chain), "chain {chain} missing from {chains:?}");
    }
    // Without the table, the xt rules stay (the golden `iptables.txt`).
    let xt = IptablesBackend::new().render(&spec);
    assert!(xt.contains("*raw") && xt.contains("rpfilter"));
}

#[test]
fn nftables_golden() {
    let backend = NftablesBackend::new();
    let spec = fixed_spec(RedirectConfig::default());
    check_golden("nftables.json", &format!("{}\n", backend.ruleset_json(&spec)));
}

#[test]
fn nftables_render_embeds_the_applied_json() {
    let backend = NftablesBackend::new();
    let spec = fixed_spec(RedirectConfig::default());
    let text = backend.render(&spec);
    let json = backend.ruleset_json(&spec);
    assert!(text.starts_with("### nft -j -f -\n"), "{text}");
    assert!(text.contains(&json));
    let parsed: serde_json::Value = serde_json::from_str(&json).expect("valid JSON");
    assert!(parsed["nftables"].is_array());
    // After the JSON come the same policy-routing steps as the iptables backend's.
    fn routing(t: &str) -> Vec<&str> {
        t.lines().filter(|l| l.starts_with("### ip ")).collect()
    }
    let ipt = IptablesBackend::new().render(&spec);
    assert_eq!(routing(&text).len(), 4);
    assert_eq!(routing(&text), routing(&ipt));
    assert!(text.ends_with(&format!("{}\n", routing(&ipt).join("\n"))));
}

#[test]
fn rendering_is_deterministic_and_independent_of_input_order() {
    let a = fixed_spec(RedirectConfig::default());
    let b = RulesetSpec::new(
        RedirectConfig::default(),
        addrs(&["10.244.1.11", "fd00:10:244:1::c", "10.244.1.12", "10.244.1.11"]),
        addrs(&["fd00:50::2", "192.168.50.2"]),
    )
    .expect("valid spec")
    .with_enforced_pods(addrs(&["fd00:10:244:2::7", "10.244.1.12", "::ffff:10.244.2.7"]));
    for backend in [&IptablesBackend::new() as &dyn Backend, &NftablesBackend::new()] {
        assert_eq!(backend.render(&a), backend.render(&b), "{}", backend.name());
        assert_eq!(backend.render(&a), backend.render(&a), "{}", backend.name());
    }
}

/// Fail-open differs from fail-closed exactly in the queue statements gaining the bypass
/// flag (iptables `--queue-bypass`, nft `"flags": ["bypass"]`), in UDP's first datagrams
/// going to the kernel-forwarded flows' queue instead of the balanced ones (the kernel
/// would forward what a failing-open queue let through, and nothing would decide it
/// later), and for nftables in the drops of intercepted packets no listener took being
/// left out (xt TPROXY drops those itself, in both modes).
#[test]
fn fail_open_only_adds_queue_bypass() {
    let closed = fixed_spec(RedirectConfig::default());
    let open = fixed_spec(RedirectConfig { queue_bypass: true, ..Default::default() });

    let ipt = IptablesBackend::new();
    let (c, o) = (ipt.render(&closed), ipt.render(&open));
    assert!(!c.contains("--queue-bypass"));
    let queue_lines = o.lines().filter(|l| l.contains("-j NFQUEUE")).count();
    assert_eq!(queue_lines, 8, "3 protocols and TCP not tproxied × 2 families");
    assert_eq!(o.matches("--queue-bypass").count(), queue_lines);
    let mut o = o.replace(" --queue-bypass", "");
    for fam in ["v4", "v6"] {
        let uncached_udp = format!(
            "-A TIERPROXY-QUEUE -p udp -m set ! --match-set tierproxy-allowed-{fam} \
             src,dst,dst -j NFQUEUE"
        );
        assert!(c.contains(&format!("{uncached_udp} --queue-balance 0:1\n")), "{c}");
        o = o.replace(
            &format!("{uncached_udp} --queue-num 2\n"),
            &format!("{uncached_udp} --queue-balance 0:1\n"),
        );
    }
    assert_eq!(o, c);

    let nft = NftablesBackend::new();
    let parse = |s: &str| serde_json::from_str::<serde_json::Value>(s).expect("JSON");
    let (mut c, mut o) = (parse(&nft.ruleset_json(&closed)), parse(&nft.ruleset_json(&open)));
    let no_listener = |v: &serde_json::Value| {
        v.pointer("/add/rule/comment").and_then(|c| c.as_str())
            == Some("tierproxy: no proxy listener")
    };
    let rules = c["nftables"].as_array_mut().expect("array");
    let before = rules.len();
    rules.retain(|r| !no_listener(r));
    assert_eq!(
        before - rules.len(),
        8,
        "TCP SYNs × egress and ingress × 2 families, and TCP between local pods (its SYN, \
         and past it) × 2 families"
    );
    assert!(!o["nftables"].as_array().expect("array").iter().any(no_listener));
    let mut bypass_flags = 0;
    for obj in o["nftables"].as_array_mut().expect("array") {
        if let Some(expr) = obj.pointer_mut("/add/rule/expr").and_then(|e| e.as_array_mut()) {
            let udp = expr.first().and_then(|m| m.pointer("/match/right"))
                == Some(&serde_json::json!("udp"))
                && expr.len() == 3;
            for stmt in expr {
                if let Some(q) = stmt.get_mut("queue").and_then(|q| q.as_object_mut()) {
                    assert_eq!(q.remove("flags"), Some(serde_json::json!(["bypass"])));
                    bypass_flags += 1;
                    // UDP's first datagrams: the forwarded flows' queue (2), not 0–1.
                    if q.get("num") == Some(&serde_json::json!(2)) && udp {
                        q.insert("num".into(), serde_json::json!({"range": [0, 1]}));
                    }
                }
            }
        }
    }
    assert_eq!(
        bypass_flags, 16,
        "(3 protocols + TCP not tproxied) × egress and ingress × 2 families"
    );
    assert_eq!(o, c);
}

#[test]
fn configuration_reaches_every_rule() {
    let config = RedirectConfig {
        tproxy_port: 16001,
        queue_first: 10,
        queue_count: 4,
        name_prefix: "tpx".into(),
        route_table: 77,
        rule_priority: 77,
        ..Default::default()
    };
    let text = IptablesBackend::new().render(&fixed_spec(config.clone()));
    assert!(text.contains("--queue-balance 10:13"), "{text}");
    assert!(text.contains("--on-port 16001"), "{text}");
    assert!(text.contains(":TPX-DIVERT - [0:0]"), "{text}");
    assert!(text.contains("create tpx-pods-v6 hash:ip family inet6"), "{text}");
    assert!(text.contains("lookup 77 priority 77"), "{text}");
    assert!(!text.contains("TIERPROXY") && !text.contains("tierproxy-"), "{text}");

    let json = NftablesBackend::new().ruleset_json(&fixed_spec(config));
    assert!(json.contains("\"name\": \"tpx\""), "{json}");
    assert!(json.contains("\"port\": 16001"), "{json}");
    assert!(json.contains("10,\n") && json.contains("13\n"), "queue range 10-13: {json}");
}
