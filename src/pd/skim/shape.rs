//! The events of one stream share a shape: every token chunk of an OpenAI stream is the
//! same bytes except its text (`delta.content` or `text`) and its usage numbers. A
//! [`ShapeCache`] keeps the last fully skimmed event as a template and answers an event
//! that matches it with two byte comparisons, one string scan and a walk of the usage
//! object, instead of a walk of the whole chunk.
//!
//! Why: the account of a continuable stream reads every event, and the walk of every
//! member was most of the CPU a continuable stream cost (BENCHMARKS §8).
//!
//! Invariants:
//! - the answer is exactly what [`super::chunk`] gives for the same bytes (property-tested):
//!   a hit requires the bytes before the text value and between the text value and the
//!   usage value to equal the template's, the text to be one JSON string, and the usage to
//!   be an object that closes the chunk, so the structure is the template's;
//! - a miss falls back to the full skim, which becomes the template when it has one choice
//!   with a text string and its usage (if any) is the last member.

use std::ops::Range;

use super::{chunk, members, parse_u64, string_end, value_end, ws, Chunk};

/// See the module docs. One per stream (the template is that stream's shape).
#[derive(Debug, Default)]
pub struct ShapeCache {
    /// The template's bytes before its text value.
    head: Vec<u8>,
    /// The template's bytes from the end of its text value to the start of its usage
    /// value, or to the end of the chunk when it has no usage.
    mid: Vec<u8>,
    /// The template's end of its text value.
    piece_end: usize,
    /// The template's usage key starts this many bytes before its usage value.
    usage_key_back: usize,
    /// The template's usage object, when `has_usage`.
    usage: UsageShape,
    has_usage: bool,
    /// The template's skim (spans in the template's bytes); `None`: no template yet.
    tpl: Option<Chunk>,
    /// The last answer (its choice list reused from event to event).
    cur: Chunk,
    /// Events answered from the template.
    #[cfg(test)]
    hits: usize,
    /// An event was skimmed (the first one is never a template: see [`Self::chunk`]).
    seen: bool,
}

/// A usage object's bytes between its values (`{"completion_tokens":`, `,"total_tokens":`,
/// ..., `}`), each with what the value after it is.
#[derive(Debug, Default)]
struct UsageShape {
    bytes: Vec<u8>,
    segs: Vec<(Range<usize>, Slot)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Completion,
    Prompt,
    Other,
    /// The closing brace: no value after it.
    End,
}

impl UsageShape {
    /// Becomes the shape of the usage object `b[u]` (a value span [`super::chunk`] gave),
    /// reusing its buffers.
    fn learn(&mut self, b: &[u8], u: &Range<usize>) -> Option<()> {
        self.bytes.clear();
        self.segs.clear();
        let mut at = u.start;
        let push = |shape: &mut UsageShape, from: usize, to: usize, slot| {
            let s = shape.bytes.len();
            shape.bytes.extend_from_slice(b.get(from..to)?);
            shape.segs.push((s..shape.bytes.len(), slot));
            Some(())
        };
        members(b, u.start, |key, _, vs| {
            let slot = match key {
                b"completion_tokens" => Slot::Completion,
                b"prompt_tokens" => Slot::Prompt,
                _ => Slot::Other,
            };
            push(self, at, vs, slot)?;
            at = value_end(b, vs)?;
            Some(at)
        })?;
        push(self, at, u.end, Slot::End)
    }

    /// The usage object at `at` when its bytes between values are this shape's: its end
    /// and its completion and prompt tokens.
    fn read(&self, b: &[u8], mut at: usize) -> Option<(usize, Option<u64>, Option<u64>)> {
        let (mut completion, mut prompt) = (None, None);
        for (r, slot) in &self.segs {
            let seg = &self.bytes[r.clone()];
            if !b.get(at..)?.starts_with(seg) {
                return None;
            }
            at += seg.len();
            let ve = match slot {
                Slot::End => return Some((at, completion, prompt)),
                _ => value_end(b, at)?,
            };
            match slot {
                Slot::Completion => completion = parse_u64(b, at..ve),
                Slot::Prompt => prompt = parse_u64(b, at..ve),
                _ => {}
            }
            at = ve;
        }
        None
    }
}

fn shift(r: &mut Option<Range<usize>>, from: usize, to: usize) {
    if let Some(r) = r {
        if r.start >= from {
            *r = r.start - from + to..r.end - from + to;
        }
    }
}

impl ShapeCache {
    /// The skim of `b` (as [`super::chunk`]), from the template when `b` matches it.
    pub fn chunk(&mut self, b: &[u8]) -> Option<&Chunk> {
        if self.hit(b).is_none() {
            self.cur = chunk(b)?;
            // A chat stream's first chunk carries the role, and no other has its shape.
            if self.seen {
                self.learn(b);
            }
            self.seen = true;
        }
        Some(&self.cur)
    }

    fn hit(&mut self, b: &[u8]) -> Option<()> {
        let tpl = self.tpl.as_ref()?;
        let ps = self.head.len();
        if !b.starts_with(&self.head) || b.get(ps) != Some(&b'"') {
            return None;
        }
        let pe = string_end(b, ps)?;
        let ms = b.get(pe..)?;
        if !ms.starts_with(&self.mid) {
            return None;
        }
        let after = pe + self.mid.len();
        let (mut completion, mut prompt) = (None, None);
        let usage = if self.has_usage {
            let (ve, c, p) = self.usage.read(b, after)?;
            (completion, prompt) = (c, p);
            let close = ws(b, ve);
            if b.get(close) != Some(&b'}') || ws(b, close + 1) != b.len() {
                return None;
            }
            Some(after..ve)
        } else {
            if after != b.len() {
                return None;
            }
            None
        };
        let cur = &mut self.cur;
        // Field by field: the choice list's allocation is reused (a derived `clone_from`
        // would build a new one per event).
        cur.id.clone_from(&tpl.id);
        cur.choices.clone_from(&tpl.choices);
        let (from, to) = (self.piece_end, pe);
        shift(&mut cur.id, from, to);
        for ch in &mut cur.choices {
            for r in [
                &mut ch.finish_reason,
                &mut ch.reasoning_content,
                &mut ch.tool_calls,
            ] {
                shift(r, from, to);
            }
            // The text value itself: its start is the same, its end is this event's.
            for r in [&mut ch.text, &mut ch.content] {
                match r {
                    Some(r) if r.start == ps => *r = ps..pe,
                    _ => shift(r, from, to),
                }
            }
        }
        cur.usage_member = usage.as_ref().map(|u| u.start - self.usage_key_back..u.end);
        cur.usage = usage;
        cur.completion_tokens = completion;
        cur.prompt_tokens = prompt;
        #[cfg(test)]
        {
            self.hits += 1;
        }
        Some(())
    }

    /// Makes `self.cur` (the full skim of `b`) the template, when it has the shape.
    fn learn(&mut self, b: &[u8]) {
        self.tpl = None;
        let c = &self.cur;
        let [ch] = c.choices.as_slice() else {
            return;
        };
        let Some(piece) = ch.text.clone().or(ch.content.clone()) else {
            return;
        };
        if b.get(piece.start) != Some(&b'"') {
            return;
        }
        let (mid_end, key_back) = match (&c.usage, &c.usage_member) {
            (Some(u), Some(m)) => {
                // The usage must close the chunk (everything else lies before it).
                let close = ws(b, u.end);
                if b.get(close) != Some(&b'}') || ws(b, close + 1) != b.len() || u.start < piece.end
                {
                    return;
                }
                if self.usage.learn(b, u).is_none() {
                    return;
                }
                (u.start, u.start - m.start)
            }
            _ => (b.len(), 0),
        };
        self.head.clear();
        self.head.extend_from_slice(&b[..piece.start]);
        self.mid.clear();
        self.mid.extend_from_slice(&b[piece.end..mid_end]);
        self.piece_end = piece.end;
        self.usage_key_back = key_back;
        self.has_usage = c.usage.is_some();
        self.tpl = Some(c.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(
        order_sim: bool,
        text: &str,
        completion: Option<u64>,
        finish: Option<&str>,
    ) -> Vec<u8> {
        event_with(order_sim, text, completion, finish, false)
    }

    fn event_with(
        order_sim: bool,
        text: &str,
        completion: Option<u64>,
        finish: Option<&str>,
        details: bool,
    ) -> Vec<u8> {
        let text = serde_json::to_string(text).unwrap();
        let finish = finish.map_or("null".to_string(), |f| format!("\"{f}\""));
        let details = if details {
            r#","prompt_tokens_details":{"cached_tokens":3}"#
        } else {
            ""
        };
        let usage = completion.map_or(String::new(), |n| {
            format!(r#","usage":{{"prompt_tokens":9,"total_tokens":{}{details},"completion_tokens":{n}}}"#, n + 9)
        });
        if order_sim {
            format!(r#"{{"choices":[{{"delta":{{"content":{text}}},"finish_reason":{finish},"index":0,"logprobs":null}}],"created":17,"id":"abc","model":"m","object":"chat.completion.chunk"{usage}}}"#).into_bytes()
        } else {
            format!(r#"{{"id":"abc","object":"chat.completion.chunk","created":17,"model":"m","choices":[{{"index":0,"delta":{{"role":null,"content":{text},"reasoning_content":null,"tool_calls":null}},"logprobs":null,"finish_reason":{finish},"matched_stop":null}}]{usage}}}"#).into_bytes()
        }
    }

    #[test]
    fn a_stream_of_one_shape_is_answered_from_the_template() {
        for sim in [true, false] {
            let mut cache = ShapeCache::default();
            for (i, t) in ["", " Paris", "\"q\"", " is", "\\n"].iter().enumerate() {
                let b = event(sim, t, Some(i as u64), None);
                let want = chunk(&b).unwrap();
                let got = cache.chunk(&b).unwrap().clone();
                assert_eq!(got, want, "{}", String::from_utf8_lossy(&b));
                // The first event is never a template, the second becomes one.
                assert_eq!(cache.hits, i.saturating_sub(1));
            }
            // A finish chunk has another shape: a miss, and still the same answer.
            let b = event(sim, "", Some(5), Some("length"));
            assert_eq!(cache.chunk(&b).unwrap().clone(), chunk(&b).unwrap());
            // Without usage, and malformed, as the full skim.
            let b = event(sim, "x", None, None);
            assert_eq!(cache.chunk(&b).unwrap().clone(), chunk(&b).unwrap());
            let mut bad = event(sim, "x", Some(1), None);
            bad.push(b'x');
            assert!(cache.chunk(&bad).is_none());
        }
    }

    proptest::proptest! {
        /// Whatever a stream sends, the cache answers as the full skim does.
        #[test]
        fn agrees_with_the_full_skim(
            events in proptest::collection::vec(
                (proptest::bool::ANY, ".{0,6}", proptest::option::of(0u64..1000),
                 proptest::option::of("stop|length"), 0usize..40, proptest::bool::ANY,
                 proptest::bool::ANY),
                1..12,
            )
        ) {
            let mut cache = ShapeCache::default();
            for (sim, text, completion, finish, cut, garble, details) in events {
                let mut b = event_with(sim, &text, completion, finish.as_deref(), details);
                if garble {
                    // Damage one byte near the end (the usage or the closing brace).
                    let at = b.len().saturating_sub(1 + cut);
                    b[at] = b'"';
                }
                let want = chunk(&b);
                let got = cache.chunk(&b).cloned();
                proptest::prop_assert_eq!(got, want);
            }
        }
    }
}
