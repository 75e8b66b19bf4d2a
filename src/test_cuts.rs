//! Test support shared by the property tests of the stream parsers (SSE scanner, leg
//! answer heads and bodies): a byte stream cut into pieces at arbitrary places, the way
//! reads from a socket may cut it.

use proptest::prelude::*;
use proptest::sample::Index;

/// Where a stream is cut: at arbitrary positions (empty pieces included), or into pieces
/// of one small size.
#[derive(Debug, Clone)]
pub enum Cuts {
    At(Vec<Index>),
    Every(usize),
}

pub fn arb_cuts() -> impl Strategy<Value = Cuts> {
    prop_oneof![
        3 => prop::collection::vec(any::<Index>(), 0..16).prop_map(Cuts::At),
        1 => (1usize..8).prop_map(Cuts::Every),
    ]
}

/// `buf` cut where `cuts` says; the pieces, in order, make `buf` again.
pub fn pieces<'a>(buf: &'a [u8], cuts: &Cuts) -> Vec<&'a [u8]> {
    let mut at: Vec<usize> = match cuts {
        Cuts::At(ix) => ix.iter().map(|i| i.index(buf.len() + 1)).collect(),
        Cuts::Every(n) => (1..buf.len().div_ceil(*n)).map(|i| i * n).collect(),
    };
    at.sort_unstable();
    let mut prev = 0;
    let mut out = Vec::new();
    for a in at.into_iter().chain(std::iter::once(buf.len())) {
        out.push(&buf[prev..a]);
        prev = a;
    }
    out
}
