//! A leg's body as pieces written with vectored writes: byte ranges of the client's body
//! (one shared allocation, never copied), short literals, and a small tail of bytes pdgate
//! writes itself (its bootstrap fields, rid, ranks).
//!
//! Why: the client's body is held for the request's life (a retry writes new legs from
//! it). Writing each leg as a fresh copy made a request cost about three times its body;
//! here both legs point into the one body, so a request costs about its body.
//!
//! Invariants: every piece is in range of what it points into (built only by [`Payload`]'s
//! own methods from ranges checked on the way in); the length is their sum.

use std::io::{self, IoSlice};
use std::ops::Range;

use bytes::Bytes;
use smallvec::SmallVec;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// At most this many slices per `writev` (well under every platform's `IOV_MAX`).
const MAX_IOV: usize = 64;

#[derive(Clone, Debug, PartialEq, Eq)]
enum Piece {
    /// A range of `src`.
    Src(u32, u32),
    /// A range of `tail`.
    Tail(u32, u32),
    Lit(&'static [u8]),
}

/// A leg's body: pieces of the client's body and of pdgate's own bytes, in order.
#[derive(Clone, Debug, Default)]
pub struct Payload {
    src: Bytes,
    pieces: SmallVec<[Piece; 8]>,
    tail: Vec<u8>,
    len: usize,
}

impl Payload {
    /// A body whose pieces point into `src` (shared, not copied).
    pub fn over(src: Bytes) -> Payload {
        Payload {
            src,
            ..Payload::default()
        }
    }

    /// Appends `range` of the source body. Out-of-range or oversized ranges are refused
    /// (`false`), never written.
    pub fn push_src(&mut self, range: Range<usize>) -> bool {
        if range.start > range.end || range.end > self.src.len() || range.end > u32::MAX as usize {
            return false;
        }
        if range.is_empty() {
            return true;
        }
        self.len += range.len();
        // A range that continues the last one extends it.
        if let Some(Piece::Src(_, end)) = self.pieces.last_mut() {
            if *end as usize == range.start {
                *end = range.end as u32;
                return true;
            }
        }
        self.pieces
            .push(Piece::Src(range.start as u32, range.end as u32));
        true
    }

    pub fn push_lit(&mut self, lit: &'static [u8]) {
        if !lit.is_empty() {
            self.len += lit.len();
            self.pieces.push(Piece::Lit(lit));
        }
    }

    /// Appends pdgate's own bytes (copied into the tail).
    pub fn push_own(&mut self, bytes: &[u8]) {
        self.own(|t| t.extend_from_slice(bytes));
    }

    /// Appends what `write` adds to the tail.
    pub fn own(&mut self, write: impl FnOnce(&mut Vec<u8>)) {
        let start = self.tail.len();
        write(&mut self.tail);
        let end = self.tail.len();
        if end == start || end > u32::MAX as usize {
            self.tail.truncate(start);
            return;
        }
        self.len += end - start;
        if let Some(Piece::Tail(_, e)) = self.pieces.last_mut() {
            if *e as usize == start {
                *e = end as u32;
                return;
            }
        }
        self.pieces.push(Piece::Tail(start as u32, end as u32));
    }

    /// The body's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The source body the pieces point into.
    pub fn source(&self) -> &Bytes {
        &self.src
    }

    /// Bytes copied into this payload (pdgate's own fields): the rest points into the
    /// source body.
    pub fn copied(&self) -> usize {
        self.tail.len()
    }

    /// How many pieces (for tests and the bench: the number of slices written).
    pub fn pieces(&self) -> usize {
        self.pieces.len()
    }

    fn slice(&self, p: &Piece) -> &[u8] {
        match *p {
            Piece::Src(a, b) => self.src.get(a as usize..b as usize).unwrap_or_default(),
            Piece::Tail(a, b) => self.tail.get(a as usize..b as usize).unwrap_or_default(),
            Piece::Lit(l) => l,
        }
    }

    /// The slices in order.
    pub fn slices(&self) -> impl Iterator<Item = &[u8]> + '_ {
        self.pieces.iter().map(|p| self.slice(p))
    }

    /// The whole body as one buffer (tests, logs; legs never do this).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.len);
        for s in self.slices() {
            out.extend_from_slice(s);
        }
        out
    }
}

impl From<Vec<u8>> for Payload {
    fn from(v: Vec<u8>) -> Payload {
        let mut p = Payload::over(Bytes::from(v));
        let n = p.src.len();
        p.push_src(0..n);
        p
    }
}

/// Writes `head` then `body` with as few `writev`s as the socket allows (at most
/// [`MAX_IOV`] slices and [`crate::body::SLICE_BYTES`] each), never copying the body, and
/// letting other tasks run between slices (`crate::body::Pacer`), past the first slice at
/// `rate` when one is given.
///
/// Why a cap per call: a loopback or LAN socket takes megabytes in one `writev`, and the
/// kernel copies them (and, on loopback, runs the receiver's TCP processing) inside that
/// one call: a maximum-size body written to a leg held the event loop for milliseconds per
/// call, whatever the pacing between calls.
pub(crate) async fn write_all(
    stream: &mut TcpStream,
    head: &[u8],
    body: &Payload,
    rate: Option<&crate::body::ByteRate>,
) -> io::Result<()> {
    // The parts in order, and how much of the current one was written.
    let parts: SmallVec<[&[u8]; 16]> = std::iter::once(head).chain(body.slices()).collect();
    let (mut i, mut off) = (0usize, 0usize);
    let mut pacer = crate::body::Pacer::with_rate(rate);
    loop {
        // Skip what is written (and empty parts).
        while i < parts.len() && parts[i].len() == off {
            i += 1;
            off = 0;
        }
        if i == parts.len() {
            return Ok(());
        }
        let bufs = next_batch(&parts, i, off);
        let n = stream.write_vectored(&bufs).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        pacer.moved(n).await;
        (i, off) = advance(&parts, i, off, n);
    }
}

/// Where writing resumes after `n` more bytes from `parts[i][off..]` on were written.
fn advance(parts: &[&[u8]], mut i: usize, mut off: usize, mut n: usize) -> (usize, usize) {
    while n > 0 && i < parts.len() {
        let left = parts[i].len() - off;
        if n >= left {
            n -= left;
            i += 1;
            off = 0;
        } else {
            off += n;
            n = 0;
        }
    }
    (i, off)
}

/// The slices of one `writev`: from `parts[i][off..]` on, at most [`MAX_IOV`] of them and
/// [`crate::body::SLICE_BYTES`] in all (the last one cut short), never an empty one.
fn next_batch<'a>(parts: &[&'a [u8]], i: usize, off: usize) -> SmallVec<[IoSlice<'a>; 16]> {
    let mut bufs: SmallVec<[IoSlice<'a>; 16]> = SmallVec::new();
    let mut room = crate::body::SLICE_BYTES;
    let first = parts.get(i).map(|p| &p[off..]).into_iter();
    for p in first.chain(parts.iter().skip(i + 1).copied()) {
        if bufs.len() == MAX_IOV || room == 0 {
            break;
        }
        if p.is_empty() {
            continue;
        }
        let take = p.len().min(room);
        room -= take;
        bufs.push(IoSlice::new(&p[..take]));
    }
    bufs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_join_and_point_into_the_source() {
        let src = Bytes::from_static(b"{\"a\":1, \"b\":2}");
        let mut p = Payload::over(src.clone());
        p.push_lit(b"{");
        assert!(p.push_src(1..6));
        assert!(p.push_src(6..13), "contiguous ranges merge");
        assert!(!p.push_src(10..99), "out of range is refused");
        p.push_own(b",\"x\":");
        p.own(|t| t.extend_from_slice(b"3}"));
        assert_eq!(p.to_vec(), b"{\"a\":1, \"b\":2,\"x\":3}");
        assert_eq!(p.len(), p.to_vec().len());
        assert_eq!(p.pieces(), 3, "lit, one source run, one tail run");
        // The source piece is the client's allocation itself.
        let first_src = p.slices().nth(1).unwrap();
        assert_eq!(first_src.as_ptr(), src[1..].as_ptr());
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(64))]
        /// Whatever the parts and however much each `writev` takes, the batches carry the
        /// parts' bytes in order, each within the caps, and the writes end.
        #[test]
        fn batches_carry_every_byte_within_the_caps(
            lens in proptest::collection::vec(
                proptest::prop_oneof![3 => 0usize..40, 1 => 0usize..(crate::body::SLICE_BYTES * 2)],
                1..(MAX_IOV + 20),
            ),
            takes in proptest::collection::vec(0.05f64..1.0, 1..64),
        ) {
            let parts_owned: Vec<Vec<u8>> = lens
                .iter()
                .enumerate()
                .map(|(k, &n)| (0..n).map(|j| (k * 31 + j) as u8).collect())
                .collect();
            let parts: Vec<&[u8]> = parts_owned.iter().map(|p| p.as_slice()).collect();
            let want: Vec<u8> = parts.concat();
            let (mut i, mut off) = (0usize, 0usize);
            let mut got = Vec::new();
            let mut calls = 0usize;
            loop {
                while i < parts.len() && parts[i].len() == off {
                    i += 1;
                    off = 0;
                }
                if i == parts.len() {
                    break;
                }
                let bufs = next_batch(&parts, i, off);
                let offered: usize = bufs.iter().map(|b| b.len()).sum();
                proptest::prop_assert!(!bufs.is_empty() && bufs.len() <= MAX_IOV);
                proptest::prop_assert!(bufs.iter().all(|b| !b.is_empty()));
                proptest::prop_assert!(offered <= crate::body::SLICE_BYTES);
                // The socket takes a part of what is offered (at least a byte).
                let f = takes[calls % takes.len()];
                let n = ((offered as f64 * f) as usize).clamp(1, offered);
                let mut left = n;
                for b in bufs.iter() {
                    let k = left.min(b.len());
                    got.extend_from_slice(&b[..k]);
                    left -= k;
                }
                (i, off) = advance(&parts, i, off, n);
                calls += 1;
                proptest::prop_assert!(calls <= want.len() + 1);
            }
            proptest::prop_assert_eq!(got, want);
        }
    }
}
