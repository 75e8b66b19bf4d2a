//! What a prefill engine does with one request instance before answering:
//! validation, DP placement, the room→rank contract checks, the compute
//! delay, and the KV hand-off to its decode.
//!
//! Why: the router's correctness hinges on the prefill placing room R where
//! the decode looks for it; this module reproduces SGLang's placement rules
//! (data_parallel_controller + `CommonKVSender.__init__`) and failure texts.
//!
//! Invariants:
//! - Rank = `routed_dp_rank` if set (out of range → 400 `DP rank N is not
//!   active.`), else `room % dp` (`follow_bootstrap_room`) or round robin.
//! - With dp > 1 and no `disagg_prefill_dp_rank`: a non-follow policy posts
//!   `/register_dp_rank` to `bootstrap_host:<own bootstrap port>`; under
//!   `follow_bootstrap_room` a rank ≠ `room % dp` fails with 500 (conflict).
//! - Room reuse and a prefill leg whose bootstrap port is not this engine's
//!   bootstrap port are counted as violations, without changing behaviour.
//! - The answer comes only after the decode of the same room reached the same
//!   rank (or `bootstrap_timeout` passed).
//! - With a prefix cache (`prefill_prefix_cache_tokens`), a rank computes one prompt at a
//!   time (its compute lock is held for the whole compute), looks the prompt up when its
//!   compute starts, and spends `prefill_per_token` only on the tokens its cache lacks;
//!   the cached tokens go to the answer and, with the KV, to the decode. Without one,
//!   every prompt token is computed and computes overlap (unless `serial_prefill`).
//! - Load phases, as SGLang reports them per rank: waiting while queued for compute (its
//!   uncached prompt tokens in `num_waiting_uncached_tokens`), running while it computes,
//!   then inflight (computed, KV not yet taken) until its decode takes the KV or the
//!   `bootstrap_timeout`, counted from the leg's arrival, fails it (`KVPoll.Bootstrapping`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::config::Faults;
use crate::http;
use crate::plan::Plan;
use crate::request::{Instance, ParsedRequest};
use crate::shapes::Failure;
use crate::state::Engine;
use crate::stats::{Tracker, Violation};

/// The message of a missing `bootstrap_room` (scheduler abort, 400).
pub(crate) fn missing_room(rid: &str) -> Failure {
    Failure::abort(
        400,
        format!("Invalid request: Disaggregated request received without bootstrap room id. req.rid='{rid}'"),
    )
}

/// SGLang's tokenizer check of the prompt length.
pub(crate) fn check_context(engine: &Engine, inst: &Instance) -> Result<(), Failure> {
    let ctx = engine.cfg.context_length;
    if inst.prompt_tokens >= ctx {
        return Err(context_failure(inst.prompt_tokens, ctx));
    }
    Ok(())
}

fn context_failure(tokens: u32, ctx: u32) -> Failure {
    Failure::validation(format!(
        "The input ({tokens} tokens) is longer than the model's context length ({ctx} tokens)."
    ))
}

/// A failure produced by a status fault (`prefill_status` / `decode_status`).
pub(crate) fn status_fault(status: u16, inst: &Instance, ctx: u32) -> Failure {
    if status == 400 {
        context_failure(inst.prompt_tokens.max(ctx), ctx)
    } else {
        Failure::abort(
            status,
            format!("Simulated engine failure (status {status})"),
        )
    }
}

/// Validates a `routed_dp_rank` against the DP size.
pub(crate) fn routed_rank(routed: Option<i64>, dp: u32) -> Result<Option<u32>, Failure> {
    match routed {
        None => Ok(None),
        Some(r) if r >= 0 && r < i64::from(dp) => Ok(Some(r as u32)),
        Some(r) => Err(Failure::validation(format!("DP rank {r} is not active."))),
    }
}

fn bootstrap_failure(inst: &Instance, room: u64, reason: &str) -> Failure {
    Failure::abort(
        500,
        format!(
            "Prefill bootstrap failed for request rank=0 req.rid='{}' req.bootstrap_room={room} with exception KVTransferError(bootstrap_room={room}): {reason}",
            inst.rid
        ),
    )
}

/// Runs the prefill side of one instance; `Ok` once the KV went to the decode.
pub(crate) async fn prepare(
    engine: &Arc<Engine>,
    req: &ParsedRequest,
    inst: &Instance,
    tracker: &Tracker,
) -> Result<Plan, Failure> {
    let Some(side) = engine.prefill.as_ref() else {
        return Err(Failure::abort(500, "not a prefill engine"));
    };
    let faults = engine.faults();
    if let Some(status) = faults.prefill_status {
        return Err(status_fault(status, inst, engine.cfg.context_length));
    }
    check_context(engine, inst)?;
    let dp = engine.cfg.dp();
    let routed = routed_rank(req.routed_dp_rank, dp)?;
    let Some(room) = inst.room else {
        return Err(missing_room(&inst.rid));
    };
    let follow = engine.cfg.follows_room();
    let rank = match routed {
        Some(r) => r,
        None if follow => (room % u64::from(dp)) as u32,
        None => engine.next_rr(),
    };
    tracker.set_rank(rank);
    tracker.waiting();

    let reused = side
        .seen
        .lock()
        .map(|mut s| s.see(room, Instant::now()))
        .unwrap_or(false);
    if reused {
        engine.stats.violation(Violation::RoomReused);
    }
    if inst.host.is_none() || inst.port != engine.bootstrap_port {
        engine.stats.violation(Violation::BootstrapMismatch);
    }

    if dp > 1 && req.disagg_prefill_dp_rank.is_none() {
        if !follow {
            register_room(engine, inst, room, rank).await;
        } else if u64::from(rank) != room % u64::from(dp) {
            let reason = format!(
                "follow_bootstrap_room conflict: dispatched to dp_rank {rank} but bootstrap_room {room} implies dp_rank {}. Set SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK=1 to allow mixed routing.",
                room % u64::from(dp)
            );
            return Err(bootstrap_failure(inst, room, &reason));
        }
    }

    if faults.prefill_die_mid_request {
        tokio::time::sleep(engine.cfg.prefill_delay).await;
        tracing::info!(addr = %engine.addr, "sim: prefill dies mid-request (engine goes down)");
        engine.set_down(true);
        std::future::pending::<()>().await;
    }
    if faults.prefill_hang {
        std::future::pending::<()>().await;
    }

    let started = tokio::time::Instant::now();
    let mut leg = side
        .rendezvous
        .prefill_arrive(room, rank, inst.host.clone(), inst.port);
    let cached_tokens = compute_prompt(engine, inst, rank, &faults, tracker).await;
    // Computed: the KV waits for its decode (SGLang's inflight queue, neither running
    // nor waiting in the load report).
    tracker.inflight();
    let left = engine
        .cfg
        .bootstrap_timeout
        .saturating_sub(started.elapsed());
    leg.transfer(left, cached_tokens)
        .await
        .map_err(|reason| bootstrap_failure(inst, room, &reason))?;
    if faults.prefill_answer_delay_ms > 0 {
        tokio::time::sleep(Duration::from_millis(faults.prefill_answer_delay_ms)).await;
    }
    Ok(Plan {
        tokens: 1,
        ttft: Duration::ZERO,
        itl: Duration::ZERO,
        die_after: None,
        cached_tokens,
    })
}

/// Computes the prompt of `inst` on `rank`: with a prefix cache, under the rank's compute
/// lock (one prompt at a time per rank) and only for the tokens the cache lacks. Returns the
/// cached tokens.
///
/// While it waits for its compute (the rank's lock, or with `serial_prefill` the engine's
/// compute queue), the instance counts in its rank's `num_waiting_uncached_tokens`: the
/// prompt tokens the rank's cache did not hold when it queued (SGLang counts a queued
/// request's `seqlen` minus its matched prefix).
async fn compute_prompt(
    engine: &Engine,
    inst: &Instance,
    rank: u32,
    faults: &Faults,
    tracker: &Tracker,
) -> u32 {
    let lock = engine.compute_locks.get(rank as usize);
    let _turn = match lock {
        Some(l) => match l.try_lock() {
            Ok(g) => Some(g),
            Err(_) => {
                let held = engine
                    .prefix_cache(rank)
                    .map_or(0, |c| c.peek_prefix(&inst.prefix_ids))
                    .min(inst.prompt_tokens);
                tracker.queue_uncached(u64::from(inst.prompt_tokens - held));
                Some(l.lock().await)
            }
        },
        None => None,
    };
    let cached = engine
        .prefix_cache(rank)
        .map_or(0, |mut c| c.match_and_insert(&inst.prefix_ids))
        .min(inst.prompt_tokens);
    engine.stats.prefix_lookup(rank, inst.prompt_tokens, cached);
    tracker.add_tokens(u64::from(inst.prompt_tokens));
    let uncached = inst.prompt_tokens - cached;
    let compute = engine.cfg.prefill_time(uncached, faults);
    if engine.cfg.serial_prefill {
        let until = engine.queue_compute(compute);
        let starts = until.checked_sub(compute).unwrap_or(until);
        if starts > tokio::time::Instant::now() {
            tracker.queue_uncached(u64::from(uncached));
            tokio::time::sleep_until(starts).await;
        }
        tracker.compute_starts();
        tracker.running();
        tokio::time::sleep_until(until).await;
    } else {
        tracker.compute_starts();
        tracker.running();
        if !compute.is_zero() {
            tokio::time::sleep(compute).await;
        }
    }
    cached
}

/// `POST /register_dp_rank` to `bootstrap_host:<own bootstrap port>`; failures
/// are only logged, as in SGLang.
async fn register_room(engine: &Engine, inst: &Instance, room: u64, rank: u32) {
    let Some(port) = engine.bootstrap_port else {
        return;
    };
    let host = inst.host.clone().unwrap_or_else(|| engine.public_ip());
    let body = json!({"bootstrap_room": room, "dp_rank": rank}).to_string();
    let addr = http::host_port(&host, port);
    match http::call(
        &addr,
        "POST",
        "/register_dp_rank",
        Some(body.into_bytes()),
        Duration::from_secs(5),
    )
    .await
    {
        Ok(r) if r.status == 200 => {}
        Ok(r) => tracing::warn!(room, status = r.status, "sim: register_dp_rank refused"),
        Err(e) => tracing::warn!(room, error = %e, "sim: register_dp_rank failed"),
    }
}
