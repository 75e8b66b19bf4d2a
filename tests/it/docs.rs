//! The docs against the code they describe: a name or a number in `docs/` that comes from
//! the code is checked here, so that a change to one without the other fails.
//!
//! - every error pdgate returns (`FailReason::ALL`) is a row of the troubleshooting table,
//!   with its status, and the table names no other;
//! - every series pdgate exports (`telemetry::SERIES`) is a row of the metrics table in
//!   docs/operations.md, with its type and labels, and every `pdgate_*` name in the docs is
//!   a series;
//! - a table row that opens with a setting (`` `progress.multiplier` | 3 | ... ``) gives
//!   that setting's default, as `Config::default()` has it;
//! - every page opens with the question it answers, and every relative link resolves.
//!
//! (The SGLang flag table is checked in `sglang_flags`, the example config in
//! `example_config`.)

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use pdgate::config::Config;
use pdgate::error::FailReason;
use pdgate::telemetry::{Kind, SERIES};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// Every Markdown page of the docs, the README and BENCHMARKS.md: (path, text).
fn pages() -> Vec<(String, String)> {
    let mut out = vec![
        ("README.md".to_string(), read("README.md")),
        ("BENCHMARKS.md".to_string(), read("BENCHMARKS.md")),
    ];
    let mut names: Vec<_> = std::fs::read_dir(root().join("docs"))
        .expect("docs/")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".md"))
        .collect();
    names.sort();
    for n in names {
        let rel = format!("docs/{n}");
        out.push((rel.clone(), read(&rel)));
    }
    out
}

/// The cells of a Markdown table row (`| a | b |`), trimmed; `None` for any other line
/// and for a separator row.
fn cells(line: &str) -> Option<Vec<String>> {
    let l = line.trim();
    if !l.starts_with('|') || l.starts_with("|---") || l.starts_with("|:--") {
        return None;
    }
    let inner = l.trim_start_matches('|').trim_end_matches('|');
    Some(inner.split('|').map(|c| c.trim().to_string()).collect())
}

/// The names between backticks in a cell.
fn ticked(cell: &str) -> Vec<String> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

/// The rows of the table that follows `heading` on `page` (up to the next heading).
fn table_after(page: &str, heading: &str) -> Vec<Vec<String>> {
    let at = page
        .find(heading)
        .unwrap_or_else(|| panic!("no {heading:?}"));
    page[at + heading.len()..]
        .lines()
        .take_while(|l| !l.starts_with('#'))
        .filter_map(cells)
        .collect()
}

#[test]
fn every_error_is_in_the_troubleshooting_table_with_its_status() {
    let page = read("docs/troubleshooting.md");
    let rows = table_after(&page, "## Every error pdgate returns");
    let mut seen = BTreeSet::new();
    for row in &rows[1..] {
        let names = ticked(&row[0]);
        assert_eq!(names.len(), 1, "{row:?}");
        let name = &names[0];
        let reason = FailReason::ALL
            .into_iter()
            .find(|r| r.as_str() == name)
            .unwrap_or_else(|| panic!("the table names {name:?}, which pdgate never returns"));
        let status = reason.status(None).as_u16();
        // The engine's own 4xx passes through for the `*_rejected` reasons.
        let want = match name.ends_with("_rejected") {
            true => "the engine's 4xx".to_string(),
            false => status.to_string(),
        };
        assert_eq!(row[1], want, "{name}");
        assert!(
            row.len() == 4 && !row[2].is_empty() && !row[3].is_empty(),
            "{name}: what it means and what to check"
        );
        assert!(seen.insert(name.clone()), "{name} twice");
    }
    let missing: Vec<&str> = FailReason::ALL
        .iter()
        .map(|r| r.as_str())
        .filter(|n| !seen.contains(*n))
        .collect();
    assert!(
        missing.is_empty(),
        "errors missing from the table: {missing:?}"
    );
}

#[test]
fn every_series_is_in_the_metrics_table_with_its_type_and_labels() {
    let page = read("docs/operations.md");
    let rows = table_after(&page, "## Metrics");
    let mut seen = BTreeSet::new();
    for row in rows.iter().filter(|r| r[0].contains("pdgate_")) {
        let (kind, labels) = (&row[1], &row[2]);
        for name in ticked(&row[0]) {
            let s = SERIES
                .iter()
                .find(|s| s.name == name)
                .unwrap_or_else(|| panic!("the table names {name}, which is not exported"));
            let want = match s.kind {
                Kind::Counter => "counter",
                Kind::Gauge => "gauge",
                Kind::Histogram => "histogram",
            };
            assert!(kind.starts_with(want), "{name}: {kind} (is a {want})");
            for l in s.labels {
                let words: Vec<&str> = labels
                    .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .collect();
                assert!(words.contains(l), "{name}: label {l} not in {labels:?}");
            }
            seen.insert(name);
        }
    }
    let missing: Vec<&str> = SERIES
        .iter()
        .map(|s| s.name)
        .filter(|n| !seen.contains(*n))
        .collect();
    assert!(
        missing.is_empty(),
        "series missing from the table: {missing:?}"
    );
}

/// Any `pdgate_…` name a page mentions is an exported series (or a histogram's part).
#[test]
fn every_series_named_in_the_docs_exists() {
    for (path, text) in pages() {
        if path.ends_with("benchmarks-history.md") {
            continue; // the history quotes series as they were named then
        }
        for (i, _) in text.match_indices("pdgate_") {
            let name: String = text[i..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            if name.ends_with('_') {
                continue; // a prefix (`pdgate_worker_*`, `pdgate_discovery_*`)
            }
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(&name);
            // Crate and binary names, not series.
            if ["pdgate_sim"].contains(&name.as_str()) {
                continue;
            }
            assert!(
                crate::metrics::exported(&name) || crate::metrics::exported(base),
                "{path}: {name} is not an exported series"
            );
        }
    }
}

/// The value of a dotted key in the serialized default config.
fn default_of<'a>(defaults: &'a serde_json::Value, key: &str) -> Option<&'a serde_json::Value> {
    key.split('.').try_fold(defaults, |v, k| v.get(k))
}

/// A documented default against the config's: numbers by value, else the text.
fn same(doc: &str, v: &serde_json::Value) -> bool {
    let first = doc
        .split([',', ' ', '('])
        .next()
        .unwrap_or("")
        .trim_matches('`');
    match v {
        serde_json::Value::Number(n) => first
            .replace('_', "")
            .parse::<f64>()
            .is_ok_and(|d| Some(d) == n.as_f64()),
        serde_json::Value::Bool(b) => first == b.to_string(),
        serde_json::Value::String(s) => first.trim_matches('"') == s,
        _ => false,
    }
}

#[test]
fn documented_defaults_are_the_configs() {
    let defaults = serde_json::to_value(Config::default()).expect("defaults");
    let sections: BTreeSet<&String> = defaults.as_object().expect("object").keys().collect();
    let mut checked = 0;
    for (path, text) in pages() {
        if path.ends_with("benchmarks-history.md") {
            continue; // the history quotes settings as they were then
        }
        for row in text.lines().filter_map(cells) {
            let names = ticked(&row[0]);
            let [key] = names.as_slice() else { continue };
            let is_setting = key.contains('.')
                && !key.contains(' ')
                && key
                    .split('.')
                    .next()
                    .is_some_and(|s| sections.contains(&s.to_string()))
                && key
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '.');
            if !is_setting || row.len() < 2 {
                continue;
            }
            let v = default_of(&defaults, key)
                .unwrap_or_else(|| panic!("{path}: {key} is not a setting"));
            assert!(
                same(&row[1], v),
                "{path}: {key} documented as {:?}, its default is {v}",
                row[1]
            );
            checked += 1;
        }
    }
    assert!(checked >= 15, "{checked} documented defaults found");
}

#[test]
fn every_page_opens_with_its_question_and_its_links_resolve() {
    for (path, text) in pages() {
        if path.starts_with("docs/") {
            let mut paragraphs = text.split("\n\n").map(str::trim);
            let title = paragraphs.next().unwrap_or_default();
            assert!(
                title.starts_with("# ") && !title.contains('\n'),
                "{path}: a title"
            );
            let q = paragraphs.next().unwrap_or_default();
            assert!(
                q.starts_with("**") && q.ends_with("?**"),
                "{path}: the question it answers, in bold, after the title; found {q:?}"
            );
        }
        let dir = Path::new(&path).parent().unwrap_or(Path::new(""));
        for (i, _) in text.match_indices("](") {
            let target: String = text[i + 2..].chars().take_while(|c| *c != ')').collect();
            if target.starts_with("http")
                || target.starts_with('#')
                || target.starts_with("mailto:")
            {
                continue;
            }
            let file = target.split('#').next().unwrap_or_default();
            let resolved = root().join(dir).join(file);
            assert!(
                resolved.exists(),
                "{path}: link to {target} ({})",
                resolved.display()
            );
        }
    }
}

/// The README stays an entrance: short, its first lines the two commands.
#[test]
fn the_readme_is_short_and_starts_with_the_two_commands() {
    let readme = read("README.md");
    assert!(
        readme.lines().count() <= 250,
        "{} lines",
        readme.lines().count()
    );
    let code: Vec<&str> = readme
        .lines()
        .skip_while(|l| !l.starts_with("```"))
        .skip(1)
        .take(2)
        .collect();
    assert!(
        code[0].starts_with("cargo run --release -- demo"),
        "{code:?}"
    );
    assert!(code[1].starts_with("cargo test --workspace"), "{code:?}");
}
