//! Parsing of generate requests (`/generate`, `/v1/chat/completions`,
//! `/v1/completions`) into independent *instances*, one per bootstrap room.
//!
//! Why: SGLang expands a batch (`text` list, `input_ids` list of lists,
//! `prompt` list) times `n` samples into `batch × n` requests, each with its
//! own room; the simulator must place and account each one separately.
//!
//! Invariants:
//! - Instances are sample-major: instance `k` is prompt `k % batch`, sample
//!   `k / batch` (SGLang's `j * batch + i`).
//! - A scalar room `R` expands to `R, R+1, …`; a room list must have one entry
//!   per instance, or one per prompt when `n > 1` (0.5.23 repeats it `n` times,
//!   so those rooms collide — detected as room reuse by the prefill).
//! - A scalar host / port is repeated; a list is taken per instance or per prompt.
//! - Parse errors carry SGLang's status and message ([`ReqError`]).

use serde_json::{Map, Value};

use crate::config::{EngineConfig, MAX_OUTPUT_TOKENS};
use crate::tokens::Context;

/// Which HTTP API a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Api {
    Generate,
    Chat,
    Completions,
}

impl Api {
    pub(crate) fn path(self) -> &'static str {
        match self {
            Api::Generate => "/generate",
            Api::Chat => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
        }
    }

    pub(crate) fn from_path(path: &str) -> Option<Api> {
        match path {
            "/generate" => Some(Api::Generate),
            "/v1/chat/completions" => Some(Api::Chat),
            "/v1/completions" => Some(Api::Completions),
            _ => None,
        }
    }
}

/// A request-level error: the body could not be turned into instances.
#[derive(Debug, Clone)]
pub(crate) struct ReqError {
    pub status: u16,
    pub message: String,
    /// FastAPI schema validation (not SGLang's own `ValueError`).
    pub schema: bool,
}

impl ReqError {
    fn value(message: impl Into<String>) -> Self {
        ReqError {
            status: 400,
            message: message.into(),
            schema: false,
        }
    }
    fn schema(message: impl Into<String>) -> Self {
        ReqError {
            status: 400,
            message: message.into(),
            schema: true,
        }
    }
}

/// One prompt × one sample.
#[derive(Debug, Clone)]
pub(crate) struct Instance {
    pub index: usize,
    pub rid: String,
    pub room: Option<u64>,
    pub host: Option<String>,
    pub port: Option<u16>,
    pub prompt_tokens: u32,
    pub prompt_ids: Vec<i64>,
    /// The prompt's token ids as the prefix caches key them (`crate::tokens`: a text or
    /// chat prompt's words; a token-id prompt's ids), as many as `prompt_tokens`; empty
    /// when the engine has no prefix cache (not worth computing then).
    pub prefix_ids: Vec<i64>,
    pub max_tokens: u32,
    /// The answer this instance gives, token by token (text, id), drawn from its context
    /// as received ([`crate::tokens`]).
    pub answer: Vec<(&'static str, i64)>,
}

impl Instance {
    /// Text of answer tokens `from..to`.
    pub(crate) fn text(&self, from: u32, to: u32) -> String {
        self.slice(from, to).iter().map(|t| t.0).collect()
    }

    /// Ids of answer tokens `from..to`.
    pub(crate) fn ids(&self, from: u32, to: u32) -> Vec<i64> {
        self.slice(from, to).iter().map(|t| t.1).collect()
    }

    fn slice(&self, from: u32, to: u32) -> &[(&'static str, i64)] {
        let to = (to as usize).min(self.answer.len());
        self.answer.get((from as usize).min(to)..to).unwrap_or(&[])
    }
}

/// A parsed generate request.
#[derive(Debug, Clone)]
pub(crate) struct ParsedRequest {
    pub api: Api,
    pub stream: bool,
    pub include_usage: bool,
    /// `stream_options.continuous_usage_stats`: usage on every chunk.
    pub continuous_usage: bool,
    pub return_logprob: bool,
    /// `logprob_start_len`: where the prompt's input logprobs start; `None` (SGLang's -1,
    /// the default) returns logprobs for output tokens only, as SGLang does.
    pub logprob_start: Option<usize>,
    pub model: String,
    pub routed_dp_rank: Option<i64>,
    pub disagg_prefill_dp_rank: Option<i64>,
    /// `/generate` answers a list (batch input or n > 1).
    pub is_batch: bool,
    /// Number of distinct prompts (instances `0..batch` are sample 0).
    pub batch: usize,
    pub instances: Vec<Instance>,
}

/// Prompt `i` as seen by the simulator.
struct Prompt {
    tokens: u32,
    ids: Vec<i64>,
    /// See [`Instance::prefix_ids`].
    prefix_ids: Vec<i64>,
    ctx: Context,
}

fn words(s: &str) -> u32 {
    (s.split_whitespace().count() as u32).max(1)
}

fn synthetic(tokens: u32) -> Vec<i64> {
    (0..i64::from(tokens)).map(|k| 1000 + (k % 30000)).collect()
}

fn ids_prompt(list: &[Value], cached: bool) -> Option<Prompt> {
    let ids: Option<Vec<i64>> = list.iter().map(Value::as_i64).collect();
    let ids = ids?;
    Some(Prompt {
        tokens: ids.len() as u32,
        ctx: Context::ids(&ids),
        prefix_ids: if cached { ids.clone() } else { Vec::new() },
        ids,
    })
}

fn text_prompt(s: &str, cached: bool) -> Prompt {
    let tokens = words(s);
    Prompt {
        tokens,
        ids: synthetic(tokens),
        prefix_ids: if cached {
            crate::tokens::text_ids(s)
        } else {
            Vec::new()
        },
        ctx: Context::text(s),
    }
}

fn content_words(v: &Value) -> u32 {
    match v {
        Value::String(s) => words(s),
        Value::Array(parts) => parts
            .iter()
            .map(|p| p.get("text").and_then(Value::as_str).map_or(0, words))
            .sum(),
        _ => 0,
    }
}

fn int_field(m: &Map<String, Value>, key: &str) -> Result<Option<i64>, ReqError> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_i64()
            .map(Some)
            .ok_or_else(|| ReqError::schema(format!("{key}: Input should be a valid integer"))),
    }
}

/// A token limit as SGLang checks it: absent or null takes the default; a negative or
/// non-integer limit is a 400 (SGLang's `SamplingParams.verify`: "must be at least 0"),
/// never a silent default.
fn cap_tokens(v: Option<&Value>, default: u32) -> Result<u32, ReqError> {
    match v {
        None | Some(Value::Null) => Ok(default),
        Some(x) => match x.as_u64() {
            Some(t) => Ok(t.min(u64::from(MAX_OUTPUT_TOKENS)) as u32),
            None => Err(ReqError::value(format!(
                "max_new_tokens must be at least 0, got {x}."
            ))),
        },
    }
}

/// Parses a generate request body. `dp_header` is `X-Data-Parallel-Rank`.
pub(crate) fn parse(
    api: Api,
    body: &[u8],
    dp_header: Option<&str>,
    cfg: &EngineConfig,
) -> Result<ParsedRequest, ReqError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ReqError::schema(format!("JSON decode error: {e}")))?;
    let Value::Object(m) = value else {
        return Err(ReqError::schema("Input should be a valid dictionary"));
    };
    let cached = cfg.prefix_cache_tokens() > 0;
    let (prompts, is_list_input, n, per_prompt_max): (Vec<Prompt>, bool, usize, Vec<u32>) =
        match api {
            Api::Generate => parse_generate_prompts(&m, cfg, cached)?,
            Api::Chat => {
                let Some(Value::Array(msgs)) = m.get("messages") else {
                    return Err(ReqError::schema("messages: Field required"));
                };
                let tokens: u32 = msgs
                    .iter()
                    .map(|msg| msg.get("content").map_or(0, content_words) + 4)
                    .sum();
                let max = m
                    .get("max_completion_tokens")
                    .filter(|v| !v.is_null())
                    .or_else(|| m.get("max_tokens"));
                let n = m.get("n").and_then(Value::as_u64).unwrap_or(1).max(1) as usize;
                let cont = m
                    .get("continue_final_message")
                    .and_then(Value::as_bool)
                    .unwrap_or(false);
                let p = Prompt {
                    tokens: tokens.max(1),
                    ids: synthetic(tokens.max(1)),
                    prefix_ids: if cached {
                        crate::tokens::chat_ids(msgs)
                    } else {
                        Vec::new()
                    },
                    ctx: Context::text(&crate::tokens::render_chat(msgs, cont)),
                };
                (
                    vec![p],
                    false,
                    n,
                    vec![cap_tokens(max, cfg.default_output_tokens)?],
                )
            }
            Api::Completions => {
                let prompts = match m.get("prompt") {
                    Some(Value::String(s)) => vec![text_prompt(s, cached)],
                    Some(Value::Array(a)) if a.iter().all(Value::is_string) && !a.is_empty() => a
                        .iter()
                        .map(|s| text_prompt(s.as_str().unwrap_or(""), cached))
                        .collect(),
                    Some(Value::Array(a)) if a.iter().all(Value::is_array) && !a.is_empty() => a
                        .iter()
                        .map(|x| x.as_array().and_then(|l| ids_prompt(l, cached)))
                        .collect::<Option<Vec<_>>>()
                        .ok_or_else(|| ReqError::schema("prompt: invalid token ids"))?,
                    Some(Value::Array(a)) => {
                        vec![ids_prompt(a, cached)
                            .ok_or_else(|| ReqError::schema("prompt: invalid prompt"))?]
                    }
                    _ => return Err(ReqError::schema("prompt: Field required")),
                };
                let n = m.get("n").and_then(Value::as_u64).unwrap_or(1).max(1) as usize;
                let max = cap_tokens(m.get("max_tokens"), cfg.default_output_tokens)?;
                let len = prompts.len();
                (prompts, len > 1, n, vec![max; len])
            }
        };
    let batch = prompts.len();
    let num = batch * n;

    let mut routed = int_field(&m, "routed_dp_rank")?;
    if routed.is_none() {
        routed = int_field(&m, "data_parallel_rank")?;
    }
    if let Some(h) = dp_header.filter(|_| api != Api::Generate) {
        routed =
            Some(h.trim().parse::<i64>().map_err(|_| {
                ReqError::value(format!("Invalid X-Data-Parallel-Rank header: {h:?}"))
            })?);
    }
    let disagg = int_field(&m, "disagg_prefill_dp_rank")?;

    let rooms = expand_rooms(m.get("bootstrap_room"), num, batch)?;
    let hosts = expand(m.get("bootstrap_host"), num, batch, "bootstrap_host", |v| {
        v.as_str().map(str::to_string)
    })?;
    let ports = expand(m.get("bootstrap_port"), num, batch, "bootstrap_port", |v| {
        v.as_u64().and_then(|p| u16::try_from(p).ok())
    })?;
    let rids = expand_rids(m.get("rid"), num, batch)?;

    let stream = m.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = m
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let continuous_usage = !cfg.ignore_continuous_usage
        && m.get("stream_options")
            .and_then(|o| o.get("continuous_usage_stats"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
    let return_logprob = match m.get("return_logprob") {
        Some(Value::Bool(b)) => *b,
        Some(Value::Array(a)) => a.iter().any(|v| v.as_bool() == Some(true)),
        _ => false,
    };
    // One start for every item (a list takes its first).
    let logprob_start = match m.get("logprob_start_len") {
        Some(Value::Array(a)) => a.first().and_then(Value::as_i64),
        Some(v) => v.as_i64(),
        None => None,
    }
    .and_then(|n| usize::try_from(n).ok());
    let model = m
        .get("model")
        .and_then(Value::as_str)
        .map_or_else(|| cfg.model.clone(), str::to_string);

    let instances = (0..num)
        .map(|k| {
            let i = k % batch;
            let p = &prompts[i];
            let max_tokens = per_prompt_max
                .get(i)
                .copied()
                .unwrap_or(cfg.default_output_tokens);
            Instance {
                index: k,
                rid: rids[k].clone(),
                room: rooms[k],
                host: hosts[k].clone(),
                port: ports[k],
                prompt_tokens: p.tokens,
                prompt_ids: p.ids.clone(),
                prefix_ids: p.prefix_ids.clone(),
                max_tokens,
                answer: p.ctx.generate(max_tokens),
            }
        })
        .collect();
    Ok(ParsedRequest {
        api,
        stream,
        include_usage,
        continuous_usage,
        return_logprob,
        logprob_start,
        model,
        routed_dp_rank: routed,
        disagg_prefill_dp_rank: disagg,
        is_batch: is_list_input || (api == Api::Generate && n > 1),
        batch,
        instances,
    })
}

type Prompts = (Vec<Prompt>, bool, usize, Vec<u32>);

fn parse_generate_prompts(
    m: &Map<String, Value>,
    cfg: &EngineConfig,
    cached: bool,
) -> Result<Prompts, ReqError> {
    let (prompts, is_list) = match (m.get("text"), m.get("input_ids")) {
        (Some(Value::String(s)), _) => (vec![text_prompt(s, cached)], false),
        (Some(Value::Array(a)), _) if !a.is_empty() => (
            a.iter()
                .map(|s| s.as_str().map(|s| text_prompt(s, cached)))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| ReqError::value("text should be a string or a list of strings"))?,
            true,
        ),
        (_, Some(Value::Array(a))) if !a.is_empty() && a.iter().all(Value::is_array) => (
            a.iter()
                .map(|x| {
                    x.as_array()
                        .and_then(|l| ids_prompt(l, cached))
                        .filter(|p| p.tokens > 0)
                })
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    ReqError::value("input_ids should be a non-empty list of integers")
                })?,
            true,
        ),
        (_, Some(Value::Array(a))) if !a.is_empty() => (
            vec![ids_prompt(a, cached)
                .ok_or_else(|| ReqError::value("input_ids should be a list of integers"))?],
            false,
        ),
        _ if m.get("input_embeds").is_some_and(|v| !v.is_null()) => {
            (vec![text_prompt("embeds", cached)], false)
        }
        _ => {
            return Err(ReqError::value(
                "Either text, input_ids or input_embeds should be provided.",
            ))
        }
    };
    let batch = prompts.len();
    let sp_at = |i: usize| -> Option<&Value> {
        match m.get("sampling_params") {
            Some(Value::Array(a)) => a.get(i),
            Some(v @ Value::Object(_)) => Some(v),
            _ => None,
        }
    };
    let n = sp_at(0)
        .and_then(|sp| sp.get("n"))
        .and_then(Value::as_u64)
        .unwrap_or(1)
        .max(1) as usize;
    let max = (0..batch)
        .map(|i| {
            cap_tokens(
                sp_at(i).and_then(|sp| sp.get("max_new_tokens")),
                cfg.default_output_tokens,
            )
        })
        .collect::<Result<_, _>>()?;
    Ok((prompts, is_list, n, max))
}

fn expand_rooms(v: Option<&Value>, num: usize, batch: usize) -> Result<Vec<Option<u64>>, ReqError> {
    let room = |x: &Value| -> Result<u64, ReqError> {
        x.as_u64().filter(|r| *r <= i64::MAX as u64).ok_or_else(|| {
            ReqError::schema("bootstrap_room: Input should be a non-negative integer")
        })
    };
    match v {
        None | Some(Value::Null) => Ok(vec![None; num]),
        Some(Value::Array(a)) => {
            let list: Vec<u64> = a.iter().map(room).collect::<Result<_, _>>()?;
            if list.len() == num {
                Ok(list.into_iter().map(Some).collect())
            } else if list.len() == batch {
                Ok((0..num).map(|k| Some(list[k % batch])).collect())
            } else {
                Err(ReqError::value(format!(
                    "The length of bootstrap_room ({}) does not match the number of requests ({num}).",
                    list.len()
                )))
            }
        }
        Some(x) => {
            let r = room(x)?;
            Ok((0..num as u64).map(|k| Some(r.wrapping_add(k))).collect())
        }
    }
}

fn expand<T: Clone>(
    v: Option<&Value>,
    num: usize,
    batch: usize,
    name: &str,
    conv: impl Fn(&Value) -> Option<T>,
) -> Result<Vec<Option<T>>, ReqError> {
    let bad = || ReqError::schema(format!("{name}: invalid value"));
    match v {
        None | Some(Value::Null) => Ok(vec![None; num]),
        Some(Value::Array(a)) => {
            let list: Vec<Option<T>> = a
                .iter()
                .map(|x| {
                    if x.is_null() {
                        Ok(None)
                    } else {
                        conv(x).map(Some).ok_or_else(bad)
                    }
                })
                .collect::<Result<_, _>>()?;
            if list.len() == num {
                Ok(list)
            } else if list.len() == batch {
                Ok((0..num).map(|k| list[k % batch].clone()).collect())
            } else {
                Err(ReqError::value(format!(
                    "The length of {name} ({}) does not match the number of requests ({num}).",
                    list.len()
                )))
            }
        }
        Some(x) => {
            let one = conv(x).ok_or_else(bad)?;
            Ok(vec![Some(one); num])
        }
    }
}

/// A fresh 32-hex-digit id (`uuid4().hex` look-alike).
pub(crate) fn new_rid() -> String {
    format!("{:032x}", rand::random::<u128>())
}

fn expand_rids(v: Option<&Value>, num: usize, batch: usize) -> Result<Vec<String>, ReqError> {
    match v {
        None | Some(Value::Null) => Ok((0..num).map(|_| new_rid()).collect()),
        Some(Value::String(s)) if num == 1 => Ok(vec![s.clone()]),
        Some(Value::String(s)) => Ok((0..num).map(|k| format!("{s}_{k}")).collect()),
        Some(Value::Array(a)) => {
            let list: Vec<String> = a
                .iter()
                .map(|x| x.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .ok_or_else(|| {
                    ReqError::value("The rid should be a string or a list of strings.")
                })?;
            if list.len() == num {
                Ok(list)
            } else if list.len() == batch {
                Ok((0..num)
                    .map(|k| {
                        if k < batch {
                            list[k].clone()
                        } else {
                            format!("{}_{}", list[k % batch], k / batch)
                        }
                    })
                    .collect())
            } else {
                Err(ReqError::value(
                    "The specified rids length mismatch with the batch_size for batch processing.",
                ))
            }
        }
        Some(_) => Err(ReqError::value(
            "The rid should be a string or a list of strings.",
        )),
    }
}
