//! `[capacity]`: how many requests a decode DP rank is given at once. Kept in its own file
//! beside the routing settings; the same rules hold (defaults only here, unknown keys
//! refused, every value checked by [`super::Config::validate`]).

use serde::{Deserialize, Serialize};

use super::{range, ConfigError};

/// `[capacity]`: decode capacity per DP rank (see docs/pools-and-capacity.md, "Decode capacity").
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CapacityConfig {
    /// Requests each decode DP rank runs at once, overriding what the engine reports;
    /// 0 = learn it from the engine.
    pub decode_max_running_per_rank: u64,
    /// Learn each decode's capacity from the engine (`/server_info`
    /// `internal_states[i].effective_max_running_requests_per_dp`, `/v1/loads`
    /// `max_running_requests`); false: only the override limits.
    pub learn_from_engine: bool,
    /// Also hold a request back while the decode rank's KV cache has no room for it
    /// (prompt + max new tokens against `max_total_num_tokens` minus the tokens in use,
    /// as `/v1/loads` reports them).
    pub kv_bound: bool,
    /// With the replica count unknown (`admission.replicas` = 0), each replica takes fresh
    /// requests on a decode rank only in proportion to its part of the rank's reported
    /// load (one request when it holds none there), and asks for an early poll when it
    /// wants more: replicas that cannot see each other then do not each fill a rank
    /// between two polls (ARCHITECTURE.md, "Admission across replicas"). Acts with the
    /// load poll on and a capacity known; off: each replica fills the rank from its own
    /// count and the last report, as if it were alone.
    pub proportional_share: bool,
}

impl Default for CapacityConfig {
    fn default() -> Self {
        CapacityConfig {
            decode_max_running_per_rank: 0,
            learn_from_engine: true,
            kv_bound: true,
            proportional_share: true,
        }
    }
}

impl CapacityConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        range(
            "capacity.decode_max_running_per_rank",
            self.decode_max_running_per_rank,
            0,
            1_000_000,
        )
    }
}
