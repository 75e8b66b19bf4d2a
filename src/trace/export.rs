//! The exporter: one task that takes finished spans from the bounded queue, batches them
//! (`trace.max_batch_spans`, or whatever waited `trace.export_interval_ms`) and POSTs each
//! batch to `<endpoint>/v1/traces` as OTLP JSON.
//!
//! Invariants:
//! - One export request at a time, bounded by `trace.export_timeout_ms`; a batch that
//!   failed (no answer, a non-2xx status, a timeout) is dropped and counted
//!   (`pdgate_trace_spans_dropped_total{why="export_failed"}`), never retried: while the
//!   collector is down, spans cost one failed request per batch, and the queue (bounded)
//!   drops the rest.
//! - [`Exporter::shutdown`] sends what is queued once more and returns within the export
//!   timeout (plus a second): a drain never waits on a dead collector.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Request};
use http_body_util::Full;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use tokio::sync::{mpsc, Notify};
use tokio::task::JoinHandle;

use super::otlp::{encode, SpanData};
use super::{TraceStats, Tracer};
use crate::config::TraceConfig;
use crate::telemetry;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// The running exporter task; [`Exporter::shutdown`] flushes it.
pub struct Exporter {
    stop: Arc<Notify>,
    task: Mutex<Option<JoinHandle<()>>>,
    timeout: Duration,
    stats: Arc<TraceStats>,
}

/// Starts the exporter task (on the current runtime) and returns the tracer that feeds it.
pub fn start(cfg: &TraceConfig) -> (Tracer, Exporter) {
    let (tx, rx) = mpsc::channel(cfg.max_queue_spans);
    let stats = Arc::new(TraceStats::default());
    let stop = Arc::new(Notify::new());
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(cfg.export_timeout()));
    connector.set_nodelay(true);
    let client = Client::builder(TokioExecutor::new()).build(connector);
    let run = Run {
        client,
        url: cfg.traces_url(),
        service: cfg.service_name.clone(),
        max_batch: cfg.max_batch_spans,
        interval: cfg.export_interval(),
        timeout: cfg.export_timeout(),
        stats: stats.clone(),
        failing: false,
    };
    let task = tokio::spawn(run.run(rx, stop.clone()));
    tracing::info!(endpoint = %cfg.traces_url(), sample_ratio = cfg.sample_ratio, "exporting OTLP traces");
    (
        Tracer::new(tx, cfg.sample_ratio, stats.clone()),
        Exporter {
            stop,
            task: Mutex::new(Some(task)),
            timeout: cfg.export_timeout(),
            stats,
        },
    )
}

impl Exporter {
    /// Sends what is queued, then stops; returns within the export timeout (plus a second).
    pub async fn shutdown(&self) {
        self.stop.notify_one();
        let task = self.task.lock().ok().and_then(|mut t| t.take());
        if let Some(mut task) = task {
            let within = self.timeout + Duration::from_secs(1);
            if tokio::time::timeout(within, &mut task).await.is_err() {
                task.abort();
            }
        }
    }

    pub fn stats(&self) -> &TraceStats {
        &self.stats
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        if let Ok(mut t) = self.task.lock() {
            if let Some(task) = t.take() {
                task.abort();
            }
        }
    }
}

struct Run {
    client: HttpClient,
    url: String,
    service: String,
    max_batch: usize,
    interval: Duration,
    timeout: Duration,
    stats: Arc<TraceStats>,
    /// The last export failed (its warning was logged; the next is logged on recovery).
    failing: bool,
}

impl Run {
    async fn run(mut self, mut rx: mpsc::Receiver<SpanData>, stop: Arc<Notify>) {
        let mut batch: Vec<SpanData> = Vec::with_capacity(self.max_batch);
        // The first tick one interval from now, not at once: a task first polled after
        // spans were queued would otherwise send them before their interval had passed.
        let start = tokio::time::Instant::now() + self.interval;
        let mut tick = tokio::time::interval_at(start, self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let room = self.max_batch - batch.len();
            tokio::select! {
                n = rx.recv_many(&mut batch, room) => {
                    if n == 0 {
                        break;
                    }
                    if batch.len() >= self.max_batch {
                        self.export(&mut batch).await;
                    }
                }
                _ = tick.tick() => {
                    if !batch.is_empty() {
                        self.export(&mut batch).await;
                    }
                }
                _ = stop.notified() => break,
            }
        }
        // The last flush: what waits in the queue now, in batches.
        while let Ok(s) = rx.try_recv() {
            batch.push(s);
            if batch.len() >= self.max_batch {
                self.export(&mut batch).await;
            }
        }
        if !batch.is_empty() {
            self.export(&mut batch).await;
        }
    }

    async fn export(&mut self, batch: &mut Vec<SpanData>) {
        let n = batch.len() as u64;
        let body = encode(&self.service, batch);
        batch.clear();
        let req = Request::builder()
            .method(Method::POST)
            .uri(self.url.as_str())
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)));
        let Ok(req) = req else {
            return self.failed(n, "the export request could not be built".into());
        };
        let sent = tokio::time::timeout(self.timeout, async {
            let resp = self.client.request(req).await?;
            let status = resp.status();
            // The answer is read (and dropped) so the connection can be kept.
            let _ = http_body_util::BodyExt::collect(resp.into_body()).await;
            Ok::<_, hyper_util::client::legacy::Error>(status)
        })
        .await;
        match sent {
            Ok(Ok(s)) if s.is_success() => {
                self.stats.exported.fetch_add(n, Ordering::Relaxed);
                metrics::counter!(telemetry::TRACE_SPANS_EXPORTED).increment(n);
                if self.failing {
                    self.failing = false;
                    tracing::info!(url = %self.url, "trace export works again");
                }
            }
            Ok(Ok(s)) => self.failed(n, format!("the collector answered {s}")),
            Ok(Err(e)) => self.failed(n, chain(&e)),
            Err(_) => self.failed(n, format!("no answer within {:?}", self.timeout)),
        }
    }

    fn failed(&mut self, n: u64, why: String) {
        self.stats.dropped.fetch_add(n, Ordering::Relaxed);
        metrics::counter!(telemetry::TRACE_SPANS_DROPPED, "why" => "export_failed").increment(n);
        if !self.failing {
            self.failing = true;
            tracing::warn!(url = %self.url, error = %why, spans = n, "trace export failed; spans are dropped until it works again");
        }
    }
}

/// An error and its causes, on one line.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}
