//! Stall detection by lack of progress (issue 17, item 1), end to end against the simulator:
//! an engine that stops making progress while its `/health` and bootstrap server stay fine
//! costs the client latency, not an error; what is plausible is learned (one config finds a
//! hung 20 ms prefill fast and leaves healthy 2 s prefills alone); slow for everyone is not a
//! stall; one stuck request never ejects its worker; a stalled worker comes back only after a
//! one-token request through a real pair succeeded.
//!
//! Every test uses the router's default `[progress]` settings (only the probe interval is
//! changed where a test needs probes sooner, or none); timing bounds are generous
//! "not stuck" checks, the figures are in BENCHMARKS.md.

use crate::support::common;

use std::time::{Duration, Instant};

use common::{attempts_seen, fast_engine, start, start_as_is, Env, GEN, GEN_STREAM};
use futures_util::StreamExt;
use http_body_util::BodyExt;
use pdgate::pool::BreakerState;
use pdgate::types::{Role, WorkerId};
use pdgate_sim::{EngineConfig, Faults, SimEngine};

/// `n` POSTs of `body` to `/generate`, `conc` at a time; each one's status and latency.
async fn load(env: &Env, n: usize, conc: usize, body: &str) -> Vec<(u16, Duration, String)> {
    futures_util::stream::iter(0..n)
        .map(|_| async move {
            let t = Instant::now();
            let (st, _, b) = env.post("/generate", body).await;
            (
                st.as_u16(),
                t.elapsed(),
                String::from_utf8_lossy(&b).into_owned(),
            )
        })
        .buffer_unordered(conc)
        .collect()
        .await
}

fn all_ok(results: &[(u16, Duration, String)]) {
    for (st, _, body) in results {
        assert_eq!(*st, 200, "{body}");
    }
}

fn slowest(results: &[(u16, Duration, String)]) -> Duration {
    results.iter().map(|r| r.1).max().unwrap_or_default()
}

fn breaker(env: &Env, role: Role, id: u32) -> BreakerState {
    env.router
        .pool
        .load()
        .worker(role, WorkerId(id))
        .expect("worker")
        .shared
        .breaker
        .state()
}

fn requests(e: &SimEngine) -> u64 {
    e.stats().requests_total
}

/// Waits until prefill `id`'s breaker is `state` (bounded: 10 s).
async fn wait_breaker(env: &Env, id: u32, state: BreakerState, what: &str) {
    env.wait_pool(what, |s| {
        s.worker(Role::Prefill, WorkerId(id))
            .is_some_and(|w| w.shared.breaker.state() == state)
    })
    .await;
}

/// Prefill 0, which recovered at `cleared`, is re-admitted (its breaker closed again)
/// within `bound`.
async fn readmitted_within(env: &Env, cleared: Instant, bound: Duration) {
    wait_breaker(env, 0, BreakerState::Closed, "prefill 0 re-admitted").await;
    let took = cleared.elapsed();
    assert!(took < bound, "re-admitted {took:?} after it recovered");
}

/// Hangs prefill 0 and sends requests until it is out of rotation as stalled (every one
/// succeeds).
async fn stall_prefill0(env: &Env) {
    hang_prefill(&env.cluster.prefills[0], true);
    all_ok(&load(env, 12, 4, GEN).await);
    wait_breaker(env, 0, BreakerState::Stalled, "prefill 0 stalled").await;
}

fn hang_prefill(e: &SimEngine, on: bool) {
    e.set_faults(Faults {
        prefill_hang: on,
        ..Faults::default()
    });
}

/// Two prefills, one hung mid-run: every request succeeds, none is stuck, and once the
/// hung prefill is out of rotation it gets no new request (no probe either: the probe
/// interval is set beyond the test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_prefill_costs_latency_not_errors_and_is_ejected() {
    let env = start(
        vec![EngineConfig::prefill(1), EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1)],
        |c| c.progress.probe_interval_ms = 600_000,
    )
    .await;
    env.wait_routable(2, 1).await;
    let warm = load(&env, 20, 4, GEN).await;
    all_ok(&warm);
    let normal = slowest(&warm);

    hang_prefill(&env.cluster.prefills[0], true);
    let hit = load(&env, 40, 4, GEN).await;
    all_ok(&hit);
    let worst = slowest(&hit);
    assert!(
        worst < normal + Duration::from_secs(5),
        "a request was stuck: {worst:?} (normal {normal:?})"
    );
    assert_eq!(breaker(&env, Role::Prefill, 0), BreakerState::Stalled);
    assert_some_retried(&env.cluster.prefills[0], &env.cluster.prefills[1], 'p');

    // Out of rotation: nothing more reaches it.
    let before = requests(&env.cluster.prefills[0]);
    all_ok(&load(&env, 20, 4, GEN).await);
    assert_eq!(requests(&env.cluster.prefills[0]), before);
    // /readiness counts it out (the admin listener's shows the breaker's `stalled`).
    let resp = env.send("GET", "/readiness", &[], "").await;
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(v["prefill"]["ejected"], 1, "{v}");
}

/// The 20 ms fleet: a hung prefill is found within about a second (its first stall costs
/// the request the learned deadline, here the 500 ms floor).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn learned_fast_fleet_finds_a_hung_prefill_within_a_second() {
    let p = |_| {
        let mut e = fast_engine(EngineConfig::prefill(1));
        e.prefill_delay = Duration::from_millis(20);
        e
    };
    let env = start_as_is(
        (0..2).map(p).collect(),
        vec![fast_engine(EngineConfig::decode(1))],
        |_| {},
    )
    .await;
    env.wait_routable(2, 1).await;
    all_ok(&load(&env, 16, 4, GEN).await);
    hang_prefill(&env.cluster.prefills[0], true);
    let t = Instant::now();
    let hit = load(&env, 8, 2, GEN).await;
    all_ok(&hit);
    assert!(
        slowest(&hit) < Duration::from_millis(1500),
        "the hung prefill cost more than about a second: {:?}",
        slowest(&hit)
    );
    env.wait_pool("the hung prefill out of rotation", |s| {
        s.worker(Role::Prefill, WorkerId(0))
            .is_some_and(|w| w.shared.breaker.state() == BreakerState::Stalled)
    })
    .await;
    assert!(t.elapsed() < Duration::from_secs(5));
}

/// A long prompt of `words` words (one simulated token each).
fn long_prompt(words: usize) -> String {
    let text = "w ".repeat(words);
    format!(r#"{{"text":"{text}","sampling_params":{{"max_new_tokens":2}}}}"#)
}

/// The same config on a fleet whose healthy long prompts take 2 s (the issue's 8 s scaled
/// 1:4 to keep the test short; a fixed timeout that finds the 20 ms fleet's hung prefill in
/// a second would kill every one of these), mixed with short prompts: no stall, no retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn learned_slow_long_prompts_are_not_stalls() {
    let p = |_| {
        let mut e = fast_engine(EngineConfig::prefill(1));
        e.prefill_delay = Duration::from_millis(20);
        e.prefill_per_token = Duration::from_millis(2);
        e
    };
    let env = start_as_is(
        (0..2).map(p).collect(),
        vec![fast_engine(EngineConfig::decode(1))],
        |_| {},
    )
    .await;
    env.wait_routable(2, 1).await;
    // Short prompts first (the fleet learns 20 ms legs), then long ones among short ones.
    all_ok(&load(&env, 12, 4, GEN).await);
    let long = long_prompt(1000);
    let (long_res, short_res) = tokio::join!(load(&env, 6, 6, &long), load(&env, 30, 2, GEN));
    all_ok(&long_res);
    all_ok(&short_res);
    assert!(
        slowest(&long_res) >= Duration::from_secs(2),
        "the long prompts did take 2 s"
    );
    for e in &env.cluster.prefills {
        assert!(
            attempts_after_first(e).is_empty(),
            "nothing was retried: {:?}",
            e.recent_rids()
        );
    }
    for id in 0..2 {
        assert_eq!(breaker(&env, Role::Prefill, id), BreakerState::Closed);
    }
}

/// Some requests were retried from `failing` to `other` (a second attempt on `other` whose
/// first attempt went to `failing`), and every second attempt on `other` was one of those.
fn assert_some_retried(failing: &SimEngine, other: &SimEngine, side: char) {
    let retried = attempts_seen(other, side, 1);
    let first = attempts_seen(failing, side, 0);
    assert!(
        !retried.is_empty(),
        "nothing was retried: {:?}",
        other.recent_rids()
    );
    for id in &retried {
        assert!(
            first.contains(id),
            "{id} was not first sent to the failing engine"
        );
    }
}

/// Rids of second or later attempts an engine saw.
fn attempts_after_first(e: &SimEngine) -> Vec<String> {
    e.recent_rids()
        .into_iter()
        .filter(|r| common::split_leg_rid(r).is_some_and(|(_, a, _)| a > 0))
        .collect()
}

/// Every prefill slows down 5x at once (150 ms legs become 750 ms, past the learned 500 ms
/// deadline): slow for everyone is not a stall — nothing ejected, nothing retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn everyone_slowing_down_5x_ejects_and_retries_nothing() {
    let p = |_| {
        let mut e = fast_engine(EngineConfig::prefill(1));
        e.prefill_delay = Duration::from_millis(150);
        e
    };
    let env = start_as_is(
        (0..2).map(p).collect(),
        vec![fast_engine(EngineConfig::decode(1))],
        |_| {},
    )
    .await;
    env.wait_routable(2, 1).await;
    all_ok(&load(&env, 16, 4, GEN).await);
    for e in &env.cluster.prefills {
        e.set_faults(Faults {
            slowdown: 5,
            ..Faults::default()
        });
    }
    let slow = load(&env, 16, 4, GEN).await;
    all_ok(&slow);
    assert!(
        slowest(&slow) >= Duration::from_millis(750),
        "the slowdown took effect"
    );
    for e in &env.cluster.prefills {
        assert!(attempts_after_first(e).is_empty(), "{:?}", e.recent_rids());
    }
    for id in 0..2 {
        assert_eq!(breaker(&env, Role::Prefill, id), BreakerState::Closed);
    }
}

/// One request stranded on a healthy prefill (SGLang can strand a single room): that
/// request is retried elsewhere, and the prefill, which keeps completing the others, stays
/// in rotation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_stuck_request_never_ejects_its_worker() {
    let env = start(
        vec![EngineConfig::prefill(1), EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1)],
        |_| {},
    )
    .await;
    env.wait_routable(2, 1).await;
    all_ok(&load(&env, 16, 4, GEN).await);
    let p0 = &env.cluster.prefills[0];
    // Strand exactly one request on prefill 0: hang it until one request arrived there.
    let mut stranded = false;
    for _ in 0..10 {
        let before = requests(p0);
        hang_prefill(p0, true);
        let req = env.post("/generate", GEN);
        tokio::pin!(req);
        let answer = loop {
            tokio::select! {
                a = &mut req => break a,
                _ = tokio::time::sleep(Duration::from_millis(2)) => {
                    if requests(p0) > before {
                        hang_prefill(p0, false);
                        stranded = true;
                    }
                }
            }
        };
        hang_prefill(p0, false);
        assert_eq!(answer.0, 200, "{}", String::from_utf8_lossy(&answer.2));
        if stranded {
            break;
        }
    }
    assert!(stranded, "no request reached prefill 0");
    assert_some_retried(p0, &env.cluster.prefills[1], 'p');
    let before = requests(p0);
    all_ok(&load(&env, 20, 4, GEN).await);
    assert!(requests(p0) > before, "prefill 0 still takes requests");
    assert_eq!(breaker(&env, Role::Prefill, 0), BreakerState::Closed);
}

/// A stalled prefill stays out while it is hung although `/health` passes (its probes fail),
/// and comes back once a one-token request through a real pair succeeded on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readmitted_only_after_a_one_token_request_through_a_real_pair() {
    let env = start(
        vec![EngineConfig::prefill(1), EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1)],
        |c| {
            c.progress.probe_interval_ms = 200;
            c.progress.probe_max_interval_ms = 400;
        },
    )
    .await;
    env.wait_routable(2, 1).await;
    all_ok(&load(&env, 16, 4, GEN).await);
    stall_prefill0(&env).await;
    // Health checks pass every 50 ms; probes (every 200-400 ms) fail: it stays out.
    let p0 = &env.cluster.prefills[0];
    let probes_before = requests(p0);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let snap = env.router.pool.load();
    let w = snap.worker(Role::Prefill, WorkerId(0)).expect("worker");
    assert!(w.facts.healthy, "health passes all along");
    assert_eq!(w.shared.breaker.state(), BreakerState::Stalled);
    assert!(requests(p0) > probes_before, "it was probed");
    // The engine recovers: the next probe goes through a real pair and re-admits it.
    let ok_before = p0.stats().ok;
    let decode_ok_before = env.cluster.decodes[0].stats().ok;
    hang_prefill(p0, false);
    wait_breaker(&env, 0, BreakerState::Closed, "prefill 0 re-admitted").await;
    assert!(p0.stats().ok > ok_before, "a request completed on it first");
    assert!(
        env.cluster.decodes[0].stats().ok > decode_ok_before,
        "through a real decode"
    );
    let before = requests(p0);
    all_ok(&load(&env, 10, 2, GEN).await);
    assert!(requests(p0) > before, "back in rotation");
}

/// A stalled prefill whose probes then fail at once (the engine answers 500: another fault,
/// not the hang) keeps being probed every interval, not after a doubled wait, so it is back
/// within about one interval of recovering. Before, every failed probe doubled the wait:
/// probes at ~0.1, 0.3, 0.7, 1.5, 3.1, 6.3 s, so a recovery at 4 s waited until 6.3 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_answered_at_once_do_not_back_off() {
    let env = start(
        vec![EngineConfig::prefill(1), EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1)],
        |c| {
            c.progress.probe_interval_ms = 100;
            c.progress.probe_max_interval_ms = 60_000;
        },
    )
    .await;
    env.wait_routable(2, 1).await;
    all_ok(&load(&env, 16, 4, GEN).await);
    let p0 = &env.cluster.prefills[0];
    stall_prefill0(&env).await;
    // No longer hung: it answers every generate with a 500 at once.
    p0.set_faults(Faults {
        prefill_status: Some(500),
        ..Faults::default()
    });
    let before = requests(p0);
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(breaker(&env, Role::Prefill, 0), BreakerState::Stalled);
    let probes = requests(p0) - before;
    // One probe per 100 ms interval (~40 in 4 s); a doubling backoff sends 5 or 6.
    assert!(probes >= 12, "probed {probes} times in 4 s");
    p0.set_faults(Faults::default());
    readmitted_within(&env, Instant::now(), Duration::from_millis(1500)).await;
}

/// A decode that pulls the KV and then never sends its first byte: each such request is
/// retried on the other decode, and the hung decode leaves rotation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_hung_before_its_first_byte_is_retried_on_the_other_decode() {
    let env = start(
        vec![EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1), EngineConfig::decode(1)],
        |c| c.progress.probe_interval_ms = 600_000,
    )
    .await;
    env.wait_routable(1, 2).await;
    // Streams: decode's first event is the first token (a non-streamed answer comes whole,
    // and is not judged against first-token times).
    all_ok(&load(&env, 16, 4, GEN_STREAM).await);
    env.cluster.decodes[0].set_faults(Faults {
        decode_hang: true,
        ..Faults::default()
    });
    let hit = load(&env, 16, 4, GEN_STREAM).await;
    all_ok(&hit);
    assert!(
        slowest(&hit) < Duration::from_secs(5),
        "{:?}",
        slowest(&hit)
    );
    assert_some_retried(&env.cluster.decodes[0], &env.cluster.decodes[1], 'd');
    assert_eq!(breaker(&env, Role::Decode, 0), BreakerState::Stalled);
}

/// The relay's bound on a decode's inter-event gaps is learned from streams that ended
/// well: the ceiling before any, the floor once a fleet of 1 ms gaps was seen (for each
/// decode, from its own streams and its peer's), once the bound computed before is
/// `GAP_BOUND_TTL` old.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_gap_bound_is_learned_from_streams() {
    let env = start(
        vec![EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1), EngineConfig::decode(1)],
        |_| {},
    )
    .await;
    env.wait_routable(1, 2).await;
    let d = env.router.server.dispatcher();
    let p = &d.cfg.progress;
    let (floor, ceiling) = (
        Duration::from_millis(p.gap_floor_ms),
        Duration::from_millis(p.gap_ceiling_ms),
    );
    assert_eq!(d.gap_deadline(Role::Decode, WorkerId(0), 0), ceiling);
    let streams = load(&env, 12, 2, GEN_STREAM).await;
    all_ok(&streams);
    // A computed bound is reused for a while (the ceiling above, for decode 0).
    tokio::time::sleep(pdgate::progress::GAP_BOUND_TTL).await;
    for id in 0..2 {
        assert_eq!(
            d.gap_deadline(Role::Decode, WorkerId(id), 0),
            floor,
            "decode {id}"
        );
    }
}

/// A non-streamed answer arrives whole, after every token: however long it takes past the
/// fleet's learned time to first token, it is not a stall (no retry, no ejection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_non_streamed_answer_is_not_a_stall() {
    let slow_tokens = |_| {
        let mut d = fast_engine(EngineConfig::decode(1));
        d.itl = Duration::from_millis(100);
        d
    };
    let env = start_as_is(
        vec![fast_engine(EngineConfig::prefill(1))],
        (0..2).map(slow_tokens).collect(),
        |_| {},
    )
    .await;
    env.wait_routable(1, 2).await;
    // The fleet learns a time to first token of a few ms (floor: 500 ms).
    all_ok(&load(&env, 12, 4, GEN_STREAM).await);
    // 12 tokens at 100 ms: each non-streamed answer takes about 1.2 s, while streams on
    // both decodes keep completing their first tokens in a few ms.
    let long = r#"{"text":"hello","sampling_params":{"max_new_tokens":12}}"#;
    let (streams, plain) = tokio::join!(load(&env, 40, 2, GEN_STREAM), load(&env, 6, 2, long));
    all_ok(&streams);
    all_ok(&plain);
    for d in &env.cluster.decodes {
        assert!(
            attempts_seen(d, 'd', 1).is_empty(),
            "a long answer was retried"
        );
    }
    assert_eq!(breaker(&env, Role::Decode, 0), BreakerState::Closed);
    assert_eq!(breaker(&env, Role::Decode, 1), BreakerState::Closed);
}

/// A stalled prefill that recovers while a probe is held on it (sent while it was still
/// hung, so that probe never gets an answer and fails at its stall deadline) is back about
/// one interval after that probe failed, not after a doubled wait: one held probe alone does
/// not grow the wait, only a second in a row does. Before, the held probe doubled the wait
/// (1 s → 2 s), so a recovery just after the probe was sent took ~2.5 s to be seen (the chaos
/// soak's "serving within 3 s of the clear" was missed by 20 ms once in CI).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_held_when_the_engine_recovers_does_not_double_the_wait() {
    let env = start(
        vec![EngineConfig::prefill(1), EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1)],
        |c| {
            c.progress.probe_interval_ms = 1000;
            c.progress.probe_max_interval_ms = 60_000;
        },
    )
    .await;
    env.wait_routable(2, 1).await;
    all_ok(&load(&env, 16, 4, GEN).await);
    let p0 = &env.cluster.prefills[0];
    stall_prefill0(&env).await;
    // The first probe (one interval after the stall) reaches the hung engine and is held.
    let before = requests(p0);
    let waited = Instant::now();
    while requests(p0) == before {
        assert!(
            waited.elapsed() < Duration::from_secs(5),
            "no probe within 5 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // It recovers at once; the held probe still fails (a hung engine keeps what it holds),
    // at its stall deadline (the 500 ms prefill floor), and the next probe re-admits it.
    hang_prefill(p0, false);
    // Held probe's deadline (~0.5 s) + one interval (1 s) + the probe itself; a doubled
    // wait makes it ~2.5 s.
    readmitted_within(&env, Instant::now(), Duration::from_millis(2100)).await;
}

/// A fault storm can spend the retry budget before an engine stalls (in the chaos soak, the
/// bootstrap faults' fast failures spent it and 17 requests stalled on a hung decode ended
/// 504 `decode_stalled` while the other decode was fine). A stalled request is what one
/// engine's failure costs, bounded by what that engine held, so its retry may spend the
/// reserve that stream moves have (`retry.budget_move_reserve`): here the budget proper is
/// empty (no ratio, no reserve) and every request that stalls on the hung prefill is still
/// retried on the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_requests_are_retried_from_the_reserve_when_the_budget_is_spent() {
    let env = start(
        vec![EngineConfig::prefill(1), EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1)],
        |c| {
            c.progress.probe_interval_ms = 600_000;
            c.retry.budget_ratio = 0.0;
            c.retry.budget_min_reserve = 0;
            c.retry.budget_move_reserve = 16;
        },
    )
    .await;
    env.wait_routable(2, 1).await;
    all_ok(&load(&env, 16, 4, GEN).await);
    hang_prefill(&env.cluster.prefills[0], true);
    all_ok(&load(&env, 24, 4, GEN).await);
    assert_eq!(breaker(&env, Role::Prefill, 0), BreakerState::Stalled);
    assert_some_retried(&env.cluster.prefills[0], &env.cluster.prefills[1], 'p');
}
