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
    /// A decode's own prefix cache (SGLang's `--disaggregation-decode-enable-radix-cache`,
    /// PRs #19746 and #26288): it receives only the KV its rank lacks, so decode-side
    /// affinity saves transfer time. Reported by `pdgate check`.
    #[serde(default)]
    pub disaggregation_decode_enable_radix_cache: Option<bool>,
    /// `--disable-radix-cache`: no prefix cache at all on this engine.
    #[serde(default)]
    pub disable_radix_cache: Option<bool>,
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
    /// The name clients use (`--served-model-name`; SGLang defaults it to the model path).
    #[serde(default, deserialize_with = "text")]
    pub served_model_name: Option<String>,
    /// The weights loaded (`--model-path`).
    #[serde(default, deserialize_with = "text")]
    pub model_path: Option<String>,
    /// The weights' version (`--weight-version`, changed by weight updates).
    #[serde(default, deserialize_with = "text")]
    pub weight_version: Option<String>,
    /// Speculative decoding: the algorithm and its shape (prefill and decode must agree).
    #[serde(default, deserialize_with = "text")]
    pub speculative_algorithm: Option<String>,
    #[serde(default, deserialize_with = "text")]
    pub speculative_num_steps: Option<String>,
    #[serde(default, deserialize_with = "text")]
    pub speculative_eagle_topk: Option<String>,
    #[serde(default, deserialize_with = "text")]
    pub speculative_num_draft_tokens: Option<String>,
}

/// What a prefill and a decode must agree on for a KV handoff: the served name, the
/// weights (path and version), the KV page size and dtype, the transfer backend and the
/// speculative-decoding settings. Workers with one key form a *group*; a prefill pairs
/// only with a decode of a [compatible](HandoffKey::compatible) key. A fact an engine does
/// not report is `None` and is not compared (as the layout-mismatch check does).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HandoffKey {
    /// The model clients name: the operator's override, else `served_model_name`, else
    /// `model_path`.
    pub model: Option<String>,
    pub model_path: Option<String>,
    pub weight_version: Option<String>,
    pub page_size: Option<u64>,
    pub kv_cache_dtype: Option<String>,
    pub transfer_backend: Option<String>,
    /// `algorithm/steps/topk/draft_tokens`, when an algorithm is set.
    pub speculative: Option<String>,
}

impl HandoffKey {
    /// Whether a prefill of one key may hand its KV to a decode of the other: every fact
    /// both report is equal.
    pub fn compatible(&self, other: &HandoffKey) -> bool {
        fn same<T: PartialEq>(a: &Option<T>, b: &Option<T>) -> bool {
            match (a, b) {
                (Some(a), Some(b)) => a == b,
                _ => true,
            }
        }
        same(&self.model, &other.model)
            && same(&self.model_path, &other.model_path)
            && same(&self.weight_version, &other.weight_version)
            && same(&self.page_size, &other.page_size)
            && same(&self.kv_cache_dtype, &other.kv_cache_dtype)
            && same(&self.transfer_backend, &other.transfer_backend)
            && same(&self.speculative, &other.speculative)
    }

    /// The key of an engine from its server info (unknown yet: `None`) and the operator's
    /// model name for it, if any.
    pub fn of(info: Option<&ServerInfo>, model_override: Option<&str>) -> HandoffKey {
        let Some(i) = info else {
            return HandoffKey {
                model: model_override.map(str::to_string),
                ..HandoffKey::default()
            };
        };
        let spec = i
            .speculative_algorithm
            .as_deref()
            .filter(|a| !a.is_empty() && !a.eq_ignore_ascii_case("none"))
            .map(|a| {
                let f = |v: &Option<String>| v.clone().unwrap_or_default();
                format!(
                    "{a}/{}/{}/{}",
                    f(&i.speculative_num_steps),
                    f(&i.speculative_eagle_topk),
                    f(&i.speculative_num_draft_tokens)
                )
            });
        HandoffKey {
            model: model_override
                .map(str::to_string)
                .or_else(|| i.served_model_name.clone())
                .or_else(|| i.model_path.clone()),
            model_path: i.model_path.clone(),
            weight_version: i.weight_version.clone(),
            page_size: i.page_size,
            kv_cache_dtype: i.kv_cache_dtype.clone(),
            transfer_backend: i.disaggregation_transfer_backend.clone(),
            speculative: spec,
        }
    }
}

/// A fact read as text, leniently: a string as is, a number or bool as written, anything
/// else (null, a list, an object) as unknown; never a refused `/server_info`.
fn text<'de, D>(d: D) -> Result<Option<String>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    let v = serde_json::Value::deserialize(d)?;
    Ok(match v {
        serde_json::Value::String(s) => Some(s),
        serde_json::Value::Number(n) => Some(n.to_string()),
        serde_json::Value::Bool(b) => Some(b.to_string()),
        _ => None,
    })
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
