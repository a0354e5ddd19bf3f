//! The load-test tools' own checks, where a mistake would go into the docs as a
//! measurement: `loadtest/phases --self-test` parses a built-in capture of one
//! connection, through a transparent proxy and through the relay, into its steps;
//! `loadtest/transparent-listen` hands nginx (the `nginx` peer of `loadtest/run`)
//! non-blocking sockets; and `loadtest/run` reads how the machine's idle CPUs wait and
//! counts their wake-up interrupts (`host_facts`, `wakeup_interrupts`, on fake sysfs
//! trees and /proc/interrupts files), and sets tierproxy against each kernel baseline in
//! its summary (`summarize`, `variant_table`, on rows as it records them). Need python3
//! (the tools use only its standard library); without it a test says it was skipped,
//! which fails under `TIERPROXY_REQUIRE_TOOLS=1` (CI). The nginx test also needs root for
//! a network namespace of its own (`unshare -n`), skipped (or failed under
//! `TIERPROXY_REQUIRE_NETNS=1`) as the netns tests are.

mod common;

use std::path::Path;
use std::process::Command;

/// Whether `python3` runs; else says the test `test` was skipped (a panic under
/// `TIERPROXY_REQUIRE_TOOLS=1`).
fn python_available(test: &str) -> bool {
    common::python_available(test, &[], "python3 is missing")
}

#[test]
fn phases_reads_a_transparent_and_a_relayed_connection_into_its_steps() {
    let test = "phases_reads_a_transparent_and_a_relayed_connection_into_its_steps";
    if !python_available(test) {
        return;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("loadtest/phases");
    let out = Command::new("python3")
        .arg(&script)
        .arg("--self-test")
        .output()
        .expect("python3 runs loadtest/phases");
    let said =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "loadtest/phases --self-test failed: {said}");
    assert!(said.contains("transparent and relayed"), "{said}");
}

/// A bug in the `nginx` variant: `transparent-listen` passed nginx blocking sockets, and
/// nginx sets O_NONBLOCK only on the sockets it opens itself (an inherited one comes from
/// an nginx binary on upgrade, already non-blocking). Every worker is woken for a new
/// connection; the ones that lost the race blocked in accept(2) until the next one came,
/// and their connections waited with them: loadtest's nginx crr failed a scenario in most
/// runs ("reading the greeting" / "waiting for the server's EOF" after 5 s). Checked on
/// the sockets as the command it execs (here a Python one-liner standing in for nginx)
/// finds them in `NGINX`: two, none blocking. In a network namespace of its own, where
/// the ports are free.
#[test]
fn transparent_listen_hands_nginx_non_blocking_sockets() {
    let test = "transparent_listen_hands_nginx_non_blocking_sockets";
    if !python_available(test) || !common::tools_available(test, &["unshare"]) {
        return;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("loadtest/transparent-listen");
    let check = "import os, fcntl\n\
                 fds = [int(x) for x in os.environ['NGINX'].split(';') if x]\n\
                 blocking = [fd for fd in fds if not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK]\n\
                 print(len(fds), len(blocking))";
    let out = Command::new("unshare")
        .args(["-n", "python3"])
        .arg(&script)
        .args(["--tcp", "15001", "--udp", "8080", "--", "python3", "-c", check])
        .output()
        .expect("unshare runs transparent-listen");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{said}{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(said.trim(), "2 0", "sockets handed over, of them blocking");
}

/// Runs `body` in python3 with `loadtest/run` loaded as module `m` (and `json`, `sys`
/// imported), `args` as its `sys.argv[1:]`: its standard output. Fails the test, with
/// python's words, when python fails.
fn with_loadtest_run(body: &str, args: &[&std::ffi::OsStr]) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("loadtest/run");
    let program = format!(
        "import importlib.machinery, importlib.util, json, sys\n\
         l = importlib.machinery.SourceFileLoader('run', {script:?})\n\
         m = importlib.util.module_from_spec(importlib.util.spec_from_loader('run', l))\n\
         l.exec_module(m)\n\
         {body}\n",
        script = script.to_str().unwrap()
    );
    let out =
        Command::new("python3").arg("-c").arg(&program).args(args).output().expect("python3 runs");
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{said}{}", String::from_utf8_lossy(&out.stderr));
    said
}

/// `loadtest/run`'s `host_facts`, which every summary.json and phases.json records, reads
/// how the machine's idle CPUs wait and says so when idle vCPUs halt without polling (a
/// host setting that moved every proxy's connection rate at concurrency 1 by 1.6–2.1× on
/// this project's VMs: loadtest/README.md, "Idle vCPUs"). Read from fake sysfs trees: a guest halting at
/// once, one polling, and a machine without the files.
#[test]
fn loadtest_records_how_idle_vcpus_wait() {
    let test = "loadtest_records_how_idle_vcpus_wait";
    if !python_available(test) {
        return;
    }
    let root = tempfile::tempdir().expect("a temporary directory");
    let fake = |name: &str, driver: Option<&str>, poll: Option<&str>| {
        let d = root.path().join(name);
        let put = |path: &str, text: &str| {
            let p = d.join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, format!("{text}\n")).unwrap();
        };
        std::fs::create_dir_all(&d).unwrap();
        if let Some(t) = driver {
            put("devices/system/cpu/cpuidle/current_driver", t);
        }
        if let Some(t) = poll {
            put("module/haltpoll/parameters/guest_halt_poll_ns", t);
        }
        d
    };
    let dirs = [
        fake("halts", Some("haltpoll"), Some("0")),
        fake("polls", Some("haltpoll"), Some("200000")),
        fake("bare", None, None),
    ];
    let args: Vec<&std::ffi::OsStr> = dirs.iter().map(|d| d.as_os_str()).collect();
    let said =
        with_loadtest_run("for d in sys.argv[1:]: print(json.dumps(m.host_facts(d)))", &args);
    let facts: Vec<serde_json::Value> =
        said.lines().map(|l| serde_json::from_str(l).expect("one JSON object a line")).collect();
    assert_eq!(facts.len(), 3, "{said}");
    assert_eq!(facts[0]["cpuidle_driver"], "haltpoll");
    assert_eq!(facts[0]["guest_halt_poll_ns"], 0);
    let note = facts[0]["note"].as_str().expect("a note when idle vCPUs halt at once");
    assert!(note.contains("halt without polling"), "{note}");
    assert_eq!(facts[1]["guest_halt_poll_ns"], 200_000);
    assert!(facts[1]["note"].is_null(), "{}", facts[1]);
    assert!(facts[2]["cpuidle_driver"].is_null() && facts[2]["note"].is_null(), "{}", facts[2]);
    assert!(facts.iter().all(|f| f["cpus"].as_u64().is_some_and(|n| n >= 1)), "{said}");
}

/// `loadtest/run`'s `wakeup_interrupts`, which `loadtest/phases` reports per connection,
/// sums the rescheduling and function-call interrupts of every CPU, as x86 and arm64 name
/// them in /proc/interrupts, and nothing else (timer, TLB and device rows left out); a
/// file without those rows, or no file, gives None, not 0.
#[test]
fn loadtest_counts_wakeup_interrupts() {
    let test = "loadtest_counts_wakeup_interrupts";
    if !python_available(test) {
        return;
    }
    let dir = tempfile::tempdir().expect("a temporary directory");
    let x86 = "            CPU0       CPU1\n   \
               1:          9          0  IO-APIC   1-edge      i8042\n \
               LOC:        100        200   Local timer interrupts\n \
               RES:         10         20   Rescheduling interrupts\n \
               CAL:          1          2   Function call interrupts\n \
               TLB:          5          5   TLB shootdowns\n \
               ERR:          0\n";
    let arm64 = "           CPU0       CPU1       CPU2\n\
                 IPI0:         3          4          5       Rescheduling interrupts\n\
                 IPI1:         7          0          1       Function call interrupts\n\
                 IPI2:         9          9          9       CPU stop interrupts\n";
    let none = "           CPU0\n  0:         44   IO-APIC   2-edge      timer\n";
    let mut files: Vec<_> = [("x86", x86), ("arm64", arm64), ("none", none)]
        .iter()
        .map(|(name, text)| {
            let p = dir.path().join(name);
            std::fs::write(&p, text).unwrap();
            p
        })
        .collect();
    files.push(dir.path().join("missing"));
    let args: Vec<&std::ffi::OsStr> = files.iter().map(|p| p.as_os_str()).collect();
    let said = with_loadtest_run(
        "print(' '.join(str(m.wakeup_interrupts(p)) for p in sys.argv[1:]))",
        &args,
    );
    assert_eq!(said.trim(), "33 20 None None");
}

/// `loadtest/run`'s summary gives tierproxy's median over each kernel baseline that ran
/// (`tierproxy_vs_kernel_ct`, `tierproxy_vs_kernel_tproxy`: how much of its gap to plain
/// forwarding is conntrack, TPROXY's fixed costs, and its own), and the per-variant table
/// shows the `kernel-tproxy` column and ratio only when that variant ran. From rows as
/// `record` writes them: two rounds each of kernel, kernel-ct, kernel-tproxy and tierproxy
/// on one metric, medians 100, 90, 80 and 72.
#[test]
fn loadtest_summary_sets_tierproxy_against_each_kernel_baseline() {
    let test = "loadtest_summary_sets_tierproxy_against_each_kernel_baseline";
    if !python_available(test) {
        return;
    }
    let body = "rows = []\n\
        for v, name, vals in [('kernel', 'udp_c8_packets_per_s.same', (99, 101)),\n\
                              ('kernel-ct', 'kernel-ct.udp_c8_packets_per_s.same', (89, 91)),\n\
                              ('kernel-tproxy', 'kernel-tproxy.udp_c8_packets_per_s.same', (79, 81)),\n\
                              ('tierproxy', 'udp_c8_packets_per_s.same', (71, 73))]:\n\
        \x20   rows += [{'variant': v, 'round': i, 'metric': name, 'value': x, 'unit': '1/s'}\n\
        \x20            for i, x in enumerate(vals)]\n\
        for keep in (True, False):\n\
        \x20   s = m.summarize([r for r in rows if keep or r['variant'] != 'kernel-tproxy'])\n\
        \x20   e = s['udp_c8_packets_per_s.same']\n\
        \x20   print(json.dumps({k: e[k] for k in ('ratio', 'tierproxy_vs_kernel_ct',\n\
        \x20                                      'tierproxy_vs_kernel_tproxy')}))\n\
        \x20   print(json.dumps(m.variant_table(s).splitlines()))";
    let said = with_loadtest_run(body, &[]);
    let lines: Vec<serde_json::Value> =
        said.lines().map(|l| serde_json::from_str(l).expect("one JSON value a line")).collect();
    assert_eq!(lines.len(), 4, "{said}");
    let close = |v: &serde_json::Value, want: f64| {
        assert!(v.as_f64().is_some_and(|x| (x - want).abs() < 1e-9), "{v} is not {want}: {said}");
    };
    close(&lines[0]["ratio"], 0.72);
    close(&lines[0]["tierproxy_vs_kernel_ct"], 0.8);
    close(&lines[0]["tierproxy_vs_kernel_tproxy"], 0.9);
    let table = |i: usize| -> Vec<String> {
        let rows = lines[i].as_array().expect("the table's lines");
        rows.iter().map(|l| l.as_str().unwrap_or_default().to_owned()).collect()
    };
    let with = table(1);
    assert!(with[0].contains("kernel-tproxy (ratio)"), "{with:?}");
    assert!(with[0].contains("tierproxy/kernel-tproxy"), "{with:?}");
    let row = with.iter().find(|l| l.starts_with("udp_c8_packets_per_s.same")).expect("the row");
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cells.last(), Some(&"0.9"), "tierproxy over kernel-tproxy last: {row}");
    // Without the variant: tierproxy over kernel-tproxy is unknown, and no column says it.
    assert!(lines[2]["tierproxy_vs_kernel_tproxy"].is_null(), "{said}");
    let without = table(3);
    assert!(!without[0].contains("kernel-tproxy"), "{without:?}");
}

/// Every label `loadtest/run` puts in a gnuplot script sits between single quotes there
/// (`title '...'`): one holding a quote would end the string early, and gnuplot then
/// rejects the script and no chart is written (seen with the first `kernel-tproxy` label).
#[test]
fn loadtest_plot_labels_hold_no_single_quote() {
    let test = "loadtest_plot_labels_hold_no_single_quote";
    if !python_available(test) {
        return;
    }
    let said = with_loadtest_run(
        "print(json.dumps(sorted({*m.LABEL.values(), *m.COMPARED.values()})))",
        &[],
    );
    let labels: Vec<String> = serde_json::from_str(said.trim()).expect("a JSON list");
    assert!(labels.iter().any(|l| l.contains("TPROXY")), "{labels:?}");
    let quoted: Vec<&String> = labels.iter().filter(|l| l.contains('\'')).collect();
    assert!(quoted.is_empty(), "labels with a single quote: {quoted:?}");
}
