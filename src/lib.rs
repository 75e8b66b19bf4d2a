//! pdgate: a router and load balancer for prefill/decode (PD) disaggregated SGLang serving.
//!
//! The crate is organised by concept: [`server`] (the front door), [`dispatch`] (one
//! request's life under the room-to-rank contract: its attempts, retries and stream moves),
//! [`relay`] (the response body from the first byte on), [`legs`] (sending one leg and
//! reading what its answer says), [`request`] (the client's request as parsed, its record,
//! its follow-up body), [`skim`] (top-level JSON reading), [`bootstrap`] (the embedded decode-side
//! bootstrap poll), [`pool`] (the lock-free worker snapshot), [`policy`] (selection),
//! [`health`] (active checks) and [`config`]; [`check`] is `pdgate check`, the deployment
//! doctor, above the router.
//!
//! The library as the router builds it holds no test doubles (the fuzz entry points and
//! their fake engine on loopback are behind the `fuzzing` feature, for the fuzz crate and
//! the corpus replay test): the SGLang engine simulator is the `pdgate-sim` crate
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
pub mod dispatch;
pub mod engine;
pub mod error;
pub mod fleet;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
pub mod health;
pub mod legs;
pub mod listen;
pub mod memory;
pub mod metrics_listener;
pub mod models;
pub mod policy;
pub mod pool;
pub mod progress;
pub mod relay;
pub mod reload;
pub mod request;
pub mod router;
pub mod server;
pub mod skim;
pub mod telemetry;
pub mod trace;
pub mod types;
pub mod upstream;
pub mod url;

#[cfg(test)]
mod test_cuts;
