//! Property: stage 1 never pairs incompatible handoff groups, whatever the fleet (models, page
//! sizes, health) and whatever the request's model; within its model when it names one;
//! and it finds a pair whenever one exists.

use std::sync::Arc;

use proptest::prelude::*;

use crate::config::Config;
use crate::dispatch::{Dispatcher, RngSource};
use crate::engine::{Generation, Layout, ServerInfo};
use crate::pool::{BootstrapInfo, Pool, RankReadiness};
use crate::request::{self, ApiRoute};
use crate::types::Role;
use crate::upstream::{parse_base_url, Upstream, UpstreamSettings};

/// The engines' reports: (served name, page size). Two groups share `m0`.
const KEYS: [(&str, u64); 3] = [("m0", 1), ("m0", 16), ("m1", 1)];

fn fleet(prefills: &[(usize, bool)], decodes: &[(usize, bool)]) -> Arc<Pool> {
    let pool = Arc::new(Pool::new());
    for (role, list) in [(Role::Prefill, prefills), (Role::Decode, decodes)] {
        for (i, (key, healthy)) in list.iter().enumerate() {
            let port = if role == Role::Prefill { 30000 } else { 31000 } + i as u16;
            let url = parse_base_url(&format!("http://127.0.0.1:{port}")).expect("url");
            let id = pool.add_worker(role, url.clone(), None);
            let (name, page) = KEYS[*key % KEYS.len()];
            pool.update_worker(role, id, |w| {
                w.facts.healthy = *healthy;
                w.facts.info = Some(
                    ServerInfo {
                        served_model_name: Some(name.into()),
                        page_size: Some(page),
                        ..ServerInfo::default()
                    }
                    .into(),
                );
                if role == Role::Prefill {
                    w.facts.bootstrap = Some(BootstrapInfo {
                        url,
                        host_json: "\"127.0.0.1\"".into(),
                        port: 8998,
                    });
                    w.facts.layout = Some(Layout {
                        generation: Generation::V3,
                        dp_size: 1,
                        attn_tp_size: 1,
                        attn_cp_size: 1,
                        pp_size: 1,
                        follow_bootstrap_room: true,
                        page_size: Some(page),
                        kv_cache_dtype: None,
                    });
                    w.facts.ranks = vec![RankReadiness::Ready];
                }
            });
        }
    }
    pool
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]
    #[test]
    fn pairs_stay_within_one_group_and_model(
        prefills in proptest::collection::vec((0usize..3, any::<bool>()), 0..6),
        decodes in proptest::collection::vec((0usize..3, any::<bool>()), 0..6),
        scope in proptest::option::of(prop::sample::select(vec!["m0", "m1", "m9"])),
        seed: u64,
    ) {
        let pool = fleet(&prefills, &decodes);
        let cfg = Config::default();
        // Never used: stage 1 sends nothing.
        let up = Upstream::new(&UpstreamSettings {
            connect_timeout: std::time::Duration::from_millis(100),
            pool_max_idle_per_host: 1,
            pool_idle_timeout: std::time::Duration::from_secs(1),
            api_key: None,
            forward_authorization: false,
        });
        let d = Dispatcher::new(pool.clone(), up, Arc::new(cfg), RngSource::Seeded(seed.into()));
        let mut req = request::parse(
            ApiRoute::ChatCompletions,
            bytes::Bytes::from_static(br#"{"messages":[{"role":"user","content":"hi"}]}"#),
        ).expect("parses");
        req.scope = scope.map(Arc::from);
        let snap = pool.load_full();
        // Whether some healthy prefill and healthy decode share a group (of the model).
        let wanted = |k: usize| scope.is_none() || Some(KEYS[k].0) == scope;
        let pair_exists = prefills.iter().any(|(pk, ph)| {
            *ph && wanted(*pk) && decodes.iter().any(|(dk, dh)| *dh && dk == pk)
        });
        let model = d.resolve_model(req.scope.clone());
        let none = crate::dispatch::attempt::Excluded::default();
        for _ in 0..4 {
            let mut off = super::backlog::PrefillNeed { tokens: 1, single: true, bound: Default::default() };
            match d.choose_pair(&snap, &req, &model, &none, None, &mut off) {
                Ok(c) => {
                    let pk = &snap.groups[c.prefill.group].key;
                    let dk = &snap.groups[c.decode.group].key;
                    prop_assert!(pk.compatible(dk), "a pair across incompatible groups: {:?} {:?}", pk, dk);
                    // Every fact here is reported, so compatible means the same group.
                    prop_assert_eq!(c.prefill.group, c.decode.group);
                    if let Some(m) = scope {
                        prop_assert_eq!(c.prefill.model.as_deref(), Some(m));
                    }
                }
                Err(_) => prop_assert!(!pair_exists, "a pair existed but none was chosen"),
            }
        }
    }
}
