//! In-process PD tests of the prefix caches (`crate::prefix_cache`): engines on port 0,
//! requests sent by hand (a prefill leg and a decode leg with the same bootstrap fields,
//! as a router sends them), assertions on the reported `cached_tokens` and the stats
//! counters, never on how fast anything ran (except lower bounds, which sleeps keep).

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::config::EngineConfig;
use crate::http;
use crate::request::{self, Api};
use crate::{SimCluster, SimEngine};

const TIMEOUT: Duration = Duration::from_secs(20);

fn fast(mut c: EngineConfig) -> EngineConfig {
    c.prefill_delay = Duration::from_millis(1);
    c.ttft = Duration::from_millis(1);
    c.itl = Duration::ZERO;
    c.default_output_tokens = 2;
    c
}

fn prefill(dp: u32, cache: u64) -> EngineConfig {
    let mut c = fast(EngineConfig::prefill(dp));
    c.prefill_prefix_cache_tokens = cache;
    c
}

fn decode(dp: u32, cache: u64) -> EngineConfig {
    let mut c = fast(EngineConfig::decode(dp));
    c.decode_prefix_cache_tokens = cache;
    c
}

/// `n` distinct words starting with `tag`.
fn words(tag: &str, n: usize) -> String {
    (0..n)
        .map(|i| format!("{tag}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

async fn post(e: &SimEngine, path: &str, body: &Value) -> (u16, String) {
    let r = http::call(
        &e.addr().to_string(),
        "POST",
        path,
        Some(body.to_string().into_bytes()),
        TIMEOUT,
    )
    .await
    .expect("the engine answers");
    (r.status, String::from_utf8_lossy(&r.body).into_owned())
}

/// Both legs of one request at once, to the cluster's first prefill and `decode_body` to
/// its first decode (the same body unless told otherwise); (prefill, decode) answers.
async fn pd(
    c: &SimCluster,
    path: &str,
    body: &Value,
    room: u64,
    decode_extra: Option<(&str, Value)>,
) -> (Value, Value) {
    let mut b = body.clone();
    b["bootstrap_host"] = json!("127.0.0.1");
    b["bootstrap_port"] = json!(c.prefills[0].bootstrap_port());
    b["bootstrap_room"] = json!(room);
    let mut d = b.clone();
    if let Some((k, v)) = decode_extra {
        d[k] = v;
    }
    let ((ps, pb), (ds, db)) = tokio::join!(
        post(&c.prefills[0], path, &b),
        post(&c.decodes[0], path, &d)
    );
    assert_eq!(ps, 200, "prefill: {pb}");
    assert_eq!(ds, 200, "decode: {db}");
    (parse(&pb), parse(&db))
}

/// A JSON answer, or the last usage-carrying event of an SSE stream.
fn parse(body: &str) -> Value {
    if let Ok(v) = serde_json::from_str(body) {
        return v;
    }
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .rfind(|v| !v.get("usage").unwrap_or(&Value::Null).is_null())
        .unwrap_or(Value::Null)
}

fn generate(text: &str) -> Value {
    json!({"text": text, "sampling_params": {"max_new_tokens": 2}})
}

fn cached(v: &Value) -> u64 {
    v["meta_info"]["cached_tokens"]
        .as_u64()
        .expect("meta_info.cached_tokens")
}

async fn quiet(c: &SimCluster) {
    let start = Instant::now();
    while c.total_stats().held_now > 0 && start.elapsed() < TIMEOUT {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let s = c.total_stats();
    assert_eq!(s.held_now, 0, "{s:?}");
    assert_eq!(s.failed + s.aborted + s.contract_violations, 0, "{s:?}");
}

/// A repeated prompt on the same prefill rank reports its cached whole pages (on the
/// prefill's answer and, as SGLang does, on the decode's) and computes only the rest; the
/// other prefill rank has a cache of its own.
#[tokio::test]
async fn a_repeated_prompt_hits_its_rank_and_only_its_rank() {
    let c = SimCluster::spawn(&[prefill(2, 6000)], &[decode(1, 12000)])
        .await
        .expect("cluster");
    // 40 tokens: two whole pages of 16 (the last token is always computed).
    let body = generate(&words("w", 40));

    // Room 0 → rank 0: a cold cache.
    let (p, d) = pd(&c, "/generate", &body, 0, None).await;
    assert_eq!((cached(&p), cached(&d)), (0, 0));
    // Room 2 → rank 0 again: two pages held.
    let (p, d) = pd(&c, "/generate", &body, 2, None).await;
    assert_eq!((cached(&p), cached(&d)), (32, 32), "{p} {d}");
    assert_eq!(d["meta_info"]["prompt_tokens"], 40);
    // Room 1 → rank 1: its own cache, cold. The decode (one rank) reports the prefill's
    // count, not its own.
    let (p, d) = pd(&c, "/generate", &body, 1, None).await;
    assert_eq!((cached(&p), cached(&d)), (0, 0), "{p} {d}");
    quiet(&c).await;

    let ps = c.prefills[0].stats();
    assert_eq!(ps.prefill_prefix_requested_tokens, vec![80, 40]);
    assert_eq!(ps.prefill_prefix_cached_tokens, vec![32, 0]);
    assert_eq!(ps.prefill_cache_hit_ratio(), Some(32.0 / 120.0));
    assert!(ps.decode_prefix_requested_tokens.is_empty());
    let ds = c.decodes[0].stats();
    assert_eq!(ds.decode_prefix_requested_tokens, vec![120]);
    assert_eq!(ds.decode_prefix_cached_tokens, vec![64]);
    assert!(ds.prefill_prefix_requested_tokens.is_empty());
    let total = c.total_stats();
    assert_eq!(total.prefill_prefix_cached_tokens, vec![32, 0]);
    assert_eq!(total.decode_prefix_cached_tokens, vec![64]);
}

/// Each decode DP rank keeps its own cache: the KV it lacks is counted per rank.
#[tokio::test]
async fn decode_ranks_do_not_share_their_caches() {
    let c = SimCluster::spawn(&[prefill(1, 0)], &[decode(2, 12000)])
        .await
        .expect("cluster");
    let body = generate(&words("d", 40));
    let on = |r: u32| Some(("routed_dp_rank", json!(r)));
    for (room, rank) in [(10, 0), (11, 1), (12, 0)] {
        let (p, d) = pd(&c, "/generate", &body, room, on(rank)).await;
        // No prefill cache: nothing to report.
        assert_eq!((cached(&p), cached(&d)), (0, 0));
    }
    quiet(&c).await;
    let ds = c.decodes[0].stats();
    assert_eq!(ds.decode_prefix_requested_tokens, vec![80, 40]);
    assert_eq!(ds.decode_prefix_cached_tokens, vec![32, 0]);
    assert_eq!(c.prefills[0].stats().prefill_prefix_cached_tokens, vec![0]);
}

/// A conversation's next turn shares the earlier turns' pages (chat prompts are keyed by
/// the rendered conversation), and OpenAI usage reports them with
/// `--enable-cache-report`, streamed or not.
#[tokio::test]
async fn a_chat_turn_reuses_the_earlier_turns() {
    let mut p = prefill(1, 6000);
    p.enable_cache_report = true;
    let mut d = decode(1, 12000);
    d.enable_cache_report = true;
    let c = SimCluster::spawn(&[p], &[d]).await.expect("cluster");
    // Turn 1: 4 + 40 (system) + 4 + 3 (user) = 51 tokens, three whole pages.
    let system = json!({"role": "system", "content": words("s", 40)});
    let turn1 =
        json!({"messages": [system, {"role": "user", "content": "what is it"}], "max_tokens": 2});
    let (p1, d1) = pd(&c, "/v1/chat/completions", &turn1, 20, None).await;
    assert_eq!(d1["usage"]["prompt_tokens"], 51, "{d1}");
    // No cached tokens: no details, as SGLang.
    assert_eq!(d1["usage"]["prompt_tokens_details"], Value::Null, "{d1}");
    assert_eq!(p1["usage"]["prompt_tokens_details"], Value::Null, "{p1}");

    let mut turn2 = turn1.clone();
    turn2["messages"] = json!([
        system,
        {"role": "user", "content": "what is it"},
        {"role": "assistant", "content": "a sim"},
        {"role": "user", "content": "and then"},
    ]);
    let (p2, d2) = pd(&c, "/v1/chat/completions", &turn2, 21, None).await;
    let details = json!({"cached_tokens": 48});
    assert_eq!(d2["usage"]["prompt_tokens_details"], details, "{d2}");
    assert_eq!(p2["usage"]["prompt_tokens_details"], details, "{p2}");

    // The same turn again, streamed with the usage chunk: still three pages (turn 2's 63
    // tokens hold no fourth whole page), reported on the decode's stream.
    let mut turn3 = turn2.clone();
    turn3["stream"] = json!(true);
    turn3["stream_options"] = json!({"include_usage": true});
    let (_, d3) = pd(&c, "/v1/chat/completions", &turn3, 22, None).await;
    assert_eq!(d3["usage"]["prompt_tokens_details"], details, "{d3}");
    quiet(&c).await;
}

/// Defaults: no cache anywhere, `cached_tokens` 0, no usage details, and the lookups
/// counted as misses.
#[tokio::test]
async fn by_default_nothing_is_cached() {
    let base = EngineConfig::default();
    assert_eq!(base.prefill_prefix_cache_tokens, 0);
    assert_eq!(base.decode_prefix_cache_tokens, 0);
    assert_eq!(base.prefix_cache_page_size, 16);
    assert_eq!(base.decode_per_missing_token, Duration::ZERO);
    assert!(!base.enable_cache_report);
    // The prefill time of a whole prompt is what it always was.
    let f = crate::Faults::default();
    assert_eq!(base.prefill_time(100, &f), base.prefill_delay);

    let c = SimCluster::spawn(
        &[fast(EngineConfig::prefill(1))],
        &[fast(EngineConfig::decode(1))],
    )
    .await
    .expect("cluster");
    let body = generate(&words("x", 40));
    for room in [30, 31] {
        let (p, d) = pd(&c, "/generate", &body, room, None).await;
        assert_eq!((cached(&p), cached(&d)), (0, 0));
    }
    let chat = json!({"messages": [{"role": "user", "content": words("y", 40)}], "max_tokens": 2});
    for room in [32, 33] {
        let (_, d) = pd(&c, "/v1/chat/completions", &chat, room, None).await;
        assert_eq!(d["usage"]["prompt_tokens_details"], Value::Null, "{d}");
    }
    quiet(&c).await;
    let s = c.total_stats();
    assert_eq!(s.prefill_prefix_cached_tokens, vec![0]);
    assert_eq!(s.decode_prefix_cached_tokens, vec![0]);
    assert_eq!(s.prefill_prefix_requested_tokens, vec![40 + 40 + 44 + 44]);
    assert_eq!(s.prefill_cache_hit_ratio(), Some(0.0));
}

/// With a cache, a prefill rank computes one prompt at a time: two prompts on one rank
/// take at least their two compute times.
#[tokio::test]
async fn a_prefill_rank_computes_one_prompt_at_a_time() {
    let mut p = prefill(1, 6000);
    p.prefill_per_token = Duration::from_millis(2);
    let c = SimCluster::spawn(&[p], &[decode(1, 0)])
        .await
        .expect("cluster");
    let start = Instant::now();
    // 30 uncached tokens each: at least 60 ms of compute each, one after the other.
    let a = generate(&words("a", 30));
    let b = generate(&words("b", 30));
    tokio::join!(
        pd(&c, "/generate", &a, 40, None),
        pd(&c, "/generate", &b, 41, None)
    );
    assert!(
        start.elapsed() >= Duration::from_millis(120),
        "{:?}",
        start.elapsed()
    );
    quiet(&c).await;
}

/// The decode waits for the KV its rank lacks before its first token.
#[tokio::test]
async fn a_decode_waits_for_the_kv_it_lacks() {
    let mut d = decode(1, 12000);
    d.decode_per_missing_token = Duration::from_millis(2);
    let c = SimCluster::spawn(&[prefill(1, 0)], &[d])
        .await
        .expect("cluster");
    let start = Instant::now();
    pd(&c, "/generate", &generate(&words("k", 40)), 50, None).await;
    assert!(
        start.elapsed() >= Duration::from_millis(80),
        "{:?}",
        start.elapsed()
    );
    quiet(&c).await;
}

/// The prefix caches' token ids: as many as the prompt's tokens, shared by prompts that
/// share leading words or turns, and not computed without a cache.
#[test]
fn prefix_ids_match_the_prompt_tokens() {
    let on = EngineConfig {
        prefill_prefix_cache_tokens: 100,
        ..EngineConfig::prefill(1)
    };
    let bodies = [
        (Api::Generate, json!({"text": "a b c"})),
        (Api::Generate, json!({"text": ""})),
        (Api::Generate, json!({"text": ["a b", "c"]})),
        (Api::Generate, json!({"input_ids": [1, 2, 3, 4]})),
        (Api::Completions, json!({"prompt": "one two"})),
        (Api::Completions, json!({"prompt": [[5, 6], [7]]})),
        (Api::Chat, json!({"messages": []})),
        (
            Api::Chat,
            json!({"messages": [{"role": "user", "content": "hi there"}]}),
        ),
        (
            Api::Chat,
            json!({"messages": [
                {"role": "system", "content": [{"type": "text", "text": "be brief"}, {"type": "text", "text": ""}, {"type": "image_url"}]},
                {"role": "user", "content": null},
            ]}),
        ),
    ];
    for (api, body) in &bodies {
        let r = request::parse(*api, body.to_string().as_bytes(), None, &on).expect("parses");
        for inst in &r.instances {
            assert_eq!(inst.prefix_ids.len(), inst.prompt_tokens as usize, "{body}");
        }
        let off = request::parse(
            *api,
            body.to_string().as_bytes(),
            None,
            &EngineConfig::prefill(1),
        )
        .expect("parses");
        assert!(off.instances.iter().all(|i| i.prefix_ids.is_empty()));
    }
    let ids = |text: &str| {
        request::parse(
            Api::Generate,
            json!({"text": text}).to_string().as_bytes(),
            None,
            &on,
        )
        .expect("parses")
        .instances[0]
            .prefix_ids
            .clone()
    };
    let (ab, ac) = (ids("p q r s"), ids("p q x"));
    assert_eq!(ab[..2], ac[..2]);
    assert_ne!(ab[2], ac[2]);
}

/// `pdgate sim`'s flags for the cache model reach the engine configuration; without them,
/// the defaults.
#[test]
fn the_cli_flags_set_the_cache_model() {
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        sim: crate::cli::SimArgs,
    }
    let near = |d: Duration, micros: u64| {
        d.abs_diff(Duration::from_micros(micros)) <= Duration::from_nanos(1)
    };
    let cli = Cli::try_parse_from([
        "sim",
        "--prefill-prefix-cache-tokens",
        "6000",
        "--decode-prefix-cache-tokens",
        "12000",
        "--prefix-cache-page-size",
        "8",
        "--prefill-per-token-ms",
        "0.8",
        "--decode-per-missing-token-ms",
        "0.2",
        "--enable-cache-report",
    ])
    .expect("parses");
    for role in [crate::Role::Prefill, crate::Role::Decode] {
        let c = cli.sim.config(role, 2);
        assert_eq!(c.prefill_prefix_cache_tokens, 6000);
        assert_eq!(c.decode_prefix_cache_tokens, 12000);
        assert_eq!(c.prefix_cache_page_size, 8);
        assert!(near(c.prefill_per_token, 800), "{:?}", c.prefill_per_token);
        assert!(
            near(c.decode_per_missing_token, 200),
            "{:?}",
            c.decode_per_missing_token
        );
        assert!(c.enable_cache_report);
    }
    assert_eq!(
        cli.sim
            .config(crate::Role::Prefill, 2)
            .prefix_cache_tokens(),
        6000
    );
    assert_eq!(
        cli.sim.config(crate::Role::Decode, 2).prefix_cache_tokens(),
        12000
    );
    assert_eq!(
        cli.sim
            .config(crate::Role::Regular, 2)
            .prefix_cache_tokens(),
        0
    );

    let bare = Cli::try_parse_from(["sim"]).expect("parses");
    let c = bare.sim.config(crate::Role::Prefill, 1);
    let d = EngineConfig::default();
    assert_eq!(
        (
            c.prefill_prefix_cache_tokens,
            c.decode_prefix_cache_tokens,
            c.prefix_cache_page_size
        ),
        (
            d.prefill_prefix_cache_tokens,
            d.decode_prefix_cache_tokens,
            d.prefix_cache_page_size
        )
    );
    assert_eq!(
        (
            c.prefill_per_token,
            c.decode_per_missing_token,
            c.enable_cache_report
        ),
        (
            d.prefill_per_token,
            d.decode_per_missing_token,
            d.enable_cache_report
        )
    );
    // A nonsense duration is no duration, not a panic.
    let neg = Cli::try_parse_from(["sim", "--prefill-per-token-ms=-3"]).expect("parses");
    assert_eq!(
        neg.sim.config(crate::Role::Prefill, 1).prefill_per_token,
        Duration::ZERO
    );
}
