//! SGLang router's front-door routes that are not requests to a model: the calls tools
//! (SGLang's scripts, `bench_serving`, dashboards) make to `sglang-router` / `smg` on its
//! main port.
//!
//! | method | path | who may call | what pdgate answers |
//! |---|---|---|---|
//! | GET | `/get_server_info`, `/server_info` | anyone (a client key when keys are on) | a healthy decode's model facts (then a prefill's), allow-listed: no URL, host, port or key |
//! | GET | `/get_model_info`, `/model_info` | same | a healthy decode's `/model_info`, allow-listed |
//! | GET | `/health_generate` | same | a real one-token `/generate` through a pair (see below) |
//! | POST | `/flush_cache` | admin token | fanned out to every engine; each engine's outcome by worker id, never its URL |
//! | GET | `/get_loads` | admin token | each worker's last reported engine load and pdgate's in-flight count, by worker id |
//! | * | `/workers[/{id}[/drain\|/undrain]]`, `/add_worker`, `/remove_worker`, `/list_workers` | admin token | the admin API itself ([`crate::admin::FrontControl`]) |
//!
//! The info routes and `/health_generate` take an optional `model` query parameter (`?model=...`, resolved like a
//! request's `model`: aliases, `base:adapter`, 404 `model_not_found` when unknown) and
//! answer for that model's engines; without it, for `models.default`'s, else any.
//!
//! Decisions:
//! - **`/health_generate` is a real request** through one (prefill, decode) pair, chosen
//!   and sent like any `/generate` (`max_new_tokens` 1): for a PD router "can it generate"
//!   means a prefill, its bootstrap server, the KV transfer and a decode all work, which
//!   neither `/readiness` (pdgate's own view) nor an engine's own `/health_generate` shows.
//!   It takes an admission slot like any request (so it cannot be used to go past the
//!   in-flight cap) and, with client keys on, needs one. 200 `{"status":"ok"}` when the
//!   answer came back whole; otherwise the request's own error (status and JSON).
//! - **Control routes** (`/flush_cache`, `/get_loads`, the worker routes) need the admin
//!   token; without one in use they are refused with where pdgate serves them
//!   ([`crate::admin::front`]).
//! - No front-door body names an engine's URL or host, except the worker routes an
//!   operator calls with the admin token (their subject is the URLs the operator gave).

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::{json, Map, Value};

use crate::admin::view::worker_ref;
use crate::body::RespBody;
use crate::dispatch::{Dispatcher, ReqCtx};
use crate::error::{FailReason, Failure};
use crate::pool::WorkerView;
use crate::request::record::RequestRecord;
use crate::request::{self, ApiRoute};
use crate::types::RequestId;
use crate::upstream::CallError;

use super::app::{json_response, reject, App};

/// One of SGLang router's routes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Call {
    ServerInfo,
    ModelInfo,
    HealthGenerate,
    FlushCache,
    GetLoads,
    Workers,
}

impl Call {
    pub(super) fn label(self) -> &'static str {
        match self {
            Call::ServerInfo => "server_info",
            Call::ModelInfo => "model_info",
            Call::HealthGenerate => "health_generate",
            Call::FlushCache => "flush_cache",
            Call::GetLoads => "get_loads",
            Call::Workers => "workers",
        }
    }

    fn control(self) -> bool {
        matches!(self, Call::FlushCache | Call::GetLoads | Call::Workers)
    }
}

/// SGLang router's route for `path`, with the methods it takes.
pub(super) fn route(path: &str) -> Option<(Call, &'static [Method])> {
    const GET: &[Method] = &[Method::GET, Method::HEAD];
    const POST: &[Method] = &[Method::POST];
    // The admin API checks its own methods per route.
    const ANY: &[Method] = &[Method::GET, Method::HEAD, Method::POST, Method::DELETE];
    Some(match path {
        "/get_server_info" | "/server_info" => (Call::ServerInfo, GET),
        "/get_model_info" | "/model_info" => (Call::ModelInfo, GET),
        "/health_generate" => (Call::HealthGenerate, GET),
        "/flush_cache" => (Call::FlushCache, POST),
        "/get_loads" => (Call::GetLoads, GET),
        p if crate::admin::front::is_worker_route(p) => (Call::Workers, ANY),
        _ => return None,
    })
}

/// `/server_info` keys passed on: what the model and its serving are, nothing that names
/// a machine (SGLang's answer also has `host`, `port`, `dist_init_addr`, keys, ...).
const SERVER_FACTS: &[&str] = &[
    "model_path",
    "tokenizer_path",
    "served_model_name",
    "context_length",
    "max_total_num_tokens",
    "max_req_input_len",
    "max_running_requests",
    "max_prefill_tokens",
    "chunked_prefill_size",
    "tp_size",
    "dp_size",
    "pp_size",
    "ep_size",
    "enable_dp_attention",
    "page_size",
    "kv_cache_dtype",
    "dtype",
    "quantization",
    "is_embedding",
    "skip_tokenizer_init",
    "disaggregation_transfer_backend",
    "speculative_algorithm",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "incremental_streaming_output",
    "attention_backend",
    "sampling_backend",
    "schedule_policy",
    "version",
    "weight_version",
];

/// `/model_info` keys passed on.
const MODEL_FACTS: &[&str] = &[
    "model_path",
    "tokenizer_path",
    "served_model_name",
    "is_generation",
    "preferred_sampling_params",
    "weight_version",
    "has_image_understanding",
    "has_audio_understanding",
    "model_type",
    "architectures",
];

/// The allow-listed keys of an engine's JSON object.
fn facts(v: &Value, keys: &[&str]) -> Map<String, Value> {
    let mut out = Map::new();
    if let Some(o) = v.as_object() {
        for k in keys {
            if let Some(x) = o.get(*k) {
                out.insert((*k).to_string(), x.clone());
            }
        }
    }
    out
}

/// Numbers and booleans only (nested objects likewise), and no key about a port: the
/// per-rank figures of `internal_states` without anything that could name a machine.
fn numbers_only(v: &Value) -> Option<Value> {
    match v {
        Value::Number(_) | Value::Bool(_) => Some(v.clone()),
        Value::Object(o) => Some(Value::Object(
            o.iter()
                .filter(|(k, _)| !k.contains("port") && !k.contains("addr"))
                .filter_map(|(k, x)| numbers_only(x).map(|x| (k.clone(), x)))
                .collect(),
        )),
        _ => None,
    }
}

/// A failed engine call, in words that name no URL or host.
fn call_error(e: &CallError) -> &'static str {
    match e {
        CallError::Transport(_) => "unreachable",
        CallError::Timeout(_) => "timed out",
        CallError::Url(_) => "bad URL",
        CallError::Body(_) => "answer not read",
    }
}

impl App {
    /// Answers one of SGLang router's routes.
    pub(super) async fn sglang(
        &self,
        d: Arc<Dispatcher>,
        call: Call,
        req: Request<Incoming>,
        rid: HeaderValue,
        rec: RequestRecord,
    ) -> Response<RespBody> {
        if call.control() {
            let checked = match self.control.get() {
                Some(c) => c.authorize(req.method(), req.uri().path(), req.headers()),
                None => Err(crate::admin::front::not_here(req.uri().path())),
            };
            if let Err(f) = checked {
                return reject(rec, f, &rid);
            }
        } else if let Err(f) = self.keys.identify(req.headers()) {
            return reject(rec, f, &rid);
        }
        let scope = match call {
            Call::ServerInfo | Call::ModelInfo | Call::HealthGenerate => {
                match model_scope(&d, req.uri().query()) {
                    Ok(s) => s,
                    Err(f) => return reject(rec, f, &rid),
                }
            }
            _ => None,
        };
        let answer = match call {
            Call::ServerInfo => self.server_info(&d, scope.as_deref(), &rid).await,
            Call::ModelInfo => self.model_info(&d, scope.as_deref(), &rid).await,
            Call::HealthGenerate => {
                return self
                    .health_generate(d, scope.as_deref(), req, rid, rec)
                    .await
            }
            Call::FlushCache => Ok(self.flush_cache(&d, &rid).await),
            Call::GetLoads => Ok(get_loads(&d, &rid)),
            Call::Workers => {
                let Some(c) = self.control.get() else {
                    let f = crate::admin::front::not_here(req.uri().path());
                    return reject(rec, f, &rid);
                };
                let mut r = c.workers(req).await;
                r.headers_mut()
                    .insert(crate::types::REQUEST_ID, rid.clone());
                Ok(r)
            }
        };
        match answer {
            Ok(r) => rec.answer(r),
            Err(f) => reject(rec, f, &rid),
        }
    }

    /// The first healthy worker's (decodes first) JSON answer on one of `paths`, among
    /// the workers of `model` when given.
    async fn engine_json(
        &self,
        d: &Dispatcher,
        model: Option<&str>,
        paths: &'static [&'static str],
    ) -> Result<Value, Failure> {
        let snap = d.pool.load_full();
        let timeout = d.cfg.bootstrap.http_timeout();
        // Owned, so that nothing borrowed by a closure is held across an await.
        let healthy: Vec<crate::upstream::BaseUrl> = snap
            .decodes
            .iter()
            .chain(snap.prefills.iter())
            .chain(snap.regulars.iter())
            .filter(|w| w.facts.healthy && w.facts.refusal().is_none())
            .filter(|w| model.is_none() || w.model.as_deref() == model)
            .map(|w| w.shared.url.clone())
            .collect();
        for url in &healthy {
            for &p in paths {
                match d.up.get(url, p, timeout).await {
                    Ok((s, body)) if s.is_success() => {
                        if let Ok(v) = serde_json::from_slice::<Value>(&body) {
                            return Ok(v);
                        }
                    }
                    Ok((s, _)) if s == StatusCode::NOT_FOUND => continue,
                    Ok((s, _)) => {
                        tracing::debug!(worker_url = %url, path = p, status = s.as_u16(), "engine info failed");
                    }
                    Err(e) => {
                        tracing::debug!(worker_url = %url, path = p, error = %e, "engine info failed");
                    }
                }
                break;
            }
        }
        let reason = if snap
            .decodes
            .iter()
            .chain(snap.regulars.iter())
            .any(|w| w.facts.healthy && (model.is_none() || w.model.as_deref() == model))
        {
            FailReason::DecodeStatus
        } else {
            FailReason::NoDecodeAvailable
        };
        Err(Failure::new(
            reason,
            format!("no healthy engine answered {}", paths.join(" or ")),
        ))
    }

    async fn server_info(
        &self,
        d: &Dispatcher,
        model: Option<&str>,
        rid: &HeaderValue,
    ) -> Result<Response<RespBody>, Failure> {
        let v = self
            .engine_json(d, model, &["/server_info", "/get_server_info"])
            .await?;
        let mut out = facts(&v, SERVER_FACTS);
        if let Some(states) = v.get("internal_states").and_then(Value::as_array) {
            let states: Vec<Value> = states.iter().filter_map(numbers_only).collect();
            out.insert("internal_states".into(), Value::Array(states));
        }
        let snap = d.pool.load();
        out.insert(
            "router".into(),
            json!({
                "name": "pdgate",
                "version": env!("CARGO_PKG_VERSION"),
                "prefill_workers": snap.prefills.len(),
                "decode_workers": snap.decodes.len(),
                "regular_workers": snap.regulars.len(),
            }),
        );
        Ok(json_response(
            StatusCode::OK,
            Value::Object(out).to_string(),
            rid,
        ))
    }

    async fn model_info(
        &self,
        d: &Dispatcher,
        model: Option<&str>,
        rid: &HeaderValue,
    ) -> Result<Response<RespBody>, Failure> {
        let v = self
            .engine_json(d, model, &["/model_info", "/get_model_info"])
            .await?;
        let out = facts(&v, MODEL_FACTS);
        Ok(json_response(
            StatusCode::OK,
            Value::Object(out).to_string(),
            rid,
        ))
    }

    /// Sends `/flush_cache` to every engine at once; 200 when every one flushed, else 502
    /// with each engine's outcome.
    async fn flush_cache(&self, d: &Dispatcher, rid: &HeaderValue) -> Response<RespBody> {
        let snap = d.pool.load_full();
        let timeout = d.cfg.bootstrap.http_timeout();
        // Owned per call (a future borrowing from an iterator's closure is not `Send`).
        let targets: Vec<(String, crate::upstream::BaseUrl)> = snap
            .prefills
            .iter()
            .chain(snap.decodes.iter())
            .chain(snap.regulars.iter())
            .filter(|w| !w.facts.leaving())
            .map(|w| (worker_ref(w.shared.role, w.shared.id), w.shared.url.clone()))
            .collect();
        let calls: Vec<_> = targets
            .into_iter()
            .map(|(id, url)| flush_one(d.up.clone(), id, url, timeout))
            .collect();
        let results = futures_util::future::join_all(calls).await;
        let total = results.len();
        let mut ok = Vec::new();
        let mut failed = Vec::new();
        for (id, r) in results {
            match r {
                Ok(()) => ok.push(Value::String(id)),
                Err(e) => failed.push(json!({"worker_id": id, "error": e})),
            }
        }
        let message = if total == 0 {
            "No workers registered; nothing to flush".to_string()
        } else if failed.is_empty() {
            format!("Cache flushed on all {total} workers")
        } else {
            format!(
                "Cache flush: {} succeeded, {} failed",
                ok.len(),
                failed.len()
            )
        };
        let status = if failed.is_empty() {
            StatusCode::OK
        } else {
            StatusCode::BAD_GATEWAY
        };
        let body = json!({
            "successful": ok,
            "failed": failed,
            "total_workers": total,
            "message": message,
        });
        json_response(status, body.to_string(), rid)
    }

    /// A one-token `/generate` through a pair (see the module docs).
    async fn health_generate(
        &self,
        d: Arc<Dispatcher>,
        model: Option<&str>,
        req: Request<Incoming>,
        rid: HeaderValue,
        rec: RequestRecord,
    ) -> Response<RespBody> {
        let slot = match self.admission.admit().await {
            Ok(s) => s,
            Err(f) => return reject(rec, f, &rid),
        };
        let mut probe = json!({
            "text": "ping",
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "stream": false,
        });
        if let Some(m) = model {
            // `/generate`'s `model` picks the pairs (it is not forwarded).
            probe["model"] = Value::String(m.to_string());
        }
        let probe = Bytes::from(probe.to_string());
        let parsed = match request::parse(ApiRoute::Generate, probe) {
            Ok(p) => p,
            Err(f) => return reject(rec, f, &rid),
        };
        let forward =
            super::app::forward_headers(&d.up, req.headers(), &rid, rec.key_id.is_some(), false);
        let ctx = ReqCtx {
            id: RequestId::random(),
            request_id: rid.clone(),
            forward,
            slot: Some(slot),
            queue: Some(self.admission.clone()),
            trace: None,
        };
        let started = Instant::now();
        let resp = d.dispatch(parsed, ctx, rec).await;
        let status = resp.status();
        if !status.is_success() {
            // The request's own error: its status and JSON (no engine URL in it).
            return resp;
        }
        let within = d.cfg.timeouts.request();
        let whole = matches!(
            tokio::time::timeout(within, read_whole(resp.into_body())).await,
            Ok(true)
        );
        if !whole {
            let f = Failure::new(
                FailReason::DecodeBroken,
                "the one-token probe's answer did not arrive whole",
            );
            return f.into_response(Some(&rid));
        }
        let ms = started.elapsed().as_millis() as u64;
        json_response(
            StatusCode::OK,
            json!({"status": "ok", "probe": "generate", "max_new_tokens": 1, "latency_ms": ms})
                .to_string(),
            &rid,
        )
    }
}

/// The model an info or probe route answers for: the `model` query parameter, else
/// `models.default`; resolved as a request's `model` is (aliases, `base:adapter`; an
/// unknown name is a 404 `model_not_found`). `None`: any engine (no name given and no
/// default, or one handoff group serving every name).
fn model_scope(d: &Dispatcher, query: Option<&str>) -> Result<Option<Arc<str>>, Failure> {
    let given = crate::admin::query(query)?.remove("model");
    let Some(name) = given.or_else(|| d.cfg.models.default.clone()) else {
        return Ok(None);
    };
    crate::models::resolve(&d.cfg.models, &d.pool, || Some(name.into()))
}

/// Reads a (small) answer to its end: true when it ended without an error.
async fn read_whole(mut body: RespBody) -> bool {
    let mut seen = 0usize;
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(f) => {
                seen = seen.saturating_add(f.data_ref().map_or(0, Bytes::len));
                if seen > PROBE_ANSWER_MAX {
                    return false;
                }
            }
            Err(_) => return false,
        }
    }
    true
}

/// The most of the one-token probe's answer read.
const PROBE_ANSWER_MAX: usize = 1 << 20;

/// `POST /flush_cache` to one engine: its worker id and outcome (no URL in the outcome).
async fn flush_one(
    up: crate::upstream::Upstream,
    id: String,
    url: crate::upstream::BaseUrl,
    timeout: std::time::Duration,
) -> (String, Result<(), String>) {
    let r = match url.uri("/flush_cache") {
        Ok(uri) => up.call(Method::POST, uri, None, timeout).await,
        Err(e) => Err(CallError::Url(e)),
    };
    let outcome = match r {
        Ok((s, _)) if s.is_success() => Ok(()),
        Ok((s, _)) => Err(format!("engine answered {}", s.as_u16())),
        Err(e) => {
            tracing::warn!(worker_id = %id, worker_url = %url, error = %e, "flush_cache failed");
            Err(call_error(&e).to_string())
        }
    };
    (id, outcome)
}

/// Each worker's load, by worker id: the engine's last reported load per DP rank (from the
/// load poll; 0 before the first) and pdgate's requests in flight on it.
fn get_loads(d: &Dispatcher, rid: &HeaderValue) -> Response<RespBody> {
    let snap = d.pool.load();
    let one = |w: &WorkerView| {
        let dp = w.effective_dp();
        let ranks: Vec<Value> = (0..dp)
            .map(|r| json!({"dp_rank": r, "load": w.engine_load(r), "in_flight": w.in_flight(r)}))
            .collect();
        json!({
            "worker_id": worker_ref(w.shared.role, w.shared.id),
            "worker_type": w.shared.role.to_string(),
            "healthy": w.facts.healthy,
            "load": (0..dp).map(|r| w.engine_load(r)).sum::<u64>(),
            "in_flight": w.in_flight_total(),
            "dp_ranks": ranks,
        })
    };
    let loads: Vec<Value> = snap
        .prefills
        .iter()
        .chain(snap.decodes.iter())
        .chain(snap.regulars.iter())
        .map(one)
        .collect();
    let body = json!({"total_workers": loads.len(), "loads": loads});
    json_response(StatusCode::OK, body.to_string(), rid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn facts_leave_machines_out() {
        let v = json!({
            "model_path": "m",
            "served_model_name": "s",
            "host": "10.0.0.1",
            "port": 30000,
            "dist_init_addr": "10.0.0.1:5000",
            "api_key": "secret",
            "tp_size": 2,
            "internal_states": [{"dp_rank": 0, "nccl_port": 1234, "name": "x",
                                 "memory_usage": {"token_capacity": 10, "addr": 1}}],
        });
        let out = Value::Object(facts(&v, SERVER_FACTS));
        assert_eq!(
            out,
            json!({"model_path": "m", "served_model_name": "s", "tp_size": 2})
        );
        let st = v["internal_states"][0].clone();
        assert_eq!(
            numbers_only(&st),
            Some(json!({"dp_rank": 0, "memory_usage": {"token_capacity": 10}}))
        );
    }

    #[test]
    fn routes() {
        let table = [
            ("/get_server_info", Some(Call::ServerInfo)),
            ("/server_info", Some(Call::ServerInfo)),
            ("/get_model_info", Some(Call::ModelInfo)),
            ("/health_generate", Some(Call::HealthGenerate)),
            ("/flush_cache", Some(Call::FlushCache)),
            ("/get_loads", Some(Call::GetLoads)),
            ("/workers", Some(Call::Workers)),
            ("/workers/decode-0", Some(Call::Workers)),
            ("/add_worker", Some(Call::Workers)),
            ("/list_workers", Some(Call::Workers)),
            ("/remove_worker", Some(Call::Workers)),
            ("/config", None),
            ("/generate", None),
        ];
        for (p, want) in table {
            assert_eq!(route(p).map(|(c, _)| c), want, "{p}");
        }
    }
}
