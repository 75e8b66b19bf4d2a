//! Short-prompt bypass benchmark (POLICIES.md, "Short prompts on regular workers"): one
//! model served by a PD pair (one prefill, one decode) and one regular worker, all
//! simulated; an open-loop mix of short and long prompts at a fixed arrival rate; the
//! bypass threshold (`models.settings."NAME".short_prompt_tokens`) swept from off to "everything".
//!
//! Engines (simulated time, no GPU): a prompt costs 2 ms + 25 µs per token to compute, and
//! computes run one at a time per engine (the prefill with `serial_prefill`, the regular
//! worker always); decode: 2 ms to the first token, then 16 tokens 5 ms apart. A regular
//! worker's tokens wait while it computes a prompt (prefill before decode, no chunking):
//! the interference disaggregation removes. Workload: streamed `/generate` sent open loop
//! at 30 and then 55 requests/s (the pair's prefill saturates near 68/s), 60 % short
//! prompts (48 token ids), 20 % medium (400 ids), 20 % long (2000 ids).
//!
//! It reports per class the time to first byte (p50, p99) and the largest gap between two
//! chunks of a stream (p50, p99: a stall of decoding), and the run's throughput.
//!
//! Run: `cargo bench --bench bypass` (`PDGATE_BENCH_QUICK=1`: 120 requests per case
//! instead of 300).
//! A measurement, not a test: nothing here asserts on a time.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use pdgate::config::{Config, RegularWorkerConfig};
use pdgate::dispatch::RngSource;
use pdgate_sim::{EngineConfig, SimCluster};
use tokio::sync::Mutex;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Prompt sizes (token ids) of the three classes, and how many of every 5 requests each is.
const CLASSES: [(usize, usize); 3] = [(48, 3), (400, 1), (2000, 1)];

fn engine(mut e: EngineConfig) -> EngineConfig {
    e.model = "m".into();
    e.prefill_delay = Duration::from_millis(2);
    e.prefill_per_token = Duration::from_micros(25);
    e.serial_prefill = true;
    e.ttft = Duration::from_millis(2);
    e.itl = Duration::from_millis(5);
    e.sentinel_interval = Duration::from_millis(50);
    e.context_length = 100_000;
    e
}

fn body(tokens: usize) -> String {
    serde_json::json!({
        "input_ids": (0..tokens as u32).map(|i| 1000 + i % 5000).collect::<Vec<_>>(),
        "sampling_params": {"max_new_tokens": 16},
        "stream": true,
    })
    .to_string()
}

#[derive(Default)]
struct Samples {
    ttfb: Vec<f64>,
    gap: Vec<f64>,
    errors: usize,
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

async fn one(client: &HttpClient, url: &str, b: &str) -> Option<(f64, f64)> {
    let req = Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(b.to_string())))
        .ok()?;
    let start = Instant::now();
    let resp = client.request(req).await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    let mut body = resp.into_body();
    let mut first = None;
    let mut last = Instant::now();
    let mut gap = 0f64;
    while let Some(f) = body.frame().await {
        let f = f.ok()?;
        if f.data_ref().is_some_and(|d| !d.is_empty()) {
            let now = Instant::now();
            match first {
                None => first = Some(now.duration_since(start).as_secs_f64() * 1e3),
                Some(_) => gap = gap.max(now.duration_since(last).as_secs_f64() * 1e3),
            }
            last = now;
        }
    }
    Some((first?, gap))
}

async fn run_case(
    threshold: Option<u32>,
    rate: f64,
    total: usize,
) -> (Vec<Samples>, f64, [u64; 3]) {
    let cluster = SimCluster::spawn(
        &[engine(EngineConfig::prefill(1))],
        &[engine(EngineConfig::decode(1))],
    )
    .await
    .expect("sim");
    let regular = pdgate_sim::spawn(engine(EngineConfig::regular(1)))
        .await
        .expect("regular");
    let mut cfg = Config::default();
    cfg.add_workers(cluster.prefill_endpoints(), cluster.decode_urls());
    cfg.worker = vec![RegularWorkerConfig {
        url: regular.url(),
        model: None,
    }];
    if let Some(t) = threshold {
        cfg.models
            .settings
            .entry("m".into())
            .or_default()
            .short_prompt_tokens = Some(t);
    }
    cfg.server.drain_secs = 1;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let router = pdgate::router::start(cfg, Some(listener), RngSource::Os)
        .await
        .expect("router");
    let deadline = Instant::now() + Duration::from_secs(10);
    while {
        let s = router.pool.load();
        s.routable_ranks(pdgate::types::Role::Prefill) == 0
            || s.routable_ranks(pdgate::types::Role::Regular) == 0
            || s.models.is_empty()
    } {
        assert!(Instant::now() < deadline, "fleet not routable");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let url = format!("{}/generate", router.url());
    let client: HttpClient = {
        let mut c = HttpConnector::new();
        c.set_nodelay(true);
        Client::builder(TokioExecutor::new()).build(c)
    };
    let samples: Arc<Vec<Mutex<Samples>>> =
        Arc::new(CLASSES.iter().map(|_| Mutex::default()).collect());
    let bodies: Arc<Vec<String>> = Arc::new(CLASSES.iter().map(|(n, _)| body(*n)).collect());
    // Request i's class: by position in each run of 5.
    let class_of = |i: usize| {
        let mut k = i % 5;
        for (c, (_, share)) in CLASSES.iter().enumerate() {
            if k < *share {
                return c;
            }
            k -= share;
        }
        0
    };
    let start = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    let mut tasks = Vec::with_capacity(total);
    for i in 0..total {
        tick.tick().await;
        let (client, url) = (client.clone(), url.clone());
        let (samples, bodies) = (samples.clone(), bodies.clone());
        let c = class_of(i);
        tasks.push(tokio::spawn(async move {
            let r = one(&client, &url, &bodies[c]).await;
            let mut s = samples[c].lock().await;
            match r {
                Some((t, g)) => {
                    s.ttfb.push(t);
                    s.gap.push(g);
                }
                None => s.errors += 1,
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let secs = start.elapsed().as_secs_f64();
    let counts = [
        cluster.prefills[0].stats().requests_total,
        cluster.decodes[0].stats().requests_total,
        regular.stats().requests_total,
    ];
    router.server.shutdown().await;
    regular.shutdown();
    let samples = match Arc::try_unwrap(samples) {
        Ok(v) => v.into_iter().map(Mutex::into_inner).collect(),
        Err(_) => Vec::new(),
    };
    (samples, total as f64 / secs, counts)
}

fn main() {
    let quick = std::env::var("PDGATE_BENCH_QUICK").is_ok();
    let total = if quick { 120 } else { 300 };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    println!(
        "| rate | bypass threshold | prompt | ttfb p50 / p99 | max gap p50 / p99 | done req/s | prefill / decode / regular legs | errors |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (rate, threshold) in [30.0, 55.0]
        .into_iter()
        .flat_map(|r| [None, Some(64), Some(512), Some(4096)].map(|t| (r, t)))
    {
        let (mut samples, rps, c) = rt.block_on(run_case(threshold, rate, total));
        for (k, s) in samples.iter_mut().enumerate() {
            println!(
                "| {rate}/s | {} | {} ids | {:.1} / {:.1} ms | {:.1} / {:.1} ms | {:.1} | {} / {} / {} | {} |",
                threshold.map_or("off".to_string(), |t| format!("{t} tokens")),
                CLASSES[k].0,
                pct(&mut s.ttfb, 0.5),
                pct(&mut s.ttfb, 0.99),
                pct(&mut s.gap, 0.5),
                pct(&mut s.gap, 0.99),
                rps,
                c[0],
                c[1],
                c[2],
                s.errors,
            );
        }
    }
}
