//! A prefill whose bootstrap server is not its own is refused in `serve`
//! (`pdgate::bootstrap::ownership`): requests fail fast instead of waiting for KV that
//! never comes (60 s, then 504), the refusal says what to fix, and a correct prefill beside
//! it keeps serving.

use std::time::{Duration, Instant};

use pdgate_sim::EngineConfig;

use crate::support::common::{gen_body, start};

/// The refusal reason the pool shows for prefill `i`, once its proof has been decided
/// (bounded wait): until then the pool shows it as not yet proved.
async fn refusal(env: &crate::support::common::Env, i: usize) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let snap = env.router.pool.load();
        if let Some(r) = snap
            .prefills
            .get(i)
            .and_then(|w| w.facts.refusal().map(str::to_owned))
        {
            if !r.contains("not yet proved") {
                return r;
            }
        }
        assert!(Instant::now() < deadline, "prefill {i} not refused in time");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bootstrap_servers_that_are_not_the_prefills_own_are_refused() {
    // (case, how the config is wired, the refused prefill, what the refusal says,
    //  whether a request still succeeds)
    type Wire = fn(&mut pdgate::config::Config);
    let table: [(&str, Wire, usize, &str, bool); 2] = [
        (
            "a prefill given another prefill's bootstrap port",
            |c| {
                c.prefill[0].bootstrap_port = c.prefill[1].bootstrap_port;
                c.prefill.truncate(1);
            },
            0,
            "disaggregation_bootstrap_port",
            false,
        ),
        (
            "two prefills given one bootstrap server",
            |c| c.prefill[1].bootstrap_port = c.prefill[0].bootstrap_port,
            1,
            "disaggregation_bootstrap_port",
            true,
        ),
    ];
    for (case, wire, refused, says, serves) in table {
        let env = start(
            vec![EngineConfig::prefill(1), EngineConfig::prefill(1)],
            vec![EngineConfig::decode(1)],
            wire,
        )
        .await;
        let why = refusal(&env, refused).await;
        assert!(why.contains(says) && why.contains("give"), "{case}: {why}");
        if serves {
            env.wait_routable(1, 1).await;
        } else {
            env.wait_pool("decode routable", |s| !s.decode_routable.is_empty())
                .await;
        }
        let started = Instant::now();
        let (st, _, body) = env.post("/generate", gen_body(false)).await;
        let body = String::from_utf8_lossy(&body).to_string();
        if serves {
            assert_eq!(st, 200, "{case}: {body}");
        } else {
            assert_eq!(st, 503, "{case}: {body}");
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{case}: a refused prefill is never waited on"
        );
        // The refused prefill's engine never got a request.
        let s = env.cluster.prefills[refused].stats();
        assert_eq!(s.requests_total, 0, "{case}: {s:?}");
    }
}
