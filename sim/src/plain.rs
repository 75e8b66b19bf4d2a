//! What a plain (non-disaggregated) engine does with one request instance before its
//! first token: SGLang's default mode (`--disaggregation-mode null`), one engine for the
//! whole request. The prompt is computed here (the prefill's compute time, by prompt
//! length), then [`crate::run`] emits the tokens.
//!
//! Why: pdgate fronts regular workers beside PD pairs; its tests need an engine that
//! takes a request with no bootstrap fields and answers it whole, like SGLang.
//!
//! Invariants:
//! - No bootstrap server, no KV rendezvous: bootstrap fields a request carries are
//!   ignored, as SGLang's plain mode ignores them.
//! - Prefill has priority over decoding on one engine (SGLang's scheduler runs a prefill
//!   batch before the next decode step; no chunked prefill here): prompt computes run one
//!   at a time on the engine (`Engine::busy_until`), and a token of any running request
//!   waits until the compute in progress ends ([`wait_idle`]). This is the interference
//!   PD disaggregation removes, and what a short-prompt bypass trades against.

use std::sync::Arc;
use std::time::Duration;

use crate::plan::Plan;
use crate::prefill::{check_context, routed_rank, status_fault};
use crate::request::{Instance, ParsedRequest};
use crate::shapes::Failure;
use crate::state::Engine;
use crate::stats::Tracker;

/// Runs the prompt of one instance on a plain engine; `Ok` once it is computed.
pub(crate) async fn prepare(
    engine: &Arc<Engine>,
    req: &ParsedRequest,
    inst: &Instance,
    tracker: &Tracker,
) -> Result<Plan, Failure> {
    let faults = engine.faults();
    if let Some(status) = faults.decode_status.or(faults.prefill_status) {
        return Err(status_fault(status, inst, engine.cfg.context_length));
    }
    check_context(engine, inst)?;
    let rank =
        routed_rank(req.routed_dp_rank, engine.cfg.dp())?.unwrap_or_else(|| engine.next_rr());
    tracker.set_rank(rank);
    tracker.waiting();
    if faults.prefill_hang || faults.decode_hang {
        std::future::pending::<()>().await;
    }
    let compute = engine.cfg.prefill_time(inst.prompt_tokens, &faults);
    let until = engine.queue_compute(compute);
    tracker.running();
    tracker.add_tokens(u64::from(inst.prompt_tokens));
    tokio::time::sleep_until(until).await;
    let extra = faults.decode_extra_ttft_ms;
    Ok(Plan {
        tokens: inst.max_tokens,
        ttft: faults.slowed(engine.cfg.ttft.saturating_add(Duration::from_millis(extra))),
        itl: faults.slowed(engine.cfg.itl),
        die_after: faults.decode_die_mid_stream_after,
        cached_tokens: 0,
    })
}

/// A plain engine's next token waits for the prompt compute in progress (if any).
pub(crate) async fn wait_idle(engine: &Engine) {
    let until = *engine.busy_until.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(t) = until.filter(|t| *t > tokio::time::Instant::now()) {
        tokio::time::sleep_until(t).await;
    }
}
