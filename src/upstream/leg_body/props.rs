//! Property tests of the body decoder: chunked and content-length bodies in many spellings,
//! read in arbitrary pieces, well-formed, corrupted and cut short. Included from
//! `leg_body.rs` under `cfg(test)`.
//!
//! A body is driven by hand: it owns a real (loopback) connection whose engine end stays
//! silent, and each "read" is the test putting the next piece into the body's buffer when
//! the body has nothing left to do (`poll_frame` is pending), which is exactly what a read
//! from the socket does there. So the read boundaries are the generated ones. One property
//! sends over the socket itself, with EOFs.
use crate::test_cuts::{arb_cuts, pieces};
use std::net::TcpListener;
use std::task::Waker;
use std::time::Duration;

use super::*;
use http_body_util::BodyExt;
use proptest::prelude::*;
use proptest::sample::Index;
use tokio::io::AsyncWriteExt;
use tokio::runtime::Runtime;

thread_local! {
    /// A runtime for the sockets (never driven by the hand-driven bodies), and a listener
    /// the engine ends come from.
    static NET: (Runtime, TcpListener) = (
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap(),
        TcpListener::bind("127.0.0.1:0").unwrap(),
    );
}

/// Runs `f` in the test runtime with a fresh connection: the leg's end, and the engine's
/// end (open until `f` returns, unless `f` closes it).
fn with_conn<T>(f: impl FnOnce(&Runtime, TcpStream, std::net::TcpStream) -> T) -> T {
    NET.with(|(rt, listener)| {
        let _in = rt.enter();
        let leg = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (engine, _) = listener.accept().unwrap();
        leg.set_nonblocking(true).unwrap();
        let leg = TcpStream::from_std(leg).unwrap();
        f(rt, leg, engine)
    })
}

/// A worker's idle list to hand connections back to (nothing listens there).
fn host() -> (Arc<HostConns>, LegSettings) {
    let url = super::super::parse_base_url("http://127.0.0.1:9").unwrap();
    let s = LegSettings {
        connect_timeout: Duration::from_secs(1),
        max_idle: 4,
        idle_timeout: Duration::from_secs(600),
    };
    (Arc::new(HostConns::new(&url)), s)
}

#[derive(Debug, PartialEq, Eq)]
enum End {
    /// The body ended (`None`) with no error.
    Clean,
    Error(String),
    /// Pending with nothing more to read.
    Stalled,
}

#[derive(Debug)]
struct Run {
    data: Vec<u8>,
    end: End,
    /// Whether the connection went back to the idle list.
    reused: bool,
}

/// Reads a body whose bytes come as `parts`: the first read together with the head, each
/// next one when the body asks for more. `body_len` is the body's decoded length and `end`
/// where it ends in the stream; what must hold at every step is checked on the way.
fn drive(
    framing: Framing,
    parts: &[&[u8]],
    body_len: usize,
    end: usize,
) -> Result<Run, TestCaseError> {
    let length = match framing {
        Framing::Length(n) => Some(n),
        _ => None,
    };
    with_conn(|_, leg, _engine| {
        let (host, s) = host();
        let first = BytesMut::from(parts.first().copied().unwrap_or_default());
        let mut body = LegBody::new(leg, first, framing, Some((host.clone(), s)));
        let mut delivered = parts.first().map_or(0, |p| p.len());
        let mut next = 1;
        let mut data = Vec::new();
        let mut cx = Context::from_waker(Waker::noop());
        let end_state = loop {
            if let Some(n) = length {
                prop_assert_eq!(body.size_hint().exact(), Some(n - data.len() as u64));
            }
            match Pin::new(&mut body).poll_frame(&mut cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    let Ok(d) = frame.into_data() else {
                        return Err(TestCaseError::fail("a frame that is not data"));
                    };
                    prop_assert!(!d.is_empty(), "an empty data frame");
                    data.extend_from_slice(&d);
                    prop_assert!(data.len() <= body_len, "more data than the body has");
                    if data.len() == body_len {
                        // The end is known with the last data once its bytes were read.
                        prop_assert_eq!(body.is_end_stream(), delivered >= end);
                    }
                }
                Poll::Ready(Some(Err(e))) => break End::Error(e.to_string()),
                Poll::Ready(None) => {
                    prop_assert!(body.is_end_stream());
                    break End::Clean;
                }
                Poll::Pending => match parts.get(next) {
                    Some(p) => {
                        body.buf.extend_from_slice(p);
                        delivered += p.len();
                        next += 1;
                    }
                    None => break End::Stalled,
                },
            }
        };
        if end_state != End::Stalled {
            // Fused: nothing more after the end or an error.
            prop_assert!(matches!(
                Pin::new(&mut body).poll_frame(&mut cx),
                Poll::Ready(None)
            ));
        }
        Ok(Run {
            data,
            end: end_state,
            reused: host.idle_count() == 1,
        })
    })
}

/// Whether a read ends exactly at `at` (the connection can then be handed back).
fn read_ends_at(parts: &[&[u8]], at: usize) -> bool {
    let mut upto = 0;
    parts.iter().any(|p| {
        upto += p.len();
        upto == at
    })
}

/// How one chunk-size line is spelled.
#[derive(Clone, Debug)]
struct Spelling {
    upper: bool,
    zeros: usize,
    ext: &'static str,
    lf_only: bool,
}

fn arb_spelling() -> impl Strategy<Value = Spelling> {
    (
        any::<bool>(),
        prop_oneof![3 => Just(0usize), 1 => 1usize..5],
        prop::sample::select(vec![
            "",
            "",
            "",
            ";a=b",
            ";name",
            " ;a=b",
            ";q=\"x;y\"",
            ";a=b;c",
            "; a = \"\"",
        ]),
        prop::bool::weighted(0.1),
    )
        .prop_map(|(upper, zeros, ext, lf_only)| Spelling {
            upper,
            zeros,
            ext,
            lf_only,
        })
}

/// How a chunked stream is broken.
#[derive(Clone, Debug)]
enum Bad {
    /// A byte that is neither a hex digit nor whitespace put into a size.
    Digit(u8, Index),
    /// A size written with this many digits (more than 15).
    TooLong(usize),
    /// A size line with no digits (only this).
    Empty(&'static str),
    /// The CRLF after a chunk's data replaced by this.
    DataEnd(&'static str),
}

fn arb_bad() -> impl Strategy<Value = Bad> {
    prop_oneof![
        (
            prop::sample::select(b"gGxXzZ-+_./:\"=\x00\x7f\xff".to_vec()),
            any::<Index>()
        )
            .prop_map(|(b, i)| Bad::Digit(b, i)),
        (16usize..24).prop_map(Bad::TooLong),
        prop::sample::select(vec!["", " ", "\t", ";a=b"]).prop_map(Bad::Empty),
        prop::sample::select(vec!["", "\n", "\r", "\r\r", "\n\r", "xx", "0\r\n"])
            .prop_map(Bad::DataEnd),
    ]
}

/// A chunked encoding of a body.
#[derive(Clone, Debug)]
struct Chunked {
    body: Vec<u8>,
    /// Where chunks end in the body (the last one ends at its end).
    cuts: Vec<Index>,
    /// Spelling of each size line, round-robin (the last chunk's too).
    spellings: Vec<Spelling>,
    trailers: Vec<&'static str>,
}

fn arb_chunked(body: impl Strategy<Value = Vec<u8>>) -> impl Strategy<Value = Chunked> {
    (
        body,
        prop::collection::vec(any::<Index>(), 0..8),
        prop::collection::vec(arb_spelling(), 1..4),
        prop::collection::vec(
            prop::sample::select(vec!["x-t: v", "Checksum: abc", "x-empty:", "x-r: a;b=c"]),
            0..3,
        ),
    )
        .prop_map(|(body, cuts, spellings, trailers)| Chunked {
            body,
            cuts,
            spellings,
            trailers,
        })
}

/// An encoded stream.
struct Encoded {
    stream: Vec<u8>,
    /// How many chunks carry data.
    chunks: usize,
    /// Where the body ends in the stream.
    end: usize,
    /// How much of the body comes before the broken spot (all of it if none).
    good: usize,
}

impl Chunked {
    /// The chunks' lengths (none empty: an empty chunk is the last).
    fn sizes(&self) -> Vec<usize> {
        let n = self.body.len();
        let mut at: Vec<usize> = self.cuts.iter().map(|i| i.index(n + 1)).collect();
        at.push(n);
        at.sort_unstable();
        at.dedup();
        let mut prev = 0;
        let mut sizes = Vec::new();
        for a in at {
            if a > prev {
                sizes.push(a - prev);
                prev = a;
            }
        }
        sizes
    }

    /// The stream; `bad` breaks chunk `k` (the last, empty chunk is `sizes().len()`).
    fn encode(&self, bad: Option<(usize, &Bad)>) -> Encoded {
        let sizes = self.sizes();
        let mut out = Vec::new();
        let mut at = 0;
        let mut good = self.body.len();
        for (k, &size) in sizes.iter().chain(std::iter::once(&0)).enumerate() {
            let sp = &self.spellings[k % self.spellings.len()];
            let hex = if sp.upper {
                format!("{size:X}")
            } else {
                format!("{size:x}")
            };
            let mut digits = ["0".repeat(sp.zeros), hex].concat().into_bytes();
            let broken = bad.filter(|(bk, _)| *bk == k).map(|(_, b)| b);
            match broken {
                Some(Bad::Digit(b, i)) => {
                    let i = i.index(digits.len() + 1);
                    digits.insert(i, *b);
                }
                Some(Bad::TooLong(len)) => {
                    let hex = format!("{size:x}");
                    digits = ["0".repeat(len - hex.len()), hex].concat().into_bytes();
                }
                Some(Bad::Empty(s)) => digits = s.as_bytes().to_vec(),
                _ => {}
            }
            if matches!(
                broken,
                Some(Bad::Digit(..) | Bad::TooLong(_) | Bad::Empty(_))
            ) {
                good = at;
            }
            let eol: &[u8] = if sp.lf_only { b"\n" } else { b"\r\n" };
            out.extend_from_slice(&digits);
            out.extend_from_slice(sp.ext.as_bytes());
            out.extend_from_slice(eol);
            if size == 0 {
                for t in &self.trailers {
                    out.extend_from_slice(t.as_bytes());
                    out.extend_from_slice(b"\r\n");
                }
                out.extend_from_slice(eol);
                break;
            }
            out.extend_from_slice(&self.body[at..at + size]);
            at += size;
            match broken {
                Some(Bad::DataEnd(s)) => {
                    out.extend_from_slice(s.as_bytes());
                    good = good.min(at);
                }
                _ => out.extend_from_slice(b"\r\n"),
            }
        }
        Encoded {
            end: out.len(),
            stream: out,
            chunks: sizes.len(),
            good,
        }
    }
}

/// What `parse_chunk_size` should make of a line: 1 to 15 hex digits before any `;`,
/// whitespace around them allowed.
fn chunk_size_model(line: &[u8]) -> Option<u64> {
    let digits = line.split(|&b| b == b';').next()?.trim_ascii();
    if digits.is_empty() || digits.len() > 15 || !digits.iter().all(u8::is_ascii_hexdigit) {
        return None;
    }
    u64::from_str_radix(std::str::from_utf8(digits).ok()?, 16).ok()
}

proptest! {
    #[test]
    fn chunk_size_lines(
        n in 0u64..1 << 60,
        upper: bool,
        zeros in 0usize..15,
        ws_before in prop::sample::select(vec!["", " ", "\t", " \t"]),
        ws_after in prop::sample::select(vec!["", " ", "\t "]),
        ext in prop::sample::select(vec!["", ";a=b", ";x", ";a=\"1;2\"", ";"]),
        raw in prop_oneof![
            prop::collection::vec(any::<u8>(), 0..24),
            "[ \t]{0,2}[0-9a-fA-FgxX+-]{0,20}[ \t\r]{0,2}(;[a-z=]{0,4})?".prop_map(String::into_bytes),
            "[0-9a-fA-F]{13,18}(;x)?".prop_map(String::into_bytes),
        ],
    ) {
        let hex = if upper { format!("{n:X}") } else { format!("{n:x}") };
        let digits = ["0".repeat(zeros.min(15 - hex.len())), hex].concat();
        let line = format!("{ws_before}{digits}{ws_after}{ext}");
        prop_assert_eq!(parse_chunk_size(line.as_bytes()).ok(), Some(n), "{:?}", line);
        // Anything else: the model's answer, never a panic.
        prop_assert_eq!(parse_chunk_size(&raw).ok(), chunk_size_model(&raw), "{:?}", raw);
    }

    #[test]
    fn chunked_bodies_decode_in_any_reads(
        c in arb_chunked(prop::collection::vec(any::<u8>(), 0..100)),
        extra in prop_oneof![
            2 => Just(Vec::new()),
            1 => prop::collection::vec(any::<u8>(), 1..8),
            1 => Just(b"HTTP/1.1 200 OK\r\n".to_vec()),
        ],
        cuts in arb_cuts(),
    ) {
        let e = c.encode(None);
        let stream = [e.stream.clone(), extra.clone()].concat();
        let parts = pieces(&stream, &cuts);
        let run = drive(Framing::chunked(), &parts, c.body.len(), e.end)?;
        prop_assert_eq!(&run.end, &End::Clean, "{:?}", String::from_utf8_lossy(&stream));
        prop_assert_eq!(&run.data, &c.body);
        // Handed back only when nothing was read past the end (bytes after it are not
        // kept for a next answer: the connection is closed instead).
        prop_assert_eq!(run.reused, read_ends_at(&parts, e.end));
    }

    #[test]
    fn broken_chunked_bodies_fail(
        c in arb_chunked(prop::collection::vec(any::<u8>(), 1..100)),
        bad in arb_bad(),
        at: Index,
        cuts in arb_cuts(),
    ) {
        let chunks = c.sizes().len();
        let k = match bad {
            // After a chunk's data: one with data.
            Bad::DataEnd(_) => at.index(chunks),
            // A size line: any, the last (`0`) one too.
            _ => at.index(chunks + 1),
        };
        let e = c.encode(Some((k, &bad)));
        prop_assert_eq!(e.chunks, chunks);
        let parts = pieces(&e.stream, &cuts);
        let run = drive(Framing::chunked(), &parts, c.body.len(), usize::MAX)?;
        prop_assert!(
            matches!(run.end, End::Error(_)),
            "{:?}: {:?}",
            run.end,
            String::from_utf8_lossy(&e.stream)
        );
        // What came before the error is the body's start, from before the broken spot.
        prop_assert!(run.data.len() <= e.good);
        prop_assert_eq!(&run.data[..], &c.body[..run.data.len()]);
        prop_assert!(!run.reused);
    }

    #[test]
    fn length_bodies_yield_exactly_their_length(
        body in prop::collection::vec(any::<u8>(), 0..100),
        extra in prop::collection::vec(any::<u8>(), 0..8),
        cuts in arb_cuts(),
    ) {
        let stream = [body.clone(), extra].concat();
        let parts = pieces(&stream, &cuts);
        let n = body.len();
        let run = drive(Framing::Length(n as u64), &parts, n, n)?;
        prop_assert_eq!(&run.end, &End::Clean);
        prop_assert_eq!(&run.data, &body);
        prop_assert_eq!(run.reused, read_ends_at(&parts, n));
    }

    #[test]
    fn bodies_cut_short_never_end(
        c in arb_chunked(prop::collection::vec(any::<u8>(), 0..100)),
        chunked: bool,
        cut: Index,
        cuts in arb_cuts(),
    ) {
        let (framing, full) = if chunked {
            (Framing::chunked(), c.encode(None).stream)
        } else {
            (Framing::Length(c.body.len() as u64), c.body.clone())
        };
        prop_assume!(!full.is_empty());
        let stream = &full[..cut.index(full.len())];
        let parts = pieces(stream, &cuts);
        let run = drive(framing, &parts, c.body.len(), full.len())?;
        // Still waiting for the rest (an EOF now is an error, see the socket test).
        prop_assert_eq!(&run.end, &End::Stalled);
        prop_assert_eq!(&run.data[..], &c.body[..run.data.len()]);
        prop_assert!(!run.reused);
    }
}

/// How the socket test's body is framed.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Length,
    Chunked,
    Eof,
}

proptest! {
    #[test]
    fn bodies_over_a_socket(
        c in arb_chunked(prop::collection::vec(any::<u8>(), 0..100)),
        kind in prop::sample::select(vec![Kind::Length, Kind::Chunked, Kind::Eof]),
        cut in prop::option::of(any::<Index>()),
        cuts in arb_cuts(),
    ) {
        let (framing, full) = match kind {
            Kind::Length => (Framing::Length(c.body.len() as u64), c.body.clone()),
            Kind::Chunked => (Framing::chunked(), c.encode(None).stream),
            Kind::Eof => (Framing::Eof, c.body.clone()),
        };
        // Cut short (then closed), or whole (then closed only when framed by EOF).
        let sent = match cut {
            Some(i) if !full.is_empty() && !matches!(kind, Kind::Eof) => i.index(full.len()),
            _ => full.len(),
        };
        let short = sent < full.len();
        let close = short || matches!(kind, Kind::Eof);
        let parts: Vec<Vec<u8>> = pieces(&full[..sent], &cuts).into_iter().map(<[u8]>::to_vec).collect();
        let (run, reused) = with_conn(|rt, leg, engine| {
            let (host, s) = host();
            let mut body = LegBody::new(leg, BytesMut::new(), framing, Some((host.clone(), s)));
            engine.set_nonblocking(true).unwrap();
            let mut engine = TcpStream::from_std(engine).unwrap();
            let run = rt.block_on(async move {
                let write = async move {
                    for p in parts {
                        engine.write_all(&p).await.unwrap();
                        tokio::task::yield_now().await;
                    }
                    // Kept open until the body is read, unless closing is the point.
                    (!close).then_some(engine)
                };
                let read = async {
                    let mut data = Vec::new();
                    loop {
                        match body.frame().await {
                            None => break (data, End::Clean),
                            Some(Err(e)) => break (data, End::Error(e.to_string())),
                            Some(Ok(f)) => data.extend_from_slice(&f.into_data().unwrap()),
                        }
                    }
                };
                let (_engine, run) = tokio::time::timeout(Duration::from_secs(10), async {
                    tokio::join!(write, read)
                })
                .await
                .expect("the body did not end");
                run
            });
            (run, host.idle_count() == 1)
        });
        let (data, end) = run;
        if short {
            prop_assert_eq!(end, End::Error(LegError::ClosedEarly.to_string()));
            prop_assert_eq!(&data[..], &c.body[..data.len()]);
        } else {
            prop_assert_eq!(end, End::Clean);
            prop_assert_eq!(&data, &c.body);
        }
        // Reused only when the end was read exactly (never for EOF framing).
        prop_assert_eq!(reused, !short && !matches!(kind, Kind::Eof));
    }
}

/// Chunks read together are relayed as one frame, up to what stops the merge: a size line
/// with an extension, a chunk not wholly read, the last chunk (which ends the body with the
/// frame). Each case is one read; the frames are what the body gives before it needs more.
#[test]
fn whole_chunks_read_together_are_one_frame() {
    let cases: &[(&str, &[&str], bool)] = &[
        ("3\r\nabc\r\n", &["abc"], false),
        ("3\r\nabc\r\n2\r\nde\r\n1\r\nf\r\n", &["abcdef"], false),
        ("3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n", &["abcde"], true),
        // An extension stops the merge; the general path reads it.
        (
            "3\r\nabc\r\n2;x=1\r\nde\r\n1\r\nf\r\n",
            &["abc", "def"],
            false,
        ),
        // A chunk not wholly read: what is read of it comes next.
        ("3\r\nabc\r\n2\r\nde\r\n5\r\nfg", &["abcde", "fg"], false),
        (
            "A\r\n0123456789\r\na\r\nabcdefghij\r\n",
            &["0123456789abcdefghij"],
            false,
        ),
    ];
    for (read, want, ends) in cases {
        with_conn(|_, leg, _engine| {
            let mut body = LegBody::new(leg, BytesMut::new(), Framing::chunked(), None);
            body.buf.extend_from_slice(read.as_bytes());
            let mut cx = Context::from_waker(Waker::noop());
            let mut frames = Vec::new();
            loop {
                match Pin::new(&mut body).poll_frame(&mut cx) {
                    Poll::Ready(Some(Ok(f))) => {
                        let d = f.into_data().expect("data");
                        frames.push(String::from_utf8(d.to_vec()).expect("utf-8"));
                    }
                    Poll::Ready(Some(Err(e))) => panic!("{read:?}: {e}"),
                    Poll::Ready(None) | Poll::Pending => break,
                }
            }
            assert_eq!(&frames, want, "{read:?}");
            assert_eq!(body.is_end_stream(), *ends, "{read:?}");
        });
    }
}
