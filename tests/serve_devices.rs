//! One server over several model replicas (`--devices`), tested with two CPU replicas
//! sharing the thread pool: load spreads over them, a prompt that extends a cached prefix
//! goes to the replica holding it, and `/metrics` reports each.

mod serve_util;

use mamba3::engine::Device;
use mamba3::serve::client::{self, post_json};
use mamba3::serve::ServerHandle;
use mamba3::text::ModelSource;
use serde_json::json;
use serve_util::*;
use std::time::Duration;

fn two_cpus(d: &tempfile::TempDir) -> ServerHandle {
    start(ModelSource::Dir(d.path().to_path_buf()), |c| {
        c.devices = vec![Device::Cpu, Device::Cpu];
        c.max_tokens_limit = 1_000_000;
    })
}

fn per(h: &ServerHandle, name: &str, r: usize) -> f64 {
    metric(h, &format!("{name}{{replica=\"{r}\",device=\"cpu\"}}"))
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
            "active sequences per replica {got:?}, want {want:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn load_spreads_over_the_replicas() {
    let dir = model_dir(false, false);
    let h = two_cpus(&dir);
    let a = endless(&h, &[1, 2, 3]);
    let b = endless(&h, &[4, 5, 6]);
    wait_active(&h, [1.0, 1.0]);
    let c = endless(&h, &[7, 8, 9]);
    let d = endless(&h, &[10, 11, 12]);
    wait_active(&h, [2.0, 2.0]);
    drop((a, b, c, d));
    wait_active(&h, [0.0, 0.0]);
    for r in 0..2 {
        assert!(per(&h, "mamba3_device_generation_tokens_total", r) >= 2.0);
        assert!(per(&h, "mamba3_device_busy_seconds_total", r) > 0.0);
    }
}

#[test]
fn a_prompt_goes_to_the_replica_holding_its_prefix() {
    let dir = model_dir(false, false);
    let h = two_cpus(&dir);
    let model = load(dir.path());
    let prefix: Vec<u32> = (0..200u32).map(|i| (i * 11 + 5) % 256).collect();
    let ask = |p: &[u32]| {
        let r = post_json(
            h.addr,
            "/v1/completions",
            &json!({"prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": true,
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
    // Replica 0 busy: the prefix goes to replica 1, and is cached there.
    let s1 = endless(&h, &[1, 2, 3]);
    wait_active(&h, [1.0, 0.0]);
    assert_eq!(ask(&prefix).1, 0);
    assert_eq!(per(&h, "mamba3_device_prefix_cache_hits_total", 1), 0.0);
    assert!(per(&h, "mamba3_device_prefix_cache_bytes", 1) > 0.0);
    // Now replica 1 is the busier one…
    let s2 = endless(&h, &[4, 5, 6]);
    wait_active(&h, [1.0, 1.0]);
    drop(s1);
    wait_active(&h, [0.0, 1.0]);
    // …but a prompt that extends the prefix still goes there, and starts from it.
    let mut p = prefix.clone();
    p.extend_from_slice(&[9, 8, 7]);
    let (t, cached) = ask(&p);
    assert_eq!(cached, prefix.len());
    assert_eq!(per(&h, "mamba3_device_prefix_cache_hits_total", 1), 1.0);
    assert_eq!(per(&h, "mamba3_device_prefix_cache_hits_total", 0), 0.0);
    assert_eq!(t, engine_greedy(&model, &p, 8, &[]));
    // A prompt with nothing cached goes to the idle replica 0.
    let misses = per(&h, "mamba3_device_prefix_cache_misses_total", 0);
    let (t, cached) = ask(&[3, 1, 4, 1, 5]);
    assert_eq!(cached, 0);
    assert_eq!(
        per(&h, "mamba3_device_prefix_cache_misses_total", 0),
        misses + 1.0
    );
    assert_eq!(t, engine_greedy(&model, &[3, 1, 4, 1, 5], 8, &[]));
    drop(s2);
    // The unlabelled families sum the replicas.
    assert_eq!(metric(&h, "mamba3_prefix_cache_hits_total"), 1.0);
}
