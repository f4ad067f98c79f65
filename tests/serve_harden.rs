//! The server against a hostile client: requests that can never succeed get a 400 naming
//! the limit; every error has the same JSON body and busy answers say when to retry.
//! (A stalling client: tests/serve_stall.rs; SIGTERM: tests/serve_sigterm.rs.)

mod serve_util;

use mamba3::serve::client::{self, get, post_json, request};
use mamba3::text::ModelSource;
use serde_json::json;
use serve_util::*;

fn dir_source(d: &tempfile::TempDir) -> ModelSource {
    ModelSource::Dir(d.path().to_path_buf())
}

#[test]
fn requests_that_cannot_succeed_and_every_error_shape() {
    let dir = model_dir(true, false);
    let h = start(dir_source(&dir), |c| {
        c.max_queue = 3;
        c.api_key = Some("sk-test".into());
    });
    let auth = [("Authorization", "bearer sk-test")];
    // More prompts than the queue holds at all: 400 naming the limit, not a 429.
    let r = request(
        h.addr,
        "POST",
        "/v1/completions",
        &auth,
        Some(
            json!({"prompt": [[1], [2], [3], [4]], "max_tokens": 1})
                .to_string()
                .as_bytes(),
        ),
    )
    .unwrap();
    assert_eq!(r.status, 400, "{}", r.text());
    let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(
        msg.contains("at most 3") && msg.contains("--max-queue"),
        "{msg}"
    );
    // The scheme is case-insensitive: `bearer` worked above (a 400, not a 401).
    let r = request(
        h.addr,
        "GET",
        "/v1/models",
        &[("Authorization", "BEARER sk-test")],
        None,
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let r = request(
        h.addr,
        "GET",
        "/v1/models",
        &[("Authorization", "Bearer nope")],
        None,
    )
    .unwrap();
    assert_eq!(r.status, 401);
    // 405 has the same body as every other error.
    let r = request(h.addr, "GET", "/v1/completions", &auth, None).unwrap();
    assert_eq!(r.status, 405, "{}", r.text());
    let e = r.json();
    assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("GET"));
    // Chat messages need a content.
    let r = request(
        h.addr,
        "POST",
        "/v1/chat/completions",
        &auth,
        Some(
            json!({"messages": [{"role": "user"}]})
                .to_string()
                .as_bytes(),
        ),
    )
    .unwrap();
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("no `content`"), "{}", r.text());
    // The model has no chat template: the fallback renders the messages as plain text.
    let r = request(
        h.addr,
        "POST",
        "/v1/chat/completions",
        &auth,
        Some(
            json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                   "temperature": 0, "return_token_ids": true})
            .to_string()
            .as_bytes(),
        ),
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let tok = mamba3::text::Tokenizer::from_file(&dir.path().join("tokenizer.json")).unwrap();
    let p = tok.encode("User: Hi\n\nAssistant:", false).unwrap();
    assert_eq!(r.json()["usage"]["prompt_tokens"], p.len());
    let want = engine_greedy(&load(dir.path()), &p, 3, &tok.eos_ids);
    assert_eq!(ids(&r.json()["choices"][0]["token_ids"]), want);
}

#[test]
fn busy_and_loading_answers_say_when_to_retry() {
    // A larger synthetic model loads for a moment: 503 with the common body and Retry-After.
    let cfg = mamba3::model::Config::synthetic(1024, 16, 64, 64, 2, 1, 32000);
    let mut sc = mamba3::serve::ServeConfig::new(ModelSource::Synthetic {
        config: cfg,
        seed: 1,
    });
    sc.addr = "127.0.0.1:0".parse().unwrap();
    let h = mamba3::serve::spawn(sc).unwrap();
    let r = get(h.addr, "/health").unwrap();
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.json()["error"]["type"], "unavailable_error");
    assert_eq!(r.json()["error"]["code"], "model_loading");
    drop(h);

    let dir = model_dir(false, false);
    let h = start(dir_source(&dir), |c| {
        c.max_queue = 1;
        c.scheduler.max_batch = 1;
        c.max_tokens_limit = 1_000_000;
    });
    let long =
        json!({"prompt": [1, 2, 3], "max_tokens": 1_000_000, "ignore_eos": true, "stream": true});
    let mut a = client::stream(h.addr, "/v1/completions", &[], &long).unwrap();
    assert!(a.next_data().unwrap().is_some());
    let b = client::stream(h.addr, "/v1/completions", &[], &long).unwrap();
    wait_metric(&h, "mamba3_queue_depth", 10, |v| v == 1.0);
    let r = post_json(h.addr, "/v1/completions", &json!({"prompt": [1]})).unwrap();
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("1"));
    drop((a, b));
}
