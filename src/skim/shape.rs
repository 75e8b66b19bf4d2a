//! The events of one stream share a shape: every token chunk of an OpenAI stream is the
//! same bytes except its text (`delta.content` or `text`) and its usage numbers. A
//! [`ShapeCache`] keeps the last fully skimmed event as a template and answers an event
//! that matches it with a few byte comparisons, one string scan and its counts' digits,
//! instead of a walk of the whole chunk.
//!
//! Why: the account of a continuable stream reads every event, and the walk of every
//! member was most of the CPU a continuable stream cost (BENCHMARKS §8).
//!
//! Invariants:
//! - the answer is exactly what [`super::chunk`] gives for the same bytes (property-tested):
//!   a hit requires the bytes before the text value to equal the template's, the text to
//!   be one JSON string, and the bytes after it to be the template's but for the digits of
//!   the usage object's counts (the usage, if any, closes the chunk), so the structure is
//!   the template's;
//! - a miss falls back to the full skim, which becomes the template when it has one choice
//!   with a text string and its usage (if any) is the last member;
//! - [`ShapeCache::token`] answers a matching event with only what differs from the template
//!   (its text, its counts, its usage member; property-tested against the full skim), for a
//!   stream's account that needs no [`Chunk`]; what follows the text is matched as literal
//!   segments and runs of digits ([`TailShape`]).

use std::ops::Range;

use super::{chunk, members, parse_u64, string_end_in_line, value_end, ws, Chunk, Flags};

/// See the module docs. One per stream (the template is that stream's shape).
#[derive(Debug, Default)]
pub struct ShapeCache {
    /// The template's bytes before its text value.
    head: Vec<u8>,
    /// The template's end of its text value.
    piece_end: usize,
    /// The template's usage key starts this many bytes before its usage value.
    usage_key_back: usize,
    /// The template's bytes after its text value.
    tail: TailShape,
    /// The template's skim (spans in the template's bytes); `None`: no template yet.
    tpl: Option<Chunk>,
    /// The last answer (its choice list reused from event to event).
    cur: Chunk,
    /// The template's only choice's flags.
    flags: Flags,
    /// The template holds neither `"abort"` nor `"error"`.
    clean: bool,
    /// Events answered from the template.
    #[cfg(test)]
    hits: usize,
    /// An event was skimmed (the first one is never a template: see [`Self::chunk`]).
    seen: bool,
}

/// The rest of a token chunk after its text value, as a template: its bytes, cut where
/// its usage object holds the digits of a count. Another chunk's rest has this shape when
/// it is the same bytes with another run of digits (at least one) in place of each count.
/// Such a rest has the template's structure, value for value, so its counts are read at
/// the template's places and its usage object ends as many bytes before the chunk's end.
///
/// Why: one stream's chunks differ after their text only in their counts. Read as literal
/// segments (each one slice comparison) and runs of digits (read as they are checked), the
/// rest costs a few comparisons instead of a walk of its members, and a count that gains a
/// digit is no miss.
///
/// The prompt's count is not a run: it is the same in every event of a stream (an event
/// with another misses, and becomes the template), so it is compared as bytes and read
/// once, when learned.
#[derive(Debug, Default)]
struct TailShape {
    /// The template's bytes outside its runs of digits, one after the other.
    lit: Vec<u8>,
    /// The literal segments' lengths in `lit`: one before the first run, one after each.
    lits: Vec<usize>,
    /// Each run: whether it is the completion tokens' count.
    runs: Vec<bool>,
    /// The completion tokens' count when it is no run (absent, `null`): the same in every
    /// chunk of the shape.
    completion: Option<u64>,
    prompt: Option<u64>,
    /// Where the usage value starts (from the rest's start; no run comes before it), and
    /// how many bytes of the chunk follow its end.
    usage: Option<(usize, usize)>,
}

impl TailShape {
    /// Becomes the shape of `b[from..]`, whose usage value (if any) is `b[u]` (a value
    /// span [`super::chunk`] gave), reusing its buffers.
    fn learn(&mut self, b: &[u8], from: usize, usage: Option<&Range<usize>>) -> Option<()> {
        let mut runs: Vec<(Range<usize>, bool)> = Vec::new();
        let (mut prompt, mut completion) = (None, None);
        if let Some(u) = usage {
            members(b, u.start, |key, _, vs| {
                let ve = value_end(b, vs)?;
                let digits = b[vs..ve].iter().all(u8::is_ascii_digit);
                match key {
                    b"prompt_tokens" => prompt = parse_u64(b, vs..ve),
                    b"completion_tokens" if digits => runs.push((vs..ve, true)),
                    b"completion_tokens" => completion = parse_u64(b, vs..ve),
                    _ if digits => runs.push((vs..ve, false)),
                    _ => {}
                }
                Some(ve)
            })?;
        }
        self.lit.clear();
        self.lits.clear();
        self.runs.clear();
        let mut at = from;
        for (r, completion) in runs {
            let l = b.get(at..r.start)?;
            self.lit.extend_from_slice(l);
            self.lits.push(l.len());
            self.runs.push(completion);
            at = r.end;
        }
        let l = b.get(at..)?;
        self.lit.extend_from_slice(l);
        self.lits.push(l.len());
        (self.prompt, self.completion) = (prompt, completion);
        self.usage = match usage {
            Some(u) => Some((u.start.checked_sub(from)?, b.len().checked_sub(u.end)?)),
            None => None,
        };
        Some(())
    }

    /// The rest at `at` when it has this shape (see the type's docs): its end and its
    /// completion and prompt tokens.
    fn read(&self, b: &[u8], at: usize) -> Option<(usize, Option<u64>, Option<u64>)> {
        let (first, lits) = self.lits.split_first()?;
        let mut i = at + first;
        let (mut l, mut completion) = (*first, self.completion);
        if b.get(at..i)? != self.lit.get(..l)? {
            return None;
        }
        for (&is_completion, &n) in self.runs.iter().zip(lits) {
            let start = i;
            let mut v = 0u64;
            while let Some(d) = b.get(i).map(|c| c.wrapping_sub(b'0')).filter(|d| *d <= 9) {
                v = v.checked_mul(10)?.checked_add(u64::from(d))?;
                i += 1;
            }
            if i == start {
                return None;
            }
            if is_completion {
                completion = Some(v);
            }
            if b.get(i..i + n)? != self.lit.get(l..l + n)? {
                return None;
            }
            i += n;
            l += n;
        }
        Some((i, completion, self.prompt))
    }
}

fn shift(r: &mut Option<Range<usize>>, from: usize, to: usize) {
    if let Some(r) = r {
        if r.start >= from {
            *r = r.start - from + to..r.end - from + to;
        }
    }
}

/// What a token event that matches the stream's template holds: all the account of a
/// stream that has not moved needs (see [`ShapeCache::token`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Token {
    /// The text value's bytes between its quotes (still escaped).
    pub piece: Range<usize>,
    pub completion_tokens: Option<u64>,
    pub prompt_tokens: Option<u64>,
    /// The usage member, from its key to the end of its value.
    pub usage_member: Option<Range<usize>>,
    /// The template's only choice's flags (its bytes around the text are the template's).
    pub flags: Flags,
    /// The event holds neither `"abort"` nor `"error"` (so no abort or error chunk): a
    /// matching event can hold either word only where its template does, or as its whole
    /// text (each word begins and ends with a quote, and inside a string every other quote
    /// is escaped).
    pub abort_free: bool,
}

impl ShapeCache {
    /// The skim of `b` (as [`super::chunk`]), from the template when `b` matches it.
    pub fn chunk(&mut self, b: &[u8]) -> Option<&Chunk> {
        match self.matched(b) {
            Some(t) => self.answer(t),
            None => {
                self.cur = chunk(b)?;
                // A chat stream's first chunk carries the role, and no other has its shape.
                if self.seen {
                    self.learn(b);
                }
                self.seen = true;
            }
        }
        Some(&self.cur)
    }

    /// `b` as a [`Token`] when it matches the template, without building its [`Chunk`]:
    /// the same answer [`Self::chunk`] would give, read where it differs from the
    /// template. `None` (a miss) changes nothing: call [`Self::chunk`] then. A text that
    /// holds a raw `\n` (which JSON escapes) misses, so a hit is one line if its template is.
    pub fn token(&mut self, b: &[u8]) -> Option<Token> {
        let t = self.matched(b)?;
        #[cfg(test)]
        {
            self.hits += 1;
        }
        Some(t)
    }

    /// The template's skim with `t`'s spans and counts.
    fn answer(&mut self, t: Token) {
        let Some(tpl) = self.tpl.as_ref() else {
            return;
        };
        let cur = &mut self.cur;
        // Field by field: the choice list's allocation is reused (a derived `clone_from`
        // would build a new one per event).
        cur.id.clone_from(&tpl.id);
        cur.choices.clone_from(&tpl.choices);
        let (ps, pe) = (t.piece.start - 1, t.piece.end + 1);
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
        cur.usage = t
            .usage_member
            .as_ref()
            .map(|m| m.start + self.usage_key_back..m.end);
        cur.usage_member = t.usage_member;
        cur.completion_tokens = t.completion_tokens;
        cur.prompt_tokens = t.prompt_tokens;
        #[cfg(test)]
        {
            self.hits += 1;
        }
    }

    /// Whether `b` has the template's shape, and what it holds where it differs.
    fn matched(&self, b: &[u8]) -> Option<Token> {
        self.tpl.as_ref()?;
        let ps = self.head.len();
        if b.get(ps) != Some(&b'"') || !b.starts_with(&self.head) {
            return None;
        }
        // A text with a raw newline would end the event's data line: a miss.
        let pe = string_end_in_line(b, ps)?;
        let (end, completion, prompt) = self.tail.read(b, pe)?;
        if end != b.len() {
            return None;
        }
        let usage_member = self
            .tail
            .usage
            .map(|(at, after)| pe + at - self.usage_key_back..end - after);
        // Neither word can appear in a matching event unless in the template's own bytes
        // or as its whole text: each begins and ends with a quote, and every other quote
        // inside a string is escaped, so no occurrence starts or ends inside the text; one
        // that takes in a count's digits has none; all the other bytes are the template's.
        let piece = ps + 1..pe - 1;
        let abort_free = self.clean && !matches!(b.get(piece.clone()), Some(b"abort" | b"error"));
        Some(Token {
            piece,
            completion_tokens: completion,
            prompt_tokens: prompt,
            usage_member,
            flags: self.flags,
            abort_free,
        })
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
        let (usage, key_back) = match (&c.usage, &c.usage_member) {
            (Some(u), Some(m)) => {
                // The usage must close the chunk (everything else lies before it).
                let close = ws(b, u.end);
                // The usage member (its key too) follows the text: `matched` finds the key
                // at a fixed distance after the text's end.
                if b.get(close) != Some(&b'}') || ws(b, close + 1) != b.len() || m.start < piece.end
                {
                    return;
                }
                (Some(u), u.start - m.start)
            }
            _ => (None, 0),
        };
        if self.tail.learn(b, piece.end, usage).is_none() {
            return;
        }
        self.head.clear();
        self.head.extend_from_slice(&b[..piece.start]);
        self.piece_end = piece.end;
        self.usage_key_back = key_back;
        self.flags = ch.flags(b);
        self.clean = !super::may_hold_abort(b);
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
        event_prompt(order_sim, text, completion, finish, details, 9)
    }

    fn event_prompt(
        order_sim: bool,
        text: &str,
        completion: Option<u64>,
        finish: Option<&str>,
        details: bool,
        prompt: u64,
    ) -> Vec<u8> {
        let text = serde_json::to_string(text).unwrap();
        let finish = finish.map_or("null".to_string(), |f| format!("\"{f}\""));
        let details = if details {
            r#","prompt_tokens_details":{"cached_tokens":3}"#
        } else {
            ""
        };
        let usage = completion.map_or(String::new(), |n| {
            format!(r#","usage":{{"prompt_tokens":{prompt},"total_tokens":{}{details},"completion_tokens":{n}}}"#, n + prompt)
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

        /// A token answer holds what the full skim finds: the text, the counts, the
        /// usage member and the choice's flags; a miss leaves the caller to the full skim.
        #[test]
        fn tokens_agree_with_the_full_skim(
            sim in proptest::bool::ANY,
            details in proptest::bool::ANY,
            events in proptest::collection::vec(
                (".{0,6}", proptest::option::weighted(0.9, 0u64..100_000),
                 proptest::option::weighted(0.1, "stop|length"), 0usize..40,
                 proptest::bool::weighted(0.2),
                 // The prompt's count, compared as bytes: mostly the stream's, at times
                 // another of the same length or of another length.
                 proptest::sample::select(vec![9u64, 9, 9, 9, 7, 1234])),
                1..16,
            )
        ) {
            let mut cache = ShapeCache::default();
            for (text, completion, finish, cut, garble, prompt) in events {
                let mut b =
                    event_prompt(sim, &text, completion, finish.as_deref(), details, prompt);
                if garble {
                    let at = b.len().saturating_sub(1 + cut);
                    b[at] = b'"';
                }
                let want = chunk(&b);
                match cache.token(&b) {
                    Some(t) => {
                        let want = want.expect("a token is a chunk");
                        let [ch] = want.choices.as_slice() else {
                            panic!("a token has one choice");
                        };
                        let piece = ch.text.as_ref().or(ch.content.as_ref());
                        proptest::prop_assert_eq!(
                            Some(t.piece),
                            piece.and_then(|r| super::super::string_body(&b, r))
                        );
                        proptest::prop_assert_eq!(t.completion_tokens, want.completion_tokens);
                        proptest::prop_assert_eq!(t.prompt_tokens, want.prompt_tokens);
                        proptest::prop_assert_eq!(t.usage_member, want.usage_member);
                        proptest::prop_assert_eq!(t.flags, ch.flags(&b));
                    }
                    None => proptest::prop_assert_eq!(cache.chunk(&b).cloned(), want),
                }
            }
        }
    }
}
