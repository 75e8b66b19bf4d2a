//! The prompt-cache figures an answer ends with: `prompt_tokens` and `cached_tokens`, as
//! SGLang puts them in `meta_info` (`/generate`) or `usage` and
//! `usage.prompt_tokens_details` (OpenAI routes), read from the answer's last bytes.
//!
//! Why from the end, by search: the figures sit in the answer's last event (a stream's
//! final usage chunk, a non-streamed answer's `usage` or `meta_info`, which SGLang writes
//! after the text), and the relay looks at them once per answer, so a search of a bounded
//! tail ([`WINDOW`]) costs what one short `memmem` does, whatever the answer's length.
//!
//! Invariants: only a key that opens a JSON string counts (one inside a string value is
//! escaped, `\"cached_tokens\"`, and is skipped); the last occurrence wins (a stream's
//! final figures); `None` when no `prompt_tokens` number is there (the engine reported
//! nothing); a missing `cached_tokens` is 0 (SGLang omits `prompt_tokens_details` when
//! nothing was cached). Never panics.

use memchr::memmem;

/// How many trailing bytes are searched.
pub const WINDOW: usize = 4096;

/// An answer's prompt figures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PromptCache {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

/// The figures in the last [`WINDOW`] bytes of `b`; see the module docs.
pub fn prompt_cache(b: &[u8]) -> Option<PromptCache> {
    let tail = &b[b.len().saturating_sub(WINDOW)..];
    let prompt_tokens = last_number(tail, b"\"prompt_tokens\"")?;
    let cached_tokens = last_number(tail, b"\"cached_tokens\"").unwrap_or(0);
    Some(PromptCache {
        prompt_tokens,
        cached_tokens,
    })
}

/// The number after the last unescaped `key` followed by a colon.
fn last_number(b: &[u8], key: &[u8]) -> Option<u64> {
    let mut end = b.len();
    while let Some(at) = memmem::rfind(&b[..end], key) {
        end = at;
        if at > 0 && b[at - 1] == b'\\' {
            continue;
        }
        let mut i = super::ws(b, at + key.len());
        if b.get(i) != Some(&b':') {
            continue;
        }
        i = super::ws(b, i + 1);
        let digits = b[i..].iter().take_while(|c| c.is_ascii_digit()).count();
        if digits == 0 {
            continue;
        }
        return super::parse_u64(b, i..i + digits);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pc(p: u64, c: u64) -> Option<PromptCache> {
        Some(PromptCache {
            prompt_tokens: p,
            cached_tokens: c,
        })
    }

    #[test]
    fn figures_are_read_from_the_answers_shapes() {
        let long_text = "x".repeat(3 * WINDOW);
        let cases: Vec<(String, Option<PromptCache>)> = vec![
            (r#"{"text":"hi","meta_info":{"prompt_tokens":120,"cached_tokens":96,"completion_tokens":4}}"#.into(), pc(120, 96)),
            (r#"data: {"choices":[],"usage":{"prompt_tokens":50,"completion_tokens":4,"total_tokens":54,"prompt_tokens_details":{"cached_tokens":32}}}

data: [DONE]

"#.into(), pc(50, 32)),
            (r#"{"usage":{"prompt_tokens": 7, "completion_tokens": 1}}"#.into(), pc(7, 0)),
            (r#"{"choices":[{"delta":{"content":"x"}}]}"#.into(), None),
            // A key spelled inside the text is escaped: skipped.
            (r#"{"text":"say \"prompt_tokens\": 99","meta_info":{"prompt_tokens":3,"cached_tokens":0}}"#.into(), pc(3, 0)),
            (r#"{"text":"say \"prompt_tokens\": 99"}"#.into(), None),
            // A stream's last figures win.
            (r#"data: {"meta_info":{"prompt_tokens":10,"cached_tokens":0}}
data: {"meta_info":{"prompt_tokens":10,"cached_tokens":8}}
"#.into(), pc(10, 8)),
            // Figures past the window's start are found in a long answer's tail.
            (format!(r#"{{"text":"{long_text}","meta_info":{{"prompt_tokens":5,"cached_tokens":4}}}}"#), pc(5, 4)),
            (r#"{"usage":{"prompt_tokens":null}}"#.into(), None),
            (r#""prompt_tokens""#.into(), None),
            (String::new(), None),
        ];
        for (b, want) in cases {
            assert_eq!(prompt_cache(b.as_bytes()), want, "{b}");
        }
    }
}
