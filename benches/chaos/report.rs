//! The soak's verdicts and its summary: requests by outcome and phase, latency against the
//! deadlines, the faults injected, recovery per worker, the gauges, RSS, and one line per
//! check (pass or fail, with what was measured).
//!
//! Why separate: the bench prints the summary and never fails; the test prints the same
//! summary and fails on any failed check, so both must judge a run the same way.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use pdgate_sim::Role;

use crate::client::Lost;
use crate::driver::Window;
use crate::soak::{Outcome, RECOVERY_BOUND, RSS_GROWTH};

/// The name of the check of RSS against the warm-up.
const RSS_WARM: &str = "router RSS at the end within 10 % of after the warm-up";

/// One claim of the soak and whether the run met it.
#[derive(Debug, Clone)]
pub struct Check {
    pub name: &'static str,
    pub measured: String,
    /// None: not measured in this setup.
    pub ok: Option<bool>,
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1000.0)
}

fn secs(d: Option<Duration>) -> String {
    d.map_or("—".to_string(), |d| format!("{:.2} s", d.as_secs_f64()))
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// Sorted, merged intervals.
fn merge(mut v: Vec<(Instant, Instant)>) -> Vec<(Instant, Instant)> {
    v.sort();
    let mut out: Vec<(Instant, Instant)> = Vec::new();
    for (a, b) in v {
        match out.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

/// The intersection of two sorted, merged interval lists.
fn intersect(x: &[(Instant, Instant)], y: &[(Instant, Instant)]) -> Vec<(Instant, Instant)> {
    let (mut i, mut j, mut out) = (0, 0, Vec::new());
    while i < x.len() && j < y.len() {
        let (a, b) = (x[i].0.max(y[j].0), x[i].1.min(y[j].1));
        if a < b {
            out.push((a, b));
        }
        if x[i].1 < y[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    out
}

/// The times when every engine of `role` had a fault on that leaves it unable to serve
/// (every fault but the slow ones); a fault that holds the requests it caught counts until
/// `carry` after it was cleared (the router's longest leg bound: until then those requests
/// are still stuck on it).
pub fn all_faulted(
    windows: &[Window],
    engines: &[usize],
    role: Role,
    carry: Duration,
) -> Vec<(Instant, Instant)> {
    let mut acc: Option<Vec<(Instant, Instant)>> = None;
    for &e in engines {
        let mine = merge(
            windows
                .iter()
                .filter(|w| w.engine == e && w.role == role && !w.kind.still_serves())
                .map(|w| {
                    let to = if w.kind.holds_requests() {
                        w.to + carry
                    } else {
                        w.to
                    };
                    (w.from, to)
                })
                .collect(),
        );
        acc = Some(match acc {
            None => mine,
            Some(a) => intersect(&a, &mine),
        });
    }
    acc.unwrap_or_default()
}

/// Lost requests split by whether, while they ran, every engine of a role was faulted at
/// once (no retry or move could find a working one: reported apart) or each role kept a
/// working engine (one engine failing must cost only latency: the goal is 0 of these).
#[derive(Debug, Default, Clone)]
pub struct LostSplit {
    /// Label → count, while every engine of a role was faulted.
    pub role_down: BTreeMap<String, u64>,
    /// Label → count, with a working engine of each role all along.
    pub one_engine: BTreeMap<String, u64>,
    /// A few of the latter, with their request ids.
    pub one_engine_samples: Vec<String>,
}

impl LostSplit {
    pub fn role_down_total(&self) -> u64 {
        self.role_down.values().sum()
    }
    pub fn one_engine_total(&self) -> u64 {
        self.one_engine.values().sum()
    }
}

fn labels(m: &BTreeMap<String, u64>) -> String {
    if m.is_empty() {
        return "none".into();
    }
    m.iter()
        .map(|(l, n)| format!("{l}: {n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Splits the lost requests of a run (see [`LostSplit`]).
pub fn split_lost(o: &Outcome) -> LostSplit {
    let windows = &o.injected.windows;
    let mut down: Vec<(Instant, Instant)> = Vec::new();
    for role in [Role::Prefill, Role::Decode] {
        let engines: Vec<usize> = {
            let mut v: Vec<usize> = windows
                .iter()
                .filter(|w| w.role == role)
                .map(|w| w.engine)
                .collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        // A role none of whose engines was ever faulted was never all down; one whose
        // engines were not all faulted neither (the intersection is empty then).
        let of_role = o.engine_roles.iter().filter(|r| **r == role).count();
        if engines.len() == of_role && of_role > 0 {
            down.extend(all_faulted(windows, &engines, role, o.held_carry));
        }
    }
    let down = merge(down);
    let mut out = LostSplit::default();
    for l in &o.tally.lost {
        let Lost {
            label, start, end, ..
        } = l;
        let overlaps = down.iter().any(|(a, b)| a < end && start < b);
        if overlaps {
            *out.role_down.entry(label.clone()).or_default() += 1;
        } else {
            *out.one_engine.entry(label.clone()).or_default() += 1;
            if out.one_engine_samples.len() < 8 {
                out.one_engine_samples.push(format!(
                    "{label} ({} phase, after {:.0} ms, x-request-id {})",
                    crate::client::PHASES[l.phase],
                    (*end - *start).as_secs_f64() * 1000.0,
                    l.request_id.as_deref().unwrap_or("-")
                ));
            }
        }
    }
    out
}

/// The check of requests lost while each role had a working engine: judged (goal 0), and
/// named so that the 10 s test can tell it apart (see `tests/it/chaos.rs`).
pub const LOST_WITH_A_WORKING_ENGINE: &str =
    "requests lost to a stall or a mid-stream death while each role had a working engine (goal 0)";

/// Judges a run.
pub fn checks(o: &Outcome) -> Vec<Check> {
    let t = &o.tally;
    let b = &o.bounds;
    let mut v = Vec::new();
    v.push(Check {
        name: "every request ended within its deadline",
        measured: format!(
            "{} late of {}, {} lanes stuck; max head {} and non-streamed {} (bound {}); max stream gap {} (bound {}); longest stream {}",
            t.late,
            t.total,
            t.stuck_lanes,
            ms(t.max_head),
            ms(t.max_plain_total),
            ms(b.head),
            ms(t.max_gap),
            ms(b.gap),
            ms(t.max_stream_total)
        ),
        ok: Some(t.late == 0 && t.stuck_lanes == 0 && t.total > 0),
    });
    v.push(Check {
        name: "every answer well-formed (JSON, JSON error, or SSE ending in [DONE])",
        measured: format!(
            "{} malformed, {} too-long prompts answered 200",
            t.malformed, t.unexpected
        ),
        ok: Some(t.malformed == 0 && t.unexpected == 0),
    });
    let split = split_lost(o);
    // The goal: one engine failing at any point of a request costs the client only
    // latency. A request lost while each role still had a working engine is the router's.
    v.push(Check {
        name: LOST_WITH_A_WORKING_ENGINE,
        measured: format!(
            "{} of {} ({})",
            split.one_engine_total(),
            t.total,
            labels(&split.one_engine)
        ),
        ok: Some(split.one_engine_total() == 0),
    });
    // Reported, not judged: the driver faults every engine independently, so both decodes
    // (or both prefills) are sometimes unusable at once, which no move or retry can save.
    // See BENCHMARKS.md §6.
    v.push(Check {
        name: "requests lost to a stall or a mid-stream death while every engine of a role was faulted (reported)",
        measured: format!(
            "{} of {} ({}); lost in all {}",
            split.role_down_total(),
            t.total,
            labels(&split.role_down),
            t.lost_to_stalls
        ),
        ok: None,
    });
    v.push(Check {
        name: "0 contract violations",
        measured: format!(
            "{} (engines' counters, killed incarnations included)",
            o.violations
        ),
        ok: Some(o.violations == 0),
    });
    let r = &o.recovered;
    let late: Vec<String> = r
        .workers
        .iter()
        .filter(|w| w.serving.is_none_or(|s| s > RECOVERY_BOUND))
        .map(|w| {
            format!(
                "{} (serving: {}; {} requests received in {} after the clear)",
                w.label,
                secs(w.serving),
                w.received,
                secs(w.serving.or(o.recovered.watched))
            )
        })
        .collect();
    let slowest = r.workers.iter().filter_map(|w| w.serving).max();
    v.push(Check {
        name: "every worker routable and serving within 3 s of the faults clearing",
        measured: if late.is_empty() {
            format!(
                "slowest worker serving after {}; every rank routable after {}",
                secs(slowest),
                secs(r.all_routable)
            )
        } else {
            format!(
                "not serving within {}: {}; every rank routable after {}",
                secs(Some(RECOVERY_BOUND)),
                late.join(", "),
                secs(r.all_routable)
            )
        },
        ok: Some(late.is_empty() && r.all_routable.is_some_and(|d| d <= RECOVERY_BOUND)),
    });
    let d = &o.drained;
    let held: u64 = d.held.iter().filter_map(|(_, h)| *h).sum();
    let fmt_g = |g: Option<f64>| g.map_or("absent".to_string(), |g| format!("{g}"));
    v.push(Check {
        name: "in-flight and admission gauges back to 0, no engine holds a request",
        measured: format!(
            "pdgate_in_flight_requests {}, pdgate_admission_queue {}, pool legs in flight {}, engines held {} ({}); {}",
            fmt_g(d.in_flight),
            fmt_g(d.queue),
            d.legs_in_flight.map_or("n/a".to_string(), |n| n.to_string()),
            held,
            d.held
                .iter()
                .map(|(l, h)| format!("{l} {}", h.map_or("?".to_string(), |h| h.to_string())))
                .collect::<Vec<_>>()
                .join(", "),
            d.zero_after
                .map_or("not all 0 within 5 s of the load's end".to_string(), |z| {
                    format!("all 0 after {}", ms(z))
                })
        ),
        ok: Some(d.zero_after.is_some()),
    });
    v.push(match (o.rss_warm_kib, o.rss_end_kib) {
        (Some(w), Some(e)) => Check {
            name: RSS_WARM,
            measured: format!(
                "VmRSS {:.1} MiB after the warm-up (under load, {} open fds) → {} MiB when the faults cleared → {} MiB when drained → {:.1} MiB at rest, {} s later (load stopped, {} open fds): {:+.1} %",
                mib(w),
                o.fds.0.map_or("?".to_string(), |n| n.to_string()),
                o.rss_cleared_kib.map_or("?".to_string(), |c| format!("{:.1}", mib(c))),
                o.rss_drained_kib.map_or("?".to_string(), |c| format!("{:.1}", mib(c))),
                mib(e),
                crate::soak::AT_REST.as_secs(),
                o.fds.1.map_or("?".to_string(), |n| n.to_string()),
                (e as f64 / w.max(1) as f64 - 1.0) * 100.0
            ),
            ok: Some(e as f64 <= w as f64 * (1.0 + RSS_GROWTH)),
        },
        _ => Check {
            name: RSS_WARM,
            measured: "not measured: the router runs in the test's own process".into(),
            ok: None,
        },
    });
    let missing: Vec<&str> = crate::driver::all_kinds()
        .iter()
        .filter(|k| !o.injected.by_kind.contains_key(k))
        .map(|k| k.label())
        .collect();
    v.push(Check {
        name: "the driver injected every fault and cleared it",
        measured: format!(
            "{} injections; not injected: {}; driver errors: {}",
            o.injected.by_kind.values().map(|(n, _)| n).sum::<u64>(),
            if missing.is_empty() {
                "none".to_string()
            } else {
                missing.join(", ")
            },
            if o.injected.errors.is_empty() {
                "none".to_string()
            } else {
                o.injected.errors.join("; ")
            }
        ),
        ok: Some(missing.is_empty() && o.injected.errors.is_empty()),
    });
    v
}

/// The names of the failed checks, with what they measured.
pub fn failures(checks: &[Check]) -> Vec<String> {
    checks
        .iter()
        .filter(|c| c.ok == Some(false))
        .map(|c| format!("{}: {}", c.name, c.measured))
        .collect()
}

/// A storm followed by others against the same router: its RSS against the warm-up is
/// reported, not judged ([`rss_between_storms`] judges the growth instead).
#[allow(dead_code)]
pub fn rss_reported(checks: &mut [Check]) {
    for c in checks
        .iter_mut()
        .filter(|c| c.name == RSS_WARM && c.ok.is_some())
    {
        c.ok = None;
        c.measured
            .push_str(" (reported: the growth between storms is judged)");
    }
}

/// The router's RSS at rest after the last storm against that after the first (see
/// [`crate::soak::RSS_BETWEEN_STORMS`]).
#[allow(dead_code)]
pub fn rss_between_storms(first: &Outcome, last: &Outcome, storms: usize) -> Check {
    let name = "router RSS at rest after the last storm within 5 % of after the first (a leak grows with each storm)";
    match (first.rss_end_kib, last.rss_end_kib) {
        (Some(a), Some(b)) => Check {
            name,
            measured: format!(
                "{:.1} MiB at rest after storm 1 → {:.1} MiB after storm {storms}: {:+.1} % (after the warm-up: {})",
                mib(a),
                mib(b),
                (b as f64 / a.max(1) as f64 - 1.0) * 100.0,
                first.rss_warm_kib.map_or("?".to_string(), |w| format!("{:.1} MiB", mib(w))),
            ),
            ok: Some(b as f64 <= a as f64 * (1.0 + crate::soak::RSS_BETWEEN_STORMS)),
        },
        _ => Check {
            name,
            measured: "not measured".into(),
            ok: None,
        },
    }
}

/// Prints the summary (markdown) to stdout.
pub fn print(o: &Outcome, checks: &[Check]) {
    let p = &o.plan;
    println!(
        "\n## Chaos soak: {:.0} s ({:.1} s warm-up, {:.1} s faults, {:.1} s after), {} open-loop lanes (a request every {} ms each, at most {} in flight), seed {}\n",
        o.elapsed.as_secs_f64(),
        p.warm.as_secs_f64(),
        p.chaos.as_secs_f64(),
        p.after.as_secs_f64(),
        p.lanes,
        p.mix.pause.as_millis(),
        crate::client::MAX_OUTSTANDING,
        p.seed
    );
    println!("Fleet: {}.\n", o.fleet);
    println!(
        "Mix: /generate and chat, streamed and not; {:.0} % too-long prompts (the engines answer 400), {:.0} % clients that go away mid-request.\n",
        p.mix.share_4xx * 100.0,
        p.mix.share_disconnect * 100.0
    );
    println!(
        "| outcome | {} | {} | {} | total |",
        crate::client::PHASES[0],
        crate::client::PHASES[1],
        crate::client::PHASES[2]
    );
    println!("|---|---:|---:|---:|---:|");
    for (label, n) in &o.tally.by_outcome {
        println!(
            "| {label} | {} | {} | {} | {} |",
            n[0],
            n[1],
            n[2],
            n.iter().sum::<u64>()
        );
    }
    println!("| **all** | | | | {} |", o.tally.total);
    // Outside the faults the engines' 400 should reach the client as a 400.
    let (warm, after) = o
        .tally
        .by_outcome
        .iter()
        .filter(|(l, _)| l.ends_with(crate::client::TOO_LONG_OTHER))
        .fold((0, 0), |(w, a), (_, n)| (w + n[0], a + n[2]));
    if warm + after > 0 {
        println!(
            "\nNote: {} too-long prompts in the warm-up and {} after the faults (no fault on) were answered other than 400 (rows marked \"too-long prompt\").",
            warm, after
        );
    }
    if !o.tally.lost_samples.is_empty() {
        println!(
            "\nRequests lost to a stall or a mid-stream death (first {}):",
            o.tally.lost_samples.len()
        );
        for s in &o.tally.lost_samples {
            println!("- {s}");
        }
    }
    let split = split_lost(o);
    if !split.one_engine_samples.is_empty() {
        println!(
            "\nOf them, lost while each role had a working engine (first {}):",
            split.one_engine_samples.len()
        );
        for s in &split.one_engine_samples {
            println!("- {s}");
        }
    }
    if !o.tally.samples.is_empty() {
        println!("\nBad answers (first {}):", o.tally.samples.len());
        for s in &o.tally.samples {
            println!("- {s}");
        }
    }
    println!("\n| fault | injected | on |");
    println!("|---|---:|---|");
    for (k, (n, on)) in &o.injected.by_kind {
        println!("| {} | {n} | {} |", k.label(), on.join(" "));
    }
    println!(
        "\nReal kills / restarts: {} / {}.",
        o.injected.kills, o.injected.restarts
    );
    println!("\n| worker | ready (readiness) after | serving after | requests | ok | failed | aborted | disconnects | violations |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (w, (_, s)) in o.recovered.workers.iter().zip(&o.engines) {
        let c = |f: fn(&pdgate_sim::StatsSnapshot) -> u64| {
            s.as_ref().map_or("?".to_string(), |s| f(s).to_string())
        };
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            w.label,
            secs(w.ready),
            secs(w.serving),
            c(|s| s.requests_total),
            c(|s| s.ok),
            c(|s| s.failed),
            c(|s| s.aborted),
            c(|s| s.client_disconnects),
            c(|s| s.contract_violations),
        );
    }
    println!(
        "\n(Engine counters are since the engine's last start; times since the faults cleared.)"
    );
    if let Some(b) = &o.recovered.breakers {
        println!("\nBreakers when recovery was late: {b}");
    }
    print_checks(checks);
}

/// The checks as a table with their verdicts.
pub fn print_checks(checks: &[Check]) {
    println!("\n| check | measured | verdict |");
    println!("|---|---|---|");
    for c in checks {
        let verdict = match c.ok {
            Some(true) => "pass",
            Some(false) => "**FAIL**",
            None if c.measured.starts_with("not measured") => "skipped",
            None => "reported",
        };
        println!("| {} | {} | {verdict} |", c.name, c.measured);
    }
    println!();
}
