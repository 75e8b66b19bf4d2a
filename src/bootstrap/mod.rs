//! The embedded decode-side bootstrap poll: the protocol client ([`client`]) and the
//! per-prefill tracker that keeps a `RankReadiness` per (prefill, DP rank) ([`tracker`]),
//! plus the request-path preflight.

pub mod client;
pub mod ownership;
pub mod preflight;
pub mod tracker;

pub use client::{Generation, Layout};
