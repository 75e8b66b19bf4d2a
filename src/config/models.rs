//! `[models]`: how a request's `model` finds its workers (see `crate::models`): aliases,
//! the default model of SGLang's `/generate`, and strict matching. The model each worker
//! serves is learned from its engine (`/server_info`), or set per worker (`model = "..."`
//! in `[[prefill]]` / `[[decode]]`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{invalid, ConfigError};

/// The most aliases (a bound on what a request's lookup and `/v1/models` walk).
pub const MAX_ALIASES: usize = 4096;
/// The longest model name or alias, in bytes.
pub const MAX_NAME_BYTES: usize = 512;

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
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
