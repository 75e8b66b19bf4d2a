//! What an attempt hands the relay: the parts of a response whose decode produced its
//! first bytes ([`Ready`]), and where a failure after that is reported ([`Passive`]).

use std::time::Duration;

use bytes::Bytes;

use super::prefill::PrefillWatch;
use super::sse::SseScanner;
use crate::legs::LegCancel;
use crate::pool::{LoadGuard, TrialGuard};
use crate::types::{DpRank, Pair, Role};
use crate::upstream::LegBody;

/// The half-open trials an attempt holds (prefill's, decode's): kept until the
/// dispatcher's verdict on the attempt is recorded, then dropped, so that no other request
/// can take a trial between the attempt's end and its verdict.
pub type Trials = (Option<TrialGuard>, Option<TrialGuard>);

/// Where a failure after the first byte is reported (the blamed leg's breaker).
pub struct Passive {
    pub pool: std::sync::Arc<crate::pool::Pool>,
    pub cfg: crate::config::BreakerConfig,
    pub prefill: crate::types::WorkerId,
    pub decode: crate::types::WorkerId,
    /// The role of the worker streaming the answer: `Decode`, or `Regular` for a regular
    /// worker's answer (`dispatch::regular`), whose failures are blamed on it.
    pub decode_role: Role,
    /// Where a stream that ended well teaches its largest inter-event gap (stall
    /// detection): the decode's progress and rank.
    pub gaps: Option<(std::sync::Arc<crate::progress::WorkerProgress>, DpRank)>,
    /// Where an answer that ends well reports its prompt-cache figures
    /// ([`crate::skim::prompt_cache`]): the prefill's (a regular worker's own) rank, whose
    /// cache the engine's `cached_tokens` describe.
    pub tally: Option<(std::sync::Arc<crate::pool::tally::RankTally>, DpRank)>,
}

impl Passive {
    /// The decode's rank, where stall detection follows it.
    pub fn gap_rank(&self) -> Option<DpRank> {
        self.gaps.as_ref().map(|(_, r)| *r)
    }
}

pub struct PdBodyParts {
    pub first: Bytes,
    pub decode: LegBody,
    pub decode_cancel: LegCancel,
    pub decode_guard: LoadGuard,
    pub sse: Option<SseScanner>,
    pub prefill: Option<PrefillWatch>,
    /// The prefill's half-open trial when its leg still runs: its verdict (success) is
    /// recorded when the leg ends well, then the trial is freed.
    pub prefill_trial: Option<TrialGuard>,
    pub idle_for: Duration,
    pub passive: Passive,
    /// The router's rate for streams that repeat input logprobs, when this one does
    /// (`upstream.stream_logprob_bytes_per_sec`).
    pub merge_rate: Option<std::sync::Arc<crate::body::ByteRate>>,
}

/// An attempt whose decode produced its first bytes: what the relay needs to answer.
pub struct Ready {
    /// Bytes held for the answer (a decode answer read whole to merge logprobs): given
    /// back with the admission slot.
    pub held: crate::memory::Charge,
    pub pair: Pair,
    /// The decode streams `/generate` incrementally (its `/server_info`
    /// `incremental_streaming_output`), not SGLang's default cumulative text.
    pub decode_incremental: bool,
    pub head: http::response::Parts,
    pub body: PdBodyParts,
    /// Dropped after the verdict (see [`Trials`]); the prefill's moves into the body
    /// when its leg is still running (its verdict comes when that leg ends).
    pub trials: Trials,
}

impl Ready {
    /// The verdict on an attempt that produced its first bytes: the decode succeeded; the
    /// prefill too if its leg already ended (else its body records it when the leg ends
    /// well, holding the prefill's half-open trial until then). Trials are freed after the
    /// verdict.
    pub fn record_success(&mut self, pool: &std::sync::Arc<crate::pool::Pool>) {
        let (prefill_trial, decode_trial) = std::mem::take(&mut self.trials);
        if self.body.passive.decode_role == Role::Regular {
            // A regular worker's answer (`dispatch::regular`): one worker, one verdict.
            pool.report_success(Role::Regular, self.pair.decode.worker);
            drop((prefill_trial, decode_trial));
            return;
        }
        if self.body.prefill.is_none() {
            pool.report_success(Role::Prefill, self.pair.prefill.worker);
            drop(prefill_trial);
        } else {
            self.body.prefill_trial = prefill_trial;
        }
        pool.report_success(Role::Decode, self.pair.decode.worker);
        drop(decode_trial);
    }
}
