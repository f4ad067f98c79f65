//! `mamba3 bench-serve`: the server under load, measured as a client sees it.
//!
//! 1. Aggregate decode throughput: C concurrent streaming clients (C from `--clients`),
//!    each with its own random prompt, greedy, `--max-tokens` tokens each (end-of-sequence
//!    ignored). Reported: wall tok/s = all tokens received / wall time from the first
//!    request to the last stream's end (prefill included), and decode tok/s = the sum over
//!    clients of (tokens − 1) / (time from its first token to its last). Medians over
//!    `--repeats`; "x 1 client" compares decode tok/s with the first row's.
//! 2. Time to first token on a shared prefix of `--prefix-len` tokens: a cold request
//!    (fresh prefix + suffix), a second one on the same prefix (the server snapshots the
//!    branch point), then a third one that starts from the cached prefix state (a hit).
//!
//! Runs an in-process server on the model given (or a synthetic model of the shape given),
//! or drives a running server with `--url`.

use super::{List, PathArg, RunOpts};
use crate::error::{Error, Result};
use crate::model::rng::Rng;
use crate::model::Config;
use crate::serve::client;
use crate::serve::metrics::{sample, Phase};
use crate::serve::scheduler::SchedulerConfig;
use crate::serve::ServeConfig;
use crate::text::ModelSource;
use serde_json::json;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Drive the server at this address (host:port or http://host:port) instead of
    /// starting one.
    #[arg(long)]
    pub url: Option<String>,
    /// Model directory; without it (and without --url) a synthetic model of the shape below.
    #[arg(long)]
    pub model: Option<PathArg>,
    #[arg(long, default_value_t = 512)]
    pub d_model: usize,
    #[arg(long, default_value_t = 8)]
    pub layers: usize,
    #[arg(long, default_value_t = 64)]
    pub d_state: usize,
    #[arg(long, default_value_t = 64)]
    pub headdim: usize,
    #[arg(long, default_value_t = 2)]
    pub expand: usize,
    #[arg(long, default_value_t = 32000)]
    pub vocab: usize,
    /// Concurrent clients to measure.
    #[arg(long, default_value = "1,8,32")]
    pub clients: List,
    /// Tokens each client generates.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Prompt tokens of each throughput client.
    #[arg(long, default_value_t = 32)]
    pub prompt_len: usize,
    /// Shared prefix length for the time-to-first-token test (0 skips it).
    #[arg(long, default_value_t = 4096)]
    pub prefix_len: usize,
    /// Suffix after the shared prefix.
    #[arg(long, default_value_t = 16)]
    pub suffix_len: usize,
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// In-process server: one replica per device (`cuda:0,cuda:1`, `all`), as
    /// `serve --devices`.
    #[arg(long)]
    pub devices: Option<String>,
    /// Server slots (in-process server).
    #[arg(long, default_value_t = 64)]
    pub max_batch: usize,
    #[arg(long, default_value_t = 512)]
    pub prefill_chunk: usize,
    #[arg(long, default_value_t = 1024)]
    pub cache_mib: usize,
    /// One JSON object per line after the table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub run: RunOpts,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// One streaming request: (time to first token, tokens received, end time, decode
/// tokens/s after the first token).
fn stream_one(
    addr: SocketAddr,
    prompt: &[u32],
    max_tokens: usize,
) -> Result<(Duration, usize, Instant, f64)> {
    // (written before the clock starts: a client's own JSON is not the server's latency)
    let body = json!({
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true,
        "stream": true, "return_token_ids": true,
    })
    .to_string();
    let t0 = Instant::now();
    let mut ev = client::stream_bytes(addr, "/v1/completions", &[], body.as_bytes())
        .map_err(|e| Error::Other(format!("request to {addr} failed: {e}")))?;
    if ev.status != 200 {
        let status = ev.status;
        return Err(Error::Other(format!(
            "server answered {status}: {}",
            ev.rest()
        )));
    }
    let mut ttft = None;
    let mut n = 0;
    while let Some(d) = ev
        .next_data()
        .map_err(|e| Error::Other(format!("reading the stream failed: {e}")))?
    {
        if d == "[DONE]" {
            break;
        }
        let v: serde_json::Value = serde_json::from_str(&d).unwrap_or_default();
        if let Some(e) = v.get("error") {
            return Err(Error::Other(format!("server error in stream: {e}")));
        }
        let k = v["choices"][0]["token_ids"]
            .as_array()
            .map_or(0, |a| a.len());
        if k > 0 && ttft.is_none() {
            ttft = Some(t0.elapsed());
        }
        n += k;
    }
    let end = Instant::now();
    let ttft = ttft.unwrap_or_default();
    let decode = (end - t0).saturating_sub(ttft).as_secs_f64();
    let rate = if n > 1 {
        (n - 1) as f64 / decode.max(1e-9)
    } else {
        0.0
    };
    Ok((ttft, n, end, rate))
}

/// The engine threads' counters from `/metrics`: seconds per phase (admit, prefill,
/// decode, sample, emit, emit_wait), decode steps, decode rows, seconds inside device
/// calls (all replicas), and when they were read.
#[derive(Clone, Copy)]
struct Engine {
    secs: [f64; Phase::ALL.len()],
    steps: f64,
    rows: f64,
    device_busy: f64,
    replicas: usize,
    at: std::time::Instant,
    /// Sum of the server's times to first token (queue arrival to the token's emission).
    ttft: f64,
}

impl Engine {
    fn read(addr: SocketAddr) -> Result<Engine> {
        let m = client::get(addr, "/metrics")
            .map_err(|e| Error::Other(format!("{addr}/metrics: {e}")))?
            .text();
        let mut e = Engine {
            secs: [0.0; Phase::ALL.len()],
            steps: 0.0,
            rows: 0.0,
            device_busy: 0.0,
            replicas: 0,
            at: std::time::Instant::now(),
            ttft: 0.0,
        };
        // (one sample per replica, summed)
        let busy: Vec<f64> = m
            .lines()
            .filter(|l| l.starts_with("mamba3_device_busy_seconds_total{"))
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .collect();
        e.device_busy = busy.iter().sum();
        e.replicas = busy.len();
        for (i, p) in Phase::ALL.iter().enumerate() {
            let name = format!("mamba3_engine_seconds_total{{phase=\"{}\"}}", p.name());
            e.secs[i] = sample(&m, &name).unwrap_or(f64::NAN);
        }
        e.steps = sample(&m, "mamba3_decode_steps_total").unwrap_or(f64::NAN);
        e.rows = sample(&m, "mamba3_decode_rows_total").unwrap_or(f64::NAN);
        e.ttft = sample(&m, "mamba3_time_to_first_token_seconds_sum").unwrap_or(f64::NAN);
        Ok(e)
    }

    fn since(self, before: Engine) -> Engine {
        Engine {
            secs: std::array::from_fn(|i| self.secs[i] - before.secs[i]),
            steps: self.steps - before.steps,
            rows: self.rows - before.rows,
            device_busy: self.device_busy - before.device_busy,
            replicas: self.replicas,
            at: self.at,
            ttft: self.ttft - before.ttft,
        }
    }

    fn phase(&self, p: Phase) -> f64 {
        self.secs[p as usize]
    }

    /// The share of the wall time from `before` to this reading the device(s) had work
    /// (`mamba3_device_busy_seconds_total`, averaged over the replicas).
    fn busy_share(&self, before: &Engine) -> f64 {
        let wall = (self.at - before.at).as_secs_f64();
        self.device_busy / wall.max(1e-9) / self.replicas.max(1) as f64
    }
}

fn random_prompt(rng: &mut Rng, len: usize, vocab: usize) -> Vec<u32> {
    (0..len).map(|_| rng.below(vocab as u64) as u32).collect()
}

pub fn run(a: Args) -> Result<()> {
    a.run.init_threads();
    let mut _server = None;
    let (addr, vocab, what) = match &a.url {
        Some(u) => {
            let hp = u.trim_start_matches("http://").trim_end_matches('/');
            let addr: SocketAddr = hp
                .parse()
                .map_err(|_| Error::input(format!("--url {u}: expected http://IP:PORT")))?;
            let models = client::get(addr, "/v1/models")
                .map_err(|e| Error::Other(format!("{addr}: {e}")))?;
            (
                addr,
                a.vocab,
                format!("server at {addr} ({})", models.text().trim()),
            )
        }
        None => {
            let source = match &a.model {
                Some(_) => ModelSource::resolve(a.model.as_deref())?,
                None => ModelSource::Synthetic {
                    config: Config::synthetic(
                        a.d_model, a.layers, a.d_state, a.headdim, a.expand, 1, a.vocab,
                    ),
                    seed: 0,
                },
            };
            let mut cfg = ServeConfig::new(source.clone());
            cfg.device = a.run.device.resolve();
            if let Some(list) = &a.devices {
                cfg.devices =
                    super::serve::parse_devices(list, crate::engine::cuda_device_count())?;
                cfg.device = cfg.devices[0];
            }
            cfg.dtype = a.run.dtype;
            cfg.addr = SocketAddr::from(([127, 0, 0, 1], 0));
            cfg.max_queue = 4096;
            cfg.max_tokens_limit = a.max_tokens.max(1);
            cfg.scheduler = SchedulerConfig {
                max_batch: a.max_batch,
                prefill_chunk: a.prefill_chunk,
                cache_bytes: a.cache_mib << 20,
                ..SchedulerConfig::default()
            };
            let vocab = match &source {
                ModelSource::Dir(d) => config_vocab_size(d)?,
                ModelSource::Synthetic { config, .. } => config.vocab_size,
            };
            let on: Vec<String> = cfg.replicas().iter().map(|d| d.to_string()).collect();
            let h = crate::serve::spawn(cfg)?;
            let addr = h.addr;
            _server = Some(h);
            let what = format!(
                "in-process server, {} on {} ({}), {} threads",
                match &a.model {
                    Some(p) => p.display().to_string(),
                    None => format!(
                        "synthetic d_model {} · layers {} · d_state {} · headdim {} · vocab {}",
                        a.d_model, a.layers, a.d_state, a.headdim, a.vocab
                    ),
                },
                on.join(", "),
                a.run.dtype,
                rayon::current_num_threads()
            );
            (addr, vocab, what)
        }
    };
    // Wait for the model.
    let t0 = Instant::now();
    loop {
        match client::get(addr, "/health") {
            Ok(r) if r.status == 200 => break,
            Ok(r) if t0.elapsed() > Duration::from_secs(600) => {
                return Err(Error::Other(format!("server not ready: {}", r.text())))
            }
            Err(e) if t0.elapsed() > Duration::from_secs(600) => {
                return Err(Error::Other(format!("server not reachable: {e}")))
            }
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    }
    println!("{what}");
    let mut rng = Rng::new(1234);
    // Warm-up.
    stream_one(addr, &random_prompt(&mut rng, a.prompt_len, vocab), 4)?;

    println!(
        "{:>8} {:>8} {:>14} {:>16} {:>10} {:>12}",
        "clients", "tokens", "wall tok/s", "decode tok/s", "TTFT ms", "x 1 client"
    );
    let mut base = None;
    let mut rows = Vec::new();
    for &c in &a.clients.0 {
        let mut tps = Vec::new();
        let mut dps = Vec::new();
        let mut ttfts = Vec::new();
        let mut total = 0;
        let before = Engine::read(addr)?;
        for _ in 0..a.repeats.max(1) {
            let prompts: Vec<Vec<u32>> = (0..c)
                .map(|_| random_prompt(&mut rng, a.prompt_len, vocab))
                .collect();
            let start = Instant::now();
            let results: Vec<Result<(Duration, usize, Instant, f64)>> = std::thread::scope(|s| {
                let hs: Vec<_> = prompts
                    .iter()
                    .map(|p| s.spawn(move || stream_one(addr, p, a.max_tokens)))
                    .collect();
                hs.into_iter()
                    .map(|h| {
                        h.join()
                            .unwrap_or_else(|_| Err(Error::Other("client thread panicked".into())))
                    })
                    .collect()
            });
            let mut n = 0;
            let mut end = start;
            let mut decode = 0.0;
            for r in results {
                let (ttft, k, e, rate) = r?;
                n += k;
                end = end.max(e);
                decode += rate;
                ttfts.push(ttft.as_secs_f64());
            }
            total = n;
            tps.push(n as f64 / (end - start).as_secs_f64());
            dps.push(decode);
        }
        let t = median(tps);
        let dt = median(dps);
        let b = *base.get_or_insert(dt);
        // Server side, all repeats together: where a decode step's time goes.
        let now = Engine::read(addr)?;
        let e = now.since(before);
        let busy = e.busy_share(&before);
        let per_step = |p: Phase| e.phase(p) / e.steps.max(1.0) * 1e6;
        let (dec, smp, emit) = (
            per_step(Phase::Decode),
            per_step(Phase::Sample),
            per_step(Phase::Emit),
        );
        let mean_batch = e.rows / e.steps.max(1.0);
        println!(
            "{:>8} {:>8} {:>14.1} {:>16.1} {:>10.1} {:>12.2}   step: {:.1} rows, model {:.0} us, sample {:.0} us, emit {:.0} us; device busy {:.0} %",
            c,
            total,
            t,
            dt,
            median(ttfts.clone()) * 1e3,
            dt / b,
            mean_batch,
            dec,
            smp,
            emit,
            busy * 100.0
        );
        rows.push(json!({"test": "throughput", "clients": c, "tokens": total,
                         "aggregate_tokens_per_s": t, "aggregate_decode_tokens_per_s": dt,
                         "median_ttft_ms": median(ttfts) * 1e3,
                         "speedup_vs_first": dt / b, "max_tokens": a.max_tokens,
                         "prompt_len": a.prompt_len, "decode_steps": e.steps,
                         "mean_step_rows": mean_batch, "step_model_us": dec,
                         "step_sample_us": smp, "step_emit_us": emit,
                         "device_busy_share": busy}));
    }

    if a.prefix_len > 0 {
        let (mut cold, mut hit) = (Vec::new(), Vec::new());
        let (mut hit_admit, mut hit_prefill, mut hit_server) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..a.repeats.max(1) {
            let prefix = random_prompt(&mut rng, a.prefix_len, vocab);
            let with = |rng: &mut Rng| {
                let mut p = prefix.clone();
                p.extend(random_prompt(rng, a.suffix_len, vocab));
                p
            };
            let (p1, p2, p3) = (with(&mut rng), with(&mut rng), with(&mut rng));
            cold.push(stream_one(addr, &p1, 1)?.0.as_secs_f64());
            stream_one(addr, &p2, 1)?; // snapshots the branch point (the shared prefix)
            let before = Engine::read(addr)?;
            hit.push(stream_one(addr, &p3, 1)?.0.as_secs_f64());
            let e = Engine::read(addr)?.since(before);
            hit_admit.push(e.phase(Phase::Admit));
            hit_prefill.push(e.phase(Phase::Prefill));
            hit_server.push(e.ttft);
        }
        let (c, h) = (median(cold), median(hit));
        let (ha, hp, hs) = (median(hit_admit), median(hit_prefill), median(hit_server));
        println!(
            "TTFT on a {}-token shared prefix (+{} tokens): cold {:.1} ms · prefix-cache hit {:.1} ms · {:.1}x faster",
            a.prefix_len,
            a.suffix_len,
            c * 1e3,
            h * 1e3,
            c / h
        );
        println!(
            "  the hit in the server: {:.2} ms from its arrival in the queue to its first token (admit {:.2} ms, prefill turn {:.2} ms); the rest is HTTP",
            hs * 1e3,
            ha * 1e3,
            hp * 1e3
        );
        rows.push(
            json!({"test": "prefix_ttft", "prefix_len": a.prefix_len, "suffix_len": a.suffix_len,
                         "cold_ms": c * 1e3, "hit_ms": h * 1e3, "speedup": c / h,
                         "hit_admit_ms": ha * 1e3, "hit_prefill_ms": hp * 1e3,
                         "hit_server_ttft_ms": hs * 1e3}),
        );
    }
    let m = client::get(addr, "/metrics")
        .map_err(|e| Error::Other(format!("{addr}/metrics: {e}")))?
        .text();
    let bytes = sample(&m, "mamba3_prefix_cache_bytes").unwrap_or(f64::NAN);
    let budget = sample(&m, "mamba3_prefix_cache_budget_bytes").unwrap_or(f64::NAN);
    println!(
        "prefix cache: {:.1} MiB held of a {:.1} MiB budget, {} entries, {} hits",
        bytes / 1048576.0,
        budget / 1048576.0,
        sample(&m, "mamba3_prefix_cache_entries").unwrap_or(f64::NAN),
        sample(&m, "mamba3_prefix_cache_hits_total").unwrap_or(f64::NAN)
    );
    rows.push(json!({"test": "prefix_cache", "bytes": bytes, "budget": budget}));
    if a.json {
        for r in rows {
            println!("{r}");
        }
    }
    Ok(())
}

/// `vocab_size` from a model folder's `config.json`, whatever its mixer and layout (every
/// layout names it so): the range of the random prompts.
fn config_vocab_size(dir: &std::path::Path) -> Result<usize> {
    let path = crate::mixers::config_path(dir);
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::input(format!("{}: not JSON: {e}", path.display())))?;
    v.get("vocab_size")
        .and_then(serde_json::Value::as_u64)
        .map(|n| n as usize)
        .ok_or_else(|| Error::input(format!("{}: no integer `vocab_size`", path.display())))
}
