//! The metrics listener (`[metrics_listener]`, SGLang router's `--prometheus-host` /
//! `--prometheus-port`): a third HTTP listener that serves only `GET /metrics` (the same
//! text as the admin listener's) and `GET /liveness` (also `/health`), with no token, for
//! Prometheus and Kubernetes probes that cannot send one.
//!
//! Invariants: it serves nothing else (every other path is a 404 that says where the rest
//! is), so opening it on a public address exposes no worker URL, config or control route;
//! it is apart from the front door, so its connection limit and drain never fail a probe;
//! at most [`MAX_CONNECTIONS`] connections at once (more are closed at once); a request
//! head must arrive within [`HEADER_WITHIN`]; on shutdown it stops accepting and open
//! connections finish their request.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{header, HeaderValue, Method, Request, Response};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::body::RespBody;
use crate::error::{FailReason, Failure};
use crate::pool::Pool;

/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 64;
/// Time a client has for a request head.
pub const HEADER_WITHIN: Duration = Duration::from_secs(10);

/// A running metrics listener.
pub struct MetricsListener {
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    task: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl MetricsListener {
    /// Serves `pool`'s metrics (and liveness) on `listener`.
    pub fn start(listener: TcpListener, pool: Arc<Pool>) -> std::io::Result<MetricsListener> {
        let addr = listener.local_addr()?;
        let (stop, rx) = watch::channel(false);
        let task = tokio::spawn(accept_loop(listener, pool, rx));
        tracing::info!(url = %format!("http://{addr}"), "metrics listener listening (/metrics, /liveness)");
        Ok(MetricsListener {
            addr,
            stop,
            task: std::sync::Mutex::new(Some(task)),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting; open connections finish their request.
    pub async fn shutdown(&self) {
        let _ = self.stop.send(true);
        let task = self.task.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(task) = task {
            let _ = task.await;
        }
    }
}

fn text(ctype: &'static str, body: String) -> Response<RespBody> {
    crate::body::whole_response(http::StatusCode::OK, ctype, body)
}

/// The whole API: two paths.
fn answer(pool: &Pool, req: &Request<hyper::body::Incoming>) -> Response<RespBody> {
    let get = req.method() == Method::GET || req.method() == Method::HEAD;
    match req.uri().path() {
        "/metrics" | "/liveness" | "/health" if !get => {
            let mut r = Failure::new(FailReason::MethodNotAllowed, "use GET").into_response(None);
            r.headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
            r
        }
        "/metrics" => text(
            crate::telemetry::CONTENT_TYPE,
            crate::telemetry::render(pool),
        ),
        "/liveness" | "/health" => text("application/json", r#"{"status":"ok"}"#.to_string()),
        _ => Failure::new(
            FailReason::NotFound,
            "this listener serves only /metrics and /liveness; requests go to the front door \
             (server.port), worker and config routes to the admin listener (admin.port)",
        )
        .into_response(None),
    }
}

async fn accept_loop(listener: TcpListener, pool: Arc<Pool>, stop: watch::Receiver<bool>) {
    let limits = crate::listen::Limits {
        name: "metrics",
        max_connections: MAX_CONNECTIONS,
        header_within: HEADER_WITHIN,
    };
    let svc = tower::service_fn(move |req: Request<hyper::body::Incoming>| {
        let resp = answer(&pool, &req);
        async move { Ok::<_, std::convert::Infallible>(resp) }
    });
    crate::listen::serve(listener, limits, svc, stop).await;
}
