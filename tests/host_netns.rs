//! The node settings the agent changes while it runs ([`tierproxy::host::HostSysctl`]),
//! in a network namespace of the test's own (`net.ipv4.tcp_tw_reuse` is per namespace).

use std::process::Command;

use tierproxy::host::{HostSysctl, TCP_TW_REUSE};
use tierproxy::lab::LabError;
use tierproxy::lab::netns::in_netns;

mod common;
use common::*;

/// A network namespace that is deleted when this is dropped, even when the test fails.
struct Netns(String);

impl Netns {
    fn new(short: &str) -> Netns {
        let name = prefix(short);
        let _ = Command::new("ip").args(["netns", "del", &name]).status();
        let ok = Command::new("ip").args(["netns", "add", &name]).status().expect("ip runs");
        assert!(ok.success(), "ip netns add {name}");
        Netns(name)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

fn tw_reuse() -> String {
    std::fs::read_to_string(TCP_TW_REUSE.path()).unwrap().trim().to_owned()
}

fn set_tw_reuse(v: &str) {
    std::fs::write(TCP_TW_REUSE.path(), v).unwrap();
}

/// Issue #23 (review finding 15): two agents of one namespace side by side, as in an
/// upgrade. The second shares the setting instead of taking the first's state file for a
/// crash's (it wrote the old value back while the first relied on the setting); the
/// first to exit leaves it set, the last restores it. A state file nobody holds is a
/// crash's and is restored, as before.
#[test]
fn agents_side_by_side_share_a_sysctl_and_the_last_restores_it() {
    if !netns_available("agents_side_by_side_share_a_sysctl_and_the_last_restores_it") {
        return;
    }
    let ns = Netns::new("sysctl");
    let state = tempfile::tempdir().unwrap();
    let dir = state.path().to_path_buf();
    let name = ns.0.clone();
    in_netns(&ns.0, move || {
        set_tw_reuse("2");
        let first = HostSysctl::start(&dir, TCP_TW_REUSE, true);
        assert_eq!(tw_reuse(), "1");
        let files: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
        assert_eq!(files.len(), 1, "the first agent's state file");
        let state_file = files[0].path();
        // The next agent starts while the first runs. Watch the setting meanwhile: it must
        // never go back to 2.
        let stop = std::sync::atomic::AtomicBool::new(false);
        let here = std::fs::read_link("/proc/thread-self/ns/net").unwrap();
        let second = std::thread::scope(|s| {
            let watcher = s.spawn(|| {
                // A new thread starts in the process's namespace: enter the test's.
                let f = std::fs::File::open(format!("/var/run/netns/{name}")).unwrap();
                nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
                assert_eq!(std::fs::read_link("/proc/thread-self/ns/net").unwrap(), here);
                let mut seen = std::collections::BTreeSet::new();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    seen.insert(tw_reuse());
                }
                seen.insert(tw_reuse());
                seen
            });
            let second = HostSysctl::start(&dir, TCP_TW_REUSE, true);
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            let seen = watcher.join().unwrap();
            assert_eq!(seen, ["1".to_owned()].into(), "the setting while the second started");
            second
        });
        assert_eq!(tw_reuse(), "1");
        drop(first);
        assert_eq!(tw_reuse(), "1", "the second agent still relies on it");
        drop(second);
        assert_eq!(tw_reuse(), "2", "the last agent restored it");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "and removed the state file");

        // A crash: an agent set it and left its state file, which nobody holds now.
        set_tw_reuse("1");
        std::fs::write(&state_file, "2").unwrap();
        let after = HostSysctl::start(&dir, TCP_TW_REUSE, false);
        assert_eq!(tw_reuse(), "2", "the crashed agent's old value is back");
        assert!(!state_file.exists(), "and its state file gone");
        drop(after);
        Ok::<(), LabError>(())
    })
    .unwrap();
}
