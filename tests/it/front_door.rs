//! The front door: bad input is refused with an OpenAI-style error and no leg is sent;
//! client PD fields are replaced; streams pass through as they come; the info routes work.

use crate::support::common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{sse_events, start};
use http_body_util::BodyExt;
use pdgate_sim::{EngineConfig, Faults};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_and_no_leg_is_sent() {
    let env = start(
        vec![EngineConfig::prefill(2)],
        vec![EngineConfig::decode(1)],
        |c| c.server.max_body_bytes = 4096,
    )
    .await;
    env.wait_routable(2, 1).await;
    let big = format!(r#"{{"text":"{}"}}"#, "x".repeat(5000));
    let json = [("content-type", "application/json")];
    // (method, path, headers, body, status, error type)
    type Case<'a> = (
        &'a str,
        &'a str,
        &'a [(&'a str, &'a str)],
        Vec<u8>,
        u16,
        &'a str,
    );
    let cases: Vec<Case<'_>> = vec![
        (
            "POST",
            "/generate",
            &json,
            b"not json".to_vec(),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/generate",
            &json,
            b"[1,2,3]".to_vec(),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/generate",
            &json,
            b"\"text\"".to_vec(),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/generate",
            &json,
            b"{\"text\":\"caf\xe9\"}".to_vec(),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/generate",
            &json,
            br#"{"text":"a","stream":"yes"}"#.to_vec(),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/generate",
            &json,
            br#"{"text":"a","sampling_params":{"n":"two"}}"#.to_vec(),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/generate",
            &json,
            br#"{"sampling_params":{}}"#.to_vec(),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/generate",
            &json,
            br#"{"text":[]}"#.to_vec(),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/v1/chat/completions",
            &json,
            br#"{"model":"m"}"#.to_vec(),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/v1/chat/completions",
            &json,
            br#"{"messages":"hi"}"#.to_vec(),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/v1/completions",
            &json,
            br#"{"model":"m","n":0,"prompt":"a"}"#.to_vec(),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/v1/completions",
            &json,
            b"".to_vec(),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/generate",
            &json,
            big.into_bytes(),
            413,
            "payload_too_large",
        ),
        (
            "POST",
            "/generate",
            &[("content-type", "text/plain")],
            br#"{"text":"a"}"#.to_vec(),
            415,
            "unsupported_media_type",
        ),
        (
            "POST",
            "/generate",
            &[("content-type", "application/x-www-form-urlencoded")],
            br#"{"text":"a"}"#.to_vec(),
            415,
            "unsupported_media_type",
        ),
        (
            "POST",
            "/v2/generate",
            &json,
            br#"{"text":"a"}"#.to_vec(),
            404,
            "not_found",
        ),
        (
            "GET",
            "/generate",
            &[],
            Vec::new(),
            405,
            "method_not_allowed",
        ),
        (
            "PUT",
            "/v1/chat/completions",
            &json,
            br#"{"messages":[]}"#.to_vec(),
            405,
            "method_not_allowed",
        ),
        (
            "POST",
            "/v1/models",
            &json,
            Vec::new(),
            405,
            "method_not_allowed",
        ),
    ];
    for (method, path, headers, body, status, kind) in cases {
        let resp = env.send(method, path, headers, body.clone()).await;
        let got = resp.status().as_u16();
        assert!(resp.headers().contains_key("x-request-id"));
        let ct = resp
            .headers()
            .get("content-type")
            .map(|v| v.to_str().unwrap().to_string());
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        let what = format!(
            "{method} {path} {}",
            String::from_utf8_lossy(&body[..body.len().min(60)])
        );
        assert_eq!(got, status, "{what}: {}", String::from_utf8_lossy(&bytes));
        assert_eq!(ct.as_deref(), Some("application/json"), "{what}");
        let v: serde_json::Value =
            serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{what}: not JSON: {e}"));
        assert_eq!(v["error"]["type"], kind, "{what}: {v}");
        assert_eq!(v["error"]["code"], status, "{what}: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{what}: {v}"
        );
    }
    let s = env.stats();
    assert_eq!(s.requests_total, 0, "a leg was sent for bad input: {s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_pd_fields_are_replaced() {
    let env = start(
        vec![EngineConfig::prefill(2)],
        vec![EngineConfig::decode(2)],
        |_| {},
    )
    .await;
    env.wait_routable(2, 2).await;
    let body = r#"{"text":"hi","sampling_params":{"max_new_tokens":2},"bootstrap_host":"203.0.113.9","bootstrap_port":1,"bootstrap_room":7,"routed_dp_rank":1,"data_parallel_rank":1,"disagg_prefill_dp_rank":1,"rid":"client-rid"}"#;
    for _ in 0..4 {
        let (status, headers, bytes) = env.post("/generate", body).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        let rid = v["meta_info"]["id"].as_str().unwrap();
        let req_id = headers["x-request-id"].to_str().unwrap();
        assert_eq!(
            rid,
            format!("pdg-{req_id}-00d"),
            "leg rid is derived from the request id"
        );
    }
    let s = env.settled_stats().await;
    assert_eq!(s.contract_violations, 0, "{s:?}");
    assert_eq!(s.failed, 0, "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_id_is_kept_and_echoed() {
    let env = common::start_pair().await;
    let resp = env
        .send(
            "POST",
            "/generate",
            &[
                ("content-type", "application/json"),
                ("x-request-id", "my-trace-42"),
            ],
            r#"{"text":"a"}"#,
        )
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-request-id"], "my-trace-42");
}

/// The first streamed chunk reaches the client while the decode is still generating.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_passes_through_as_it_comes() {
    let mut slow = EngineConfig::decode(1);
    slow.faults.decode_extra_itl_ms = 150;
    let env = start(vec![EngineConfig::prefill(1)], vec![slow], |_| {}).await;
    env.wait_routable(1, 1).await;
    let resp = env
        .send(
            "POST",
            "/v1/chat/completions",
            &[("content-type", "application/json")],
            r#"{"model":"sim-model","messages":[{"role":"user","content":"hi"}],"max_tokens":10,"stream":true}"#,
        )
        .await;
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let mut body = resp.into_body();
    let first = tokio::time::timeout(Duration::from_secs(10), body.frame())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let first = first.into_data().unwrap();
    assert!(first.starts_with(b"data: "), "{first:?}");
    // The decode still holds the request: it has not finished generating.
    let d = env.cluster.decodes[0].stats();
    assert_eq!(
        d.held_now, 1,
        "decode finished before the client saw the first chunk: {d:?}"
    );
    assert_eq!(d.ok, 0);
    let rest = body.collect().await.unwrap().to_bytes();
    let mut all = first.to_vec();
    all.extend_from_slice(&rest);
    let (events, done) = sse_events(&all);
    assert!(done);
    assert!(events.len() >= 10, "{} events", events.len());
    let s = env.settled_stats().await;
    assert_eq!(s.ok, 2, "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn info_routes() {
    let env = start(
        vec![EngineConfig::prefill(2)],
        vec![EngineConfig::decode(1)],
        |c| c.server.public_metrics = true,
    )
    .await;
    env.wait_routable(2, 1).await;
    for (path, status) in [
        ("/health", 200),
        ("/liveness", 200),
        ("/readiness", 200),
        ("/v1/models", 200),
    ] {
        let resp = env.send("GET", path, &[], "").await;
        assert_eq!(resp.status().as_u16(), status, "{path}");
        let v: serde_json::Value =
            serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
        if path == "/v1/models" {
            assert_eq!(v["data"][0]["id"], "sim-model", "{v}");
        }
        if path == "/readiness" {
            assert_eq!(v["routable_prefill_ranks"], 2, "{v}");
        }
    }
    let (status, _, _) = env.post("/generate", r#"{"text":"a"}"#).await;
    assert_eq!(status, 200);
    let resp = env.send("GET", "/metrics", &[], "").await;
    let text = String::from_utf8(
        resp.into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
    .unwrap();
    assert!(text.contains("pdgate_requests_total"), "{text}");
    // Not ready once no prefill rank can bootstrap.
    env.cluster.prefills[0].set_down(true);
    env.wait_pool("prefill out", |s| s.prefill_routable.is_empty())
        .await;
    let resp = env.send("GET", "/readiness", &[], "").await;
    assert_eq!(resp.status(), 503);
}

/// A request that succeeds cancels nothing: no abort reaches either engine, streamed or not
/// (a non-streamed answer with a Content-Length ends without its body being read to EOF).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn success_cancels_nothing() {
    let env = start(
        vec![EngineConfig::prefill(2)],
        vec![EngineConfig::decode(1)],
        |_| {},
    )
    .await;
    env.wait_routable(2, 1).await;
    for body in [
        r#"{"text":"a","sampling_params":{"max_new_tokens":2}}"#,
        r#"{"text":"a","sampling_params":{"max_new_tokens":2},"stream":true}"#,
        r#"{"text":["a","b"],"sampling_params":{"max_new_tokens":2},"return_logprob":true,"logprob_start_len":0}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":2}"#,
    ] {
        for _ in 0..3 {
            let path = if body.contains("messages") {
                "/v1/chat/completions"
            } else {
                "/generate"
            };
            let (st, _, b) = env.post(path, body).await;
            assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
        }
    }
    let s = env.settled_stats().await;
    assert_eq!(s.aborted, 0, "{s:?}");
    assert_eq!(s.client_disconnects, 0, "{s:?}");
    assert_eq!(s.failed, 0, "{s:?}");
    // The router has let go of every leg (its in-flight counts are back to 0; a leg's abort
    // handle goes before its count): an abort, had one been due, is on its way.
    env.wait_pool("the router let go of every leg", |s| {
        s.prefills.iter().chain(&s.decodes).all(|w| {
            w.per_rank
                .loads
                .iter()
                .all(|c| c.load(Ordering::Relaxed) == 0)
        })
    })
    .await;
    // A marker sent after them that must be aborted on both engines: a request held by the
    // prefill whose client goes away. Once its aborts arrived, any earlier one (sent before
    // it) has arrived too, so each engine must have seen the marker's abort and no other.
    env.cluster.prefills[0].set_faults(Faults {
        prefill_hang: true,
        ..Faults::default()
    });
    let marker = {
        let (url, client) = (env.url("/generate"), env.client.clone());
        tokio::spawn(async move {
            let req = http::Request::post(url)
                .header("content-type", "application/json")
                .body(http_body_util::Full::new(bytes::Bytes::from_static(
                    br#"{"text":"marker"}"#,
                )))
                .unwrap();
            client.request(req).await
        })
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while env.stats().held_now < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the marker's legs never arrived"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let engines = [&env.cluster.prefills[0], &env.cluster.decodes[0]];
    let marker_rids: Vec<String> = engines
        .iter()
        .map(|e| e.recent_rids().last().cloned().unwrap())
        .collect();
    marker.abort();
    for (e, rid) in engines.iter().zip(&marker_rids) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !e.recent_abort_rids().contains(rid) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the marker's abort of {rid} never arrived: {:?}",
                e.recent_abort_rids()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(
            e.recent_abort_rids(),
            std::slice::from_ref(rid),
            "a successful request sent an abort"
        );
        assert_eq!(e.stats().abort_requests_received, 1, "{:?}", e.stats());
    }
}

/// With `return_logprob`, the prefill's input logprobs are merged into decode's answer,
/// streamed or not, per item of a batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn input_logprobs_from_the_prefill_are_merged() {
    let env = start(
        vec![EngineConfig::prefill(2)],
        vec![EngineConfig::decode(1)],
        |_| {},
    )
    .await;
    env.wait_routable(2, 1).await;
    // Non-streamed batch: each item carries its prompt's input logprobs (one per token,
    // first one null), which only the prefill computes.
    let (st, _, bytes) = env
        .post(
            "/generate",
            r#"{"input_ids":[[11,12,13],[21,22]],"sampling_params":{"max_new_tokens":2},"return_logprob":true,"logprob_start_len":0}"#,
        )
        .await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&bytes));
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    for (i, want) in [3usize, 2].iter().enumerate() {
        let lp = v[i]["meta_info"]["input_token_logprobs"]
            .as_array()
            .unwrap_or_else(|| panic!("{v}"));
        assert_eq!(lp.len(), *want, "{v}");
        assert!(lp[0][0].is_null());
        assert!(
            v[i]["meta_info"]["output_token_logprobs"]
                .as_array()
                .is_some_and(|o| o.len() == 2),
            "{v}"
        );
    }
    // Streamed: every chunk carries them.
    let (st, _, bytes) = env
        .post(
            "/generate",
            r#"{"input_ids":[5,6,7,8],"sampling_params":{"max_new_tokens":3},"return_logprob":true,"logprob_start_len":0,"stream":true}"#,
        )
        .await;
    assert_eq!(st, 200);
    let (events, done) = sse_events(&bytes);
    assert!(done && !events.is_empty());
    for e in &events {
        assert_eq!(
            e["meta_info"]["input_token_logprobs"]
                .as_array()
                .map(Vec::len),
            Some(4),
            "{e}"
        );
    }
}

/// Reads what the router sends on `s` until it closes the connection (bounded: 10 s, a
/// guard against a hang, not a timing assertion).
async fn read_until_closed(s: &mut tokio::net::TcpStream, what: &str) -> Vec<u8> {
    use tokio::io::AsyncReadExt;
    let mut out = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), async {
        let mut buf = [0u8; 4096];
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
    });
    if read.await.is_err() {
        panic!("{what}: the router never closed the connection");
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_are_cut_off_and_no_leg_is_sent() {
    use tokio::io::AsyncWriteExt;
    let env = start(
        vec![EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1)],
        |c| {
            c.server.header_read_timeout_secs = 1;
            c.server.body_read_timeout_secs = 1;
        },
    )
    .await;
    env.wait_routable(1, 1).await;
    let addr = env.addr();
    let head = "POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n";

    // A body that stops halfway: 408 `request_body_timeout` with the error JSON.
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let partial = format!("{head}content-length: 40\r\nx-request-id: slow-body\r\n\r\n{{\"text\":");
    s.write_all(partial.as_bytes()).await.unwrap();
    let answer = read_until_closed(&mut s, "a body that stops").await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("x-request-id: slow-body"), "{answer}");
    let json = &answer[answer.find("\r\n\r\n").expect("a head") + 4..];
    let v: serde_json::Value =
        serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {answer}"));
    assert_eq!(v["error"]["type"], "request_body_timeout", "{v}");
    assert_eq!(v["error"]["code"], 408, "{v}");

    // A head that stops halfway, and a connection that never sends anything: closed
    // without an answer (hyper's header read timeout).
    for sent in [head, ""] {
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        s.write_all(sent.as_bytes()).await.unwrap();
        let answer = read_until_closed(&mut s, &format!("{sent:?}")).await;
        assert!(
            answer.is_empty(),
            "{sent:?}: {}",
            String::from_utf8_lossy(&answer)
        );
    }

    // The same request sent whole, even in pieces, is served.
    let body = r#"{"text":"hello","sampling_params":{"max_new_tokens":2}}"#;
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let req = format!(
        "{head}content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let (a, b) = req.as_bytes().split_at(req.len() - 10);
    s.write_all(a).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    s.write_all(b).await.unwrap();
    let answer = read_until_closed(&mut s, "a whole request").await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

    let s = env.settled_stats().await;
    assert_eq!(
        s.requests_total, 2,
        "only the whole request reached the engines: {s:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_does_not_wait_for_connections_that_never_sent_a_byte() {
    // Clients' pools open connections they may never use. Draining must not wait for them
    // (here the drain and header deadlines are an hour: only a bug would reach them).
    let env = start(
        vec![EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1)],
        |c| {
            c.server.header_read_timeout_secs = 3600;
            c.server.drain_secs = 3600;
        },
    )
    .await;
    env.wait_routable(1, 1).await;
    let addr = env.addr();
    let mut idle = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let (status, _, _) = env
        .post(
            "/generate",
            r#"{"text":"hi","sampling_params":{"max_new_tokens":2}}"#,
        )
        .await;
    assert_eq!(status, 200);
    let drained = tokio::time::timeout(Duration::from_secs(10), env.router.server.shutdown());
    assert!(
        drained.await.is_ok(),
        "shutdown waited for an unused connection"
    );
    // The unused connection was closed by the router.
    assert!(read_until_closed(&mut idle, "the unused connection")
        .await
        .is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_clients_are_served() {
    use http_body_util::Full;
    use hyper_util::client::legacy::{connect::HttpConnector, Client};
    use hyper_util::rt::TokioExecutor;
    let env = start(
        vec![EngineConfig::prefill(2)],
        vec![EngineConfig::decode(1)],
        |c| c.server.max_body_bytes = 4096,
    )
    .await;
    env.wait_routable(2, 1).await;
    // HTTP/2 with prior knowledge (no upgrade), as gRPC-style clients and proxies speak it.
    let h2: Client<HttpConnector, Full<bytes::Bytes>> = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let post = |path: &str, body: String| {
        hyper::Request::post(env.url(path))
            .header("content-type", "application/json")
            .body(Full::new(bytes::Bytes::from(body)))
            .unwrap()
    };
    let cases = [
        ("/generate", r#"{"text":"hi","sampling_params":{"max_new_tokens":3}}"#.to_string(), 200, None),
        ("/v1/chat/completions", r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":3,"stream":true}"#.to_string(), 200, None),
        ("/generate", "not json".to_string(), 400, Some("invalid_request")),
        ("/generate", format!(r#"{{"text":"{}"}}"#, "x".repeat(5000)), 413, Some("payload_too_large")),
    ];
    for (path, body, status, kind) in cases {
        let resp = h2.request(post(path, body)).await.expect("an h2 answer");
        assert_eq!(resp.version(), http::Version::HTTP_2);
        assert_eq!(resp.status().as_u16(), status, "{path}");
        assert!(resp.headers().contains_key("x-request-id"));
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        match kind {
            Some(kind) => {
                let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
                assert_eq!(v["error"]["type"], kind, "{v}");
            }
            None if path == "/generate" => {
                let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
                assert!(v["text"].is_string(), "{v}");
            }
            None => {
                let (events, done) = sse_events(&bytes);
                assert!(
                    done && !events.is_empty(),
                    "{}",
                    String::from_utf8_lossy(&bytes)
                );
            }
        }
    }
    // Two legs per good request, none for the bad ones.
    let s = env.settled_stats().await;
    assert_eq!(s.requests_total, 4, "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_allow_listed_headers_reach_the_engines() {
    let client_headers = [
        ("content-type", "application/json"),
        ("x-request-id", "trace-me-1"),
        (
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ),
        ("tracestate", "vendor=opaque"),
        ("authorization", "Bearer client-secret"),
        ("cookie", "session=abc"),
        ("x-forwarded-for", "10.0.0.9"),
        ("x-custom", "1"),
        ("x-data-parallel-rank", "7"),
    ];
    // (forward_authorization, api_key, the authorization the engines must see)
    let setups = [
        (false, None, None),
        (true, None, Some("Bearer client-secret")),
        (true, Some("engine-key"), Some("Bearer engine-key")),
    ];
    for (forward, key, want_auth) in setups {
        let env = start(
            vec![EngineConfig::prefill(1)],
            vec![EngineConfig::decode(1)],
            |c| {
                c.upstream.forward_authorization = forward;
                c.upstream.api_key = key.map(str::to_string);
            },
        )
        .await;
        env.wait_routable(1, 1).await;
        let body = r#"{"text":"hi","sampling_params":{"max_new_tokens":2}}"#;
        let resp = env.send("POST", "/generate", &client_headers, body).await;
        assert_eq!(resp.status(), 200);
        let _ = resp.into_body().collect().await;
        for e in env.cluster.prefills.iter().chain(&env.cluster.decodes) {
            let seen = e.last_generate_headers();
            let get = |name: &str| {
                seen.iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v.as_str())
            };
            assert_eq!(get("x-request-id"), Some("trace-me-1"), "{seen:?}");
            assert_eq!(get("traceparent"), Some(client_headers[2].1), "{seen:?}");
            assert_eq!(get("tracestate"), Some("vendor=opaque"), "{seen:?}");
            assert_eq!(get("authorization"), want_auth, "{seen:?}");
            // Nothing else of the client's: no cookie, no spoofed DP rank, no custom header.
            for (k, _) in &seen {
                assert!(
                    [
                        "host",
                        "content-type",
                        "content-length",
                        "x-request-id",
                        "traceparent",
                        "tracestate",
                        "authorization"
                    ]
                    .contains(&k.as_str()),
                    "{k} reached an engine: {seen:?}"
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_held_whole_are_bounded_by_max_answer_bytes() {
    let env = start(
        vec![EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1)],
        |c| c.upstream.max_answer_bytes = 2048,
    )
    .await;
    env.wait_routable(1, 1).await;
    // A non-streamed answer whose logprobs are merged is read whole: 200 tokens with their
    // logprobs are over 2 KiB, so the decode leg counts as broken (and is aborted).
    let (st, _, bytes) = env
        .post(
            "/generate",
            r#"{"text":"hi","sampling_params":{"max_new_tokens":200},"return_logprob":true,"logprob_start_len":0}"#,
        )
        .await;
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(st, 502, "{v}");
    assert_eq!(v["error"]["type"], "decode_broken", "{v}");
    let s = env.settled_stats().await;
    assert_eq!(s.held_now, 0, "{s:?}");
    // The same answer without logprobs to merge is streamed through, not held: it passes,
    // and so does a long stream of events each under the bound.
    let (st, _, bytes) = env
        .post(
            "/generate",
            r#"{"text":"hi","sampling_params":{"max_new_tokens":200}}"#,
        )
        .await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&bytes));
    let (st, _, bytes) = env
        .post(
            "/v1/chat/completions",
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":200,"stream":true}"#,
        )
        .await;
    assert_eq!(st, 200);
    let (events, done) = sse_events(&bytes);
    assert!(done && events.len() > 100, "{}", events.len());
    assert!(events.iter().all(|e| e.get("error").is_none()));
}
