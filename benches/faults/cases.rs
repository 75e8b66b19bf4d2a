//! The fault cases: the two setups, the fault helpers, the targets and verdicts, and one
//! async function per kind of fault, each returning its `Row`.

use std::time::{Duration, Instant};

use pdgate::pool::RankReadiness;
use pdgate_sim::{EngineConfig, Faults, SimEngine};

use crate::env::{engine, measure, routable, start, warm_up, Kind, Row};

// ---------------------------------------------------------------------------------------
// Cases

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Setup {
    /// The faulty engine is the only one of its role.
    Only,
    /// One healthy engine of that role remains.
    Spare,
}

impl Setup {
    fn label(self) -> &'static str {
        match self {
            Setup::Only => "(a) only",
            Setup::Spare => "(b) +healthy",
        }
    }
}

fn prefills(setup: Setup, faulty: EngineConfig) -> Vec<EngineConfig> {
    let mut v = vec![engine(faulty)];
    if setup == Setup::Spare {
        v.push(engine(EngineConfig::prefill(1)));
    }
    v
}

fn decodes(setup: Setup, faulty: EngineConfig) -> Vec<EngineConfig> {
    let mut v = vec![engine(faulty)];
    if setup == Setup::Spare {
        v.push(engine(EngineConfig::decode(1)));
    }
    v
}

fn set(e: &SimEngine, f: impl FnOnce(&mut Faults)) {
    let mut faults = e.faults();
    f(&mut faults);
    e.set_faults(faults);
}

/// Targets of a fault visible before dispatch.
fn judge_visible(r: &mut Row, setup: Setup) {
    match setup {
        Setup::Spare => {
            r.target = "0 client errors".into();
            r.verdict = ok_text(r.errors() == 0);
        }
        Setup::Only => {
            r.target = "503 ≤ 10 ms, decode never receives".into();
            let all_503 = r.mix.get("503").copied().unwrap_or(0) == r.n;
            r.verdict = ok_text(all_503 && r.pct(0.99) <= 10.0 && r.decode_saw == 0);
        }
    }
}

/// Targets of a prefill 4xx/5xx. The simulated prefill answers its error at once, so the
/// time to an error answer bounds "time after the prefill's answer" from above.
pub(crate) fn judge_prefill_status(r: &mut Row, setup: Setup) {
    let fast = r.err_max() <= 10.0;
    let has_4xx = r.mix.keys().any(|k| k.starts_with('4'));
    match setup {
        Setup::Only => {
            r.target = "error answered ≤ 10 ms after the prefill's".into();
            r.verdict = ok_text(fast);
        }
        Setup::Spare if has_4xx => {
            r.target =
                "4xx passed through ≤ 10 ms after the prefill's (a client error: not retried)"
                    .into();
            r.verdict = ok_text(fast);
        }
        Setup::Spare => {
            r.target = "0 client errors (retried on the healthy prefill)".into();
            r.verdict = ok_text(r.errors() == 0);
        }
    }
}

pub(crate) fn ok_text(ok: bool) -> String {
    if ok {
        "met".into()
    } else {
        "**missed**".into()
    }
}

/// Prefill fault set at run time, visible before dispatch: waits until the router sees it.
pub(crate) async fn prefill_visible(
    name: &str,
    setup: Setup,
    n: usize,
    seen: bool,
    fault: fn(&mut Faults),
) -> Row {
    let env = start(
        prefills(setup, EngineConfig::prefill(1)),
        vec![engine(EngineConfig::decode(1))],
    )
    .await;
    env.wait_routable(&[]).await;
    warm_up(&env, 4).await;
    let faulty = &env.cluster.prefills[0];
    let t0 = Instant::now();
    set(faulty, fault);
    let mut detect = "not waited for".to_string();
    if seen {
        let d = env
            .wait_pool(Duration::from_secs(10), |s| !routable(s, faulty, true))
            .await;
        detect = d.map_or("not within 10 s".into(), |_| {
            format!("{:.0} ms", t0.elapsed().as_secs_f64() * 1000.0)
        });
    }
    let mut r = measure(&env, faulty, Kind::Generate, n).await;
    r.fault = name.to_string();
    r.setup = setup.label();
    r.detect = detect;
    if seen {
        judge_visible(&mut r, setup);
    } else {
        r.target = "(not yet visible: retried / failed fast)".into();
        r.verdict = if setup == Setup::Spare {
            ok_text(r.errors() == 0)
        } else {
            "—".into()
        };
    }
    r
}

pub(crate) async fn ranks_never_registered(setup: Setup, n: usize) -> Row {
    let mut p = EngineConfig::prefill(1);
    p.faults.register_none = true;
    let env = start(prefills(setup, p), vec![engine(EngineConfig::decode(1))]).await;
    env.wait_routable(&[0]).await;
    let faulty = &env.cluster.prefills[0];
    // The router has looked at the faulty prefill (healthy, ranks not Unknown any more).
    let t0 = Instant::now();
    let d = env
        .wait_pool(Duration::from_secs(10), |s| {
            s.prefills.iter().any(|w| {
                w.shared.url.as_str() == faulty.url()
                    && w.facts.healthy
                    && !w.facts.ranks.is_empty()
                    && w.facts.ranks.iter().all(|r| *r != RankReadiness::Unknown)
            })
        })
        .await;
    if setup == Setup::Spare {
        warm_up(&env, 4).await;
    }
    let mut r = measure(&env, faulty, Kind::Generate, n).await;
    r.fault = "ranks never registered".into();
    r.setup = setup.label();
    r.detect = d.map_or("not within 10 s".into(), |_| {
        format!("view after {:.0} ms", t0.elapsed().as_secs_f64() * 1000.0)
    });
    judge_visible(&mut r, setup);
    r
}

/// A prefill fault that only shows when a request arrives.
pub(crate) async fn prefill_runtime(
    name: &str,
    setup: Setup,
    n: usize,
    fault: fn(&mut Faults),
    judge: fn(&mut Row, Setup),
) -> Row {
    let env = start(
        prefills(setup, EngineConfig::prefill(1)),
        vec![engine(EngineConfig::decode(1))],
    )
    .await;
    env.wait_routable(&[]).await;
    warm_up(&env, 4).await;
    let faulty = &env.cluster.prefills[0];
    set(faulty, fault);
    let mut r = measure(&env, faulty, Kind::Generate, n).await;
    r.fault = name.to_string();
    r.setup = setup.label();
    judge(&mut r, setup);
    r
}

pub(crate) async fn decode_runtime(
    name: &str,
    setup: Setup,
    n: usize,
    kind: Kind,
    fault: fn(&mut Faults),
    judge: fn(&mut Row, Setup),
) -> Row {
    let env = start(
        vec![engine(EngineConfig::prefill(1))],
        decodes(setup, EngineConfig::decode(1)),
    )
    .await;
    env.wait_routable(&[]).await;
    warm_up(&env, 4).await;
    let faulty = &env.cluster.decodes[0];
    set(faulty, fault);
    let mut r = measure(&env, faulty, kind, n).await;
    r.fault = name.to_string();
    r.setup = setup.label();
    judge(&mut r, setup);
    r
}

/// Decode engines without SGLang PR #24772 (`legacy_bootstrap_bug`): a failed rank lookup
/// hangs the decode until its waiting timeout. The failing lookup: rank `r'` of a DP-2
/// prefill is unregistered after the router saw it Ready, while the decode already knows
/// the prefill (sentinel cached by one warm-up request on the other rank).
pub(crate) async fn legacy_bug(setup: Setup, n: usize, seen: bool) -> Row {
    let mut d = EngineConfig::decode(1);
    d.legacy_bootstrap_bug = true;
    let env = start(prefills(setup, EngineConfig::prefill(2)), vec![engine(d)]).await;
    env.wait_routable(&[]).await;
    let faulty = &env.cluster.prefills[0];
    // Exactly one request on the faulty prefill, so the decode caches its layout and one
    // rank's route only.
    for _ in 0..6 {
        if faulty.stats().requests_total > 0 {
            break;
        }
        warm_up(&env, 1).await;
    }
    let per_rank = faulty.stats().requests_per_rank;
    let used = per_rank.iter().position(|c| *c > 0).unwrap_or(0) as u32;
    let other = 1 - used.min(1);
    let t0 = Instant::now();
    set(faulty, |f| f.unregistered_ranks = vec![other]);
    let mut detect = "not waited for (stale view)".to_string();
    if seen {
        let dd = env
            .wait_pool(Duration::from_secs(10), |s| !routable(s, faulty, true))
            .await;
        detect = dd.map_or("not within 10 s".into(), |_| {
            format!("{:.0} ms", t0.elapsed().as_secs_f64() * 1000.0)
        });
    }
    let mut r = measure(&env, faulty, Kind::Generate, n).await;
    r.fault = if seen {
        "legacy bootstrap bug, tracker saw the rank fail".into()
    } else {
        format!("legacy bootstrap bug, stale view (rank {other} of 2 unregistered)")
    };
    r.setup = setup.label();
    r.detect = detect;
    if seen {
        r.target = "never dispatched to the failing prefill".into();
        r.verdict = ok_text(r.faulty_saw == 0 && (setup == Setup::Only || r.errors() == 0));
    } else {
        r.target = "answered at the decode first-byte deadline (2 s here)".into();
        // The error answers are the requests that hit the failing rank.
        r.verdict = ok_text(r.err_max() <= 2000.0 + 100.0);
    }
    r
}
