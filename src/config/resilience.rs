//! `[retry]`, `[health]` and `[breaker]`: how pdgate recovers from a failing engine
//! (retries and stream moves, active health checks, circuit breakers). Kept in their own
//! file beside the routing settings; the same rules hold (defaults only here, unknown keys
//! refused, every value checked by [`super::Config::validate`]).

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Retries before the first byte reached the client, within a budget.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetryConfig {
    /// Extra attempts per request (0 disables retries).
    pub max_retries: u32,
    /// Retries allowed as a share of requests (0.2 = one retry per five requests).
    pub budget_ratio: f64,
    /// Retries always allowed, as a reserve that refills with requests.
    pub budget_min_reserve: u32,
    /// Retries kept for what one engine's failure costs, on top of the budget: stream
    /// moves, and the retries of requests whose engine stalled (found by lack of progress).
    /// An ordinary retry before the first byte leaves them, deposits refill them first. A
    /// client whose request failed fast before its first byte gets a clean error it can
    /// retry; a stream already half read has no such way back, and a stalled request has
    /// already cost its client the stall deadline, so in a storm that spends the budget
    /// these go first. Size it to the requests one engine runs at once (an engine that
    /// hangs stalls or moves them all).
    pub budget_move_reserve: u32,
    /// Times one stream may be moved to another decode after its decode died or stalled
    /// mid-stream (0: never; each move spends the retry budget). Two by default: a long
    /// stream can meet two faults in a row (its decode dies, and the one it moved to
    /// stalls later), each of one engine.
    pub max_stream_moves: u32,
    /// A decode that sent tokens and then nothing for this long is taken for stalled and
    /// its stream moved (only streams that can still move; others wait for
    /// `timeouts.stream_idle_secs`).
    pub mid_stream_gap_ceiling_ms: u64,
    /// How long a stream whose decode died waits for another decode to become routable
    /// when none is (the other decode recovering, restarting or at capacity) before it
    /// ends with its error frame. The client sees a pause, not an error. A retry before the
    /// first byte, after an attempt a worker failed, waits the same way for a routable
    /// alternative (a request that could not be sent anywhere is answered at once).
    pub move_wait_ms: u64,
}

impl RetryConfig {
    /// Whether `other` keeps this budget (a reload keeps its balance when it does).
    pub fn same_budget(&self, other: &RetryConfig) -> bool {
        self.budget_ratio == other.budget_ratio
            && self.budget_min_reserve == other.budget_min_reserve
            && self.budget_move_reserve == other.budget_move_reserve
    }
}

impl Default for RetryConfig {
    fn default() -> Self {
        RetryConfig {
            max_retries: 2,
            budget_ratio: 0.2,
            budget_min_reserve: 100,
            budget_move_reserve: 100,
            max_stream_moves: 2,
            mid_stream_gap_ceiling_ms: 10_000,
            move_wait_ms: 3_000,
        }
    }
}

/// Active health checks of engines (`GET /health`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthConfig {
    pub interval_secs: f64,
    pub timeout_secs: f64,
    /// Consecutive failed checks that take a worker out.
    pub failure_threshold: u32,
    /// Consecutive good checks that bring it back after it was taken out (a worker that
    /// was never healthy is admitted at its first good check).
    pub success_threshold: u32,
    /// How often a worker that is not healthy is probed (at most `interval_secs`): a
    /// restarted engine is back within about `success_threshold` × this, however long
    /// the healthy interval is (Envoy's `unhealthy_interval`).
    pub unhealthy_interval_ms: u64,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            interval_secs: 1.0,
            timeout_secs: 1.0,
            failure_threshold: 2,
            success_threshold: 1,
            unhealthy_interval_ms: 1000,
        }
    }
}

impl HealthConfig {
    pub fn interval(&self) -> Duration {
        Duration::from_secs_f64(self.interval_secs)
    }
    pub fn timeout(&self) -> Duration {
        Duration::from_secs_f64(self.timeout_secs)
    }
    pub fn unhealthy_interval(&self) -> Duration {
        Duration::from_millis(self.unhealthy_interval_ms)
    }
}

/// Passive health: a circuit breaker per worker, fed by real request outcomes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BreakerConfig {
    /// Failures in a row (blamed on the worker's own leg) that open the circuit; 0 = off.
    pub failure_threshold: u32,
    /// First open time; doubles on every re-open (a failed half-open trial).
    pub open_ms: u64,
    pub max_open_ms: u64,
    /// Largest share of a pool that passive signals alone may hold open (rounded down).
    pub max_ejection_ratio: f64,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            failure_threshold: 3,
            open_ms: 1000,
            max_open_ms: 30_000,
            max_ejection_ratio: 0.5,
        }
    }
}
