//! The server driven over real HTTP on loopback: every route, streaming, errors, the
//! prefix cache, continuous batching under load and disconnects.

mod serve_util;

use mamba3::serve::client::{self, get, post_json, request};
use mamba3::text::{ModelSource, Tokenizer};
use serde_json::json;
use serve_util::*;
use std::time::Duration;

fn dir_source(d: &tempfile::TempDir) -> ModelSource {
    ModelSource::Dir(d.path().to_path_buf())
}

fn tokenizer() -> Tokenizer {
    Tokenizer::from_file(&fixtures().join("byte-tokenizer/tokenizer.json")).unwrap()
}

#[test]
fn completions_plain_and_streaming_agree_with_the_engine() {
    let dir = model_dir(true, true);
    let h = start(dir_source(&dir), |_| {});
    let model = load(dir.path());
    let tok = tokenizer();
    let prompt = "The theory of state spaces";
    let ids_in = tok.encode(prompt, true).unwrap();
    let want = engine_greedy(&model, &ids_in, 24, &tok.eos_ids);
    let want_text = tok.decode(&want, true).unwrap();

    let body = json!({"model": h_name(&dir), "prompt": prompt, "max_tokens": 24, "temperature": 0,
                      "return_token_ids": true});
    let r = post_json(h.addr, "/v1/completions", &body).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    let c = &v["choices"][0];
    assert_eq!(ids(&c["token_ids"]), want);
    assert_eq!(c["text"].as_str().unwrap(), want_text);
    assert!(want.iter().all(|&t| (t as usize) < TOK_VOCAB));
    let fin = if want.len() < 24 { "stop" } else { "length" };
    assert_eq!(c["finish_reason"], fin);
    assert_eq!(v["usage"]["prompt_tokens"], ids_in.len());
    assert_eq!(v["usage"]["completion_tokens"], want.len());

    // The same, streamed, with usage in a last chunk.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let (text, sids, chunks) =
        read_stream(client::stream(h.addr, "/v1/completions", &[], &sbody).unwrap());
    assert_eq!(sids, want);
    assert_eq!(text, want_text);
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"].as_array().unwrap().len(), 0);
    assert_eq!(last["usage"]["completion_tokens"], want.len());
    assert_eq!(chunks[chunks.len() - 2]["choices"][0]["finish_reason"], fin);

    // Token-id prompts give the same answer as the text.
    let r = post_json(
        h.addr,
        "/v1/completions",
        &json!({"prompt": ids_in, "max_tokens": 24, "temperature": 0}),
    )
    .unwrap();
    assert_eq!(r.json()["choices"][0]["text"].as_str().unwrap(), want_text);

    // Several prompts in one request: one choice each, in order.
    let r = post_json(
        h.addr,
        "/v1/completions",
        &json!({"prompt": [prompt, "another"], "max_tokens": 5, "temperature": 0}),
    )
    .unwrap();
    let v = r.json();
    assert_eq!(v["choices"].as_array().unwrap().len(), 2);
    assert_eq!(v["choices"][1]["index"], 1);
}

/// Runs of U+FFFD as one.
fn squeeze(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        if !(c == '\u{FFFD}' && out.ends_with('\u{FFFD}')) {
            out.push(c);
        }
    }
    out
}

fn h_name(d: &tempfile::TempDir) -> String {
    d.path()
        .canonicalize()
        .unwrap()
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

#[test]
fn sampling_seed_stop_strings_and_stop_ids() {
    let dir = model_dir(true, false);
    let h = start(dir_source(&dir), |_| {});
    let run = |extra: serde_json::Value| {
        let mut b =
            json!({"prompt": "Once upon a time", "max_tokens": 40, "return_token_ids": true});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        let r = post_json(h.addr, "/v1/completions", &b).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["choices"][0].clone()
    };
    let a = run(json!({"temperature": 1.0, "top_p": 0.9, "top_k": 50, "min_p": 0.01, "seed": 42}));
    let b = run(json!({"temperature": 1.0, "top_p": 0.9, "top_k": 50, "min_p": 0.01, "seed": 42}));
    assert_eq!(a["token_ids"], b["token_ids"], "same seed, same tokens");
    assert_eq!(a["text"], b["text"]);
    let c = run(json!({"temperature": 1.0, "seed": 43}));
    assert_ne!(a["token_ids"], c["token_ids"]);

    // A stop string cuts the text before it.
    let full = run(json!({"temperature": 0}));
    let text = full["text"].as_str().unwrap().to_string();
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() > 8, "{text:?}");
    let stop: String = chars[5..8].iter().collect();
    let cut = run(json!({"temperature": 0, "stop": [stop.clone()]}));
    let expect = &text[..text.find(&stop).unwrap()];
    assert_eq!(cut["text"].as_str().unwrap(), expect);
    assert_eq!(cut["finish_reason"], "stop");
    // A stop token id ends the sequence at that token.
    let toks = ids(&full["token_ids"]);
    let at = toks[3];
    let first = toks.iter().position(|&t| t == at).unwrap();
    let s = run(json!({"temperature": 0, "stop_token_ids": [at]}));
    assert_eq!(ids(&s["token_ids"]), toks[..=first].to_vec());
    assert_eq!(s["finish_reason"], "stop");
}

#[test]
fn chat_with_and_without_a_template() {
    let dir = model_dir(true, true);
    let h = start(dir_source(&dir), |_| {});
    let msgs = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi there"}]}]);
    let r = post_json(
        h.addr,
        "/v1/chat/completions",
        &json!({"messages": msgs, "max_tokens": 12, "temperature": 0, "return_token_ids": true}),
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    // The prompt is the template's text, tokenized with its special tokens.
    let tok = tokenizer();
    let rendered =
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
                    <|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>\
                    <|start_header_id|>assistant<|end_header_id|>\n\n";
    let p = tok.encode(rendered, false).unwrap();
    assert_eq!(p[0], 264, "BOS from the template, once");
    assert_eq!(v["usage"]["prompt_tokens"], p.len());
    let want = engine_greedy(&load(dir.path()), &p, 12, &tok.eos_ids);
    assert_eq!(ids(&v["choices"][0]["token_ids"]), want);
    assert_eq!(
        v["choices"][0]["message"]["content"].as_str().unwrap(),
        tok.decode(&want, true).unwrap()
    );

    let (text, _, chunks) = read_stream(
        client::stream(
            h.addr,
            "/v1/chat/completions",
            &[],
            &json!({"messages": msgs, "max_tokens": 12, "temperature": 0, "stream": true}),
        )
        .unwrap(),
    );
    assert_eq!(text, tok.decode(&want, true).unwrap());
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");

    // Without a template: the plain-text fallback (`User: …` paragraphs, `Assistant:`).
    let plain = model_dir(true, false);
    let h2 = start(dir_source(&plain), |_| {});
    let r = post_json(
        h2.addr,
        "/v1/chat/completions",
        &json!({"messages": msgs, "max_tokens": 4, "temperature": 0, "return_token_ids": true}),
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let p = tok
        .encode("Be brief.\n\nUser: Hi there\n\nAssistant:", false)
        .unwrap();
    assert_eq!(r.json()["usage"]["prompt_tokens"], p.len());
    let want = engine_greedy(&load(plain.path()), &p, 4, &tok.eos_ids);
    assert_eq!(ids(&r.json()["choices"][0]["token_ids"]), want);
}

#[test]
fn embeddings_pool_the_final_hidden_state() {
    // Inputs read in one window, and in windows of 7 tokens between other work.
    for chunk in [512, 7] {
        embeddings_match_golden(chunk);
    }
}

fn embeddings_match_golden(chunk: usize) {
    // The golden fixture holds the hidden states after norm_f of the official model.
    let fx = fixtures().join("siso-tiny");
    let h = start(ModelSource::Dir(fx.clone()), |c| {
        c.scheduler.prefill_chunk = chunk
    });
    let g = mamba3::model::tensor_file::TensorFile::open(&fx.join("golden.safetensors")).unwrap();
    let input: Vec<i64> = g.get("input_ids").unwrap().to_i64("input_ids").unwrap();
    let hid = g.get("hidden").unwrap();
    let d = hid.shape[1];
    let hidden = hid
        .to_float("hidden", mamba3::DType::F32)
        .unwrap()
        .to_f32_vec();
    let rel = |a: &[f32], b: &[f32]| {
        let n: f64 = a
            .iter()
            .zip(b)
            .map(|(x, y)| ((x - y) as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        n / b.iter().map(|y| (*y as f64).powi(2)).sum::<f64>().sqrt()
    };
    let t = input.len();
    let r = post_json(
        h.addr,
        "/v1/embeddings",
        &json!({"input": [input.clone(), input[..10].to_vec()]}),
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let e0: Vec<f32> = v["data"][0]["embedding"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect();
    assert_eq!(e0.len(), d);
    assert!(
        rel(&e0, &hidden[(t - 1) * d..t * d]) < 1e-4,
        "last-token pooling vs golden"
    );
    let e1: Vec<f32> = v["data"][1]["embedding"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect();
    assert!(
        rel(&e1, &hidden[9 * d..10 * d]) < 1e-4,
        "each input its own fresh state"
    );
    assert_eq!(v["usage"]["prompt_tokens"], t + 10);

    let r = post_json(
        h.addr,
        "/v1/embeddings",
        &json!({"input": input, "pooling": "mean", "encoding_format": "base64"}),
    )
    .unwrap();
    let b64 = r.json()["data"][0]["embedding"]
        .as_str()
        .unwrap()
        .to_string();
    let bytes = decode_b64(&b64);
    let mean: Vec<f32> = bytes
        .chunks(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let mut want = vec![0f32; d];
    for row in hidden.chunks(d) {
        want.iter_mut()
            .zip(row)
            .for_each(|(a, b)| *a += b / t as f32);
    }
    assert!(rel(&mean, &want) < 1e-4, "mean pooling vs golden");

    // This model has no tokenizer: text is refused, clearly.
    let r = post_json(h.addr, "/v1/embeddings", &json!({"input": "hello"})).unwrap();
    assert_eq!(r.status, 400);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("no tokenizer"));
    let r = post_json(h.addr, "/v1/completions", &json!({"prompt": "hello"})).unwrap();
    assert_eq!(r.status, 400);
    let r = post_json(
        h.addr,
        "/v1/completions",
        &json!({"prompt": [1, 2, 3], "max_tokens": 3}),
    )
    .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(
        r.json()["choices"][0]["token_ids"]
            .as_array()
            .unwrap()
            .len(),
        3
    );
}

fn decode_b64(s: &str) -> Vec<u8> {
    let val = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        _ => 63,
    } as u32;
    let mut out = Vec::new();
    for q in s.as_bytes().chunks(4) {
        let pad = q.iter().filter(|&&c| c == b'=').count();
        let n = q
            .iter()
            .fold(0u32, |n, &c| (n << 6) | if c == b'=' { 0 } else { val(c) });
        let b = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&b[..3 - pad]);
    }
    out
}

#[test]
fn models_health_metrics_and_loading() {
    // A larger synthetic model takes a moment to build: /health is 503 meanwhile.
    let cfg = mamba3::model::Config::synthetic(1024, 16, 64, 64, 2, 1, 32000);
    let mut sc = mamba3::serve::ServeConfig::new(ModelSource::Synthetic {
        config: cfg,
        seed: 1,
    });
    sc.addr = "127.0.0.1:0".parse().unwrap();
    sc.model_name = Some("big".into());
    let h = mamba3::serve::spawn(sc).unwrap();
    let r = get(h.addr, "/health").unwrap();
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.json()["error"]["type"], "unavailable_error");
    let r = post_json(h.addr, "/v1/completions", &json!({"prompt": [1]})).unwrap();
    assert_eq!(r.status, 503);
    wait_ready(&h);
    assert_eq!(get(h.addr, "/health").unwrap().json()["status"], "ok");
    drop(h);

    let dir = model_dir(true, false);
    let h = start(dir_source(&dir), |c| c.model_name = Some("tiny".into()));
    let v = get(h.addr, "/v1/models").unwrap().json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "tiny");
    assert_eq!(get(h.addr, "/v1/models/tiny").unwrap().status, 200);
    assert_eq!(get(h.addr, "/v1/models/other").unwrap().status, 404);
    for _ in 0..3 {
        let r = post_json(
            h.addr,
            "/v1/completions",
            &json!({"model": "tiny", "prompt": "abc", "max_tokens": 5}),
        )
        .unwrap();
        assert_eq!(r.status, 200);
    }
    post_json(
        h.addr,
        "/v1/completions",
        &json!({"model": "nope", "prompt": "abc"}),
    )
    .unwrap();
    wait_metric(&h, "mamba3_active_sequences", 10, |v| v == 0.0);
    let page = get(h.addr, "/metrics").unwrap().text();
    for needle in [
        "mamba3_requests_total{route=\"/v1/completions\",status=\"200\"} 3",
        "mamba3_requests_total{route=\"/v1/completions\",status=\"404\"} 1",
        "mamba3_generation_tokens_total 15",
        "mamba3_time_to_first_token_seconds_count 3",
        "mamba3_inter_token_latency_seconds_count 12",
        "mamba3_queue_depth 0",
        "mamba3_active_sequences 0",
        "mamba3_prefix_cache_budget_bytes 1073741824",
        "mamba3_prefix_cache_hits_total",
    ] {
        assert!(page.contains(needle), "missing {needle:?} in\n{page}");
    }
    let prompt_tokens =
        mamba3::serve::metrics::sample(&page, "mamba3_prompt_tokens_total").unwrap();
    assert_eq!(prompt_tokens, 12.0, "3 × (BOS + 3 bytes)");
}

#[test]
fn bad_input_gets_openai_errors_and_the_server_survives() {
    let dir = model_dir(true, false);
    let h = start(dir_source(&dir), |c| {
        c.api_key = Some("sk-test".into());
        c.max_tokens_limit = 100;
        c.max_prompt_tokens = 50;
        c.debug_routes = true;
    });
    let auth = [("Authorization", "Bearer sk-test")];
    let post = |body: &str| {
        request(
            h.addr,
            "POST",
            "/v1/completions",
            &auth,
            Some(body.as_bytes()),
        )
        .unwrap()
    };
    let check = |r: client::Response, status: u16, needle: &str| {
        assert_eq!(r.status, status, "{}", r.text());
        let e = &r.json()["error"];
        assert!(
            e["message"].as_str().unwrap().contains(needle),
            "{needle:?} not in {e}"
        );
        assert!(e.get("type").is_some() && e.get("param").is_some() && e.get("code").is_some());
    };
    check(post("{\"prompt\": \"hi\", "), 400, "not valid JSON");
    check(post("[1, 2]"), 400, "must be a JSON object, found an array");
    check(post(""), 400, "not valid JSON");
    let r = post("{\"prompt\": \"hi\", \"max_tokens\": \"ten\"}");
    assert_eq!(r.json()["error"]["param"], "max_tokens");
    check(r, 400, "invalid type: string");
    check(post("{\"prompt\": 5}"), 400, "must be a string");
    check(
        post("{\"prompt\": \"hi\", \"temperature\": -1}"),
        400,
        "temperature",
    );
    check(
        post("{\"prompt\": \"hi\", \"max_tokens\": 101}"),
        400,
        "at most 100",
    );
    let long = "x".repeat(60);
    check(
        post(&format!("{{\"prompt\": \"{long}\"}}")),
        400,
        "at most 50",
    );
    check(post("{\"prompt\": [1, 99999]}"), 400, "out of range");
    check(
        post("{\"prompt\": \"hi\", \"model\": \"gpt-4\"}"),
        404,
        "does not exist",
    );
    check(post("{\"prompt\": \"hi\", \"n\": 3}"), 400, "one choice");
    check(post("{}"), 400, "`prompt` is missing");
    check(
        request(
            h.addr,
            "POST",
            "/v1/completions",
            &[],
            Some(b"{\"prompt\": \"hi\"}"),
        )
        .unwrap(),
        401,
        "missing API key",
    );
    check(
        request(
            h.addr,
            "POST",
            "/v1/completions",
            &[("Authorization", "Bearer nope")],
            Some(b"{}"),
        )
        .unwrap(),
        401,
        "incorrect API key",
    );
    check(
        request(h.addr, "GET", "/v1/nothing", &auth, None).unwrap(),
        404,
        "no route",
    );
    // Health and metrics stay public.
    assert_eq!(get(h.addr, "/health").unwrap().status, 200);
    // A panicking handler is a 500, and the server goes on serving.
    check(get(h.addr, "/debug/panic").unwrap(), 500, "test panic");
    let r = post("{\"prompt\": \"hi\", \"max_tokens\": 3}");
    assert_eq!(r.status, 200, "{}", r.text());
    let page = get(h.addr, "/metrics").unwrap().text();
    assert!(
        page.contains("route=\"/v1/completions\",status=\"401\"} 2"),
        "{page}"
    );
    assert!(
        page.contains("route=\"/debug/panic\",status=\"500\"} 1"),
        "{page}"
    );
}

#[test]
fn full_queue_is_refused_with_429() {
    let dir = model_dir(false, false);
    let h = start(dir_source(&dir), |c| {
        c.max_queue = 1;
        c.scheduler.max_batch = 1;
        c.max_tokens_limit = 1_000_000;
    });
    let long =
        json!({"prompt": [1, 2, 3], "max_tokens": 1_000_000, "ignore_eos": true, "stream": true});
    let mut a = client::stream(h.addr, "/v1/completions", &[], &long).unwrap();
    assert!(a.next_data().unwrap().is_some(), "first request runs");
    let b = client::stream(h.addr, "/v1/completions", &[], &long).unwrap();
    wait_metric(&h, "mamba3_queue_depth", 10, |v| v == 1.0);
    let r = post_json(
        h.addr,
        "/v1/completions",
        &json!({"prompt": [1], "max_tokens": 2}),
    )
    .unwrap();
    assert_eq!(r.status, 429, "{}", r.text());
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("busy"));
    drop(a);
    drop(b);
    wait_metric(&h, "mamba3_active_sequences", 20, |v| v == 0.0);
    wait_metric(&h, "mamba3_queue_depth", 20, |v| v == 0.0);
    let r = post_json(
        h.addr,
        "/v1/completions",
        &json!({"prompt": [1], "max_tokens": 2}),
    )
    .unwrap();
    assert_eq!(r.status, 200, "slots are free again");
}

#[test]
fn prefix_cache_hits_return_the_tokens_of_a_cold_run() {
    let dir = model_dir(false, false);
    let h = start(dir_source(&dir), |c| c.scheduler.prefill_chunk = 64);
    let cold = start(dir_source(&dir), |c| c.scheduler.cache_bytes = 0);
    let model = load(dir.path());
    let prefix: Vec<u32> = (0..300u32).map(|i| (i * 7 + 3) % 256).collect();
    let with = |s: &[u32]| {
        let mut p = prefix.clone();
        p.extend_from_slice(s);
        p
    };
    let ask = |h: &mamba3::serve::ServerHandle, p: &[u32]| {
        let r = post_json(
            h.addr,
            "/v1/completions",
            &json!({"prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": true}),
        )
        .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        (
            ids(&v["choices"][0]["token_ids"]),
            v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap(),
        )
    };
    let (p1, p2, p3) = (with(&[1, 2, 3]), with(&[4, 5]), with(&[6, 7, 8, 9]));
    assert_eq!(ask(&h, &p1).1, 0);
    assert_eq!(
        ask(&h, &p2).1,
        0,
        "a branch of p1: snapshotted at 300, but not a hit yet"
    );
    let (t3, cached) = ask(&h, &p3);
    assert_eq!(cached, 300, "starts from the shared prefix");
    assert_eq!(t3, ask(&cold, &p3).0, "cache hit == cold run");
    assert_eq!(t3, engine_greedy(&model, &p3, 16, &[]));
    // The same prompt again: the whole prompt is cached (its last logits too).
    let (again, cached) = ask(&h, &p3);
    assert_eq!(cached as usize, p3.len());
    assert_eq!(again, t3);
    // A conversation's next turn extends prompt + answer: it starts from the answer's end.
    let mut next = p3.clone();
    next.extend_from_slice(&t3);
    next.extend_from_slice(&[10, 11]);
    let (t4, cached) = ask(&h, &next);
    assert_eq!(cached as usize, p3.len() + t3.len() - 1);
    assert_eq!(t4, engine_greedy(&model, &next, 16, &[]));
    assert!(metric(&h, "mamba3_prefix_cache_hits_total") >= 3.0);
    assert_eq!(metric(&cold, "mamba3_prefix_cache_hits_total"), 0.0);
}

#[test]
fn prefix_cache_stays_within_its_byte_budget() {
    let dir = model_dir(false, false);
    let model = load(dir.path());
    let st = model.new_state();
    // Room for about three entries.
    let budget =
        3 * mamba3::serve::prefix_cache::PrefixCache::entry_bytes(20, &st, TOK_VOCAB) + 100;
    let h = start(dir_source(&dir), |c| c.scheduler.cache_bytes = budget);
    assert_eq!(
        metric(&h, "mamba3_prefix_cache_budget_bytes"),
        budget as f64
    );
    for i in 0..12u32 {
        let p: Vec<u32> = (0..10).map(|j| (i * 13 + j) % 256).collect();
        let r = post_json(
            h.addr,
            "/v1/completions",
            &json!({"prompt": p, "max_tokens": 4, "ignore_eos": true}),
        )
        .unwrap();
        assert_eq!(r.status, 200);
        let bytes = metric(&h, "mamba3_prefix_cache_bytes");
        assert!(bytes <= budget as f64, "{bytes} > {budget}");
    }
    assert!(metric(&h, "mamba3_prefix_cache_evictions_total") > 0.0);
    assert!(metric(&h, "mamba3_prefix_cache_entries") <= 3.0);
}

#[test]
fn thirty_two_streaming_clients_then_disconnects() {
    let dir = model_dir(true, false);
    let h = start(dir_source(&dir), |c| c.max_tokens_limit = 1_000_000);
    let model = load(dir.path());
    let prompts: Vec<Vec<u32>> = (0..32u32)
        .map(|i| vec![264, 40 + i, 100 + (i * 5) % 150, 7])
        .collect();
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| engine_greedy(&model, p, 40, &[]))
        .collect();
    let got: Vec<(String, Vec<u32>, Vec<serde_json::Value>)> = std::thread::scope(|s| {
        let hs: Vec<_> = prompts
            .iter()
            .map(|p| {
                let addr = h.addr;
                s.spawn(move || {
                    read_stream(client::stream(addr, "/v1/completions", &[],
                        &json!({"prompt": p, "max_tokens": 40, "temperature": 0, "ignore_eos": true,
                                "stream": true, "return_token_ids": true})).unwrap())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let tok = tokenizer();
    for (i, (text, ids, _)) in got.iter().enumerate() {
        assert_eq!(ids, &want[i], "client {i}");
        // Random bytes are not UTF-8: a streamed text may mark a broken character with a
        // different number of U+FFFD than one decode of the whole; compare modulo that.
        assert_eq!(
            squeeze(text),
            squeeze(&tok.decode(&want[i], true).unwrap()),
            "client {i}"
        );
    }
    wait_metric(&h, "mamba3_active_sequences", 10, |v| v == 0.0);

    // Clients that go away mid-stream free their slots at once.
    let before = metric(&h, "mamba3_cancelled_sequences_total");
    let mut streams: Vec<_> = (0..6)
        .map(|i| {
            client::stream(h.addr, "/v1/completions", &[],
                &json!({"prompt": [264, i], "max_tokens": 1_000_000, "ignore_eos": true, "stream": true})).unwrap()
        })
        .collect();
    for s in &mut streams {
        assert!(s.next_data().unwrap().is_some());
    }
    wait_metric(&h, "mamba3_active_sequences", 10, |v| v == 6.0);
    drop(streams);
    wait_metric(&h, "mamba3_active_sequences", 20, |v| v == 0.0);
    assert!(metric(&h, "mamba3_cancelled_sequences_total") >= before + 6.0);
    // And the server still answers.
    let r = post_json(
        h.addr,
        "/v1/completions",
        &json!({"prompt": "ok", "max_tokens": 2}),
    )
    .unwrap();
    assert_eq!(r.status, 200);
    std::thread::sleep(Duration::from_millis(10));
}

#[test]
fn a_long_prompt_is_prefilled_in_chunks_between_decode_steps() {
    let dir = model_dir(false, false);
    let h = start(dir_source(&dir), |c| {
        c.scheduler.prefill_chunk = 16;
        c.max_tokens_limit = 1_000_000;
    });
    // A running sequence, recording when each of its tokens arrives.
    let mut ev = client::stream(
        h.addr,
        "/v1/completions",
        &[],
        &json!({"prompt": [1, 2, 3], "max_tokens": 1_000_000, "ignore_eos": true, "stream": true}),
    )
    .unwrap();
    assert!(ev.next_data().unwrap().is_some());
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut times = Vec::new();
        while let Ok(Some(_)) = ev.next_data() {
            times.push(std::time::Instant::now());
            if rx.try_recv().is_ok() {
                break;
            }
        }
        times
    });
    std::thread::sleep(Duration::from_millis(50));
    // A 2000-token prompt: 125 windows of 16 tokens, each followed by a decode step.
    let long: Vec<u32> = (0..2000u32).map(|i| (i * 7 + 1) % 256).collect();
    let t0 = std::time::Instant::now();
    let r = post_json(
        h.addr,
        "/v1/completions",
        &json!({"prompt": long, "max_tokens": 1}),
    )
    .unwrap();
    let t1 = std::time::Instant::now();
    assert_eq!(r.status, 200);
    tx.send(()).unwrap();
    let times = reader.join().unwrap();
    let during = times.iter().filter(|&&t| t > t0 && t < t1).count();
    assert!(
        during >= 60,
        "only {during} tokens of the running sequence during the prefill"
    );
}

#[test]
fn a_non_streaming_client_that_hangs_up_frees_its_slot() {
    use std::io::Write;
    let dir = model_dir(false, false);
    let h = start(dir_source(&dir), |c| c.max_tokens_limit = 1_000_000);
    let body =
        json!({"prompt": [1, 2, 3], "max_tokens": 1_000_000, "ignore_eos": true}).to_string();
    let mut s = std::net::TcpStream::connect(h.addr).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    wait_metric(&h, "mamba3_active_sequences", 10, |v| v == 1.0);
    drop(s);
    wait_metric(&h, "mamba3_active_sequences", 10, |v| v == 0.0);
    assert!(metric(&h, "mamba3_cancelled_sequences_total") >= 1.0);
}
