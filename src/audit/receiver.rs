//! A small OTLP logs receiver on the official protobuf types (`opentelemetry-proto`):
//! gRPC (`LogsService/Export`) or HTTP/protobuf (`POST /v1/logs`, gzip or not). It keeps
//! what it receives for a caller to inspect, and can be made slow or stopped, for tests of
//! the exporters' behaviour against a real server. `tierproxy otlp-receive` prints what it
//! receives as JSON Lines.
//!
//! Source: OTLP specification 1.x ("OTLP/gRPC", "OTLP/HTTP": request/response messages,
//! `Content-Type: application/x-protobuf`, `Content-Encoding: gzip`).

use std::collections::BTreeMap;
use std::io::Read as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use opentelemetry_proto::tonic::collector::logs::v1::logs_service_server::{
    LogsService, LogsServiceServer,
};
use opentelemetry_proto::tonic::collector::logs::v1::{
    ExportLogsServiceRequest, ExportLogsServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, any_value};
use prost::Message as _;

use super::otlp::OtlpProtocol;

/// One log record as received, flattened.
#[derive(Debug, Clone, PartialEq)]
pub struct Received {
    /// `event_name`.
    pub event_name: String,
    /// `severity_text`.
    pub severity: String,
    /// The body, when a string.
    pub body: String,
    /// `time_unix_nano`.
    pub time_unix_nano: u64,
    /// Attributes, as JSON values (strings, integers, arrays).
    pub attributes: BTreeMap<String, serde_json::Value>,
    /// The resource's attributes.
    pub resource: BTreeMap<String, serde_json::Value>,
    /// The instrumentation scope's name.
    pub scope: String,
}

impl Received {
    /// String attribute `key`.
    pub fn str(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).and_then(serde_json::Value::as_str)
    }

    /// Integer attribute `key`.
    pub fn int(&self, key: &str) -> Option<i64> {
        self.attributes.get(key).and_then(serde_json::Value::as_i64)
    }

    /// The record as one JSON object: `time_unix_nano`, `event`, `severity`, `body`,
    /// `attributes`, `resource`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "time_unix_nano": self.time_unix_nano,
            "event": self.event_name,
            "severity": self.severity,
            "body": self.body,
            "attributes": self.attributes,
            "resource": self.resource,
        })
    }
}

fn json(v: Option<&AnyValue>) -> serde_json::Value {
    use serde_json::Value as J;
    match v.and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => J::String(s.clone()),
        Some(any_value::Value::BoolValue(b)) => J::Bool(*b),
        Some(any_value::Value::IntValue(i)) => J::from(*i),
        Some(any_value::Value::DoubleValue(d)) => J::from(*d),
        Some(any_value::Value::ArrayValue(a)) => {
            J::Array(a.values.iter().map(|v| json(Some(v))).collect())
        }
        Some(any_value::Value::KvlistValue(l)) => {
            J::Object(l.values.iter().map(|kv| (kv.key.clone(), json(kv.value.as_ref()))).collect())
        }
        Some(any_value::Value::BytesValue(b)) => J::from(b.clone()),
        _ => J::Null,
    }
}

/// Flattens an export request.
pub fn flatten(req: &ExportLogsServiceRequest) -> Vec<Received> {
    let mut out = Vec::new();
    for rl in &req.resource_logs {
        let resource: BTreeMap<String, serde_json::Value> = rl
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .map(|kv| (kv.key.clone(), json(kv.value.as_ref())))
            .collect();
        for sl in &rl.scope_logs {
            let scope = sl.scope.as_ref().map(|s| s.name.clone()).unwrap_or_default();
            for r in &sl.log_records {
                out.push(Received {
                    event_name: r.event_name.clone(),
                    severity: r.severity_text.clone(),
                    body: json(r.body.as_ref()).as_str().unwrap_or_default().to_string(),
                    time_unix_nano: r.time_unix_nano,
                    attributes: r
                        .attributes
                        .iter()
                        .map(|kv| (kv.key.clone(), json(kv.value.as_ref())))
                        .collect(),
                    resource: resource.clone(),
                    scope: scope.clone(),
                });
            }
        }
    }
    out
}

/// A callback given each export request's records.
pub type OnRecords = Box<dyn Fn(&[Received]) + Send + Sync>;

/// What every handler shares.
#[derive(Default)]
struct State {
    records: Mutex<Vec<Received>>,
    /// Delay before answering each request (milliseconds): a slow receiver.
    delay_ms: AtomicU64,
    requests: AtomicU64,
    /// Records received (kept or not).
    seen: AtomicU64,
    /// Keep the records for [`Receiver::records`] (off for long runs: memory).
    keep: bool,
    /// Called with each request's records (e.g. to print them).
    on_records: Option<OnRecords>,
}

impl State {
    async fn take(&self, req: &ExportLogsServiceRequest) {
        let delay = self.delay_ms.load(Ordering::Relaxed);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        let recs = flatten(req);
        if let Some(f) = &self.on_records {
            f(&recs);
        }
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.seen.fetch_add(recs.len() as u64, Ordering::Relaxed);
        if self.keep {
            self.records.lock().unwrap_or_else(|p| p.into_inner()).extend(recs);
        }
    }
}

struct Grpc(Arc<State>);

#[tonic::async_trait]
impl LogsService for Grpc {
    async fn export(
        &self,
        request: tonic::Request<ExportLogsServiceRequest>,
    ) -> Result<tonic::Response<ExportLogsServiceResponse>, tonic::Status> {
        self.0.take(request.get_ref()).await;
        Ok(tonic::Response::new(ExportLogsServiceResponse { partial_success: None }))
    }
}

async fn http_logs(
    axum::extract::State(state): axum::extract::State<Arc<State>>,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> Result<Vec<u8>, (axum::http::StatusCode, String)> {
    let bad = |m: String| (axum::http::StatusCode::BAD_REQUEST, m);
    let gzip = headers
        .get(axum::http::header::CONTENT_ENCODING)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"gzip"));
    let raw = if gzip {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&body[..])
            .read_to_end(&mut out)
            .map_err(|e| bad(format!("gzip: {e}")))?;
        out
    } else {
        body.to_vec()
    };
    let req =
        ExportLogsServiceRequest::decode(&raw[..]).map_err(|e| bad(format!("protobuf: {e}")))?;
    state.take(&req).await;
    Ok(ExportLogsServiceResponse { partial_success: None }.encode_to_vec())
}

/// A running receiver on its own thread and runtime.
pub struct Receiver {
    /// The address it listens on.
    pub addr: SocketAddr,
    /// The protocol it speaks.
    pub protocol: OtlpProtocol,
    state: Arc<State>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Receiver {
    /// Starts a receiver on `addr` (port 0: any free port).
    ///
    /// # Errors
    /// The address cannot be bound.
    pub fn start(protocol: OtlpProtocol, addr: SocketAddr) -> anyhow::Result<Self> {
        Self::start_with(protocol, addr, None, true)
    }

    /// [`Receiver::start`], calling `on_records` with each request's records, and keeping
    /// them for [`Receiver::records`] only if `keep` ([`Receiver::count`] counts anyway).
    ///
    /// # Errors
    /// The address cannot be bound.
    pub fn start_with(
        protocol: OtlpProtocol,
        addr: SocketAddr,
        on_records: Option<OnRecords>,
        keep: bool,
    ) -> anyhow::Result<Self> {
        Self::start_inner(protocol, addr, on_records, keep, None)
    }

    /// A gRPC receiver serving TLS with certificate `cert_pem` and key `key_pem` (PEM):
    /// for tests of the exporter's TLS settings. Keeps what it receives.
    ///
    /// # Errors
    /// The address cannot be bound, or the identity is unusable.
    pub fn start_grpc_tls(
        addr: SocketAddr,
        cert_pem: &[u8],
        key_pem: &[u8],
    ) -> anyhow::Result<Self> {
        Self::start_tls(OtlpProtocol::Grpc, addr, cert_pem, key_pem)
    }

    /// A receiver of `protocol` serving TLS with certificate `cert_pem` and key `key_pem`
    /// (PEM): for tests of the exporter's TLS settings. Keeps what it receives.
    ///
    /// # Errors
    /// The address cannot be bound, or the identity is unusable.
    pub fn start_tls(
        protocol: OtlpProtocol,
        addr: SocketAddr,
        cert_pem: &[u8],
        key_pem: &[u8],
    ) -> anyhow::Result<Self> {
        let identity = tonic::transport::Identity::from_pem(cert_pem, key_pem);
        Self::start_inner(protocol, addr, None, true, Some(identity))
    }

    fn start_inner(
        protocol: OtlpProtocol,
        addr: SocketAddr,
        on_records: Option<OnRecords>,
        keep: bool,
        tls: Option<tonic::transport::Identity>,
    ) -> anyhow::Result<Self> {
        let tls_on = tls.is_some();
        let mut grpc = tonic::transport::Server::builder();
        if let Some(identity) = tls {
            super::sink::ensure_crypto_provider();
            grpc = grpc
                .tls_config(tonic::transport::ServerTlsConfig::new().identity(identity))
                .context("receiver TLS identity")?;
        }
        let state = Arc::new(State { on_records, keep, ..State::default() });
        let listener = std::net::TcpListener::bind(addr)
            .with_context(|| format!("binding the OTLP receiver to {addr}"))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let st = state.clone();
        let thread = std::thread::Builder::new().name("otlp-receiver".into()).spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(rt) => rt,
                Err(e) => {
                    tracing::error!(error = %e, "OTLP receiver runtime");
                    return;
                }
            };
            rt.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(listener) {
                    Ok(l) => l,
                    Err(e) => {
                        tracing::error!(error = %e, "OTLP receiver listener");
                        return;
                    }
                };
                let serve = async {
                    match protocol {
                        OtlpProtocol::Grpc => grpc
                            .add_service(
                                LogsServiceServer::new(Grpc(st))
                                    .accept_compressed(tonic::codec::CompressionEncoding::Gzip),
                            )
                            .serve_with_incoming(Accept(listener))
                            .await
                            .map_err(anyhow::Error::from),
                        OtlpProtocol::HttpProtobuf => {
                            let app = axum::Router::new()
                                .route("/v1/logs", axum::routing::post(http_logs))
                                .with_state(st);
                            if tls_on {
                                // tonic's server brings the TLS; it serves HTTP/1.1 too.
                                grpc.accept_http1(true)
                                    .add_routes(tonic::service::Routes::from(app))
                                    .serve_with_incoming(Accept(listener))
                                    .await
                                    .map_err(anyhow::Error::from)
                            } else {
                                axum::serve(listener, app).await.map_err(anyhow::Error::from)
                            }
                        }
                    }
                };
                // On stop the runtime is dropped with every connection task: the peer
                // sees its connections cut, as when a receiver crashes.
                tokio::select! {
                    r = serve => if let Err(e) = r {
                        tracing::error!(error = %e, "OTLP receiver stopped");
                    },
                    _ = stop_rx => {}
                }
            });
        })?;
        Ok(Receiver { addr, protocol, state, stop: Some(stop_tx), thread: Some(thread) })
    }

    /// The base endpoint an exporter should use: `http://ADDR`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every record received so far.
    pub fn records(&self) -> Vec<Received> {
        self.state.records.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Number of records received so far (kept or not).
    pub fn count(&self) -> u64 {
        self.state.seen.load(Ordering::Relaxed)
    }

    /// Export requests answered so far.
    pub fn requests(&self) -> u64 {
        self.state.requests.load(Ordering::Relaxed)
    }

    /// Makes every later request wait `delay` before it is answered.
    pub fn set_delay(&self, delay: Duration) {
        self.state.delay_ms.store(delay.as_millis() as u64, Ordering::Relaxed);
    }

    /// Waits until `pred(records)` holds or `timeout` passes; returns the records.
    pub fn wait_for(&self, timeout: Duration, pred: impl Fn(&[Received]) -> bool) -> Vec<Received> {
        let until = Instant::now() + timeout;
        loop {
            let r = self.records();
            if pred(&r) || Instant::now() >= until {
                return r;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops listening and closes every connection (as a crash of the receiver would).
    pub fn stop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A tokio listener as the stream of connections tonic serves.
struct Accept(tokio::net::TcpListener);

impl futures_core::Stream for Accept {
    type Item = std::io::Result<tokio::net::TcpStream>;

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.0.poll_accept(cx).map(|r| Some(r.map(|(s, _)| s)))
    }
}
