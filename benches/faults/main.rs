//! Fault benchmark: how long a client waits for an answer, and what answer it gets, for
//! each engine fault, with pdgate in front of simulated SGLang engines (router, engines and
//! client in one process, one fresh tokio runtime per case so that nothing leaks between
//! cases).
//!
//! For every case: N requests sent 2 ms apart (open loop), then the time to the complete
//! answer (p50/p99/max), the client-visible status mix, how long the router took to see
//! the fault (when it is visible before dispatch), which engines received the request, the
//! requests the engines still held right after the last answer and 1 s later, and the
//! engines' `aborted` / `client_disconnects` counters (the cancelled other leg).
//!
//! Two setups where they make sense: (a) the faulty engine is the only one of its role,
//! (b) one healthy engine of that role remains (the goal there is 0 client errors).
//!
//! Router settings: the defaults (health every 0.5 s, 2 failures; bootstrap heartbeat 1 s,
//! 2 misses; refresh 2 s; freshness 5 s; retries 2 within the budget; breaker 3 failures)
//! except shortened leg timeouts so that the bench stays bounded: prefill 3 s, decode first
//! byte 2 s, stream idle 5 s, request 30 s.
//!
//! Run: `cargo bench --bench faults` (`PDGATE_BENCH_QUICK=1` for a smoke run).
//! This is a measurement, not a test: nothing here asserts on a time.

mod cases;
mod disconnect;
mod env;
mod report;

use std::future::Future;
use std::time::{Duration, Instant};

use pdgate_sim::Faults;

use cases::{
    decode_runtime, judge_prefill_status, legacy_bug, ok_text, prefill_runtime, prefill_visible,
    ranks_never_registered, Setup,
};
use disconnect::disconnect;
use env::{Kind, Row};
use report::report;

struct Knobs {
    quick: bool,
    n: usize,
    n_disconnect: usize,
}

fn knobs() -> Knobs {
    let quick = std::env::var("PDGATE_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
    Knobs {
        quick,
        n: if quick { 10 } else { 50 },
        n_disconnect: if quick { 5 } else { 20 },
    }
}

// ---------------------------------------------------------------------------------------
// Main

/// Runs one case on a fresh runtime, dropped afterwards (ending every router and engine task).
fn run<T>(label: &str, fut: impl Future<Output = T>) -> T {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let t0 = Instant::now();
    let out = rt.block_on(fut);
    rt.shutdown_timeout(Duration::from_millis(500));
    eprintln!("[faults] {label}: {:.1} s", t0.elapsed().as_secs_f64());
    out
}

fn set_down(f: &mut Faults) {
    f.down = true;
}
fn set_bootstrap_down(f: &mut Faults) {
    f.bootstrap_down = true;
}

fn main() {
    let k = knobs();
    let n = k.n;
    let started = Instant::now();
    let mut rows: Vec<Row> = Vec::new();
    for setup in [Setup::Only, Setup::Spare] {
        rows.push(run(
            "prefill down (seen)",
            prefill_visible("prefill down (router saw it)", setup, n, true, set_down),
        ));
        rows.push(run(
            "prefill down (at once)",
            prefill_visible("prefill down, requests at once", setup, n, false, set_down),
        ));
        rows.push(run(
            "bootstrap down (seen)",
            prefill_visible(
                "bootstrap server down (router saw it)",
                setup,
                n,
                true,
                set_bootstrap_down,
            ),
        ));
        rows.push(run(
            "bootstrap down (at once)",
            prefill_visible(
                "bootstrap server down, requests at once",
                setup,
                n,
                false,
                set_bootstrap_down,
            ),
        ));
        rows.push(run(
            "ranks never registered",
            ranks_never_registered(setup, n),
        ));
        rows.push(run(
            "prefill 500",
            prefill_runtime(
                "prefill answers 500",
                setup,
                n,
                |f| f.prefill_status = Some(500),
                judge_prefill_status,
            ),
        ));
        rows.push(run(
            "prefill 400",
            prefill_runtime(
                "prefill answers 400",
                setup,
                n,
                |f| f.prefill_status = Some(400),
                judge_prefill_status,
            ),
        ));
        rows.push(run(
            "prefill hangs",
            prefill_runtime(
                "prefill hangs",
                setup,
                n,
                |f| f.prefill_hang = true,
                |r, _| {
                    r.target = "answered at the prefill timeout (3 s here), nothing held".into();
                    r.verdict = ok_text(r.max() <= 3000.0 + 200.0 && r.held_1s == (0, 0));
                },
            ),
        ));
        rows.push(run(
            "prefill dies mid-request",
            prefill_runtime(
                "prefill dies mid-request",
                setup,
                n,
                |f| f.prefill_die_mid_request = true,
                |r, setup| {
                    r.target = "answered within the heartbeat detection (~2 s)".into();
                    r.verdict = ok_text(
                        r.max() <= 2000.0 + 200.0 && (setup == Setup::Only || r.errors() == 0),
                    );
                },
            ),
        ));
        rows.push(run(
            "prefill goes silent",
            prefill_runtime(
                "prefill goes silent mid-request (hangs + bootstrap unreachable, no connection reset)",
                setup,
                n,
                |f| {
                    f.prefill_hang = true;
                    f.bootstrap_down = true;
                },
                |r, setup| {
                    r.target = "answered within the heartbeat detection (~2 s)".into();
                    r.verdict = ok_text(r.max() <= 2000.0 + 200.0 && (setup == Setup::Only || r.errors() == 0));
                },
            ),
        ));
        rows.push(run(
            "decode 500",
            decode_runtime(
                "decode answers 500",
                setup,
                n,
                Kind::Generate,
                |f| f.decode_status = Some(500),
                |r, setup| {
                    if setup == Setup::Spare {
                        r.target = "0 client errors (retried on the other decode)".into();
                        r.verdict = ok_text(r.errors() == 0);
                    } else {
                        r.target = "error answered ≤ 10 ms, prefill leg cancelled".into();
                        r.verdict = ok_text(r.err_max() <= 10.0 && r.held_1s == (0, 0));
                    }
                },
            ),
        ));
        rows.push(run(
            "decode dies mid-stream",
            decode_runtime(
                "decode dies mid-stream (after 2 chunks)",
                setup,
                n,
                Kind::Stream(8),
                |f| f.decode_die_mid_stream_after = Some(2),
                |r, _| {
                    r.target = "stream ends with an error event, nothing held".into();
                    let ended = r.mix.keys().all(|k| k == "200" || k == "200 + error event");
                    r.verdict = ok_text(ended && r.held_1s == (0, 0));
                },
            ),
        ));
        rows.push(run(
            "slow decode",
            decode_runtime(
                "slow decode (+300 ms TTFT, +50 ms ITL)",
                setup,
                n,
                Kind::Stream(4),
                |f| {
                    f.decode_extra_ttft_ms = 300;
                    f.decode_extra_itl_ms = 50;
                },
                |r, _| {
                    r.target = "no errors (slow is not failed)".into();
                    r.verdict = ok_text(r.errors() == 0);
                },
            ),
        ));
        rows.push(run("legacy bug (stale)", legacy_bug(setup, n, false)));
        rows.push(run("legacy bug (seen)", legacy_bug(setup, n, true)));
    }
    let dis = vec![
        run(
            "disconnect before first byte",
            disconnect(true, k.n_disconnect),
        ),
        run("disconnect mid-stream", disconnect(false, k.n_disconnect)),
    ];
    report(&k, &rows, &dis, started.elapsed());
}
