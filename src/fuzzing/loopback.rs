//! Fuzz targets whose parser reads from a socket: the leg client's HTTP/1.1 answer framing
//! and the bootstrap API's answers. Each input is served by a small fake engine on
//! 127.0.0.1 to the production client, called through its public API, on a
//! current-thread runtime kept per thread (one listener each, bound once).
//!
//! Every call is bounded: a fake engine sends what the input says and closes (legs) or
//! answers every request the same way (bootstrap calls), so nothing here can wait for
//! more than its timeout; a leg that outlives [`LEG_DEADLINE`] is a hang, and a panic.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::runtime::Runtime;

use crate::bootstrap::client::{self as bootstrap_client, Generation};
use crate::upstream::{parse_base_url, BaseUrl, HostConns, LegRequest, Upstream, UpstreamSettings};

/// The longest one leg may take here (a fake engine answers at once and closes).
const LEG_DEADLINE: Duration = Duration::from_secs(10);
/// The timeout of one bootstrap call.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

struct Loop {
    rt: Runtime,
    up: Upstream,
    /// The fake engine of `leg_answer` (one connection per input).
    legs: TcpListener,
    legs_url: BaseUrl,
    /// The fake bootstrap server's answer to every request: status and body.
    answer: Arc<Mutex<(u16, Vec<u8>)>>,
    calls_url: BaseUrl,
}

thread_local! {
    static LOOP: Loop = Loop::new();
}

impl Loop {
    fn new() -> Loop {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime for the fuzz loopback");
        let answer = Arc::new(Mutex::new((200, Vec::new())));
        let (legs, legs_url, calls_url) = rt.block_on(async {
            let legs = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let calls = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let url = |l: &TcpListener| {
                let port = l.local_addr().map(|a| a.port()).unwrap_or(0);
                parse_base_url(&format!("http://127.0.0.1:{port}")).expect("a loopback URL")
            };
            let (legs_url, calls_url) = (url(&legs), url(&calls));
            tokio::spawn(serve_calls(calls, answer.clone()));
            (legs, legs_url, calls_url)
        });
        let up = Upstream::new(&UpstreamSettings {
            connect_timeout: Duration::from_secs(2),
            pool_max_idle_per_host: 4,
            pool_idle_timeout: Duration::from_secs(30),
            api_key: None,
            forward_authorization: false,
        });
        Loop {
            rt,
            up,
            legs,
            legs_url,
            answer,
            calls_url,
        }
    }
}

/// The fake bootstrap server: every request (a GET, no body) on every kept-alive
/// connection gets the current answer, with its Content-Length.
async fn serve_calls(l: TcpListener, answer: Arc<Mutex<(u16, Vec<u8>)>>) {
    while let Ok((mut s, _)) = l.accept().await {
        let answer = answer.clone();
        let _ = s.set_nodelay(true);
        tokio::spawn(async move {
            let mut buf = Vec::new();
            let mut chunk = [0u8; 1024];
            loop {
                let Some(end) = memchr::memmem::find(&buf, b"\r\n\r\n") else {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                    continue;
                };
                buf.drain(..end + 4);
                let (status, body) = answer.lock().map(|a| a.clone()).unwrap_or_default();
                // One write: a head and a body in two would wait on Nagle and delayed ACKs.
                let mut out = format!(
                    "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                    body.len()
                )
                .into_bytes();
                out.extend_from_slice(&body);
                if s.write_all(&out).await.is_err() {
                    return;
                }
            }
        });
    }
}

/// A leg's answer, as raw bytes from the engine, through the leg client
/// (`upstream::leg`: `httparse` head, 1xx skipping, Content-Length, chunked or EOF
/// framing). The first byte is the size of the pieces the answer is written in (0: whole);
/// the engine reads the request, writes the rest of the input and closes. The body must
/// end or fail within the deadline, never yield more bytes than the engine sent after
/// the head, and say it ended when it did.
pub fn leg_answer(data: &[u8]) {
    let Some((&sel, answer)) = data.split_first() else {
        return;
    };
    let piece = if sel == 0 {
        answer.len().max(1)
    } else {
        usize::from(sel)
    };
    LOOP.with(|lp| {
        lp.rt.block_on(async {
            let host = Arc::new(HostConns::new(&lp.legs_url));
            let req = LegRequest::post_json(&host, "/generate", b"{\"text\":\"a\"}".to_vec(), b"");
            let want = req.head.len() + req.body.len();
            let engine = async {
                let Ok((mut s, _)) = lp.legs.accept().await else {
                    return;
                };
                // Each piece goes out at once (no Nagle wait behind a delayed ACK).
                let _ = s.set_nodelay(true);
                let mut got = vec![0u8; want];
                if s.read_exact(&mut got).await.is_err() {
                    return;
                }
                for p in answer.chunks(piece) {
                    if s.write_all(p).await.is_err() {
                        return;
                    }
                    // Let the client read this piece before the next one arrives.
                    tokio::task::yield_now().await;
                }
                let _ = s.shutdown().await;
                // Hold the socket until the client is done, so that it sees an EOF, not a
                // reset.
                let mut rest = [0u8; 64];
                while matches!(s.read(&mut rest).await, Ok(n) if n > 0) {}
            };
            let client = async {
                let Ok(resp) = lp.up.send_leg(&host, &req).await else {
                    host.sweep(Duration::ZERO);
                    return;
                };
                let mut body = resp.into_body();
                let mut total = 0usize;
                loop {
                    match body.frame().await {
                        Some(Ok(f)) => {
                            total += f.data_ref().map_or(0, |d| d.len());
                            assert!(
                                total <= answer.len(),
                                "the body yielded {total} bytes of an answer of {}",
                                answer.len()
                            );
                        }
                        Some(Err(_)) => break,
                        None => {
                            assert!(
                                hyper::body::Body::is_end_stream(&body),
                                "ended without saying so"
                            );
                            break;
                        }
                    }
                }
                // Close the connection, kept alive or not, so that the engine sees EOF.
                drop(body);
                host.sweep(Duration::ZERO);
            };
            let both = async { tokio::join!(engine, client) };
            if tokio::time::timeout(LEG_DEADLINE, both).await.is_err() {
                panic!("a leg did not end within {LEG_DEADLINE:?}");
            }
        });
    });
}

const STATUSES: [u16; 6] = [200, 503, 404, 500, 400, 200];

/// A bootstrap or engine-info answer (`bootstrap::client`): `[call] [status] body`; the
/// call byte picks the sentinel query (of a given generation or newest-first), a rank's
/// route, the bootstrap health check or `/server_info`, and the status byte one of
/// [`STATUSES`]. The fake server gives that answer to every request of the call.
pub fn bootstrap(data: &[u8]) {
    let [call, status, body @ ..] = data else {
        return;
    };
    let status = STATUSES[usize::from(*status) % STATUSES.len()];
    LOOP.with(|lp| {
        if let Ok(mut a) = lp.answer.lock() {
            *a = (status, body.to_vec());
        }
        let (up, url) = (&lp.up, &lp.calls_url);
        lp.rt.block_on(async {
            let gens = [Generation::V3, Generation::V2, Generation::V1];
            match call % 8 {
                0 => {
                    let _ = bootstrap_client::sentinel(up, url, None, CALL_TIMEOUT).await;
                }
                c @ 1..=3 => {
                    let g = gens[usize::from(c - 1)];
                    if let Ok(bootstrap_client::Sentinel::Ready(l)) =
                        bootstrap_client::sentinel(up, url, Some(g), CALL_TIMEOUT).await
                    {
                        assert!((1..=bootstrap_client::MAX_DP_SIZE).contains(&l.dp_size));
                    }
                }
                c @ 4..=6 => {
                    let g = gens[usize::from(c - 4)];
                    let rank = u32::from(call >> 3);
                    let _ = bootstrap_client::rank_route(up, url, g, rank, CALL_TIMEOUT).await;
                }
                _ => {
                    let _ = bootstrap_client::health(up, url, CALL_TIMEOUT).await;
                    let _ = bootstrap_client::server_info(up, url, CALL_TIMEOUT).await;
                }
            }
        });
    });
}
