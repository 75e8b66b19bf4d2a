//! A decode engine's caches of what it learnt from prefills' bootstrap servers: each
//! prefill's parallel info (the sentinel `GET /route` answer), the fetches in progress, and
//! each prefill DP rank's KV endpoint, keyed by `bootstrap_addr` like SGLang's.
//!
//! Why a module of its own: the caches are part of an engine's shared state
//! ([`crate::state::Engine`]) while [`crate::decode`] (which fills and reads them) needs
//! that state; plain data here keeps the module graph acyclic.
//!
//! Invariants: one fetch per address at a time (waiters share its `watch` receiver);
//! [`DecodeState::forget`] drops an address's info and rank routes together.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::watch;

/// What decode needs from the sentinel answer.
#[derive(Debug, Clone)]
pub(crate) struct PrefillInfo {
    pub dp_size: u32,
    pub follow_bootstrap_room: bool,
    pub page_size: Option<i64>,
    pub kv_cache_dtype: Option<String>,
}

pub(crate) type FetchResult = Option<Result<Arc<PrefillInfo>, String>>;

#[derive(Default)]
pub(crate) struct Caches {
    pub info: HashMap<String, Arc<PrefillInfo>>,
    pub fetching: HashMap<String, watch::Receiver<FetchResult>>,
    pub routes: HashMap<(String, u32), String>,
}

/// Decode-side caches, keyed by `bootstrap_addr` like SGLang's.
#[derive(Default)]
pub(crate) struct DecodeState {
    caches: Mutex<Caches>,
}

impl DecodeState {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Caches> {
        self.caches.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn forget(&self, addr: &str) {
        let mut g = self.lock();
        g.info.remove(addr);
        g.routes.retain(|(a, _), _| a != addr);
    }
}
