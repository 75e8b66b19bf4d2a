//! Read-only engine endpoints: `/server_info` (`/get_server_info`),
//! `/model_info` (`/get_model_info`), `/v1/models`, `/v1/loads`, `/get_load`.
//!
//! Why: the router discovers each engine's role, bootstrap port, DP size,
//! page size and KV dtype from `/server_info`, and balances on the load
//! endpoints; the shapes follow SGLang (spec §6.6, §6.7).
//!
//! Invariants: `internal_states` and the load lists have one entry per DP
//! rank; the load gauges come from the live [`crate::stats::Stats`].

use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use crate::http::query_param;
use crate::state::Engine;

fn now_f64() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// `GET /server_info`.
pub(crate) fn server_info(engine: &Engine) -> Value {
    let cfg = &engine.cfg;
    let loads = engine.stats.loads();
    let cap = max_running(engine);
    let internal: Vec<Value> = loads
        .iter()
        .enumerate()
        .map(|(rank, l)| {
            let mut v = json!({
                "dp_rank": rank,
                "last_gen_throughput": 0.0,
                "num_running_reqs": l.running,
                "num_waiting_reqs": l.waiting,
                "memory_usage": {"token_capacity": cfg.max_total_num_tokens},
            });
            if let (Some(cap), Some(o)) = (cap, v.as_object_mut()) {
                o.insert("effective_max_running_requests_per_dp".into(), json!(cap));
            }
            v
        })
        .collect();
    json!({
        "model_path": cfg.model,
        "tokenizer_path": cfg.model,
        "served_model_name": cfg.served_name(),
        "weight_version": cfg.weight_version,
        "speculative_algorithm": cfg.speculative_algorithm,
        "speculative_num_steps": null,
        "speculative_eagle_topk": null,
        "speculative_num_draft_tokens": null,
        "host": engine.public_ip(),
        "port": engine.addr.port(),
        "disaggregation_mode": cfg.role.disaggregation_mode(),
        "disaggregation_bootstrap_port": engine.bootstrap_port.unwrap_or(sglang_pd::DEFAULT_BOOTSTRAP_PORT),
        "disaggregation_transfer_backend": "sim",
        "dp_size": cfg.dp(),
        "tp_size": 1,
        "pp_size": 1,
        "enable_dp_attention": true,
        "load_balance_method": if cfg.role == crate::config::Role::Prefill { cfg.load_balance_method.as_str() } else { "round_robin" },
        "incremental_streaming_output": cfg.incremental_streaming_output,
        // SGLang's `--disaggregation-decode-enable-radix-cache` (and `--disable-radix-cache`):
        // a decode with a prefix cache reports it as the engine does.
        "disaggregation_decode_enable_radix_cache": cfg.role == crate::config::Role::Decode && cfg.decode_prefix_cache_tokens > 0,
        "disable_radix_cache": match cfg.role {
            crate::config::Role::Prefill => cfg.prefill_prefix_cache_tokens == 0,
            crate::config::Role::Decode => cfg.decode_prefix_cache_tokens == 0,
            _ => true,
        },
        "page_size": cfg.page_size,
        "kv_cache_dtype": cfg.kv_cache_dtype,
        "context_length": cfg.context_length,
        "max_total_num_tokens": cfg.max_total_num_tokens,
        "max_req_input_len": cfg.context_length.saturating_sub(1),
        "internal_states": internal,
        "version": "0.5.23-sim",
    })
}

/// The decode's running cap per DP rank, when it has one (reported only then).
fn max_running(engine: &Engine) -> Option<u32> {
    (engine.cfg.role == crate::config::Role::Decode)
        .then_some(engine.cfg.max_running_requests)
        .flatten()
}

/// `GET /model_info`.
pub(crate) fn model_info(engine: &Engine) -> Value {
    json!({
        "model_path": engine.cfg.model,
        "tokenizer_path": engine.cfg.model,
        "is_generation": true,
        "preferred_sampling_params": null,
        "weight_version": engine.cfg.weight_version,
        "has_image_understanding": false,
        "has_audio_understanding": false,
        "model_type": "sim",
        "architectures": ["SimForCausalLM"],
    })
}

/// One entry of `GET /v1/models`.
pub(crate) fn model_card(engine: &Engine) -> Value {
    json!({
        "id": engine.cfg.served_name(),
        "object": "model",
        "created": now_f64() as u64,
        "owned_by": "sglang",
        "root": engine.cfg.model,
        "parent": null,
        "max_model_len": engine.cfg.context_length,
    })
}

/// `GET /v1/models`.
pub(crate) fn models(engine: &Engine) -> Value {
    json!({"object": "list", "data": [model_card(engine)]})
}

/// The sections of `/v1/loads` a request asks for (`include=`, comma-separated; SGLang's
/// default is all of them). The simulator reports the core keys and `disaggregation`.
fn wants_disaggregation(query: Option<&str>) -> bool {
    match query_param(query, "include") {
        None => true,
        Some(list) => list
            .split(',')
            .map(str::trim)
            .any(|s| s == "all" || s == "disagg"),
    }
}

/// `GET /v1/loads[?dp_rank=N][&include=...]` (newest generation, `{"loads": [...]}`), one
/// entry per DP rank with SGLang's core keys and, unless `include` leaves it out, its
/// `disaggregation` section. As SGLang counts them: a decode's `num_waiting_reqs` holds its
/// pre-allocation queue (no running slot yet) and its transfer queue; a prefill's holds the
/// prompts queued for compute, whose uncached tokens are `num_waiting_uncached_tokens` (0 on
/// a decode), and not the computed requests whose KV waits for a decode (the inflight queue).
pub(crate) fn loads(engine: &Engine, query: Option<&str>) -> Value {
    let cfg = &engine.cfg;
    let only = query_param(query, "dp_rank").and_then(|r| r.parse::<usize>().ok());
    let disagg = wants_disaggregation(query);
    let ts = now_f64();
    let max = cfg.max_total_num_tokens;
    let cap = max_running(engine);
    let prefill = cfg.role == crate::config::Role::Prefill;
    let decode = cfg.role == crate::config::Role::Decode;
    let entries: Vec<Value> = engine
        .stats
        .loads()
        .iter()
        .enumerate()
        .filter(|(rank, _)| only.is_none_or(|o| o == *rank))
        .map(|(rank, l)| {
            let usage = if max == 0 {
                0.0
            } else {
                l.tokens as f64 / max as f64
            };
            let mut v = json!({
                "dp_rank": rank,
                "timestamp": ts,
                "num_running_reqs": l.running,
                "num_waiting_reqs": l.waiting,
                "num_waiting_uncached_tokens": if prefill { l.uncached_tokens } else { 0 },
                "num_used_tokens": l.tokens,
                "num_total_tokens": l.tokens,
                "max_total_num_tokens": max,
                "token_usage": usage,
                "gen_throughput": 0.0,
                "cache_hit_rate": 0.0,
                "utilization": usage,
                "max_running_requests": cap,
            });
            if let (true, Some(o)) = (disagg, v.as_object_mut()) {
                o.insert(
                    "disaggregation".into(),
                    json!({
                        "mode": cfg.role.disaggregation_mode(),
                        "prefill_bootstrap_queue_reqs": 0,
                        "prefill_inflight_queue_reqs": if prefill { l.inflight } else { 0 },
                        "decode_prealloc_queue_reqs": if decode { l.prealloc } else { 0 },
                        "decode_transfer_queue_reqs": if decode { l.waiting.saturating_sub(l.prealloc) } else { 0 },
                        "decode_retracted_queue_reqs": 0,
                        "kv_transfer_speed_gb_s": 0.0,
                        "kv_transfer_latency_ms": 0.0,
                    }),
                );
            }
            v
        })
        .collect();
    json!({"loads": entries})
}

/// `GET /get_load` (mid generation: a list per DP rank).
pub(crate) fn get_load(engine: &Engine) -> Value {
    let ts = now_f64();
    Value::Array(
        engine
            .stats
            .loads()
            .iter()
            .enumerate()
            .map(|(rank, l)| {
                json!({
                    "dp_rank": rank,
                    "num_reqs": l.running + l.waiting,
                    "num_waiting_reqs": l.waiting,
                    "num_tokens": l.tokens,
                    "ts_tic": ts,
                })
            })
            .collect(),
    )
}
