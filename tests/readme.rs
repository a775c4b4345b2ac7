//! The README's example is `examples/readme.rs`, word for word: what it shows compiles
//! and prints what it says (`.ci/run` runs it and checks the line).

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
