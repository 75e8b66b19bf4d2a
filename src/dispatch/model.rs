//! A request's model, resolved once: its name and every setting it is dispatched with
//! (selection policies, retry settings and budget, breaker thresholds, admission, the
//! short-prompt bypass), the top level's or the model's own (`[models.settings."NAME"]`).
//!
//! Why here: the dispatcher already holds the top level's policies and retry budget and
//! is rebuilt on every reload ([`super::Dispatcher::reconfigured`]), so a model's state
//! lives beside them and is carried across reloads the same way.
//!
//! Invariants:
//! - [`Dispatcher::resolve_model`] is the one place a request's model name is looked up in
//!   the settings: the request then carries a [`Model`] (its name and an `Arc` of its
//!   [`Settings`]) to every attempt, its relay and its moves; nothing looks the model up
//!   by string after that (a worker's own model is looked up for what concerns the worker
//!   alone: a stall's ejection, a probe's partner).
//! - Only a model with an override of a section gets state of its own for it; in every
//!   other section it shares the top level's state (policies, budget). With no
//!   `[models.settings]` the map is empty: resolving is one `is_empty` check and one `Arc`
//!   clone, no hashing, no lock, no allocation.
//! - A reload keeps a model's state whose effective settings did not change (round-robin
//!   positions, cache-aware rings, the budget's balance, the admission's slots held); its
//!   admission changes its limits in place (`Admission::reconfigure`), so a request in
//!   flight keeps its slot; a model whose settings are removed falls back to the top level
//!   (slots held in its old admission are given back as those requests end). A request in
//!   flight keeps the settings it was resolved with.

use std::collections::HashMap;
use std::sync::Arc;

use crate::admission::Admission;
use crate::config::{AdmissionConfig, BreakerConfig, Config, PolicyConfig, RetryConfig};
use crate::policy::{self, Policy};
use crate::pool::Pool;
use crate::types::Role;

use super::{Dispatcher, RetryBudget};

/// A model's own prefill, decode and regular-worker policies (the last of the decode
/// kind, with its own state), and the settings they were built with.
pub struct Policies {
    cfg: PolicyConfig,
    pub prefill: Arc<dyn Policy>,
    pub decode: Arc<dyn Policy>,
    pub regular: Arc<dyn Policy>,
    /// The `cache_aware` ring a keyed request is placed on under sticky sessions
    /// (`affinity.sticky`) when its role's policy does not read keys itself.
    pub keyed: Arc<dyn Policy>,
}

impl Policies {
    /// The policy that places a `role` leg: the role's own, or the key's `cache_aware`
    /// ring for a request with a routing key under sticky sessions (`sticky_key`) when the
    /// role's own policy does not read keys itself.
    pub fn placing(&self, role: Role, sticky_key: bool) -> &dyn Policy {
        let own = match role {
            Role::Prefill => &self.prefill,
            Role::Decode => &self.decode,
            Role::Regular => &self.regular,
        };
        if sticky_key && !own.wants_prefix() {
            self.keyed.as_ref()
        } else {
            own.as_ref()
        }
    }

    pub fn new(cfg: PolicyConfig) -> Policies {
        Policies {
            prefill: policy::build_with(cfg.prefill, &cfg).into(),
            decode: policy::build_with(cfg.decode, &cfg).into(),
            regular: policy::build_with(cfg.decode, &cfg).into(),
            keyed: policy::build_with(crate::config::PolicyKind::CacheAware, &cfg).into(),
            cfg,
        }
    }

    /// `prev` when it was built with `cfg` (its state kept), else new ones.
    pub fn keep_or_new(prev: Option<&Arc<Policies>>, cfg: PolicyConfig) -> Arc<Policies> {
        match prev {
            Some(p) if p.cfg == cfg => p.clone(),
            _ => Arc::new(Policies::new(cfg)),
        }
    }
}

/// Everything a model's requests are dispatched with.
pub struct Settings {
    pub policies: Arc<Policies>,
    pub retry: RetryConfig,
    pub budget: Arc<RetryBudget>,
    pub breaker: BreakerConfig,
    /// The model's own admission (on top of the replica-wide one), when it has one.
    pub admission: Option<Arc<Admission>>,
    /// Prompts shorter than this go to a regular worker of the model.
    pub short_prompt_tokens: Option<u32>,
}

impl Settings {
    /// The top level's settings, keeping `prev`'s policies and budget where their settings
    /// did not change.
    pub fn top(cfg: &Config, prev: Option<&Settings>) -> Settings {
        let budget = match prev {
            Some(p) if p.retry.same_budget(&cfg.retry) => p.budget.clone(),
            _ => Arc::new(RetryBudget::new(&cfg.retry)),
        };
        Settings {
            policies: Policies::keep_or_new(prev.map(|p| &p.policies), cfg.policy.clone()),
            retry: cfg.retry.clone(),
            budget,
            breaker: cfg.breaker.clone(),
            admission: None,
            short_prompt_tokens: None,
        }
    }
}

/// A request's model: its served name (`None`: any worker, one handoff group serving
/// everything) and its settings. Cheap to clone (two `Arc`s).
#[derive(Clone)]
pub struct Model {
    pub name: Option<Arc<str>>,
    pub settings: Arc<Settings>,
}

impl Model {
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }
    pub fn retry(&self) -> &RetryConfig {
        &self.settings.retry
    }
    pub fn budget(&self) -> &RetryBudget {
        &self.settings.budget
    }
    pub fn breaker(&self) -> &BreakerConfig {
        &self.settings.breaker
    }
    pub fn policies(&self) -> &Policies {
        &self.settings.policies
    }
}

/// One model's own state: each part `None` where the model uses the top level's.
#[derive(Default)]
pub struct ModelState {
    pub policies: Option<Arc<Policies>>,
    pub retry: Option<(RetryConfig, Arc<RetryBudget>)>,
    pub admission: Option<(AdmissionConfig, Arc<Admission>)>,
    pub breaker: Option<BreakerConfig>,
}

/// Every model's own state and its whole settings (its own over the top level's), by the
/// model's served name. Cheap to clone (one `Arc`).
#[derive(Clone, Default)]
pub struct PerModel(Arc<HashMap<Box<str>, Own>>);

/// A model's own state (for a reload's comparison) and its whole settings.
type Own = (ModelState, Arc<Settings>);

impl PerModel {
    /// The state for `cfg`'s `[models.settings]` over the top level's `top`, keeping from
    /// `prev` whatever did not change (see the module docs).
    pub fn build(cfg: &Config, prev: Option<&PerModel>, top: &Settings) -> PerModel {
        if cfg.models.settings.is_empty() {
            return PerModel::default();
        }
        let mut map = HashMap::with_capacity(cfg.models.settings.len());
        for (name, s) in &cfg.models.settings {
            let old = prev.and_then(|p| p.0.get(name.as_str())).map(|(o, _)| o);
            let policies = s
                .policy(cfg)
                .map(|pc| Policies::keep_or_new(old.and_then(|o| o.policies.as_ref()), pc));
            let retry = s.retry(cfg).map(|rc| {
                let budget = match old.and_then(|o| o.retry.as_ref()) {
                    Some((was, b)) if was.same_budget(&rc) => b.clone(),
                    _ => Arc::new(RetryBudget::new(&rc)),
                };
                (rc, budget)
            });
            let admission = s.admission(cfg).map(|ac| {
                let a = match old.and_then(|o| o.admission.as_ref()) {
                    Some((was, a)) => {
                        if *was != ac {
                            a.reconfigure(&ac);
                        }
                        a.clone()
                    }
                    None => Arc::new(Admission::for_model(&ac, name)),
                };
                (ac, a)
            });
            let state = ModelState {
                policies,
                retry,
                admission,
                breaker: s.breaker(cfg),
            };
            let (retry, budget) = match &state.retry {
                Some((rc, b)) => (rc.clone(), b.clone()),
                None => (top.retry.clone(), top.budget.clone()),
            };
            let settings = Settings {
                policies: state
                    .policies
                    .clone()
                    .unwrap_or_else(|| top.policies.clone()),
                retry,
                budget,
                breaker: state.breaker.clone().unwrap_or_else(|| top.breaker.clone()),
                admission: state.admission.as_ref().map(|(_, a)| a.clone()),
                short_prompt_tokens: s.short_prompt_tokens,
            };
            map.insert(Box::from(name.as_str()), (state, Arc::new(settings)));
        }
        PerModel(Arc::new(map))
    }

    /// Whether no model has settings of its own.
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The own state of `model`, when it has settings of its own.
    #[cfg(test)]
    pub fn get(&self, model: Option<&str>) -> Option<&ModelState> {
        self.settings_of(model).map(|(s, _)| s)
    }

    fn settings_of(&self, model: Option<&str>) -> Option<&Own> {
        if self.0.is_empty() {
            return None;
        }
        self.0.get(model?)
    }

    /// The model a request resolved to "any worker" is served by, when it has settings:
    /// the one model of the snapshot (one handoff group serves everything, so a request
    /// scoped to it is routed exactly as an unscoped one).
    pub fn only_model(&self, pool: &Pool) -> Option<Arc<str>> {
        if self.0.is_empty() {
            return None;
        }
        let snap = pool.load();
        match snap.models.as_slice() {
            [only] if self.0.contains_key(&*only.name) => Some(only.name.clone()),
            _ => None,
        }
    }
}

impl Dispatcher {
    /// The [`Model`] of a request that `models::resolve` scoped to `scope` (see the module
    /// docs): one handoff group serving everything resolves to "any worker", which a model
    /// with settings of its own still needs the name of (the same workers either way).
    pub fn resolve_model(&self, scope: Option<Arc<str>>) -> Model {
        let name = match scope {
            None => self.per_model.only_model(&self.pool),
            s => s,
        };
        let settings = self.settings_of(name.as_deref());
        Model { name, settings }
    }

    /// The model a worker serves, with its settings: for what concerns the worker alone
    /// (a stall's probe).
    pub fn model_of_worker(&self, w: &crate::pool::WorkerView) -> Model {
        Model {
            name: w.model.clone(),
            settings: self.settings_of(w.model.as_deref()),
        }
    }

    /// The settings of the model named `model` (a worker's own), or the top level's.
    pub fn settings_of(&self, model: Option<&str>) -> Arc<Settings> {
        match self.per_model.settings_of(model) {
            Some((_, s)) => s.clone(),
            None => self.top.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(toml: &str) -> Config {
        let c = Config::from_toml(toml).unwrap();
        c.validate().unwrap();
        c
    }

    #[test]
    fn state_is_built_only_for_overridden_sections_and_kept_across_unchanged_reloads() {
        let one = cfg(r#"
            [models.settings."a".policy]
            prefill = "random"
            [models.settings."a".retry]
            max_retries = 0
            [models.settings."b".breaker]
            failure_threshold = 9
            [models.settings."b".admission]
            max_in_flight = 2
            "#);
        let pm = PerModel::build(&one, None, &Settings::top(&one, None));
        let a = pm.get(Some("a")).unwrap();
        let b = pm.get(Some("b")).unwrap();
        assert!(a.policies.is_some() && a.retry.is_some());
        assert!(a.admission.is_none() && a.breaker.is_none());
        assert!(b.policies.is_none() && b.retry.is_none());
        assert_eq!(b.breaker.as_ref().unwrap().failure_threshold, 9);
        assert!(pm.get(Some("c")).is_none() && pm.get(None).is_none());

        // The same settings again: every piece of state is the same object.
        let again = PerModel::build(&one, Some(&pm), &Settings::top(&one, None));
        let a2 = again.get(Some("a")).unwrap();
        assert!(Arc::ptr_eq(
            a.policies.as_ref().unwrap(),
            a2.policies.as_ref().unwrap()
        ));
        assert!(Arc::ptr_eq(
            &a.retry.as_ref().unwrap().1,
            &a2.retry.as_ref().unwrap().1
        ));
        let b2 = again.get(Some("b")).unwrap();
        assert!(Arc::ptr_eq(
            &b.admission.as_ref().unwrap().1,
            &b2.admission.as_ref().unwrap().1
        ));

        // "a"'s policy changes (a top-level knob it inherits): rebuilt; its budget stays.
        let mut two = one.clone();
        two.policy.cache_aware_vnodes = 7;
        let next = PerModel::build(&two, Some(&again), &Settings::top(&two, None));
        let a3 = next.get(Some("a")).unwrap();
        assert!(!Arc::ptr_eq(
            a2.policies.as_ref().unwrap(),
            a3.policies.as_ref().unwrap()
        ));
        assert!(Arc::ptr_eq(
            &a2.retry.as_ref().unwrap().1,
            &a3.retry.as_ref().unwrap().1
        ));
        // "b"'s admission keeps its object (limits change in place).
        assert!(Arc::ptr_eq(
            &b2.admission.as_ref().unwrap().1,
            &next.get(Some("b")).unwrap().admission.as_ref().unwrap().1
        ));

        // No settings: an empty map.
        assert!(PerModel::build(
            &Config::default(),
            Some(&next),
            &Settings::top(&Config::default(), None)
        )
        .is_empty());
    }

    /// A model's whole settings are its own where it overrides a section and the top
    /// level's (the same state) elsewhere: a model with only breaker thresholds of its own
    /// shares the top level's policies and retry budget.
    #[test]
    fn settings_lay_a_models_own_over_the_top_levels() {
        let c = cfg(r#"
            [models.settings."b".breaker]
            failure_threshold = 9
            [models.settings."r".retry]
            max_retries = 0
            "#);
        let top = Settings::top(&c, None);
        let pm = PerModel::build(&c, None, &top);
        let b = &pm.settings_of(Some("b")).unwrap().1;
        assert!(Arc::ptr_eq(&b.policies, &top.policies));
        assert!(Arc::ptr_eq(&b.budget, &top.budget));
        assert_eq!(b.breaker.failure_threshold, 9);
        assert_eq!(b.retry, top.retry);
        let r = &pm.settings_of(Some("r")).unwrap().1;
        assert!(!Arc::ptr_eq(&r.budget, &top.budget));
        assert_eq!(r.retry.max_retries, 0);
        assert_eq!(r.breaker, top.breaker);
        assert!(pm.settings_of(Some("other")).is_none());
        // The top level's own, across a reload that changed nothing.
        let again = Settings::top(&c, Some(&top));
        assert!(Arc::ptr_eq(&again.policies, &top.policies));
        assert!(Arc::ptr_eq(&again.budget, &top.budget));
    }
}
