//! Running the netfilter and routing tools: one place that spawns a program, feeds its
//! standard input, and turns a failure into a [`RedirectError`] naming the command line and
//! carrying its standard error.

use std::io::Write;
use std::process::{Command, Output, Stdio};

use super::RedirectError;

/// One command line: program and arguments, kept as strings so errors can print them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Cmd {
    program: String,
    args: Vec<String>,
}

impl Cmd {
    /// `program` with `args`.
    pub(crate) fn new<S: AsRef<str>>(program: &str, args: impl IntoIterator<Item = S>) -> Cmd {
        Cmd {
            program: program.to_owned(),
            args: args.into_iter().map(|a| a.as_ref().to_owned()).collect(),
        }
    }

    /// The command line as a shell user would type it (arguments with spaces are not quoted;
    /// none of ours has any).
    pub(crate) fn line(&self) -> String {
        std::iter::once(self.program.as_str())
            .chain(self.args.iter().map(String::as_str))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Runs the command with `stdin` as its standard input (or none) and returns its output
    /// whatever its exit status.
    ///
    /// # Errors
    /// [`RedirectError::Spawn`] when the program cannot be started or its input not written.
    pub(crate) fn output(&self, stdin: Option<&str>) -> Result<Output, RedirectError> {
        let spawn_err = |source| RedirectError::Spawn { command: self.line(), source };
        let mut child = Command::new(&self.program)
            .args(&self.args)
            .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(spawn_err)?;
        if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
            // A program that exits early closes its end; its stderr then says why, so a
            // broken pipe here is reported through the exit status below, not as a spawn
            // failure.
            match pipe.write_all(input.as_bytes()) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
                Err(e) => return Err(spawn_err(e)),
            }
        }
        child.wait_with_output().map_err(spawn_err)
    }

    /// Runs the command and returns its standard output when it exits with status 0.
    ///
    /// # Errors
    /// [`RedirectError::Spawn`] as for [`Cmd::output`]; [`RedirectError::Failed`] with the
    /// exit status and standard error otherwise.
    pub(crate) fn run(&self, stdin: Option<&str>) -> Result<String, RedirectError> {
        let out = self.output(stdin)?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(self.failed(&out))
        }
    }

    /// The [`RedirectError::Failed`] for a finished command.
    pub(crate) fn failed(&self, out: &Output) -> RedirectError {
        RedirectError::Failed {
            command: self.line(),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_names_command_and_stderr() {
        let cmd = Cmd::new("sh", ["-c", "cat >/dev/null; echo nope >&2; exit 3"]);
        match cmd.run(Some("input\n")) {
            Err(RedirectError::Failed { command, status, stderr }) => {
                assert_eq!(command, "sh -c cat >/dev/null; echo nope >&2; exit 3");
                assert!(status.contains('3'), "{status}");
                assert_eq!(stderr, "nope");
            }
            other => panic!("expected Failed, got {other:?}"),
        }
    }

    #[test]
    fn success_returns_stdout_and_feeds_stdin() {
        let out = Cmd::new("sh", ["-c", "tr a-z A-Z"]).run(Some("abc")).unwrap();
        assert_eq!(out, "ABC");
    }

    #[test]
    fn missing_program_is_a_spawn_error() {
        let err = Cmd::new("tierproxy-no-such-program", ["x"]).run(None).unwrap_err();
        assert!(matches!(err, RedirectError::Spawn { .. }), "{err:?}");
        assert!(err.to_string().contains("tierproxy-no-such-program x"), "{err}");
    }
}
