//! The dispatcher's per-model state (`[models.settings."NAME"]`): a model's own selection
//! policies, retry settings and budget, admission, and breaker thresholds.
//!
//! Why here: the dispatcher already holds the top level's policies and retry budget and
//! is rebuilt on every reload ([`super::Dispatcher::reconfigured`]), so a model's state
//! lives beside them and is carried across reloads the same way.
//!
//! Invariants:
//! - Only a model with an override of a section gets state for it; any other request uses
//!   the top level's (and shares its state). With no `[models.settings]` the map is empty
//!   and every lookup is one `is_empty` check: no hashing, no lock, no allocation.
//! - A reload keeps a model's state whose effective settings did not change (round-robin
//!   positions, cache-aware rings, the budget's balance, the admission's slots held); its
//!   admission changes its limits in place (`Admission::reconfigure`), so a request in
//!   flight keeps its slot; a model whose settings are removed falls back to the top level
//!   (slots held in its old admission are given back as those requests end).
//! - Breaker thresholds are read when a failure is reported, by the model of the request
//!   (or, for a stall, of the worker): a worker whose model changes, or a reload, takes
//!   effect at its next failure, with no per-worker state to re-apply.

use std::collections::HashMap;
use std::sync::Arc;

use crate::admission::Admission;
use crate::config::{AdmissionConfig, BreakerConfig, Config, PolicyConfig, RetryConfig};
use crate::policy::{self, Policy};
use crate::pool::Pool;

use super::{Dispatcher, RetryBudget};

/// A model's own prefill, decode and regular-worker policies (the last of the decode
/// kind, with its own state), and the settings they were built with.
pub struct Policies {
    cfg: PolicyConfig,
    pub prefill: Arc<dyn Policy>,
    pub decode: Arc<dyn Policy>,
    pub regular: Arc<dyn Policy>,
}

impl Policies {
    pub fn new(cfg: PolicyConfig) -> Policies {
        Policies {
            prefill: policy::build_with(cfg.prefill, &cfg).into(),
            decode: policy::build_with(cfg.decode, &cfg).into(),
            regular: policy::build_with(cfg.decode, &cfg).into(),
            cfg,
        }
    }
}

/// One model's state; each part `None` where the model uses the top level's.
#[derive(Default)]
pub struct ModelState {
    pub policies: Option<Arc<Policies>>,
    pub retry: Option<(RetryConfig, Arc<RetryBudget>)>,
    pub admission: Option<(AdmissionConfig, Arc<Admission>)>,
    pub breaker: Option<BreakerConfig>,
}

/// Every model's state, by the model's served name. Cheap to clone (one `Arc`).
#[derive(Clone, Default)]
pub struct PerModel(Arc<HashMap<Box<str>, ModelState>>);

impl PerModel {
    /// The state for `cfg`'s `[models.settings]`, keeping from `prev` whatever did not
    /// change (see the module docs).
    pub fn build(cfg: &Config, prev: Option<&PerModel>) -> PerModel {
        if cfg.models.settings.is_empty() {
            return PerModel::default();
        }
        let mut map = HashMap::with_capacity(cfg.models.settings.len());
        for (name, s) in &cfg.models.settings {
            let old = prev.and_then(|p| p.0.get(name.as_str()));
            let policies = s
                .policy(cfg)
                .map(|pc| match old.and_then(|o| o.policies.as_ref()) {
                    Some(p) if p.cfg == pc => p.clone(),
                    _ => Arc::new(Policies::new(pc)),
                });
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
            map.insert(Box::from(name.as_str()), state);
        }
        PerModel(Arc::new(map))
    }

    /// Whether no model has settings of its own.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The state of `model`, when it has settings of its own.
    pub fn get(&self, model: Option<&str>) -> Option<&ModelState> {
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
    /// The prefill and decode policies of `model`'s requests.
    pub(super) fn policies(&self, model: Option<&str>) -> (&dyn Policy, &dyn Policy) {
        match self
            .per_model
            .get(model)
            .and_then(|m| m.policies.as_deref())
        {
            Some(p) => (p.prefill.as_ref(), p.decode.as_ref()),
            None => (self.prefill_policy.as_ref(), self.decode_policy.as_ref()),
        }
    }

    /// The policy that picks a regular worker for `model`'s requests.
    pub(super) fn regular_policy_of(&self, model: Option<&str>) -> &dyn Policy {
        match self
            .per_model
            .get(model)
            .and_then(|m| m.policies.as_deref())
        {
            Some(p) => p.regular.as_ref(),
            None => self.regular_policy.as_ref(),
        }
    }

    /// The retry settings and budget of `model`'s requests.
    pub(super) fn retry(&self, model: Option<&str>) -> (&RetryConfig, &RetryBudget) {
        match self.per_model.get(model).and_then(|m| m.retry.as_ref()) {
            Some((cfg, budget)) => (cfg, budget),
            None => (&self.cfg.retry, &self.budget),
        }
    }

    /// The breaker thresholds of `model`'s workers.
    pub fn breaker_cfg(&self, model: Option<&str>) -> &BreakerConfig {
        self.per_model
            .get(model)
            .and_then(|m| m.breaker.as_ref())
            .unwrap_or(&self.cfg.breaker)
    }

    /// The own admission of `model`, when it has one.
    pub(super) fn model_admission(&self, model: Option<&str>) -> Option<&Arc<Admission>> {
        self.per_model
            .get(model)?
            .admission
            .as_ref()
            .map(|(_, a)| a)
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
        let pm = PerModel::build(&one, None);
        let a = pm.get(Some("a")).unwrap();
        let b = pm.get(Some("b")).unwrap();
        assert!(a.policies.is_some() && a.retry.is_some());
        assert!(a.admission.is_none() && a.breaker.is_none());
        assert!(b.policies.is_none() && b.retry.is_none());
        assert_eq!(b.breaker.as_ref().unwrap().failure_threshold, 9);
        assert!(pm.get(Some("c")).is_none() && pm.get(None).is_none());

        // The same settings again: every piece of state is the same object.
        let again = PerModel::build(&one, Some(&pm));
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
        let next = PerModel::build(&two, Some(&again));
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
        assert!(PerModel::build(&Config::default(), Some(&next)).is_empty());
    }
}
