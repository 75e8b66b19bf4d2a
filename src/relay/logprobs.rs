//! Merging the prefill's input logprobs into decode's answer (`/generate` with
//! `return_logprob`), as SGLang's routers do: the prefill's `input_token_logprobs`,
//! `input_top_logprobs` and `input_token_ids_logprobs` are prepended to decode's, per
//! item of a batch (by position, or by a stream chunk's `index`).
//!
//! Without a JSON tree: the prefill's answer is scanned once for the three arrays, which
//! are kept as byte ranges of that answer (no copy, no tree); each decode answer or event
//! is scanned shallowly (its top level, then its `meta_info`'s) for where the arrays go,
//! and the prefill's bytes are spliced in there. Every other byte of decode's JSON is
//! forwarded as decode wrote it.
//!
//! Cost: an event costs its own scan plus a copy of the prefill's arrays (SGLang's stream
//! chunks carry cumulative `meta_info`, so each event repeats them). That is why a stream's
//! merge is capped, per event (`upstream.max_stream_logprob_bytes`) and in all
//! (`upstream.max_stream_logprob_total_bytes`: their size times the events the request can
//! produce; see `dispatch::attempt::first_byte`): past either the request is refused before its first byte
//! rather than answered differently from SGLang.
//!
//! Invariants: what a merge writes is valid JSON whenever decode's input was (the arrays'
//! inner bytes come from a valid array; separators are written only between non-empty
//! parts); input that does not have the expected shape is forwarded unchanged.

use std::borrow::Cow;
use std::fmt;
use std::ops::Range;

use bytes::Bytes;
use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::memory::Charge;

const KEYS: [&str; 3] = [
    "input_token_logprobs",
    "input_top_logprobs",
    "input_token_ids_logprobs",
];

/// The prefill's input logprobs: per item, the bytes inside the brackets of each array it
/// had (`None`: the key was absent or not an array).
#[derive(Debug, Default)]
pub struct PrefillLogprobs {
    items: Vec<[Option<Bytes>; 3]>,
    /// The arrays' bytes, all items together: what one event's merge copies at most.
    bytes: usize,
    /// Their share of the in-flight byte budget (the prefill's answer they point into).
    _charge: Charge,
}

/// A JSON object's members, in order: the key and the raw value (borrowed).
struct Members<'a>(Vec<(Cow<'a, str>, &'a RawValue)>);

impl<'de> Deserialize<'de> for Members<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, m: A) -> Result<Members<'de>, A::Error> {
                read_members(m)
            }
        }
        d.deserialize_map(V)
    }
}

/// An answer item's `meta_info` members (its first `meta_info`, when that is an object),
/// read in the one walk of the item: every other member, and anything that is not an
/// object, is skipped as it is read.
///
/// Why: a prefill answer with input logprobs is megabytes of number arrays; reading the
/// item, then its members, then `meta_info`'s as raw values walked those arrays three
/// times (a logprob bomb's prefill answer spent a fifth of the router's CPU in
/// `serde_json`'s `ignore_value`: BENCHMARKS §10).
struct ItemMeta<'a>(Option<Members<'a>>);

/// Consumes any JSON value; an object's members are kept (`Some`), anything else is not.
struct MaybeMembers<'a>(Option<Members<'a>>);

/// What [`ItemMeta`] and [`MaybeMembers`] read from a value that is not an object: nothing
/// (a list's elements are skipped).
macro_rules! not_an_object {
    ($t:ident) => {
        fn visit_bool<E>(self, _: bool) -> Result<$t<'de>, E> {
            Ok($t(None))
        }
        fn visit_i64<E>(self, _: i64) -> Result<$t<'de>, E> {
            Ok($t(None))
        }
        fn visit_u64<E>(self, _: u64) -> Result<$t<'de>, E> {
            Ok($t(None))
        }
        fn visit_f64<E>(self, _: f64) -> Result<$t<'de>, E> {
            Ok($t(None))
        }
        fn visit_str<E>(self, _: &str) -> Result<$t<'de>, E> {
            Ok($t(None))
        }
        fn visit_unit<E>(self) -> Result<$t<'de>, E> {
            Ok($t(None))
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<$t<'de>, A::Error> {
            while s.next_element::<IgnoredAny>()?.is_some() {}
            Ok($t(None))
        }
    };
}

impl<'de> Deserialize<'de> for MaybeMembers<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = MaybeMembers<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_map<A: MapAccess<'de>>(self, m: A) -> Result<MaybeMembers<'de>, A::Error> {
                Ok(MaybeMembers(Some(read_members(m)?)))
            }
            not_an_object!(MaybeMembers);
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for ItemMeta<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ItemMeta<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<ItemMeta<'de>, A::Error> {
                let (mut meta, mut seen) = (None, false);
                while let Some(k) = m.next_key::<Cow<'de, str>>()? {
                    if k == "meta_info" && !seen {
                        seen = true;
                        meta = m.next_value::<MaybeMembers<'de>>()?.0;
                    } else {
                        m.next_value::<IgnoredAny>()?;
                    }
                }
                Ok(ItemMeta(meta))
            }
            not_an_object!(ItemMeta);
        }
        d.deserialize_any(V)
    }
}

/// An object's members, in order, each value kept raw.
fn read_members<'de, A: MapAccess<'de>>(mut m: A) -> Result<Members<'de>, A::Error> {
    let mut v = Vec::with_capacity(m.size_hint().unwrap_or(8));
    while let Some((k, val)) = m.next_entry::<Cow<'de, str>, &'de RawValue>()? {
        v.push((k, val));
    }
    Ok(Members(v))
}

/// The `meta_info` of each top-level item of a prefill answer (a list's elements, or the
/// one object), in one walk.
fn item_metas(json: &str) -> Option<Vec<ItemMeta<'_>>> {
    match json.trim_ascii_start().as_bytes().first() {
        Some(b'[') => serde_json::from_str(json).ok(),
        Some(b'{') => serde_json::from_str::<ItemMeta<'_>>(json)
            .ok()
            .map(|m| vec![m]),
        _ => None,
    }
}

/// Where `inner` (a slice of `outer`) sits in it.
fn span(outer: &str, inner: &str) -> Range<usize> {
    let start = inner.as_ptr() as usize - outer.as_ptr() as usize;
    start..start + inner.len()
}

/// The bytes inside a JSON array's brackets, trimmed, if `raw` is an array.
fn array_inner(raw: &str) -> Option<Range<usize>> {
    let t = raw.trim_ascii();
    let inner = t.strip_prefix('[')?.strip_suffix(']')?.trim_ascii();
    Some(span(raw, inner))
}

/// The top-level items of an answer: a list's elements, or the one object.
fn items(json: &str) -> Option<Vec<&RawValue>> {
    match json.trim_ascii_start().as_bytes().first() {
        Some(b'[') => serde_json::from_str(json).ok(),
        Some(b'{') => serde_json::from_str::<&RawValue>(json)
            .ok()
            .map(|v| vec![v]),
        _ => None,
    }
}

impl PrefillLogprobs {
    /// Scans the prefill's whole answer for its input logprobs. `charge` (the answer's
    /// share of the byte budget) is held as long as they are.
    pub fn from_prefill_body(body: &Bytes, charge: Charge) -> PrefillLogprobs {
        let mut lp = PrefillLogprobs {
            _charge: charge,
            ..PrefillLogprobs::default()
        };
        let Ok(text) = std::str::from_utf8(body) else {
            return lp;
        };
        let Some(list) = item_metas(text) else {
            return lp;
        };
        for ItemMeta(meta) in list {
            let mut arrays: [Option<Bytes>; 3] = Default::default();
            for (k, v) in meta.map(|m| m.0).unwrap_or_default() {
                if let Some(i) = KEYS.iter().position(|key| *key == k) {
                    if let Some(r) = array_inner(v.get()) {
                        let at = span(text, v.get());
                        let inner = body.slice(at.start + r.start..at.start + r.end);
                        lp.bytes += inner.len();
                        arrays[i] = Some(inner);
                    }
                }
            }
            lp.items.push(arrays);
        }
        lp
    }

    pub fn is_empty(&self) -> bool {
        self.items.iter().all(|a| a.iter().all(Option::is_none))
    }

    /// The bytes of the arrays (all items): what each streamed event repeats at most.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Writes `item` (one answer object) with item `idx`'s arrays spliced into its
    /// `meta_info`; anything not of that shape is written as it is.
    fn merge_item(&self, idx: usize, item: &str, out: &mut Vec<u8>) {
        let top = serde_json::from_str::<Members<'_>>(item).ok();
        self.merge_members(idx, item, top.as_ref(), out);
    }

    /// [`Self::merge_item`] with the item's top-level members already read.
    fn merge_members(&self, idx: usize, item: &str, top: Option<&Members<'_>>, out: &mut Vec<u8>) {
        let src = self.items.get(idx);
        let meta = top.and_then(|t| t.0.iter().find(|(k, _)| k == "meta_info").map(|(_, v)| *v));
        let (Some(src), Some(meta)) = (src, meta) else {
            out.extend_from_slice(item.as_bytes());
            return;
        };
        let Ok(members) = serde_json::from_str::<Members<'_>>(meta.get()) else {
            out.extend_from_slice(item.as_bytes());
            return;
        };
        let m = span(item, meta.get());
        out.extend_from_slice(&item.as_bytes()[..m.start]);
        let meta = meta.get();
        // Keys decode does not have go first, right after `{`.
        let open = meta.find('{').map_or(0, |i| i + 1);
        out.extend_from_slice(&meta.as_bytes()[..open]);
        let mut wrote = false;
        for (i, p) in src.iter().enumerate() {
            let Some(p) = p else { continue };
            if members.0.iter().any(|(k, _)| k == KEYS[i]) {
                continue;
            }
            if wrote {
                out.push(b',');
            }
            out.push(b'"');
            out.extend_from_slice(KEYS[i].as_bytes());
            out.extend_from_slice(b"\":[");
            out.extend_from_slice(p);
            out.push(b']');
            wrote = true;
        }
        if wrote && !members.0.is_empty() {
            out.push(b',');
        }
        // Then decode's members, its arrays for those keys prefixed with the prefill's.
        let mut at = open;
        for (k, v) in &members.0 {
            let Some(i) = KEYS.iter().position(|key| key == k) else {
                continue;
            };
            let Some(p) = &src[i] else { continue };
            let vs = span(meta, v.get());
            out.extend_from_slice(&meta.as_bytes()[at..vs.start]);
            out.push(b'[');
            out.extend_from_slice(p);
            if let Some(d) = array_inner(v.get()) {
                let d = &v.get()[d];
                if !p.is_empty() && !d.is_empty() {
                    out.push(b',');
                }
                out.extend_from_slice(d.as_bytes());
            }
            out.push(b']');
            at = vs.end;
        }
        out.extend_from_slice(&meta.as_bytes()[at..]);
        out.extend_from_slice(&item.as_bytes()[m.end..]);
    }

    /// Merges into a whole non-streamed answer (an object or a batch list).
    pub fn merge_answer(&self, body: &[u8]) -> Option<Vec<u8>> {
        let text = std::str::from_utf8(body).ok()?;
        let list = items(text)?;
        let mut out = Vec::with_capacity(body.len() + self.bytes + 64);
        let mut at = 0;
        for (i, item) in list.iter().enumerate() {
            let s = span(text, item.get());
            out.extend_from_slice(&body[at..s.start]);
            self.merge_item(i, item.get(), &mut out);
            at = s.end;
        }
        out.extend_from_slice(&body[at..]);
        Some(out)
    }

    /// Merges into one stream chunk's JSON (its `index` picks the batch item), appending
    /// to `out`; `false` (nothing written) when the chunk is not a JSON object.
    pub fn merge_chunk_into(&self, json: &[u8], out: &mut Vec<u8>) -> bool {
        let Ok(text) = std::str::from_utf8(json) else {
            return false;
        };
        let Ok(top) = serde_json::from_str::<Members<'_>>(text) else {
            return false;
        };
        let idx = top
            .0
            .iter()
            .find(|(k, _)| k == "index")
            .and_then(|(_, v)| v.get().parse::<u64>().ok())
            .unwrap_or(0) as usize;
        self.merge_members(idx, text, Some(&top), out);
        true
    }

    /// [`Self::merge_chunk_into`] into a new buffer.
    pub fn merge_chunk(&self, json: &[u8]) -> Option<Vec<u8>> {
        let mut out = Vec::with_capacity(json.len() + self.bytes + 64);
        self.merge_chunk_into(json, &mut out).then_some(out)
    }
}

#[cfg(test)]
mod tests;
