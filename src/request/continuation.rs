//! Continuing an answer on another decode: from the client's original request and what the
//! client has already received, the body of the follow-up request, or why there is none.
//!
//! How each route continues (the follow-up is an ordinary client body, parsed again by
//! [`super::parse`] and sent on a fresh pair):
//! - `/generate` with `input_ids`: the ids received are appended to `input_ids`; with `text`,
//!   the text received is appended to `text`; `sampling_params.max_new_tokens` is reduced
//!   by the completion tokens the engine reported;
//! - `/v1/completions`: the text received is appended to the (string) `prompt`;
//!   `max_tokens` is reduced;
//! - `/v1/chat/completions`: the text received becomes a final assistant message and
//!   `continue_final_message: true` is set — SGLang then renders the conversation with its
//!   generation prompt and appends that message's content as the start of the answer, so
//!   the model continues it; `max_completion_tokens` (or `max_tokens`) is reduced.
//!
//! Invariants:
//! - Only the top-level members this module changes are parsed; every other member of the
//!   client's body goes to the follow-up as the exact bytes the client sent.
//! - A request that cannot be continued with the same answer is refused at [`plan`], before
//!   its legs are sent: a batch or `n > 1` (several answers in one stream), constrained
//!   decoding (a grammar's state is not in the prompt), logprobs (the follow-up's would
//!   cover a different prompt), `echo` (the follow-up would echo the extended prompt), a
//!   token-id prompt on `/v1/completions` (the answer arrives as text only), `input_embeds`,
//!   and a chat request that already continues its own assistant message. A tool call or
//!   reasoning in progress is refused later, by the relay, when it sees one.
//! - An answer without an explicit limit on `/generate` and `/v1/completions` is limited by
//!   SGLang's defaults (128 and 16 tokens), so the follow-up's limit is the default less
//!   what was sent; a chat answer without a limit stays without one.

use std::collections::BTreeMap;

use bytes::Bytes;
use serde_json::value::RawValue;

use super::{ApiRoute, ParsedRequest};

/// SGLang's `SamplingParams.max_new_tokens` default (`/generate`).
pub const SGLANG_DEFAULT_MAX_NEW_TOKENS: u64 = 128;
/// SGLang's `CompletionRequest.max_tokens` default (`/v1/completions`).
pub const SGLANG_DEFAULT_COMPLETION_TOKENS: u64 = 16;

/// What a continuable request needs to be continued; decided once, before its legs go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub route: ApiRoute,
    /// The completion tokens the client asked for (or the engine's default); `None`: no
    /// limit.
    pub limit: Option<u64>,
    /// `/generate` with `input_ids`: the answer continues as ids, not text.
    pub uses_ids: bool,
    /// OpenAI routes: the client asked for a final usage chunk (`stream_options.include_usage`).
    pub client_usage: bool,
    /// ... and for usage on every chunk (`stream_options.continuous_usage_stats`).
    pub client_continuous_usage: bool,
}

/// What the client has received so far, as the engine reported it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sent {
    /// The answer's text so far.
    pub text: String,
    /// Its token ids (`/generate`'s `output_ids`); empty where the route has none.
    pub ids: Vec<i64>,
    /// Completion tokens the engine reported for it.
    pub completion_tokens: u64,
}

fn is_null(v: &str) -> bool {
    v.trim() == "null"
}

fn truthy(v: &str) -> bool {
    let v = v.trim();
    !(v == "null" || v == "false" || v == "0" || v == "\"\"")
}

/// An object's members as (key, raw value), by key.
fn object(raw: &str) -> Option<BTreeMap<String, &RawValue>> {
    serde_json::from_str(raw).ok()
}

fn as_u64(v: Option<&&RawValue>) -> Option<u64> {
    v.filter(|v| !is_null(v.get()))
        .and_then(|v| v.get().trim().parse().ok())
}

/// Constrained decoding keys (SGLang's sampling params and its OpenAI extensions).
const CONSTRAINED: [&str; 4] = ["json_schema", "regex", "ebnf", "structural_tag"];

/// Whether `req` can be continued on another decode, and how.
pub fn plan(req: &ParsedRequest) -> Result<Plan, &'static str> {
    if req.batch.is_some() {
        return Err("a batch of prompts is several answers in one stream");
    }
    if req.n > 1 {
        return Err("n > 1 is several answers in one stream");
    }
    if req.return_logprob {
        return Err("logprobs of a follow-up would cover a different prompt");
    }
    let mut p = Plan {
        route: req.route,
        limit: match req.route {
            ApiRoute::Generate => Some(SGLANG_DEFAULT_MAX_NEW_TOKENS),
            ApiRoute::Completions => Some(SGLANG_DEFAULT_COMPLETION_TOKENS),
            ApiRoute::ChatCompletions => None,
        },
        uses_ids: false,
        client_usage: false,
        client_continuous_usage: false,
    };
    let mut max_completion = None;
    let mut max_tokens = None;
    for (key, raw) in req.members() {
        let k: &str = &key;
        match (req.route, k) {
            (ApiRoute::Generate, "input_ids") if !is_null(raw) => p.uses_ids = true,
            (ApiRoute::Generate, "input_embeds") if !is_null(raw) => {
                return Err("an input_embeds prompt cannot be extended")
            }
            (ApiRoute::Generate, "sampling_params") if !is_null(raw) => {
                let sp = object(raw).ok_or("sampling_params is not an object")?;
                if CONSTRAINED
                    .iter()
                    .any(|c| sp.get(*c).is_some_and(|v| !is_null(v.get())))
                {
                    return Err("constrained decoding keeps its grammar state in the engine");
                }
                if let Some(m) = as_u64(sp.get("max_new_tokens")) {
                    p.limit = Some(m);
                }
            }
            (ApiRoute::Generate, _) => {}
            (_, "logprobs" | "top_logprobs") if truthy(raw) => {
                return Err("logprobs of a follow-up would cover a different prompt")
            }
            (_, "echo") if truthy(raw) => {
                return Err("echo would repeat the extended prompt");
            }
            (_, "continue_final_message") if truthy(raw) => {
                return Err("the request already continues its own assistant message");
            }
            (_, c) if CONSTRAINED.contains(&c) && !is_null(raw) => {
                return Err("constrained decoding keeps its grammar state in the engine");
            }
            (_, "response_format") if !is_null(raw) => {
                let rf = object(raw).ok_or("response_format is not an object")?;
                let text = rf.get("type").map(|t| t.get().trim()) == Some("\"text\"");
                if !text {
                    return Err("constrained decoding keeps its grammar state in the engine");
                }
            }
            (ApiRoute::Completions, "prompt") if !raw.trim_start().starts_with('"') => {
                return Err("a token-id prompt cannot be extended with text");
            }
            (_, "max_tokens") => max_tokens = Some(raw),
            (ApiRoute::ChatCompletions, "max_completion_tokens") => max_completion = Some(raw),
            (_, "stream_options") if !is_null(raw) => {
                let so = object(raw).ok_or("stream_options is not an object")?;
                p.client_usage = so.get("include_usage").is_some_and(|v| truthy(v.get()));
                p.client_continuous_usage = so
                    .get("continuous_usage_stats")
                    .is_some_and(|v| truthy(v.get()));
            }
            _ => {}
        }
    }
    let explicit = max_completion
        .filter(|v| !is_null(v))
        .or(max_tokens.filter(|v| !is_null(v)));
    if let Some(m) = explicit {
        p.limit = Some(m.trim().parse().map_err(|_| "max_tokens is not a count")?);
    }
    Ok(p)
}

/// Why a follow-up could not be built.
#[derive(Debug, PartialEq, Eq)]
pub struct Refused(pub String);

/// The follow-up's body: the client's request, continued after `sent`.
pub fn follow_up(req: &ParsedRequest, plan: &Plan, sent: &Sent) -> Result<Bytes, Refused> {
    let remaining = match plan.limit {
        Some(l) if sent.completion_tokens >= l => {
            return Err(Refused(format!(
                "the answer had reached its limit of {l} tokens"
            )))
        }
        Some(l) => Some(l - sent.completion_tokens),
        None => None,
    };
    if plan.uses_ids && sent.ids.is_empty() && sent.completion_tokens > 0 {
        return Err(Refused("the engine reported no output_ids".into()));
    }
    let mut out = String::with_capacity(req.members().map(|(_, v)| v.len() + 24).sum::<usize>());
    out.push('{');
    let mut had_limit = false;
    let member = |out: &mut String, key: &str, raw: &str| {
        if out.len() > 1 {
            out.push(',');
        }
        push_json_str(out, key);
        out.push(':');
        out.push_str(raw);
    };
    for (key, raw) in req.members() {
        let k: &str = &key;
        match (plan.route, k) {
            (ApiRoute::Generate, "text") | (ApiRoute::Completions, "prompt")
                if !is_null(raw) && !plan.uses_ids =>
            {
                let mut s: String = serde_json::from_str(raw)
                    .map_err(|_| Refused(format!("'{k}' is not a string")))?;
                s.push_str(&sent.text);
                let mut v = String::new();
                push_json_str(&mut v, &s);
                member(&mut out, k, &v);
            }
            (ApiRoute::Generate, "input_ids") if plan.uses_ids => {
                let open = raw.trim_end();
                let open = open
                    .strip_suffix(']')
                    .ok_or_else(|| Refused("'input_ids' is not a list".into()))?;
                let mut v = String::with_capacity(open.len() + sent.ids.len() * 7 + 1);
                v.push_str(open);
                for id in &sent.ids {
                    v.push(',');
                    v.push_str(itoa::Buffer::new().format(*id));
                }
                v.push(']');
                member(&mut out, k, &v);
            }
            (ApiRoute::Generate, "sampling_params") if !is_null(raw) => {
                let n = remaining.map(|r| r.to_string()).unwrap_or_default();
                let boxed = RawValue::from_string(n)
                    .map_err(|_| Refused("no token limit to reduce".into()))?;
                let mut sp = object(raw)
                    .ok_or_else(|| Refused("'sampling_params' is not an object".into()))?;
                sp.insert("max_new_tokens".into(), &boxed);
                let v = serde_json::to_string(&sp).map_err(|e| Refused(e.to_string()))?;
                had_limit = true;
                member(&mut out, k, &v);
            }
            (ApiRoute::ChatCompletions, "messages") => {
                let open = raw.trim_end();
                let open = open
                    .strip_suffix(']')
                    .ok_or_else(|| Refused("'messages' is not a list".into()))?;
                let mut v = String::with_capacity(open.len() + sent.text.len() + 48);
                v.push_str(open);
                v.push_str(",{\"role\":\"assistant\",\"content\":");
                push_json_str(&mut v, &sent.text);
                v.push_str("}]");
                member(&mut out, k, &v);
            }
            (ApiRoute::Completions | ApiRoute::ChatCompletions, "max_tokens")
            | (ApiRoute::ChatCompletions, "max_completion_tokens")
                if !is_null(raw) =>
            {
                let v = remaining
                    .map(|r| r.to_string())
                    .unwrap_or_else(|| raw.into());
                had_limit = true;
                member(&mut out, k, &v);
            }
            _ => member(&mut out, k, raw),
        }
    }
    if let (false, Some(r)) = (had_limit, remaining) {
        match plan.route {
            ApiRoute::Generate => member(
                &mut out,
                "sampling_params",
                &format!("{{\"max_new_tokens\":{r}}}"),
            ),
            _ => member(&mut out, "max_tokens", &r.to_string()),
        }
    }
    if plan.route == ApiRoute::ChatCompletions {
        member(&mut out, "continue_final_message", "true");
    }
    member(
        &mut out,
        "stream",
        if req.stream { "true" } else { "false" },
    );
    out.push('}');
    Ok(Bytes::from(out))
}

/// `s` as a JSON string literal.
fn push_json_str(out: &mut String, s: &str) {
    match serde_json::to_string(s) {
        Ok(q) => out.push_str(&q),
        // Serializing a str cannot fail; keep the output valid JSON regardless.
        Err(_) => out.push_str("\"\""),
    }
}

/// The `stream_options` a continuable OpenAI stream's legs carry: per-chunk usage, so
/// that the completion tokens sent are what the engine counted (SGLang's
/// `continuous_usage_stats`). The relay hides what the client did not ask for.
pub const LEG_STREAM_OPTIONS: &str = r#"{"include_usage":true,"continuous_usage_stats":true}"#;

#[cfg(test)]
mod tests;
