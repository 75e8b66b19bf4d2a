//! `[models]`: how a request's `model` finds its workers (see `crate::models`): aliases,
//! the default model of SGLang's `/generate`, and strict matching; and the regular
//! (non-PD) workers' part: whether a model falls back to them when its PD pairs are all
//! unroutable, and the short-prompt bypass per model. The model each worker serves is
//! learned from its engine (`/server_info`), or set per worker (`model = "..."` in
//! `[[prefill]]` / `[[decode]]` / `[[worker]]`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{invalid, ConfigError};

/// The most aliases (a bound on what a request's lookup and `/v1/models` walk).
pub const MAX_ALIASES: usize = 4096;
/// The longest model name or alias, in bytes.
pub const MAX_NAME_BYTES: usize = 512;
/// The largest short-prompt threshold, in prompt tokens.
pub const MAX_SHORT_PROMPT_TOKENS: u32 = 1 << 20;

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
    /// A model served by PD pairs and regular workers sends its requests to its regular
    /// workers while none of its PD pairs is routable (default on); off, such a request
    /// answers 503 like a model without regular workers.
    #[serde(default = "default_true")]
    pub regular_fallback: bool,
    /// The short-prompt bypass, per model (`"NAME" = tokens`): a request whose prompt is
    /// shorter than this many tokens goes to a regular worker of its model (when one is
    /// routable) instead of a PD pair. Unset for a model: no bypass. Range 1..=2^20.
    pub short_prompt_tokens: BTreeMap<String, u32>,
}

impl Default for ModelsConfig {
    fn default() -> Self {
        ModelsConfig {
            default: None,
            strict: false,
            aliases: BTreeMap::new(),
            regular_fallback: true,
            short_prompt_tokens: BTreeMap::new(),
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
        if self.short_prompt_tokens.len() > MAX_ALIASES {
            return Err(invalid(format!(
                "models.short_prompt_tokens has {} entries; at most {MAX_ALIASES}",
                self.short_prompt_tokens.len()
            )));
        }
        for (model, n) in &self.short_prompt_tokens {
            if !name_ok(model) {
                return Err(invalid(format!(
                    "models.short_prompt_tokens {model:?}: must be a non-empty name of at most {MAX_NAME_BYTES} bytes"
                )));
            }
            if !(1..=MAX_SHORT_PROMPT_TOKENS).contains(n) {
                return Err(invalid(format!(
                    "models.short_prompt_tokens {model:?} = {n} is out of range 1..={MAX_SHORT_PROMPT_TOKENS}"
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
