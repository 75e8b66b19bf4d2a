//! The prompt-cache figures an answer ends with: `prompt_tokens` and `cached_tokens`, as
//! SGLang puts them in `meta_info` (`/generate`) or `usage` and
//! `usage.prompt_tokens_details` (OpenAI routes), read from the answer's last bytes.
//!
//! Why from the end, by search: the figures sit in the answer's last event (a stream's
//! final usage chunk, a non-streamed answer's `usage` or `meta_info`, which SGLang writes
//! after the text), and the relay looks at them once per answer: one search of a bounded
//! tail ([`WINDOW`]) for `prompt_tokens`, then one for `cached_tokens` within [`NEAR`]
//! bytes of it, with searchers built once, whatever the answer's length. The relay hands
//! over the decode's bytes as they came, before a continuable stream's account cuts the
//! usage it asked for out of what the client gets.
//!
//! Invariants: only a key that opens a JSON string counts (one inside a string value is
//! escaped, `\"cached_tokens\"`, and is skipped); the last `prompt_tokens` wins (a
//! stream's final figures) with the `cached_tokens` nearest after it (else before it);
//! `None` when no `prompt_tokens` number is there (the engine reported nothing); a missing
//! `cached_tokens` is 0 (SGLang omits `prompt_tokens_details` when nothing was cached).
//! Never panics.

use std::sync::LazyLock;

use memchr::memmem;

/// How many trailing bytes are searched for `prompt_tokens`.
pub const WINDOW: usize = 2048;
/// How far from `prompt_tokens` its `cached_tokens` is looked for (after it, where SGLang
/// writes it in `meta_info` and `usage`, else before it).
pub const NEAR: usize = 512;

// Forward searchers (memchr's SIMD prefilter; its reverse search has none): the last
// occurrence is the last one a forward pass meets.
static PROMPT: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"prompt_tokens\""));
static CACHED: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"cached_tokens\""));

/// An answer's prompt figures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PromptCache {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

/// The figures in the last [`WINDOW`] bytes of `b`; see the module docs.
pub fn prompt_cache(b: &[u8]) -> Option<PromptCache> {
    let key = b"\"prompt_tokens\"".len();
    // The final figures usually sit in the last few hundred bytes (a stream's last usage
    // chunk before `[DONE]`): look there first, so that a stream with usage on every chunk
    // is not read event by event; then the whole window.
    let (tail, (at, prompt_tokens)) = [NEAR, WINDOW]
        .into_iter()
        .map(|w| &b[b.len().saturating_sub(w)..])
        .find_map(|t| last_number(t, &PROMPT, key).map(|found| (t, found)))?;
    let after = &tail[at..tail.len().min(at + NEAR)];
    let before = &tail[at.saturating_sub(NEAR)..at];
    let key = b"\"cached_tokens\"".len();
    let cached_tokens = CACHED
        .find(after)
        .and_then(|i| number_after(after, i, key))
        .or_else(|| last_number(before, &CACHED, key).map(|(_, n)| n))
        .unwrap_or(0);
    Some(PromptCache {
        prompt_tokens,
        cached_tokens,
    })
}

/// Where the last unescaped key `finder` finds (of `key_len` bytes) starts, and the number
/// after its colon.
fn last_number(b: &[u8], finder: &memmem::Finder<'_>, key_len: usize) -> Option<(usize, u64)> {
    finder
        .find_iter(b)
        .filter_map(|at| number_after(b, at, key_len).map(|n| (at, n)))
        .last()
}

/// The number after the key at `at` (of `key_len` bytes) and its colon, when the key is
/// not escaped (inside a string).
fn number_after(b: &[u8], at: usize, key_len: usize) -> Option<u64> {
    if at > 0 && b[at - 1] == b'\\' {
        return None;
    }
    let mut i = super::ws(b, at + key_len);
    if b.get(i) != Some(&b':') {
        return None;
    }
    i = super::ws(b, i + 1);
    let digits = b
        .get(i..)?
        .iter()
        .take_while(|c| c.is_ascii_digit())
        .count();
    if digits == 0 {
        return None;
    }
    super::parse_u64(b, i..i + digits)
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
