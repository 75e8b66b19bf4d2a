//! Parsing a client's body into a [`ParsedRequest`]: the top-level object's members read
//! as raw values (no value parsed that pdgate does not touch), the prompt's shape checked
//! for its route, client-supplied PD fields set aside; anything else is a 400 decided
//! here, before any leg is sent.

use std::borrow::Cow;
use std::fmt;
use std::ops::Range;

use bytes::Bytes;
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

use super::*;
use crate::error::{FailReason, Failure};

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
        routing_key: None,
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
