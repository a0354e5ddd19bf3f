//! Error formatting shared by the commands, the agent and the cluster sources.
//!
//! Kept apart from any command so that a module deep in the daemon (`cluster`, `agent`)
//! formats an error without importing a CLI module (`explain`).

use std::fmt::Write as _;

/// `e`'s message followed by each of its sources ([`std::error::Error::source`]),
/// `: `-separated: `reading x.yaml: line 3: invalid type`. One line, for a log field or a
/// command's `error:` line. The house style keeps a wrapped source out of its wrapper's own
/// message (STYLE.md, "Errors"), so no cause is printed twice.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(cause) = src {
        let _ = write!(s, ": {cause}");
        src = cause.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("reading {file}")]
    struct Outer {
        file: &'static str,
        #[source]
        source: Middle,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("line {0}")]
    struct Middle(u32, #[source] std::io::Error);

    #[test]
    fn chain_names_every_cause_in_order() {
        let e = Outer { file: "x.yaml", source: Middle(3, std::io::Error::other("invalid type")) };
        assert_eq!(chain(&e), "reading x.yaml: line 3: invalid type");
    }

    #[test]
    fn chain_of_an_error_without_source_is_its_message() {
        assert_eq!(chain(&std::io::Error::other("refused")), "refused");
    }
}
