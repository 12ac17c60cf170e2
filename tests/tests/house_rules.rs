//! House rules that hold without a reviewer (issue 73, item 5): no function outside tests
//! returns `Result<_, String>` (an error is a type: the engine's `Error` or `Invalid`, the
//! transport's `Error`, the GPU path's `GpuError`), checked over every crate's sources.

use std::path::{Path, PathBuf};

/// The workspace's root (this crate is `tests/`).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace")
        .to_path_buf()
}

/// Every `.rs` file under `dir` that is not test code: `tests.rs` files, `tests/` folders,
/// fuzz targets and build output are left out.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_owned();
        if p.is_dir() {
            if !matches!(name.as_str(), "target" | "tests" | "fuzz" | "python" | ".ramjet") {
                sources(&p, out);
            }
        } else if name.ends_with(".rs") && name != "tests.rs" {
            out.push(p);
        }
    }
}

/// Whether the generic arguments starting at `s` (just past `Result<`) end with `String` as
/// the error type.
fn error_is_string(s: &str) -> bool {
    // The error type is the second argument: none with one (`io::Result<String>`).
    let (mut depth, mut last) = (0i32, None::<usize>);
    for (i, c) in s.char_indices() {
        match c {
            '<' | '(' | '[' => depth += 1,
            ')' | ']' => depth -= 1,
            '>' if depth == 0 => return last.is_some_and(|l| s[l..i].trim() == "String"),
            '>' => depth -= 1,
            ',' if depth == 0 => last = Some(i + 1),
            _ => {}
        }
    }
    false
}

/// The lines of `text` (a source file, named `name`) outside its tests that name a
/// `Result<_, String>`: `name:line: text` each.
fn string_results(name: &str, text: &str) -> Vec<String> {
    let mut hits = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.starts_with("#[cfg(test)]") {
            break; // the file's test module: the rest is tests
        }
        let code = line.split("//").next().unwrap_or_default();
        let mut at = 0;
        while let Some(i) = code[at..].find("Result<") {
            let start = at + i + "Result<".len();
            if error_is_string(&code[start..]) {
                hits.push(format!("{name}:{}: {}", n + 1, line.trim()));
                break;
            }
            at = start;
        }
    }
    hits
}

#[test]
fn no_function_outside_tests_returns_a_string_error() {
    let mut files = Vec::new();
    for dir in [
        "engine",
        "transport",
        "cuda",
        "bindings",
        "tools",
        "benches",
        "tests/src",
    ] {
        sources(&root().join(dir), &mut files);
    }
    assert!(
        files.len() > 100,
        "the scan found only {} files: the walk is wrong",
        files.len()
    );
    let hits: Vec<String> = files
        .iter()
        .flat_map(|p| {
            let text = std::fs::read_to_string(p).expect("a source file");
            string_results(&p.strip_prefix(root()).unwrap_or(p).display().to_string(), &text)
        })
        .collect();
    assert!(
        hits.is_empty(),
        "Result<_, String> outside tests (return the engine's Invalid or a typed error):\n{}",
        hits.join("\n")
    );
}

#[test]
fn the_scan_finds_a_planted_string_error_and_passes_typed_ones() {
    let planted = "fn a() -> Result<(), String> {}\nfn b() -> std::result::Result<Vec<String>, Invalid> {}\n\
                   fn c() -> Result<HashMap<String, u8>, String> {}\ntype T = Result<String, (u8, String)>;\n\
                   fn f() -> io::Result<String> {}\n// fn d() -> Result<(), String>\n#[cfg(test)]\nfn e() -> Result<(), String> {}\n";
    let hits = string_results("x.rs", planted);
    assert_eq!(hits.len(), 2, "{hits:?}");
    assert!(
        hits[0].starts_with("x.rs:1:") && hits[1].starts_with("x.rs:3:"),
        "{hits:?}"
    );
}
