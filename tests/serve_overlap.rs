//! The overlapped server (the emitter one turn behind the engine thread) against the
//! engine's own generation loop, which detokenizes and checks stop strings before each
//! next step: the same tokens and text for greedy and seeded sampling, stop strings cut
//! exactly (the token decoded one step late never reaches the client), the prefix state
//! cached after a late stop is the one after the last sent token, and `/metrics` shows
//! the busy fractions.

mod serve_util;

use mamba3::engine::Model;
use mamba3::serve::client::{self, post_json};
use mamba3::serve::ServerHandle;
use mamba3::text::generate::generate;
use mamba3::text::{Continuation, GenParams, ModelSource, SamplingParams, Tokenizer};
use serde_json::json;
use serve_util::*;
use std::sync::Arc;

fn dir_source(d: &tempfile::TempDir) -> ModelSource {
    ModelSource::Dir(d.path().to_path_buf())
}

fn tokenizer() -> Arc<Tokenizer> {
    Arc::new(Tokenizer::from_file(&fixtures().join("byte-tokenizer/tokenizer.json")).unwrap())
}

/// What the engine's own loop (`text::generate`, no overlap) gives: token ids, text and
/// finish reason.
fn engine_run(
    model: &Model,
    tok: &Arc<Tokenizer>,
    prompt: &[u32],
    params: &GenParams,
) -> (Vec<u32>, String, String) {
    let mut cont = Continuation::new(params, prompt, Some(tok.clone()));
    let mut state = model.new_state();
    let (mut ids, mut text, mut finish) = (Vec::new(), String::new(), String::new());
    generate(
        model,
        &mut state,
        prompt,
        None,
        &mut cont,
        4096,
        false,
        |_, _| {},
        |out| {
            ids.push(out.token);
            text.push_str(&out.text);
            if let Some(f) = out.finish {
                finish = f.as_str().to_string();
            }
        },
    )
    .unwrap();
    (ids, text, finish)
}

/// The request body of `params` (the fields the server reads).
fn body(prompt: &[u32], p: &GenParams) -> serde_json::Value {
    let s = &p.sampling;
    let mut b = json!({
        "prompt": prompt, "max_tokens": p.max_tokens, "temperature": s.temperature,
        "top_p": s.top_p, "top_k": s.top_k, "min_p": s.min_p,
        "repetition_penalty": s.repetition_penalty,
        "frequency_penalty": s.frequency_penalty, "presence_penalty": s.presence_penalty,
        "stop": p.stop, "ignore_eos": p.ignore_eos, "return_token_ids": true,
    });
    if let Some(seed) = s.seed {
        b["seed"] = json!(seed);
    }
    b
}

/// Streamed from the server: token ids, text and finish reason.
fn server_run(h: &ServerHandle, b: &serde_json::Value) -> (Vec<u32>, String, String) {
    let mut b = b.clone();
    b["stream"] = json!(true);
    let (text, ids, chunks) =
        read_stream(client::stream(h.addr, "/v1/completions", &[], &b).unwrap());
    let finish = chunks
        .iter()
        .rev()
        .find_map(|c| c["choices"].get(0)?["finish_reason"].as_str())
        .unwrap_or("")
        .to_string();
    (ids, text, finish)
}

fn prompt(i: usize) -> Vec<u32> {
    (0..6 + 3 * i as u32)
        .map(|t| (t * 37 + 11 * i as u32 + 5) % 256)
        .collect()
}

/// Greedy and seeded option sets, a third of them with stop strings.
fn params(i: usize, stops: &[String]) -> GenParams {
    let sampling = match i % 3 {
        0 => SamplingParams::greedy(),
        1 => SamplingParams {
            temperature: 0.9,
            top_p: 0.95,
            seed: Some(7 + i as u64),
            ..Default::default()
        },
        _ => SamplingParams {
            temperature: 1.2,
            top_k: 40,
            repetition_penalty: 1.2,
            seed: Some(99 + i as u64),
            ..Default::default()
        },
    };
    GenParams {
        sampling,
        max_tokens: 20 + i,
        stop: stops.to_vec(),
        ignore_eos: i.is_multiple_of(2),
        ..Default::default()
    }
}

#[test]
fn many_clients_get_the_engine_loops_tokens_and_text() {
    let dir = model_dir(true, false);
    let h = start(dir_source(&dir), |c| c.scheduler.max_batch = 6);
    let model = load(dir.path());
    let tok = tokenizer();
    // Stop strings taken from each prompt's own unstopped text, at its start, middle and
    // end, so that they cut on the first token, later ones, or not at all.
    let mut jobs = Vec::new();
    for i in 0..12 {
        let p = prompt(i);
        let mut gp = params(i, &[]);
        if i % 4 == 3 {
            let (_, text, _) = engine_run(&model, &tok, &p, &gp);
            let chars: Vec<char> = text.chars().collect();
            let at =
                [0, chars.len() / 3, chars.len() / 2][i % 3].min(chars.len().saturating_sub(2));
            gp.stop = vec![chars[at..(at + 2).min(chars.len())].iter().collect()];
        }
        let want = engine_run(&model, &tok, &p, &gp);
        jobs.push((body(&p, &gp), want));
    }
    let stopped = jobs.iter().filter(|(_, w)| w.2 == "stop").count();
    assert!(stopped >= 3, "only {stopped} runs stop");
    // All at once (more than the slots: some wait), each compared with the engine's loop.
    std::thread::scope(|s| {
        let h = &h;
        let handles: Vec<_> = jobs
            .iter()
            .map(|(b, want)| s.spawn(move || (server_run(h, b), want)))
            .collect();
        for (i, t) in handles.into_iter().enumerate() {
            let (got, want) = t.join().unwrap();
            assert_eq!(&got, want, "request {i}");
        }
    });
}

#[test]
fn a_stop_string_cuts_exactly_and_caches_the_state_after_the_last_sent_token() {
    let dir = model_dir(true, false);
    let h = start(dir_source(&dir), |_| {});
    let cold = start(dir_source(&dir), |c| c.scheduler.cache_bytes = 0);
    let model = load(dir.path());
    let tok = tokenizer();
    let p: Vec<u32> = (0..40u32).map(|i| (i * 13 + 2) % 256).collect();
    let greedy = |stop: Vec<String>| GenParams {
        sampling: SamplingParams::greedy(),
        max_tokens: 32,
        stop,
        ignore_eos: true,
        ..Default::default()
    };
    let (full, text, _) = engine_run(&model, &tok, &p, &greedy(vec![]));
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() > 12, "{text:?}");
    let stop: String = chars[8..10].iter().collect();
    let gp = greedy(vec![stop.clone()]);
    let want = engine_run(&model, &tok, &p, &gp);
    assert_eq!(want.2, "stop");
    assert!(want.0.len() < full.len());
    let got = server_run(&h, &body(&p, &gp));
    assert_eq!(
        got, want,
        "the same tokens (none past the stop) and the text cut before {stop:?}"
    );
    assert_eq!(got.1, text[..text.find(&stop).unwrap()]);

    // The next turn of the conversation extends prompt + every sent token: its state
    // comes from the cache, the one after the last sent token.
    let hits = metric(&h, "mamba3_prefix_cache_hit_tokens_total");
    let mut next = p.clone();
    next.extend_from_slice(&got.0);
    next.extend_from_slice(&[65, 66]);
    let ask = |h: &ServerHandle| {
        let r = post_json(
            h.addr,
            "/v1/completions",
            &json!({"prompt": next, "max_tokens": 12, "temperature": 0, "ignore_eos": true,
                    "return_token_ids": true}),
        )
        .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        (
            ids(&v["choices"][0]["token_ids"]),
            v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap() as usize,
        )
    };
    let (t, cached) = ask(&h);
    assert_eq!(cached, p.len() + got.0.len());
    assert_eq!(
        metric(&h, "mamba3_prefix_cache_hit_tokens_total") - hits,
        cached as f64
    );
    assert_eq!(t, ask(&cold).0, "cache hit == cold run");
    assert_eq!(t, engine_greedy(&model, &next, 12, &[]));
}

#[test]
fn metrics_show_the_busy_fractions_per_device() {
    let dir = model_dir(false, false);
    let h = start(dir_source(&dir), |_| {});
    for i in 0..4 {
        let r = post_json(
            h.addr,
            "/v1/completions",
            &json!({"prompt": prompt(i), "max_tokens": 64, "ignore_eos": true}),
        )
        .unwrap();
        assert_eq!(r.status, 200);
    }
    let label = "{replica=\"0\",device=\"cpu\"}";
    let m = |name: &str| metric(&h, &format!("{name}{label}"));
    let device = m("mamba3_device_busy_seconds_total");
    let engine = m("mamba3_engine_busy_seconds_total");
    assert!(device > 0.0, "device busy {device}");
    assert!(
        engine >= device,
        "engine turns {engine} s hold the device calls {device} s"
    );
    let ratio = m("mamba3_device_busy_ratio");
    assert!(ratio > 0.0 && ratio <= 1.0, "device busy ratio {ratio}");
    let ratio = m("mamba3_engine_busy_ratio");
    assert!(ratio > 0.0 && ratio <= 1.0, "engine busy ratio {ratio}");
    assert!(m("mamba3_emitter_busy_ratio") >= 0.0);
    assert_eq!(m("mamba3_device_generation_tokens_total"), 256.0);
    assert_eq!(metric(&h, "mamba3_generation_tokens_total"), 256.0);
    assert!(m("mamba3_device_decode_steps_total") >= 63.0);
    assert!(metric(&h, "mamba3_engine_seconds_total{phase=\"emit_wait\"}") >= 0.0);
    assert_eq!(m("mamba3_device_active_sequences"), 0.0);
}
