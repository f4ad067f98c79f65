//! The gradient reduction overlapped with the backward (`train::parallel`'s module doc,
//! `train::ready`): over the host collective, with 2 and 4 CPU workers, SISO and MIMO, and
//! buckets that cut tensors, hold several or hold everything, overlapped training equals
//! the reduction after the backward bit for bit over several steps, and so does a backend
//! that never calls the hook; the hook fires once per stage of each rank's last
//! micro-batch, in the backward's order, and each bucket's all-reduce starts right after
//! the stage that completes it; a rank failing mid-backward aborts the group instead of
//! leaving its peers waiting.
mod common;
use common::{random_batch, sentences_text, short_run};

use mamba3::error::Result;
use mamba3::model::Config;
use mamba3::train::collective::{Collective, FlatBuf, HostCollective};
use mamba3::train::data::Dataset;
use mamba3::train::parallel::{DataParallel, HostReplica, MakeReplica, Replica};
use mamba3::train::ready::{GradReady, Stage};
use mamba3::train::trainer::Trainer;
use mamba3::train::{Backend, Batch, CpuBackend, Params};
use std::ops::Range;
use std::sync::{Arc, Mutex};

fn siso() -> Config {
    let mut c = Config::synthetic(32, 2, 16, 16, 2, 1, 256);
    c.ssm_cfg.chunk_size = 16;
    c.d_intermediate = 48;
    c.tie_embeddings = false;
    c
}

/// Tied embeddings: the head's gradient is final only with the embedding's.
fn mimo() -> Config {
    let mut c = Config::synthetic(32, 2, 16, 16, 2, 1, 256);
    c.ssm_cfg.is_mimo = true;
    c.ssm_cfg.mimo_rank = 2;
    c.ssm_cfg.chunk_size = 8;
    c
}

fn data() -> Dataset {
    let text = sentences_text(
        &[
            "In the beginning was the word. ",
            "The quick brown fox jumps over the lazy dog. ",
            "She sells sea shells by the sea shore.\n",
        ],
        20_000,
    );
    Dataset::from_bytes(&text, 5)
}

/// Bucket sizes that cut every tensor (64 bytes), hold several (4 KiB) and hold everything.
const BUCKETS: [usize; 3] = [64, 4096, 1 << 30];

fn bits(p: &Params<f32>) -> Vec<u32> {
    p.tensors()
        .iter()
        .flat_map(|(_, t)| t.iter().map(|x| x.to_bits()))
        .collect()
}

/// What a rank did, in order.
#[derive(Clone, Debug, PartialEq)]
enum Event {
    /// a micro-batch's backward; `hooked`: through `loss_and_grad_ready`
    Backward {
        hooked: bool,
    },
    Stage(Stage),
    /// an all-reduce of the bucket whose first range is this
    Reduce(Range<usize>),
}

type Log = Arc<Mutex<Vec<Event>>>;

/// The CPU backend with its calls logged; `call_hook: false` is a backend that never
/// calls the hook; `fail` makes the hooked backward fail before its first stage.
struct Logged {
    log: Log,
    call_hook: bool,
    fail: bool,
}

/// Passes the backward's word on to the replica's hook, logging it.
struct Tap<'a> {
    inner: &'a mut dyn GradReady<Params<f32>>,
    log: Log,
}

impl GradReady<Params<f32>> for Tap<'_> {
    fn ready(&mut self, stage: Stage, grad: &mut Params<f32>) -> Result<()> {
        self.log.lock().unwrap().push(Event::Stage(stage));
        self.inner.ready(stage, grad)
    }
}

impl Backend for Logged {
    fn name(&self) -> String {
        "logged cpu".into()
    }

    fn loss_and_grad(&mut self, p: &Params<f32>, b: &Batch, g: &mut Params<f32>) -> Result<f64> {
        let e = Event::Backward { hooked: false };
        self.log.lock().unwrap().push(e);
        CpuBackend.loss_and_grad(p, b, g)
    }

    fn loss_and_grad_ready(
        &mut self,
        p: &Params<f32>,
        b: &Batch,
        g: &mut Params<f32>,
        ready: &mut dyn GradReady<Params<f32>>,
    ) -> Result<f64> {
        let e = Event::Backward { hooked: true };
        self.log.lock().unwrap().push(e);
        if self.fail {
            return Err(mamba3::error::Error::Other(
                "this rank's backward failed".into(),
            ));
        }
        if !self.call_hook {
            return CpuBackend.loss_and_grad(p, b, g);
        }
        let mut tap = Tap {
            inner: ready,
            log: self.log.clone(),
        };
        CpuBackend.loss_and_grad_ready(p, b, g, &mut tap)
    }

    fn loss(&mut self, p: &Params<f32>, b: &Batch) -> Result<f64> {
        CpuBackend.loss(p, b)
    }
}

/// The host collective with its all-reduces logged.
struct LoggedGroup {
    inner: HostCollective,
    log: Log,
}

impl Collective for LoggedGroup {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce_sum(&mut self, buf: FlatBuf<'_>, ranges: &[Range<usize>]) -> Result<()> {
        let e = Event::Reduce(ranges[0].clone());
        self.log.lock().unwrap().push(e);
        self.inner.all_reduce_sum(buf, ranges)
    }
    fn abort(&mut self) {
        self.inner.abort()
    }
}

/// `n` logged CPU ranks; rank `fail_rank` (if any) fails its hooked backward.
fn logged(
    cfg: &Config,
    n: usize,
    bytes: usize,
    call_hook: bool,
    fail_rank: Option<usize>,
) -> (DataParallel, Vec<Log>) {
    let logs: Vec<Log> = (0..n).map(|_| Log::default()).collect();
    let makers = (logs.iter().enumerate())
        .map(|(rank, log)| {
            let (c, log) = (cfg.clone(), log.clone());
            let fail = fail_rank == Some(rank);
            Box::new(move || {
                let b = Logged {
                    log,
                    call_hook,
                    fail,
                };
                Ok(Box::new(HostReplica::new(&c, b)) as Box<dyn Replica>)
            }) as MakeReplica
        })
        .collect();
    let groups = (HostCollective::group(n).unwrap().into_iter().zip(&logs))
        .map(|(inner, log)| {
            let log = log.clone();
            Box::new(LoggedGroup { inner, log }) as Box<dyn Collective>
        })
        .collect();
    (DataParallel::new(cfg, makers, groups, bytes).unwrap(), logs)
}

/// `steps` steps of `accum` micro-batches: the (loss bits, weights, moments) afterwards.
fn train<B: Backend>(cfg: &Config, backend: B, steps: u64, accum: usize) -> (Vec<u64>, Vec<u32>) {
    let run = short_run(cfg.clone(), steps, 2, accum, 24);
    let mut t = Trainer::with_data(run, backend, data()).unwrap();
    while t.progress.step < steps {
        t.step().unwrap();
    }
    t.sync().unwrap();
    let losses = (t.progress.train_loss.iter())
        .map(|(_, l)| l.to_bits())
        .collect();
    let mut state = bits(&t.params);
    state.extend(bits(&t.opt.m));
    state.extend(bits(&t.opt.v));
    (losses, state)
}

#[test]
fn overlapped_equals_after_the_backward_bit_for_bit() {
    for (name, cfg) in [("SISO", siso()), ("MIMO", mimo())] {
        for n in [2, 4] {
            for bytes in BUCKETS {
                let what = format!("{name} N {n} buckets of {bytes} B");
                let mut after = DataParallel::host(&cfg, n, bytes).unwrap();
                after.set_overlap(false);
                let after = train(&cfg, after, 3, n);
                let over = DataParallel::host(&cfg, n, bytes).unwrap();
                assert!(over.overlap(), "overlap is the default");
                let over = train(&cfg, over, 3, n);
                assert_eq!(over.0, after.0, "{what}: losses");
                assert!(over.1 == after.1, "{what}: weights or moments");
                // a backend that never calls the hook: everything reduced after it
                let (silent, _) = logged(&cfg, n, bytes, false, None);
                let silent = train(&cfg, silent, 3, n);
                assert_eq!(silent.0, after.0, "{what}: losses without the hook");
                assert!(silent.1 == after.1, "{what}: weights without the hook");
            }
        }
    }
}

#[test]
fn the_hook_fires_once_per_stage_of_the_last_micro_batch_and_buckets_follow_it() {
    for (name, cfg) in [("SISO", siso()), ("MIMO", mimo())] {
        let n_layer = cfg.n_layer;
        let (n, accum, steps) = (2, 6, 2);
        for bytes in BUCKETS {
            let (dp, logs) = logged(&cfg, n, bytes, true, None);
            let buckets = dp.buckets().to_vec();
            train(&cfg, dp, steps, accum);
            // per step: accum / n − 1 plain backwards, one hooked; after each stage the
            // buckets it completes (ready_at = its key), in the planned order
            let mut want = Vec::new();
            for _ in 0..steps {
                for _ in 0..accum / n - 1 {
                    want.push(Event::Backward { hooked: false });
                }
                want.push(Event::Backward { hooked: true });
                for stage in Stage::all(n_layer) {
                    want.push(Event::Stage(stage));
                    for b in buckets.iter().filter(|b| b.ready_at == stage.key(n_layer)) {
                        want.push(Event::Reduce(b.ranges[0].clone()));
                    }
                }
            }
            for (rank, log) in logs.iter().enumerate() {
                let got = log.lock().unwrap().clone();
                assert_eq!(got, want, "{name} {bytes} B rank {rank}");
            }
        }
    }
}

#[test]
fn without_overlap_or_without_the_hook_every_bucket_waits_for_the_backward() {
    let cfg = siso();
    // overlap off (the hook unused), or on with a backend that never calls it
    for call_hook in [true, false] {
        let (mut dp, logs) = logged(&cfg, 2, 4096, call_hook, None);
        let buckets = dp.buckets().len();
        dp.set_overlap(!call_hook);
        train(&cfg, dp, 1, 2);
        let got = logs[0].lock().unwrap().clone();
        assert_eq!(got[0], Event::Backward { hooked: !call_hook });
        assert!(got[1..].iter().all(|e| matches!(e, Event::Reduce(_))));
        assert_eq!(got.len(), 1 + buckets);
    }
}

#[test]
fn a_rank_failing_mid_backward_aborts_the_group_instead_of_hanging() {
    let cfg = siso();
    let (mut dp, logs) = logged(&cfg, 2, 64, true, Some(1));
    let p = Params::<f32>::init(&cfg, 3).unwrap();
    let bs: Vec<Batch> = (0..2).map(|i| random_batch(256, 2, 24, i)).collect();
    let e = dp.reduced_gradient(&p, &bs).unwrap_err().to_string();
    assert!(e.contains("failed"), "{e}");
    // rank 0 had started reducing, and was let go
    let rank0 = logs[0].lock().unwrap().clone();
    assert!(
        rank0.iter().any(|e| matches!(e, Event::Reduce(_))),
        "{rank0:?}"
    );
    let e = dp.reduced_gradient(&p, &bs).unwrap_err().to_string();
    assert!(e.contains("aborted"), "{e}");
}

#[test]
fn bench_train_reports_the_wait_for_the_reduction_and_checks_the_switch() {
    let bench = |overlap: &str| {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_mamba3"))
            .args(["bench-train", "--devices", "cpu,cpu", "--d-model", "32"])
            .args(["--layers", "2", "--d-state", "16", "--headdim", "16"])
            .args(["--vocab", "64", "--chunk", "16", "--batch", "1"])
            .args(["--seq-len", "16", "--steps", "3", "--warmup", "1", "--json"])
            .args(["--bucket-mb", "0.001", "--overlap-reduce", overlap])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stdout).to_string(),
            err,
        )
    };
    for (flag, on) in [("on", true), ("off", false)] {
        let (code, out, err) = bench(flag);
        assert_eq!(code, Some(0), "{err}");
        let j: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        assert_eq!(j["devices"], 2);
        assert_eq!(j["overlap_reduce"], on, "{out}");
        let wait = j["reduce_wait_ms"].as_f64().expect("a wait in ms");
        assert!(wait.is_finite() && wait >= 0.0, "{out}");
    }
    let (code, _, err) = bench("maybe");
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("expected on or off"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
