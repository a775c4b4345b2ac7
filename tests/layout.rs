//! The crate's modules depend one way: no module imports one that imports it back (an
//! import circle), the fan-in's statements stay in their one home, and no SQL is written
//! outside `store/`. Read from the sources, so that a change that breaks it fails here.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Every `.rs` file under `dir`.
fn sources(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir).expect("src readable") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            files.extend(sources(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files
}

/// The top-level module a file belongs to (`src/worker/acks.rs` -> `worker`).
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).expect("under src");
    let first = rel.components().next().expect("a component");
    first
        .as_os_str()
        .to_string_lossy()
        .trim_end_matches(".rs")
        .to_owned()
}

/// The code of a file without its comments (doc links name modules without importing).
fn code(file: &Path) -> String {
    fs::read_to_string(file)
        .expect("a source file")
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The top-level modules a piece of code names as `crate::name`, or in `use crate::{..}`.
fn named_modules(code: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                let name: String = item
                    .trim()
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                    .collect();
                if !name.is_empty() {
                    names.insert(name);
                }
            }
            continue;
        }
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || *c == '_' || c.is_ascii_digit())
            .collect();
        if !name.is_empty() {
            names.insert(name);
        }
    }
    names
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn no_module_imports_one_that_imports_it_back() {
    let src = src();
    let mut deps: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in sources(&src) {
        let module = module_of(&src, &file);
        let named = named_modules(&code(&file));
        deps.entry(module.clone())
            .or_default()
            .extend(named.into_iter().filter(|m| *m != module));
    }
    assert!(
        deps.contains_key("engine") && deps["worker"].contains("engine"),
        "the scan found no imports: {deps:?}"
    );
    // Depth-first search for a cycle through modules of the crate.
    fn visit(
        m: &str,
        deps: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == m) {
            let mut cycle = path[at..].to_vec();
            cycle.push(m.to_owned());
            return Some(cycle);
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_owned());
        for next in deps.get(m).into_iter().flatten() {
            if deps.contains_key(next) {
                if let Some(cycle) = visit(next, deps, path, done) {
                    return Some(cycle);
                }
            }
        }
        path.pop();
        done.insert(m.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    for m in deps.keys() {
        if let Some(cycle) = visit(m, &deps, &mut Vec::new(), &mut done) {
            panic!("import circle: {}", cycle.join(" -> "));
        }
    }
}

#[test]
fn the_counters_move_only_in_the_fan_in_module() {
    let src = src();
    let home = src.join("store").join("fan_in.rs");
    let mut found = 0;
    for file in sources(&src) {
        let code = code(&file);
        // A statement that moves a countdown: `SET remaining = ... remaining -/+ ...`.
        let moves = code.matches("SET remaining = ").count();
        if file == home {
            found = moves;
        } else if file != src.join("store").join("audit.rs") {
            // The auditor's repair sets counters from a re-count, under `locks::counters`.
            assert_eq!(
                moves,
                0,
                "{} moves a counter outside store/fan_in.rs",
                file.display()
            );
        }
    }
    assert!(
        found >= 4,
        "store/fan_in.rs moves no counter: the check reads nothing"
    );
}

#[test]
fn sql_stays_under_store() {
    let src = src();
    for file in sources(&src) {
        if file.starts_with(src.join("store")) {
            continue;
        }
        let code = code(&file);
        // Any of sqlx's statement builders: query, query_as, query_scalar, query_with,
        // turbofished or not, and raw_sql.
        assert!(
            !code.contains("sqlx::query") && !code.contains("sqlx::raw_sql"),
            "{} runs SQL outside store/",
            file.display()
        );
    }
}
