//! Reading a `/v1/loads` (or `/get_load`) body: its per-DP-rank entries and their numbers.
//! Shared by the parts of the poll that read different figures from one body (decode
//! capacity in `capacity`, prefill backlog in `backlog`, load in `load`).
//!
//! Invariants: never panics; a number is a non-negative integer or a finite non-negative
//! float (rounded), anything else is absent; an entry's rank is its `dp_rank`, else its
//! position in the list.

use serde_json::Value;

/// A count in `v`: a non-negative integer, or a finite non-negative float rounded.
pub fn count(v: Option<&Value>) -> Option<u64> {
    let v = v?;
    v.as_u64().or_else(|| {
        v.as_f64()
            .filter(|f| f.is_finite() && *f >= 0.0)
            .map(|f| f.round() as u64)
    })
}

/// `f` of each per-rank entry of a load body (`{"loads": [...]}`, a bare list, or one
/// entry), with the entry's rank; empty when the body has none (e.g. the old
/// `{"load": n}`) or is not JSON.
pub fn per_rank<T>(body: &[u8], f: impl Fn(&Value) -> T) -> Vec<(usize, T)> {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return Vec::new();
    };
    let list = match &v {
        Value::Array(a) => a.as_slice(),
        Value::Object(o) => match o.get("loads") {
            Some(Value::Array(a)) => a.as_slice(),
            _ if o.contains_key("num_running_reqs") || o.contains_key("num_reqs") => {
                std::slice::from_ref(&v)
            }
            _ => return Vec::new(),
        },
        _ => return Vec::new(),
    };
    list.iter()
        .enumerate()
        .map(|(i, e)| {
            let rank = count(e.get("dp_rank"))
                .and_then(|r| usize::try_from(r).ok())
                .unwrap_or(i);
            (rank, f(e))
        })
        .collect()
}
