//! The usage member that closes an OpenAI stream chunk, found from the chunk's end.
//!
//! Why: before a move, all a continuable stream must do to an event right away is cut the
//! per-chunk usage pdgate asked the decode for out of what the client gets; the account
//! of the event can wait (see `splice`). Engines write `usage` as the chunk's last member
//! (SGLang's and vLLM's chunk models end with it), so it is found by walking back over the
//! usage object alone, not over the whole chunk.
//!
//! Invariants:
//! - for a chunk that is JSON, the answer is the full skim's `usage_member` when that
//!   member is an object and the chunk's last member, and `None` otherwise (property-tested
//!   against [`super::chunk`]): an unescaped `"usage"` key right after `,` or `{` whose
//!   value closes one brace before the chunk's end is a member of the chunk itself;
//! - a usage object holding a string with a backslash, or an array, gives `None` (the
//!   caller then skims the whole chunk); nothing here panics on any input;
//! - a payload that is not JSON may still get an answer (the walk reads the usage object's
//!   braces and strings and its key, not the rest): the caller forwards it cut, as
//!   malformed as it came. Why no forward check: in JSON, a quote not preceded by a
//!   backslash delimits a string, so a backward walk over strings without backslashes
//!   meets the same structure a forward one would.

use std::ops::Range;

/// What the walk back over a usage object stops at: braces and quotes, and what makes it
/// give up (brackets, a backslash).
static STOPS: [bool; 256] = super::table(b"{}\"[]\\");

/// The index after the last non-whitespace byte of `b[..end]`.
fn trim_end(b: &[u8], mut end: usize) -> usize {
    while end > 0 && matches!(b[end - 1], b' ' | b'\t' | b'\n' | b'\r') {
        end -= 1;
    }
    end
}

/// The `"usage":{...}` member (from its key's opening quote to the end of its value) that
/// closes the chunk `b`, found from its end (see the module docs).
pub fn usage_member(b: &[u8]) -> Option<Range<usize>> {
    let end = trim_end(b, b.len());
    if end < 2 || b[end - 1] != b'}' {
        return None;
    }
    let ve = trim_end(b, end - 1);
    if ve == 0 || b[ve - 1] != b'}' {
        return None;
    }
    // Back to the brace that opens the usage object, over its keys and nested objects,
    // from one byte that matters to the previous one.
    let mut depth = 0usize;
    let mut i = ve;
    let vs = loop {
        i = b[..i].iter().rposition(|&c| STOPS[usize::from(c)])?;
        match b[i] {
            b'}' => depth += 1,
            b'{' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    break i;
                }
            }
            b'"' => {
                // A string without a backslash: its opening quote is the previous quote.
                i = b[..i].iter().rposition(|&c| c == b'"' || c == b'\\')?;
                if b[i] == b'\\' || (i > 0 && b[i - 1] == b'\\') {
                    return None;
                }
            }
            _ => return None,
        }
    };
    // Its key: `"usage"` then `:`, right after the `,` or `{` that starts a member.
    let colon = trim_end(b, vs);
    if colon == 0 || b[colon - 1] != b':' {
        return None;
    }
    let key_end = trim_end(b, colon - 1);
    let key_start = key_end.checked_sub(7)?;
    if &b[key_start..key_end] != b"\"usage\"" {
        return None;
    }
    let before = trim_end(b, key_start);
    if before == 0 || !matches!(b[before - 1], b',' | b'{') {
        return None;
    }
    Some(key_start..ve)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Map, Value};

    #[test]
    fn table_of_chunks() {
        // (payload, the member's text, or None)
        let table: &[(&str, Option<&str>)] = &[
            (
                r#"{"id":"a","choices":[{"delta":{"content":"x"}}],"usage":{"prompt_tokens":3,"completion_tokens":1}}"#,
                Some(r#""usage":{"prompt_tokens":3,"completion_tokens":1}"#),
            ),
            (
                r#" { "choices" : [ ] , "usage" : { "a" : { "b" : 1 } , "c" : null } } "#,
                Some(r#""usage" : { "a" : { "b" : 1 } , "c" : null }"#),
            ),
            (r#"{"usage":{"n":1}}"#, Some(r#""usage":{"n":1}"#)),
            // Not last, null, nested, or not an object.
            (r#"{"usage":{"n":1},"id":"a"}"#, None),
            (r#"{"id":"a","usage":null}"#, None),
            (r#"{"choices":[{"usage":{"n":1}}]}"#, None),
            (r#"{"x":{"a":1,"usage":{"n":1}}}"#, None),
            (r#"{"usage":[1]}"#, None),
            (r#"{"id":"say \"usage\":{\"n\":1}"}"#, None),
            // Strings with escapes or arrays inside usage: left to the full skim.
            (r#"{"usage":{"k\"":1}}"#, None),
            (r#"{"usage":{"k":[1]}}"#, None),
            // Not JSON at the end.
            (r#"{"usage":{"n":1}"#, None),
            (r#"}}"#, None),
            (r#""#, None),
            (r#"{"usage":{"n":1}}x"#, None),
        ];
        for (payload, want) in table {
            let b = payload.as_bytes();
            let got = usage_member(b).map(|r| std::str::from_utf8(&b[r]).unwrap());
            assert_eq!(got, *want, "{payload}");
        }
    }

    fn usage_value() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        (
            0u64..1000,
            proptest::option::of(0u64..100),
            proptest::bool::ANY,
            "[a-z{}\\[\\]\"\\\\]{0,4}",
        )
            .prop_map(|(n, cached, details, key)| {
                let mut u = Map::new();
                u.insert("prompt_tokens".into(), json!(9));
                u.insert("completion_tokens".into(), json!(n));
                if details {
                    u.insert(
                        "prompt_tokens_details".into(),
                        cached.map_or(Value::Null, |c| json!({ "cached_tokens": c })),
                    );
                }
                if !key.is_empty() {
                    u.insert(key, json!(1));
                }
                Value::Object(u)
            })
    }

    proptest::proptest! {
        /// Whatever a chunk holds, the answer is the full skim's usage member when usage
        /// closes the chunk, and nothing otherwise.
        #[test]
        fn agrees_with_the_full_skim(
            text in ".{0,8}",
            usage in usage_value(),
            at in 0usize..4,
            nested in proptest::bool::ANY,
            null in proptest::bool::ANY,
        ) {
            let mut members: Vec<(String, Value)> = vec![
                ("id".into(), json!("c-1")),
                ("choices".into(), json!([{"index": 0, "delta": {"content": text}, "finish_reason": null}])),
                ("model".into(), json!("m")),
            ];
            let usage = if null { Value::Null } else { usage };
            if nested {
                members[1].1[0]["usage"] = usage;
            } else {
                members.insert(at.min(members.len()), ("usage".into(), usage));
            }
            let body: Vec<String> = members
                .iter()
                .map(|(k, v)| format!("{}:{}", json!(k), v))
                .collect();
            let b = format!("{{{}}}", body.join(","));
            let b = b.as_bytes();
            let full = super::super::chunk(b).expect("a JSON chunk");
            let last = !nested && !null && at >= 3;
            match usage_member(b) {
                Some(m) => {
                    proptest::prop_assert!(last);
                    proptest::prop_assert_eq!(Some(m), full.usage_member);
                }
                None => {
                    // Only a usage key with a backslash gives up on a last usage member.
                    let escaped = full
                        .usage
                        .as_ref()
                        .is_some_and(|u| b[u.clone()].contains(&b'\\') || b[u.clone()].contains(&b'['));
                    proptest::prop_assert!(!last || escaped, "{}", String::from_utf8_lossy(b));
                }
            }
        }
    }
}
