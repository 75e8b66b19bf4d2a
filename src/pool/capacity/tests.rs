use super::*;
use proptest::prelude::*;

fn need(override_per_rank: u64, tokens: u64) -> Need {
    Need {
        limits: Limits {
            override_per_rank,
            learn_from_engine: true,
            kv_bound: true,
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
