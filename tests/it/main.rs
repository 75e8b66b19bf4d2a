//! The integration tests, as one test binary (the crate is linked once, not once per
//! file): each module is one concern, sharing [`support`]. Every server listens on
//! 127.0.0.1, port 0, and keeps its listener; every load loop is bounded in count and time.

mod support;

mod access_log;
mod admin;
mod api_keys;
mod background_load;
mod bootstrap_ownership;
mod bootstrap_tracking;
mod breaker_trials;
mod capacity;
mod chaos;
mod check;
mod check_discovery;
mod connections;
mod contract;
mod detached_prefill;
mod discovery;
mod discovery_e2e;
mod docs;
mod down_at_start;
mod engine_bounds;
mod example_config;
mod faults;
mod first_day;
mod fleet;
mod front_door;
mod fuzz_corpus;
mod garbage;
mod health_flags;
mod image_runs;
mod interop_bootstrap;
mod interop_uvicorn;
mod layers;
mod manifests;
mod memory_budget;
mod metrics;
mod models;
mod models_rollout;
mod per_model;
mod policies;
mod prefill_backlog;
mod preflight;
mod regular_moves;
mod regular_stalls;
mod regular_workers;
mod reload;
mod replica_count;
mod retries;
mod self_healing;
mod serve_binary;
mod sglang_endpoints;
mod sglang_flags;
mod shutdown;
mod sim_bootstrap;
mod sim_cli;
mod sim_faults;
mod sim_pd;
mod stale_connection;
mod stalls;
mod stream_moves;
mod traces;
mod upstream_leg_errors;
mod upstream_legs;
mod worker_logs;

// The chaos soak's driver, shared with `benches/chaos` (whose modules name each other
// from the crate root).
#[path = "../../benches/chaos/client.rs"]
mod client;
#[path = "../../benches/chaos/driver.rs"]
mod driver;
#[path = "../../benches/chaos/report.rs"]
mod report;
#[path = "../../benches/chaos/soak.rs"]
mod soak;
