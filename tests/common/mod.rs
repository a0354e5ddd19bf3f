//! Helpers shared by the test binaries: the skip-or-fail checks for CAP_NET_ADMIN (the
//! network-namespace tests: `lab_netns`, `datapath_netns`, ...) and for the tools a test
//! drives (python3, its packages, kubectl), and a lab guard that runs `lab down` when
//! dropped, also when the test panics.
#![allow(dead_code)] // each test binary uses a different subset

pub mod apiserver;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::Value;

pub fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tierproxy"))
}

/// Whether the lab can run here; prints the skip line (or panics when netns tests are
/// required) when it cannot.
pub fn netns_available(test: &str) -> bool {
    let missing = tierproxy::lab::netns::missing_capabilities();
    let ip = Command::new("ip").arg("-V").output().is_ok();
    if missing.is_empty() && ip {
        return true;
    }
    let why = if missing.is_empty() {
        "no `ip` command".to_string()
    } else {
        format!("missing {}", missing.join(", "))
    };
    skip(test, &format!("CAP_NET_ADMIN ({why})"))
}

/// [`netns_available`], and every program of `tools` runs here (`--version`); prints the
/// skip line naming the missing ones (or panics when netns tests are required) when not.
pub fn tools_available(test: &str, tools: &[&str]) -> bool {
    if !netns_available(test) {
        return false;
    }
    let missing: Vec<&str> = tools
        .iter()
        .copied()
        .filter(|tool| Command::new(tool).arg("--version").output().is_err())
        .collect();
    missing.is_empty() || skip(test, &format!("{} on PATH", missing.join(", ")))
}

/// Says that `test` cannot run because it `needs` something: `SKIPPED: <test>: needs
/// <needs>` on standard error, or a panic under `TIERPROXY_REQUIRE_NETNS=1` (CI), so that
/// a skip never passes silently there. Returns `false`.
fn skip(test: &str, needs: &str) -> bool {
    if std::env::var("TIERPROXY_REQUIRE_NETNS").as_deref() == Ok("1") {
        panic!("{test}: needs {needs} and TIERPROXY_REQUIRE_NETNS=1");
    }
    // Straight to the process's stderr: libtest captures `eprintln!` of passing tests, and
    // a skip must be seen.
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED: {test}: needs {needs}");
    false
}

/// Says that `test` cannot run because a tool it drives is missing (`why`): `SKIPPED:
/// <test>: <why>` on standard error, or a panic under `TIERPROXY_REQUIRE_TOOLS=1` (CI), so
/// that the skip never passes silently there. Returns `false`.
pub fn skip_without_tool(test: &str, why: &str) -> bool {
    if std::env::var("TIERPROXY_REQUIRE_TOOLS").as_deref() == Ok("1") {
        panic!("{test}: {why}, and TIERPROXY_REQUIRE_TOOLS=1");
    }
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED: {test}: {why}");
    false
}

/// Whether `python3` runs with every module of `modules` importable (none: the standard
/// library); else [`skip_without_tool`] with `missing`.
pub fn python_available(test: &str, modules: &[&str], missing: &str) -> bool {
    let mut cmd = Command::new("python3");
    if modules.is_empty() {
        cmd.arg("--version");
    } else {
        cmd.args(["-c", &format!("import {}", modules.join(", "))]);
    }
    let ok = cmd
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    ok || skip_without_tool(test, missing)
}

/// The snapshot of manifest text `cluster` plus `policies` (revision 1), asserting that
/// nothing in it is an error: the engine tables' fixture.
pub fn compile_clean(cluster: &str, policies: &str) -> tierproxy::policy::Snapshot {
    let text = format!("{cluster}\n---\n{policies}");
    let loaded = tierproxy::cluster::manifest::parse_str(Path::new("test.yaml"), &text)
        .expect("test YAML parses");
    assert!(loaded.problems.iter().all(|p| !p.is_error()), "load problems: {:?}", loaded.problems);
    let compiled =
        tierproxy::policy::Snapshot::compile(&loaded.inputs, tierproxy::policy::Revision(1));
    let errors: Vec<_> = compiled.problems.iter().filter(|p| p.is_error()).collect();
    assert!(errors.is_empty(), "compile errors: {errors:?}");
    compiled.snapshot
}

/// A lab prefix unique to this test and this test process.
pub fn prefix(short: &str) -> String {
    format!("t{}-{short}", std::process::id() % 100_000)
}

/// The namespace of pod `ns/pod` in `lab`.
pub fn netns_of_pod(lab: &Lab, ns: &str, pod: &str) -> String {
    format!("{}_pod_{ns}_{pod}", lab.prefix)
}

/// The namespace of node `node` in `lab`.
pub fn netns_of_node(lab: &Lab, node: &str) -> String {
    format!("{}_node_{node}", lab.prefix)
}

/// Wraps a test's I/O error as a [`LabError`] naming `what`, for `in_netns` closures.
pub fn io(what: &str) -> impl Fn(std::io::Error) -> tierproxy::lab::LabError + '_ {
    move |e| tierproxy::lab::LabError::Netns {
        netns: what.to_string(),
        what: "test I/O".into(),
        source: e,
    }
}

/// The HTTP/1.0 response (status line, headers, body) of a lab agent's metrics server at
/// 127.0.0.1:9464 in `netns` (the agent started with `--metrics-addr=127.0.0.1:9464`) to
/// `GET path`.
pub fn agent_http(netns: &str, path: &str) -> String {
    use std::io::{Read, Write};
    tierproxy::lab::netns::in_netns(netns, || {
        let mut s = std::net::TcpStream::connect("127.0.0.1:9464").map_err(io(netns))?;
        s.set_read_timeout(Some(Duration::from_secs(5))).map_err(io(netns))?;
        write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").map_err(io(netns))?;
        let mut body = String::new();
        s.read_to_string(&mut body).map_err(io(netns))?;
        Ok(body)
    })
    .expect("metrics reachable in the node's namespace")
}

/// The value of the first sample of `metrics` (a Prometheus text exposition) whose line
/// starts with `sample` (a name, with labels if any). Panics, showing `metrics`, if none.
pub fn metric_value(metrics: &str, sample: &str) -> f64 {
    metrics
        .lines()
        .find(|l| l.starts_with(sample))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no {sample} in\n{metrics}"))
}

/// `f()` (one blocking receive), again while it fails with `Interrupted`. A receive on a
/// socket with a timeout (`SO_RCVTIMEO`, `set_read_timeout`) is never restarted after a
/// signal, even one whose handler asked for it (signal(7), "Interruption of system calls
/// and library functions by signal handlers"), and std's `read` and `recv` pass that
/// `EINTR` on (its `read_exact` and `read_line` retry it). Seen once in CI, as a reset
/// test's read failing with "Interrupted system call".
pub fn retrying<T>(mut f: impl FnMut() -> std::io::Result<T>) -> std::io::Result<T> {
    loop {
        match f() {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            other => return other,
        }
    }
}

/// What a connected UDP socket of `netns`, bound to `from` (port 0), hears back within
/// 5 s after sending one datagram to `to`: `Ok(())` for an answer, else the error's kind
/// (`ConnectionRefused` for an ICMP port unreachable, `WouldBlock` for nothing).
pub fn udp_answer(netns: &str, from: &str, to: &str) -> Result<(), std::io::ErrorKind> {
    tierproxy::lab::netns::in_netns(netns, || {
        let s = std::net::UdpSocket::bind(from).map_err(io("bind"))?;
        s.connect(to).map_err(io("connect"))?;
        s.set_read_timeout(Some(Duration::from_secs(5))).map_err(io("timeout"))?;
        s.send(b"anyone there?").map_err(io("send"))?;
        let mut buf = [0u8; 64];
        Ok(retrying(|| s.recv(&mut buf)).map(|_| ()).map_err(|e| e.kind()))
    })
    .expect("the UDP client runs")
}

/// Whether a new TCP connection from `netns` to `to` is made within `timeout`.
pub fn connects(netns: &str, to: &str, timeout: std::time::Duration) -> bool {
    tierproxy::lab::netns::in_netns(netns, || {
        Ok(std::net::TcpStream::connect_timeout(&to.parse().unwrap(), timeout).is_ok())
    })
    .expect("netns")
}

/// `ip netns exec <netns> <cmd...>`'s standard output; panics, with its output, when it
/// fails.
pub fn netns_out(netns: &str, cmd: &[&str]) -> String {
    let o = Command::new("ip")
        .args(["netns", "exec", netns])
        .args(cmd)
        .output()
        .expect("ip netns exec runs");
    assert!(o.status.success(), "{cmd:?} in {netns}: {}", text(&o));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Namespaces whose names start with `<prefix>_`.
pub fn lab_netns(prefix: &str) -> Vec<String> {
    let out = Command::new("ip").args(["netns", "list"]).output().expect("ip netns list");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(&format!("{prefix}_")))
        .map(str::to_string)
        .collect()
}

/// Whether process `pid` has a thread that has not exited ([`tierproxy::lab::procs::alive`]).
pub fn alive(pid: u64) -> bool {
    tierproxy::lab::procs::alive(pid as i32)
}

/// A lab under a test's own prefix; dropping it runs `lab down`.
pub struct Lab {
    pub prefix: String,
    pub dir: tempfile::TempDir,
}

impl Lab {
    /// The guard alone (nothing built yet), with a temp dir for the test's files.
    pub fn new(short: &str) -> Lab {
        Lab { prefix: prefix(short), dir: tempfile::tempdir().expect("temp dir") }
    }

    pub fn file(&self, name: &str, content: &str) -> PathBuf {
        let p = self.dir.path().join(name);
        std::fs::write(&p, content).expect("test file written");
        p
    }

    /// `tierproxy lab <args[0]> --prefix <prefix> <args[1..]>`.
    pub fn lab(&self, args: &[&str]) -> Output {
        bin()
            .arg("lab")
            .args(&args[..1])
            .args(["--prefix", &self.prefix])
            .args(&args[1..])
            .output()
            .expect("tierproxy runs")
    }

    /// `lab up --no-agents`; panics (the guard still cleans up) if it fails.
    pub fn up(&self, manifests: &[&Path], probes: Option<&Path>) -> Output {
        self.up_with(false, manifests, probes)
    }

    /// `lab up`, with a tierproxy agent on every node when `agents`; panics (the guard
    /// still cleans up) if it fails.
    pub fn up_with(&self, agents: bool, manifests: &[&Path], probes: Option<&Path>) -> Output {
        let mut args = vec!["up"];
        if !agents {
            args.push("--no-agents");
        }
        args.push("--manifests");
        args.extend(manifests.iter().map(|p| p.to_str().unwrap()));
        if let Some(p) = probes {
            args.extend(["--probes", p.to_str().unwrap()]);
        }
        let o = self.lab(&args);
        assert!(o.status.success(), "lab up failed: {}", text(&o));
        o
    }

    /// `lab probe --output json`: the parsed lines and the exit code.
    pub fn probe(&self, probes: &Path) -> (Vec<Value>, Option<i32>, Output) {
        let o = self.lab(&["probe", "--output", "json", "--probes", probes.to_str().unwrap()]);
        let lines = String::from_utf8_lossy(&o.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}\n{}", text(&o))))
            .collect();
        (lines, o.status.code(), o)
    }

    pub fn state(&self) -> Value {
        let path = Path::new("/run/tierproxy-lab").join(&self.prefix).join("state.json");
        serde_json::from_str(&std::fs::read_to_string(&path).expect("state file")).expect("json")
    }

    pub fn pids(&self) -> Vec<u64> {
        self.state()["processes"]
            .as_array()
            .expect("processes")
            .iter()
            .map(|p| p["pid"].as_u64().expect("pid"))
            .collect()
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        let o = self.lab(&["down"]);
        if !o.status.success() {
            eprintln!("cleanup of lab {} failed: {}", self.prefix, text(&o));
        }
    }
}

/// The established TCP sockets of `netns` (`ss -tnH state established`), as (local, peer)
/// address strings.
pub fn established(netns: &str) -> Vec<(String, String)> {
    let o = Command::new("ip")
        .args(["netns", "exec", netns, "ss", "-tnH", "state", "established"])
        .output()
        .expect("ss");
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            (w.len() >= 4).then(|| (w[2].to_string(), w[3].to_string()))
        })
        .collect()
}

/// The audit events of the lab agent on `node` (its JSON Lines file; none if it has none).
pub fn audit_events(lab: &Lab, node: &str) -> Vec<Value> {
    let path =
        Path::new("/run/tierproxy-lab").join(&lab.prefix).join(format!("audit-{node}.jsonl"));
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// Waits (bounded) until the audit file of one of `nodes` holds an event for which `f`
/// holds.
pub fn wait_for_event_on(lab: &Lab, nodes: &[&str], f: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(5);
    let node = nodes.join(", ");
    loop {
        let all: Vec<Value> = nodes.iter().flat_map(|n| audit_events(lab, n)).collect();
        if let Some(e) = all.into_iter().find(|e| f(e)) {
            return e;
        }
        assert!(
            Instant::now() < deadline,
            "no such audit event on {node}; it has:\n{}",
            nodes
                .iter()
                .flat_map(|n| audit_events(lab, n))
                .map(|e| e.to_string())
                .collect::<Vec<_>>()
                .join("\n")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
