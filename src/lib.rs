//! pdgate: a router and load balancer for prefill/decode (PD) disaggregated SGLang serving.
//!
//! The crate is organised by concept: [`server`] (the front door), [`pd`] (one request's
//! life under the room-to-rank contract), [`bootstrap`] (the embedded decode-side
//! bootstrap poll), [`pool`] (the lock-free worker snapshot), [`policy`] (selection),
//! [`health`] (active checks) and [`config`]; [`check`] is `pdgate check`, the deployment
//! doctor, above the router.
//!
//! The library holds no test doubles: the SGLang engine simulator is the `pdgate-sim` crate
//! (`sim/`), used by the `pdgate` binary's `sim` and `demo` commands and by the tests and
//! benches; the SGLang PD wire types both share ([`types::Role`], the default bootstrap
//! port) come from the `sglang-pd` crate (`protocol/`).
#![forbid(unsafe_code)]

pub mod admin;
pub mod admission;
pub mod auth;
pub mod body;
pub mod bootstrap;
pub mod check;
pub mod cli;
pub mod config;
pub mod discovery;
pub mod engine;
pub mod error;
pub mod fleet;
#[doc(hidden)]
pub mod fuzzing;
pub mod health;
pub mod listen;
pub mod memory;
pub mod metrics_listener;
pub mod models;
pub mod pd;
pub mod policy;
pub mod pool;
pub mod progress;
pub mod reload;
pub mod router;
pub mod server;
pub mod telemetry;
pub mod trace;
pub mod types;
pub mod upstream;
pub mod url;

#[cfg(test)]
mod test_cuts;
