//! The documentation names files that exist: every repository path in backticks in the README
//! and in docs/ (a crate's path from the repository root) is there, so that a move or a rename
//! cannot leave the newcomer's map pointing nowhere.

use std::path::{Path, PathBuf};

const ROOTS: &[&str] = &[
    "rdmabox/",
    "proto/",
    "mem-server/",
    "fs-client/",
    "io/",
    "tests/",
    "fuzz/",
    "iozone/",
    "scripts/",
    "dist/",
    "docs/",
];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The `code` spans of `text` that are repository paths.
fn paths(text: &str) -> Vec<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .filter(|s| ROOTS.iter().any(|r| s.starts_with(r)))
        .filter(|s| !s.contains(' ') && !s.contains('*') && !s.contains('{') && !s.contains('<'))
        .map(|s| s.trim_end_matches(':').to_string())
        .collect()
}

#[test]
fn every_path_the_docs_name_exists() {
    let root = repo();
    let mut docs = vec![root.join("README.md")];
    for e in std::fs::read_dir(root.join("docs")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "md") {
            docs.push(p);
        }
    }
    let mut missing = Vec::new();
    let mut checked = 0;
    for doc in &docs {
        let text = std::fs::read_to_string(doc).unwrap();
        for p in paths(&text) {
            checked += 1;
            if !root.join(&p).exists() {
                missing.push(format!("{}: {p}", doc.display()));
            }
        }
    }
    assert!(
        checked > 20,
        "only {checked} paths found: the scan is broken"
    );
    assert!(
        missing.is_empty(),
        "paths the docs name that do not exist:\n{}",
        missing.join("\n")
    );
}
