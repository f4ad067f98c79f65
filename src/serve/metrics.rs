//! Server metrics in the Prometheus text exposition format (`GET /metrics`), written by
//! hand: counters and gauges are atomics, histograms fixed bucket lists (vLLM's, with
//! finer low buckets for small models).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_ns: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_ns: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, seconds: f64) {
        let i = self
            .bounds
            .iter()
            .position(|&b| seconds <= b)
            .unwrap_or(self.bounds.len());
        self.counts[i].fetch_add(1, Relaxed);
        self.sum_ns.fetch_add((seconds * 1e9) as u64, Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Relaxed)).sum()
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut acc = 0;
        for (i, b) in self.bounds.iter().enumerate() {
            acc += self.counts[i].load(Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {acc}");
        }
        acc += self.counts[self.bounds.len()].load(Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {acc}");
        let _ = writeln!(
            out,
            "{name}_sum {}\n{name}_count {acc}",
            self.sum_ns.load(Relaxed) as f64 / 1e9
        );
    }
}

const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
    5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
];

/// Where the engine thread's time goes, phase by phase (`mamba3_engine_seconds_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Looking a new sequence up in the prefix cache and giving it a state.
    Admit,
    /// Prefill turns (the model call, the cache inserts, the first tokens' sampling).
    Prefill,
    /// The model's decode steps, logits back on the host.
    Decode,
    /// Sampling the decode steps' rows.
    Sample,
    /// Streaming the sampled tokens out (and caching finished sequences).
    Emit,
}

impl Phase {
    pub const ALL: [Phase; 5] = [
        Phase::Admit,
        Phase::Prefill,
        Phase::Decode,
        Phase::Sample,
        Phase::Emit,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Phase::Admit => "admit",
            Phase::Prefill => "prefill",
            Phase::Decode => "decode",
            Phase::Sample => "sample",
            Phase::Emit => "emit",
        }
    }
}

pub struct Metrics {
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub queue_depth: AtomicI64,
    pub active_sequences: AtomicI64,
    pub cancelled: AtomicU64,
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
    pub cache_hit_tokens: AtomicU64,
    pub cache_bytes: AtomicU64,
    pub cache_budget: AtomicU64,
    pub cache_entries: AtomicU64,
    pub cache_evictions: AtomicU64,
    /// Nanoseconds spent per [`Phase`].
    engine_ns: [AtomicU64; Phase::ALL.len()],
    pub decode_steps: AtomicU64,
    pub decode_rows: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        Metrics {
            requests: Mutex::new(BTreeMap::new()),
            prompt_tokens: AtomicU64::new(0),
            generated_tokens: AtomicU64::new(0),
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            queue_depth: AtomicI64::new(0),
            active_sequences: AtomicI64::new(0),
            cancelled: AtomicU64::new(0),
            cache_hits: AtomicU64::new(0),
            cache_misses: AtomicU64::new(0),
            cache_hit_tokens: AtomicU64::new(0),
            cache_bytes: AtomicU64::new(0),
            cache_budget: AtomicU64::new(0),
            cache_entries: AtomicU64::new(0),
            cache_evictions: AtomicU64::new(0),
            engine_ns: Default::default(),
            decode_steps: AtomicU64::new(0),
            decode_rows: AtomicU64::new(0),
        }
    }

    /// Count the time since `since` to `phase`; returns now, the start of the next phase.
    pub fn spent(&self, phase: Phase, since: std::time::Instant) -> std::time::Instant {
        let now = std::time::Instant::now();
        self.engine_ns[phase as usize].fetch_add((now - since).as_nanos() as u64, Relaxed);
        now
    }

    pub fn count_request(&self, route: &str, status: u16) {
        let mut m = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry((route.to_string(), status)).or_insert(0) += 1;
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        };
        let gauge = |out: &mut String, name: &str, help: &str, v: i64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        let _ = writeln!(
            out,
            "# HELP mamba3_requests_total HTTP requests by route and status.\n\
             # TYPE mamba3_requests_total counter"
        );
        for ((route, status), n) in self
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            let route = route.replace('\\', "\\\\").replace('"', "\\\"");
            let _ = writeln!(
                out,
                "mamba3_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}"
            );
        }
        let l = |a: &AtomicU64| a.load(Relaxed);
        counter(
            &mut out,
            "mamba3_prompt_tokens_total",
            "Prompt tokens received (cached ones included).",
            l(&self.prompt_tokens),
        );
        counter(
            &mut out,
            "mamba3_generation_tokens_total",
            "Tokens generated.",
            l(&self.generated_tokens),
        );
        self.ttft.render(
            &mut out,
            "mamba3_time_to_first_token_seconds",
            "Time from a request's arrival to its first token.",
        );
        self.itl.render(
            &mut out,
            "mamba3_inter_token_latency_seconds",
            "Time between consecutive tokens of a sequence.",
        );
        gauge(
            &mut out,
            "mamba3_queue_depth",
            "Sequences waiting for a slot.",
            self.queue_depth.load(Relaxed),
        );
        gauge(
            &mut out,
            "mamba3_active_sequences",
            "Sequences being prefilled or decoded.",
            self.active_sequences.load(Relaxed),
        );
        counter(
            &mut out,
            "mamba3_cancelled_sequences_total",
            "Sequences dropped because their client went away.",
            l(&self.cancelled),
        );
        counter(
            &mut out,
            "mamba3_prefix_cache_hits_total",
            "Prompts that started from a cached prefix state.",
            l(&self.cache_hits),
        );
        counter(
            &mut out,
            "mamba3_prefix_cache_misses_total",
            "Prompts with no cached prefix.",
            l(&self.cache_misses),
        );
        counter(
            &mut out,
            "mamba3_prefix_cache_hit_tokens_total",
            "Prompt tokens not prefilled thanks to the prefix cache.",
            l(&self.cache_hit_tokens),
        );
        gauge(
            &mut out,
            "mamba3_prefix_cache_bytes",
            "Bytes held by the prefix cache.",
            l(&self.cache_bytes) as i64,
        );
        gauge(
            &mut out,
            "mamba3_prefix_cache_budget_bytes",
            "The prefix cache's byte budget.",
            l(&self.cache_budget) as i64,
        );
        gauge(
            &mut out,
            "mamba3_prefix_cache_entries",
            "Prefix states held.",
            l(&self.cache_entries) as i64,
        );
        counter(
            &mut out,
            "mamba3_prefix_cache_evictions_total",
            "Prefix states evicted to stay within the budget.",
            l(&self.cache_evictions),
        );
        let _ = writeln!(
            out,
            "# HELP mamba3_engine_seconds_total Time of the engine thread by phase.\n\
             # TYPE mamba3_engine_seconds_total counter"
        );
        for p in Phase::ALL {
            let _ = writeln!(
                out,
                "mamba3_engine_seconds_total{{phase=\"{}\"}} {}",
                p.name(),
                l(&self.engine_ns[p as usize]) as f64 / 1e9
            );
        }
        counter(
            &mut out,
            "mamba3_decode_steps_total",
            "Batched decode steps run.",
            l(&self.decode_steps),
        );
        counter(
            &mut out,
            "mamba3_decode_rows_total",
            "Sequences advanced by decode steps (the steps' batch sizes summed).",
            l(&self.decode_rows),
        );
        out
    }
}

/// The value of an unlabelled sample in a Prometheus text page (for tests and tools).
pub fn sample(page: &str, name: &str) -> Option<f64> {
    page.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (k, v) = l.rsplit_once(' ')?;
        (k == name).then(|| v.parse().ok()).flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_has_counters_gauges_and_histograms() {
        let m = Metrics::new();
        m.count_request("/v1/completions", 200);
        m.count_request("/v1/completions", 200);
        m.count_request("/v1/completions", 400);
        m.ttft.observe(0.003);
        m.ttft.observe(100.0);
        m.active_sequences.store(3, Relaxed);
        let page = m.render();
        assert!(page.contains("mamba3_requests_total{route=\"/v1/completions\",status=\"200\"} 2"));
        assert!(page.contains("mamba3_requests_total{route=\"/v1/completions\",status=\"400\"} 1"));
        assert!(page.contains("mamba3_time_to_first_token_seconds_bucket{le=\"0.005\"} 1"));
        assert!(page.contains("mamba3_time_to_first_token_seconds_bucket{le=\"+Inf\"} 2"));
        assert_eq!(sample(&page, "mamba3_active_sequences"), Some(3.0));
        let t0 = std::time::Instant::now() - std::time::Duration::from_millis(2);
        m.spent(Phase::Sample, t0);
        let page = m.render();
        let v = sample(&page, "mamba3_engine_seconds_total{phase=\"sample\"}").unwrap();
        assert!((0.002..1.0).contains(&v), "sample phase {v}");
        assert_eq!(
            sample(&page, "mamba3_engine_seconds_total{phase=\"decode\"}"),
            Some(0.0)
        );
        assert_eq!(
            sample(&page, "mamba3_time_to_first_token_seconds_count"),
            Some(2.0)
        );
    }
}
