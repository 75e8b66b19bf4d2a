//! The front door's state ([`App`]) and what its routes share to answer: the JSON
//! response, the rejection accounted in the request's record, and the headers both legs
//! forward. The routes (`routes`, and SGLang router's others in `sglang`) build on it.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{header, HeaderMap, HeaderName, HeaderValue, Response, StatusCode};

use crate::admission::Admission;
use crate::auth::ClientKeys;
use crate::body::{whole_response, RespBody, JSON};
use crate::config::Config;
use crate::dispatch::Dispatcher;
use crate::error::Failure;
use crate::request::record::RequestRecord;
use crate::types::REQUEST_ID;

/// Headers forwarded to engines as they are. `traceparent` first: a traced request skips
/// it (its legs carry their own, [`forward_headers`]).
static FORWARD: [HeaderName; 2] = [
    HeaderName::from_static("traceparent"),
    HeaderName::from_static("tracestate"),
];

/// The front door's state.
pub struct App {
    /// Swapped whole by a config reload; each request loads it once.
    pub dispatcher: ArcSwap<Dispatcher>,
    pub draining: AtomicBool,
    pub(super) admission: Arc<Admission>,
    /// Client API keys (reloaded in place by whoever holds the `Arc`).
    pub(super) keys: std::sync::Arc<ClientKeys>,
    /// The admin API's control routes on this port (SGLang's router serves them on its
    /// main port), set once by the router when an admin listener runs.
    pub(super) control: std::sync::OnceLock<crate::admin::FrontControl>,
}

impl App {
    pub fn new(dispatcher: Dispatcher, keys: std::sync::Arc<ClientKeys>) -> App {
        dispatcher
            .pool
            .replicas()
            .configure(&dispatcher.cfg.admission);
        App {
            admission: Arc::new(Admission::new(&dispatcher.cfg.admission)),
            dispatcher: ArcSwap::from_pointee(dispatcher),
            draining: AtomicBool::new(false),
            keys,
            control: std::sync::OnceLock::new(),
        }
    }

    /// Applies a reloaded config: the dispatcher (policies, timeouts, breaker and retry
    /// settings), the admission limits and a static replica count. Requests in flight keep
    /// what they started with.
    pub fn reconfigure(&self, cfg: Arc<Config>) {
        self.admission.reconfigure(&cfg.admission);
        self.dispatcher
            .load()
            .pool
            .replicas()
            .configure(&cfg.admission);
        let next = self.dispatcher.load().reconfigured(cfg);
        self.dispatcher.store(Arc::new(next));
    }

    /// How long hyper gives a client for a request head (`server.header_read_timeout_secs`).
    pub fn header_read_timeout(&self) -> std::time::Duration {
        self.dispatcher.load().cfg.server.header_read_timeout()
    }
}

/// A request answered with `f`, accounted for in `rec`.
pub(super) fn reject(mut rec: RequestRecord, f: Failure, rid: &HeaderValue) -> Response<RespBody> {
    rec.fail(f.reason);
    rec.answer(f.into_response(Some(rid)))
}

/// A JSON answer with the request id.
pub(super) fn json_response(
    status: StatusCode,
    body: impl Into<Bytes>,
    rid: &HeaderValue,
) -> Response<RespBody> {
    let mut r = whole_response(status, JSON, body);
    r.headers_mut().insert(REQUEST_ID, rid.clone());
    r
}

/// The allow-listed headers both legs carry, as `name: value\r\n` lines. With client
/// keys on (`client_key`), the client's `Authorization` is its pdgate key and is never
/// forwarded, whatever `upstream.forward_authorization` says: engines get
/// `upstream.api_key` or nothing. A traced request (`traced`) does not forward the
/// caller's `traceparent`: each leg carries its own (`crate::trace`).
pub(super) fn forward_headers(
    up: &crate::upstream::Upstream,
    incoming: &HeaderMap,
    rid: &HeaderValue,
    client_key: bool,
    traced: bool,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    let auth = match &up.auth {
        Some(a) => Some(a),
        None if up.forward_authorization && !client_key => incoming.get(header::AUTHORIZATION),
        None => None,
    };
    let fwd = FORWARD
        .iter()
        .skip(usize::from(traced))
        .filter_map(|name| incoming.get(name).map(|v| (name, v)));
    crate::upstream::header_lines(
        std::iter::once((&REQUEST_ID, rid))
            .chain(fwd)
            .chain(auth.map(|a| (&header::AUTHORIZATION, a))),
        &mut out,
    );
    out
}
