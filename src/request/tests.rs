//! Unit tests of the request parser and leg writer (kept apart: `request.rs` stays short).

use super::*;
use crate::error::FailReason;
use serde_json::Value;

fn leg(
    req: &ParsedRequest,
    rooms: &[u64],
    routed: Option<u32>,
    hint: Option<u32>,
    stream: bool,
) -> Value {
    let mut out = Vec::new();
    req.write_leg(
        &mut out,
        &LegFields {
            host_json: "\"10.0.0.1\"",
            port: 8998,
            rooms,
            rid: "pdg-0123456789abcdef-00p",
            routed_dp_rank: routed,
            disagg_prefill_dp_rank: hint,
            stream,
        },
    );
    serde_json::from_slice(&out).unwrap()
}

/// A non-streamed leg with host `h`, port 1, room 5, rid `r` and no DP fields.
pub(super) fn simple_leg(req: &ParsedRequest) -> Vec<u8> {
    let mut out = Vec::new();
    req.write_leg(
        &mut out,
        &LegFields {
            host_json: "\"h\"",
            port: 1,
            rooms: &[5],
            rid: "r",
            routed_dp_rank: None,
            disagg_prefill_dp_rank: None,
            stream: false,
        },
    );
    out
}

#[test]
fn untouched_fields_are_forwarded_byte_for_byte() {
    let body = r#"{"text":"hi","sampling_params":{"temperature":0.10000000000000001,"max_new_tokens":3},"extra":[1, 2 ,{"a":"\u00e9"}],"bootstrap_host":"evil","routed_dp_rank":7}"#;
    let req = parse(ApiRoute::Generate, Bytes::from(body)).unwrap();
    assert_eq!(req.replaced, vec!["bootstrap_host", "routed_dp_rank"]);
    let out = simple_leg(&req);
    let s = String::from_utf8(out).unwrap();
    assert!(
        s.contains(r#""sampling_params":{"temperature":0.10000000000000001,"max_new_tokens":3}"#),
        "{s}"
    );
    assert!(s.contains(r#""extra":[1, 2 ,{"a":"\u00e9"}]"#), "{s}");
    assert!(!s.contains("evil") && !s.contains(":7"), "{s}");
    let v: Value = serde_json::from_str(&s).unwrap();
    assert_eq!(v["bootstrap_host"], "h");
    assert_eq!(v["bootstrap_room"], 5);
    assert_eq!(v["stream"], false);
}

#[test]
fn write_legs_matches_write_leg_for_each_leg() {
    let cases: &[(ApiRoute, &str, &[u64])] = &[
        (
            ApiRoute::Generate,
            r#"{"text":"hi","sampling_params":{"max_new_tokens":3}}"#,
            &[4],
        ),
        (
            ApiRoute::Generate,
            r#"{"text":["a","b"],"rid":"x"}"#,
            &[2, 6],
        ),
        (
            ApiRoute::ChatCompletions,
            r#"{"messages":[{"role":"user","content":"q"}],"n":3,"stream":true}"#,
            &[1, 3, 5],
        ),
        (ApiRoute::Completions, r#"{"prompt":"p","k\"q":1}"#, &[7]),
    ];
    let fields = |rid, routed, hint, stream, rooms| LegFields {
        host_json: "\"10.0.0.1\"",
        port: 8998,
        rooms,
        rid,
        routed_dp_rank: routed,
        disagg_prefill_dp_rank: hint,
        stream,
    };
    for (route, body, rooms) in cases {
        let req = parse(*route, Bytes::from(*body)).unwrap();
        for (routed_p, routed_d, hint) in [(None, None, None), (Some(1), Some(2), Some(1))] {
            let p = fields("pdg-1-00p", routed_p, hint, false, rooms);
            let d = fields("pdg-1-00d", routed_d, hint, req.stream, rooms);
            let (pb, db) = req.write_legs(&p, &d);
            let (pb, db) = (pb.to_vec(), db.to_vec());
            let (mut p1, mut d1) = (Vec::new(), Vec::new());
            req.write_leg(&mut p1, &p);
            req.write_leg(&mut d1, &d);
            assert_eq!(pb, p1, "{body}");
            assert_eq!(db, d1, "{body}");
            // Different bootstrap fields per leg are still written as asked.
            let other = fields("pdg-1-00d", routed_d, hint, false, &[99]);
            let db2 = req.write_legs(&p, &other).1.to_vec();
            let mut d2 = Vec::new();
            req.write_leg(&mut d2, &other);
            assert_eq!(db2, d2, "{body}");
        }
    }
}

#[test]
fn keys_with_and_without_escapes_are_written_as_valid_json() {
    // Whitespace around keys, an escaped key, a key with a non-ASCII char, an escaped
    // key that means a PD key (still replaced).
    let body = "{ \"text\" : \"hi\" ,\n\"k\\\"q\":1,\"\u{e9}t\u{e9}\":2,\"a\\u0062\":3,\"bootstrap\\u005froom\":9}";
    let req = parse(ApiRoute::Generate, Bytes::from(body)).unwrap();
    assert_eq!(req.replaced, vec!["bootstrap_room"]);
    let out = simple_leg(&req);
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["text"], "hi");
    assert_eq!(v["k\"q"], 1);
    assert_eq!(v["\u{e9}t\u{e9}"], 2);
    assert_eq!(v["ab"], 3);
    assert_eq!(v["bootstrap_room"], 5);
}

#[test]
fn batch_and_n_detection() {
    let cases: &[(ApiRoute, &str, Option<usize>, u32)] = &[
        (ApiRoute::Generate, r#"{"text":"a"}"#, None, 1),
        (ApiRoute::Generate, r#"{"text":["a","b"]}"#, Some(2), 1),
        (ApiRoute::Generate, r#"{"input_ids":[1,2,3]}"#, None, 1),
        (
            ApiRoute::Generate,
            r#"{"input_ids":[[1],[2],[3]]}"#,
            Some(3),
            1,
        ),
        (
            ApiRoute::Generate,
            r#"{"text":"a","sampling_params":{"n":3}}"#,
            None,
            3,
        ),
        (
            ApiRoute::Generate,
            r#"{"text":["a","b"],"sampling_params":[{"n":2},{"n":2}]}"#,
            Some(2),
            2,
        ),
        (ApiRoute::Completions, r#"{"prompt":"a","n":2}"#, None, 2),
        (
            ApiRoute::Completions,
            r#"{"prompt":["a","b","c"]}"#,
            Some(3),
            1,
        ),
        (ApiRoute::Completions, r#"{"prompt":[1,2]}"#, None, 1),
        (ApiRoute::Completions, r#"{"prompt":[[1],[2]]}"#, Some(2), 1),
        (
            ApiRoute::ChatCompletions,
            r#"{"messages":[{"role":"user","content":"x"}],"n":4}"#,
            None,
            4,
        ),
    ];
    for (route, body, batch, n) in cases {
        let r = parse(*route, Bytes::from(*body)).unwrap_or_else(|e| panic!("{body}: {e}"));
        assert_eq!((r.batch, r.n), (*batch, *n), "{body}");
    }
}

#[test]
fn multi_instance_legs_get_full_lists() {
    let req = parse(
        ApiRoute::Generate,
        Bytes::from(r#"{"text":["a","b"],"sampling_params":{"n":2}}"#),
    )
    .unwrap();
    assert_eq!(req.instances(), 4);
    let v = leg(&req, &[2, 4, 6, 8], Some(0), Some(0), true);
    assert_eq!(v["bootstrap_room"], serde_json::json!([2, 4, 6, 8]));
    assert_eq!(v["bootstrap_host"].as_array().unwrap().len(), 4);
    assert_eq!(
        v["bootstrap_port"],
        serde_json::json!([8998, 8998, 8998, 8998])
    );
    assert_eq!(v["routed_dp_rank"], 0);
    assert_eq!(v["disagg_prefill_dp_rank"], 0);
    assert_eq!(v["stream"], true);
}

#[test]
fn bad_input_table() {
    let cases: &[(ApiRoute, &[u8], &str)] = &[
        (ApiRoute::Generate, b"not json", "not valid JSON"),
        (ApiRoute::Generate, b"[1,2]", "JSON object"),
        (ApiRoute::Generate, b"\"s\"", "JSON object"),
        (ApiRoute::Generate, b"{\"text\":\"\xff\"}", "UTF-8"),
        (ApiRoute::Generate, b"{}", "no prompt"),
        (ApiRoute::Generate, br#"{"text":1}"#, "'text'"),
        (ApiRoute::Generate, br#"{"text":[]}"#, "empty"),
        (ApiRoute::Generate, br#"{"input_ids":[]}"#, "empty"),
        (
            ApiRoute::Generate,
            br#"{"text":"a","input_ids":[1]}"#,
            "only one",
        ),
        (
            ApiRoute::Generate,
            br#"{"text":"a","stream":"yes"}"#,
            "'stream'",
        ),
        (
            ApiRoute::Generate,
            br#"{"text":"a","sampling_params":{"n":0}}"#,
            "sampling_params.n",
        ),
        (
            ApiRoute::Generate,
            br#"{"text":"a","sampling_params":5}"#,
            "sampling_params",
        ),
        (
            ApiRoute::Generate,
            br#"{"text":"a","return_logprob":"x"}"#,
            "return_logprob",
        ),
        (
            ApiRoute::ChatCompletions,
            br#"{"model":"m"}"#,
            "'messages' is required",
        ),
        (ApiRoute::ChatCompletions, br#"{"messages":[]}"#, "empty"),
        (ApiRoute::ChatCompletions, br#"{"messages":{}}"#, "list"),
        (
            ApiRoute::ChatCompletions,
            br#"{"messages":[{}],"n":-1}"#,
            "'n'",
        ),
        (
            ApiRoute::Completions,
            br#"{"model":"m"}"#,
            "'prompt' is required",
        ),
        (ApiRoute::Completions, br#"{"prompt":[{}]}"#, "'prompt'"),
    ];
    for (route, body, want) in cases {
        let e =
            parse(*route, Bytes::copy_from_slice(body)).expect_err(&String::from_utf8_lossy(body));
        assert_eq!(e.reason, FailReason::InvalidRequest);
        assert!(
            e.message.contains(want),
            "{}: {}",
            String::from_utf8_lossy(body),
            e.message
        );
    }
}

#[test]
fn prefix_keys_are_stable_across_turns() {
    let key = |route, body: &str| {
        parse(route, Bytes::from(body.to_string()))
            .unwrap()
            .prefix_hash()
            .unwrap()
    };
    let t1 = key(
        ApiRoute::ChatCompletions,
        r#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":"hi"}]}"#,
    );
    let t2 = key(
        ApiRoute::ChatCompletions,
        r#"{"model":"m","messages":[{"role":"system","content":"S"},{"role":"user","content":"hi"},{"role":"assistant","content":"yo"},{"role":"user","content":"more"}]}"#,
    );
    let other = key(
        ApiRoute::ChatCompletions,
        r#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":"bye"}]}"#,
    );
    assert_eq!(t1, t2);
    assert_ne!(t1, other);
    let long = "x".repeat(1000);
    let a = key(ApiRoute::Completions, &format!(r#"{{"prompt":"{long}"}}"#));
    let b = key(
        ApiRoute::Completions,
        &format!(r#"{{"prompt":"{long} and more","max_tokens":3}}"#),
    );
    assert_eq!(a, b);
    assert_ne!(
        key(ApiRoute::Generate, r#"{"text":"a"}"#),
        key(ApiRoute::Generate, r#"{"text":"b"}"#)
    );
    assert_eq!(fnv1a(b"a"), 0xaf63dc4c8601ec8c, "FNV-1a must never change");
}

#[test]
fn digits() {
    for v in [0u64, 7, 10, 12345, u64::MAX] {
        let mut out = Vec::new();
        push_u64(&mut out, v);
        assert_eq!(String::from_utf8(out).unwrap(), v.to_string());
    }
}

/// Issue 18's reproduction of the "3x the body": both legs were written as copies of the
/// body (a request held its body three times). Now each leg is pieces of the one body the
/// request holds, plus pdgate's own fields: a 1 MiB prompt is copied into neither leg.
#[test]
fn legs_point_into_the_body_and_copy_only_pdgate_fields() {
    let prompt = "a".repeat(1 << 20);
    let bodies = [
        format!(
            r#"{{"text":"{prompt}","sampling_params":{{"max_new_tokens":1}},"stream":true,"rid":"x","extra":1}}"#
        ),
        format!("{{ \"rid\" : 1 ,\n \"text\" : \"{prompt}\" , \"k\\\"q\": 2 }}"),
    ];
    for text in bodies {
        let body = Bytes::from(text);
        let req = parse(ApiRoute::Generate, body.clone()).unwrap();
        let f = |rid| LegFields {
            host_json: "\"10.0.0.1\"",
            port: 8998,
            rooms: &[3],
            rid,
            routed_dp_rank: Some(1),
            disagg_prefill_dp_rank: Some(1),
            stream: false,
        };
        let (p, d) = req.write_legs(&f("p"), &f("d"));
        let inside = body.as_ptr() as usize..body.as_ptr() as usize + body.len();
        for leg in [&p, &d] {
            let from_body: usize = leg
                .slices()
                .filter(|s| inside.contains(&(s.as_ptr() as usize)))
                .map(<[u8]>::len)
                .sum();
            assert!(
                from_body > 1 << 20,
                "the prompt is written from the body itself"
            );
            assert!(
                leg.copied() < 256,
                "only pdgate's fields are copied: {}",
                leg.copied()
            );
            assert!(
                leg.pieces() <= 8,
                "a few slices per write: {}",
                leg.pieces()
            );
            let v: Value = serde_json::from_slice(&leg.to_vec()).unwrap();
            assert_eq!(v["text"].as_str().map(str::len), Some(1 << 20));
            assert_eq!(v["bootstrap_room"], 3);
        }
    }
}

/// `model` is read as the client wrote it (escapes undone); a string is not sent on
/// `/generate` legs (SGLang's `/generate` has no such field); OpenAI legs keep it; a value
/// that is not a string names no model and is forwarded as before.
#[test]
fn model_is_read_and_kept_only_on_openai_legs() {
    let chat = parse(
        ApiRoute::ChatCompletions,
        Bytes::from_static(br#"{"model":"a\/b:lora","messages":[{"role":"user","content":"x"}]}"#),
    )
    .expect("parses");
    assert_eq!(chat.model().as_deref(), Some("a/b:lora"));
    assert!(chat.members().any(|(k, _)| k == "model"));
    let generate = parse(
        ApiRoute::Generate,
        Bytes::from_static(br#"{"text":"x","model":"m-a"}"#),
    )
    .expect("parses");
    assert_eq!(generate.model().as_deref(), Some("m-a"));
    assert!(generate.members().all(|(k, _)| k != "model"));
    for odd in [
        &br#"{"text":"x","model":null}"#[..],
        br#"{"text":"x","model":7}"#,
    ] {
        let r = parse(ApiRoute::Generate, Bytes::copy_from_slice(odd)).expect("parses");
        assert_eq!(r.model(), None);
        assert!(r.members().any(|(k, _)| k == "model"));
    }
}
