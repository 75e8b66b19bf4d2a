//! Routing and the checks every request passes before it is dispatched: method, client
//! key, content type, body size, request id. Errors become responses only through
//! [`Failure::into_response`].
//!
//! Every request gets its [`RequestRecord`] as soon as it is routed; whatever answers it
//! (a rejection here, the dispatcher, a GET endpoint) hands the record to the response body,
//! which accounts for the request when it ends.
//!
//! The client-key check is a plain call in [`App::handle`], not a tower layer: its result
//! (the key id, and the hold on the key's in-flight limit) must reach the dispatch, and a
//! layer could only hand it over through the request's extensions (a type map allocated on
//! first insert, then a lookup by type) — per-request work the front door does not need.
//! With no keys file it costs one `ArcSwap` load. The admin listener, off the hot path,
//! is a tower stack (`crate::admin`).
//!
//! Which routes need a client key (when `auth.api_keys_file` is set): the API routes
//! (`/generate`, `/v1/chat/completions`, `/v1/completions`, `/v1/models`). Probes
//! (`/health`, `/liveness`, `/readiness`) and `/metrics` (only served here with
//! `server.public_metrics`) do not.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use futures_util::FutureExt;
use http::{header, HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;

use super::app::{forward_headers, json_response, reject, App};
use crate::admission::Admission;
use crate::body::RespBody;
use crate::dispatch::{Dispatcher, ReqCtx};
use crate::error::{FailReason, Failure};
use crate::memory::Charge;
use crate::request::record::{RequestRecord, Route};
use crate::request::{self, ApiRoute};
use crate::types::REQUEST_ID;
use crate::types::{RequestId, Role, WorkerIdent};

enum Endpoint {
    Pd(ApiRoute),
    Models,
    Health,
    Readiness,
    Metrics,
    /// SGLang router's other routes ([`super::sglang`]).
    Sglang(super::sglang::Call),
}

impl Endpoint {
    fn route(&self) -> Route {
        match self {
            Endpoint::Pd(r) => Route::Api(*r),
            Endpoint::Models => Route::Other("models"),
            Endpoint::Health => Route::Other("health"),
            Endpoint::Readiness => Route::Other("readiness"),
            Endpoint::Metrics => Route::Other("metrics"),
            Endpoint::Sglang(c) => Route::Other(c.label()),
        }
    }
}

/// `/metrics` is a route of the front door only with `server.public_metrics` (it always is
/// on the admin listener).
fn route(path: &str, public_metrics: bool) -> Option<(Endpoint, &'static [Method])> {
    const POST: &[Method] = &[Method::POST];
    const GET: &[Method] = &[Method::GET, Method::HEAD];
    Some(match path {
        "/generate" => (Endpoint::Pd(ApiRoute::Generate), POST),
        "/v1/chat/completions" => (Endpoint::Pd(ApiRoute::ChatCompletions), POST),
        "/v1/completions" => (Endpoint::Pd(ApiRoute::Completions), POST),
        "/v1/models" => (Endpoint::Models, GET),
        "/health" | "/liveness" => (Endpoint::Health, GET),
        "/readiness" => (Endpoint::Readiness, GET),
        "/metrics" if public_metrics => (Endpoint::Metrics, GET),
        p => match super::sglang::route(p) {
            Some((c, methods)) => (Endpoint::Sglang(c), methods),
            None => return None,
        },
    })
}

/// Why a request body was not read whole.
enum BodyError {
    /// Over `server.max_body_bytes`.
    TooLarge,
    /// The in-flight byte budget refused it (413 or 503, see `crate::admission`).
    Budget(Failure),
    Read(hyper::Error),
}

/// The whole request body, at most `limit` bytes, each frame charged to `charge` as it
/// arrives (a slow body holds only what it sent). A body that arrives in one frame (the
/// usual case: a small JSON body with a content-length) is returned as that frame, without
/// a copy. A large body lets other requests run every 256 KiB, and past that goes at
/// `rate` (`crate::body::Pacer`).
async fn read_body(
    mut body: Incoming,
    limit: usize,
    declared: Option<u64>,
    mut charge: Charge,
    rate: Option<&crate::body::ByteRate>,
) -> Result<(Bytes, Charge), BodyError> {
    let mut first: Option<Bytes> = None;
    let mut rest: Vec<u8> = Vec::new();
    let mut total = 0usize;
    let mut pacer = crate::body::Pacer::with_rate(rate);
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.map_err(BodyError::Read)?.into_data() else {
            continue; // trailers
        };
        let len = data.len();
        total = total.saturating_add(len);
        if total > limit {
            return Err(BodyError::TooLarge);
        }
        Admission::charge(&mut charge, data.len(), "the request body")
            .map_err(BodyError::Budget)?;
        match &first {
            None if rest.is_empty() => first = Some(data),
            _ => {
                if let Some(f) = first.take() {
                    let cap = declared.map_or(total, |d| d.min(limit as u64) as usize);
                    rest.reserve(cap.max(total));
                    rest.extend_from_slice(&f);
                }
                rest.extend_from_slice(&data);
            }
        }
        pacer.moved(len).await;
    }
    Ok((first.unwrap_or_else(|| Bytes::from(rest)), charge))
}

/// [`request::parse`], off the event loop for a large body (`crate::body::off_loop`).
async fn parse_body(route: ApiRoute, bytes: Bytes) -> Result<request::ParsedRequest, Failure> {
    crate::body::off_loop(bytes.len(), move || request::parse(route, bytes))
        .await
        .unwrap_or_else(|| {
            Err(Failure::new(
                FailReason::Internal,
                "the request body could not be parsed (the runtime is stopping)",
            ))
        })
}

/// An answer after which the connection is closed: the rest of the request body was not
/// read (too large, or too slow), so the connection cannot carry another request.
fn closing(mut r: Response<RespBody>) -> Response<RespBody> {
    r.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    r
}

fn valid_request_id(v: &HeaderValue) -> bool {
    let b = v.as_bytes();
    !b.is_empty() && b.len() <= 128 && b.iter().all(|c| c.is_ascii_graphic())
}

impl App {
    pub async fn handle(&self, req: Request<Incoming>) -> Response<RespBody> {
        let id = RequestId::random();
        let rid_header = req
            .headers()
            .get(REQUEST_ID)
            .filter(|v| valid_request_id(v))
            .cloned()
            .unwrap_or_else(|| {
                HeaderValue::from_str(id.as_str()).unwrap_or_else(|_| HeaderValue::from_static("-"))
            });
        // One dispatcher (config, policies) for the request's whole life, even across a
        // reload.
        let d = self.dispatcher.load_full();
        let (access, public_metrics) = (d.cfg.log.access, d.cfg.server.public_metrics);
        let Some((ep, methods)) = route(req.uri().path(), public_metrics) else {
            let rec = RequestRecord::new(id, Route::Other("unmatched"), &rid_header, access);
            let f = Failure::new(
                FailReason::NotFound,
                format!("no route for {}", req.uri().path()),
            );
            return reject(rec, f, &rid_header);
        };
        let rec = RequestRecord::new(id, ep.route(), &rid_header, access);
        if !methods.contains(req.method()) {
            let f = Failure::new(
                FailReason::MethodNotAllowed,
                format!("{} is not allowed on {}", req.method(), req.uri().path()),
            );
            let mut r = reject(rec, f, &rid_header);
            let allow = methods
                .iter()
                .map(Method::as_str)
                .collect::<Vec<_>>()
                .join(", ");
            if let Ok(v) = HeaderValue::from_str(&allow) {
                r.headers_mut().insert(header::ALLOW, v);
            }
            return r;
        }
        match ep {
            Endpoint::Pd(route) => {
                // The client key first: a refused request takes no admission slot and sends
                // no leg.
                let mut rec = rec;
                if let Some(t) = &d.tracer {
                    start_trace(t, &d, route, req.headers(), &mut rec);
                }
                let hold = match self.keys.admit_keyed(req.headers()) {
                    Ok(Some(k)) => {
                        rec.key_id = Some(k.id);
                        k.hold
                    }
                    Ok(None) => None,
                    Err((f, key)) => {
                        // A 429 over the key's limit is counted and logged under its key.
                        rec.key_id = key;
                        return reject(rec, f, &rid_header);
                    }
                };
                // The client's routing key (`[affinity]`): a value that cannot be one is
                // refused before a slot is taken.
                let key = match d.keys.read(req.headers()) {
                    Ok(k) => k,
                    Err(f) => return reject(rec, f, &rid_header),
                };
                let slot = match self.admission.admit().await {
                    Ok(s) => s.with_client(hold),
                    Err(f) => return reject(rec, f, &rid_header),
                };
                // The slot goes with the request: its response body (or a prefill leg still
                // running after it) releases it, and with it the key's count.
                self.pd(&d, route, req, rid_header, Some(slot), rec, key)
                    .await
            }
            Endpoint::Health => rec.answer(json_response(
                StatusCode::OK,
                r#"{"status":"ok"}"#,
                &rid_header,
            )),
            Endpoint::Readiness => rec.answer(self.readiness(&rid_header)),
            Endpoint::Metrics => {
                let text = crate::telemetry::render(&*d.pool);
                rec.answer(crate::body::whole_response(
                    StatusCode::OK,
                    crate::telemetry::CONTENT_TYPE,
                    text,
                ))
            }
            Endpoint::Sglang(c) => self.sglang(d.clone(), c, req, rid_header, rec).await,
            Endpoint::Models => match self.keys.identify(req.headers()) {
                Ok(_) => match self.models(&rid_header).await {
                    Ok(r) => rec.answer(r),
                    Err(f) => reject(rec, f, &rid_header),
                },
                Err(f) => reject(rec, f, &rid_header),
            },
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn pd(
        &self,
        d: &Arc<Dispatcher>,
        route: ApiRoute,
        req: Request<Incoming>,
        rid_header: HeaderValue,
        mut slot: Option<crate::dispatch::AdmissionSlot>,
        rec: RequestRecord,
        routing_key: Option<u64>,
    ) -> Response<RespBody> {
        let (parts, body) = req.into_parts();
        if let Some(ct) = parts.headers.get(header::CONTENT_TYPE) {
            let ok = ct.to_str().ok().is_some_and(|s| {
                let mime = s
                    .split(';')
                    .next()
                    .unwrap_or("")
                    .trim()
                    .to_ascii_lowercase();
                mime == "application/json"
                    || (mime.starts_with("application/") && mime.ends_with("+json"))
            });
            if !ok {
                let f = Failure::new(
                    FailReason::UnsupportedMediaType,
                    "content type must be application/json",
                );
                return reject(rec, f, &rid_header);
            }
        }
        let limit = d.cfg.server.max_body_bytes;
        let too_large = |rec| {
            let f = Failure::new(
                FailReason::PayloadTooLarge,
                format!("request body is larger than {limit} bytes"),
            );
            closing(reject(rec, f, &rid_header))
        };
        let declared = parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|s| s.parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit as u64) {
            return too_large(rec);
        }
        // A body that came with its head (the usual case) is read at once, with no timer;
        // only a body still on its way is given `body_read_timeout`.
        // A declared body the budget cannot hold now is refused before any of it is read
        // (its charge is still taken frame by frame as it arrives: a slow body holds only
        // what it sent).
        if let Some(n) = declared {
            let n = usize::try_from(n).unwrap_or(usize::MAX);
            if let Err(r) = self.admission.bytes().check(n) {
                let f = crate::admission::refused(r, "the request body");
                return closing(reject(rec, f, &rid_header));
            }
        }
        let charge = self.admission.bytes().charge();
        let read = read_body(body, limit, declared, charge, d.bulk_rate.as_deref());
        tokio::pin!(read);
        let read = match (&mut read).now_or_never() {
            Some(r) => r,
            None => {
                let within = d.cfg.server.body_read_timeout();
                match tokio::time::timeout(within, read).await {
                    Ok(r) => r,
                    Err(_) => {
                        let f = Failure::new(
                            FailReason::RequestBodyTimeout,
                            format!(
                                "the request body did not arrive within {}s",
                                within.as_secs()
                            ),
                        );
                        return closing(reject(rec, f, &rid_header));
                    }
                }
            }
        };
        let (bytes, charge) = match read {
            Ok(b) => b,
            Err(BodyError::TooLarge) => return too_large(rec),
            Err(BodyError::Budget(f)) => return closing(reject(rec, f, &rid_header)),
            Err(BodyError::Read(e)) => {
                let f = Failure::new(
                    FailReason::InvalidRequest,
                    format!("could not read the request body: {e}"),
                );
                return reject(rec, f, &rid_header);
            }
        };
        // The body's bytes are held until the response ends (retries write legs from it).
        if let Some(s) = slot.as_mut() {
            s.hold_bytes(charge);
        }
        let mut parsed = match parse_body(route, bytes).await {
            Ok(p) => p,
            Err(f) => return reject(rec, f, &rid_header),
        };
        parsed.routing_key = routing_key;
        // Traced: the legs carry their own `traceparent` instead of the caller's.
        let traced = rec.trace.is_some();
        let forward = forward_headers(
            &d.up,
            &parts.headers,
            &rid_header,
            rec.key_id.is_some(),
            traced,
        );
        let ctx = ReqCtx {
            id: rec.id(),
            request_id: rid_header,
            forward,
            slot,
            queue: Some(self.admission.clone()),
            trace: None,
        };
        d.dispatch(parsed, ctx, rec).await
    }

    fn readiness(&self, rid: &HeaderValue) -> Response<RespBody> {
        let dispatcher = self.dispatcher.load();
        let snap = dispatcher.pool.load();
        let draining = self.draining.load(Ordering::SeqCst);
        let replicas = dispatcher.pool.replicas().get();
        // Ready when some prefill has a decode of its handoff group (see `pool::groups`),
        // or a regular worker is routable.
        let ready =
            !draining && (!snap.prefill_pairable.is_empty() || !snap.regular_routable.is_empty());
        // Counts only: the client port never lists internal topology (URLs, pods, engine
        // messages). The admin listener's `/readiness` has the detail.
        let count = |ws: &[crate::pool::WorkerView]| {
            serde_json::json!({
                "workers": ws.len(),
                "healthy": ws.iter().filter(|w| w.facts.healthy).count(),
                "draining": ws.iter().filter(|w| w.facts.draining()).count(),
                "refused": ws.iter().filter(|w| w.facts.refusal().is_some()).count(),
                "ejected": ws.iter().filter(|w| w.shared.breaker.state().is_out()).count(),
            })
        };
        let body = serde_json::json!({
            "ready": ready,
            "draining": draining,
            "routable_prefill_ranks": snap.routable_ranks(Role::Prefill),
            "routable_decode_ranks": snap.routable_ranks(Role::Decode),
            "prefill": count(&snap.prefills),
            "decode": count(&snap.decodes),
            "routable_regular_ranks": snap.routable_ranks(Role::Regular),
            "regular": count(&snap.regulars),
            "models": crate::models::readiness(&snap),
            // How many replicas share each decode rank's capacity (0 = unknown), this
            // replica's index among them, and where the count comes from.
            "replicas": replicas.replicas,
            "replica_index": replicas.index,
            "replica_source": replicas.source.as_str(),
        });
        let status = if ready {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        json_response(status, body.to_string(), rid)
    }

    /// `/v1/models`: every model the workers serve, and the aliases, from pdgate's own
    /// knowledge (`crate::models::list`); only while no engine named a model, a healthy
    /// worker's own list (decode first: it serves the tokens).
    async fn models(&self, rid: &HeaderValue) -> Result<Response<RespBody>, Failure> {
        let d = self.dispatcher.load_full();
        let snap = d.pool.load_full();
        if !snap.models.is_empty() {
            let created = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |t| t.as_secs());
            let v = crate::models::list(&d.cfg.models, &snap, created);
            return Ok(json_response(StatusCode::OK, v.to_string(), rid));
        }
        let timeout = d.cfg.bootstrap.http_timeout();
        let candidates = snap
            .decodes
            .iter()
            .chain(snap.prefills.iter())
            .chain(snap.regulars.iter())
            .filter(|w| w.facts.healthy);
        for w in candidates {
            match d.up.get(&w.shared.url, "/v1/models", timeout).await {
                Ok((s, body)) if s.is_success() => {
                    return Ok(json_response(StatusCode::OK, body, rid))
                }
                Ok((s, _)) => {
                    tracing::debug!(worker_id = %WorkerIdent::new(w.shared.role, w.shared.id), worker_url = %w.shared.url, status = s.as_u16(), "/v1/models failed")
                }
                Err(e) => {
                    tracing::debug!(worker_id = %WorkerIdent::new(w.shared.role, w.shared.id), worker_url = %w.shared.url, error = %e, "/v1/models failed")
                }
            }
        }
        let reason = if snap
            .decodes
            .iter()
            .any(|w| w.shared.role == Role::Decode && w.facts.healthy)
        {
            FailReason::DecodeStatus
        } else {
            FailReason::NoDecodeAvailable
        };
        Err(Failure::new(
            reason,
            "no healthy worker answered /v1/models",
        ))
    }
}

/// The request's span, when `[trace]` is on and the request is sampled (the caller's
/// `traceparent` decides, else `trace.sample_ratio` drawn from the dispatcher's randomness).
fn start_trace(
    t: &crate::trace::Tracer,
    d: &Dispatcher,
    route: ApiRoute,
    headers: &HeaderMap,
    rec: &mut RequestRecord,
) {
    let name = match route {
        ApiRoute::Generate => "POST /generate",
        ApiRoute::ChatCompletions => "POST /v1/chat/completions",
        ApiRoute::Completions => "POST /v1/completions",
    };
    rec.trace = d
        .rng
        .with(|rng| t.start_request(headers, std::borrow::Cow::Borrowed(name), rng));
    let id = rec.id();
    if let Some(tr) = rec.trace.as_mut() {
        tr.set("http.request.method", "POST");
        tr.set("http.route", route.path());
        tr.set("pdgate.request_id", id.as_str().to_string());
        if let Some(v) = headers.get(REQUEST_ID).and_then(|v| v.to_str().ok()) {
            tr.set("pdgate.client_request_id", v.to_string());
        }
    }
}
