//! Table tests of the learning and the verdict, with injected times (no clock).

use super::*;

fn lim() -> Limits {
    Limits {
        floor: Duration::from_millis(500),
        ceiling: Duration::from_secs(30),
        multiplier: 3.0,
        min_samples: 5,
        window: 16,
    }
}

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

/// A worker (dp 1) whose prefill legs took `took` each for prompts of `size`.
fn learned(samples: &[(u64, u32)]) -> WorkerProgress {
    let w = WorkerProgress::new(1);
    for &(took, size) in samples {
        w.record(Kind::Prefill, 0, ms(took), size);
    }
    w
}

/// (what, own samples, peer samples, size, deadline).
type DeadlineCase = (
    &'static str,
    Vec<(u64, u32)>,
    Vec<(u64, u32)>,
    u32,
    Duration,
);

#[test]
fn deadline_table() {
    let l = lim();
    let fast = vec![(20, 100); 8];
    let slow_long = vec![(2000, 4000); 8];
    #[rustfmt::skip]
    let cases: Vec<DeadlineCase> = vec![
        ("nothing learned: the ceiling", vec![], vec![], 100, l.ceiling),
        ("too few samples count as nothing", vec![(20, 100); 2], vec![(20, 100); 2], 100, l.ceiling),
        ("own and peers count together", vec![(20, 100); 3], vec![(20, 100); 2], 100, l.floor),
        ("fast fleet: 3 x 20 ms is under the floor", fast.clone(), fast.clone(), 100, l.floor),
        ("own unlearned: the peers decide", vec![], fast.clone(), 100, l.floor),
        ("long prompts: 3 x 2 s", slow_long.clone(), slow_long.clone(), 4000, ms(6000)),
        ("scaled by size: twice the prompt, twice the time", slow_long.clone(), vec![], 8000, ms(12000)),
        ("never scaled down: a short prompt may queue behind a long one", slow_long.clone(), vec![], 10, ms(6000)),
        ("the slower side wins (peers slow)", fast.clone(), slow_long.clone(), 4000, ms(6000)),
        ("the slower side wins (own slow)", slow_long.clone(), fast.clone(), 4000, ms(6000)),
        ("clamped to the ceiling", vec![(20_000, 100); 8], vec![], 100, l.ceiling),
    ];
    for (what, own, peers, size, want) in cases {
        let (o, p) = (learned(&own), learned(&peers));
        let got = deadline(
            o.estimate(Kind::Prefill, 0, size, l.window),
            p.estimate_all(Kind::Prefill, size, l.window),
            &l,
        );
        assert_eq!(got, want, "{what}");
    }
}

#[test]
fn the_window_forgets_old_samples() {
    let l = lim();
    // Slow once, then 16 fast samples: the slow one left the window.
    let mut s = vec![(5000, 100)];
    s.extend(vec![(20, 100); 16]);
    let w = learned(&s);
    let e = w.estimate(Kind::Prefill, 0, 100, l.window);
    assert_eq!(e.samples, 16);
    assert_eq!(deadline(e, Estimate::default(), &l), l.floor);
    // A wider window still sees it.
    let e = w.estimate(Kind::Prefill, 0, 100, 32);
    assert_eq!(e.samples, 17);
    assert_eq!(deadline(e, Estimate::default(), &l), ms(15_000));
    // More writes than the ring holds: only the ring's worth counts.
    let w = learned(&vec![(20, 100); 3 * WINDOW_CAP]);
    assert_eq!(
        w.estimate(Kind::Prefill, 0, 100, WINDOW_CAP as u32).samples,
        WINDOW_CAP as u32
    );
}

#[test]
fn verdict_table() {
    let l = lim();
    let fast = learned(&[(20, 100); 8]);
    let own = fast.estimate(Kind::Prefill, 0, 100, l.window);
    let peer_est = fast.estimate_all(Kind::Prefill, 100, l.window);
    let moving = Peers {
        estimate: peer_est,
        progressed: true,
        idle: false,
    };
    let still = Peers {
        estimate: peer_est,
        progressed: false,
        idle: false,
    };
    let idle = Peers {
        estimate: peer_est,
        progressed: false,
        idle: true,
    };
    #[rustfmt::skip]
    let cases: Vec<(&str, Duration, Peers, Verdict)> = vec![
        ("before the deadline", ms(100), moving, Verdict::LookAgainAt(l.floor)),
        ("past it, peers progressing: stalled", ms(600), moving, Verdict::Stalled { deadline: l.floor }),
        ("past it, nobody progressing: slow for everyone", ms(600), still, Verdict::LookAgainAt(ms(1100))),
        ("far past it, still nobody", ms(9000), still, Verdict::LookAgainAt(ms(9500))),
        ("idle peers: not yet at twice the deadline", ms(600), idle, Verdict::LookAgainAt(ms(1000))),
        ("idle peers: stalled at twice the deadline", ms(1000), idle, Verdict::Stalled { deadline: ms(1000) }),
    ];
    for (what, elapsed, peers, want) in cases {
        assert_eq!(judge(elapsed, own, &peers, &l), want, "{what}");
    }
}

/// "Slow for everyone is not a stall", with injected stamps: every prefill slows 5x at
/// once; legs started after the slowdown complete only after the one being judged passed
/// its deadline, and when they do their samples raise the bound above it.
#[test]
fn everyone_slowing_down_is_not_a_stall() {
    let l = lim();
    let (a, b) = (WorkerProgress::new(1), WorkerProgress::new(1));
    // Healthy: 200 ms legs, deadline 600 ms.
    for i in 0..8u64 {
        a.record(Kind::Prefill, 0, ms(200), 100);
        b.record(Kind::Prefill, 0, ms(200), 100);
        a.completed(1 + i * 1000);
        b.completed(1 + i * 1000);
    }
    let t0 = 10_000_000u64; // the judged leg on `a` starts here, after the slowdown
    let own = a.estimate(Kind::Prefill, 0, 100, l.window);
    // At 700 ms: past 600 ms, but `b` completed nothing started after t0.
    let peers = Peers::gather([(&b, true)], Kind::Prefill, 100, t0, l.window);
    assert!(matches!(
        judge(ms(700), own, &peers, &l),
        Verdict::LookAgainAt(_)
    ));
    // `b`'s leg started 10 ms after t0 completes after 1 s (5x): its sample comes first.
    b.record(Kind::Prefill, 0, ms(1000), 100);
    b.completed(t0 + 10_000);
    let peers = Peers::gather([(&b, true)], Kind::Prefill, 100, t0, l.window);
    assert!(peers.progressed);
    assert_eq!(
        judge(ms(1005), own, &peers, &l),
        Verdict::LookAgainAt(ms(3000)),
        "the peer's slow sample raised the bound"
    );
    // A hung worker: `b` keeps completing fast legs started after t0.
    let (a, b) = (learned(&[(20, 100); 8]), learned(&[(20, 100); 8]));
    b.completed(t0 + 30_000);
    let peers = Peers::gather([(&b, true)], Kind::Prefill, 100, t0, l.window);
    let own = a.estimate(Kind::Prefill, 0, 100, l.window);
    assert_eq!(
        judge(ms(500), own, &peers, &l),
        Verdict::Stalled { deadline: l.floor }
    );
}

#[test]
fn stalls_count_until_a_completion() {
    let w = WorkerProgress::new(2);
    assert_eq!(w.stalled(), 1);
    w.completed(5);
    assert_eq!(w.stalled(), 1, "a completion resets the count");
    assert_eq!(w.stalled(), 2);
    assert!(w.progressed_since(4) && !w.progressed_since(5));
    w.completed(3);
    assert!(!w.progressed_since(5), "the mark only moves forward");
    w.clear_stalls();
    assert_eq!(w.stalled(), 1);
}

#[test]
fn ranks_learn_apart_and_unknown_ranks_are_ignored() {
    let l = lim();
    let w = WorkerProgress::new(2);
    for _ in 0..8 {
        w.record(Kind::FirstToken, 1, ms(400), 1);
    }
    w.record(Kind::FirstToken, 7, ms(400), 1);
    assert_eq!(w.estimate(Kind::FirstToken, 0, 1, l.window).samples, 0);
    assert_eq!(w.estimate(Kind::FirstToken, 1, 1, l.window).samples, 8);
    assert_eq!(w.estimate(Kind::Gap, 1, 1, l.window).samples, 0);
    assert_eq!(w.estimate_all(Kind::FirstToken, 1, l.window).samples, 8);
    assert_eq!(
        deadline(
            w.estimate(Kind::FirstToken, 1, 1, l.window),
            Estimate::default(),
            &l
        ),
        ms(1200)
    );
}

#[test]
fn stamps_are_monotonic_and_never_zero() {
    let now = Instant::now();
    let (a, b) = (stamp(now), stamp(now + ms(3)));
    assert!(a >= 1);
    assert_eq!(b - a, 3000);
}

#[test]
fn one_probe_at_a_time() {
    let w = std::sync::Arc::new(WorkerProgress::new(1));
    let claim = w.claim_probe().expect("the first claim");
    assert!(w.claim_probe().is_none(), "a second probe waits");
    drop(claim);
    assert!(w.claim_probe().is_some(), "freed with its claim");
}

#[test]
fn peers_are_idle_only_when_there_are_some_and_none_is_busy() {
    let (a, b) = (WorkerProgress::new(1), WorkerProgress::new(1));
    let g = |peers: Vec<(&WorkerProgress, bool)>| Peers::gather(peers, Kind::Prefill, 1, 0, 16);
    assert!(
        !g(vec![]).idle,
        "no peer: never idle (a pool of one never stalls)"
    );
    assert!(g(vec![(&a, false), (&b, false)]).idle);
    assert!(!g(vec![(&a, false), (&b, true)]).idle);
    let l = lim();
    let none = g(vec![]);
    assert!(matches!(
        judge(ms(60_000), Estimate::default(), &none, &l),
        Verdict::LookAgainAt(_)
    ));
}
