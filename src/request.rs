//! Reading a client request: only the top-level JSON object is parsed, and only the keys
//! pdgate touches are looked at; every other value is kept as the exact bytes the client
//! sent and forwarded byte-for-byte.
//!
//! Invariants:
//! - A [`ParsedRequest`] exists only for a body that is valid UTF-8 JSON whose top level is
//!   an object with a prompt of the right shape for its route; anything else is a 400 that
//!   is decided before any leg is sent.
//! - Client-supplied PD fields (bootstrap host/port/room, DP ranks, rid) are dropped here
//!   and never reach an engine; pdgate writes its own in [`ParsedRequest::write_leg`].

use std::borrow::Cow;
use std::fmt;
use std::ops::Range;
use std::sync::OnceLock;

use bytes::Bytes;
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::error::{FailReason, Failure};
use crate::types::fnv1a;
use crate::upstream::Payload;

/// The generation routes pdgate dispatches as PD requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ApiRoute {
    Generate,
    ChatCompletions,
    Completions,
}

impl ApiRoute {
    pub fn path(self) -> &'static str {
        match self {
            ApiRoute::Generate => "/generate",
            ApiRoute::ChatCompletions => "/v1/chat/completions",
            ApiRoute::Completions => "/v1/completions",
        }
    }
    pub const fn label(self) -> &'static str {
        match self {
            ApiRoute::Generate => "generate",
            ApiRoute::ChatCompletions => "chat_completions",
            ApiRoute::Completions => "completions",
        }
    }
}

/// Keys pdgate owns on the legs; a client's values for them are dropped.
pub const PD_KEYS: [&str; 7] = [
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "routed_dp_rank",
    "data_parallel_rank",
    "disagg_prefill_dp_rank",
    "rid",
];

/// Largest `n` accepted (parallel samples per prompt).
pub const MAX_N: u64 = 1024;
/// Largest number of instances (prompts × samples) in one request.
pub const MAX_INSTANCES: usize = 65_536;

/// A top-level member kept verbatim.
#[derive(Debug)]
struct Field {
    /// The key, JSON-escaped and quoted, ready to write.
    key_json: KeyJson,
    /// Byte range of the raw value inside the body.
    value: Range<usize>,
}

/// A key as JSON: its quoted span in the body when it has no escapes (the usual case, no
/// allocation), else re-escaped.
#[derive(Debug)]
enum KeyJson {
    Span(Range<usize>),
    Escaped(Box<str>),
}

/// A validated client request.
#[derive(Debug)]
pub struct ParsedRequest {
    body: Bytes,
    fields: Vec<Field>,
    pub route: ApiRoute,
    pub stream: bool,
    /// Number of prompts when the prompt is a batch; `None` for a single prompt.
    pub batch: Option<usize>,
    /// Samples per prompt (`n`).
    pub n: u32,
    /// `/generate` with `return_logprob`: the prefill's input logprobs are merged.
    pub return_logprob: bool,
    /// PD keys the client sent that pdgate replaced (for the log).
    pub replaced: Vec<&'static str>,
    /// Byte range of the prompt's raw JSON value (`text`, `input_ids`, `input_embeds`,
    /// `prompt` or `messages`).
    prompt: Option<Range<usize>>,
    prefix_hash: OnceLock<Option<u64>>,
    /// Top-level members the legs carry instead of the client's (`stream_options` on a
    /// continuable OpenAI stream, see `request::continuation`; `model` when the client named an
    /// alias, see `crate::models::leg_name`). Empty (no allocation) on most requests.
    leg_overrides: Vec<(&'static str, Box<str>)>,
    /// Byte range of the top-level `model` string (its raw JSON, quotes included). Kept on
    /// OpenAI legs; SGLang's `/generate` has no such field, so it is not sent there.
    model: Option<Range<usize>>,
    /// The model the request was resolved to (`crate::models::resolve`): `None` while one
    /// handoff group serves everything (any worker may take it).
    pub scope: Option<std::sync::Arc<str>>,
}

/// How many bytes of a prompt's raw JSON form its affinity key.
pub const PREFIX_KEY_BYTES: usize = 256;

impl ParsedRequest {
    /// Prompt instances (prompts × samples): the number of rooms one attempt needs.
    pub fn instances(&self) -> usize {
        self.batch.unwrap_or(1) * self.n as usize
    }

    /// The prompt's affinity key, computed once on first use: for chat, the messages up to
    /// and including the first user message (stable across the turns of a conversation);
    /// otherwise the first [`PREFIX_KEY_BYTES`] bytes of the prompt's raw JSON.
    pub fn prefix_hash(&self) -> Option<u64> {
        *self.prefix_hash.get_or_init(|| {
            let raw = &self.body[self.prompt.clone()?];
            if self.route == ApiRoute::ChatCompletions {
                #[derive(serde::Deserialize)]
                struct Msg<'a> {
                    #[serde(borrow, default)]
                    role: Option<Cow<'a, str>>,
                }
                let items: Vec<&RawValue> = serde_json::from_slice(raw).ok()?;
                let end = items
                    .iter()
                    .position(|m| {
                        serde_json::from_str::<Msg<'_>>(m.get())
                            .ok()
                            .and_then(|m| m.role)
                            .as_deref()
                            == Some("user")
                    })
                    .unwrap_or(0);
                let mut h = Vec::new();
                for m in &items[..=end.min(items.len().saturating_sub(1))] {
                    h.extend_from_slice(m.get().as_bytes());
                    h.push(0);
                }
                return Some(fnv1a(&h));
            }
            Some(fnv1a(&raw[..raw.len().min(PREFIX_KEY_BYTES)]))
        })
    }

    /// The `model` the client named, unescaped (borrowed unless it had escapes).
    pub fn model(&self) -> Option<Cow<'_, str>> {
        let raw = self.raw(self.model.clone()?);
        match raw.strip_prefix('"').and_then(|r| r.strip_suffix('"')) {
            Some(inner) if !inner.contains('\\') => Some(Cow::Borrowed(inner)),
            _ => serde_json::from_str::<String>(raw).ok().map(Cow::Owned),
        }
    }

    /// The request's size for stall detection: the byte length of the prompt's raw JSON
    /// (text, ids or messages; no tokenizer on the request path), at least 1.
    pub fn prompt_size(&self) -> u32 {
        self.prompt
            .as_ref()
            .map_or(1, |r| r.len().clamp(1, u32::MAX as usize) as u32)
    }

    /// The client's top-level members in order: the key (unescaped) and its raw JSON value.
    /// PD keys and `stream` are not among them.
    pub fn members(&self) -> impl Iterator<Item = (Cow<'_, str>, &str)> + '_ {
        self.fields
            .iter()
            .map(|f| (self.key_of(f), self.raw(f.value.clone())))
    }

    fn key_of(&self, f: &Field) -> Cow<'_, str> {
        match &f.key_json {
            KeyJson::Span(r) => Cow::Borrowed(self.raw(r.start + 1..r.end - 1)),
            KeyJson::Escaped(k) => {
                Cow::Owned(serde_json::from_str::<String>(k).unwrap_or_default())
            }
        }
    }

    fn raw(&self, r: Range<usize>) -> &str {
        // The body was checked to be UTF-8 and every range sits on JSON token bounds.
        std::str::from_utf8(&self.body[r]).unwrap_or("null")
    }

    /// The legs carry `raw` as the value of `key` instead of the client's member (added
    /// when the client had none). The client's value stays readable in [`Self::members`].
    pub fn override_on_legs(&mut self, key: &'static str, raw: String) {
        let raw = raw.into_boxed_str();
        match self.leg_overrides.iter_mut().find(|(k, _)| *k == key) {
            Some(slot) => slot.1 = raw,
            None => self.leg_overrides.push((key, raw)),
        }
    }

    /// A follow-up of `first` (a moved stream's continuation) goes where `first` went and
    /// carries what `first`'s legs carried instead of the client's members.
    pub fn follow(&mut self, first: &ParsedRequest) {
        self.scope = first.scope.clone();
        self.leg_overrides = first.leg_overrides.clone();
    }

    /// Whether the bootstrap fields go as lists (one entry per instance).
    pub fn is_multi(&self) -> bool {
        self.batch.is_some() || self.n > 1
    }

    /// Writes one leg's body: every untouched member verbatim, then pdgate's own fields
    /// (the bytes [`Self::write_legs`] writes for that leg, in one buffer).
    pub fn write_leg(&self, out: &mut Vec<u8>, leg: &LegFields<'_>) {
        let mut p = self.member_pieces();
        push_fields(&mut p, leg, self);
        out.clear();
        out.extend_from_slice(&p.to_vec());
    }

    /// The leg overrides `applies` selects, as `"key":value,` members.
    fn push_overrides(&self, out: &mut Vec<u8>, applies: impl Fn(&str) -> bool) {
        for (k, v) in self.leg_overrides.iter().filter(|(k, _)| applies(k)) {
            push_key(out, k);
            out.extend_from_slice(v.as_bytes());
            out.push(b',');
        }
    }

    /// Both legs' bodies, as pieces of the client's body (never copied: both point into
    /// the one allocation the request holds) and a small tail of pdgate's own fields each.
    pub fn write_legs(&self, p: &LegFields<'_>, d: &LegFields<'_>) -> (Payload, Payload) {
        let mut pb = self.member_pieces();
        let mut db = pb.clone();
        push_fields(&mut pb, p, self);
        push_fields(&mut db, d, self);
        (pb, db)
    }

    /// `{` and the client's members, as ranges of the body: a run of members that follow
    /// each other in the body (nothing dropped between) is one range, whitespace and all.
    fn member_pieces(&self) -> Payload {
        self.pieces_skipping(|_| true)
    }

    /// `{` and the client's members but those the leg overrides that `applies` selects
    /// replace (see [`Self::member_pieces`]; the caller writes those overrides).
    fn pieces_skipping(&self, applies: impl Fn(&str) -> bool) -> Payload {
        let mut out = Payload::over(self.body.clone());
        let body = &self.body[..];
        // Where the last member written ends in the body.
        let mut prev_end: Option<usize> = None;
        for f in &self.fields {
            if !self.leg_overrides.is_empty() {
                let key = self.key_of(f);
                if self
                    .leg_overrides
                    .iter()
                    .any(|(k, _)| key == *k && applies(k))
                {
                    continue;
                }
            }
            match &f.key_json {
                KeyJson::Span(r) => {
                    // The bytes before the key: `{` (first member) or `,` (members that
                    // follow each other), with whitespace; else a separator is written.
                    let gap = &body[prev_end.unwrap_or(0)..r.start];
                    let joins = gap.trim_ascii() == if prev_end.is_some() { b"," } else { b"{" };
                    let from = if joins {
                        prev_end.unwrap_or(0)
                    } else {
                        out.push_lit(if prev_end.is_some() { b"," } else { b"{" });
                        r.start
                    };
                    out.push_src(from..f.value.end);
                }
                KeyJson::Escaped(k) => {
                    out.push_lit(if prev_end.is_some() { b"," } else { b"{" });
                    out.push_own(k.as_bytes());
                    out.push_lit(b":");
                    out.push_src(f.value.clone());
                }
            }
            prev_end = Some(f.value.end);
        }
        if prev_end.is_none() {
            out.push_lit(b"{");
        } else {
            out.push_lit(b",");
        }
        out
    }
}

/// pdgate's part of a leg, after the client's members: the override, the bootstrap host,
/// port and room(s), then what differs between the legs.
fn push_fields(out: &mut Payload, leg: &LegFields<'_>, req: &ParsedRequest) {
    out.own(|out| {
        req.push_overrides(out, |_| true);
        let multi = req.is_multi();
        push_key(out, "bootstrap_host");
        list_or_scalar(out, multi, leg.rooms.len(), |o| {
            o.extend_from_slice(leg.host_json.as_bytes())
        });
        push_key(out, ",bootstrap_port");
        list_or_scalar(out, multi, leg.rooms.len(), |o| {
            push_u64(o, u64::from(leg.port))
        });
        push_key(out, ",bootstrap_room");
        if multi {
            out.push(b'[');
            for (i, r) in leg.rooms.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                push_u64(out, *r);
            }
            out.push(b']');
        } else {
            push_u64(out, leg.rooms.first().copied().unwrap_or(0));
        }
        write_own(out, leg);
    });
}

/// What differs between the legs: rid, DP fields, stream, and the closing brace.
fn write_own(out: &mut Vec<u8>, leg: &LegFields<'_>) {
    push_key(out, ",rid");
    out.push(b'"');
    out.extend_from_slice(leg.rid.as_bytes());
    out.push(b'"');
    if let Some(r) = leg.routed_dp_rank {
        push_key(out, ",routed_dp_rank");
        push_u64(out, u64::from(r));
    }
    if let Some(r) = leg.disagg_prefill_dp_rank {
        push_key(out, ",disagg_prefill_dp_rank");
        push_u64(out, u64::from(r));
    }
    push_key(out, ",stream");
    out.extend_from_slice(if leg.stream { b"true" } else { b"false" });
    out.push(b'}');
}

/// What pdgate writes on a leg.
#[derive(Debug)]
pub struct LegFields<'a> {
    /// The bootstrap host as a JSON string literal (quoted, escaped).
    pub host_json: &'a str,
    pub port: u16,
    pub rooms: &'a [u64],
    /// A rid made of `[A-Za-z0-9-]` only.
    pub rid: &'a str,
    pub routed_dp_rank: Option<u32>,
    pub disagg_prefill_dp_rank: Option<u32>,
    pub stream: bool,
}

fn push_key(out: &mut Vec<u8>, key_with_optional_comma: &str) {
    let (comma, key) = match key_with_optional_comma.strip_prefix(',') {
        Some(k) => (true, k),
        None => (false, key_with_optional_comma),
    };
    if comma {
        out.push(b',');
    }
    out.push(b'"');
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(b"\":");
}

fn push_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(itoa::Buffer::new().format(v).as_bytes());
}

fn list_or_scalar(out: &mut Vec<u8>, multi: bool, len: usize, mut item: impl FnMut(&mut Vec<u8>)) {
    if multi {
        out.push(b'[');
        for i in 0..len {
            if i > 0 {
                out.push(b',');
            }
            item(out);
        }
        out.push(b']');
    } else {
        item(out);
    }
}

fn invalid(msg: impl Into<String>) -> Failure {
    Failure::new(FailReason::InvalidRequest, msg)
}

/// A top-level key, borrowed when it has no escapes.
struct Key<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string key")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v.to_owned())))
            }
        }
        d.deserialize_str(V)
    }
}

/// The top-level object as (key, raw value) pairs in order.
struct TopLevel<'a>(Vec<(Key<'a>, &'a RawValue)>);

impl<'de> Deserialize<'de> for TopLevel<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TopLevel<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<TopLevel<'de>, A::Error> {
                let mut v = Vec::with_capacity(m.size_hint().unwrap_or(8));
                while let Some(entry) = m.next_entry::<Key<'de>, &'de RawValue>()? {
                    v.push(entry);
                }
                Ok(TopLevel(v))
            }
        }
        d.deserialize_map(V)
    }
}

/// Shape of a JSON value, read from its first byte.
fn first_byte(v: &RawValue) -> u8 {
    v.get().as_bytes().first().copied().unwrap_or(b' ')
}

fn is_null(v: &RawValue) -> bool {
    v.get() == "null"
}

fn parse_bool(key: &str, v: &RawValue) -> Result<bool, Failure> {
    match v.get() {
        "true" => Ok(true),
        "false" | "null" => Ok(false),
        _ => Err(invalid(format!("'{key}' must be a boolean"))),
    }
}

/// `return_logprob` may be a bool or a list of bools (one per prompt).
fn parse_bool_or_list(key: &str, v: &RawValue) -> Result<bool, Failure> {
    if first_byte(v) == b'[' {
        let items: Vec<Option<bool>> = serde_json::from_str(v.get())
            .map_err(|_| invalid(format!("'{key}' must be a boolean or a list of booleans")))?;
        return Ok(items.into_iter().any(|b| b == Some(true)));
    }
    parse_bool(key, v)
}

fn parse_n(key: &str, v: &RawValue) -> Result<u32, Failure> {
    if is_null(v) {
        return Ok(1);
    }
    match v.get().parse::<u64>() {
        Ok(n) if (1..=MAX_N).contains(&n) => Ok(n as u32),
        _ => Err(invalid(format!(
            "'{key}' must be an integer from 1 to {MAX_N}"
        ))),
    }
}

/// Reads `n` from `sampling_params` (an object, or a list of objects that must agree).
fn sampling_n(v: &RawValue) -> Result<u32, Failure> {
    #[derive(Deserialize)]
    struct Sp<'a> {
        #[serde(borrow, default)]
        n: Option<&'a RawValue>,
    }
    match first_byte(v) {
        b'n' if is_null(v) => Ok(1),
        b'{' => {
            let sp: Sp<'_> = serde_json::from_str(v.get())
                .map_err(|_| invalid("'sampling_params' must be an object"))?;
            sp.n.map_or(Ok(1), |n| parse_n("sampling_params.n", n))
        }
        b'[' => {
            let list: Vec<Sp<'_>> = serde_json::from_str(v.get())
                .map_err(|_| invalid("'sampling_params' must be an object or a list of objects"))?;
            let mut n = None;
            for sp in list {
                let this = sp.n.map_or(Ok(1), |n| parse_n("sampling_params.n", n))?;
                if n.is_some_and(|prev| prev != this) {
                    return Err(invalid("'sampling_params' list entries must share one 'n'"));
                }
                n = Some(this);
            }
            Ok(n.unwrap_or(1))
        }
        _ => Err(invalid("'sampling_params' must be an object")),
    }
}

/// Element shapes of a JSON array, without parsing the elements.
fn array_shape(key: &str, v: &RawValue) -> Result<(usize, u8), Failure> {
    let items: Vec<&RawValue> = serde_json::from_str(v.get())
        .map_err(|_| invalid(format!("'{key}' is not a valid array")))?;
    let first = items.first().map(|f| first_byte(f)).unwrap_or(b' ');
    Ok((items.len(), first))
}

/// `text`: a string or a non-empty list of strings.
fn text_batch(v: &RawValue) -> Result<Option<usize>, Failure> {
    match first_byte(v) {
        b'"' => Ok(None),
        b'[' => {
            let items: Vec<&RawValue> =
                serde_json::from_str(v.get()).map_err(|_| invalid("'text' is not a valid list"))?;
            if items.is_empty() {
                return Err(invalid("'text' must not be an empty list"));
            }
            if items.iter().any(|i| first_byte(i) != b'"') {
                return Err(invalid("'text' must be a string or a list of strings"));
            }
            Ok(Some(items.len()))
        }
        _ => Err(invalid("'text' must be a string or a list of strings")),
    }
}

/// `input_ids` / `prompt` of token ids: a flat list of ints is one prompt; a list of lists
/// is a batch. `allow_strings` admits a list of strings (OpenAI `prompt`).
fn ids_or_prompt_batch(
    key: &str,
    v: &RawValue,
    allow_strings: bool,
) -> Result<Option<usize>, Failure> {
    let shape_err = || {
        if allow_strings {
            invalid(format!(
                "'{key}' must be a string, a list of strings, a list of token ids or a list of lists of token ids"
            ))
        } else {
            invalid(format!(
                "'{key}' must be a list of token ids or a list of lists of token ids"
            ))
        }
    };
    match first_byte(v) {
        b'"' if allow_strings => Ok(None),
        b'[' => {
            let (len, first) = array_shape(key, v)?;
            if len == 0 {
                return Err(invalid(format!("'{key}' must not be empty")));
            }
            match first {
                b'-' | b'0'..=b'9' => Ok(None),
                b'[' => Ok(Some(len)),
                b'"' if allow_strings => Ok(Some(len)),
                _ => Err(shape_err()),
            }
        }
        _ => Err(shape_err()),
    }
}

/// The quoted span of a key borrowed from `text` (so it had no escapes), if it is one.
#[allow(clippy::ptr_arg)] // whether the key is borrowed from `text` is the point
fn key_span(text: &str, base: usize, key: &Cow<'_, str>) -> Option<Range<usize>> {
    let k: &str = match key {
        Cow::Borrowed(k) => k,
        Cow::Owned(_) => return None,
    };
    let start = (k.as_ptr() as usize).checked_sub(base)?;
    let (open, close) = (start.checked_sub(1)?, start + k.len());
    let b = text.as_bytes();
    (b.get(open) == Some(&b'"') && b.get(close) == Some(&b'"')).then_some(open..close + 1)
}

/// Parses and validates a client body for `route`.
pub fn parse(route: ApiRoute, body: Bytes) -> Result<ParsedRequest, Failure> {
    let text =
        std::str::from_utf8(&body).map_err(|e| invalid(format!("body is not valid UTF-8: {e}")))?;
    let top: TopLevel<'_> = match serde_json::from_str(text) {
        Ok(t) => t,
        Err(e) if e.is_data() => return Err(invalid("request body must be a JSON object")),
        Err(e) => return Err(invalid(format!("body is not valid JSON: {e}"))),
    };
    let base = text.as_ptr() as usize;
    let mut fields = Vec::with_capacity(top.0.len());
    let mut replaced = Vec::new();
    let mut stream = false;
    let mut batch = None;
    let mut n = 1u32;
    let mut return_logprob = false;
    let mut prompt_keys = 0u32;
    let mut prompt = None;
    let mut model = None;
    for (Key(key), value) in top.0 {
        let k: &str = &key;
        if let Some(pd) = PD_KEYS.iter().find(|p| **p == k) {
            if !replaced.contains(pd) {
                replaced.push(*pd);
            }
            continue;
        }
        match (route, k) {
            (_, "stream") => {
                stream = parse_bool("stream", value)?;
                continue;
            }
            (ApiRoute::Generate, "text") if !is_null(value) => {
                batch = text_batch(value)?;
                prompt_keys += 1;
            }
            (ApiRoute::Generate, "input_ids") if !is_null(value) => {
                batch = ids_or_prompt_batch("input_ids", value, false)?;
                prompt_keys += 1;
            }
            (ApiRoute::Generate, "input_embeds") if !is_null(value) => {
                if first_byte(value) != b'[' {
                    return Err(invalid("'input_embeds' must be a list"));
                }
                prompt_keys += 1;
            }
            (ApiRoute::Generate, "sampling_params") => n = sampling_n(value)?,
            (ApiRoute::Generate, "return_logprob") => {
                return_logprob = parse_bool_or_list("return_logprob", value)?
            }
            (ApiRoute::Completions, "prompt") if !is_null(value) => {
                batch = ids_or_prompt_batch("prompt", value, true)?;
                prompt_keys += 1;
            }
            (ApiRoute::ChatCompletions, "messages") => {
                let (len, _) = if first_byte(value) == b'[' {
                    array_shape("messages", value)?
                } else {
                    return Err(invalid("'messages' must be a list"));
                };
                if len == 0 {
                    return Err(invalid("'messages' must not be empty"));
                }
                prompt_keys += 1;
            }
            (ApiRoute::ChatCompletions | ApiRoute::Completions, "n") => n = parse_n("n", value)?,
            // A string names the model; anything else names none and is left to the
            // engine to judge, as before.
            (_, "model") if first_byte(value) == b'"' => {
                let raw = value.get();
                let start = raw.as_ptr() as usize - base;
                model = Some(start..start + raw.len());
                if route == ApiRoute::Generate {
                    // pdgate's routing key only: SGLang's `/generate` takes no `model`.
                    continue;
                }
            }
            _ => {}
        }
        let raw = value.get();
        let start = raw.as_ptr() as usize - base;
        if prompt_keys == 1 && prompt.is_none() {
            prompt = Some(start..start + raw.len());
        }
        let key_json = match key_span(text, base, &key) {
            Some(span) => KeyJson::Span(span),
            None => match serde_json::to_string(k) {
                Ok(s) => KeyJson::Escaped(s.into_boxed_str()),
                Err(e) => return Err(invalid(format!("bad key: {e}"))),
            },
        };
        fields.push(Field {
            key_json,
            value: start..start + raw.len(),
        });
    }
    match (route, prompt_keys) {
        (ApiRoute::Generate, 0) => {
            return Err(invalid(
                "no prompt: give one of 'text', 'input_ids' or 'input_embeds'",
            ))
        }
        (ApiRoute::Generate, k) if k > 1 => {
            return Err(invalid(
                "give only one of 'text', 'input_ids' or 'input_embeds'",
            ))
        }
        (ApiRoute::ChatCompletions, 0) => return Err(invalid("'messages' is required")),
        (ApiRoute::Completions, 0) => return Err(invalid("'prompt' is required")),
        _ => {}
    }
    let req = ParsedRequest {
        body,
        fields,
        route,
        stream,
        batch,
        n,
        return_logprob: return_logprob && route == ApiRoute::Generate,
        replaced,
        prompt,
        prefix_hash: OnceLock::new(),
        leg_overrides: Vec::new(),
        model,
        scope: None,
    };
    if req.instances() > MAX_INSTANCES {
        return Err(invalid(format!(
            "too many prompt instances ({}; at most {MAX_INSTANCES})",
            req.instances()
        )));
    }
    Ok(req)
}

pub mod continuation;
mod plain;
pub mod record;
mod size;

#[cfg(test)]
mod tests;

#[cfg(test)]
mod props;
