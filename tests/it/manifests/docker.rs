//! `docker/Dockerfile`, as far as it can be checked without a Docker engine: every `COPY`
//! source exists and is in the build context (`Dockerfile.dockerignore`), build.rs included;
//! the dependency-cache stage stubs every bench the root manifest names (cargo refuses a
//! missing one); the image's binary is stripped; the default command starts (its flags
//! parse and the config the image carries validates); and every `docker run` command line
//! documented in the Dockerfile parses with pdgate's own parser.

use std::path::{Path, PathBuf};

use clap::{CommandFactory, FromArgMatches};
use pdgate::cli::prefill_groups;

use super::fleet::{Cli, Cmd};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn dockerfile() -> String {
    std::fs::read_to_string(root().join("docker/Dockerfile")).expect("docker/Dockerfile")
}

/// The instructions, continuation lines joined, comments dropped.
fn instructions(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for line in text.lines().map(str::trim) {
        if line.starts_with('#') || (line.is_empty() && cur.is_empty()) {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(part) => cur.push_str(part),
            None => {
                cur.push_str(line);
                out.push(std::mem::take(&mut cur));
            }
        }
    }
    out
}

/// Whether `path` is in the context: the ignore file excludes everything (`*`) and lets in
/// its `!` entries and what is under them (the only form it uses).
fn in_context(ignore: &str, path: &str) -> bool {
    let rules: Vec<&str> = ignore
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    assert_eq!(rules.first(), Some(&"*"), "the ignore file starts with *");
    let path = path.trim_end_matches('/');
    rules[1..].iter().any(|r| {
        let r = r.strip_prefix('!').expect("only ! entries after *");
        path == r || path.starts_with(&format!("{r}/"))
    })
}

#[test]
fn every_copy_source_exists_and_is_in_the_build_context() {
    let ignore = std::fs::read_to_string(root().join("docker/Dockerfile.dockerignore"))
        .expect("the ignore file");
    let mut sources = Vec::new();
    for i in instructions(&dockerfile()) {
        let Some(rest) = i.strip_prefix("COPY ") else {
            continue;
        };
        if rest.starts_with("--from") {
            continue;
        }
        let words: Vec<&str> = rest.split_whitespace().collect();
        sources.extend(words[..words.len() - 1].iter().map(|s| s.to_string()));
    }
    assert!(
        sources.iter().any(|s| s == "build.rs"),
        "build.rs is not copied"
    );
    for s in &sources {
        assert!(root().join(s).exists(), "COPY {s}: no such file");
        assert!(
            in_context(&ignore, s),
            "COPY {s}: left out by the ignore file"
        );
    }
    // The checker itself: what the ignore file leaves out is refused.
    assert!(!in_context(&ignore, "target/release/pdgate"));
    assert!(!in_context(&ignore, "tests/it/main.rs"));
}

#[test]
fn the_stub_stage_has_every_bench_and_the_binary_is_stripped() {
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).expect("Cargo.toml");
    let toml: toml::Value = toml::from_str(&manifest).expect("Cargo.toml parses");
    let mut benches: Vec<&str> = toml["bench"]
        .as_array()
        .expect("[[bench]]")
        .iter()
        .filter_map(|b| b["name"].as_str())
        .collect();
    let text = dockerfile();
    let (_, list) = text.split_once("for b in ").expect("the bench stub loop");
    let (list, _) = list.split_once(';').expect("loop list");
    let mut stubs: Vec<&str> = list.split_whitespace().collect();
    benches.sort_unstable();
    stubs.sort_unstable();
    assert_eq!(stubs, benches, "bench stubs vs Cargo.toml's [[bench]]");
    let strip = toml
        .get("profile")
        .and_then(|p| p.get("release"))
        .and_then(|r| r.get("strip"))
        .is_some();
    let env = instructions(&text).iter().any(|i| {
        i.strip_prefix("ENV CARGO_PROFILE_RELEASE_STRIP=")
            .is_some_and(|v| ["true", "debuginfo", "symbols"].contains(&v))
    });
    assert!(
        strip || env,
        "the release binary in the image is not stripped"
    );
}

/// `argv` with pdgate's parser; for `serve`, the effective config, where `files` maps
/// in-image paths to repository files.
fn parse(argv: &[String], files: &[(&str, &Path)]) -> Result<(), String> {
    let all = std::iter::once("pdgate".to_string()).chain(argv.iter().cloned());
    let m = Cli::command()
        .try_get_matches_from(all)
        .map_err(|e| e.to_string())?;
    let cli = Cli::from_arg_matches(&m).map_err(|e| e.to_string())?;
    match cli.command {
        Cmd::Sim(_) => Ok(()),
        Cmd::Serve(mut args) => {
            if let Some(p) = &args.config {
                let (_, local) = files
                    .iter()
                    .find(|(in_image, _)| Path::new(in_image) == p)
                    .ok_or_else(|| format!("--config {}: not in the image", p.display()))?;
                args.config = Some(local.to_path_buf());
            }
            let sm = m.subcommand_matches("serve").ok_or("serve")?;
            let groups = prefill_groups(sm).map_err(|e| e.to_string())?;
            args.into_config(groups)
                .map(|_| ())
                .map_err(|e| e.to_string())
        }
    }
}

/// The Dockerfile's documented `docker run` lines: (the line's index, the line, its pdgate
/// arguments: what follows the image name, or `cmd` when nothing does).
pub(crate) fn documented_runs(text: &str, cmd: &[String]) -> Vec<(usize, String, Vec<String>)> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let Some(run) = line
            .trim_start_matches('#')
            .trim()
            .strip_prefix("docker run ")
        else {
            continue;
        };
        let words: Vec<&str> = run.split_whitespace().collect();
        let at = words
            .iter()
            .position(|w| *w == "pdgate")
            .unwrap_or_else(|| panic!("{line}: no image pdgate"));
        let argv: Vec<String> = match &words[at + 1..] {
            [] => cmd.to_vec(),
            rest => rest.iter().map(|w| w.to_string()).collect(),
        };
        out.push((i, line.trim_start_matches('#').trim().to_string(), argv));
    }
    out
}

#[test]
fn the_default_command_and_the_documented_docker_runs_parse() {
    let text = dockerfile();
    let ins = instructions(&text);
    let json = |prefix: &str| -> Vec<String> {
        let i = ins.iter().rfind(|i| i.starts_with(prefix)).expect(prefix);
        serde_json::from_str(i[prefix.len()..].trim()).expect("exec form")
    };
    assert_eq!(json("ENTRYPOINT "), ["/usr/local/bin/pdgate"]);
    let cmd = json("CMD ");
    // The image's config is the example one (COPY config/pdgate.example.toml).
    let example = root().join("config/pdgate.example.toml");
    let files = [("/etc/pdgate/pdgate.toml", example.as_path())];
    assert!(text.contains("COPY config/pdgate.example.toml /etc/pdgate/pdgate.toml"));
    parse(&cmd, &files).unwrap_or_else(|e| panic!("CMD {cmd:?}: {e}"));
    // The documented runs: what follows the image name, or the CMD when nothing does.
    let runs = documented_runs(&text, &cmd);
    for (_, line, argv) in &runs {
        // A mounted file over /etc/pdgate/pdgate.toml is a config like the example one.
        parse(argv, &files).unwrap_or_else(|e| panic!("{line}: {e}"));
    }
    assert!(
        runs.len() >= 2,
        "{} documented docker run lines",
        runs.len()
    );
    // A misspelled flag in such a line would fail.
    let bad: Vec<String> = ["sim", "--prefil", "2"].map(String::from).to_vec();
    assert!(parse(&bad, &files).is_err());
}
