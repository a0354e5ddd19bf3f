//! The manifest source: Kubernetes objects read from files and directories.
//!
//! Reads what `kubectl apply -f` reads: `.yaml`, `.yml` and `.json` files (directories
//! recursively, in name order), multi-document YAML, concatenated JSON objects, and
//! `kind: List` / `*List` objects, which are flattened. Kinds read: Namespace, Node, Pod
//! (`v1`), NetworkPolicy (`networking.k8s.io/v1`), AdminNetworkPolicy and
//! BaselineAdminNetworkPolicy (`policy.networking.k8s.io/v1alpha1`), ClusterNetworkPolicy
//! (`policy.networking.k8s.io/v1alpha2`), and Antrea's Tier, ClusterNetworkPolicy and
//! NetworkPolicy (`crd.antrea.io/v1beta1`), told from the upstream kinds of the same name
//! by `apiVersion`. Anything else is skipped with a [`Note`].
//!
//! # Antrea-native objects (issue #22)
//!
//! They are decoded here into [`Inputs::antrea`] and validated against each other (a
//! policy's `spec.tier` must name a Tier) where they are used: by the compile of
//! `check` and `explain` ([`crate::policy::compile::admit_antrea`]), and in the agent by
//! its builder, which keeps last good versions (`cluster::builder`). Antrea's older API versions of these
//! kinds (`crd.antrea.io/v1alpha1`, `v1alpha2`, `security.antrea.tanzu.vmware.com/*`) are
//! refused with an error naming the object.
//!
//! # Memory
//!
//! A file is decoded object by object, never as one tree: the items of a list are read one
//! at a time (each into a `serde_json::Value`, then into its type, so a wrong type in one
//! object is that object's error and not the file's), and what is kept depends on the
//! [`Form`]. [`Form::Compact`], the agent's, keeps what the API-server source keeps: Pods
//! as [`PodView`]s (validated here, since the compiler validates only whole Pods), Nodes
//! with only `status.addresses` of their status, and no `managedFields`, owner references
//! or finalizers. A JSON file is read through a buffer, not as a whole. A YAML file's text
//! is held while it is read: serde-saphyr counts its budget over the whole file (below)
//! only when reading from a string; its reader counts per document.
//!
//! # Limits
//!
//! Per file; each is set so that no file within the byte limit reaches another limit
//! unless it nests deeper than [`MAX_DEPTH`] or expands YAML aliases. A file over a limit
//! contributes nothing and is reported as [`LoadError::Limit`], naming the file, the
//! [`Limit`] and where; the other files are still read. The agent then keeps its last good
//! snapshot, logs the error once per change and counts it
//! (`tierproxy_manifest_reload_errors_total`); `check` and `explain` exit 2.
//!
//! | limit | value | why |
//! |---|---|---|
//! | size | [`MAX_FILE_BYTES`] (64 MiB) | above any real manifest set, so a mistaken path (a disk image, a log) fails fast |
//! | nesting depth of lists and maps | [`MAX_DEPTH`] (127) | serde_json's fixed recursion limit; YAML's budget and scanner set to the same; Kubernetes objects nest about 10 deep |
//! | YAML documents | one per byte of the file | a document takes at least 4 bytes (`---` and a line end), so only a file over the size limit could reach it |
//! | YAML nodes (scalars, lists, maps), counted after alias expansion | two per byte of the file, plus [`MAX_ALIAS_NODES`] | no YAML text holds more than 1.5 nodes per byte (`[?,?,…]`; real manifests about one per 10 bytes), so without aliases only the size limit applies; parser events follow from nodes |
//! | YAML alias expansion | [`MAX_ALIAS_NODES`] (1,000,000) nodes replayed per document, and per file what the node limit leaves; as many nodes and [`MAX_ALIAS_SCALAR_BYTES`] (16 MiB) of text recorded under anchors per file; aliases nested 64 deep | a billion-laughs file fails after a million nodes, in well under a second |
//! | YAML anchors, aliases and merge keys (`<<`) | one each per byte of the file | each takes at least two bytes; serde-saphyr's ratio heuristic (at most 10 aliases per anchor) is off, as it refused one anchor shared by many objects |
//! | YAML scalar text, tags spelled out | four bytes per byte of the file, plus [`MAX_ALIAS_SCALAR_BYTES`] | `!!str` counts as `tag:yaml.org,2002:str` |
//! | YAML implicit keys | 1,024 characters | YAML 1.2 §7.4: "at most 1024 Unicode characters" |
//!
//! The YAML limits are serde-saphyr's `Budget` and `AliasLimits`, counted over the whole
//! file (`yaml_options`); its defaults (1,024 documents, 250,000 nodes) refused a list of
//! 10,000 pods of 2 to 3 MB. JSON has no aliases; its size and depth are the only limits.

use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

use crate::policy::api::{Namespace, NetworkPolicy, Node, Pod, antrea, v1alpha1, v1alpha2};
use crate::policy::compile::meta_namespace;
use crate::policy::{Inputs, Kind, ObjectRef, PodView, Problem, ProblemKind};

/// Largest manifest file read, in bytes (64 MiB): far above any real manifest set (a
/// 10,000-pod cluster with 1,000 policies is ~20 MiB of YAML), small enough that a
/// mistaken path (a disk image, a log) fails fast instead of eating memory.
pub const MAX_FILE_BYTES: u64 = 64 << 20;

/// Deepest nesting of lists and maps read (127 levels): serde_json's recursion limit
/// (128, exclusive), which YAML is held to as well. Kubernetes objects nest about 10 deep
/// (a List's items' `spec.ingress[].from[].podSelector.matchExpressions[].values[]`), a
/// CRD's schema about 30.
pub const MAX_DEPTH: usize = 127;

/// Most nodes YAML alias expansion may add to a document, and to a file beyond two nodes
/// per byte (1,000,000, serde-saphyr's default replay limit): anchors shared by thousands
/// of objects stay well below it, an alias bomb (10^12 nodes from a few hundred bytes)
/// fails when it is reached.
pub const MAX_ALIAS_NODES: usize = 1_000_000;

/// Most scalar text YAML alias expansion may copy into a file's objects beyond four bytes
/// per byte of the file (16 MiB): the node limit alone would let a long anchored string be
/// copied a million times.
pub const MAX_ALIAS_SCALAR_BYTES: usize = 16 << 20;

/// Most aliases replaying aliases (serde-saphyr's default replay stack depth).
const MAX_ALIAS_NESTING: usize = 64;

/// A limit of the manifest reader (module docs, "Limits") that a file exceeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// [`MAX_FILE_BYTES`] per file.
    Bytes,
    /// [`MAX_DEPTH`] levels of nested lists and maps.
    Depth,
    /// YAML documents: one per byte of the file.
    Documents,
    /// YAML nodes after alias expansion: two per byte of the file plus [`MAX_ALIAS_NODES`].
    Nodes,
    /// YAML alias expansion: [`MAX_ALIAS_NODES`] nodes replayed per document, as many nodes
    /// and [`MAX_ALIAS_SCALAR_BYTES`] recorded under anchors per file, aliases nested 64
    /// deep.
    AliasExpansion,
    /// YAML scalar text: four bytes per byte of the file plus [`MAX_ALIAS_SCALAR_BYTES`].
    ScalarBytes,
    /// YAML anchors, aliases and merge keys: one each per byte of the file.
    Anchors,
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Limit::Bytes => write!(f, "size: {MAX_FILE_BYTES} bytes (64 MiB) per file"),
            Limit::Depth => write!(f, "nesting: {MAX_DEPTH} levels of lists and maps"),
            Limit::Documents => f.write_str("YAML documents: one per byte of the file"),
            Limit::Nodes => write!(
                f,
                "YAML nodes: two per byte of the file plus {MAX_ALIAS_NODES} from alias expansion"
            ),
            Limit::AliasExpansion => write!(
                f,
                "YAML alias expansion: {MAX_ALIAS_NODES} nodes per document and recorded under \
                 anchors per file, aliases nested {MAX_ALIAS_NESTING} deep"
            ),
            Limit::ScalarBytes => write!(
                f,
                "YAML scalar text: four bytes per byte of the file plus {MAX_ALIAS_SCALAR_BYTES} \
                 from alias expansion"
            ),
            Limit::Anchors => {
                f.write_str("YAML anchors, aliases and merge keys: one each per byte of the file")
            }
        }
    }
}

/// A file-level failure: the file could not be read, is not YAML/JSON at all, or exceeds
/// a [`Limit`].
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The path could not be read (missing, permissions, a directory walk failure).
    #[error("{path}: cannot read")]
    Io {
        /// The path.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The file exceeds one of the reader's limits (module docs, "Limits").
    #[error("{path}: {at}: over the manifest limit on {limit}")]
    Limit {
        /// The path.
        path: PathBuf,
        /// The limit.
        limit: Limit,
        /// Where or by how much: `70000000 bytes`, `line 12 column 5`.
        at: String,
    },
    /// YAML or JSON syntax error.
    #[error("{path}: not valid YAML/JSON: {message}")]
    Syntax {
        /// The path.
        path: PathBuf,
        /// The parser's message, with line and column where it has them.
        message: String,
    },
}

/// What [`load_as`] keeps of the objects it reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Form {
    /// Every object as the file gives it, Pods in [`Inputs::pods`]: for readers of more
    /// than the engine reads (the lab reads pods' annotations, containers and phase;
    /// `explain` a hostNetwork pod's fields).
    #[default]
    Whole,
    /// What the engine reads, as the API-server source stores it
    /// (`cluster::apiserver`): Pods as [`PodView`]s in [`Inputs::pod_views`], validated
    /// here (their problems are in [`Loaded::problems`]; an invalid pod's view takes no
    /// traffic, as the compiler leaves an invalid Pod out); Namespaces without spec and
    /// status; Nodes with only `status.addresses` of their status; no object keeps
    /// `managedFields`, owner references or finalizers. Annotations are kept: validation
    /// reads them (the API source's objects were validated by the API server). A pod
    /// given twice is validated twice (the compiler validates only the copy it keeps).
    Compact,
}

/// Something skipped that the user may want to know about (printed to stderr by the CLI).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Note {
    /// The file.
    pub path: PathBuf,
    /// What was skipped and why.
    pub message: String,
}

impl fmt::Display for Note {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path.display(), self.message)
    }
}

/// Everything read from a set of paths.
#[derive(Debug, Default)]
pub struct Loaded {
    /// The decoded objects.
    pub inputs: Inputs,
    /// Objects that failed to decode (wrong types: errors), unknown fields (warnings), and
    /// with [`Form::Compact`] the Pods' validation problems.
    pub problems: Vec<Problem>,
    /// Skipped documents (other kinds, empty documents).
    pub notes: Vec<Note>,
    /// File-level failures; the files concerned contributed nothing.
    pub errors: Vec<LoadError>,
}

impl Loaded {
    /// Moves everything of `other` to the end of `self`.
    fn append(&mut self, mut other: Loaded) {
        let (i, o) = (&mut self.inputs, &mut other.inputs);
        i.namespaces.append(&mut o.namespaces);
        i.nodes.append(&mut o.nodes);
        i.pods.append(&mut o.pods);
        i.pod_views.append(&mut o.pod_views);
        i.network_policies.append(&mut o.network_policies);
        i.admin_network_policies.append(&mut o.admin_network_policies);
        i.baseline_admin_network_policies.append(&mut o.baseline_admin_network_policies);
        i.cluster_network_policies.append(&mut o.cluster_network_policies);
        i.antrea.append(&mut o.antrea);
        self.problems.append(&mut other.problems);
        self.notes.append(&mut other.notes);
        self.errors.append(&mut other.errors);
    }
}

/// Reads every manifest under `paths` (files or directories), keeping whole objects
/// ([`Form::Whole`]). Never fails as a whole: every failure is collected in [`Loaded`], so
/// one bad file does not hide the others.
pub fn load(paths: &[PathBuf]) -> Loaded {
    load_as(paths, Form::Whole)
}

/// [`load`], keeping the objects in `form`.
pub fn load_as(paths: &[PathBuf], form: Form) -> Loaded {
    let mut out = Loaded::default();
    for path in paths {
        for file in files(path, &mut out.errors) {
            match on_parse_stack(&file, || read(&file, form)) {
                Ok(one) => out.append(one),
                Err(e) => out.errors.push(e),
            }
        }
    }
    out
}

/// A [`fingerprint`] as an agent logs it: 16 lowercase hex digits (the `manifests` field
/// of its `enforcing` line, which `tierproxy lab apply` compares with the fingerprint of
/// the contents it wrote).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FingerprintHex(pub u64);

impl std::fmt::Display for FingerprintHex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// A 64-bit hash of what [`load`] would read under `paths`: each file's path and bytes, in
/// reading order (a file that cannot be read hashes its error). Equal fingerprints mean an
/// event changed nothing (a `touch`, a rewrite with the same content), so a watcher can
/// skip the reload. Not cryptographic; an accidental collision would only delay a reload
/// to the next change.
pub fn fingerprint(paths: &[PathBuf]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let mut errors = Vec::new();
    for path in paths {
        for file in files(path, &mut errors) {
            file.hash(&mut h);
            // Hashed through a buffer: a large file is never whole in memory here either.
            let hashed = std::fs::File::open(&file).and_then(|f| {
                let mut reader = std::io::BufReader::with_capacity(64 << 10, f);
                let mut len = 0u64;
                loop {
                    let chunk = std::io::BufRead::fill_buf(&mut reader)?;
                    if chunk.is_empty() {
                        return Ok(len);
                    }
                    h.write(chunk);
                    let n = chunk.len();
                    len += n as u64;
                    std::io::BufRead::consume(&mut reader, n);
                }
            });
            match hashed {
                Ok(len) => len.hash(&mut h),
                Err(e) => e.kind().hash(&mut h),
            }
        }
    }
    errors.len().hash(&mut h);
    h.finish()
}

/// How long the manifest files must stay quiet before a change is reported: an editor's
/// save, a `kubectl cp` or a ConfigMap update (a symlink swap) is several file events
/// within a few milliseconds, and one reload should see all of them.
pub const DEFAULT_DEBOUNCE: std::time::Duration = std::time::Duration::from_millis(100);

/// A running watch of manifest paths (inotify through the `notify` crate); dropping it stops
/// the watch and closes its channel.
pub struct Watch {
    _watcher: notify::RecommendedWatcher,
}

impl fmt::Debug for Watch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Watch")
    }
}

/// Whether a file event can change what [`load`] reads: creations, writes, renames,
/// removals and metadata changes. Reads and opens (the watcher's own reloads, and every
/// other agent reading the same files) are not changes; reacting to them would reload for
/// ever.
fn is_change(kind: &notify::EventKind) -> bool {
    use notify::EventKind;
    use notify::event::{MetadataKind, ModifyKind};
    match kind {
        EventKind::Create(_) | EventKind::Remove(_) | EventKind::Any => true,
        EventKind::Modify(m) => !matches!(m, ModifyKind::Metadata(MetadataKind::AccessTime)),
        EventKind::Access(_) | EventKind::Other => false,
    }
}

/// Watches `paths` (the files and directories given to [`load`]) and sends the changed
/// paths on the returned channel once no change has come for `debounce`. A directory is
/// watched recursively. A file is watched through its parent directory (editors and
/// ConfigMap volumes replace files by renaming, which a watch on the file itself would
/// lose), and only events for its own name and for the `..data` symlinks of a ConfigMap
/// volume are reported. Reads and opens are not changes. Errors of the watch itself
/// (an overflowing inotify queue) are reported as a change of every path, so the caller
/// reloads rather than misses one.
///
/// # Errors
/// A path that cannot be watched (missing, no permission, the inotify watch limit
/// `fs.inotify.max_user_watches` reached), naming the path.
pub fn watch(
    paths: &[PathBuf],
    debounce: std::time::Duration,
) -> Result<(Watch, std::sync::mpsc::Receiver<Vec<PathBuf>>), LoadError> {
    use notify::{RecursiveMode, Watcher};
    // (watched directory, file name filter): None = everything below the directory.
    let mut targets: Vec<(PathBuf, Option<std::ffi::OsString>)> = Vec::new();
    for p in paths {
        let abs =
            std::path::absolute(p).map_err(|source| LoadError::Io { path: p.clone(), source })?;
        if abs.is_dir() {
            targets.push((abs, None));
        } else {
            let parent = abs.parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("/"));
            targets.push((parent, abs.file_name().map(|n| n.to_os_string())));
        }
    }
    let filter = targets.clone();
    let all: Vec<PathBuf> = paths.to_vec();
    let relevant = move |path: &Path| {
        filter.iter().any(|(dir, name)| match name {
            None => path.starts_with(dir),
            Some(name) => {
                path.parent() == Some(dir.as_path())
                    && path.file_name().is_some_and(|n| {
                        n == name.as_os_str() || n.to_string_lossy().starts_with("..")
                    })
            }
        })
    };
    // The watcher's callback feeds raw changes to a debouncing thread, which sends a batch
    // once changes stop for `debounce`; it ends when the watcher (and its sender) is gone.
    let (raw_tx, raw_rx) = std::sync::mpsc::channel::<Vec<PathBuf>>();
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        let changed: Vec<PathBuf> = match res {
            Ok(e) if is_change(&e.kind) => e.paths.into_iter().filter(|p| relevant(p)).collect(),
            Ok(_) => Vec::new(),
            Err(_) => all.clone(),
        };
        if !changed.is_empty() {
            let _ = raw_tx.send(changed);
        }
    })
    .map_err(|e| LoadError::Io { path: PathBuf::new(), source: std::io::Error::other(e) })?;
    for (dir, name) in &targets {
        let mode =
            if name.is_none() { RecursiveMode::Recursive } else { RecursiveMode::NonRecursive };
        watcher
            .watch(dir, mode)
            .map_err(|e| LoadError::Io { path: dir.clone(), source: std::io::Error::other(e) })?;
    }
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("tierproxy-watch".into())
        .spawn(move || {
            use std::sync::mpsc::RecvTimeoutError;
            while let Ok(mut batch) = raw_rx.recv() {
                loop {
                    match raw_rx.recv_timeout(debounce) {
                        Ok(more) => batch.extend(more),
                        Err(RecvTimeoutError::Timeout) => break,
                        Err(RecvTimeoutError::Disconnected) => break,
                    }
                }
                batch.sort();
                batch.dedup();
                if tx.send(batch).is_err() {
                    return;
                }
            }
        })
        .map_err(|source| LoadError::Io { path: PathBuf::new(), source })?;
    Ok((Watch { _watcher: watcher }, rx))
}

/// Parses manifest text (YAML, any number of documents; JSON if `origin` ends in `.json`)
/// from `origin`, keeping whole objects, as [`load`] reads a file.
///
/// # Errors
/// [`LoadError::Syntax`] if the text is not YAML/JSON, [`LoadError::Limit`] if it exceeds
/// a limit.
pub fn parse_str(origin: &Path, text: &str) -> Result<Loaded, LoadError> {
    parse_str_as(origin, text, Form::Whole)
}

/// [`parse_str`], keeping the objects in `form`.
///
/// # Errors
/// As [`parse_str`].
pub fn parse_str_as(origin: &Path, text: &str, form: Form) -> Result<Loaded, LoadError> {
    if text.len() as u64 > MAX_FILE_BYTES {
        return Err(too_large(origin, text.len() as u64));
    }
    let mut out = on_parse_stack(origin, || {
        if is_json(origin) {
            json_objects(origin, serde_json::Deserializer::from_str(text), form)
        } else {
            yaml_objects(origin, text, form)
        }
    })?;
    set_note_paths(&mut out, origin);
    Ok(out)
}

/// Stack of the thread a file is decoded on (8 MiB, a main thread's): decoding recurses
/// once per level of nesting, [`MAX_DEPTH`] levels took more than the 2 MiB of a spawned
/// thread (the agent's reloader, a test) in a debug build. Only the pages a deep file
/// touches are ever mapped.
const PARSE_STACK_BYTES: usize = 8 << 20;

/// Runs `f` (the decoding of `path`) on a thread with [`PARSE_STACK_BYTES`] of stack,
/// whatever thread calls.
fn on_parse_stack<T: Send>(
    path: &Path,
    f: impl FnOnce() -> Result<T, LoadError> + Send,
) -> Result<T, LoadError> {
    std::thread::scope(|scope| {
        let spawned = std::thread::Builder::new()
            .name("tierproxy-parse".into())
            .stack_size(PARSE_STACK_BYTES)
            .spawn_scoped(scope, f)
            .map_err(|source| LoadError::Io { path: path.to_path_buf(), source })?;
        spawned.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// The files [`load`] reads for `path`, in the order it reads them: `path` itself if it is
/// not a directory, else every `.yaml`, `.yml` and `.json` file below it, in name order.
/// Directory walk failures are pushed to `errors`.
pub fn files(path: &Path, errors: &mut Vec<LoadError>) -> Vec<PathBuf> {
    if !path.is_dir() {
        // Named explicitly: read whatever the extension (and report if missing).
        return vec![path.to_path_buf()];
    }
    let mut out = Vec::new();
    for entry in walkdir::WalkDir::new(path).follow_links(true).sort_by_file_name() {
        match entry {
            Ok(e) if e.file_type().is_file() => {
                let ext = e.path().extension().and_then(|x| x.to_str()).unwrap_or("");
                if matches!(ext, "yaml" | "yml" | "json") {
                    out.push(e.into_path());
                }
            }
            Ok(_) => {}
            Err(err) => {
                let p = err.path().unwrap_or(path).to_path_buf();
                errors.push(LoadError::Io { path: p, source: err.into() });
            }
        }
    }
    out
}

/// The documents of one manifest file as [`load`] reads them (size and the other limits,
/// YAML 1.2 core booleans, concatenated JSON objects), before any kind is looked at, each
/// whole. For readers of kinds the policy loader skips (the lab reads `v1` Services with
/// it), in files of a few objects.
///
/// # Errors
/// [`LoadError::Io`], [`LoadError::Limit`] or [`LoadError::Syntax`].
pub fn documents(path: &Path) -> Result<Vec<Value>, LoadError> {
    on_parse_stack(path, || documents_here(path))
}

fn documents_here(path: &Path) -> Result<Vec<Value>, LoadError> {
    let (size, text) = read_text(path)?;
    if is_json(path) {
        return serde_json::Deserializer::from_str(&text)
            .into_iter::<Value>()
            .collect::<Result<_, _>>()
            .map_err(|e| json_error(path, e));
    }
    let docs: Vec<Option<Value>> =
        serde_saphyr::from_multiple_with_options(&text, yaml_options(size))
            .map_err(|e| yaml_error(path, e))?;
    Ok(docs.into_iter().flatten().collect())
}

fn is_json(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "json")
}

fn too_large(path: &Path, size: u64) -> LoadError {
    LoadError::Limit { path: path.to_path_buf(), limit: Limit::Bytes, at: format!("{size} bytes") }
}

/// Notes are made without their file (a document's decoder does not know it); `path`'s
/// are given it here.
fn set_note_paths(out: &mut Loaded, path: &Path) {
    for n in &mut out.notes {
        n.path = path.to_path_buf();
    }
}

/// The text of `path` and its length, refusing more than [`MAX_FILE_BYTES`] (also when the
/// file grows while it is read).
fn read_text(path: &Path) -> Result<(usize, String), LoadError> {
    let (mut capped, size) = open_capped(path)?;
    let mut text = String::with_capacity(size as usize);
    capped.read_to_string(&mut text).map_err(|source| io_error(path, source))?;
    if text.len() as u64 > MAX_FILE_BYTES {
        return Err(too_large(path, text.len() as u64));
    }
    Ok((text.len(), text))
}

fn io_error(path: &Path, source: std::io::Error) -> LoadError {
    LoadError::Io { path: path.to_path_buf(), source }
}

/// `path` opened, refused if larger than [`MAX_FILE_BYTES`], and its size. What is read
/// from it stops a byte past the limit: a file that grows while it is read is refused too.
fn open_capped(path: &Path) -> Result<(std::io::Take<std::fs::File>, u64), LoadError> {
    let file = std::fs::File::open(path).map_err(|e| io_error(path, e))?;
    let size = file.metadata().map_err(|e| io_error(path, e))?.len();
    if size > MAX_FILE_BYTES {
        return Err(too_large(path, size));
    }
    Ok((file.take(MAX_FILE_BYTES + 1), size))
}

/// Reads one file in `form`. JSON is decoded from a buffered reader (the text is never
/// whole in memory); YAML from its text, which serde-saphyr's file-wide limits need.
fn read(path: &Path, form: Form) -> Result<Loaded, LoadError> {
    let mut out = if is_json(path) {
        let (mut capped, _) = open_capped(path)?;
        let reader = std::io::BufReader::with_capacity(64 << 10, &mut capped);
        let result = json_objects(path, serde_json::Deserializer::from_reader(reader), form);
        if capped.limit() == 0 {
            return Err(too_large(path, MAX_FILE_BYTES + 1));
        }
        result?
    } else {
        let (_, text) = read_text(path)?;
        yaml_objects(path, &text, form)?
    };
    set_note_paths(&mut out, path);
    Ok(out)
}

/// serde-saphyr's options for a YAML file of `len` bytes: YAML 1.2 core booleans (with
/// YAML 1.1's `y`/`n`/`on`/`off`, `name: n` would decode as `false` before the typed
/// decoder sees it), no comment events (nothing reads them), and the limits of the module
/// docs, counted over the whole file.
fn yaml_options(len: usize) -> serde_saphyr::Options {
    let mut budget = serde_saphyr::Budget::default();
    budget.max_reader_input_bytes = Some(MAX_FILE_BYTES as usize);
    budget.max_depth = MAX_DEPTH;
    // The scanner's limit on flow collections (`[[[`), checked as it reads ahead.
    budget.flow_nesting_limit = MAX_DEPTH;
    budget.max_documents = len + 1;
    budget.max_nodes = len.saturating_mul(2).saturating_add(MAX_ALIAS_NODES);
    // Every event is a node, a node's end, a document's start or end, an alias, or the
    // stream's start or end.
    budget.max_events = budget
        .max_nodes
        .saturating_mul(2)
        .saturating_add(budget.max_documents.saturating_mul(2))
        .saturating_add(len)
        .saturating_add(2);
    budget.max_total_scalar_bytes = len.saturating_mul(4).saturating_add(MAX_ALIAS_SCALAR_BYTES);
    budget.max_aliases = len;
    budget.max_anchors = len;
    budget.max_merge_keys = len;
    // What anchored nodes record for their aliases to replay: an anchor holding an alias
    // records its expansion.
    budget.max_recorded_anchor_events = MAX_ALIAS_NODES;
    budget.max_recorded_anchor_bytes = MAX_ALIAS_SCALAR_BYTES;
    // The alias/anchor ratio heuristic would refuse one anchor shared by a thousand
    // objects; the node and alias limits bound what aliases can cost.
    budget.enforce_alias_anchor_ratio = false;
    let mut options = serde_saphyr::Options::default();
    options.strict_booleans = true;
    options.emit_comments = false;
    options.budget = Some(budget);
    options.alias_limits.max_total_replayed_events = MAX_ALIAS_NODES;
    options.alias_limits.max_replay_stack_depth = MAX_ALIAS_NESTING;
    options
}

/// The objects of a YAML text, document by document.
fn yaml_objects(path: &Path, text: &str, form: Form) -> Result<Loaded, LoadError> {
    let options = yaml_options(text.len());
    let docs = match form {
        Form::Whole => {
            serde_saphyr::from_str_multiple_with_options::<Doc<false>, Docs>(text, options)
        }
        Form::Compact => {
            serde_saphyr::from_str_multiple_with_options::<Doc<true>, Docs>(text, options)
        }
    };
    docs.map(|d| d.0).map_err(|e| yaml_error(path, e))
}

/// The objects of a JSON stream (any number of concatenated values), value by value.
fn json_objects<'de, R: serde_json::de::Read<'de>>(
    path: &Path,
    de: serde_json::Deserializer<R>,
    form: Form,
) -> Result<Loaded, LoadError> {
    fn each<'de, const COMPACT: bool, R: serde_json::de::Read<'de>>(
        path: &Path,
        de: serde_json::Deserializer<R>,
    ) -> Result<Loaded, LoadError> {
        let mut out = Loaded::default();
        for doc in de.into_iter::<Doc<COMPACT>>() {
            out.append(doc.map_err(|e| json_error(path, e))?.0);
        }
        Ok(out)
    }
    match form {
        Form::Whole => each::<false, R>(path, de),
        Form::Compact => each::<true, R>(path, de),
    }
}

/// A serde-saphyr error as a [`LoadError`]: a [`Limit`] where a budget or alias limit was
/// hit, else a syntax error with the parser's message.
fn yaml_error(path: &Path, e: serde_saphyr::Error) -> LoadError {
    use serde_saphyr::Error as E;
    use serde_saphyr::budget::BudgetBreach as B;
    use serde_saphyr::granit_parser;
    let mut inner = &e;
    while let E::WithSnippet { error, .. } | E::AliasError { error, .. } = inner {
        inner = error;
    }
    let limit = match inner {
        E::Budget { breach, .. } => match breach {
            B::InputBytes { .. } => Some(Limit::Bytes),
            B::Depth { .. } => Some(Limit::Depth),
            B::Documents { .. } => Some(Limit::Documents),
            B::Nodes { .. } | B::Events { .. } => Some(Limit::Nodes),
            B::ScalarBytes { .. } => Some(Limit::ScalarBytes),
            B::Aliases { .. }
            | B::Anchors { .. }
            | B::MergeKeys { .. }
            | B::AliasAnchorRatio { .. } => Some(Limit::Anchors),
            B::RecordedAnchorEvents { .. } | B::RecordedAnchorBytes { .. } => {
                Some(Limit::AliasExpansion)
            }
            _ => None,
        },
        // The scanner's own nesting limit (flow collections, read ahead of the budget).
        E::ExternalMessage { source, .. }
            if matches!(
                &**source,
                serde_saphyr::ExternalMessageSource::Parser(scan)
                    if matches!(scan.kind(), granit_parser::ErrorKind::RecursionLimitExceeded)
            ) =>
        {
            Some(Limit::Depth)
        }
        E::AliasReplayLimitExceeded { .. }
        | E::AliasReplayStackDepthExceeded { .. }
        | E::AliasExpansionLimitExceeded { .. }
        | E::AliasReplayCounterOverflow { .. } => Some(Limit::AliasExpansion),
        _ => None,
    };
    match limit {
        Some(limit) => {
            let at = match e.location() {
                Some(l) => format!("line {} column {}", l.line(), l.column()),
                None => "at an unknown position".into(),
            };
            LoadError::Limit { path: path.to_path_buf(), limit, at }
        }
        None => LoadError::Syntax { path: path.to_path_buf(), message: e.to_string() },
    }
}

/// A serde_json error as a [`LoadError`]: its recursion limit is [`Limit::Depth`] (serde_json
/// gives it no category of its own, only its message), an I/O error is [`LoadError::Io`].
fn json_error(path: &Path, e: serde_json::Error) -> LoadError {
    if e.is_io() {
        return io_error(path, e.into());
    }
    if e.to_string().starts_with("recursion limit exceeded") {
        let at = format!("line {} column {}", e.line(), e.column());
        return LoadError::Limit { path: path.to_path_buf(), limit: Limit::Depth, at };
    }
    LoadError::Syntax { path: path.to_path_buf(), message: e.to_string() }
}

/// One document of a file (or one JSON value), decoded object by object into its own
/// [`Loaded`] (its notes without their file). `COMPACT`: [`Form::Compact`].
struct Doc<const COMPACT: bool>(Loaded);

impl<'de, const COMPACT: bool> serde::Deserialize<'de> for Doc<COMPACT> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut out = Loaded::default();
        let form = if COMPACT { Form::Compact } else { Form::Whole };
        ObjectSeed { out: &mut out, form }.deserialize(d)?;
        Ok(Doc(out))
    }
}

/// The documents of a file, appended one by one as serde-saphyr reads them.
#[derive(Default)]
struct Docs(Loaded);

impl<const COMPACT: bool> Extend<Doc<COMPACT>> for Docs {
    fn extend<I: IntoIterator<Item = Doc<COMPACT>>>(&mut self, docs: I) {
        for d in docs {
            self.0.append(d.0);
        }
    }
}

/// The `visit_*` methods of a visitor for every scalar (and null): each returns
/// `$on(self, what)`, `what` naming the type as a note says it ("a number").
macro_rules! scalars {
    ($value:ty, $on:expr) => {
        fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<$value, E> {
            Ok($on(self, "a boolean"))
        }
        fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<$value, E> {
            Ok($on(self, "a number"))
        }
        fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<$value, E> {
            Ok($on(self, "a number"))
        }
        fn visit_i128<E: serde::de::Error>(self, _: i128) -> Result<$value, E> {
            Ok($on(self, "a number"))
        }
        fn visit_u128<E: serde::de::Error>(self, _: u128) -> Result<$value, E> {
            Ok($on(self, "a number"))
        }
        fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<$value, E> {
            Ok($on(self, "a number"))
        }
        fn visit_str<E: serde::de::Error>(self, _: &str) -> Result<$value, E> {
            Ok($on(self, "a string"))
        }
        fn visit_unit<E: serde::de::Error>(self) -> Result<$value, E> {
            Ok($on(self, "null"))
        }
        fn visit_none<E: serde::de::Error>(self) -> Result<$value, E> {
            Ok($on(self, "null"))
        }
    };
}

/// Decodes one object (a document, or an item of a list) into `out`. Its fields are read
/// one by one; `items` is not kept as a tree but read item by item, each into its own
/// object: a List document of 100,000 pods is never whole in memory.
struct ObjectSeed<'a> {
    out: &'a mut Loaded,
    form: Form,
}

impl<'de> DeserializeSeed<'de> for ObjectSeed<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl ObjectSeed<'_> {
    fn not_an_object(self, what: &str) {
        let message = format!("skipped a document that is not an object ({what})");
        self.out.notes.push(Note { path: PathBuf::new(), message });
    }
}

impl<'de> Visitor<'de> for ObjectSeed<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a Kubernetes object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut fields = serde_json::Map::new();
        // Some: `items` was a list, whose objects were read into this.
        let mut items: Option<Loaded> = None;
        while let Some(key) = map.next_key::<String>()? {
            if key == "items" {
                let mut list = Loaded::default();
                let is_list = map.next_value_seed(ItemsSeed { out: &mut list, form: self.form })?;
                items = is_list.then_some(list);
                // Its value is not needed again: a List takes the objects read, and no
                // other kind read has an `items` field, so for them it is an unknown
                // field, which is reported by name only.
                fields.insert(key, Value::Null);
            } else {
                let value: Value = map.next_value()?;
                fields.insert(key, value);
            }
        }
        add(fields, items, self.out, self.form);
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        // Read as values, one at a time and dropped: serde_json's depth limit applies
        // only where it builds values (it skips `IgnoredAny` without one).
        while seq.next_element::<Value>()?.is_some() {}
        self.not_an_object("a list");
        Ok(())
    }

    scalars!((), |seed: Self, what| {
        seed.not_an_object(what);
    });

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

/// Reads the value of an object's `items`: a list's elements, each an object decoded into
/// `out` as it is read (true); anything else is skipped (false).
struct ItemsSeed<'a> {
    out: &'a mut Loaded,
    form: Form,
}

impl<'de> DeserializeSeed<'de> for ItemsSeed<'_> {
    type Value = bool;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ItemsSeed<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of objects")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<bool, A::Error> {
        let (out, form) = (self.out, self.form);
        while seq.next_element_seed(ObjectSeed { out: &mut *out, form })?.is_some() {}
        Ok(true)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<bool, A::Error> {
        // As values, for the depth limit (see `ObjectSeed::visit_seq`).
        while map.next_entry::<IgnoredAny, Value>()?.is_some() {}
        Ok(false)
    }

    scalars!(bool, |_seed: Self, _what| false);

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_any(self)
    }
}

/// Formats a serde_ignored path as `spec.ingress[0].from`.
fn ignored_path(p: &serde_ignored::Path<'_>) -> String {
    use serde_ignored::Path as P;
    match p {
        P::Root => String::new(),
        P::Seq { parent, index } => format!("{}[{index}]", ignored_path(parent)),
        P::Map { parent, key } => {
            let parent = ignored_path(parent);
            if parent.is_empty() { key.clone() } else { format!("{parent}.{key}") }
        }
        P::Some { parent } | P::NewtypeStruct { parent } | P::NewtypeVariant { parent } => {
            ignored_path(parent)
        }
    }
}

fn object_ref(kind: Kind, doc: &Value) -> ObjectRef {
    let meta = doc.get("metadata");
    let name = meta.and_then(|m| m.get("name")).and_then(Value::as_str).unwrap_or("").to_string();
    match kind {
        Kind::Pod | Kind::NetworkPolicy | Kind::AntreaNetworkPolicy => {
            let ns = meta
                .and_then(|m| m.get("namespace"))
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty());
            ObjectRef::namespaced(kind, ns.unwrap_or("default"), name)
        }
        _ => ObjectRef::cluster(kind, name),
    }
}

/// Decodes `doc` as `T`, reporting wrong types with their field path (error) and fields
/// `T` does not know (warning; newer upstream versions add fields).
fn decode<T: DeserializeOwned>(
    obj: &ObjectRef,
    doc: Value,
    problems: &mut Vec<Problem>,
) -> Option<T> {
    let mut unknown = Vec::new();
    let mut on_ignored = |p: serde_ignored::Path<'_>| unknown.push(ignored_path(&p));
    let de = serde_ignored::Deserializer::new(doc, &mut on_ignored);
    let result: Result<T, _> = serde_path_to_error::deserialize(de);
    for field in unknown {
        // kube-derive's root types skip apiVersion/kind rather than read them.
        if field != "apiVersion" && field != "kind" {
            problems.push(Problem::warning(obj, field, ProblemKind::UnknownField));
        }
    }
    match result {
        Ok(v) => Some(v),
        Err(e) => {
            let field = e.path().to_string();
            let field = if field == "." { String::new() } else { field };
            problems.push(Problem::error(
                obj,
                field,
                ProblemKind::Decode { reason: e.into_inner().to_string() },
            ));
            None
        }
    }
}

/// Adds the object of `fields` to `out`; `items`: the objects of its `items` list, if it
/// had one (see [`ObjectSeed`]).
fn add(
    fields: serde_json::Map<String, Value>,
    items: Option<Loaded>,
    out: &mut Loaded,
    form: Form,
) {
    let note =
        |out: &mut Loaded, message: String| out.notes.push(Note { path: PathBuf::new(), message });
    let text = |key: &str| fields.get(key).and_then(Value::as_str).unwrap_or("").to_string();
    let (api_version, kind) = (text("apiVersion"), text("kind"));
    // "kind: List" (kubectl get -o yaml) and typed lists ("PodList", ...) are flattened.
    if kind == "List" || kind.ends_with("List") {
        match items {
            Some(list) => out.append(list),
            None => note(out, format!("skipped {kind} without an items list")),
        }
        return;
    }
    let doc = Value::Object(fields);
    let known = match (api_version.as_str(), kind.as_str()) {
        ("v1", "Namespace") => Kind::Namespace,
        ("v1", "Node") => Kind::Node,
        ("v1", "Pod") => Kind::Pod,
        ("networking.k8s.io/v1", "NetworkPolicy") => Kind::NetworkPolicy,
        ("policy.networking.k8s.io/v1alpha1", "AdminNetworkPolicy") => Kind::AdminNetworkPolicy,
        ("policy.networking.k8s.io/v1alpha1", "BaselineAdminNetworkPolicy") => {
            Kind::BaselineAdminNetworkPolicy
        }
        ("policy.networking.k8s.io/v1alpha2", "ClusterNetworkPolicy") => Kind::ClusterNetworkPolicy,
        (antrea::API_VERSION, "Tier") => Kind::AntreaTier,
        (antrea::API_VERSION, "ClusterNetworkPolicy") => Kind::AntreaClusterNetworkPolicy,
        (antrea::API_VERSION, "NetworkPolicy") => Kind::AntreaNetworkPolicy,
        (v, k @ ("Tier" | "ClusterNetworkPolicy" | "NetworkPolicy")) if is_antrea_group(v) => {
            let kind = match k {
                "Tier" => Kind::AntreaTier,
                "ClusterNetworkPolicy" => Kind::AntreaClusterNetworkPolicy,
                _ => Kind::AntreaNetworkPolicy,
            };
            let obj = object_ref(kind, &doc);
            out.problems.push(Problem::error(
                &obj,
                "apiVersion",
                ProblemKind::Invalid { value: v.to_owned(), reason: antrea_version_refusal(v) },
            ));
            return;
        }
        (v, k @ ("ClusterGroup" | "Group")) if is_antrea_group(v) => {
            let name = doc.pointer("/metadata/name").and_then(Value::as_str).unwrap_or("");
            note(
                out,
                format!(
                    "skipped {v} {k} {name:?}: Antrea ClusterGroups and Groups are not supported \
                     by tierproxy; policies that reference one are warned about"
                ),
            );
            return;
        }
        _ => {
            let name = doc.pointer("/metadata/name").and_then(Value::as_str).unwrap_or("");
            let what = if kind.is_empty() {
                "a document without kind".to_string()
            } else {
                format!("{api_version} {kind} {name:?}")
            };
            note(out, format!("skipped {what}: not a kind tierproxy reads"));
            return;
        }
    };
    let obj = object_ref(known, &doc);
    let problems = &mut out.problems;
    let inputs = &mut out.inputs;
    let compact = form == Form::Compact;
    match known {
        Kind::Namespace => inputs.namespaces.extend(
            decode::<Namespace>(&obj, doc, problems)
                .map(|n| if compact { compact_namespace(n) } else { n })
                .map(Arc::new),
        ),
        Kind::Node => inputs.nodes.extend(
            decode::<Node>(&obj, doc, problems)
                .map(|n| if compact { compact_node(n) } else { n })
                .map(Arc::new),
        ),
        Kind::Pod => {
            let Some(pod) = decode::<Pod>(&obj, doc, problems).map(default_namespace) else {
                return;
            };
            if compact {
                inputs.pod_views.push(Arc::new(pod_view(&pod, problems)));
            } else {
                inputs.pods.push(Arc::new(pod));
            }
        }
        Kind::NetworkPolicy => inputs.network_policies.extend(
            decode::<NetworkPolicy>(&obj, doc, problems)
                .map(default_namespace)
                .map(|p| if compact { compact_meta(p) } else { p })
                .map(Arc::new),
        ),
        Kind::AdminNetworkPolicy => inputs.admin_network_policies.extend(
            decode::<v1alpha1::AdminNetworkPolicy>(&obj, doc, problems)
                .map(|p| if compact { compact_meta(p) } else { p })
                .map(Arc::new),
        ),
        Kind::BaselineAdminNetworkPolicy => inputs.baseline_admin_network_policies.extend(
            decode::<v1alpha1::BaselineAdminNetworkPolicy>(&obj, doc, problems)
                .map(|p| if compact { compact_meta(p) } else { p })
                .map(Arc::new),
        ),
        Kind::ClusterNetworkPolicy => inputs.cluster_network_policies.extend(
            decode::<v1alpha2::ClusterNetworkPolicy>(&obj, doc, problems)
                .map(|p| if compact { compact_meta(p) } else { p })
                .map(Arc::new),
        ),
        // Validated with each other where they are compiled (`compile::admit_antrea`).
        Kind::AntreaTier => inputs.antrea.tiers.extend(
            decode::<antrea::Tier>(&obj, doc, problems)
                .map(|p| if compact { compact_meta(p) } else { p })
                .map(Arc::new),
        ),
        Kind::AntreaClusterNetworkPolicy => inputs.antrea.cluster_network_policies.extend(
            decode::<antrea::ClusterNetworkPolicy>(&obj, doc, problems)
                .map(|p| if compact { compact_meta(p) } else { p })
                .map(Arc::new),
        ),
        Kind::AntreaNetworkPolicy => inputs.antrea.network_policies.extend(
            decode::<antrea::NetworkPolicy>(&obj, doc, problems)
                .map(|mut p| {
                    p.metadata.namespace = Some(meta_namespace(&p.metadata));
                    p
                })
                .map(|p| if compact { compact_meta(p) } else { p })
                .map(Arc::new),
        ),
    }
}

/// Whether `api_version` is in one of Antrea's policy API groups, current
/// (`crd.antrea.io`) or pre-1.0 (`security.antrea.tanzu.vmware.com`).
fn is_antrea_group(api_version: &str) -> bool {
    let group = api_version.split_once('/').map_or("", |(g, _)| g);
    group == antrea::GROUP || group == antrea::LEGACY_GROUP
}

/// Why a Tier, ClusterNetworkPolicy or NetworkPolicy of an Antrea `api_version` other than
/// `crd.antrea.io/v1beta1` is refused.
fn antrea_version_refusal(api_version: &str) -> String {
    let older = api_version.starts_with(antrea::LEGACY_GROUP)
        || api_version.starts_with("crd.antrea.io/v1alpha");
    if older {
        format!(
            "an older Antrea API version, no longer served by Antrea; tierproxy reads this kind \
             only as {}: rewrite apiVersion and check the spec against it (the v1beta1 \
             static Tiers are emergency 50, securityops 100, networkops 150, platform 200, \
             application 250, baseline 253)",
            antrea::API_VERSION
        )
    } else {
        format!(
            "an Antrea API version tierproxy does not know; it reads this kind only as {}",
            antrea::API_VERSION
        )
    }
}

/// The view of `pod` ([`Form::Compact`]), its validation problems pushed to `problems`.
/// The compiler validates whole Pods only, and leaves an invalid one out: no IP, no
/// traffic; its view says so with `terminated`.
fn pod_view(pod: &Pod, problems: &mut Vec<Problem>) -> PodView {
    let start = problems.len();
    crate::policy::validate::pod(pod, problems);
    let mut view = PodView::from_pod(pod);
    if problems[start..].iter().any(Problem::is_error) {
        view.terminated = true;
    }
    view
}

/// `o` without what no kind's validation or compilation reads of its metadata
/// (`managedFields`, often the largest part of an object, owner references, finalizers).
/// Annotations stay: validation reads them.
fn compact_meta<K: kube::Resource>(mut o: K) -> K {
    let meta = o.meta_mut();
    meta.managed_fields = None;
    meta.owner_references = None;
    meta.finalizers = None;
    o
}

/// A Namespace as [`Form::Compact`] keeps it: its metadata ([`compact_meta`]).
fn compact_namespace(n: Namespace) -> Namespace {
    Namespace { spec: None, status: None, ..compact_meta(n) }
}

/// A Node as [`Form::Compact`] keeps it: its metadata ([`compact_meta`]) and
/// `status.addresses` (a node's status also lists its images and conditions, often
/// kilobytes).
fn compact_node(n: Node) -> Node {
    use k8s_openapi::api::core::v1::NodeStatus;
    let n = compact_meta(n);
    let status = n.status.map(|s| NodeStatus { addresses: s.addresses, ..NodeStatus::default() });
    Node { metadata: n.metadata, spec: None, status }
}

/// Namespaced objects without `metadata.namespace` land in `default`, as with `kubectl
/// apply` and no `-n`.
fn default_namespace<
    T: k8s_openapi::Metadata<Ty = k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>,
>(
    mut obj: T,
) -> T {
    let ns = meta_namespace(obj.metadata());
    obj.metadata_mut().namespace = Some(ns);
    obj
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Loaded {
        parse_str(Path::new("test.yaml"), text).unwrap()
    }

    #[test]
    fn multi_document_yaml_and_lists_are_flattened() {
        let l = parse(
            "apiVersion: v1\nkind: Namespace\nmetadata: {name: a}\n---\n---\napiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Pod\n  metadata: {name: p}\n- apiVersion: v1\n  kind: NamespaceList\n  items: [{apiVersion: v1, kind: Namespace, metadata: {name: b}}]\n",
        );
        assert_eq!(l.inputs.namespaces.len(), 2);
        assert_eq!(l.inputs.pods.len(), 1);
        assert_eq!(l.inputs.pods[0].metadata.namespace.as_deref(), Some("default"));
        assert!(l.problems.is_empty(), "{:?}", l.problems);
    }

    #[test]
    fn wrong_type_names_object_and_field() {
        let l = parse(
            "apiVersion: policy.networking.k8s.io/v1alpha1\nkind: AdminNetworkPolicy\nmetadata: {name: x}\nspec:\n  priority: high\n  subject: {namespaces: {}}\n",
        );
        assert!(l.inputs.admin_network_policies.is_empty());
        let p = &l.problems[0];
        assert!(p.is_error());
        assert_eq!(p.object, ObjectRef::cluster(Kind::AdminNetworkPolicy, "x"));
        assert_eq!(p.field, "spec.priority");
    }

    #[test]
    fn unknown_fields_are_warnings_with_their_path() {
        let l = parse(
            "apiVersion: policy.networking.k8s.io/v1alpha1\nkind: AdminNetworkPolicy\nmetadata: {name: x}\nspec:\n  priority: 1\n  subject: {namespaces: {}}\n  egress:\n  - action: Deny\n    to: [{futurePeer: {}}]\n",
        );
        assert_eq!(l.inputs.admin_network_policies.len(), 1);
        assert_eq!(l.problems.len(), 1, "{:?}", l.problems);
        assert_eq!(l.problems[0].field, "spec.egress[0].to[0].futurePeer");
        assert_eq!(l.problems[0].kind, ProblemKind::UnknownField);
    }

    #[test]
    fn other_kinds_and_api_groups_are_skipped_with_a_note() {
        let l = parse(
            "apiVersion: crd.antrea.io/v1beta1\nkind: ExternalIPPool\nmetadata: {name: pool}\n---\napiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\n---\napiVersion: crd.antrea.io/v1alpha2\nkind: ExternalIPPool\nmetadata: {name: old-pool}\n---\napiVersion: crd.antrea.io/v1beta1\nkind: ClusterGroup\nmetadata: {name: cg}\n",
        );
        assert!(l.inputs.cluster_network_policies.is_empty() && l.inputs.antrea.is_empty());
        assert!(l.problems.is_empty(), "{:?}", l.problems);
        let notes: Vec<_> = l.notes.iter().map(|n| n.message.as_str()).collect();
        assert_eq!(notes.len(), 4, "{notes:?}");
        assert!(notes[0].contains("crd.antrea.io/v1beta1 ExternalIPPool \"pool\""), "{notes:?}");
        // Another Antrea kind of an older version is not a policy: noted, not refused.
        assert!(notes[2].contains("crd.antrea.io/v1alpha2 ExternalIPPool"), "{notes:?}");
        assert!(notes[3].contains("ClusterGroups and Groups are not supported"), "{notes:?}");
    }

    /// An Antrea object: `kind`, `apiVersion: crd.antrea.io/v1beta1`, the given metadata
    /// and spec, as YAML flow.
    fn antrea(kind: &str, meta: &str, spec: &str) -> String {
        format!(
            "apiVersion: crd.antrea.io/v1beta1\nkind: {kind}\nmetadata: {meta}\nspec: {spec}\n---\n"
        )
    }

    /// The kinds Antrea shares with upstream are told apart by apiVersion: each goes to its
    /// own list, the upstream ones unchanged.
    #[test]
    fn antrea_kinds_are_dispatched_on_api_version() {
        let text = [
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: p, namespace: x}\nspec: {podSelector: {}}\n---\n".to_owned(),
            "apiVersion: policy.networking.k8s.io/v1alpha2\nkind: ClusterNetworkPolicy\nmetadata: {name: c}\nspec: {tier: Admin, priority: 1, subject: {namespaces: {}}}\n---\n".to_owned(),
            antrea("NetworkPolicy", "{name: p, namespace: x}", "{priority: 1, appliedTo: [{podSelector: {}}], ingress: [{action: Drop}]}"),
            antrea("ClusterNetworkPolicy", "{name: c}", "{tier: dev, priority: 2.5, appliedTo: [{namespaceSelector: {}}], egress: [{action: Reject, to: [{ipBlock: {cidr: 10.0.0.0/8}}]}]}"),
            antrea("Tier", "{name: dev}", "{priority: 90}"),
        ]
        .concat();
        let l = parse(&text);
        assert_eq!(l.inputs.network_policies.len(), 1);
        assert_eq!(l.inputs.cluster_network_policies.len(), 1);
        assert_eq!(l.inputs.cluster_network_policies[0].spec.priority, 1);
        let a = &l.inputs.antrea;
        assert_eq!(
            (a.tiers.len(), a.cluster_network_policies.len(), a.network_policies.len()),
            (1, 1, 1)
        );
        assert_eq!(a.network_policies[0].metadata.namespace.as_deref(), Some("x"));
        assert!(l.problems.is_empty(), "{:?}", l.problems);
        let mut problems = Vec::new();
        let admitted = crate::policy::compile::admit_antrea(a, &mut problems);
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(admitted.cluster_network_policies.len(), 1);
    }

    /// Antrea's older API versions of its policy kinds are errors naming the object.
    #[test]
    fn older_antrea_api_versions_are_refused_naming_the_object() {
        let l = parse(
            "apiVersion: crd.antrea.io/v1alpha1\nkind: ClusterNetworkPolicy\nmetadata: {name: old}\nspec: {priority: 1}\n---\napiVersion: security.antrea.tanzu.vmware.com/v1alpha1\nkind: NetworkPolicy\nmetadata: {name: legacy, namespace: n}\n---\napiVersion: crd.antrea.io/v1alpha2\nkind: Tier\nmetadata: {name: t}\n---\napiVersion: crd.antrea.io/v2\nkind: Tier\nmetadata: {name: future}\n",
        );
        assert!(l.inputs.antrea.is_empty());
        let got: Vec<(String, &str, bool)> = l
            .problems
            .iter()
            .map(|p| (p.object.to_string(), p.field.as_str(), p.is_error()))
            .collect();
        assert_eq!(
            got,
            [
                ("ClusterNetworkPolicy.crd.antrea.io old".to_owned(), "apiVersion", true),
                ("NetworkPolicy.crd.antrea.io n/legacy".to_owned(), "apiVersion", true),
                ("Tier.crd.antrea.io t".to_owned(), "apiVersion", true),
                ("Tier.crd.antrea.io future".to_owned(), "apiVersion", true),
            ]
        );
        let msg = l.problems[0].to_string();
        assert!(
            msg.contains("\"crd.antrea.io/v1alpha1\" is invalid: an older Antrea API version"),
            "{msg}"
        );
        assert!(msg.contains("only as crd.antrea.io/v1beta1"), "{msg}");
        assert!(l.problems[3].to_string().contains("does not know"), "{}", l.problems[3]);
    }

    /// Invalid Antrea objects are errors naming object and field, and are left out; a
    /// policy naming a refused Tier names no Tier.
    #[test]
    fn invalid_antrea_objects_are_named_and_left_out() {
        let text = [
            antrea("Tier", "{name: reserved}", "{priority: 251}"),
            antrea("ClusterNetworkPolicy", "{name: in-reserved}", "{tier: reserved, priority: 1, appliedTo: [{podSelector: {}}]}"),
            antrea("NetworkPolicy", "{name: pass, namespace: a}", "{tier: baseline, priority: 1, appliedTo: [{podSelector: {}}], egress: [{action: Pass}]}"),
            antrea("ClusterNetworkPolicy", "{name: no-priority}", "{appliedTo: [{podSelector: {}}]}"),
        ]
        .concat();
        let mut l = parse(&text);
        let admitted = crate::policy::compile::admit_antrea(&l.inputs.antrea, &mut l.problems);
        assert!(admitted.cluster_network_policies.is_empty(), "{admitted:?}");
        assert!(admitted.network_policies.is_empty(), "{admitted:?}");
        let got: Vec<String> = l.problems.iter().map(ToString::to_string).collect();
        assert_eq!(
            got,
            [
                "error: ClusterNetworkPolicy.crd.antrea.io no-priority: spec: cannot decode: missing field `priority`",
                "error: Tier.crd.antrea.io reserved: spec.priority: \"251\" is invalid: Tier priority 251 is reserved",
                "error: ClusterNetworkPolicy.crd.antrea.io in-reserved: spec.tier: \"reserved\" is invalid: tier does not exist: no static Tier and no Tier object has this name",
                "error: NetworkPolicy.crd.antrea.io a/pass: spec.egress[0].action: `Pass` action should not be set for Baseline Tier policy rules",
            ],
        );
    }

    /// The Tiers of every file are known before any policy is checked, whatever the file
    /// order; of two objects with one name the later replaces the earlier.
    #[test]
    fn antrea_tiers_of_other_files_and_duplicates() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("a-policy.yaml"),
            antrea(
                "NetworkPolicy",
                "{name: p, namespace: a}",
                "{tier: late, priority: 1, appliedTo: [{podSelector: {}}]}",
            ),
        )
        .unwrap();
        std::fs::write(
            dir.path().join("b-tiers.yaml"),
            [
                antrea("Tier", "{name: late}", "{priority: 252}"),
                antrea("Tier", "{name: late}", "{priority: 240}"),
            ]
            .concat(),
        )
        .unwrap();
        for form in [Form::Whole, Form::Compact] {
            let mut l = load_as(&[dir.path().to_path_buf()], form);
            let a = crate::policy::compile::admit_antrea(&l.inputs.antrea, &mut l.problems);
            assert_eq!(a.tiers.len(), 1);
            assert_eq!(a.tiers[0].spec.priority, 240);
            assert_eq!(a.network_policies.len(), 1);
            let kinds: Vec<_> =
                l.problems.iter().map(|p| (p.object.kind, p.kind.clone())).collect();
            assert!(
                matches!(&kinds[..], [(Kind::AntreaTier, ProblemKind::Duplicate)]),
                "{:?}",
                l.problems
            );
        }
    }

    #[test]
    fn malformed_yaml_is_a_syntax_error() {
        let e = parse_str(Path::new("bad.yaml"), "kind: [unclosed\n").unwrap_err();
        assert!(matches!(e, LoadError::Syntax { .. }), "{e}");
    }

    #[test]
    fn alias_bomb_fails_fast() {
        let mut text = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n");
        for i in 1..12 {
            let prev = i - 1;
            text.push_str(&format!(
                "a{i}: &a{i} [*a{prev}, *a{prev}, *a{prev}, *a{prev}, *a{prev}, *a{prev}, *a{prev}, *a{prev}, *a{prev}, *a{prev}]\n"
            ));
        }
        let start = std::time::Instant::now();
        let e = parse_str(Path::new("bomb.yaml"), &text).unwrap_err();
        assert!(matches!(e, LoadError::Limit { limit: Limit::AliasExpansion, .. }), "{e}");
        assert!(e.to_string().starts_with("bomb.yaml: line "), "{e}");
        assert!(e.to_string().contains("alias expansion: 1000000 nodes per document"), "{e}");
        // Not a timing assertion on performance, a guard against an unbounded expansion:
        // 10^12 nodes could never finish in this time.
        assert!(start.elapsed() < std::time::Duration::from_secs(30));
    }

    #[test]
    fn yaml_1_1_boolean_spellings_stay_strings() {
        let l = parse(
            "apiVersion: v1\nkind: Namespace\nmetadata: {name: n, labels: {a: yes, b: off}}\n",
        );
        assert!(l.problems.is_empty(), "{:?}", l.problems);
        let ns = &l.inputs.namespaces[0];
        assert_eq!(ns.metadata.name.as_deref(), Some("n"));
        assert_eq!(ns.metadata.labels.as_ref().unwrap()["a"], "yes");
    }

    #[test]
    fn scalar_documents_are_noted_not_fatal() {
        let l = parse("just a string\n---\napiVersion: v1\nkind: Namespace\nmetadata: {name: a}\n");
        assert_eq!(l.inputs.namespaces.len(), 1);
        assert_eq!(l.notes.len(), 1);
    }

    /// Pods of a block-style YAML `kind: List`, `n` of them (about 300 bytes each).
    fn pod_list_yaml(n: usize) -> String {
        let mut text = String::from("apiVersion: v1\nkind: List\nitems:\n");
        for j in 0..n {
            let ip = crate::synth::pod_ip(j);
            text.push_str(&format!(
                "- apiVersion: v1\n  kind: Pod\n  metadata:\n    name: pod-{j}\n    namespace: ns-{}\n    labels:\n      app: a{}\n      tier: fe\n  spec:\n    nodeName: node-{}\n    containers:\n    - name: c\n      ports:\n      - name: http\n        containerPort: 8080\n  status:\n    podIP: {ip}\n    phase: Running\n",
                j % 50,
                j % 10,
                j % 20,
            ));
        }
        text
    }

    /// serde-saphyr's default budget (1,024 documents, 250,000 nodes) refused this 3 MB
    /// list, far below the 64 MiB the docs promise.
    #[test]
    fn a_yaml_list_of_10000_pods_loads() {
        let text = pod_list_yaml(10_000);
        assert!(text.len() > 2_000_000, "{} bytes", text.len());
        let l = parse_str_as(Path::new("pods.yaml"), &text, Form::Compact).unwrap();
        assert_eq!(l.inputs.pod_views.len(), 10_000);
        assert!(l.problems.is_empty() && l.notes.is_empty(), "{:?}", l.problems);
    }

    /// As many documents as a small file can hold: the document limit scales with the size.
    #[test]
    fn a_yaml_file_of_2000_documents_loads() {
        let doc = "apiVersion: v1\nkind: Namespace\nmetadata: {name: n}\n---\n";
        let l = parse(&doc.repeat(2000));
        assert_eq!(l.inputs.namespaces.len(), 2000);
    }

    /// A file of exactly the byte limit is read (these zero bytes are not YAML or JSON);
    /// one byte more is refused before a byte is read, with an error naming the limit.
    #[test]
    fn a_file_over_the_byte_limit_is_refused_naming_the_limit() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["big.yaml", "big.json"] {
            let path = dir.path().join(name);
            // Sparse: no disk space used.
            let f = std::fs::File::create(&path).unwrap();
            f.set_len(MAX_FILE_BYTES).unwrap();
            let l = load(std::slice::from_ref(&path));
            assert!(matches!(l.errors[..], [LoadError::Syntax { .. }]), "{:?}", l.errors);
            f.set_len(MAX_FILE_BYTES + 1).unwrap();
            let l = load_as(std::slice::from_ref(&path), Form::Compact);
            let [e] = &l.errors[..] else { panic!("{:?}", l.errors) };
            assert!(matches!(e, LoadError::Limit { limit: Limit::Bytes, .. }), "{e}");
            let message = e.to_string();
            assert!(message.starts_with(&format!("{}: 67108865 bytes", path.display())), "{e}");
            assert!(message.contains("size: 67108864 bytes (64 MiB) per file"), "{e}");
        }
    }

    /// Many documents, each expanding aliases below the per-document limit, meet the
    /// file's node limit: aliases cannot multiply work by the number of documents.
    #[test]
    fn alias_expansion_is_bounded_per_file() {
        // a3 is 10^4 scalars; each document replays it 40 times: 400,000 nodes.
        let mut doc = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n");
        for i in 1..4 {
            let prev = format!("*a{}", i - 1);
            doc.push_str(&format!("a{i}: &a{i} [{}]\n", vec![prev; 10].join(", ")));
        }
        doc.push_str(&format!("b: [{}]\n---\n", vec!["*a3"; 40].join(", ")));
        assert!(
            parse_str(Path::new("one.yaml"), &doc).is_ok(),
            "one document is within the limits"
        );
        let e = parse_str(Path::new("many.yaml"), &doc.repeat(3)).unwrap_err();
        assert!(matches!(e, LoadError::Limit { limit: Limit::Nodes, .. }), "{e}");
    }

    /// One anchor shared by a thousand objects: serde-saphyr's alias/anchor ratio
    /// heuristic (at most 10 aliases per anchor) refused it; the node limits bound it.
    #[test]
    fn an_anchor_shared_by_many_objects_loads() {
        let mut text = String::from(
            "apiVersion: v1\nkind: List\nitems:\n- {apiVersion: v1, kind: Pod, metadata: {name: p0, labels: &l {app: web, tier: fe}}}\n",
        );
        for j in 1..1000 {
            text.push_str(&format!(
                "- {{apiVersion: v1, kind: Pod, metadata: {{name: p{j}, labels: *l}}}}\n"
            ));
        }
        let l = parse(&text);
        assert_eq!(l.inputs.pods.len(), 1000);
        assert_eq!(l.inputs.pods[999].metadata.labels.as_ref().unwrap()["tier"], "fe");
    }

    /// [`MAX_DEPTH`] levels of lists and maps are read, in YAML and in JSON alike; one more
    /// is refused with the limit named.
    #[test]
    fn nesting_is_limited_alike_in_yaml_and_json() {
        // The document is one level; `x` holds the rest.
        let doc = |depth: usize| {
            format!(
                r#"{{"apiVersion": "v1", "kind": "Namespace", "metadata": {{"name": "n"}}, "x": {}0{}}}"#,
                "[".repeat(depth - 1),
                "]".repeat(depth - 1)
            )
        };
        for name in ["deep.yaml", "deep.json"] {
            let l = parse_str(Path::new(name), &doc(MAX_DEPTH)).unwrap();
            assert_eq!(l.inputs.namespaces.len(), 1, "{name}");
            assert_eq!(l.problems[0].field, "x", "{name}: {:?}", l.problems);
            let e = parse_str(Path::new(name), &doc(MAX_DEPTH + 1)).unwrap_err();
            assert!(matches!(e, LoadError::Limit { limit: Limit::Depth, .. }), "{name}: {e}");
            assert!(e.to_string().contains("nesting: 127 levels"), "{e}");
        }
    }

    /// A syntax error anywhere in a file: the file contributes nothing, not even its
    /// documents before the error.
    #[test]
    fn a_broken_file_contributes_nothing() {
        let text = format!("{}---\nkind: [unclosed\n", pod_list_yaml(3));
        assert!(matches!(parse_str(Path::new("t.yaml"), &text), Err(LoadError::Syntax { .. })));
    }

    /// A list's `items` read item by item: notes of items that are not objects, a List
    /// whose items are not a list, and a known kind with an `items` field (unknown to it).
    #[test]
    fn lists_are_read_item_by_item() {
        let l = parse(
            "kind: List\nitems: [3, {apiVersion: v1, kind: Namespace, metadata: {name: a}}]\n---\nkind: PodList\nitems: {a: 1}\n---\napiVersion: v1\nkind: Namespace\nmetadata: {name: b}\nitems: [{apiVersion: v1, kind: Namespace, metadata: {name: c}}]\n",
        );
        let names: Vec<_> =
            l.inputs.namespaces.iter().map(|n| n.metadata.name.clone().unwrap()).collect();
        assert_eq!(names, ["a", "b"]);
        let notes: Vec<_> = l.notes.iter().map(|n| n.to_string()).collect();
        assert_eq!(
            notes,
            [
                "test.yaml: skipped a document that is not an object (a number)",
                "test.yaml: skipped PodList without an items list"
            ]
        );
        assert_eq!(l.problems.len(), 1, "{:?}", l.problems);
        assert_eq!(
            (l.problems[0].field.as_str(), &l.problems[0].kind),
            ("items", &ProblemKind::UnknownField)
        );
    }

    /// The edge cases of pods and the parts [`Form::Compact`] drops, added to a synthetic
    /// cluster: an invalid pod, a terminated one, a hostNetwork one, one without
    /// namespace, one given twice, a node with images and managedFields, a policy with
    /// annotations.
    fn edge_objects() -> Vec<Value> {
        let pod = |name: &str, ns: Option<&str>, ip: &str, extra: Value| {
            let mut p = serde_json::json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "labels": {"app": "a1", "tier": "fe"},
                             "managedFields": [{"manager": "kubectl"}]},
                "spec": {"nodeName": "node-0", "containers": [{"name": "c", "ports": [
                    {"name": "http", "containerPort": 8080}]}]},
                "status": {"podIP": ip, "phase": "Running"},
            });
            if let Some(ns) = ns {
                p["metadata"]["namespace"] = ns.into();
            }
            json_merge(&mut p, extra);
            p
        };
        vec![
            pod("bad-ip", Some("ns-0"), "10.200.0.300", Value::Null),
            pod(
                "done",
                Some("ns-1"),
                "10.200.0.2",
                serde_json::json!({"status": {"phase": "Succeeded"}}),
            ),
            pod(
                "host",
                Some("ns-1"),
                "172.16.0.1",
                serde_json::json!({"spec": {"hostNetwork": true}}),
            ),
            pod("plain", None, "10.200.0.4", Value::Null),
            pod("twice", Some("ns-2"), "10.200.0.5", Value::Null),
            pod(
                "twice",
                Some("ns-2"),
                "10.200.0.6",
                serde_json::json!({"metadata": {"labels": {"app": "a2"}}}),
            ),
            serde_json::json!({"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": "node-x", "managedFields": [{"manager": "kubelet"}]},
                "spec": {"podCIDR": "10.244.0.0/24"},
                "status": {"addresses": [{"type": "InternalIP", "address": "172.16.9.9"}],
                           "images": [{"names": ["nginx"], "sizeBytes": 1}]}}),
            serde_json::json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "metadata": {"name": "ann", "namespace": "ns-0", "annotations": {
                    "tierproxy.io/audit": "all", "kubectl.kubernetes.io/last-applied-configuration": "{}",
                    "Bad Key": "x"}},
                "spec": {"podSelector": {}, "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "a1"}}}]}]}}),
        ]
    }

    fn json_merge(into: &mut Value, from: Value) {
        match (into, from) {
            (Value::Object(a), Value::Object(b)) => {
                for (k, v) in b {
                    json_merge(a.entry(k).or_insert(Value::Null), v);
                }
            }
            (a, b) if !b.is_null() => *a = b,
            _ => {}
        }
    }

    /// Problems as sorted lines (the two forms find them in different stages and orders).
    fn problem_lines(l: &Loaded, c: &crate::policy::Compiled) -> Vec<String> {
        let mut v: Vec<String> =
            l.problems.iter().chain(&c.problems).map(|p| p.to_string()).collect();
        v.sort();
        v
    }

    /// The same objects in YAML and JSON, kept whole or compact, compile to snapshots that
    /// decide alike and report the same problems.
    #[test]
    fn forms_and_formats_compile_to_the_same_decisions() {
        use crate::policy::{Revision, Snapshot};
        use crate::synth::{self, Shape};
        let shape = Shape {
            namespaces: 10,
            pods: 300,
            nodes: 4,
            network_policies: 20,
            admin_policies: 6,
            rules_per_admin_policy: 5,
            ..Shape::LOAD_TEST
        };
        let i = synth::cluster(shape, 7);
        fn values<T: serde::Serialize>(v: &[Arc<T>]) -> impl Iterator<Item = Value> + '_ {
            v.iter().map(|o| serde_json::to_value(o).unwrap())
        }
        let mut items: Vec<Value> = values(&i.namespaces)
            .chain(values(&i.nodes))
            .chain(values(&i.pods))
            .chain(values(&i.network_policies))
            .chain(values(&i.admin_network_policies))
            .chain(values(&i.baseline_admin_network_policies))
            .collect();
        items.extend(edge_objects());
        let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items});
        let yaml = serde_saphyr::to_string(&list).unwrap();
        let json = list.to_string();
        let loads = [
            ("whole YAML", parse_str_as(Path::new("c.yaml"), &yaml, Form::Whole).unwrap()),
            ("compact YAML", parse_str_as(Path::new("c.yaml"), &yaml, Form::Compact).unwrap()),
            ("compact JSON", parse_str_as(Path::new("c.json"), &json, Form::Compact).unwrap()),
        ];
        assert_eq!(loads[1].1.inputs.pod_views.len(), 306);
        let node = loads[1]
            .1
            .inputs
            .nodes
            .iter()
            .find(|n| n.metadata.name.as_deref() == Some("node-x"))
            .unwrap();
        assert!(node.metadata.managed_fields.is_none() && node.spec.is_none());
        assert!(node.status.as_ref().unwrap().images.is_none());
        let mut flows = synth::flows(shape, 3000, 3);
        for ip in [
            "10.200.0.2",
            "10.200.0.4",
            "10.200.0.5",
            "10.200.0.6",
            "10.200.0.44",
            "172.16.0.1",
            "172.16.9.9",
        ] {
            for other in [crate::synth::pod_ip(1), crate::synth::pod_ip(2)] {
                for (src, dst) in
                    [(ip.parse().unwrap(), other.into()), (other.into(), ip.parse().unwrap())]
                {
                    flows.push(crate::policy::Flow {
                        src,
                        dst,
                        protocol: crate::policy::Protocol::Tcp,
                        dst_port: 8080,
                    });
                }
            }
        }
        let compiled: Vec<_> =
            loads.iter().map(|(_, l)| Snapshot::compile(&l.inputs, Revision(1))).collect();
        let want = problem_lines(&loads[0].1, &compiled[0]);
        assert!(
            want.iter().any(|p| p.contains("bad-ip") && p.contains("status.podIP")),
            "{want:#?}"
        );
        assert!(want.iter().any(|p| p.contains("Bad Key")), "{want:#?}");
        assert!(want.iter().any(|p| p.contains("twice")), "{want:#?}");
        for ((what, l), c) in loads.iter().zip(&compiled).skip(1) {
            assert_eq!(problem_lines(l, c), want, "{what}");
            for f in &flows {
                assert_eq!(c.snapshot.decide(f), compiled[0].snapshot.decide(f), "{what}: {f:?}");
            }
        }
    }
}

#[cfg(test)]
mod watch_tests {
    use super::*;
    use std::time::Duration;

    const QUIET: Duration = Duration::from_millis(50);

    /// Reads are not changes (the reloads of every agent reading the same directory would
    /// otherwise trigger each other for ever, as a first version did); a write, a new file
    /// and a rename are, each reported once after the debounce.
    #[test]
    fn reads_are_not_changes_and_writes_renames_and_new_files_are() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a.yaml");
        std::fs::write(&file, "kind: Namespace\n").unwrap();
        let (_watch, rx) = watch(&[dir.path().to_path_buf()], QUIET).unwrap();
        let _ = std::fs::read(&file).unwrap();
        let _ = load(&[dir.path().to_path_buf()]);
        assert!(rx.recv_timeout(Duration::from_millis(400)).is_err(), "a read is no change");
        std::fs::write(&file, "kind: Namespace\nmetadata: {name: x}\n").unwrap();
        let batch = rx.recv_timeout(Duration::from_secs(5)).expect("write reported");
        assert_eq!(batch, vec![file.clone()]);
        let tmp = dir.path().join(".b.yaml.tmp");
        std::fs::write(&tmp, "{}").unwrap();
        std::fs::rename(&tmp, dir.path().join("b.yaml")).unwrap();
        let batch = rx.recv_timeout(Duration::from_secs(5)).expect("rename reported");
        assert!(batch.contains(&dir.path().join("b.yaml")), "{batch:?}");
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err(), "one batch per burst");
    }

    /// A watched file is watched through its directory: a sibling's change is not reported,
    /// the file's replacement by rename is.
    #[test]
    fn a_watched_file_ignores_its_siblings_and_sees_its_replacement() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("policy.yaml");
        std::fs::write(&file, "{}").unwrap();
        let (_watch, rx) = watch(std::slice::from_ref(&file), QUIET).unwrap();
        std::fs::write(dir.path().join("other.log"), "noise").unwrap();
        assert!(rx.recv_timeout(Duration::from_millis(400)).is_err(), "sibling ignored");
        let tmp = dir.path().join("policy.yaml.new");
        std::fs::write(&tmp, "kind: Namespace\n").unwrap();
        std::fs::rename(&tmp, &file).unwrap();
        let batch = rx.recv_timeout(Duration::from_secs(5)).expect("replacement reported");
        assert!(batch.contains(&file), "{batch:?}");
    }

    #[test]
    fn fingerprint_changes_with_content_only() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a.yaml");
        std::fs::write(&file, "x: 1\n").unwrap();
        let paths = [dir.path().to_path_buf()];
        let first = fingerprint(&paths);
        std::fs::write(&file, "x: 1\n").unwrap();
        assert_eq!(fingerprint(&paths), first, "same bytes rewritten");
        std::fs::write(&file, "x: 2\n").unwrap();
        assert_ne!(fingerprint(&paths), first);
    }
}
