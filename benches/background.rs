//! Background load bench (issue 18, item 5): the requests idle routers send each engine,
//! against the number of router replicas and the prefill's DP size.
//!
//! N real router instances (1, 10, 50, 100), each with the default settings, run in one
//! process in front of the same simulated engines: prefills of DP 1, 8 and 32 and one
//! decode. Nothing is sent to the routers; the simulator counts what each of its servers
//! received (`SimEngine::hits`) over the window, after the routers settled. Reported per
//! engine: requests a second on the prefill's bootstrap server (the sentinel heartbeat and
//! the rank-route re-reads) and on its engine port (health checks; load polling is off by
//! default), in total and per replica.
//!
//! Time: by default the window runs on tokio's paused clock (timers virtual, sockets
//! real: every request is a real HTTP request the simulator answered), so a 120 s window
//! over 100 replicas takes seconds. `PDGATE_BENCH_REAL=1` runs a real-time window instead
//! (10 s; shorter with `PDGATE_BENCH_QUICK=1`), the cross-check that the paused clock
//! does not change the counts.
//!
//! Run: `cargo bench --bench background`. A measurement, not a test: nothing asserts.

use std::time::{Duration, Instant};

use pdgate::config::Config;
use pdgate::dispatch::RngSource;
use pdgate_sim::{EngineConfig, HitsSnapshot, SimCluster};

const DPS: [u32; 3] = [1, 8, 32];

fn env_on(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| !v.is_empty() && v != "0")
}

struct Row {
    replicas: usize,
    dp: u32,
    window: Duration,
    hits: HitsSnapshot,
}

async fn measure(replicas: usize, window: Duration) -> Vec<Row> {
    let prefills: Vec<EngineConfig> = DPS.iter().map(|d| EngineConfig::prefill(*d)).collect();
    let cluster = SimCluster::spawn(&prefills, &[EngineConfig::decode(1)])
        .await
        .expect("sim cluster");
    let mut routers = Vec::with_capacity(replicas);
    for _ in 0..replicas {
        let mut cfg = Config::default();
        cfg.add_workers(cluster.prefill_endpoints(), cluster.decode_urls());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let router = pdgate::router::start(cfg, Some(listener), RngSource::Os)
            .await
            .expect("router");
        routers.push(router);
    }
    // Settled: every router learned every prefill's layout and ranks.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let want: usize = DPS.iter().map(|d| *d as usize).sum();
    while routers
        .iter()
        .any(|r| r.pool.load().routable_ranks(pdgate::types::Role::Prefill) != want)
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "routers not settled"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before: Vec<HitsSnapshot> = cluster.prefills.iter().map(|p| p.hits()).collect();
    tokio::time::sleep(window).await;
    let rows = cluster
        .prefills
        .iter()
        .zip(before)
        .zip(DPS)
        .map(|((p, b), dp)| Row {
            replicas,
            dp,
            window,
            hits: p.hits().since(&b),
        })
        .collect();
    drop(routers);
    rows
}

fn run(replicas: usize, real: bool, window: Duration) -> Vec<Row> {
    let mut b = tokio::runtime::Builder::new_current_thread();
    b.enable_all();
    if !real {
        b.start_paused(true);
    }
    let rt = b.build().expect("runtime");
    let t0 = Instant::now();
    let rows = rt.block_on(measure(replicas, window));
    rt.shutdown_timeout(Duration::from_millis(500));
    eprintln!(
        "[background] {replicas} replicas: {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    rows
}

fn main() {
    let quick = env_on("PDGATE_BENCH_QUICK");
    let real = env_on("PDGATE_BENCH_REAL");
    let window = match (real, quick) {
        (true, true) => Duration::from_secs(3),
        (true, false) => Duration::from_secs(10),
        (false, true) => Duration::from_secs(30),
        (false, false) => Duration::from_secs(120),
    };
    let counts: &[usize] = if quick { &[1, 10] } else { &[1, 10, 50, 100] };
    let mut rows = Vec::new();
    for n in counts {
        rows.extend(run(*n, real, window));
    }
    let d = Config::default().bootstrap;
    println!(
        "\nIdle routers, default settings (heartbeat {} ms, refresh {} ms ± {:.0} %, route budget {}/s); window {} s on the {} clock.\n",
        d.heartbeat_interval_ms,
        d.refresh_interval_ms,
        d.refresh_jitter * 100.0,
        d.max_route_reads_per_sec,
        window.as_secs(),
        if real { "real" } else { "paused" }
    );
    println!("| replicas | prefill DP | bootstrap req/s | of which sentinel (liveness) | rank-route reads/s | `GET /health` on bootstrap | per replica | engine port req/s (health) | per replica |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        let s = r.window.as_secs_f64();
        let boot = r.hits.bootstrap_total() as f64 / s;
        let routes = r.hits.bootstrap("GET /route") as f64 / s;
        // One sentinel per beat; the rest of `GET /route` are the re-reads (a sentinel
        // and the DP routes each).
        let beats = r.replicas as f64 * 1000.0 / d.heartbeat_interval_ms as f64;
        let engine = r.hits.engine_background() as f64 / s;
        println!(
            "| {} | {} | {:.1} | {:.1} | {:.2} | {:.0} | {:.2} | {:.1} | {:.2} |",
            r.replicas,
            r.dp,
            boot,
            beats.min(routes),
            (routes - beats).max(0.0),
            r.hits.bootstrap("GET /health") as f64 / s,
            boot / r.replicas as f64,
            engine,
            engine / r.replicas as f64,
        );
    }
}
