//! `mamba3 serve` stopped by SIGTERM while 16 clients stream: it stops accepting
//! connections, and after its grace period every stream ends with a `finish_reason` and
//! `[DONE]`; then the process exits cleanly.

mod serve_util;

use mamba3::serve::client;
use serde_json::json;
use serve_util::*;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn sigterm_during_16_streams_ends_every_one_with_done() {
    let dir = model_dir(true, false);
    let port = free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_mamba3"))
        .args(["serve", "--model", dir.path().to_str().unwrap()])
        .args(["--port", &port.to_string(), "--shutdown-grace", "1"])
        .args(["--max-tokens-limit", "1000000", "--threads", "2"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while client::get(addr, "/health").map_or(true, |r| r.status != 200) {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "server did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let body = json!({"prompt": "In the beginning", "max_tokens": 1_000_000,
                      "ignore_eos": true, "stream": true});
    let mut streams: Vec<client::Events> = (0..16)
        .map(|_| client::stream(addr, "/v1/completions", &[], &body).unwrap())
        .collect();
    for s in &mut streams {
        assert_eq!(s.status, 200);
        assert!(s.next_data().unwrap().is_some(), "the stream has begun");
    }
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    // No new connections once the signal is handled.
    let t1 = Instant::now();
    while TcpStream::connect(addr).is_ok() {
        assert!(
            t1.elapsed() < Duration::from_secs(5),
            "still accepting connections after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    for (i, mut s) in streams.into_iter().enumerate() {
        let mut last = None;
        loop {
            let d = s
                .next_data()
                .unwrap()
                .unwrap_or_else(|| panic!("stream {i} ended without [DONE]"));
            if d == "[DONE]" {
                break;
            }
            last = Some(d);
        }
        let v: serde_json::Value = serde_json::from_str(&last.unwrap()).unwrap();
        assert_eq!(
            v["choices"][0]["finish_reason"], "abort",
            "stream {i}'s last chunk: {v}"
        );
    }
    let t2 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t2.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!("the server did not exit after SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    use std::io::Read;
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(status.success(), "exit {status}: {err}");
    assert!(err.contains("shutting down"), "{err}");
}
