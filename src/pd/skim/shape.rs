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
//!   with a text string and its usage (if any) is the last member;
//! - [`ShapeCache::token`] answers a matching event with only what differs from the template
//!   (its text, its counts, its usage member; property-tested against the full skim), for a
//!   stream's account that needs no [`Chunk`]; the usage object is matched eight bytes at a
//!   time, its counts' digits under a mask ([`UsageShape`]).

use std::ops::Range;

use super::{chunk, members, parse_u64, string_end, value_end, ws, Chunk, Flags};

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

/// A usage object as a template: its bytes, and where they hold the digits of a count.
/// Another usage object has this shape when it is as long and differs only in those
/// digits (each still a digit). Such an object has the template's structure, value for
/// value, so its counts are read at the template's places.
///
/// Why: one stream's usage objects differ only in their counts, and mostly not in the
/// counts' lengths (a count gains a digit a few times per stream; that event misses and
/// becomes the template). Compared eight bytes at a time under a mask, the object costs
/// a dozen word operations instead of a walk of its members.
#[derive(Debug, Default)]
struct UsageShape {
    /// The template object's length.
    len: usize,
    /// Its bytes, eight at a time (the last word ends at its end, overlapping the one
    /// before).
    words: Vec<Word>,
    completion: Count,
    prompt: Count,
}

/// Where a count is, in a [`UsageShape`].
#[derive(Debug, Clone, PartialEq, Eq)]
enum Count {
    /// A run of digits at these offsets (read from each object).
    Digits(Range<usize>),
    /// Anything else (absent, `null`, a fraction): the same bytes in every object of
    /// the shape, so the same answer.
    Fixed(Option<u64>),
}

impl Default for Count {
    fn default() -> Count {
        Count::Fixed(None)
    }
}

const ZEROS: u64 = 0x3030_3030_3030_3030;
const HIGH_NIBBLES: u64 = 0xf0f0_f0f0_f0f0_f0f0;
const LOW_NIBBLES: u64 = 0x0f0f_0f0f_0f0f_0f0f;

impl UsageShape {
    /// Becomes the shape of the usage object `b[u]` (a value span [`super::chunk`] gave),
    /// reusing its buffers.
    fn learn(&mut self, b: &[u8], u: &Range<usize>) -> Option<()> {
        let obj = b.get(u.clone())?;
        // Shorter than a word: no usage object an engine writes; never a template.
        if obj.len() < 8 {
            return None;
        }
        let mut digit = vec![false; obj.len()];
        let (mut completion, mut prompt) = (Count::default(), Count::default());
        members(b, u.start, |key, _, vs| {
            let ve = value_end(b, vs)?;
            let count = if b[vs..ve].iter().all(u8::is_ascii_digit) {
                digit[vs - u.start..ve - u.start].fill(true);
                Count::Digits(vs - u.start..ve - u.start)
            } else {
                Count::Fixed(parse_u64(b, vs..ve))
            };
            match key {
                b"completion_tokens" => completion = count,
                b"prompt_tokens" => prompt = count,
                _ => {}
            }
            Some(ve)
        })?;
        self.words.clear();
        let len = obj.len();
        self.len = len;
        let last = (len % 8 != 0).then_some(len - 8);
        for at in (0..len / 8).map(|w| w * 8).chain(last) {
            let m = (0..8).fold(0u64, |m, k| {
                m | (u64::from(digit[at + k]) * 0xff) << (8 * k)
            });
            let bytes = u64::from_le_bytes(obj.get(at..at + 8)?.try_into().ok()?);
            self.words.push(Word { bytes, digits: m });
        }
        (self.completion, self.prompt) = (completion, prompt);
        Some(())
    }

    /// The usage object at `at` when it has this shape (see the type's docs): its end and
    /// its completion and prompt tokens.
    fn read(&self, b: &[u8], at: usize) -> Option<(usize, Option<u64>, Option<u64>)> {
        let n = self.len;
        let obj = b.get(at..at + n)?;
        // The whole words, then (when the length is not a multiple of eight) the last
        // eight bytes, overlapping.
        let (whole, last) = self.words.split_at_checked(n / 8)?;
        for (x, w) in obj.chunks_exact(8).zip(whole) {
            if !w.fits(u64::from_le_bytes(x.try_into().ok()?)) {
                return None;
            }
        }
        if let Some(w) = last.first() {
            if !w.fits(u64::from_le_bytes(obj.get(n - 8..)?.try_into().ok()?)) {
                return None;
            }
        }
        let count = |c: &Count| match c {
            Count::Digits(r) => parse_u64(obj, r.clone()),
            Count::Fixed(n) => *n,
        };
        Some((at + n, count(&self.completion), count(&self.prompt)))
    }
}

/// Eight bytes of a [`UsageShape`]: the template's, and a mask with `0xff` in the bytes
/// that are digits of a count.
#[derive(Debug, Clone, Copy)]
struct Word {
    bytes: u64,
    digits: u64,
}

impl Word {
    /// Whether `x` equals the template's bytes outside the digits, and has digits there.
    #[inline]
    fn fits(&self, x: u64) -> bool {
        let m = self.digits;
        if (x ^ self.bytes) & !m != 0 {
            return false;
        }
        // Each masked byte a digit: its high nibble 3, its low nibble at most 9.
        let z = (x & m) | (ZEROS & !m);
        m == 0
            || (z & HIGH_NIBBLES == ZEROS
                && ((z & LOW_NIBBLES) + 0x0606_0606_0606_0606) & HIGH_NIBBLES == 0)
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
    /// template. `None` (a miss) changes nothing: call [`Self::chunk`] then.
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
        let pe = string_end(b, ps)?;
        if !b.get(pe..)?.starts_with(&self.mid) {
            return None;
        }
        let after = pe + self.mid.len();
        let (mut completion, mut prompt) = (None, None);
        let usage_member = if self.has_usage {
            let (ve, c, p) = self.usage.read(b, after)?;
            (completion, prompt) = (c, p);
            let close = ws(b, ve);
            if b.get(close) != Some(&b'}') || ws(b, close + 1) != b.len() {
                return None;
            }
            Some(after - self.usage_key_back..ve)
        } else {
            if after != b.len() {
                return None;
            }
            None
        };
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

        /// A token answer holds what the full skim finds: the text, the counts, the
        /// usage member and the choice's flags; a miss leaves the caller to the full skim.
        #[test]
        fn tokens_agree_with_the_full_skim(
            sim in proptest::bool::ANY,
            details in proptest::bool::ANY,
            events in proptest::collection::vec(
                (".{0,6}", proptest::option::weighted(0.9, 0u64..100_000),
                 proptest::option::weighted(0.1, "stop|length"), 0usize..40,
                 proptest::bool::weighted(0.2)),
                1..16,
            )
        ) {
            let mut cache = ShapeCache::default();
            for (text, completion, finish, cut, garble) in events {
                let mut b = event_with(sim, &text, completion, finish.as_deref(), details);
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
