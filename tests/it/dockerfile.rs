//! The Dockerfile's build stage, run on exactly what its COPY lines bring
//! in. No image can be built here (no Docker engine), and the stage broke
//! once unnoticed: it listed the bench targets it knew, and a new one made
//! `cargo build` fail with "can't find `heap` bench".
//!
//! The test copies the build stage's COPY sources into a fresh context
//! directory and runs the stage's cargo commands there, with `check` in
//! place of `build` (a release build from scratch takes minutes; what the
//! stage can get wrong, a target or file the COPY lines miss or a feature
//! set that does not compile, fails `check` just the same). The target
//! directory is cached under ~/.cache/model-residency so reruns are quick.

use std::path::{Path, PathBuf};
use std::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The build stage's instructions, continuation lines joined.
fn build_stage(dockerfile: &str) -> Vec<String> {
    let joined = dockerfile.replace("\\\n", " ");
    joined
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .skip_while(|l| !l.starts_with("FROM "))
        .enumerate()
        .take_while(|(i, l)| *i == 0 || !l.starts_with("FROM "))
        .map(|(_, l)| l.to_owned())
        .collect()
}

fn cache_dir() -> PathBuf {
    let home = std::env::var_os("HOME").expect("HOME");
    let base = std::env::var_os("MODEL_RESIDENCY_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(&home).join(".cache/model-residency"));
    base.join("dockerfile")
}

fn copy_into(src: &Path, dest: &Path) {
    if src.is_dir() {
        std::fs::create_dir_all(dest).unwrap();
        for entry in std::fs::read_dir(src).unwrap() {
            let entry = entry.unwrap();
            copy_into(&entry.path(), &dest.join(entry.file_name()));
        }
    } else {
        std::fs::copy(src, dest).unwrap_or_else(|e| panic!("COPY {}: {e}", src.display()));
    }
}

#[test]
fn the_image_build_stage_works_on_what_its_copy_lines_bring() {
    let dockerfile = std::fs::read_to_string(Path::new(ROOT).join("Dockerfile")).unwrap();
    let stage = build_stage(&dockerfile);
    assert!(stage[0].starts_with("FROM rust:"), "{stage:?}");
    let context = cache_dir().join("context");
    let _ = std::fs::remove_dir_all(&context);
    std::fs::create_dir_all(&context).unwrap();
    let mut workdir = context.clone();
    let mut env: Vec<(String, String)> = Vec::new();
    let mut cargo_commands = Vec::new();
    for line in &stage[1..] {
        let (instruction, rest) = line.split_once(' ').unwrap_or((line, ""));
        match instruction {
            "WORKDIR" => {
                workdir = context.join(rest.trim_start_matches('/'));
                std::fs::create_dir_all(&workdir).unwrap();
            }
            "ENV" => {
                let (k, v) = rest.split_once('=').expect("ENV KEY=value");
                env.push((k.to_owned(), v.to_owned()));
            }
            "COPY" => {
                let parts: Vec<&str> = rest.split_whitespace().collect();
                assert!(!parts[0].starts_with("--from"), "{line}");
                let (dest, sources) = parts.split_last().unwrap();
                let dest = workdir.join(dest);
                for src in sources {
                    let target = if dest.to_string_lossy().ends_with('/') || sources.len() > 1 {
                        std::fs::create_dir_all(&dest).unwrap();
                        dest.join(src)
                    } else {
                        dest.clone()
                    };
                    copy_into(&Path::new(ROOT).join(src), &target);
                }
            }
            "RUN" => {
                let commands = rest
                    .split_whitespace()
                    .filter(|w| !w.starts_with("--mount="))
                    .collect::<Vec<_>>()
                    .join(" ");
                for command in commands.split("&&").map(str::trim) {
                    if command.starts_with("cargo ") {
                        cargo_commands.push(command.to_owned());
                    }
                }
            }
            other => panic!("the build stage has an instruction this test does not know: {other}"),
        }
    }
    assert_eq!(cargo_commands.len(), 1, "{cargo_commands:?}");
    let command = &cargo_commands[0];
    assert!(
        command.contains("--no-default-features"),
        "the image must be built without the local test rig: {command}"
    );
    let args: Vec<&str> = command.split_whitespace().skip(1).collect();
    assert_eq!(args[0], "build", "{command}");
    let out = Command::new(env!("CARGO"))
        .arg("check")
        .args(&args[1..])
        .current_dir(&workdir)
        .envs(env)
        .env("CARGO_TARGET_DIR", cache_dir().join("target"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cargo {} failed in the Dockerfile's context:\n{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}
