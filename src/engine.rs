//! What pdgate knows of an engine, as plain data: a prefill deployment's parallel layout
//! (from its bootstrap server's sentinel), the engine facts of `/server_info`, and the
//! bounds on them. A leaf: it imports nothing of the crate, so the pool, the bootstrap
//! tracker and the health checker can all hold these without importing each other.

use serde::Deserialize;

/// Which `GET /route` dialect a bootstrap server speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Generation {
    V1,
    V2,
    V3,
}

/// A prefill deployment's parallel layout, from the sentinel query.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    pub generation: Generation,
    pub dp_size: u32,
    pub attn_tp_size: u32,
    pub attn_cp_size: u32,
    pub pp_size: u32,
    /// True when the prefill places a room on `room % dp_size` (R4).
    pub follow_bootstrap_room: bool,
    pub page_size: Option<u64>,
    pub kv_cache_dtype: Option<String>,
}

/// The largest DP size pdgate accepts from an engine: DP sizes size per-rank vectors on
/// every snapshot rebuild, so an engine cannot make the router allocate without bound.
/// Real deployments run DP 1–64.
pub const MAX_DP_SIZE: u32 = 1024;

/// The engine facts pdgate uses from `/server_info` (or the older `/get_server_info`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct ServerInfo {
    #[serde(default)]
    pub disaggregation_mode: Option<String>,
    #[serde(default)]
    pub disaggregation_bootstrap_port: Option<u16>,
    #[serde(default)]
    pub dp_size: Option<u32>,
    #[serde(default)]
    pub page_size: Option<u64>,
    #[serde(default)]
    pub kv_cache_dtype: Option<String>,
    #[serde(default)]
    pub version: Option<String>,
    /// `mooncake`, `nixl`, ...: a prefill and a decode must use the same one.
    #[serde(default)]
    pub disaggregation_transfer_backend: Option<String>,
    /// A prefill's DP dispatch: `follow_bootstrap_room` places room R on rank `R % dp`
    /// (what `modulo` contract mode needs).
    #[serde(default)]
    pub load_balance_method: Option<String>,
    /// SGLang's `--incremental-streaming-output`: `/generate` streams what is new in each
    /// event instead of the whole text so far.
    #[serde(default)]
    pub incremental_streaming_output: Option<bool>,
    /// Per DP rank, the requests it runs at once
    /// (`internal_states[i].effective_max_running_requests_per_dp`; `None` where not
    /// reported). Read leniently: an unexpected shape yields an empty list, never a
    /// refused `/server_info`.
    #[serde(
        default,
        rename = "internal_states",
        deserialize_with = "max_running_per_dp"
    )]
    pub max_running_per_dp: Vec<Option<u64>>,
}

/// A count from JSON: a non-negative integer, or a finite non-negative float rounded.
fn count(v: &serde_json::Value) -> Option<u64> {
    v.as_u64().or_else(|| {
        v.as_f64()
            .filter(|f| f.is_finite() && *f >= 0.0)
            .map(|f| f.round() as u64)
    })
}

fn max_running_per_dp<'de, D>(d: D) -> Result<Vec<Option<u64>>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    let v = serde_json::Value::deserialize(d)?;
    let Some(list) = v.as_array() else {
        return Ok(Vec::new());
    };
    Ok(list
        .iter()
        .take(MAX_DP_SIZE as usize)
        .map(|e| {
            e.get("effective_max_running_requests_per_dp")
                .and_then(count)
        })
        .collect())
}
