//! The server against clients that stall it: a 30 MB prompt and 900 half-sent requests
//! in flight leave `/health` answering within 100 ms, and past the time-outs the server
//! has let go of every half-sent request. In a binary of its own, so that no other test
//! shares the cores while the latency is measured.

mod serve_util;

use mamba3::serve::client::{get, request};
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
