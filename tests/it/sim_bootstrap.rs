//! The simulated bootstrap server against the rows observed from the real
//! SGLang 0.5.23 `CommonKVBootstrapServer` (shared/spec/sglang-0.5.23-bootstrap-observed.md).

use crate::support::sim_support;

use std::time::Duration;

use pdgate_sim::{EngineConfig, Faults};
use serde_json::{json, Value};
use sim_support::{request, Answer};

const G500: &str = "500 Internal Server Error\n\nServer got itself in trouble";
const SENTINEL: &str =
    "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1";
const TEXT: &str = "text/plain";
const JSON: &str = "application/json";

/// One row: method, path, body, expected status, content type, body.
type Row<'a> = (&'a str, String, Option<String>, u16, &'a str, String);

fn sentinel_body(dp: u32, tp: u32, page: u32, dtype: &str, layout: Option<&str>) -> String {
    let layout = layout
        .map(|l| format!("\"kv_layout\": \"{l}\", "))
        .unwrap_or_default();
    format!(
        "{{\"attn_tp_size\": {tp}, \"attn_cp_size\": 1, \"dp_size\": {dp}, \"pp_size\": 1, \"page_size\": {page}, \"kv_cache_dtype\": \"{dtype}\", \"follow_bootstrap_room\": true, \"enable_dsa_cache_layer_split\": false, {layout}\"decode_allocation_policy\": \"early\", \"enable_kv_cache_sharding\": false, \"prefill_http_port\": 30000, \"target_tp_rank\": null, \"target_tp_ranks\": null, \"target_cp_ranks\": null, \"target_pp_ranks\": null, \"required_dst_info_num\": null, \"required_prefill_response_num\": null}}"
    )
}

fn put(dp_size: u32, dp_rank: u32, tp_size: u32, tp_rank: u32, port: u32) -> Value {
    json!({
        "attn_tp_size": tp_size, "attn_tp_rank": tp_rank, "attn_cp_size": 1, "attn_cp_rank": 0,
        "attn_dp_size": dp_size, "attn_dp_rank": dp_rank, "pp_size": 1, "pp_rank": 0,
        "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "127.0.0.1", "rank_port": port,
        "page_size": 1, "kv_cache_dtype": "auto", "prefill_http_port": 30000,
        "decode_allocation_policy": "early",
    })
}

fn route(dp: &str, cp: &str, tp: &str, pp: &str) -> String {
    format!(
        "/route?prefill_dp_rank={dp}&prefill_cp_rank={cp}&target_tp_rank={tp}&target_pp_rank={pp}"
    )
}

fn not_ready(n: u32) -> String {
    format!("Prefill server not fully registered yet ({n} workers registered).")
}

fn ok<'a>(method: &'a str, path: &str, body: Value) -> Row<'a> {
    (
        method,
        path.to_string(),
        Some(body.to_string()),
        200,
        TEXT,
        "OK".into(),
    )
}

/// A fresh bootstrap server (the engine registers none of its own ranks).
async fn fresh(ttl: Duration) -> pdgate_sim::SimEngine {
    let cfg = EngineConfig {
        room_entry_ttl: ttl,
        faults: Faults {
            register_none: true,
            ..Faults::default()
        },
        ..EngineConfig::prefill(1)
    };
    pdgate_sim::spawn(cfg).await.expect("spawn")
}

async fn run_rows(engine: &pdgate_sim::SimEngine, rows: &[Row<'_>]) {
    let base = engine.bootstrap_url().expect("bootstrap url");
    for (method, path, body, status, ct, expected) in rows {
        let a: Answer = request(method, &format!("{base}{path}"), body.as_deref()).await;
        assert_eq!(
            (a.status, a.content_type.as_str(), a.body.as_str()),
            (*status, *ct, expected.as_str()),
            "{method} {path} body={body:?}"
        );
    }
}

#[tokio::test(crate = "crate::support::rt")]
async fn a_fresh_server() {
    let e = fresh(Duration::from_secs(120)).await;
    let rows: Vec<Row> = vec![
        ("GET", "/health".into(), None, 200, TEXT, "OK".into()),
        ("GET", SENTINEL.into(), None, 503, TEXT, not_ready(0)),
        (
            "GET",
            route("0", "0", "0", "0"),
            None,
            503,
            TEXT,
            not_ready(0),
        ),
        (
            "GET",
            "/route".into(),
            None,
            400,
            TEXT,
            "Missing inputs for bootstrap server.".into(),
        ),
        (
            "GET",
            "/route?prefill_dp_rank=0".into(),
            None,
            400,
            TEXT,
            "Missing inputs for bootstrap server.".into(),
        ),
        (
            "GET",
            route("", "0", "0", "0"),
            None,
            400,
            TEXT,
            "Missing inputs for bootstrap server.".into(),
        ),
        (
            "GET",
            route("x", "-1", "-1", "-1"),
            None,
            500,
            TEXT,
            G500.into(),
        ),
        (
            "GET",
            route("0", "0", "0", "x"),
            None,
            503,
            TEXT,
            not_ready(0),
        ),
        (
            "POST",
            "/query_dp_ranks".into(),
            Some(r#"{"bootstrap_rooms": [1]}"#.into()),
            200,
            JSON,
            "{}".into(),
        ),
        ok(
            "POST",
            "/register_dp_rank",
            json!({"bootstrap_room": 7, "dp_rank": 1}),
        ),
        (
            "POST",
            "/query_dp_ranks".into(),
            Some(r#"{"bootstrap_rooms": [7]}"#.into()),
            200,
            JSON,
            "{\"7\": 1}".into(),
        ),
        (
            "POST",
            "/route".into(),
            None,
            405,
            JSON,
            "Method not allowed".into(),
        ),
        (
            "DELETE",
            "/route".into(),
            None,
            405,
            JSON,
            "Method not allowed".into(),
        ),
        ("HEAD", "/health".into(), None, 200, TEXT, "".into()),
        (
            "POST",
            "/health".into(),
            None,
            405,
            TEXT,
            "405: Method Not Allowed".into(),
        ),
        (
            "GET",
            "/register_dp_rank".into(),
            None,
            405,
            TEXT,
            "405: Method Not Allowed".into(),
        ),
        (
            "GET",
            "/query_dp_ranks".into(),
            None,
            405,
            TEXT,
            "405: Method Not Allowed".into(),
        ),
        (
            "GET",
            "/nope".into(),
            None,
            404,
            TEXT,
            "404: Not Found".into(),
        ),
    ];
    run_rows(&e, &rows).await;
}

#[tokio::test(crate = "crate::support::rt")]
async fn b_partial_then_ready() {
    let e = fresh(Duration::from_secs(120)).await;
    let rows: Vec<Row> = vec![
        ok("PUT", "/route", put(4, 0, 1, 0, 17000)),
        ok("PUT", "/route", put(4, 1, 1, 0, 17001)),
        ("GET", SENTINEL.into(), None, 503, TEXT, not_ready(2)),
        (
            "GET",
            route("0", "0", "0", "0"),
            None,
            503,
            TEXT,
            not_ready(2),
        ),
        (
            "GET",
            route("3", "0", "0", "0"),
            None,
            503,
            TEXT,
            not_ready(2),
        ),
        (
            "GET",
            route("9", "0", "0", "0"),
            None,
            503,
            TEXT,
            not_ready(2),
        ),
        ok("PUT", "/route", put(4, 2, 1, 0, 17002)),
        ok("PUT", "/route", put(4, 3, 1, 0, 17003)),
        (
            "GET",
            SENTINEL.into(),
            None,
            200,
            JSON,
            sentinel_body(4, 1, 1, "auto", None),
        ),
        (
            "GET",
            route("3", "0", "0", "0"),
            None,
            200,
            JSON,
            r#"{"rank_ip": "127.0.0.1", "rank_port": 17003}"#.into(),
        ),
        (
            "GET",
            route("4", "0", "0", "0"),
            None,
            404,
            TEXT,
            "Bootstrap info not found for dp_rank=4 cp_rank=0 tp_rank=0 pp_rank=0".into(),
        ),
        (
            "GET",
            route("0", "0", "1", "0"),
            None,
            404,
            TEXT,
            "Bootstrap info not found for dp_rank=0 cp_rank=0 tp_rank=1 pp_rank=0".into(),
        ),
        (
            "GET",
            route("-1", "0", "0", "0"),
            None,
            404,
            TEXT,
            "Bootstrap info not found for dp_rank=-1 cp_rank=0 tp_rank=0 pp_rank=0".into(),
        ),
        (
            "GET",
            route("-1", "-1", "-1", "0"),
            None,
            404,
            TEXT,
            "Bootstrap info not found for dp_rank=-1 cp_rank=-1 tp_rank=-1 pp_rank=0".into(),
        ),
        (
            "GET",
            route("0", "0", "0", "x"),
            None,
            500,
            TEXT,
            G500.into(),
        ),
        (
            "GET",
            format!("{}&extra=1", route("1", "0", "0", "0")),
            None,
            200,
            JSON,
            r#"{"rank_ip": "127.0.0.1", "rank_port": 17001}"#.into(),
        ),
    ];
    run_rows(&e, &rows).await;
}

#[tokio::test(crate = "crate::support::rt")]
async fn c_tp2_layout_latched_by_first_put() {
    let e = fresh(Duration::from_secs(120)).await;
    let mut rows: Vec<Row> = Vec::new();
    let mut port = 17000;
    for dp in 0..2 {
        for tp in 0..2 {
            let mut b = put(2, dp, 2, tp, port);
            b["page_size"] = json!(64);
            b["kv_cache_dtype"] = json!("bfloat16");
            b["kv_layout"] = json!("NHD");
            rows.push(ok("PUT", "/route", b));
            port += 1;
        }
    }
    let sentinel = sentinel_body(2, 2, 64, "bfloat16", Some("NHD"));
    rows.extend([
        ("GET", SENTINEL.into(), None, 200, JSON, sentinel.clone()),
        (
            "GET",
            route("1", "0", "1", "0"),
            None,
            200,
            JSON,
            r#"{"rank_ip": "127.0.0.1", "rank_port": 17003}"#.into(),
        ),
        (
            "GET",
            route("1", "0", "2", "0"),
            None,
            404,
            TEXT,
            "Bootstrap info not found for dp_rank=1 cp_rank=0 tp_rank=2 pp_rank=0".into(),
        ),
        ok("PUT", "/route", put(8, 5, 1, 0, 17005)),
        ("GET", SENTINEL.into(), None, 200, JSON, sentinel),
        (
            "GET",
            route("5", "0", "0", "0"),
            None,
            200,
            JSON,
            r#"{"rank_ip": "127.0.0.1", "rank_port": 17005}"#.into(),
        ),
    ]);
    run_rows(&e, &rows).await;
}

#[tokio::test(crate = "crate::support::rt")]
async fn d_duplicate_put_counts_twice() {
    let e = fresh(Duration::from_secs(120)).await;
    let rows: Vec<Row> = vec![
        ok("PUT", "/route", put(2, 0, 1, 0, 17000)),
        ok("PUT", "/route", put(2, 0, 1, 0, 17555)),
        (
            "GET",
            SENTINEL.into(),
            None,
            200,
            JSON,
            sentinel_body(2, 1, 1, "auto", None),
        ),
        (
            "GET",
            route("0", "0", "0", "0"),
            None,
            200,
            JSON,
            r#"{"rank_ip": "127.0.0.1", "rank_port": 17555}"#.into(),
        ),
        (
            "GET",
            route("1", "0", "0", "0"),
            None,
            404,
            TEXT,
            "Bootstrap info not found for dp_rank=1 cp_rank=0 tp_rank=0 pp_rank=0".into(),
        ),
    ];
    run_rows(&e, &rows).await;
}

#[tokio::test(crate = "crate::support::rt")]
async fn e_system_dp_mode() {
    let e = fresh(Duration::from_secs(120)).await;
    let mut rows: Vec<Row> = Vec::new();
    for r in 0..2 {
        let mut b = put(1, 0, 1, 0, 17000 + r);
        b["system_dp_size"] = json!(2);
        b["system_dp_rank"] = json!(r);
        rows.push(ok("PUT", "/route", b));
    }
    rows.push((
        "GET",
        SENTINEL.into(),
        None,
        200,
        JSON,
        sentinel_body(2, 1, 1, "auto", None),
    ));
    rows.push((
        "GET",
        route("1", "0", "0", "0"),
        None,
        200,
        JSON,
        r#"{"rank_ip": "127.0.0.1", "rank_port": 17001}"#.into(),
    ));
    run_rows(&e, &rows).await;
}

#[tokio::test(crate = "crate::support::rt")]
async fn f_bad_puts() {
    let e = fresh(Duration::from_secs(120)).await;
    let mut missing_ip = put(2, 0, 1, 0, 17000);
    missing_ip.as_object_mut().map(|m| m.remove("rank_ip"));
    let mut bad_port = put(2, 0, 1, 0, 17000);
    bad_port["rank_port"] = json!("abc");
    let mut null_page = put(2, 0, 1, 0, 17000);
    null_page["page_size"] = Value::Null;
    let mut other_policy = put(2, 1, 1, 0, 17001);
    other_policy["decode_allocation_policy"] = json!("late");
    let mut other_dsv = put(2, 1, 1, 0, 17001);
    other_dsv["dsv41_spec_layout"] = json!({"x": 1});
    let raw = |b: &str| Some(b.to_string());
    let rows: Vec<Row> = vec![
        (
            "PUT",
            "/route".into(),
            raw("{not json"),
            500,
            TEXT,
            G500.into(),
        ),
        ("PUT", "/route".into(), raw(""), 500, TEXT, G500.into()),
        (
            "PUT",
            "/route".into(),
            raw("[1, 2]"),
            500,
            TEXT,
            G500.into(),
        ),
        (
            "PUT",
            "/route".into(),
            Some(missing_ip.to_string()),
            500,
            TEXT,
            G500.into(),
        ),
        (
            "PUT",
            "/route".into(),
            Some(bad_port.to_string()),
            500,
            TEXT,
            G500.into(),
        ),
        (
            "PUT",
            "/route".into(),
            Some(null_page.to_string()),
            500,
            TEXT,
            G500.into(),
        ),
        ("GET", SENTINEL.into(), None, 503, TEXT, not_ready(0)),
        ok("PUT", "/route", put(2, 0, 1, 0, 17000)),
        (
            "PUT",
            "/route".into(),
            Some(other_policy.to_string()),
            400,
            TEXT,
            "Inconsistent prefill allocation policies".into(),
        ),
        (
            "PUT",
            "/route".into(),
            Some(other_dsv.to_string()),
            400,
            TEXT,
            "DeepSeek-V4.1 DSpark PD layout differs across prefill ranks".into(),
        ),
        ("GET", SENTINEL.into(), None, 503, TEXT, not_ready(1)),
    ];
    run_rows(&e, &rows).await;

    // String ranks are stored under string keys: ready, but never found.
    let e2 = fresh(Duration::from_secs(120)).await;
    let mut strings = put(1, 0, 1, 0, 17000);
    strings["attn_dp_rank"] = json!("0");
    strings["attn_tp_rank"] = json!("0");
    let rows: Vec<Row> = vec![
        ok("PUT", "/route", strings),
        (
            "GET",
            SENTINEL.into(),
            None,
            200,
            JSON,
            sentinel_body(1, 1, 1, "auto", None),
        ),
        (
            "GET",
            route("0", "0", "0", "0"),
            None,
            404,
            TEXT,
            "Bootstrap info not found for dp_rank=0 cp_rank=0 tp_rank=0 pp_rank=0".into(),
        ),
    ];
    run_rows(&e2, &rows).await;
}

#[tokio::test(crate = "crate::support::rt")]
async fn g_rooms() {
    let e = fresh(Duration::from_millis(200)).await;
    let q = |b: &str| ("POST", "/query_dp_ranks".to_string(), Some(b.to_string()));
    let reg = |b: &str| ("POST", "/register_dp_rank".to_string(), Some(b.to_string()));
    let rows: Vec<Row> = vec![
        {
            let (m, p, b) = reg(r#"{"bootstrap_room": 12345, "dp_rank": 1}"#);
            (m, p, b, 200, TEXT, "OK".into())
        },
        {
            let (m, p, b) = reg(r#"{"bootstrap_room": "42", "dp_rank": "3"}"#);
            (m, p, b, 200, TEXT, "OK".into())
        },
        {
            let (m, p, b) = q(r#"{"bootstrap_rooms": [12345, 42, 99]}"#);
            (m, p, b, 200, JSON, r#"{"12345": 1, "42": 3}"#.into())
        },
        {
            let (m, p, b) = q(r#"{"bootstrap_rooms": ["42"]}"#);
            (m, p, b, 200, JSON, r#"{"42": 3}"#.into())
        },
        {
            let (m, p, b) = q(r#"{"bootstrap_rooms": []}"#);
            (m, p, b, 200, JSON, "{}".into())
        },
        {
            let (m, p, b) = reg(r#"{"bootstrap_room": 12345, "dp_rank": 0}"#);
            (m, p, b, 200, TEXT, "OK".into())
        },
        {
            let (m, p, b) = q(r#"{"bootstrap_rooms": [12345]}"#);
            (m, p, b, 200, JSON, r#"{"12345": 0}"#.into())
        },
        {
            let (m, p, b) = reg(r#"{"bootstrap_room": 1}"#);
            (m, p, b, 500, TEXT, G500.into())
        },
        {
            let (m, p, b) = reg(r#"{"bootstrap_room": "abc", "dp_rank": 0}"#);
            (m, p, b, 500, TEXT, G500.into())
        },
        {
            let (m, p, b) = reg("{bad");
            (m, p, b, 500, TEXT, G500.into())
        },
        {
            let (m, p, b) = q("{}");
            (m, p, b, 500, TEXT, G500.into())
        },
        {
            let (m, p, b) = q(r#"{"bootstrap_rooms": ["x"]}"#);
            (m, p, b, 500, TEXT, G500.into())
        },
        {
            let (m, p, b) = q(r#"{"bootstrap_rooms": 5}"#);
            (m, p, b, 500, TEXT, G500.into())
        },
        {
            let (m, p, b) = q(r#"{"bootstrap_rooms": "12"}"#);
            (m, p, b, 200, JSON, "{}".into())
        },
        {
            let (m, p, b) = q("{bad");
            (m, p, b, 500, TEXT, G500.into())
        },
    ];
    run_rows(&e, &rows).await;
    // Entries live between 1x and 2x the cleanup interval (200 ms here): the sweeper drops
    // them (bounded wait: 10 s, fifty intervals).
    let base = e.bootstrap_url().expect("bootstrap url");
    let query = r#"{"bootstrap_rooms": [12345, 42]}"#;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let a = request("POST", &format!("{base}/query_dp_ranks"), Some(query)).await;
        assert_eq!(
            (a.status, a.content_type.as_str()),
            (200, JSON),
            "{}",
            a.body
        );
        if a.body == "{}" {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "room entries never expired: {}",
            a.body
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(crate = "crate::support::rt")]
async fn engine_registers_its_own_ranks() {
    let e = pdgate_sim::spawn(EngineConfig::prefill(2))
        .await
        .expect("spawn");
    let base = e.bootstrap_url().expect("url");
    let s = request("GET", &format!("{base}{SENTINEL}"), None).await;
    assert_eq!(s.status, 200, "{}", s.body);
    let v = s.json();
    assert_eq!(v["dp_size"], 2);
    assert_eq!(v["follow_bootstrap_room"], true);
    assert_eq!(v["prefill_http_port"], e.addr().port());
    for (rank, port) in e.rank_ports().iter().enumerate() {
        let r = request(
            "GET",
            &format!("{base}{}", route(&rank.to_string(), "0", "0", "0")),
            None,
        )
        .await;
        assert_eq!(r.json(), json!({"rank_ip": "127.0.0.1", "rank_port": port}));
    }
    // Unregistering a rank at run time lowers the count: every query is 503 again.
    e.set_faults(Faults {
        unregistered_ranks: vec![1],
        ..Faults::default()
    });
    let ok = sim_support::eventually(|| !e.faults().unregistered_ranks.is_empty()).await;
    assert!(ok);
    let mut status = 0;
    for _ in 0..100 {
        status = request("GET", &format!("{base}{SENTINEL}"), None)
            .await
            .status;
        if status == 503 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(status, 503);
    // And registering it again (a real PUT) makes the server ready.
    e.set_faults(Faults::default());
    for _ in 0..100 {
        status = request("GET", &format!("{base}{SENTINEL}"), None)
            .await
            .status;
        if status == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(status, 200);
}

#[tokio::test(crate = "crate::support::rt")]
async fn bootstrap_down_drops_connections_but_keeps_port() {
    let e = pdgate_sim::spawn(EngineConfig::prefill(1))
        .await
        .expect("spawn");
    let base = e.bootstrap_url().expect("url");
    e.set_faults(Faults {
        bootstrap_down: true,
        ..Faults::default()
    });
    assert!(
        sim_support::try_request("GET", &format!("{base}/health"), None)
            .await
            .is_err()
    );
    // The engine port itself still answers.
    assert_eq!(
        request("GET", &format!("{}/health", e.url()), None)
            .await
            .status,
        200
    );
    e.set_faults(Faults::default());
    assert_eq!(
        request("GET", &format!("{base}/health"), None).await.body,
        "OK"
    );
}
