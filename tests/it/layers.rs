//! The module graph runs one way (ARCHITECTURE.md, "The module graph"): no import cycle
//! among the router crate's top-level modules, counting `crate::` paths in non-test code
//! (a file's text up to its first `#[cfg(test)]`, comments left out; test-only files are
//! skipped).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

fn test_only(p: &Path) -> bool {
    let name = p.file_stem().and_then(|s| s.to_str()).unwrap_or("");
    name == "tests" || name == "props" || name.ends_with("_tests")
}

/// Top-level module → the top-level modules its non-test code names with `crate::`.
fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let Ok(rd) = std::fs::read_dir(src) else {
        return g;
    };
    for e in rd.flatten() {
        let p = e.path();
        let module = match (p.is_dir(), p.file_stem().and_then(|s| s.to_str())) {
            (true, Some(m)) => m.to_string(),
            (false, Some(m)) if p.extension().is_some_and(|x| x == "rs") => m.to_string(),
            _ => continue,
        };
        if module == "lib" || module == "main" {
            continue;
        }
        let mut files = Vec::new();
        if p.is_dir() {
            rs_files(&p, &mut files);
        } else {
            files.push(p.clone());
        }
        let deps = g.entry(module.clone()).or_default();
        for f in files.iter().filter(|f| !test_only(f)) {
            let text = std::fs::read_to_string(f).unwrap_or_default();
            let before_tests = text.split("#[cfg(test)]").next().unwrap_or("");
            // Code only: comments (and doc comments) may name any module.
            let code: String = before_tests
                .lines()
                .map(|l| l.split("//").next().unwrap_or(""))
                .collect::<Vec<_>>()
                .join("\n");
            for (i, _) in code.match_indices("crate::") {
                let name: String = code[i + 7..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() && name != module {
                    deps.insert(name);
                }
            }
        }
    }
    g
}

/// A cycle through `from`, if any (depth-first search).
fn cycle(g: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        g: &BTreeMap<String, BTreeSet<String>>,
        m: &str,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|x| x == m) {
            let mut c = path[i..].to_vec();
            c.push(m.to_string());
            return Some(c);
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_string());
        for d in g.get(m).into_iter().flatten() {
            if g.contains_key(d) {
                if let Some(c) = visit(g, d, path, done) {
                    return Some(c);
                }
            }
        }
        path.pop();
        done.insert(m.to_string());
        None
    }
    let mut done = BTreeSet::new();
    g.keys()
        .find_map(|m| visit(g, m, &mut Vec::new(), &mut done))
}

#[test]
fn the_module_graph_has_no_cycle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let g = graph(&root.join("src"));
    assert!(g.len() > 20, "modules found: {:?}", g.keys());
    assert!(
        g["pd"].contains("pool"),
        "the scan sees imports: {:?}",
        g["pd"]
    );
    assert_eq!(
        cycle(&g),
        None,
        "an import cycle among src's top-level modules"
    );
    // The simulator crate too.
    let sim = graph(&root.join("sim/src"));
    assert!(sim.len() > 10, "sim modules found: {:?}", sim.keys());
    assert_eq!(
        cycle(&sim),
        None,
        "an import cycle among sim/src's top-level modules"
    );
    // The check itself finds a cycle when there is one.
    let mut bad = g.clone();
    bad.entry("pool".into()).or_default().insert("pd".into());
    assert!(cycle(&bad).is_some());
}
