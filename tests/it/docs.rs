//! Every link in the README, docs/ and history/ points at a file that exists, and
//! every `#anchor` at a heading of that file (GitHub's anchor rule: the
//! heading's text lowercased, punctuation but `-` and `_` dropped, spaces
//! to `-`).

use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn pages() -> Vec<PathBuf> {
    let mut pages = vec![Path::new(ROOT).join("README.md")];
    for entry in std::fs::read_dir(Path::new(ROOT).join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            pages.push(path);
        }
    }
    pages
}

/// The user guide's pages and the performance history's (history/): links
/// are checked in both; named paths only in the guide, as the history
/// records files of its day.
fn pages_and_history() -> Vec<PathBuf> {
    let mut pages = pages();
    for entry in std::fs::read_dir(Path::new(ROOT).join("history")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            pages.push(path);
        }
    }
    pages
}

/// The lines of `text` but its code fences, each with whether it is
/// inside a code block.
fn lines_and_code(text: &str) -> Vec<(&str, bool)> {
    let mut in_code = false;
    let mut out = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
        } else {
            out.push((line, in_code));
        }
    }
    out
}

/// `[text](target)` targets outside code spans and blocks.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (line, in_code) in lines_and_code(text) {
        if in_code {
            continue;
        }
        // Drop code spans: `[x](y)` inside backticks is not a link.
        let plain: String = line.split('`').step_by(2).collect::<Vec<_>>().join(" ");
        let mut rest = plain.as_str();
        while let Some(i) = rest.find("](") {
            rest = &rest[i + 2..];
            let Some(end) = rest.find(')') else { break };
            out.push(rest[..end].to_owned());
            rest = &rest[end..];
        }
    }
    out
}

fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn anchors(text: &str) -> Vec<String> {
    lines_and_code(text)
        .into_iter()
        .filter(|(line, in_code)| !in_code && line.starts_with('#'))
        .map(|(line, _)| anchor(line.trim_start_matches('#')))
        .collect()
}

#[test]
fn every_link_in_the_docs_points_at_a_file_and_heading_that_exist() {
    let mut checked = 0;
    let mut broken = Vec::new();
    for page in pages_and_history() {
        let text = std::fs::read_to_string(&page).unwrap();
        for target in links(&text) {
            if target.starts_with("http://") || target.starts_with("https://") {
                continue;
            }
            checked += 1;
            let (file, fragment) = match target.split_once('#') {
                Some((f, a)) => (f, Some(a)),
                None => (target.as_str(), None),
            };
            let file = if file.is_empty() {
                page.clone()
            } else {
                page.parent().unwrap().join(file)
            };
            if !file.exists() {
                broken.push(format!("{}: {target}: no such file", page.display()));
                continue;
            }
            if let Some(fragment) = fragment {
                let there = std::fs::read_to_string(&file).unwrap_or_default();
                if !anchors(&there).iter().any(|a| a == fragment) {
                    broken.push(format!("{}: {target}: no such heading", page.display()));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    assert!(
        checked > 20,
        "only {checked} links found: is the parser right?"
    );
}

#[test]
fn the_anchor_rule_is_githubs() {
    assert_eq!(
        anchor(" `model-residency simulate`"),
        "model-residency-simulate"
    );
    assert_eq!(anchor("A session"), "a-session");
    assert_eq!(
        anchor("HPA, KEDA and `kubectl scale`: `ModelDemand`"),
        "hpa-keda-and-kubectl-scale-modeldemand"
    );
    assert_eq!(links("see [a](b.md#c) and `[x](y)`"), ["b.md#c"]);
}

/// Backticked spans of `text`, code blocks' lines included (a code block
/// is one span per line).
fn spans(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (line, in_code) in lines_and_code(text) {
        if in_code {
            out.push(line.to_owned());
            continue;
        }
        out.extend(line.split('`').skip(1).step_by(2).map(str::to_owned));
    }
    out
}

/// The repository's paths a doc names: a span's words that start with one
/// of the tree's top folders (a `:line` or `#anchor` cut off; globs and
/// placeholders left out).
fn named_paths(text: &str) -> Vec<String> {
    const ROOTS: [&str; 8] = [
        "src/",
        "tests/",
        "scripts/",
        "benches/",
        "examples/",
        "charts/",
        "crds/",
        "docs/",
    ];
    let mut out = Vec::new();
    for span in spans(text) {
        for word in span.split(|c: char| c.is_whitespace() || "(),;=\"'[]".contains(c)) {
            let word = word.trim_end_matches(['.', ':']);
            let Some(root) = ROOTS.iter().find(|r| word.starts_with(*r)) else {
                continue;
            };
            if word.contains(['*', '<', '{', '$'])
                || word.contains("X.Y")
                || word.len() == root.len()
            {
                continue;
            }
            let path = word.split([':', '#']).next().unwrap_or(word);
            out.push(path.to_owned());
        }
    }
    out
}

/// Fails with `what` and every finding, once each, if there is any.
fn assert_none(what: &str, mut found: Vec<String>) {
    found.sort();
    found.dedup();
    assert!(found.is_empty(), "{what}:\n{}", found.join("\n"));
}

/// Every path of the tree a doc names exists (the reliability page named
/// 19 test files that had moved).
#[test]
fn every_path_a_doc_names_exists() {
    let mut missing = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for path in named_paths(&text) {
            checked += 1;
            if !Path::new(ROOT).join(&path).exists() {
                missing.push(format!("{}: {path}", page.display()));
            }
        }
    }
    assert_none("no such path", missing);
    assert!(
        checked > 50,
        "only {checked} paths found: is the parser right?"
    );
}

/// Every file a folder of `dir` holds, relative to the root.
fn files_under(dir: &str) -> Vec<String> {
    fn walk(at: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(at).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else {
                out.push(path);
            }
        }
    }
    let mut out = Vec::new();
    walk(&Path::new(ROOT).join(dir), &mut out);
    out.iter()
        .map(|p| p.strip_prefix(ROOT).unwrap().display().to_string())
        .collect()
}

/// docs/layout.md names every source file and script: by its path, its
/// file name, or (a module) its stem in backticks; a `mod.rs` by its
/// folder; the pins under scripts/ by their folder.
#[test]
fn the_layout_names_every_source_file_and_script() {
    let layout = std::fs::read_to_string(Path::new(ROOT).join("docs/layout.md")).unwrap();
    let spans = spans(&layout).join(" ");
    let named = |word: &str| {
        spans
            .split(|c: char| c.is_whitespace() || "(),;".contains(c))
            .any(|w| w == word)
    };
    let mut omitted = Vec::new();
    for file in files_under("src").into_iter().chain(files_under("scripts")) {
        let path = Path::new(&file);
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let stem = path.file_stem().unwrap().to_string_lossy().to_string();
        let parent = path.parent().unwrap();
        let folder = parent.file_name().unwrap().to_string_lossy().to_string();
        // A pin folder's files (scripts/control-plane/<version>/go.mod) go
        // by the folder under scripts/.
        let pins = file
            .strip_prefix("scripts/")
            .and_then(|rest| rest.split_once('/'))
            .map(|(top, _)| format!("{top}/"));
        let ok = layout.contains(&file)
            || named(&name)
            || (name == "mod.rs" && (named(&format!("{folder}/")) || named(&folder)))
            || (file.starts_with("src/") && named(&stem))
            || pins.is_some_and(|top| layout.contains(&top));
        if !ok {
            omitted.push(file);
        }
    }
    omitted.sort();
    assert!(
        omitted.is_empty(),
        "docs/layout.md does not name:\n{}",
        omitted.join("\n")
    );
}

/// The flags of every `model-residency` subcommand, from its `--help`.
fn our_flags() -> std::collections::BTreeSet<String> {
    let bin = env!("CARGO_BIN_EXE_model-residency");
    let help = |args: &[&str]| {
        let out = std::process::Command::new(bin).args(args).output().unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let top = help(&["--help"]);
    let mut subcommands: Vec<String> = Vec::new();
    let mut in_commands = false;
    for line in top.lines() {
        if line.starts_with("Commands:") {
            in_commands = true;
            continue;
        }
        if in_commands {
            match line.split_whitespace().next() {
                Some(word) if line.starts_with("  ") => subcommands.push(word.to_owned()),
                _ => in_commands = false,
            }
        }
    }
    assert!(subcommands.len() > 5, "{top}");
    let mut flags = std::collections::BTreeSet::new();
    // The benches' and scripts' own flags, as their sources spell them.
    for dir in ["benches", "scripts"] {
        for file in files_under(dir) {
            let text = std::fs::read_to_string(Path::new(ROOT).join(&file)).unwrap_or_default();
            for piece in text.split(['"', '\'', ' ', '(', ')', '[', ']', '|', ',', '=']) {
                if let Some(flag) = piece.strip_prefix("--")
                    && !flag.is_empty()
                    && flag.chars().all(|c| c.is_ascii_lowercase() || c == '-')
                {
                    flags.insert(flag.to_owned());
                }
            }
        }
    }
    for sub in subcommands
        .iter()
        .map(|s| vec![s.as_str(), "--help"])
        .chain([vec!["--help"]])
    {
        for word in help(&sub).split(|c: char| c.is_whitespace() || c == ',' || c == '=') {
            if let Some(flag) = word.strip_prefix("--") {
                flags.insert(flag.trim_end_matches(['.', ')']).to_owned());
            }
        }
    }
    flags
}

/// Flags of other programs the docs show: kubectl's, the Kubernetes
/// components' (kube-apiserver, kubelet), cargo's and the test harness's,
/// nsenter's, jeprof's, and the model servers' (vLLM, SGLang).
const OTHER_FLAGS: &[&str] = &[
    // kubectl
    "field-selector",
    "field-manager",
    "force-conflicts",
    "replicas",
    "server-side",
    "sort-by",
    "subresource",
    "type",
    // kube-apiserver, kubelet
    "authorization-mode",
    "kube-api-qps",
    // cargo, the test harness
    "features",
    "nocapture",
    // nsenter
    "target",
    "net",
    "mount",
    // jeprof
    "text",
    "cum",
    // vLLM, SGLang
    "enable-sleep-mode",
    "served-model-name",
    "enable-memory-saver",
    "enable-weights-cpu-backup",
    "enable-lora",
    "max-loras",
    "max-cpu-loras",
    "tensor-parallel-size",
    "distributed-executor-backend",
    "gpu-memory-utilization",
];

/// Every `--flag` a doc shows is one of ours (in some subcommand's
/// `--help`) or one of another program's listed in [`OTHER_FLAGS`].
#[test]
fn every_flag_a_doc_shows_is_in_the_binarys_help() {
    let ours = our_flags();
    let mut unknown = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for span in spans(&text) {
            for word in span.split(|c: char| c.is_whitespace() || "(),;[]|`\"'".contains(c)) {
                let Some(flag) = word.strip_prefix("--") else {
                    continue;
                };
                let flag = flag.split('=').next().unwrap_or(flag);
                let flag = flag.trim_end_matches(['.', ':']);
                if flag.is_empty() || !flag.chars().all(|c| c.is_ascii_lowercase() || c == '-') {
                    continue;
                }
                if !ours.contains(flag) && !OTHER_FLAGS.contains(&flag) {
                    unknown.push(format!("{}: --{flag}", page.display()));
                }
            }
        }
    }
    assert_none("flags no --help shows", unknown);
}

/// Every test a doc names by its function (a backticked snake_case name
/// of four words or more that is not a metric, a field or a label) is a
/// function of the tree.
#[test]
fn every_test_a_doc_names_exists() {
    let mut fns = std::collections::BTreeSet::new();
    for dir in ["src", "tests", "benches"] {
        for file in files_under(dir) {
            let text = std::fs::read_to_string(Path::new(ROOT).join(&file)).unwrap_or_default();
            for piece in text.split("fn ").skip(1) {
                let name: String = piece
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                fns.insert(name);
            }
        }
    }
    let mut missing = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        // A setting (`key = value`) is no test; a path's parts are not
        // either.
        for span in spans(&text).into_iter().filter(|s| !s.contains(" = ")) {
            let words = span.split_whitespace().filter(|w| !w.contains(['/', '.']));
            for word in words.flat_map(|w| {
                w.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
            }) {
                let name = word.rsplit("::").next().unwrap_or(word);
                let looks_like_a_test = name.matches('_').count() >= 3
                    && name
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
                    && !name.starts_with("model_residency_")
                    && !name.ends_with("_total")
                    && !name.ends_with("_seconds")
                    && !name.ends_with("_bytes");
                if !looks_like_a_test {
                    continue;
                }
                checked += 1;
                if !fns.contains(name) {
                    missing.push(format!("{}: {name}", page.display()));
                }
            }
        }
    }
    assert_none("no such function", missing);
    assert!(
        checked > 30,
        "only {checked} names found: is the parser right?"
    );
}
