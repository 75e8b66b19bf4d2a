//! JSON shapes of SGLang's answers: `/generate` objects and SSE chunks, the
//! OpenAI chat / text completion objects and chunks, and SGLang's failure
//! shapes per route and streaming mode.
//!
//! Why: the router must parse real SGLang output (cumulative `/generate`
//! chunks, abort finish reasons inside a 200 stream, `{"error": …}` chunks on
//! the OpenAI routes); the simulator emits exactly those shapes.
//!
//! Invariants (from the sglang 0.5.23 sources):
//! - `/generate` non-stream failure: 400 → `{"error": {"message"}}`, other
//!   status → `{"object":"error","message","type":"<status>","param":null,"code"}`.
//! - `/generate` stream failure: HTTP 200, then a chunk whose
//!   `meta_info.finish_reason` is `{"type":"abort","message","status_code","err_type":null}`
//!   (a tokenizer validation error instead gives `{"error": {...}}`).
//! - OpenAI non-stream failure: `{"object":"error","message","type","param":null,"code"}`
//!   with type `BadRequestError` for 400 and `str(status)` otherwise.
//! - OpenAI stream failure: `data: {"error": {…, "type": "<HTTPStatus name>"}}`.
//! - A graceful abort (`/abort_request`, no status) is a normal answer whose
//!   finish reason is abort.
//! - Every SSE stream ends with `data: [DONE]\n\n`.
//! - `meta_info.cached_tokens` is the prompt tokens the prefill's prefix cache held (a
//!   decode reports its prefill's); OpenAI usage carries them as
//!   `prompt_tokens_details: {"cached_tokens": N}` only with `--enable-cache-report` and
//!   N > 0 (else null), summed over each prompt's first sample, never on the per-chunk
//!   `continuous_usage_stats` usage (SGLang's `UsageProcessor`).

use bytes::Bytes;
use serde_json::{json, Value};

use crate::http::{self, Resp};
use crate::request::{Api, Instance, ParsedRequest, ReqError};
use crate::stats::Outcome;

/// Why an instance did not finish normally.
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    /// `None` = graceful abort (answered as a normal, abort-finished result).
    pub status: Option<u16>,
    pub message: String,
    /// Raised by the tokenizer before scheduling (a `ValueError`).
    pub validation: bool,
    pub outcome: Outcome,
}

impl Failure {
    /// A scheduler abort with a status (500 unless said otherwise).
    pub(crate) fn abort(status: u16, message: impl Into<String>) -> Self {
        Failure {
            status: Some(status),
            message: message.into(),
            validation: false,
            outcome: Outcome::Failed,
        }
    }

    /// A tokenizer `ValueError` (400).
    pub(crate) fn validation(message: impl Into<String>) -> Self {
        Failure {
            status: Some(400),
            message: message.into(),
            validation: true,
            outcome: Outcome::Failed,
        }
    }

    /// `POST /abort_request`.
    pub(crate) fn user_abort() -> Self {
        Failure {
            status: None,
            message: "Aborted".to_string(),
            validation: false,
            outcome: Outcome::Aborted,
        }
    }
}

/// `HTTPStatus(code).name`.
pub(crate) fn status_name(code: u16) -> String {
    match code {
        400 => "BAD_REQUEST".into(),
        401 => "UNAUTHORIZED".into(),
        403 => "FORBIDDEN".into(),
        404 => "NOT_FOUND".into(),
        408 => "REQUEST_TIMEOUT".into(),
        413 => "REQUEST_ENTITY_TOO_LARGE".into(),
        422 => "UNPROCESSABLE_ENTITY".into(),
        429 => "TOO_MANY_REQUESTS".into(),
        500 => "INTERNAL_SERVER_ERROR".into(),
        501 => "NOT_IMPLEMENTED".into(),
        502 => "BAD_GATEWAY".into(),
        503 => "SERVICE_UNAVAILABLE".into(),
        504 => "GATEWAY_TIMEOUT".into(),
        other => format!("HTTP_{other}"),
    }
}

/// What the role contributes to `/generate` logprob fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Logprobs {
    /// Prefill: input logprobs of the prompt (+ its one output token).
    Prefill,
    /// Decode: empty input logprobs, output logprobs.
    Decode,
}

/// Per-request context shared by every builder.
pub(crate) struct Ctx<'a> {
    pub req: &'a ParsedRequest,
    pub created: u64,
    pub logprobs: Logprobs,
    /// A streamed `/generate` sends only what is new in each event
    /// (`--incremental-streaming-output`).
    pub incremental: bool,
    /// OpenAI usage reports cached tokens (`--enable-cache-report`).
    pub cache_report: bool,
}

impl Ctx<'_> {
    fn finish_reason_json(&self, tokens: u32, failure: Option<&Failure>) -> Value {
        match failure {
            Some(f) => {
                json!({"type": "abort", "message": f.message, "status_code": f.status, "err_type": null})
            }
            None => json!({"type": "length", "length": tokens}),
        }
    }

    /// A `/generate` object after `tokens` output tokens, of a prompt with `cached`
    /// cached tokens. `finished` adds the finish reason (length, or the failure's abort).
    pub(crate) fn generate_obj(
        &self,
        inst: &Instance,
        from: u32,
        tokens: u32,
        finished: bool,
        failure: Option<&Failure>,
        cached: u32,
    ) -> Value {
        let finish = if finished || failure.is_some() {
            self.finish_reason_json(tokens, failure)
        } else {
            Value::Null
        };
        let mut meta = json!({
            "id": inst.rid,
            "finish_reason": finish,
            "prompt_tokens": inst.prompt_tokens,
            "completion_tokens": tokens,
            "cached_tokens": cached,
        });
        if self.req.return_logprob {
            let out: Vec<Value> = inst
                .ids(from, tokens)
                .into_iter()
                .map(|id| json!([-0.125, id, null]))
                .collect();
            match self.logprobs {
                Logprobs::Prefill => {
                    // From `logprob_start_len` on; none without it (SGLang's default -1:
                    // output tokens only). The prompt's first token has no logprob.
                    let start = self.req.logprob_start.unwrap_or(usize::MAX);
                    let input: Vec<Value> = inst
                        .prompt_ids
                        .iter()
                        .enumerate()
                        .skip(start)
                        .map(|(i, id)| {
                            if i == 0 {
                                json!([null, id, null])
                            } else {
                                json!([-0.5, id, null])
                            }
                        })
                        .collect();
                    let n = input.len();
                    meta["input_token_logprobs"] = Value::Array(input);
                    meta["input_top_logprobs"] = Value::Array(vec![Value::Null; n]);
                    meta["output_token_logprobs"] = Value::Array(out);
                }
                Logprobs::Decode => {
                    meta["input_token_logprobs"] = json!([]);
                    meta["output_token_logprobs"] = Value::Array(out);
                }
            }
        }
        let mut obj = json!({"text": inst.text(from, tokens), "output_ids": inst.ids(from, tokens), "meta_info": meta});
        if self.req.is_batch && self.req.stream {
            obj["index"] = json!(inst.index);
        }
        obj
    }

    fn usage(&self, prompt: u32, completion: u32, cached: u32) -> Value {
        let details = if self.cache_report && cached > 0 {
            json!({"cached_tokens": cached})
        } else {
            Value::Null
        };
        json!({"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion, "prompt_tokens_details": details})
    }

    fn object_id(&self) -> String {
        self.req
            .instances
            .first()
            .map_or_else(crate::request::new_rid, |i| i.rid.clone())
    }

    /// The non-streaming OpenAI object for finished instances
    /// `(instance, tokens, failure, cached tokens)`.
    pub(crate) fn openai_obj(&self, results: &[(&Instance, u32, Option<&Failure>, u32)]) -> Value {
        let mut prompt = 0;
        let mut completion = 0;
        let mut cached_total = 0;
        let choices: Vec<Value> = results
            .iter()
            .map(|(inst, tokens, failure, cached)| {
                if inst.index < self.req.batch {
                    prompt += inst.prompt_tokens;
                    cached_total += cached;
                }
                completion += tokens;
                let reason = if failure.is_some() { "abort" } else { "length" };
                match self.req.api {
                    Api::Chat => json!({
                        "index": inst.index,
                        "message": {"role": "assistant", "content": inst.text(0, *tokens), "reasoning_content": null, "tool_calls": null},
                        "logprobs": null,
                        "finish_reason": reason,
                        "matched_stop": null,
                    }),
                    _ => json!({
                        "index": inst.index,
                        "text": inst.text(0, *tokens),
                        "logprobs": null,
                        "finish_reason": reason,
                        "matched_stop": null,
                    }),
                }
            })
            .collect();
        let object = if self.req.api == Api::Chat {
            "chat.completion"
        } else {
            "text_completion"
        };
        json!({
            "id": self.object_id(),
            "object": object,
            "created": self.created,
            "model": self.req.model,
            "choices": choices,
            "usage": self.usage(prompt, completion, cached_total),
        })
    }

    fn chunk(&self, choice: Value) -> Value {
        let object = if self.req.api == Api::Chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        json!({
            "id": self.object_id(),
            "object": object,
            "created": self.created,
            "model": self.req.model,
            "choices": [choice],
        })
    }

    /// OpenAI chat: the first chunk of an instance, carrying the role.
    pub(crate) fn role_chunk(&self, inst: &Instance) -> Value {
        self.chunk(json!({"index": inst.index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}))
    }

    /// OpenAI, prefill: the single chunk of a one-token answer (role, token
    /// and finish reason together).
    pub(crate) fn single_chunk(&self, inst: &Instance) -> Value {
        let text = inst.text(0, 1);
        match self.req.api {
            Api::Chat => self.chunk(json!({"index": inst.index, "delta": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": "length", "matched_stop": null})),
            _ => self.chunk(json!({"index": inst.index, "text": text, "logprobs": null, "finish_reason": "length", "matched_stop": null})),
        }
    }

    /// OpenAI: the chunk carrying output token `k`.
    pub(crate) fn token_chunk(&self, inst: &Instance, k: u32) -> Value {
        let text = inst.text(k, k + 1);
        match self.req.api {
            Api::Chat => self.chunk(json!({"index": inst.index, "delta": {"content": text}, "logprobs": null, "finish_reason": null})),
            _ => self.chunk(json!({"index": inst.index, "text": text, "logprobs": null, "finish_reason": null})),
        }
    }

    /// OpenAI: the last chunk of an instance (finish reason length / abort).
    pub(crate) fn finish_chunk(&self, inst: &Instance, aborted: bool) -> Value {
        let reason = if aborted { "abort" } else { "length" };
        match self.req.api {
            Api::Chat => self.chunk(json!({"index": inst.index, "delta": {}, "logprobs": null, "finish_reason": reason, "matched_stop": null})),
            _ => self.chunk(json!({"index": inst.index, "text": "", "logprobs": null, "finish_reason": reason, "matched_stop": null})),
        }
    }

    /// `v` with the usage so far when the client asked for usage on every chunk
    /// (`stream_options.continuous_usage_stats`).
    pub(crate) fn with_usage(&self, mut v: Value, inst: &Instance, completion: u32) -> Value {
        if self.req.continuous_usage {
            v["usage"] = self.usage(inst.prompt_tokens, completion, 0);
        }
        v
    }

    /// OpenAI `stream_options.include_usage` chunk (`cached`: the prompts' cached tokens).
    pub(crate) fn usage_chunk(&self, prompt: u32, completion: u32, cached: u32) -> Value {
        let object = if self.req.api == Api::Chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        json!({
            "id": self.object_id(),
            "object": object,
            "created": self.created,
            "model": self.req.model,
            "choices": [],
            "usage": self.usage(prompt, completion, cached),
        })
    }

    /// The SSE chunk that reports `f` for `inst` after `tokens` tokens (`cached`: its
    /// prompt's cached tokens, if known by then).
    pub(crate) fn failure_chunk(
        &self,
        inst: &Instance,
        tokens: u32,
        f: &Failure,
        cached: u32,
    ) -> Value {
        match (self.req.api, f.status) {
            (Api::Generate, Some(400)) if f.validation => json!({"error": {
                "message": f.message, "type": "invalid_request_error", "code": 400, "retryable": false
            }}),
            (Api::Generate, _) => {
                let from = if self.incremental { tokens } else { 0 };
                self.generate_obj(inst, from, tokens, true, Some(f), cached)
            }
            (_, None) => self.finish_chunk(inst, true),
            (_, Some(code)) => {
                let err_type = if f.validation {
                    "BadRequestError".to_string()
                } else {
                    status_name(code)
                };
                json!({"error": {"object": "error", "message": f.message, "type": err_type, "param": null, "code": code}})
            }
        }
    }
}

/// `data: <json>\n\n`.
pub(crate) fn sse_event(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// `data: [DONE]\n\n`.
pub(crate) fn sse_done() -> Bytes {
    Bytes::from_static(b"data: [DONE]\n\n")
}

/// Non-streaming failure response for a failure with a status.
pub(crate) fn failure_response(api: Api, status: u16, f: &Failure) -> Resp {
    let body = match api {
        Api::Generate if status == 400 => json!({"error": {"message": f.message}}),
        Api::Generate => {
            json!({"object": "error", "message": f.message, "type": status.to_string(), "param": null, "code": status})
        }
        _ => {
            let t = if status == 400 {
                "BadRequestError".to_string()
            } else {
                status.to_string()
            };
            json!({"object": "error", "message": f.message, "type": t, "param": null, "code": status})
        }
    };
    http::json(status, &body)
}

/// Response for a request that could not be parsed into instances.
pub(crate) fn request_error_response(api: Api, e: &ReqError) -> Resp {
    let body = if e.schema {
        json!({"object": "error", "message": e.message, "type": "Bad Request", "param": null, "code": e.status})
    } else if api == Api::Generate {
        json!({"error": {"message": e.message}})
    } else {
        json!({"object": "error", "message": e.message, "type": "BadRequest", "param": null, "code": e.status})
    };
    http::json(e.status, &body)
}
