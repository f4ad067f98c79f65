//! The layers of `docs/architecture.md` hold: a top-level module imports only from the
//! modules below it in `ORDER` (non-test code; comments ignored), so no import goes up and
//! no cycle can form between folders.

use std::collections::BTreeSet;
use std::path::Path;

/// Highest first.
const ORDER: [&str; 15] = [
    "main", "lib", "cli", "serve", "text", "train", "engine", "mixers", "cpu", "cuda", "model",
    "timeline", "options", "atomic", "error",
];

fn rank(m: &str) -> Option<usize> {
    ORDER.iter().position(|&o| o == m)
}

fn visit(dir: &Path, out: &mut Vec<(String, String)>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            visit(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push((
                p.display().to_string(),
                std::fs::read_to_string(&p).unwrap(),
            ));
        }
    }
}

/// The top-level modules `text` names as `crate::<module>`, outside comments and tests.
fn imports(text: &str) -> BTreeSet<String> {
    let body = text.split("#[cfg(test)]").next().unwrap_or("");
    let mut found = BTreeSet::new();
    for line in body.lines().filter(|l| !l.trim_start().starts_with("//")) {
        for (i, _) in line.match_indices("crate::") {
            let rest = &line[i + 7..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            if !name.is_empty() {
                found.insert(name);
            }
        }
    }
    found
}

#[test]
fn imports_only_go_down() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    visit(&src, &mut files);
    let mut bad = Vec::new();
    for (path, text) in &files {
        let rel = path
            .strip_prefix(&src.display().to_string())
            .unwrap_or(path);
        let top = rel
            .trim_start_matches('/')
            .split('/')
            .next()
            .unwrap()
            .trim_end_matches(".rs")
            .to_string();
        let Some(own) = rank(&top) else {
            bad.push(format!("{path}: top-level module `{top}` is not in ORDER"));
            continue;
        };
        for m in imports(text) {
            // macros exported at the crate root (`crate::with_data!`) are not modules
            let Some(r) = rank(&m) else { continue };
            if m != top && r <= own {
                bad.push(format!(
                    "{path}: `{top}` imports from `{m}`, which is not below it"
                ));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "imports that go up the layers:\n{}",
        bad.join("\n")
    );
}
