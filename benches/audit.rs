//! Audit pipeline throughput: events per second, and per CPU-second of the pipeline's own
//! threads (`audit`, `audit-otlp`, `audit-json`), delivered into a local receiver.
//!
//! Each run hands `EVENTS` decisions of the examples' cluster (`examples/`) to a lossless
//! pipeline (so nothing is dropped and the figure is what it sustains) with every event
//! logged (allow sampling 1, no aggregation, no rate limit), and waits until the sink has
//! delivered all of them. Sinks: OTLP over HTTP/protobuf and over gRPC into the in-process
//! receiver (which runs on a thread of its own, not counted), and JSON Lines into
//! `/dev/null` (the cost of rendering and serialising alone).
//!
//! Run: `cargo bench --bench audit` (prints a table; issue #4 target ≥ 100,000 events/s
//! per core).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime};

use tierproxy::audit::limit::Limits;
use tierproxy::audit::receiver::Receiver;
use tierproxy::audit::{
    AuditConfig, Auditor, Defaults, FlowInfo, JsonTarget, Mode, OtlpConfig, OtlpProtocol,
    Selection, SinkConfig,
};
use tierproxy::policy::{Decision, Flow, FlowKey, Protocol, Revision, Snapshot};

const EVENTS: u64 = 300_000;

/// CPU seconds (user + system) of this process's threads whose name starts with `audit`.
fn pipeline_cpu() -> f64 {
    let tick = 100.0; // USER_HZ on Linux
    let mut total = 0u64;
    for t in std::fs::read_dir("/proc/self/task").into_iter().flatten().flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if !comm.starts_with("audit") {
            continue;
        }
        let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
        // Fields after the command name (which ends with ')'): utime is the 14th field of
        // the line, stime the 15th.
        let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
        let f: Vec<&str> = rest.split_whitespace().collect();
        let utime: u64 = f.get(11).and_then(|s| s.parse().ok()).unwrap_or(0);
        let stime: u64 = f.get(12).and_then(|s| s.parse().ok()).unwrap_or(0);
        total += utime + stime;
    }
    total as f64 / tick
}

fn decisions(s: &Snapshot) -> Vec<(FlowInfo, Arc<Decision>)> {
    // The examples' probes: a mix of allows, denies (each tier) and Pass chains.
    let text = std::fs::read_to_string("examples/probes.jsonl").expect("examples/probes.jsonl");
    let mut out = Vec::new();
    for line in text.lines() {
        let v: serde_json::Value = match serde_json::from_str(line) {
            Ok(v) => v,
            Err(_) => continue,
        };
        let (Some(from), Some(to), Some(port)) =
            (v["from"].as_str(), v["to"].as_str(), v["port"].as_u64())
        else {
            continue;
        };
        let ip_of = |who: &str| -> Option<std::net::IpAddr> {
            if let Ok(ip) = who.parse() {
                return Some(ip);
            }
            let (ns, name) = who.split_once('/')?;
            if ns == "node" {
                return s.node_addrs(s.find_node(name)?).first().copied();
            }
            s.pod_ips(s.find_pod(ns, name)?).first().copied()
        };
        let (Some(src), Some(dst)) = (ip_of(from), ip_of(to)) else { continue };
        let flow = Flow { src, dst, protocol: Protocol::Tcp, dst_port: port as u16 };
        let d = Arc::new(s.decide(&flow));
        if d.egress.is_none() && d.ingress.is_none() {
            continue;
        }
        let info = FlowInfo {
            key: FlowKey {
                src: (src, 40000).into(),
                dst: (dst, port as u16).into(),
                protocol: Protocol::Tcp,
            },
            time: SystemTime::now(),
            point: Default::default(),
        };
        out.push((info, d));
    }
    out
}

/// Whether the run `name` was asked for: `cargo bench --bench audit -- [WORD...]` runs
/// the sinks whose name contains a word (all without words).
fn wanted(name: &str) -> bool {
    let words: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    words.is_empty() || words.iter().any(|w| name.contains(w.as_str()))
}

fn run(name: &str, sink: SinkConfig, s: &Arc<Snapshot>, flows: &[(FlowInfo, Arc<Decision>)]) {
    let mut c = AuditConfig::new("bench-node", vec![sink]);
    c.mode = Mode::Lossless;
    c.defaults = Defaults { allow_sample: 1, deny: true, pass: true, close: true };
    c.deny_window = Duration::ZERO;
    c.limits = Limits { per_rule: 0.0, node: 0.0 };
    c.context = tierproxy::audit::event::Context::new("bench-node", vec!["app".into()]);
    let (plan, _) = Selection::new(s, c.defaults);
    let auditor = Auditor::start(c).expect("pipeline starts");
    let cpu0 = pipeline_cpu();
    let t0 = Instant::now();
    let mut submitted = 0u64;
    let mut i = 0usize;
    let mut port = 0u16;
    while submitted < EVENTS {
        let (mut info, d) = flows[i % flows.len()].clone();
        info.key.src.set_port(1024 + port % 60000);
        port = port.wrapping_add(1);
        i += 1;
        if auditor.decision(&plan, s, info, &d) {
            submitted += 1;
        }
    }
    let deadline = Instant::now() + Duration::from_secs(300);
    let emitted = || auditor.stats().emitted.load(Ordering::Relaxed);
    while (auditor.queue_depth() > 0
        || auditor.stats().sinks[0].exported.load(Ordering::Relaxed) < emitted())
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(2));
    }
    let wall = t0.elapsed().as_secs_f64();
    let cpu = pipeline_cpu() - cpu0;
    let delivered = auditor.stats().sinks[0].exported.load(Ordering::Relaxed);
    auditor.shutdown();
    println!(
        "{name:<22} {delivered:>8} events  {:>9.0} events/s  {:>9.0} events per pipeline CPU-second  ({cpu:.2} CPU-s in {wall:.2} s)",
        delivered as f64 / wall,
        delivered as f64 / cpu.max(1e-9),
    );
}

fn main() {
    let (manifests, _) = tierproxy::lab::example_inputs(&tierproxy::lab::examples_dir());
    let loaded = tierproxy::cluster::manifest::load(&manifests);
    let s = Arc::new(Snapshot::compile(&loaded.inputs, Revision(1)).snapshot);
    let flows = decisions(&s);
    assert!(!flows.is_empty(), "no decidable probe in examples/");
    println!("audit pipeline, {EVENTS} events per sink, {} distinct decisions", flows.len());
    for protocol in [OtlpProtocol::HttpProtobuf, OtlpProtocol::Grpc] {
        let name = match protocol {
            OtlpProtocol::HttpProtobuf => "otlp http/protobuf",
            OtlpProtocol::Grpc => "otlp grpc",
        };
        if !wanted(name) {
            continue;
        }
        let receiver = Receiver::start_with(protocol, "127.0.0.1:0".parse().unwrap(), None, false)
            .expect("receiver");
        let sink = SinkConfig::Otlp(OtlpConfig {
            protocol: Some(protocol),
            endpoint: Some(receiver.endpoint()),
            ..OtlpConfig::from_env()
        });
        run(name, sink, &s, &flows);
        assert!(receiver.count() > 0, "the receiver got nothing");
    }
    let sink = SinkConfig::Json(JsonTarget::File {
        path: "/dev/null".into(),
        max_bytes: usize::MAX,
        keep: 1,
    });
    if wanted("json lines /dev/null") {
        run("json lines /dev/null", sink, &s, &flows);
    }
}
