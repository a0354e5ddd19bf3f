//! `deploy/otel-collector/config.yaml`, the OpenTelemetry Collector configuration that maps
//! tierproxy's audit events to OCSF Network Activity: every pipeline (and every pipeline
//! left commented out as an example) names only defined components, the OTTL statements
//! read only attributes tierproxy emits (the crate's own attribute names) and the event
//! names and close reasons it has, and the README's mapping table names every OCSF field
//! the statements write. No collector and no network: the file is parsed and read.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_json::Value;
use tierproxy::audit::CloseReason;
use tierproxy::audit::event::{self, attr};
use tierproxy::policy::{Kind, Verdict};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/otel-collector")
}

fn read(name: &str) -> String {
    let p = dir().join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()))
}

fn config() -> (String, Value) {
    let text = read("config.yaml");
    let v = serde_saphyr::from_str::<Value>(&text).expect("config.yaml is valid YAML");
    (text, v)
}

/// The component ids defined in top-level section `kind` (`receivers`, `processors`, …).
fn defined(cfg: &Value, kind: &str) -> BTreeSet<String> {
    cfg[kind].as_object().map(|m| m.keys().cloned().collect()).unwrap_or_default()
}

/// The ids of a YAML flow list written on one line, e.g. `[memory_limiter, batch]`.
fn flow_list(s: &str) -> Option<Vec<String>> {
    let inner = s.trim().strip_prefix('[')?.strip_suffix(']')?;
    Some(inner.split(',').map(|x| x.trim().to_string()).filter(|x| !x.is_empty()).collect())
}

const KINDS: [&str; 3] = ["receivers", "processors", "exporters"];

#[test]
fn every_pipeline_uses_defined_components() {
    let (text, cfg) = config();
    let pipelines = cfg["service"]["pipelines"].as_object().expect("service.pipelines");
    assert!(!pipelines.is_empty(), "no pipeline");
    for (name, p) in pipelines {
        assert!(name == "logs" || name.starts_with("logs/"), "{name}: audit events are logs");
        for kind in KINDS {
            let ids: Vec<&str> = p[kind]
                .as_array()
                .map(|a| a.iter().map(|v| v.as_str().expect("component id")).collect())
                .unwrap_or_default();
            if kind != "processors" {
                assert!(!ids.is_empty(), "{name}: no {kind}");
            }
            let known = defined(&cfg, kind);
            for id in ids {
                assert!(known.contains(id), "{name}: {kind} {id:?} is not defined");
            }
        }
    }
    let extensions = defined(&cfg, "extensions");
    for id in cfg["service"]["extensions"].as_array().into_iter().flatten() {
        let id = id.as_str().expect("extension id");
        assert!(extensions.contains(id), "extension {id:?} is not defined");
    }

    // The example pipelines left commented out must work once uncommented.
    let mut commented = BTreeSet::new();
    for line in text.lines() {
        let Some(rest) = line.trim_start().strip_prefix('#') else { continue };
        let rest = rest.trim();
        for kind in KINDS {
            let Some(list) = rest.strip_prefix(kind).and_then(|r| r.strip_prefix(':')) else {
                continue;
            };
            let ids = flow_list(list).unwrap_or_else(|| panic!("commented {kind}: {line:?}"));
            let known = defined(&cfg, kind);
            for id in ids {
                assert!(known.contains(&id), "commented pipeline: {kind} {id:?} is not defined");
                commented.insert(id);
            }
        }
    }
    for example in ["splunk_hec", "elasticsearch"] {
        let active = pipelines.values().any(|p| {
            p["exporters"].as_array().into_iter().flatten().any(|e| e.as_str() == Some(example))
        });
        assert!(
            active || commented.contains(example),
            "no pipeline (active or commented) exports to {example}"
        );
    }
}

/// The OTTL statements and conditions of every transform processor.
fn ottl(cfg: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for (id, p) in cfg["processors"].as_object().expect("processors") {
        if id != "transform" && !id.starts_with("transform/") {
            continue;
        }
        for group in p["log_statements"].as_array().expect("log_statements") {
            assert_eq!(group["context"], "log", "{id}: statements in the log context");
            for key in ["conditions", "statements"] {
                for s in group[key].as_array().into_iter().flatten() {
                    out.push(s.as_str().expect("an OTTL string").to_string());
                }
            }
        }
    }
    out
}

/// Whether tierproxy emits log attribute `key` (src/audit/event.rs).
fn emitted(key: &str) -> bool {
    let fixed = [
        attr::TRANSPORT,
        attr::NETWORK_TYPE,
        attr::SRC_ADDR,
        attr::SRC_PORT,
        attr::DST_ADDR,
        attr::DST_PORT,
        attr::NODE,
        attr::RULE_NAME,
        attr::RULESET,
        attr::DIRECTION,
        attr::VERDICT,
        attr::FLOW_VERDICT,
        attr::BASIS,
        attr::TIER,
        attr::POLICY_KIND,
        attr::POLICY_API_VERSION,
        attr::POLICY_NAMESPACE,
        attr::POLICY_NAME,
        attr::RULE_INDEX,
        attr::RULE_ACTION,
        attr::FAIL_CLOSED,
        attr::LOG_LABEL,
        attr::PASS_CHAIN,
        attr::REVISION,
        attr::COUNT,
        attr::LAST_SEEN,
        attr::CLOSE_REASON,
        attr::BYTES_TO_SERVER,
        attr::BYTES_TO_CLIENT,
        attr::DURATION_MS,
        attr::SUPPRESSED_COUNT,
        attr::SUPPRESSED_BY,
    ];
    if fixed.contains(&key) {
        return true;
    }
    // Per end: tierproxy.source.* and tierproxy.destination.*.
    ["source", "destination"].iter().any(|side| {
        let Some(rest) = key.strip_prefix(event::PREFIX).and_then(|k| k.strip_prefix(side)) else {
            return false;
        };
        let Some(rest) = rest.strip_prefix('.') else { return false };
        ["kind", "k8s.namespace.name", "k8s.pod.name", "k8s.node.name"].contains(&rest)
            || rest.strip_prefix("k8s.pod.label.").is_some_and(|l| !l.is_empty())
    })
}

/// The keys of every `attributes["…"]` in `s`, each with whether it is a resource
/// attribute (`resource.attributes["…"]`).
fn attribute_refs(s: &str) -> Vec<(bool, String)> {
    const OPEN: &str = "attributes[\"";
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(i) = s[from..].find(OPEN) {
        let at = from + i;
        let rest = &s[at + OPEN.len()..];
        let key = rest.split('"').next().unwrap_or_default().to_string();
        out.push((s[..at].ends_with("resource."), key));
        from = at + OPEN.len();
    }
    out
}

/// The OCSF field paths written under the staging attribute: `attributes["ocsf"]["a"]["b"]`
/// gives `a.b`.
fn ocsf_paths(s: &str) -> BTreeSet<String> {
    const STAGE: &str = "attributes[\"ocsf\"]";
    let mut out = BTreeSet::new();
    let mut from = 0;
    while let Some(i) = s[from..].find(STAGE) {
        let mut rest = &s[from + i + STAGE.len()..];
        let mut path = Vec::new();
        while let Some(r) = rest.strip_prefix("[\"") {
            let Some(end) = r.find("\"]") else { break };
            path.push(&r[..end]);
            rest = &r[end + 2..];
        }
        if !path.is_empty() {
            out.insert(path.join("."));
        }
        from += i + STAGE.len();
    }
    out
}

#[test]
fn ocsf_transform_reads_only_what_tierproxy_emits() {
    let (_, cfg) = config();
    let statements = ottl(&cfg);
    assert!(!statements.is_empty(), "no OTTL statement");
    let all = statements.join("\n");

    let mut read = BTreeSet::new();
    for s in &statements {
        for (resource, key) in attribute_refs(s) {
            if resource {
                assert!(
                    ["service.name", "service.version", "k8s.node.name"].contains(&key.as_str()),
                    "resource attribute {key:?} is not in tierproxy's resource: {s}"
                );
            } else if key == "ocsf" || key.starts_with("ocsf.") {
                // The OCSF output being built.
            } else {
                assert!(emitted(&key), "attribute {key:?} is not one tierproxy emits: {s}");
                read.insert(key);
            }
        }
    }
    for key in [attr::SRC_ADDR, attr::DST_ADDR, attr::VERDICT, attr::CLOSE_REASON, attr::RULE_NAME]
    {
        assert!(read.contains(key), "the mapping never reads {key}");
    }

    // Event names: only tierproxy's, and all of them.
    const EQ: &str = "event_name == \"";
    let names: BTreeSet<&str> =
        all.match_indices(EQ).filter_map(|(i, _)| all[i + EQ.len()..].split('"').next()).collect();
    let expected = BTreeSet::from([event::DECISION, event::CONNECTION_END, event::SUPPRESSED]);
    assert_eq!(names, expected, "event names compared in the OTTL");

    // Every close reason has an activity.
    for r in [
        CloseReason::Normal,
        CloseReason::Reset,
        CloseReason::Timeout,
        CloseReason::PolicyChange,
        CloseReason::Shutdown,
        CloseReason::UpstreamUnreachable,
    ] {
        let cond = format!("attributes[\"{}\"] == \"{}\"", attr::CLOSE_REASON, r.as_str());
        assert!(all.contains(&cond), "close reason {:?} is not mapped", r.as_str());
    }
    // Every verdict has an action (this direction's) and an activity (the flow's); a new
    // verdict breaks this match, and so this test, until the transform maps it.
    let verdicts = [Verdict::Allow, Verdict::Deny, Verdict::Reject];
    for v in verdicts {
        match v {
            Verdict::Allow | Verdict::Deny | Verdict::Reject => {}
        }
        for key in [attr::VERDICT, attr::FLOW_VERDICT] {
            let cond = format!("attributes[\"{key}\"] == \"{}\"", v.as_str());
            assert!(all.contains(&cond), "{key} {:?} is not mapped", v.as_str());
        }
    }
    // Antrea's kinds are told from the upstream ones of the same name by the apiVersion
    // tierproxy emits for them.
    for k in [Kind::AntreaClusterNetworkPolicy, Kind::AntreaNetworkPolicy] {
        let cond =
            format!("attributes[\"{}\"] == \"{}\"", attr::POLICY_API_VERSION, k.api_version());
        assert!(all.contains(&cond), "{k} is not told apart: no {cond}");
        let qualified = format!(
            "Concat([attributes[\"{}\"], \"{}\"], \".\")",
            attr::POLICY_KIND,
            k.api_group()
        );
        assert!(all.contains(&qualified), "{k} is not qualified: no {qualified}");
    }

    // The class, and the body swap that makes the OCSF event the record's body.
    for s in [
        "set(attributes[\"ocsf\"][\"class_uid\"], 4001)",
        "set(attributes[\"ocsf\"][\"category_uid\"], 4)",
        "set(body, attributes[\"ocsf\"])",
        "delete_key(attributes, \"ocsf\")",
    ] {
        assert!(statements.iter().any(|t| t == s), "missing statement {s}");
    }
    assert_eq!(statements.last().map(String::as_str), Some("delete_key(attributes, \"ocsf\")"));
}

#[test]
fn readme_maps_every_ocsf_field_the_config_writes() {
    let (_, cfg) = config();
    let readme = read("README.md");
    let mut paths = BTreeSet::new();
    for s in ottl(&cfg) {
        paths.extend(ocsf_paths(&s));
    }
    assert!(paths.contains("src_endpoint.ip") && paths.contains("firewall_rule.name"));
    for p in &paths {
        assert!(readme.contains(&format!("`{p}`")), "README.md does not list OCSF field `{p}`");
    }
}
