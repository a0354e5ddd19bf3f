//! Policy routing for TPROXY'd packets, shared by both backends.
//!
//! A packet TPROXY assigned to a local socket keeps its non-local destination address, so
//! the routing decision after PREROUTING would forward it. Documentation/networking/tproxy.rst
//! ("Making non-local sockets work") routes marked packets to the loopback instead:
//!
//! ```text
//! ip rule add fwmark ROUTE/MASK lookup TABLE priority P
//! ip route add local 0.0.0.0/0 dev lo table TABLE        (and -6 with ::/0)
//! ```
//!
//! Rules are added only when missing (`ip rule add` would duplicate them); routes use
//! `replace`, which is idempotent. Removal deletes every matching rule and the route, and
//! succeeds when there is none.

use std::collections::BTreeSet;
use std::net::IpAddr;

use serde_json::Value;

use super::RedirectError;
use super::exec::Cmd;
use crate::config::RedirectConfig;

/// An IP family with its `ip` flag and the any-address prefix of the local default route.
#[derive(Debug, Clone, Copy)]
struct Fam {
    flag: &'static str,
    default: &'static str,
}

const FAMILIES: [Fam; 2] =
    [Fam { flag: "-4", default: "0.0.0.0/0" }, Fam { flag: "-6", default: "::/0" }];

fn rule_args(config: &RedirectConfig) -> Vec<String> {
    vec![
        "fwmark".into(),
        config.route_mark.to_string(),
        "lookup".into(),
        config.route_table.to_string(),
        "priority".into(),
        config.rule_priority.to_string(),
    ]
}

fn route_args(config: &RedirectConfig, fam: Fam) -> Vec<String> {
    ["local", fam.default, "dev", "lo", "table"]
        .into_iter()
        .map(str::to_owned)
        .chain([config.route_table.to_string()])
        .collect()
}

fn ip_cmd(ip: &str, fam: Fam, object: &str, verb: &str, rest: Vec<String>) -> Cmd {
    Cmd::new(ip, [fam.flag, object, verb].into_iter().map(str::to_owned).chain(rest))
}

/// The command lines [`install`] runs (rules only where missing), for `render`.
pub(crate) fn render(config: &RedirectConfig, ip: &str) -> Vec<String> {
    let mut lines = Vec::new();
    for fam in FAMILIES {
        lines.push(format!(
            "{}   (only when `{ip} -j {} rule show` lists no such rule)",
            ip_cmd(ip, fam, "rule", "add", rule_args(config)).line(),
            fam.flag
        ));
        lines.push(ip_cmd(ip, fam, "route", "replace", route_args(config, fam)).line());
    }
    lines
}

/// Parses a hex (`0x…`) or decimal number as `ip -j` prints marks and tables.
fn parse_u32(v: &Value) -> Option<u32> {
    match v {
        Value::Number(n) => n.as_u64().and_then(|n| u32::try_from(n).ok()),
        Value::String(s) => match s.strip_prefix("0x") {
            Some(hex) => u32::from_str_radix(hex, 16).ok(),
            None => s.parse().ok(),
        },
        _ => None,
    }
}

fn json_list(cmd: &Cmd, stdout: &str) -> Result<Vec<Value>, RedirectError> {
    let unexpected = |detail: String| RedirectError::Output { command: cmd.line(), detail };
    match serde_json::from_str::<Value>(stdout) {
        Ok(Value::Array(items)) => Ok(items),
        Ok(other) => Err(unexpected(format!("expected a JSON array, got {other}"))),
        Err(e) => Err(unexpected(format!("invalid JSON: {e}"))),
    }
}

/// How many `ip rule`s of `fam` match tierproxy's (fwmark, mask, table, priority).
fn count_rules(config: &RedirectConfig, ip: &str, fam: Fam) -> Result<usize, RedirectError> {
    let cmd = Cmd::new(ip, ["-j", fam.flag, "rule", "show"]);
    let rules = json_list(&cmd, &cmd.run(None)?)?;
    let table = config.route_table;
    Ok(rules
        .iter()
        .filter(|r| {
            parse_u32(&r["priority"]) == Some(config.rule_priority)
                && parse_u32(&r["fwmark"]) == Some(config.route_mark.value)
                // `ip` omits fwmask when it is all ones.
                && r.get("fwmask").map_or(Some(u32::MAX), parse_u32) == Some(config.route_mark.mask)
                && parse_u32(&r["table"]) == Some(table)
        })
        .count())
}

/// Whether table `route_table` holds the `local default` route of `fam`.
fn has_route(config: &RedirectConfig, ip: &str, fam: Fam) -> Result<bool, RedirectError> {
    // `table all` instead of `table T`: listing a table that does not exist is an error.
    let cmd = Cmd::new(ip, ["-j", fam.flag, "route", "show", "table", "all", "type", "local"]);
    let routes = json_list(&cmd, &cmd.run(None)?)?;
    Ok(routes.iter().any(|r| {
        parse_u32(&r["table"]) == Some(config.route_table) && r["dst"].as_str() == Some("default")
    }))
}

/// Installs the fwmark rule (when missing) and the local default route of both families.
///
/// # Errors
/// The first failing `ip` command, with its standard error.
pub(crate) fn install(config: &RedirectConfig, ip: &str) -> Result<(), RedirectError> {
    for fam in FAMILIES {
        if count_rules(config, ip, fam)? == 0 {
            ip_cmd(ip, fam, "rule", "add", rule_args(config)).run(None)?;
        }
        ip_cmd(ip, fam, "route", "replace", route_args(config, fam)).run(None)?;
    }
    Ok(())
}

/// Removes every matching fwmark rule and the local default route of both families;
/// succeeds when none is installed.
///
/// # Errors
/// The first failing `ip` command, with its standard error.
pub(crate) fn uninstall(config: &RedirectConfig, ip: &str) -> Result<(), RedirectError> {
    for fam in FAMILIES {
        for _ in 0..count_rules(config, ip, fam)? {
            ip_cmd(ip, fam, "rule", "del", rule_args(config)).run(None)?;
        }
        if has_route(config, ip, fam)? {
            ip_cmd(ip, fam, "route", "del", route_args(config, fam)).run(None)?;
        }
    }
    Ok(())
}

/// The `ip -batch` input of [`pod_interfaces`]: one `route get` per address.
fn route_get_input(addrs: &[IpAddr]) -> String {
    addrs.iter().map(|a| format!("route get {}\n", a.to_canonical())).collect()
}

/// The output devices of the routes in `stdout` (one JSON array per `route get`, as `ip -j
/// -batch` prints them), leaving out routes via a gateway, local and other non-unicast
/// routes and `lo`.
fn route_devices(cmd: &Cmd, stdout: &str) -> Result<BTreeSet<String>, RedirectError> {
    let mut out = BTreeSet::new();
    for line in stdout.lines().filter(|l| !l.trim().is_empty()) {
        for r in json_list(cmd, line)? {
            let unicast = r.get("type").is_none_or(|t| t == "unicast");
            let direct = r.get("gateway").is_none() && r.get("via").is_none();
            match r["dev"].as_str() {
                Some(dev) if unicast && direct && dev != "lo" && super::valid_ifname(dev) => {
                    out.insert(dev.to_owned());
                }
                _ => {}
            }
        }
    }
    Ok(out)
}

/// The interfaces through which the node routes `addrs`: see
/// [`super::Backend::pod_interfaces`]. One `ip -j -force -batch -` run; an address without
/// a route makes `ip` print an error for that line and carry on (`-force`), so the exit
/// status is not an error here, only output that is not `ip`'s JSON is.
///
/// # Errors
/// `ip` cannot run, or prints something that is not JSON.
pub(crate) fn pod_interfaces(
    ip: &str,
    addrs: &[IpAddr],
) -> Result<BTreeSet<String>, RedirectError> {
    if addrs.is_empty() {
        return Ok(BTreeSet::new());
    }
    let cmd = Cmd::new(ip, ["-j", "-force", "-batch", "-"]);
    let out = cmd.output(Some(&route_get_input(addrs)))?;
    route_devices(&cmd, &String::from_utf8_lossy(&out.stdout))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn parses_ip_json_numbers() {
        assert_eq!(parse_u32(&json!("0x2000")), Some(0x2000));
        assert_eq!(parse_u32(&json!("1501")), Some(1501));
        assert_eq!(parse_u32(&json!(1501)), Some(1501));
        assert_eq!(parse_u32(&json!("main")), None);
        assert_eq!(parse_u32(&Value::Null), None);
    }

    #[test]
    fn route_devices_keep_direct_routes_only() {
        let cmd = Cmd::new("ip", ["-j"]);
        let out = concat!(
            r#"[{"dst":"10.50.1.2","dev":"pod0","prefsrc":"10.50.0.1","flags":[],"uid":0,"cache":[]}]"#,
            "\n",
            r#"[{"dst":"10.99.0.1","gateway":"192.0.2.1","dev":"eth0","flags":[],"uid":0,"cache":[]}]"#,
            "\n",
            r#"[{"type":"local","dst":"10.50.0.1","dev":"lo","flags":[],"uid":0,"cache":["local"]}]"#,
            "\n",
            r#"[{"dst":"fd00::2","dev":"cni0","flags":[],"uid":0,"cache":[]}]"#,
            "\n",
            r#"[{"dst":"fd00::3","dev":"bad name","flags":[]}]"#,
            "\n"
        );
        let got: Vec<String> = route_devices(&cmd, out).unwrap().into_iter().collect();
        assert_eq!(got, ["cni0", "pod0"]);
        assert!(route_devices(&cmd, "not json\n").is_err());
        assert_eq!(
            route_get_input(&["10.0.0.1".parse().unwrap(), "::ffff:10.0.0.2".parse().unwrap()]),
            "route get 10.0.0.1\nroute get 10.0.0.2\n"
        );
    }

    #[test]
    fn renders_both_families() {
        let lines = render(&RedirectConfig::default(), "ip");
        assert_eq!(
            lines[0],
            "ip -4 rule add fwmark 0x2000/0x2000 lookup 1501 priority 1501   \
             (only when `ip -j -4 rule show` lists no such rule)"
        );
        assert_eq!(lines[1], "ip -4 route replace local 0.0.0.0/0 dev lo table 1501");
        assert_eq!(lines[3], "ip -6 route replace local ::/0 dev lo table 1501");
    }
}
