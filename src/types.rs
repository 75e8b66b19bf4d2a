//! Names shared by every module: roles, worker ids, DP ranks, rooms, targets and pairs.
//!
//! A [`Room`] is the SGLang `bootstrap_room`: a non-negative integer that fits in an i64
//! (63 bits). A [`Target`] is one (worker, DP rank) a leg is sent to; a [`Pair`] is the
//! prefill and decode target of one request attempt.

use std::fmt;

/// Which side of PD disaggregation a worker serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Prefill,
    Decode,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            other => Err(format!(
                "unknown role {other:?} (expected prefill or decode)"
            )),
        }
    }
}

/// Index of a worker in its pool's configuration order; stable for the worker's life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId(pub u32);

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "w{}", self.0)
    }
}

/// A data-parallel rank inside one engine.
pub type DpRank = u32;

/// A bootstrap room: always `<= Room::MAX` (fits in an i64).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Room(u64);

impl Room {
    /// 2^63 - 1: SGLang routers draw rooms uniformly from [0, 2^63 - 1].
    pub const MAX: u64 = i64::MAX as u64;

    /// A room from a raw value; `None` when it does not fit in an i64.
    pub fn new(v: u64) -> Option<Room> {
        (v <= Self::MAX).then_some(Room(v))
    }

    pub fn get(self) -> u64 {
        self.0
    }

    /// The prefill DP rank a `follow_bootstrap_room` engine with `dp` ranks runs this room on.
    pub fn rank_for(self, dp: u32) -> DpRank {
        if dp <= 1 {
            0
        } else {
            (self.0 % u64::from(dp)) as DpRank
        }
    }
}

impl fmt::Display for Room {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// One leg's destination: a worker and the DP rank on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Target {
    pub worker: WorkerId,
    pub rank: DpRank,
}

/// The two legs of one request attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pair {
    pub prefill: Target,
    pub decode: Target,
}
