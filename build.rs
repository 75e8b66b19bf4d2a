//! Records the git commit the binary is built from as `PDGATE_COMMIT` (logged at start),
//! unless the environment already sets it (a Docker build without `.git`). No git, or not a
//! checkout: the start-up line says `unknown`.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
        .filter(|s| !s.is_empty())
}

fn main() {
    println!("cargo:rerun-if-env-changed=PDGATE_COMMIT");
    if std::env::var_os("PDGATE_COMMIT").is_some() {
        return;
    }
    // Rebuilt when HEAD moves (a commit, a checkout).
    if let Some(path) = git(&["rev-parse", "--git-path", "HEAD"]) {
        println!("cargo:rerun-if-changed={path}");
    }
    if let Some(head) = git(&["symbolic-ref", "-q", "HEAD"]) {
        if let Some(path) = git(&["rev-parse", "--git-path", &head]) {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    if let Some(commit) = git(&["rev-parse", "--short=12", "HEAD"]) {
        println!("cargo:rustc-env=PDGATE_COMMIT={commit}");
    }
}
