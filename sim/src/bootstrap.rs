//! The prefill's KV bootstrap server: SGLang 0.5.23's `CommonKVBootstrapServer`
//! (aiohttp) re-implemented to answer exactly like the observed rows in
//! `shared/spec/sglang-0.5.23-bootstrap-observed.md`.
//!
//! Why: the router probes this server (sentinel, `/health`, `/query_dp_ranks`)
//! and the simulated decode uses it for real, so any difference in status,
//! body or content type would hide router bugs.
//!
//! Invariants (same as the real server):
//! - The layout is latched from the first accepted `PUT /route`; readiness is
//!   "accepted PUTs >= dp × cp × tp × pp" (it counts PUTs, not ranks).
//! - Table keys follow Python dict semantics (`1 == 1.0 == True`, `1 != "1"`).
//! - Bad input is aiohttp's bare 500 and changes nothing that the real handler
//!   had not changed before raising (the handler order is kept).
//! - `GET /route` converts its parameters lazily, left to right.
//! - Room → dp_rank entries are swept every `room_entry_ttl` and dropped when
//!   older than it (they live between 1x and 2x the interval).
//! - Only the simulator's own fault handling ever removes a table entry
//!   ([`BootstrapState::remove_rank`]), lowering the PUT count by one.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use hyper::body::Incoming;
use hyper::header::{HeaderValue, ALLOW};
use hyper::{Method, Request};
use serde_json::{json, Value};
use tokio::sync::watch;

use crate::http::{self, query_param, Cut, Resp};
use crate::pyjson::{self, int_str, int_value, PyKey, PyObj};

const GENERIC_500: &str = "500 Internal Server Error\n\nServer got itself in trouble";

#[derive(Debug, Clone)]
struct RankInfo {
    rank_ip: String,
    rank_port: i64,
}

type Table = HashMap<PyKey, HashMap<PyKey, HashMap<PyKey, HashMap<PyKey, RankInfo>>>>;

#[derive(Default)]
struct Inner {
    attn_tp_size: Option<Value>,
    attn_cp_size: Option<Value>,
    dp_size: Option<Value>,
    pp_size: Option<Value>,
    page_size: Option<i64>,
    kv_cache_dtype: Option<Value>,
    kv_layout: Option<Value>,
    dsv41_spec_layout: Value,
    follow_bootstrap_room: Option<bool>,
    enable_dsa_cache_layer_split: Option<bool>,
    enable_kv_cache_sharding: Option<bool>,
    prefill_http_port: Option<i64>,
    decode_allocation_policy: Value,
    table: Table,
    registered: i64,
    rooms: HashMap<i64, (i64, Instant)>,
}

/// Readiness as the real `_is_ready` computes it.
enum Ready {
    Yes,
    No,
}

impl Inner {
    fn new() -> Self {
        Inner {
            dsv41_spec_layout: Value::Null,
            decode_allocation_policy: Value::String("early".into()),
            ..Default::default()
        }
    }

    /// `Err` where Python's `_is_ready` would raise a TypeError.
    fn is_ready(&self) -> Result<Ready, ()> {
        let sizes = [
            &self.dp_size,
            &self.attn_cp_size,
            &self.attn_tp_size,
            &self.pp_size,
        ];
        let mut product = 1.0f64;
        for s in sizes {
            match s {
                None | Some(Value::Null) => return Ok(Ready::No),
                Some(Value::Number(n)) => product *= n.as_f64().ok_or(())?,
                Some(Value::Bool(b)) => product *= f64::from(u8::from(*b)),
                Some(_) => return Err(()),
            }
        }
        Ok(if (self.registered as f64) >= product {
            Ready::Yes
        } else {
            Ready::No
        })
    }

    fn not_ready_text(&self) -> String {
        format!(
            "Prefill server not fully registered yet ({} workers registered).",
            self.registered
        )
    }

    fn sentinel(&self) -> Option<String> {
        let size = |v: &Option<Value>| v.as_ref().and_then(int_value).map(Value::from);
        let mut obj: PyObj = vec![
            ("attn_tp_size".into(), size(&self.attn_tp_size)?),
            ("attn_cp_size".into(), size(&self.attn_cp_size)?),
            ("dp_size".into(), size(&self.dp_size)?),
            ("pp_size".into(), size(&self.pp_size)?),
            (
                "page_size".into(),
                self.page_size.map_or(Value::Null, Value::from),
            ),
            (
                "kv_cache_dtype".into(),
                match &self.kv_cache_dtype {
                    None | Some(Value::Null) => Value::Null,
                    Some(v) => Value::String(pyjson::str_value(v)),
                },
            ),
            (
                "follow_bootstrap_room".into(),
                Value::Bool(self.follow_bootstrap_room.unwrap_or(true)),
            ),
            (
                "enable_dsa_cache_layer_split".into(),
                Value::Bool(self.enable_dsa_cache_layer_split.unwrap_or(false)),
            ),
        ];
        if !self.dsv41_spec_layout.is_null() {
            obj.push(("dsv41_spec_layout".into(), self.dsv41_spec_layout.clone()));
        }
        if let Some(l) = self.kv_layout.as_ref().filter(|l| !l.is_null()) {
            obj.push(("kv_layout".into(), Value::String(pyjson::str_value(l))));
        }
        obj.push((
            "decode_allocation_policy".into(),
            self.decode_allocation_policy.clone(),
        ));
        obj.push((
            "enable_kv_cache_sharding".into(),
            Value::Bool(self.enable_kv_cache_sharding.unwrap_or(false)),
        ));
        obj.push((
            "prefill_http_port".into(),
            self.prefill_http_port.map_or(Value::Null, Value::from),
        ));
        for k in [
            "target_tp_rank",
            "target_tp_ranks",
            "target_cp_ranks",
            "target_pp_ranks",
            "required_dst_info_num",
            "required_prefill_response_num",
        ] {
            obj.push((k.into(), Value::Null));
        }
        Some(pyjson::dumps_obj(&obj))
    }
}

/// Shared state of one bootstrap server.
pub(crate) struct BootstrapState {
    inner: Mutex<Inner>,
    room_ttl: Duration,
}

impl BootstrapState {
    pub(crate) fn new(room_ttl: Duration) -> Arc<Self> {
        Arc::new(BootstrapState {
            inner: Mutex::new(Inner::new()),
            room_ttl,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `(dp=rank, cp=0, tp=0, pp=0)` is in the table.
    pub(crate) fn has_rank(&self, rank: u32) -> bool {
        let g = self.lock();
        lookup(&g.table, &[i64::from(rank), 0, 0, 0]).is_some()
    }

    /// Sim-only power: forgets `(dp=rank, cp=0, tp=0, pp=0)` and lowers the
    /// PUT count by one. Returns whether an entry was removed.
    pub(crate) fn remove_rank(&self, rank: u32) -> bool {
        let mut g = self.lock();
        let removed = g
            .table
            .get_mut(&PyKey::Int(i64::from(rank)))
            .and_then(|cp| cp.get_mut(&PyKey::Int(0)))
            .and_then(|tp| tp.get_mut(&PyKey::Int(0)))
            .and_then(|pp| pp.remove(&PyKey::Int(0)))
            .is_some();
        if removed {
            g.registered = (g.registered - 1).max(0);
        }
        removed
    }

    fn sweep_rooms(&self) {
        let ttl = self.room_ttl;
        let now = Instant::now();
        self.lock()
            .rooms
            .retain(|_, (_, at)| now.duration_since(*at) <= ttl);
    }
}

fn lookup(table: &Table, ranks: &[i64; 4]) -> Option<RankInfo> {
    table
        .get(&PyKey::Int(ranks[0]))?
        .get(&PyKey::Int(ranks[1]))?
        .get(&PyKey::Int(ranks[2]))?
        .get(&PyKey::Int(ranks[3]))
        .cloned()
}

/// Spawns the periodic sweep of expired room entries.
pub(crate) fn spawn_sweeper(state: Arc<BootstrapState>, mut shutdown: watch::Receiver<bool>) {
    tokio::spawn(async move {
        let period = state.room_ttl.max(Duration::from_millis(10));
        loop {
            tokio::select! {
                _ = tokio::time::sleep(period) => state.sweep_rooms(),
                _ = http::wait_shutdown(&mut shutdown) => break,
            }
        }
    });
}

fn generic_500() -> Resp {
    http::text(500, GENERIC_500)
}

fn aiohttp_405(allow: &'static str) -> Resp {
    let mut r = http::text(405, "405: Method Not Allowed");
    r.headers_mut()
        .insert(ALLOW, HeaderValue::from_static(allow));
    r
}

/// Handles one request to the bootstrap server.
pub(crate) async fn handle(
    state: Arc<BootstrapState>,
    req: Request<Incoming>,
) -> Result<Resp, Cut> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let query = req.uri().query().map(str::to_string);
    let resp = match path.as_str() {
        "/route" => match method {
            Method::PUT => {
                let body = http::read_body(req.into_body()).await?;
                route_put(&state, &body)
            }
            Method::GET => route_get(&state, query.as_deref()),
            _ => http::full(405, "application/json; charset=utf-8", "Method not allowed"),
        },
        "/register_dp_rank" => match method {
            Method::POST => {
                let body = http::read_body(req.into_body()).await?;
                register_dp_rank(&state, &body)
            }
            _ => aiohttp_405("POST"),
        },
        "/query_dp_ranks" => match method {
            Method::POST => {
                let body = http::read_body(req.into_body()).await?;
                query_dp_ranks(&state, &body)
            }
            _ => aiohttp_405("POST"),
        },
        "/health" => match method {
            Method::GET | Method::HEAD => http::text(200, "OK"),
            _ => aiohttp_405("GET,HEAD"),
        },
        _ => http::text(404, "404: Not Found"),
    };
    Ok(resp)
}

fn parse_obj(body: &[u8]) -> Option<serde_json::Map<String, Value>> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Some(m),
        _ => None,
    }
}

/// `_handle_route_put`, step by step in the real order.
fn route_put(state: &BootstrapState, body: &[u8]) -> Resp {
    let Some(data) = parse_obj(body) else {
        return generic_500();
    };
    const REQUIRED: [&str; 11] = [
        "attn_tp_size",
        "attn_tp_rank",
        "attn_cp_size",
        "attn_cp_rank",
        "attn_dp_size",
        "attn_dp_rank",
        "pp_size",
        "pp_rank",
        "system_dp_size",
        "system_dp_rank",
        "rank_ip",
    ];
    if REQUIRED.iter().any(|k| !data.contains_key(*k)) {
        return generic_500();
    }
    let get = |k: &str| data.get(k).cloned().unwrap_or(Value::Null);
    let Some(rank_port) = data.get("rank_port").and_then(int_value) else {
        return generic_500();
    };
    let Some(page_size) = data.get("page_size").and_then(int_value) else {
        return generic_500();
    };
    let Some(kv_cache_dtype) = data.get("kv_cache_dtype").cloned() else {
        return generic_500();
    };
    let kv_layout = get("kv_layout");
    let prefill_http_port = get("prefill_http_port");
    let dsv41 = get("dsv41_spec_layout");

    let mut guard = state.lock();
    let g = &mut *guard;
    if g.registered != 0 && g.dsv41_spec_layout != dsv41 {
        return http::text(
            400,
            "DeepSeek-V4.1 DSpark PD layout differs across prefill ranks",
        );
    }
    let policy = data
        .get("decode_allocation_policy")
        .cloned()
        .unwrap_or_else(|| Value::String("early".into()));
    if g.registered != 0 && g.decode_allocation_policy != policy {
        return http::text(400, "Inconsistent prefill allocation policies");
    }
    g.dsv41_spec_layout = dsv41;
    g.decode_allocation_policy = policy;
    let system_dp_size = get("system_dp_size");
    if g.attn_tp_size.is_none() {
        g.attn_tp_size = Some(get("attn_tp_size"));
    }
    if g.attn_cp_size.is_none() {
        g.attn_cp_size = Some(get("attn_cp_size"));
    }
    if g.dp_size.is_none() {
        g.dp_size = Some(if pyjson::eq_one(&system_dp_size) {
            get("attn_dp_size")
        } else {
            system_dp_size.clone()
        });
    }
    if g.pp_size.is_none() {
        g.pp_size = Some(get("pp_size"));
    }
    // Python keeps `None` sizes as "unset": later PUTs may fill them.
    for slot in [
        &mut g.attn_tp_size,
        &mut g.attn_cp_size,
        &mut g.dp_size,
        &mut g.pp_size,
    ] {
        if matches!(slot, Some(Value::Null)) {
            *slot = None;
        }
    }
    if g.page_size.is_none() {
        g.page_size = Some(page_size);
    }
    if g.kv_cache_dtype.is_none() && !kv_cache_dtype.is_null() {
        g.kv_cache_dtype = Some(kv_cache_dtype);
    }
    if g.kv_layout.is_none() && !kv_layout.is_null() {
        g.kv_layout = Some(kv_layout);
    }
    if g.prefill_http_port.is_none() && !prefill_http_port.is_null() {
        match int_value(&prefill_http_port) {
            Some(p) => g.prefill_http_port = Some(p),
            None => return generic_500(),
        }
    }
    if g.follow_bootstrap_room.is_none() {
        let lbm = data
            .get("load_balance_method")
            .cloned()
            .unwrap_or_else(|| Value::String("follow_bootstrap_room".into()));
        g.follow_bootstrap_room = Some(lbm == Value::String("follow_bootstrap_room".into()));
    }
    if g.enable_dsa_cache_layer_split.is_none() {
        g.enable_dsa_cache_layer_split = Some(truthy(data.get("enable_dsa_cache_layer_split")));
    }
    if g.enable_kv_cache_sharding.is_none() {
        g.enable_kv_cache_sharding = Some(truthy(data.get("enable_kv_cache_sharding")));
    }
    let dp_group = if pyjson::eq_one(&system_dp_size) {
        get("attn_dp_rank")
    } else {
        get("system_dp_rank")
    };
    let keys = [
        dp_group,
        get("attn_cp_rank"),
        get("attn_tp_rank"),
        get("pp_rank"),
    ];
    let Some(k) = keys
        .iter()
        .map(PyKey::from_value)
        .collect::<Option<Vec<_>>>()
    else {
        return generic_500();
    };
    let info = RankInfo {
        rank_ip: pyjson::str_value(&get("rank_ip")),
        rank_port,
    };
    let [k0, k1, k2, k3]: [PyKey; 4] = match k.try_into() {
        Ok(a) => a,
        Err(_) => return generic_500(),
    };
    g.table
        .entry(k0)
        .or_default()
        .entry(k1)
        .or_default()
        .entry(k2)
        .or_default()
        .insert(k3, info);
    g.registered += 1;
    http::text(200, "OK")
}

/// Python truthiness of an optional JSON value.
fn truthy(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(Value::Number(n)) => n.as_f64() != Some(0.0),
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
    }
}

/// `_handle_route_get`: lazy `int()` left to right, as Python evaluates it.
fn route_get(state: &BootstrapState, query: Option<&str>) -> Resp {
    let names = [
        "prefill_dp_rank",
        "prefill_cp_rank",
        "target_tp_rank",
        "target_pp_rank",
    ];
    let raw: Vec<String> = names
        .iter()
        .map(|n| query_param(query, n).unwrap_or_default())
        .collect();
    if raw.iter().any(String::is_empty) {
        return http::text(400, "Missing inputs for bootstrap server.");
    }
    let g = state.lock();
    // `int(dp) == -1 and int(cp) == -1 and ...` short-circuits.
    let mut sentinel = true;
    for r in &raw {
        match int_str(r) {
            None => return generic_500(),
            Some(-1) => {}
            Some(_) => {
                sentinel = false;
                break;
            }
        }
    }
    let ready = match g.is_ready() {
        Ok(r) => r,
        Err(()) => return generic_500(),
    };
    if matches!(ready, Ready::No) {
        return http::text(503, g.not_ready_text());
    }
    if sentinel {
        return match g.sentinel() {
            Some(body) => http::json_str(200, body).with_charset(),
            None => generic_500(),
        };
    }
    // `table[int(dp)][int(cp)][int(tp)][int(pp)]`, KeyError -> 404.
    let not_found = || {
        http::text(
            404,
            format!(
                "Bootstrap info not found for dp_rank={} cp_rank={} tp_rank={} pp_rank={}",
                raw[0], raw[1], raw[2], raw[3]
            ),
        )
    };
    let Some(dp) = int_str(&raw[0]) else {
        return generic_500();
    };
    let Some(cp_table) = g.table.get(&PyKey::Int(dp)) else {
        return not_found();
    };
    let Some(cp) = int_str(&raw[1]) else {
        return generic_500();
    };
    let Some(tp_table) = cp_table.get(&PyKey::Int(cp)) else {
        return not_found();
    };
    let Some(tp) = int_str(&raw[2]) else {
        return generic_500();
    };
    let Some(pp_table) = tp_table.get(&PyKey::Int(tp)) else {
        return not_found();
    };
    let Some(pp) = int_str(&raw[3]) else {
        return generic_500();
    };
    let Some(info) = pp_table.get(&PyKey::Int(pp)) else {
        return not_found();
    };
    let body = pyjson::dumps_obj(&vec![
        ("rank_ip".into(), Value::String(info.rank_ip.clone())),
        ("rank_port".into(), Value::from(info.rank_port)),
    ]);
    http::json_str(200, body).with_charset()
}

fn register_dp_rank(state: &BootstrapState, body: &[u8]) -> Resp {
    let Some(data) = parse_obj(body) else {
        return generic_500();
    };
    let Some(room) = data.get("bootstrap_room").and_then(int_value) else {
        return generic_500();
    };
    let Some(dp_rank) = data.get("dp_rank").and_then(int_value) else {
        return generic_500();
    };
    state.lock().rooms.insert(room, (dp_rank, Instant::now()));
    http::text(200, "OK")
}

fn query_dp_ranks(state: &BootstrapState, body: &[u8]) -> Resp {
    let Some(data) = parse_obj(body) else {
        return generic_500();
    };
    // Python iterates whatever it got: list items, string characters, dict keys.
    let items: Vec<Value> = match data.get("bootstrap_rooms") {
        Some(Value::Array(a)) => a.clone(),
        Some(Value::String(s)) => s.chars().map(|c| Value::String(c.to_string())).collect(),
        Some(Value::Object(o)) => o.keys().map(|k| Value::String(k.clone())).collect(),
        _ => return generic_500(),
    };
    let mut rooms = Vec::with_capacity(items.len());
    for it in &items {
        match int_value(it) {
            Some(r) => rooms.push(r),
            _ => return generic_500(),
        }
    }
    let g = state.lock();
    let mut out: PyObj = Vec::new();
    for room in rooms {
        if let Some((rank, _)) = g.rooms.get(&room) {
            let key = room.to_string();
            if let Some(slot) = out.iter_mut().find(|(k, _)| *k == key) {
                slot.1 = json!(rank);
            } else {
                out.push((key, json!(rank)));
            }
        }
    }
    http::json_str(200, pyjson::dumps_obj(&out)).with_charset()
}

/// aiohttp's `json_response` says `application/json; charset=utf-8`.
trait WithCharset {
    fn with_charset(self) -> Self;
}

impl WithCharset for Resp {
    fn with_charset(mut self) -> Self {
        self.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json; charset=utf-8"),
        );
        self
    }
}
