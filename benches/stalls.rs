//! Stall benchmark: what a hung engine (health and bootstrap fine, no progress) costs the
//! clients, with stall detection on (`[progress]` defaults) and off (`progress.enabled =
//! false`: only the fixed leg timeouts, here the production defaults except a 30 s prefill
//! timeout and a 20 s decode first-byte timeout so that a run stays bounded).
//!
//! Each case: two prefills and one decode (or one prefill and two decodes, or two regular
//! workers: SGLang's plain mode, no PD pair) from the simulator, prefill 20 ms, decode 4
//! tokens; 20 warm-up requests; then the fault is set on one engine and N requests are sent
//! open loop at 10 requests/s (the issue's setup). The decode and regular cases stream their
//! requests: a decode's wait for its first token, and a regular worker's for its first
//! event, are judged only for a stream (a non-streamed answer's first byte comes with the
//! whole answer, so it has the fixed timeout alone); a prefill is judged either way. It
//! reports the latency of the requests sent after the fault (p50, p99, max, how many took
//! over 250 ms), the client errors, the requests retried, and how many requests the hung
//! engine received in the second half of the run (after detection only its probes: one
//! after 1 s, then 2 s, 4 s, ... later).
//!
//! Run: `cargo bench --bench stalls` (`PDGATE_BENCH_QUICK=1`: N = 20 instead of 60).
//! A measurement, not a test: nothing here asserts on a time.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use pdgate::config::Config;
use pdgate::dispatch::RngSource;
use pdgate_sim::{EngineConfig, Faults, SimCluster, SimEngine};

type HttpClient = Client<HttpConnector, Full<Bytes>>;

const BODY: &str = r#"{"text":"hello there","sampling_params":{"max_new_tokens":4}}"#;
const BODY_STREAM: &str =
    r#"{"text":"hello there","sampling_params":{"max_new_tokens":4},"stream":true}"#;

fn engine(mut e: EngineConfig) -> EngineConfig {
    e.prefill_delay = Duration::from_millis(20);
    e.ttft = Duration::from_millis(2);
    e.itl = Duration::from_millis(2);
    e.sentinel_interval = Duration::from_millis(50);
    e.waiting_timeout = Duration::from_secs(60);
    e.bootstrap_timeout = Duration::from_secs(60);
    e
}

fn config(detect: bool) -> Config {
    let mut c = Config::default();
    c.progress.enabled = detect;
    c.timeouts.prefill_secs = 30;
    c.timeouts.decode_first_byte_secs = 20;
    c.timeouts.request_secs = 60;
    c.server.drain_secs = 1;
    c
}

#[derive(Clone, Copy, PartialEq)]
enum Hung {
    Prefill,
    Decode,
    Regular,
}

struct Row {
    fault: &'static str,
    detect: bool,
    lat_ms: Vec<f64>,
    errors: usize,
    retried: usize,
    slow: usize,
    late_to_hung: u64,
}

async fn post(client: &HttpClient, url: &str, body: &'static str) -> (u16, Duration) {
    let t = Instant::now();
    let req = Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .expect("request");
    let fut = async {
        let resp = client.request(req).await.ok()?;
        let st = resp.status().as_u16();
        let answer = resp.into_body().collect().await.ok()?.to_bytes();
        // A stream that ended with an error event is an error too.
        let failed = answer.windows(9).any(|w| w == b"\"error\":{");
        Some(if failed { 502 } else { st })
    };
    let st = tokio::time::timeout(Duration::from_secs(60), fut)
        .await
        .ok()
        .flatten()
        .unwrap_or(0);
    (st, t.elapsed())
}

/// The request ids an engine saw a second (or later) attempt of.
fn retried_ids(e: &SimEngine) -> Vec<String> {
    e.recent_rids()
        .iter()
        .filter_map(|r| {
            let (head, tail) = r.rsplit_once('-')?;
            (!tail.starts_with("00")).then(|| head.to_string())
        })
        .collect()
}

async fn case(fault: Hung, detect: bool, n: usize) -> Row {
    let (p, d, r) = match fault {
        Hung::Prefill => (2, 1, 0),
        Hung::Decode => (1, 2, 0),
        Hung::Regular => (0, 0, 2),
    };
    let prefill: Vec<_> = (0..p).map(|_| engine(EngineConfig::prefill(1))).collect();
    let decode: Vec<_> = (0..d).map(|_| engine(EngineConfig::decode(1))).collect();
    let cluster = SimCluster::spawn(&prefill, &decode).await.expect("cluster");
    let mut regular = Vec::new();
    for _ in 0..r {
        let e = pdgate_sim::spawn(engine(EngineConfig::regular(1))).await;
        regular.push(e.expect("regular engine"));
    }
    let mut cfg = config(detect);
    cfg.add_workers(cluster.prefill_endpoints(), cluster.decode_urls());
    cfg.add_regular_workers(regular.iter().map(SimEngine::url));
    let body = if fault == Hung::Prefill {
        BODY
    } else {
        BODY_STREAM
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let router = pdgate::router::start_with(
        cfg,
        Some(listener),
        pdgate::router::AdminListener::Off,
        RngSource::Seeded(1.into()),
    )
    .await
    .expect("router");
    let url = format!("{}/generate", router.url());
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    let client: HttpClient = Client::builder(TokioExecutor::new()).build(conn);
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline && post(&client, &url, body).await.0 != 200 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Both regular workers serving (the first answer came from one of them).
    while Instant::now() < deadline
        && router
            .pool
            .load()
            .routable_ranks(pdgate::types::Role::Regular)
            < r
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for _ in 0..20 {
        post(&client, &url, body).await;
    }
    let hung = match fault {
        Hung::Prefill => &cluster.prefills[0],
        Hung::Decode => &cluster.decodes[0],
        Hung::Regular => &regular[0],
    };
    hung.set_faults(Faults {
        prefill_hang: fault != Hung::Decode,
        decode_hang: fault == Hung::Decode,
        ..Faults::default()
    });
    let mut tasks = Vec::new();
    let mut half = 0;
    for i in 0..n {
        if i == n / 2 {
            half = hung.stats().requests_total;
        }
        let (c, u) = (client.clone(), url.clone());
        tasks.push(tokio::spawn(async move { post(&c, &u, body).await }));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let late_to_hung = hung.stats().requests_total - half;
    let mut row = Row {
        fault: match fault {
            Hung::Prefill => "prefill hangs (1 of 2)",
            Hung::Decode => "decode hangs before its first token (1 of 2; streamed)",
            Hung::Regular => "regular worker hangs before its first event (1 of 2; streamed)",
        },
        detect,
        lat_ms: Vec::new(),
        errors: 0,
        retried: 0,
        slow: 0,
        late_to_hung,
    };
    for t in tasks {
        let (st, took) = t.await.expect("task");
        if st != 200 {
            row.errors += 1;
        }
        row.lat_ms.push(took.as_secs_f64() * 1000.0);
    }
    let ids: std::collections::BTreeSet<String> = cluster
        .engines()
        .chain(regular.iter())
        .flat_map(retried_ids)
        .collect();
    row.retried = ids.len();
    row.slow = row.lat_ms.iter().filter(|ms| **ms > 250.0).count();
    row.lat_ms.sort_by(f64::total_cmp);
    row
}

fn pct(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)]
}

fn main() {
    let quick = std::env::var("PDGATE_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
    let n = if quick { 20 } else { 60 };
    let mut rows = Vec::new();
    for fault in [Hung::Prefill, Hung::Decode, Hung::Regular] {
        for detect in [true, false] {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime");
            let t0 = Instant::now();
            rows.push(rt.block_on(case(fault, detect, n)));
            rt.shutdown_timeout(Duration::from_millis(500));
            eprintln!("[stalls] case done in {:.1} s", t0.elapsed().as_secs_f64());
        }
    }
    println!("N = {n} requests at 10/s after the fault (prefill 20 ms, 4 tokens)\n");
    println!("| fault | stall detection | p50 ms | p99 ms | max ms | > 250 ms | client errors | requests retried | requests to the hung engine, 2nd half |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        println!(
            "| {} | {} | {:.0} | {:.0} | {:.0} | {} | {} | {} | {} |",
            r.fault,
            if r.detect { "on" } else { "off" },
            pct(&r.lat_ms, 0.5),
            pct(&r.lat_ms, 0.99),
            pct(&r.lat_ms, 1.0),
            r.slow,
            r.errors,
            r.retried,
            r.late_to_hung
        );
    }
}
