//! Server metrics in the Prometheus text exposition format (`GET /metrics`), written by
//! hand: counters and gauges are atomics, histograms fixed bucket lists (vLLM's, with
//! finer low buckets for small models).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Instant;

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
    /// Sampling the decode steps' rows apart from the step (none now: `Model::decode_sample`
    /// samples inside `Decode`; kept so that the page's phases stay the same).
    Sample,
    /// Handing the sampled tokens to the emitter thread (and caching finished sequences).
    Emit,
    /// Waiting for the emitter to finish the previous turn's tokens (near zero while the
    /// emitter keeps up: its work overlaps the next device step).
    EmitWait,
}

impl Phase {
    pub const ALL: [Phase; 6] = [
        Phase::Admit,
        Phase::Prefill,
        Phase::Decode,
        Phase::Sample,
        Phase::Emit,
        Phase::EmitWait,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Phase::Admit => "admit",
            Phase::Prefill => "prefill",
            Phase::Decode => "decode",
            Phase::Sample => "sample",
            Phase::Emit => "emit",
            Phase::EmitWait => "emit_wait",
        }
    }
}

/// The server's metrics: what concerns the whole server here, what concerns one model
/// replica (one device, its engine thread) in [`DeviceMetrics`]. The unlabelled families
/// of the page sum the replicas; the `mamba3_device_*` families give each one.
pub struct Metrics {
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    pub prompt_tokens: AtomicU64,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub cancelled: AtomicU64,
    /// Sequences submitted and not yet admitted by any replica.
    pub queue_depth: AtomicI64,
    /// Each replica's prefix-cache budget (they are alike).
    pub cache_budget: AtomicU64,
    pub devices: Vec<Arc<DeviceMetrics>>,
}

/// One replica's counters, written by its engine thread and its emitter.
pub struct DeviceMetrics {
    /// The device it runs on (`cpu`, `cuda:1`), a label of the page.
    pub device: String,
    /// Sequences this replica has taken in and not yet admitted.
    pub queue_depth: AtomicI64,
    /// Sequences sent to this replica (by `serve::dispatch`), taken in by its engine
    /// thread, and held there (waiting or active): its load is sent − taken + held.
    pub sent: AtomicU64,
    pub taken: AtomicU64,
    pub held: AtomicI64,
    pub active_sequences: AtomicI64,
    pub generated_tokens: AtomicU64,
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
    pub cache_hit_tokens: AtomicU64,
    pub cache_bytes: AtomicU64,
    pub cache_entries: AtomicU64,
    pub cache_evictions: AtomicU64,
    /// Nanoseconds spent per [`Phase`].
    engine_ns: [AtomicU64; Phase::ALL.len()],
    pub decode_steps: AtomicU64,
    pub decode_rows: AtomicU64,
    /// Time inside the model's calls that run on the device (prefill passes, decode
    /// steps, and on the CPU the embedding reads): every such call returns once its
    /// results are on the host, so the device can only be busy inside them.
    pub device_busy: BusyMeter,
    /// Time the engine thread spent in its turns (not waiting for work).
    pub engine_busy: BusyMeter,
    /// Time the emitter thread spent detokenizing, checking stop strings and sending.
    pub emitter_busy: BusyMeter,
}

/// Width of one slot of a [`BusyMeter`] and the slots it keeps: the ratio is read over
/// the last `BUSY_SLOTS - 1` complete slots (4 s).
const BUSY_SLOT_NS: u64 = 250_000_000;
const BUSY_SLOTS: usize = 17;

/// Busy time, in total and over a sliding window: each interval given to
/// [`BusyMeter::add`] is split over fixed slots of 250 ms, and [`BusyMeter::ratio`] is
/// the busy share of the last 4 s of complete slots. One thread writes a meter; an
/// interval counts when it is added (when its call returns).
pub struct BusyMeter {
    origin: Instant,
    total_ns: AtomicU64,
    /// The slot number (+1; 0: none yet) whose time each cell holds, and that time.
    slot_of: [AtomicU64; BUSY_SLOTS],
    slot_ns: [AtomicU64; BUSY_SLOTS],
}

impl Default for BusyMeter {
    fn default() -> Self {
        BusyMeter::new()
    }
}

impl BusyMeter {
    pub fn new() -> BusyMeter {
        BusyMeter {
            origin: Instant::now(),
            total_ns: AtomicU64::new(0),
            slot_of: Default::default(),
            slot_ns: Default::default(),
        }
    }

    fn ns(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.origin).as_nanos() as u64
    }

    /// Count `start..end` as busy.
    pub fn add(&self, start: Instant, end: Instant) {
        let (s, e) = (self.ns(start), self.ns(end));
        if e <= s {
            return;
        }
        self.total_ns.fetch_add(e - s, Relaxed);
        // Only the last BUSY_SLOTS slots of a long interval can still be read.
        let first =
            (s / BUSY_SLOT_NS).max((e / BUSY_SLOT_NS).saturating_sub(BUSY_SLOTS as u64 - 1));
        for k in first..=e / BUSY_SLOT_NS {
            let lo = s.max(k * BUSY_SLOT_NS);
            let hi = e.min((k + 1) * BUSY_SLOT_NS);
            if hi <= lo {
                continue;
            }
            let cell = k as usize % BUSY_SLOTS;
            if self.slot_of[cell].load(Relaxed) != k + 1 {
                self.slot_of[cell].store(k + 1, Relaxed);
                self.slot_ns[cell].store(0, Relaxed);
            }
            self.slot_ns[cell].fetch_add(hi - lo, Relaxed);
        }
    }

    /// Count the time since `since` as busy; returns now.
    pub fn since(&self, since: Instant) -> Instant {
        let now = Instant::now();
        self.add(since, now);
        now
    }

    /// Busy seconds in all.
    pub fn total_seconds(&self) -> f64 {
        self.total_ns.load(Relaxed) as f64 / 1e9
    }

    /// The busy share of the window before `now` (0 to 1): the last complete slots, or
    /// the time since the meter started while it is younger than one slot.
    pub fn ratio(&self, now: Instant) -> f64 {
        let t = self.ns(now);
        let cur = t / BUSY_SLOT_NS;
        let busy_in = |k: u64| {
            let cell = k as usize % BUSY_SLOTS;
            if self.slot_of[cell].load(Relaxed) == k + 1 {
                self.slot_ns[cell].load(Relaxed)
            } else {
                0
            }
        };
        if cur == 0 {
            return if t == 0 {
                0.0
            } else {
                (busy_in(0) as f64 / t as f64).min(1.0)
            };
        }
        let from = cur.saturating_sub(BUSY_SLOTS as u64 - 1);
        let busy: u64 = (from..cur).map(busy_in).sum();
        (busy as f64 / ((cur - from) * BUSY_SLOT_NS) as f64).min(1.0)
    }
}

impl DeviceMetrics {
    pub fn new(device: String) -> DeviceMetrics {
        DeviceMetrics {
            device,
            queue_depth: AtomicI64::new(0),
            sent: AtomicU64::new(0),
            taken: AtomicU64::new(0),
            held: AtomicI64::new(0),
            active_sequences: AtomicI64::new(0),
            generated_tokens: AtomicU64::new(0),
            cache_hits: AtomicU64::new(0),
            cache_misses: AtomicU64::new(0),
            cache_hit_tokens: AtomicU64::new(0),
            cache_bytes: AtomicU64::new(0),
            cache_entries: AtomicU64::new(0),
            cache_evictions: AtomicU64::new(0),
            engine_ns: Default::default(),
            decode_steps: AtomicU64::new(0),
            decode_rows: AtomicU64::new(0),
            device_busy: BusyMeter::new(),
            engine_busy: BusyMeter::new(),
            emitter_busy: BusyMeter::new(),
        }
    }

    /// Count the time since `since` to `phase`; returns now, the start of the next phase.
    pub fn spent(&self, phase: Phase, since: Instant) -> Instant {
        let now = Instant::now();
        self.engine_ns[phase as usize].fetch_add((now - since).as_nanos() as u64, Relaxed);
        now
    }

    /// Sequences sent to this replica and not yet ended.
    pub fn load(&self) -> i64 {
        // (held first: a sequence being taken in is counted twice for a moment, never
        // missed)
        let held = self.held.load(Relaxed);
        self.sent.load(Relaxed) as i64 - self.taken.load(Relaxed) as i64 + held
    }

    /// Seconds spent in `phase` so far.
    pub fn phase_seconds(&self, phase: Phase) -> f64 {
        self.engine_ns[phase as usize].load(Relaxed) as f64 / 1e9
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// The metrics of a server of one replica on the CPU.
    pub fn new() -> Metrics {
        Metrics::for_devices(&["cpu".to_string()])
    }

    /// The metrics of a server with one replica per entry of `devices` (their names).
    pub fn for_devices(devices: &[String]) -> Metrics {
        Metrics {
            requests: Mutex::new(BTreeMap::new()),
            prompt_tokens: AtomicU64::new(0),
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            cancelled: AtomicU64::new(0),
            queue_depth: AtomicI64::new(0),
            cache_budget: AtomicU64::new(0),
            devices: devices
                .iter()
                .map(|d| Arc::new(DeviceMetrics::new(d.clone())))
                .collect(),
        }
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
        // Summed over the replicas.
        let sum =
            |f: &dyn Fn(&DeviceMetrics) -> u64| self.devices.iter().map(|d| f(d)).sum::<u64>();
        let isum =
            |f: &dyn Fn(&DeviceMetrics) -> i64| self.devices.iter().map(|d| f(d)).sum::<i64>();
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
            sum(&|d| l(&d.generated_tokens)),
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
            isum(&|d| d.active_sequences.load(Relaxed)),
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
            sum(&|d| l(&d.cache_hits)),
        );
        counter(
            &mut out,
            "mamba3_prefix_cache_misses_total",
            "Prompts with no cached prefix.",
            sum(&|d| l(&d.cache_misses)),
        );
        counter(
            &mut out,
            "mamba3_prefix_cache_hit_tokens_total",
            "Prompt tokens not prefilled thanks to the prefix cache.",
            sum(&|d| l(&d.cache_hit_tokens)),
        );
        gauge(
            &mut out,
            "mamba3_prefix_cache_bytes",
            "Bytes held by the prefix caches.",
            sum(&|d| l(&d.cache_bytes)) as i64,
        );
        gauge(
            &mut out,
            "mamba3_prefix_cache_budget_bytes",
            "The prefix cache's byte budget (of each replica).",
            l(&self.cache_budget) as i64,
        );
        gauge(
            &mut out,
            "mamba3_prefix_cache_entries",
            "Prefix states held.",
            sum(&|d| l(&d.cache_entries)) as i64,
        );
        counter(
            &mut out,
            "mamba3_prefix_cache_evictions_total",
            "Prefix states evicted to stay within the budget.",
            sum(&|d| l(&d.cache_evictions)),
        );
        let _ = writeln!(
            out,
            "# HELP mamba3_engine_seconds_total Time of the engine threads by phase.\n\
             # TYPE mamba3_engine_seconds_total counter"
        );
        for p in Phase::ALL {
            let ns = sum(&|d| l(&d.engine_ns[p as usize]));
            let _ = writeln!(
                out,
                "mamba3_engine_seconds_total{{phase=\"{}\"}} {}",
                p.name(),
                ns as f64 / 1e9
            );
        }
        counter(
            &mut out,
            "mamba3_decode_steps_total",
            "Batched decode steps run.",
            sum(&|d| l(&d.decode_steps)),
        );
        counter(
            &mut out,
            "mamba3_decode_rows_total",
            "Sequences advanced by decode steps (the steps' batch sizes summed).",
            sum(&|d| l(&d.decode_rows)),
        );
        self.render_devices(&mut out);
        out
    }

    /// The `mamba3_device_*` families: one sample per replica, labelled with its index
    /// and device.
    fn render_devices(&self, out: &mut String) {
        let now = Instant::now();
        type Value = fn(&DeviceMetrics, Instant) -> String;
        let families: [(&str, &str, &str, Value); 12] = [
            (
                "mamba3_device_busy_ratio",
                "gauge",
                "Share of the last 4 s the replica's device had work: the engine thread was \
                 inside a device call (prefill, decode step; on the CPU also embeddings), each \
                 of which returns once its results are on the host. On a GPU this bounds the \
                 time the GPU had work queued from above (the host's launch gaps inside a \
                 call count as busy); on the CPU it is the share of the engine thread's time \
                 spent computing.",
                |d, now| format!("{:.4}", d.device_busy.ratio(now)),
            ),
            (
                "mamba3_device_busy_seconds_total",
                "counter",
                "Seconds inside device calls (as mamba3_device_busy_ratio counts them).",
                |d, _| format!("{}", d.device_busy.total_seconds()),
            ),
            (
                "mamba3_engine_busy_ratio",
                "gauge",
                "Share of the last 4 s the replica's engine thread was in a turn (not waiting \
                 for work).",
                |d, now| format!("{:.4}", d.engine_busy.ratio(now)),
            ),
            (
                "mamba3_engine_busy_seconds_total",
                "counter",
                "Seconds the engine thread spent in turns.",
                |d, _| format!("{}", d.engine_busy.total_seconds()),
            ),
            (
                "mamba3_emitter_busy_ratio",
                "gauge",
                "Share of the last 4 s the replica's emitter thread spent detokenizing, \
                 checking stop strings and sending tokens (overlapping the device's steps).",
                |d, now| format!("{:.4}", d.emitter_busy.ratio(now)),
            ),
            (
                "mamba3_device_active_sequences",
                "gauge",
                "Sequences being prefilled or decoded by the replica.",
                |d, _| d.active_sequences.load(Relaxed).to_string(),
            ),
            (
                "mamba3_device_queue_depth",
                "gauge",
                "Sequences sent to the replica and waiting for a slot.",
                |d, _| d.queue_depth.load(Relaxed).to_string(),
            ),
            (
                "mamba3_device_generation_tokens_total",
                "counter",
                "Tokens the replica generated.",
                |d, _| d.generated_tokens.load(Relaxed).to_string(),
            ),
            (
                "mamba3_device_decode_steps_total",
                "counter",
                "Batched decode steps the replica ran.",
                |d, _| d.decode_steps.load(Relaxed).to_string(),
            ),
            (
                "mamba3_device_prefix_cache_hits_total",
                "counter",
                "Prompts the replica started from a cached prefix state.",
                |d, _| d.cache_hits.load(Relaxed).to_string(),
            ),
            (
                "mamba3_device_prefix_cache_misses_total",
                "counter",
                "Prompts the replica started with no cached prefix.",
                |d, _| d.cache_misses.load(Relaxed).to_string(),
            ),
            (
                "mamba3_device_prefix_cache_bytes",
                "gauge",
                "Bytes held by the replica's prefix cache.",
                |d, _| d.cache_bytes.load(Relaxed).to_string(),
            ),
        ];
        for (name, kind, help, value) in families {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (i, d) in self.devices.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "{name}{{replica=\"{i}\",device=\"{}\"}} {}",
                    d.device,
                    value(d, now)
                );
            }
        }
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
        m.devices[0].active_sequences.store(3, Relaxed);
        let page = m.render();
        assert!(page.contains("mamba3_requests_total{route=\"/v1/completions\",status=\"200\"} 2"));
        assert!(page.contains("mamba3_requests_total{route=\"/v1/completions\",status=\"400\"} 1"));
        assert!(page.contains("mamba3_time_to_first_token_seconds_bucket{le=\"0.005\"} 1"));
        assert!(page.contains("mamba3_time_to_first_token_seconds_bucket{le=\"+Inf\"} 2"));
        assert_eq!(sample(&page, "mamba3_active_sequences"), Some(3.0));
        let t0 = std::time::Instant::now() - std::time::Duration::from_millis(2);
        m.devices[0].spent(Phase::Sample, t0);
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

    #[test]
    fn busy_meter_reads_the_last_complete_slots() {
        use std::time::Duration;
        let b = BusyMeter::new();
        let at = |ms: u64| b.origin + Duration::from_millis(ms);
        b.add(at(100), at(600));
        assert!((b.total_seconds() - 0.5).abs() < 1e-9);
        // Slots 0..4 (1 s) hold 0.5 s busy.
        assert!(
            (b.ratio(at(1000)) - 0.5).abs() < 1e-9,
            "{}",
            b.ratio(at(1000))
        );
        // Younger than one slot: the time so far.
        let young = BusyMeter::new();
        young.add(
            young.origin + Duration::from_millis(50),
            young.origin + Duration::from_millis(150),
        );
        let r = young.ratio(young.origin + Duration::from_millis(200));
        assert!((r - 0.5).abs() < 1e-9, "{r}");
        // Out of the 4 s window.
        assert_eq!(b.ratio(at(10_000)), 0.0);
        // A long interval fills the window; its old slots are not kept.
        b.add(at(10_000), at(20_000));
        assert!((b.ratio(at(20_000)) - 1.0).abs() < 1e-9);
        assert!(
            (b.ratio(at(22_000)) - 0.5).abs() < 1e-9,
            "{}",
            b.ratio(at(22_000))
        );
        assert!((b.total_seconds() - 10.5).abs() < 1e-9);
        // Two replicas: each labelled, the unlabelled families their sums.
        let m = Metrics::for_devices(&["cuda:0".into(), "cuda:1".into()]);
        m.devices[0].active_sequences.store(2, Relaxed);
        m.devices[1].active_sequences.store(5, Relaxed);
        m.devices[1]
            .device_busy
            .add(m.devices[1].device_busy.origin, Instant::now());
        let page = m.render();
        assert_eq!(sample(&page, "mamba3_active_sequences"), Some(7.0));
        assert_eq!(
            sample(
                &page,
                "mamba3_device_active_sequences{replica=\"1\",device=\"cuda:1\"}"
            ),
            Some(5.0)
        );
        assert!(
            sample(
                &page,
                "mamba3_device_busy_seconds_total{replica=\"1\",device=\"cuda:1\"}"
            )
            .unwrap()
                > 0.0
        );
        assert_eq!(
            sample(
                &page,
                "mamba3_device_busy_seconds_total{replica=\"0\",device=\"cuda:0\"}"
            ),
            Some(0.0)
        );
    }
}
