//! The soak's fault driver: every simulator fault, a real kill and restart where the fleet
//! can do one, put on random engines (one fault per engine at a time, each kind in turn in
//! a shuffled order), each for a random time, then every fault cleared.
//!
//! Why apart from `soak.rs`: what is injected, and how it is undone, is the part of the
//! soak that grows with the simulator; the phases and checks do not.
//!
//! Bounded: the driver loop runs for the chaos phase only (at most one pass per poll), and
//! every HTTP call has a timeout.

use std::collections::BTreeMap;
use std::time::Instant;

use pdgate_sim::{Faults, Role};
use rand::rngs::StdRng;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};

use crate::client::{self, HttpClient};
use crate::soak::{stats, EngineRef, Fleet, Plan, CALL, DP, POLL};

/// Every fault the driver injects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Down,
    Kill,
    BootstrapDown,
    RankUnregistered,
    RegisterNone,
    Prefill500,
    Prefill400,
    PrefillHang,
    PrefillDiesMidRequest,
    Decode500,
    Decode400,
    DecodeDiesMidStream,
    DecodeHang,
    DecodeStallsMidStream,
    SlowTtft,
    SlowItl,
}

const KINDS: [Kind; 16] = [
    Kind::Down,
    Kind::Kill,
    Kind::BootstrapDown,
    Kind::RankUnregistered,
    Kind::RegisterNone,
    Kind::Prefill500,
    Kind::Prefill400,
    Kind::PrefillHang,
    Kind::PrefillDiesMidRequest,
    Kind::Decode500,
    Kind::Decode400,
    Kind::DecodeDiesMidStream,
    Kind::DecodeHang,
    Kind::DecodeStallsMidStream,
    Kind::SlowTtft,
    Kind::SlowItl,
];

/// Every fault kind, for the report.
pub fn all_kinds() -> &'static [Kind] {
    &KINDS
}

impl Kind {
    pub fn label(self) -> &'static str {
        match self {
            Kind::Down => "engine down (listeners kept)",
            Kind::Kill => "engine killed, then restarted",
            Kind::BootstrapDown => "bootstrap server down",
            Kind::RankUnregistered => "one DP rank unregistered",
            Kind::RegisterNone => "no rank registered",
            Kind::Prefill500 => "prefill answers 500",
            Kind::Prefill400 => "prefill answers 400",
            Kind::PrefillHang => "prefill hangs",
            Kind::PrefillDiesMidRequest => "prefill dies mid-request",
            Kind::Decode500 => "decode answers 500",
            Kind::Decode400 => "decode answers 400",
            Kind::DecodeDiesMidStream => "decode dies mid-stream",
            Kind::DecodeHang => "decode stalls before its first byte (health fine)",
            Kind::DecodeStallsMidStream => "decode stalls mid-stream (4 s between tokens)",
            Kind::SlowTtft => "slow decode (+300 ms TTFT)",
            Kind::SlowItl => "slow decode (+50 ms ITL)",
        }
    }

    fn fits(self, role: Role) -> bool {
        match self {
            Kind::Down | Kind::Kill => true,
            Kind::BootstrapDown
            | Kind::RankUnregistered
            | Kind::RegisterNone
            | Kind::Prefill500
            | Kind::Prefill400
            | Kind::PrefillHang
            | Kind::PrefillDiesMidRequest => role == Role::Prefill,
            _ => role == Role::Decode,
        }
    }

    /// Whether the fault takes the whole engine down (only an engine held in-process can be
    /// brought back from that).
    fn takes_down(self) -> bool {
        matches!(self, Kind::Down | Kind::Kill | Kind::PrefillDiesMidRequest)
    }

    /// The engine's faults while this one is on (for `Kill`: the `down` fault, used where no
    /// real kill is possible).
    fn faults(self, rng: &mut StdRng) -> Faults {
        let mut f = Faults::default();
        match self {
            Kind::Down | Kind::Kill => f.down = true,
            Kind::BootstrapDown => f.bootstrap_down = true,
            Kind::RankUnregistered => f.unregistered_ranks = vec![rng.random_range(0..DP)],
            Kind::RegisterNone => f.register_none = true,
            Kind::Prefill500 => f.prefill_status = Some(500),
            Kind::Prefill400 => f.prefill_status = Some(400),
            Kind::PrefillHang => f.prefill_hang = true,
            Kind::PrefillDiesMidRequest => f.prefill_die_mid_request = true,
            Kind::Decode500 => f.decode_status = Some(500),
            Kind::Decode400 => f.decode_status = Some(400),
            Kind::DecodeDiesMidStream => {
                f.decode_die_mid_stream_after = Some(rng.random_range(0..3));
            }
            Kind::DecodeHang => f.decode_hang = true,
            // Silent for longer than the learned gap bound and than the stream idle bound:
            // a move, or the stream's idle error.
            Kind::DecodeStallsMidStream => f.decode_extra_itl_ms = 4000,
            Kind::SlowTtft => f.decode_extra_ttft_ms = 300,
            Kind::SlowItl => f.decode_extra_itl_ms = 50,
        }
        f
    }
}

/// What the driver did.
#[derive(Debug, Default, Clone)]
pub struct Injected {
    /// Fault → (injections, on which engines).
    pub by_kind: BTreeMap<Kind, (u64, Vec<String>)>,
    /// Real kills and restarts.
    pub kills: u64,
    pub restarts: u64,
    /// Fault or kill/restart calls that failed (should be 0).
    pub errors: Vec<String>,
    /// Violations counted by engine processes before they were killed.
    pub retired_violations: u64,
    /// Every fault's time on its engine (from its injection until it was cleared, the
    /// restart of a killed engine included), to tell which lost requests met every engine
    /// of a role faulted at once.
    pub windows: Vec<Window>,
}

/// One fault on one engine, for the time it was on.
#[derive(Debug, Clone)]
pub struct Window {
    pub engine: usize,
    pub role: Role,
    pub kind: Kind,
    pub from: Instant,
    pub to: Instant,
}

impl Kind {
    /// Whether the engine can still serve under this fault (only slower): such a fault
    /// never makes a role's engines all unusable.
    pub fn still_serves(self) -> bool {
        matches!(self, Kind::SlowTtft | Kind::SlowItl)
    }

    /// Whether the fault keeps holding the requests it caught after it is cleared: a hung
    /// or stalled engine's requests stay stuck (as SGLang's stuck rooms do) until the
    /// router's own bound ends them.
    pub fn holds_requests(self) -> bool {
        matches!(
            self,
            Kind::PrefillHang | Kind::DecodeHang | Kind::DecodeStallsMidStream
        )
    }
}

struct Active {
    until: Instant,
    killed: bool,
    kind: Kind,
    from: Instant,
}

fn close(out: &mut Injected, engines: &[EngineRef], i: usize, a: &Active) {
    out.windows.push(Window {
        engine: i,
        role: engines[i].role,
        kind: a.kind,
        from: a.from,
        to: Instant::now(),
    });
}

/// Replaces engine `i`'s faults: through its handle when the fleet has one, else over HTTP.
async fn set_faults(
    client: &HttpClient,
    fleet: &dyn Fleet,
    engines: &[EngineRef],
    i: usize,
    f: &Faults,
) -> Result<(), String> {
    if fleet.in_process(i) {
        fleet.set_faults_direct(i, f);
        return Ok(());
    }
    let e = &engines[i];
    let body = serde_json::to_value(f).map_err(|e| e.to_string())?;
    match client::post_json(client, &format!("{}/sim/faults", e.url), &body, CALL).await {
        Some((200, _)) => Ok(()),
        Some((s, b)) => Err(format!(
            "{}: /sim/faults answered {s}: {}",
            e.label,
            String::from_utf8_lossy(&b)
        )),
        None => Err(format!("{}: /sim/faults did not answer", e.label)),
    }
}

/// Ends the fault on engine `i` (restarting it if it was killed).
async fn end_fault(
    client: &HttpClient,
    fleet: &dyn Fleet,
    engines: &[EngineRef],
    i: usize,
    killed: bool,
    out: &mut Injected,
) {
    if killed {
        match fleet.restart(i).await {
            Ok(_) => out.restarts += 1,
            Err(e) => out
                .errors
                .push(format!("{}: restart: {e}", engines[i].label)),
        }
    }
    if let Err(e) = set_faults(client, fleet, engines, i, &Faults::default()).await {
        out.errors.push(e);
    }
}

/// Injects faults on random engines for `plan.chaos`, one at a time per engine, each kind
/// in turn (shuffled), then clears them all. Returns when every fault is cleared.
pub async fn drive_faults(
    client: &HttpClient,
    fleet: &dyn Fleet,
    engines: &[EngineRef],
    plan: &Plan,
) -> Injected {
    let mut rng = StdRng::seed_from_u64(plan.seed ^ 0x5eed_fa17);
    let mut out = Injected::default();
    let mut active: Vec<Option<Active>> = engines.iter().map(|_| None).collect();
    let mut order = KINDS.to_vec();
    order.shuffle(&mut rng);
    let mut next = 0usize;
    let end = Instant::now() + plan.chaos;
    let mut next_start = Instant::now();
    // Bounded by time and by count (one pass every POLL).
    let max_steps = (plan.chaos.as_millis() / POLL.as_millis()).max(1) as usize + 1;
    for _ in 0..max_steps {
        let now = Instant::now();
        if now >= end {
            break;
        }
        for (i, slot) in active.iter_mut().enumerate() {
            if slot.as_ref().is_some_and(|a| now >= a.until) {
                if let Some(a) = slot.take() {
                    end_fault(client, fleet, engines, i, a.killed, &mut out).await;
                    close(&mut out, engines, i, &a);
                }
            }
        }
        if now >= next_start {
            let kind = order[next % order.len()];
            let free: Vec<usize> = (0..engines.len())
                .filter(|&i| active[i].is_none() && kind.fits(engines[i].role))
                .filter(|&i| {
                    // One engine failing at a time per role, when the plan says so.
                    !plan.one_per_role
                        || !(0..engines.len())
                            .any(|j| active[j].is_some() && engines[j].role == engines[i].role)
                })
                .filter(|&i| {
                    // A fault that takes an engine down needs a way back: a real restart
                    // or the engine's handle.
                    !kind.takes_down()
                        || (kind == Kind::Kill && fleet.can_kill(i))
                        || fleet.in_process(i)
                })
                .collect();
            if let Some(&i) = free.choose(&mut rng) {
                let len = rng.random_range(plan.fault_len.0..=plan.fault_len.1);
                let from = Instant::now();
                let killed = kind == Kind::Kill && fleet.can_kill(i);
                let res = if killed {
                    if let Some(s) = stats(client, &engines[i]).await {
                        out.retired_violations += s.contract_violations;
                    }
                    fleet.kill(i).await.map(|_| ())
                } else {
                    let f = kind.faults(&mut rng);
                    set_faults(client, fleet, engines, i, &f).await
                };
                match res {
                    Ok(()) => {
                        let e = out.by_kind.entry(kind).or_default();
                        e.0 += 1;
                        if !e.1.contains(&engines[i].label) {
                            e.1.push(engines[i].label.clone());
                        }
                        out.kills += u64::from(killed);
                        active[i] = Some(Active {
                            until: Instant::now() + len,
                            killed,
                            kind,
                            from,
                        });
                    }
                    Err(e) => out.errors.push(e),
                }
                next += 1;
                if next.is_multiple_of(order.len()) {
                    order.shuffle(&mut rng);
                }
                next_start = Instant::now() + rng.random_range(plan.fault_gap.0..=plan.fault_gap.1);
            } else {
                next_start = Instant::now() + POLL;
            }
        }
        tokio::time::sleep(POLL).await;
    }
    for (i, slot) in active.iter_mut().enumerate() {
        match slot.take() {
            Some(a) => {
                end_fault(client, fleet, engines, i, a.killed, &mut out).await;
                close(&mut out, engines, i, &a);
            }
            None => end_fault(client, fleet, engines, i, false, &mut out).await,
        }
    }
    out
}
