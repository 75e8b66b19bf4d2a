//! `[models.settings]`: the overlay over the top level, and its validation.

use super::*;

const TWO: &str = r#"
[retry]
max_retries = 3
budget_ratio = 0.5
[breaker]
failure_threshold = 7
[policy]
prefill = "random"
cache_aware_vnodes = 50
[admission]
max_in_flight = 100
max_queue = 10
[models.settings."model-a".retry]
max_retries = 0
[models.settings."model-a".admission]
max_in_flight = 1
max_queue = 0
[models.settings."model-b".policy]
decode = "power_of_two"
[models.settings."model-b".breaker]
open_ms = 50
[models.settings."model-c"]
short_prompt_tokens = 256
"#;

#[test]
fn a_models_settings_are_the_top_level_with_its_overrides_laid_over() {
    let cfg = Config::from_toml(TWO).unwrap();
    cfg.validate().unwrap();
    let s = &cfg.models.settings;
    assert_eq!(s.len(), 3);
    let a = s["model-a"].effective(&cfg);
    // Overridden fields are the model's; the rest of the section is the top level's.
    assert_eq!(a.retry.max_retries, 0);
    assert_eq!(a.retry.budget_ratio, 0.5);
    assert_eq!(a.admission.max_in_flight, 1);
    assert_eq!(a.admission.max_queue, 0);
    assert_eq!(a.admission.queue_timeout_ms, cfg.admission.queue_timeout_ms);
    assert_eq!(
        a.admission.max_bytes_in_flight,
        cfg.admission.max_bytes_in_flight
    );
    // Sections it does not override are the top level's whole.
    assert_eq!(a.policy, cfg.policy);
    assert_eq!(a.breaker, cfg.breaker);
    assert!(s["model-a"].policy(&cfg).is_none() && s["model-a"].breaker(&cfg).is_none());
    let b = s["model-b"].effective(&cfg);
    assert_eq!(b.policy.prefill, PolicyKind::Random);
    assert_eq!(b.policy.decode, PolicyKind::PowerOfTwo);
    assert_eq!(b.policy.cache_aware_vnodes, 50);
    assert_eq!(b.breaker.failure_threshold, 7);
    assert_eq!(b.breaker.open_ms, 50);
    assert_eq!(b.retry, cfg.retry);
    let c = &s["model-c"];
    assert_eq!(c.short_prompt_tokens, Some(256));
    assert_eq!(c.effective(&cfg).admission, cfg.admission);
}

#[test]
fn an_empty_override_is_the_top_level() {
    let top = Config::default();
    assert_eq!(RetryOverride::default().over(&top.retry), top.retry);
    assert_eq!(PolicyOverride::default().over(&top.policy), top.policy);
    assert_eq!(
        AdmissionOverride::default().over(&top.admission),
        top.admission
    );
    assert_eq!(BreakerOverride::default().over(&top.breaker), top.breaker);
}

#[test]
fn unknown_keys_in_an_override_are_named() {
    for (toml, key) in [
        (
            "[models.settings.\"m\".retry]\nmax_retry = 1\n",
            "max_retry",
        ),
        (
            "[models.settings.\"m\".policy]\nload_poll_interval_ms = 10\n",
            "load_poll_interval_ms",
        ),
        (
            "[models.settings.\"m\".admission]\nmax_bytes_in_flight = 1\n",
            "max_bytes_in_flight",
        ),
        (
            "[models.settings.\"m\".breaker]\nthreshold = 1\n",
            "threshold",
        ),
        ("[models.settings.\"m\"]\ntimeouts = 1\n", "timeouts"),
    ] {
        let err = Config::from_toml(toml).unwrap_err().to_string();
        assert!(err.contains(key), "{toml}: {err}");
    }
}

#[test]
fn out_of_range_overrides_name_the_model_and_the_key() {
    let cases: &[(&str, &str)] = &[
        (
            "[models.settings.\"m\".retry]\nmax_retries = 17\n",
            "models.settings.\"m\": retry.max_retries = 17 is out of range (allowed: 0..=16)",
        ),
        (
            "[models.settings.\"m\".retry]\nbudget_ratio = -1.0\n",
            "models.settings.\"m\": retry.budget_ratio = -1 is out of range",
        ),
        (
            "[models.settings.\"m\".breaker]\nmax_ejection_ratio = 2.0\n",
            "models.settings.\"m\": breaker.max_ejection_ratio = 2 is out of range",
        ),
        (
            "[models.settings.\"m\".policy]\ncache_aware_vnodes = 0\n",
            "models.settings.\"m\": policy.cache_aware_vnodes = 0 is out of range",
        ),
        (
            "[models.settings.\"m\".admission]\nqueue_timeout_ms = 0\n",
            "models.settings.\"m\": admission.queue_timeout_ms = 0 is out of range",
        ),
        (
            "[models.settings.\"m\"]\nshort_prompt_tokens = 0\n",
            "models.settings.\"m\".short_prompt_tokens = 0 is out of range (allowed: 1..=1048576)",
        ),
        (
            "[models.aliases]\n\"gpt\" = \"m\"\n[models.settings.\"gpt\".retry]\nmax_retries = 1\n",
            "models.settings \"gpt\" names an alias: settings go under the model it names (\"m\")",
        ),
        (
            "[models.settings.\" \".retry]\nmax_retries = 1\n",
            "models.settings \" \": must be a non-empty name",
        ),
    ];
    for (toml, want) in cases {
        let cfg = Config::from_toml(toml).unwrap();
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains(want), "{toml}: {err} does not contain {want}");
    }
}

#[test]
fn a_valid_top_level_does_not_cover_an_invalid_override() {
    let cfg = Config::from_toml(
        "[breaker]\nopen_ms = 1000\n[models.settings.\"m\".breaker]\nopen_ms = 0\n",
    )
    .unwrap();
    let err = cfg.validate().unwrap_err().to_string();
    assert!(
        err.contains("models.settings.\"m\": breaker.open_ms = 0"),
        "{err}"
    );
    // A config without settings is validated as before.
    Config::default().validate().unwrap();
}

mod props {
    use super::*;
    use proptest::prelude::*;

    fn opt<T: std::fmt::Debug + Clone>(
        s: impl Strategy<Value = T>,
    ) -> impl Strategy<Value = Option<T>> {
        proptest::option::of(s)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Every field of an overlay is the override's where it gives one, else the top
        /// level's; and a model's settings validate exactly when its effective sections
        /// would validate as the top level's.
        #[test]
        fn an_overlay_takes_given_fields_and_keeps_the_rest(
            max_retries in opt(0u32..40),
            budget_ratio in opt(-1.0f64..12.0),
            max_stream_moves in opt(0u32..12),
            failure_threshold in opt(0u32..1200),
            max_ejection_ratio in opt(-0.5f64..1.5),
        ) {
            let top = Config::default();
            let retry = RetryOverride {
                max_retries,
                budget_ratio,
                max_stream_moves,
                ..RetryOverride::default()
            };
            let breaker = BreakerOverride {
                failure_threshold,
                max_ejection_ratio,
                ..BreakerOverride::default()
            };
            let r = retry.over(&top.retry);
            prop_assert_eq!(r.max_retries, max_retries.unwrap_or(top.retry.max_retries));
            prop_assert_eq!(r.budget_ratio, budget_ratio.unwrap_or(top.retry.budget_ratio));
            prop_assert_eq!(r.max_stream_moves, max_stream_moves.unwrap_or(top.retry.max_stream_moves));
            prop_assert_eq!(r.move_wait_ms, top.retry.move_wait_ms);
            prop_assert_eq!(r.budget_min_reserve, top.retry.budget_min_reserve);
            let b = breaker.over(&top.breaker);
            prop_assert_eq!(b.failure_threshold, failure_threshold.unwrap_or(top.breaker.failure_threshold));
            prop_assert_eq!(b.open_ms, top.breaker.open_ms);

            let mut cfg = top.clone();
            cfg.models.settings.insert("m".into(), ModelSettings {
                retry: Some(retry),
                breaker: Some(breaker),
                ..ModelSettings::default()
            });
            let mut as_top = top.clone();
            as_top.retry = r;
            as_top.breaker = b;
            prop_assert_eq!(cfg.validate().is_ok(), as_top.validate().is_ok());
        }
    }
}
