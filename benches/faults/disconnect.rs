//! Client disconnects: the client gives up before the first byte or drops the stream, and
//! the time until neither engine holds the request any more.

use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use pdgate_sim::EngineConfig;

use crate::env::{engine, request, start, warm_up, Env, Kind};

// ---------------------------------------------------------------------------------------
// Client disconnects

pub(crate) struct DisconnectRow {
    pub(crate) case: &'static str,
    pub(crate) n: usize,
    pub(crate) held_at_drop: Vec<u64>,
    pub(crate) cancel_ms: Vec<f64>,
    pub(crate) not_cancelled: usize,
    pub(crate) p_abort: (u64, u64),
    pub(crate) d_abort: (u64, u64),
    /// Requests that could not be dropped as planned.
    pub(crate) early: Vec<String>,
}

/// `before_first_byte`: the client gives up during a 200 ms prefill, once both engines hold
/// the request; otherwise it drops the stream after its first chunk (a 100-token stream at 20 ms per token). Then the
/// engines are polled every millisecond until neither holds the request.
/// Waits until the prefills hold at least `p` and the decodes at least `d` requests.
async fn wait_held(env: &Env, p: u64, d: u64, bound: Duration) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < bound {
        if env.prefill_stats().held_now >= p && env.decode_stats().held_now >= d {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    false
}

pub(crate) async fn disconnect(before_first_byte: bool, n: usize) -> DisconnectRow {
    let mut p = EngineConfig::prefill(1);
    let mut d = EngineConfig::decode(1);
    p = engine(p);
    d = engine(d);
    if before_first_byte {
        p.prefill_delay = Duration::from_millis(200);
    } else {
        d.itl = Duration::from_millis(20);
    }
    let env = start(vec![p], vec![d]).await;
    env.wait_routable(&[]).await;
    warm_up(&env, 2).await;
    let p0 = env.prefill_stats();
    let d0 = env.decode_stats();
    let mut held_at_drop = Vec::new();
    let mut cancel_ms = Vec::new();
    let mut not_cancelled = 0;
    let mut early: Vec<String> = Vec::new();
    for _ in 0..n {
        let req = request(&env, Kind::Stream(100));
        let mut fut = Box::pin(env.client.request(req));
        if before_first_byte {
            // Drop the request once both legs are held by the engines (the prefill is
            // computing, the decode waits for its KV), and 20 ms more.
            let reached = tokio::select! {
                r = &mut fut => {
                    early.push(match r {
                        Ok(resp) => format!("answered {} before the drop", resp.status()),
                        Err(e) => format!("client error before the drop: {e}"),
                    });
                    false
                }
                ok = wait_held(&env, 1, 1, Duration::from_secs(1)) => ok,
            };
            if reached {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            drop(fut);
        } else {
            match tokio::time::timeout(Duration::from_secs(5), fut).await {
                Ok(Ok(resp)) => {
                    let mut body = resp.into_body();
                    let _ = tokio::time::timeout(Duration::from_secs(5), body.frame()).await;
                    drop(body);
                }
                other => early.push(format!("no stream to drop: {other:?}")),
            }
        }
        // The future (or body) is dropped: the connection closes now.
        let t_drop = Instant::now();
        held_at_drop.push(env.prefill_stats().held_now + env.decode_stats().held_now);
        let mut done = false;
        while t_drop.elapsed() < Duration::from_secs(2) {
            if env.prefill_stats().held_now + env.decode_stats().held_now == 0 {
                done = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        if done {
            cancel_ms.push(t_drop.elapsed().as_secs_f64() * 1000.0);
        } else {
            not_cancelled += 1;
            // Do not let one stuck request spoil the next one.
            let t = Instant::now();
            while t.elapsed() < Duration::from_secs(5)
                && env.prefill_stats().held_now + env.decode_stats().held_now > 0
            {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    let p1 = env.prefill_stats();
    let d1 = env.decode_stats();
    cancel_ms.sort_by(f64::total_cmp);
    DisconnectRow {
        case: if before_first_byte {
            "client gives up before the first byte (during a 200 ms prefill, both legs held)"
        } else {
            "client drops the stream after its first chunk"
        },
        n,
        held_at_drop,
        cancel_ms,
        not_cancelled,
        p_abort: (
            p1.aborted - p0.aborted,
            p1.client_disconnects - p0.client_disconnects,
        ),
        d_abort: (
            d1.aborted - d0.aborted,
            d1.client_disconnects - d0.client_disconnects,
        ),
        early,
    }
}
