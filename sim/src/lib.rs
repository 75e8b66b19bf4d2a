//! pdgate-sim: an SGLang engine simulator. Prefill and decode engines that speak SGLang
//! 0.5.23's PD protocol over real TCP, for pdgate's tests, benches and `pdgate sim|demo`.
//!
//! Why: pdgate must be tested against the behaviour that makes PD routing hard
//! — the bootstrap server, the room → DP-rank contract, the KV rendezvous, the
//! decode's timeouts and SGLang's failure shapes — without GPUs. Each
//! simulated engine is a set of real listeners on 127.0.0.1 (or `host`):
//!
//! - a plain engine (`Role::Regular`, SGLang's `--disaggregation-mode null`) runs whole
//!   requests on its own ([`plain`]);
//! - the engine HTTP port (`/generate`, OpenAI routes, `/server_info`, loads,
//!   `/abort_request`, plus `/sim/stats` and `/sim/faults`);
//! - for a prefill, its bootstrap server ([`bootstrap`]) answering exactly like
//!   SGLang's, and one KV rank endpoint per DP rank ([`rendezvous`]) that the
//!   decode long-polls, standing in for ZMQ.
//!
//! Why a crate of its own: it is a test double, and the router library must not contain
//! one. The `pdgate` package uses it only from its binary (`pdgate sim`, `pdgate demo`) and
//! from its tests, benches and examples.
//!
//! Invariants that hold across the crate:
//! - Independent of the router: it does not depend on `pdgate`; the only wire types it
//!   shares with it ([`Role`], the default bootstrap port) come from the protocol crate
//!   `sglang-pd`, so the simulator stands in for SGLang and cannot borrow the router's
//!   view of the protocol.
//! - Listeners stay bound for an engine's whole life; "down" means
//!   accept-and-drop plus cutting open connections, never re-binding.
//! - No panics on input: every parse failure becomes an HTTP error shape.
//! - Stats are exact: every request instance ends in exactly one outcome and
//!   `held_now` returns to 0 (drop guards), see [`StatsSnapshot`].
//!
//! Public API: [`spawn`] / [`SimEngine`], [`SimCluster`], [`EngineConfig`],
//! [`Faults`], [`Role`], [`StatsSnapshot`] and [`cli`] for `pdgate sim`.
#![forbid(unsafe_code)]

mod bootstrap;
#[cfg(test)]
mod cache_tests;
pub mod cli;
mod cluster;
mod config;
mod contract;
mod decode;
mod decode_cache;
mod engine;
mod hits;
mod http;
mod info;
#[cfg(test)]
mod load_tests;
mod plain;
mod plan;
mod prefill;
mod prefix_cache;
mod pyjson;
mod rendezvous;
mod request;
mod run;
mod shapes;
mod state;
mod stats;
mod tokens;

pub use cluster::SimCluster;
pub use config::{EngineConfig, Faults, Role, MAX_OUTPUT_TOKENS};
pub use engine::{spawn, SimEngine};
pub use hits::HitsSnapshot;
pub use state::RECENT_RIDS;
pub use stats::StatsSnapshot;
