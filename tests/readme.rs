//! Documentation that tests can hold to: the README's example is `examples/readme.rs`, word
//! for word (so what it shows compiles, and `.ci/run` runs it and checks what it prints),
//! and every public async fn says what dropping its future does.

#[test]
fn the_readme_example_is_examples_readme_rs() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let example = std::fs::read_to_string(root.join("examples/readme.rs")).unwrap();
    assert!(
        readme.contains(&format!("```rust,no_run\n{example}```")),
        "README.md's example differs from examples/readme.rs: copy the file into the README"
    );
    assert!(
        example.contains(r#"// completed -> {"charged":19,"failed":1}"#),
        "the example says what it prints"
    );
}

/// Every public async fn of the library says what happens when its future is dropped.
#[test]
fn every_public_async_fn_documents_its_cancel_safety() {
    fn walk(dir: &std::path::Path, missing: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, missing);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let lines: Vec<&str> = text.lines().collect();
            for (i, line) in lines.iter().enumerate() {
                if !line.trim_start().starts_with("pub async fn ") {
                    continue;
                }
                let documented = lines[..i]
                    .iter()
                    .rev()
                    .take_while(|l| {
                        let l = l.trim_start();
                        l.starts_with("///") || l.starts_with("#[")
                    })
                    .any(|l| l.contains("# Cancel safety"));
                if !documented {
                    missing.push(format!("{}:{}", path.display(), i + 1));
                }
            }
        }
    }
    let mut missing = Vec::new();
    walk(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &mut missing,
    );
    assert!(
        missing.is_empty(),
        "public async fns without a `# Cancel safety` section: {missing:?}"
    );
}
