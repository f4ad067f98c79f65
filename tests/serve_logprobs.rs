//! Log-probabilities over real HTTP: `/v1/completions` (`logprobs: n`, the legacy shape)
//! and `/v1/chat/completions` (`logprobs: true`, `top_logprobs: n`), plain and streamed.
//! Every value is checked against log_softmax in f64 of the engine's own raw logits of the
//! same position (before temperature, penalties and bias), the alternatives against the
//! row's true best; the shapes key by key; out-of-range requests get a 400 naming the field.

mod serve_util;

use mamba3::engine::{LogitsWant, Model};
use mamba3::serve::client::{self, post_json};
use mamba3::text::{ModelSource, Tokenizer};
use serde_json::{json, Value};
use serve_util::*;
use std::collections::BTreeSet;

fn tokenizer() -> Tokenizer {
    Tokenizer::from_file(&fixtures().join("byte-tokenizer/tokenizer.json")).unwrap()
}

/// The raw logits (`vocab_size` entries) each generated token was chosen from: after the
/// prompt, then after each token but the last.
fn rows(model: &Model, prompt: &[u32], generated: &[u32]) -> Vec<Vec<f32>> {
    let v = model.dims().vocab_size;
    let mut st = model.new_state();
    let mut row = model
        .prefill(prompt, &mut st, LogitsWant::Last)
        .unwrap()
        .data;
    let mut out = vec![row[..v].to_vec()];
    for &t in &generated[..generated.len() - 1] {
        row = model.decode(&[t], &mut [&mut st]).unwrap().data;
        out.push(row[..v].to_vec());
    }
    out
}

/// log_softmax of `row` in f64, and its ids best first (ties to the lower id).
fn reference(row: &[f32]) -> (Vec<f64>, Vec<u32>) {
    let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
    let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
    let lp = row.iter().map(|&x| x as f64 - max - sum.ln()).collect();
    let mut order: Vec<u32> = (0..row.len() as u32).collect();
    order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
    (lp, order)
}

fn close(got: &Value, want: f64) -> bool {
    let g = got.as_f64().unwrap_or_else(|| panic!("{got} is no number"));
    (g - want).abs() <= 1e-6 * want.abs().max(1.0)
}

fn name(tok: &Tokenizer, id: u32) -> String {
    tok.decode(&[id], false).unwrap()
}

fn keys(v: &Value) -> BTreeSet<&str> {
    v.as_object().unwrap().keys().map(String::as_str).collect()
}

/// Check a completion's legacy `logprobs` against the engine: `n` alternatives.
fn check_completion(lp: &Value, tok: &Tokenizer, rows: &[Vec<f32>], ids: &[u32], n: usize) {
    assert_eq!(
        keys(lp),
        BTreeSet::from(["tokens", "token_logprobs", "top_logprobs", "text_offset"])
    );
    assert_eq!(lp["tokens"].as_array().unwrap().len(), ids.len());
    let mut offset = 0;
    for (k, (&id, row)) in ids.iter().zip(rows).enumerate() {
        let (want, order) = reference(row);
        assert_eq!(lp["tokens"][k], name(tok, id));
        assert!(
            close(&lp["token_logprobs"][k], want[id as usize]),
            "token {k}: {lp}"
        );
        assert_eq!(lp["text_offset"][k], offset);
        offset += name(tok, id).chars().count();
        // The n best, named (two ids of one text are one key: the better one's value).
        let top = lp["top_logprobs"][k].as_object().unwrap();
        let mut names = BTreeSet::new();
        for &t in &order[..n] {
            if names.insert(name(tok, t)) {
                assert!(close(&top[&name(tok, t)], want[t as usize]), "{top:?}");
            }
        }
        assert_eq!(top.len(), names.len());
    }
}

/// Check a chat choice's `logprobs` (`{"content": [...]}`) against the engine.
fn check_chat(lp: &Value, tok: &Tokenizer, rows: &[Vec<f32>], ids: &[u32], n: usize) {
    assert_eq!(keys(lp), BTreeSet::from(["content"]));
    let content = lp["content"].as_array().unwrap();
    assert_eq!(content.len(), ids.len());
    let entry = |e: &Value, id: u32, want: f64| {
        let s = name(tok, id);
        assert_eq!(e["token"], s);
        assert_eq!(e["bytes"], json!(s.as_bytes()));
        assert!(close(&e["logprob"], want), "{e}");
    };
    for (e, (&id, row)) in content.iter().zip(ids.iter().zip(rows)) {
        let (want, order) = reference(row);
        assert_eq!(
            keys(e),
            BTreeSet::from(["token", "logprob", "bytes", "top_logprobs"])
        );
        entry(e, id, want[id as usize]);
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), n);
        for (a, &t) in top.iter().zip(&order) {
            assert_eq!(keys(a), BTreeSet::from(["token", "logprob", "bytes"]));
            entry(a, t, want[t as usize]);
        }
    }
}

#[test]
fn completions_report_the_models_log_probabilities() {
    let dir = model_dir(true, true);
    let h = start(ModelSource::Dir(dir.path().to_path_buf()), |_| {});
    let model = load(dir.path());
    let tok = tokenizer();
    let prompt = "The theory of state spaces";
    let p = tok.encode(prompt, true).unwrap();
    // Greedy, and drawn with temperature, top-k and penalties: the values are the raw
    // logits' all the same.
    let greedy = json!({"prompt": prompt, "max_tokens": 10, "temperature": 0,
                        "logprobs": 3, "return_token_ids": true, "ignore_eos": true});
    let drawn = json!({"prompt": prompt, "max_tokens": 10, "temperature": 1.3, "top_k": 5,
                       "seed": 7, "repetition_penalty": 1.5, "logit_bias": {"101": 4.0},
                       "logprobs": 0, "return_token_ids": true, "ignore_eos": true});
    for (body, n) in [(greedy, 3), (drawn, 0)] {
        let r = post_json(h.addr, "/v1/completions", &body).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let c = &r.json()["choices"][0];
        let got = ids(&c["token_ids"]);
        let rows = rows(&model, &p, &got);
        check_completion(&c["logprobs"], &tok, &rows, &got, n);

        // Streamed: one chunk per token, each with its own piece, offsets running on.
        let mut sbody = body.clone();
        sbody["stream"] = json!(true);
        let (_, sids, chunks) =
            read_stream(client::stream(h.addr, "/v1/completions", &[], &sbody).unwrap());
        assert_eq!(sids, got);
        let mut joined = json!({"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []});
        for ch in chunks
            .iter()
            .filter(|c| c["choices"][0]["logprobs"].is_object())
        {
            let piece = &ch["choices"][0]["logprobs"];
            assert_eq!(piece["tokens"].as_array().unwrap().len(), 1, "{ch}");
            for k in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
                let a = joined[k].as_array_mut().unwrap();
                a.extend(piece[k].as_array().unwrap().iter().cloned());
            }
        }
        assert_eq!(joined, c["logprobs"]);
    }
    // Without the field, `logprobs` is null as before.
    let r = post_json(
        h.addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 2}),
    )
    .unwrap();
    assert!(r.json()["choices"][0]["logprobs"].is_null());
}

#[test]
fn chat_reports_the_models_log_probabilities() {
    let dir = model_dir(true, true);
    let h = start(ModelSource::Dir(dir.path().to_path_buf()), |_| {});
    let model = load(dir.path());
    let tok = tokenizer();
    let msgs = json!([{"role": "user", "content": "Hi there"}]);
    let rendered = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi there\
                    <|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n";
    let p = tok.encode(rendered, false).unwrap();
    for n in [0usize, 2, 20] {
        let body = json!({"messages": msgs, "max_tokens": 8, "temperature": 0, "logprobs": true,
                          "top_logprobs": n, "return_token_ids": true, "ignore_eos": true});
        let r = post_json(h.addr, "/v1/chat/completions", &body).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        assert_eq!(v["usage"]["prompt_tokens"], p.len());
        let c = &v["choices"][0];
        let got = ids(&c["token_ids"]);
        let rows = rows(&model, &p, &got);
        check_chat(&c["logprobs"], &tok, &rows, &got, n);

        let mut sbody = body.clone();
        sbody["stream"] = json!(true);
        let (_, sids, chunks) =
            read_stream(client::stream(h.addr, "/v1/chat/completions", &[], &sbody).unwrap());
        assert_eq!(sids, got);
        let content: Vec<Value> = chunks
            .iter()
            .filter_map(|ch| ch["choices"][0]["logprobs"]["content"].as_array())
            .flatten()
            .cloned()
            .collect();
        assert_eq!(json!({ "content": content }), c["logprobs"]);
    }
    // `logprobs: true` alone: the chosen tokens', no alternatives.
    let r = post_json(
        h.addr,
        "/v1/chat/completions",
        &json!({"messages": msgs, "max_tokens": 3, "logprobs": true}),
    )
    .unwrap();
    let content = &r.json()["choices"][0]["logprobs"]["content"];
    assert_eq!(content.as_array().unwrap().len(), 3);
    assert_eq!(content[0]["top_logprobs"], json!([]));
}

#[test]
fn out_of_range_requests_name_the_field() {
    let dir = model_dir(true, true);
    let h = start(ModelSource::Dir(dir.path().to_path_buf()), |_| {});
    let cases: Vec<(&str, Value, &str, &str)> = vec![
        (
            "/v1/completions",
            json!({"prompt": "a", "logprobs": 21}),
            "logprobs",
            "`logprobs` must be an integer in 0..=20, found 21",
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "logprobs": -1}),
            "logprobs",
            "found -1",
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "logprobs": true}),
            "logprobs",
            "found true",
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "logprobs": 2, "top_logprobs": 2}),
            "top_logprobs",
            "/v1/completions takes `logprobs`",
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "echo": true, "logprobs": 1}),
            "echo",
            "`echo` is not supported",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "a"}], "logprobs": true,
                   "top_logprobs": 21}),
            "top_logprobs",
            "`top_logprobs` must be an integer in 0..=20, found 21",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "a"}], "logprobs": true,
                   "top_logprobs": -3}),
            "top_logprobs",
            "found -3",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}),
            "top_logprobs",
            "`logprobs` is not true",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "a"}], "logprobs": 3}),
            "logprobs",
            "`logprobs` must be true or false, found 3",
        ),
    ];
    for (route, body, field, needle) in cases {
        let r = post_json(h.addr, route, &body).unwrap();
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        let e = &r.json()["error"];
        assert_eq!(e["param"], field, "{body}: {e}");
        assert!(
            e["message"].as_str().unwrap().contains(needle),
            "{needle:?} not in {e}"
        );
    }
    // The server still answers.
    let r = post_json(
        h.addr,
        "/v1/completions",
        &json!({"prompt": "a", "max_tokens": 1, "logprobs": false}),
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
}
