use super::*;

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-3 * b.abs().max(1.0)
}

#[test]
fn the_pace_is_tokens_over_service_time() {
    // (legs as (tokens, secs), the pace after them)
    type Legs<'a> = &'a [(f64, f64)];
    let table: &[(Legs<'_>, Option<f64>)] = &[
        (&[], None),
        // One leg: its own rate.
        (&[(1000.0, 0.5)], Some(2000.0)),
        // Steady legs: their rate whatever the weight.
        (&[(1000.0, 0.5), (1000.0, 0.5), (1000.0, 0.5)], Some(2000.0)),
        // Sizes differ, the rate does not: a ratio of sums, not a mean of ratios.
        (&[(100.0, 0.05), (4000.0, 2.0), (100.0, 0.05)], Some(2000.0)),
        // A first leg with no measurable time teaches nothing yet.
        (&[(500.0, 0.0)], None),
        // Garbage is ignored.
        (&[(f64::NAN, 1.0), (-1.0, 1.0), (1.0, f64::INFINITY)], None),
        (&[(1000.0, 1.0), (f64::NAN, 1.0)], Some(1000.0)),
    ];
    for (legs, want) in table {
        let p = legs
            .iter()
            .fold(Pace::default(), |p, (t, s)| p.sample(*t, *s));
        match (p.per_sec(), want) {
            (None, None) => {}
            (Some(got), Some(w)) => assert!(close(got, *w), "{legs:?}: {got} vs {w}"),
            (got, w) => panic!("{legs:?}: {got:?} vs {w:?}"),
        }
    }
    // Batches of four ending together, 1 s each: one leg carries the batch's time, the
    // others none; the pace stays around the batches' 4000 tokens a second.
    let mut p = Pace::default();
    for i in 0..40 {
        p = p.sample(1000.0, if i % 4 == 0 { 1.0 } else { 0.0 });
        if i >= 24 {
            let now = p.per_sec().unwrap_or(0.0);
            assert!((2800.0..=5800.0).contains(&now), "leg {i}: {now}");
        }
    }
    // The newest legs weigh most: a rank that slows down is seen slowing within a few legs.
    let mut p = Pace::default();
    for _ in 0..20 {
        p = p.sample(1000.0, 0.5);
    }
    for _ in 0..10 {
        p = p.sample(1000.0, 2.0);
    }
    let now = p.per_sec().unwrap_or(0.0);
    assert!(now < 600.0 && now > 500.0, "{now}");
}

#[test]
fn the_backlog_in_tokens_and_seconds() {
    let f = |engine_waiting, new, done_old, own, ratio, pace| Figures {
        engine_waiting,
        new,
        done_old,
        own,
        ratio,
        pace,
    };
    // (figures, backlog tokens, seconds)
    let table = [
        // No report: this replica's own legs, in the engine's units.
        (f(None, 0, 0, 3000, 1.0, Some(1000.0)), 3000.0, Some(3.0)),
        (f(None, 0, 0, 3000, 0.5, Some(1000.0)), 1500.0, Some(1.5)),
        // The engine's figure plus what was sent since the poll, less what ended since.
        (
            f(Some(5000), 1000, 0, 1000, 1.0, Some(2000.0)),
            6000.0,
            Some(3.0),
        ),
        (
            f(Some(5000), 0, 2000, 1000, 1.0, Some(2000.0)),
            3000.0,
            Some(1.5),
        ),
        (
            f(Some(5000), 1000, 2000, 3000, 2.0, Some(2000.0)),
            6000.0,
            Some(3.0),
        ),
        // Never below this replica's own legs (the engine's figure leaves out the prompt
        // in compute, and is a poll old).
        (
            f(Some(0), 0, 4000, 2000, 1.0, Some(1000.0)),
            2000.0,
            Some(2.0),
        ),
        (
            f(Some(100), 0, 0, 2000, 1.0, Some(1000.0)),
            2000.0,
            Some(2.0),
        ),
        // No pace: tokens, no seconds.
        (f(Some(700), 0, 0, 0, 1.0, None), 700.0, None),
        (f(None, 0, 0, 0, 1.0, None), 0.0, None),
    ];
    for (fig, tokens, secs) in table {
        assert!(close(fig.tokens(), tokens), "{fig:?}: {}", fig.tokens());
        match (fig.secs(), secs) {
            (None, None) => {}
            (Some(g), Some(w)) => assert!(close(g, w), "{fig:?}: {g} vs {w}"),
            (g, w) => panic!("{fig:?}: {g:?} vs {w:?}"),
        }
    }
}

#[test]
fn the_bound_admits_up_to_its_seconds() {
    let f = |engine_waiting, own, pace| Figures {
        engine_waiting,
        new: 0,
        done_old: 0,
        own,
        ratio: 1.0,
        pace,
    };
    // (figures, the leg's tokens, bound in seconds, admitted)
    let table = [
        // 1000 tok/s, 2 s: 2000 tokens of room.
        (f(None, 1000, Some(1000.0)), 1000, 2.0, true),
        (f(None, 1000, Some(1000.0)), 1001, 2.0, false),
        (f(Some(1500), 0, Some(1000.0)), 500, 2.0, true),
        // Holding nothing of this replica's, a rank takes anything (no starvation).
        (f(Some(50_000), 0, Some(1000.0)), 9000, 2.0, true),
        (f(None, 0, Some(1000.0)), 1_000_000, 2.0, true),
        // Other replicas' queue counts once this replica holds something.
        (f(Some(50_000), 1, Some(1000.0)), 1, 2.0, false),
        // No pace learned: no bound.
        (f(Some(50_000), 10_000, None), 10_000, 2.0, true),
        // The bound off.
        (f(Some(50_000), 10_000, Some(1000.0)), 10_000, 0.0, true),
    ];
    for (fig, est, max, want) in table {
        assert_eq!(fig.admits(est, max), want, "{fig:?} + {est} under {max} s");
    }
}

fn signal() -> Arc<CapacitySignal> {
    Arc::new(CapacitySignal::default())
}

#[test]
fn holds_count_across_polls_and_give_back_what_they_took() {
    let ranks = new_ranks(2);
    let s = signal();
    let off = Bound::default();
    let take = |rank, est| BacklogHold::take(&ranks, rank, est, true, &off, &s);
    let a = take(0, 300);
    let b = take(0, 200);
    assert_eq!(ranks[0].figures().own, 500);
    assert_eq!(ranks[0].figures().new, 500);
    assert_eq!(ranks[1].figures().own, 0);
    // The engine saw both queued (400 of their tokens, say); one more is sent after.
    ranks[0].observe(Some(400));
    let c = take(0, 100);
    let fig = ranks[0].figures();
    assert_eq!(
        (fig.engine_waiting, fig.new, fig.own),
        (Some(400), 100, 600)
    );
    assert!(close(fig.tokens(), 600.0));
    // An old leg ends: the engine's figure is corrected by it until the next poll.
    drop(a);
    let fig = ranks[0].figures();
    assert_eq!((fig.done_old, fig.own), (300, 300));
    // 400 + 100 − 300 = 200, below the 300 this replica still holds.
    assert!(close(fig.tokens(), 300.0));
    drop((b, c));
    let fig = ranks[0].figures();
    assert_eq!((fig.own, fig.new), (0, 0));
    // A failed poll: the engine's figure is gone, not kept stale.
    ranks[0].observe(None);
    assert_eq!(ranks[0].figures().engine_waiting, None);
    assert!(close(ranks[0].figures().tokens(), 0.0));
    // A rank outside the array is not bounded and counts nothing.
    let half = Bound {
        max_secs: 0.5,
        fallback_pace: None,
    };
    let stray = BacklogHold::take(&ranks, 7, 100, true, &half, &s);
    assert!(stray.is_some());
}

#[test]
fn a_hold_is_refused_past_the_bound_once_the_pace_is_known() {
    let ranks = new_ranks(1);
    let s = signal();
    let one = Bound {
        max_secs: 1.0,
        fallback_pace: None,
    };
    let take = |est| BacklogHold::take(&ranks, 0, est, true, &one, &s);
    // No pace yet: anything goes.
    let first = take(5000);
    assert!(first.is_some());
    // Its leg answers after 1 s for 1000 uncached tokens of 1000 estimated.
    if let Some(h) = first {
        h.answered(1_000_000, 2_000_000, Some((1000, 0)));
    }
    let r = &ranks[0];
    assert!(close(r.pace().unwrap_or(0.0), 1000.0));
    assert!(
        close(r.ratio(), 0.2),
        "5000 estimated, 1000 uncached: {}",
        r.ratio()
    );
    // 1 s of room at 1000 tok/s, estimates count a fifth: 5000 estimated tokens fit.
    let a = take(4000);
    assert!(a.is_some(), "holding nothing: always");
    let b = take(900);
    assert!(b.is_some(), "800 + 180 engine tokens fit 1 s");
    assert!(take(200).is_none(), "980 + 40 do not");
    drop(b);
    assert!(take(200).is_some());
}

#[test]
fn the_service_time_excludes_the_wait_behind_earlier_legs() {
    let r = RankBacklog::default();
    // Three legs of 1000 tokens sent together at t=0 on a rank that computes one at a time
    // in 1 s: they end at 1, 2 and 3 s; each took 1 s of the rank, not 1, 2 and 3 s.
    for end in [1, 2, 3] {
        r.learn(1000, 0, end * 1_000_000, Some((1000, 0)));
    }
    assert!(close(r.pace().unwrap_or(0.0), 1000.0), "{:?}", r.pace());
    // An idle rank: the leg's whole time is its service time.
    let r = RankBacklog::default();
    r.learn(1000, 10_000_000, 10_500_000, None);
    assert!(close(r.pace().unwrap_or(0.0), 2000.0));
    // A prompt fully cached teaches a ratio of 0, and a pace sample of 0 tokens.
    r.learn(1000, 11_000_000, 11_100_000, Some((1000, 1000)));
    assert!(close(r.ratio(), 0.0));
    // Without the engine's figures (a batch), the estimate times the ratio counts.
    let r = RankBacklog::default();
    r.learn(1000, 0, 1_000_000, Some((500, 0)));
    r.learn(1000, 1_000_000, 2_000_000, None);
    assert!(close(r.pace().unwrap_or(0.0), 500.0));
}

#[test]
fn a_rank_without_a_pace_is_held_to_its_pool_s() {
    let cold = Figures {
        engine_waiting: None,
        new: 0,
        done_old: 0,
        own: 900,
        ratio: 1.0,
        pace: None,
    };
    let warm = Figures {
        pace: Some(1000.0),
        ..cold
    };
    let b = |fallback_pace| Bound {
        max_secs: 1.0,
        fallback_pace,
    };
    // (bound, figures, the leg's tokens, admitted)
    let table = [
        // No pace anywhere: no bound.
        (b(None), cold, 1000, true),
        // The pool's pace stands in.
        (b(Some(1000.0)), cold, 100, true),
        (b(Some(1000.0)), cold, 101, false),
        // The rank's own pace wins once learned.
        (b(Some(10.0)), warm, 100, true),
    ];
    for (bound, fig, est, want) in table {
        assert_eq!(bound.admits(fig, est), want, "{bound:?} {fig:?} + {est}");
    }
}
