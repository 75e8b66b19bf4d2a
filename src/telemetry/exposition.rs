//! Writing derived series in the Prometheus text format (0.0.4), after the recorder's.
//!
//! Invariants: a family's `# HELP` and `# TYPE` lines come from [`super::SERIES`] and are
//! written once, before its samples; label values are escaped (`\`, `"`, newline), so a
//! worker URL can never break the text.

use std::fmt::Write;

use super::{series, AtomicHistogram, Origin};

/// What derives series at scrape time (the pool: per worker, per DP rank).
pub trait Source {
    fn write_series(&self, out: &mut Exposition);
}

/// No derived series (a front door without a pool, tests).
impl Source for () {
    fn write_series(&self, _: &mut Exposition) {}
}

/// The exposition being written.
pub struct Exposition {
    text: String,
    /// The family whose samples are being written.
    open: Option<&'static str>,
}

impl Exposition {
    pub(super) fn new(recorded: String) -> Exposition {
        Exposition {
            text: recorded,
            open: None,
        }
    }

    pub(super) fn into_text(self) -> String {
        self.text
    }

    /// Starts the family `name` (its HELP and TYPE lines). `name` must be a derived series
    /// of the table: a recorded one would appear twice in the text, so it is refused.
    pub fn family(&mut self, name: &'static str) -> bool {
        let Some(s) = series(name).filter(|s| s.origin == Origin::Derived) else {
            debug_assert!(false, "{name} is not a derived series");
            self.open = None;
            return false;
        };
        if !self.text.is_empty() && !self.text.ends_with("\n\n") {
            self.text.push('\n');
        }
        let _ = writeln!(self.text, "# HELP {} {}", s.name, escape_help(s.help));
        let _ = writeln!(self.text, "# TYPE {} {}", s.name, s.kind.as_str());
        self.open = Some(s.name);
        true
    }

    /// One sample of the family last started.
    pub fn sample(&mut self, labels: &[(&str, &str)], value: impl std::fmt::Display) {
        self.line("", labels, None, value);
    }

    /// The samples of one histogram of the family last started (a histogram family):
    /// `_bucket` per bound and `+Inf`, `_sum`, `_count`.
    pub fn histogram(&mut self, labels: &[(&str, &str)], h: &AtomicHistogram) {
        let (buckets, sum) = h.read();
        let mut count = 0;
        for (le, n) in buckets {
            let le = le.map_or_else(|| "+Inf".to_string(), |b| b.to_string());
            self.line("_bucket", labels, Some(("le", &le)), n);
            count = n;
        }
        self.line("_sum", labels, None, sum);
        self.line("_count", labels, None, count);
    }

    fn line(
        &mut self,
        suffix: &str,
        labels: &[(&str, &str)],
        extra: Option<(&str, &str)>,
        value: impl std::fmt::Display,
    ) {
        let Some(name) = self.open else {
            return;
        };
        self.text.push_str(name);
        self.text.push_str(suffix);
        if !labels.is_empty() || extra.is_some() {
            self.text.push('{');
            for (i, (k, v)) in labels.iter().chain(extra.iter()).enumerate() {
                if i > 0 {
                    self.text.push(',');
                }
                self.text.push_str(k);
                self.text.push_str("=\"");
                escape_label(&mut self.text, v);
                self.text.push('"');
            }
            self.text.push('}');
        }
        let _ = writeln!(self.text, " {value}");
    }
}

fn escape_label(out: &mut String, v: &str) {
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

fn escape_help(h: &str) -> String {
    h.replace('\\', "\\\\").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::{WORKER_HEALTHY, WORKER_IN_FLIGHT};

    #[test]
    fn families_and_escaping() {
        let mut ex = Exposition::new("# TYPE a counter\na 1\n".into());
        assert!(ex.family(WORKER_HEALTHY));
        ex.sample(&[("role", "decode"), ("worker", "http://h:1\"\\\n")], 1);
        assert!(ex.family(WORKER_IN_FLIGHT));
        ex.sample(&[], 0.5);
        let text = ex.into_text();
        assert!(text.starts_with("# TYPE a counter\na 1\n\n# HELP pdgate_worker_healthy "));
        assert!(text.contains("# TYPE pdgate_worker_healthy gauge\n"));
        assert!(text.contains(
            "pdgate_worker_healthy{role=\"decode\",worker=\"http://h:1\\\"\\\\\\n\"} 1\n"
        ));
        assert!(text.ends_with("\npdgate_worker_in_flight_requests 0.5\n"));
    }
}
