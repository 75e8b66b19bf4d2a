//! How a live stream asks to be moved, without the relay reaching up into the dispatcher:
//! the relay owns the stream's account ([`Tracker`]) and a [`Moves`], the dispatcher's way
//! to run a follow-up attempt (`dispatch::moves` implements it). The relay asks; the
//! dispatcher runs attempts; arrows point down.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use super::parts::{Passive, Ready};
use super::splice::{GenerateMode, Tracker};
use crate::error::Failure;
use crate::request::record::LegTrace;
use crate::request::ApiRoute;
use crate::telemetry;
use crate::types::{Role, WorkerId};

/// A move under way: the new attempt's parts and the legs it picked.
pub type MoveFuture = Pin<Box<dyn Future<Output = Result<(Ready, LegTrace), Failure>> + Send>>;

/// The dispatcher's side of a move (implemented by `dispatch::moves`).
pub trait Moves: Send {
    /// The longest silence after which the decode at `at` is taken for stalled and the
    /// stream moved; `None` when no move is left.
    fn gap(&self, at: &Passive) -> Option<Duration>;
    /// Starts moving the stream off `dead` (the decode or regular worker, by `role`, that
    /// just failed), from what `tracker` says was sent; `Err` says why it cannot be moved.
    fn start(
        &mut self,
        tracker: &mut Tracker,
        role: Role,
        dead: WorkerId,
    ) -> Result<MoveFuture, String>;
}

/// A continuable stream's account and its way to another worker.
pub struct Mover {
    pub tracker: Tracker,
    moves: Box<dyn Moves>,
}

impl Mover {
    pub fn new(tracker: Tracker, moves: Box<dyn Moves>) -> Mover {
        Mover { tracker, moves }
    }

    /// See [`Moves::gap`]; `None` too once the stream showed something that cannot be
    /// continued.
    pub fn gap(&self, at: &Passive) -> Option<Duration> {
        if self.tracker.stopped().is_some() {
            return None;
        }
        self.moves.gap(at)
    }

    pub fn route(&self) -> ApiRoute {
        self.tracker.plan().route
    }

    /// See [`Moves::start`].
    pub fn start(&mut self, role: Role, dead: WorkerId) -> Result<MoveFuture, String> {
        self.moves.start(&mut self.tracker, role, dead)
    }

    /// The new decode streams `/generate` incrementally (or not).
    pub fn moved_to(&mut self, incremental: bool) {
        self.tracker.set_source_mode(if incremental {
            GenerateMode::Incremental
        } else {
            GenerateMode::Cumulative
        });
    }
}

/// How a move ended, for `pdgate_stream_moves_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoveOutcome {
    /// The stream continues on a new pair.
    Moved,
    /// The stream could not be continued (the reason is logged).
    Refused,
    /// The follow-up failed before its first byte.
    Failed,
}

impl MoveOutcome {
    fn label(self) -> &'static str {
        match self {
            MoveOutcome::Moved => "moved",
            MoveOutcome::Refused => "refused",
            MoveOutcome::Failed => "failed",
        }
    }
}

/// Counts a move (rare: a plain counter lookup is fine).
pub fn count(route: ApiRoute, reason: &'static str, outcome: MoveOutcome) {
    metrics::counter!(telemetry::STREAM_MOVES, "route" => route.label(), "reason" => reason, "outcome" => outcome.label())
        .increment(1);
}
