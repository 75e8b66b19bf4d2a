//! The generate driver shared by both roles: parses the request, runs every
//! instance concurrently (role-specific preparation, then token generation),
//! and answers as JSON or as a real chunk-by-chunk SSE stream.
//!
//! Why: batching, streaming, aborts, client disconnects and failure shapes are
//! the same for prefill and decode; only "what happens before the first token"
//! differs ([`crate::prefill::prepare`], [`crate::decode::prepare`]).
//!
//! Invariants:
//! - Each instance owns a [`Tracker`] (stats drop guard) and an abort
//!   registration; both are released whatever ends the instance.
//! - Streaming responses are sent from a spawned task into an mpsc-backed
//!   body; when the client goes away (or the connection is cut) the task's
//!   work is dropped at once (`tx.closed()`), which releases every guard.
//! - A "die" fault cuts the connection: an `Err` body item when streaming,
//!   `Err(Cut)` from the handler otherwise.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::future::join_all;
use hyper::body::Incoming;
use hyper::Request;

use crate::config::Role;
use crate::http::{self, ChunkTx, Cut, Resp};
use crate::plan::Plan;
use crate::request::{self, Api, Instance, ParsedRequest};
use crate::shapes::{self, Ctx, Failure, Logprobs};
use crate::state::Engine;
use crate::stats::{Outcome, Tracker};

/// How one instance ended.
struct InstanceResult {
    tokens: u32,
    /// The prompt's cached tokens (0 if the instance failed before it knew).
    cached: u32,
    failure: Option<Failure>,
    died: bool,
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Handles `/generate`, `/v1/chat/completions` and `/v1/completions`.
pub(crate) async fn handle_generate(
    engine: Arc<Engine>,
    api: Api,
    req: Request<Incoming>,
) -> Result<Resp, Cut> {
    if let Ok(mut last) = engine.last_headers.lock() {
        *last = req
            .headers()
            .iter()
            .map(|(k, v)| {
                (
                    k.as_str().to_string(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect();
    }
    let dp_header = req
        .headers()
        .get("x-data-parallel-rank")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = http::read_body(req.into_body()).await?;
    if let (Ok(v), Ok(mut log)) = (
        serde_json::from_slice::<serde_json::Value>(&body),
        engine.bodies.lock(),
    ) {
        if log.len() >= crate::state::RECENT_RIDS {
            log.pop_front();
        }
        log.push_back((api.path().to_string(), v));
    }
    let parsed = match request::parse(api, &body, dp_header.as_deref(), &engine.cfg) {
        Ok(p) => Arc::new(p),
        Err(e) => {
            let t = Tracker::new(engine.stats.begin());
            t.finish(Outcome::Failed);
            return Ok(shapes::request_error_response(api, &e));
        }
    };
    if parsed.stream {
        let (resp, tx) = http::sse();
        tokio::spawn(stream_task(engine, parsed, tx));
        Ok(resp)
    } else {
        non_stream(engine, parsed).await
    }
}

fn logprob_mode(engine: &Engine) -> Logprobs {
    match engine.cfg.role {
        Role::Prefill => Logprobs::Prefill,
        Role::Decode => Logprobs::Decode,
        // A plain engine computes the prompt too: input and output logprobs, like a
        // prefill's answer.
        Role::Regular => Logprobs::Prefill,
    }
}

async fn non_stream(engine: Arc<Engine>, parsed: Arc<ParsedRequest>) -> Result<Resp, Cut> {
    let ctx = Ctx {
        req: &parsed,
        created: now_secs(),
        logprobs: logprob_mode(&engine),
        incremental: engine.cfg.incremental_streaming_output && parsed.stream,
        cache_report: engine.cfg.enable_cache_report,
    };
    let results = join_all(
        parsed
            .instances
            .iter()
            .map(|inst| run_instance(&engine, &ctx, inst, None)),
    )
    .await;
    if results.iter().any(|r| r.died) {
        return Err(Cut);
    }
    if let Some(f) = results
        .iter()
        .filter_map(|r| r.failure.as_ref())
        .find(|f| f.status.is_some())
    {
        let status = f.status.unwrap_or(500);
        return Ok(shapes::failure_response(parsed.api, status, f));
    }
    let body = match parsed.api {
        Api::Generate => {
            let objs: Vec<_> = parsed
                .instances
                .iter()
                .zip(&results)
                .map(|(inst, r)| {
                    ctx.generate_obj(inst, 0, r.tokens, true, r.failure.as_ref(), r.cached)
                })
                .collect();
            if parsed.is_batch {
                serde_json::Value::Array(objs)
            } else {
                objs.into_iter().next().unwrap_or(serde_json::Value::Null)
            }
        }
        _ => {
            let rows: Vec<_> = parsed
                .instances
                .iter()
                .zip(&results)
                .map(|(inst, r)| (inst, r.tokens, r.failure.as_ref(), r.cached))
                .collect();
            ctx.openai_obj(&rows)
        }
    };
    Ok(http::json(200, &body))
}

async fn stream_task(engine: Arc<Engine>, parsed: Arc<ParsedRequest>, tx: ChunkTx) {
    let ctx = Ctx {
        req: &parsed,
        created: now_secs(),
        logprobs: logprob_mode(&engine),
        incremental: engine.cfg.incremental_streaming_output && parsed.stream,
        cache_report: engine.cfg.enable_cache_report,
    };
    let work = async {
        let results = join_all(
            parsed
                .instances
                .iter()
                .map(|inst| run_instance(&engine, &ctx, inst, Some(&tx))),
        )
        .await;
        if results.iter().any(|r| r.died) {
            return;
        }
        if parsed.include_usage && parsed.api != Api::Generate && engine.cfg.role != Role::Prefill {
            let prompt: u32 = parsed
                .instances
                .iter()
                .filter(|i| i.index < parsed.batch)
                .map(|i| i.prompt_tokens)
                .sum();
            let completion: u32 = results.iter().map(|r| r.tokens).sum();
            let cached: u32 = parsed
                .instances
                .iter()
                .zip(&results)
                .filter(|(i, _)| i.index < parsed.batch)
                .map(|(_, r)| r.cached)
                .sum();
            let _ = tx
                .send(Ok(shapes::sse_event(
                    &ctx.usage_chunk(prompt, completion, cached),
                )))
                .await;
        }
        let _ = tx.send(Ok(shapes::sse_done())).await;
    };
    tokio::select! {
        _ = work => {}
        _ = tx.closed() => {}
    }
}

/// Runs one instance; with `tx`, streams its chunks (including its failure chunk).
async fn run_instance(
    engine: &Arc<Engine>,
    ctx: &Ctx<'_>,
    inst: &Instance,
    tx: Option<&ChunkTx>,
) -> InstanceResult {
    let tracker = Tracker::new(engine.stats.begin());
    engine.started_rids.push(&inst.rid);
    let (abort_rx, _registration) = engine.inflight.register(&inst.rid);
    let progress = AtomicU32::new(0);
    let cached = AtomicU32::new(0);
    let work = async {
        let plan = match engine.cfg.role {
            Role::Prefill => crate::prefill::prepare(engine, ctx.req, inst, &tracker).await?,
            Role::Decode => crate::decode::prepare(engine, ctx.req, inst, &tracker).await?,
            Role::Regular => crate::plain::prepare(engine, ctx.req, inst, &tracker).await?,
        };
        cached.store(plan.cached_tokens, Ordering::Relaxed);
        tracker.running();
        generate(engine, ctx, inst, plan, tx, &progress, &tracker).await
    };
    let ended: Result<Generated, Failure> = tokio::select! {
        r = work => r,
        _ = abort_rx => Err(Failure::user_abort()),
    };
    let tokens = progress.load(Ordering::Relaxed);
    let cached = cached.load(Ordering::Relaxed);
    match ended {
        Ok(Generated::Done) => {
            tracker.finish(Outcome::Ok);
            InstanceResult {
                tokens,
                cached,
                failure: None,
                died: false,
            }
        }
        Ok(Generated::Died) => {
            tracker.finish(Outcome::Failed);
            if let Some(tx) = tx {
                let _ = tx
                    .send(Err(std::io::Error::other("simulated decode death")))
                    .await;
            }
            InstanceResult {
                tokens,
                cached,
                failure: None,
                died: true,
            }
        }
        Err(f) => {
            tracker.finish(f.outcome);
            if let Some(tx) = tx {
                let _ = tx
                    .send(Ok(shapes::sse_event(
                        &ctx.failure_chunk(inst, tokens, &f, cached),
                    )))
                    .await;
            }
            InstanceResult {
                tokens,
                cached,
                failure: Some(f),
                died: false,
            }
        }
    }
}

enum Generated {
    Done,
    Died,
}

/// Emits the plan's tokens with its timing.
async fn generate(
    engine: &Arc<Engine>,
    ctx: &Ctx<'_>,
    inst: &Instance,
    plan: Plan,
    tx: Option<&ChunkTx>,
    progress: &AtomicU32,
    tracker: &Tracker,
) -> Result<Generated, Failure> {
    let mut sent: u32 = 0;
    // Returns false when the connection must be cut instead of sending.
    let send = |v: serde_json::Value, sent: &mut u32| {
        let die = plan.die_after.is_some_and(|n| *sent >= n);
        *sent += 1;
        let fut = tx.map(|tx| tx.send(Ok(shapes::sse_event(&v))));
        async move {
            if die {
                return false;
            }
            if let Some(f) = fut {
                let _ = f.await;
            }
            true
        }
    };
    let streaming_openai = tx.is_some() && ctx.req.api != Api::Generate;
    if streaming_openai && engine.cfg.role == Role::Prefill {
        // The prefill's one token: a single chunk, then [DONE].
        progress.store(plan.tokens.min(1), Ordering::Relaxed);
        tracker.add_tokens(1);
        if !send(ctx.single_chunk(inst), &mut sent).await {
            return Ok(Generated::Died);
        }
        return Ok(Generated::Done);
    }
    if streaming_openai
        && ctx.req.api == Api::Chat
        && !send(ctx.with_usage(ctx.role_chunk(inst), inst, 0), &mut sent).await
    {
        return Ok(Generated::Died);
    }
    if !plan.ttft.is_zero() {
        tokio::time::sleep(plan.ttft).await;
    }
    for k in 0..plan.tokens {
        if engine.cfg.role == Role::Regular {
            crate::plain::wait_idle(engine).await;
        }
        if k > 0 {
            let extra = if engine.cfg.role != Role::Prefill {
                Duration::from_millis(engine.faults_tx.borrow().decode_extra_itl_ms)
            } else {
                Duration::ZERO
            };
            let pause = plan.itl.saturating_add(extra);
            if !pause.is_zero() {
                tokio::time::sleep(pause).await;
            }
        }
        progress.store(k + 1, Ordering::Relaxed);
        tracker.add_tokens(1);
        if tx.is_some() {
            let chunk = if ctx.req.api == Api::Generate {
                let from = if ctx.incremental { k } else { 0 };
                ctx.generate_obj(
                    inst,
                    from,
                    k + 1,
                    k + 1 == plan.tokens,
                    None,
                    plan.cached_tokens,
                )
            } else {
                ctx.with_usage(ctx.token_chunk(inst, k), inst, k + 1)
            };
            if !send(chunk, &mut sent).await {
                return Ok(Generated::Died);
            }
        }
    }
    if tx.is_some() {
        let last = if ctx.req.api == Api::Generate {
            (plan.tokens == 0).then(|| ctx.generate_obj(inst, 0, 0, true, None, plan.cached_tokens))
        } else {
            Some(ctx.with_usage(ctx.finish_chunk(inst, false), inst, plan.tokens))
        };
        if let Some(v) = last {
            if !send(v, &mut sent).await {
                return Ok(Generated::Died);
            }
        }
        // Cut after exactly as many chunks as the stream has: the answer is complete,
        // its end (the usage chunk, `[DONE]`) never comes.
        if plan.die_after.is_some_and(|n| sent >= n) {
            // After a moment: the server drops what it has not written yet when a body
            // fails, and the point is that every chunk reached the client.
            tokio::time::sleep(Duration::from_millis(20)).await;
            return Ok(Generated::Died);
        }
    } else if plan.die_after.is_some() {
        return Ok(Generated::Died);
    }
    Ok(Generated::Done)
}
