//! Many models behind one front door: which workers a request's `model` may use, and the
//! list of models pdgate serves (`GET /v1/models`).
//!
//! Each worker's model comes from its engine (`/server_info`: `served_model_name`, else
//! `model_path`) or from the operator (a worker's `model` in the config or the admin API);
//! the pool groups workers by their [`crate::engine::HandoffKey`] and lists the groups by
//! model (`pool::groups`). This module only names: a request resolves once, at the start of
//! its dispatch, to a model of the snapshot (or to "any", while one group serves all), and
//! the pair is then picked within that model, the decode within the prefill's group.
//!
//! Rules (`[models]`):
//! - One handoff group, no aliases, not `strict`: nothing is looked up (any `model` value,
//!   or none, is served by the one group; SGLang engines ignore the name).
//! - One model served (maybe in several groups), no aliases, not `strict`: any value routes
//!   to it.
//! - Otherwise the name is looked up: a model served, else an alias, else the base of
//!   `base:adapter` (SGLang's LoRA naming; the value is forwarded unchanged). A request
//!   naming no model takes `models.default`, else the only model served. An unknown name
//!   answers 404 `model_not_found` (naming nothing internal); a known model without a
//!   routable worker answers 503 when its pair is picked.

use std::borrow::Cow;
use std::sync::Arc;

use crate::config::ModelsConfig;
use crate::error::{FailReason, Failure};
use crate::pool::{Pool, Snapshot};

/// The most bytes of a client's model name repeated in an error message.
const ECHO_BYTES: usize = 256;

/// The model a request may be served by: `Ok(None)` for any worker (one handoff group,
/// nothing to match), `Ok(Some(name))` for that model's workers.
/// `requested` reads the request's `model` only when a name matters.
pub fn resolve<'r>(
    cfg: &ModelsConfig,
    pool: &Pool,
    requested: impl FnOnce() -> Option<Cow<'r, str>>,
) -> Result<Option<Arc<str>>, Failure> {
    let snap = pool.load();
    // Regular workers sit in no handoff group: a second model they serve makes a name matter.
    if !cfg.strict && cfg.aliases.is_empty() && snap.groups.len() <= 1 && snap.models.len() <= 1 {
        return Ok(None);
    }
    resolve_in(cfg, &snap, requested().as_deref())
}

/// [`resolve`] against one snapshot.
pub fn resolve_in(
    cfg: &ModelsConfig,
    snap: &Snapshot,
    requested: Option<&str>,
) -> Result<Option<Arc<str>>, Failure> {
    let loose = !cfg.strict && cfg.aliases.is_empty();
    if loose {
        match snap.models.as_slice() {
            // No engine named a model yet: the decode still comes from the prefill's group.
            [] => return Ok(None),
            [only] => return Ok(Some(only.name.clone())),
            _ => {}
        }
    }
    let name = match requested {
        Some(n) => n,
        None => match (&cfg.default, snap.models.as_slice()) {
            (Some(d), _) => d.as_str(),
            (None, [only]) => return Ok(Some(only.name.clone())),
            (None, _) => {
                return Err(Failure::new(
                    FailReason::InvalidRequest,
                    "'model' is required: several models are served (see GET /v1/models)",
                ))
            }
        },
    };
    if let Some(m) = lookup(cfg, snap, name) {
        return Ok(Some(m));
    }
    if let Some((base, _adapter)) = name.split_once(':') {
        if let Some(m) = lookup(cfg, snap, base) {
            return Ok(Some(m));
        }
    }
    Err(not_found(name))
}

/// A model served under `name` or its alias; a configured name nobody serves now (an
/// alias's target, the default) is still known: its requests get 503, not 404.
fn lookup(cfg: &ModelsConfig, snap: &Snapshot, name: &str) -> Option<Arc<str>> {
    if let Some(m) = snap.model(name) {
        return Some(m.name.clone());
    }
    let target = cfg
        .aliases
        .get(name)
        .map(String::as_str)
        .or_else(|| (cfg.default.as_deref() == Some(name)).then_some(name))?;
    Some(
        snap.model(target)
            .map_or_else(|| Arc::from(target), |m| m.name.clone()),
    )
}

/// The name a request's legs carry instead of the client's, when the client named an alias
/// (`resolved` is the model it resolved to): the served name, keeping a LoRA adapter
/// (`alias:adapter` → `model:adapter`). `None` for every other name (a served name,
/// `base:adapter` of a served base, any name in the loose single-model case): the engine
/// gets it unchanged. SGLang parses `model` for `base:adapter` and otherwise echoes it in
/// its answers, so an engine sees a name it serves and the answer names the model served
/// (as OpenAI answers an alias with the model behind it).
pub fn leg_name(cfg: &ModelsConfig, requested: &str, resolved: &str) -> Option<String> {
    if cfg.aliases.is_empty() || requested == resolved {
        return None;
    }
    if cfg.aliases.contains_key(requested) {
        return Some(resolved.to_string());
    }
    let (base, adapter) = requested.split_once(':')?;
    cfg.aliases
        .contains_key(base)
        .then(|| format!("{resolved}:{adapter}"))
}

fn not_found(name: &str) -> Failure {
    let mut shown = name;
    if shown.len() > ECHO_BYTES {
        let mut end = ECHO_BYTES;
        while !shown.is_char_boundary(end) {
            end -= 1;
        }
        shown = &shown[..end];
    }
    Failure::new(
        FailReason::ModelNotFound,
        format!("The model `{shown}` does not exist."),
    )
}

/// `GET /v1/models` in OpenAI's shape: every model served (by any worker, in any state),
/// then every alias whose model is served.
pub fn list(cfg: &ModelsConfig, snap: &Snapshot, created: u64) -> serde_json::Value {
    let root = |name: &str| {
        snap.model(name)
            .and_then(|m| m.groups.first())
            .and_then(|g| snap.groups.get(*g))
            .and_then(|g| g.key.model_path.clone())
    };
    let mut data: Vec<serde_json::Value> = snap
        .models
        .iter()
        .map(|m| {
            serde_json::json!({
                "id": &*m.name,
                "object": "model",
                "created": created,
                "owned_by": "sglang",
                "root": root(&m.name),
                "parent": null,
            })
        })
        .collect();
    for (alias, target) in &cfg.aliases {
        if snap.model(alias).is_none() && snap.model(target).is_some() {
            data.push(serde_json::json!({
                "id": alias,
                "object": "model",
                "created": created,
                "owned_by": "sglang",
                "root": root(target),
                "parent": target,
            }));
        }
    }
    serde_json::json!({"object": "list", "data": data})
}

/// Per model, for `/readiness`: whether it can take a request now (a routable prefill in a
/// handoff group with a routable decode, or a routable regular worker), its routable ranks
/// and its workers. Names and
/// counts only (the model names are the ones `/v1/models` lists).
pub fn readiness(snap: &Snapshot) -> serde_json::Value {
    let ranks = |l: &[crate::pool::Routable]| l.iter().map(|r| r.ranks.len()).sum::<usize>();
    let models: Vec<serde_json::Value> = snap
        .models
        .iter()
        .map(|m| {
            serde_json::json!({
                "model": &*m.name,
                "ready": !m.prefill_routable.is_empty() || !m.regular_routable.is_empty(),
                "handoff_groups": m.groups.len(),
                "routable_prefill_ranks": ranks(&m.prefill_routable),
                "routable_decode_ranks": ranks(&m.decode_routable),
                "prefill_workers": m.workers[0],
                "decode_workers": m.workers[1],
                "regular_workers": m.workers[2],
                "routable_regular_ranks": ranks(&m.regular_routable),
            })
        })
        .collect();
    serde_json::Value::Array(models)
}

#[cfg(test)]
mod tests;
