//! The merge, against the tree-based merge it replaces (kept here as the reference: the
//! prefill's arrays first, then decode's, per item), on a table and on generated answers.

use super::*;
use proptest::prelude::*;
use serde_json::{json, Map, Value};

/// The reference: parse both into trees and prepend (what `relay/logprobs.rs` did before).
fn reference(prefill: &Value, decode: &Value, idx: Option<usize>) -> Value {
    let items = |v: &Value| match v {
        Value::Array(a) => a.clone(),
        other => vec![other.clone()],
    };
    let p = items(prefill);
    let merge = |i: usize, item: &mut Value| {
        let Some(src) = p
            .get(i)
            .and_then(|s| s.get("meta_info"))
            .and_then(Value::as_object)
        else {
            return;
        };
        let Some(meta) = item.get_mut("meta_info").and_then(Value::as_object_mut) else {
            return;
        };
        for k in KEYS {
            let Some(Value::Array(pv)) = src.get(k) else {
                continue;
            };
            let mut merged = pv.clone();
            if let Some(Value::Array(d)) = meta.get(k) {
                merged.extend(d.iter().cloned());
            }
            meta.insert(k.to_string(), Value::Array(merged));
        }
    };
    let mut out = decode.clone();
    match (idx, &mut out) {
        (Some(i), v) => merge(i, v),
        (None, Value::Array(a)) => a.iter_mut().enumerate().for_each(|(i, it)| merge(i, it)),
        (None, v) => merge(0, v),
    }
    out
}

fn lp(prefill: &str) -> PrefillLogprobs {
    PrefillLogprobs::from_prefill_body(&Bytes::from(prefill.to_string()), Charge::none())
}

#[test]
fn prefill_first_then_decode() {
    let p = r#"{"meta_info":{"input_token_logprobs":[[null,1,null],[-0.5,2,null]],"input_top_logprobs":[null,[]]}}"#;
    let cases = [
        r#"{"text":"x","meta_info":{"input_token_logprobs":[[-1.0,3,null]],"output_token_logprobs":[[-0.1,9,null]]}}"#,
        r#"{"text":"x","meta_info":{}}"#,
        r#"{"text":"x","meta_info":{"input_token_logprobs":[], "input_top_logprobs" : null}}"#,
        r#"{"text":"x"}"#,
        r#"{ "meta_info" : { "a" : 1 , "input_token_ids_logprobs":[1]} , "z":2 }"#,
    ];
    let lp = lp(p);
    assert!(!lp.is_empty());
    let pv: Value = serde_json::from_str(p).unwrap();
    for d in cases {
        let out = lp.merge_answer(d.as_bytes()).unwrap();
        let got: Value = serde_json::from_slice(&out)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out)));
        let dv: Value = serde_json::from_str(d).unwrap();
        assert_eq!(got, reference(&pv, &dv, None), "{d}");
    }
}

#[test]
fn batches_merge_by_position_and_index() {
    let p = r#"[{"meta_info":{"input_token_logprobs":[[null,1,null]]}},{"meta_info":{"input_token_logprobs":[[null,2,null]]}}]"#;
    let lp = lp(p);
    let out = lp
        .merge_answer(br#"[{"meta_info":{}},{"meta_info":{"input_token_logprobs":[]}}]"#)
        .unwrap();
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(
        v[1]["meta_info"]["input_token_logprobs"],
        json!([[null, 2, null]])
    );
    let out = lp.merge_chunk(br#"{"index":1,"meta_info":{}}"#).unwrap();
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(
        v["meta_info"]["input_token_logprobs"],
        json!([[null, 2, null]])
    );
    // Not an object: nothing merged, the caller forwards the event as it was.
    assert!(lp.merge_chunk(b"[DONE]").is_none());
}

/// The prefill's arrays are kept as slices of its answer (no copy), and counted.
#[test]
fn arrays_point_into_the_prefill_answer() {
    let body =
        Bytes::from_static(br#"{"meta_info":{"input_token_logprobs":[ [null,1,null] ],"x":[1]}}"#);
    let lp = PrefillLogprobs::from_prefill_body(&body, Charge::none());
    let arr = lp.items[0][0].as_ref().unwrap();
    assert_eq!(&arr[..], b"[null,1,null]");
    let base = body.as_ptr() as usize;
    assert!((base..base + body.len()).contains(&(arr.as_ptr() as usize)));
    assert_eq!(lp.bytes(), arr.len());
}

fn arb_logprob() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        // Eighths: exact in binary, so the tree's float round trip keeps them (the splice
        // keeps any number as decode and the prefill wrote it).
        (-40i32..0, 0u32..1000).prop_map(|(l, t)| json!([f64::from(l) / 8.0, t, null])),
        Just(json!([])),
    ]
}

fn arb_meta() -> impl Strategy<Value = Value> {
    (
        proptest::option::of(proptest::collection::vec(arb_logprob(), 0..4)),
        proptest::option::of(proptest::collection::vec(arb_logprob(), 0..3)),
        proptest::option::of(prop_oneof![Just(Value::Null), Just(json!(7))]),
        any::<bool>(),
    )
        .prop_map(|(a, b, odd, extra)| {
            let mut m = Map::new();
            if extra {
                m.insert("output_token_logprobs".into(), json!([[-0.1, 1, null]]));
            }
            if let Some(a) = a {
                m.insert(KEYS[0].into(), Value::Array(a));
            }
            if let Some(b) = b {
                m.insert(KEYS[1].into(), Value::Array(b));
            }
            if let Some(o) = odd {
                m.insert(KEYS[2].into(), o);
            }
            json!({"text": "t", "meta_info": Value::Object(m)})
        })
}

proptest! {
    /// Splicing bytes gives the same JSON as merging trees, for objects, batches and
    /// chunks, compact or pretty-printed.
    #[test]
    fn splice_equals_tree_merge(
        p in proptest::collection::vec(arb_meta(), 1..3),
        d in proptest::collection::vec(arb_meta(), 1..3),
        pretty in any::<bool>(),
        idx in 0usize..3,
    ) {
        let enc = |v: &Value| if pretty { serde_json::to_string_pretty(v).unwrap() } else { v.to_string() };
        let pv = if p.len() == 1 { p[0].clone() } else { Value::Array(p) };
        let dv = if d.len() == 1 { d[0].clone() } else { Value::Array(d.clone()) };
        let lp = lp(&enc(&pv));
        let out = lp.merge_answer(enc(&dv).as_bytes()).unwrap();
        let got: Value = serde_json::from_slice(&out).map_err(|e| TestCaseError::fail(format!("{e}: {}", String::from_utf8_lossy(&out))))?;
        prop_assert_eq!(got, reference(&pv, &dv, None));
        let mut chunk = d[0].clone();
        chunk["index"] = json!(idx);
        let out = lp.merge_chunk(enc(&chunk).as_bytes()).unwrap();
        let got: Value = serde_json::from_slice(&out).unwrap();
        prop_assert_eq!(got, reference(&pv, &chunk, Some(idx)));
    }
}

/// Table: what the one walk of a prefill answer finds, item by item (the arrays' inner
/// bytes), for answers of every shape: non-object items and `meta_info`s, nested and
/// repeated keys, invalid JSON.
#[test]
fn the_prefill_answer_is_read_in_one_walk_whatever_its_shape() {
    let t = |s: &str| Some(s.to_string());
    let table: &[(&str, Vec<[Option<String>; 3]>)] = &[
        (r#"{"meta_info": null}"#, vec![[None, None, None]]),
        (r#"{"text":"a","meta_info":7}"#, vec![[None, None, None]]),
        (
            r#"[1, "x", {"meta_info":{"input_token_logprobs":[[1,2,null]]}}, [3], null]"#,
            vec![
                [None, None, None],
                [None, None, None],
                [t("[1,2,null]"), None, None],
                [None, None, None],
                [None, None, None],
            ],
        ),
        (
            r#"{"meta_info":{"input_token_logprobs":5,"input_top_logprobs":[ 1 , 2 ]}}"#,
            vec![[None, t("1 , 2"), None]],
        ),
        (
            r#"{"a":[{"meta_info":{"input_token_logprobs":[1]}}],"b":{"meta_info":{"input_token_logprobs":[9]}},"meta_info":{"input_token_ids_logprobs":[2]}}"#,
            vec![[None, None, t("2")]],
        ),
        (
            r#"{"meta_info":{"input_token_logprobs":[1]},"meta_info":{"input_token_logprobs":[2]}}"#,
            vec![[t("1"), None, None]],
        ),
        (
            r#"{"meta_info":[1],"meta_info":{"input_token_logprobs":[2]}}"#,
            vec![[None, None, None]],
        ),
        (r#"{"meta_info":{"input_token_logprobs":[1]}"#, vec![]),
        (r#"{"meta_info":{"input_token_logprobs":[1]}} x"#, vec![]),
        (r#""str""#, vec![]),
        ("", vec![]),
    ];
    for (body, want) in table {
        let got = lp(body);
        let got: Vec<[Option<String>; 3]> = got
            .items
            .iter()
            .map(|a| {
                a.clone()
                    .map(|b| b.map(|b| String::from_utf8_lossy(&b).into_owned()))
            })
            .collect();
        assert_eq!(&got, want, "{body}");
    }
}
