//! The manifest source: Kubernetes objects read from files and directories.
//!
//! Reads what `kubectl apply -f` reads: `.yaml`, `.yml` and `.json` files (directories
//! recursively, in name order), multi-document YAML, and `kind: List` / `*List` objects,
//! which are flattened. Kinds read: Namespace, Node, Pod (`v1`), NetworkPolicy
//! (`networking.k8s.io/v1`), AdminNetworkPolicy and BaselineAdminNetworkPolicy
//! (`policy.networking.k8s.io/v1alpha1`) and ClusterNetworkPolicy
//! (`policy.networking.k8s.io/v1alpha2`). Anything else — including Antrea's
//! `crd.antrea.io` ClusterNetworkPolicy — is skipped with a [`Note`].
//!
//! Hostile input is bounded: YAML alias expansion, nesting depth, node and byte counts are
//! capped by serde-saphyr's default budget (alias bombs fail fast with a named error), and
//! files larger than [`MAX_FILE_BYTES`] are refused.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::policy::api::{Namespace, NetworkPolicy, Node, Pod, v1alpha1, v1alpha2};
use crate::policy::compile::meta_namespace;
use crate::policy::{Inputs, Kind, ObjectRef, Problem, ProblemKind};

/// Largest manifest file read, in bytes (64 MiB): far above any real manifest set (a
/// 10,000-pod cluster with 1,000 policies is ~20 MiB of YAML), small enough that a
/// mistaken path (a disk image, a log) fails fast instead of eating memory.
pub const MAX_FILE_BYTES: u64 = 64 << 20;

/// A file-level failure: the file could not be read or is not YAML/JSON at all.
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
    /// The file is larger than [`MAX_FILE_BYTES`].
    #[error("{path}: {size} bytes exceed the limit of {MAX_FILE_BYTES}")]
    TooLarge {
        /// The path.
        path: PathBuf,
        /// Its size.
        size: u64,
    },
    /// YAML or JSON syntax error, or a resource budget (alias bomb, nesting) exceeded.
    #[error("{path}: not valid YAML/JSON: {message}")]
    Syntax {
        /// The path.
        path: PathBuf,
        /// The parser's message, with line and column where it has them.
        message: String,
    },
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
    /// Objects that failed to decode (wrong types: errors) and unknown fields (warnings).
    pub problems: Vec<Problem>,
    /// Skipped documents (other kinds, empty documents).
    pub notes: Vec<Note>,
    /// File-level failures; the files concerned contributed nothing.
    pub errors: Vec<LoadError>,
}

/// Reads every manifest under `paths` (files or directories). Never fails as a whole:
/// every failure is collected in [`Loaded`], so one bad file does not hide the others.
pub fn load(paths: &[PathBuf]) -> Loaded {
    let mut out = Loaded::default();
    for path in paths {
        for file in files(path, &mut out.errors) {
            match read(&file) {
                Ok(docs) => {
                    for doc in docs {
                        add(&file, doc, &mut out);
                    }
                }
                Err(e) => out.errors.push(e),
            }
        }
    }
    out
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
            match std::fs::read(&file) {
                Ok(bytes) => bytes.hash(&mut h),
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

/// Parses manifest text (YAML, any number of documents; JSON is YAML too) from `origin`.
///
/// # Errors
/// [`LoadError::Syntax`] if the text is not YAML or exceeds the parser's budget.
pub fn parse_str(origin: &Path, text: &str) -> Result<Loaded, LoadError> {
    let mut out = Loaded::default();
    for doc in parse_docs(origin, text)? {
        add(origin, doc, &mut out);
    }
    Ok(out)
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

/// The documents of one manifest file as [`load`] reads them (size limit, YAML 1.2 core
/// booleans, concatenated JSON objects), before any kind is looked at. For readers of kinds
/// the policy loader skips (the lab reads `v1` Services with it).
///
/// # Errors
/// [`LoadError::Io`], [`LoadError::TooLarge`] or [`LoadError::Syntax`].
pub fn documents(path: &Path) -> Result<Vec<Value>, LoadError> {
    read(path)
}

fn read(path: &Path) -> Result<Vec<Value>, LoadError> {
    let io = |source| LoadError::Io { path: path.to_path_buf(), source };
    let size = std::fs::metadata(path).map_err(io)?.len();
    if size > MAX_FILE_BYTES {
        return Err(LoadError::TooLarge { path: path.to_path_buf(), size });
    }
    let text = std::fs::read_to_string(path).map_err(io)?;
    parse_docs(path, &text)
}

fn parse_docs(path: &Path, text: &str) -> Result<Vec<Value>, LoadError> {
    let syntax = |message: String| LoadError::Syntax { path: path.to_path_buf(), message };
    if path.extension().is_some_and(|e| e == "json") {
        // A JSON file may hold several concatenated objects.
        return serde_json::Deserializer::from_str(text)
            .into_iter::<Value>()
            .collect::<Result<_, _>>()
            .map_err(|e| syntax(e.to_string()));
    }
    // YAML 1.2 core booleans only: with YAML 1.1's `y`/`n`/`on`/`off`, `name: n` would
    // decode as `false` before the typed decoder sees it.
    let mut options = serde_saphyr::Options::default();
    options.strict_booleans = true;
    let docs: Vec<Option<Value>> = serde_saphyr::from_multiple_with_options(text, options)
        .map_err(|e| syntax(e.to_string()))?;
    Ok(docs.into_iter().flatten().collect())
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
        Kind::Pod | Kind::NetworkPolicy => {
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

fn add(path: &Path, doc: Value, out: &mut Loaded) {
    let note = |out: &mut Loaded, message: String| {
        out.notes.push(Note { path: path.to_path_buf(), message })
    };
    if !doc.is_object() {
        note(out, format!("skipped a document that is not an object ({})", type_name(&doc)));
        return;
    }
    let api_version = doc.get("apiVersion").and_then(Value::as_str).unwrap_or("").to_string();
    let kind = doc.get("kind").and_then(Value::as_str).unwrap_or("").to_string();
    // "kind: List" (kubectl get -o yaml) and typed lists ("PodList", ...) are flattened.
    if kind == "List" || kind.ends_with("List") {
        match doc.get("items") {
            Some(Value::Array(items)) => {
                for item in items.clone() {
                    add(path, item, out);
                }
            }
            _ => note(out, format!("skipped {kind} without an items list")),
        }
        return;
    }
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
    match known {
        Kind::Namespace => {
            inputs.namespaces.extend(decode::<Namespace>(&obj, doc, problems).map(Arc::new))
        }
        Kind::Node => inputs.nodes.extend(decode::<Node>(&obj, doc, problems).map(Arc::new)),
        Kind::Pod => inputs
            .pods
            .extend(decode::<Pod>(&obj, doc, problems).map(default_namespace).map(Arc::new)),
        Kind::NetworkPolicy => inputs.network_policies.extend(
            decode::<NetworkPolicy>(&obj, doc, problems).map(default_namespace).map(Arc::new),
        ),
        Kind::AdminNetworkPolicy => inputs
            .admin_network_policies
            .extend(decode::<v1alpha1::AdminNetworkPolicy>(&obj, doc, problems).map(Arc::new)),
        Kind::BaselineAdminNetworkPolicy => inputs.baseline_admin_network_policies.extend(
            decode::<v1alpha1::BaselineAdminNetworkPolicy>(&obj, doc, problems).map(Arc::new),
        ),
        Kind::ClusterNetworkPolicy => inputs
            .cluster_network_policies
            .extend(decode::<v1alpha2::ClusterNetworkPolicy>(&obj, doc, problems).map(Arc::new)),
    }
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

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
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
            "apiVersion: crd.antrea.io/v1beta1\nkind: ClusterNetworkPolicy\nmetadata: {name: acnp}\n---\napiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\n",
        );
        assert!(l.inputs.cluster_network_policies.is_empty());
        assert_eq!(l.notes.len(), 2);
        assert!(l.notes[0].message.contains("crd.antrea.io/v1beta1 ClusterNetworkPolicy"));
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
        assert!(matches!(e, LoadError::Syntax { .. }), "{e}");
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
