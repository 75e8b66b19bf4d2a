//! A small side listener (the admin API, the metrics listener): accept, bound the open
//! connections, serve HTTP/1.1 with a head deadline, stop on a signal.
//!
//! Why one place: both side listeners need the same guards against a client that opens
//! connections and sends nothing, and the same shutdown (stop accepting, let each open
//! connection finish its request).
//!
//! Invariants: at most `max` connections are served at once (more are closed as they come);
//! a request head must arrive within `header_within`; after `stop` turns, nothing is
//! accepted and open connections end after their current request.

use std::convert::Infallible;
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tower::util::BoxCloneService;
use tower::{Service, ServiceExt};

use crate::body::RespBody;

/// How one side listener is bounded.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Named in its log lines.
    pub name: &'static str,
    pub max_connections: usize,
    pub header_within: Duration,
}

/// Serves `svc` on `listener` until `stop` turns (see the module docs).
pub async fn serve<S>(
    listener: TcpListener,
    limits: Limits,
    svc: S,
    mut stop: watch::Receiver<bool>,
) where
    S: Service<
            http::Request<hyper::body::Incoming>,
            Response = http::Response<RespBody>,
            Error = Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    let svc = SideService::new(svc);
    let slots = std::sync::Arc::new(Semaphore::new(limits.max_connections));
    loop {
        tokio::select! {
            r = listener.accept() => {
                let stream = match r {
                    Ok((s, _)) => s,
                    Err(e) => {
                        tracing::warn!(listener = limits.name, error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let Ok(slot) = slots.clone().try_acquire_owned() else {
                    tracing::warn!(
                        listener = limits.name,
                        max = limits.max_connections,
                        "connection refused: too many open"
                    );
                    continue;
                };
                let svc = svc.clone();
                let stop = stop.clone();
                tokio::spawn(async move {
                    let _slot = slot;
                    connection(stream, limits, svc, stop).await;
                });
            }
            _ = stop.changed() => break,
        }
    }
}

/// The service every connection of one side listener shares (boxed once per listener: these
/// listeners are off the request path).
type SideService =
    BoxCloneService<http::Request<hyper::body::Incoming>, http::Response<RespBody>, Infallible>;

async fn connection(
    stream: TcpStream,
    limits: Limits,
    svc: SideService,
    mut stop: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let svc = hyper::service::service_fn(move |req| svc.clone().oneshot(req));
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_within)
        .serve_connection(TokioIo::new(stream), svc);
    tokio::pin!(conn);
    tokio::select! {
        r = conn.as_mut() => {
            if let Err(e) = r {
                tracing::debug!(listener = limits.name, error = %e, "connection ended with an error");
            }
            return;
        }
        _ = stop.changed() => conn.as_mut().graceful_shutdown(),
    }
    let _ = conn.await;
}
