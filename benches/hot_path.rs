//! The pure parts of the request path, one by one: parsing a client body, writing a leg,
//! drawing rooms, and scanning a decode SSE chunk.
//!
//! Run: `cargo bench --bench hot_path` (`PDGATE_BENCH_QUICK=1` for a smoke run).

use std::hint::black_box;
use std::time::Duration;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use pdgate::dispatch::attempt::room::assign;
use pdgate::relay::sse::{Scan, SseScanner};
use pdgate::request::{parse, ApiRoute, LegFields};

const CHAT: &str = r#"{"model":"sim-model","messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"What is the capital of France?"}],"max_tokens":64,"temperature":0.7,"stream":true}"#;

/// A `/generate` body of about 4 KB: a long text prompt plus sampling parameters.
fn generate_4k() -> String {
    let sentence = "The quick brown fox jumps over the lazy dog, and then it runs far away. ";
    let mut text = String::new();
    while text.len() < 3900 {
        text.push_str(sentence);
    }
    format!(
        r#"{{"text":"{text}","sampling_params":{{"max_new_tokens":128,"temperature":0.6,"top_p":0.95,"stop":["\n\n"]}},"stream":false,"return_logprob":false}}"#
    )
}

/// A batch of 8 prompts with `n = 2` (16 instances, so 16 rooms).
fn batch() -> String {
    let prompts: Vec<String> = (0..8)
        .map(|i| format!("\"prompt number {i}: tell me a story\""))
        .collect();
    format!(
        r#"{{"text":[{}],"sampling_params":{{"max_new_tokens":32,"n":2}}}}"#,
        prompts.join(",")
    )
}

/// One decode SSE chunk as SGLang sends it for a chat stream (a whole event).
const SSE_CHUNK: &[u8] = b"data: {\"id\":\"2a1d8c0b6b6c4e0f9d2a3b4c5d6e7f80\",\"object\":\"chat.completion.chunk\",\"created\":1760000000,\"model\":\"sim-model\",\"choices\":[{\"index\":0,\"delta\":{\"role\":null,\"content\":\" Paris\",\"reasoning_content\":null,\"tool_calls\":null},\"logprobs\":null,\"finish_reason\":null,\"matched_stop\":null}],\"usage\":null}\n\n";

fn config() -> Criterion {
    let quick = std::env::var("PDGATE_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
    let c = Criterion::default().without_plots();
    if quick {
        c.measurement_time(Duration::from_millis(300))
            .warm_up_time(Duration::from_millis(100))
            .sample_size(10)
    } else {
        c.measurement_time(Duration::from_secs(2))
            .warm_up_time(Duration::from_millis(500))
            .sample_size(30)
    }
}

/// The request bodies the parse and leg-writing benches run on.
fn bodies() -> [(&'static str, ApiRoute, Bytes); 3] {
    [
        (
            "chat_small",
            ApiRoute::ChatCompletions,
            Bytes::from_static(CHAT.as_bytes()),
        ),
        (
            "generate_4k",
            ApiRoute::Generate,
            Bytes::from(generate_4k()),
        ),
        (
            "generate_batch8_n2",
            ApiRoute::Generate,
            Bytes::from(batch()),
        ),
    ]
}

/// The pdgate fields of a leg as the benches write them.
fn fields<'a>(rooms: &'a [u64], rid: &'a str, stream: bool) -> LegFields<'a> {
    LegFields {
        host_json: "\"10.0.0.17\"",
        port: 8998,
        rooms,
        rid,
        routed_dp_rank: None,
        disagg_prefill_dp_rank: Some(3),
        stream,
    }
}

fn bench_parse(c: &mut Criterion) {
    let mut g = c.benchmark_group("parse");
    for (name, route, body) in bodies() {
        g.throughput(Throughput::Bytes(body.len() as u64));
        g.bench_function(name, |b| {
            b.iter(|| parse(route, black_box(body.clone())).expect("valid body"))
        });
    }
    g.finish();
}

fn bench_write_leg(c: &mut Criterion) {
    let mut g = c.benchmark_group("write_leg");
    for (name, route, body) in bodies() {
        let req = parse(route, body).expect("valid body");
        let rooms: Vec<u64> = (0..req.instances() as u64)
            .map(|i| 4_611_686_018_427_387_904 + 8 * i)
            .collect();
        let mut out = Vec::new();
        g.bench_function(name, |b| {
            b.iter(|| {
                req.write_leg(
                    &mut out,
                    &fields(black_box(&rooms), "pdg-0123456789abcdef-00d", true),
                );
                black_box(out.len())
            })
        });
        // Both legs written one by one into fresh buffers (what the request path did).
        g.bench_function(format!("{name}_two_fresh_legs"), |b| {
            b.iter(|| {
                let leg = |rid, stream| fields(black_box(&rooms), rid, stream);
                let (mut p, mut d) = (Vec::new(), Vec::new());
                req.write_leg(&mut p, &leg("pdg-0123456789abcdef-00p", false));
                req.write_leg(&mut d, &leg("pdg-0123456789abcdef-00d", true));
                black_box(p.len() + d.len())
            })
        });
        // Both legs of one attempt, as the request path writes them.
        g.bench_function(format!("{name}_both_legs"), |b| {
            b.iter(|| {
                let leg = |rid, stream| fields(black_box(&rooms), rid, stream);
                let (p, d) = req.write_legs(
                    &leg("pdg-0123456789abcdef-00p", false),
                    &leg("pdg-0123456789abcdef-00d", true),
                );
                black_box(p.len() + d.len())
            })
        });
    }
    g.finish();
}

fn bench_rooms(c: &mut Criterion) {
    let mut g = c.benchmark_group("room_assign");
    let mut out = Vec::new();
    for (name, dp, count) in [("single_dp8", 8u32, 1usize), ("batch16_dp8", 8, 16)] {
        g.bench_function(name, |b| {
            let mut rng = rand::rng();
            b.iter(|| {
                assign(&mut rng, black_box(dp), 3, black_box(count), &mut out);
                black_box(out.len())
            })
        });
    }
    g.finish();
}

fn bench_sse(c: &mut Criterion) {
    let mut g = c.benchmark_group("sse_push");
    g.throughput(Throughput::Bytes(SSE_CHUNK.len() as u64));
    g.bench_function("whole_event", |b| {
        let mut s = SseScanner::new(
            None,
            pdgate::config::UpstreamConfig::default().max_answer_bytes,
        );
        let chunk = Bytes::from_static(SSE_CHUNK);
        b.iter(|| match s.push(black_box(chunk.clone())) {
            Scan::Forward(b) => black_box(b.len()),
            _ => unreachable!("no abort in the chunk"),
        })
    });
    // The same event split in two reads (the tail is carried over).
    g.bench_function("event_split_in_two", |b| {
        let (a, rest) = SSE_CHUNK.split_at(SSE_CHUNK.len() / 2);
        let (a, rest) = (Bytes::from_static(a), Bytes::from_static(rest));
        b.iter_batched(
            || {
                SseScanner::new(
                    None,
                    pdgate::config::UpstreamConfig::default().max_answer_bytes,
                )
            },
            |mut s| {
                let _ = s.push(a.clone());
                match s.push(rest.clone()) {
                    Scan::Forward(b) => black_box(b.len()),
                    _ => unreachable!("no abort in the chunk"),
                }
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

/// A continuable stream's per-event cost after the scanner: pdgate's account of what was
/// sent (`relay::splice`). A chat chunk with the per-chunk usage pdgate asked for (parsed, and
/// the usage cut out for the client), and a cumulative `/generate` event (only kept).
fn bench_tracked(c: &mut Criterion) {
    use pdgate::relay::splice::{GenerateMode, Tracker};
    use pdgate::request::continuation::Plan;
    let mut g = c.benchmark_group("stream_account");
    let plan = |route| Plan {
        route,
        limit: Some(1 << 40),
        uses_ids: false,
        client_usage: false,
        client_continuous_usage: false,
    };
    let chat: &[u8] = b"data: {\"id\":\"2a1d8c0b6b6c4e0f9d2a3b4c5d6e7f80\",\"object\":\"chat.completion.chunk\",\"created\":1760000000,\"model\":\"sim-model\",\"choices\":[{\"index\":0,\"delta\":{\"role\":null,\"content\":\" Paris\",\"reasoning_content\":null,\"tool_calls\":null},\"logprobs\":null,\"finish_reason\":null,\"matched_stop\":null}],\"usage\":{\"prompt_tokens\":20,\"completion_tokens\":7,\"total_tokens\":27}}\n\n";
    g.throughput(Throughput::Bytes(chat.len() as u64));
    g.bench_function("chat_event_usage_cut", |b| {
        let mut t = Tracker::new(plan(ApiRoute::ChatCompletions), GenerateMode::Cumulative);
        let chunk = Bytes::from_static(chat);
        b.iter(|| black_box(t.relay(black_box(chunk.clone())).map_or(0, |o| o.len())))
    });
    let text = " word".repeat(200);
    let gen = Bytes::from(format!(
        "data: {{\"text\":\"{text}\",\"output_ids\":[{}],\"meta_info\":{{\"id\":\"x\",\"finish_reason\":null,\"prompt_tokens\":9,\"completion_tokens\":200}}}}\n\n",
        vec!["1234"; 200].join(",")
    ));
    g.throughput(Throughput::Bytes(gen.len() as u64));
    g.bench_function("generate_cumulative_event", |b| {
        let mut t = Tracker::new(plan(ApiRoute::Generate), GenerateMode::Cumulative);
        b.iter(|| black_box(t.relay(black_box(gen.clone())).map_or(0, |o| o.len())))
    });
    g.finish();
}

/// Reading a prefill answer's input logprobs (`relay::logprobs`): an 8,000-token prompt's
/// `input_token_logprobs` (about 150 KB), found and kept as byte ranges of the answer.
fn bench_prefill_logprobs(c: &mut Criterion) {
    use pdgate::memory::Charge;
    use pdgate::relay::logprobs::PrefillLogprobs;
    let entries: Vec<String> = (0..8000)
        .map(|i| format!("[-{}.{:03},{},null]", i % 7, i % 1000, 1000 + i))
        .collect();
    let answer = Bytes::from(format!(
        "{{\"text\":\"\",\"meta_info\":{{\"id\":\"x\",\"prompt_tokens\":8000,\"input_token_logprobs\":[{}],\"output_token_logprobs\":[],\"finish_reason\":{{\"type\":\"length\",\"length\":1}}}}}}",
        entries.join(",")
    ));
    let mut g = c.benchmark_group("prefill_logprobs");
    g.throughput(Throughput::Bytes(answer.len() as u64));
    g.bench_function("read_8000_token_prompt", |b| {
        b.iter(|| {
            black_box(
                PrefillLogprobs::from_prefill_body(black_box(&answer), Charge::none()).bytes(),
            )
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = config();
    targets = bench_parse, bench_write_leg, bench_rooms, bench_sse, bench_tracked, bench_prefill_logprobs
}
criterion_main!(benches);
