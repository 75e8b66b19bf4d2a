//! What a decode engine does with one request instance before its first
//! token: SGLang's decode bootstrap pipeline, over real HTTP and TCP.
//!
//! Steps (spec §3.2): fetch the prefill's parallel info from
//! `bootstrap_host:bootstrap_port` (sentinel `GET /route`, cached per address,
//! up to `sentinel_attempts` tries `sentinel_interval` apart, shared by every
//! request waiting on that address); resolve the prefill DP rank
//! (`disagg_prefill_dp_rank`, dp 1 → 0, `room % dp` when the prefill follows
//! rooms, else poll `/query_dp_ranks`); fetch that rank's `GET /route`
//! (cached; any non-200 fails at once, or — `legacy_bootstrap_bug` — hangs
//! until `waiting_timeout`); long-poll the rank endpoint until the KV arrives
//! (`waiting_timeout`). From the cached info on, a heartbeat probes the
//! bootstrap `/health` every `heartbeat_interval`; `heartbeat_max_failures` in
//! a row fail the request and drop the address from the caches. The
//! `decode_hold` fault parks a request before the first step until cleared.
//! With `max_running_requests`, a request waits for a running slot on its DP
//! rank before its KV pull starts (SGLang's decode queue), so a prefill's
//! `bootstrap_timeout` can expire meanwhile. Once the KV arrived, the request waits
//! `decode_per_missing_token` for each prompt token its rank's prefix cache lacks (all of
//! them without a cache), then the rank's cache takes the prompt; the answer reports the
//! prefill's cached tokens, which came with the KV, as SGLang's decode does.
//!
//! Invariants: failure texts are SGLang's; nothing here retries what SGLang
//! does not retry, except reconnecting a cut rank connection while the
//! heartbeat and the waiting timeout still allow it.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::watch;

use crate::decode_cache::{FetchResult, PrefillInfo};
use crate::http::{self, ClientError};
use crate::plan::Plan;
use crate::prefill::{check_context, missing_room, routed_rank, status_fault};
use crate::request::{Instance, ParsedRequest};
use crate::shapes::Failure;
use crate::state::Engine;
use crate::stats::Tracker;

const HTTP_TIMEOUT: Duration = Duration::from_secs(5);

fn handshake_failure(inst: &Instance, room: u64, reason: &str) -> Failure {
    Failure::abort(
        500,
        format!(
            "Decode handshake failed for request rank=0 decode_req.req.rid='{}' decode_req.req.bootstrap_room={room} with exception KVTransferError(bootstrap_room={room}): {reason}",
            inst.rid
        ),
    )
}

fn transfer_failure(inst: &Instance, room: u64, reason: &str) -> Failure {
    Failure::abort(
        500,
        format!(
            "Decode transfer failed for request rank=0 decode_req.req.rid='{}' decode_req.req.bootstrap_room={room} with exception KVTransferError(bootstrap_room={room}): {reason}",
            inst.rid
        ),
    )
}

fn waiting_timeout(inst: &Instance, room: u64, elapsed: Duration) -> Failure {
    let reason = format!(
        "Request {room} timed out after {:.1}s in KVPoll.WaitingForInput",
        elapsed.as_secs_f64()
    );
    transfer_failure(inst, room, &reason)
}

/// Runs the decode side of one instance; `Ok` once the KV arrived.
pub(crate) async fn prepare(
    engine: &Arc<Engine>,
    req: &ParsedRequest,
    inst: &Instance,
    tracker: &Tracker,
) -> Result<Plan, Failure> {
    let faults = engine.faults();
    if let Some(status) = faults.decode_status {
        return Err(status_fault(status, inst, engine.cfg.context_length));
    }
    check_context(engine, inst)?;
    let own = routed_rank(req.routed_dp_rank, engine.cfg.dp())?;
    let Some(room) = inst.room else {
        return Err(missing_room(&inst.rid));
    };
    let my_rank = own.unwrap_or_else(|| engine.next_rr());
    tracker.set_rank(my_rank);
    tracker.waiting();
    // SGLang's pre-allocation queue: from arrival (the handshake happens there) until the
    // request holds a running slot (`running_slot`).
    tracker.prealloc();
    tracker.add_tokens(u64::from(inst.prompt_tokens));
    if faults.decode_hold {
        let mut rx = engine.faults_tx.subscribe();
        http::wait_faults(&mut rx, |f| !f.decode_hold).await;
    }

    let host = inst.host.clone().unwrap_or_else(|| "None".to_string());
    let addr = match inst.port {
        Some(p) => http::host_port(&host, p),
        None => format!("{host}:None"),
    };
    let info = parallel_info(engine, &addr)
        .await
        .map_err(|msg| Failure::abort(500, msg))?;
    if info
        .page_size
        .is_some_and(|p| p != i64::from(engine.cfg.page_size))
        || info
            .kv_cache_dtype
            .as_deref()
            .is_some_and(|d| d != engine.cfg.kv_cache_dtype)
    {
        return Err(handshake_failure(
            inst,
            room,
            &format!(
                "prefill page_size/kv_cache_dtype {:?}/{:?} differ from decode {}/{}",
                info.page_size,
                info.kv_cache_dtype,
                engine.cfg.page_size,
                engine.cfg.kv_cache_dtype
            ),
        ));
    }
    let pipeline = async {
        let rank = resolve_rank(req, &addr, room, &info).await;
        let rank_addr = rank_endpoint(engine, inst, &addr, room, rank).await?;
        running_slot(engine, my_rank, tracker).await;
        pull_kv(engine, inst, &rank_addr, room).await
    };
    let cached_tokens = tokio::select! {
        r = pipeline => r?,
        lost = heartbeat(engine, &addr) => return Err(handshake_failure(inst, room, &lost)),
    };
    receive_missing_kv(engine, inst, my_rank).await;
    let faults = engine.faults();
    if faults.decode_hang {
        tracing::info!(addr = %engine.addr, room, "sim: decode hangs before its first token");
        std::future::pending::<()>().await;
    }
    let extra = faults.decode_extra_ttft_ms;
    Ok(Plan {
        tokens: inst.max_tokens,
        ttft: faults.slowed(engine.cfg.ttft.saturating_add(Duration::from_millis(extra))),
        itl: faults.slowed(engine.cfg.itl),
        die_after: faults.decode_die_mid_stream_after,
        cached_tokens: cached_tokens.min(inst.prompt_tokens),
    })
}

/// Waits for the prompt's KV that `rank` does not hold (`decode_per_missing_token` per
/// token its prefix cache lacks), then stores the prompt in the rank's cache.
async fn receive_missing_kv(engine: &Engine, inst: &Instance, rank: u32) {
    let held = engine
        .prefix_cache(rank)
        .map_or(0, |mut c| c.match_prefix(&inst.prefix_ids))
        .min(inst.prompt_tokens);
    engine.stats.prefix_lookup(rank, inst.prompt_tokens, held);
    let wait = engine
        .cfg
        .decode_per_missing_token
        .saturating_mul(inst.prompt_tokens - held);
    if !wait.is_zero() {
        tokio::time::sleep(wait).await;
    }
    if let Some(mut c) = engine.prefix_cache(rank) {
        c.insert(&inst.prefix_ids);
    }
}

/// Waits for a running slot on `rank` (SGLang's decode keeps a request in its queue, KV
/// transfer not started, until the rank has room under `max_running_requests`); the
/// tracker holds it until the instance ends.
async fn running_slot(engine: &Arc<Engine>, rank: u32, tracker: &Tracker) {
    let permit = match engine.running_slots.get(rank as usize) {
        Some(sem) => Arc::clone(sem).acquire_owned().await.ok(),
        None => None,
    };
    tracker.hold_slot(permit);
}

/// The cached sentinel answer for `addr`, fetching it (shared) if needed.
async fn parallel_info(engine: &Arc<Engine>, addr: &str) -> Result<Arc<PrefillInfo>, String> {
    let mut rx = {
        let mut g = engine.decode.lock();
        if let Some(info) = g.info.get(addr) {
            return Ok(Arc::clone(info));
        }
        match g.fetching.get(addr) {
            Some(rx) => rx.clone(),
            None => {
                let (tx, rx) = watch::channel(None);
                g.fetching.insert(addr.to_string(), rx.clone());
                tokio::spawn(fetch_info(Arc::clone(engine), addr.to_string(), tx));
                rx
            }
        }
    };
    let res = rx
        .wait_for(Option::is_some)
        .await
        .map(|r| r.clone())
        .map_err(|_| format!("Could not fetch prefill parallel info from {addr}"))?;
    res.unwrap_or_else(|| Err(format!("Could not fetch prefill parallel info from {addr}")))
}

async fn fetch_info(engine: Arc<Engine>, addr: String, tx: watch::Sender<FetchResult>) {
    let attempts = engine.cfg.sentinel_attempts.max(1);
    let mut shutdown = engine.shutdown_tx.subscribe();
    let mut result = Err(format!(
        "Could not fetch prefill parallel info from {addr} after {attempts} attempts"
    ));
    for attempt in 1..=attempts {
        let path =
            "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1";
        let got = tokio::select! {
            r = http::call(&addr, "GET", path, None, HTTP_TIMEOUT) => r,
            _ = http::wait_shutdown(&mut shutdown) => break,
        };
        if let Some(info) = got
            .ok()
            .filter(|r| r.status == 200)
            .and_then(|r| parse_info(&r.body))
        {
            result = Ok(Arc::new(info));
            break;
        }
        if attempt < attempts {
            tokio::select! {
                _ = tokio::time::sleep(engine.cfg.sentinel_interval) => {}
                _ = http::wait_shutdown(&mut shutdown) => break,
            }
        }
    }
    {
        let mut g = engine.decode.lock();
        g.fetching.remove(&addr);
        if let Ok(info) = &result {
            g.info.insert(addr.clone(), Arc::clone(info));
        }
    }
    if let Err(e) = &result {
        tracing::warn!(addr, "sim decode: {e}");
    }
    tx.send_replace(Some(result));
}

fn parse_info(body: &[u8]) -> Option<PrefillInfo> {
    let v: Value = serde_json::from_slice(body).ok()?;
    Some(PrefillInfo {
        dp_size: u32::try_from(v.get("dp_size")?.as_u64()?).ok()?.max(1),
        follow_bootstrap_room: v
            .get("follow_bootstrap_room")
            .and_then(Value::as_bool)
            .unwrap_or(true),
        page_size: v.get("page_size").and_then(Value::as_i64),
        kv_cache_dtype: v
            .get("kv_cache_dtype")
            .and_then(Value::as_str)
            .map(str::to_string),
    })
}

/// SGLang decode's `_resolve_prefill_dp_rank` (+ the pending query loop).
async fn resolve_rank(req: &ParsedRequest, addr: &str, room: u64, info: &PrefillInfo) -> u32 {
    if let Some(r) = req.disagg_prefill_dp_rank {
        return u32::try_from(r).unwrap_or(u32::MAX);
    }
    if info.dp_size == 1 {
        return 0;
    }
    if info.follow_bootstrap_room {
        return (room % u64::from(info.dp_size)) as u32;
    }
    // No timeout, as in SGLang: the heartbeat or the client ends the wait.
    let body = json!({"bootstrap_rooms": [room]}).to_string();
    let mut pause = Duration::from_millis(10);
    loop {
        if let Ok(r) = http::call(
            addr,
            "POST",
            "/query_dp_ranks",
            Some(body.clone().into_bytes()),
            HTTP_TIMEOUT,
        )
        .await
        {
            let v: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
            if let Some(rank) = v.get(room.to_string()).and_then(Value::as_u64) {
                return u32::try_from(rank).unwrap_or(u32::MAX);
            }
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(200));
    }
}

/// `GET /route` for (rank, cp 0, tp 0, pp 0), cached per address and rank.
async fn rank_endpoint(
    engine: &Arc<Engine>,
    inst: &Instance,
    addr: &str,
    room: u64,
    rank: u32,
) -> Result<String, Failure> {
    let key = (addr.to_string(), rank);
    if let Some(a) = engine.decode.lock().routes.get(&key) {
        return Ok(a.clone());
    }
    let started = tokio::time::Instant::now();
    let path = format!(
        "/route?prefill_dp_rank={rank}&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
    );
    let got = http::call(addr, "GET", &path, None, HTTP_TIMEOUT).await;
    let found = got.ok().filter(|r| r.status == 200).and_then(|r| {
        let v: Value = serde_json::from_slice(&r.body).ok()?;
        let ip = v.get("rank_ip")?.as_str()?.to_string();
        let port = u16::try_from(v.get("rank_port")?.as_u64()?).ok()?;
        Some(http::host_port(&ip, port))
    });
    match found {
        Some(a) => {
            engine.decode.lock().routes.insert(key, a.clone());
            Ok(a)
        }
        None if engine.cfg.legacy_bootstrap_bug => {
            // Pre-#24772 engines: the failure is overwritten and the request
            // sits in WaitingForInput until the waiting timeout.
            tokio::time::sleep_until(http::deadline(started, engine.cfg.waiting_timeout)).await;
            Err(waiting_timeout(inst, room, started.elapsed()))
        }
        None => Err(handshake_failure(
            inst,
            room,
            &format!(
                "Could not fetch bootstrap info for: prefill_dp_rank: {rank} prefill_cp_rank: 0 target_tp_rank: 0 and target_pp_rank 0"
            ),
        )),
    }
}

/// Long-polls the rank endpoint until the KV arrived (`Ok`: the prompt tokens the
/// prefill's prefix cache held), failed, or timed out.
async fn pull_kv(
    engine: &Arc<Engine>,
    inst: &Instance,
    rank_addr: &str,
    room: u64,
) -> Result<u32, Failure> {
    let started = tokio::time::Instant::now();
    let deadline = http::deadline(started, engine.cfg.waiting_timeout);
    let body = json!({
        "bootstrap_host": inst.host,
        "bootstrap_port": inst.port,
        "bootstrap_room": room,
        "decode_rid": inst.rid,
        "decode_addr": engine.addr.to_string(),
        "kv_identity": engine.cfg.kv_identity(),
    })
    .to_string();
    let path = format!("/kv/{room}");
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            return Err(waiting_timeout(inst, room, started.elapsed()));
        }
        match http::call(
            rank_addr,
            "POST",
            &path,
            Some(body.clone().into_bytes()),
            left,
        )
        .await
        {
            Ok(r) if r.status == 200 => {
                let v: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
                if v.get("status").and_then(Value::as_str) == Some("success") {
                    let cached = v
                        .get("cached_tokens")
                        .and_then(Value::as_u64)
                        .map_or(0, |c| u32::try_from(c).unwrap_or(u32::MAX));
                    return Ok(cached);
                }
                let reason = v
                    .get("reason")
                    .and_then(Value::as_str)
                    .unwrap_or(crate::rendezvous::PREFILL_DEAD);
                return Err(transfer_failure(inst, room, reason));
            }
            Ok(r) => {
                return Err(transfer_failure(
                    inst,
                    room,
                    &format!(
                        "{} (rank endpoint answered {})",
                        crate::rendezvous::PREFILL_DEAD,
                        r.status
                    ),
                ))
            }
            Err(ClientError::Timeout) => {
                return Err(waiting_timeout(inst, room, started.elapsed()))
            }
            Err(e) => {
                // Cut or refused: the prefill may be down; the heartbeat decides.
                tracing::debug!(rank_addr, error = %e, "sim decode: rank connection lost, retrying");
                tokio::time::sleep(Duration::from_millis(50).min(left)).await;
            }
        }
    }
}

/// Resolves (with SGLang's text) once the bootstrap server is considered lost.
async fn heartbeat(engine: &Arc<Engine>, addr: &str) -> String {
    let interval = engine.cfg.heartbeat_interval.max(Duration::from_millis(1));
    let max_failures = engine.cfg.heartbeat_max_failures.max(1);
    let timeout = interval.min(Duration::from_secs(3));
    let mut failures = 0;
    loop {
        tokio::time::sleep(interval).await;
        match http::call(addr, "GET", "/health", None, timeout).await {
            Ok(r) if r.status == 200 => failures = 0,
            _ => failures += 1,
        }
        if failures >= max_failures {
            engine.decode.forget(addr);
            return format!("Lost connection with prefill instance (bootstrap_addr: {addr})");
        }
    }
}
