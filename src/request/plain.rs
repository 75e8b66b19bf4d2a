//! What a regular (non-PD) worker is sent, and the prompt length the short-prompt bypass
//! reads (`dispatch::regular`).
//!
//! A regular worker gets the client's body as it came, minus what pdgate strips from
//! every request (the client's bootstrap and disaggregation fields, `stream`, the routing
//! `model` of `/generate`), plus pdgate's `rid`, `stream` and, on a DP engine, the DP rank
//! picked. The leg overrides apply as on a PD leg: `model` (an alias's served name) and a
//! continuable stream's `stream_options` (per-chunk usage, counted by the mover and hidden
//! from a client that did not ask: a regular stream moves like a PD one, `dispatch::moves`).

use super::{push_key, ParsedRequest};
use crate::upstream::Payload;

impl ParsedRequest {
    /// A regular worker's body: the client's members, then `rid`, the DP rank and `stream`.
    pub fn write_plain(&self, rid: &str, routed_dp_rank: Option<u32>) -> Payload {
        let mut out = self.pieces_skipping(|_| true);
        let stream = self.stream;
        out.own(|o| {
            self.push_overrides(o, |_| true);
            push_key(o, "rid");
            o.push(b'"');
            o.extend_from_slice(rid.as_bytes());
            o.push(b'"');
            if let Some(r) = routed_dp_rank {
                push_key(o, ",routed_dp_rank");
                o.extend_from_slice(r.to_string().as_bytes());
            }
            push_key(o, ",stream");
            o.extend_from_slice(if stream { b"true" } else { b"false" });
            o.push(b'}');
        });
        out
    }

    /// The prompt's length in tokens, for the short-prompt bypass: exact for a list of
    /// token ids (`input_ids`, or a `prompt` of ids; a batch counts all its ids), else
    /// estimated as one token per [`super::size::BYTES_PER_TOKEN`] bytes of the prompt's
    /// raw JSON (text, or chat messages with their JSON punctuation): no tokenizer runs on
    /// the request path.
    pub fn prompt_tokens(&self) -> u64 {
        let Some(r) = self.prompt.clone() else {
            return 0;
        };
        let raw = &self.body[r];
        if let Some(ids) = count_ids(raw) {
            return ids;
        }
        (raw.len() as u64).div_ceil(super::size::BYTES_PER_TOKEN)
    }
}

/// The number of integers in `raw` when it is a list (or list of lists) of integers only.
fn count_ids(raw: &[u8]) -> Option<u64> {
    let first = raw
        .iter()
        .copied()
        .find(|c| !c.is_ascii_whitespace() && *c != b'[')?;
    if raw.first() != Some(&b'[') || !(first.is_ascii_digit() || first == b'-' || first == b']') {
        return None;
    }
    let mut n = 0u64;
    let mut in_num = false;
    for &c in raw {
        match c {
            b'0'..=b'9' | b'-' => {
                if !in_num {
                    n += 1;
                    in_num = true;
                }
            }
            b'[' | b']' | b',' | b' ' | b'\n' | b'\r' | b'\t' => in_num = false,
            // A float, a string, an object: not token ids.
            _ => return None,
        }
    }
    Some(n)
}

#[cfg(test)]
mod tests {
    use super::count_ids;
    use crate::request::{parse, ApiRoute};
    use bytes::Bytes;

    #[test]
    fn prompt_tokens_are_exact_for_ids_and_estimated_for_text() {
        let cases: &[(ApiRoute, &str, u64)] = &[
            (ApiRoute::Generate, r#"{"input_ids":[1,2,3,40000]}"#, 4),
            (ApiRoute::Generate, r#"{"input_ids":[[1,2],[3]]}"#, 3),
            (ApiRoute::Completions, r#"{"prompt":[7, 8, -1]}"#, 3),
            // "abcdefgh" with its quotes: 10 bytes → 3 tokens.
            (ApiRoute::Generate, r#"{"text":"abcdefgh"}"#, 3),
            (ApiRoute::Completions, r#"{"prompt":"abcd"}"#, 2),
            (
                ApiRoute::ChatCompletions,
                r#"{"messages":[{"role":"user","content":"hi"}]}"#,
                8,
            ),
        ];
        for (route, body, want) in cases {
            let req = parse(*route, Bytes::from_static(body.as_bytes())).unwrap();
            assert_eq!(req.prompt_tokens(), *want, "{body}");
        }
        assert_eq!(count_ids(b"[0.5, 1.5]"), None);
        assert_eq!(count_ids(b"[]"), Some(0));
        assert_eq!(count_ids(b"\"12\""), None);
    }

    #[test]
    fn the_plain_body_drops_pd_fields_and_keeps_the_clients_members() {
        let body = r#"{"text":"hi","bootstrap_room":5,"bootstrap_host":"x","stream":true,"sampling_params":{"max_new_tokens":3}}"#;
        let req = parse(ApiRoute::Generate, Bytes::from_static(body.as_bytes())).unwrap();
        let out = req.write_plain("pdg-1", Some(2)).to_vec();
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"text":"hi","sampling_params":{"max_new_tokens":3},
                "rid":"pdg-1","routed_dp_rank":2,"stream":true})
        );
    }

    #[test]
    fn leg_overrides_replace_the_clients_members_on_the_plain_leg() {
        let body = r#"{"model":"alias","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":false}}"#;
        let mut req = parse(
            ApiRoute::ChatCompletions,
            Bytes::from_static(body.as_bytes()),
        )
        .unwrap();
        req.override_on_legs("model", r#""served""#.into());
        req.override_on_legs(
            "stream_options",
            r#"{"include_usage":true,"continuous_usage_stats":true}"#.into(),
        );
        let out = req.write_plain("pdg-2", None).to_vec();
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"messages":[{"role":"user","content":"hi"}],"model":"served",
                "stream_options":{"include_usage":true,"continuous_usage_stats":true},
                "rid":"pdg-2","stream":true})
        );
    }
}
