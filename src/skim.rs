//! A skim of JSON the request path reads a member or two of: one OpenAI stream chunk (the
//! few members a continuable stream's account reads: `id`, `usage`, and per choice `text`,
//! `finish_reason` and the `delta`'s `content`, `reasoning_content` and `tool_calls`;
//! [`chunk`]), or a number in an object ([`u64_member`], e.g. `sampling_params`'
//! `max_new_tokens`), found by walking the JSON's structure without building anything.
//!
//! Why not serde: the account reads every event of every continuable stream, and a typed
//! deserialisation (a `Vec` of choices, owned strings where text is escaped) cost several
//! times what the relay spends on an event; the skim allocates nothing and touches each
//! byte once.
//!
//! Invariants: a member is found only at its place in the structure (a key spelled inside
//! a string or a nested value never matches); spans are byte ranges of the payload; text
//! stays JSON-escaped (see [`unescape`]); anything malformed gives `None`, never a panic,
//! and the caller then forwards the event untouched as serde's failure did.
//!
//! A stream's events mostly share one shape: [`ShapeCache`] skims them from a template.
//! [`may_hold_abort`], the cheap pre-check for an abort or error in engines' JSON, lives
//! here so that the template can be judged by it once.

use std::ops::Range;

mod cached;
mod shape;
pub mod tail;
pub use cached::{prompt_cache, PromptCache};
pub use shape::{ShapeCache, Token};

/// The members of one chunk the account reads (value spans, `null` included as it is).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Chunk {
    pub id: Option<Range<usize>>,
    pub usage: Option<Range<usize>>,
    /// From the start of the `"usage"` key to the end of its value (for cutting it out).
    pub usage_member: Option<Range<usize>>,
    /// `usage.completion_tokens` and `usage.prompt_tokens`, when numbers.
    pub completion_tokens: Option<u64>,
    pub prompt_tokens: Option<u64>,
    pub choices: Vec<Choice>,
}

/// One element of `choices`.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Choice {
    pub text: Option<Range<usize>>,
    pub finish_reason: Option<Range<usize>>,
    /// The `delta` member was there and not `null`.
    pub has_delta: bool,
    pub content: Option<Range<usize>>,
    pub reasoning_content: Option<Range<usize>>,
    pub tool_calls: Option<Range<usize>>,
}

/// What one choice shows that decides whether its stream can be continued.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Flags {
    /// A tool call (`delta.tool_calls` other than `[]` or `null`).
    pub tool_call: bool,
    /// Reasoning text (`delta.reasoning_content` a string that is not empty).
    pub reasoning: bool,
    /// A finish reason that is not `null`.
    pub finish: bool,
}

impl Choice {
    /// This choice's [`Flags`], read from `b` (the bytes it was skimmed from).
    pub fn flags(&self, b: &[u8]) -> Flags {
        Flags {
            tool_call: self
                .tool_calls
                .as_ref()
                .and_then(|t| b.get(t.clone()))
                .is_some_and(|t| t.trim_ascii() != b"[]"),
            reasoning: self
                .reasoning_content
                .as_ref()
                .and_then(|r| string_body(b, r))
                .is_some_and(|r| !r.is_empty()),
            finish: self.finish_reason.is_some(),
        }
    }
}

/// Whether `bytes` contain `"abort"` or `"error"` at all: a cheap pre-check (most answers,
/// and most runs of SSE events, contain neither; searchers built once). When it says no,
/// `legs::abort_in_json` finds nothing in any part of `bytes`.
pub fn may_hold_abort(bytes: &[u8]) -> bool {
    use memchr::memmem::Finder;
    use std::sync::LazyLock;
    static ABORT: LazyLock<Finder<'static>> = LazyLock::new(|| json_finder(b"\"abort\""));
    static ERROR: LazyLock<Finder<'static>> = LazyLock::new(|| json_finder(b"\"error\""));
    ABORT.find(bytes).is_some() || ERROR.find(bytes).is_some()
}

/// A searcher for `needle` in engines' JSON: its prefilter keys on the needle's bytes that
/// are rare in JSON. memchr's default ranking (drawn from prose and code) takes `"` for a
/// rare byte, and in JSON nearly every other byte is next to one: every quote became a
/// candidate to verify, and this search was the costliest step of relaying a token
/// (BENCHMARKS §8).
fn json_finder(needle: &[u8]) -> memchr::memmem::Finder<'static> {
    struct JsonRank;
    impl memchr::arch::all::packedpair::HeuristicFrequencyRank for JsonRank {
        fn rank(&self, byte: u8) -> u8 {
            // Lower is rarer: JSON's structure and digits are the most common; lowercase
            // letters by their frequency in English and in the keys of engine chunks.
            const COMMON: &[u8] = b"etaonisrlcdhumpfgkwybvxjqz";
            match byte {
                b'"' | b':' | b',' | b'{' | b'}' | b'[' | b']' | b' ' | b'0'..=b'9' => 255,
                _ => COMMON
                    .iter()
                    .position(|&c| c == byte)
                    .map_or(64, |i| 250 - 8 * i as u8),
            }
        }
    }
    memchr::memmem::FinderBuilder::new()
        .build_forward_with_ranker(JsonRank, needle)
        .into_owned()
}

/// The index of the first byte at or after `i` that is not JSON whitespace.
pub fn ws(b: &[u8], mut i: usize) -> usize {
    // Most JSON from engines has no whitespace between tokens: one test settles it.
    while let Some(&c) = b.get(i) {
        if c > b' ' || !matches!(c, b' ' | b'\t' | b'\n' | b'\r') {
            break;
        }
        i += 1;
    }
    i
}

const ONES: u64 = 0x0101_0101_0101_0101;
const HIGHS: u64 = 0x8080_8080_8080_8080;

/// The high bit of each byte of `w` equal to `c`: exact for the lowest such byte (a
/// false positive can only sit above a true one), which is all [`string_end`] reads.
fn bytes_eq(w: u64, c: u8) -> u64 {
    let x = w ^ (ONES * u64::from(c));
    x.wrapping_sub(ONES) & !x & HIGHS
}

/// The end (exclusive) of the string whose opening quote is at `i`. Keys and most values
/// are short: eight bytes at a time over the first bytes, `memchr` past them.
fn string_end(b: &[u8], i: usize) -> Option<usize> {
    string_end_of::<false>(b, i)
}

/// [`string_end`] of a string that holds no raw `\n` (`None` if it does): a string that
/// can be relayed as part of one SSE data line. (JSON escapes a newline in a string, so
/// only a broken engine sends one raw.)
pub(crate) fn string_end_in_line(b: &[u8], i: usize) -> Option<usize> {
    string_end_of::<true>(b, i)
}

/// [`string_end`]; with `NO_LF`, `None` at a raw `\n` in the string (each test in the same
/// pass as the quote and backslash ones).
fn string_end_of<const NO_LF: bool>(b: &[u8], i: usize) -> Option<usize> {
    const SHORT: usize = 64;
    let end = b.len().min(i + 1 + SHORT);
    let mut j = i + 1;
    while j + 8 <= end {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[j..j + 8]);
        let w = u64::from_le_bytes(w);
        let mut m = bytes_eq(w, b'"') | bytes_eq(w, b'\\');
        if NO_LF {
            m |= bytes_eq(w, b'\n');
        }
        if m == 0 {
            j += 8;
            continue;
        }
        let k = j + (m.trailing_zeros() / 8) as usize;
        match b[k] {
            b'"' => return Some(k + 1),
            b'\n' => return None,
            // An escape: the byte after it is no newline either.
            _ if NO_LF && b.get(k + 1) == Some(&b'\n') => return None,
            _ => j = k + 2,
        }
    }
    while j < end {
        match b[j] {
            b'"' => return Some(j + 1),
            b'\\' if NO_LF && b.get(j + 1) == Some(&b'\n') => return None,
            b'\\' => j += 2,
            b'\n' if NO_LF => return None,
            _ => j += 1,
        }
    }
    if NO_LF {
        let e = long_string_end(b, j)?;
        return (!b[j..e].contains(&b'\n')).then_some(e);
    }
    long_string_end(b, j)
}

/// [`string_end`] from `j` (inside the string, or at a backslash).
fn long_string_end(b: &[u8], mut j: usize) -> Option<usize> {
    loop {
        let k = j + memchr::memchr2(b'"', b'\\', b.get(j..)?)?;
        if b[k] == b'"' {
            return Some(k + 1);
        }
        j = k + 2;
    }
}

/// `table(set)[c]`: whether byte `c` is in `set`.
pub(super) const fn table(set: &[u8]) -> [bool; 256] {
    let mut t = [false; 256];
    let mut i = 0;
    while i < set.len() {
        t[set[i] as usize] = true;
        i += 1;
    }
    t
}

/// What ends a number or a literal.
static ENDS_SCALAR: [bool; 256] = table(b",}] \t\n\r");
/// What a walk over a container stops at.
static IN_CONTAINER: [bool; 256] = table(b"\"{}[]");

/// The end (exclusive) of the value that starts at `i`.
pub fn value_end(b: &[u8], i: usize) -> Option<usize> {
    match *b.get(i)? {
        b'"' => string_end(b, i),
        b'{' | b'[' => {
            // Brackets are counted, strings skipped whole; whether each closes its own
            // kind is left to the walk of the members the account reads.
            let mut depth = 0usize;
            let mut j = i;
            loop {
                j += b
                    .get(j..)?
                    .iter()
                    .position(|&c| IN_CONTAINER[usize::from(c)])?;
                match b[j] {
                    b'"' => {
                        j = string_end(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    _ => {
                        depth = depth.checked_sub(1)?;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                }
                j += 1;
            }
        }
        _ => {
            let n = b
                .get(i..)?
                .iter()
                .position(|&c| ENDS_SCALAR[usize::from(c)])
                .unwrap_or(b.len() - i);
            (n > 0).then_some(i + n)
        }
    }
}

/// Calls `f(key, key_start, value_start)` for each member of the object at `i` (its `{`);
/// `f` returns where the value ends (walking it itself, or by [`value_end`]). Returns the
/// end of the object. `key` is the raw text between the key's quotes. Each byte is walked
/// once.
fn members<'b>(
    b: &'b [u8],
    i: usize,
    mut f: impl FnMut(&'b [u8], usize, usize) -> Option<usize>,
) -> Option<usize> {
    if b.get(i) != Some(&b'{') {
        return None;
    }
    let mut j = ws(b, i + 1);
    if b.get(j) == Some(&b'}') {
        return Some(j + 1);
    }
    loop {
        if b.get(j) != Some(&b'"') {
            return None;
        }
        let ke = string_end(b, j)?;
        let key = &b[j + 1..ke - 1];
        let c = ws(b, ke);
        if b.get(c) != Some(&b':') {
            return None;
        }
        let vs = ws(b, c + 1);
        let ve = f(key, j, vs)?;
        let n = ws(b, ve);
        match b.get(n)? {
            b',' => j = ws(b, n + 1),
            b'}' => return Some(n + 1),
            _ => return None,
        }
    }
}

/// Calls `f(value_start)` for each element of the array at `i` (its `[`); `f` returns
/// where the element ends. Returns the end of the array.
pub fn elements(b: &[u8], i: usize, mut f: impl FnMut(usize) -> Option<usize>) -> Option<usize> {
    if b.get(i) != Some(&b'[') {
        return None;
    }
    let mut j = ws(b, i + 1);
    if b.get(j) == Some(&b']') {
        return Some(j + 1);
    }
    loop {
        let ve = f(j)?;
        let n = ws(b, ve);
        match b.get(n)? {
            b',' => j = ws(b, n + 1),
            b']' => return Some(n + 1),
            _ => return None,
        }
    }
}

/// The value at `vs` (its span, or `None` for `null`) and its end.
fn scalar_or_skip(b: &[u8], vs: usize) -> Option<(Option<Range<usize>>, usize)> {
    let ve = value_end(b, vs)?;
    let null = b.get(vs..ve)? == b"null";
    Some(((!null).then_some(vs..ve), ve))
}

fn is_null_at(b: &[u8], vs: usize) -> bool {
    b.get(vs..vs + 4) == Some(b"null")
}

fn choice(b: &[u8], at: usize) -> Option<(Choice, usize)> {
    let mut c = Choice::default();
    let end = members(b, at, |key, _, vs| match key {
        b"text" => {
            let (v, ve) = scalar_or_skip(b, vs)?;
            c.text = v;
            Some(ve)
        }
        b"finish_reason" => {
            let (v, ve) = scalar_or_skip(b, vs)?;
            c.finish_reason = v;
            Some(ve)
        }
        b"delta" if !is_null_at(b, vs) => {
            c.has_delta = true;
            members(b, vs, |key, _, vs| {
                let (v, ve) = scalar_or_skip(b, vs)?;
                match key {
                    b"content" => c.content = v,
                    b"reasoning_content" => c.reasoning_content = v,
                    b"tool_calls" => c.tool_calls = v,
                    _ => {}
                }
                Some(ve)
            })
        }
        _ => value_end(b, vs),
    })?;
    Some((c, end))
}

/// The digits at `r` as `str::parse::<u64>` reads them (an optional `+`, no overflow).
#[inline]
fn parse_u64(b: &[u8], r: Range<usize>) -> Option<u64> {
    let d = b.get(r)?;
    let d = d.strip_prefix(b"+").unwrap_or(d);
    if d.is_empty() {
        return None;
    }
    d.iter().try_fold(0u64, |n, &c| {
        let v = c.wrapping_sub(b'0');
        if v > 9 {
            return None;
        }
        n.checked_mul(10)?.checked_add(u64::from(v))
    })
}

/// The skim of a chunk, or `None` when it is not a JSON object as expected.
pub fn chunk(b: &[u8]) -> Option<Chunk> {
    let mut out = Chunk::default();
    let start = ws(b, 0);
    let end = members(b, start, |key, key_start, vs| match key {
        b"id" => {
            let (v, ve) = scalar_or_skip(b, vs)?;
            out.id = v;
            Some(ve)
        }
        b"usage" if !is_null_at(b, vs) => {
            let (mut completion, mut prompt) = (None, None);
            let ve = members(b, vs, |key, _, vs| {
                let ve = value_end(b, vs)?;
                match key {
                    b"completion_tokens" => completion = parse_u64(b, vs..ve),
                    b"prompt_tokens" => prompt = parse_u64(b, vs..ve),
                    _ => {}
                }
                Some(ve)
            })?;
            out.usage_member = Some(key_start..ve);
            out.usage = Some(vs..ve);
            out.completion_tokens = completion;
            out.prompt_tokens = prompt;
            Some(ve)
        }
        b"choices" if !is_null_at(b, vs) => elements(b, vs, |es| {
            let (c, ce) = choice(b, es)?;
            out.choices.push(c);
            Some(ce)
        }),
        _ => value_end(b, vs),
    })?;
    (ws(b, end) == b.len()).then_some(out)
}

/// A string value's bytes between its quotes (still escaped), or `None` if not a string.
pub fn string_body(b: &[u8], r: &Range<usize>) -> Option<Range<usize>> {
    let s = b.get(r.clone())?;
    (s.len() >= 2 && s[0] == b'"' && s[s.len() - 1] == b'"').then(|| r.start + 1..r.end - 1)
}

/// An unsigned integer member of the object at `r` (e.g. `sampling_params`'
/// `max_new_tokens`).
pub fn u64_member(b: &[u8], r: &Range<usize>, name: &[u8]) -> Option<u64> {
    let mut found = None;
    members(b, r.start, |key, _, vs| {
        let ve = value_end(b, vs)?;
        if key == name {
            found = parse_u64(b, vs..ve);
        }
        Some(ve)
    })?;
    found
}

/// JSON-escaped string content (as [`string_body`] gives, possibly several concatenated)
/// decoded; `None` if the escapes are invalid.
pub fn unescape(raw: &[u8]) -> Option<String> {
    if memchr::memchr(b'\\', raw).is_none() {
        return String::from_utf8(raw.to_vec()).ok();
    }
    let mut quoted = Vec::with_capacity(raw.len() + 2);
    quoted.push(b'"');
    quoted.extend_from_slice(raw);
    quoted.push(b'"');
    serde_json::from_slice(&quoted).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// The pre-check's searchers (keyed on bytes rare in JSON) find either word
        /// wherever it is, as a plain substring search does.
        #[test]
        fn the_pre_check_finds_what_a_substring_search_finds(
            pieces in proptest::collection::vec(
                proptest::sample::select(vec![
                    "\"abort\"", "\"error\"", "\"abor", "t\"", "err", "or\"", "\"", "b", "r",
                    "o", "{\"id\":\"x\",", "\"object\":", "\"finish_reason\":null", " ",
                ]),
                0..40,
            )
        ) {
            let s = pieces.concat();
            let want = s.contains("\"abort\"") || s.contains("\"error\"");
            proptest::prop_assert_eq!(may_hold_abort(s.as_bytes()), want);
        }
    }

    fn text<'a>(b: &'a [u8], r: &Option<Range<usize>>) -> Option<&'a str> {
        r.clone().map(|r| std::str::from_utf8(&b[r]).unwrap())
    }

    #[test]
    fn finds_members_at_their_place_only() {
        let b = br#"{"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":"say \"content\":\"x\" {[","reasoning_content":null,"tool_calls":null},"logprobs":{"content":[{"token":"a"}]},"finish_reason":null}],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}"#;
        let c = chunk(b).unwrap();
        assert_eq!(text(b, &c.id), Some(r#""c1""#));
        assert_eq!(c.choices.len(), 1);
        let ch = &c.choices[0];
        assert!(ch.has_delta);
        assert_eq!(text(b, &ch.content), Some(r#""say \"content\":\"x\" {[""#));
        assert_eq!(ch.reasoning_content, None);
        assert_eq!(ch.tool_calls, None);
        assert_eq!(ch.finish_reason, None);
        let u = c.usage.clone().unwrap();
        assert_eq!(u64_member(b, &u, b"completion_tokens"), Some(2));
        assert_eq!(u64_member(b, &u, b"prompt_tokens"), Some(3));
        assert_eq!((c.completion_tokens, c.prompt_tokens), (Some(2), Some(3)));
        let m = c.usage_member.unwrap();
        assert!(b[m.clone()].starts_with(b"\"usage\""));
        assert_eq!(m.end, b.len() - 1);
        let body = string_body(b, ch.content.as_ref().unwrap()).unwrap();
        assert_eq!(unescape(&b[body]).unwrap(), r#"say "content":"x" {["#);
    }

    #[test]
    fn table_of_shapes() {
        // (payload, choices, has_delta of the first, finish present, tool_calls present)
        let table: &[(&str, usize, bool, bool, bool)] = &[
            (r#"{"choices":[]}"#, 0, false, false, false),
            (r#"{"choices":null,"usage":null}"#, 0, false, false, false),
            (
                r#" { "choices" : [ { "delta" : null , "finish_reason" : "stop" } ] } "#,
                1,
                false,
                true,
                false,
            ),
            (
                r#"{"choices":[{"delta":{"tool_calls":[{"id":"t"}]}}]}"#,
                1,
                true,
                false,
                true,
            ),
            (
                r#"{"choices":[{"text":"a","finish_reason":null},{"text":"b"}]}"#,
                2,
                false,
                false,
                false,
            ),
        ];
        for (p, n, delta, finish, tools) in table {
            let c = chunk(p.as_bytes()).unwrap_or_else(|| panic!("{p}"));
            assert_eq!(c.choices.len(), *n, "{p}");
            if let Some(ch) = c.choices.first() {
                assert_eq!(ch.has_delta, *delta, "{p}");
                assert_eq!(ch.finish_reason.is_some(), *finish, "{p}");
                assert_eq!(ch.tool_calls.is_some(), *tools, "{p}");
            }
        }
    }

    #[test]
    fn malformed_input_is_none_never_a_panic() {
        for p in [
            "",
            "{",
            "[1]",
            r#"{"a":}"#,
            r#"{"a":"x}"#,
            r#"{"a":1,}"#,
            r#"{"choices":[{"delta":{"content":"x"}]}"#,
            r#"{"a":1} trailing"#,
            r#"{"a":"\"#,
            r#"{"a":[}"#,
            r#"{"a":]}"#,
        ] {
            assert!(chunk(p.as_bytes()).is_none(), "{p}");
        }
        assert_eq!(unescape(br"\x"), None);
        assert_eq!(unescape(br"a\nb").as_deref(), Some("a\nb"));
        // Halves of a surrogate pair from two events decode once joined.
        assert_eq!(unescape(br"\ud83d\ude00").as_deref(), Some("😀"));
    }

    proptest::proptest! {
        #[test]
        fn reads_numbers_as_str_parse_does(s in "[+-]?[0-9a ]{0,22}") {
            let b = s.as_bytes();
            proptest::prop_assert_eq!(parse_u64(b, 0..b.len()), s.parse::<u64>().ok());
        }

        #[test]
        fn string_end_as_a_byte_walk(data in proptest::collection::vec(
            proptest::sample::select(b"ab\\\"".to_vec()), 0..150)) {
            let mut b = vec![b'"'];
            b.extend_from_slice(&data);
            let mut j = 1;
            let want = loop {
                match b.get(j) {
                    None => break None,
                    Some(b'"') => break Some(j + 1),
                    Some(b'\\') => j += 2,
                    Some(_) => j += 1,
                }
            };
            proptest::prop_assert_eq!(string_end(&b, 0), want);
        }

        #[test]
        fn string_end_in_line_refuses_exactly_a_raw_newline(data in proptest::collection::vec(
            proptest::sample::select(b"ab\\\"\n".to_vec()), 0..150)) {
            let mut b = vec![b'"'];
            b.extend_from_slice(&data);
            let want = string_end(&b, 0).filter(|&e| !b[..e].contains(&b'\n'));
            proptest::prop_assert_eq!(string_end_in_line(&b, 0), want);
        }

        #[test]
        fn never_panics(data: Vec<u8>) {
            let _ = chunk(&data);
        }

        #[test]
        fn agrees_with_serde_on_content(pieces: Vec<String>, usage in 0u64..1_000_000) {
            let mut joined = Vec::new();
            let mut want = String::new();
            for p in &pieces {
                let ev = serde_json::json!({
                    "id": "x", "choices": [{"index": 0, "delta": {"content": p}, "finish_reason": null}],
                    "usage": {"completion_tokens": usage},
                });
                let b = serde_json::to_vec(&ev).unwrap();
                let c = chunk(&b).unwrap();
                let r = string_body(&b, c.choices[0].content.as_ref().unwrap()).unwrap();
                joined.extend_from_slice(&b[r]);
                want.push_str(p);
                proptest::prop_assert_eq!(u64_member(&b, c.usage.as_ref().unwrap(), b"completion_tokens"), Some(usage));
                proptest::prop_assert_eq!(c.completion_tokens, Some(usage));
            }
            proptest::prop_assert_eq!(unescape(&joined), Some(want));
        }
    }
}
