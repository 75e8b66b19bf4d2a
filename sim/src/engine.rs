//! One simulated engine: its listeners, HTTP routing and the public [`SimEngine`]
//! handle (the shared state is [`crate::state::Engine`]).
//!
//! Why: the router talks to the simulator exactly as to SGLang, over real TCP;
//! tests and `pdgate sim` control it through [`SimEngine`] (or `/sim/*`).
//!
//! Invariants:
//! - Every listener (engine port, bootstrap server, one per prefill DP rank) is
//!   bound in [`spawn`] and kept until shutdown; "down" never re-binds.
//! - The current [`Faults`] live in one `watch` channel; `Stats::engine_down`
//!   mirrors `faults.down` (see [`crate::state`]).
//! - A prefill's own ranks are registered with real `PUT /route` requests; a
//!   reconciler task keeps the bootstrap table in line with
//!   `unregistered_ranks` / `register_none` whenever the faults change.
//! - Dropping a [`SimEngine`] shuts everything down (listeners closed,
//!   connections cut, background tasks ended).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper::body::Incoming;
use hyper::{Method, Request};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::bootstrap::{self, BootstrapState};
use crate::config::{EngineConfig, Faults, Role};
use crate::contract::{ContractBook, SeenRooms};
use crate::decode_cache::DecodeState;
use crate::hits::{Hits, HitsSnapshot, Server};
use crate::http::{self, Cut, Gate, Resp};
use crate::info;
use crate::prefix_cache::PrefixCache;
use crate::rendezvous::{self, Rendezvous};
use crate::request::Api;
use crate::state::{Engine, Inflight, PrefillSide, RidLog};
use crate::stats::{Stats, StatsSnapshot};

/// A running simulated engine. Dropping it shuts the engine down.
pub struct SimEngine {
    engine: Arc<Engine>,
}

impl std::fmt::Debug for SimEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimEngine")
            .field("role", &self.engine.cfg.role)
            .field("addr", &self.engine.addr)
            .field("bootstrap_port", &self.engine.bootstrap_port)
            .finish()
    }
}

impl SimEngine {
    /// `http://IP:PORT` of the engine's HTTP server.
    pub fn url(&self) -> String {
        format!(
            "http://{}",
            http::host_port(&self.engine.public_ip(), self.engine.addr.port())
        )
    }

    /// Bound address of the engine's HTTP server.
    pub fn addr(&self) -> SocketAddr {
        self.engine.addr
    }

    pub fn role(&self) -> Role {
        self.engine.cfg.role
    }

    /// The configuration the engine runs with (ports as configured, not bound).
    pub fn config(&self) -> &EngineConfig {
        &self.engine.cfg
    }

    /// Bootstrap server port (prefill only).
    pub fn bootstrap_port(&self) -> Option<u16> {
        self.engine.bootstrap_port
    }

    /// `http://IP:BOOTSTRAP_PORT` (prefill only).
    pub fn bootstrap_url(&self) -> Option<String> {
        let port = self.engine.bootstrap_port?;
        Some(format!(
            "http://{}",
            http::host_port(&self.engine.public_ip(), port)
        ))
    }

    /// Ports of the prefill's per-DP-rank KV endpoints (empty for decode).
    pub fn rank_ports(&self) -> Vec<u16> {
        self.engine
            .prefill
            .as_ref()
            .map(|p| p.rank_ports.clone())
            .unwrap_or_default()
    }

    /// Same JSON as `GET /sim/stats`.
    pub fn stats(&self) -> StatsSnapshot {
        self.engine.stats.snapshot()
    }

    /// The requests each of the engine's servers received so far, by method and path.
    pub fn hits(&self) -> HitsSnapshot {
        self.engine.hits.snapshot()
    }

    /// The headers of the last generate request this engine received (lower-case names,
    /// in order), empty before the first.
    pub fn last_generate_headers(&self) -> Vec<(String, String)> {
        self.engine
            .last_headers
            .lock()
            .map(|h| h.clone())
            .unwrap_or_default()
    }

    /// The rids of the last [`RECENT_RIDS`](crate::RECENT_RIDS) request instances this engine started, in
    /// arrival order, whatever their outcome.
    pub fn recent_rids(&self) -> Vec<String> {
        self.engine.started_rids.list()
    }

    /// The last [`RECENT_RIDS`](crate::RECENT_RIDS) generate requests this engine received,
    /// oldest first: (path, body as received). Tests check what a router sent.
    pub fn recent_generate_bodies(&self) -> Vec<(String, serde_json::Value)> {
        self.engine
            .bodies
            .lock()
            .map(|b| b.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// The rids named by the last [`RECENT_RIDS`](crate::RECENT_RIDS) `POST /abort_request` calls, in arrival
    /// order, matched or not (`abort_requests_received` counts them all).
    pub fn recent_abort_rids(&self) -> Vec<String> {
        self.engine.abort_rids.list()
    }

    /// Current faults.
    pub fn faults(&self) -> Faults {
        self.engine.faults()
    }

    /// Replaces the faults at run time.
    pub fn set_faults(&self, f: Faults) {
        self.engine.set_faults(f);
    }

    /// Takes the whole engine down (accept-and-drop, in-flight cut) or up.
    pub fn set_down(&self, down: bool) {
        self.engine.set_down(down);
    }

    /// Stops every server and task of the engine.
    pub fn shutdown(self) {
        drop(self);
    }
}

impl Drop for SimEngine {
    fn drop(&mut self) {
        self.engine.shutdown_tx.send_replace(true);
    }
}

/// Starts one engine with its own contract book.
pub async fn spawn(cfg: EngineConfig) -> std::io::Result<SimEngine> {
    spawn_in(cfg, ContractBook::new()).await
}

/// Starts one engine that shares `book` with other engines (a cluster).
pub(crate) async fn spawn_in(
    cfg: EngineConfig,
    book: Arc<ContractBook>,
) -> std::io::Result<SimEngine> {
    let dp = cfg.dp();
    let (faults_tx, _) = watch::channel(cfg.faults.clone());
    let (shutdown_tx, _) = watch::channel(false);
    let stats = Stats::new(dp, cfg.role);
    stats.engine_down.store(cfg.faults.down, Ordering::Relaxed);
    let listener = TcpListener::bind((cfg.host.as_str(), cfg.port)).await?;
    let addr = listener.local_addr()?;

    let mut prefill_listeners = None;
    let prefill = if cfg.role == Role::Prefill {
        let b = TcpListener::bind((cfg.host.as_str(), cfg.bootstrap_port)).await?;
        let mut ranks = Vec::with_capacity(dp as usize);
        for _ in 0..dp {
            ranks.push(TcpListener::bind((cfg.host.as_str(), 0)).await?);
        }
        let rank_ports = ranks
            .iter()
            .map(|l| l.local_addr().map(|a| a.port()))
            .collect::<std::io::Result<Vec<_>>>()?;
        let side = PrefillSide {
            bootstrap: BootstrapState::new(cfg.room_entry_ttl),
            rendezvous: Rendezvous::new(Arc::clone(&stats), book, cfg.kv_identity()),
            seen: Mutex::new(SeenRooms::default()),
            rank_ports,
        };
        prefill_listeners = Some((b, ranks));
        Some(side)
    } else {
        None
    };
    let bootstrap_port = match &prefill_listeners {
        Some((b, _)) => Some(b.local_addr()?.port()),
        None => None,
    };
    let running_slots = match (cfg.role, cfg.max_running_requests) {
        (Role::Decode, Some(n)) => (0..dp)
            .map(|_| Arc::new(tokio::sync::Semaphore::new(n as usize)))
            .collect(),
        _ => Vec::new(),
    };
    let cache_tokens = cfg.prefix_cache_tokens();
    let prefix_caches: Vec<_> = if cache_tokens > 0 {
        (0..dp)
            .map(|_| {
                std::sync::Mutex::new(PrefixCache::new(cache_tokens, cfg.prefix_cache_page_size))
            })
            .collect()
    } else {
        Vec::new()
    };
    let compute_locks = if cfg.role == Role::Prefill {
        prefix_caches
            .iter()
            .map(|_| tokio::sync::Mutex::new(()))
            .collect()
    } else {
        Vec::new()
    };
    let engine = Arc::new(Engine {
        running_slots,
        prefix_caches,
        compute_locks,
        cfg,
        faults_tx,
        shutdown_tx,
        stats,
        addr,
        bootstrap_port,
        inflight: Arc::new(Inflight::default()),
        rr: AtomicU64::new(0),
        prefill,
        decode: DecodeState::default(),
        last_headers: std::sync::Mutex::new(Vec::new()),
        started_rids: RidLog::default(),
        busy_until: std::sync::Mutex::new(None),
        bodies: std::sync::Mutex::new(std::collections::VecDeque::new()),
        abort_rids: RidLog::default(),
        hits: Hits::default(),
    });
    let gate = |down_if: fn(&Faults) -> bool| Gate {
        faults: engine.faults_tx.subscribe(),
        shutdown: engine.shutdown_tx.subscribe(),
        down_if,
    };
    let e = Arc::clone(&engine);
    http::serve(listener, gate(|f| f.down), move |req| {
        e.hits
            .record(Server::Engine, req.method(), req.uri().path());
        handle(Arc::clone(&e), req)
    });

    if let (Some((b, ranks)), Some(side)) = (prefill_listeners, &engine.prefill) {
        let state = Arc::clone(&side.bootstrap);
        let e = Arc::clone(&engine);
        http::serve(b, gate(|f| f.down || f.bootstrap_down), move |req| {
            e.hits
                .record(Server::Bootstrap, req.method(), req.uri().path());
            let delay = match (req.method(), req.uri().path()) {
                (&Method::GET, "/route") => e.faults_tx.borrow().bootstrap_route_delay_ms,
                _ => 0,
            };
            let state = Arc::clone(&state);
            async move {
                if delay > 0 {
                    tokio::time::sleep(Duration::from_millis(delay)).await;
                }
                bootstrap::handle(state, req).await
            }
        });
        bootstrap::spawn_sweeper(Arc::clone(&side.bootstrap), engine.shutdown_tx.subscribe());
        for (rank, l) in ranks.into_iter().enumerate() {
            let rv = Arc::clone(&side.rendezvous);
            let rank = rank as u32;
            http::serve(l, gate(|f| f.down), move |req| {
                rendezvous::handle_rank(Arc::clone(&rv), rank, req)
            });
        }
        reconcile(&engine).await;
        tokio::spawn(reconcile_loop(Arc::clone(&engine)));
    }
    tracing::info!(role = %engine.cfg.role, addr = %engine.addr, bootstrap_port = ?engine.bootstrap_port, "sim engine up");
    Ok(SimEngine { engine })
}

/// Brings the bootstrap table in line with the registration faults once.
/// Returns false if some `PUT /route` failed.
async fn reconcile(engine: &Arc<Engine>) -> bool {
    let Some(side) = &engine.prefill else {
        return true;
    };
    let faults = engine.faults();
    let mut ok = true;
    for rank in 0..engine.cfg.dp() {
        let want = faults.rank_registered(rank);
        let has = side.bootstrap.has_rank(rank);
        if want && !has {
            ok &= put_route(engine, side, rank).await;
        } else if !want && has {
            side.bootstrap.remove_rank(rank);
        }
    }
    ok
}

async fn put_route(engine: &Engine, side: &PrefillSide, rank: u32) -> bool {
    let Some(bport) = engine.bootstrap_port else {
        return false;
    };
    let body = json!({
        "attn_tp_size": 1, "attn_tp_rank": 0,
        "attn_cp_size": 1, "attn_cp_rank": 0,
        "attn_dp_size": engine.cfg.dp(), "attn_dp_rank": rank,
        "pp_size": 1, "pp_rank": 0,
        "system_dp_size": 1, "system_dp_rank": 0,
        "rank_ip": engine.public_ip(),
        "rank_port": side.rank_ports.get(rank as usize).copied().unwrap_or(0),
        "page_size": engine.cfg.page_size,
        "kv_cache_dtype": engine.cfg.kv_cache_dtype,
        "load_balance_method": engine.cfg.load_balance_method,
        "enable_dsa_cache_layer_split": false,
        "prefill_http_port": engine.addr.port(),
        "decode_allocation_policy": "early",
    });
    let addr = http::host_port(&engine.public_ip(), bport);
    match http::call(
        &addr,
        "PUT",
        "/route",
        Some(body.to_string().into_bytes()),
        Duration::from_secs(5),
    )
    .await
    {
        Ok(r) if r.status == 200 => true,
        Ok(r) => {
            tracing::warn!(rank, status = r.status, "sim: PUT /route refused");
            false
        }
        Err(e) => {
            tracing::debug!(rank, error = %e, "sim: PUT /route failed");
            false
        }
    }
}

async fn reconcile_loop(engine: Arc<Engine>) {
    let mut faults = engine.faults_tx.subscribe();
    let mut shutdown = engine.shutdown_tx.subscribe();
    let mut retries = 0u32;
    loop {
        let ok = reconcile(&engine).await;
        if ok {
            retries = 0;
        }
        // Like SGLang: a few retries with backoff, then wait for a change.
        let retry = !ok && retries < 5;
        if retry {
            retries += 1;
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(50u64 << retries)), if retry => {}
            r = faults.changed() => {
                if r.is_err() {
                    break;
                }
                retries = 0;
            }
            _ = http::wait_shutdown(&mut shutdown) => break,
        }
    }
}

fn not_found() -> Resp {
    http::json(404, &json!({"detail": "Not Found"}))
}

fn method_not_allowed() -> Resp {
    http::json(405, &json!({"detail": "Method Not Allowed"}))
}

/// Routes one request on the engine's HTTP port.
async fn handle(engine: Arc<Engine>, req: Request<Incoming>) -> Result<Resp, Cut> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    let get = method == Method::GET || method == Method::HEAD;
    if let Some(api) = Api::from_path(&path) {
        let allowed = method == Method::POST || (api == Api::Generate && method == Method::PUT);
        if !allowed {
            return Ok(method_not_allowed());
        }
        return crate::run::handle_generate(engine, api, req).await;
    }
    let resp = match path.as_str() {
        "/health" | "/health_generate" if get => http::empty(200),
        "/server_info" | "/get_server_info" if get => http::json(200, &info::server_info(&engine)),
        "/model_info" | "/get_model_info" if get => http::json(200, &info::model_info(&engine)),
        "/v1/models" if get => http::json(200, &info::models(&engine)),
        "/v1/loads" if get => http::json(200, &info::loads(&engine, req.uri().query())),
        "/get_load" if get => http::json(200, &info::get_load(&engine)),
        "/flush_cache" if get || method == Method::POST => {
            http::text(200, "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n")
        }
        "/abort_request" if method == Method::POST => {
            engine
                .stats
                .abort_requests_received
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let body = http::read_body(req.into_body()).await?;
            let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let rid = v.get("rid").and_then(Value::as_str).unwrap_or("");
            let all = v.get("abort_all").and_then(Value::as_bool).unwrap_or(false);
            engine.abort_rids.push(rid);
            let n = engine.inflight.abort(rid, all);
            tracing::debug!(rid, all, aborted = n, "sim: abort_request");
            http::empty(200)
        }
        "/sim/stats" if get => http::json(200, &json!(engine.stats.snapshot())),
        "/sim/faults" if get => http::json(200, &json!(engine.faults())),
        "/sim/faults" if method == Method::POST => {
            let body = http::read_body(req.into_body()).await?;
            match merge_faults(&engine.faults(), &body) {
                Ok(f) => {
                    engine.set_faults(f.clone());
                    http::json(200, &json!(f))
                }
                Err(msg) => http::json(400, &json!({"error": msg})),
            }
        }
        p if p.starts_with("/v1/models/") && get => {
            let name = &p["/v1/models/".len()..];
            if name == engine.cfg.model {
                http::json(200, &info::model_card(&engine))
            } else {
                http::json(404, &json!({"object": "error", "message": format!("The model `{name}` does not exist."), "type": "NotFoundError", "param": null, "code": 404}))
            }
        }
        "/health" | "/health_generate" | "/server_info" | "/get_server_info" | "/model_info"
        | "/get_model_info" | "/v1/models" | "/v1/loads" | "/get_load" | "/flush_cache"
        | "/abort_request" | "/sim/stats" | "/sim/faults" => method_not_allowed(),
        _ => not_found(),
    };
    Ok(resp)
}

/// Overlays the JSON object in `body` on `current` (absent keys keep their value).
fn merge_faults(current: &Faults, body: &[u8]) -> Result<Faults, String> {
    let patch: Value = serde_json::from_slice(body).map_err(|e| format!("invalid JSON: {e}"))?;
    let Value::Object(patch) = patch else {
        return Err("expected a JSON object".to_string());
    };
    let mut base = serde_json::to_value(current).map_err(|e| e.to_string())?;
    if let Value::Object(m) = &mut base {
        for (k, v) in patch {
            if !m.contains_key(&k) {
                return Err(format!("unknown fault {k:?}"));
            }
            m.insert(k, v);
        }
    }
    serde_json::from_value(base).map_err(|e| format!("invalid faults: {e}"))
}
