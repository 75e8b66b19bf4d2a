//! Resolution rules, table-driven over a pool whose engines report their models.

use super::*;
use crate::engine::ServerInfo;
use crate::types::Role;
use crate::url::parse_base_url;

/// A pool with one prefill and one decode per model name (`page` sets the page size of
/// every engine, so one name can be served by two handoff groups).
fn pool(models: &[(&str, u64)]) -> Pool {
    let pool = Pool::new();
    for (i, (name, page)) in models.iter().enumerate() {
        for role in [Role::Prefill, Role::Decode] {
            let port = if role == Role::Prefill { 30000 } else { 30001 };
            let url = parse_base_url(&format!("http://10.0.0.{i}:{port}")).expect("url");
            let id = pool.add_worker(role, url, None);
            let info = ServerInfo {
                served_model_name: Some(name.to_string()),
                model_path: Some(format!("/models/{name}")),
                page_size: Some(*page),
                ..ServerInfo::default()
            };
            pool.update_worker(role, id, |w| w.facts.info = Some(info.into()));
        }
    }
    pool
}

fn cfg(strict: bool, default: Option<&str>, aliases: &[(&str, &str)]) -> ModelsConfig {
    ModelsConfig {
        default: default.map(str::to_string),
        strict,
        aliases: aliases
            .iter()
            .map(|(a, t)| (a.to_string(), t.to_string()))
            .collect(),
        ..ModelsConfig::default()
    }
}

#[derive(Debug, PartialEq)]
enum Want {
    Any,
    Model(&'static str),
    Fails(FailReason),
}

#[test]
fn resolution_follows_the_rules() {
    let one = [("m-a", 1)];
    let two = [("m-a", 1), ("m-b", 1)];
    let one_two_groups = [("m-a", 1), ("m-a", 16)];
    use Want::*;
    type Case<'a> = (
        &'a str,
        &'a [(&'a str, u64)],
        ModelsConfig,
        Option<&'a str>,
        Want,
    );
    #[rustfmt::skip]
    let cases: Vec<Case<'_>> = vec![
        ("one group, loose: nothing looked up", &one, cfg(false, None, &[]), Some("whatever"), Any),
        ("one group, loose, no model", &one, cfg(false, None, &[]), None, Any),
        ("one group, strict, its name", &one, cfg(true, None, &[]), Some("m-a"), Model("m-a")),
        ("one group, strict, other name", &one, cfg(true, None, &[]), Some("gpt-4o"), Fails(FailReason::ModelNotFound)),
        ("one group, strict, no model: the only one", &one, cfg(true, None, &[]), None, Model("m-a")),
        ("one model in two groups, loose: any name", &one_two_groups, cfg(false, None, &[]), Some("x"), Model("m-a")),
        ("two models: by name", &two, cfg(false, None, &[]), Some("m-b"), Model("m-b")),
        ("two models: unknown", &two, cfg(false, None, &[]), Some("m-c"), Fails(FailReason::ModelNotFound)),
        ("two models: no model, no default", &two, cfg(false, None, &[]), None, Fails(FailReason::InvalidRequest)),
        ("two models: no model, default", &two, cfg(false, Some("m-b"), &[]), None, Model("m-b")),
        ("two models: LoRA adapter of a base", &two, cfg(false, None, &[]), Some("m-a:my-adapter"), Model("m-a")),
        ("two models: adapter of an unknown base", &two, cfg(false, None, &[]), Some("m-c:x"), Fails(FailReason::ModelNotFound)),
        ("alias", &two, cfg(false, None, &[("gpt-4o", "m-b")]), Some("gpt-4o"), Model("m-b")),
        ("alias with an adapter", &two, cfg(false, None, &[("gpt-4o", "m-b")]), Some("gpt-4o:ad"), Model("m-b")),
        ("alias to a model nobody serves: known (503 later)", &two, cfg(false, None, &[("old", "m-z")]), Some("old"), Model("m-z")),
        ("one group with aliases: names matter", &one, cfg(false, None, &[("gpt-4o", "m-a")]), Some("nope"), Fails(FailReason::ModelNotFound)),
        ("one group with aliases: the model's own name", &one, cfg(false, None, &[("gpt-4o", "m-a")]), Some("m-a"), Model("m-a")),
    ];
    for (what, models, cfg, requested, want) in cases {
        let p = pool(models);
        let got = match resolve(&cfg, &p, || requested.map(Cow::Borrowed)) {
            Ok(None) => Any,
            Ok(Some(m)) => Model(Box::leak(m.to_string().into_boxed_str())),
            Err(f) => Fails(f.reason),
        };
        assert_eq!(got, want, "{what}");
    }
}

#[test]
fn not_found_is_openai_shaped_and_names_nothing_internal() {
    let p = pool(&[("m-a", 1), ("m-b", 1)]);
    let f = resolve_in(&cfg(false, None, &[]), &p.load(), Some("m-c")).expect_err("unknown");
    assert_eq!(f.status(), http::StatusCode::NOT_FOUND);
    let v: serde_json::Value = serde_json::from_slice(&f.json()).expect("json");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(v["error"]["code"], "model_not_found");
    assert_eq!(v["error"]["param"], "model");
    let text = v.to_string();
    assert!(
        !text.contains("10.0.0") && !text.contains("/models/"),
        "{text}"
    );
    // A long name is echoed only in part.
    let long = "x".repeat(10_000);
    let f = resolve_in(&cfg(false, None, &[]), &p.load(), Some(&long)).expect_err("unknown");
    assert!(f.message.len() < 400, "{}", f.message.len());
}

#[test]
fn the_list_has_every_model_and_the_aliases_of_served_ones() {
    let p = pool(&[("m-a", 1), ("m-b", 1), ("m-a", 16)]);
    let c = cfg(false, None, &[("gpt-4o", "m-b"), ("old", "m-z")]);
    let v = list(&c, &p.load(), 7);
    let ids: Vec<&str> = v["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|m| m["id"].as_str().expect("id"))
        .collect();
    assert_eq!(ids, ["m-a", "m-b", "gpt-4o"]);
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["root"], "/models/m-a");
    assert_eq!(v["data"][2]["parent"], "m-b");
}

/// Facts one side does not report are not compared: an engine that names no model (an
/// older or non-SGLang engine) still pairs with a named one of the same layout, and never
/// with one whose reported facts differ.
#[test]
fn unreported_facts_are_not_compared() {
    use crate::engine::HandoffKey;
    let named = HandoffKey {
        model: Some("m-a".into()),
        model_path: Some("/models/m-a".into()),
        page_size: Some(1),
        transfer_backend: Some("mooncake".into()),
        ..HandoffKey::default()
    };
    let bare = HandoffKey {
        page_size: Some(1),
        ..HandoffKey::default()
    };
    let other_page = HandoffKey {
        page_size: Some(16),
        ..bare.clone()
    };
    let other_model = HandoffKey {
        model: Some("m-b".into()),
        ..named.clone()
    };
    for (a, b, want) in [
        (&named, &named, true),
        (&named, &bare, true),
        (&bare, &named, true),
        (&named, &other_page, false),
        (&named, &other_model, false),
        (&HandoffKey::default(), &other_model, true),
    ] {
        assert_eq!(a.compatible(b), want, "{a:?} / {b:?}");
    }
    // In a snapshot: the named prefill's partners include the bare decode.
    let p = Pool::new();
    let pid = p.add_worker(
        Role::Prefill,
        parse_base_url("http://10.0.0.1:1").expect("url"),
        None,
    );
    let did = p.add_worker(
        Role::Decode,
        parse_base_url("http://10.0.0.2:1").expect("url"),
        None,
    );
    p.update_worker(Role::Prefill, pid, |w| {
        w.facts.info = Some(
            ServerInfo {
                served_model_name: Some("m-a".into()),
                page_size: Some(1),
                ..ServerInfo::default()
            }
            .into(),
        )
    });
    p.update_worker(Role::Decode, did, |w| {
        w.facts.healthy = true;
        w.facts.info = Some(
            ServerInfo {
                page_size: Some(1),
                ..ServerInfo::default()
            }
            .into(),
        )
    });
    let snap = p.load();
    assert_eq!(snap.groups.len(), 2);
    let partners = snap.decodes_for(pid).expect("two groups");
    assert_eq!(partners.len(), 1);
    assert_eq!(partners[0].worker, did);
}

#[test]
fn legs_carry_the_served_name_of_an_alias() {
    let c = cfg(false, None, &[("gpt-4o", "org/m"), ("x:y", "org/m")]);
    let rows: &[(&str, &str, Option<&str>)] = &[
        ("gpt-4o", "org/m", Some("org/m")),
        ("gpt-4o:sql", "org/m", Some("org/m:sql")),
        ("x:y", "org/m", Some("org/m")),
        ("org/m", "org/m", None),
        ("org/m:sql", "org/m", None),
        ("other:sql", "org/m", None),
    ];
    for (asked, resolved, want) in rows {
        assert_eq!(
            leg_name(&c, asked, resolved).as_deref(),
            *want,
            "{asked} -> {resolved}"
        );
    }
    assert_eq!(leg_name(&cfg(false, None, &[]), "gpt-4o", "org/m"), None);
}
