//! `[progress]`: stall detection by lack of progress (see `crate::progress` for the rule).
//! Every deadline has a floor and a ceiling; what lies between is learned.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{invalid, range, range_f, ConfigError};

/// Stall detection: deadlines learned per worker and DP rank from recent legs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProgressConfig {
    /// Off: no leg is ever declared stalled (the fixed timeouts still apply).
    pub enabled: bool,
    /// A deadline is this many times the largest recent (size-scaled) leg time.
    pub multiplier: f64,
    /// Samples a worker's rank (or its peers together) need before learning replaces the
    /// ceiling.
    pub min_samples: u32,
    /// Recent samples that count, per (worker, rank) and kind.
    pub window: u32,
    /// Stalls on one worker, with no leg completed on it in between, that take it out of
    /// rotation (at least 2: one stuck request alone never ejects its worker).
    pub eject_after_stalls: u32,
    /// The prefill leg (sent → answered), scaled by the prompt's size.
    pub prefill_floor_ms: u64,
    pub prefill_ceiling_ms: u64,
    /// Decode's first event after the prefill answered.
    pub first_token_floor_ms: u64,
    pub first_token_ceiling_ms: u64,
    /// The gap between two events of a decode stream (the bound offered to the relay).
    pub gap_floor_ms: u64,
    pub gap_ceiling_ms: u64,
    /// A stalled worker is probed with a one-token request through a real pair; the first
    /// probe waits this long; from the second probe in a row the engine held without
    /// answering (still stuck), each doubles the wait up to the max; any other failed probe
    /// brings it back to the interval.
    pub probe_interval_ms: u64,
    pub probe_max_interval_ms: u64,
    /// How long one probe may take.
    pub probe_timeout_ms: u64,
}

impl Default for ProgressConfig {
    fn default() -> Self {
        ProgressConfig {
            enabled: true,
            multiplier: 3.0,
            min_samples: 5,
            window: 32,
            eject_after_stalls: 2,
            prefill_floor_ms: 500,
            prefill_ceiling_ms: 30_000,
            first_token_floor_ms: 500,
            first_token_ceiling_ms: 30_000,
            gap_floor_ms: 1000,
            gap_ceiling_ms: 30_000,
            probe_interval_ms: 1000,
            probe_max_interval_ms: 30_000,
            probe_timeout_ms: 10_000,
        }
    }
}

impl ProgressConfig {
    pub fn probe_interval(&self) -> Duration {
        Duration::from_millis(self.probe_interval_ms)
    }
    pub fn probe_max_interval(&self) -> Duration {
        Duration::from_millis(self.probe_max_interval_ms)
    }
    pub fn probe_timeout(&self) -> Duration {
        Duration::from_millis(self.probe_timeout_ms)
    }
}

const HOUR_MS: u64 = 3_600_000;

pub(super) fn validate(p: &ProgressConfig) -> Result<(), ConfigError> {
    range_f("progress.multiplier", p.multiplier, 1.0, 100.0)?;
    range("progress.min_samples", p.min_samples, 1, 64)?;
    range("progress.window", p.window, 1, 64)?;
    range("progress.eject_after_stalls", p.eject_after_stalls, 2, 1000)?;
    for (name, floor, ceiling) in [
        ("prefill", p.prefill_floor_ms, p.prefill_ceiling_ms),
        (
            "first_token",
            p.first_token_floor_ms,
            p.first_token_ceiling_ms,
        ),
        ("gap", p.gap_floor_ms, p.gap_ceiling_ms),
    ] {
        range(&format!("progress.{name}_floor_ms"), floor, 10, HOUR_MS)?;
        range(&format!("progress.{name}_ceiling_ms"), ceiling, 10, HOUR_MS)?;
        if floor > ceiling {
            return Err(invalid(format!(
                "progress.{name}_floor_ms = {floor} must not be above progress.{name}_ceiling_ms = {ceiling}"
            )));
        }
    }
    range(
        "progress.probe_interval_ms",
        p.probe_interval_ms,
        10,
        HOUR_MS,
    )?;
    range(
        "progress.probe_max_interval_ms",
        p.probe_max_interval_ms,
        10,
        HOUR_MS,
    )?;
    range("progress.probe_timeout_ms", p.probe_timeout_ms, 10, HOUR_MS)?;
    Ok(())
}
