use super::*;
use proptest::prelude::*;
use std::time::Duration;

fn need(override_per_rank: u64, tokens: u64) -> Need {
    Need {
        limits: Limits {
            override_per_rank,
            learn_from_engine: true,
            kv_bound: true,
            ..Limits::default()
        },
        tokens,
        slots: 1,
    }
}

fn take(ranks: &Arc<[RankCapacity]>, n: &Need, sig: &Arc<CapacitySignal>) -> Option<Reservation> {
    Reservation::try_take(ranks, 0, n, sig)
}

#[test]
fn the_limit_is_the_override_else_the_engine_s_figure() {
    // (override, learn, engine cap, limit)
    let table = [
        (0, true, 0, 0),
        (0, true, 8, 8),
        (3, true, 8, 3),
        (3, false, 8, 3),
        (0, false, 8, 0),
    ];
    for (ov, learn, engine, want) in table {
        let r = RankCapacity::default();
        r.set_engine_cap(engine);
        let l = Limits {
            override_per_rank: ov,
            learn_from_engine: learn,
            kv_bound: false,
            ..Limits::default()
        };
        assert_eq!(r.limit(&l), want, "{ov} {learn} {engine}");
    }
}

#[test]
fn occupancy_is_the_engine_s_figure_plus_reservations_since_the_poll() {
    let ranks = new_ranks(1);
    let sig = Arc::new(CapacitySignal::default());
    let n = need(0, 10);
    let r = &ranks[0];
    r.observe(&Reported {
        busy: Some(2),
        max_running: Some(4),
        tokens: Some(100),
        max_tokens: Some(1000),
        prealloc: None,
        waiting: None,
    });
    assert_eq!(r.occupancy(), 2);
    let a = take(&ranks, &n, &sig).expect("2 of 4");
    let b = take(&ranks, &n, &sig).expect("3 of 4");
    assert_eq!((r.occupancy(), r.own(), r.tokens()), (4, 2, Some(120)));
    assert!(take(&ranks, &n, &sig).is_none(), "4 of 4: full");
    // Released in the same window: counted out at once.
    drop(a);
    assert_eq!(r.occupancy(), 3);
    let c = take(&ranks, &n, &sig).expect("a slot again");
    // A poll that sees both of ours (and one other replica's request gone).
    r.observe(&Reported {
        busy: Some(2),
        max_running: None,
        tokens: Some(20),
        max_tokens: Some(1000),
        prealloc: None,
        waiting: None,
    });
    assert_eq!(
        r.engine_cap(),
        4,
        "a poll without a figure keeps the capacity"
    );
    assert_eq!(r.occupancy(), 2);
    // Released after the poll that counted it: the engine's figure is corrected.
    drop(b);
    assert_eq!((r.occupancy(), r.own()), (1, 1));
    assert_eq!(r.tokens(), Some(10));
    // A failed poll (nothing reported): our own count is the floor.
    r.observe(&Reported::default());
    assert_eq!((r.occupancy(), r.tokens()), (1, None));
    drop(c);
    assert_eq!((r.occupancy(), r.own()), (0, 0));
}

#[test]
fn kv_tokens_bound_admission_unless_the_rank_is_empty() {
    let ranks = new_ranks(1);
    let sig = Arc::new(CapacitySignal::default());
    let r = &ranks[0];
    r.observe(&Reported {
        busy: Some(1),
        max_running: Some(100),
        tokens: Some(900),
        max_tokens: Some(1000),
        prealloc: None,
        waiting: None,
    });
    assert!(
        take(&ranks, &need(0, 101), &sig).is_none(),
        "900 + 101 > 1000"
    );
    let off = Need {
        limits: Limits {
            kv_bound: false,
            ..need(0, 0).limits
        },
        tokens: 101,
        slots: 1,
    };
    assert!(r.has_room(&off), "the KV bound is off");
    let fits = take(&ranks, &need(0, 100), &sig).expect("900 + 100 fits");
    drop(fits);
    r.observe(&Reported {
        busy: Some(0),
        max_running: None,
        tokens: Some(0),
        max_tokens: Some(1000),
        prealloc: None,
        waiting: None,
    });
    let _big = take(&ranks, &need(0, 5000), &sig).expect("alone, even a large request goes");
}

#[test]
fn without_capacity_nothing_is_refused() {
    let ranks = new_ranks(1);
    let sig = Arc::new(CapacitySignal::default());
    let held: Vec<_> = (0..100)
        .map(|_| take(&ranks, &need(0, 1), &sig).expect("no limit"))
        .collect();
    assert_eq!(ranks[0].own(), 100);
    drop(held);
    assert_eq!(ranks[0].own(), 0);
}

#[tokio::test]
async fn a_release_wakes_a_waiter() {
    let ranks = new_ranks(1);
    let sig = Arc::new(CapacitySignal::default());
    let slot = take(&ranks, &need(1, 0), &sig).expect("first");
    let w = sig.waiter();
    let mut wake = Box::pin(w.notified());
    wake.as_mut().enable();
    assert!(take(&ranks, &need(1, 0), &sig).is_none());
    drop(slot);
    tokio::time::timeout(std::time::Duration::from_secs(5), wake)
        .await
        .expect("woken by the release");
    assert!(take(&ranks, &need(1, 0), &sig).is_some());
}

proptest! {
    /// Whatever the interleaving of reservations, releases and polls, this replica never
    /// holds more than the capacity, and every count returns to 0.
    #[test]
    fn never_more_than_the_capacity(cap in 1u64..6, ops in proptest::collection::vec(0u8..3, 1..80)) {
        let ranks = new_ranks(1);
        let sig = Arc::new(CapacitySignal::default());
        let n = need(cap, 1);
        let mut held = Vec::new();
        for op in ops {
            match op {
                0 => if let Some(r) = take(&ranks, &n, &sig) { held.push(r) },
                1 => { held.pop(); }
                _ => ranks[0].observe(&Reported { busy: Some(held.len() as u64), ..Reported::default() }),
            }
            prop_assert!(held.len() as u64 <= cap);
            prop_assert_eq!(ranks[0].own(), held.len() as u64);
            prop_assert!(ranks[0].occupancy() >= held.len() as u64);
        }
        held.clear();
        prop_assert_eq!(ranks[0].own(), 0);
        prop_assert_eq!(ranks[0].tokens(), None);
    }
}

#[test]
fn a_batch_takes_one_slot_per_instance() {
    let ranks = new_ranks(1);
    let sig = Arc::new(CapacitySignal::default());
    let batch = |slots| Need {
        slots,
        ..need(4, 1)
    };
    // (held before, slots asked, admitted)
    let table = [
        (0, 3, true),
        (3, 1, true),
        (3, 2, false),
        (0, 9, true),
        (1, 4, false),
    ];
    for (before, slots, want) in table {
        let held: Vec<_> = (0..before)
            .map(|_| take(&ranks, &need(4, 1), &sig).expect("room"))
            .collect();
        let got = take(&ranks, &batch(slots), &sig);
        assert_eq!(got.is_some(), want, "{before} held, {slots} asked");
        if got.is_some() {
            assert_eq!(ranks[0].own(), before + slots);
        }
        drop((held, got));
        assert_eq!(ranks[0].own(), 0);
    }
}

/// `R` replicas in one process: each its own capacity state (as separate processes have),
/// every one with the same settings but its own index.
fn replicas(r: u32, indexed: bool, dp: u32) -> Vec<(Arc<[RankCapacity]>, Limits)> {
    (0..r)
        .map(|i| {
            let limits = Limits {
                learn_from_engine: true,
                replicas: r,
                replica_index: indexed.then_some(i),
                ..Limits::default()
            };
            (new_ranks(dp), limits)
        })
        .collect()
}

#[test]
fn a_replica_holds_its_share_whatever_the_engine_reports() {
    // (replicas, capacity, indexed, what replica 0 takes on rank 0 and rank 1)
    let table = [
        (1, 4, false, (4, 4)),
        (3, 4, true, (2, 1)),
        (3, 4, false, (1, 1)),
        (5, 4, true, (1, 1)),
        (5, 1, true, (1, 0)),
        (5, 2, false, (1, 1)),
    ];
    let sig = Arc::new(CapacitySignal::default());
    for (r, cap, indexed, want) in table {
        let all = replicas(r, indexed, 2);
        let (ranks, limits) = &all[0];
        let n = Need {
            limits: *limits,
            tokens: 0,
            slots: 1,
        };
        let mut got = Vec::new();
        for rank in 0..2u32 {
            // The engine reports the rank empty: the report alone would admit `cap`.
            ranks[rank as usize].observe(&Reported {
                busy: Some(0),
                max_running: Some(cap),
                ..Reported::default()
            });
            let held: Vec<_> = std::iter::from_fn(|| Reservation::try_take(ranks, rank, &n, &sig))
                .take(cap as usize + 1)
                .collect();
            assert_eq!(
                ranks[rank as usize].share(limits),
                Some(held.len() as u64),
                "{r} {cap} {indexed}"
            );
            got.push(held.len() as u64);
        }
        assert_eq!(
            (got[0], got[1]),
            want,
            "{r} replicas, capacity {cap}, indexed {indexed}"
        );
    }
}

#[test]
fn a_request_larger_than_the_share_goes_alone_to_an_empty_rank() {
    let all = replicas(2, true, 1);
    let (ranks, limits) = &all[0];
    let sig = Arc::new(CapacitySignal::default());
    ranks[0].observe(&Reported {
        busy: Some(0),
        max_running: Some(4),
        ..Reported::default()
    });
    let batch = |slots| Need {
        limits: *limits,
        tokens: 0,
        slots,
    };
    let big = Reservation::try_take(ranks, 0, &batch(3), &sig).expect("alone");
    assert!(
        Reservation::try_take(ranks, 0, &batch(1), &sig).is_none(),
        "share spent"
    );
    drop(big);
    let one = Reservation::try_take(ranks, 0, &batch(1), &sig).expect("within the share");
    assert!(
        Reservation::try_take(ranks, 0, &batch(3), &sig).is_none(),
        "not alone any more"
    );
    drop(one);
}

proptest! {
    /// The bound across replicas: R replicas (separate states, as separate processes),
    /// any interleaving of reservations, releases and engine polls on two DP ranks, against
    /// a model engine whose count is every replica's live reservations; the polls report
    /// that count (or fail). With the replica count known and every index known, no rank
    /// ever holds more than its capacity; without indexes, neither when the capacity is at
    /// least R (else at most R: one slot each). Each replica stays within its share.
    #[test]
    fn replicas_together_never_exceed_a_rank_s_capacity(
        r in 1u32..6,
        cap in 1u64..12,
        indexed in any::<bool>(),
        learned in any::<bool>(),
        ops in proptest::collection::vec((0u32..6, 0u32..2, 0u8..4), 1..200),
    ) {
        let sig = Arc::new(CapacitySignal::default());
        let mut all = replicas(r, indexed, 2);
        for (ranks, limits) in &mut all {
            if learned {
                // `/server_info` gave the capacity before any poll.
                ranks.iter().for_each(|k| k.set_engine_cap(cap));
            } else {
                limits.override_per_rank = cap;
                limits.learn_from_engine = false;
            }
        }
        let bound = if indexed || cap >= u64::from(r) { cap } else { u64::from(r) };
        // held[replica] = (rank, reservation)
        let mut held: Vec<Vec<(u32, Reservation)>> = (0..r).map(|_| Vec::new()).collect();
        let engine = |held: &Vec<Vec<(u32, Reservation)>>, rank: u32| -> u64 {
            held.iter().flatten().filter(|(k, _)| *k == rank).map(|(_, h)| h.slots).sum()
        };
        for (who, rank, op) in ops {
            let who = (who % r) as usize;
            let (ranks, limits) = &all[who];
            match op {
                0 | 1 => {
                    let n = Need { limits: *limits, tokens: 1, slots: 1 };
                    if let Some(h) = Reservation::try_take(ranks, rank, &n, &sig) {
                        held[who].push((rank, h));
                    }
                }
                2 => {
                    if !held[who].is_empty() {
                        let i = (rank as usize) % held[who].len();
                        held[who].swap_remove(i);
                    }
                }
                _ => {
                    let busy = engine(&held, rank);
                    let report = if busy % 3 == 2 {
                        Reported::default() // a failed poll
                    } else {
                        Reported { busy: Some(busy), max_running: Some(cap), ..Reported::default() }
                    };
                    ranks[rank as usize].observe(&report);
                }
            }
            for k in 0..2u32 {
                prop_assert!(engine(&held, k) <= bound, "rank {} holds {} > {}", k, engine(&held, k), bound);
                for (i, (ranks, limits)) in all.iter().enumerate() {
                    let own = ranks[k as usize].own();
                    prop_assert!(Some(own) <= ranks[k as usize].share(limits).or(Some(u64::MAX)), "replica {} over its share", i);
                }
            }
        }
        held.clear();
        for (ranks, _) in &all {
            prop_assert!(ranks.iter().all(|k| k.own() == 0));
        }
    }
}

#[test]
fn a_rank_whose_engine_queues_before_pre_allocation_has_no_room_until_it_drains() {
    let sig = Arc::new(CapacitySignal::default());
    let learn = need(0, 10);
    let not_learning = Need {
        limits: Limits {
            override_per_rank: 8,
            learn_from_engine: false,
            ..learn.limits
        },
        ..learn
    };
    // (reports in order: busy, capacity, pre-allocation queue; then whether a request
    // with `learn_from_engine` has room, and one without)
    type Polls<'a> = &'a [(u64, Option<u64>, Option<u64>)];
    let table: &[(Polls, bool, bool)] = &[
        // No figure (older engine, `include=core`): as before.
        (&[(2, Some(8), None)], true, true),
        (&[(0, None, None)], true, true),
        // A queue closes the rank, even under its capacity, and with no capacity known.
        (&[(2, Some(8), Some(1))], false, true),
        (&[(5, None, Some(3))], false, true),
        // Even a rank the engine reports idle otherwise (the queue is the figure to trust).
        (&[(0, Some(8), Some(1))], false, true),
        // Drained: room again.
        (&[(9, Some(8), Some(4)), (3, Some(8), Some(0))], true, true),
        // A failed poll or a report without the figure: unknown, judged as before.
        (&[(9, Some(8), Some(4)), (3, Some(8), None)], true, true),
        // Still queued at the next poll: still closed.
        (&[(9, Some(8), Some(4)), (3, Some(8), Some(1))], false, true),
    ];
    for (reports, want_learn, want_not) in table {
        let ranks = new_ranks(1);
        for (busy, cap, prealloc) in reports.iter().copied() {
            ranks[0].observe(&Reported {
                busy: Some(busy),
                max_running: cap,
                prealloc,
                ..Reported::default()
            });
        }
        let r = &ranks[0];
        assert_eq!(r.has_room(&learn), *want_learn, "{reports:?}");
        assert_eq!(r.has_room(&not_learning), *want_not, "{reports:?}");
        let got = take(&ranks, &learn, &sig);
        assert_eq!(got.is_some(), *want_learn, "{reports:?}: reservation");
        assert_eq!(
            r.prealloc_queue(),
            reports.last().and_then(|(_, _, q)| *q),
            "{reports:?}"
        );
    }
}

#[test]
fn this_replica_s_fresh_requests_explain_a_short_queue() {
    let sig = Arc::new(CapacitySignal::default());
    let n = need(0, 10);
    // (reservations taken in the window before the poll and still held, the queue it
    // reported, whether the rank has room after it, and after one more poll showing the
    // same queue with nothing sent in between)
    let table = [
        (0, 0, true, true),
        // One request of ours, still handshaking: no sign of waiting yet.
        (1, 1, true, false),
        (2, 2, true, false),
        // More queued than ours (older ones, or another replica's): closed at once.
        (1, 2, false, false),
        (0, 1, false, false),
    ];
    for (fresh, queue, room, room_next) in table {
        let ranks = new_ranks(1);
        let r = &ranks[0];
        r.observe(&Reported {
            busy: Some(0),
            max_running: Some(8),
            prealloc: Some(0),
            ..Reported::default()
        });
        let held: Vec<_> = (0..fresh)
            .map(|_| take(&ranks, &n, &sig).expect("room"))
            .collect();
        let poll = Reported {
            busy: Some(queue),
            max_running: Some(8),
            prealloc: Some(queue),
            ..Reported::default()
        };
        r.observe(&poll);
        assert_eq!(r.has_room(&n), room, "{fresh} fresh, queue {queue}");
        assert_eq!(r.queue_closes(), !room);
        r.observe(&poll);
        assert_eq!(
            r.has_room(&n),
            room_next,
            "{fresh} fresh, queue {queue}, next"
        );
        drop(held);
    }
}

fn proportional(cap_override: u64) -> Need {
    Need {
        limits: Limits {
            override_per_rank: cap_override,
            learn_from_engine: true,
            kv_bound: false,
            proportional: true,
            ..Limits::default()
        },
        tokens: 1,
        slots: 1,
    }
}

#[test]
fn without_a_count_a_replica_takes_its_part_of_the_free_slots() {
    // (capacity, busy reported at the poll before, busy reported, this replica's
    // reservations at both polls, coin, allowance)
    type Row = (u64, Option<u64>, Option<u64>, u64, u64, Option<u64>);
    let table: &[Row] = &[
        // No report (none yet, or a failed poll): as if alone, one then doubling.
        (8, None, None, 0, 0, Some(1)),
        (8, None, None, 3, 0, Some(3)),
        (8, None, None, 6, 0, Some(2)),
        // Holding none on the rank: one request, when the rank has room.
        (8, None, Some(0), 0, 0, Some(1)),
        (8, None, Some(5), 0, 0, Some(1)),
        (8, None, Some(8), 0, 0, Some(0)),
        (8, None, Some(11), 0, 0, Some(0)),
        // Alone on the rank (busy = own): all the free slots, but no more than doubling.
        (8, None, Some(2), 2, 0, Some(2)),
        (8, None, Some(5), 5, 0, Some(3)),
        (8, Some(4), Some(4), 4, 0, Some(4)),
        // Half of the load: half of the free slots.
        (8, None, Some(4), 2, 0, Some(2)),
        // A third of 4 free: 1, and a third of a slot rounded up by the coin or not.
        (13, None, Some(9), 3, 0, Some(2)),
        (13, None, Some(9), 3, 2, Some(2)),
        (13, None, Some(9), 3, 3, Some(1)),
        (13, None, Some(9), 3, 8, Some(1)),
        // A third of 5 free is 1.67, but no more than doubling the one it holds.
        (8, None, Some(3), 1, 0, Some(1)),
        // Over capacity: nothing fresh.
        (8, None, Some(9), 3, 0, Some(0)),
        // The others seen at the poll before count while a report lags (their newest
        // requests not arrived yet): two others then, none now, two of ours: nothing.
        (4, Some(4), Some(2), 2, 0, Some(0)),
        // ... and at the poll after, no more.
        (4, Some(2), Some(2), 2, 0, Some(2)),
        // Ours not counted (a leg that ended on the engine first): as all ours.
        (8, None, Some(1), 3, 0, Some(3)),
    ];
    for &(cap, before, busy, own, coin, want) in table {
        let ranks = new_ranks(1);
        let sig = Arc::new(CapacitySignal::default());
        let n = proportional(cap);
        // Taken without the rule.
        let held: Vec<_> = (0..own)
            .map(|_| take(&ranks, &need(cap, 1), &sig).expect("room"))
            .collect();
        ranks[0].observe(&Reported {
            busy: before,
            ..Reported::default()
        });
        ranks[0].observe_with(
            &Reported {
                busy,
                ..Reported::default()
            },
            coin,
        );
        assert_eq!(
            ranks[0].allowance(&n.limits),
            want,
            "cap {cap}, busy {before:?} then {busy:?}, own {own}, coin {coin}"
        );
        drop(held);
    }
    // A known replica count (shares), a rule turned off or reports that do not count: no
    // such bound.
    let ranks = new_ranks(1);
    ranks[0].observe(&Reported {
        busy: Some(3),
        ..Reported::default()
    });
    let base = proportional(8).limits;
    for l in [
        Limits {
            replicas: 2,
            ..base
        },
        Limits {
            proportional: false,
            ..base
        },
        Limits {
            learn_from_engine: false,
            ..base
        },
        Limits {
            override_per_rank: 0,
            ..base
        },
    ] {
        assert_eq!(ranks[0].allowance(&l), None, "{l:?}");
    }
}

#[test]
fn the_allowance_spent_waits_for_a_poll_and_releases_are_refilled() {
    let ranks = new_ranks(1);
    let sig = Arc::new(CapacitySignal::default());
    let n = proportional(8);
    ranks[0].observe(&Reported {
        busy: Some(0),
        ..Reported::default()
    });
    // Holding none on an idle rank: one.
    let first = take(&ranks, &n, &sig).expect("one");
    assert!(
        take(&ranks, &n, &sig).is_none(),
        "the rest waits for a poll"
    );
    // The polls show it alone: it doubles what it holds at each, up to the whole rank.
    let mut more = Vec::new();
    for (busy, fresh) in [(1, 1), (2, 2), (4, 4)] {
        ranks[0].observe(&Reported {
            busy: Some(busy),
            ..Reported::default()
        });
        for _ in 0..fresh {
            more.push(take(&ranks, &n, &sig).expect("room"));
        }
        assert!(take(&ranks, &n, &sig).is_none(), "{fresh} after {busy}");
    }
    // Releases of older reservations are refilled at once, without a poll.
    ranks[0].observe(&Reported {
        busy: Some(8),
        ..Reported::default()
    });
    // A release while a request waits here: it takes the slot at once.
    let waiting = sig.waiter();
    drop(first);
    let again = take(&ranks, &n, &sig).expect("refill");
    assert!(take(&ranks, &n, &sig).is_none(), "no more than refills");
    drop(waiting);
    // A release with nobody waiting goes back to the fleet: not refilled before a poll
    // shows the slot free (another replica's poll may have seen it first).
    let mut more = more;
    more.pop();
    assert!(take(&ranks, &n, &sig).is_none(), "not refillable");
    drop((more, again));
}

#[test]
fn a_queue_that_would_outlast_the_bootstrap_timeout_closes_the_rank() {
    let sig = Arc::new(CapacitySignal::default());
    // (hold time ms, reported running + waiting, waiting, bootstrap timeout ms, closed)
    let table: &[(u64, u64, Option<u64>, u64, bool)] = &[
        // No waiting figure, nothing waiting, no hold time or no timeout: not judged.
        (1000, 8, None, 4000, false),
        (1000, 4, Some(0), 4000, false),
        (0, 8, Some(4), 4000, false),
        (1000, 8, Some(4), 0, false),
        // 4 running, 3 waiting: one more is served in the first round: 1 s, against 2 s.
        (1000, 7, Some(3), 4000, false),
        // 4 running, 4 waiting: the 5th waits a round (2 rounds: 2 s >= half of 4 s).
        (1000, 8, Some(4), 4000, true),
        (1000, 8, Some(4), 5000, false),
        // Nothing running: every waiting one is a round.
        (1000, 2, Some(2), 10_000, false),
        (2000, 3, Some(3), 10_000, true),
    ];
    for &(hold, busy, waiting, timeout, closed) in table {
        let ranks = new_ranks(1);
        if hold > 0 {
            ranks[0].held_for(Duration::from_millis(hold));
        }
        ranks[0].observe(&Reported {
            busy: Some(busy),
            waiting,
            ..Reported::default()
        });
        let n = Need {
            limits: Limits {
                bootstrap_timeout_ms: timeout,
                ..need(0, 1).limits
            },
            ..need(0, 1)
        };
        assert_eq!(
            take(&ranks, &n, &sig).is_none(),
            closed,
            "hold {hold}, busy {busy}, waiting {waiting:?}, timeout {timeout}"
        );
    }
}

#[test]
fn the_hold_time_is_a_moving_average() {
    let r = RankCapacity::default();
    assert_eq!(r.hold_time(), None);
    r.held_for(Duration::from_millis(800));
    assert_eq!(r.hold_time(), Some(Duration::from_millis(800)));
    for _ in 0..64 {
        r.held_for(Duration::from_millis(1600));
    }
    let ms = r.hold_time().map(|d| d.as_millis()).unwrap_or(0);
    assert!((1590..=1600).contains(&ms), "{ms}");
}

proptest! {
    /// The bound without a replica count: R replicas (separate states and signals, as
    /// separate processes), proportional admission, any interleaving of reservations,
    /// releases and each replica's own polls of a model engine whose count is every
    /// replica's live reservations. A release made while a request of that replica waits
    /// is refilled by it at once (as the waiting request does, before any poll can see
    /// the slot free); one made with nobody waiting is not refillable. No rank holds more
    /// than its capacity plus one request per replica (an allowance rounded up, or a
    /// replica holding none taking one).
    #[test]
    fn replicas_without_a_count_exceed_a_rank_by_at_most_one_each(
        r in 1usize..6,
        cap in 1u64..12,
        ops in proptest::collection::vec((0usize..6, 0u8..4, any::<u64>()), 1..300),
    ) {
        let sigs: Vec<Arc<CapacitySignal>> = (0..r).map(|_| Arc::new(CapacitySignal::default())).collect();
        let n = proportional(0);
        let all: Vec<Arc<[RankCapacity]>> = (0..r)
            .map(|_| {
                let k = new_ranks(1);
                k[0].set_engine_cap(cap);
                k
            })
            .collect();
        let mut held: Vec<Vec<Reservation>> = (0..r).map(|_| Vec::new()).collect();
        let total = |held: &Vec<Vec<Reservation>>| held.iter().map(Vec::len).sum::<usize>() as u64;
        // Every replica polled once before traffic (an idle engine).
        for k in &all {
            k[0].observe(&Reported { busy: Some(0), ..Reported::default() });
        }
        for (who, op, coin) in ops {
            let who = who % r;
            match op {
                0 | 1 => {
                    if let Some(h) = take(&all[who], &n, &sigs[who]) {
                        held[who].push(h);
                    }
                }
                2 => {
                    if !held[who].is_empty() {
                        let i = (coin as usize) % held[who].len();
                        if coin % 2 == 0 {
                            held[who].swap_remove(i);
                        } else {
                            // A request of this replica waits: it takes the slot at once.
                            let waiting = sigs[who].waiter();
                            held[who].swap_remove(i);
                            if let Some(h) = take(&all[who], &n, &sigs[who]) {
                                held[who].push(h);
                            }
                            drop(waiting);
                        }
                    }
                }
                _ => {
                    let busy = total(&held);
                    all[who][0].observe_with(&Reported { busy: Some(busy), ..Reported::default() }, coin);
                }
            }
            prop_assert!(
                total(&held) <= cap + r as u64,
                "{} held > capacity {} + {} replicas", total(&held), cap, r
            );
        }
        held.clear();
        prop_assert!(all.iter().all(|k| k[0].own() == 0));
    }
}

#[test]
fn an_early_poll_is_asked_once_until_a_poller_starts_one() {
    let sig = CapacitySignal::default();
    let seen = sig.polling();
    let wanted = sig.poll_wanted();
    tokio::pin!(wanted);
    assert!(futures_util::FutureExt::now_or_never(wanted.as_mut()).is_none());
    // Many requests wait: one ask, and the registered poller is woken.
    for _ in 0..5 {
        sig.want_poll();
    }
    assert!(
        futures_util::FutureExt::now_or_never(wanted.as_mut()).is_some(),
        "an early poll was asked for"
    );
    assert_eq!(sig.poll_asks(), seen + 1, "asked once");
    // A poller starts one: the next ask counts again, also for a poller that was busy
    // polling when it came (it compares the count after its pause).
    let seen = sig.polling();
    assert_eq!(sig.poll_asks(), seen);
    sig.want_poll();
    assert_eq!(sig.poll_asks(), seen + 1);
}
