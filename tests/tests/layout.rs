//! The house stays walkable: within each crate no module imports one that imports it back
//! (directly or through others), and no source file has more than 650 lines before its tests.
//! Imports are read from the sources (`crate::` and `super::` paths, doc comments aside), as a
//! reader follows them.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const CRATES: &[&str] = &[
    "rdmabox/src",
    "proto/src",
    "daemon/src",
    "client/src",
    "mem-server/src",
    "fs-client/src",
    "io/src",
    "admin/src",
];
const MAX_LINES: usize = 650;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The module path of source file `p` of the crate at `root` ("" for the crate root), or None
/// for binaries and test modules.
fn module_of(root: &Path, p: &Path) -> Option<Vec<String>> {
    let rel = p.strip_prefix(root).unwrap().with_extension("");
    let mut parts: Vec<String> = rel.iter().map(|s| s.to_string_lossy().into()).collect();
    if parts[0] == "bin" || parts.iter().any(|p| p == "tests") {
        return None;
    }
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    Some(parts)
}

/// The code of a file before its `#[cfg(test)] mod tests`, without comments.
fn code(p: &Path) -> String {
    let text = std::fs::read_to_string(p).unwrap();
    let text = text.split("#[cfg(test)]\nmod tests {").next().unwrap();
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The module paths `src` names after `prefix` (`crate::` or `super::`), braces expanded one
/// level: `crate::a::{b, c::D}` names `a::b` and `a::c`.
fn named(src: &str, prefix: &str) -> Vec<Vec<String>> {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = Vec::new();
    for (at, _) in src.match_indices(prefix) {
        if src[..at].ends_with(|c: char| ident(c) || c == ':') {
            continue;
        }
        let rest = &src[at + prefix.len()..];
        let path: String = rest.chars().take_while(|&c| ident(c) || c == ':').collect();
        let mut head: Vec<String> = path
            .split("::")
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect();
        if rest[path.len()..].starts_with('{') && (path.is_empty() || path.ends_with("::")) {
            let inner = &rest[path.len() + 1..];
            let inner = &inner[..inner.find('}').unwrap_or(inner.len())];
            for item in inner.split(',') {
                let first: String = item.trim().chars().take_while(|&c| ident(c)).collect();
                if !first.is_empty() {
                    let mut p = head.clone();
                    p.push(first);
                    out.push(p);
                }
            }
        } else if !head.is_empty() {
            out.push(std::mem::take(&mut head));
        }
    }
    out
}

/// The longest module of `modules` that `path` starts with.
fn resolve(modules: &BTreeSet<Vec<String>>, path: &[String]) -> Option<Vec<String>> {
    (1..=path.len())
        .rev()
        .map(|n| path[..n].to_vec())
        .find(|p| modules.contains(p))
}

fn cycles(graph: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Vec<Vec<String>> {
    // Tarjan's strongly connected components.
    struct S<'a> {
        g: &'a BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        index: BTreeMap<&'a Vec<String>, usize>,
        low: BTreeMap<&'a Vec<String>, usize>,
        stack: Vec<&'a Vec<String>>,
        found: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut S<'a>, v: &'a Vec<String>) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        for w in &s.g[v] {
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if s.stack.contains(&w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = s.stack.pop() {
                comp.push(w.join("::"));
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                s.found.push(comp);
            }
        }
    }
    let mut s = S {
        g: graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        found: Vec::new(),
    };
    for v in graph.keys() {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.found
}

#[test]
fn no_module_imports_one_that_imports_it_back() {
    let mut all = Vec::new();
    for krate in CRATES {
        let root = repo().join(krate);
        let mut files = Vec::new();
        sources(&root, &mut files);
        let mut deps: BTreeMap<Vec<String>, Vec<Vec<String>>> = BTreeMap::new();
        for f in &files {
            let Some(m) = module_of(&root, f) else {
                continue;
            };
            let src = code(f);
            let mut names = named(&src, "crate::");
            let parent = &m[..m.len().saturating_sub(1)];
            for p in named(&src, "super::") {
                names.push([parent.to_vec(), p].concat());
            }
            deps.entry(m).or_default().extend(names);
        }
        let modules: BTreeSet<Vec<String>> = deps.keys().cloned().collect();
        // A sanity check of the module finder; the admin binary is one file.
        assert!(
            modules.len() > 4 || *krate == "admin/src",
            "{krate}: only {} modules found",
            modules.len()
        );
        let nested = |a: &Vec<String>, b: &Vec<String>| a.starts_with(b) || b.starts_with(a);
        let graph: BTreeMap<_, BTreeSet<_>> = deps
            .iter()
            .map(|(m, names)| {
                let to = names
                    .iter()
                    .filter_map(|p| resolve(&modules, p))
                    .filter(|d| !nested(m, d))
                    .collect();
                (m.clone(), to)
            })
            .collect();
        for c in cycles(&graph) {
            all.push(format!("{krate}: {}", c.join(" <-> ")));
        }
    }
    assert!(all.is_empty(), "import circles:\n{}", all.join("\n"));
}

#[test]
fn no_source_file_is_longer_than_a_reader_can_hold() {
    let mut long = Vec::new();
    for krate in CRATES {
        let mut files = Vec::new();
        sources(&repo().join(krate), &mut files);
        for f in files {
            let text = std::fs::read_to_string(&f).unwrap();
            let is_tests = f.file_stem().is_some_and(|s| s == "tests" || s == "fake")
                || f.iter().any(|c| c == "tests");
            // Up to an inline test module: a `mod tests;` declaration leaves the code counted.
            let before_tests = text
                .split("#[cfg(test)]\nmod tests {")
                .next()
                .unwrap()
                .lines()
                .count();
            if !is_tests && before_tests > MAX_LINES {
                long.push(format!("{} ({before_tests} lines)", f.display()));
            }
        }
    }
    assert!(
        long.is_empty(),
        "over {MAX_LINES} lines before the tests:\n{}",
        long.join("\n")
    );
}

#[test]
fn the_circle_finder_finds_a_circle() {
    let m = |s: &str| s.split("::").map(String::from).collect::<Vec<_>>();
    let graph = BTreeMap::from([
        (m("a"), BTreeSet::from([m("b")])),
        (m("b"), BTreeSet::from([m("c")])),
        (m("c"), BTreeSet::from([m("a")])),
        (m("d"), BTreeSet::from([m("a")])),
    ]);
    assert_eq!(cycles(&graph), vec![vec!["a", "b", "c"]]);
    let src = "use crate::x::{y, z::W};\nuse super::{p, q};\nlet v = crate::r::s();";
    assert_eq!(named(src, "crate::"), vec![m("x::y"), m("x::z"), m("r::s")]);
    assert_eq!(named(src, "super::"), vec![m("p"), m("q")]);
}
