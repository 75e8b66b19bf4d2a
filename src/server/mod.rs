//! The front door: a hyper 1 server (HTTP/1.1 and h2c) on a listener that it keeps for its
//! whole life, with TCP_NODELAY on every accepted socket, and graceful drain on shutdown.
//!
//! Invariants: once shutdown starts, `/readiness` answers 503, no new connection is
//! accepted, and in-flight requests get up to the drain deadline to finish (connections that
//! never sent a byte are closed at once). A client gets `server.header_read_timeout_secs` for
//! its first byte and for each request head, and `server.body_read_timeout_secs` for a body.

pub mod admission;
mod routes;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderName;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::pd::Dispatcher;

pub use routes::{prometheus, App};

/// The request id header, echoed on every response and forwarded to engines.
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// A running front door.
pub struct Server {
    addr: SocketAddr,
    shutdown: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
    app: Arc<App>,
}

impl Server {
    /// Serves `dispatcher` on `listener` until [`Server::shutdown`].
    pub fn start(
        listener: TcpListener,
        dispatcher: Dispatcher,
        drain: Duration,
    ) -> std::io::Result<Server> {
        let addr = listener.local_addr()?;
        let app = Arc::new(App::new(dispatcher));
        let (tx, rx) = watch::channel(false);
        let task = tokio::spawn(accept_loop(listener, app.clone(), rx, drain));
        Ok(Server {
            addr,
            shutdown: tx,
            task,
            app,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting, drains in-flight requests (up to the drain deadline), then returns.
    pub async fn shutdown(self) {
        self.app.draining.store(true, Ordering::SeqCst);
        let _ = self.shutdown.send(true);
        let _ = self.task.await;
    }
}

async fn accept_loop(
    listener: TcpListener,
    app: Arc<App>,
    mut stop: watch::Receiver<bool>,
    drain: Duration,
) {
    let graceful = GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    let first_byte_within = app.header_read_timeout();
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(first_byte_within)
        .keep_alive(true);
    loop {
        tokio::select! {
            r = listener.accept() => {
                let (stream, _) = match r {
                    Ok(s) => s,
                    Err(e) => {
                        // Out of fds and similar: back off briefly rather than spin.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let app = app.clone();
                let svc = service_fn(move |req| {
                    let app = app.clone();
                    async move { Ok::<_, std::convert::Infallible>(app.handle(req).await) }
                });
                let builder = builder.clone();
                let watcher = graceful.watcher();
                let mut stop = stop.clone();
                tokio::spawn(async move {
                    // hyper's header timer starts once the auto builder has seen the first
                    // bytes (to tell HTTP/1 from h2c): a connection that sends nothing at
                    // all is closed here, after the same time, or when shutdown begins (a
                    // client's pool may hold connections it never used).
                    let mut first = [0u8; 1];
                    let peek = tokio::time::timeout(first_byte_within, stream.peek(&mut first));
                    tokio::select! {
                        r = peek => if !matches!(r, Ok(Ok(1))) {
                            return; // silent past the deadline, closed, or broken
                        },
                        _ = stop.changed() => return,
                    }
                    let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), svc);
                    if let Err(e) = watcher.watch(conn.into_owned()).await {
                        tracing::debug!(error = %e, "connection ended with an error");
                    }
                });
            }
            _ = stop.changed() => break,
        }
    }
    drop(listener);
    tracing::info!(
        drain_secs = drain.as_secs_f64(),
        "shutting down: draining in-flight requests"
    );
    if tokio::time::timeout(drain, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("drain deadline passed with requests still in flight");
    }
}
