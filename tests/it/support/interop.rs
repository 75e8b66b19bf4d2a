//! What the interop tests (real SGLang bootstrap server, uvicorn engine) share: where the
//! venv is, the skip-or-fail rule (promtool), the cannot-run rule (interop), draining a child's pipes, and a default engine client.

use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use pdgate::upstream::Upstream;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};

/// The repository's root.
pub fn manifest() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The interop venv's python (built by `.ci/run`).
pub fn venv_python() -> PathBuf {
    manifest().join("target/sglang-venv/bin/python")
}

/// A test that cannot run here: a failure under `CI`, else skipped with a notice written
/// straight to the process's stderr (libtest captures `eprintln!`, and a skip must be seen).
pub fn skip_or_fail<T>(test: &str, why: &str) -> Option<T> {
    if std::env::var_os("CI").is_some() {
        panic!("{test}: {why}");
    }
    let bar = "!".repeat(88);
    let _ = writeln!(
        std::io::stderr(),
        "\n{bar}\n!! SKIPPED {test}: {why}\n!! (set CI to make this a failure)\n{bar}\n"
    );
    None
}

/// An interop test that cannot run where it was asked to run: a failure, never a pass.
/// The interop tests are `#[ignore]`d (a fresh clone shows them as ignored); `.ci/run`
/// builds the venv and runs them with `--include-ignored`.
pub fn cannot_run<T>(test: &str, why: &str) -> Option<T> {
    panic!("{test} cannot run: {why}")
}

/// Appends every line of `r` to `buf` until EOF (keeps the child's pipes drained).
pub fn drain<R: AsyncRead + Unpin + Send + 'static>(r: R, buf: Arc<Mutex<String>>) {
    tokio::spawn(async move {
        let mut lines = BufReader::new(r).lines();
        while let Ok(Some(l)) = lines.next_line().await {
            let mut b = buf.lock().unwrap();
            b.push_str(&l);
            b.push('\n');
        }
    });
}

/// The engine clients with the default settings.
pub fn upstream() -> Upstream {
    Upstream::new(&pdgate::router::upstream_settings(
        &pdgate::config::Config::default(),
    ))
}
