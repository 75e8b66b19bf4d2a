//! The engine-pool autoscaling examples (docs/scaling.md): KEDA `ScaledObject`s, plain HPAs
//! on External metrics with prometheus-adapter's rules, and the recording rules both read.
//!
//! - the two CRDs the examples use (KEDA's `ScaledObject`, the Prometheus Operator's
//!   `PrometheusRule`) have typed structs of the fields used, any other refused, so the
//!   round trip of `super` catches a typo as it does for built-in kinds;
//! - in a build, each autoscaler targets an engine workload of that build by name (the
//!   `sglang-pd` StatefulSets), which no longer sets `replicas`; a prefill pool scales on
//!   prefill signals and a decode pool on decode ones, for the model its engines serve;
//!   every External metric is one the build's adapter rules serve, from a series the build's
//!   recording rules record;
//! - every PromQL expression of the manifests is valid (`promtool check rules`) and reads
//!   only series pdgate exports or recording rules of the manifests record.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;

use k8s_openapi::api::autoscaling::v2::{HorizontalPodAutoscaler, HorizontalPodAutoscalerBehavior};
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::fleet::Res;
use super::kustomize::{self, KUSTOMIZATION};
use super::{k8s_dir, manifest_files};

/// KEDA's `keda.sh/v1alpha1` ScaledObject, the fields the manifests use.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ScaledObject {
    api_version: String,
    kind: String,
    metadata: ObjectMeta,
    spec: ScaledObjectSpec,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ScaledObjectSpec {
    scale_target_ref: ScaleTarget,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    min_replica_count: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_replica_count: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    polling_interval: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cooldown_period: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    advanced: Option<Advanced>,
    triggers: Vec<Trigger>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ScaleTarget {
    api_version: String,
    kind: String,
    name: String,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Advanced {
    horizontal_pod_autoscaler_config: HpaConfig,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct HpaConfig {
    behavior: HorizontalPodAutoscalerBehavior,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Trigger {
    #[serde(rename = "type")]
    type_: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    metric_type: Option<String>,
    metadata: PrometheusTrigger,
}

/// The Prometheus scaler's metadata (the only scaler the manifests use).
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PrometheusTrigger {
    server_address: String,
    query: String,
    threshold: String,
}

/// The Prometheus Operator's `monitoring.coreos.com/v1` PrometheusRule, recording rules
/// only (what the manifests use).
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PrometheusRule {
    api_version: String,
    kind: String,
    metadata: ObjectMeta,
    spec: RuleFile,
}

/// A Prometheus rules file: what `promtool check rules` reads (the rule's `spec`).
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleFile {
    groups: Vec<RuleGroup>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleGroup {
    name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    interval: Option<String>,
    rules: Vec<Rule>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Rule {
    record: String,
    expr: String,
}

/// prometheus-adapter's config file (`config.yaml` of its ConfigMap), external rules only.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct AdapterConfig {
    external_rules: Vec<AdapterRule>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct AdapterRule {
    series_query: String,
    resources: AdapterResources,
    name: AdapterName,
    metrics_query: String,
}

/// Which Kubernetes resource a series label names: the recording rules keep pdgate's
/// `namespace`, so an External metric is read in the namespace of the HPA asking.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AdapterResources {
    overrides: BTreeMap<String, AdapterOverride>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AdapterOverride {
    resource: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AdapterName {
    #[serde(rename = "as")]
    as_: String,
}

/// The adapter's templated query with its template filled in as the adapter does for one
/// namespace: a PromQL expression.
fn filled(rule: &AdapterRule) -> String {
    let series = rule
        .series_query
        .split('{')
        .next()
        .unwrap_or_default()
        .trim();
    rule.metrics_query
        .replace("<<.Series>>", series)
        .replace("<<.LabelMatchers>>", "namespace=\"pdgate\"")
        .replace("<<.GroupBy>>", "namespace")
}

/// Metric names an expression reads: identifiers with `pdgate_` in them, recording rule
/// names (`level:metric:operations`) included.
fn metric_names(expr: &str) -> Vec<String> {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(i) = rest.find("pdgate_") {
        let start = rest[..i]
            .char_indices()
            .rev()
            .take_while(|(_, c)| ident(*c))
            .last()
            .map_or(i, |(j, _)| j);
        let tail = &rest[i..];
        let end = i + tail.find(|c: char| !ident(c)).unwrap_or(tail.len());
        out.push(rest[start..end].to_string());
        rest = &rest[end..];
    }
    out
}

/// Whether `name` (from [`metric_names`]) is a series pdgate exports, or a histogram's part.
fn exported(name: &str) -> bool {
    let base = ["_bucket", "_sum", "_count"]
        .iter()
        .find_map(|s| name.strip_suffix(s))
        .unwrap_or(name);
    crate::metrics::exported(name) || crate::metrics::exported(base)
}

/// Every expression of the manifests, by where it is; and the recorded names.
struct Queries {
    exprs: Vec<(String, String)>,
    recorded: BTreeSet<String>,
    rule_files: Vec<(String, RuleFile)>,
}

fn queries_of(objs: &[(String, Value)]) -> Res<Queries> {
    let mut q = Queries {
        exprs: Vec::new(),
        recorded: BTreeSet::new(),
        rule_files: Vec::new(),
    };
    for (at, o) in objs {
        let name = o["metadata"]["name"].as_str().unwrap_or_default();
        match o["kind"].as_str() {
            Some("PrometheusRule") => {
                let r: PrometheusRule = get(o)?;
                for g in &r.spec.groups {
                    for rule in &g.rules {
                        q.recorded.insert(rule.record.clone());
                        q.exprs
                            .push((format!("{at}: rule {}", rule.record), rule.expr.clone()));
                    }
                }
                q.rule_files.push((format!("{at}: {name}"), r.spec));
            }
            Some("ScaledObject") => {
                let s: ScaledObject = get(o)?;
                for t in &s.spec.triggers {
                    q.exprs.push((
                        format!("{at}: ScaledObject {name}"),
                        t.metadata.query.clone(),
                    ));
                }
            }
            Some("ConfigMap") => {
                for rule in adapter_rules(o)? {
                    let w = format!("{at}: adapter rule {}", rule.name.as_);
                    q.exprs.push((w.clone(), rule.series_query.clone()));
                    q.exprs.push((w, filled(&rule)));
                }
            }
            _ => {}
        }
    }
    Ok(q)
}

/// The external rules of a prometheus-adapter ConfigMap (none for another ConfigMap).
fn adapter_rules(o: &Value) -> Res<Vec<AdapterRule>> {
    let cm: ConfigMap = get(o)?;
    let Some(text) = cm.data.as_ref().and_then(|d| d.get("config.yaml")) else {
        return Ok(Vec::new());
    };
    let cfg: AdapterConfig =
        serde_saphyr::from_str(text).map_err(|e| format!("adapter config.yaml: {e}"))?;
    Ok(cfg.external_rules)
}

fn get<K: serde::de::DeserializeOwned>(o: &Value) -> Res<K> {
    serde_json::from_value(o.clone()).map_err(|e| format!("{}: {e}", o["kind"]))
}

/// Every document of every manifest file, with its file.
fn all_documents() -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for f in manifest_files() {
        if f.file_name().is_some_and(|n| n == KUSTOMIZATION) {
            continue;
        }
        let rel = f
            .strip_prefix(k8s_dir())
            .unwrap_or(&f)
            .display()
            .to_string();
        for d in kustomize::yaml_docs(&f).unwrap() {
            out.push((rel.clone(), d));
        }
    }
    out
}

#[test]
fn every_series_the_scaling_queries_read_is_exported_or_recorded() {
    let q = queries_of(&all_documents()).unwrap();
    assert!(q.exprs.len() >= 10, "only {} queries", q.exprs.len());
    let mut read = BTreeSet::new();
    for (at, e) in &q.exprs {
        let names = metric_names(e);
        assert!(!names.is_empty(), "{at}: reads no pdgate series: {e}");
        for n in names {
            if n.contains(':') {
                assert!(q.recorded.contains(&n), "{at}: {n} is recorded by no rule");
            } else {
                assert!(exported(&n), "{at}: {n} is not a series pdgate exports");
                read.insert(n);
            }
        }
        // Labels grouped or matched by are the series' own (or the scrape's namespace).
        for l in crate::metrics::labels_in(e) {
            assert!(
                ["model", "namespace"].contains(&l.as_str()),
                "{at}: label {l}: {e}"
            );
        }
    }
    // Each pool's signals are read.
    for s in [
        "pdgate_prefill_backlog_seconds",
        "pdgate_prefill_engines_busy",
        "pdgate_decode_slots_used",
        "pdgate_decode_slots_capacity",
        "pdgate_admission_queue_waiting",
    ] {
        assert!(read.contains(s), "{s} is read by no query: {read:?}");
    }
}

#[test]
fn metric_names_are_read_from_promql() {
    let table: &[(&str, &[&str])] = &[
        ("max(pdgate_a{model=\"x\"})", &["pdgate_a"]),
        (
            "max(model:pdgate_a:max{x=\"1\"}) / pdgate_b",
            &["model:pdgate_a:max", "pdgate_b"],
        ),
        ("rate(pdgate_h_bucket[5m])", &["pdgate_h_bucket"]),
        ("sum(up)", &[]),
    ];
    for (e, want) in table {
        assert_eq!(metric_names(e), *want, "{e}");
    }
}

/// `promtool check rules` on `files` (name, JSON or YAML text): whether it passed and what
/// it said; `None` when promtool is missing.
fn promtool_rules(test: &str, files: &[(String, String)]) -> Option<(bool, String)> {
    let dir = std::env::temp_dir().join(format!("pdgate-rules-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut paths = Vec::new();
    for (i, (_, text)) in files.iter().enumerate() {
        let p = dir.join(format!("rules-{i}.yaml"));
        std::fs::File::create(&p)
            .and_then(|mut f| f.write_all(text.as_bytes()))
            .unwrap();
        paths.push(p);
    }
    let out = std::process::Command::new("promtool")
        .args(["check", "rules"])
        .args(&paths)
        .output();
    let _ = std::fs::remove_dir_all(&dir);
    let out = match out {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let why = "promtool is not installed (apt-get install -y prometheus)";
            return crate::support::interop::skip_or_fail(test, why);
        }
        r => r.unwrap(),
    };
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Some((out.status.success(), said))
}

#[test]
fn the_scaling_queries_pass_promtool() {
    let q = queries_of(&all_documents()).unwrap();
    assert!(!q.rule_files.is_empty(), "no PrometheusRule");
    // The recording rules as shipped...
    let mut files: Vec<(String, String)> = q
        .rule_files
        .iter()
        .map(|(at, r)| (at.clone(), serde_json::to_string(r).unwrap()))
        .collect();
    // ... and every query (KEDA's, the adapter's filled in) as a rule of its own.
    let rules: Vec<Value> = q
        .exprs
        .iter()
        .enumerate()
        .map(|(i, (_, e))| serde_json::json!({"record": format!("pdgate_manifest_query_{i}"), "expr": e}))
        .collect();
    let every = serde_json::json!({"groups": [{"name": "every-query", "rules": rules}]});
    files.push(("every query".into(), every.to_string()));
    let test = "the_scaling_queries_pass_promtool";
    let Some((ok, said)) = promtool_rules(test, &files) else {
        return;
    };
    let names: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
    assert!(ok, "promtool check rules {names:?}: {said}");
    // An invalid expression is refused: the check is not vacuous.
    let bad = serde_json::json!({"groups": [{"name": "bad", "rules": [
        {"record": "x", "expr": "max(pdgate_decode_slots_used"}]}]});
    let refused = promtool_rules(test, &[("bad".into(), bad.to_string())]);
    assert!(matches!(refused, Some((false, _))), "{refused:?}");
}

/// The pool (`prefill` or `decode`) of a workload's pods, from their `component` label.
fn pool_of(w: &Value) -> Option<String> {
    w["spec"]["template"]["metadata"]["labels"]["component"]
        .as_str()
        .filter(|c| ["prefill", "decode"].contains(c))
        .map(str::to_string)
}

/// The model a workload's engines serve: `--served-model-name`, else `--model-path`.
fn model_of(w: &Value) -> Option<String> {
    let args: Vec<&str> = w["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let flag = |f: &str| {
        args.iter()
            .position(|a| *a == f)
            .and_then(|i| args.get(i + 1))
            .map(|s| s.to_string())
    };
    flag("--served-model-name").or_else(|| flag("--model-path"))
}

/// The engine workload an autoscaler of `ns` targets: its pool and model. It must be in the
/// build and no longer set `replicas` (the autoscaler owns the count).
fn target(
    objs: &[Value],
    ns: &Option<String>,
    (api, kind, name): (&str, &str, &str),
) -> Res<(String, Option<String>)> {
    if api != "apps/v1" || !["StatefulSet", "Deployment"].contains(&kind) {
        return Err(format!("{api} {kind} {name} is not a workload"));
    }
    let w = objs
        .iter()
        .find(|o| {
            o["kind"] == kind
                && o["metadata"]["name"] == name
                && o["metadata"]["namespace"].as_str() == ns.as_deref()
        })
        .ok_or_else(|| format!("no {kind} {name} in the build"))?;
    if !w["spec"]["replicas"].is_null() {
        return Err(format!(
            "{kind} {name} sets replicas, which its autoscaler owns"
        ));
    }
    let pool = pool_of(w).ok_or_else(|| format!("{kind} {name} runs no engine pool"))?;
    Ok((pool, model_of(w)))
}

/// A query is about `pool`: it reads that pool's series and not the other's.
fn about(pool: &str, expr: &str) -> bool {
    let other = if pool == "prefill" {
        "decode"
    } else {
        "prefill"
    };
    let names = metric_names(expr);
    names.iter().any(|n| n.contains(pool)) && !names.iter().any(|n| n.contains(other))
}

/// The autoscalers of one build (see the module docs); `Ok` when there are none.
pub fn check(objs: &[Value]) -> Res<()> {
    let labelled: Vec<(String, Value)> = objs
        .iter()
        .map(|o| ("build".to_string(), o.clone()))
        .collect();
    let q = queries_of(&labelled)?;
    let mut scaled = BTreeMap::new();
    for o in objs.iter().filter(|o| o["kind"] == "ScaledObject") {
        let s: ScaledObject = get(o)?;
        let t = &s.spec.scale_target_ref;
        let name = s.metadata.name.clone().unwrap_or_default();
        let (pool, model) = target(
            objs,
            &s.metadata.namespace,
            (&t.api_version, &t.kind, &t.name),
        )
        .map_err(|e| format!("ScaledObject {name}: {e}"))?;
        let (min, max) = (
            s.spec.min_replica_count.unwrap_or(0),
            s.spec.max_replica_count.unwrap_or(100),
        );
        if min < 1 || min > max {
            return Err(format!("ScaledObject {name}: replicas {min}..{max}"));
        }
        if s.spec.triggers.is_empty() {
            return Err(format!("ScaledObject {name} has no trigger"));
        }
        for tr in &s.spec.triggers {
            let m = &tr.metadata;
            let why = if tr.type_ != "prometheus" {
                Some("not the Prometheus scaler")
            } else if !m.server_address.starts_with("http") {
                Some("serverAddress is not a URL")
            } else if !m.threshold.parse::<f64>().is_ok_and(|t| t > 0.0) {
                Some("threshold is not a positive number")
            } else if !["Value", "AverageValue"]
                .contains(&tr.metric_type.as_deref().unwrap_or("AverageValue"))
            {
                Some("metricType is neither Value nor AverageValue")
            } else if !about(&pool, &m.query) {
                Some("the query is not about the pool it scales")
            } else if let Some(model) = &model {
                (!m.query.contains(&format!("model=\"{model}\"")))
                    .then_some("the query is not about the model its engines serve")
            } else {
                None
            };
            if let Some(why) = why {
                return Err(format!("ScaledObject {name}: {why}: {}", m.query));
            }
        }
        if scaled.insert(t.name.clone(), "ScaledObject").is_some() {
            return Err(format!("{} has two autoscalers", t.name));
        }
    }
    // Plain HPAs on engines (pdgate's own HPA is `monitoring`'s to check).
    let served: BTreeMap<String, String> = objs
        .iter()
        .filter(|o| o["kind"] == "ConfigMap")
        .map(adapter_rules)
        .collect::<Res<Vec<_>>>()?
        .into_iter()
        .flatten()
        .map(|r| {
            let ns = r
                .resources
                .overrides
                .get("namespace")
                .map(|o| o.resource.as_str());
            if ns != Some("namespace") {
                return Err(format!(
                    "adapter rule {}: namespace is not mapped to the namespace",
                    r.name.as_
                ));
            }
            let series = r
                .series_query
                .split('{')
                .next()
                .unwrap_or_default()
                .trim()
                .to_string();
            Ok((r.name.as_, series))
        })
        .collect::<Res<_>>()?;
    for o in objs
        .iter()
        .filter(|o| o["kind"] == "HorizontalPodAutoscaler")
    {
        let h: HorizontalPodAutoscaler = get(o)?;
        let name = h.metadata.name.clone().unwrap_or_default();
        let spec = h.spec.ok_or("HPA without spec")?;
        let t = &spec.scale_target_ref;
        if t.kind == "Deployment" && t.name == "pdgate" {
            continue;
        }
        let (pool, _) = target(
            objs,
            &h.metadata.namespace,
            (
                t.api_version.as_deref().unwrap_or_default(),
                &t.kind,
                &t.name,
            ),
        )
        .map_err(|e| format!("HPA {name}: {e}"))?;
        let metrics = spec.metrics.unwrap_or_default();
        if metrics.is_empty() {
            return Err(format!("HPA {name} has no metric"));
        }
        for m in metrics {
            let ext = m
                .external
                .filter(|_| m.type_ == "External")
                .ok_or_else(|| format!("HPA {name}: a metric that is not External"))?;
            let metric = &ext.metric.name;
            let series = served
                .get(metric)
                .ok_or_else(|| format!("HPA {name}: no adapter rule serves {metric}"))?;
            if !q.recorded.contains(series) {
                return Err(format!(
                    "HPA {name}: {metric} comes from {series}, recorded by no rule"
                ));
            }
            if !about(&pool, series) {
                return Err(format!("HPA {name}: {metric} is not about the {pool} pool"));
            }
        }
        if scaled.insert(t.name.clone(), "HPA").is_some() {
            return Err(format!("{} has two autoscalers", t.name));
        }
    }
    // Whoever scales one engine pool scales the other too.
    let pools: BTreeSet<_> = scaled.keys().collect();
    if !pools.is_empty() && pools.len() != 2 {
        return Err(format!("autoscalers for {pools:?}: one per pool expected"));
    }
    Ok(())
}

/// Each way an autoscaler can miss its pool fails the build's check.
#[test]
fn a_misdirected_autoscaler_fails_the_check() {
    type Edit = fn(&mut Vec<Value>);
    fn find<'a>(objs: &'a mut [Value], kind: &str, name: &str) -> &'a mut Value {
        objs.iter_mut()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("{kind} {name}"))
    }
    // (root, what is changed, the edit, the error's words)
    let table: &[(&str, &str, Edit, &str)] = &[
        ("examples/autoscaling-keda", "nothing", |_| {}, ""),
        ("examples/autoscaling-hpa", "nothing", |_| {}, ""),
        (
            "examples/autoscaling-keda",
            "a target that is not in the build",
            |o| {
                find(o, "ScaledObject", "sglang-prefill")["spec"]["scaleTargetRef"]["name"] =
                    "prefill".into()
            },
            "no StatefulSet prefill",
        ),
        (
            "examples/autoscaling-keda",
            "a target that still sets replicas",
            |o| find(o, "StatefulSet", "sglang-decode")["spec"]["replicas"] = 2.into(),
            "sets replicas",
        ),
        (
            "examples/autoscaling-keda",
            "the decode pool on a prefill signal",
            |o| {
                find(o, "ScaledObject", "sglang-decode")["spec"]["triggers"][0]["metadata"]
                    ["query"] =
                    "max(model:pdgate_prefill_engines_busy:max{model=\"Qwen/Qwen2.5-7B-Instruct\"})"
                        .into()
            },
            "not about the pool",
        ),
        (
            "examples/autoscaling-keda",
            "another model than the engines serve",
            |o| {
                find(o, "ScaledObject", "sglang-prefill")["spec"]["triggers"][1]["metadata"]
                    ["query"] = "max(model:pdgate_prefill_engines_busy:max{model=\"llama\"})".into()
            },
            "not about the model",
        ),
        (
            "examples/autoscaling-keda",
            "a threshold that is not a number",
            |o| {
                find(o, "ScaledObject", "sglang-decode")["spec"]["triggers"][0]["metadata"]
                    ["threshold"] = "80%".into()
            },
            "threshold",
        ),
        (
            "examples/autoscaling-keda",
            "one pool left without an autoscaler",
            |o| {
                o.retain(|o| {
                    !(o["kind"] == "ScaledObject" && o["metadata"]["name"] == "sglang-decode")
                })
            },
            "one per pool",
        ),
        (
            "examples/autoscaling-hpa",
            "an External metric no adapter rule serves",
            |o| {
                find(o, "HorizontalPodAutoscaler", "sglang-decode")["spec"]["metrics"][0]
                    ["external"]["metric"]["name"] = "pdgate_decode_slots_used".into()
            },
            "no adapter rule serves",
        ),
        (
            "examples/autoscaling-hpa",
            "a prefill HPA on the decode's metric",
            |o| {
                find(o, "HorizontalPodAutoscaler", "sglang-prefill")["spec"]["metrics"][0]
                    ["external"]["metric"]["name"] = "pdgate_model_decode_slots_demand".into()
            },
            "not about the prefill pool",
        ),
        (
            "examples/autoscaling-hpa",
            "an adapter rule on a series nothing records",
            |o| {
                let cm = find(o, "ConfigMap", "adapter-config");
                let text = cm["data"]["config.yaml"].as_str().unwrap().replace(
                    "model:pdgate_decode_slots_demand:ratio",
                    "model:pdgate_decode_slots_demand:max",
                );
                cm["data"]["config.yaml"] = text.into();
            },
            "recorded by no rule",
        ),
    ];
    for (root, what, edit, want) in table {
        let mut objs = kustomize::build(&k8s_dir().join(root), &mut BTreeSet::new()).unwrap();
        edit(&mut objs);
        match (check(&objs), *want) {
            (Ok(()), "") => {}
            (Err(e), w) if !w.is_empty() && e.contains(w) => {}
            (got, _) => panic!("{root}, {what}: {got:?}, want an error with {want:?}"),
        }
    }
}
