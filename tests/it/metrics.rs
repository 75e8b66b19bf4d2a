//! `/metrics` as an on-call engineer reads it: requests (streamed, not, failed, retried)
//! through a router in front of simulated engines, then the scrape: the expected series with
//! sane values, per-worker and per-rank series from the pool, and `promtool check metrics`
//! on the text. Also: the dashboard names only series pdgate exports, and every series
//! named in the source is in the telemetry table.
//!
//! The recorded series are process-wide (every router of this test binary shares the
//! recorder), so their checks are lower bounds; the series derived from the pool are this
//! router's own, so theirs are exact.

use crate::support::common::{sse_events, start_with_admin, with_faults, Env, GEN, GEN_STREAM};
use crate::support::interop::{manifest, skip_or_fail};

use std::collections::BTreeMap;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use pdgate::telemetry::{self, Kind, SERIES};
use pdgate_sim::{EngineConfig, Faults};

/// One sample of the text format.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

fn parse(text: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    for line in text
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let (series, value) = line.rsplit_once(' ').expect("a sample line");
        let value = value.parse().unwrap_or_else(|_| panic!("value of {line}"));
        let (name, labels) = match series.split_once('{') {
            None => (series.to_string(), BTreeMap::new()),
            Some((name, rest)) => {
                let body = rest.strip_suffix('}').expect("closing brace");
                let mut labels = BTreeMap::new();
                // Label values here hold no `",` (URLs, words, numbers).
                for pair in body.split("\",").filter(|p| !p.is_empty()) {
                    let (k, v) = pair.split_once("=\"").expect("k=\"v\"");
                    labels.insert(k.to_string(), v.trim_end_matches('"').to_string());
                }
                (name.to_string(), labels)
            }
        };
        out.push(Sample {
            name,
            labels,
            value,
        });
    }
    out
}

/// The value of the one sample named `name` whose labels include `with`.
fn value(samples: &[Sample], name: &str, with: &[(&str, &str)]) -> Option<f64> {
    let found: Vec<f64> = samples
        .iter()
        .filter(|s| s.name == name)
        .filter(|s| {
            with.iter()
                .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
        .collect();
    assert!(found.len() <= 1, "{name} {with:?} matches {found:?}");
    found.first().copied()
}

fn must(samples: &[Sample], name: &str, with: &[(&str, &str)]) -> f64 {
    value(samples, name, with).unwrap_or_else(|| panic!("no sample {name} {with:?}"))
}

/// Scrapes the admin listener, as Prometheus does (no token needed for `/metrics`).
async fn scrape(env: &Env) -> String {
    let (status, headers, body) = env.admin("GET", "/metrics", None, "").await;
    assert_eq!(status, 200);
    let ct = headers["content-type"].to_str().unwrap().to_string();
    assert!(ct.starts_with("text/plain; version=0.0.4"), "{ct}");
    String::from_utf8(body.to_vec()).unwrap()
}

/// `promtool check metrics` on `text`: no format error, no lint problem. Skipped (loudly)
/// when promtool is not installed, unless `CI` is set (`apt-get install -y prometheus`).
pub(crate) fn promtool_check(test: &str, text: &str) {
    let child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let why = "promtool is not installed (apt-get install -y prometheus)";
            return skip_or_fail(test, why).unwrap_or(());
        }
        Err(e) => panic!("promtool: {e}"),
    };
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && said.trim().is_empty(),
        "promtool check metrics: {said}\n--- the text:\n{text}"
    );
}

/// Every family in `text` is in the table, with its type and a HELP line.
fn families_are_described(text: &str) {
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            let s = telemetry::series(name).unwrap_or_else(|| panic!("{name} not in the table"));
            assert_eq!(s.kind.as_str(), kind, "{name}");
            assert!(
                text.contains(&format!("# HELP {name} ")),
                "{name} has no HELP"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_on_call_scrape() {
    // Round robin sends one of the first two requests to the failing decode: retried.
    let bad = with_faults(
        EngineConfig::decode(1),
        Faults {
            decode_status: Some(500),
            ..Faults::default()
        },
    );
    let env = start_with_admin(
        vec![EngineConfig::prefill(2)],
        vec![bad, EngineConfig::decode(1)],
        |_| {},
    )
    .await;
    env.wait_routable(2, 2).await;
    for body in [GEN, GEN, GEN_STREAM, GEN_STREAM] {
        let (st, _, bytes) = env.post("/generate", body).await;
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&bytes));
    }
    let chat =
        r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":3,"stream":true}"#;
    let (st, _, bytes) = env.post("/v1/chat/completions", chat).await;
    assert_eq!(st, 200);
    let (events, done) = sse_events(&bytes);
    assert!(done && events.len() >= 3, "{events:?}");
    // Rejected before dispatch.
    let (st, _, _) = env.post("/generate", "{not json").await;
    assert_eq!(st, 400);
    env.settled_stats().await;

    let p = env.cluster.prefills[0].url();
    let (d_bad, d_good) = (env.cluster.decodes[0].url(), env.cluster.decodes[1].url());
    // Legs still held (a prefill answering after its decode) are let go first.
    let text = scrape_until(&env, "no leg in flight at rest", |s| {
        [
            ("prefill", &p, 2),
            ("decode", &d_bad, 1),
            ("decode", &d_good, 1),
        ]
        .iter()
        .all(|(role, w, ranks)| {
            (0..*ranks).all(|r| {
                let r = r.to_string();
                let at = [
                    ("role", *role),
                    ("worker_url", w.as_str()),
                    ("rank", r.as_str()),
                ];
                value(s, "pdgate_worker_in_flight_requests", &at) == Some(0.0)
            })
        })
    })
    .await;
    let s = parse(&text);

    // Requests by route and outcome; their durations in 10 ms .. 10 min buckets.
    let ok = [("route", "generate"), ("outcome", "ok")];
    assert!(must(&s, "pdgate_requests_total", &ok) >= 4.0);
    let bad_json = [("route", "generate"), ("outcome", "invalid_request")];
    assert!(must(&s, "pdgate_requests_total", &bad_json) >= 1.0);
    let chat_ok = [("route", "chat_completions"), ("outcome", "ok")];
    assert!(must(&s, "pdgate_requests_total", &chat_ok) >= 1.0);
    let count = must(&s, "pdgate_request_duration_seconds_count", &ok);
    assert!(count >= 4.0);
    for (le, at_least) in [("0.01", 0.0), ("600", count), ("+Inf", count)] {
        let b = [ok[0], ok[1], ("le", le)];
        let v = must(&s, "pdgate_request_duration_seconds_bucket", &b);
        assert!(v >= at_least && v <= count, "le={le}: {v} of {count}");
    }
    assert!(must(&s, "pdgate_request_duration_seconds_sum", &ok) > 0.0);
    // Streams: time to first token, and the gaps between events (finer buckets).
    let gen = [("route", "generate")];
    assert!(must(&s, "pdgate_time_to_first_token_seconds_count", &gen) >= 2.0);
    must(
        &s,
        "pdgate_time_to_first_token_seconds_bucket",
        &[gen[0], ("le", "600")],
    );
    assert!(must(&s, "pdgate_stream_inter_event_seconds_count", &gen) >= 2.0);
    must(
        &s,
        "pdgate_stream_inter_event_seconds_bucket",
        &[gen[0], ("le", "0.001")],
    );
    let chat = [("route", "chat_completions")];
    assert!(must(&s, "pdgate_time_to_first_token_seconds_count", &chat) >= 1.0);
    // The failing decode's attempts were retried, by reason (its 500 reads as a decode
    // failure: decode_status, or decode_aborted for SGLang's abort shape).
    let decode_failures = |name: &str, phase: Option<&str>| -> f64 {
        s.iter()
            .filter(|x| x.name == name)
            .filter(|x| phase.is_none_or(|p| x.labels.get("phase").is_some_and(|v| v == p)))
            .filter(|x| {
                x.labels
                    .get("reason")
                    .is_some_and(|r| r.starts_with("decode_"))
            })
            .map(|x| x.value)
            .sum()
    };
    assert!(decode_failures("pdgate_retries_total", None) >= 1.0);
    let before = Some("before_first_byte");
    assert!(decode_failures("pdgate_request_failures_total", before) >= 1.0);
    // Admission gauges, build info.
    must(&s, "pdgate_in_flight_requests", &[]);
    must(&s, "pdgate_admission_queue", &[]);
    must(
        &s,
        "pdgate_build_info",
        &[("version", env!("CARGO_PKG_VERSION"))],
    );
    // Both results are there from the start (a query for errors has a series to read).
    must(&s, "pdgate_config_reloads_total", &[("result", "ok")]);
    must(&s, "pdgate_config_reloads_total", &[("result", "error")]);
    must(
        &s,
        "pdgate_config_last_reload_success_timestamp_seconds",
        &[],
    );

    // This router's pool, exactly.
    for (role, w) in [("prefill", &p), ("decode", &d_bad), ("decode", &d_good)] {
        let at = [("role", role), ("worker_url", w.as_str())];
        assert_eq!(must(&s, "pdgate_worker_healthy", &at), 1.0, "{w}");
        let states: f64 = ["closed", "open", "half_open"]
            .iter()
            .map(|st| {
                must(
                    &s,
                    "pdgate_worker_breaker_state",
                    &[at[0], at[1], ("state", st)],
                )
            })
            .sum();
        assert_eq!(states, 1.0, "one breaker state of {w}");
    }
    let good = [
        ("role", "decode"),
        ("worker_url", d_good.as_str()),
        ("state", "closed"),
    ];
    assert_eq!(must(&s, "pdgate_worker_breaker_state", &good), 1.0);
    for rank in ["0", "1"] {
        for (state, want) in [("ready", 1.0), ("failed", 0.0), ("unknown", 0.0)] {
            let at = [("worker_url", p.as_str()), ("rank", rank), ("state", state)];
            assert_eq!(
                must(&s, "pdgate_bootstrap_rank_state", &at),
                want,
                "{rank} {state}"
            );
        }
    }
    assert_eq!(
        must(&s, "pdgate_routable_ranks", &[("role", "prefill")]),
        2.0
    );

    families_are_described(&text);
    promtool_check("an_on_call_scrape", &text);
}

/// Per worker: after N requests through one pair (streamed and not), the scrape shows N
/// `ok` legs for that prefill and that decode, and N observations in each of their leg-time
/// histograms; every per-worker series carries the worker's stable id; no series twice;
/// promtool accepts the text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcomes_and_leg_times_per_worker() {
    let env = start_with_admin(
        vec![EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1)],
        |_| {},
    )
    .await;
    env.wait_routable(1, 1).await;
    let bodies = [GEN, GEN_STREAM, GEN, GEN_STREAM, GEN];
    for body in bodies {
        let (st, _, bytes) = env.post("/generate", body).await;
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&bytes));
    }
    let n = bodies.len() as f64;
    let (p, d) = (env.cluster.prefills[0].url(), env.cluster.decodes[0].url());
    let pw = [
        ("role", "prefill"),
        ("worker_id", "prefill-0"),
        ("worker_url", p.as_str()),
    ];
    let dw = [
        ("role", "decode"),
        ("worker_id", "decode-0"),
        ("worker_url", d.as_str()),
    ];
    fn with<'a>(w: &[(&'a str, &'a str)], extra: (&'a str, &'a str)) -> Vec<(&'a str, &'a str)> {
        let mut v = w.to_vec();
        v.push(extra);
        v
    }
    // A prefill's verdict may come after its decode's answer ended: wait for it.
    let ok = ("outcome", "ok");
    let text = scrape_until(&env, "every leg's verdict", |s| {
        value(s, "pdgate_worker_requests_total", &with(&pw, ok)) == Some(n)
            && value(s, "pdgate_worker_requests_total", &with(&dw, ok)) == Some(n)
    })
    .await;
    let s = parse(&text);
    for (name, w) in [
        ("pdgate_worker_prefill_duration_seconds", &pw),
        ("pdgate_worker_first_byte_seconds", &dw),
    ] {
        assert_eq!(must(&s, &format!("{name}_count"), &w[..]), n, "{name}");
        let inf = must(&s, &format!("{name}_bucket"), &with(&w[..], ("le", "+Inf")));
        assert_eq!(inf, n, "{name}");
        assert!(must(&s, &format!("{name}_sum"), &w[..]) > 0.0, "{name}");
    }
    // No failure outcome, and each role's histogram only for its own workers.
    let failed = s
        .iter()
        .filter(|x| x.name == "pdgate_worker_requests_total")
        .filter(|x| x.labels.get("outcome").is_some_and(|o| o != "ok"))
        .count();
    assert_eq!(failed, 0, "{text}");
    assert_eq!(
        value(&s, "pdgate_worker_first_byte_seconds_count", &pw[..]),
        None
    );
    for x in s.iter().filter(|x| x.name.starts_with("pdgate_worker_")) {
        assert!(x.labels.contains_key("worker_id"), "{x:?}");
    }
    let mut keys: Vec<String> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.rsplit_once(' ').map(|(k, _)| k.to_string()))
        .collect();
    let all = keys.len();
    keys.sort_unstable();
    keys.dedup();
    assert_eq!(keys.len(), all, "a series twice in\n{text}");
    families_are_described(&text);
    promtool_check("outcomes_and_leg_times_per_worker", &text);
}

/// Scrapes until `cond` holds on the samples (bounded: 200 scrapes, 20 ms apart); returns
/// the text that satisfied it.
async fn scrape_until(env: &Env, what: &str, cond: impl Fn(&[Sample]) -> bool) -> String {
    let mut text = String::new();
    for _ in 0..200 {
        text = scrape(env).await;
        if cond(&parse(&text)) {
            return text;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("never saw {what}:\n{text}");
}

fn set_hold(env: &Env, hold: bool) {
    env.cluster.decodes[0].set_faults(Faults {
        decode_hold: hold,
        ..Faults::default()
    });
}

/// A request held by the decode (`decode_hold`) shows on its worker's DP rank, and one
/// more waits in the admission queue; when the hold is lifted both end and every gauge is
/// back to 0. Nothing here depends on timing: the decode holds until told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_per_rank_and_queue_depth() {
    let env = std::sync::Arc::new(
        start_with_admin(
            vec![EngineConfig::prefill(1)],
            vec![EngineConfig::decode(2)],
            |c| {
                c.admission.max_in_flight = 1;
                c.admission.max_queue = 4;
                c.admission.queue_timeout_ms = 30_000;
            },
        )
        .await,
    );
    env.wait_routable(1, 2).await;
    set_hold(&env, true);
    let post = |env: &std::sync::Arc<Env>| {
        let env = env.clone();
        tokio::spawn(async move { env.post("/generate", GEN).await })
    };
    let first = post(&env);
    let d = env.cluster.decodes[0].url();
    let held = |s: &[Sample]| -> f64 {
        ["0", "1"]
            .iter()
            .map(|r| {
                let at = [("role", "decode"), ("worker_url", d.as_str()), ("rank", *r)];
                must(s, "pdgate_worker_in_flight_requests", &at)
            })
            .sum()
    };
    scrape_until(&env, "the held request on a decode rank", |s| {
        held(s) == 1.0
    })
    .await;
    let second = post(&env);
    let text = scrape_until(&env, "the second request queued", |s| {
        value(s, "pdgate_admission_queue", &[]).is_some_and(|v| v >= 1.0)
    })
    .await;
    let s = parse(&text);
    assert!(must(&s, "pdgate_in_flight_requests", &[]) >= 1.0);
    assert_eq!(held(&s), 1.0, "the queued request holds no leg");
    promtool_check("in_flight_per_rank_and_queue_depth", &text);

    set_hold(&env, false);
    for h in [first, second] {
        let (st, _, _) = tokio::time::timeout(Duration::from_secs(20), h)
            .await
            .expect("answered")
            .unwrap();
        assert_eq!(st, 200);
    }
    scrape_until(&env, "no leg in flight after the end", |s| held(s) == 0.0).await;
}

/// The scaling signals of one model (issue 36, item 5): a request held by its decode
/// fills the model's one decode slot (`[capacity]` 1 per rank), the next waits in the
/// router's queue for a slot, counted under its model; when the hold is lifted it is
/// admitted and its wait observed as such. The engines serve a model no other test names,
/// so the process-wide recorder's per-model series are this test's alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scaling_signals_per_model() {
    const MODEL: &str = "signals-test-model";
    let named = |mut e: EngineConfig| {
        e.model = MODEL.into();
        e
    };
    let env = std::sync::Arc::new(
        start_with_admin(
            vec![named(EngineConfig::prefill(1))],
            vec![named(EngineConfig::decode(1))],
            |c| {
                c.capacity.decode_max_running_per_rank = 1;
                c.admission.max_queue = 4;
                c.admission.queue_timeout_ms = 30_000;
            },
        )
        .await,
    );
    env.wait_routable(1, 1).await;
    set_hold(&env, true);
    let post = |env: &std::sync::Arc<Env>| {
        let env = env.clone();
        tokio::spawn(async move { env.post("/generate", GEN).await })
    };
    let m = [("model", MODEL)];
    let first = post(&env);
    scrape_until(&env, "the model's one decode slot in use", |s| {
        value(s, "pdgate_decode_slots_used", &m) == Some(1.0)
    })
    .await;
    let second = post(&env);
    let text = scrape_until(
        &env,
        "the second request waiting for its model's slot",
        |s| value(s, "pdgate_admission_queue_waiting", &m) == Some(1.0),
    )
    .await;
    let s = parse(&text);
    assert_eq!(must(&s, "pdgate_decode_slots_capacity", &m), 1.0);
    assert!(must(&s, "pdgate_admission_queue", &[]) >= 1.0);
    let ratio = must(&s, "pdgate_suggested_prefill_decode_ratio", &m);
    assert!(ratio.is_finite() && ratio >= 0.0, "{ratio}");
    promtool_check("scaling_signals_per_model", &text);

    set_hold(&env, false);
    for h in [first, second] {
        let (st, _, _) = tokio::time::timeout(Duration::from_secs(20), h)
            .await
            .expect("answered")
            .unwrap();
        assert_eq!(st, 200);
    }
    let admitted = [("model", MODEL), ("outcome", "admitted")];
    let text = scrape_until(&env, "the wait observed as admitted", |s| {
        value(s, "pdgate_admission_queue_wait_seconds_count", &admitted) == Some(1.0)
            && value(s, "pdgate_admission_queue_waiting", &m) == Some(0.0)
    })
    .await;
    let s = parse(&text);
    for outcome in ["timeout", "gone"] {
        let at = [("model", MODEL), ("outcome", outcome)];
        assert_eq!(
            value(&s, "pdgate_admission_queue_wait_seconds_count", &at),
            None
        );
    }
    scrape_until(&env, "the slot given back", |s| {
        value(s, "pdgate_decode_slots_used", &m) == Some(0.0)
    })
    .await;
}

/// A request that waited for a decode slot leaves the queue as soon as it holds one, not
/// when its attempt ends: while it runs it no longer counts against `admission.max_queue`
/// or in the queue gauges. The first request's client goes away (its slot is given back)
/// while the decode holds every request, so the second runs held, after its wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_leaves_the_queue_once_it_holds_a_slot() {
    const MODEL: &str = "queue-leave-test-model";
    let named = |mut e: EngineConfig| {
        e.model = MODEL.into();
        e
    };
    let env = std::sync::Arc::new(
        start_with_admin(
            vec![named(EngineConfig::prefill(1))],
            vec![named(EngineConfig::decode(1))],
            |c| {
                c.capacity.decode_max_running_per_rank = 1;
                c.admission.max_queue = 1;
                c.admission.queue_timeout_ms = 30_000;
            },
        )
        .await,
    );
    env.wait_routable(1, 1).await;
    set_hold(&env, true);
    let post = |env: &std::sync::Arc<Env>| {
        let env = env.clone();
        tokio::spawn(async move { env.post("/generate", GEN).await })
    };
    let m = [("model", MODEL)];
    let first = post(&env);
    scrape_until(&env, "the first request holding the slot", |s| {
        value(s, "pdgate_decode_slots_used", &m) == Some(1.0)
    })
    .await;
    let second = post(&env);
    scrape_until(&env, "the second request waiting", |s| {
        value(s, "pdgate_admission_queue_waiting", &m) == Some(1.0)
    })
    .await;
    first.abort();
    let admitted = [("model", MODEL), ("outcome", "admitted")];
    scrape_until(
        &env,
        "the second request out of the queue, holding the slot",
        |s| {
            value(s, "pdgate_admission_queue_wait_seconds_count", &admitted) == Some(1.0)
                && value(s, "pdgate_admission_queue_waiting", &m) == Some(0.0)
                && value(s, "pdgate_decode_slots_used", &m) == Some(1.0)
        },
    )
    .await;
    // The queue has room again while the second request runs: a third waits (it is not
    // refused as if the queue were still full).
    let third = post(&env);
    scrape_until(&env, "a third request waiting", |s| {
        value(s, "pdgate_admission_queue_waiting", &m) == Some(1.0)
    })
    .await;
    set_hold(&env, false);
    for h in [second, third] {
        let (st, _, _) = tokio::time::timeout(Duration::from_secs(20), h)
            .await
            .expect("answered")
            .unwrap();
        assert_eq!(st, 200);
    }
}

/// Series other branches declare, which docs and manifests on this branch already name
/// (a merge removes each name from here once `telemetry::SERIES` has it). Empty today:
/// `pdgate_prefill_backlog_seconds` came with the `backlog` branch.
pub(crate) const DECLARED_ON_OTHER_BRANCHES: &[&str] = &[];

/// Whether `name` is a series pdgate exports (or one of [`DECLARED_ON_OTHER_BRANCHES`]).
pub(crate) fn exported(name: &str) -> bool {
    telemetry::series(name).is_some() || DECLARED_ON_OTHER_BRANCHES.contains(&name)
}

/// Metric names in a PromQL expression (`pdgate_...`), histogram suffixes removed.
pub(crate) fn names_in(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(i) = rest.find("pdgate_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let name = &tail[..end];
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suf| {
                name.strip_suffix(suf)
                    .filter(|b| telemetry::series(b).is_some_and(|s| s.kind == Kind::Histogram))
            })
            .unwrap_or(name);
        out.push(base.to_string());
        rest = &tail[end..];
    }
    out
}

/// Label names an expression groups or matches by: `by (a, b)`, `without (a)`, `{a="x"}`.
pub(crate) fn labels_in(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    for kw in ["by (", "by(", "without (", "without("] {
        for (i, _) in expr.match_indices(kw) {
            let inner = &expr[i + kw.len()..];
            let inner = &inner[..inner.find(')').unwrap_or(inner.len())];
            out.extend(inner.split(',').map(|l| l.trim().to_string()));
        }
    }
    for (i, _) in expr.match_indices('{') {
        let inner = &expr[i + 1..];
        let inner = &inner[..inner.find('}').unwrap_or(inner.len())];
        for m in inner.split(',') {
            if let Some(k) = m.split(['=', '!']).next() {
                out.push(k.trim().to_string());
            }
        }
    }
    out.retain(|l| !l.is_empty());
    out
}

fn exprs(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("expr", serde_json::Value::String(e)) => out.push(e.clone()),
                    _ => exprs(v, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|v| exprs(v, out)),
        _ => {}
    }
}

/// Series the dashboard deliberately does not show, with why. Empty today: every series
/// pdgate exports is on a panel.
const DASHBOARD_LEFT_OFF: &[(&str, &str)] = &[];

/// The Grafana dashboard's every query names only series pdgate exports, and groups or
/// matches only by labels those series have (or `le`, or Grafana's `$variables`).
#[test]
fn the_dashboard_names_only_exported_series() {
    let path = manifest().join("docker/grafana/pdgate.json");
    let text = std::fs::read_to_string(&path).expect("the dashboard");
    let dash: serde_json::Value = serde_json::from_str(&text).expect("dashboard JSON");
    let mut all = Vec::new();
    exprs(&dash, &mut all);
    assert!(all.len() >= 10, "only {} queries", all.len());
    let mut used = std::collections::BTreeSet::new();
    for e in &all {
        let names = names_in(e);
        assert!(!names.is_empty(), "a query on no pdgate series: {e}");
        let mut allowed: Vec<&str> = vec!["le", "instance", "job"];
        for n in &names {
            let s = telemetry::series(n).unwrap_or_else(|| panic!("{n} is not exported: {e}"));
            allowed.extend(s.labels);
            used.insert(s.name);
        }
        for l in labels_in(e) {
            assert!(
                allowed.contains(&l.as_str()),
                "label {l} is not on {names:?}: {e}"
            );
        }
    }
    // Every series is on a panel, or deliberately left off (with why).
    for s in SERIES {
        let left_off = DASHBOARD_LEFT_OFF.iter().find(|(n, _)| *n == s.name);
        assert!(
            used.contains(s.name) != left_off.is_some(),
            "{}: on no panel of the dashboard and not in DASHBOARD_LEFT_OFF (or both)",
            s.name
        );
    }
}

/// The dashboard's error ratio counts exactly the outcomes answered with a 5xx: client 4xx
/// (and 429 shedding, 499 gone clients) are left out, and a new 5xx reason must be added.
#[test]
fn the_dashboard_error_ratio_counts_exactly_the_5xx_outcomes() {
    let path = manifest().join("docker/grafana/pdgate.json");
    let text = std::fs::read_to_string(&path).expect("the dashboard");
    let mut all = Vec::new();
    exprs(
        &serde_json::from_str(&text).expect("dashboard JSON"),
        &mut all,
    );
    let ratio: Vec<&String> = all
        .iter()
        .filter(|e| e.contains("pdgate_requests_total") && e.contains(" / "))
        .collect();
    assert_eq!(ratio.len(), 1, "one error ratio: {ratio:?}");
    let (_, rest) = ratio[0]
        .split_once("outcome=~\"")
        .expect("an outcome=~ matcher");
    let (rx, _) = rest.split_once('"').expect("closed");
    let used: std::collections::BTreeSet<&str> = rx.split('|').collect();
    let want: std::collections::BTreeSet<&str> = pdgate::error::FailReason::ALL
        .iter()
        .filter(|r| r.status(None).is_server_error())
        .map(|r| r.as_str())
        .collect();
    assert_eq!(used, want);
    for client in [
        "invalid_request",
        "key_in_flight_limit",
        "client_disconnected",
    ] {
        assert!(!used.contains(client), "{client}");
    }
}

/// Every `"pdgate_..."` literal in the library's source is a series of the table (a
/// series named at a call site but never described would have no HELP).
#[test]
fn every_series_named_in_the_source_is_described() {
    fn walk(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    walk(&manifest().join("src"), &mut files);
    let mut found = 0;
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let code = text.split("#[cfg(test)]").next().unwrap_or("");
        for (i, _) in code.match_indices("\"pdgate_") {
            let lit = &code[i + 1..];
            let name = &lit[..lit.find('"').unwrap()];
            if name.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
                assert!(
                    SERIES.iter().any(|s| s.name == name),
                    "{name} ({}) is not in telemetry::SERIES",
                    f.display()
                );
                found += 1;
            }
        }
    }
    assert!(found > 20, "only {found} names found: is the scan broken?");
}

/// Every series name lives once, in `telemetry` (its constant and its `SERIES` row): no
/// production file outside `src/telemetry/` writes a `pdgate_` name as a string literal,
/// so no series can be exported that the table (and so the docs and the dashboard test)
/// does not know.
#[test]
fn series_names_are_written_only_in_telemetry() {
    fn walk(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).expect("src").flatten() {
            let p = e.path();
            if p.is_dir() {
                if !p.ends_with("telemetry") {
                    walk(&p, out);
                }
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    walk(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &mut files,
    );
    assert!(files.len() > 50, "{} files", files.len());
    let mut found = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap_or_default();
        // Production code only: a file's inline tests start at its first `#[cfg(test)]`
        // module; test files are skipped.
        let name = f.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name == "tests.rs" || name.ends_with("_tests.rs") || name.ends_with("props.rs") {
            continue;
        }
        let prod = text.split("#[cfg(test)]\nmod ").next().unwrap_or("");
        for (i, line) in prod.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            if code.contains("\"pdgate_") {
                found.push(format!("{}:{}: {}", f.display(), i + 1, line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "series names outside telemetry:\n{}",
        found.join("\n")
    );
}
