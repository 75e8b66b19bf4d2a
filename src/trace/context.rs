//! W3C Trace Context (`traceparent`, version `00`): parsing a caller's header and writing
//! the one each engine leg carries.
//!
//! Invariants:
//! - [`TraceParent::parse`] accepts exactly `00-<32 hex>-<16 hex>-<2 hex>` (lower-case hex,
//!   as the spec requires), refuses all-zero ids and version `ff`, and for a version above
//!   `00` reads the first four fields (the spec's forward compatibility); anything else is
//!   `None`, and the caller starts a new trace (a malformed header is never an error to the
//!   client).
//! - [`TraceParent::format`] writes into a fixed 55-byte array: no allocation.

use std::fmt;

/// A trace id: 16 bytes, never all zero when valid.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceId(pub [u8; 16]);

/// A span id: 8 bytes, never all zero when valid.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct SpanId(pub [u8; 8]);

impl TraceId {
    pub fn is_valid(&self) -> bool {
        self.0 != [0; 16]
    }
    /// 32 lower-case hex digits (OTLP/JSON and `traceparent` spell ids alike).
    pub fn hex(&self) -> String {
        hex(&self.0)
    }
}

impl SpanId {
    pub fn is_valid(&self) -> bool {
        self.0 != [0; 8]
    }
    pub fn hex(&self) -> String {
        hex(&self.0)
    }
}

impl fmt::Debug for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.hex())
    }
}

impl fmt::Debug for SpanId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.hex())
    }
}

/// A `traceparent` header's fields (version 00).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: TraceId,
    /// The caller's span: the parent of pdgate's request span.
    pub parent_id: SpanId,
    /// The trace flags; bit 0 is `sampled`.
    pub flags: u8,
}

/// The length of a version-00 `traceparent`.
pub const TRACEPARENT_LEN: usize = 55;

const HEX: &[u8; 16] = b"0123456789abcdef";

fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(HEX[usize::from(b >> 4)] as char);
        s.push(HEX[usize::from(b & 15)] as char);
    }
    s
}

fn write_hex(bytes: &[u8], out: &mut [u8]) {
    for (i, b) in bytes.iter().enumerate() {
        out[2 * i] = HEX[usize::from(b >> 4)];
        out[2 * i + 1] = HEX[usize::from(b & 15)];
    }
}

/// Lower-case hex digits only (the spec refuses upper case).
fn nibble(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    }
}

fn read_hex<const N: usize>(s: &[u8]) -> Option<[u8; N]> {
    if s.len() != 2 * N {
        return None;
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = (nibble(s[2 * i])? << 4) | nibble(s[2 * i + 1])?;
    }
    Some(out)
}

impl TraceParent {
    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }

    /// The header's fields, or `None` when it is not a valid `traceparent`.
    pub fn parse(v: &[u8]) -> Option<TraceParent> {
        // Optional whitespace around the value is allowed by HTTP; none inside.
        let v = v.trim_ascii();
        if v.len() < TRACEPARENT_LEN {
            return None;
        }
        let version = read_hex::<1>(&v[0..2])?[0];
        if version == 0xff {
            return None;
        }
        // Version 00 is exactly 55 bytes; a later version may append `-...` fields.
        if version == 0 && v.len() != TRACEPARENT_LEN {
            return None;
        }
        if version > 0 && v.len() > TRACEPARENT_LEN && v[TRACEPARENT_LEN] != b'-' {
            return None;
        }
        if v[2] != b'-' || v[35] != b'-' || v[52] != b'-' {
            return None;
        }
        let trace_id = TraceId(read_hex::<16>(&v[3..35])?);
        let parent_id = SpanId(read_hex::<8>(&v[36..52])?);
        let flags = read_hex::<1>(&v[53..55])?[0];
        if !trace_id.is_valid() || !parent_id.is_valid() {
            return None;
        }
        Some(TraceParent {
            trace_id,
            parent_id,
            flags,
        })
    }

    /// The version-00 header, written into a fixed array (no allocation).
    pub fn format(&self) -> [u8; TRACEPARENT_LEN] {
        let mut out = [b'-'; TRACEPARENT_LEN];
        out[0] = b'0';
        out[1] = b'0';
        write_hex(&self.trace_id.0, &mut out[3..35]);
        write_hex(&self.parent_id.0, &mut out[36..52]);
        write_hex(&[self.flags], &mut out[53..55]);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn headers_are_read_as_the_spec_says() {
        // (header, Some((trace id, parent id, sampled)) or None)
        type Want = Option<(&'static str, &'static str, bool)>;
        let cases: &[(&str, Want)] = &[
            (
                GOOD,
                Some(("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", true)),
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
                Some((
                    "4bf92f3577b34da6a3ce929d0e0e4736",
                    "00f067aa0ba902b7",
                    false,
                )),
            ),
            // Other flag bits: sampled is bit 0 only.
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-02",
                Some((
                    "4bf92f3577b34da6a3ce929d0e0e4736",
                    "00f067aa0ba902b7",
                    false,
                )),
            ),
            (
                " 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-03 ",
                Some(("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", true)),
            ),
            // A later version with more fields: the first four are read.
            (
                "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-ever",
                Some(("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", true)),
            ),
            ("", None),
            ("garbage", None),
            // Version ff is invalid; version 00 must be exactly 55 bytes.
            (
                "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                None,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
                None,
            ),
            (
                "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
                None,
            ),
            // All-zero ids.
            (
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                None,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
                None,
            ),
            // Upper case, short ids, wrong separators, non-hex.
            (
                "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
                None,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7a-01",
                None,
            ),
            (
                "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                None,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7-01",
                None,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7_01",
                None,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
                None,
            ),
            (
                "0g-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                None,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e47zz-00f067aa0ba902b7-01",
                None,
            ),
        ];
        for (header, want) in cases {
            let got = TraceParent::parse(header.as_bytes());
            let got = got.map(|p| (p.trace_id.hex(), p.parent_id.hex(), p.sampled()));
            let want = want.map(|(t, s, f)| (t.to_string(), s.to_string(), f));
            assert_eq!(got, want, "{header:?}");
        }
    }

    #[test]
    fn a_parsed_header_is_written_back_as_it_was() {
        let p = TraceParent::parse(GOOD.as_bytes()).unwrap();
        assert_eq!(&p.format()[..], GOOD.as_bytes());
    }

    proptest! {
        #[test]
        fn parse_inverts_format(t in any::<[u8; 16]>(), s in any::<[u8; 8]>(), flags in any::<u8>()) {
            let p = TraceParent { trace_id: TraceId(t), parent_id: SpanId(s), flags };
            let parsed = TraceParent::parse(&p.format());
            if p.trace_id.is_valid() && p.parent_id.is_valid() {
                prop_assert_eq!(parsed, Some(p));
            } else {
                prop_assert_eq!(parsed, None);
            }
        }

        #[test]
        fn no_input_panics(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
            let _ = TraceParent::parse(&bytes);
        }
    }
}
