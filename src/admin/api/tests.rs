//! Tests of the admin API's own parsing: query strings (percent-decoded) and its route table.
use super::*;

#[test]
fn query_components_are_decoded() {
    let q = query(Some(
        "url=http%3A%2F%2Fh%3A1&worker_type=prefill&x=a+b&url=second&flag",
    ))
    .unwrap_or_default();
    assert_eq!(q["url"], "http://h:1", "the first of a name wins");
    assert_eq!(q["worker_type"], "prefill");
    assert_eq!(q["x"], "a b");
    assert_eq!(q["flag"], "");
    assert!(query(Some("url=%zz")).is_err());
    assert!(query(Some("url=%e2%82")).is_err(), "not UTF-8");
}

#[test]
fn routes_and_their_methods() {
    let table = [
        ("/metrics", true),
        ("/liveness", true),
        ("/readiness", true),
        ("/workers", true),
        ("/workers/", true),
        ("/workers/prefill-1", true),
        ("/workers/prefill-1/drain", true),
        ("/workers/prefill-1/undrain", true),
        ("/workers/prefill-1/other", false),
        ("/config", true),
        ("/add_worker", true),
        ("/remove_worker", true),
        ("/list_workers", true),
        ("/", false),
        ("/generate", false),
    ];
    for (p, known) in table {
        assert_eq!(route(p).is_some(), known, "{p}");
    }
}
