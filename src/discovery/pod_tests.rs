//! The pod → worker mapping, one row per rule.

use super::*;

use serde_json::{json, Value};

fn settings() -> PodSettings {
    PodSettings {
        namespaces: Vec::new(),
        port: 30000,
        port_name: Some("http".into()),
        bootstrap_annotation: "sglang.ai/bootstrap-port".into(),
        model_key: "sglang.ai/model".into(),
        default_grace: Duration::from_secs(30),
    }
}

/// A running, ready pod at 10.0.0.7 with a container port `http` 8000; `tweak` edits its
/// JSON before it is read as a `Pod`.
fn pod(tweak: impl FnOnce(&mut Value)) -> Pod {
    let mut v = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "engine-0", "namespace": "llm", "uid": "u-0",
                     "labels": {"app": "sglang"}},
        "spec": {"containers": [{"name": "engine", "image": "sglang",
                                  "ports": [{"name": "metrics", "containerPort": 9000},
                                            {"name": "http", "containerPort": 8000}]}]},
        "status": {"phase": "Running", "podIP": "10.0.0.7",
                   "conditions": [{"type": "PodScheduled", "status": "True"},
                                  {"type": "Ready", "status": "True"}]}
    });
    tweak(&mut v);
    serde_json::from_value(v).expect("pod json")
}

const P: Matched = Matched {
    prefill: true,
    decode: false,
    regular: false,
};
const D: Matched = Matched {
    prefill: false,
    decode: true,
    regular: false,
};
const R: Matched = Matched {
    prefill: false,
    decode: false,
    regular: true,
};

fn ep(role: Role, url: &str, bootstrap_port: Option<u16>) -> Endpoint {
    Endpoint {
        role,
        url: parse_base_url(url).expect("url"),
        bootstrap_port,
        model: None,
    }
}

#[test]
fn pods_map_to_workers_by_the_rules() {
    type Tweak = fn(&mut Value);
    let no_change: Tweak = |_| {};
    let cases: Vec<(&str, Tweak, Matched, PodSettings, PodState)> = vec![
        (
            "ready decode: the named port",
            no_change,
            D,
            settings(),
            PodState::Ready(ep(Role::Decode, "http://10.0.0.7:8000", None)),
        ),
        (
            "ready regular (non-PD) engine: the named port, no bootstrap port",
            |v| v["metadata"]["annotations"] = json!({"sglang.ai/bootstrap-port": "8998"}),
            R,
            settings(),
            PodState::Ready(ep(Role::Regular, "http://10.0.0.7:8000", None)),
        ),
        (
            "ready prefill without annotation: bootstrap port from /server_info",
            no_change,
            P,
            settings(),
            PodState::Ready(ep(Role::Prefill, "http://10.0.0.7:8000", None)),
        ),
        (
            "prefill with the annotation",
            |v| v["metadata"]["annotations"] = json!({"sglang.ai/bootstrap-port": " 8998 "}),
            P,
            settings(),
            PodState::Ready(ep(Role::Prefill, "http://10.0.0.7:8000", Some(8998))),
        ),
        (
            "decode ignores the annotation, even a bad one",
            |v| v["metadata"]["annotations"] = json!({"sglang.ai/bootstrap-port": "x"}),
            D,
            settings(),
            PodState::Ready(ep(Role::Decode, "http://10.0.0.7:8000", None)),
        ),
        (
            "prefill with a malformed annotation is refused",
            |v| v["metadata"]["annotations"] = json!({"sglang.ai/bootstrap-port": "eighty"}),
            P,
            settings(),
            PodState::Ignored(Ignored::BadAnnotation("eighty".into())),
        ),
        (
            "annotation 0 is no port",
            |v| v["metadata"]["annotations"] = json!({"sglang.ai/bootstrap-port": "0"}),
            P,
            settings(),
            PodState::Ignored(Ignored::BadAnnotation("0".into())),
        ),
        (
            "annotation above 65535",
            |v| v["metadata"]["annotations"] = json!({"sglang.ai/bootstrap-port": "70000"}),
            P,
            settings(),
            PodState::Ignored(Ignored::BadAnnotation("70000".into())),
        ),
        (
            "no container port by that name: the default port",
            |v| v["spec"]["containers"][0]["ports"] = json!([{"name": "grpc", "containerPort": 1}]),
            D,
            settings(),
            PodState::Ready(ep(Role::Decode, "http://10.0.0.7:30000", None)),
        ),
        (
            "the named port out of range",
            |v| v["spec"]["containers"][0]["ports"][1]["containerPort"] = json!(0),
            D,
            settings(),
            PodState::Ignored(Ignored::NoPort(
                "container port \"http\" is 0 (not 1-65535)".into(),
            )),
        ),
        (
            "the named port in a second container",
            |v| {
                v["spec"]["containers"][0]["ports"] = json!([]);
                v["spec"]["containers"]
                    .as_array_mut()
                    .expect("containers")
                    .push(json!({"name": "sidecar", "ports": [{"name": "http", "containerPort": 8080}]}));
            },
            D,
            settings(),
            PodState::Ready(ep(Role::Decode, "http://10.0.0.7:8080", None)),
        ),
        (
            "IPv6 pod IP gets brackets",
            |v| v["status"]["podIP"] = json!("fd00::7"),
            D,
            settings(),
            PodState::Ready(ep(Role::Decode, "http://[fd00::7]:8000", None)),
        ),
        (
            "podIPs when podIP is absent",
            |v| {
                v["status"]["podIP"] = Value::Null;
                v["status"]["podIPs"] = json!([{"ip": "10.0.0.9"}]);
            },
            D,
            settings(),
            PodState::Ready(ep(Role::Decode, "http://10.0.0.9:8000", None)),
        ),
        (
            "not ready: known endpoint, not added",
            |v| v["status"]["conditions"][1]["status"] = json!("False"),
            D,
            settings(),
            PodState::NotReady(ep(Role::Decode, "http://10.0.0.7:8000", None)),
        ),
        (
            "no Ready condition at all",
            |v| v["status"]["conditions"] = json!([]),
            D,
            settings(),
            PodState::NotReady(ep(Role::Decode, "http://10.0.0.7:8000", None)),
        ),
        (
            "no IP",
            |v| v["status"]["podIP"] = Value::Null,
            D,
            settings(),
            PodState::Ignored(Ignored::NoIp),
        ),
        (
            "an IP that is not one",
            |v| v["status"]["podIP"] = json!("ten.0.0.7"),
            D,
            settings(),
            PodState::Ignored(Ignored::BadIp("ten.0.0.7".into())),
        ),
        (
            "pending",
            |v| v["status"]["phase"] = json!("Pending"),
            D,
            settings(),
            PodState::Ignored(Ignored::NotRunning("Pending".into())),
        ),
        (
            "no status at all",
            |v| v["status"] = Value::Null,
            D,
            settings(),
            PodState::Ignored(Ignored::NotRunning("Unknown".into())),
        ),
        (
            "terminating with its deletion grace period",
            |v| {
                v["metadata"]["deletionTimestamp"] = json!("2025-01-01T00:00:00Z");
                v["metadata"]["deletionGracePeriodSeconds"] = json!(45);
                v["spec"]["terminationGracePeriodSeconds"] = json!(90);
            },
            D,
            settings(),
            PodState::Terminating {
                grace: Duration::from_secs(45),
            },
        ),
        (
            "terminating with the spec's grace period",
            |v| {
                v["metadata"]["deletionTimestamp"] = json!("2025-01-01T00:00:00Z");
                v["spec"]["terminationGracePeriodSeconds"] = json!(90);
            },
            P,
            settings(),
            PodState::Terminating {
                grace: Duration::from_secs(90),
            },
        ),
        (
            "cluster-wide: a namespace not allowed is ignored, whatever its state",
            no_change,
            D,
            PodSettings {
                namespaces: vec!["llm-a".into(), "llm-b".into()],
                ..settings()
            },
            PodState::Ignored(Ignored::NamespaceNotAllowed("llm".into())),
        ),
        (
            "cluster-wide: an allowed namespace maps as usual",
            no_change,
            D,
            PodSettings {
                namespaces: vec!["llm".into()],
                ..settings()
            },
            PodState::Ready(ep(Role::Decode, "http://10.0.0.7:8000", None)),
        ),
        (
            "terminating with a huge grace period: bounded to a day",
            |v| {
                v["metadata"]["deletionTimestamp"] = json!("2025-01-01T00:00:00Z");
                v["metadata"]["deletionGracePeriodSeconds"] = json!(i64::MAX);
            },
            D,
            settings(),
            PodState::Terminating { grace: MAX_GRACE },
        ),
        (
            "terminating with no grace period: the default",
            |v| v["metadata"]["deletionTimestamp"] = json!("2025-01-01T00:00:00Z"),
            P,
            settings(),
            PodState::Terminating {
                grace: Duration::from_secs(30),
            },
        ),
        (
            "terminating even while still ready",
            |v| {
                v["metadata"]["deletionTimestamp"] = json!("2025-01-01T00:00:00Z");
                v["metadata"]["deletionGracePeriodSeconds"] = json!(0);
            },
            D,
            settings(),
            PodState::Terminating {
                grace: Duration::ZERO,
            },
        ),
        (
            "both selectors: refused, whatever its state",
            no_change,
            Matched {
                prefill: true,
                decode: true,
                regular: false,
            },
            settings(),
            PodState::Ignored(Ignored::BothSelectors),
        ),
        (
            "a regular and a decode selector: refused",
            no_change,
            Matched {
                prefill: false,
                decode: true,
                regular: true,
            },
            settings(),
            PodState::Ignored(Ignored::BothSelectors),
        ),
        (
            "no selector",
            no_change,
            Matched::default(),
            settings(),
            PodState::Ignored(Ignored::NoSelector),
        ),
        (
            "the model annotation names the pod's model",
            |v| v["metadata"]["annotations"] = json!({"sglang.ai/model": " Qwen/Qwen3-8B "}),
            D,
            settings(),
            PodState::Ready(Endpoint {
                model: Some("Qwen/Qwen3-8B".into()),
                ..ep(Role::Decode, "http://10.0.0.7:8000", None)
            }),
        ),
        (
            "without the annotation, a label of that key",
            |v| {
                v["metadata"]["labels"]["sglang.ai/model"] = json!("qwen3-8b");
            },
            D,
            settings(),
            PodState::Ready(Endpoint {
                model: Some("qwen3-8b".into()),
                ..ep(Role::Decode, "http://10.0.0.7:8000", None)
            }),
        ),
        (
            "an empty model annotation names nothing",
            |v| v["metadata"]["annotations"] = json!({"sglang.ai/model": " "}),
            D,
            settings(),
            PodState::Ready(ep(Role::Decode, "http://10.0.0.7:8000", None)),
        ),
        (
            "no port name configured: the port",
            no_change,
            D,
            PodSettings {
                port_name: None,
                ..settings()
            },
            PodState::Ready(ep(Role::Decode, "http://10.0.0.7:30000", None)),
        ),
    ];
    for (name, tweak, matched, s, want) in cases {
        let p = pod(tweak);
        let got = classify(&p, matched, &s);
        assert_eq!(got, want, "{name}");
        assert!(STATE_LABELS.contains(&got.label()), "{name}: label");
    }
}

#[test]
fn pod_ref_names_the_pod() {
    let r = pod_ref(&pod(|_| {}));
    assert_eq!(
        r,
        PodRef {
            namespace: "llm".into(),
            name: "engine-0".into(),
            uid: "u-0".into()
        }
    );
}

#[test]
fn reasons_read_as_sentences() {
    let cases = [
        (Ignored::BothSelectors, "both the prefill and the decode"),
        (Ignored::NotRunning("Pending".into()), "phase Pending"),
        (Ignored::NoIp, "no IP"),
        (Ignored::BadAnnotation("x".into()), "\"x\" is not a port"),
        (Ignored::NoPort("why".into()), "no usable port: why"),
        (
            Ignored::NamespaceNotAllowed("team-x".into()),
            "\"team-x\" is not in discovery.allowed_namespaces",
        ),
    ];
    for (i, want) in cases {
        assert!(i.to_string().contains(want), "{i:?}");
    }
}
