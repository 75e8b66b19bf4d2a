//! A request's size in KV tokens, estimated without a tokenizer: what a decode rank must
//! hold for it (`pool::capacity` bounds admission by it and picks decode ranks by the
//! tokens in flight).
//!
//! pdgate does not tokenize: the prompt counts one token per [`BYTES_PER_TOKEN`] bytes of
//! its raw JSON (close for English text, and for `input_ids` lists, whose ids take 4–7
//! bytes each), and the output budget is what the request asks
//! (`max_tokens`/`max_completion_tokens` on the OpenAI routes, `sampling_params.max_new_tokens`
//! on `/generate`), else [`DEFAULT_MAX_NEW_TOKENS`] (SGLang's default), per instance.
//! Computed on demand from the raw body; the top-level scan reads only these keys.

use super::{ApiRoute, KeyJson, ParsedRequest};
use crate::skim;

/// Bytes of prompt JSON counted as one token.
pub const BYTES_PER_TOKEN: u64 = 4;
/// The output budget of a request that does not set one (SGLang's `max_new_tokens`).
pub const DEFAULT_MAX_NEW_TOKENS: u64 = 128;

impl ParsedRequest {
    /// The estimated prompt tokens (all prompts of a batch, once): what a prefill computes
    /// for it before its cache is looked up (`pool::backlog` learns how far off this is).
    pub fn prompt_tokens_estimate(&self) -> u64 {
        self.prompt
            .as_ref()
            .map_or(0, |r| (r.len() as u64).div_ceil(BYTES_PER_TOKEN))
    }

    /// The estimated KV tokens the request holds on a decode (prompt + output budget, all
    /// instances).
    pub fn kv_tokens_estimate(&self) -> u64 {
        self.prompt_tokens_estimate()
            .saturating_mul(u64::from(self.n))
            .saturating_add(self.output_tokens_bound())
    }

    /// The most output tokens the request can produce in all: its output budget (or
    /// SGLang's default), per instance. A stream has at most one event per token.
    pub fn output_tokens_bound(&self) -> u64 {
        self.max_new_tokens()
            .unwrap_or(DEFAULT_MAX_NEW_TOKENS)
            .saturating_mul(self.instances() as u64)
    }

    /// The output budget the request asks for, if it says.
    fn max_new_tokens(&self) -> Option<u64> {
        let keys: &[&str] = match self.route {
            ApiRoute::Generate => &["\"sampling_params\""],
            _ => &["\"max_completion_tokens\"", "\"max_tokens\""],
        };
        self.fields.iter().find_map(|f| {
            let key: &str = match &f.key_json {
                KeyJson::Span(r) => std::str::from_utf8(self.body.get(r.clone())?).ok()?,
                KeyJson::Escaped(k) => k,
            };
            if !keys.contains(&key) {
                return None;
            }
            let raw = std::str::from_utf8(self.body.get(f.value.clone())?).ok()?;
            match self.route {
                ApiRoute::Generate => sampling_max_new(raw),
                _ => raw.trim().parse::<u64>().ok(),
            }
        })
    }
}

/// `max_new_tokens` of a `sampling_params` object, or the largest of a list's (a skim:
/// this runs for every request that reserves decode capacity).
fn sampling_max_new(raw: &str) -> Option<u64> {
    let b = raw.as_bytes();
    let start = b.iter().position(|c| !c.is_ascii_whitespace())?;
    let one = |r: std::ops::Range<usize>| skim::u64_member(b, &r, b"max_new_tokens");
    match b[start] {
        b'{' => one(start..b.len()),
        b'[' => {
            let mut max = None;
            skim::elements(b, start, |e| {
                let end = skim::value_end(b, e)?;
                max = max.max(one(e..end));
                Some(end)
            })?;
            max
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    #[test]
    fn estimates_prompt_and_budget() {
        let table: &[(ApiRoute, &str, u64)] = &[
            // 8 bytes of prompt JSON ("abcdef" quoted) = 2 tokens, + 10.
            (
                ApiRoute::Generate,
                r#"{"text": "abcdef", "sampling_params": {"max_new_tokens": 10}}"#,
                12,
            ),
            (
                ApiRoute::Generate,
                r#"{"text": "abcdef"}"#,
                2 + DEFAULT_MAX_NEW_TOKENS,
            ),
            (
                ApiRoute::Generate,
                r#"{"text": ["ab", "cd"], "sampling_params": [{"max_new_tokens": 3}, {"max_new_tokens": 7}]}"#,
                3 + 14,
            ),
            (
                ApiRoute::Completions,
                r#"{"prompt": "abcdef", "max_tokens": 5}"#,
                7,
            ),
            // The messages list is 35 bytes: 9 tokens.
            (
                ApiRoute::ChatCompletions,
                r#"{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4}"#,
                9 + 4,
            ),
            (
                ApiRoute::Completions,
                r#"{"prompt": "abcdef", "max_tokens": "x"}"#,
                2 + DEFAULT_MAX_NEW_TOKENS,
            ),
        ];
        for (route, body, want) in table {
            let req = super::super::parse(*route, Bytes::from_static(body.as_bytes())).unwrap();
            assert_eq!(req.kv_tokens_estimate(), *want, "{body}");
        }
    }
}
