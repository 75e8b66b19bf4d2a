//! The model facts every prefill/decode pair must share, from each engine's `/server_info`:
//! the model (`served_model_name`, else `model_path`), the context length, and the TP size
//! (reported, not required to match: SGLang's transfer backends pair different TP sizes).
//!
//! Many models behind one router (each pair serving one) are fine: a prefill needs a decode
//! of its own model and a decode a prefill of its own, and the context length is compared
//! within a model only. A fact an engine does not report is not compared.

use std::time::Duration;

use serde_json::Value;

use super::{Check, EngineProbe, FLEET};
use crate::types::Role;
use crate::upstream::{BaseUrl, Upstream};

/// What one engine's `/server_info` says of its model.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Facts {
    /// `served_model_name`, else `model_path`.
    pub model: Option<String>,
    pub context_length: Option<u64>,
    pub tp_size: Option<u64>,
}

impl Facts {
    /// Reads them (`/server_info`, else `/get_server_info`); all unknown when neither answers.
    pub(super) async fn read(up: &Upstream, url: &BaseUrl, timeout: Duration) -> Facts {
        for path in ["/server_info", "/get_server_info"] {
            if let Ok((s, body)) = up.get(url, path, timeout).await {
                if s.is_success() {
                    if let Ok(v) = serde_json::from_slice::<Value>(&body) {
                        return Facts::from_json(&v);
                    }
                }
            }
        }
        Facts::default()
    }

    fn from_json(v: &Value) -> Facts {
        let text = |k: &str| {
            v.get(k)
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
        };
        Facts {
            model: text("served_model_name").or_else(|| text("model_path")),
            context_length: v.get("context_length").and_then(Value::as_u64),
            tp_size: v.get("tp_size").and_then(Value::as_u64),
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
    vec![
        model(&prefills, &decodes),
        context(&prefills, &decodes),
        tp(&prefills, &decodes),
    ]
}

/// Every prefill has a decode of its model, and every decode a prefill of its.
fn model(prefills: &[(&str, &Facts)], decodes: &[(&str, &Facts)]) -> Check {
    let name = "model";
    let known = |xs: &[(&str, &Facts)]| xs.iter().any(|(_, f)| f.model.is_some());
    if !known(prefills) || !known(decodes) {
        return Check::pass(
            FLEET,
            name,
            "model: not reported by both a prefill and a decode, not compared",
        );
    }
    let mut alone = Vec::new();
    for (mine, theirs, role, other) in [
        (prefills, decodes, "prefill", "decode"),
        (decodes, prefills, "decode", "prefill"),
    ] {
        for (t, f) in mine {
            let Some(m) = &f.model else { continue };
            if !theirs
                .iter()
                .any(|(_, g)| g.model.as_ref().is_none_or(|x| x == m))
            {
                alone.push(format!("{role} {t} serves {m}, which no {other} serves"));
            }
        }
    }
    if !alone.is_empty() {
        return Check::fail(
            FLEET,
            name,
            alone.join("; "),
            "a prefill's KV is only usable by a decode of the same model: start both with the \
             same --model-path (and --served-model-name), or list the engine in its own \
             model's pair",
        );
    }
    let mut seen: Vec<&str> = prefills
        .iter()
        .chain(decodes.iter())
        .filter_map(|(_, f)| f.model.as_deref())
        .collect();
    seen.sort_unstable();
    seen.dedup();
    Check::pass(
        FLEET,
        name,
        format!(
            "every prefill and decode has a peer of its model ({})",
            seen.join(", ")
        ),
    )
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
        }
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
            assert_eq!(model(&p, &d).ok, model_ok, "{p:?} {d:?}");
            assert_eq!(context(&p, &d).ok, ctx_ok, "{p:?} {d:?}");
            assert!(tp(&p, &d).ok);
        }
        let json = serde_json::json!({"model_path": "/m", "served_model_name": "", "context_length": 8, "tp_size": 2});
        assert_eq!(Facts::from_json(&json), f(Some("/m"), Some(8), Some(2)));
    }
}
