//! What a continuable stream has sent the client, and the splice of a continued stream onto
//! it, so that the client sees one answer.
//!
//! Before a move (segment 0) the relay hands each run of whole events to [`Tracker::relay`]:
//! - `/generate` in SGLang's default cumulative mode: nothing is parsed; the last data
//!   event (a zero-copy slice) already holds the whole answer so far, and is parsed only
//!   when a move needs it;
//! - `/generate` in incremental mode (`--incremental-streaming-output`) and the OpenAI
//!   routes: each event's few fields (text, ids, engine-reported completion tokens, finish
//!   reason, tool calls, reasoning) are read; on the OpenAI routes the per-chunk usage
//!   pdgate asked the decode for is cut out of what the client gets unless it asked for it
//!   (and its final usage chunk dropped unless it asked for that).
//!
//! After a move (segment 1, 2, ...) each event of the continued stream is rewritten: its
//! counts are the sums over segments (`prompt_tokens` the original's), its ids the first
//! segment's, its cumulative `text`/`output_ids` prefixed with what earlier segments sent,
//! and the continuation's own role chunk dropped. Counts are only ever the engine's.
//!
//! Invariants: bytes pass unchanged unless a rewrite is needed; one event in gives at most
//! one event out; `[DONE]` and comments pass as they are.

use std::borrow::Cow;

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use super::continuation::{Plan, Sent};
use super::request::ApiRoute;

/// How an engine streams `/generate`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GenerateMode {
    /// SGLang's default: each event holds the whole text and ids so far.
    Cumulative,
    /// `--incremental-streaming-output`: each event holds only what is new.
    Incremental,
}

/// Why a stream can no longer be continued, seen in the stream itself.
pub type Stop = &'static str;

/// One continuable stream's account (see the module docs).
#[derive(Debug)]
pub struct Tracker {
    plan: Plan,
    /// How the client's `/generate` stream goes (the first decode's mode).
    client_mode: GenerateMode,
    /// How the current segment's decode streams.
    mode: GenerateMode,
    segment: u32,
    /// What earlier segments sent.
    base: Sent,
    /// What this segment sent (the engine's own counts).
    cur: Sent,
    /// Cumulative `/generate`: this segment's last data payload, parsed on demand.
    last: Option<Bytes>,
    prompt_tokens: Option<u64>,
    /// The first segment's object id (OpenAI `id`, `/generate` `meta_info.id`).
    id: Option<String>,
    stop: Option<Stop>,
}

#[derive(Deserialize)]
struct GenChunk<'a> {
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(default)]
    output_ids: Option<Vec<i64>>,
    #[serde(borrow, default)]
    meta_info: Option<GenMeta<'a>>,
}

#[derive(Deserialize)]
struct GenMeta<'a> {
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(borrow, default)]
    finish_reason: Option<&'a RawValue>,
    #[serde(borrow, default)]
    id: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct OaChunk<'a> {
    #[serde(borrow, default)]
    id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    choices: Option<Vec<OaChoice<'a>>>,
    #[serde(borrow, default)]
    usage: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct OaChoice<'a> {
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    delta: Option<OaDelta<'a>>,
    #[serde(borrow, default)]
    finish_reason: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct OaDelta<'a> {
    #[serde(borrow, default)]
    content: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    reasoning_content: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    tool_calls: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Usage {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
}

/// The `data:` payload of one event, if it has one (SGLang writes one line per event).
fn payload(event: &[u8]) -> Option<(usize, usize)> {
    let mut start = 0;
    for end in memchr::memchr_iter(b'\n', event).chain(std::iter::once(event.len())) {
        let line = &event[start..end];
        let line_start = start;
        start = end + 1;
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(d) = line.strip_prefix(b"data:") {
            let skip = 5 + usize::from(d.first() == Some(&b' '));
            let from = line_start + skip;
            return Some((from, line_start + line.len()));
        }
    }
    None
}

/// The events of a run of whole events, each with its blank line.
fn events(buf: &[u8]) -> impl Iterator<Item = (usize, usize)> + '_ {
    let mut pos = 0;
    std::iter::from_fn(move || {
        if pos >= buf.len() {
            return None;
        }
        let rest = &buf[pos..];
        let len = memchr::memchr_iter(b'\n', rest)
            .find_map(|i| match rest.get(i + 1..) {
                Some([b'\n', ..]) => Some(i + 2),
                Some([b'\r', b'\n', ..]) => Some(i + 3),
                _ => None,
            })
            .unwrap_or(rest.len());
        let ev = (pos, pos + len);
        pos += len;
        Some(ev)
    })
}

/// `data` without the member whose raw value is `value` (a slice of `data`), or `None`
/// when it cannot be cut cleanly.
fn without_member(data: &[u8], value: &RawValue) -> Option<Vec<u8>> {
    let v = value.get().as_bytes();
    let vs = (v.as_ptr() as usize).checked_sub(data.as_ptr() as usize)?;
    let ve = vs + v.len();
    if ve > data.len() {
        return None;
    }
    let head = data[..vs].trim_ascii_end().strip_suffix(b":")?;
    let head = head.trim_ascii_end();
    let key_start = head.len().checked_sub(b"\"usage\"".len())?;
    if &head[key_start..] != b"\"usage\"" {
        return None;
    }
    let before = head[..key_start].trim_ascii_end();
    let mut out = Vec::with_capacity(data.len());
    if let Some(b) = before.strip_suffix(b",") {
        out.extend_from_slice(b);
        out.extend_from_slice(&data[ve..]);
    } else {
        // The first member: drop the comma after it instead.
        out.extend_from_slice(before);
        let after = data[ve..].trim_ascii_start();
        out.extend_from_slice(after.strip_prefix(b",").unwrap_or(after));
    }
    Some(out)
}

fn push_event(out: &mut Vec<u8>, data: &[u8]) {
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(data);
    out.extend_from_slice(b"\n\n");
}

impl Tracker {
    pub fn new(plan: Plan, mode: GenerateMode) -> Tracker {
        Tracker {
            plan,
            client_mode: mode,
            mode,
            segment: 0,
            base: Sent::default(),
            cur: Sent::default(),
            last: None,
            prompt_tokens: None,
            id: None,
            stop: None,
        }
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Moves made so far.
    pub fn segment(&self) -> u32 {
        self.segment
    }

    /// The stream showed something that cannot be continued (a tool call, reasoning, a
    /// finished answer).
    pub fn stopped(&self) -> Option<Stop> {
        self.stop
    }

    /// Whole events forwarded to the client: recorded, and rewritten where needed.
    pub fn relay(&mut self, run: Bytes) -> Bytes {
        let fast = self.segment == 0
            && self.plan.route == ApiRoute::Generate
            && self.mode == GenerateMode::Cumulative;
        if fast {
            // The last data event holds everything; keep it, forward the run as is.
            for (s, e) in events(&run) {
                if let Some((ds, de)) = payload(&run[s..e]) {
                    if &run[s + ds..s + de] != b"[DONE]" {
                        self.last = Some(run.slice(s + ds..s + de));
                    }
                }
            }
            return run;
        }
        let mut out: Option<Vec<u8>> = None;
        for (s, e) in events(&run) {
            let event = &run[s..e];
            let data = payload(event).map(|(ds, de)| &event[ds..de]);
            let replaced = match data {
                Some(d) if d != b"[DONE]" => self.event(d),
                _ => None,
            };
            match replaced {
                None => {
                    if let Some(o) = out.as_mut() {
                        o.extend_from_slice(event);
                    }
                }
                Some(r) => {
                    let o = out.get_or_insert_with(|| run[..s].to_vec());
                    if let Some(d) = r {
                        push_event(o, &d);
                    }
                }
            }
        }
        match out {
            Some(o) => Bytes::from(o),
            None => run,
        }
    }

    /// One data payload: `None` to forward it as is, `Some(None)` to drop it,
    /// `Some(Some(d))` to send `d` instead.
    fn event(&mut self, data: &[u8]) -> Option<Option<Vec<u8>>> {
        match self.plan.route {
            ApiRoute::Generate => self.generate_event(data),
            _ => self.openai_event(data),
        }
    }

    fn generate_event(&mut self, data: &[u8]) -> Option<Option<Vec<u8>>> {
        let Ok(c) = serde_json::from_slice::<GenChunk<'_>>(data) else {
            return None;
        };
        let meta = c.meta_info.as_ref();
        if self.segment == 0 {
            if self.id.is_none() {
                self.id = meta.and_then(|m| m.id.as_deref()).map(str::to_string);
            }
            if let Some(p) = meta.and_then(|m| m.prompt_tokens) {
                self.prompt_tokens = Some(p);
            }
        }
        if meta.and_then(|m| m.finish_reason).is_some() {
            self.stop = Some("the answer was complete");
        }
        if let Some(n) = meta.and_then(|m| m.completion_tokens) {
            self.cur.completion_tokens = n;
        }
        let text = c.text.as_deref().unwrap_or("");
        let ids = c.output_ids.as_deref().unwrap_or(&[]);
        let (text_was, ids_was) = (self.cur.text.len(), self.cur.ids.len());
        match self.mode {
            GenerateMode::Cumulative => {
                self.cur.text.clear();
                self.cur.text.push_str(text);
                self.cur.ids.clear();
                self.cur.ids.extend_from_slice(ids);
            }
            GenerateMode::Incremental => {
                self.cur.text.push_str(text);
                self.cur.ids.extend_from_slice(ids);
            }
        }
        if self.segment == 0 {
            return None;
        }
        let mut v: Value = serde_json::from_slice(data).ok()?;
        // The client's format, whatever this decode's: the whole answer, or what is new.
        let (out_text, out_ids): (String, Vec<i64>) = match self.client_mode {
            GenerateMode::Cumulative => (
                format!("{}{}", self.base.text, self.cur.text),
                self.base.ids.iter().chain(&self.cur.ids).copied().collect(),
            ),
            GenerateMode::Incremental => (
                self.cur.text.get(text_was..).unwrap_or("").to_string(),
                self.cur.ids.get(ids_was..).unwrap_or(&[]).to_vec(),
            ),
        };
        if let Some(t) = v.get_mut("text") {
            *t = Value::from(out_text);
        }
        if let Some(o) = v.get_mut("output_ids") {
            *o = Value::from(out_ids);
        }
        if let Some(m) = v.get_mut("meta_info").and_then(Value::as_object_mut) {
            if let Some(n) = meta.and_then(|m| m.completion_tokens) {
                m.insert(
                    "completion_tokens".into(),
                    (n + self.base.completion_tokens).into(),
                );
            }
            if let Some(p) = self.prompt_tokens {
                m.insert("prompt_tokens".into(), p.into());
            }
            if let Some(id) = &self.id {
                m.insert("id".into(), id.clone().into());
            }
            if let Some(len) = m
                .get_mut("finish_reason")
                .and_then(|f| f.get_mut("length"))
                .filter(|l| l.is_u64())
            {
                *len = self.plan.limit.map_or_else(|| len.clone(), Value::from);
            }
        }
        Some(serde_json::to_vec(&v).ok())
    }

    fn openai_event(&mut self, data: &[u8]) -> Option<Option<Vec<u8>>> {
        let Ok(c) = serde_json::from_slice::<OaChunk<'_>>(data) else {
            return None;
        };
        let usage = c
            .usage
            .and_then(|u| serde_json::from_str::<Usage>(u.get()).ok());
        if let Some(u) = &usage {
            if let Some(n) = u.completion_tokens {
                self.cur.completion_tokens = n;
            }
            if self.segment == 0 {
                if let Some(p) = u.prompt_tokens {
                    self.prompt_tokens = Some(p);
                }
            }
        }
        if self.segment == 0 && self.id.is_none() {
            self.id = c.id.as_deref().map(str::to_string);
        }
        let choices = c.choices.as_deref().unwrap_or(&[]);
        let mut role_only = self.segment > 0 && !choices.is_empty();
        for ch in choices {
            let d = ch.delta.as_ref();
            let piece = ch
                .text
                .as_deref()
                .or(d.and_then(|d| d.content.as_deref()))
                .unwrap_or("");
            self.cur.text.push_str(piece);
            if d.and_then(|d| d.tool_calls)
                .is_some_and(|t| t.get() != "[]")
            {
                self.stop = Some("a tool call was in progress");
            }
            if d.and_then(|d| d.reasoning_content.as_deref())
                .is_some_and(|r| !r.is_empty())
            {
                self.stop = Some("reasoning was in progress");
            }
            if ch.finish_reason.is_some() {
                self.stop = Some("the answer was complete");
            }
            if !piece.is_empty() || ch.finish_reason.is_some() || d.is_none() {
                role_only = false;
            }
        }
        let usage_chunk = choices.is_empty() && c.usage.is_some();
        let show_usage = if usage_chunk {
            self.plan.client_usage || self.plan.client_continuous_usage
        } else {
            self.plan.client_continuous_usage
        };
        if usage_chunk && !show_usage {
            return Some(None);
        }
        if self.segment == 0 {
            return match c.usage {
                Some(u) if !show_usage => Some(without_member(data, u).or_else(|| {
                    let mut v: Value = serde_json::from_slice(data).ok()?;
                    v.as_object_mut()?.remove("usage");
                    serde_json::to_vec(&v).ok()
                })),
                _ => None,
            };
        }
        if role_only {
            // The continuation's opening chunk (its role): the client has had one.
            return Some(None);
        }
        let mut v: Value = serde_json::from_slice(data).ok()?;
        let o = v.as_object_mut()?;
        if let Some(id) = &self.id {
            o.insert("id".into(), id.clone().into());
        }
        if let Some(chs) = o.get_mut("choices").and_then(Value::as_array_mut) {
            for ch in chs {
                if let Some(d) = ch.get_mut("delta").and_then(Value::as_object_mut) {
                    d.remove("role");
                }
            }
        }
        if show_usage {
            if let (Some(u), Some(n)) =
                (o.get_mut("usage"), usage.and_then(|u| u.completion_tokens))
            {
                let total = n + self.base.completion_tokens;
                let prompt = self.prompt_tokens.unwrap_or(0);
                // The engine's usage object, with the counts of the whole answer.
                if let Some(u) = u.as_object_mut() {
                    u.insert("prompt_tokens".into(), prompt.into());
                    u.insert("completion_tokens".into(), total.into());
                    u.insert("total_tokens".into(), (prompt + total).into());
                }
            }
        } else {
            o.remove("usage");
        }
        Some(serde_json::to_vec(&v).ok())
    }

    /// What the client has received in all, for the follow-up; `Err` when the stream
    /// cannot be continued.
    pub fn sent(&mut self) -> Result<Sent, String> {
        if let Some(last) = self.last.take() {
            // Cumulative `/generate` before any move: the last event holds it all.
            self.generate_event(&last);
        }
        if let Some(why) = self.stop {
            return Err(why.to_string());
        }
        let mut s = self.base.clone();
        s.text.push_str(&self.cur.text);
        s.ids.extend_from_slice(&self.cur.ids);
        s.completion_tokens += self.cur.completion_tokens;
        Ok(s)
    }

    /// The next segment's decode streams `/generate` in `mode`.
    pub fn set_source_mode(&mut self, mode: GenerateMode) {
        self.mode = mode;
    }

    /// A move was made: what was sent so far is the base of the next segment.
    pub fn next_segment(&mut self, sent: Sent) {
        self.base = sent;
        self.cur = Sent::default();
        self.last = None;
        self.segment += 1;
    }
}

#[cfg(test)]
mod tests;
