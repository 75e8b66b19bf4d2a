//! Configuration of one simulated engine and its run-time faults.
//!
//! Why: every default of the simulator lives in exactly one place, the
//! [`Default`] impl of [`EngineConfig`] (and [`Faults`]), so the CLI, the
//! cluster helper and tests cannot drift apart.
//!
//! Invariants:
//! - `dp_size` is treated as at least 1 everywhere (`EngineConfig::dp()`).
//! - [`Faults`] is plain data (serde, `Clone`); the engine keeps the current
//!   value in a `tokio::sync::watch` channel so that connection tasks can react
//!   to `down` / `bootstrap_down` at once.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Which half of a PD pair an engine simulates (`--disaggregation-mode prefill|decode`):
/// the wire type shared with the router, from the protocol crate [`sglang_pd`].
pub use sglang_pd::Role;

/// Faults that can be switched on and off while the engine runs
/// (`SimEngine::set_faults`, `POST /sim/faults`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Faults {
    /// Whole engine (HTTP port, bootstrap server, rank endpoints) accepts and
    /// drops every connection; in-flight connections are cut.
    pub down: bool,
    /// Prefill only: only the bootstrap server accepts and drops.
    pub bootstrap_down: bool,
    /// Prefill only: these DP ranks are not registered (never `PUT /route`).
    /// Adding a rank at run time removes its entry from the bootstrap table and
    /// lowers the registered count (a power the real server does not have).
    pub unregistered_ranks: Vec<u32>,
    /// Prefill only: no rank is registered.
    pub register_none: bool,
    /// Prefill answers this status with SGLang's error shape without running.
    pub prefill_status: Option<u16>,
    /// Prefill accepts generate requests and never answers.
    pub prefill_hang: bool,
    /// Prefill accepts a request, then the whole engine goes down about
    /// `prefill_delay` later (as `down`), cutting the connection.
    pub prefill_die_mid_request: bool,
    /// Decode answers with this status in SGLang's failure shape.
    pub decode_status: Option<u16>,
    /// Decode streams this many chunks then cuts the connection (as many as the stream
    /// has: its end, the usage chunk and `[DONE]`, never comes; non-streaming: cuts
    /// before answering).
    pub decode_die_mid_stream_after: Option<u32>,
    /// Extra inter-token latency on decode (slow decode).
    pub decode_extra_itl_ms: u64,
    /// Extra time to first token on decode.
    pub decode_extra_ttft_ms: u64,
    /// Prefill: extra time between the KV hand-off and the prefill's own answer (its
    /// decode can finish first).
    pub prefill_answer_delay_ms: u64,
    /// Decode holds every request that arrives while this is set before its bootstrap
    /// lookup (a stalled scheduler: held, not failed); clearing it lets them all go on.
    /// Tests use it to keep requests in flight exactly until they release them.
    pub decode_hold: bool,
    /// Decode pulls the KV (its prefill answers), then never sends a first byte, while
    /// its health stays fine (a stalled decode).
    pub decode_hang: bool,
    /// Every compute time of this engine (prefill time, time to first token, inter-token
    /// latency) multiplied by this (0 and 1: none), e.g. 5 for an engine 5x slower.
    pub slowdown: u32,
    /// Prefill only: the bootstrap server answers each `GET /route` this much later (a
    /// busy Python server).
    pub bootstrap_route_delay_ms: u64,
}

impl Faults {
    /// `d` under the slowdown fault.
    pub fn slowed(&self, d: Duration) -> Duration {
        d.saturating_mul(self.slowdown.max(1))
    }

    /// Whether the prefill DP rank `rank` should be registered in the bootstrap table.
    pub fn rank_registered(&self, rank: u32) -> bool {
        !self.register_none && !self.unregistered_ranks.contains(&rank)
    }
}

/// Static configuration of one simulated engine. All fields are public; build
/// one with [`EngineConfig::prefill`] / [`EngineConfig::decode`] and adjust.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    pub role: Role,
    /// Number of DP ranks (attention DP; `enable_dp_attention` is reported true).
    pub dp_size: u32,
    /// Listen address of every server of this engine (engine, bootstrap, ranks).
    pub host: String,
    /// Engine HTTP port; 0 = ephemeral.
    pub port: u16,
    /// Prefill only: bootstrap server port; 0 = ephemeral.
    pub bootstrap_port: u16,
    /// `model_path` (and `served_model_name` unless that is set).
    pub model: String,
    /// `served_model_name` when it differs from the model path (SGLang's
    /// `--served-model-name`); unset, the model path is the name, as in SGLang.
    pub served_model_name: Option<String>,
    /// `weight_version` in `/server_info` (SGLang's `--weight-version`).
    pub weight_version: String,
    /// `speculative_algorithm` in `/server_info` (`None`: null, no speculative decoding).
    pub speculative_algorithm: Option<String>,
    pub page_size: u32,
    pub kv_cache_dtype: String,
    /// Prefill DP dispatch policy. `follow_bootstrap_room` (default) runs room R
    /// on rank `R % dp`; any other value runs round robin and registers each
    /// room's rank with `POST /register_dp_rank` on its own bootstrap server.
    pub load_balance_method: String,
    /// Model context length (`max_model_len`, `max_req_input_len`); longer
    /// prompts get SGLang's 400.
    pub context_length: u32,
    /// KV capacity per DP rank reported in `/server_info` and `/v1/loads`.
    pub max_total_num_tokens: u64,
    /// Prefill compute time per request.
    pub prefill_delay: Duration,
    /// Prefill compute time per prompt token the rank's prefix cache does not hold (all of
    /// them without a cache), on top of `prefill_delay`: long prompts take longer, cached
    /// prefixes are free.
    pub prefill_per_token: Duration,
    /// Prefill: prompt computes run one at a time on the engine (a long prompt delays the
    /// ones behind it, as one batch after another on a GPU); off (default), they overlap.
    /// A plain engine (`Role::Regular`) always runs them one at a time.
    pub serial_prefill: bool,
    /// Prefill: tokens of prefix cache per DP rank (SGLang's radix cache, see
    /// `crate::prefix_cache`); 0 (default): no cache. With a cache, each rank computes one
    /// prompt at a time (a long prompt delays the ones behind it on its rank) and answers
    /// report the tokens it held as `cached_tokens`.
    pub prefill_prefix_cache_tokens: u64,
    /// Decode: tokens of prefix cache per DP rank (0, default: no cache); what the rank
    /// holds of a prompt it need not wait for (`decode_per_missing_token`).
    pub decode_prefix_cache_tokens: u64,
    /// Tokens per page of the prefix caches (only whole pages are cached). SGLang's radix
    /// cache pages by the KV `page_size`; this one is apart so that the reported
    /// `page_size` keeps its default.
    pub prefix_cache_page_size: u32,
    /// Decode: time to receive one prompt token of KV the rank's prefix cache lacks (all
    /// of them without a cache), before the first token.
    pub decode_per_missing_token: Duration,
    /// SGLang's `--enable-cache-report`: OpenAI answers report the prompt's cached tokens
    /// (`usage.prompt_tokens_details.cached_tokens`, when there are any).
    pub enable_cache_report: bool,
    /// Decode: time to first token after the KV arrived.
    pub ttft: Duration,
    /// Decode: inter-token latency.
    pub itl: Duration,
    /// Output length when the request does not say (`max_new_tokens`,
    /// `max_tokens`, `max_completion_tokens` override it, capped at 4096).
    pub default_output_tokens: u32,
    /// Decode: `SGLANG_DISAGGREGATION_WAITING_TIMEOUT`.
    pub waiting_timeout: Duration,
    /// Prefill: `SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT` (waiting for decode).
    pub bootstrap_timeout: Duration,
    /// Decode: attempts to fetch the prefill's parallel info (sentinel).
    pub sentinel_attempts: u32,
    /// Decode: pause between sentinel attempts.
    pub sentinel_interval: Duration,
    /// Decode: period of the bootstrap `/health` heartbeat while waiting.
    pub heartbeat_interval: Duration,
    /// Decode: consecutive heartbeat failures that mean "prefill lost".
    pub heartbeat_max_failures: u32,
    /// Prefill bootstrap server: `SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL`
    /// (room → dp_rank entries live between 1x and 2x this).
    pub room_entry_ttl: Duration,
    /// Decode: emulate engines without SGLang PR #24772: a failed rank lookup
    /// hangs until `waiting_timeout` instead of failing at once.
    pub legacy_bootstrap_bug: bool,
    /// Decode: requests each DP rank runs at once (SGLang's `max_running_requests`
    /// per DP rank). Requests beyond it queue inside the engine before their KV transfer
    /// starts (so a prefill's `bootstrap_timeout` can run out, as with SGLang). Reported
    /// in `/server_info` (`internal_states[i].effective_max_running_requests_per_dp`) and
    /// `/v1/loads` (`max_running_requests` per entry). `None`: no limit, not reported.
    pub max_running_requests: Option<u32>,
    /// SGLang's `--incremental-streaming-output`: a streamed `/generate` event holds only
    /// its new text and ids (default: the whole answer so far).
    pub incremental_streaming_output: bool,
    /// OpenAI routes: ignore `stream_options.continuous_usage_stats` (no usage on each
    /// chunk), as older SGLang builds and other OpenAI-compatible servers do.
    pub ignore_continuous_usage: bool,
    /// Faults active from the start.
    pub faults: Faults,
}

/// Cap on the number of output tokens a request may ask for.
pub const MAX_OUTPUT_TOKENS: u32 = 4096;

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            role: Role::Prefill,
            dp_size: 1,
            host: "127.0.0.1".to_string(),
            port: 0,
            bootstrap_port: 0,
            model: "sim-model".to_string(),
            served_model_name: None,
            weight_version: "default".to_string(),
            speculative_algorithm: None,
            page_size: 1,
            kv_cache_dtype: "auto".to_string(),
            load_balance_method: "follow_bootstrap_room".to_string(),
            context_length: 32768,
            max_total_num_tokens: 1_000_000,
            prefill_delay: Duration::from_millis(5),
            prefill_per_token: Duration::ZERO,
            serial_prefill: false,
            prefill_prefix_cache_tokens: 0,
            decode_prefix_cache_tokens: 0,
            prefix_cache_page_size: 16,
            decode_per_missing_token: Duration::ZERO,
            enable_cache_report: false,
            ttft: Duration::from_millis(5),
            itl: Duration::from_millis(2),
            default_output_tokens: 16,
            waiting_timeout: Duration::from_secs(300),
            bootstrap_timeout: Duration::from_secs(300),
            sentinel_attempts: 15,
            sentinel_interval: Duration::from_secs(1),
            heartbeat_interval: Duration::from_secs(5),
            heartbeat_max_failures: 2,
            room_entry_ttl: Duration::from_secs(120),
            legacy_bootstrap_bug: false,
            max_running_requests: None,
            incremental_streaming_output: false,
            ignore_continuous_usage: false,
            faults: Faults::default(),
        }
    }
}

impl EngineConfig {
    /// What a prefill and a decode must share for a KV handoff to make sense (the weights,
    /// their version, the KV page size and dtype, the speculative settings): the decode
    /// sends it with its KV request and the prefill refuses another.
    pub fn kv_identity(&self) -> String {
        format!(
            "{}|{}|{}|{}|{}",
            self.model,
            self.weight_version,
            self.page_size,
            self.kv_cache_dtype,
            self.speculative_algorithm.as_deref().unwrap_or("")
        )
    }

    /// The name clients use: `served_model_name`, else the model path.
    pub fn served_name(&self) -> &str {
        self.served_model_name.as_deref().unwrap_or(&self.model)
    }

    /// A prefill engine with `dp_size` DP ranks and default everything else.
    pub fn prefill(dp_size: u32) -> Self {
        EngineConfig {
            role: Role::Prefill,
            dp_size,
            ..Default::default()
        }
    }

    /// A decode engine with `dp_size` DP ranks and default everything else.
    pub fn decode(dp_size: u32) -> Self {
        EngineConfig {
            role: Role::Decode,
            dp_size,
            ..Default::default()
        }
    }

    /// A plain (non-disaggregated) engine with `dp_size` DP ranks: SGLang's default mode,
    /// one engine for the whole request (`crate::plain`).
    pub fn regular(dp_size: u32) -> Self {
        EngineConfig {
            role: Role::Regular,
            dp_size,
            ..Default::default()
        }
    }

    /// DP size, at least 1.
    pub fn dp(&self) -> u32 {
        self.dp_size.max(1)
    }

    /// The prefill's compute time for a prompt of `tokens` uncached tokens, under `faults`.
    pub fn prefill_time(&self, tokens: u32, faults: &Faults) -> Duration {
        let per_token = self.prefill_per_token.saturating_mul(tokens);
        faults.slowed(self.prefill_delay.saturating_add(per_token))
    }

    /// The prefix cache capacity per DP rank of this engine's role, in tokens (0: none; a
    /// plain engine has none).
    pub fn prefix_cache_tokens(&self) -> u64 {
        match self.role {
            Role::Prefill => self.prefill_prefix_cache_tokens,
            Role::Decode => self.decode_prefix_cache_tokens,
            Role::Regular => 0,
        }
    }

    /// Whether the prefill places rooms by `room % dp`.
    pub fn follows_room(&self) -> bool {
        self.load_balance_method == "follow_bootstrap_room"
    }
}
