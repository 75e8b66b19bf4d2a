//! The runtime a test written as `#[tokio::test(crate = "crate::support::rt")]` runs on:
//! current-thread as written, or, when `PDGATE_TEST_THREADS=N` is set, a multi-thread
//! runtime with N workers. The router under test runs in-process on the test's runtime, so
//! this is how the whole suite exercises the router on several threads
//! (`PDGATE_TEST_THREADS=2 cargo test -p pdgate --test it`) while the default run stays
//! what each test says.
//!
//! How: `#[tokio::test]` builds its runtime with `<crate>::runtime::Builder::
//! new_current_thread()` and pins its body with `<crate>::pin!`; this module stands in for
//! that crate and answers `new_current_thread()` with tokio's own builder of the flavor
//! the variable asks for. Everything else is tokio's.
//!
//! Logs: a test that captures the router's logs installs its subscriber with
//! [`set_default`], not `tracing::subscriber::set_default` (which holds for the calling
//! thread only): on a multi-thread runtime, the runtime's other threads forward their
//! events to it.
//!
//! Tests that stay on one thread whatever the variable says keep plain `#[tokio::test]`:
//! those that need paused time (`start_paused`, `tokio::time::pause`, current-thread only)
//! — today `background_load::an_idle_router_keeps_to_the_bootstrap_budget_and_rebuilds_nothing`. Tests written
//! `flavor = "multi_thread"` are multi-threaded in both runs.

pub use tokio::pin;

use std::cell::RefCell;
use std::sync::{Arc, RwLock};

use tracing::span::{Attributes, Id, Record};
use tracing::subscriber::{Interest, Subscriber};
use tracing::{Dispatch, Event, Metadata};

/// Workers of the multi-thread runtime every such test runs on, from
/// `PDGATE_TEST_THREADS`; `None` (unset or empty): the test's own current-thread runtime.
pub fn threads() -> Option<usize> {
    let v = std::env::var("PDGATE_TEST_THREADS").ok()?;
    let v = v.trim();
    if v.is_empty() {
        return None;
    }
    match v.parse::<usize>() {
        Ok(n) if (1..=64).contains(&n) => Some(n),
        _ => panic!("PDGATE_TEST_THREADS={v:?}: a number of worker threads from 1 to 64"),
    }
}

/// The subscriber a test installed with [`set_default`], shared by its runtime's threads.
type Slot = Arc<RwLock<Option<Dispatch>>>;

thread_local! {
    /// On a test's thread: the slot of the multi-thread runtime built for it.
    static TEST_SLOT: RefCell<Option<Slot>> = const { RefCell::new(None) };
    /// On a runtime thread: its forwarder's guard, for the thread's life.
    static WORKER_GUARD: RefCell<Option<tracing::dispatcher::DefaultGuard>> =
        const { RefCell::new(None) };
}

/// `tracing::subscriber::set_default` for the whole test: this thread, and the other
/// threads of a runtime built by this module. Until the guard drops.
pub fn set_default<S: Subscriber + Send + Sync + 'static>(subscriber: S) -> LogGuard {
    let dispatch = Dispatch::new(subscriber);
    let slot = TEST_SLOT.with(|s| s.borrow().clone());
    match &slot {
        Some(slot) => *slot.write().unwrap_or_else(|p| p.into_inner()) = Some(dispatch.clone()),
        None => assert!(
            tokio::runtime::Handle::try_current().map_or(true, |h| {
                h.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread
            }),
            "a multi-thread test capturing logs must be written \
             #[tokio::test(crate = \"crate::support::rt\")]"
        ),
    }
    LogGuard {
        _this_thread: tracing::dispatcher::set_default(&dispatch),
        slot,
    }
}

/// Uninstalls what [`set_default`] installed.
pub struct LogGuard {
    _this_thread: tracing::dispatcher::DefaultGuard,
    slot: Option<Slot>,
}

impl Drop for LogGuard {
    fn drop(&mut self) {
        if let Some(slot) = &self.slot {
            *slot.write().unwrap_or_else(|p| p.into_inner()) = None;
        }
    }
}

/// A runtime thread's subscriber: whatever the test installed, else nothing.
struct Forward(Slot);

impl Forward {
    fn get(&self) -> Option<Dispatch> {
        self.0.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl Subscriber for Forward {
    fn register_callsite(&self, _: &'static Metadata<'static>) -> Interest {
        // Asked per event: the slot fills after the callsites registered.
        Interest::sometimes()
    }
    fn enabled(&self, m: &Metadata<'_>) -> bool {
        self.get().is_some_and(|d| d.enabled(m))
    }
    fn new_span(&self, a: &Attributes<'_>) -> Id {
        // Called only when `enabled` said yes; a span of no subscriber gets a dummy id.
        self.get().map_or(Id::from_u64(u64::MAX), |d| d.new_span(a))
    }
    fn record(&self, span: &Id, values: &Record<'_>) {
        if let Some(d) = self.get() {
            d.record(span, values);
        }
    }
    fn record_follows_from(&self, span: &Id, follows: &Id) {
        if let Some(d) = self.get() {
            d.record_follows_from(span, follows);
        }
    }
    fn event(&self, e: &Event<'_>) {
        if let Some(d) = self.get() {
            d.event(e);
        }
    }
    fn enter(&self, span: &Id) {
        if let Some(d) = self.get() {
            d.enter(span);
        }
    }
    fn exit(&self, span: &Id) {
        if let Some(d) = self.get() {
            d.exit(span);
        }
    }
    fn clone_span(&self, id: &Id) -> Id {
        self.get().map_or_else(|| id.clone(), |d| d.clone_span(id))
    }
    fn try_close(&self, id: Id) -> bool {
        self.get().is_some_and(|d| d.try_close(id))
    }
}

pub mod runtime {
    use super::{Forward, Slot, TEST_SLOT, WORKER_GUARD};

    /// Stands in for `tokio::runtime::Builder` in `#[tokio::test]`'s expansion.
    pub struct Builder;

    impl Builder {
        /// A current-thread builder, or a multi-thread one when `PDGATE_TEST_THREADS` says
        /// (its threads forward their logs to what the test installs with
        /// [`super::set_default`]).
        pub fn new_current_thread() -> tokio::runtime::Builder {
            let Some(n) = super::threads() else {
                TEST_SLOT.with(|s| *s.borrow_mut() = None);
                return tokio::runtime::Builder::new_current_thread();
            };
            let slot = Slot::default();
            TEST_SLOT.with(|s| *s.borrow_mut() = Some(slot.clone()));
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(n)
                .on_thread_start(move || {
                    let d = tracing::Dispatch::new(Forward(slot.clone()));
                    let g = tracing::dispatcher::set_default(&d);
                    WORKER_GUARD.with(|w| *w.borrow_mut() = Some(g));
                })
                .on_thread_stop(|| {
                    WORKER_GUARD.with(|w| w.borrow_mut().take());
                });
            b
        }
    }
}
