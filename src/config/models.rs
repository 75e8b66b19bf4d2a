//! `[models]`: how a request's `model` finds its workers (see `crate::models`): aliases,
//! the default model of SGLang's `/generate`, and strict matching; and the regular
//! (non-PD) workers' part: whether a model falls back to them when its PD pairs are all
//! unroutable. The model each worker serves is learned from its engine (`/server_info`),
//! or set per worker (`model = "..."` in `[[prefill]]` / `[[decode]]` / `[[worker]]`).
//!
//! `[models.settings."NAME"]` gives one model its own policies, admission limits, retries
//! and breaker thresholds: each sub-table is a partial override laid over the top-level
//! section of the same name (defaults stay in those sections' types), validated as the
//! top level is, with the model named in the error; and its short-prompt bypass
//! (`short_prompt_tokens`: prompts shorter than that go to a regular worker of the model).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{
    invalid, AdmissionConfig, BreakerConfig, Config, ConfigError, PolicyConfig, PolicyKind,
    RetryConfig,
};

/// The most aliases (a bound on what a request's lookup and `/v1/models` walk).
pub const MAX_ALIASES: usize = 4096;
/// The longest model name or alias, in bytes.
pub const MAX_NAME_BYTES: usize = 512;

/// A regular (non-PD) engine: `[[worker]]`, or `--worker URL`. It runs whole requests
/// (SGLang's default mode, `--disaggregation-mode null`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegularWorkerConfig {
    pub url: String,
    /// The model clients name for this engine. Unset: what its `/server_info` reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

/// Checks the `[[worker]]` entries.
pub(super) fn check_regular_workers(workers: &[RegularWorkerConfig]) -> Result<(), ConfigError> {
    for (i, w) in workers.iter().enumerate() {
        if let Err(e) = crate::url::parse_base_url(&w.url) {
            return Err(invalid(format!("worker[{i}].url {:?}: {e}", w.url)));
        }
        check_worker_model(&format!("worker[{i}].model"), w.model.as_deref())?;
    }
    Ok(())
}

fn default_true() -> bool {
    true
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelsConfig {
    /// The model a request names no model for (SGLang's `/generate`): unset, the only
    /// model served (with several, such a request is refused).
    pub default: Option<String>,
    /// With one model served and no aliases, any `model` value routes to it (SGLang
    /// engines ignore the name) unless this is set: then only its name (or an alias) does.
    pub strict: bool,
    /// Names clients use → the model served (`"gpt-4o" = "Qwen/Qwen3-8B"`).
    pub aliases: BTreeMap<String, String>,
    /// Per served model: policies, admission limits, retries and breaker thresholds that
    /// differ from the top level's (`[models.settings."NAME".retry]`, ...), and the
    /// short-prompt bypass.
    pub settings: BTreeMap<String, ModelSettings>,
    /// A model served by PD pairs and regular workers sends its requests to its regular
    /// workers while none of its PD pairs is routable (default on); off, such a request
    /// answers 503 like a model without regular workers.
    #[serde(default = "default_true")]
    pub regular_fallback: bool,
}

impl Default for ModelsConfig {
    fn default() -> Self {
        ModelsConfig {
            default: None,
            strict: false,
            aliases: BTreeMap::new(),
            settings: BTreeMap::new(),
            regular_fallback: true,
        }
    }
}

impl ModelsConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.aliases.len() > MAX_ALIASES {
            return Err(invalid(format!(
                "models.aliases has {} entries; at most {MAX_ALIASES}",
                self.aliases.len()
            )));
        }
        let name_ok = |n: &str| !n.trim().is_empty() && n.len() <= MAX_NAME_BYTES;
        if let Some(d) = &self.default {
            if !name_ok(d) {
                return Err(invalid(format!(
                    "models.default {d:?}: must be a non-empty name of at most {MAX_NAME_BYTES} bytes"
                )));
            }
        }
        for (alias, target) in &self.aliases {
            if !name_ok(alias) || !name_ok(target) {
                return Err(invalid(format!(
                    "models.aliases {alias:?} = {target:?}: both must be non-empty names of at most {MAX_NAME_BYTES} bytes"
                )));
            }
            if self.aliases.contains_key(target) {
                return Err(invalid(format!(
                    "models.aliases {alias:?} = {target:?}: an alias must name a model, not another alias"
                )));
            }
        }
        Ok(())
    }
}

/// Checks a worker's `model` override (`what` names the key).
pub(super) fn check_worker_model(what: &str, model: Option<&str>) -> Result<(), ConfigError> {
    match model {
        Some(m) if m.trim().is_empty() || m.len() > MAX_NAME_BYTES => Err(invalid(format!(
            "{what} {m:?}: must be a non-empty name of at most {MAX_NAME_BYTES} bytes"
        ))),
        _ => Ok(()),
    }
}

/// The most entries of `[models.settings]`.
pub const MAX_SETTINGS: usize = 1024;
/// The longest prompt `short_prompt_tokens` may name.
pub const MAX_SHORT_PROMPT_TOKENS: u32 = 1 << 20;

/// Declares a partial override of a top-level section: every field optional, unknown keys
/// refused, and [`over`](PolicyOverride::over) laying the given fields over the top level's.
macro_rules! overlay {
    ($(#[$m:meta])* $name:ident over $full:ty { $($(#[$fm:meta])* $f:ident : $t:ty,)* }) => {
        $(#[$m])*
        #[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
        #[serde(default, deny_unknown_fields)]
        pub struct $name {
            $(
                $(#[$fm])*
                #[serde(skip_serializing_if = "Option::is_none")]
                pub $f: Option<$t>,
            )*
        }

        impl $name {
            /// The top level's section with this override's fields laid over it.
            pub fn over(&self, top: &$full) -> $full {
                let mut out = top.clone();
                $(if let Some(v) = &self.$f {
                    out.$f = v.clone();
                })*
                out
            }
        }
    };
}

overlay! {
    /// `[models.settings."NAME".policy]`: the model's own selection policies (its own
    /// round-robin positions and cache-aware rings). `load_poll_interval_ms` stays global.
    PolicyOverride over PolicyConfig {
        prefill: PolicyKind,
        decode: PolicyKind,
        cache_aware_balance_factor: f64,
        cache_aware_slack: u32,
        cache_aware_vnodes: u32,
    }
}

overlay! {
    /// `[models.settings."NAME".admission]`: the model's own in-flight cap and wait queue,
    /// taken once the request's model is known, on top of the replica-wide `[admission]`.
    /// The byte budget (`max_bytes_in_flight`) stays replica-wide.
    AdmissionOverride over AdmissionConfig {
        max_in_flight: usize,
        max_queue: usize,
        queue_timeout_ms: u64,
    }
}

overlay! {
    /// `[models.settings."NAME".retry]`: the model's retries, stream moves and its own
    /// retry budget.
    RetryOverride over RetryConfig {
        max_retries: u32,
        budget_ratio: f64,
        budget_min_reserve: u32,
        budget_move_reserve: u32,
        max_stream_moves: u32,
        mid_stream_gap_ceiling_ms: u64,
        move_wait_ms: u64,
    }
}

overlay! {
    /// `[models.settings."NAME".breaker]`: the breaker thresholds of the model's workers.
    BreakerOverride over BreakerConfig {
        failure_threshold: u32,
        open_ms: u64,
        max_open_ms: u64,
        max_ejection_ratio: f64,
    }
}

/// `[models.settings."NAME"]`: one served model's settings (NAME as the engines serve it,
/// i.e. an alias's target, not the alias). Each sub-table is a partial override of the
/// top-level section of the same name; a model without one uses the top level's (and
/// shares its state: policies, retry budget, admission).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelSettings {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy: Option<PolicyOverride>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub admission: Option<AdmissionOverride>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry: Option<RetryOverride>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub breaker: Option<BreakerOverride>,
    /// Prompts shorter than this (in tokens) go to a regular worker of the model; used by
    /// regular workers (unset: every prompt is disaggregated).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub short_prompt_tokens: Option<u32>,
}

/// A model's effective sections: the top level's with the model's overrides laid over.
#[derive(Clone, Debug, PartialEq)]
pub struct Effective {
    pub policy: PolicyConfig,
    pub admission: AdmissionConfig,
    pub retry: RetryConfig,
    pub breaker: BreakerConfig,
}

impl ModelSettings {
    /// The model's policy settings, when it overrides them.
    pub fn policy(&self, top: &Config) -> Option<PolicyConfig> {
        self.policy.as_ref().map(|o| o.over(&top.policy))
    }
    /// The model's admission limits, when it overrides them.
    pub fn admission(&self, top: &Config) -> Option<AdmissionConfig> {
        self.admission.as_ref().map(|o| o.over(&top.admission))
    }
    /// The model's retry settings, when it overrides them.
    pub fn retry(&self, top: &Config) -> Option<RetryConfig> {
        self.retry.as_ref().map(|o| o.over(&top.retry))
    }
    /// The model's breaker settings, when it overrides them.
    pub fn breaker(&self, top: &Config) -> Option<BreakerConfig> {
        self.breaker.as_ref().map(|o| o.over(&top.breaker))
    }

    /// Every section as the model runs with it.
    pub fn effective(&self, top: &Config) -> Effective {
        Effective {
            policy: self.policy(top).unwrap_or_else(|| top.policy.clone()),
            admission: self.admission(top).unwrap_or_else(|| top.admission.clone()),
            retry: self.retry(top).unwrap_or_else(|| top.retry.clone()),
            breaker: self.breaker(top).unwrap_or_else(|| top.breaker.clone()),
        }
    }
}

/// Checks `[models.settings]` once the rest of `cfg` passed: each key a model name (not
/// an alias), each model's effective sections within the same ranges as the top level's
/// (the error names the model, then the key, the value and the range).
pub(super) fn validate_settings(cfg: &Config) -> Result<(), ConfigError> {
    let settings = &cfg.models.settings;
    if settings.is_empty() {
        return Ok(());
    }
    if settings.len() > MAX_SETTINGS {
        return Err(invalid(format!(
            "models.settings has {} entries; at most {MAX_SETTINGS}",
            settings.len()
        )));
    }
    // The top level passed: its worker lists need no second look per model.
    let mut scratch = Config {
        prefill: Vec::new(),
        decode: Vec::new(),
        ..cfg.clone()
    };
    scratch.models.settings.clear();
    for (name, s) in settings {
        if name.trim().is_empty() || name.len() > MAX_NAME_BYTES {
            return Err(invalid(format!(
                "models.settings {name:?}: must be a non-empty name of at most {MAX_NAME_BYTES} bytes"
            )));
        }
        if let Some(target) = cfg.models.aliases.get(name) {
            return Err(invalid(format!(
                "models.settings {name:?} names an alias: settings go under the model it names ({target:?})"
            )));
        }
        if let Some(n) = s.short_prompt_tokens {
            super::range(
                &format!("models.settings.{name:?}.short_prompt_tokens"),
                n,
                1,
                MAX_SHORT_PROMPT_TOKENS,
            )?;
        }
        let e = s.effective(cfg);
        scratch.policy = e.policy;
        scratch.admission = e.admission;
        scratch.retry = e.retry;
        scratch.breaker = e.breaker;
        scratch.validate().map_err(|err| match err {
            ConfigError::Invalid(m) => invalid(format!("models.settings.{name:?}: {m}")),
            other => other,
        })?;
    }
    Ok(())
}

#[cfg(test)]
#[path = "models_tests.rs"]
mod tests;
