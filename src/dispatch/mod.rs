//! One request's life: resolve its model, admit it, then attempts (a PD pair: select a
//! pair → assign rooms and ranks → preflight → send both legs → couple their failures; or a
//! regular worker) until one produces its first bytes, which the relay streams to the
//! client (`crate::relay`).
//!
//! Invariants (see also ARCHITECTURE.md, "A request's life"):
//! 1. The room-to-rank contract holds for every attempt: both legs carry the same
//!    bootstrap host, port and rooms; every room is `≡ k (mod dp_P)` for the chosen prefill
//!    rank k, so the rank that runs it is the rank decode resolves ([`attempt::room`]).
//! 2. No half-dispatch: the decode leg is only sent together with its prefill leg, and only
//!    to a prefill rank whose bootstrap is `Ready` (checked again on the request path when
//!    the view is older than the freshness bound).
//! 3. Once either leg failed, the other is cancelled and the client is answered.
//! 4. Failures before the first byte are retried with a fresh pair and fresh rooms, within
//!    `max_retries` and the retry budget; nothing is retried after the client saw bytes.
//! 5. The request path reads one pool snapshot per attempt, without a lock; the few locks
//!    it does take (a worker's idle-connection list per leg, the ejection lock when a
//!    breaker would open, the metrics registry for per-request labels) are listed in
//!    ARCHITECTURE.md, "The locks a request takes".

pub mod attempt;
pub mod attempts;
pub mod model;
pub mod moves;
mod probe;
mod regular;
mod stall;

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;

use http::{HeaderValue, Response};
use rand::{RngCore, SeedableRng};

use crate::body::RespBody;
use crate::config::Config;
use crate::error::FailReason;
use crate::pool::Pool;
use crate::request::record::RequestRecord;
use crate::request::{self, ParsedRequest};
use crate::types::{RequestId, Role, WorkerId};
use crate::upstream::Upstream;

/// Where randomness comes from: the OS-seeded thread CSPRNG in production, or a seeded
/// sequence for deterministic tests. Rooms are drawn from it, so both are CSPRNGs
/// (ChaCha).
pub enum RngSource {
    Os,
    Seeded(AtomicU64),
}

impl RngSource {
    pub fn with<T>(&self, f: impl FnOnce(&mut dyn RngCore) -> T) -> T {
        match self {
            RngSource::Os => f(&mut rand::rng()),
            RngSource::Seeded(next) => {
                let seed = next.fetch_add(1, Ordering::Relaxed);
                f(&mut rand::rngs::StdRng::seed_from_u64(seed))
            }
        }
    }
}

/// The most attempts one request makes, stale-connection retries included (a bound that
/// holds whatever the engines do; `retry.max_retries` bounds the counted ones).
const MAX_ATTEMPTS: u32 = 16;

/// A cap on retries as a share of requests (in thousandths of a retry), so that a dead
/// pool cannot multiply its load: every request deposits `ratio`, a retry withdraws one,
/// and the balance starts at (and is capped near) the minimum reserve. On top of it sit
/// `reserve` retries only what one engine's failure costs may spend ([`Spend::Reserved`]:
/// stream moves, and the retries of requests whose engine stalled): an ordinary retry
/// before the first byte leaves them, deposits refill them first, so when a storm spends
/// the budget the ordinary retries are refused first.
///
/// Why stalls too: a stalled request has already cost its client the stall deadline, and
/// what stalls is bounded by what the stalled engine held when it stopped (it leaves
/// rotation after `progress.eject_after_stalls`); a storm of fast failures elsewhere (the
/// chaos soak's bootstrap faults) must not leave them to end 504 while another engine could
/// serve them (issue 17's "a single engine failing costs the client nothing but latency").
pub struct RetryBudget {
    balance: AtomicI64,
    deposit: i64,
    cap: i64,
    reserve: i64,
}

/// What a withdrawal from the [`RetryBudget`] is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spend {
    /// A retry before the first byte: leaves the reserve in the budget.
    Retry,
    /// A stream move, or the retry of a request whose engine stalled: may spend the
    /// reserve.
    Reserved,
}

impl Spend {
    /// What the retry of a request that failed for `reason` spends.
    pub fn retry_of(reason: FailReason) -> Spend {
        if reason.is_stall() {
            Spend::Reserved
        } else {
            Spend::Retry
        }
    }
}

impl RetryBudget {
    pub fn new(rc: &crate::config::RetryConfig) -> RetryBudget {
        // The reserve sits on top of the retries' own reserve and cap, so that ordinary
        // retries see the same budget with or without it.
        let reserve = i64::from(rc.budget_move_reserve) * 1000;
        let start = i64::from(rc.budget_min_reserve) * 1000 + reserve;
        RetryBudget {
            balance: AtomicI64::new(start),
            deposit: (rc.budget_ratio * 1000.0).round() as i64,
            cap: start + 100_000,
            reserve,
        }
    }
    pub fn deposit(&self) {
        let _ = self
            .balance
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                Some((b + self.deposit).min(self.cap))
            });
    }
    /// The balance a withdrawal for `what` must find.
    fn floor(&self, what: Spend) -> i64 {
        match what {
            Spend::Retry => 1000 + self.reserve,
            Spend::Reserved => 1000,
        }
    }
    /// Whether a withdrawal for `what` could be made now (looked at before a retry waits
    /// for a worker, so that a request whose retry the budget would refuse is answered at
    /// once).
    pub fn has_balance(&self, what: Spend) -> bool {
        self.balance.load(Ordering::Relaxed) >= self.floor(what)
    }
    pub fn try_withdraw(&self, what: Spend) -> bool {
        let floor = self.floor(what);
        self.balance
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                (b >= floor).then_some(b - 1000)
            })
            .is_ok()
    }
}

/// The admission slot a request holds until its response body ends, or until a prefill
/// leg it left running ends.
pub type AdmissionSlot = crate::admission::Slot;

/// Per-request context from the front door.
pub struct ReqCtx {
    /// Fixed-length internal id (16 hex digits): the base of every leg's rid.
    pub id: RequestId,
    /// The id shown to the client and forwarded (`x-request-id`): the client's, or `id`.
    pub request_id: HeaderValue,
    /// Headers forwarded on both legs, serialized once (`name: value\r\n` lines).
    pub forward: Vec<u8>,
    /// Held by the response body (or a prefill leg left running after it); an error
    /// answered before the first byte releases it when the dispatch returns.
    pub slot: Option<AdmissionSlot>,
    /// The admission queue a request at decode capacity waits in (`None`: it is
    /// answered 429 at once).
    pub queue: Option<Arc<crate::admission::Admission>>,
    /// Where this attempt's spans hang, when the request is traced (set per attempt by
    /// [`Dispatcher::dispatch`]).
    pub trace: Option<crate::trace::Scope>,
}

/// Everything the request path needs. Immutable: a config reload builds a new one with
/// [`Dispatcher::reconfigured`] (sharing the pool, the clients, and every piece of state
/// whose settings did not change) and the front door swaps it in; a request in flight keeps
/// the one it started with.
pub struct Dispatcher {
    pub pool: Arc<Pool>,
    pub up: Upstream,
    pub cfg: Arc<Config>,
    /// The top level's settings: what a request of a model without settings of its own
    /// is dispatched with ([`model`]).
    top: Arc<model::Settings>,
    /// Models with settings of their own (`[models.settings]`; see [`model`]).
    per_model: model::PerModel,
    pub rng: Arc<RngSource>,
    /// Traces (`[trace]`), when enabled: kept across reloads (a restart-only section).
    pub tracer: Option<crate::trace::Tracer>,
    /// The rate shared by streams that repeat input logprobs
    /// (`upstream.stream_logprob_bytes_per_sec`; `None`: not limited). Kept across a
    /// reload that leaves the setting alone.
    pub merge_rate: Option<Arc<crate::body::ByteRate>>,
    /// The rate shared by request bodies past their first slice, read from clients and
    /// written to engines (`server.large_body_bytes_per_sec`; `None`: not limited).
    pub bulk_rate: Option<Arc<crate::body::ByteRate>>,
    /// The headers a client's routing key is read from (`[affinity]`), parsed once per
    /// config; the front door reads the key, the picks use it.
    pub keys: request::RoutingKeys,
}

fn routing_keys(cfg: &Config) -> request::RoutingKeys {
    request::RoutingKeys::new(&cfg.affinity.headers, cfg.affinity.sticky)
}

/// How long a quiet shared rate lets bytes go at full speed: 100 ms worth of it.
const RATE_BURST: std::time::Duration = std::time::Duration::from_millis(100);

/// A shared rate of `bytes_per_sec` (0: none): `prev` when it has that rate already (a
/// reload that left the setting alone keeps its debt), else a new one.
fn shared_rate(
    prev: Option<&Arc<crate::body::ByteRate>>,
    bytes_per_sec: u64,
) -> Option<Arc<crate::body::ByteRate>> {
    match prev {
        Some(r) if r.bytes_per_sec() == bytes_per_sec => Some(r.clone()),
        _ => (bytes_per_sec > 0)
            .then(|| Arc::new(crate::body::ByteRate::new(bytes_per_sec, RATE_BURST))),
    }
}

impl Dispatcher {
    pub fn new(pool: Arc<Pool>, up: Upstream, cfg: Arc<Config>, rng: RngSource) -> Dispatcher {
        let rate = shared_rate(None, cfg.upstream.stream_logprob_bytes_per_sec);
        let bulk = shared_rate(None, cfg.server.large_body_bytes_per_sec);
        let top = Arc::new(model::Settings::top(&cfg, None));
        Dispatcher {
            keys: routing_keys(&cfg),
            per_model: model::PerModel::build(&cfg, None, &top),
            top,
            pool,
            up,
            cfg,
            rng: Arc::new(rng),
            tracer: None,
            merge_rate: rate,
            bulk_rate: bulk,
        }
    }

    /// The same dispatcher, tracing requests with `tracer`.
    pub fn with_tracer(mut self, tracer: Option<crate::trace::Tracer>) -> Dispatcher {
        self.tracer = tracer;
        self
    }

    /// The same dispatcher under a new config: policies are rebuilt only when the policy
    /// settings changed (so round-robin positions and cache-aware rings survive a reload
    /// that did not touch them), the retry budget only when the retry settings did; each
    /// model's own state likewise ([`model::PerModel::build`]).
    pub fn reconfigured(&self, cfg: Arc<Config>) -> Dispatcher {
        let rate = shared_rate(
            self.merge_rate.as_ref(),
            cfg.upstream.stream_logprob_bytes_per_sec,
        );
        let bulk = shared_rate(self.bulk_rate.as_ref(), cfg.server.large_body_bytes_per_sec);
        let top = Arc::new(model::Settings::top(&cfg, Some(&self.top)));
        Dispatcher {
            keys: routing_keys(&cfg),
            per_model: model::PerModel::build(&cfg, Some(&self.per_model), &top),
            top,
            pool: self.pool.clone(),
            up: self.up.clone(),
            cfg,
            rng: self.rng.clone(),
            tracer: self.tracer.clone(),
            merge_rate: rate,
            bulk_rate: bulk,
        }
    }

    /// Whether `req` carries a routing key that places it under any policy
    /// (`affinity.sticky`; see `model::Policies::placing`).
    fn sticky_key(&self, req: &ParsedRequest) -> bool {
        req.routing_key.is_some() && self.keys.sticky()
    }

    /// An OpenAI request that named an alias carries the model served on its legs
    /// (`models::leg_name`); nothing is looked at without aliases.
    fn alias_on_legs(&self, req: &mut ParsedRequest, resolved: &str) {
        if self.cfg.models.aliases.is_empty() || req.route == request::ApiRoute::Generate {
            return;
        }
        let name = req
            .model()
            .and_then(|asked| crate::models::leg_name(&self.cfg.models, &asked, resolved));
        if let Some(n) = name {
            match serde_json::to_string(&n) {
                Ok(json) => req.override_on_legs("model", json),
                Err(_) => tracing::debug!("model name not encodable: kept"),
            }
        }
    }

    /// Runs a parsed request to its response: retries before the first byte, errors mapped
    /// once by [`Failure::into_response`]. `record` (the request's account since it
    /// arrived) ends up on the response's body.
    pub async fn dispatch(
        self: &Arc<Self>,
        mut req: ParsedRequest,
        mut ctx: ReqCtx,
        mut record: RequestRecord,
    ) -> Response<RespBody> {
        record.set_stream(req.stream);
        // The request's model: which workers may serve it (one lookup; nothing while one
        // handoff group serves everything and no name must match).
        let model;
        match crate::models::resolve(&self.cfg.models, &self.pool, || req.model()) {
            Ok(scope) => {
                record.model = scope.clone();
                if let Some(m) = scope.as_deref() {
                    self.alias_on_legs(&mut req, m);
                }
                model = self.resolve_model(scope);
                req.scope = model.name.clone();
            }
            Err(f) => {
                record.fail(f.reason);
                return record.answer(f.into_response(Some(&ctx.request_id)));
            }
        }
        if !req.replaced.is_empty() {
            tracing::info!(request_id = %ctx.id, fields = ?req.replaced, "client-supplied PD fields replaced by pdgate's own");
        }
        if let Some(a) = &model.settings.admission {
            // The model's own cap, on top of the replica-wide slot taken at the door.
            match a.admit().await {
                Ok(s) => match ctx.slot.as_mut() {
                    Some(held) => held.hold_model(s),
                    None => ctx.slot = Some(s),
                },
                Err(f) => {
                    record.fail(f.reason);
                    return record.answer(f.into_response(Some(&ctx.request_id)));
                }
            }
        }
        model.budget().deposit();
        let plan = moves::plan_for(&model, &req);
        if let Some(p) = &plan {
            moves::prepare_legs(&mut req, p);
        }
        let root = record.trace.as_ref().and_then(|t| t.scope());
        let mut run = attempts::Drive::new(attempts::Purpose::Answer, &model, 0);
        run.deadline = Some(tokio::time::Instant::now() + self.cfg.timeouts.request());
        run.root = root.clone();
        let res = self
            .drive(
                &req,
                &mut ctx,
                &mut run,
                attempts::Account::Request(&mut record),
            )
            .await;
        let attempt_no = run.attempt_no;
        drop(run);
        match res {
            Ok(ready) => {
                if let Some(t) = record.trace.as_mut() {
                    t.relay_started();
                }
                let slot = ctx.slot.take();
                // A move's attempts hang under the request's span, as this one did.
                ctx.trace = root;
                let mover = match plan {
                    Some(p) if ready.body.sse.is_some() => Some(Box::new(moves::mover(
                        self.clone(),
                        req,
                        model,
                        &ctx,
                        p,
                        ready.decode_incremental,
                        attempt_no + 1,
                    ))),
                    _ => None,
                };
                crate::relay::PdBody::respond(ready, record, &ctx.request_id, slot, mover)
            }
            Err(failure) => {
                record.fail(failure.reason);
                record.answer(failure.into_response(Some(&ctx.request_id)))
            }
        }
    }
}

/// Whether `snap` has a routable worker of `role` for the model `scope` outside `exclude`.
fn any_routable_left(
    snap: &crate::pool::Snapshot,
    role: Role,
    scope: Option<&str>,
    exclude: &[WorkerId],
) -> bool {
    snap.routable_for(role, scope)
        .iter()
        .any(|r| !exclude.contains(&r.worker))
}

/// Whether `snap` has a routable prefill and decode for `scope` outside the exclusions.
fn pair_left(snap: &crate::pool::Snapshot, scope: Option<&str>, ex: &attempt::Excluded) -> bool {
    any_routable_left(snap, Role::Prefill, scope, ex.of(Role::Prefill))
        && any_routable_left(snap, Role::Decode, scope, ex.of(Role::Decode))
}

#[cfg(test)]
mod budget_tests {
    use super::{RetryBudget, Spend};

    #[test]
    fn retries_are_a_bounded_share_of_requests() {
        let budget = |ratio, min, moves| {
            RetryBudget::new(&crate::config::RetryConfig {
                budget_ratio: ratio,
                budget_min_reserve: min,
                budget_move_reserve: moves,
                ..Default::default()
            })
        };
        let b = budget(0.2, 2, 0);
        // The reserve: two retries with no traffic; `has_balance` says so without spending.
        assert!(b.has_balance(Spend::Retry) && b.has_balance(Spend::Retry));
        assert!(b.try_withdraw(Spend::Retry));
        assert!(b.try_withdraw(Spend::Retry));
        assert!(!b.has_balance(Spend::Retry));
        assert!(!b.try_withdraw(Spend::Retry));
        // Then one retry per five requests.
        for _ in 0..4 {
            b.deposit();
        }
        assert!(!b.try_withdraw(Spend::Retry));
        b.deposit();
        assert!(b.try_withdraw(Spend::Retry));
        assert!(!b.try_withdraw(Spend::Retry));
        // A dead pool under heavy load retries at most ratio × requests (plus the
        // reserves), moves included.
        for moves in [0, 5] {
            let b = budget(0.2, 0, moves);
            let mut spent = 0;
            for i in 0..1000 {
                b.deposit();
                let what = if i % 2 == 0 {
                    Spend::Retry
                } else {
                    Spend::Reserved
                };
                while b.try_withdraw(what) {
                    spent += 1;
                }
            }
            // The moves' reserve is spent once on top of the 200 deposited; at most one
            // retry's worth is left unspent at the end.
            assert!(spent <= 200 + moves, "{spent}");
            assert!(spent + 1 >= 200, "{spent}");
        }
    }

    /// Table: the retries of stalled requests spend as moves do; every other retry is an
    /// ordinary one.
    #[test]
    fn stalled_requests_retry_from_the_reserve() {
        for (reason, want) in [
            (crate::error::FailReason::PrefillStalled, Spend::Reserved),
            (crate::error::FailReason::DecodeStalled, Spend::Reserved),
            (crate::error::FailReason::PrefillTimeout, Spend::Retry),
            (
                crate::error::FailReason::DecodeFirstByteTimeout,
                Spend::Retry,
            ),
            (crate::error::FailReason::BootstrapNotReady, Spend::Retry),
            (crate::error::FailReason::PrefillConnect, Spend::Retry),
            (crate::error::FailReason::DecodeStatus, Spend::Retry),
        ] {
            assert_eq!(Spend::retry_of(reason), want, "{reason:?}");
        }
    }

    #[test]
    fn stream_moves_keep_a_reserve_that_retries_cannot_spend() {
        let b = RetryBudget::new(&crate::config::RetryConfig {
            budget_ratio: 0.2,
            budget_min_reserve: 3,
            budget_move_reserve: 2,
            ..Default::default()
        });
        // Retries spend their own reserve, as without a move reserve ...
        let mut retries = 0;
        while b.try_withdraw(Spend::Retry) {
            retries += 1;
        }
        assert_eq!(retries, 3);
        assert!(!b.has_balance(Spend::Retry));
        // ... and leave the moves' reserve, which moves then spend.
        assert!(b.has_balance(Spend::Reserved));
        assert!(b.try_withdraw(Spend::Reserved));
        assert!(b.try_withdraw(Spend::Reserved));
        assert!(!b.try_withdraw(Spend::Reserved));
        // Deposits refill the moves' reserve first: retries resume only above it.
        for _ in 0..10 {
            b.deposit();
        }
        assert!(!b.try_withdraw(Spend::Retry));
        assert!(b.try_withdraw(Spend::Reserved));
        for _ in 0..10 {
            b.deposit();
        }
        assert!(b.try_withdraw(Spend::Retry));
    }
}
