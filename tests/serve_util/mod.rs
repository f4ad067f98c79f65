//! Helpers for the product-layer tests: tiny model directories (synthetic weights with the
//! byte-level test tokenizer), in-process servers, the engine's own greedy loop.
#![allow(dead_code)]

use mamba3::engine::{Device, LogitsWant, Model};
use mamba3::mixers::mamba3::Weights;
use mamba3::model::{Config, DType};
use mamba3::serve::{client, ServeConfig, ServerHandle};
use mamba3::text::ModelSource;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The byte-level BPE tokenizer fixture: 256 bytes, 8 merges, 5 special tokens (269).
pub const TOK_VOCAB: usize = 269;

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

pub fn tiny_config() -> Config {
    // vocab 269 → padded to 272: three padded head rows that must never be sampled.
    Config::synthetic(64, 2, 16, 16, 2, 1, TOK_VOCAB)
}

/// A model directory with synthetic weights; `tokenizer` copies the byte tokenizer,
/// `template` also its tokenizer_config.json (the chat template).
pub fn model_dir(tokenizer: bool, template: bool) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    Weights::synthetic(tiny_config(), DType::F32, 3)
        .unwrap()
        .save(dir.path())
        .unwrap();
    let src = fixtures().join("byte-tokenizer");
    if tokenizer {
        std::fs::copy(
            src.join("tokenizer.json"),
            dir.path().join("tokenizer.json"),
        )
        .unwrap();
    }
    if template {
        std::fs::copy(
            src.join("tokenizer_config.json"),
            dir.path().join("tokenizer_config.json"),
        )
        .unwrap();
    }
    dir
}

pub fn load(dir: &Path) -> Model {
    Model::load(dir, Device::Cpu, DType::F32).unwrap()
}

/// Start a server on a free loopback port and wait until it is ready.
pub fn start(source: ModelSource, tweak: impl FnOnce(&mut ServeConfig)) -> ServerHandle {
    let mut cfg = ServeConfig::new(source);
    cfg.addr = "127.0.0.1:0".parse().unwrap();
    tweak(&mut cfg);
    let h = mamba3::serve::spawn(cfg).unwrap();
    wait_ready(&h);
    h
}

pub fn wait_ready(h: &ServerHandle) {
    let t0 = Instant::now();
    loop {
        let r = client::get(h.addr, "/health").unwrap();
        if r.status == 200 {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "server not ready: {}",
            r.text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The engine's own greedy loop: one prefill, then decode the argmax over the real
/// vocabulary, `n` tokens (stopping early at any of `stop_ids`).
pub fn engine_greedy(model: &Model, prompt: &[u32], n: usize, stop_ids: &[u32]) -> Vec<u32> {
    engine_greedy_windows(model, &[prompt], n, stop_ids)
}

/// [`engine_greedy`] with the prompt prefilled as these windows, one pass each (as a
/// server continues a cached prefix).
pub fn engine_greedy_windows(
    model: &Model,
    windows: &[&[u32]],
    n: usize,
    stop_ids: &[u32],
) -> Vec<u32> {
    let vocab = model.dims().vocab_size;
    let mut st = model.new_state();
    let (last, before) = windows.split_last().expect("at least one window");
    for w in before {
        model.prefill(w, &mut st, LogitsWant::None).unwrap();
    }
    let mut logits = model.prefill(last, &mut st, LogitsWant::Last).unwrap().data;
    let mut out = Vec::new();
    for _ in 0..n {
        let row = &logits[..vocab];
        let t = mamba3::text::sampling::argmax(row);
        out.push(t);
        if stop_ids.contains(&t) {
            break;
        }
        logits = model.decode(&[t], &mut [&mut st]).unwrap().data;
    }
    out
}

/// A metric's value from /metrics.
pub fn metric(h: &ServerHandle, name: &str) -> f64 {
    let page = client::get(h.addr, "/metrics").unwrap().text();
    mamba3::serve::metrics::sample(&page, name).unwrap_or_else(|| panic!("no {name} in\n{page}"))
}

/// Poll a metric until `ok` holds (or fail after `secs`).
pub fn wait_metric(h: &ServerHandle, name: &str, secs: u64, ok: impl Fn(f64) -> bool) -> f64 {
    let t0 = Instant::now();
    loop {
        let v = metric(h, name);
        if ok(v) {
            return v;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(secs),
            "{name} stuck at {v}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Token ids and concatenated text of a streamed completion; asserts the stream ends with
/// `[DONE]`. Returns (text, token ids, chunks as JSON).
pub fn read_stream(mut ev: client::Events) -> (String, Vec<u32>, Vec<serde_json::Value>) {
    assert_eq!(ev.status, 200);
    let (mut text, mut ids, mut chunks) = (String::new(), Vec::new(), Vec::new());
    loop {
        let d = ev
            .next_data()
            .unwrap()
            .expect("stream ended without [DONE]");
        if d == "[DONE]" {
            assert!(ev.next_data().unwrap().is_none(), "data after [DONE]");
            break;
        }
        let v: serde_json::Value = serde_json::from_str(&d).unwrap();
        assert!(v.get("error").is_none(), "error in stream: {v}");
        if let Some(c) = v["choices"].get(0) {
            text.push_str(
                c["text"]
                    .as_str()
                    .or(c["delta"]["content"].as_str())
                    .unwrap_or(""),
            );
            if let Some(t) = c["token_ids"].as_array() {
                ids.extend(t.iter().map(|x| x.as_u64().unwrap() as u32));
            }
        }
        chunks.push(v);
    }
    (text, ids, chunks)
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("token_ids array")
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}
