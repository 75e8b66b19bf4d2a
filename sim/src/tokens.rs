//! The simulator's "model": output tokens that depend on everything before them.
//!
//! Why: a router that moves a stream to another decode must send the prompt plus what was
//! already generated. With tokens drawn from the context (a streaming FNV-1a hash of the
//! prompt as received, then of each token produced), a continuation that carries the
//! partial answer produces exactly the rest of the uninterrupted answer, and a replay from
//! scratch, or a continuation without the partial answer, produces different text.
//!
//! Invariants: the same context gives the same tokens in every process and build; a text
//! context feeds token texts, a token-id context feeds token ids, so `/generate` with
//! `text` + received text and with `input_ids` + received `output_ids` both continue
//! exactly.

const WORDS: [&str; 12] = [
    " the", " quick", " sim", " engine", " says", " hello", " to", " a", " router", " and",
    " moves", " on",
];

/// A context being hashed.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Context {
    h: u64,
    by_ids: bool,
}

fn feed(mut h: u64, bytes: &[u8]) -> u64 {
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

impl Context {
    /// A text prompt (`text`, a string `prompt`, a rendered chat).
    pub(crate) fn text(s: &str) -> Context {
        Context {
            h: feed(FNV_OFFSET, s.as_bytes()),
            by_ids: false,
        }
    }

    /// A token-id prompt (`input_ids`, a token-id `prompt`).
    pub(crate) fn ids(ids: &[i64]) -> Context {
        let mut c = Context {
            h: FNV_OFFSET,
            by_ids: true,
        };
        for id in ids {
            c.push_id(*id);
        }
        c
    }

    fn push_id(&mut self, id: i64) {
        self.h = feed(self.h, id.to_string().as_bytes());
        self.h = feed(self.h, b",");
    }

    /// The next `n` tokens (text, id).
    pub(crate) fn generate(mut self, n: u32) -> Vec<(&'static str, i64)> {
        (0..n)
            .map(|_| {
                let mix = self.h ^ (self.h >> 29);
                let word = WORDS[(mix % WORDS.len() as u64) as usize];
                let id = 2000 + ((mix >> 11) % 5000) as i64;
                if self.by_ids {
                    self.push_id(id);
                } else {
                    self.h = feed(self.h, word.as_bytes());
                }
                (word, id)
            })
            .collect()
    }
}

/// The token id of one word: the simulator's tokenizer makes one token of each
/// whitespace-separated word (as it counts prompt tokens), its id a hash of the word, so
/// that prompts sharing leading words share leading token ids (the prefix caches key on
/// them, `crate::prefix_cache`).
pub(crate) fn word_id(word: &str) -> i64 {
    // Non-negative, and clear of the answer ids (2000..7000) and the synthetic prompt ids.
    ((feed(FNV_OFFSET, word.as_bytes()) >> 2) as i64).max(100_000)
}

/// The token ids of a text prompt: one per word, or one for a prompt without words (the
/// simulator counts it as one token).
pub(crate) fn text_ids(s: &str) -> Vec<i64> {
    let ids: Vec<i64> = s.split_whitespace().map(word_id).collect();
    if ids.is_empty() {
        vec![word_id("")]
    } else {
        ids
    }
}

/// The token ids of a chat conversation as the simulator counts its tokens: per message,
/// four of framing (start, role, newline, end) around its content's words (a text part
/// without words counts one, a part without text none). A conversation's next turn thus
/// starts with the earlier turns' ids, as with a real chat template.
pub(crate) fn chat_ids(msgs: &[serde_json::Value]) -> Vec<i64> {
    let mut ids = Vec::new();
    for m in msgs {
        ids.push(word_id("<|im_start|>"));
        ids.push(word_id(
            m.get("role")
                .and_then(serde_json::Value::as_str)
                .unwrap_or(""),
        ));
        ids.push(word_id("\n"));
        match m.get("content") {
            Some(serde_json::Value::String(s)) => ids.extend(text_ids(s)),
            Some(serde_json::Value::Array(parts)) => {
                for p in parts {
                    if let Some(t) = p.get("text").and_then(serde_json::Value::as_str) {
                        ids.extend(text_ids(t));
                    }
                }
            }
            _ => {}
        }
        ids.push(word_id("<|im_end|>"));
    }
    if ids.is_empty() {
        ids.push(word_id(""));
    }
    ids
}

/// SGLang's chat rendering, as far as the simulator needs it: each message as
/// `<role>content\n`, then the generation prompt `<assistant>`; with
/// `continue_final_message` and a final assistant message, that message's content follows
/// the generation prompt (the answer continues it).
pub(crate) fn render_chat(msgs: &[serde_json::Value], continue_final: bool) -> String {
    let content = |m: &serde_json::Value| -> String {
        match m.get("content") {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Array(parts)) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(serde_json::Value::as_str))
                .collect(),
            _ => String::new(),
        }
    };
    let cont = continue_final
        && msgs.last().is_some_and(|m| {
            m.get("role").and_then(serde_json::Value::as_str) == Some("assistant")
        });
    let (head, prefix) = match (cont, msgs.split_last()) {
        (true, Some((last, head))) => (head, content(last)),
        _ => (msgs, String::new()),
    };
    let mut s = String::new();
    for m in head {
        s.push('<');
        s.push_str(
            m.get("role")
                .and_then(serde_json::Value::as_str)
                .unwrap_or(""),
        );
        s.push('>');
        s.push_str(&content(m));
        s.push('\n');
    }
    s.push_str("<assistant>");
    s.push_str(&prefix);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_continuation_with_the_partial_answer_is_the_rest() {
        for by_ids in [false, true] {
            let start = if by_ids {
                Context::ids(&[5, 6, 7])
            } else {
                Context::text("hi there")
            };
            let whole = start.generate(20);
            for k in 0..20 {
                let rest = if by_ids {
                    let mut ids = vec![5, 6, 7];
                    ids.extend(whole[..k].iter().map(|t| t.1));
                    Context::ids(&ids).generate(20 - k as u32)
                } else {
                    let text: String = whole[..k].iter().map(|t| t.0).collect();
                    Context::text(&format!("hi there{text}")).generate(20 - k as u32)
                };
                assert_eq!(&whole[k..], &rest[..], "by_ids {by_ids}, cut {k}");
                if k > 0 {
                    // A replay from scratch differs from the rest.
                    assert_ne!(&start.generate(20 - k as u32)[..], &whole[k..]);
                }
            }
        }
        let other = Context::text("hi therE").generate(20);
        assert_ne!(Context::text("hi there").generate(20), other);
    }
}
