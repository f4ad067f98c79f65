//! `mamba3 generate` as a user runs it: greedy output equal to the engine's own loop and
//! to the server's, state save and resume, seeds, and clear refusals.

mod serve_util;

use mamba3::serve::client::post_json;
use mamba3::text::{ModelSource, Tokenizer};
use serde_json::json;
use serve_util::*;
use std::process::{Command, Output};

fn mamba3(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mamba3"))
        .args(args)
        .output()
        .expect("run mamba3")
}

fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "mamba3 failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout.clone()).unwrap()
}

fn parse_ids(s: &str) -> Vec<u32> {
    s.split_whitespace().map(|t| t.parse().unwrap()).collect()
}

#[test]
fn greedy_generate_equals_engine_loop_and_server() {
    let dir = model_dir(true, true);
    let d = dir.path().to_str().unwrap();
    let tok = Tokenizer::from_file(&dir.path().join("tokenizer.json")).unwrap();
    let prompt = "In the beginning";
    let p = tok.encode(prompt, true).unwrap();
    let want = engine_greedy(&load(dir.path()), &p, 20, &tok.eos_ids);

    let greedy = [
        "generate",
        "--model",
        d,
        "--prompt",
        prompt,
        "--max-tokens",
        "20",
        "--temperature",
        "0",
    ];
    let o = mamba3(&[&greedy[..], &["--print-ids"]].concat());
    assert_eq!(parse_ids(&ok(&o)), want);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        stderr.contains(&format!("prompt {} tokens", p.len())),
        "{stderr}"
    );
    assert!(stderr.contains("tok/s"), "{stderr}");

    // Text mode streams the same tokens' text (modulo how broken bytes are marked).
    let o = mamba3(&greedy);
    let text = ok(&o);
    let h = start(ModelSource::Dir(dir.path().to_path_buf()), |_| {});
    let r = post_json(
        h.addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 20, "temperature": 0, "return_token_ids": true}),
    )
    .unwrap();
    let v = r.json();
    assert_eq!(ids(&v["choices"][0]["token_ids"]), want, "server == engine");
    // The prompt is echoed first (--no-echo leaves it out).
    assert_eq!(
        text.strip_suffix('\n').unwrap(),
        format!("{prompt}{}", v["choices"][0]["text"].as_str().unwrap()),
        "generate == server"
    );

    // The prompt from stdin.
    let mut child = Command::new(env!("CARGO_BIN_EXE_mamba3"))
        .args([
            "generate",
            "--model",
            d,
            "--max-tokens",
            "20",
            "--temperature",
            "0",
            "--print-ids",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(prompt.as_bytes())
        .unwrap();
    let o = child.wait_with_output().unwrap();
    assert_eq!(parse_ids(&ok(&o)), want);
}

#[test]
fn seeds_and_sampling_options() {
    let dir = model_dir(true, false);
    let d = dir.path().to_str().unwrap();
    let run = |seed: &str| {
        ok(&mamba3(&[
            "generate",
            "--model",
            d,
            "--prompt",
            "abc",
            "--max-tokens",
            "30",
            "--temperature",
            "1.0",
            "--top-p",
            "0.95",
            "--top-k",
            "40",
            "--seed",
            seed,
            "--print-ids",
        ]))
    };
    assert_eq!(run("5"), run("5"));
    assert_ne!(run("5"), run("6"));
}

#[test]
fn save_and_resume_a_text() {
    let dir = model_dir(false, false);
    let d = dir.path().to_str().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let (p1, p2, st) = (
        tmp.path().join("p1.json"),
        tmp.path().join("p2.json"),
        tmp.path().join("s.safetensors"),
    );
    std::fs::write(&p1, "[5, 6, 7, 8]").unwrap();
    std::fs::write(&p2, "[9, 10]").unwrap();
    let first = parse_ids(&ok(&mamba3(&[
        "generate",
        "--model",
        d,
        "--input-ids",
        p1.to_str().unwrap(),
        "--max-tokens",
        "6",
        "--temperature",
        "0",
        "--save-state",
        st.to_str().unwrap(),
    ])));
    assert_eq!(first.len(), 6);
    let o = mamba3(&[
        "generate",
        "--model",
        d,
        "--input-ids",
        p2.to_str().unwrap(),
        "--max-tokens",
        "6",
        "--temperature",
        "0",
        "--load-state",
        st.to_str().unwrap(),
    ]);
    let second = parse_ids(&ok(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("after 10 from the state"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    // One unbroken run over the whole text gives the same continuation.
    let mut whole = vec![5, 6, 7, 8];
    whole.extend(&first);
    whole.extend([9, 10]);
    assert_eq!(second, engine_greedy(&load(dir.path()), &whole, 6, &[]));
}

#[test]
fn refusals_are_clear() {
    let dir = model_dir(false, false);
    let d = dir.path().to_str().unwrap();
    let o = mamba3(&["generate", "--model", d, "--prompt", "hello"]);
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("no tokenizer.json") && e.contains("--input-ids"),
        "{e}"
    );
    // Without --model: the built-in default model, as the README's first command runs it.
    let o = mamba3(&[
        "generate",
        "And God said",
        "--max-tokens",
        "40",
        "--temperature",
        "0",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.trim().len() >= 20, "default model produced {text:?}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("generated 40 tokens"));
    let o = mamba3(&["generate", "--model", "/nonexistent/dir", "--prompt", "x"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("does not exist"));
}

#[test]
fn timeline_marks_the_start_up_stages_in_order() {
    let args = [
        "generate",
        "And God said",
        "--max-tokens",
        "4",
        "--temperature",
        "0",
        "--device",
        "cpu",
    ];
    let run = |timeline: Option<&str>| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_mamba3"));
        c.args(args).env_remove("MAMBA3_TIMELINE");
        if let Some(t) = timeline {
            c.env("MAMBA3_TIMELINE", t);
        }
        c.output().expect("run mamba3")
    };
    let (plain, timed) = (run(None), run(Some("1")));
    // The timeline only adds lines to stderr.
    assert_eq!(ok(&plain), ok(&timed));
    assert!(!String::from_utf8_lossy(&plain.stderr).contains("[timeline]"));
    let err = String::from_utf8_lossy(&timed.stderr);
    let marks: Vec<(f64, &str)> = err
        .lines()
        .filter_map(|l| l.strip_prefix("[timeline]"))
        .map(|l| {
            let secs = l.split_whitespace().next().unwrap();
            let label = l.split("ms  ").nth(1).unwrap_or("");
            (secs.parse().expect("seconds"), label)
        })
        .collect();
    let labels: Vec<&str> = marks.iter().map(|m| m.1).collect();
    assert_eq!(labels.len(), 5, "{err}");
    assert_eq!(
        labels[..3],
        [
            "process started",
            "tokenizer read",
            "checkpoint read and converted"
        ],
        "{err}"
    );
    assert!(labels[3].starts_with("model ready on cpu"), "{err}");
    assert_eq!(labels[4], "first token sampled", "{err}");
    assert!(marks.windows(2).all(|w| w[0].0 <= w[1].0), "{err}");
}
