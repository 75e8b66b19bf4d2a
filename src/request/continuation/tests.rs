//! Tests of the follow-up builder: which requests are refused and why (a table), and the
//! property that an answer cut after any token and continued with the follow-up is the
//! uninterrupted answer, token for token, against a model engine whose next token depends
//! on everything before it (as a language model's does).
use super::*;
use crate::request::parse;
use proptest::prelude::*;
use serde_json::{json, Value};

fn req(route: ApiRoute, body: Value) -> ParsedRequest {
    parse(route, Bytes::from(body.to_string())).expect("valid request")
}

#[test]
fn refusals_name_their_reason() {
    use ApiRoute::*;
    let cases: Vec<(ApiRoute, Value, &str)> = vec![
        (Generate, json!({"text": ["a", "b"]}), "batch"),
        (
            Generate,
            json!({"text": "a", "sampling_params": {"n": 2}}),
            "n > 1",
        ),
        (
            Generate,
            json!({"text": "a", "return_logprob": true}),
            "logprobs",
        ),
        (Generate, json!({"input_embeds": [[0.1]]}), "input_embeds"),
        (
            Generate,
            json!({"text": "a", "sampling_params": {"regex": "a+"}}),
            "constrained",
        ),
        (
            Generate,
            json!({"text": "a", "sampling_params": {"json_schema": "{}"}}),
            "constrained",
        ),
        (
            Generate,
            json!({"text": "a", "sampling_params": {"ebnf": "x"}}),
            "constrained",
        ),
        (
            ChatCompletions,
            json!({"messages": [{"role": "user", "content": "a"}], "n": 2}),
            "n > 1",
        ),
        (
            ChatCompletions,
            json!({"messages": [{"role": "user", "content": "a"}], "logprobs": true}),
            "logprobs",
        ),
        (
            ChatCompletions,
            json!({"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "json_object"}}),
            "constrained",
        ),
        (
            ChatCompletions,
            json!({"messages": [{"role": "user", "content": "a"}], "regex": "a"}),
            "constrained",
        ),
        (
            ChatCompletions,
            json!({"messages": [{"role": "user", "content": "a"}], "continue_final_message": true}),
            "own assistant",
        ),
        (
            Completions,
            json!({"prompt": "a", "logprobs": 2}),
            "logprobs",
        ),
        (Completions, json!({"prompt": "a", "echo": true}), "echo"),
        (Completions, json!({"prompt": [1, 2]}), "token-id"),
        (Completions, json!({"prompt": ["a", "b"]}), "batch"),
    ];
    for (route, body, why) in cases {
        let r = req(route, body.clone());
        match plan(&r) {
            Err(msg) => assert!(msg.contains(why), "{body}: {msg}"),
            Ok(p) => panic!("{body} planned as continuable: {p:?}"),
        }
    }
    let fine: Vec<(ApiRoute, Value, Option<u64>)> = vec![
        (Generate, json!({"text": "a"}), Some(128)),
        (
            Generate,
            json!({"text": "a", "sampling_params": {"max_new_tokens": 7, "regex": null}}),
            Some(7),
        ),
        (
            Completions,
            json!({"prompt": "a", "logprobs": null, "echo": false}),
            Some(16),
        ),
        (
            ChatCompletions,
            json!({"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "text"}, "logprobs": false}),
            None,
        ),
        (
            ChatCompletions,
            json!({"messages": [{"role": "user", "content": "a"}], "max_tokens": 9, "max_completion_tokens": 5}),
            Some(5),
        ),
    ];
    for (route, body, limit) in fine {
        let p = plan(&req(route, body.clone())).unwrap_or_else(|e| panic!("{body}: {e}"));
        assert_eq!(p.limit, limit, "{body}");
    }
}

#[test]
fn a_spent_limit_is_not_continued() {
    let r = req(
        ApiRoute::Generate,
        json!({"text": "a", "sampling_params": {"max_new_tokens": 3}}),
    );
    let p = plan(&r).unwrap();
    let sent = Sent {
        text: "x".into(),
        ids: vec![],
        completion_tokens: 3,
    };
    assert!(follow_up(&r, &p, &sent).is_err());
    let r = req(
        ApiRoute::Generate,
        json!({"input_ids": [1], "sampling_params": {"max_new_tokens": 3}}),
    );
    let p = plan(&r).unwrap();
    let sent = Sent {
        text: "x".into(),
        ids: vec![],
        completion_tokens: 1,
    };
    assert!(follow_up(&r, &p, &sent).is_err(), "ids route without ids");
}

/// A model engine: the next token is a function of the whole context so far.
fn next(ctx: &str) -> (String, i64) {
    let h = ctx.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let id = (h % 50_000) as i64 + 1;
    (format!(" t{}", h % 97), id)
}

fn ids_ctx(ids: &[i64]) -> String {
    ids.iter().map(|i| format!("{i},")).collect()
}

/// What the model engine answers to `body` on `route`: (text, ids, tokens).
fn engine(route: ApiRoute, body: &Value) -> (String, Vec<i64>, u64) {
    let limit = match route {
        ApiRoute::Generate => body["sampling_params"]["max_new_tokens"]
            .as_u64()
            .unwrap_or(128),
        ApiRoute::Completions => body["max_tokens"].as_u64().unwrap_or(16),
        ApiRoute::ChatCompletions => body["max_completion_tokens"]
            .as_u64()
            .or(body["max_tokens"].as_u64())
            .unwrap_or(1000),
    };
    let mut ids: Vec<i64> = body["input_ids"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_i64).collect())
        .unwrap_or_default();
    let by_ids = route == ApiRoute::Generate && body.get("input_ids").is_some();
    let mut ctx = match route {
        ApiRoute::Generate if by_ids => String::new(),
        ApiRoute::Generate => body["text"].as_str().unwrap_or("").to_string(),
        ApiRoute::Completions => body["prompt"].as_str().unwrap_or("").to_string(),
        ApiRoute::ChatCompletions => {
            let msgs = body["messages"].as_array().cloned().unwrap_or_default();
            let cont = body["continue_final_message"] == json!(true)
                && msgs.last().is_some_and(|m| m["role"] == "assistant");
            let (head, prefix) = if cont {
                let last = msgs
                    .last()
                    .and_then(|m| m["content"].as_str())
                    .unwrap_or("");
                (&msgs[..msgs.len() - 1], last.to_string())
            } else {
                (&msgs[..], String::new())
            };
            let mut s: String = head
                .iter()
                .map(|m| format!("<{}>{}\n", m["role"], m["content"]))
                .collect();
            s.push_str("<assistant>");
            s.push_str(&prefix);
            s
        }
    };
    let (mut text, mut out) = (String::new(), Vec::new());
    for _ in 0..limit {
        let (t, id) = if by_ids {
            next(&ids_ctx(&ids))
        } else {
            next(&ctx)
        };
        let t = if by_ids { format!(" i{id}") } else { t };
        ctx.push_str(&t);
        ids.push(id);
        text.push_str(&t);
        out.push(id);
    }
    (text, out, limit)
}

fn arb_text() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z ]{1,16}",
        prop::collection::vec(any::<char>(), 1..8).prop_map(String::from_iter),
        Just("quote \" back \\ nl \n é 😀".to_string()),
    ]
}

fn arb_extra() -> impl Strategy<Value = Vec<(String, Value)>> {
    prop::collection::vec(
        (
            prop::sample::select(vec![
                "model",
                "temperature",
                "stop",
                "user",
                "seed",
                "x_custom",
            ]),
            prop_oneof![
                Just(json!(0.5)),
                Just(json!(["\n\n", "x"])),
                arb_text().prop_map(Value::from),
                Just(json!({"nested": [1, {"a": null}]})),
            ],
        )
            .prop_map(|(k, v)| (k.to_string(), v)),
        0..4,
    )
}

/// A body for `route` with prompt, limit and extra members.
fn arb_body() -> impl Strategy<Value = (ApiRoute, Value, u64)> {
    let route = prop::sample::select(vec![
        (ApiRoute::Generate, false),
        (ApiRoute::Generate, true),
        (ApiRoute::Completions, false),
        (ApiRoute::ChatCompletions, false),
        (ApiRoute::ChatCompletions, true),
    ]);
    (
        route,
        arb_text(),
        prop::collection::vec(1i64..50_000, 1..6),
        prop::collection::vec(arb_text(), 1..4),
        1u64..24,
        arb_extra(),
        any::<bool>(),
    )
        .prop_map(|((route, alt), text, ids, turns, limit, extra, stream)| {
            let mut m = serde_json::Map::new();
            for (k, v) in extra {
                m.insert(k, v);
            }
            match route {
                ApiRoute::Generate if alt => {
                    m.insert("input_ids".into(), json!(ids));
                }
                ApiRoute::Generate => {
                    m.insert("text".into(), json!(text));
                }
                ApiRoute::Completions => {
                    m.insert("prompt".into(), json!(text));
                }
                ApiRoute::ChatCompletions => {
                    let msgs: Vec<Value> = turns
                        .iter()
                        .enumerate()
                        .map(|(i, t)| {
                            let role = if i % 2 == 0 { "user" } else { "assistant" };
                            json!({"role": role, "content": t})
                        })
                        .collect();
                    m.insert("messages".into(), Value::Array(msgs));
                }
            }
            match route {
                ApiRoute::Generate => {
                    m.insert(
                        "sampling_params".into(),
                        json!({"max_new_tokens": limit, "temperature": 0}),
                    );
                }
                ApiRoute::ChatCompletions if alt => {
                    m.insert("max_completion_tokens".into(), json!(limit));
                }
                _ => {
                    m.insert("max_tokens".into(), json!(limit));
                }
            }
            m.insert("stream".into(), json!(stream));
            (route, Value::Object(m), limit)
        })
}

proptest! {
    /// An answer cut after any number of tokens and continued with the follow-up is the
    /// uninterrupted answer: same text, same ids, exactly the asked number of tokens; the
    /// follow-up's limit is what was left; every member the builder does not own is kept.
    #[test]
    fn a_continued_answer_is_the_uninterrupted_one(
        (route, body, limit) in arb_body(),
        cut in any::<prop::sample::Index>(),
    ) {
        let r = req(route, body.clone());
        let p = plan(&r).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(p.limit, Some(limit));
        let (whole_text, whole_ids, whole_n) = engine(route, &body);
        prop_assert_eq!(whole_n, limit);
        let k = cut.index(limit as usize);
        // What the client received before the decode died: the first k tokens.
        let mut sent = Sent::default();
        let mut ctx_body = body.clone();
        if route == ApiRoute::Generate {
            ctx_body["sampling_params"]["max_new_tokens"] = json!(k);
        } else if ctx_body.get("max_completion_tokens").is_some() {
            ctx_body["max_completion_tokens"] = json!(k);
        } else {
            ctx_body["max_tokens"] = json!(k);
        }
        let (t, ids, n) = engine(route, &ctx_body);
        sent.text = t;
        sent.ids = ids;
        sent.completion_tokens = n;
        let fu = follow_up(&r, &p, &sent).map_err(|e| TestCaseError::fail(e.0))?;
        let fu_v: Value = serde_json::from_slice(&fu).map_err(|e| TestCaseError::fail(e.to_string()))?;
        // The follow-up parses as a client request of the same route, and is continuable.
        let fu_req = parse(route, fu.clone()).map_err(|e| TestCaseError::fail(e.message))?;
        prop_assert_eq!(fu_req.stream, r.stream);
        let (rest_text, rest_ids, rest_n) = engine(route, &fu_v);
        prop_assert_eq!(rest_n, limit - k as u64);
        prop_assert_eq!(format!("{}{}", sent.text, rest_text), whole_text);
        let mut all_ids = sent.ids.clone();
        all_ids.extend(rest_ids);
        prop_assert_eq!(all_ids, whole_ids);
        // Untouched members are byte-for-byte the same values.
        let owned = ["text", "input_ids", "prompt", "messages", "sampling_params", "max_tokens",
            "max_completion_tokens", "continue_final_message", "stream"];
        for (k, v) in body.as_object().into_iter().flatten() {
            // `/generate`'s `model` is pdgate's routing key, never sent to an engine.
            let routing = route == ApiRoute::Generate && k == "model";
            if !owned.contains(&k.as_str()) && !routing {
                prop_assert_eq!(&fu_v[k], v, "member {}", k);
            }
        }
        if route == ApiRoute::Generate {
            prop_assert_eq!(&fu_v["sampling_params"]["temperature"], &json!(0));
        }
    }
}
