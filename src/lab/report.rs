//! Probe results for people (a table, a connectivity matrix) and machines (JSON Lines:
//! `explain`'s line plus `observed`, `detail` and `seen_source`).

use std::io::Write;

use serde_json::{Value, json};

use super::probe::{Observation, Observed};
use crate::explain::Probe;
use crate::policy::{Flow, Protocol};

/// One probe with `explain`'s answer and what the lab observed.
#[derive(Debug, Clone)]
pub struct Row {
    /// The probe as written.
    pub probe: Probe,
    /// The flow it resolved to.
    pub flow: Flow,
    /// `explain`'s JSON line for it ([`crate::explain::probe_json`]).
    pub explained: Value,
    /// What happened on the wire.
    pub observation: Observation,
}

impl Row {
    /// `explain`'s verdict: `allow`, `deny` or `reject`.
    pub fn verdict(&self) -> &str {
        self.explained["verdict"].as_str().unwrap_or("")
    }

    /// Whether the observation was made and differs from `explain`'s verdict (errors
    /// always differ; a refusal differs from a deny, and a silent drop from a reject).
    pub fn disagrees(&self) -> bool {
        self.observation.observed != Observed::Untested
            && self.observation.observed.as_str() != self.verdict()
    }

    /// The JSON line: `explain`'s plus `observed`, `detail`, `seen_source`.
    pub fn json(&self) -> Value {
        let mut v = self.explained.clone();
        v["observed"] = json!(self.observation.observed.as_str());
        v["detail"] = json!(self.observation.detail);
        v["seen_source"] = json!(self.observation.seen_source.map(|a| a.to_string()));
        v
    }
}

/// Counts over a run, and its exit code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Summary {
    /// Probes.
    pub probes: usize,
    /// Observed allow.
    pub allow: usize,
    /// Observed deny.
    pub deny: usize,
    /// Observed reject (refused at once).
    pub reject: usize,
    /// Observed error.
    pub errors: usize,
    /// Not tried.
    pub untested: usize,
    /// Observed allow/deny/reject equal to `explain`'s verdict.
    pub agree: usize,
    /// Observations (errors included) that differ from `explain`'s verdict.
    pub disagree: usize,
}

impl Summary {
    /// Counts `rows`.
    pub fn of(rows: &[Row]) -> Summary {
        let mut s = Summary { probes: rows.len(), ..Summary::default() };
        for r in rows {
            match r.observation.observed {
                Observed::Allow => s.allow += 1,
                Observed::Deny => s.deny += 1,
                Observed::Reject => s.reject += 1,
                Observed::Error => s.errors += 1,
                Observed::Untested => s.untested += 1,
            }
            if r.disagrees() {
                s.disagree += 1;
            } else if r.observation.observed != Observed::Untested {
                s.agree += 1;
            }
        }
        s
    }

    /// [`crate::explain::EXIT_OK`] when every observation agrees with `explain`, else
    /// [`crate::explain::EXIT_MISMATCH`].
    pub fn exit_code(&self) -> u8 {
        if self.disagree == 0 { crate::explain::EXIT_OK } else { crate::explain::EXIT_MISMATCH }
    }

    /// One line for people.
    pub fn line(&self) -> String {
        format!(
            "{} probes observed: {} allow, {} deny, {} reject, {} error, {} untested; {} agree with explain, {} disagree",
            self.probes,
            self.allow,
            self.deny,
            self.reject,
            self.errors,
            self.untested,
            self.agree,
            self.disagree
        )
    }
}

fn port_text(flow: &Flow) -> String {
    format!("{}/{}", flow.dst_port, flow.protocol)
}

/// Writes one JSON line per row.
pub fn write_json(rows: &[Row], out: &mut dyn Write) -> std::io::Result<()> {
    for r in rows {
        writeln!(out, "{}", r.json())?;
    }
    Ok(())
}

/// Writes an aligned table, one row per probe, then the summary line.
pub fn write_table(rows: &[Row], out: &mut dyn Write) -> std::io::Result<()> {
    let w_from = rows.iter().map(|r| r.probe.from.len()).max().unwrap_or(0).max(4);
    let w_to = rows.iter().map(|r| r.probe.to.len()).max().unwrap_or(0).max(2);
    writeln!(
        out,
        "{:<w_from$}  {:<w_to$}  {:<10} {:<7} {:<8} DETAIL",
        "FROM", "TO", "PORT", "EXPLAIN", "OBSERVED"
    )?;
    for r in rows {
        let flag = match r.observation.observed {
            Observed::Error => "   <- ERROR",
            _ if r.disagrees() => "   <- DIFFERS FROM EXPLAIN",
            _ => "",
        };
        let expect = match r.probe.expect.as_deref() {
            Some(e) if e != r.verdict() => format!(" (expected {e})"),
            _ => String::new(),
        };
        writeln!(
            out,
            "{:<w_from$}  {:<w_to$}  {:<10} {:<7} {:<8} {}{expect}{flag}",
            r.probe.from,
            r.probe.to,
            port_text(&r.flow),
            r.verdict(),
            r.observation.observed.as_str(),
            r.observation.detail,
        )?;
    }
    writeln!(out, "{}", Summary::of(rows).line())
}

/// Writes the connectivity matrix: a row per `from`, a numbered column per destination
/// (`to:port`, protocol shown when not TCP), cells `A` (allow), `.` (deny), `R` (reject),
/// `E` (error), `?` (untested), followed by `!` where the observation differs from
/// `explain`; then the column legend and the summary line.
pub fn write_matrix(rows: &[Row], out: &mut dyn Write) -> std::io::Result<()> {
    let mut froms: Vec<&str> = Vec::new();
    let mut tos: Vec<String> = Vec::new();
    let column = |r: &Row| match r.flow.protocol {
        Protocol::Tcp => format!("{}:{}", r.probe.to, r.flow.dst_port),
        p => format!("{}:{}/{p}", r.probe.to, r.flow.dst_port),
    };
    for r in rows {
        if !froms.contains(&r.probe.from.as_str()) {
            froms.push(&r.probe.from);
        }
        let c = column(r);
        if !tos.contains(&c) {
            tos.push(c);
        }
    }
    let w = froms.iter().map(|f| f.len()).max().unwrap_or(0).max(4);
    let cw = tos.len().to_string().len().max(2) + 1;
    writeln!(
        out,
        "Observed connectivity: A allow, . deny, R reject, E error, ? untested; ! explain disagrees"
    )?;
    write!(out, "{:<w$} ", "from \\ to")?;
    for i in 1..=tos.len() {
        write!(out, "{i:>cw$}")?;
    }
    writeln!(out)?;
    for f in &froms {
        write!(out, "{f:<w$} ")?;
        for c in &tos {
            let cell = rows.iter().filter(|r| r.probe.from == *f && column(r) == *c).fold(
                String::new(),
                |mut s, r| {
                    s.push(match r.observation.observed {
                        Observed::Allow => 'A',
                        Observed::Deny => '.',
                        Observed::Reject => 'R',
                        Observed::Error => 'E',
                        Observed::Untested => '?',
                    });
                    if r.disagrees() {
                        s.push('!');
                    }
                    s
                },
            );
            let cell = if cell.is_empty() { " ".to_string() } else { cell };
            write!(out, "{cell:>cw$}")?;
        }
        writeln!(out)?;
    }
    writeln!(out, "\nColumns:")?;
    for (i, c) in tos.iter().enumerate() {
        writeln!(out, "{:>cw$}  {c}", i + 1)?;
    }
    let disagreeing: Vec<&Row> = rows.iter().filter(|r| r.disagrees()).collect();
    if !disagreeing.is_empty() {
        writeln!(out, "\nDisagreements with explain:")?;
        for r in disagreeing {
            writeln!(
                out,
                "  {} -> {} {}: explain {}, observed {} ({})",
                r.probe.from,
                r.probe.to,
                port_text(&r.flow),
                r.verdict(),
                r.observation.observed.as_str(),
                r.observation.detail
            )?;
        }
    }
    writeln!(out, "\n{}", Summary::of(rows).line())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(from: &str, to: &str, port: u16, verdict: &str, observed: Observed) -> Row {
        Row {
            probe: Probe {
                from: from.into(),
                to: to.into(),
                port,
                protocol: "TCP".into(),
                family: None,
                expect: None,
                note: None,
            },
            flow: Flow {
                src: "10.0.0.1".parse().unwrap(),
                dst: "10.0.0.2".parse().unwrap(),
                protocol: Protocol::Tcp,
                dst_port: port,
            },
            explained: json!({"from": from, "to": to, "verdict": verdict}),
            observation: Observation {
                observed,
                detail: "d".into(),
                seen_source: Some("10.0.0.1:5".parse().unwrap()),
            },
        }
    }

    #[test]
    fn errors_and_differences_fail_the_run_untested_does_not() {
        let ok = [
            row("a/x", "b/y", 80, "deny", Observed::Deny),
            row("a/x", "b/y", 1, "allow", Observed::Untested),
        ];
        let s = Summary::of(&ok);
        assert_eq!((s.agree, s.disagree, s.untested, s.exit_code()), (1, 0, 1, 0));
        let bad = [row("a/x", "b/y", 80, "deny", Observed::Error)];
        assert_eq!(Summary::of(&bad).exit_code(), 1);
        let differs = [row("a/x", "b/y", 80, "deny", Observed::Allow)];
        assert_eq!(Summary::of(&differs).exit_code(), 1);
    }

    /// A refusal where explain said deny is the bug it is (policy drops silently), and so
    /// is a silent drop where explain said reject; a refusal where it said reject agrees.
    #[test]
    fn reject_agrees_only_with_reject() {
        let agree = [row("a/x", "b/y", 80, "reject", Observed::Reject)];
        let s = Summary::of(&agree);
        assert_eq!((s.reject, s.agree, s.disagree, s.exit_code()), (1, 1, 0, 0));
        for (verdict, observed) in [
            ("deny", Observed::Reject),
            ("allow", Observed::Reject),
            ("reject", Observed::Deny),
            ("reject", Observed::Allow),
            ("reject", Observed::Error),
        ] {
            let s = Summary::of(&[row("a/x", "b/y", 80, verdict, observed)]);
            assert_eq!((s.disagree, s.exit_code()), (1, 1), "explain {verdict}, {observed:?}");
        }
        let mut out = Vec::new();
        write_table(&[row("a/x", "b/y", 80, "deny", Observed::Reject)], &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("deny    reject   d   <- DIFFERS FROM EXPLAIN"), "{text}");
        assert!(text.contains("0 deny, 1 reject, 0 error"), "{text}");
    }

    #[test]
    fn json_line_is_explains_plus_the_observation() {
        let v = row("a/x", "b/y", 80, "allow", Observed::Allow).json();
        assert_eq!(v["verdict"], "allow");
        assert_eq!(v["observed"], "allow");
        assert_eq!(v["detail"], "d");
        assert_eq!(v["seen_source"], "10.0.0.1:5");
    }

    #[test]
    fn matrix_marks_disagreements() {
        let rows = [
            row("a/x", "b/y", 80, "allow", Observed::Allow),
            row("a/x", "b/y", 81, "deny", Observed::Allow),
            row("c/z", "b/y", 80, "deny", Observed::Deny),
            row("c/z", "b/y", 81, "reject", Observed::Reject),
        ];
        let mut out = Vec::new();
        write_matrix(&rows, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[2].split_whitespace().collect::<Vec<_>>(), ["a/x", "A", "A!"]);
        assert_eq!(lines[3].split_whitespace().collect::<Vec<_>>(), ["c/z", ".", "R"]);
        assert!(text.contains("  1  b/y:80\n  2  b/y:81\n"), "{text}");
        assert!(text.contains("a/x -> b/y 81/TCP: explain deny, observed allow"), "{text}");
        assert!(text.ends_with("3 agree with explain, 1 disagree\n"), "{text}");
    }
}
