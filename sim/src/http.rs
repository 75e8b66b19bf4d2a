//! HTTP plumbing shared by every simulated server: the accept loop with the
//! "down" gate, response builders, a streaming body and a tiny HTTP/1 client.
//!
//! Why: the engine port, the bootstrap server and each rank endpoint must all
//! behave the same when "down": the listener stays bound for the server's whole
//! life, every new connection is accepted and dropped at once, and connections
//! already open are cut (their hyper connection future is dropped, which closes
//! the socket and drops any in-flight handler).
//!
//! Invariants:
//! - A listener is never re-bound; only [`Gate`] decides accept-vs-drop.
//! - Every accepted socket gets `TCP_NODELAY`.
//! - A handler returning `Err(Cut)` closes the connection without an answer.
//! - Streaming bodies are fed by an mpsc channel and flushed chunk by chunk;
//!   a body item `Err` aborts the connection mid-stream (used for "die").

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full, Limited};
use hyper::body::{Body as HttpBody, Frame, Incoming};
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};

use crate::config::Faults;

/// Error type of response bodies.
pub(crate) type BodyError = std::io::Error;
/// Response body used by every simulated server.
pub(crate) type Body = BoxBody<Bytes, BodyError>;
/// Response type used by every simulated server.
pub(crate) type Resp = Response<Body>;

/// Returned by a handler to close the connection without answering.
#[derive(Debug, thiserror::Error)]
#[error("connection cut by the simulator")]
pub(crate) struct Cut;

/// Largest request body a simulated server reads.
const MAX_BODY: usize = 64 * 1024 * 1024;

/// Decides whether a server is "down" and when the whole engine shuts down.
#[derive(Clone)]
pub(crate) struct Gate {
    pub faults: watch::Receiver<Faults>,
    pub shutdown: watch::Receiver<bool>,
    pub down_if: fn(&Faults) -> bool,
}

impl Gate {
    fn is_down(&self) -> bool {
        (self.down_if)(&self.faults.borrow())
    }
}

/// Resolves once `pred` holds for the faults (or the sender is gone).
pub(crate) async fn wait_faults(rx: &mut watch::Receiver<Faults>, pred: fn(&Faults) -> bool) {
    let _ = rx.wait_for(pred).await.map(|_| ());
}

/// Resolves once shutdown was requested (or the sender is gone).
pub(crate) async fn wait_shutdown(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await.map(|_| ());
}

/// `start + d`, or about a year later when that would overflow.
pub(crate) fn deadline(start: tokio::time::Instant, d: Duration) -> tokio::time::Instant {
    start
        .checked_add(d)
        .unwrap_or_else(|| start + Duration::from_secs(365 * 24 * 3600))
}

/// Spawns the accept loop of one server. The listener lives until shutdown.
pub(crate) fn serve<F, Fut>(listener: TcpListener, gate: Gate, handler: F)
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<Resp, Cut>> + Send + 'static,
{
    tokio::spawn(async move {
        let mut shutdown = gate.shutdown.clone();
        loop {
            let accepted = tokio::select! {
                r = listener.accept() => r,
                _ = wait_shutdown(&mut shutdown) => break,
            };
            let stream = match accepted {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::debug!(error = %e, "sim: accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            if gate.is_down() || *shutdown.borrow() {
                drop(stream);
                continue;
            }
            tokio::spawn(serve_conn(stream, gate.clone(), handler.clone()));
        }
    });
}

async fn serve_conn<F, Fut>(stream: TcpStream, gate: Gate, handler: F)
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<Resp, Cut>> + Send + 'static,
{
    let svc = hyper::service::service_fn(handler);
    let conn = hyper::server::conn::http1::Builder::new()
        .keep_alive(true)
        .serve_connection(TokioIo::new(stream), svc);
    let mut faults = gate.faults.clone();
    let mut shutdown = gate.shutdown.clone();
    tokio::select! {
        r = conn => {
            if let Err(e) = r {
                tracing::trace!(error = %e, "sim: connection ended");
            }
        }
        _ = wait_faults(&mut faults, gate.down_if) => {}
        _ = wait_shutdown(&mut shutdown) => {}
    }
}

fn full_body(bytes: Bytes) -> Body {
    Full::new(bytes)
        .map_err(|never: Infallible| match never {})
        .boxed()
}

/// A response with a fixed body and content type.
pub(crate) fn full(status: u16, content_type: &'static str, body: impl Into<Bytes>) -> Resp {
    let mut resp = Response::new(full_body(body.into()));
    *resp.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

/// aiohttp-style `text/plain` response.
pub(crate) fn text(status: u16, body: impl Into<Bytes>) -> Resp {
    full(status, "text/plain; charset=utf-8", body)
}

/// JSON response from an already serialized body.
pub(crate) fn json_str(status: u16, body: impl Into<Bytes>) -> Resp {
    full(status, "application/json", body)
}

/// JSON response from a serde value.
pub(crate) fn json(status: u16, value: &serde_json::Value) -> Resp {
    json_str(status, value.to_string())
}

/// Empty 200 (e.g. `/abort_request`).
pub(crate) fn empty(status: u16) -> Resp {
    full(status, "text/plain; charset=utf-8", Bytes::new())
}

/// Sender side of a streaming body; `Err` items cut the connection.
pub(crate) type ChunkTx = mpsc::Sender<Result<Bytes, BodyError>>;

/// A body that yields whatever arrives on an mpsc channel, one frame per item.
struct ChannelBody {
    rx: mpsc::Receiver<Result<Bytes, BodyError>>,
}

impl HttpBody for ChannelBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(Ok(b))) => Poll::Ready(Some(Ok(Frame::data(b)))),
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// A `text/event-stream` response and the sender that feeds it.
pub(crate) fn sse() -> (Resp, ChunkTx) {
    let (tx, rx) = mpsc::channel(64);
    let mut resp = Response::new(ChannelBody { rx }.boxed());
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    resp.headers_mut()
        .insert("cache-control", HeaderValue::from_static("no-cache"));
    (resp, tx)
}

/// Reads a whole request body (bounded).
pub(crate) async fn read_body(body: Incoming) -> Result<Bytes, Cut> {
    match Limited::new(body, MAX_BODY).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(_) => Err(Cut),
    }
}

/// Decodes one `application/x-www-form-urlencoded` component like aiohttp.
pub(crate) fn url_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(b) => {
                        out.push(b);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// First value of each query parameter, decoded.
pub(crate) fn query_param(query: Option<&str>, name: &str) -> Option<String> {
    let q = query?;
    q.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (url_decode(k) == name).then(|| url_decode(v))
    })
}

/// `host:port` with IPv6 hosts bracketed.
pub(crate) fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Answer of [`call`].
#[derive(Debug)]
pub(crate) struct ClientResp {
    pub status: u16,
    pub body: Bytes,
}

/// Why a [`call`] failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ClientError {
    #[error("connect to {0}: {1}")]
    Connect(String, std::io::Error),
    #[error("http: {0}")]
    Http(#[from] hyper::Error),
    #[error("bad request: {0}")]
    Build(#[from] hyper::http::Error),
    #[error("timed out")]
    Timeout,
}

/// One HTTP/1.1 request over a fresh connection to `addr` (`host:port`).
/// Dropping the returned future closes the connection.
pub(crate) async fn call(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<Vec<u8>>,
    timeout: Duration,
) -> Result<ClientResp, ClientError> {
    tokio::time::timeout(timeout, call_inner(addr, method, path, body))
        .await
        .unwrap_or(Err(ClientError::Timeout))
}

async fn call_inner(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<Vec<u8>>,
) -> Result<ClientResp, ClientError> {
    let stream = TcpStream::connect(addr)
        .await
        .map_err(|e| ClientError::Connect(addr.to_string(), e))?;
    let _ = stream.set_nodelay(true);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    let mut builder = Request::builder()
        .method(method)
        .uri(path)
        .header(hyper::header::HOST, addr);
    if body.is_some() {
        builder = builder.header(CONTENT_TYPE, "application/json");
    }
    let req = builder.body(full_body(Bytes::from(body.unwrap_or_default())))?;
    let exchange = async move {
        let resp = sender.send_request(req).await?;
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await?.to_bytes();
        Ok::<_, ClientError>(ClientResp { status, body })
    };
    tokio::pin!(exchange);
    tokio::pin!(conn);
    tokio::select! {
        biased;
        r = &mut exchange => r,
        c = &mut conn => match c {
            Err(e) => Err(ClientError::Http(e)),
            Ok(()) => exchange.await,
        },
    }
}
