//! What a (worker, DP rank)'s prefix cache did for the requests placed on it: the prompt
//! tokens its answers reported and how many of them the engine found cached
//! (`meta_info.cached_tokens`, `usage.prompt_tokens_details.cached_tokens`), and how many
//! requests an affinity policy placed here although the request's key belonged to another
//! rank (a *spill*: the key's own rank was over the load bound or had no room).
//!
//! Why per rank: with DP attention an engine keeps one prefix cache per rank, so a hit
//! ratio per worker would hide a conversation that hops between a worker's ranks. Read at
//! scrape time (`pool::series`), like the in-flight counters: a request adds to two
//! atomics when its answer ends, and touches no labelled metric.
//!
//! Invariants: counters only grow (a set is replaced whole, from zero, when the worker's DP
//! size changes, which Prometheus reads as a counter reset); a rank out of range is
//! ignored, never a panic.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::types::DpRank;

/// Per-rank counters of one worker; see the module docs.
#[derive(Debug)]
pub struct RankTally {
    prompt_tokens: Box<[AtomicU64]>,
    cached_tokens: Box<[AtomicU64]>,
    spills: Box<[AtomicU64]>,
}

/// One rank's counters as read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RankCounts {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub spills: u64,
}

impl RankTally {
    /// Zeroed counters for `dp` ranks (at least one).
    pub fn new(dp: u32) -> RankTally {
        let zeros = || (0..dp.max(1)).map(|_| AtomicU64::new(0)).collect();
        RankTally {
            prompt_tokens: zeros(),
            cached_tokens: zeros(),
            spills: zeros(),
        }
    }

    /// An answer from `rank` reported `prompt` prompt tokens, `cached` of them cached
    /// (`cached` is capped at `prompt`: an engine's figures never raise the ratio past 1).
    pub fn answered(&self, rank: DpRank, prompt: u64, cached: u64) {
        let k = rank as usize;
        if let (Some(p), Some(c)) = (self.prompt_tokens.get(k), self.cached_tokens.get(k)) {
            p.fetch_add(prompt, Ordering::Relaxed);
            c.fetch_add(cached.min(prompt), Ordering::Relaxed);
        }
    }

    /// A request was placed on `rank` although its key's own rank was another.
    pub fn spilled_in(&self, rank: DpRank) {
        if let Some(s) = self.spills.get(rank as usize) {
            s.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Every rank's counters, rank 0 first.
    pub fn read(&self) -> Vec<RankCounts> {
        (0..self.spills.len())
            .map(|k| RankCounts {
                prompt_tokens: self.prompt_tokens[k].load(Ordering::Relaxed),
                cached_tokens: self.cached_tokens[k].load(Ordering::Relaxed),
                spills: self.spills[k].load(Ordering::Relaxed),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_add_up_per_rank_and_stray_ranks_are_ignored() {
        let t = RankTally::new(2);
        t.answered(1, 100, 64);
        t.answered(1, 50, 80); // more cached than prompt: capped
        t.answered(0, 10, 0);
        t.answered(7, 1, 1); // no such rank
        t.spilled_in(0);
        t.spilled_in(9);
        assert_eq!(
            t.read(),
            vec![
                RankCounts {
                    prompt_tokens: 10,
                    cached_tokens: 0,
                    spills: 1
                },
                RankCounts {
                    prompt_tokens: 150,
                    cached_tokens: 114,
                    spills: 0
                },
            ]
        );
        assert_eq!(RankTally::new(0).read().len(), 1);
    }
}
