//! Load benchmark: pdgate (a separate `pdgate serve` process) in front of simulated engines
//! (a separate `pdgate sim` process), against a zero-overhead "direct" client that sends the
//! two legs itself, with the same bootstrap fields, to the same simulated engines.
//!
//! Measured per (route, concurrency, target): requests/s, p50/p99 latency, errors, the
//! router's CPU per request (the scheduler's exact count from `/proc/<pid>/task/*/schedstat`;
//! its user/sys split sampled at the clock tick from `/proc/<pid>/stat`), the simulator's CPU
//! per request (for context), the router's RSS after the concurrency-256 run, and the time to
//! the first streamed chunk over a kept-alive connection.
//!
//! Run: `cargo build --release --bin pdgate && cargo bench --bench load`
//! (`PDGATE_BENCH_QUICK=1` for a smoke run; `PDGATE_BIN=/path/to/pdgate` to pick a binary;
//! `PDGATE_BENCH_ROUTER_ARGS="--log-level warn"` to pass extra flags to `pdgate serve`).
//! This is a measurement, not a test: nothing here asserts on a time.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;

mod support;
use support::*;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

// ---------------------------------------------------------------------------------------
// Settings

struct Settings {
    quick: bool,
    concurrency: Vec<usize>,
    warmup: Duration,
    duration: Duration,
    max_requests: u64,
    tokens: u32,
}

impl Settings {
    fn from_env() -> Settings {
        let quick = std::env::var("PDGATE_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
        if quick {
            Settings {
                quick,
                concurrency: vec![1, 16, 64, 256],
                warmup: Duration::from_millis(100),
                duration: Duration::from_millis(300),
                max_requests: 2_000,
                tokens: 4,
            }
        } else {
            Settings {
                quick,
                concurrency: vec![1, 16, 64, 256],
                warmup: Duration::from_millis(300),
                duration: Duration::from_secs(2),
                max_requests: 20_000,
                tokens: 4,
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Requests

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Route {
    /// Non-streamed `/generate`.
    Generate,
    /// Streamed `/v1/chat/completions`.
    ChatStream,
}

impl Route {
    fn label(self) -> &'static str {
        match self {
            Route::Generate => "/generate (non-streamed)",
            Route::ChatStream => "/v1/chat/completions (streamed)",
        }
    }
    fn path(self) -> &'static str {
        match self {
            Route::Generate => "/generate",
            Route::ChatStream => "/v1/chat/completions",
        }
    }
    fn stream(self) -> bool {
        self == Route::ChatStream
    }
    /// The client's body (what pdgate receives).
    fn client_body(self, tokens: u32) -> String {
        match self {
            Route::Generate => format!(
                r#"{{"text":"The capital of France is","sampling_params":{{"max_new_tokens":{tokens},"temperature":0}}}}"#
            ),
            Route::ChatStream => format!(
                r#"{{"model":"sim-model","messages":[{{"role":"user","content":"The capital of France is"}}],"max_tokens":{tokens},"stream":true}}"#
            ),
        }
    }
    /// One leg as a zero-overhead router would write it.
    fn leg_body(self, tokens: u32, port: u16, room: u64, rid: &str, stream: bool) -> String {
        let pd = format!(
            r#""bootstrap_host":"127.0.0.1","bootstrap_port":{port},"bootstrap_room":{room},"rid":"{rid}","stream":{stream}"#
        );
        match self {
            Route::Generate => format!(
                r#"{{"text":"The capital of France is","sampling_params":{{"max_new_tokens":{tokens},"temperature":0}},{pd}}}"#
            ),
            Route::ChatStream => format!(
                r#"{{"model":"sim-model","messages":[{{"role":"user","content":"The capital of France is"}}],"max_tokens":{tokens},{pd}}}"#
            ),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Target {
    Direct,
    Pdgate,
}

impl Target {
    fn label(self) -> &'static str {
        match self {
            Target::Direct => "direct",
            Target::Pdgate => "pdgate",
        }
    }
}

struct Endpoints {
    router: String,
    prefill: String,
    decode: String,
    bootstrap_port: u16,
    tokens: u32,
}

fn post(url: String, body: String) -> Request<Full<Bytes>> {
    Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("request")
}

/// Sends one request and reads the whole answer; returns (time to first body chunk, total).
async fn read_answer(
    client: &HttpClient,
    req: Request<Full<Bytes>>,
    t0: Instant,
    stream: bool,
) -> Result<(Duration, Duration), String> {
    let resp = client
        .request(req)
        .await
        .map_err(|e| format!("request: {e}"))?;
    let status = resp.status();
    let mut body = resp.into_body();
    let mut first = None;
    let mut tail: Vec<u8> = Vec::new();
    let mut errored = false;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| format!("body: {e}"))?;
        if let Ok(data) = frame.into_data() {
            if data.is_empty() {
                continue;
            }
            if first.is_none() {
                first = Some(t0.elapsed());
            }
            if stream && memchr::memmem::find(&data, b"\"error\"").is_some() {
                errored = true;
            }
            tail.clear();
            tail.extend_from_slice(&data[data.len().saturating_sub(16)..]);
        }
    }
    let total = t0.elapsed();
    if status != StatusCode::OK {
        return Err(format!("status {status}"));
    }
    if stream && (errored || memchr::memmem::find(&tail, b"[DONE]").is_none()) {
        return Err("stream without [DONE] or with an error event".to_string());
    }
    Ok((first.unwrap_or(total), total))
}

/// One request through `target`: (time to first chunk of the answer, total latency).
async fn one(
    client: &HttpClient,
    ep: &Endpoints,
    route: Route,
    target: Target,
    seq: u64,
) -> Result<(Duration, Duration), String> {
    let t0 = Instant::now();
    match target {
        Target::Pdgate => {
            let req = post(
                format!("{}{}", ep.router, route.path()),
                route.client_body(ep.tokens),
            );
            read_answer(client, req, t0, route.stream()).await
        }
        Target::Direct => {
            // What a router with zero overhead does: both legs at once, same bootstrap
            // fields, the answer is decode's; the request is done when both legs are.
            let room = rand::random::<u64>() >> 1;
            let rid = format!("bench-{:016x}", seq ^ (room << 20));
            let pbody = route.leg_body(
                ep.tokens,
                ep.bootstrap_port,
                room,
                &format!("{rid}-p"),
                false,
            );
            let dbody = route.leg_body(
                ep.tokens,
                ep.bootstrap_port,
                room,
                &format!("{rid}-d"),
                route.stream(),
            );
            let preq = post(format!("{}{}", ep.prefill, route.path()), pbody);
            let dreq = post(format!("{}{}", ep.decode, route.path()), dbody);
            let (p, d) = tokio::join!(
                read_answer(client, preq, t0, false),
                read_answer(client, dreq, t0, route.stream())
            );
            p.map_err(|e| format!("prefill leg: {e}"))?;
            let (first, _) = d.map_err(|e| format!("decode leg: {e}"))?;
            Ok((first, t0.elapsed()))
        }
    }
}

// ---------------------------------------------------------------------------------------
// Closed-loop load

struct PointResult {
    ok: u64,
    errors: u64,
    first_error: Option<String>,
    elapsed: Duration,
    lat_us: Vec<u32>,
    first_chunk_us: Vec<u32>,
    /// (utime, stime) ticks: the split, sampled at the clock tick.
    router_ticks: (u64, u64),
    /// Exact time on a CPU (schedstat), in ns: the totals.
    router_ns: u64,
    sim_ns: u64,
    listen_overflows: u64,
    /// Router VmRSS (KiB) right after the point.
    router_rss: u64,
}

impl PointResult {
    fn rps(&self) -> f64 {
        self.ok as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

fn pct(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    f64::from(sorted[i.min(sorted.len() - 1)]) / 1000.0
}

#[allow(clippy::too_many_arguments)]
async fn run_point(
    client: &HttpClient,
    ep: &Arc<Endpoints>,
    route: Route,
    target: Target,
    conc: usize,
    dur: Duration,
    max: u64,
    pids: (u32, u32),
) -> PointResult {
    let issued = Arc::new(AtomicU64::new(0));
    let r0 = cpu_ticks(pids.0);
    let (rn0, sn0) = (cpu_ns(pids.0), cpu_ns(pids.1));
    let lo0 = listen_overflows();
    let start = Instant::now();
    let stop_at = start + dur;
    let mut tasks = Vec::with_capacity(conc);
    for _ in 0..conc {
        let client = client.clone();
        let ep = ep.clone();
        let issued = issued.clone();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut first = Vec::new();
            let (mut ok, mut errors, mut first_error) = (0u64, 0u64, None);
            loop {
                if Instant::now() >= stop_at {
                    break;
                }
                let seq = issued.fetch_add(1, Ordering::Relaxed);
                if seq >= max {
                    break;
                }
                match tokio::time::timeout(
                    Duration::from_secs(10),
                    one(&client, &ep, route, target, seq),
                )
                .await
                {
                    Ok(Ok((f, t))) => {
                        ok += 1;
                        lat.push(t.as_micros().min(u128::from(u32::MAX)) as u32);
                        first.push(f.as_micros().min(u128::from(u32::MAX)) as u32);
                    }
                    Ok(Err(e)) => {
                        errors += 1;
                        first_error.get_or_insert(e);
                    }
                    Err(_) => {
                        errors += 1;
                        first_error.get_or_insert_with(|| "client timeout (10 s)".to_string());
                    }
                }
            }
            (lat, first, ok, errors, first_error)
        }));
    }
    let mut res = PointResult {
        ok: 0,
        errors: 0,
        first_error: None,
        elapsed: Duration::ZERO,
        lat_us: Vec::new(),
        first_chunk_us: Vec::new(),
        router_ticks: (0, 0),
        router_ns: 0,
        sim_ns: 0,
        listen_overflows: 0,
        router_rss: 0,
    };
    for t in tasks {
        let (lat, first, ok, errors, fe) = t.await.expect("load task");
        res.lat_us.extend(lat);
        res.first_chunk_us.extend(first);
        res.ok += ok;
        res.errors += errors;
        if res.first_error.is_none() {
            res.first_error = fe;
        }
    }
    res.elapsed = start.elapsed();
    let r1 = cpu_ticks(pids.0);
    let (rn1, sn1) = (cpu_ns(pids.0), cpu_ns(pids.1));
    res.router_ticks = (r1.0.saturating_sub(r0.0), r1.1.saturating_sub(r0.1));
    res.router_ns = rn1.saturating_sub(rn0);
    res.sim_ns = sn1.saturating_sub(sn0);
    res.listen_overflows = listen_overflows().saturating_sub(lo0);
    res.router_rss = rss_kib(pids.0).0;
    res.lat_us.sort_unstable();
    res.first_chunk_us.sort_unstable();
    res
}

async fn wait_ready(client: &HttpClient, router: &str) -> Result<Duration, String> {
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs(20);
    loop {
        let req = Request::get(format!("{router}/readiness"))
            .body(Full::new(Bytes::new()))
            .expect("req");
        if let Ok(Ok(r)) = tokio::time::timeout(Duration::from_secs(1), client.request(req)).await {
            let ok = r.status() == StatusCode::OK;
            let _ = r.into_body().collect().await;
            if ok {
                return Ok(t0.elapsed());
            }
        }
        if Instant::now() > deadline {
            return Err("router not ready within 20 s".to_string());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ---------------------------------------------------------------------------------------
// Report

struct Row {
    route: Route,
    conc: usize,
    target: Target,
    res: PointResult,
}

fn main() {
    let settings = Settings::from_env();
    let bin = pdgate_bin();
    let tck = clk_tck();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    eprintln!(
        "[load] binary {} · {cores} cores · CLK_TCK {tck} · quick={} · extra router flags: {:?}",
        bin.display(),
        settings.quick,
        std::env::var("PDGATE_BENCH_ROUTER_ARGS").unwrap_or_default()
    );

    let (sim_proc, sim) = start_sim(&bin, settings.tokens);
    let (router_proc, router_url) = start_router(&bin, &sim);
    let pids = (router_proc.pid(), sim_proc.pid());
    eprintln!(
        "[load] sim pid {} (prefill {} bootstrap {}, decode {}), router pid {} at {router_url}",
        pids.1, sim.prefill_url, sim.bootstrap_port, sim.decode_url, pids.0
    );

    // The load generator: one thread, so that it takes as little of the 2 cores as it can.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let mut conn = HttpConnector::new();
        conn.set_nodelay(true);
        conn.set_keepalive(Some(Duration::from_secs(60)));
        let client: HttpClient = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(1024)
            .pool_idle_timeout(Duration::from_secs(90))
            .build(conn);
        match wait_ready(&client, &router_url).await {
            Ok(d) => eprintln!("[load] router ready after {d:?}"),
            Err(e) => {
                eprintln!("[load] {e}; see the router log in {}", std::env::temp_dir().display());
                return;
            }
        }
        let (idle_rss, _) = rss_kib(pids.0);
        let ep = Arc::new(Endpoints {
            router: router_url.clone(),
            prefill: sim.prefill_url.clone(),
            decode: sim.decode_url.clone(),
            bootstrap_port: sim.bootstrap_port,
            tokens: settings.tokens,
        });

        let started = Instant::now();
        let mut rows: Vec<Row> = Vec::new();
        let mut rss_at_256: Vec<(Route, u64, u64)> = Vec::new();
        for route in [Route::Generate, Route::ChatStream] {
            for &conc in &settings.concurrency {
                for target in [Target::Direct, Target::Pdgate] {
                    // Warm-up at the same concurrency (connections opened), not measured.
                    let _ = run_point(&client, &ep, route, target, conc, settings.warmup, settings.max_requests, pids).await;
                    let res = run_point(&client, &ep, route, target, conc, settings.duration, settings.max_requests, pids).await;
                    eprintln!(
                        "[load] {:<32} c={conc:<3} {:<6} {:>8.0} req/s  p50 {:>7.3} ms  p99 {:>7.3} ms  ok {} err {}{}",
                        route.label(),
                        target.label(),
                        res.rps(),
                        pct(&res.lat_us, 0.5),
                        pct(&res.lat_us, 0.99),
                        res.ok,
                        res.errors,
                        res.first_error.as_deref().map(|e| format!(" (first: {e})")).unwrap_or_default()
                    );
                    if target == Target::Pdgate && conc == 256 {
                        let (rss, hwm) = rss_kib(pids.0);
                        rss_at_256.push((route, rss, hwm));
                    }
                    rows.push(Row { route, conc, target, res });
                }
            }
        }
        let total = started.elapsed();
        print_report(&settings, &rows, &rss_at_256, idle_rss, tck, cores, total);
    });
    drop(rt);
    drop(router_proc);
    drop(sim_proc);
}

fn ms_per_req(ticks: u64, ok: u64, tck: f64) -> f64 {
    if ok == 0 {
        return f64::NAN;
    }
    ticks as f64 * 1000.0 / tck / ok as f64
}

fn ns_per_req_ms(ns: u64, ok: u64) -> f64 {
    if ok == 0 {
        return f64::NAN;
    }
    ns as f64 / 1e6 / ok as f64
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "met"
    } else {
        "**missed**"
    }
}

fn print_report(
    s: &Settings,
    rows: &[Row],
    rss: &[(Route, u64, u64)],
    idle_rss: u64,
    tck: f64,
    cores: usize,
    total: Duration,
) {
    let find = |route: Route, conc: usize, target: Target| {
        rows.iter()
            .find(|r| r.route == route && r.conc == conc && r.target == target)
    };
    println!();
    println!(
        "## pdgate load bench ({} cores shared by load generator, router and simulator; {} s per point{}; CLK_TCK {tck})",
        cores,
        s.duration.as_secs_f64(),
        if s.quick { ", QUICK smoke run" } else { "" }
    );
    println!();
    if let Ok(extra) = std::env::var("PDGATE_BENCH_ROUTER_ARGS") {
        if !extra.trim().is_empty() {
            println!("Extra `pdgate serve` flags: `{}`", extra.trim());
            println!();
        }
    }
    println!("| route | conc | target | req/s | p50 ms | p99 ms | added p50 ms | errors | router CPU ms/req (user / sys, tick-sampled) | sim CPU ms/req | listen overflows | router RSS after, MiB |");
    println!("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        let added = match r.target {
            Target::Pdgate => find(r.route, r.conc, Target::Direct)
                .map(|d| format!("{:+.3}", pct(&r.res.lat_us, 0.5) - pct(&d.res.lat_us, 0.5)))
                .unwrap_or_default(),
            Target::Direct => "—".to_string(),
        };
        let router_cpu = match r.target {
            Target::Pdgate => format!(
                "{:.4} ({:.4} / {:.4})",
                ns_per_req_ms(r.res.router_ns, r.res.ok),
                ms_per_req(r.res.router_ticks.0, r.res.ok, tck),
                ms_per_req(r.res.router_ticks.1, r.res.ok, tck)
            ),
            Target::Direct => "—".to_string(),
        };
        println!(
            "| {} | {} | {} | {:.0} | {:.3} | {:.3} | {} | {} | {} | {:.4} | {} | {:.1} |",
            r.route.label(),
            r.conc,
            r.target.label(),
            r.res.rps(),
            pct(&r.res.lat_us, 0.5),
            pct(&r.res.lat_us, 0.99),
            added,
            r.res.errors,
            router_cpu,
            ns_per_req_ms(r.res.sim_ns, r.res.ok),
            r.res.listen_overflows,
            r.res.router_rss as f64 / 1024.0,
        );
    }
    println!();
    println!(
        "Router RSS: {:.1} MiB idle after start.",
        idle_rss as f64 / 1024.0
    );
    for (route, cur, hwm) in rss {
        println!(
            "Router RSS after the concurrency-256 run of {}: VmRSS {:.1} MiB, VmHWM {:.1} MiB.",
            route.label(),
            *cur as f64 / 1024.0,
            *hwm as f64 / 1024.0
        );
    }

    // Targets.
    println!();
    println!("| target | measured | verdict |");
    println!("|---|---|---|");
    let cpu_row = |route: Route, limit: f64, what: &str| {
        let vals: Vec<(usize, f64)> = rows
            .iter()
            .filter(|r| r.route == route && r.target == Target::Pdgate)
            .map(|r| (r.conc, ns_per_req_ms(r.res.router_ns, r.res.ok)))
            .collect();
        let worst = vals.iter().map(|v| v.1).fold(f64::NAN, f64::max);
        let list: Vec<String> = vals.iter().map(|(c, v)| format!("c={c}: {v:.4}")).collect();
        let met: Vec<String> = vals
            .iter()
            .filter(|v| v.1 <= limit)
            .map(|v| format!("c={}", v.0))
            .collect();
        let verdict_text = if worst <= limit {
            "met at every concurrency".to_string()
        } else if met.is_empty() {
            "**missed** at every concurrency".to_string()
        } else {
            format!("**missed** (met only at {})", met.join(", "))
        };
        println!(
            "| router CPU ≤ {limit} ms per {what} request | {} ms | {verdict_text} |",
            list.join(", ")
        );
    };
    cpu_row(Route::Generate, 0.04, "non-streamed");
    cpu_row(Route::ChatStream, 0.06, "streamed");
    if let (Some(p), Some(d)) = (
        find(Route::Generate, 1, Target::Pdgate),
        find(Route::Generate, 1, Target::Direct),
    ) {
        let added = pct(&p.res.lat_us, 0.5) - pct(&d.res.lat_us, 0.5);
        println!(
            "| added p50 ≤ 0.2 ms at concurrency 1 (non-streamed) | {added:+.3} ms (pdgate {:.3} − direct {:.3}) | {} |",
            pct(&p.res.lat_us, 0.5),
            pct(&d.res.lat_us, 0.5),
            verdict(added <= 0.2)
        );
    }
    if let (Some(p), Some(d)) = (
        find(Route::ChatStream, 1, Target::Pdgate),
        find(Route::ChatStream, 1, Target::Direct),
    ) {
        let added = pct(&p.res.lat_us, 0.5) - pct(&d.res.lat_us, 0.5);
        println!(
            "| added p50 ≤ 0.2 ms at concurrency 1 (streamed, whole stream) | {added:+.3} ms (pdgate {:.3} − direct {:.3}) | {} |",
            pct(&p.res.lat_us, 0.5),
            pct(&d.res.lat_us, 0.5),
            verdict(added <= 0.2)
        );
        let pf = pct(&p.res.first_chunk_us, 0.5);
        let df = pct(&d.res.first_chunk_us, 0.5);
        println!(
            "| first streamed chunk ≤ 0.5 ms added (c=1, kept-alive) | pdgate p50 {pf:.3} ms / p99 {:.3} ms vs direct p50 {df:.3} ms / p99 {:.3} ms → added p50 {:+.3} ms | {} |",
            pct(&p.res.first_chunk_us, 0.99),
            pct(&d.res.first_chunk_us, 0.99),
            pf - df,
            verdict(pf - df <= 0.5)
        );
    }
    for (route, cur, hwm) in rss {
        let mib = *hwm as f64 / 1024.0;
        println!(
            "| RSS ≤ 25 MB at concurrency 256 ({}) | VmRSS {:.1} MiB, VmHWM {mib:.1} MiB | {} |",
            route.label(),
            *cur as f64 / 1024.0,
            verdict(*hwm as f64 * 1024.0 <= 25e6)
        );
    }
    println!();
    println!("(total measuring time {:.1} s)", total.as_secs_f64());
}
