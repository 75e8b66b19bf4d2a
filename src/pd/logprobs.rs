//! Merging the prefill's input logprobs into decode's answer (`/generate` with
//! `return_logprob`), as SGLang's routers do: the prefill's `input_token_logprobs`,
//! `input_top_logprobs` and `input_token_ids_logprobs` are prepended to decode's, per
//! item of a batch (by position, or by a stream chunk's `index`).

use serde_json::{Map, Value};

const KEYS: [&str; 3] = [
    "input_token_logprobs",
    "input_top_logprobs",
    "input_token_ids_logprobs",
];

/// The prefill's input logprobs, one map per item.
#[derive(Debug, Default)]
pub struct PrefillLogprobs {
    items: Vec<Map<String, Value>>,
}

impl PrefillLogprobs {
    pub fn from_prefill_body(body: &[u8]) -> PrefillLogprobs {
        let Ok(v) = serde_json::from_slice::<Value>(body) else {
            return PrefillLogprobs::default();
        };
        let list = match v {
            Value::Array(a) => a,
            other => vec![other],
        };
        let items = list
            .into_iter()
            .map(|mut it| {
                let mut m = Map::new();
                if let Some(meta) = it.get_mut("meta_info").and_then(Value::as_object_mut) {
                    for k in KEYS {
                        if let Some(v) = meta.remove(k) {
                            if v.is_array() {
                                m.insert(k.to_string(), v);
                            }
                        }
                    }
                }
                m
            })
            .collect();
        PrefillLogprobs { items }
    }

    pub fn is_empty(&self) -> bool {
        self.items.iter().all(Map::is_empty)
    }

    fn merge_item(&self, idx: usize, item: &mut Value) {
        let Some(src) = self.items.get(idx) else {
            return;
        };
        let Some(meta) = item.get_mut("meta_info").and_then(Value::as_object_mut) else {
            return;
        };
        for (k, pv) in src {
            let Some(p) = pv.as_array() else { continue };
            let mut merged = p.clone();
            if let Some(Value::Array(d)) = meta.get(k) {
                merged.extend(d.iter().cloned());
            }
            meta.insert(k.clone(), Value::Array(merged));
        }
    }

    /// Merges into a whole non-streamed answer (an object or a batch list).
    pub fn merge_answer(&self, body: &[u8]) -> Option<Vec<u8>> {
        let mut v: Value = serde_json::from_slice(body).ok()?;
        match &mut v {
            Value::Array(a) => a
                .iter_mut()
                .enumerate()
                .for_each(|(i, it)| self.merge_item(i, it)),
            other => self.merge_item(0, other),
        }
        serde_json::to_vec(&v).ok()
    }

    /// Merges into one stream chunk's JSON (its `index` picks the batch item).
    pub fn merge_chunk(&self, json: &[u8]) -> Option<Vec<u8>> {
        let mut v: Value = serde_json::from_slice(json).ok()?;
        let idx = v.get("index").and_then(Value::as_u64).unwrap_or(0) as usize;
        self.merge_item(idx, &mut v);
        serde_json::to_vec(&v).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_first_then_decode() {
        let p = PrefillLogprobs::from_prefill_body(
            br#"{"meta_info":{"input_token_logprobs":[[null,1,null],[-0.5,2,null]],"input_top_logprobs":[null,[]]}}"#,
        );
        assert!(!p.is_empty());
        let out = p
            .merge_answer(br#"{"text":"x","meta_info":{"input_token_logprobs":[[-1.0,3,null]],"output_token_logprobs":[[-0.1,9,null]]}}"#)
            .unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(
            v["meta_info"]["input_token_logprobs"],
            serde_json::json!([[null, 1, null], [-0.5, 2, null], [-1.0, 3, null]])
        );
        assert_eq!(
            v["meta_info"]["input_top_logprobs"],
            serde_json::json!([null, []])
        );
        assert_eq!(
            v["meta_info"]["output_token_logprobs"],
            serde_json::json!([[-0.1, 9, null]])
        );
    }

    #[test]
    fn batches_merge_by_position_and_index() {
        let p = PrefillLogprobs::from_prefill_body(
            br#"[{"meta_info":{"input_token_logprobs":[[null,1,null]]}},{"meta_info":{"input_token_logprobs":[[null,2,null]]}}]"#,
        );
        let out = p
            .merge_answer(br#"[{"meta_info":{}},{"meta_info":{"input_token_logprobs":[]}}]"#)
            .unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(
            v[1]["meta_info"]["input_token_logprobs"],
            serde_json::json!([[null, 2, null]])
        );
        let out = p.merge_chunk(br#"{"index":1,"meta_info":{}}"#).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(
            v["meta_info"]["input_token_logprobs"],
            serde_json::json!([[null, 2, null]])
        );
    }
}
