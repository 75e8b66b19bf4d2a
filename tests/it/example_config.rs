//! `config/pdgate.example.toml` lists every setting: each key of every section of the
//! config (as `Config::default()` serializes it) appears in the example under its section,
//! set or commented out (`# key = ...`, for settings that are unset by default). A setting
//! added to `src/config/` without a line in the example fails here.

use std::collections::BTreeSet;

use pdgate::config::Config;

/// `(section, key)` of every line `key = ...` or `# key = ...` under `[section]` (or
/// `# [section]`).
fn listed(text: &str) -> BTreeSet<(String, String)> {
    let mut out = BTreeSet::new();
    let mut section = String::new();
    for line in text.lines() {
        let l = line.trim().trim_start_matches('#').trim();
        if let Some(name) = l.strip_prefix('[').and_then(|r| r.split(']').next()) {
            section = name.trim_matches(['[', ']']).to_string();
            // `[a.b]` is the key `b` of section `a` (a table of free-form keys).
            if let Some((outer, inner)) = section.split_once('.') {
                out.insert((outer.to_string(), inner.to_string()));
            }
            continue;
        }
        if let Some((key, _)) = l.split_once('=') {
            let key = key.trim();
            if !key.is_empty()
                && key
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            {
                out.insert((section.clone(), key.to_string()));
            }
        }
    }
    out
}

#[test]
fn the_example_config_lists_every_setting() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/pdgate.example.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    let have = listed(&text);
    let defaults = serde_json::to_value(Config::default()).unwrap();
    let mut missing = Vec::new();
    let sections = defaults.as_object().unwrap();
    assert!(sections.len() > 15, "{sections:?}");
    for (section, v) in sections {
        // `[[prefill]]` / `[[decode]]`: arrays of tables, empty by default.
        let Some(keys) = v.as_object() else {
            assert!(
                have.iter().any(|(s, _)| s == section),
                "no [[{section}]] in the example"
            );
            continue;
        };
        for key in keys.keys() {
            if !have.contains(&(section.clone(), key.clone())) {
                missing.push(format!("{section}.{key}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "settings missing from {}: {missing:?}",
        path.display()
    );
}
