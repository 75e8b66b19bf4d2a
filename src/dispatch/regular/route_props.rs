//! Properties of the PD-or-regular choice (`Dispatcher::regular_route`) and of the regular
//! pick, whatever the fleet (PD workers and regular workers of three models, healthy or
//! not), the request's model, the bypass threshold and the fallback setting:
//! - a regular worker picked for a model serves that model (never across models);
//! - a request goes regular only when a routable regular worker of its model exists;
//! - a model without PD workers goes regular whenever it has a routable regular worker;
//! - a model with a routable pair goes PD unless its prompt is under the bypass threshold.

use std::sync::Arc;

use proptest::prelude::*;

use crate::config::Config;
use crate::dispatch::{Dispatcher, RngSource};
use crate::engine::{Generation, Layout, ServerInfo};
use crate::policy::{self, PickCtx};
use crate::pool::{BootstrapInfo, Pool, RankReadiness};
use crate::request::{self, ApiRoute};
use crate::types::Role;
use crate::upstream::{parse_base_url, Upstream, UpstreamSettings};

const MODELS: [&str; 3] = ["m0", "m1", "m2"];

/// Workers as (role, model index, healthy).
fn fleet(workers: &[(Role, usize, bool)]) -> Arc<Pool> {
    let pool = Arc::new(Pool::new());
    for (i, (role, m, healthy)) in workers.iter().enumerate() {
        let url = parse_base_url(&format!("http://127.0.0.1:{}", 30000 + i)).expect("url");
        let id = pool.add_worker(*role, url.clone(), None);
        pool.update_worker(*role, id, |w| {
            w.facts.healthy = *healthy;
            w.facts.info = Some(
                ServerInfo {
                    served_model_name: Some(MODELS[*m].into()),
                    ..ServerInfo::default()
                }
                .into(),
            );
            if *role == Role::Prefill {
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
                    page_size: None,
                    kv_cache_dtype: None,
                });
                w.facts.ranks = vec![RankReadiness::Ready];
            }
        });
    }
    pool
}

fn role() -> impl Strategy<Value = Role> {
    prop::sample::select(vec![Role::Prefill, Role::Decode, Role::Regular])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn regular_routing_stays_within_the_model(
        workers in proptest::collection::vec((role(), 0usize..3, any::<bool>()), 0..9),
        model in 0usize..3,
        threshold in proptest::option::of(1u32..20),
        fallback: bool,
        seed: u64,
    ) {
        let pool = fleet(&workers);
        let m = MODELS[model];
        let mut cfg = Config::default();
        cfg.models.regular_fallback = fallback;
        if let Some(t) = threshold {
            cfg.models.settings.entry(m.to_string()).or_default().short_prompt_tokens = Some(t);
        }
        let up = Upstream::new(&UpstreamSettings {
            connect_timeout: std::time::Duration::from_millis(100),
            pool_max_idle_per_host: 1,
            pool_idle_timeout: std::time::Duration::from_secs(1),
            api_key: None,
            forward_authorization: false,
        });
        let d = Dispatcher::new(pool.clone(), up, Arc::new(cfg), RngSource::Seeded(seed.into()));
        // 8 tokens of input ids.
        let mut req = request::parse(
            ApiRoute::Generate,
            bytes::Bytes::from_static(br#"{"input_ids":[1,2,3,4,5,6,7,8]}"#),
        ).expect("parses");
        req.scope = Some(Arc::from(m));
        let of = |r: Role| workers.iter().filter(move |(wr, wm, _)| *wr == r && *wm == model);
        let regular_up = of(Role::Regular).any(|w| w.2);
        let has_pd = of(Role::Prefill).count() + of(Role::Decode).count() > 0;
        let pair_up = of(Role::Prefill).any(|w| w.2) && of(Role::Decode).any(|w| w.2);
        let short = threshold.is_some_and(|t| 8 < t);

        let model = d.resolve_model(req.scope.clone());
        let none = crate::dispatch::attempt::Excluded::default();
        let regular = d.regular_route(&pool.load(), &req, &model, &none);
        prop_assert!(!regular || regular_up, "regular without a routable regular worker");
        if regular_up && !has_pd {
            prop_assert!(regular, "a regular-only model did not go regular");
        }
        if pair_up && !short {
            prop_assert!(!regular, "a routable pair was passed over without the bypass");
        }
        if regular_up && has_pd && short {
            prop_assert!(regular, "a short prompt did not bypass");
        }
        let snap = pool.load_full();
        let pctx = PickCtx {
            exclude: &[],
            prefix_hash: None,
            need: None,
            among: Some(snap.routable_for(Role::Regular, Some(m))),
        };
        let pick = d.rng.with(|rng| {
            policy::select(model.policies().regular.as_ref(), &snap, Role::Regular, &pctx, rng)
        });
        match pick {
            Some(p) => {
                let w = snap.worker(Role::Regular, p.target.worker).expect("picked worker");
                prop_assert_eq!(w.model.as_deref(), Some(m), "a regular worker of another model");
            }
            None => prop_assert!(!regular_up, "a routable regular worker was not picked"),
        }
    }
}
