//! A scripted Kubernetes API server on loopback, for the API-server source's tests: real
//! HTTP, real kube-rs client, the list-then-watch protocol of the Kubernetes API ("Efficient
//! detection of changes": a list carries `metadata.resourceVersion`; a watch from it
//! streams newline-delimited `{"type", "object"}` events; a resourceVersion older than
//! the kept history gets an `ERROR` event with a 410 Status, and the client relists).
//!
//! What it implements: list (paged by `limit` and `continue`; with `resourceVersion=0`,
//! whole, from the current state, as an API server answers it from its watch cache,
//! ignoring `limit`) and watch of any collection (cluster-wide or in a namespace),
//! get, create (POST; 409 AlreadyExists for a name in use), replace (PUT; 409 Conflict when
//! the body's `metadata.resourceVersion` is not the stored one), patch (merge, strategic
//! and apply patches, merged as JSON with `status.conditions` keyed by `type`; an apply
//! patch's `data` replaces the object's, as server-side apply removes the keys its one
//! manager no longer applies), delete, the
//! `status` subresource. What the test scripts: objects ([`FakeApi::apply`],
//! [`FakeApi::delete`]), which collections exist ([`FakeApi::uninstall`]: 404 as for a CRD
//! not installed), failures ([`FakeApi::fail_next`]: 500s), watch ends
//! ([`FakeApi::close_watches`]), history compaction ([`FakeApi::compact`]: 410 Gone), an
//! outage ([`FakeApi::set_down`]: every request refused with 503, `/readyz` too), a user's
//! lost write permission ([`FakeApi::forbid`]: 403). `GET /readyz` answers 200 `ok`
//! otherwise. A client is told apart by its bearer token (the user, [`as_user`]). Every
//! request is logged with its user and User-Agent ([`FakeApi::requests`],
//! [`FakeApi::requests_by`], [`FakeApi::user_agents`]).
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::http::{Method, Request, Response, StatusCode};
use serde_json::{Value, json};

/// One stored change, for watchers.
#[derive(Clone, Debug)]
struct Change {
    collection: String,
    rv: u64,
    kind: &'static str,
    object: Value,
}

#[derive(Default)]
struct Collection {
    objects: BTreeMap<(String, String), Value>,
}

#[derive(Default)]
struct State {
    rv: u64,
    /// Resource versions at or below this are gone (410).
    compacted: u64,
    collections: BTreeMap<String, Collection>,
    uninstalled: BTreeSet<String>,
    history: Vec<Change>,
    fail_next: u32,
    down: bool,
    /// (user, collection) pairs whose writes are refused with 403.
    forbidden: BTreeSet<(String, String)>,
    /// Each request's user (its bearer token) and `METHOD path?query`.
    requests: Vec<(Option<String>, String)>,
    /// The User-Agent of each of `requests` ("" if none).
    user_agents: Vec<String>,
    writes: Vec<(String, String, Value)>,
}

#[derive(Clone, Debug)]
enum Live {
    Change(Change),
    Close,
}

/// The running server; stops when dropped.
pub struct FakeApi {
    pub addr: SocketAddr,
    state: Arc<Mutex<State>>,
    live: tokio::sync::broadcast::Sender<Live>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// A kube client configuration for `api` that authenticates as `user`: a bearer token the
/// server logs each request under ([`FakeApi::requests_by`]) and [`FakeApi::forbid`]
/// refers to.
pub fn as_user(api: &FakeApi, user: &str) -> kube::Config {
    let mut config = kube::Config::new(format!("http://{}", api.addr).parse().unwrap());
    config.headers.push((
        axum::http::header::AUTHORIZATION,
        axum::http::HeaderValue::from_str(&format!("Bearer {user}")).unwrap(),
    ));
    config
}

/// The collection path of an object: `/api/v1/pods`, `/apis/GROUP/VERSION/PLURAL`.
pub fn collection_of(api_version: &str, kind: &str) -> String {
    let lower = kind.to_ascii_lowercase();
    let plural = match lower.strip_suffix('y') {
        Some(stem) => format!("{stem}ies"),
        None => format!("{lower}s"),
    };
    if api_version.contains('/') {
        format!("/apis/{api_version}/{plural}")
    } else {
        format!("/api/{api_version}/{plural}")
    }
}

/// What a request path addresses.
struct Target {
    collection: String,
    namespace: Option<String>,
    name: Option<String>,
    subresource: Option<String>,
}

/// Parses `/api/v1[/namespaces/NS]/PLURAL[/NAME[/SUB]]` and the `/apis/GROUP/VERSION/...`
/// equivalent.
fn parse(path: &str) -> Option<Target> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (prefix, rest) = match *segs.first()? {
        "api" => (format!("/api/{}", segs.get(1)?), &segs[2..]),
        "apis" => (format!("/apis/{}/{}", segs.get(1)?, segs.get(2)?), &segs[3..]),
        _ => return None,
    };
    let s = |i: usize| rest.get(i).map(|x| x.to_string());
    Some(if rest.first() == Some(&"namespaces") && rest.len() >= 3 {
        Target {
            collection: format!("{prefix}/{}", rest[2]),
            namespace: s(1),
            name: s(3),
            subresource: s(4),
        }
    } else {
        Target {
            collection: format!("{prefix}/{}", rest.first()?),
            namespace: None,
            name: s(1),
            subresource: s(2),
        }
    })
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
           "reason": reason, "code": code})
}

fn reply(code: u16, body: &Value) -> Response<Body> {
    Response::builder()
        .status(StatusCode::from_u16(code).unwrap())
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap()
}

/// JSON merge of `patch` into `target`; `status.conditions` lists merge by `type` (as the
/// upstream CRDs' `listType=map`), other lists are replaced, `null` deletes.
fn merge(target: &mut Value, patch: &Value, path: &str) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (k, v) in p {
                let sub = format!("{path}/{k}");
                if v.is_null() {
                    t.remove(k);
                } else if sub == "/status/conditions"
                    && let (Some(Value::Array(old)), Value::Array(new)) = (t.get_mut(k), v)
                {
                    for c in new {
                        match old.iter_mut().find(|o| o["type"] == c["type"]) {
                            Some(o) => *o = c.clone(),
                            None => old.push(c.clone()),
                        }
                    }
                } else {
                    merge(t.entry(k.clone()).or_insert(Value::Null), v, &sub);
                }
            }
        }
        (t, p) => *t = p.clone(),
    }
}

fn key(obj: &Value) -> (String, String) {
    let m = &obj["metadata"];
    (
        m["namespace"].as_str().unwrap_or("").to_string(),
        m["name"].as_str().unwrap_or("").to_string(),
    )
}

impl State {
    /// Stores `obj` in `collection` (creating or replacing), with a new resourceVersion;
    /// `generation` rises when anything but status and metadata changed.
    fn put(&mut self, collection: &str, mut obj: Value) -> Change {
        self.rv += 1;
        let k = key(&obj);
        let coll = self.collections.entry(collection.to_string()).or_default();
        let old = coll.objects.get(&k);
        let kind = if old.is_some() { "MODIFIED" } else { "ADDED" };
        let old_gen = old.and_then(|o| o["metadata"]["generation"].as_i64()).unwrap_or(0);
        let spec_changed = old.is_none_or(|o| {
            let strip = |v: &Value| {
                let mut v = v.clone();
                if let Some(m) = v.as_object_mut() {
                    m.remove("status");
                    m.remove("metadata");
                }
                v
            };
            strip(o) != strip(&obj)
        });
        let generation = if spec_changed { old_gen + 1 } else { old_gen.max(1) };
        obj["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        obj["metadata"]["generation"] = json!(generation);
        // An update keeps the object's identity.
        obj["metadata"]["uid"] = match old {
            Some(o) => o["metadata"]["uid"].clone(),
            None => json!(format!("uid-{}", self.rv)),
        };
        coll.objects.insert(k, obj.clone());
        let c = Change { collection: collection.to_string(), rv: self.rv, kind, object: obj };
        self.history.push(c.clone());
        c
    }

    fn remove(&mut self, collection: &str, k: &(String, String)) -> Option<Change> {
        let obj = self.collections.get_mut(collection)?.objects.remove(k)?;
        self.rv += 1;
        let mut obj = obj;
        obj["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        let c = Change {
            collection: collection.to_string(),
            rv: self.rv,
            kind: "DELETED",
            object: obj,
        };
        self.history.push(c.clone());
        Some(c)
    }
}

impl FakeApi {
    /// Starts the server on 127.0.0.1 (a free port) with every collection installed and
    /// empty.
    pub fn start() -> FakeApi {
        let state = Arc::new(Mutex::new(State::default()));
        let (live, _) = tokio::sync::broadcast::channel(4096);
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (st, lv) = (state.clone(), live.clone());
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                addr_tx.send(listener.local_addr().unwrap()).unwrap();
                let app = axum::Router::new().fallback(move |req: Request<Body>| {
                    let (st, lv) = (st.clone(), lv.clone());
                    async move { handle(st, lv, req).await }
                });
                let _ = axum::serve(listener, app)
                    .with_graceful_shutdown(async {
                        let _ = stop_rx.await;
                    })
                    .await;
            });
            // Open watch streams end with the runtime.
            rt.shutdown_timeout(std::time::Duration::from_millis(100));
        });
        let addr = addr_rx.recv().unwrap();
        FakeApi { addr, state, live, stop: Some(stop), thread: Some(thread) }
    }

    /// A kubeconfig file (in `dir`) that points kube clients at this server.
    pub fn kubeconfig(&self, dir: &std::path::Path) -> std::path::PathBuf {
        let path = dir.join("kubeconfig");
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{}\n\
             users:\n- name: fake\n  user: {{}}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n\
             current-context: fake\n",
            self.addr
        );
        std::fs::write(&path, text).unwrap();
        path
    }

    fn with<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        f(&mut self.state.lock().unwrap())
    }

    /// Creates or replaces `obj` (with `apiVersion`, `kind` and `metadata.name`), as a
    /// client's create or update would; watchers see ADDED or MODIFIED.
    pub fn apply(&self, obj: Value) {
        let coll =
            collection_of(obj["apiVersion"].as_str().unwrap(), obj["kind"].as_str().unwrap());
        let c = self.with(|s| s.put(&coll, obj));
        let _ = self.live.send(Live::Change(c));
    }

    /// Deletes an object; watchers see DELETED.
    pub fn delete(&self, api_version: &str, kind: &str, namespace: Option<&str>, name: &str) {
        let coll = collection_of(api_version, kind);
        let k = (namespace.unwrap_or("").to_string(), name.to_string());
        if let Some(c) = self.with(|s| s.remove(&coll, &k)) {
            let _ = self.live.send(Live::Change(c));
        }
    }

    /// The stored object, if any.
    pub fn get(
        &self,
        api_version: &str,
        kind: &str,
        namespace: Option<&str>,
        name: &str,
    ) -> Option<Value> {
        let coll = collection_of(api_version, kind);
        let k = (namespace.unwrap_or("").to_string(), name.to_string());
        self.with(|s| s.collections.get(&coll).and_then(|c| c.objects.get(&k).cloned()))
    }

    /// Every stored object of a collection.
    pub fn list(&self, api_version: &str, kind: &str) -> Vec<Value> {
        let coll = collection_of(api_version, kind);
        self.with(|s| {
            s.collections
                .get(&coll)
                .map(|c| c.objects.values().cloned().collect())
                .unwrap_or_default()
        })
    }

    /// Makes a collection answer 404, as for a CRD that is not installed (its objects are
    /// forgotten; open watches end).
    pub fn uninstall(&self, api_version: &str, kind: &str) {
        let coll = collection_of(api_version, kind);
        self.with(|s| {
            s.uninstalled.insert(coll.clone());
            s.collections.remove(&coll);
        });
        self.close_watches();
    }

    /// Installs a collection (the CRD appears).
    pub fn install(&self, api_version: &str, kind: &str) {
        let coll = collection_of(api_version, kind);
        self.with(|s| s.uninstalled.remove(&coll));
    }

    /// The next `n` list or watch requests fail with 500.
    pub fn fail_next(&self, n: u32) {
        self.with(|s| s.fail_next = n);
    }

    /// Every request is answered 503 while `down` (an outage); open watches end.
    pub fn set_down(&self, down: bool) {
        self.with(|s| s.down = down);
        if down {
            self.close_watches();
        }
    }

    /// Ends every open watch (as an API server restart or a watch timeout does).
    pub fn close_watches(&self) {
        let _ = self.live.send(Live::Close);
    }

    /// Forgets the history, as etcd compaction does: a watch from the current
    /// resourceVersion or an older one gets 410 Gone (the next change must come before a
    /// relist can watch again).
    pub fn compact(&self) {
        self.with(|s| {
            s.compacted = s.rv + 1;
            s.history.clear();
        });
    }

    /// Every request so far, as `METHOD path?query`.
    pub fn requests(&self) -> Vec<String> {
        self.with(|s| s.requests.iter().map(|(_, r)| r.clone()).collect())
    }

    /// Every request so far by `user` (see [`as_user`]), as `METHOD path?query`.
    pub fn requests_by(&self, user: &str) -> Vec<String> {
        self.with(|s| {
            s.requests
                .iter()
                .filter(|(u, _)| u.as_deref() == Some(user))
                .map(|(_, r)| r.clone())
                .collect()
        })
    }

    /// From now on, every write (any method but GET) by `user` to `collection` (a path as
    /// [`collection_of`] gives it) is refused with 403 Forbidden, as after its RBAC
    /// permission was revoked; its reads still work.
    pub fn forbid(&self, user: &str, collection: &str) {
        self.with(|s| s.forbidden.insert((user.to_string(), collection.to_string())));
    }

    /// The User-Agent header of every request so far, in the order of
    /// [`FakeApi::requests`] ("" for a request without one).
    pub fn user_agents(&self) -> Vec<String> {
        self.with(|s| s.user_agents.clone())
    }

    /// Every write (POST, PUT, PATCH) so far: (method, path, body).
    pub fn writes(&self) -> Vec<(String, String, Value)> {
        self.with(|s| s.writes.clone())
    }
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        // Refuse new requests first: a client re-watching on a kept-alive connection after
        // the close below would otherwise hold the graceful shutdown for its whole
        // timeoutSeconds.
        self.with(|s| s.down = true);
        self.close_watches();
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn handle(
    st: Arc<Mutex<State>>,
    live: tokio::sync::broadcast::Sender<Live>,
    req: Request<Body>,
) -> Response<Body> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let user = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_string);
    let query: BTreeMap<String, String> = req
        .uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let agent = req
        .headers()
        .get(axum::http::header::USER_AGENT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let apply = req
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/apply-patch"));
    let body = axum::body::to_bytes(req.into_body(), 16 << 20).await.unwrap_or_default();
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let mut s = st.lock().unwrap();
    s.requests.push((
        user.clone(),
        format!(
            "{method} {path}?{}",
            query.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join("&")
        ),
    ));
    s.user_agents.push(agent);
    if s.down {
        return reply(503, &status(503, "ServiceUnavailable", "the server is down (scripted)"));
    }
    if path == "/readyz" {
        return Response::builder().status(200).body(Body::from("ok")).unwrap();
    }
    let Some(Target { collection: coll, namespace: ns, name, subresource: sub }) = parse(&path)
    else {
        return reply(404, &status(404, "NotFound", "no such path"));
    };
    if s.uninstalled.contains(&coll) {
        return reply(
            404,
            &status(404, "NotFound", "the server could not find the requested resource"),
        );
    }
    if method != Method::GET
        && let Some(u) = &user
        && s.forbidden.contains(&(u.clone(), coll.clone()))
    {
        let m = format!("user \"{u}\" cannot {method} in {coll} (scripted)");
        return reply(403, &status(403, "Forbidden", &m));
    }
    if method == Method::GET && name.is_none() && s.fail_next > 0 {
        s.fail_next -= 1;
        return reply(500, &status(500, "InternalError", "scripted failure"));
    }
    let in_ns = |o: &Value| ns.as_deref().is_none_or(|n| o["metadata"]["namespace"] == n);
    match (method, name) {
        (Method::GET, None) if query.get("watch").map(String::as_str) == Some("true") => {
            let from: u64 = query.get("resourceVersion").and_then(|v| v.parse().ok()).unwrap_or(0);
            if from < s.compacted {
                let ev = json!({"type": "ERROR", "object": status(410, "Expired", "too old resource version")});
                return Response::builder()
                    .status(200)
                    .header("content-type", "application/json")
                    .body(Body::from(format!("{ev}\n")))
                    .unwrap();
            }
            let backlog: Vec<Change> = s
                .history
                .iter()
                .filter(|c| c.collection == coll && c.rv > from && in_ns(&c.object))
                .cloned()
                .collect();
            let mut rx = live.subscribe();
            drop(s);
            let ns2 = ns.clone();
            let stream = async_stream(backlog, move |tx| async move {
                loop {
                    match rx.recv().await {
                        Ok(Live::Change(c)) => {
                            if c.collection == coll
                                && c.rv > from
                                && ns2
                                    .as_deref()
                                    .is_none_or(|n| c.object["metadata"]["namespace"] == n)
                                && tx.send(c).await.is_err()
                            {
                                return;
                            }
                        }
                        Ok(Live::Close) | Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                            return;
                        }
                        Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => return,
                    }
                }
            });
            Response::builder()
                .status(200)
                .header("content-type", "application/json")
                .body(stream)
                .unwrap()
        }
        (Method::GET, None) => {
            // Pages of `limit` objects, the `continue` token being the next offset, as the
            // API server pages a list from etcd. `resourceVersion=0` ("any") is answered
            // from the watch cache, whole: the API server ignores `limit` then.
            let from_cache = query.get("resourceVersion").map(String::as_str) == Some("0");
            let limit: usize = query
                .get("limit")
                .filter(|_| !from_cache)
                .and_then(|v| v.parse().ok())
                .unwrap_or(usize::MAX);
            let from: usize = query.get("continue").and_then(|v| v.parse().ok()).unwrap_or(0);
            let all: Vec<&Value> = s
                .collections
                .get(&coll)
                .map(|c| c.objects.values().filter(|o| in_ns(o)).collect())
                .unwrap_or_default();
            let end = from.saturating_add(limit).min(all.len());
            let items: Vec<Value> = all[from.min(end)..end].iter().map(|o| (*o).clone()).collect();
            let mut meta = json!({"resourceVersion": s.rv.to_string()});
            if end < all.len() {
                meta["continue"] = json!(end.to_string());
            }
            reply(
                200,
                &json!({"apiVersion": "v1", "kind": "List", "metadata": meta, "items": items}),
            )
        }
        (Method::GET, Some(name)) => {
            let k = (ns.unwrap_or_default(), name.clone());
            match s.collections.get(&coll).and_then(|c| c.objects.get(&k)) {
                Some(o) => reply(200, o),
                None => reply(404, &status(404, "NotFound", &format!("{name} not found"))),
            }
        }
        (Method::POST, None) => {
            s.writes.push(("POST".into(), path.clone(), body.clone()));
            let mut obj = body;
            if let Some(n) = &ns {
                obj["metadata"]["namespace"] = json!(n);
            }
            if obj["metadata"]["name"].is_null() {
                let prefix = obj["metadata"]["generateName"].as_str().unwrap_or("obj-").to_string();
                obj["metadata"]["name"] = json!(format!("{prefix}{}", s.rv + 1));
            }
            let k = key(&obj);
            if s.collections.get(&coll).is_some_and(|c| c.objects.contains_key(&k)) {
                return reply(409, &status(409, "AlreadyExists", "already exists"));
            }
            let c = s.put(&coll, obj);
            let _ = live.send(Live::Change(c.clone()));
            reply(201, &c.object)
        }
        (m @ (Method::PUT | Method::PATCH), Some(name)) => {
            s.writes.push((m.to_string(), path.clone(), body.clone()));
            let k = (ns.clone().unwrap_or_default(), name.clone());
            let old = s.collections.get(&coll).and_then(|c| c.objects.get(&k)).cloned();
            // Optimistic concurrency: a replace names the version it read.
            if m == Method::PUT
                && let Some(rv) = body["metadata"]["resourceVersion"].as_str()
                && !rv.is_empty()
            {
                match &old {
                    None => {
                        return reply(404, &status(404, "NotFound", &format!("{name} not found")));
                    }
                    Some(o) if o["metadata"]["resourceVersion"] != rv => {
                        let msg = "the object has been modified; please apply your changes to \
                                   the latest version and try again";
                        return reply(409, &status(409, "Conflict", msg));
                    }
                    Some(_) => {}
                }
            }
            let obj = match (m, old) {
                (Method::PUT, _) => body,
                (_, Some(mut o)) => {
                    let mut patch = body;
                    if sub.as_deref() == Some("status") {
                        patch =
                            json!({"status": patch.get("status").cloned().unwrap_or(Value::Null)});
                    }
                    // Server-side apply by the object's one manager: keys of `data` it no
                    // longer applies are removed (a ConfigMap's; no other object here has
                    // `data`).
                    if apply
                        && let Some(data) = patch.as_object_mut().and_then(|p| p.remove("data"))
                    {
                        o["data"] = data;
                    }
                    merge(&mut o, &patch, "");
                    o
                }
                (_, None) => {
                    // An apply patch creates; other patches need the object.
                    let mut o = body;
                    o["metadata"]["name"] = json!(name);
                    if let Some(n) = &ns {
                        o["metadata"]["namespace"] = json!(n);
                    }
                    o
                }
            };
            let c = s.put(&coll, obj);
            let _ = live.send(Live::Change(c.clone()));
            reply(200, &c.object)
        }
        (Method::DELETE, Some(name)) => {
            let k = (ns.unwrap_or_default(), name.clone());
            match s.remove(&coll, &k) {
                Some(c) => {
                    let _ = live.send(Live::Change(c.clone()));
                    reply(200, &c.object)
                }
                None => reply(404, &status(404, "NotFound", "not found")),
            }
        }
        _ => reply(405, &status(405, "MethodNotAllowed", "not scripted")),
    }
}

/// A streaming body: the `backlog` events, then what `pump` sends, one JSON line each.
fn async_stream<F, Fut>(backlog: Vec<Change>, pump: F) -> Body
where
    F: FnOnce(tokio::sync::mpsc::Sender<Change>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel::<Change>(1024);
    let fut = pump(tx.clone());
    tokio::spawn(async move {
        for c in backlog {
            if tx.send(c).await.is_err() {
                return;
            }
        }
        drop(tx);
        fut.await;
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        let c = rx.recv().await?;
        let line = format!("{}\n", json!({"type": c.kind, "object": c.object}));
        Some((Ok::<_, Infallible>(Bytes::from(line)), rx))
    });
    Body::from_stream(stream)
}
