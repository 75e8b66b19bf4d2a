//! A run of whole SSE events, split into its events and their `data:` payloads, without
//! a copy: what the tracker reads event by event (`super::Tracker::relay`). Kept apart from
//! the account itself: this is the stream's framing, the same for every route.

/// The `data:` payload of one event, if it has one (SGLang writes one line per event),
/// with the end of the event's first line (its first `\n`, or its length) already known:
/// most events are one `data:` line, read with no second scan.
pub(super) fn payload_with(event: &[u8], first: usize) -> Option<(usize, usize)> {
    if let Some(d) = event.get(..first).and_then(|l| l.strip_prefix(b"data:")) {
        let skip = 5 + usize::from(d.first() == Some(&b' '));
        let end = first - usize::from(event.get(first.wrapping_sub(1)) == Some(&b'\r'));
        return Some((skip.min(end), end));
    }
    let mut start = 0;
    for end in memchr::memchr_iter(b'\n', event).chain(std::iter::once(event.len())) {
        let line = &event[start..end];
        let line_start = start;
        start = end + 1;
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(d) = line.strip_prefix(b"data:") {
            let skip = 5 + usize::from(d.first() == Some(&b' '));
            let from = line_start + skip;
            return Some((from, line_start + line.len()));
        }
    }
    None
}

/// The events of a run of whole events, each with its blank line: (start, end, the end of
/// its first line relative to its start).
pub(super) fn events(buf: &[u8]) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
    let mut pos = 0;
    std::iter::from_fn(move || {
        if pos >= buf.len() {
            return None;
        }
        let rest = &buf[pos..];
        let mut first = None;
        let len = memchr::memchr_iter(b'\n', rest)
            .find_map(|i| {
                first.get_or_insert(i);
                match rest.get(i + 1..) {
                    Some([b'\n', ..]) => Some(i + 2),
                    Some([b'\r', b'\n', ..]) => Some(i + 3),
                    _ => None,
                }
            })
            .unwrap_or(rest.len());
        let ev = (pos, pos + len, first.unwrap_or(len));
        pos += len;
        Some(ev)
    })
}
