//! The admin API's routes (behind the token layer): workers, the effective config,
//! `/metrics`, and SGLang router's legacy worker calls.
//!
//! Answers are JSON; errors go through [`Failure::into_response`] like the front door's
//! (`{"error":{"message","type","param","code"}}`: 400 bad input, 404 unknown worker or path, 405
//! wrong method, 409 a worker that exists or is not the admin API's to remove). The SGLang
//! aliases answer success as SGLang's router does, in plain text.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::body::{whole_response, RespBody};
use crate::bootstrap::ownership::UNPROVED;
use crate::error::{FailReason, Failure};
use crate::fleet::{Fleet, FleetError, Removed, WorkerSpec};
use crate::pool::WorkerSource;
use crate::types::{Role, WorkerId};
use crate::url::parse_base_url;

use super::view::{parse_worker_ref, redact, worker_json, worker_ref};

/// Largest request body the admin API reads.
const MAX_BODY: usize = 64 * 1024;
/// How long a request body may take to arrive.
const BODY_WITHIN: Duration = Duration::from_secs(10);

/// The admin API over one router's fleet.
pub struct Api {
    pub fleet: Arc<Fleet>,
}

enum Route {
    Metrics,
    Liveness,
    Readiness,
    Workers,
    Worker(String),
    Drain(String),
    Undrain(String),
    Config,
    AddWorker,
    RemoveWorker,
    ListWorkers,
}

fn route(path: &str) -> Option<(Route, &'static [Method])> {
    const GET: &[Method] = &[Method::GET, Method::HEAD];
    const POST: &[Method] = &[Method::POST];
    const WORKERS: &[Method] = &[Method::GET, Method::HEAD, Method::POST];
    const WORKER: &[Method] = &[Method::GET, Method::HEAD, Method::DELETE];
    let segs: Vec<&str> = path.trim_end_matches('/').split('/').skip(1).collect();
    Some(match segs.as_slice() {
        ["metrics"] => (Route::Metrics, GET),
        ["liveness"] => (Route::Liveness, GET),
        ["readiness"] => (Route::Readiness, GET),
        ["workers"] => (Route::Workers, WORKERS),
        ["workers", id] => (Route::Worker((*id).to_string()), WORKER),
        ["workers", id, "drain"] => (Route::Drain((*id).to_string()), POST),
        ["workers", id, "undrain"] => (Route::Undrain((*id).to_string()), POST),
        ["config"] => (Route::Config, GET),
        ["add_worker"] => (Route::AddWorker, POST),
        ["remove_worker"] => (Route::RemoveWorker, POST),
        ["list_workers"] => (Route::ListWorkers, GET),
        _ => return None,
    })
}

fn json_response(status: StatusCode, v: &Value) -> Response<RespBody> {
    whole_response(status, crate::body::JSON, v.to_string())
}

fn text_response(status: StatusCode, text: String) -> Response<RespBody> {
    whole_response(status, "text/plain; charset=utf-8", text)
}

fn fail(reason: FailReason, message: impl Into<String>) -> Failure {
    Failure::new(reason, message)
}

/// A handler's answer: a response, or the failure to map.
type Answer = Result<Response<RespBody>, Failure>;

/// `application/x-www-form-urlencoded` decoding of one query component.
fn decode_component(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = b.get(i + 1..i + 3)?;
                let hex = std::str::from_utf8(hex).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 2;
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8(out).ok()
}

/// The query's parameters (the first of each name).
pub(crate) fn query(req_query: Option<&str>) -> Result<HashMap<String, String>, Failure> {
    let mut out = HashMap::new();
    for pair in req_query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let (Some(k), Some(v)) = (decode_component(k), decode_component(v)) else {
            return Err(fail(
                FailReason::InvalidRequest,
                "the query string is not valid percent-encoded UTF-8",
            ));
        };
        out.entry(k).or_insert(v);
    }
    Ok(out)
}

fn parse_role(s: &str, key: &str) -> Result<Role, Failure> {
    s.parse::<Role>().map_err(|_| {
        fail(
            FailReason::InvalidRequest,
            format!("{key} must be prefill, decode or regular, not {s:?}"),
        )
    })
}

/// `POST /workers`: SGLang's field names (`worker_type`) are accepted for `role`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AddBody {
    url: String,
    #[serde(alias = "worker_type")]
    role: String,
    #[serde(default)]
    bootstrap_port: Option<u16>,
    #[serde(default)]
    bootstrap_host: Option<String>,
    /// The model clients name for it (SGLang router's `model_id`); unset, its
    /// `/server_info` tells.
    #[serde(default, alias = "model_id")]
    model: Option<String>,
}

impl Api {
    pub async fn handle(&self, req: Request<hyper::body::Incoming>) -> Response<RespBody> {
        let path = req.uri().path();
        let Some((r, methods)) = route(path) else {
            return fail(FailReason::NotFound, format!("no admin route {path}"))
                .into_response(None);
        };
        if !methods.contains(req.method()) {
            let mut resp = fail(
                FailReason::MethodNotAllowed,
                format!("{} is not allowed on {path}", req.method()),
            )
            .into_response(None);
            let allow: Vec<&str> = methods.iter().map(Method::as_str).collect();
            if let Ok(v) = HeaderValue::from_str(&allow.join(", ")) {
                resp.headers_mut().insert(header::ALLOW, v);
            }
            return resp;
        }
        self.answer(r, req)
            .await
            .unwrap_or_else(|f| f.into_response(None))
    }

    async fn answer(&self, r: Route, req: Request<hyper::body::Incoming>) -> Answer {
        let params = query(req.uri().query())?;
        match r {
            Route::Metrics => {
                let text = crate::telemetry::render(&**self.fleet.pool());
                Ok(whole_response(
                    StatusCode::OK,
                    crate::telemetry::CONTENT_TYPE,
                    text,
                ))
            }
            // The process serves: what a liveness probe asks (not behind the front door's
            // connection limit, and answered while a drain runs).
            Route::Liveness => Ok(json_response(StatusCode::OK, &json!({"status": "ok"}))),
            Route::Workers if req.method() == Method::POST => self.add(&read_body(req).await?),
            Route::Workers => Ok(self.list(params.get("model").map(String::as_str))),
            Route::Readiness => Ok(self.readiness()),
            Route::Worker(id) if req.method() == Method::DELETE => {
                let wait = matches!(params.get("wait").map(String::as_str), Some("true" | "1"));
                self.delete(&id, wait).await
            }
            Route::Worker(id) => self.one(&id),
            Route::Drain(id) => self.set_draining(&id, true),
            Route::Undrain(id) => self.set_draining(&id, false),
            Route::Config => {
                let mut v = serde_json::to_value(&**self.fleet.live().load())
                    .map_err(|e| fail(FailReason::Internal, format!("config: {e}")))?;
                redact(&mut v);
                Ok(json_response(StatusCode::OK, &v))
            }
            Route::AddWorker => self.sglang_add(&params).await,
            Route::RemoveWorker => self.sglang_remove(&params),
            Route::ListWorkers => Ok(self.sglang_list()),
        }
    }

    /// The worker an id names, as JSON, or the 404.
    fn view(&self, id: &str) -> Result<(Role, WorkerId, Value), Failure> {
        let not_found = || {
            fail(
                FailReason::NotFound,
                format!(
                    "no worker {id} (ids look like prefill-0 or decode-3; GET /workers lists them)"
                ),
            )
        };
        let (role, wid) = parse_worker_ref(id).ok_or_else(not_found)?;
        let snap = self.fleet.pool().load_full();
        let w = snap.worker(role, wid).ok_or_else(not_found)?;
        Ok((role, wid, worker_json(&snap, w)))
    }

    fn workers_json(&self, snap: &crate::pool::Snapshot) -> Vec<Value> {
        snap.prefills
            .iter()
            .chain(snap.decodes.iter())
            .chain(snap.regulars.iter())
            .map(|w| worker_json(snap, w))
            .collect()
    }

    /// The front door's `/readiness` with the detail it leaves out: every worker, its
    /// URL, pod, health, ranks and why it is out of rotation.
    fn readiness(&self) -> Response<RespBody> {
        let snap = self.fleet.pool().load_full();
        let replicas = self.fleet.pool().replicas().get();
        let ready = (!snap.prefill_routable.is_empty() && !snap.decode_routable.is_empty())
            || !snap.regular_routable.is_empty();
        let status = if ready {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        json_response(
            status,
            &json!({
                "ready": ready,
                "routable_prefill_ranks": snap.routable_ranks(Role::Prefill),
                "routable_decode_ranks": snap.routable_ranks(Role::Decode),
                "routable_regular_ranks": snap.routable_ranks(Role::Regular),
                "replicas": replicas.replicas,
                "replica_index": replicas.index,
                "replica_source": replicas.source.as_str(),
                "workers": self.workers_json(&snap),
            }),
        )
    }

    /// Every worker, or with `?model=NAME` the workers serving that model (by the name its
    /// engine reports or the operator gave), with the model's own counts.
    fn list(&self, model: Option<&str>) -> Response<RespBody> {
        let snap = self.fleet.pool().load_full();
        let mut workers = self.workers_json(&snap);
        if let Some(m) = model {
            workers.retain(|w| w["model"].as_str() == Some(m));
            let view = snap.model(m);
            let ranks = |l: Option<&[crate::pool::Routable]>| {
                l.map_or(0, |l| l.iter().map(|r| r.ranks.len()).sum::<usize>())
            };
            let count = |role: &str| workers.iter().filter(|w| w["role"] == role).count();
            return json_response(
                StatusCode::OK,
                &json!({
                    "model": m,
                    "total": workers.len(),
                    "stats": {
                        "prefill": count("prefill"),
                        "decode": count("decode"),
                        "routable_prefill_ranks": ranks(view.map(|v| v.prefill_routable.as_slice())),
                        "routable_decode_ranks": ranks(view.map(|v| v.decode_routable.as_slice())),
                    },
                    "workers": workers,
                }),
            );
        }
        json_response(
            StatusCode::OK,
            &json!({
                "workers": workers,
                "total": workers.len(),
                "stats": {
                    "prefill": snap.prefills.len(),
                    "decode": snap.decodes.len(),
                    "regular": snap.regulars.len(),
                    "routable_prefill_ranks": snap.routable_ranks(Role::Prefill),
                    "routable_decode_ranks": snap.routable_ranks(Role::Decode),
                    "routable_regular_ranks": snap.routable_ranks(Role::Regular),
                },
            }),
        )
    }

    fn one(&self, id: &str) -> Answer {
        let (_, _, v) = self.view(id)?;
        Ok(json_response(StatusCode::OK, &v))
    }

    /// Adds a worker from the admin API (409 when its role has one at that URL).
    fn add_spec(
        &self,
        role: Role,
        url: &str,
        bootstrap_port: Option<u16>,
        bootstrap_host: Option<String>,
        model: Option<String>,
    ) -> Result<WorkerId, Failure> {
        let url = parse_base_url(url)
            .map_err(|e| fail(FailReason::InvalidRequest, format!("url {url:?}: {e}")))?;
        if role == Role::Decode && (bootstrap_port.is_some() || bootstrap_host.is_some()) {
            return Err(fail(
                FailReason::InvalidRequest,
                "bootstrap_port and bootstrap_host are for prefill workers",
            ));
        }
        if bootstrap_port == Some(0) {
            return Err(fail(
                FailReason::InvalidRequest,
                "bootstrap_port must be 1-65535",
            ));
        }
        if bootstrap_host
            .as_deref()
            .is_some_and(|h| h.trim().is_empty())
        {
            return Err(fail(
                FailReason::InvalidRequest,
                "bootstrap_host must not be empty",
            ));
        }
        if model
            .as_deref()
            .is_some_and(|m| m.trim().is_empty() || m.len() > crate::config::models::MAX_NAME_BYTES)
        {
            return Err(fail(
                FailReason::InvalidRequest,
                "model must be a non-empty name of at most 512 bytes",
            ));
        }
        self.fleet
            .add(WorkerSpec {
                role,
                url,
                bootstrap_port,
                bootstrap_host,
                source: WorkerSource::Admin,
                model,
            })
            .map_err(|e| match e {
                FleetError::Exists { role, url, id } => fail(
                    FailReason::Conflict,
                    format!(
                        "a {role} worker at {url} already exists: {}",
                        worker_ref(role, id)
                    ),
                ),
                FleetError::NotFound { .. } => fail(FailReason::Internal, e.to_string()),
            })
    }

    fn add(&self, body: &Bytes) -> Answer {
        let b: AddBody = serde_json::from_slice(body).map_err(|e| {
            fail(
                FailReason::InvalidRequest,
                format!(
                    "body must be JSON {{\"role\": \"prefill\"|\"decode\", \"url\": ..., \
                     \"bootstrap_port\"?: ..., \"bootstrap_host\"?: ...}}: {e}"
                ),
            )
        })?;
        let role = parse_role(&b.role, "role")?;
        let id = self.add_spec(role, &b.url, b.bootstrap_port, b.bootstrap_host, b.model)?;
        let reference = worker_ref(role, id);
        // (A DELETE racing the add may have removed it already: then this is the 404.)
        let (_, _, v) = self.view(&reference)?;
        let mut resp = json_response(StatusCode::CREATED, &v);
        if let Ok(loc) = HeaderValue::from_str(&format!("/workers/{reference}")) {
            resp.headers_mut().insert(header::LOCATION, loc);
        }
        Ok(resp)
    }

    fn set_draining(&self, id: &str, on: bool) -> Answer {
        let (role, wid, _) = self.view(id)?;
        let done = if on {
            self.fleet.drain(role, wid)
        } else {
            self.fleet.undrain(role, wid)
        };
        done.map_err(|e| fail(FailReason::NotFound, e.to_string()))?;
        self.one(id)
    }

    /// Whether the admin API may remove this worker: discovery owns the ones it found (it
    /// would add a live pod's worker back at its next resync).
    fn removable(&self, role: Role, id: WorkerId) -> Result<(), Failure> {
        let snap = self.fleet.pool().load();
        if let Some(w) = snap.worker(role, id) {
            if let WorkerSource::Discovered(p) = &w.shared.source {
                let r = worker_ref(role, id);
                return Err(fail(
                    FailReason::Conflict,
                    format!(
                        "{r} is pod {}/{}, owned by Kubernetes discovery: drain it \
                         (POST /workers/{r}/drain) or delete the pod",
                        p.namespace, p.name
                    ),
                ));
            }
        }
        Ok(())
    }

    fn remove(
        &self,
        role: Role,
        id: WorkerId,
    ) -> Result<tokio::task::JoinHandle<Removed>, Failure> {
        self.removable(role, id)?;
        let within = self.fleet.live().load().admin.remove_drain();
        self.fleet
            .remove(role, id, within)
            .map_err(|e| fail(FailReason::NotFound, e.to_string()))
    }

    async fn delete(&self, id: &str, wait: bool) -> Answer {
        let (role, wid, _) = self.view(id)?;
        let task = self.remove(role, wid)?;
        if !wait {
            let within = self.fleet.live().load().admin.remove_drain_secs;
            return Ok(json_response(
                StatusCode::ACCEPTED,
                &json!({
                    "id": id,
                    "state": "removing",
                    "message": format!(
                        "draining: removed when its requests in flight end, at most {within}s from now"
                    ),
                }),
            ));
        }
        let how = task
            .await
            .map_err(|e| fail(FailReason::Internal, format!("removal task failed: {e}")))?;
        Ok(json_response(
            StatusCode::OK,
            &json!({
                "id": id,
                "state": "removed",
                "outcome": match how {
                    Removed::Drained => "drained",
                    Removed::DeadlinePassed => "deadline_passed",
                    Removed::AlreadyGone => "already_gone",
                },
            }),
        ))
    }

    /// `POST /add_worker?url=U[&worker_type=prefill|decode|regular][&bootstrap_port=N]`
    /// (SGLang; no type: regular).
    /// Like SGLang's router, it answers once the worker takes traffic (200), up to
    /// `admin.add_worker_wait_secs`; past that, 202 says it is registered but not yet
    /// checked. A worker refused by its checks (a layout or bootstrap mismatch) is 409, and
    /// stays registered and visible in `/workers` with the reason.
    async fn sglang_add(&self, params: &HashMap<String, String>) -> Answer {
        let url = params.get("url").ok_or_else(|| {
            fail(
                FailReason::InvalidRequest,
                "url is required: /add_worker?url=...",
            )
        })?;
        // Without a type, a regular worker (SGLang's router's default `worker_type`).
        let role = match params.get("worker_type").or_else(|| params.get("role")) {
            Some(kind) => parse_role(kind, "worker_type")?,
            None => Role::Regular,
        };
        let port =
            match params.get("bootstrap_port") {
                None => None,
                Some(p) => Some(p.parse::<u16>().map_err(|_| {
                    fail(FailReason::InvalidRequest, "bootstrap_port must be 1-65535")
                })?),
            };
        let host = params.get("bootstrap_host").cloned();
        let model = params
            .get("model")
            .or_else(|| params.get("model_id"))
            .cloned();
        let id = self.add_spec(role, url, port, host, model)?;
        let reference = worker_ref(role, id);
        let within = self.fleet.live().load().admin.add_worker_wait();
        match wait_routable(self.fleet.pool(), role, id, within).await {
            Admitted::Routable => Ok(text_response(
                StatusCode::OK,
                format!("Successfully added {role} worker: {url} ({reference}; healthy, taking traffic)"),
            )),
            Admitted::Refused(why) => Err(fail(
                FailReason::Conflict,
                format!(
                    "{role} worker {url} ({reference}) is registered but refused by its checks: \
                     {why} (GET /workers/{reference}; remove it with POST /remove_worker?url=...)"
                ),
            )),
            Admitted::Gone => Err(fail(
                FailReason::NotFound,
                format!("{role} worker {url} ({reference}) was removed while it was being added"),
            )),
            Admitted::NotYet => Ok(text_response(
                StatusCode::ACCEPTED,
                format!(
                    "Registered {role} worker: {url} ({reference}), not yet checked: it takes \
                     traffic once its /server_info answers and its first health check passes \
                     (waited {}s; GET /workers/{reference} shows its state)",
                    within.as_secs()
                ),
            )),
        }
    }

    /// `POST /remove_worker?url=U[&worker_type=...]` (SGLang): drains, then removes.
    fn sglang_remove(&self, params: &HashMap<String, String>) -> Answer {
        let raw = params.get("url").ok_or_else(|| {
            fail(
                FailReason::InvalidRequest,
                "url is required: /remove_worker?url=...",
            )
        })?;
        let url = parse_base_url(raw)
            .map_err(|e| fail(FailReason::InvalidRequest, format!("url {raw:?}: {e}")))?;
        let roles = match params.get("worker_type").or_else(|| params.get("role")) {
            Some(k) => vec![parse_role(k, "worker_type")?],
            None => vec![Role::Prefill, Role::Decode, Role::Regular],
        };
        let found: Vec<(Role, WorkerId)> = roles
            .into_iter()
            .filter_map(|r| self.fleet.find(r, &url).map(|id| (r, id)))
            .collect();
        if found.is_empty() {
            return Err(fail(FailReason::NotFound, format!("no worker at {url}")));
        }
        for (r, id) in &found {
            self.removable(*r, *id)?;
        }
        let mut ids = Vec::new();
        for (r, id) in found {
            self.remove(r, id)?;
            ids.push(worker_ref(r, id));
        }
        Ok(text_response(
            StatusCode::OK,
            format!(
                "Successfully removed worker: {url} ({} draining; dropped when its requests end)",
                ids.join(", ")
            ),
        ))
    }

    /// `GET /list_workers` (SGLang): `{"urls": [...]}`, prefills first, plus each role's.
    fn sglang_list(&self) -> Response<RespBody> {
        let snap = self.fleet.pool().load();
        let urls = |role: Role| -> Vec<&str> {
            snap.workers(role)
                .iter()
                .map(|w| w.shared.url.as_str())
                .collect()
        };
        let (p, d) = (urls(Role::Prefill), urls(Role::Decode));
        let all: Vec<&str> = p.iter().chain(d.iter()).copied().collect();
        json_response(
            StatusCode::OK,
            &json!({"urls": all, "prefill": p, "decode": d}),
        )
    }
}

/// Where a newly added worker stands after [`wait_routable`].
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Admitted {
    /// In the snapshot's routable set: it takes traffic.
    Routable,
    /// Its checks refused it (the reason, as `/workers` shows it).
    Refused(String),
    /// Removed meanwhile.
    Gone,
    /// Still unchecked when the wait ended.
    NotYet,
}

/// How often [`wait_routable`] reads the snapshot.
const ADMIT_POLL: Duration = Duration::from_millis(25);

/// Waits up to `within` for worker `id` to be routable (or refused for good, or gone).
pub(crate) async fn wait_routable(
    pool: &crate::pool::Pool,
    role: Role,
    id: WorkerId,
    within: Duration,
) -> Admitted {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let snap = pool.load();
        let Some(w) = snap.worker(role, id) else {
            return Admitted::Gone;
        };
        if snap.routable(role).iter().any(|r| r.worker == id) {
            return Admitted::Routable;
        }
        // A prefill whose bootstrap server is not yet proved its own is refused only for
        // now: the proof is under way (its verdict is final, either way).
        if let Some(why) = w.facts.refusal().filter(|r| *r != UNPROVED) {
            return Admitted::Refused(why.to_owned());
        }
        if tokio::time::Instant::now() >= deadline {
            return Admitted::NotYet;
        }
        tokio::time::sleep(ADMIT_POLL).await;
    }
}

/// The whole request body, bounded in size and time.
async fn read_body(req: Request<hyper::body::Incoming>) -> Result<Bytes, Failure> {
    let body = Limited::new(req.into_body(), MAX_BODY);
    match tokio::time::timeout(BODY_WITHIN, body.collect()).await {
        Ok(Ok(b)) => Ok(b.to_bytes()),
        Ok(Err(e)) => Err(fail(
            FailReason::InvalidRequest,
            format!("could not read the body (at most {MAX_BODY} bytes): {e}"),
        )),
        Err(_) => Err(fail(
            FailReason::RequestBodyTimeout,
            "the body did not arrive in time",
        )),
    }
}

/// Adapts [`Api::handle`] to a tower service (it never fails).
pub async fn serve(
    api: Arc<Api>,
    req: Request<hyper::body::Incoming>,
) -> Result<Response<RespBody>, Infallible> {
    Ok(api.handle(req).await)
}

#[cfg(test)]
mod tests;
