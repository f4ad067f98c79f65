//! Sampling a decode batch on the device (kernels/sample.cu), for every GPU backend: the
//! rows' options, logit biases, per-sequence token counts and draw counters live in device
//! buffers; a step launches one block per row over the logits the step left on the device
//! and copies back only the ids, whether each row was finite, and for the rows that ask
//! the log-probabilities of the chosen token and of the few best ([`LOGPROB_WORDS`] words a
//! row). [`DeviceSampling`] is what a GPU backend holds to sample its decode steps.
//!
//! Each sequence's counts and draw counter sit in a slot of their own, named by its
//! sampler's key ([`Sampler::key`]): a slot is filled from the host sampler's history when
//! its sequence first comes (or comes back), and from then on only the kernel writes it
//! (the caller accepts each id into the host sampler too, so that the two agree). The
//! options are uploaded only when the batch's rows change.

use crate::cuda::context::{DevBuf, Gpu, Kernel, PinnedBuf};
use crate::cuda::kernels::{KernelConfig, Module, SAMPLING};
use crate::engine::logprobs::{TokenLogprobs, MAX_TOP_LOGPROBS};
use crate::engine::sample_step::SampleStep;
use crate::engine::sampling::Sampler;
use crate::error::{Error, Result};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

/// Threads per row (`SAMPLE_THREADS` in kernels/sample.cu).
const THREADS: u32 = 1024;

/// Words of a row's log-probabilities (`LOGPROB_WORDS` in kernels/sample.cu): the chosen
/// token's, then [`MAX_TOP_LOGPROBS`] ids (`NO_TOKEN` past the last) and theirs.
const LOGPROB_WORDS: usize = 1 + 2 * MAX_TOP_LOGPROBS;
const NO_TOKEN: u32 = u32::MAX;

/// One row's options (twin of `RowOptions` in kernels/sample.cu: 13 words).
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Debug)]
struct RowOptions {
    temperature: f32,
    top_k: u32,
    top_p: f32,
    min_p: f32,
    repetition_penalty: f32,
    frequency_penalty: f32,
    presence_penalty: f32,
    bias_start: u32,
    bias_len: u32,
    seed_lo: u32,
    seed_hi: u32,
    slot: u32,
    /// 0: none; n + 1: the chosen token's and the n best tokens' log-probabilities
    logprobs: u32,
}

/// The device side of the sampling of decode batches over one vocabulary.
pub struct DeviceSampler {
    gpu: Arc<Gpu>,
    kernel: Kernel,
    vocab: usize,
    /// The key of the sampler whose counts each slot holds.
    slots: Vec<Option<u64>>,
    /// `[slots, vocab]` count words, `[slots]` draw counters (u64).
    counts: DevBuf,
    draws: DevBuf,
    /// Per row: options; the bias list; the scratch row (`ld` floats); then the batch's
    /// ids, finiteness and log-probabilities (`[rows]`, `[rows]`, `[rows, LOGPROB_WORDS]`).
    row_opts: DevBuf,
    bias: DevBuf,
    scratch: DevBuf,
    out: DevBuf,
    out_host: PinnedBuf<u32>,
    /// The rows `out` has room for.
    out_rows: usize,
    /// What `row_opts`/`bias` hold now.
    uploaded: (Vec<RowOptions>, Vec<[u32; 2]>),
    /// Where the last sampled step's logits are (address, row stride), until the next pass.
    last_logits: Option<(u64, usize)>,
    /// The backend's pass counter when the last step was sampled (its logits are valid
    /// while no other pass has run).
    pass: u64,
}

impl DeviceSampler {
    /// The sampling kernel loaded on `gpu` for rows of `vocab` tokens.
    pub fn new(gpu: &Arc<Gpu>, vocab: usize) -> Result<DeviceSampler> {
        let (module, _) = Module::load(gpu, SAMPLING, &KernelConfig { defines: vec![] })?;
        let kernel = module.kernel("sample_rows")?;
        Ok(DeviceSampler {
            gpu: gpu.clone(),
            kernel,
            vocab,
            slots: Vec::new(),
            counts: gpu.alloc::<u32>(0)?,
            draws: gpu.alloc::<u64>(0)?,
            row_opts: gpu.alloc::<RowOptions>(0)?,
            bias: gpu.alloc::<[u32; 2]>(0)?,
            scratch: gpu.alloc::<f32>(0)?,
            out: gpu.alloc::<u32>(0)?,
            out_host: PinnedBuf::new(gpu, 0)?,
            out_rows: 0,
            uploaded: (Vec::new(), Vec::new()),
            last_logits: None,
            pass: 0,
        })
    }

    /// Sample row `b` of the `[samplers.len(), ld]` logits at device address `logits`
    /// with `samplers[b]` into `step`'s id `b`. With `check_finite`, `step.finite(b)` says
    /// whether the row's first `vocab` entries were finite, and a row that was not is not
    /// sampled (id 0, no log-probabilities); without, every row is sampled (NaN never
    /// chosen). A row whose sampler asks for log-probabilities gets them
    /// (`step.logprobs(b)`). Counts each id as generated on the device: the caller accepts
    /// it into the host sampler.
    pub fn sample(
        &mut self,
        logits: u64,
        ld: usize,
        samplers: &mut [&mut Sampler],
        check_finite: bool,
        step: &mut SampleStep,
    ) -> Result<()> {
        let nb = samplers.len();
        if ld < self.vocab {
            return Err(Error::Device(format!(
                "logits rows of {ld} entries hold no vocabulary of {}",
                self.vocab
            )));
        }
        let slot_of = self.place(samplers)?;
        self.put_options(samplers, &slot_of, ld)?;
        let g = &self.gpu;
        let (ld_i, vocab_i, check) = (ld as i32, self.vocab as i32, i32::from(check_finite));
        let (opts, bias, scratch, out) = (
            self.row_opts.ptr,
            self.bias.ptr,
            self.scratch.ptr,
            self.out.ptr,
        );
        let (finite_at, logprobs_at) = (self.out.at::<u32>(nb), self.out.at::<u32>(2 * nb));
        g.launch(
            &self.kernel,
            (nb as u32, 1, 1),
            THREADS,
            0,
            false,
            &[
                &logits,
                &ld_i,
                &vocab_i,
                &opts,
                &bias,
                &self.counts.ptr,
                &self.draws.ptr,
                &scratch,
                &out,
                &finite_at,
                &check,
                &logprobs_at,
            ],
        )?;
        // Only the rows' ids and finiteness come back, and the log-probabilities when a
        // row asked for them.
        let asked = samplers.iter().any(|s| s.params().logprobs.is_some());
        let words = if asked {
            (2 + LOGPROB_WORDS) * nb
        } else {
            2 * nb
        };
        let host = &mut self.out_host.as_mut_slice()[..words];
        g.dtoh(out, host)?;
        step.ids.clear();
        step.ids.extend_from_slice(&host[..nb]);
        step.finite.clear();
        step.finite.extend(host[nb..2 * nb].iter().map(|&f| f != 0));
        step.logprobs.clear();
        step.logprobs
            .extend(samplers.iter().enumerate().map(|(b, s)| {
                let n = s.params().logprobs?;
                if host[nb + b] == 0 {
                    return None;
                }
                let w = &host[2 * nb + b * LOGPROB_WORDS..2 * nb + (b + 1) * LOGPROB_WORDS];
                let top = (0..n.min(MAX_TOP_LOGPROBS))
                    .take_while(|&k| w[1 + k] != NO_TOKEN)
                    .map(|k| (w[1 + k], f32::from_bits(w[1 + MAX_TOP_LOGPROBS + k])))
                    .collect();
                Some(TokenLogprobs {
                    token: host[b],
                    logprob: f32::from_bits(w[0]),
                    top,
                })
            }));
        for s in samplers.iter_mut() {
            s.device_steps += 1;
        }
        self.last_logits = Some((logits, ld));
        Ok(())
    }

    /// Row `b` of the last sampled step's logits (`ld` entries), fetched from the device.
    pub fn last_row(&self, b: usize) -> Result<Vec<f32>> {
        let (at, ld) = self.last_logits.ok_or_else(|| {
            Error::Device("no sampled decode step's logits are on the device now".into())
        })?;
        let mut row = vec![0f32; ld];
        self.gpu.dtoh(at + (b * ld * 4) as u64, &mut row)?;
        Ok(row)
    }

    /// The slot of each sampler: kept where it has one; else a free one (a slot whose
    /// sampler is not in this batch), filled from the sampler's history.
    fn place(&mut self, samplers: &[&mut Sampler]) -> Result<Vec<u32>> {
        let keys: Vec<u64> = samplers.iter().map(|s| s.key()).collect();
        // Slots of samplers gone from the batch are free (one that comes back is filled
        // again from its host history, which the caller kept in step).
        for s in self.slots.iter_mut() {
            if s.is_some_and(|k| !keys.contains(&k)) {
                *s = None;
            }
        }
        if self.slots.len() < samplers.len() {
            self.grow(samplers.len().next_power_of_two())?;
        }
        let mut slot_of = Vec::with_capacity(samplers.len());
        for s in samplers {
            let slot = match self.slots.iter().position(|&k| k == Some(s.key())) {
                Some(i) => i,
                None => {
                    let i = self
                        .slots
                        .iter()
                        .position(Option::is_none)
                        .expect("as many slots as rows");
                    self.fill(i, s)?;
                    self.slots[i] = Some(s.key());
                    i
                }
            };
            slot_of.push(slot as u32);
        }
        Ok(slot_of)
    }

    /// Room for `n` slots (the filled ones kept).
    fn grow(&mut self, n: usize) -> Result<()> {
        let g = &self.gpu;
        let counts = g.alloc::<u32>(n * self.vocab)?;
        let draws = g.alloc::<u64>(n)?;
        g.dtod(
            self.counts.ptr,
            counts.ptr,
            self.counts.bytes.min(counts.bytes),
        )?;
        g.dtod(self.draws.ptr, draws.ptr, self.draws.bytes.min(draws.bytes))?;
        (self.counts, self.draws) = (counts, draws);
        self.slots.resize(n, None);
        Ok(())
    }

    /// Slot `i` from `s`'s history: its count words and its draw counter.
    fn fill(&mut self, i: usize, s: &Sampler) -> Result<()> {
        let mut words = vec![0u32; self.vocab];
        for (t, w) in s.count_words() {
            if let Some(x) = words.get_mut(t as usize) {
                *x = w;
            }
        }
        self.gpu
            .htod(&words, self.counts.at::<u32>(i * self.vocab))?;
        self.gpu.htod(&[s.device_steps], self.draws.at::<u64>(i))
    }

    /// The rows' options and bias list, uploaded when they differ from what the device
    /// holds; the per-row buffers grown to the batch.
    fn put_options(&mut self, samplers: &[&mut Sampler], slot_of: &[u32], ld: usize) -> Result<()> {
        let mut bias: Vec<[u32; 2]> = Vec::new();
        let opts: Vec<RowOptions> = samplers
            .iter()
            .zip(slot_of)
            .map(|(s, &slot)| {
                let p = s.params();
                let start = bias.len() as u32;
                bias.extend(p.logit_bias.iter().map(|&(t, b)| [t, b.to_bits()]));
                let seed = s.seed();
                RowOptions {
                    temperature: p.temperature,
                    top_k: p.top_k.min(u32::MAX as usize) as u32,
                    top_p: p.top_p,
                    min_p: p.min_p,
                    repetition_penalty: p.repetition_penalty,
                    frequency_penalty: p.frequency_penalty,
                    presence_penalty: p.presence_penalty,
                    bias_start: start,
                    bias_len: p.logit_bias.len() as u32,
                    seed_lo: seed as u32,
                    seed_hi: (seed >> 32) as u32,
                    slot,
                    logprobs: p.logprobs.map_or(0, |n| n.min(MAX_TOP_LOGPROBS) as u32 + 1),
                }
            })
            .collect();
        let nb = samplers.len();
        let g = &self.gpu;
        if self.out_rows < nb {
            let n = nb.next_power_of_two();
            self.row_opts = g.alloc::<RowOptions>(n)?;
            self.out = g.alloc::<u32>((2 + LOGPROB_WORDS) * n)?;
            self.out_host = PinnedBuf::new(g, (2 + LOGPROB_WORDS) * n)?;
            self.out_rows = n;
            self.uploaded.0.clear();
        }
        if self.scratch.bytes < nb * ld * 4 {
            self.scratch = g.alloc::<f32>(nb.next_power_of_two() * ld)?;
        }
        if bias.len() * 8 > self.bias.bytes {
            self.bias = g.alloc::<[u32; 2]>(bias.len().next_power_of_two())?;
            self.uploaded.1.clear();
        }
        if self.uploaded.0 != opts {
            g.htod(&opts, self.row_opts.ptr)?;
            self.uploaded.0 = opts;
        }
        if self.uploaded.1 != bias {
            g.htod(&bias, self.bias.ptr)?;
            self.uploaded.1 = bias;
        }
        Ok(())
    }
}

/// What a GPU backend holds to sample its decode steps: the [`DeviceSampler`] (made at the
/// first sampled step) and a count of the backend's passes, by which a sampled step's
/// logits are known to be still on the device (no other pass has run since).
pub(crate) struct DeviceSampling {
    sampler: Mutex<Option<DeviceSampler>>,
    passes: AtomicU64,
}

impl DeviceSampling {
    pub(crate) fn new() -> DeviceSampling {
        DeviceSampling {
            sampler: Mutex::new(None),
            passes: AtomicU64::new(0),
        }
    }

    /// Every pass of the backend (eager or replayed) calls this before it writes logits.
    pub(crate) fn count_pass(&self) {
        self.passes.fetch_add(1, Relaxed);
    }

    /// A sampled decode step: `decode(sample)` runs the step and calls `sample(address)`
    /// with the device address of its `[batch, ld]` logits while they are there; the rows
    /// are sampled by `samplers` into `step`. Locked before the backend's own buffers.
    pub(crate) fn decode_sample(
        &self,
        gpu: &Arc<Gpu>,
        vocab: usize,
        ld: usize,
        samplers: &mut [&mut Sampler],
        step: &mut SampleStep,
        decode: impl FnOnce(&mut dyn FnMut(u64) -> Result<()>) -> Result<()>,
    ) -> Result<()> {
        let mut guard = self
            .sampler
            .lock()
            .map_err(|_| Error::Device("the device sampler's lock is poisoned".into()))?;
        if guard.is_none() {
            *guard = Some(DeviceSampler::new(gpu, vocab)?);
        }
        let ds = guard.as_mut().expect("made above");
        decode(&mut |at| ds.sample(at, ld, samplers, true, step))?;
        ds.pass = self.passes.load(Relaxed);
        Ok(())
    }

    /// Row `b` of the last sampled step's logits, while no other pass has run since.
    pub(crate) fn last_step_row(&self, b: usize) -> Result<Vec<f32>> {
        let guard = self
            .sampler
            .lock()
            .map_err(|_| Error::Device("the device sampler's lock is poisoned".into()))?;
        match guard.as_ref() {
            Some(ds) if ds.pass == self.passes.load(Relaxed) => ds.last_row(b),
            _ => Err(Error::Device(
                "the sampled step's logits are gone from the device (another pass ran since)"
                    .into(),
            )),
        }
    }
}
