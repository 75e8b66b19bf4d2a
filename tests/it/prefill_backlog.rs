//! Prefill admission by tokens end to end (issue 36, item 3): two prefills of DP 2 whose
//! ranks each compute one prompt at a time (a prefix cache), 1 ms per uncached token, and a
//! burst of long prompts that all carry one sticky routing key (so a router that does not
//! bound the backlog piles them on one rank: the affinity's load bound is set too high to
//! spill them). With `admission.prefill_backlog_max_secs`
//! no rank ever has more than that much work queued, by the engine's own count of its
//! queued uncached tokens (the simulator's peak of `num_waiting_uncached_tokens`); the
//! burst spills to the other ranks and waits in pdgate's admission queue, and every request
//! is answered. The backlog and pace series show in `/metrics`.

use std::time::Duration;

use futures_util::future::join_all;
use http::StatusCode;
use http_body_util::BodyExt;
use pdgate::config::Config;
use pdgate_sim::EngineConfig;

use crate::support::common::{start_with_admin, Env};

/// Uncached tokens a prefill rank computes per second (1 ms each).
const PACE: f64 = 1000.0;
/// Words (tokens, for the simulator) of each long prompt: 0.3 s of compute.
const WORDS: usize = 300;

fn prefill() -> EngineConfig {
    let mut p = crate::support::common::fast_engine(EngineConfig::prefill(2));
    p.prefill_prefix_cache_tokens = 1_000_000;
    p.prefill_per_token = Duration::from_secs_f64(1.0 / PACE);
    p
}

/// A long prompt of its own (its first word differs, so no prefix cache helps it): 4
/// bytes a word, which pdgate estimates as one token each.
fn body(i: usize) -> String {
    let text = format!("r{:02}{}", i % 100, " abc".repeat(WORDS - 1));
    serde_json::json!({"text": text, "sampling_params": {"max_new_tokens": 2}}).to_string()
}

async fn env(max_secs: f64) -> Env {
    env_polled(max_secs, 50).await
}

async fn env_polled(max_secs: f64, poll_ms: u64) -> Env {
    let decode = crate::support::common::fast_engine(EngineConfig::decode(1));
    let env = start_with_admin(
        vec![prefill(), prefill()],
        vec![decode],
        |c: &mut Config| {
            c.policy.load_poll_interval_ms = poll_ms;
            c.affinity.sticky = true;
            // The key's (worker, rank) takes everything: no load bound spills it elsewhere.
            c.policy.cache_aware_balance_factor = 1000.0;
            c.policy.cache_aware_slack = 64;
            c.admission.prefill_backlog_max_secs = max_secs;
            c.admission.queue_timeout_ms = 30_000;
            c.timeouts.decode_first_byte_secs = 20;
        },
    )
    .await;
    env.wait_routable(4, 1).await;
    env
}

/// Sends `bodies` with one routing key; their statuses, each within 60 s.
async fn send_all(env: &Env, bodies: impl Iterator<Item = String>) -> Vec<StatusCode> {
    let calls = bodies.map(|b| async move {
        let resp = tokio::time::timeout(
            Duration::from_secs(60),
            env.send(
                "POST",
                "/generate",
                &[
                    ("content-type", "application/json"),
                    ("x-session-id", "one-conversation"),
                ],
                b,
            ),
        )
        .await
        .expect("answered in time");
        let status = resp.status();
        let _ = resp.into_body().collect().await;
        status
    });
    join_all(calls).await
}

/// Learns a pace (two prompts one after the other), then sends a burst of `n`; the most
/// uncached tokens any prefill rank had queued at once, and the statuses.
async fn burst(env: &Env, n: usize) -> (u64, Vec<StatusCode>) {
    for i in 0..2 {
        let s = send_all(env, std::iter::once(body(90 + i))).await;
        assert_eq!(s, vec![StatusCode::OK]);
    }
    let statuses = send_all(env, (0..n).map(body)).await;
    let s = env.settled_stats().await;
    assert_eq!(s.contract_violations, 0, "{s:?}");
    let peak = env
        .cluster
        .prefills
        .iter()
        .flat_map(|p| p.stats().prefill_peak_waiting_uncached_tokens)
        .max()
        .unwrap_or(0);
    (peak, statuses)
}

#[tokio::test(crate = "crate::support::rt")]
async fn without_the_bound_a_burst_piles_on_one_prefill_rank() {
    let env = env(0.0).await;
    let (peak, statuses) = burst(&env, 8).await;
    eprintln!("without the bound: a rank had {peak} uncached tokens queued at most");
    assert!(
        statuses.iter().all(|s| *s == StatusCode::OK),
        "{statuses:?}"
    );
    // Seven prompts of 300 tokens queued behind the first, on the key's rank.
    assert!(
        peak as f64 > PACE,
        "a rank had only {peak} tokens (under 1 s) queued"
    );
    let used = env
        .cluster
        .prefills
        .iter()
        .filter(|p| p.stats().requests_total > 0)
        .count();
    assert_eq!(used, 1, "one key, one prefill");
}

#[tokio::test(crate = "crate::support::rt")]
async fn with_the_bound_no_prefill_rank_queues_more_than_it_allows() {
    const MAX_SECS: f64 = 1.0;
    let env = env(MAX_SECS).await;
    // Sample the series while the burst runs.
    let sampler = async {
        let (mut seen, mut queued) = (Vec::new(), 0.0f64);
        for _ in 0..120 {
            let text = scrape(&env).await;
            if let Some(v) = sample(&text, "pdgate_prefill_backlog_seconds{") {
                if v > 0.0 {
                    seen.push((v, rank_backlogs(&text)));
                }
            }
            queued = queued.max(sample(&text, "pdgate_admission_queue ").unwrap_or(0.0));
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        (seen, queued)
    };
    let ((peak, statuses), (seen, queued)) = tokio::join!(burst(&env, 16), sampler);
    eprintln!("with a bound of {MAX_SECS} s: a rank had {peak} uncached tokens queued at most");
    assert!(
        statuses.iter().all(|s| *s == StatusCode::OK),
        "every request answered: {statuses:?}"
    );
    assert!(
        peak as f64 <= MAX_SECS * PACE,
        "a rank had {peak} uncached tokens queued, more than {MAX_SECS} s of its work"
    );
    let used = env
        .cluster
        .prefills
        .iter()
        .filter(|p| p.stats().requests_total > 0)
        .count();
    assert_eq!(used, 2, "the burst spilled to the other prefill");
    // Four ranks take three prompts each (1 s of work at most): the rest waited in pdgate.
    assert!(queued >= 1.0, "nothing waited in the admission queue");
    // The series: a pool backlog while the burst ran, per-rank backlogs within about the
    // bound (a rank may briefly read a poll's figure before its legs that ended since).
    assert!(!seen.is_empty(), "no backlog seen while the burst ran");
    // The requests held back in pdgate's queue count in the model's backlog: it reads more
    // than the bound lets any rank hold (what an autoscaler needs to see).
    let most = seen.iter().map(|(p, _)| *p).fold(0.0, f64::max);
    eprintln!("the model's backlog read {most:.2} s at most");
    assert!(
        most > MAX_SECS,
        "the model's backlog never passed the bound: {most}"
    );
    for (pool, ranks) in &seen {
        assert!(pool.is_finite() && *pool > 0.0, "{pool}");
        for r in ranks {
            assert!(
                *r >= 0.0 && *r <= 2.0 * MAX_SECS,
                "rank backlog {r} s in {ranks:?}"
            );
        }
    }
    // At rest: nothing queued, and the learned paces no faster than the engine computes.
    let text = scrape(&env).await;
    assert_eq!(
        sample(&text, "pdgate_prefill_backlog_seconds{"),
        Some(0.0),
        "{text}"
    );
    let paces = samples(&text, "pdgate_prefill_rank_tokens_per_second{");
    assert!(!paces.is_empty(), "no pace learned:\n{text}");
    for p in paces {
        assert!(
            p > 0.0 && p <= PACE * 1.25,
            "pace {p} of an engine at {PACE} (within jitter)"
        );
    }
}

#[tokio::test(crate = "crate::support::rt")]
async fn with_the_load_poll_off_the_bound_holds_on_pdgate_s_own_count() {
    // No engine report: a rank's backlog is this replica's legs on it, learned pace and all.
    const MAX_SECS: f64 = 1.0;
    let env = env_polled(MAX_SECS, 0).await;
    let (peak, statuses) = burst(&env, 16).await;
    eprintln!(
        "poll off, a bound of {MAX_SECS} s: a rank had {peak} uncached tokens queued at most"
    );
    assert!(
        statuses.iter().all(|s| *s == StatusCode::OK),
        "{statuses:?}"
    );
    assert!(peak as f64 <= MAX_SECS * PACE, "{peak} tokens queued");
    let used = env
        .cluster
        .prefills
        .iter()
        .filter(|p| p.stats().requests_total > 0)
        .count();
    assert_eq!(used, 2, "the burst spilled to the other prefill");
}

async fn scrape(env: &Env) -> String {
    let (status, _, body) = env.admin("GET", "/metrics", None, "").await;
    assert_eq!(status, 200);
    String::from_utf8_lossy(&body).into_owned()
}

/// The values of the samples whose line starts with `prefix`.
fn samples(text: &str, prefix: &str) -> Vec<f64> {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse().ok()))
        .collect()
}

fn sample(text: &str, prefix: &str) -> Option<f64> {
    samples(text, prefix).first().copied()
}

fn rank_backlogs(text: &str) -> Vec<f64> {
    samples(text, "pdgate_prefill_rank_backlog_seconds{")
}
