//! A set of simulated engines in one process, sharing one contract book.
//!
//! Why: router tests and `pdgate sim --prefill N --decode M` need several
//! prefills and decodes at once, and cross-engine contract checks (a decode
//! leg sent to the wrong prefill) need the engines to see each other's legs.
//!
//! Invariants: engines in `prefills` always have role prefill and those in
//! `decodes` role decode (the role field of the given configs is overridden);
//! dropping the cluster shuts every engine down.

use std::io;

use crate::config::{EngineConfig, Role};
use crate::contract::ContractBook;
use crate::engine::{spawn_in, SimEngine};
use crate::stats::StatsSnapshot;

/// Prefill and decode engines started together.
#[derive(Debug)]
pub struct SimCluster {
    pub prefills: Vec<SimEngine>,
    pub decodes: Vec<SimEngine>,
}

impl SimCluster {
    /// Starts one prefill per entry of `prefill` and one decode per entry of `decode`.
    pub async fn spawn(prefill: &[EngineConfig], decode: &[EngineConfig]) -> io::Result<Self> {
        let book = ContractBook::new();
        let mut prefills = Vec::with_capacity(prefill.len());
        for cfg in prefill {
            let cfg = EngineConfig {
                role: Role::Prefill,
                ..cfg.clone()
            };
            prefills.push(spawn_in(cfg, book.clone()).await?);
        }
        let mut decodes = Vec::with_capacity(decode.len());
        for cfg in decode {
            let cfg = EngineConfig {
                role: Role::Decode,
                ..cfg.clone()
            };
            decodes.push(spawn_in(cfg, book.clone()).await?);
        }
        Ok(SimCluster { prefills, decodes })
    }

    /// Each prefill as a router worker: its URL and its bootstrap port.
    pub fn prefill_endpoints(&self) -> impl Iterator<Item = (String, Option<u16>)> + '_ {
        self.prefills.iter().map(|p| (p.url(), p.bootstrap_port()))
    }

    /// Each decode's URL.
    pub fn decode_urls(&self) -> impl Iterator<Item = String> + '_ {
        self.decodes.iter().map(|d| d.url())
    }

    /// Every engine, prefills first.
    pub fn engines(&self) -> impl Iterator<Item = &SimEngine> {
        self.prefills.iter().chain(self.decodes.iter())
    }

    /// The counters of every engine, summed.
    pub fn total_stats(&self) -> StatsSnapshot {
        let mut total = StatsSnapshot::default();
        for e in self.engines() {
            total.add(&e.stats());
        }
        total
    }

    /// Stops every engine.
    pub fn shutdown(self) {
        drop(self);
    }
}
