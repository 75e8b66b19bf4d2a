//! What the admin API shows: worker ids as they appear in URLs, a worker as JSON, and the
//! effective config with its secrets redacted.
//!
//! Worker ids: `prefill-<n>` and `decode-<n>`. A [`WorkerId`] is only unique within its
//! role (each role counts from 0), so the role is part of the id; `n` is never reused in
//! its role, so a stale id names no worker rather than another one.

use serde_json::{json, Value};

use crate::pool::{RankReadiness, Snapshot, WorkerSource, WorkerView};
use crate::types::{Role, WorkerId};

/// A worker's id in the admin API: `prefill-3`, `decode-0`.
pub fn worker_ref(role: Role, id: WorkerId) -> String {
    id.reference(role)
}

/// The worker an id names (its form only: the worker may not exist).
pub fn parse_worker_ref(s: &str) -> Option<(Role, WorkerId)> {
    let (role, n) = s.split_once('-')?;
    let role = role.parse::<Role>().ok()?;
    if n.is_empty() || !n.bytes().all(|c| c.is_ascii_digit()) || (n.len() > 1 && n.starts_with('0'))
    {
        return None;
    }
    Some((role, WorkerId(n.parse().ok()?)))
}

fn source_json(s: &WorkerSource) -> Value {
    match s {
        WorkerSource::Static => json!({"kind": "static"}),
        WorkerSource::Admin => json!({"kind": "admin"}),
        WorkerSource::Discovered(p) => json!({
            "kind": "discovered",
            "namespace": p.namespace,
            "pod": p.name,
            "uid": p.uid,
        }),
    }
}

/// One worker as JSON.
pub fn worker_json(snap: &Snapshot, w: &WorkerView) -> Value {
    let routable = snap
        .routable(w.shared.role)
        .iter()
        .find(|r| r.worker == w.shared.id)
        .map(|r| r.ranks.as_slice())
        .unwrap_or(&[]);
    let dp = w.effective_dp();
    let ranks: Vec<Value> = (0..dp)
        .map(|k| {
            let mut r = json!({
                "rank": k,
                "routable": routable.contains(&k),
                "in_flight": w.in_flight(k),
                "engine_load": w.engine_load(k),
            });
            if w.shared.role == Role::Prefill {
                let st = w.facts.ranks.get(k as usize);
                r["bootstrap"] = json!(st.map_or("unknown", RankReadiness::label));
                if let Some(RankReadiness::Failed { reason, since }) = st {
                    r["bootstrap_failure"] = json!(reason.label());
                    r["failed_for_secs"] = json!(since.elapsed().as_secs_f64());
                }
            }
            r
        })
        .collect();
    let info = w.facts.info.as_ref().map(|i| {
        json!({
            "version": i.version,
            "dp_size": i.dp_size,
            "disaggregation_mode": i.disaggregation_mode,
            "transfer_backend": i.disaggregation_transfer_backend,
            "load_balance_method": i.load_balance_method,
        })
    });
    json!({
        "id": worker_ref(w.shared.role, w.shared.id),
        "role": w.shared.role.as_str(),
        "url": w.shared.url.as_str(),
        "source": source_json(&w.shared.source),
        "healthy": w.facts.healthy,
        "health_checked": w.facts.health_checked,
        "draining": w.facts.draining(),
        "leaving": w.facts.leaving(),
        "routable": !routable.is_empty(),
        "breaker": w.shared.breaker.state().label(),
        "refused": w.facts.refusal(),
        "dp_size": dp,
        "in_flight": w.in_flight_total(),
        "bootstrap": w.facts.bootstrap.as_ref().map(|b| json!({
            "url": b.url.as_str(),
            "port": b.port,
        })),
        "ranks": ranks,
        "server_info": info,
        "model": w.model.as_deref(),
        // Why it sits where it does: what it must share with a partner (see
        // `engine::HandoffKey`); it pairs only with workers of the same group.
        "handoff_group": snap.groups.get(w.group).map(|g| json!({
            "index": w.group,
            "model_path": g.key.model_path,
            "weight_version": g.key.weight_version,
            "page_size": g.key.page_size,
            "kv_cache_dtype": g.key.kv_cache_dtype,
            "transfer_backend": g.key.transfer_backend,
            "speculative": g.key.speculative,
        })),
    })
}

const REDACTED: &str = "<redacted>";

/// Whether a config key holds a secret: `api_key` and `*_api_key`, and a key whose last
/// word names a token, secret or password (`session_token`) — but not a path to one
/// (`*_file`), nor a setting that only mentions one (`first_token_ceiling_ms`,
/// `secrets_watch_ms`).
fn secret_key(k: &str) -> bool {
    let last = k.rsplit('_').next().unwrap_or(k);
    k == "api_key" || k.ends_with("_api_key") || ["token", "secret", "password"].contains(&last)
}

/// Replaces every secret in a config's JSON with `"<redacted>"` (unset ones stay `null`,
/// so that whether a secret is set still shows).
pub fn redact(v: &mut Value) {
    match v {
        Value::Object(m) => {
            for (k, x) in m.iter_mut() {
                if secret_key(k) && !x.is_null() {
                    *x = json!(REDACTED);
                } else {
                    redact(x);
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(redact),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_ids_round_trip_and_odd_ones_are_refused() {
        for (role, n) in [
            (Role::Prefill, 0),
            (Role::Decode, 17),
            (Role::Prefill, u32::MAX),
            (Role::Regular, 2),
        ] {
            let s = worker_ref(role, WorkerId(n));
            assert_eq!(parse_worker_ref(&s), Some((role, WorkerId(n))), "{s}");
        }
        for bad in [
            "prefill",
            "prefill-",
            "p3",
            "prefill-03",
            "prefill-x",
            "worker-1",
            "decode-+1",
            "decode-4294967296",
            "decode-1-2",
        ] {
            assert_eq!(parse_worker_ref(bad), None, "{bad}");
        }
    }

    #[test]
    fn secrets_are_redacted_and_paths_are_not() {
        let mut cfg = crate::config::Config::default();
        cfg.admin.api_key = Some("admin-secret".into());
        cfg.upstream.api_key = Some("engine-secret".into());
        cfg.auth.api_keys_file = Some("/etc/pdgate/keys".into());
        let mut v = serde_json::to_value(&cfg).unwrap();
        redact(&mut v);
        let text = v.to_string();
        assert!(
            !text.contains("admin-secret") && !text.contains("engine-secret"),
            "{text}"
        );
        // Settings that only mention a secret or a token are shown.
        assert_eq!(v["reload"]["secrets_watch_ms"], 2000, "{text}");
        assert!(v["progress"]["first_token_floor_ms"].is_number(), "{text}");
        assert_eq!(v["admin"]["api_key"], REDACTED);
        assert_eq!(v["upstream"]["api_key"], REDACTED);
        assert_eq!(v["admin"]["api_key_file"], Value::Null);
        assert_eq!(v["auth"]["api_keys_file"], "/etc/pdgate/keys");
        // Nested and unknown secrets too.
        let mut x = json!({"a": [{"session_token": "t", "password": null, "token_file": "/f"}]});
        redact(&mut x);
        assert_eq!(
            x,
            json!({"a": [{"session_token": REDACTED, "password": null, "token_file": "/f"}]})
        );
    }
}
