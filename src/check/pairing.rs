//! The model facts every prefill/decode pair must share, from each engine's `/server_info`:
//! the model (`served_model_name`, else `model_path`), the context length, and the TP size
//! (reported, not required to match: SGLang's transfer backends pair different TP sizes).
//!
//! Many models behind one router (each pair serving one) are fine: the `model` check is
//! reported per model. Within a model, engines are put in handoff groups by what a KV
//! handoff needs them to agree on ([`HandoffKey`]: the served name, model path, weight
//! version, page size, KV dtype, transfer backend, speculative settings), as the router
//! does; a model's ✓ lists its groups and which decodes each prefill may pair with, its ✗
//! names the model and each engine that has no compatible partner (the router would never
//! pick it). The context length is compared within a model only. A fact an engine does
//! not report is not compared.

use std::time::Duration;

use serde_json::Value;

use super::{Check, EngineProbe, FLEET};
use crate::engine::{HandoffKey, ServerInfo};
use crate::types::Role;
use crate::upstream::{BaseUrl, Upstream};

/// What one engine's `/server_info` says of its model.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Facts {
    /// `served_model_name`, else `model_path`.
    pub model: Option<String>,
    pub context_length: Option<u64>,
    pub tp_size: Option<u64>,
    /// Its handoff facts (`model` as above): engines pair only where these are compatible.
    pub key: HandoffKey,
}

impl Facts {
    /// Reads them (`/server_info`, else `/get_server_info`); all unknown when neither answers.
    /// `model` is the operator's name for the engine (config or pod annotation): it wins.
    pub(super) async fn read(
        up: &Upstream,
        url: &BaseUrl,
        timeout: Duration,
        model: Option<&str>,
    ) -> Facts {
        for path in ["/server_info", "/get_server_info"] {
            if let Ok((s, body)) = up.get(url, path, timeout).await {
                if s.is_success() {
                    if let Ok(v) = serde_json::from_slice::<Value>(&body) {
                        return Facts::from_json(&v, model);
                    }
                }
            }
        }
        let key = HandoffKey::of(None, model);
        Facts {
            model: key.model.clone(),
            key,
            ..Facts::default()
        }
    }

    fn from_json(v: &Value, model: Option<&str>) -> Facts {
        let text = |k: &str| {
            v.get(k)
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
        };
        let info = serde_json::from_value::<ServerInfo>(v.clone()).ok();
        let mut key = HandoffKey::of(info.as_ref(), model);
        key.model = model
            .map(str::to_string)
            .or_else(|| text("served_model_name"))
            .or_else(|| text("model_path"));
        Facts {
            model: key.model.clone(),
            context_length: v.get("context_length").and_then(Value::as_u64),
            tp_size: v.get("tp_size").and_then(Value::as_u64),
            key,
        }
    }
}

/// The model, context-length and TP checks.
pub(super) fn checks(probes: &[EngineProbe]) -> Vec<Check> {
    let of = |role: Role| -> Vec<(&str, &Facts)> {
        probes
            .iter()
            .filter(|p| p.role == role)
            .map(|p| (p.target.as_str(), &p.facts))
            .collect()
    };
    let (prefills, decodes) = (of(Role::Prefill), of(Role::Decode));
    let mut out = models(&prefills, &decodes);
    out.extend(regular_models(&of(Role::Regular)));
    out.push(context(&prefills, &decodes));
    out.push(tp(&prefills, &decodes));
    out
}

/// Per model (one `model` row each): every prefill has a decode it may hand its KV to,
/// and every decode a prefill; the ✓ lists the model's handoff groups and its pairs.
fn models(prefills: &[(&str, &Facts)], decodes: &[(&str, &Facts)]) -> Vec<Check> {
    let name = "model";
    let known = |xs: &[(&str, &Facts)]| xs.iter().any(|(_, f)| f.model.is_some());
    if !known(prefills) || !known(decodes) {
        return vec![Check::pass(
            FLEET,
            name,
            "model: not reported by both a prefill and a decode, not compared",
        )];
    }
    let mut names: Vec<&str> = prefills
        .iter()
        .chain(decodes.iter())
        .filter_map(|(_, f)| f.model.as_deref())
        .collect();
    names.sort_unstable();
    names.dedup();
    names
        .into_iter()
        .map(|m| one_model(m, prefills, decodes))
        .collect()
}

/// One `regular_model` row per model served by regular (non-PD) engines: they hand off
/// nothing, so there is nothing to pair; the row says which engines serve it.
fn regular_models(regulars: &[(&str, &Facts)]) -> Vec<Check> {
    let mut names: Vec<&str> = regulars
        .iter()
        .filter_map(|(_, f)| f.model.as_deref())
        .collect();
    names.sort_unstable();
    names.dedup();
    names
        .into_iter()
        .map(|m| {
            let engines: Vec<&str> = regulars
                .iter()
                .filter(|(_, f)| f.model.as_deref() == Some(m))
                .map(|(t, _)| *t)
                .collect();
            Check::pass(
                FLEET,
                "regular_model",
                format!(
                    "{m}: {} regular engine(s), each serving whole requests: {}",
                    engines.len(),
                    engines.join(", ")
                ),
            )
        })
        .collect()
}

/// The `model` row of model `m`.
fn one_model(m: &str, prefills: &[(&str, &Facts)], decodes: &[(&str, &Facts)]) -> Check {
    let mine = |xs: &[(&str, &Facts)]| -> Vec<(String, HandoffKey)> {
        xs.iter()
            .filter(|(_, f)| f.model.as_deref() == Some(m))
            .map(|(t, f)| (t.to_string(), f.key.clone()))
            .collect()
    };
    let (ps, ds) = (mine(prefills), mine(decodes));
    // The model's handoff groups, in first-seen order (prefills, then decodes).
    let mut groups: Vec<&HandoffKey> = Vec::new();
    for (_, k) in ps.iter().chain(ds.iter()) {
        if !groups.contains(&k) {
            groups.push(k);
        }
    }
    let group_of = |k: &HandoffKey| groups.iter().position(|g| *g == k).map_or(0, |i| i + 1);
    let partners = |k: &HandoffKey, others: &[(&str, &Facts)]| -> Vec<String> {
        others
            .iter()
            .filter(|(_, f)| f.key.compatible(k))
            .map(|(t, _)| t.to_string())
            .collect()
    };
    let mut alone = Vec::new();
    let mut pairs = Vec::new();
    for (t, k) in &ps {
        let ds = partners(k, decodes);
        if ds.is_empty() {
            alone.push(format!(
                "prefill {t} (group {}) has no compatible decode",
                group_of(k)
            ));
        } else {
            pairs.push(format!("prefill {t} → decode {}", ds.join(", ")));
        }
    }
    for (t, k) in &ds {
        if partners(k, prefills).is_empty() {
            alone.push(format!(
                "decode {t} (group {}) has no compatible prefill",
                group_of(k)
            ));
        }
    }
    let listed: Vec<String> = groups
        .iter()
        .enumerate()
        .map(|(i, k)| format!("group {} ({})", i + 1, describe(k)))
        .collect();
    if !alone.is_empty() {
        return Check::fail(
            FLEET,
            "model",
            format!(
                "{m}: {}; handoff groups: {}",
                alone.join("; "),
                listed.join(", ")
            ),
            format!(
                "a prefill's KV is only usable by a decode of the same model, weights (path and \
                 version), KV page size and dtype, transfer backend and speculative settings: \
                 start {m}'s missing role with the same settings, or name each engine's model \
                 (`model = ...` in its [[prefill]]/[[decode]] entry, the pod's model annotation)"
            ),
        );
    }
    Check::pass(
        FLEET,
        "model",
        format!(
            "{m}: {} handoff group(s): {}; pairs: {}",
            groups.len(),
            listed.join(", "),
            pairs.join("; ")
        ),
    )
}

/// A handoff group's facts, those reported.
fn describe(k: &HandoffKey) -> String {
    let mut f = Vec::new();
    if let Some(v) = &k.model_path {
        f.push(format!("path {v}"));
    }
    if let Some(v) = &k.weight_version {
        f.push(format!("weight_version {v}"));
    }
    if let Some(v) = k.page_size {
        f.push(format!("page_size {v}"));
    }
    if let Some(v) = &k.kv_cache_dtype {
        f.push(format!("kv_cache_dtype {v}"));
    }
    if let Some(v) = &k.transfer_backend {
        f.push(format!("backend {v}"));
    }
    if let Some(v) = &k.speculative {
        f.push(format!("speculative {v}"));
    }
    if f.is_empty() {
        "nothing reported".to_string()
    } else {
        f.join(", ")
    }
}

/// Within a model, prefills and decodes agree on the context length.
fn context(prefills: &[(&str, &Facts)], decodes: &[(&str, &Facts)]) -> Check {
    let name = "context_length";
    let mut differ = Vec::new();
    let mut compared = 0usize;
    for (p, pf) in prefills {
        for (d, df) in decodes {
            if pf.model.is_some() && df.model.is_some() && pf.model != df.model {
                continue;
            }
            if let (Some(a), Some(b)) = (pf.context_length, df.context_length) {
                compared += 1;
                if a != b {
                    differ.push(format!("prefill {p} {a} ≠ decode {d} {b}"));
                }
            }
        }
    }
    if !differ.is_empty() {
        return Check::fail(
            FLEET,
            name,
            format!("context length: {}", differ.join("; ")),
            "start every prefill and decode of a model with the same --context-length (a \
             prompt one side accepts, the other refuses after the prefill did its work)",
        );
    }
    if compared == 0 {
        return Check::pass(
            FLEET,
            name,
            "context length: not reported by both sides of a pair, not compared",
        );
    }
    Check::pass(
        FLEET,
        name,
        "context length agrees on every pair of a model",
    )
}

/// TP sizes, reported: a ✓ either way (different TP sizes are a supported setup).
fn tp(prefills: &[(&str, &Facts)], decodes: &[(&str, &Facts)]) -> Check {
    let list = |xs: &[(&str, &Facts)]| {
        let mut v: Vec<u64> = xs.iter().filter_map(|(_, f)| f.tp_size).collect();
        v.sort_unstable();
        v.dedup();
        v.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")
    };
    let (p, d) = (list(prefills), list(decodes));
    let detail = if p.is_empty() || d.is_empty() {
        "TP size: not reported by both a prefill and a decode".to_string()
    } else if p == d {
        format!("TP size {p} on prefills and decodes")
    } else {
        format!(
            "TP size {p} on prefills, {d} on decodes: SGLang pairs different TP sizes (the \
             KV is resharded), at some transfer cost"
        )
    };
    Check::pass(FLEET, "tp_size", detail)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(model: Option<&str>, ctx: Option<u64>, tp: Option<u64>) -> Facts {
        Facts {
            model: model.map(str::to_string),
            context_length: ctx,
            tp_size: tp,
            key: HandoffKey {
                model: model.map(str::to_string),
                ..HandoffKey::default()
            },
        }
    }

    fn all_ok(p: &[(&str, &Facts)], d: &[(&str, &Facts)]) -> bool {
        models(p, d).iter().all(|c| c.ok)
    }

    #[test]
    fn pairs_of_models() {
        let a = f(Some("a"), Some(4096), Some(1));
        let a_short = f(Some("a"), Some(2048), Some(2));
        let b = f(Some("b"), Some(2048), Some(1));
        let unknown = f(None, None, None);
        // (prefills, decodes, model ok, context ok)
        type Case<'a> = (
            Vec<(&'a str, &'a Facts)>,
            Vec<(&'a str, &'a Facts)>,
            bool,
            bool,
        );
        let table: Vec<Case> = vec![
            (vec![("p", &a)], vec![("d", &a)], true, true),
            (vec![("p", &a)], vec![("d", &b)], false, true),
            (
                vec![("p", &a), ("p2", &b)],
                vec![("d", &a), ("d2", &b)],
                true,
                true,
            ),
            (vec![("p", &a)], vec![("d", &a_short)], true, false),
            (vec![("p", &a)], vec![("d", &unknown)], true, true),
        ];
        for (p, d, model_ok, ctx_ok) in table {
            assert_eq!(all_ok(&p, &d), model_ok, "{p:?} {d:?}");
            assert_eq!(context(&p, &d).ok, ctx_ok, "{p:?} {d:?}");
            assert!(tp(&p, &d).ok);
        }
        let json = serde_json::json!({"model_path": "/m", "served_model_name": "", "context_length": 8, "tp_size": 2});
        let read = Facts::from_json(&json, None);
        assert_eq!(read.model.as_deref(), Some("/m"));
        assert_eq!((read.context_length, read.tp_size), (Some(8), Some(2)));
        assert_eq!(read.key.model_path.as_deref(), Some("/m"));
        let named = Facts::from_json(&json, Some("mine"));
        assert_eq!(named.model.as_deref(), Some("mine"));
    }

    /// One row per model; a model whose prefill has no decode of its weight version is a ✗
    /// naming it (and its group), the other model's row still a ✓ listing its pairs.
    #[test]
    fn per_model_rows_with_handoff_groups() {
        let v = |m: &str, w: &str| {
            Facts::from_json(
                &serde_json::json!({"served_model_name": m, "model_path": m, "weight_version": w}),
                None,
            )
        };
        let (a1, a2, b1) = (v("a", "v1"), v("a", "v2"), v("b", "v1"));
        let rows = models(
            &[("pa1", &a1), ("pa2", &a2), ("pb", &b1)],
            &[("da1", &a1), ("db", &b1)],
        );
        assert_eq!(rows.len(), 2, "{rows:?}");
        assert!(!rows[0].ok && rows[0].detail.starts_with("a: "), "{rows:?}");
        assert!(
            rows[0]
                .detail
                .contains("prefill pa2 (group 2) has no compatible decode")
                && rows[0].detail.contains("weight_version v2"),
            "{rows:?}"
        );
        assert!(rows[0]
            .fix
            .as_deref()
            .is_some_and(|f| f.contains("start a's")));
        assert!(rows[1].ok, "{rows:?}");
        assert!(
            rows[1].detail.contains("1 handoff group(s)")
                && rows[1].detail.contains("prefill pb → decode db"),
            "{rows:?}"
        );
        // Both versions with their decode: two groups, each prefill paired within its own.
        let rows = models(&[("pa1", &a1), ("pa2", &a2)], &[("da1", &a1), ("da2", &a2)]);
        assert!(rows[0].ok, "{rows:?}");
        assert!(
            rows[0].detail.contains("2 handoff group(s)")
                && rows[0].detail.contains("prefill pa1 → decode da1;")
                && rows[0].detail.contains("prefill pa2 → decode da2"),
            "{rows:?}"
        );
    }
}
