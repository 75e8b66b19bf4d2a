//! The front door: a hyper 1 server (HTTP/1.1 and h2c) on a listener that it keeps for its
//! whole life, with TCP_NODELAY on every accepted socket, and graceful drain on shutdown.
//!
//! Invariants: once shutdown starts, `/readiness` answers 503, no new connection is
//! accepted, and in-flight requests get up to the drain deadline to finish (connections that
//! never sent a byte are closed at once). A client gets `server.header_read_timeout_secs` for
//! its first byte and for each request head, and `server.body_read_timeout_secs` for a body.
//! At most `server.max_connections` connections are served at once, and an HTTP/2
//! connection without a stream is closed after `server.idle_timeout_secs` ([`conn`]).

mod app;
mod conn;
mod routes;
mod sglang;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::auth::ClientKeys;
use crate::dispatch::Dispatcher;

pub use app::App;

pub use crate::types::REQUEST_ID;

/// A running front door.
pub struct Server {
    addr: SocketAddr,
    shutdown: watch::Sender<bool>,
    task: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    app: Arc<App>,
}

impl Server {
    /// Serves `dispatcher` on `listener` until [`Server::shutdown`].
    pub fn start(
        listener: TcpListener,
        dispatcher: Dispatcher,
        keys: Arc<ClientKeys>,
        drain: Duration,
    ) -> std::io::Result<Server> {
        let addr = listener.local_addr()?;
        let app = Arc::new(App::new(dispatcher, keys));
        let (tx, rx) = watch::channel(false);
        let task = tokio::spawn(accept_loop(listener, app.clone(), rx, drain));
        Ok(Server {
            addr,
            shutdown: tx,
            task: std::sync::Mutex::new(Some(task)),
            app,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Applies a reloaded config to the request path (see [`App::reconfigure`]).
    /// The dispatcher requests start with now (e.g. for its learned stall bounds).
    pub fn dispatcher(&self) -> Arc<crate::dispatch::Dispatcher> {
        self.app.dispatcher.load_full()
    }

    pub fn reconfigure(&self, cfg: Arc<crate::config::Config>) {
        self.app.reconfigure(cfg);
    }

    /// Serves the admin API's control routes on this port too (SGLang's router does), under
    /// the admin token ([`crate::admin::front`]). Set once; a second call is ignored.
    pub fn serve_control(&self, control: crate::admin::FrontControl) {
        let _ = self.app.control.set(control);
    }

    /// Stops accepting, drains in-flight requests (up to the drain deadline), then returns.
    /// A second call returns at once.
    pub async fn shutdown(&self) {
        self.app.draining.store(true, Ordering::SeqCst);
        let _ = self.shutdown.send(true);
        let task = self.task.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(task) = task {
            let _ = task.await;
        }
    }
}

/// The most an HTTP/1 connection buffers (its request head must fit; hyper's floor is 8 KiB).
pub const HTTP1_MAX_BUF: usize = 16 * 1024;
/// An h2c connection's flow-control window (per stream and per connection): the most of
/// request bodies it buffers before they are read and charged.
pub const H2_WINDOW: u32 = 64 * 1024;
/// The largest h2 header list accepted.
pub const H2_MAX_HEADER_LIST: u32 = 16 * 1024;

async fn accept_loop(
    listener: TcpListener,
    app: Arc<App>,
    mut stop: watch::Receiver<bool>,
    drain: Duration,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    let first_byte_within = app.header_read_timeout();
    // What one connection may make the process hold before a request is admitted and its
    // body charged (`crate::memory`): a head of at most HTTP1_MAX_BUF (larger: 431), and
    // for h2c a flow-control window and a header list of the same order.
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(first_byte_within)
        .max_buf_size(HTTP1_MAX_BUF)
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(H2_MAX_HEADER_LIST)
        .initial_stream_window_size(H2_WINDOW)
        .initial_connection_window_size(H2_WINDOW);
    let registry = Arc::new(conn::Registry::default());
    let refusals = Arc::new(tokio::sync::Semaphore::new(conn::MAX_REFUSALS_IN_FLIGHT));
    let (max, idle) = {
        let d = app.dispatcher.load();
        (d.cfg.server.max_connections, d.cfg.server.idle_timeout())
    };
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
                let Some(slot) = registry.enter(max) else {
                    conn::refuse(stream, max, &refusals);
                    continue;
                };
                let app = app.clone();
                let builder = builder.clone();
                let stop = stop.clone();
                tokio::spawn(async move {
                    let _slot = slot;
                    serve(stream, app, builder, stop, first_byte_within, idle).await;
                });
            }
            _ = stop.changed() => break,
        }
    }
    drop(listener);
    tracing::info!(
        drain_deadline = ?drain,
        connections = registry.open(),
        "shutting down: draining in-flight requests"
    );
    if tokio::time::timeout(drain, registry.wait_empty())
        .await
        .is_err()
    {
        tracing::warn!("drain deadline passed with requests still in flight");
    }
}

/// Serves one connection until it ends, its HTTP/2 idle timer fires, or drain begins.
async fn serve(
    stream: tokio::net::TcpStream,
    app: Arc<App>,
    builder: auto::Builder<TokioExecutor>,
    mut stop: watch::Receiver<bool>,
    first_byte_within: Duration,
    idle: Duration,
) {
    // hyper's header timer starts once the auto builder has seen the first bytes (to tell
    // HTTP/1 from h2c): a connection that sends nothing at all is closed here, after the
    // same time, or when shutdown begins (a client's pool may hold connections it never
    // used).
    let (sniffed, stream) = tokio::select! {
        s = conn::sniff(stream, first_byte_within) => s,
        _ = stop.changed() => return,
    };
    let activity = match sniffed {
        conn::Sniffed::Nothing => return,
        conn::Sniffed::Http1 => None,
        conn::Sniffed::H2 => Some(conn::Activity::new()),
    };
    let tracked = activity.clone();
    let svc = service_fn(move |req| {
        let app = app.clone();
        // Only HTTP/2 streams are tracked (for the idle timer).
        let stream = tracked.as_ref().map(|a| a.begin());
        async move {
            let resp = app.handle(req).await;
            Ok::<_, std::convert::Infallible>(match stream {
                None => resp,
                Some(g) => resp.map(|b| {
                    http_body_util::BodyExt::boxed_unsync(crate::body::Guarded::new(b, g))
                }),
            })
        }
    });
    let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), svc);
    tokio::pin!(conn);
    let mut closing = false;
    loop {
        let idle_timer = async {
            match &activity {
                Some(a) if !closing => a.idle_for(idle).await,
                _ => std::future::pending().await,
            }
        };
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                return;
            }
            _ = stop.changed(), if !closing => {
                closing = true;
                conn.as_mut().graceful_shutdown();
            }
            _ = idle_timer => {
                tracing::debug!(idle = ?idle, "idle HTTP/2 connection closed");
                closing = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}
