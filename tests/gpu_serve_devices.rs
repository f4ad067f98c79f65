//! The server on GPUs: on one GPU (`--devices cuda:0`) greedy completions equal the GPU
//! engine's own greedy loop, a stop string cuts as the engine's generation loop does, and
//! `/metrics` reports the GPU's busy fraction under its label; on two GPUs or more
//! (`--devices all`) load spreads over them and a prompt that extends a cached prefix goes
//! to the GPU holding it (skipped, with the reason printed, on a machine with one GPU).
//! Run on a machine with a CUDA device:
//! `cargo test --release --features cuda --test gpu_serve_devices -- --include-ignored`.
#![cfg(feature = "cuda")]

mod serve_util;

use mamba3::engine::{cuda_device_count, Device, Model};
use mamba3::model::DType;
use mamba3::serve::client::{self, post_json};
use mamba3::serve::ServerHandle;
use mamba3::text::generate::generate;
use mamba3::text::{Continuation, GenParams, ModelSource, SamplingParams, Tokenizer};
use serde_json::json;
use serve_util::*;
use std::sync::Arc;
use std::time::Duration;

fn server(d: &tempfile::TempDir, devices: Vec<Device>) -> ServerHandle {
    start(ModelSource::Dir(d.path().to_path_buf()), |c| {
        c.device = devices[0];
        c.devices = devices;
        c.max_tokens_limit = 1_000_000;
    })
}

fn complete(h: &ServerHandle, body: serde_json::Value) -> serde_json::Value {
    let r = post_json(h.addr, "/v1/completions", &body).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

fn per(h: &ServerHandle, name: &str, r: usize) -> f64 {
    metric(h, &format!("{name}{{replica=\"{r}\",device=\"cuda:{r}\"}}"))
}

#[test]
#[ignore]
fn one_gpu_serves_the_engines_tokens_and_reports_its_busy_fraction() {
    let dir = model_dir(true, false);
    let h = server(&dir, vec![Device::Cuda(0)]);
    let model = Model::load(dir.path(), Device::Cuda(0), DType::F32).unwrap();
    for i in 0..3u32 {
        let p: Vec<u32> = (0..20 + 7 * i).map(|t| (t * 29 + i) % 256).collect();
        let v = complete(
            &h,
            json!({"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": true,
                   "return_token_ids": true}),
        );
        let got = ids(&v["choices"][0]["token_ids"]);
        assert_eq!(got, engine_greedy(&model, &p, 24, &[]), "prompt {i}");
    }
    // A stop string: the engine's loop (text checked before each next step) and the
    // server (checked one step behind) send the same tokens and text.
    let tok =
        Arc::new(Tokenizer::from_file(&fixtures().join("byte-tokenizer/tokenizer.json")).unwrap());
    let p: Vec<u32> = (0..30u32).map(|t| (t * 13 + 2) % 256).collect();
    let run = |stop: Vec<String>| {
        let params = GenParams {
            sampling: SamplingParams::greedy(),
            max_tokens: 32,
            stop,
            ignore_eos: true,
            ..Default::default()
        };
        let mut cont = Continuation::new(&params, &p, Some(tok.clone()));
        let mut st = model.new_state();
        let (mut ids, mut text) = (Vec::new(), String::new());
        generate(
            &model,
            &mut st,
            &p,
            None,
            &mut cont,
            4096,
            false,
            |_, _| {},
            |o| {
                ids.push(o.token);
                text.push_str(&o.text);
            },
        )
        .unwrap();
        (ids, text)
    };
    let (_, full) = run(vec![]);
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() > 12, "{full:?}");
    let stop: String = chars[8..10].iter().collect();
    let want = run(vec![stop.clone()]);
    let v = complete(
        &h,
        json!({"prompt": p, "max_tokens": 32, "temperature": 0, "ignore_eos": true,
               "stop": [stop], "return_token_ids": true}),
    );
    let c = &v["choices"][0];
    assert_eq!(ids(&c["token_ids"]), want.0);
    assert_eq!(c["text"].as_str().unwrap(), want.1);
    assert_eq!(c["finish_reason"], "stop");
    let busy = per(&h, "mamba3_device_busy_seconds_total", 0);
    let ratio = per(&h, "mamba3_device_busy_ratio", 0);
    println!("cuda:0 busy {busy:.4} s in all, {ratio:.3} of the last 4 s");
    assert!(busy > 0.0);
    assert!(ratio > 0.0 && ratio <= 1.0);
}

/// A stream that runs until dropped, once its first token has come.
fn endless(h: &ServerHandle, prompt: &[u32]) -> client::Events {
    let mut ev = client::stream(
        h.addr,
        "/v1/completions",
        &[],
        &json!({"prompt": prompt, "max_tokens": 1_000_000, "ignore_eos": true, "stream": true}),
    )
    .unwrap();
    assert!(ev.next_data().unwrap().is_some());
    ev
}

fn wait_active(h: &ServerHandle, want: [f64; 2]) {
    let t0 = std::time::Instant::now();
    loop {
        let got = [0, 1].map(|r| per(h, "mamba3_device_active_sequences", r));
        if got == want {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "active sequences per GPU {got:?}, want {want:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A prompt that carries a cached prefix a few tokens on: the server prefills the tail by
/// a replayed CUDA graph (`serve/scheduler/short_prefill.rs`), for each length from 2 to 32
/// and again for a length already captured; its greedy tokens equal the engine's eager
/// prefill of the prefix, then of the tail, then its decode.
#[test]
#[ignore]
fn short_turns_after_a_prefix_hit_give_the_engines_tokens() {
    let dir = model_dir(true, false);
    let h = server(&dir, vec![Device::Cuda(0)]);
    let model = Model::load(dir.path(), Device::Cuda(0), DType::F32).unwrap();
    let prefix: Vec<u32> = (0..96u32).map(|t| (t * 37 + 5) % 256).collect();
    let greedy = |p: &[u32]| {
        let v = complete(
            &h,
            json!({"prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": true,
                   "return_token_ids": true}),
        );
        ids(&v["choices"][0]["token_ids"])
    };
    greedy(&prefix);
    let hits = |h: &ServerHandle| metric(h, "mamba3_prefix_cache_hits_total");
    for (i, tail_len) in [2usize, 5, 16, 32, 5].into_iter().enumerate() {
        let tail: Vec<u32> = (0..tail_len as u32)
            .map(|t| (t * 11 + i as u32) % 256)
            .collect();
        let prompt = [prefix.as_slice(), &tail].concat();
        let before = hits(&h);
        let got = greedy(&prompt);
        assert!(hits(&h) > before, "tail {tail_len}: no prefix-cache hit");
        // the engine: the prefix, then the tail, each an eager pass; then its decode
        let want = engine_greedy_windows(&model, &[&prefix, &tail], 12, &[]);
        assert_eq!(
            got, want,
            "tail of {tail_len} tokens after the cached prefix"
        );
    }
    println!("short turns after a prefix hit (tails 2, 5, 16, 32, 5): the engine's greedy tokens");
}

#[test]
#[ignore]
fn several_gpus_spread_the_load_and_route_prefixes_to_their_holder() {
    let n = cuda_device_count();
    if n < 2 {
        println!("skipped: {n} CUDA device(s) on this machine; this test needs 2 or more");
        return;
    }
    let dir = model_dir(false, false);
    let h = server(&dir, (0..n).map(Device::Cuda).collect());
    let model = Model::load(dir.path(), Device::Cuda(1), DType::F32).unwrap();
    // Two streams: one on each of the first two GPUs (the others stay idle).
    let s1 = endless(&h, &[1, 2, 3]);
    let s2 = endless(&h, &[4, 5, 6]);
    if n == 2 {
        wait_active(&h, [1.0, 1.0]);
    }
    drop(s2);
    drop(s1);
    wait_active(&h, [0.0, 0.0]);
    // GPU 0 busy: the prefix goes elsewhere; then it comes back to its holder.
    let s1 = endless(&h, &[1, 2, 3]);
    let prefix: Vec<u32> = (0..200u32).map(|i| (i * 11 + 5) % 256).collect();
    let ask = |p: &[u32]| {
        let v = complete(
            &h,
            json!({"prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": true,
                   "return_token_ids": true}),
        );
        (
            ids(&v["choices"][0]["token_ids"]),
            v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap() as usize,
        )
    };
    assert_eq!(ask(&prefix).1, 0);
    assert!(per(&h, "mamba3_device_prefix_cache_bytes", 1) > 0.0);
    drop(s1);
    wait_active(&h, [0.0, 0.0]);
    let mut p = prefix.clone();
    p.extend_from_slice(&[9, 8, 7]);
    let (t, cached) = ask(&p);
    assert_eq!(cached, prefix.len());
    assert_eq!(per(&h, "mamba3_device_prefix_cache_hits_total", 1), 1.0);
    assert_eq!(t, engine_greedy(&model, &p, 8, &[]));
}
