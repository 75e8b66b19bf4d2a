//! The module graph runs one way (ARCHITECTURE.md, "The module graph"): no import cycle
//! among sibling modules at any folder level of the router crate and of the simulator
//! (`src`, `src/dispatch`, `src/dispatch/attempt`, ...).
//!
//! An arrow `a → b` between two children of one folder is any reference from a production
//! file of `a` to `b`: `crate::<the folder's path>::b`, `super::b` (with as many `super::`
//! as the file sits deep below the folder), or a name inside `use super::{..}` /
//! `use crate::<path>::{..}` groups. Every production line is read: comments are left
//! out, and so are test files (`tests.rs`, `props.rs`, `*_tests.rs`, `*_props.rs`),
//! `#[cfg(test)] mod NAME;` lines and the bodies of `#[cfg(test)] mod NAME { .. }` blocks
//! (brace-matched), so a `#[cfg(test)]` on a field or a method hides nothing else.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn test_file(name: &str) -> bool {
    let stem = name.strip_suffix(".rs").unwrap_or(name);
    stem == "tests" || stem == "props" || stem.ends_with("_tests") || stem.ends_with("_props")
}

/// `text` without comments and without test modules (see the module docs).
fn production_text(text: &str) -> String {
    let code: String = text
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = String::with_capacity(code.len());
    let mut rest = code.as_str();
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let after = &rest[at + "#[cfg(test)]".len()..];
        match test_mod(after) {
            Some(skip) => rest = &after[skip..],
            None => {
                // On an item that is not a module: only the attribute goes.
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// After a `#[cfg(test)]`: the length of the `mod NAME;` or `mod NAME { .. }` that
/// follows (with an optional `pub`/`pub(..)`), if one does.
fn test_mod(s: &str) -> Option<usize> {
    let mut i = s.len() - s.trim_start().len();
    let t = &s[i..];
    if let Some(p) = t.strip_prefix("pub") {
        i += 3;
        if p.starts_with('(') {
            i += p.find(')')? + 1;
        }
        i += s[i..].len() - s[i..].trim_start().len();
    }
    let t = s[i..].strip_prefix("mod")?;
    if !t.starts_with(char::is_whitespace) {
        return None;
    }
    i += 3;
    i += s[i..].len() - s[i..].trim_start().len();
    let name = s[i..]
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .count();
    if name == 0 {
        return None;
    }
    i += name;
    i += s[i..].len() - s[i..].trim_start().len();
    match s[i..].chars().next()? {
        ';' => Some(i + 1),
        '{' => {
            let mut depth = 0usize;
            for (j, c) in s[i..].char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(i + j + 1);
                        }
                    }
                    _ => {}
                }
            }
            Some(s.len())
        }
        _ => None,
    }
}

/// A folder's child modules: `x.rs`, `x/mod.rs`, or `x.rs` with an `x/` folder (whose
/// files belong to `x`), each with the paths that make it.
fn children(folder: &Path) -> BTreeMap<String, Vec<PathBuf>> {
    let mut kids: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    let Ok(rd) = std::fs::read_dir(folder) else {
        return kids;
    };
    for e in rd.flatten() {
        let p = e.path();
        let name = e.file_name().to_string_lossy().to_string();
        if p.is_dir() {
            kids.entry(name).or_default().push(p);
        } else if let Some(stem) = name.strip_suffix(".rs") {
            if !matches!(stem, "mod" | "lib" | "main") && !test_file(&name) {
                kids.entry(stem.to_string()).or_default().push(p);
            }
        }
    }
    kids
}

/// The production files of a child module, each with its depth below the folder (how
/// many `super::` lead from it to the folder, less one).
fn files_of(paths: &[PathBuf]) -> Vec<(PathBuf, usize)> {
    fn walk(dir: &Path, depth: usize, out: &mut Vec<(PathBuf, usize)>) {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return;
        };
        for e in rd.flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().to_string();
            if p.is_dir() {
                walk(&p, depth + 1, out);
            } else if name.ends_with(".rs") && !test_file(&name) {
                // A folder's mod.rs is its module's own file, one level up.
                let d = if name == "mod.rs" { depth - 1 } else { depth };
                out.push((p, d));
            }
        }
    }
    let mut out = Vec::new();
    for p in paths {
        if p.is_dir() {
            walk(p, 1, &mut out);
        } else {
            out.push((p.clone(), 0));
        }
    }
    out
}

fn ident_at(s: &str) -> String {
    s.chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect()
}

/// The names `text` reaches through `prefix` (`prefix::name`, `prefix{a, b::c}`).
fn names_after(text: &str, prefix: &str, out: &mut BTreeSet<String>) {
    for (i, _) in text.match_indices(prefix) {
        // `super::` must not be the tail of a longer `super::super::`.
        if prefix.starts_with("super::") && text[..i].ends_with("::") {
            continue;
        }
        let rest = &text[i + prefix.len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let group = &group[..group.find('}').unwrap_or(group.len())];
            for item in group.split(',') {
                let n = ident_at(item.trim());
                if !n.is_empty() {
                    out.insert(n);
                }
            }
        } else {
            let n = ident_at(rest);
            if !n.is_empty() {
                out.insert(n);
            }
        }
    }
}

/// Sibling arrows among the children of `folder` (its path from the crate root: `path`).
fn sibling_graph(folder: &Path, path: &[String]) -> BTreeMap<String, BTreeSet<String>> {
    let kids = children(folder);
    let crate_prefix = if path.is_empty() {
        "crate::".to_string()
    } else {
        format!("crate::{}::", path.join("::"))
    };
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (k, paths) in &kids {
        let deps = g.entry(k.clone()).or_default();
        for (f, depth) in files_of(paths) {
            let text = production_text(&std::fs::read_to_string(&f).unwrap_or_default());
            let mut refs = BTreeSet::new();
            names_after(&text, &crate_prefix, &mut refs);
            names_after(&text, &"super::".repeat(depth + 1), &mut refs);
            for r in refs {
                if r != *k && kids.contains_key(&r) {
                    deps.insert(r);
                }
            }
        }
    }
    g
}

/// A cycle in `g`, if any (depth-first search).
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
            if let Some(c) = visit(g, d, path, done) {
                return Some(c);
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

/// Every folder below `src` (itself included) with its module path.
fn folders(src: &Path) -> Vec<(PathBuf, Vec<String>)> {
    fn walk(dir: &Path, path: Vec<String>, out: &mut Vec<(PathBuf, Vec<String>)>) {
        out.push((dir.to_path_buf(), path.clone()));
        let Ok(rd) = std::fs::read_dir(dir) else {
            return;
        };
        let mut subs: Vec<PathBuf> = rd
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_dir())
            .collect();
        subs.sort();
        for d in subs {
            let mut p = path.clone();
            p.push(
                d.file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .to_string(),
            );
            walk(&d, p, out);
        }
    }
    let mut out = Vec::new();
    walk(src, Vec::new(), &mut out);
    out
}

/// Each folder's sibling cycle, if any: `folder: a -> b -> a`.
fn cycles(src: &Path) -> Vec<String> {
    folders(src)
        .into_iter()
        .filter_map(|(dir, path)| {
            let c = cycle(&sibling_graph(&dir, &path))?;
            Some(format!("src/{}: {}", path.join("/"), c.join(" -> ")))
        })
        .collect()
}

/// The top-level modules' arrows (the ARCHITECTURE table's "imports").
pub(crate) fn top_level(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    sibling_graph(src, &[])
}

#[test]
fn no_folder_has_an_import_cycle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for src in [root.join("src"), root.join("sim/src")] {
        let g = top_level(&src);
        assert!(g.len() > 10, "modules found: {:?}", g.keys());
        assert_eq!(
            cycles(&src),
            Vec::<String>::new(),
            "import cycles in {}",
            src.display()
        );
    }
    let g = top_level(&root.join("src"));
    assert!(
        g["dispatch"].contains("pool"),
        "the scan sees crate:: imports: {:?}",
        g["dispatch"]
    );
    // The scan sees `super::` arrows between siblings inside a folder.
    let relay = sibling_graph(&root.join("src/relay"), &["relay".to_string()]);
    assert!(relay["body"].contains("sse"), "{relay:?}");
    // The check itself finds a cycle when there is one.
    let mut bad = g.clone();
    bad.entry("pool".into())
        .or_default()
        .insert("dispatch".into());
    assert!(cycle(&bad).is_some());
}

/// The reader sees through what used to hide production code: a `#[cfg(test)]` on a field
/// or a method hides nothing else, a test module's body is skipped whole, comments name
/// nothing. Table-driven: source, whether `super::b` is seen.
#[test]
fn the_reader_skips_only_test_code_and_comments() {
    let cases = [
        ("use super::b::X;", true),
        ("// use super::b::X;", false),
        ("/// [`super::b`]", false),
        ("#[cfg(test)]\nmod tests { use super::b::X; }", false),
        (
            "#[cfg(test)]\npub(crate) mod tests;\nuse super::b::X;",
            true,
        ),
        (
            "struct S {\n #[cfg(test)]\n f: u8,\n}\nuse super::b::X;",
            true,
        ),
        (
            "#[cfg(test)]\nfn helper() {}\nfn g() { super::b::f() }",
            true,
        ),
        (
            "#[cfg(test)]\nmod t { fn f() { { } } }\nuse super::{a, b::Y};",
            true,
        ),
        ("use super::super::b::X;", false),
    ];
    for (src, seen) in cases {
        let mut refs = BTreeSet::new();
        names_after(&production_text(src), "super::", &mut refs);
        assert_eq!(refs.contains("b"), seen, "{src:?}: {refs:?}");
    }
}

/// The modules `src/lib.rs` and `src/main.rs` declare outside test code.
fn declared(src: &Path) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for root in ["lib.rs", "main.rs"] {
        let text = production_text(&std::fs::read_to_string(src.join(root)).unwrap_or_default());
        for line in text.lines() {
            let l = line.trim();
            let l = l.strip_prefix("pub ").unwrap_or(l);
            if let Some(rest) = l.strip_prefix("mod ") {
                let name = ident_at(rest);
                if rest[name.len()..].trim_start().starts_with(';') {
                    out.insert(name);
                }
            }
        }
    }
    out
}

/// ARCHITECTURE.md's module table: module → the modules its "imports" column names.
fn documented(md: &str) -> BTreeMap<String, BTreeSet<String>> {
    let section = md
        .split("## The module graph")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .unwrap_or("");
    let mut out = BTreeMap::new();
    for line in section.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        // `| `name` | imports | what |` → ["", name, imports, what, ""]
        let Some(name) = cells
            .get(1)
            .and_then(|c| c.strip_prefix('`'))
            .and_then(|c| c.strip_suffix('`'))
        else {
            continue;
        };
        let imports = cells.get(2).copied().unwrap_or("");
        let deps = if imports.starts_with('—') {
            BTreeSet::new()
        } else {
            imports
                .split(',')
                .map(|d| d.trim().to_string())
                .filter(|d| !d.is_empty())
                .collect()
        };
        out.insert(name.to_string(), deps);
    }
    out
}

/// ARCHITECTURE.md's table lists every module of `src` with exactly the modules it
/// imports (its non-test code's `crate::` paths), so the map a newcomer reads is the code.
#[test]
fn the_architecture_table_is_the_import_graph() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let src = root.join("src");
    let modules = declared(&src);
    assert!(
        modules.contains("dispatch") && modules.contains("command"),
        "{modules:?}"
    );
    let code: BTreeMap<String, BTreeSet<String>> = top_level(&src)
        .into_iter()
        .filter(|(m, _)| modules.contains(m))
        .map(|(m, deps)| {
            let deps = deps.into_iter().filter(|d| modules.contains(d)).collect();
            (m, deps)
        })
        .collect();
    let md = std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let table = documented(&md);
    let mut wrong = Vec::new();
    for (m, deps) in &code {
        match table.get(m) {
            None => wrong.push(format!("{m}: missing from the table (imports {deps:?})")),
            Some(t) if t != deps => wrong.push(format!(
                "{m}: the table says {t:?}, the code imports {deps:?}"
            )),
            Some(_) => {}
        }
    }
    for m in table.keys().filter(|m| !code.contains_key(*m)) {
        wrong.push(format!("{m}: in the table, not a module of src"));
    }
    assert!(
        wrong.is_empty(),
        "ARCHITECTURE.md's module table:\n{}",
        wrong.join("\n")
    );
}

/// A type's inherent `impl` blocks live in one folder (its own concept's): no
/// `impl Dispatcher { .. }` in another folder than the dispatcher's. Trait impls
/// (`impl Trait for T`) may live with the trait.
#[test]
fn a_types_impl_lives_in_one_folder() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for (dir, _) in folders(&root.join("src")) {
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().to_string();
            if p.is_file() && name.ends_with(".rs") && !test_file(&name) {
                files.push(p);
            }
        }
    }
    let mut homes: BTreeMap<String, BTreeSet<PathBuf>> = BTreeMap::new();
    for f in &files {
        let text = production_text(&std::fs::read_to_string(f).unwrap_or_default());
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("impl") else {
                continue;
            };
            // `impl<T> Name<T> {` or `impl Name {`; not `impl Trait for Name {`.
            let rest = match rest.strip_prefix('<') {
                Some(r) => r.split_once('>').map_or("", |(_, r)| r),
                None => rest,
            };
            if !rest.starts_with(' ') || rest.contains(" for ") || !rest.trim_end().ends_with('{') {
                continue;
            }
            let name = ident_at(rest.trim_start());
            if !name.is_empty() {
                let dir = f.parent().map(Path::to_path_buf).unwrap_or_default();
                homes.entry(name).or_default().insert(dir);
            }
        }
    }
    assert!(
        homes.contains_key("Dispatcher") && homes.contains_key("PdBody"),
        "{homes:?}"
    );
    let spread: Vec<String> = homes
        .iter()
        .filter(|(_, dirs)| dirs.len() > 1)
        .map(|(t, dirs)| format!("{t}: {dirs:?}"))
        .collect();
    assert!(
        spread.is_empty(),
        "impls of one type in several folders:\n{}",
        spread.join("\n")
    );
}
