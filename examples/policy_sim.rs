//! Policy simulator: replays one synthetic multi-turn chat workload against N simulated
//! workers under each selection policy, calling pdgate's real policy code
//! (`policy::build_with` + `policy::select` over a real `Pool` snapshot whose in-flight
//! counters are driven by `LoadGuard`s), and prints a markdown table.
//!
//! Why: to show, with numbers, what prefix affinity buys (prefix-cache hits) and what it
//! costs (load spread), and that independent replicas keep the affinity. With DP attention
//! an engine keeps one prefix cache per DP rank, so the DP rows model one cache per
//! (worker, rank) on the prefill side and, with a decode radix cache, on the decode side
//! too: a pick is a (worker, rank), as pdgate makes it.
//!
//! Invariants: deterministic (fixed seeds; the workload is drawn once and shared by every
//! policy; a discrete-event loop in virtual time), bounded (about 1,100 requests per run,
//! well under a second per run in release), no wall-clock dependence except the final
//! pick-cost measurement.
//!
//! Run: `cargo run --release --example policy_sim`.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::atomic::Ordering;
use std::time::Instant;

use pdgate::config::{PolicyConfig, PolicyKind};
use pdgate::policy::{build_with, select, PickCtx, Policy};
use pdgate::pool::{LoadGuard, Pool, Snapshot};
use pdgate::types::Role;
use pdgate::upstream::parse_base_url;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

// Workload.
const CONVERSATIONS: usize = 200;
const SYSTEM_PROMPTS: usize = 4;
const SYSTEM_TOKENS: u64 = 1200;
const CONV_PER_SEC: f64 = 2.0;
const THINK_MEAN_S: f64 = 4.0;
// Worker model.
const CACHE_TOKENS: u64 = 24_000;
const OVERHEAD_S: f64 = 0.03;
const PREFILL_S_PER_TOKEN: f64 = 0.000_25;
const ITL_S: f64 = 0.015;
const BATCH_SLOWDOWN: f64 = 32.0;
// The decode's wait per prompt token of KV its rank lacks (DP rows).
const DECODE_S_PER_MISSING_TOKEN: f64 = 0.000_2;
// Measurement.
const SAMPLE_EVERY_US: u64 = 50_000;
const POLL_EVERY_US: u64 = 500_000;

struct Turn {
    user: u64,
    output: u64,
    think_s: f64,
}

struct Conversation {
    start_s: f64,
    system: usize,
    key: u64,
    turns: Vec<Turn>,
}

fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

fn exp(rng: &mut StdRng, mean: f64) -> f64 {
    let u: f64 = rng.random_range(f64::EPSILON..1.0);
    -mean * u.ln()
}

fn workload(seed: u64) -> Vec<Conversation> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut t = 0.0;
    (0..CONVERSATIONS)
        .map(|c| {
            t += exp(&mut rng, 1.0 / CONV_PER_SEC);
            let system = rng.random_range(0..SYSTEM_PROMPTS);
            let n = rng.random_range(3..=8);
            let turns = (0..n)
                .map(|_| Turn {
                    user: rng.random_range(50..300),
                    output: rng.random_range(100..400),
                    think_s: exp(&mut rng, THINK_MEAN_S),
                })
                .collect();
            // pdgate's chat key: the messages up to the first user message.
            let key = fnv1a(format!("system {system} | first user message of {c}").as_bytes());
            Conversation {
                start_s: t,
                system,
                key,
                turns,
            }
        })
        .collect()
}

/// A worker's prefix cache: LRU over system prompts and conversation prefixes, in tokens.
#[derive(Default)]
struct Cache {
    entries: HashMap<(bool, usize), (u64, u64)>, // (is_conv, id) -> (tokens, last use)
    used: u64,
    clock: u64,
}

impl Cache {
    /// The next use time; every touch gets its own, so eviction never depends on map order.
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Cached prefix tokens of a prompt of `system` + `history` conversation tokens.
    fn hit(&mut self, system: usize, conv: usize, history: u64) -> u64 {
        let (ts, tc) = (self.tick(), self.tick());
        let Some(s) = self.entries.get_mut(&(false, system)) else {
            return 0;
        };
        s.1 = ts;
        let conv_hit = self.entries.get_mut(&(true, conv)).map_or(0, |e| {
            e.1 = tc;
            e.0.min(history)
        });
        SYSTEM_TOKENS + conv_hit
    }

    fn insert(&mut self, system: usize, conv: usize, conv_tokens: u64) {
        for (k, tokens) in [
            ((false, system), SYSTEM_TOKENS),
            ((true, conv), conv_tokens),
        ] {
            let now = self.tick();
            let old = self.entries.insert(k, (tokens, now)).map_or(0, |e| e.0);
            self.used = self.used + tokens - old;
        }
        while self.used > CACHE_TOKENS {
            let Some((&k, &(t, _))) = self.entries.iter().min_by_key(|(_, v)| v.1) else {
                break;
            };
            self.entries.remove(&k);
            self.used -= t;
        }
    }
}

struct Replica {
    /// Owns the workers the snapshot's counters belong to.
    _pool: Pool,
    snap: std::sync::Arc<Snapshot>,
    policy: Box<dyn Policy>,
}

/// `n` routable workers of DP `dp`. Both sides of the handoff are modelled on decode-role
/// workers: the policy code is the same for either role, and a decode is routable without
/// a bootstrap server.
fn replica(n: usize, dp: u32, kind: PolicyKind, cfg: &PolicyConfig) -> Replica {
    let pool = Pool::new();
    for i in 0..n {
        let url = parse_base_url(&format!("http://10.0.0.{}:30000", i + 1)).unwrap_or_else(|e| {
            eprintln!("bad url: {e}");
            std::process::exit(2)
        });
        let id = pool.add_worker(Role::Decode, url, None);
        pool.update_worker(Role::Decode, id, |w| {
            w.facts.healthy = true;
            w.facts.dp_size = Some(dp);
        });
    }
    let snap = pool.load_full();
    Replica {
        _pool: pool,
        snap,
        policy: build_with(kind, cfg),
    }
}

struct InFlight {
    conv: usize,
    turn: usize,
    /// The prefill (worker, rank) member, and the decode's when the run has a decode side.
    member: usize,
    decode: Option<usize>,
    history: u64,
    _guards: (LoadGuard, Option<LoadGuard>),
}

/// One side of the handoff: `workers` engines of DP `dp` (members: worker × dp + rank).
#[derive(Clone, Copy)]
struct Side {
    workers: usize,
    dp: u32,
}

impl Side {
    fn members(self) -> usize {
        self.workers * self.dp as usize
    }
}

/// A (worker, rank) pick on `r`: its member index and its load guard.
fn pick(r: &Replica, dp: u32, key: u64, rng: &mut StdRng) -> Option<(usize, LoadGuard)> {
    let ctx = PickCtx {
        exclude: &[],
        prefix_hash: Some(key),
        need: None,
        among: None,
    };
    let target = select(r.policy.as_ref(), &r.snap, Role::Decode, &ctx, rng)?.target;
    let view = r.snap.worker(Role::Decode, target.worker)?;
    let member = target.worker.0 as usize * dp as usize + target.rank as usize;
    Some((member, LoadGuard::new(view, target.rank)))
}

#[derive(PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Arrive { conv: usize, turn: usize },
    Complete { req: u64 },
}

struct Outcome {
    hit_ratio: f64,
    /// Decode side: the KV a decode rank already held, over all prompt tokens.
    decode_hit_ratio: Option<f64>,
    count_spread: f64,
    p99_inflight_spread: f64,
    mean_inflight_spread: f64,
    mean_latency_s: f64,
}

/// Runs the workload on the prefill `side` (and a `decode` side, if given) with `replicas`
/// independent policy instances per side.
fn run(
    convs: &[Conversation],
    side: Side,
    decode: Option<Side>,
    pol: &Policy2,
    replicas: usize,
    poll: bool,
) -> Outcome {
    let n = side.members();
    let reps: Vec<Replica> = (0..replicas)
        .map(|_| replica(side.workers, side.dp, pol.kind, &pol.cfg))
        .collect();
    let dreps: Vec<Replica> = decode.map_or_else(Vec::new, |d| {
        (0..replicas)
            .map(|_| replica(d.workers, d.dp, pol.kind, &pol.cfg))
            .collect()
    });
    let mut rng = StdRng::seed_from_u64(7);
    let mut caches: Vec<Cache> = (0..n).map(|_| Cache::default()).collect();
    let mut dcaches: Vec<Cache> = (0..decode.map_or(0, Side::members))
        .map(|_| Cache::default())
        .collect();
    let mut inflight = vec![0u64; n];
    let mut dinflight = vec![0u64; dcaches.len()];
    let mut counts = vec![0u64; n];
    let mut history = vec![0u64; convs.len()];
    let mut live: HashMap<u64, InFlight> = HashMap::new();
    let mut events = BinaryHeap::new();
    let mut seq = 0u64;
    let us = |s: f64| (s * 1e6) as u64;
    for (c, conv) in convs.iter().enumerate() {
        events.push(Reverse((
            us(conv.start_s),
            seq,
            Event::Arrive { conv: c, turn: 0 },
        )));
        seq += 1;
    }
    let (mut hit, mut dhit, mut prompt, mut latency, mut done) = (0u64, 0u64, 0u64, 0.0, 0u64);
    let mut spreads = Vec::new();
    let (mut next_sample, mut next_poll) = (0u64, 0u64);
    while let Some(Reverse((t, _, ev))) = events.pop() {
        while next_sample <= t {
            let total: u64 = inflight.iter().sum();
            // Only when there is on average at least one request per member: below that
            // max/mean measures emptiness, not imbalance.
            if total >= n as u64 {
                let max = inflight.iter().copied().max().unwrap_or(0);
                spreads.push(max as f64 * n as f64 / total as f64);
            }
            next_sample += SAMPLE_EVERY_US;
        }
        while poll && next_poll <= t {
            // What `health::load` would store: the engine's own count per rank, every
            // replica's.
            for (reps, dp, counts) in [
                (&reps, side.dp, &inflight),
                (&dreps, decode.map_or(1, |d| d.dp), &dinflight),
            ] {
                for r in reps {
                    for (w, view) in r.snap.decodes.iter().enumerate() {
                        for (k, slot) in view.per_rank.engine_load.iter().enumerate() {
                            let m = w * dp as usize + k;
                            slot.store(counts.get(m).copied().unwrap_or(0), Ordering::Relaxed);
                        }
                    }
                }
            }
            next_poll += POLL_EVERY_US;
        }
        match ev {
            Event::Arrive { conv, turn } => {
                let c = &convs[conv];
                let ri = rng.random_range(0..replicas);
                let Some((m, guard)) = pick(&reps[ri], side.dp, c.key, &mut rng) else {
                    continue;
                };
                let dpick = match (decode, dreps.get(ri)) {
                    (Some(d), Some(r)) => {
                        let Some(p) = pick(r, d.dp, c.key, &mut rng) else {
                            continue;
                        };
                        Some(p)
                    }
                    _ => None,
                };
                let hist = history[conv];
                let tokens = SYSTEM_TOKENS + hist + c.turns[turn].user;
                let cached = caches[m].hit(c.system, conv, hist);
                hit += cached;
                prompt += tokens;
                // The decode waits for the KV its rank lacks.
                let kv_wait = match &dpick {
                    Some((dm, _)) => {
                        let held = dcaches[*dm].hit(c.system, conv, hist);
                        dhit += held;
                        dinflight[*dm] += 1;
                        DECODE_S_PER_MISSING_TOKEN * (tokens - held) as f64
                    }
                    None => 0.0,
                };
                let slowdown = 1.0 + inflight[m] as f64 / BATCH_SLOWDOWN;
                let svc = OVERHEAD_S
                    + PREFILL_S_PER_TOKEN * (tokens - cached) as f64
                    + kv_wait
                    + ITL_S * c.turns[turn].output as f64 * slowdown;
                latency += svc;
                inflight[m] += 1;
                counts[m] += 1;
                let (decode_member, dguard) = match dpick {
                    Some((dm, g)) => (Some(dm), Some(g)),
                    None => (None, None),
                };
                live.insert(
                    seq,
                    InFlight {
                        conv,
                        turn,
                        member: m,
                        decode: decode_member,
                        history: hist,
                        _guards: (guard, dguard),
                    },
                );
                events.push(Reverse((t + us(svc), seq, Event::Complete { req: seq })));
                seq += 1;
            }
            Event::Complete { req } => {
                let Some(f) = live.remove(&req) else { continue };
                let c = &convs[f.conv];
                let turn = &c.turns[f.turn];
                inflight[f.member] -= 1;
                done += 1;
                let h = f.history + turn.user + turn.output;
                history[f.conv] = h;
                // A PD prefill rank caches the prompt it computed (it never sees the
                // output); a decode rank with a radix cache keeps the KV it received and
                // generated. Without a decode side a worker is one engine that keeps both.
                let computed = match f.decode {
                    Some(_) => f.history + turn.user,
                    None => h,
                };
                caches[f.member].insert(c.system, f.conv, computed);
                if let Some(dm) = f.decode {
                    dinflight[dm] -= 1;
                    dcaches[dm].insert(c.system, f.conv, h);
                }
                if f.turn + 1 < c.turns.len() {
                    let at = t + us(turn.think_s);
                    events.push(Reverse((
                        at,
                        seq,
                        Event::Arrive {
                            conv: f.conv,
                            turn: f.turn + 1,
                        },
                    )));
                    seq += 1;
                }
            }
        }
    }
    spreads.sort_by(f64::total_cmp);
    let p99 = spreads
        .get((spreads.len() as f64 * 0.99) as usize)
        .or(spreads.last())
        .copied()
        .unwrap_or(0.0);
    let mean_count = counts.iter().sum::<u64>() as f64 / n as f64;
    Outcome {
        hit_ratio: hit as f64 / prompt.max(1) as f64,
        decode_hit_ratio: decode.map(|_| dhit as f64 / prompt.max(1) as f64),
        count_spread: counts.iter().copied().max().unwrap_or(0) as f64 / mean_count.max(1e-9),
        p99_inflight_spread: p99,
        mean_inflight_spread: spreads.iter().sum::<f64>() / spreads.len().max(1) as f64,
        mean_latency_s: latency / done.max(1) as f64,
    }
}

struct Policy2 {
    label: &'static str,
    kind: PolicyKind,
    cfg: PolicyConfig,
}

fn policies() -> Vec<Policy2> {
    let with_c = |c: f64| PolicyConfig {
        cache_aware_balance_factor: c,
        ..PolicyConfig::default()
    };
    vec![
        Policy2 {
            label: "random",
            kind: PolicyKind::Random,
            cfg: PolicyConfig::default(),
        },
        Policy2 {
            label: "round_robin",
            kind: PolicyKind::RoundRobin,
            cfg: PolicyConfig::default(),
        },
        Policy2 {
            label: "power_of_two",
            kind: PolicyKind::PowerOfTwo,
            cfg: PolicyConfig::default(),
        },
        Policy2 {
            label: "cache_aware (c=1.25)",
            kind: PolicyKind::CacheAware,
            cfg: with_c(1.25),
        },
        Policy2 {
            label: "cache_aware (c=2)",
            kind: PolicyKind::CacheAware,
            cfg: with_c(2.0),
        },
    ]
}

fn pick_cost() {
    println!("\n| workers | power_of_two ns/pick | cache_aware ns/pick (100 vnodes) |");
    println!("|---:|---:|---:|");
    for n in [4usize, 8, 16, 32, 64] {
        let mut row = Vec::new();
        for kind in [PolicyKind::PowerOfTwo, PolicyKind::CacheAware] {
            let r = replica(n, 1, kind, &PolicyConfig::default());
            let mut rng = StdRng::seed_from_u64(1);
            let iters = 20_000u64;
            let start = Instant::now();
            let mut sink = 0u64;
            for k in 0..iters {
                let ctx = PickCtx {
                    exclude: &[],
                    prefix_hash: Some(k.wrapping_mul(0x9e37_79b9)),
                    need: None,
                    among: None,
                };
                if let Some(t) = select(r.policy.as_ref(), &r.snap, Role::Decode, &ctx, &mut rng)
                    .map(|p| p.target)
                {
                    sink = sink.wrapping_add(u64::from(t.worker.0));
                }
            }
            row.push(start.elapsed().as_nanos() as f64 / iters as f64);
            std::hint::black_box(sink);
        }
        println!("| {n} | {:.0} | {:.0} |", row[0], row[1]);
    }
}

fn main() {
    let convs = workload(42);
    let requests: usize = convs.iter().map(|c| c.turns.len()).sum();
    println!(
        "workload: {CONVERSATIONS} conversations, {requests} requests, {SYSTEM_PROMPTS} system prompts, \
         cache {CACHE_TOKENS} tokens/worker\n"
    );
    println!("| workers | replicas | engine load polled | policy | prefix hit | requests max/mean | in-flight max/mean: mean | p99 | mean service s |");
    println!("|---:|---:|:---:|---|---:|---:|---:|---:|---:|");
    let one = |workers| Side { workers, dp: 1 };
    let scenarios = [(4, 1, false), (8, 1, false), (8, 2, false), (8, 2, true)];
    for (n, replicas, poll) in scenarios {
        for p in policies() {
            let o = run(&convs, one(n), None, &p, replicas, poll);
            println!(
                "| {n} | {replicas} | {} | {} | {:.1}% | {:.2} | {:.2} | {:.2} | {:.2} |",
                if poll { "yes" } else { "no" },
                p.label,
                o.hit_ratio * 100.0,
                o.count_spread,
                o.mean_inflight_spread,
                o.p99_inflight_spread,
                o.mean_latency_s
            );
        }
    }
    // PD with DP attention: 2 prefills of DP 4 and 2 decodes of DP 2 (issue 35's fleet),
    // one prefix cache per rank on each side (each rank's share of the worker's cache).
    let (prefill, decode) = (Side { workers: 2, dp: 4 }, Side { workers: 2, dp: 2 });
    println!(
        "\nPD, DP attention: prefills {}×DP{}, decodes {}×DP{}; one cache of {CACHE_TOKENS} tokens per rank\n",
        prefill.workers, prefill.dp, decode.workers, decode.dp
    );
    println!("| replicas | engine load polled | policy (both sides) | prefill hit | decode hit | prefill ranks: requests max/mean | in-flight max/mean: mean | p99 | mean service s |");
    println!("|---:|:---:|---|---:|---:|---:|---:|---:|---:|");
    for (replicas, poll) in [(1, false), (3, false), (3, true)] {
        for p in policies() {
            let o = run(&convs, prefill, Some(decode), &p, replicas, poll);
            println!(
                "| {replicas} | {} | {} | {:.1}% | {:.1}% | {:.2} | {:.2} | {:.2} | {:.2} |",
                if poll { "yes" } else { "no" },
                p.label,
                o.hit_ratio * 100.0,
                o.decode_hit_ratio.unwrap_or(0.0) * 100.0,
                o.count_spread,
                o.mean_inflight_spread,
                o.p99_inflight_spread,
                o.mean_latency_s
            );
        }
    }
    pick_cost();
}
