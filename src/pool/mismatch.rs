//! Layout mismatches between prefills and decodes: a decode that pairs with a prefill whose
//! page size or KV dtype differs would crash its scheduler (spec §7.1). Computed from the
//! facts the pool holds (the prefill's bootstrap layout, the decode's server info), by
//! whoever just learned one of them.

use super::Pool;

/// A prefill and a decode that disagree on a KV layout fact (page size or KV dtype): a
/// decode would crash its scheduler on such a pair (spec §7.1).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayoutMismatch {
    pub prefill: String,
    pub decode: String,
    /// `page_size` or `kv_cache_dtype`.
    pub what: &'static str,
    pub prefill_value: String,
    pub decode_value: String,
}

impl Pool {
    /// Every (prefill, decode) pair whose known layouts disagree. A fact one side has not
    /// reported yet is not compared.
    pub fn layout_mismatches(&self) -> Vec<LayoutMismatch> {
        let snap = self.load_full();
        let mut out = Vec::new();
        for p in &snap.prefills {
            let Some(layout) = &p.facts.layout else {
                continue;
            };
            for d in &snap.decodes {
                let Some(info) = &d.facts.info else {
                    continue;
                };
                let mut differ = |what, a: Option<String>, b: Option<String>| {
                    if let (Some(a), Some(b)) = (a, b) {
                        if a != b {
                            out.push(LayoutMismatch {
                                prefill: p.shared.url.to_string(),
                                decode: d.shared.url.to_string(),
                                what,
                                prefill_value: a,
                                decode_value: b,
                            });
                        }
                    }
                };
                let page = |v: Option<u64>| v.map(|v| v.to_string());
                differ("page_size", page(layout.page_size), page(info.page_size));
                differ(
                    "kv_cache_dtype",
                    layout.kv_cache_dtype.clone(),
                    info.kv_cache_dtype.clone(),
                );
            }
        }
        out
    }

    /// Logs every layout mismatch and sets the `pdgate_layout_mismatches` gauge (called as
    /// layouts and engine facts are learned).
    pub fn warn_mismatches(&self) {
        let found = self.layout_mismatches();
        metrics::gauge!(crate::telemetry::LAYOUT_MISMATCHES).set(found.len() as f64);
        for m in &found {
            tracing::warn!(prefill = %m.prefill, decode = %m.decode, prefill_value = %m.prefill_value, decode_value = %m.decode_value, "{} differs between prefill and decode", m.what);
        }
    }
}
