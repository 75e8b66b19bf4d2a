//! The pieces of one event a [`super::Tracker`] reads or cuts: whether it holds a choice,
//! the usage member's cut, the finish and tool flags noted, the engine's count taken.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

use super::{Stop, COMPLETE};
use crate::request::continuation::Sent;
use crate::skim;

/// Whether the chunk `data` holds a choice: `Some(true)` when its (first) `"choices"` key
/// has an array that is not empty, `Some(false)` when it has none (no key, `[]`, `null`),
/// `None` when it is something else. Engines write no other `"choices"` key before the
/// chunk's own.
pub(super) fn choices(data: &[u8]) -> Option<bool> {
    static CHOICES: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
        std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\"choices\""));
    let Some(k) = CHOICES.find(data) else {
        return Some(false);
    };
    let colon = skim::ws(data, k + 9);
    if data.get(colon) != Some(&b':') {
        return None;
    }
    let v = skim::ws(data, colon + 1);
    match data.get(v)? {
        b'[' => Some(data.get(skim::ws(data, v + 1))? != &b']'),
        b'n' => (data.get(v..v + 4) == Some(b"null")).then_some(false),
        _ => None,
    }
}

/// One event's count into `cur`: the engine's completion tokens so far when it reported
/// them; else whether it relayed text the engine has not counted (see
/// `Tracker::uncounted`).
pub(super) fn count(
    cur: &mut Sent,
    uncounted: &mut bool,
    completion_tokens: Option<u64>,
    text_relayed: bool,
) {
    match completion_tokens {
        Some(n) => {
            cur.completion_tokens = n;
            *uncounted = false;
        }
        None => *uncounted |= text_relayed,
    }
}

/// The bytes of `data` that go when the member at `member` (from its key's opening quote to
/// the end of its value, as [`skim::Chunk::usage_member`] gives) is cut out: the member and
/// the comma before it, or, for the first member, the comma after it (with the whitespace
/// around). `None` when `member` is not in `data`.
pub(super) fn cut_range(
    data: &[u8],
    member: std::ops::Range<usize>,
) -> Option<std::ops::Range<usize>> {
    let before = data.get(..member.start)?.trim_ascii_end();
    let after = data.get(member.end..)?;
    Some(match before.strip_suffix(b",") {
        Some(b) => b.len()..member.end,
        None => {
            // The first member: drop the comma after it instead.
            let rest = after.trim_ascii_start();
            let rest = rest.strip_prefix(b",").unwrap_or(rest);
            before.len()..data.len() - rest.len()
        }
    })
}

/// `data` without the member at `member` and the comma that joined it ([`cut_range`]).
pub(super) fn cut_member(out: &mut Vec<u8>, data: &[u8], member: std::ops::Range<usize>) {
    match cut_range(data, member) {
        Some(r) => {
            out.extend_from_slice(&data[..r.start]);
            out.extend_from_slice(&data[r.end..]);
        }
        None => out.extend_from_slice(data),
    }
}

/// What becomes of one data payload (see [`Tracker::relay`]).
pub(super) enum Replace {
    /// Forwarded as it is.
    Keep,
    /// Dropped.
    Drop,
    /// Replaced by these bytes.
    With(Vec<u8>),
    /// Forwarded without this member (and the comma that joined it).
    Cut(std::ops::Range<usize>),
}

impl From<Option<Option<Vec<u8>>>> for Replace {
    fn from(r: Option<Option<Vec<u8>>>) -> Replace {
        match r {
            None => Replace::Keep,
            Some(None) => Replace::Drop,
            Some(Some(d)) => Replace::With(d),
        }
    }
}

/// What a choice showed that stops a move (the last one shown wins).
pub(super) fn note(stop: &mut Option<Stop>, f: skim::Flags) {
    if f.tool_call {
        *stop = Some("a tool call was in progress");
    }
    if f.reasoning {
        *stop = Some("reasoning was in progress");
    }
    if f.finish {
        *stop = Some(COMPLETE);
    }
}

pub(super) fn push_event(out: &mut Vec<u8>, data: &[u8]) {
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(data);
    out.extend_from_slice(b"\n\n");
}

/// A `/generate` event's fields the account reads.
#[derive(Deserialize)]
pub(super) struct GenChunk<'a> {
    #[serde(borrow, default)]
    pub(super) text: Option<Cow<'a, str>>,
    #[serde(default)]
    pub(super) output_ids: Option<Vec<i64>>,
    #[serde(borrow, default)]
    pub(super) meta_info: Option<GenMeta<'a>>,
}

#[derive(Deserialize)]
pub(super) struct GenMeta<'a> {
    #[serde(default)]
    pub(super) completion_tokens: Option<u64>,
    #[serde(default)]
    pub(super) prompt_tokens: Option<u64>,
    #[serde(borrow, default)]
    pub(super) finish_reason: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub(super) id: Option<Cow<'a, str>>,
}
