//! Names shared by every module: roles, worker ids, DP ranks, rooms, targets and pairs, and
//! the request id header. A leaf: it imports nothing of the crate.
//!
//! A [`Room`] is the SGLang `bootstrap_room`: a non-negative integer that fits in an i64
//! (63 bits). A [`Target`] is one (worker, DP rank) a leg is sent to; a [`Pair`] is the
//! prefill and decode target of one request attempt.

use std::fmt;

/// The request id header, echoed on every response and forwarded to engines.
pub const REQUEST_ID: http::HeaderName = http::HeaderName::from_static("x-request-id");

/// Which side of PD disaggregation a worker serves: SGLang's wire name, defined in the
/// protocol crate [`sglang_pd`] that the simulator shares.
pub use sglang_pd::Role;

/// A role's index in per-role arrays (`[T; ROLES]`): prefill 0, decode 1, regular 2.
pub const fn role_index(role: Role) -> usize {
    match role {
        Role::Prefill => 0,
        Role::Decode => 1,
        Role::Regular => 2,
    }
}

/// How many roles there are (the length of per-role arrays).
pub const ROLES: usize = 3;

/// 64-bit FNV-1a: stable across processes, builds and versions, so that independent
/// pdgate replicas map the same prompt to the same key (`request`'s prefix key) and the
/// same worker to the same points (`policy::cache_aware`'s ring). Never change it.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Index of a worker in its pool's configuration order; stable for the worker's life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId(pub u32);

impl WorkerId {
    /// Its stable id with its role, as the admin API and `/metrics` (`worker_id`) show it:
    /// `prefill-3`, `decode-0` (ids count per role and are never reused in it).
    pub fn reference(self, role: Role) -> String {
        WorkerIdent::new(role, self).to_string()
    }
}

/// A worker's one name: `prefill-3`, `decode-0`, `regular-1` (ids count per role and are
/// never reused in it). Every log line about a worker carries it as `worker_id` beside the
/// engine's URL as `worker_url`, the same two names as the `worker_id` and `worker_url`
/// labels of the `pdgate_worker_*` series, the admin API's `id` and `url`, and the trace
/// attributes (docs/operations.md, "Logs"). Displayed without allocating:
/// `tracing::warn!(worker_id = %WorkerIdent::new(role, id), worker_url = %url, ...)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WorkerIdent {
    pub role: Role,
    pub id: WorkerId,
}

impl WorkerIdent {
    pub fn new(role: Role, id: WorkerId) -> WorkerIdent {
        WorkerIdent { role, id }
    }
}

impl serde::Serialize for WorkerIdent {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl fmt::Display for WorkerIdent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.role.as_str(), self.id.0)
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "w{}", self.0)
    }
}

/// A request's internal id: 16 lowercase hex digits, kept inline (`Copy`, no allocation).
/// It is the base of every leg's `rid` and of the `x-request-id` pdgate makes up.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct RequestId([u8; 16]);

impl RequestId {
    /// A fresh random id.
    pub fn random() -> RequestId {
        RequestId::from_u64(rand::random())
    }

    pub fn from_u64(v: u64) -> RequestId {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut out = [0u8; 16];
        for (i, b) in out.iter_mut().enumerate() {
            *b = HEX[((v >> (60 - 4 * i)) & 0xf) as usize];
        }
        RequestId(out)
    }

    pub fn as_str(&self) -> &str {
        // Only ASCII hex digits are ever stored.
        std::str::from_utf8(&self.0).unwrap_or("0000000000000000")
    }

    /// The `rid` of one leg: `pdg-{id}-{attempt:02}{side}` (`side` is `p` or `d`).
    pub fn leg_rid(&self, attempt: u32, side: char) -> String {
        let mut s = String::with_capacity(26);
        s.push_str("pdg-");
        s.push_str(self.as_str());
        s.push('-');
        if attempt < 10 {
            s.push('0');
        }
        let mut digits = [0u8; 10];
        let mut n = attempt;
        let mut i = digits.len();
        loop {
            i -= 1;
            digits[i] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        s.push_str(std::str::from_utf8(&digits[i..]).unwrap_or("0"));
        s.push(side);
        s
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
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

#[cfg(test)]
mod request_id_tests {
    use super::RequestId;

    #[test]
    fn ids_and_leg_rids_match_the_formatted_forms() {
        for v in [0u64, 1, 0xdead_beef, u64::MAX, 0x0123_4567_89ab_cdef] {
            let id = RequestId::from_u64(v);
            assert_eq!(id.as_str(), format!("{v:016x}"));
            for attempt in [0u32, 1, 9, 10, 99, 100, 12345, u32::MAX] {
                for side in ['p', 'd'] {
                    assert_eq!(
                        id.leg_rid(attempt, side),
                        format!("pdg-{v:016x}-{attempt:02}{side}")
                    );
                }
            }
        }
    }
}
