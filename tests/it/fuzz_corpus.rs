//! The committed fuzz corpus (`fuzz/corpus/<target>/`) replayed on stable Rust: every file
//! goes through the same entry point its fuzz target calls (`pdgate::fuzzing`), so the seeds
//! and every input fuzzing once found interesting are regression tests. Fails when a
//! target has no corpus, or a corpus folder names no target.

use std::path::Path;

use pdgate::fuzzing::{target, TARGETS};

fn corpus_root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/corpus"))
}

#[test]
fn every_target_has_a_corpus_and_a_fuzz_target() {
    for (name, _) in TARGETS {
        let dir = corpus_root().join(name);
        let files = std::fs::read_dir(&dir)
            .map(|d| d.flatten().count())
            .unwrap_or(0);
        assert!(
            files > 0,
            "no corpus for the fuzz target {name} in {}",
            dir.display()
        );
        let src =
            Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("fuzz/fuzz_targets/{name}.rs"));
        let text = std::fs::read_to_string(&src).unwrap_or_default();
        assert!(
            text.contains(&format!("pdgate::fuzzing::{name}(")),
            "{} does not call pdgate::fuzzing::{name}",
            src.display()
        );
    }
    for e in std::fs::read_dir(corpus_root())
        .expect("fuzz/corpus")
        .flatten()
    {
        let name = e.file_name().to_string_lossy().to_string();
        assert!(
            target(&name).is_some(),
            "fuzz/corpus/{name} names no target"
        );
    }
}

#[test]
fn the_corpus_replays_without_a_failure() {
    let mut replayed = 0;
    for (name, run) in TARGETS {
        let mut files: Vec<_> = std::fs::read_dir(corpus_root().join(name))
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        files.sort();
        for f in files {
            let data = std::fs::read(&f).expect("a corpus file");
            // A panic names the file, so that it can be run again on its own.
            let ok = std::panic::catch_unwind(|| run(&data));
            assert!(ok.is_ok(), "fuzz target {name} failed on {}", f.display());
            replayed += 1;
        }
    }
    assert!(replayed >= TARGETS.len(), "replayed {replayed} inputs");
}
