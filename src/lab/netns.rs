//! The system side of the lab: privileges, the `ip` command, network namespaces, sysctls and
//! entering a namespace from a thread.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use nix::sched::{CloneFlags, setns};

use super::LabError;

/// Where `ip netns` keeps its namespaces (bind mounts named after them).
pub const NETNS_DIR: &str = "/run/netns";

/// Capability bits (linux/capability.h) the lab needs.
const CAP_NET_ADMIN: u32 = 12;
const CAP_NET_RAW: u32 = 13;
const CAP_SYS_ADMIN: u32 = 21;

/// The capabilities the lab needs that this process lacks, by name (`CAP_NET_ADMIN` for
/// links, addresses, routes and sysctls; `CAP_SYS_ADMIN` for `ip netns add` (a mount) and
/// `setns`; `CAP_NET_RAW` for the raw sockets that serve and probe SCTP where the kernel
/// has no SCTP sockets). Read from `CapEff` in `/proc/self/status`; unreadable counts as
/// lacking all.
pub fn missing_capabilities() -> Vec<&'static str> {
    let eff = std::fs::read_to_string("/proc/self/status").ok().and_then(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("CapEff:"))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
    });
    let has = |bit: u32| eff.is_some_and(|e| e & (1 << bit) != 0);
    let mut out = Vec::new();
    if !has(CAP_NET_ADMIN) {
        out.push("CAP_NET_ADMIN");
    }
    if !has(CAP_SYS_ADMIN) {
        out.push("CAP_SYS_ADMIN");
    }
    if !has(CAP_NET_RAW) {
        out.push("CAP_NET_RAW");
    }
    out
}

/// Checks that the lab can run here: the capabilities and the `ip` command (iproute2).
///
/// # Errors
/// [`LabError::Privileges`] naming the missing capabilities, [`LabError::IpMissing`].
pub fn check_environment() -> Result<(), LabError> {
    let missing = missing_capabilities();
    if !missing.is_empty() {
        return Err(LabError::Privileges { missing: missing.join(" and ") });
    }
    match Command::new("ip").arg("-V").stdout(Stdio::null()).stderr(Stdio::null()).status() {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(LabError::IpMissing),
        Err(source) => Err(LabError::Spawn { command: "ip -V".into(), source }),
    }
}

/// The programs the lab runs, with the Debian package that has each, and whether only
/// agents need it (their iptables backend; `nft` also programs the lab's Service DNAT and
/// the kernel probe that picks the backend).
pub const LAB_TOOLS: &[(&str, &str, bool)] = &[
    ("ip", "iproute2", false),
    ("nft", "nftables", false),
    ("iptables", "iptables", true),
    ("ip6tables", "iptables", true),
    ("iptables-restore", "iptables", true),
    ("ip6tables-restore", "iptables", true),
    ("iptables-save", "iptables", true),
    ("ip6tables-save", "iptables", true),
    ("ipset", "ipset", true),
];

/// The directories programs are looked up in: `PATH`'s, then `/usr/sbin` and `/sbin`,
/// where Debian puts these tools and a non-login root shell may not look.
fn search_dirs() -> Vec<std::path::PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(std::path::PathBuf::from))
        .collect()
}

/// Whether `program` is an executable file in one of `dirs`.
fn found_in(program: &str, dirs: &[std::path::PathBuf]) -> bool {
    use std::os::unix::fs::PermissionsExt;
    dirs.iter().map(|dir| dir.join(program)).any(|p| {
        std::fs::metadata(&p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    })
}

/// Whether `program` is installed (`PATH`, `/usr/sbin`, `/sbin`).
pub fn on_path(program: &str) -> bool {
    found_in(program, &search_dirs())
}

/// The [`LAB_TOOLS`] a lab (with agents when `agents`) needs and this machine lacks:
/// (program, Debian package).
pub fn missing_tools(agents: bool) -> Vec<(&'static str, &'static str)> {
    missing_in(&search_dirs(), agents)
}

fn missing_in(dirs: &[std::path::PathBuf], agents: bool) -> Vec<(&'static str, &'static str)> {
    LAB_TOOLS
        .iter()
        .filter(|(_, _, agents_only)| agents || !agents_only)
        .filter(|(tool, _, _)| !found_in(tool, dirs))
        .map(|(tool, package, _)| (*tool, *package))
        .collect()
}

/// Checks, before anything is built, that every program the lab will run is installed.
/// What is missing is installed with `apt-get` when `install` is set and this is a Debian
/// or Ubuntu machine (as `.ci/run` does: a fresh machine of this kind has none of the
/// netfilter tools), saying so on `err`; otherwise the error names the programs and the
/// one command that installs them.
///
/// # Errors
/// [`LabError::ToolsMissing`]; [`LabError::Spawn`] if `apt-get` cannot run.
pub fn ensure_tools(
    agents: bool,
    install: bool,
    err: &mut dyn std::io::Write,
) -> Result<(), LabError> {
    let missing = missing_tools(agents);
    if missing.is_empty() {
        return Ok(());
    }
    let mut packages: Vec<&str> = missing.iter().map(|(_, p)| *p).collect();
    packages.dedup();
    let tools = missing.iter().map(|(t, _)| *t).collect::<Vec<_>>().join(", ");
    let command = format!("apt-get install -y {}", packages.join(" "));
    if !install || !on_path("apt-get") {
        return Err(LabError::ToolsMissing { tools, command });
    }
    let _ = writeln!(err, "lab: {tools} missing; installing: apt-get update && {command}");
    let apt = |args: &[&str]| -> Result<(), LabError> {
        let shown = format!("apt-get {}", args.join(" "));
        let status = Command::new("apt-get")
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .status()
            .map_err(|source| LabError::Spawn { command: shown.clone(), source })?;
        if status.success() {
            Ok(())
        } else {
            Err(LabError::ToolsMissing { tools: tools.clone(), command: command.clone() })
        }
    };
    apt(&["update", "-qq"])?;
    let mut args = vec!["install", "-y", "-qq"];
    args.extend(&packages);
    apt(&args)?;
    let still = missing_tools(agents);
    if still.is_empty() {
        Ok(())
    } else {
        let tools = still.iter().map(|(t, _)| *t).collect::<Vec<_>>().join(", ");
        Err(LabError::ToolsMissing { tools, command })
    }
}

/// Runs `ip ARGS` (with `stdin` fed to it, for `-batch -`) and returns its stdout.
///
/// # Errors
/// [`LabError::Spawn`] if it cannot start, [`LabError::Command`] with its stderr if it
/// fails.
pub fn ip(args: &[&str], stdin: Option<&str>) -> Result<String, LabError> {
    let command = format!("ip {}", args.join(" "));
    let mut child = Command::new("ip")
        .args(args)
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| LabError::Spawn { command: command.clone(), source })?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        // A write error means ip exited early; its status and stderr tell why.
        let _ = pipe.write_all(text.as_bytes());
    }
    let out = child
        .wait_with_output()
        .map_err(|source| LabError::Spawn { command: command.clone(), source })?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(LabError::Command {
            command,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

/// Runs `commands` with `ip -batch -` (in namespace `netns`, or the current one). On a
/// failure the error names the failing command, not just its line number.
///
/// # Errors
/// [`LabError::Command`].
pub fn ip_batch(netns: Option<&str>, commands: &[String]) -> Result<(), LabError> {
    if commands.is_empty() {
        return Ok(());
    }
    let mut args = Vec::new();
    if let Some(ns) = netns {
        args.extend(["-n", ns]);
    }
    args.extend(["-batch", "-"]);
    let script = commands.join("\n") + "\n";
    ip(&args, Some(&script)).map(drop).map_err(|e| match e {
        LabError::Command { command, stderr } => match failed_line(&stderr, commands) {
            Some(line) => LabError::Command { command: format!("{command}: {line}"), stderr },
            None => LabError::Command { command, stderr },
        },
        other => other,
    })
}

/// The batch command iproute2 reports as failed ("Command failed -:N" for line N).
fn failed_line<'a>(stderr: &str, commands: &'a [String]) -> Option<&'a String> {
    stderr
        .rsplit_once("Command failed -:")
        .and_then(|(_, n)| n.trim().parse::<usize>().ok())
        .and_then(|n| commands.get(n.checked_sub(1)?))
}

/// Names of every network namespace `ip netns list` shows that start with `prefix`.
///
/// # Errors
/// [`LabError::Command`] if `ip netns list` fails.
pub fn list_netns(prefix: &str) -> Result<Vec<String>, LabError> {
    let out = ip(&["netns", "list"], None)?;
    // Lines are "name" or "name (id: N)".
    Ok(out
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(prefix))
        .map(str::to_string)
        .collect())
}

/// Pids of the processes in namespace `netns` (`ip netns pids`); empty if it is gone.
pub fn netns_pids(netns: &str) -> Vec<i32> {
    ip(&["netns", "pids", netns], None)
        .map(|out| out.split_whitespace().filter_map(|p| p.parse().ok()).collect())
        .unwrap_or_default()
}

/// The bind mount of namespace `netns`.
pub fn netns_path(netns: &str) -> PathBuf {
    Path::new(NETNS_DIR).join(netns)
}

/// Moves the calling thread into network namespace `netns` (only this thread: sockets it
/// opens afterwards belong to that namespace, and so do `/proc/sys/net` files it opens).
///
/// # Errors
/// [`LabError::Netns`] if the namespace cannot be opened or entered.
pub fn enter(netns: &str) -> Result<(), LabError> {
    let file = File::open(netns_path(netns)).map_err(|source| LabError::Netns {
        netns: netns.to_string(),
        what: "cannot open".into(),
        source,
    })?;
    setns(&file, CloneFlags::CLONE_NEWNET).map_err(|errno| LabError::Netns {
        netns: netns.to_string(),
        what: "cannot enter (setns)".into(),
        source: errno.into(),
    })
}

/// Runs `f` on a new thread inside namespace `netns` and returns its result.
///
/// # Errors
/// What [`enter`] or `f` returns; [`LabError::Netns`] if the thread panicked.
pub fn in_netns<T: Send>(
    netns: &str,
    f: impl FnOnce() -> Result<T, LabError> + Send,
) -> Result<T, LabError> {
    std::thread::scope(|s| {
        s.spawn(|| {
            enter(netns)?;
            f()
        })
        .join()
        .unwrap_or_else(|_| {
            Err(LabError::Netns {
                netns: netns.to_string(),
                what: "thread panicked".into(),
                source: std::io::Error::other("panic"),
            })
        })
    })
}

/// Writes `value` to `/proc/sys/<key with . as />` in the calling thread's namespace.
/// A missing IPv6 tree (IPv6 disabled) is not an error for IPv6 keys.
///
/// # Errors
/// [`LabError::Netns`] naming the key.
pub fn sysctl(netns: &str, key: &str, value: &str) -> Result<(), LabError> {
    let path = Path::new("/proc/sys").join(key.replace('.', "/"));
    match std::fs::write(&path, value) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && key.starts_with("net.ipv6.") => {
            Ok(())
        }
        Err(source) => Err(LabError::Netns {
            netns: netns.to_string(),
            what: format!("cannot set {key}={value}"),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn missing_tools_are_named_with_their_packages() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        for tool in ["ip", "nft", "iptables", "iptables-restore", "iptables-save"] {
            let p = dir.path().join(tool);
            std::fs::write(&p, "#!/bin/sh\n").unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        // Not executable: does not count.
        std::fs::write(dir.path().join("ipset"), "").unwrap();
        let dirs = [dir.path().to_path_buf()];
        assert!(missing_in(&dirs, false).is_empty(), "a lab without agents needs ip and nft");
        assert_eq!(
            missing_in(&dirs, true),
            [
                ("ip6tables", "iptables"),
                ("ip6tables-restore", "iptables"),
                ("ip6tables-save", "iptables"),
                ("ipset", "ipset")
            ]
        );
    }

    use super::*;

    #[test]
    fn a_failed_batch_names_the_failing_command() {
        let cmds = vec!["link set lo up".to_string(), "route add 10.0.0.1 dev eth9".to_string()];
        let stderr = "Cannot find device \"eth9\"\nCommand failed -:2";
        assert_eq!(failed_line(stderr, &cmds), Some(&cmds[1]));
        assert_eq!(failed_line("Command failed -:0", &cmds), None);
        assert_eq!(failed_line("Command failed -:3", &cmds), None);
        assert_eq!(failed_line("something else", &cmds), None);
    }
}
