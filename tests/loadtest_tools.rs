//! The load-test tools' own checks: `loadtest/phases --self-test` parses a built-in
//! capture of one connection, through a transparent proxy and through the relay, into
//! its steps. Nothing else runs that parsing without root and a lab, and a figure the
//! tool misreads would go into the docs as a measurement. Needs python3 (the tools use
//! only its standard library); without it the test says it was skipped, which fails
//! under `TIERPROXY_REQUIRE_TOOLS=1` (CI).

use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};

/// Whether `python3` runs; else says the test `test` was skipped (a panic under
/// `TIERPROXY_REQUIRE_TOOLS=1`).
fn python_available(test: &str) -> bool {
    let ok = Command::new("python3")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        if std::env::var("TIERPROXY_REQUIRE_TOOLS").as_deref() == Ok("1") {
            panic!("{test}: python3 is missing, and TIERPROXY_REQUIRE_TOOLS=1");
        }
        let _ = writeln!(std::io::stderr(), "SKIPPED: {test}: python3 is missing");
    }
    ok
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
