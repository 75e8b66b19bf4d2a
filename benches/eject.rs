//! Eject and re-admit times with the **default** health, heartbeat and breaker settings:
//! how long after a prefill, one of its DP ranks, or a decode dies pdgate stops routing to
//! it (idle, and under load), and how long after it recovers pdgate routes to it again.
//!
//! In-process: simulated engines and the router share one runtime; the router's pool
//! snapshot is polled every 2 ms. Bounded: `PDGATE_BENCH_REPEATS` (default 5) repetitions
//! per scenario, each capped at 10 s. Run: `cargo bench --bench eject`.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use pdgate::config::Config;
use pdgate::dispatch::RngSource;
use pdgate::pool::Snapshot;
use pdgate::router::Router;
use pdgate::types::{Role, WorkerId};
use pdgate_sim::{EngineConfig, Faults, SimCluster};

struct Bench {
    cluster: SimCluster,
    router: Router,
}

async fn setup() -> Bench {
    let quick = |mut e: EngineConfig| {
        e.prefill_delay = Duration::from_millis(1);
        e.ttft = Duration::from_millis(1);
        e.itl = Duration::from_millis(1);
        e.default_output_tokens = 2;
        e
    };
    let cluster = SimCluster::spawn(
        &[
            quick(EngineConfig::prefill(2)),
            quick(EngineConfig::prefill(2)),
        ],
        &[
            quick(EngineConfig::decode(1)),
            quick(EngineConfig::decode(1)),
        ],
    )
    .await
    .expect("sim");
    let mut cfg = Config::default();
    cfg.add_workers(cluster.prefill_endpoints(), cluster.decode_urls());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let router = pdgate::router::start(cfg, Some(listener), RngSource::Os)
        .await
        .expect("router");
    let b = Bench { cluster, router };
    b.wait("all routable", |s| {
        s.routable_ranks(Role::Prefill) == 4 && s.routable_ranks(Role::Decode) == 2
    })
    .await;
    b
}

impl Bench {
    /// Time until `f` holds on the router's snapshot (polled every 2 ms, capped at 10 s).
    async fn wait(&self, what: &str, f: impl Fn(&Snapshot) -> bool) -> Duration {
        let start = Instant::now();
        while !f(&self.router.pool.load()) {
            if start.elapsed() > Duration::from_secs(10) {
                eprintln!("timed out: {what}");
                return start.elapsed();
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        start.elapsed()
    }
}

fn out(role: Role, w: u32) -> impl Fn(&Snapshot) -> bool {
    move |s| s.routable(role).iter().all(|r| r.worker != WorkerId(w))
}

fn back(role: Role, w: u32, ranks: usize) -> impl Fn(&Snapshot) -> bool {
    move |s| {
        s.routable(role)
            .iter()
            .any(|r| r.worker == WorkerId(w) && r.ranks.len() == ranks)
    }
}

fn rank_out(w: u32, rank: u32) -> impl Fn(&Snapshot) -> bool {
    move |s| {
        !s.prefill_routable
            .iter()
            .any(|r| r.worker == WorkerId(w) && r.ranks.contains(&rank))
    }
}

/// Closed-loop load (4 clients) until `stop`; returns (requests, errors before first byte).
fn start_load(url: String, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<(usize, usize)> {
    tokio::spawn(async move {
        let mut c = HttpConnector::new();
        c.set_nodelay(true);
        let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(c);
        let done = Arc::new(AtomicUsize::new(0));
        let errors = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for _ in 0..4 {
            let (client, url, stop, done, errors) = (
                client.clone(),
                url.clone(),
                stop.clone(),
                done.clone(),
                errors.clone(),
            );
            tasks.push(tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) && done.load(Ordering::Relaxed) < 200_000 {
                    let req = http::Request::post(format!("{url}/generate"))
                        .header("content-type", "application/json")
                        .body(Full::new(Bytes::from_static(
                            br#"{"text":"a","sampling_params":{"max_new_tokens":2}}"#,
                        )))
                        .expect("request");
                    let ok = match client.request(req).await {
                        Ok(r) => r.status() == 200 && r.into_body().collect().await.is_ok(),
                        Err(_) => false,
                    };
                    done.fetch_add(1, Ordering::Relaxed);
                    if !ok {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }));
        }
        for t in tasks {
            let _ = t.await;
        }
        (done.load(Ordering::Relaxed), errors.load(Ordering::Relaxed))
    })
}

fn summary(name: &str, xs: &mut [Duration], extra: &str) {
    xs.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let p50 = xs.get(xs.len() / 2).copied().unwrap_or_default();
    let max = xs.last().copied().unwrap_or_default();
    println!(
        "| {name} | {:.0} | {:.0} | {} | {extra} |",
        ms(p50),
        ms(max),
        xs.len()
    );
}

fn main() {
    let repeats: usize = std::env::var("PDGATE_BENCH_REPEATS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        println!("Defaults: health every 0.5 s (2 failures out, 1 success back), bootstrap heartbeat every 0.5 s (2 misses = lost), refresh 0.5 s, breaker 3 failures → open 1 s.\n");
        println!("| scenario | p50 ms | max ms | runs | notes |");
        println!("|---|---|---|---|---|");
        let b = setup().await;
        let (mut eject_idle, mut readmit) = (Vec::new(), Vec::new());
        for _ in 0..repeats {
            b.cluster.prefills[0].set_down(true);
            eject_idle.push(b.wait("prefill out", out(Role::Prefill, 0)).await);
            b.cluster.prefills[0].set_down(false);
            readmit.push(b.wait("prefill back", back(Role::Prefill, 0, 2)).await);
        }
        summary("prefill killed, idle → out of rotation", &mut eject_idle, "active health + bootstrap heartbeat");
        summary("prefill restarted → routable again", &mut readmit, "first good health check + bootstrap refresh");

        let (mut eject_load, mut readmit_load) = (Vec::new(), Vec::new());
        let (mut reqs, mut errs) = (0, 0);
        for _ in 0..repeats {
            let stop = Arc::new(AtomicBool::new(false));
            let load = start_load(b.router.url(), stop.clone());
            tokio::time::sleep(Duration::from_millis(100)).await;
            b.cluster.prefills[0].set_down(true);
            eject_load.push(b.wait("prefill out under load", out(Role::Prefill, 0)).await);
            tokio::time::sleep(Duration::from_millis(100)).await;
            b.cluster.prefills[0].set_down(false);
            readmit_load.push(b.wait("prefill back under load", back(Role::Prefill, 0, 2)).await);
            stop.store(true, Ordering::Relaxed);
            let (r, e) = load.await.unwrap_or((0, 0));
            reqs += r;
            errs += e;
        }
        summary("prefill killed under load → out", &mut eject_load, &format!("passive breaker; client errors {errs} of {reqs} requests"));
        summary("prefill restarted under load → routable", &mut readmit_load, "breaker half-open trial or health");

        let (mut rank_eject, mut rank_back) = (Vec::new(), Vec::new());
        for _ in 0..repeats {
            b.cluster.prefills[1].set_faults(Faults { unregistered_ranks: vec![1], ..Faults::default() });
            rank_eject.push(b.wait("rank out", rank_out(1, 1)).await);
            b.cluster.prefills[1].set_faults(Faults::default());
            rank_back.push(b.wait("rank back", back(Role::Prefill, 1, 2)).await);
        }
        summary("DP rank unregistered → out", &mut rank_eject, "bootstrap refresh (sentinel 503)");
        summary("DP rank re-registered → routable", &mut rank_back, "bootstrap refresh");

        let (mut d_out, mut d_back) = (Vec::new(), Vec::new());
        for _ in 0..repeats {
            b.cluster.decodes[0].set_down(true);
            d_out.push(b.wait("decode out", out(Role::Decode, 0)).await);
            b.cluster.decodes[0].set_down(false);
            d_back.push(b.wait("decode back", back(Role::Decode, 0, 1)).await);
        }
        summary("decode killed, idle → out", &mut d_out, "active health");
        summary("decode restarted → routable", &mut d_back, "active health");
    });
}
