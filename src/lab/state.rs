//! The state file of a lab: what `lab up` built, so `probe`, `exec` and `down` can find it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::LabError;
use super::plan::Plan;

/// Default directory holding one state directory per lab prefix. Under `/run`: a tmpfs
/// emptied at boot, like the namespaces it describes.
pub const DEFAULT_STATE_ROOT: &str = "/run/tierproxy-lab";
/// Version of the state file format; a different version is refused by `probe`/`exec`
/// (`down` still works: it needs nothing from the file).
pub const STATE_VERSION: u32 = 1;

/// What a background process of the lab does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// An echo server (`tierproxy lab serve`).
    Server,
    /// A node's tierproxy agent (`tierproxy agent`).
    Agent,
}

/// A background process started by `lab up`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessRecord {
    /// Its pid (in the initial pid namespace).
    pub pid: u32,
    /// The namespace it runs in.
    pub netns: String,
    /// Server or agent.
    pub role: Role,
    /// Its stdout/stderr.
    pub log: PathBuf,
}

/// The state file (`<state root>/<prefix>/state.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct State {
    /// [`STATE_VERSION`].
    pub version: u32,
    /// The directory holding this file, logs and ready files.
    pub dir: PathBuf,
    /// The manifests the lab was built from (absolute paths), for `explain` and agents.
    pub manifests: Vec<PathBuf>,
    /// The probe file given to `lab up`, if any (absolute).
    pub probes: Option<PathBuf>,
    /// Whether agents were started.
    pub agents: bool,
    /// Whether the lab was built `--dual-stack` (`lab apply` adds the IPv6 addresses too).
    #[serde(default)]
    pub dual_stack: bool,
    /// The topology: namespaces, interface names, addresses, servers.
    pub plan: Plan,
    /// Background processes.
    pub processes: Vec<ProcessRecord>,
}

/// The state directory of lab `prefix` under `root`.
pub fn state_dir(root: &Path, prefix: &str) -> PathBuf {
    root.join(prefix)
}

/// The state file in state directory `dir`.
pub fn state_file(dir: &Path) -> PathBuf {
    dir.join("state.json")
}

impl State {
    /// Writes the state file atomically (a temporary file renamed over it).
    ///
    /// # Errors
    /// [`LabError::State`] naming the file.
    pub fn save(&self) -> Result<(), LabError> {
        let path = state_file(&self.dir);
        let tmp = self.dir.join("state.json.tmp");
        let text = serde_json::to_string_pretty(self).map_err(|e| LabError::State {
            path: path.clone(),
            source: std::io::Error::other(e),
        })?;
        std::fs::write(&tmp, text + "\n")
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|source| LabError::State { path, source })
    }

    /// Reads the state file of lab `prefix` under `root`.
    ///
    /// # Errors
    /// [`LabError::NotUp`] if there is none, [`LabError::State`] if it cannot be read or is
    /// not a state file of this version.
    pub fn load(root: &Path, prefix: &str) -> Result<State, LabError> {
        let path = state_file(&state_dir(root, prefix));
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(LabError::NotUp { prefix: prefix.to_string(), path });
            }
            Err(source) => return Err(LabError::State { path, source }),
        };
        let state: State = serde_json::from_str(&text).map_err(|e| LabError::State {
            path: path.clone(),
            source: std::io::Error::other(e),
        })?;
        if state.version != STATE_VERSION {
            let msg = format!("version {} (this tierproxy reads {STATE_VERSION})", state.version);
            return Err(LabError::State { path, source: std::io::Error::other(msg) });
        }
        Ok(state)
    }
}
