//! What the integration tests share: the in-process router and simulated engines harness
//! ([`common`]), raw-socket engines for the leg client ([`upstream_support`]), simulator
//! helpers ([`sim_support`]), an in-process OTLP collector ([`otlp_collector`]), the
//! skip-or-fail rule of the interop tests ([`interop`]) and the runtime that puts the whole
//! suite on several threads under `PDGATE_TEST_THREADS` ([`rt`]).

pub mod common;
pub mod fake_kube;
pub mod interop;
pub mod otlp_collector;
pub mod rt;
pub mod sim_support;
pub mod upstream_support;
