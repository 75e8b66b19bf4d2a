//! Detection of PD contract violations that one room table cannot see:
//! bootstrap fields that differ between the two legs of a room (possibly on
//! different prefill engines) and rooms a prefill has already seen.
//!
//! Why: a router bug that sends the decode leg somewhere else, or reuses a
//! room, makes the real engines hang until their 300 s timeouts; the simulator
//! behaves the same but counts the violation the moment the second leg shows.
//!
//! Invariants:
//! - A [`ContractBook`] is shared by every engine of one [`crate::SimCluster`]
//!   (an engine spawned alone gets its own), so cross-engine checks only see
//!   engines of the same cluster and parallel tests cannot disturb each other.
//! - A leg is in the book only while it is in flight ([`BookEntry`] removes it
//!   on drop); a bootstrap mismatch is counted at most once per arriving leg.
//! - [`SeenRooms`] remembers a room for at least [`ROOM_REUSE_TTL`] and holds
//!   at most [`SEEN_ROOMS_CAP`] rooms (oldest forgotten first).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a prefill remembers a room for reuse detection (2 × the bootstrap
/// server's 120 s entry TTL).
pub(crate) const ROOM_REUSE_TTL: Duration = Duration::from_secs(240);
/// Memory bound of [`SeenRooms`].
pub(crate) const SEEN_ROOMS_CAP: usize = 1_000_000;

/// Which leg of a room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LegKind {
    Prefill,
    Decode,
}

#[derive(Debug, Clone)]
struct BookLeg {
    id: u64,
    kind: LegKind,
    host: Option<String>,
    port: Option<u16>,
}

/// Legs in flight, by room, across the engines of one cluster.
#[derive(Default)]
pub(crate) struct ContractBook {
    legs: Mutex<HashMap<u64, Vec<BookLeg>>>,
    next_id: AtomicU64,
}

impl ContractBook {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(ContractBook::default())
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Vec<BookLeg>>> {
        self.legs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a leg; returns the entry (remove-on-drop) and whether a leg of
    /// the other kind for the same room carries different bootstrap fields.
    pub(crate) fn enter(
        self: &Arc<Self>,
        room: u64,
        kind: LegKind,
        host: Option<String>,
        port: Option<u16>,
    ) -> (BookEntry, bool) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut g = self.lock();
        let legs = g.entry(room).or_default();
        let mismatch = legs
            .iter()
            .any(|o| o.kind != kind && (o.host != host || o.port != port));
        legs.push(BookLeg {
            id,
            kind,
            host,
            port,
        });
        (
            BookEntry {
                book: Arc::clone(self),
                room,
                id,
            },
            mismatch,
        )
    }
}

/// Removes its leg from the book when dropped.
pub(crate) struct BookEntry {
    book: Arc<ContractBook>,
    room: u64,
    id: u64,
}

impl Drop for BookEntry {
    fn drop(&mut self) {
        let mut g = self.book.lock();
        if let Some(legs) = g.get_mut(&self.room) {
            legs.retain(|l| l.id != self.id);
            if legs.is_empty() {
                g.remove(&self.room);
            }
        }
    }
}

/// Rooms a prefill engine has seen recently.
#[derive(Default)]
pub(crate) struct SeenRooms {
    last: HashMap<u64, Instant>,
    order: VecDeque<(Instant, u64)>,
}

impl SeenRooms {
    /// Records `room`; returns true if it was seen within the TTL.
    pub(crate) fn see(&mut self, room: u64, now: Instant) -> bool {
        while let Some(&(at, r)) = self.order.front() {
            let expired = now.duration_since(at) > ROOM_REUSE_TTL;
            if !expired && self.order.len() <= SEEN_ROOMS_CAP {
                break;
            }
            self.order.pop_front();
            if self.last.get(&r) == Some(&at) {
                self.last.remove(&r);
            }
        }
        let reused = self
            .last
            .get(&room)
            .is_some_and(|at| now.duration_since(*at) <= ROOM_REUSE_TTL);
        self.last.insert(room, now);
        self.order.push_back((now, room));
        reused
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seen_rooms_detects_reuse_and_expires() {
        let mut s = SeenRooms::default();
        let t0 = Instant::now();
        assert!(!s.see(1, t0));
        assert!(!s.see(2, t0));
        assert!(s.see(1, t0 + Duration::from_secs(10)));
        assert!(!s.see(2, t0 + ROOM_REUSE_TTL + Duration::from_secs(1)));
    }

    #[test]
    fn book_flags_differing_fields_once_per_leg() {
        let book = ContractBook::new();
        let (_p, m1) = book.enter(7, LegKind::Prefill, Some("h".into()), Some(1));
        assert!(!m1);
        let (d, m2) = book.enter(7, LegKind::Decode, Some("h".into()), Some(2));
        assert!(m2);
        drop(d);
        let (_d2, m3) = book.enter(7, LegKind::Decode, Some("h".into()), Some(1));
        assert!(!m3);
    }
}
