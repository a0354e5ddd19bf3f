//! Helpers shared by the unit tests of several modules.

/// Whether a test that needs `capability` (e.g. `CAP_NET_RAW`) can run here: `probe` is an
/// attempt to use it (opening a raw socket, making a socket transparent). When the attempt
/// failed, prints `SKIPPED: <test>: needs <capability> (<error>)` to standard error and
/// returns `false`; under `TIERPROXY_REQUIRE_NETNS=1` (CI) it panics instead, so a skip
/// never passes silently there.
pub(crate) fn capable<T>(test: &str, capability: &str, probe: std::io::Result<T>) -> bool {
    let Err(e) = probe else { return true };
    if std::env::var("TIERPROXY_REQUIRE_NETNS").as_deref() == Ok("1") {
        panic!("{test}: needs {capability} ({e}) and TIERPROXY_REQUIRE_NETNS=1");
    }
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED: {test}: needs {capability} ({e})");
    false
}
