//! A failed attempt's log line names the worker it blames (id and URL), at WARN.

use pdgate_sim::{EngineConfig, Faults};

use crate::support::common::{start, with_faults, Captured, GEN};

/// Every task logs into this test's subscriber, on whichever thread it runs
/// (`support::rt::set_default`).
#[tokio::test(crate = "crate::support::rt")]
async fn a_failed_attempt_names_its_worker() {
    let buf = Captured::default();
    let sink = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_ansi(false)
        .with_writer(move || sink.clone())
        .finish();
    let _guard = crate::support::rt::set_default(subscriber);
    let failing = with_faults(
        EngineConfig::prefill(1),
        Faults {
            prefill_status: Some(500),
            ..Faults::default()
        },
    );
    let env = start(
        vec![failing, EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1)],
        |_| {},
    )
    .await;
    env.wait_routable(2, 1).await;
    let bad = env.cluster.prefills[0].url();
    let bad_hostport = bad.trim_start_matches("http://").to_string();
    for _ in 0..4 {
        let (st, _, _) = env.post("/generate", GEN).await;
        assert_eq!(st, 200);
    }
    let text =
        String::from_utf8_lossy(&buf.0.lock().map(|v| v.clone()).unwrap_or_default()).to_string();
    let line = text
        .lines()
        .find(|l| l.contains("attempt failed"))
        .unwrap_or_else(|| panic!("no failed attempt logged:\n{text}"));
    assert!(line.contains("WARN"), "{line}");
    assert!(line.contains(&bad_hostport), "{line}");
    assert!(
        line.contains("role=\"prefill\"") && line.contains("worker_id=prefill-0"),
        "{line}"
    );
}
