//! `deploy/`: the committed CRDs are what `tierproxy crds` prints, every manifest a cluster
//! admin applies is valid against the Kubernetes schemas of two releases (1.31, the oldest
//! the CRDs' `isCIDR` rules run on, and 1.37) and against the CRDs, and so is every object
//! under `examples/`. The container build file and the DaemonSet agree on the entrypoint,
//! and the entrypoint picks the iptables flavour kubelet uses. `tierproxy crds --antrea`
//! (not committed) prints structural CRDs that the objects under `tests/antrea-crds/`
//! validate against exactly as `tierproxy check` judges them. The ClusterRole reads exactly
//! what the API-server source watches.
//!
//! The schema validation runs `tests/validate_manifests.py` (PyPI `kubernetes-validate`,
//! which bundles the Kubernetes JSON schemas: offline) over `kubectl kustomize deploy/`
//! (kubectl's built-in kustomize: offline). Without python3, the package or kubectl a test
//! prints `SKIPPED: <why>` and passes, unless TIERPROXY_REQUIRE_TOOLS=1 (CI sets it), which
//! makes that a failure. `.ci/run` installs the package.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}\n--- stderr\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Whether python3 with kubernetes-validate (and so jsonschema and PyYAML) is here.
fn validator_available(test: &str) -> bool {
    let modules = ["kubernetes_validate", "jsonschema", "yaml"];
    common::python_available(
        test,
        &modules,
        "python3 with the PyPI package kubernetes-validate is missing",
    )
}

/// Runs tests/validate_manifests.py with `args`.
fn validate(args: &[&Path]) -> Output {
    validate_with_crds(&[], args)
}

/// [`validate`] with the CRDs in `crds` (directories) beside `deploy/crds`.
fn validate_with_crds(crds: &[&Path], args: &[&Path]) -> Output {
    let mut cmd = Command::new("python3");
    cmd.arg(root().join("tests/validate_manifests.py"))
        .arg("--crds")
        .arg(root().join("deploy/crds"));
    for dir in crds {
        cmd.arg("--crds").arg(dir);
    }
    cmd.args(args).output().expect("running python3")
}

/// `kubectl kustomize deploy/` into a file in `dir`, or `None` (SKIPPED) without kubectl.
fn render(test: &str, dir: &Path) -> Option<PathBuf> {
    let out = match Command::new("kubectl").arg("kustomize").arg(root().join("deploy")).output() {
        Ok(o) => o,
        Err(e) => {
            common::skip_without_tool(
                test,
                &format!("kubectl (for its built-in kustomize) cannot run: {e}"),
            );
            return None;
        }
    };
    assert!(out.status.success(), "kubectl kustomize deploy/ failed:\n{}", text(&out));
    let path = dir.join("rendered.yaml");
    std::fs::write(&path, &out.stdout).expect("writing the rendered manifests");
    Some(path)
}

#[test]
fn committed_crds_are_what_tierproxy_crds_prints() {
    let dir = root().join("deploy/crds");
    let crds = tierproxy::crds::crds();
    assert_eq!(crds.len(), 3);
    let mut expected: Vec<String> = Vec::new();
    for crd in &crds {
        let path = dir.join(&crd.file_name);
        let want = tierproxy::crds::to_yaml(crd).expect("serializing the CRD");
        let got = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            got == want,
            "{} differs from what `tierproxy crds` prints (the types in src/policy/api/ \
             changed?); regenerate with:\n    cargo run -- crds --out-dir deploy/crds",
            path.display()
        );
        expected.push(crd.file_name.clone());
    }
    let mut present: Vec<String> = std::fs::read_dir(&dir)
        .expect("deploy/crds")
        .map(|e| e.expect("dir entry").file_name().to_string_lossy().into_owned())
        .collect();
    present.sort();
    expected.sort();
    assert_eq!(present, expected, "deploy/crds/ holds files `tierproxy crds` does not write");
}

#[test]
fn crds_subcommand_prints_the_three_crds() {
    let out = Command::new(env!("CARGO_BIN_EXE_tierproxy")).arg("crds").output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8(out.stdout).expect("UTF-8");
    assert_eq!(stdout, tierproxy::crds::to_yaml_stream().unwrap());
    let docs: Vec<serde_json::Value> = serde_saphyr::from_multiple(&stdout).expect("YAML stream");
    let names: Vec<&str> = docs.iter().map(|d| d["metadata"]["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "adminnetworkpolicies.policy.networking.k8s.io",
            "baselineadminnetworkpolicies.policy.networking.k8s.io",
            "clusternetworkpolicies.policy.networking.k8s.io",
        ]
    );
    for d in &docs {
        // A CRD in a *.k8s.io group without this annotation is refused by the API server.
        assert!(d["metadata"]["annotations"]["api-approved.kubernetes.io"].is_string(), "{d}");
        let v = &d["spec"]["versions"][0];
        assert_eq!(v["subresources"]["status"], serde_json::json!({}), "{d}");
        let schema = v["schema"]["openAPIV3Schema"].to_string();
        assert!(!schema.contains("nullable"), "nullable left in {}", d["metadata"]["name"]);
        assert!(schema.contains("x-kubernetes-validations"), "no CEL rule in {schema}");
    }
}

/// `tierproxy` with `args`, successful, its standard output.
fn tierproxy(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tierproxy")).args(args).output().unwrap();
    assert!(out.status.success(), "tierproxy {args:?}: {}", text(&out));
    String::from_utf8(out.stdout).expect("UTF-8")
}

#[test]
fn crds_antrea_prints_the_three_antrea_crds() {
    let stdout = tierproxy(&["crds", "--antrea"]);
    let crds = tierproxy::crds::antrea_crds();
    assert_eq!(stdout, tierproxy::crds::yaml_stream(&crds).unwrap());
    let docs: Vec<serde_json::Value> = serde_saphyr::from_multiple(&stdout).expect("YAML stream");
    let got: Vec<(&str, &str, &str, &str, &serde_json::Value)> = docs
        .iter()
        .map(|d| {
            let s = &d["spec"];
            (
                d["metadata"]["name"].as_str().unwrap(),
                s["names"]["kind"].as_str().unwrap(),
                s["scope"].as_str().unwrap(),
                s["group"].as_str().unwrap(),
                &s["names"]["shortNames"],
            )
        })
        .collect();
    let (tr, acnp, annp) =
        (serde_json::json!(["tr"]), serde_json::json!(["acnp"]), serde_json::json!(["annp"]));
    assert_eq!(
        got,
        [
            ("tiers.crd.antrea.io", "Tier", "Cluster", "crd.antrea.io", &tr),
            (
                "clusternetworkpolicies.crd.antrea.io",
                "ClusterNetworkPolicy",
                "Cluster",
                "crd.antrea.io",
                &acnp
            ),
            (
                "networkpolicies.crd.antrea.io",
                "NetworkPolicy",
                "Namespaced",
                "crd.antrea.io",
                &annp
            ),
        ]
    );
    for d in &docs {
        let name = &d["metadata"]["name"];
        assert_eq!(d["apiVersion"], "apiextensions.k8s.io/v1", "{name}");
        let versions = d["spec"]["versions"].as_array().unwrap();
        assert_eq!(versions.len(), 1, "{name}");
        let v = &versions[0];
        assert_eq!(
            (&v["name"], &v["served"], &v["storage"]),
            (&"v1beta1".into(), &true.into(), &true.into())
        );
        let schema = v["schema"]["openAPIV3Schema"].to_string();
        assert!(!schema.contains("nullable"), "nullable left in {name}");
        // Not a protected group: no approval to name.
        assert!(d["metadata"]["annotations"].get("api-approved.kubernetes.io").is_none());
    }
    // The header says where they belong, before anyone applies them.
    assert_eq!(stdout.matches("Only for a cluster WITHOUT Antrea").count(), 3, "{stdout}");

    // Without --antrea: the committed upstream CRDs, byte for byte, and nothing of Antrea's.
    let upstream = tierproxy(&["crds"]);
    let committed: String = tierproxy::crds::crds()
        .iter()
        .map(|c| {
            let path = root().join("deploy/crds").join(&c.file_name);
            format!("---\n{}", std::fs::read_to_string(path).unwrap())
        })
        .collect();
    assert_eq!(upstream, committed);
    assert!(!upstream.contains("crd.antrea.io"));

    // --out-dir: one file each, named as Antrea's group and plural.
    let tmp = tempfile::tempdir().unwrap();
    tierproxy(&["crds", "--antrea", "--out-dir", tmp.path().to_str().unwrap()]);
    let mut files: Vec<String> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "crd.antrea.io_clusternetworkpolicies.yaml",
            "crd.antrea.io_networkpolicies.yaml",
            "crd.antrea.io_tiers.yaml"
        ]
    );
    for c in &crds {
        let got = std::fs::read_to_string(tmp.path().join(&c.file_name)).unwrap();
        assert_eq!(got, tierproxy::crds::to_yaml(c).unwrap(), "{}", c.file_name);
    }
}

/// The Antrea CRDs are structural and valid CRDs of Kubernetes 1.31 and 1.37; the
/// representative objects of `tests/antrea-crds/valid.yaml` validate against them and pass
/// `tierproxy check`; every object of `invalid.yaml` (one per limit the schemas carry) is
/// refused by both, at the same field.
#[test]
fn antrea_crds_validate_and_agree_with_check() {
    let test = "antrea_crds_validate_and_agree_with_check";
    if !validator_available(test) {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let crds = tmp.path();
    tierproxy(&["crds", "--antrea", "--out-dir", crds.to_str().unwrap()]);
    let run = |files: &[&Path]| {
        let mut cmd = Command::new("python3");
        cmd.arg(root().join("tests/validate_manifests.py")).arg("--crds").arg(crds).args(files);
        cmd.output().expect("running python3")
    };
    let valid = root().join("tests/antrea-crds/valid.yaml");
    let out = run(&[crds, &valid]);
    assert!(out.status.success(), "the Antrea CRDs or objects do not validate:\n{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    for kind in
        ["CustomResourceDefinition 3", "ClusterNetworkPolicy 1", "NetworkPolicy 1", "Tier 1"]
    {
        assert!(stdout.contains(kind), "{kind} was not validated:\n{}", text(&out));
    }
    assert!(stdout.contains(" 0 skipped, 0 problems"), "{}", text(&out));
    let check = tierproxy(&["check", "-m", valid.to_str().unwrap()]);
    assert!(check.contains("0 error(s)"), "{check}");

    let invalid = root().join("tests/antrea-crds/invalid.yaml");
    let out = run(&[&invalid]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let schema = String::from_utf8_lossy(&out.stdout).into_owned();
    let out = Command::new(env!("CARGO_BIN_EXE_tierproxy"))
        .args(["check", "-o", "json", "-m", invalid.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let errors: Vec<(String, String)> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["severity"] == "error")
        .map(|v| (v["name"].as_str().unwrap().to_owned(), v["field"].as_str().unwrap().to_owned()))
        .collect();
    // (object, the field `check` names, the path and words of the schema's problem)
    let cases = [
        ("t-256", "spec.priority", "spec.priority: 256 is greater than the maximum"),
        ("p-low", "spec.priority", "spec.priority: 0.5 is less than the minimum"),
        ("p-high", "spec.priority", "spec.priority: 10000.5 is greater than the maximum"),
        (
            "proto",
            "spec.ingress[0].ports[0].protocol",
            "spec.ingress.0.ports.0.protocol: 'ICMP' is not one of",
        ),
        (
            "icmp",
            "spec.ingress[0].protocols[0].icmp.icmpType",
            "spec.ingress.0.protocols.0.icmp.icmpType: 256",
        ),
        (
            "igmp",
            "spec.egress[0].protocols[0].igmp.igmpType",
            "spec.egress.0.protocols.0.igmp.igmpType: 5 is not one of",
        ),
        (
            "two-protocols",
            "spec.ingress[0].protocols[0]",
            "spec.ingress.0.protocols.0: {'icmp': {}, 'igmp': {}} has too many",
        ),
        (
            "two-criteria",
            "spec.ingress[0].from[0].namespaces",
            "spec.ingress.0.from.0.namespaces: {'match'",
        ),
        (
            "no-cidr",
            "spec.ingress[0].from[0].ipBlock.cidr",
            "spec.ingress.0.from.0.ipBlock: 'cidr' is a required",
        ),
        (
            "empty-l7",
            "spec.egress[0].l7Protocols[0]",
            "spec.egress.0.l7Protocols.0: {} should be non-empty",
        ),
    ];
    for (name, field, problem) in cases {
        assert!(
            errors.iter().any(|(n, f)| n == name && f == field),
            "tierproxy check has no error at {name} {field}: {errors:?}"
        );
        let line = schema.lines().find(|l| l.contains(&format!("/{name}): ")));
        assert!(
            line.is_some_and(|l| l.contains(problem)),
            "the schema does not refuse {name} at {problem}:\n{schema}"
        );
    }
    assert!(schema.contains(&format!(" {} problems", cases.len())), "{schema}");
}

#[test]
fn deploy_and_examples_validate_against_kubernetes_and_the_crds() {
    let test = "deploy_and_examples_validate_against_kubernetes_and_the_crds";
    if !validator_available(test) {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let Some(rendered) = render(test, tmp.path()) else { return };
    let r = root();
    let inputs = [
        rendered.clone(),
        r.join("deploy/metrics-access.yaml"),
        r.join("deploy/crds"),
        r.join("examples"),
        r.join("examples/policies"),
        r.join("examples/conflicts"),
    ];
    // The examples' Antrea objects validate against the CRDs `tierproxy crds --antrea`
    // prints (a cluster with Antrea has its own).
    let antrea = tmp.path().join("antrea-crds");
    std::fs::create_dir(&antrea).unwrap();
    tierproxy(&["crds", "--antrea", "--out-dir", antrea.to_str().unwrap()]);
    let args: Vec<&Path> = inputs.iter().map(PathBuf::as_path).collect();
    let out = validate_with_crds(&[&antrea], &args);
    assert!(out.status.success(), "manifests do not validate:\n{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    // What an admin applies is all there: kustomize rendered every resource, and the
    // examples' policies were checked against the CRDs, not skipped.
    for kind in [
        "DaemonSet 1",
        "ServiceAccount 1",
        "ClusterRole 1",
        "ClusterRoleBinding 1",
        "Role 1",
        "RoleBinding 1",
        "ConfigMap 1",
        "CustomResourceDefinition 3",
        "AdminNetworkPolicy",
        "BaselineAdminNetworkPolicy",
        "ClusterNetworkPolicy",
        "NetworkPolicy",
        "Tier 1",
    ] {
        assert!(stdout.contains(kind), "{kind} was not validated:\n{}", text(&out));
    }
    assert!(stdout.contains(" 0 skipped, 0 problems"), "{}", text(&out));
}

#[test]
fn the_validator_rejects_broken_manifests() {
    let test = "the_validator_rejects_broken_manifests";
    if !validator_available(test) {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let broken = tmp.path().join("broken.yaml");
    // Two DaemonSets, one with a string where a boolean goes, one with a misspelt field
    // (kubernetes-validate reports the first problem of a built-in object), and an ANP
    // with an out-of-range priority, a two-field subject and an empty `from`.
    let daemonset = |field: &str| {
        format!(
            "apiVersion: apps/v1\nkind: DaemonSet\nmetadata: {{name: x}}\nspec:\n  selector: \
             {{matchLabels: {{a: b}}}}\n  template:\n    metadata: {{labels: {{a: b}}}}\n    \
             spec:\n      {field}\n      containers:\n      - {{name: c, image: i}}\n---\n"
        )
    };
    let anp = "apiVersion: policy.networking.k8s.io/v1alpha1\nkind: AdminNetworkPolicy\n\
               metadata: {name: x}\nspec:\n  priority: 1001\n  subject: {namespaces: {}, \
               pods: {podSelector: {}}}\n  ingress:\n  - {action: Allow, from: []}\n";
    let yaml = daemonset("hostNetwork: \"yes\"") + &daemonset("hostNetwrk: true") + anp;
    std::fs::write(&broken, yaml).unwrap();
    let out = validate(&[&broken]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "spec.template.spec.hostNetwork: 'yes' is not of type 'boolean'",
        "'hostNetwrk' was unexpected",
        "spec.priority: 1001 is greater than the maximum",
        "spec.subject",
        "spec.ingress.0.from",
    ] {
        assert!(stdout.contains(needle), "no problem reported at {needle}:\n{}", text(&out));
    }
}

#[test]
fn containerfile_installs_what_the_daemonset_runs() {
    let cf = std::fs::read_to_string(root().join("deploy/Containerfile")).unwrap();
    let ds = std::fs::read_to_string(root().join("deploy/daemonset.yaml")).unwrap();
    // Every COPY source from the build context exists.
    for line in cf.lines().filter(|l| l.starts_with("COPY ") && !l.contains("--from=")) {
        let words: Vec<&str> = line.split_whitespace().collect();
        for src in &words[1..words.len() - 1] {
            assert!(root().join(src).exists(), "Containerfile copies missing {src}: {line}");
        }
    }
    for (what, needle) in [
        ("the entrypoint", "/usr/local/bin/tierproxy-entrypoint"),
        ("the agent binary", "/usr/local/bin/tierproxy"),
    ] {
        assert!(cf.contains(needle), "Containerfile does not install {what} at {needle}");
    }
    assert!(ds.contains("command: [/usr/local/bin/tierproxy-entrypoint]"), "{ds}");
    // The tools the agent runs are in the runtime image.
    for pkg in ["iptables", "ipset", "nftables", "iproute2", "ca-certificates"] {
        assert!(cf.contains(pkg), "runtime image lacks {pkg}");
    }
}

/// Stub `iptables-{nft,legacy}-save` tools printing `nft` and `legacy` rulesets, the
/// entrypoint run with them, and the flavour its `iptables-restore` link points at.
fn entrypoint_mode(dir: &Path, nft: &str, legacy: &str, mode: Option<&str>) -> (String, String) {
    let sbin = dir.join("sbin");
    std::fs::create_dir_all(&sbin).unwrap();
    for (flavour, rules) in [("nft", nft), ("legacy", legacy)] {
        for fam in ["iptables", "ip6tables"] {
            for tool in ["", "-save", "-restore"] {
                let p = sbin.join(format!("{fam}-{flavour}{tool}"));
                let body = if tool == "-save" && fam == "iptables" {
                    format!("#!/bin/sh\nprintf '%s' '{rules}'\n")
                } else {
                    "#!/bin/sh\nexit 0\n".to_owned()
                };
                std::fs::write(&p, body).unwrap();
                let mut perm = std::fs::metadata(&p).unwrap().permissions();
                std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
                std::fs::set_permissions(&p, perm).unwrap();
            }
        }
    }
    let mut cmd = Command::new("sh");
    cmd.arg(root().join("deploy/tierproxy-entrypoint.sh"))
        .args(["sh", "-c", "readlink \"$(command -v iptables-restore)\"; echo \"$*\"", "sh"])
        .env("TIERPROXY_SBIN", &sbin)
        .env("TIERPROXY_BIN_DIR", dir.join("bin"))
        .env("TIERPROXY_AGENT_FLAGS", "--keep-rules  --fail-open *");
    match mode {
        Some(m) => cmd.env("TIERPROXY_IPTABLES_MODE", m),
        None => cmd.env_remove("TIERPROXY_IPTABLES_MODE"),
    };
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let mut lines = stdout.lines();
    let link = lines.next().unwrap_or_default().to_owned();
    let args = lines.next().unwrap_or_default().to_owned();
    let flavour = link.rsplit('/').next().unwrap_or_default().to_owned();
    (flavour, args)
}

/// The entrypoint raises the soft open files limit to what the agent needs at its defaults
/// ([`tierproxy::config::NEEDED_FDS`]), or, when the hard limit is lower, to the hard limit
/// (and says so).
#[test]
fn entrypoint_raises_the_open_files_limit_the_agent_needs() {
    let tmp = tempfile::tempdir().unwrap();
    let sbin = tmp.path().join("sbin");
    std::fs::create_dir_all(&sbin).unwrap();
    for fam in ["iptables", "ip6tables"] {
        for tool in ["", "-save", "-restore"] {
            let p = sbin.join(format!("{fam}-nft{tool}"));
            std::fs::write(&p, "#!/bin/sh\nexit 0\n").unwrap();
            let mut perm = std::fs::metadata(&p).unwrap().permissions();
            std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
            std::fs::set_permissions(&p, perm).unwrap();
        }
    }
    let script = std::fs::read_to_string(root().join("deploy/tierproxy-entrypoint.sh")).unwrap();
    let default = format!("TIERPROXY_NOFILE:-{}", tierproxy::config::NEEDED_FDS);
    assert!(script.contains(&default), "the entrypoint's default is the agent's need");
    for (hard, want, got) in [("4096", "2048", "2048"), ("1024", "2048", "1024")] {
        let out = Command::new("sh")
            .arg("-c")
            .arg(format!("ulimit -n {hard}; exec sh \"$0\" sh -c 'ulimit -S -n'"))
            .arg(root().join("deploy/tierproxy-entrypoint.sh"))
            .env("TIERPROXY_SBIN", &sbin)
            .env("TIERPROXY_BIN_DIR", tmp.path().join("bin"))
            .env("TIERPROXY_IPTABLES_MODE", "nft")
            .env("TIERPROXY_NOFILE", want)
            .env_remove("TIERPROXY_AGENT_FLAGS")
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out));
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), got, "{}", text(&out));
        if got != want {
            assert!(String::from_utf8_lossy(&out.stderr).contains("below the"), "{}", text(&out));
        }
    }
}

#[test]
fn entrypoint_follows_kubelets_iptables_flavour() {
    let hint = "*mangle\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n";
    let kube_rules = "*nat\n:KUBE-SERVICES - [0:0]\n-A PREROUTING -j KUBE-SERVICES\n-A OUTPUT -j \
                      KUBE-SERVICES\nCOMMIT\n";
    let cases = [
        // kubelet's hint wins over rule counts, in either flavour.
        (hint, kube_rules, None, "iptables-nft-restore"),
        (kube_rules, hint, None, "iptables-legacy-restore"),
        // No hint: the flavour with more rules.
        ("", kube_rules, None, "iptables-legacy-restore"),
        (kube_rules, "", None, "iptables-nft-restore"),
        // Nothing anywhere: nf_tables.
        ("", "", None, "iptables-nft-restore"),
        // Configured.
        (hint, "", Some("legacy"), "iptables-legacy-restore"),
    ];
    for (i, (nft, legacy, mode, want)) in cases.into_iter().enumerate() {
        let tmp = tempfile::tempdir().unwrap();
        let (got, args) = entrypoint_mode(tmp.path(), nft, legacy, mode);
        assert_eq!(got, want, "case {i}");
        // Flags split on blanks, not globbed.
        assert_eq!(args, "--keep-rules --fail-open *", "case {i}");
    }
    let tmp = tempfile::tempdir().unwrap();
    let out = Command::new("sh")
        .arg(root().join("deploy/tierproxy-entrypoint.sh"))
        .arg("true")
        .env("TIERPROXY_IPTABLES_MODE", "xtables")
        .env("TIERPROXY_BIN_DIR", tmp.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("must be auto, nft or legacy"));
}

/// `tierproxy agent --help`.
fn agent_help() -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tierproxy")).args(["agent", "--help"]).output();
    let out = out.expect("running tierproxy agent --help");
    assert!(out.status.success(), "{}", text(&out));
    String::from_utf8(out.stdout).expect("UTF-8")
}

/// The `[default: N]` of flag `flag` in `help`, in seconds.
fn default_secs(help: &str, flag: &str) -> u64 {
    let at = help.find(flag).unwrap_or_else(|| panic!("{flag} not in agent --help"));
    let rest = &help[at..];
    let d = rest.find("[default: ").expect("a default") + "[default: ".len();
    rest[d..].split(']').next().unwrap().parse().expect("a number of seconds")
}

#[test]
fn daemonset_keeps_what_deploy_readme_promises() {
    let text = std::fs::read_to_string(root().join("deploy/daemonset.yaml")).unwrap();
    let ds: serde_json::Value = serde_saphyr::from_str(&text).expect("daemonset.yaml");
    let pod = &ds["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let sc = &c["securityContext"];
    assert_eq!(pod["hostNetwork"], true);
    assert_eq!(sc["privileged"], false);
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(sc["capabilities"]["drop"], serde_json::json!(["ALL"]));
    assert_eq!(
        sc["capabilities"]["add"],
        serde_json::json!(["NET_ADMIN", "NET_RAW", "NET_BIND_SERVICE"])
    );
    // The lab's agents run with exactly the DaemonSet's capabilities (issue #17), so the
    // lab and loadtest/ measure what a node runs.
    let lab: Vec<&str> = tierproxy::lab::procs::AGENT_CAPABILITIES.split(',').collect();
    assert_eq!(sc["capabilities"]["add"], serde_json::json!(lab));
    // Surge: the new agent starts beside the old one and takes over (issue #23).
    let ru = &ds["spec"]["updateStrategy"]["rollingUpdate"];
    assert_eq!((ru["maxUnavailable"].as_i64(), ru["maxSurge"].as_i64()), (Some(0), Some(1)));
    assert_eq!(pod["tolerations"], serde_json::json!([{"operator": "Exists"}]));

    // The grace period covers the drain and the audit flush at their defaults.
    let help = agent_help();
    let needed = default_secs(&help, "--drain-grace-secs")
        + default_secs(&help, "--audit-flush-timeout-secs");
    let grace = pod["terminationGracePeriodSeconds"].as_u64().expect("a grace period");
    assert!(grace > needed, "terminationGracePeriodSeconds {grace} <= drain + flush {needed}");

    // The probes ask the port the agent serves them on.
    let args: Vec<&str> =
        c["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
    let metrics =
        args.iter().find_map(|a| a.strip_prefix("--metrics-addr=")).expect("--metrics-addr");
    let port: u16 = metrics.rsplit(':').next().unwrap().parse().unwrap();
    for (probe, path) in [("startupProbe", "/healthz"), ("livenessProbe", "/healthz")] {
        assert_eq!(c[probe]["httpGet"]["path"], path, "{probe}");
        assert_eq!(c[probe]["httpGet"]["port"].as_u64(), Some(u64::from(port)), "{probe}");
        // Bound on loopback (no pod reads the metrics), so kubelet must probe there.
        let host = metrics.rsplit_once(':').unwrap().0;
        assert_eq!(c[probe]["httpGet"]["host"], host, "{probe}");
    }
    // Readiness is the pod's own ready file, in its own emptyDir: during a surge both
    // agents answer on the metrics port, so /readyz could be the old one's.
    let ready = args.iter().find_map(|a| a.strip_prefix("--ready-file=")).expect("--ready-file");
    assert_eq!(c["readinessProbe"]["exec"]["command"], serde_json::json!(["test", "-e", ready]));
    let mounted = |path: &str| {
        c["volumeMounts"].as_array().unwrap().iter().find_map(|m| {
            let at = m["mountPath"].as_str().unwrap();
            Path::new(path).starts_with(at).then(|| m["name"].as_str().unwrap().to_string())
        })
    };
    let volume = |name: &str| {
        pod["volumes"].as_array().unwrap().iter().find(|v| v["name"] == name).unwrap().clone()
    };
    assert!(volume(&mounted(ready).expect("ready file mounted")).get("emptyDir").is_some());
    // The hand-over socket is on the node, where the next pod finds it.
    let socket =
        args.iter().find_map(|a| a.strip_prefix("--handover-socket=")).expect("--handover-socket");
    assert!(volume(&mounted(socket).expect("socket mounted")).get("hostPath").is_some());
    // No port declared: on a hostNetwork pod it would be a hostPort, which keeps the surge
    // pod off the node.
    assert!(c.get("ports").is_none(), "declared ports block the surge: {}", c["ports"]);

    // Every flag the DaemonSet and agent.env give exists.
    let env = std::fs::read_to_string(root().join("deploy/agent.env")).unwrap();
    let flags_line = env
        .lines()
        .find_map(|l| l.strip_prefix("TIERPROXY_AGENT_FLAGS="))
        .expect("TIERPROXY_AGENT_FLAGS in agent.env");
    assert!(flags_line.split_whitespace().any(|f| f == "--keep-rules"), "{flags_line}");
    let flags = args
        .iter()
        .copied()
        .chain(flags_line.split_whitespace())
        .filter(|a| a.starts_with("--"))
        .map(|a| a.split('=').next().unwrap());
    for flag in flags {
        assert!(
            help.contains(&format!("{flag} ")) || help.contains(&format!("{flag}\n")),
            "{flag} is not an agent flag"
        );
    }
}

/// The ClusterRole grants get, list and watch on exactly the resources the API-server
/// source watches (`WatchedKind::ALL`), Antrea's three included, and on nothing else; and
/// never more than those verbs on them (a spec the agent could rewrite).
#[test]
fn the_cluster_role_reads_exactly_what_the_source_watches() {
    use std::collections::BTreeSet;
    use tierproxy::cluster::apiserver::WatchedKind;
    let text = std::fs::read_to_string(root().join("deploy/rbac.yaml")).unwrap();
    let docs: Vec<serde_json::Value> = serde_saphyr::from_multiple(&text).expect("rbac.yaml");
    let role = docs.iter().find(|d| d["kind"] == "ClusterRole").expect("a ClusterRole");
    let strings = |v: &serde_json::Value| -> Vec<String> {
        v.as_array().unwrap().iter().map(|x| x.as_str().unwrap().to_string()).collect()
    };
    let mut read = BTreeSet::new();
    for rule in role["rules"].as_array().unwrap() {
        let verbs = strings(&rule["verbs"]);
        for group in strings(&rule["apiGroups"]) {
            for resource in strings(&rule["resources"]) {
                let watched =
                    WatchedKind::ALL.iter().any(|k| k.group() == group && k.plural() == resource);
                // Subresources (the upstream policies' `/status`) are not watched.
                if resource.contains('/') {
                    continue;
                }
                if verbs.iter().any(|v| ["get", "list", "watch"].contains(&v.as_str())) {
                    assert_eq!(verbs, ["get", "list", "watch"], "{group}/{resource}");
                    read.insert((group.clone(), resource.clone()));
                } else if watched {
                    // Writes on a watched resource: only nodes (one annotation).
                    assert_eq!((group.as_str(), resource.as_str()), ("", "nodes"), "{verbs:?}");
                    assert_eq!(verbs, ["patch"]);
                }
            }
        }
    }
    let watched: BTreeSet<(String, String)> =
        WatchedKind::ALL.iter().map(|k| (k.group().to_string(), k.plural().to_string())).collect();
    assert_eq!(read, watched);
    assert!(watched.contains(&("crd.antrea.io".to_string(), "tiers".to_string())));
}
