//! The server against a hostile client: a 30 MB prompt and 900 half-sent requests leave
//! `/health` answering within 100 ms; requests that can never succeed get a 400 naming the
//! limit; every error has the same JSON body and busy answers say when to retry; SIGTERM
//! ends every running stream with a finish reason and `[DONE]`.

mod serve_util;

use mamba3::serve::client::{self, get, post_json, request};
use mamba3::text::ModelSource;
use serde_json::json;
use serve_util::*;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

fn dir_source(d: &tempfile::TempDir) -> ModelSource {
    ModelSource::Dir(d.path().to_path_buf())
}

/// Let this process hold a few thousand sockets (the server's and the clients' ends).
fn raise_fd_limit() {
    unsafe {
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < 4096 {
            r.rlim_cur = r.rlim_max.min(4096);
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

/// `/health`'s latency, and that it said 200.
fn health_latency(addr: SocketAddr) -> Duration {
    let t = Instant::now();
    let r = get(addr, "/health").unwrap();
    let took = t.elapsed();
    assert_eq!(r.status, 200, "{}", r.text());
    took
}

#[test]
fn health_answers_within_100ms_under_a_huge_prompt_and_900_half_sent_requests() {
    raise_fd_limit();
    let dir = model_dir(true, false);
    let h = start(dir_source(&dir), |c| {
        c.timeouts.header = Duration::from_secs(3);
        c.timeouts.body = Duration::from_secs(3);
    });
    let addr = h.addr;
    // 900 requests that stop half-way: 450 in the head, 450 in the body.
    let mut half: Vec<TcpStream> = (0..900)
        .map(|i| {
            let mut s = TcpStream::connect(addr).unwrap();
            let text = if i % 2 == 0 {
                "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty".to_string()
            } else {
                "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
                 Content-Length: 1000\r\n\r\n{\"prompt\": \"abc"
                    .to_string()
            };
            s.write_all(text.as_bytes()).unwrap();
            s
        })
        .collect();
    // A 30 MB prompt, sent in full, being read and refused meanwhile.
    let big = std::thread::spawn(move || {
        let prompt = "a".repeat(30 << 20);
        let body = json!({"prompt": prompt, "max_tokens": 1}).to_string();
        request(addr, "POST", "/v1/completions", &[], Some(body.as_bytes())).unwrap()
    });
    let mut worst = Duration::ZERO;
    let t0 = Instant::now();
    while !big.is_finished() || t0.elapsed() < Duration::from_secs(1) {
        worst = worst.max(health_latency(addr));
        std::thread::sleep(Duration::from_millis(10));
    }
    let r = big.join().unwrap();
    assert_eq!(r.status, 400, "{}", r.text());
    let e = r.json();
    assert_eq!(e["error"]["code"], "context_length_exceeded", "{e}");
    assert!(
        worst < Duration::from_millis(100),
        "/health took {worst:?} while the attack was in flight"
    );
    // Past the time-outs, the server has let go of every half-sent request: each socket is
    // answered (408) or closed.
    std::thread::sleep(Duration::from_secs(4));
    for (i, s) in half.iter_mut().enumerate() {
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = Vec::new();
        let _ = s.read_to_end(&mut buf);
        let text = String::from_utf8_lossy(&buf);
        assert!(
            buf.is_empty() || text.starts_with("HTTP/1.1 408"),
            "half-sent request {i} got {text:?}"
        );
    }
    assert!(health_latency(addr) < Duration::from_millis(100));
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
