//! Sampling a decode batch on the device (kernels/sample.cu), for every GPU backend: the
//! rows' options, logit biases, per-sequence token counts and draw counters live in device
//! buffers; a step launches one block per row over the logits the step left on the device
//! and copies back only the ids (and whether each row was finite).
//!
//! Each sequence's counts and draw counter sit in a slot of their own, named by its
//! sampler's key ([`Sampler::key`]): a slot is filled from the host sampler's history when
//! its sequence first comes (or comes back), and from then on only the kernel writes it
//! (the caller accepts each id into the host sampler too, so that the two agree). The
//! options are uploaded only when the batch's rows change.

use crate::cuda::context::{DevBuf, Gpu, Kernel, PinnedBuf};
use crate::cuda::kernels::{KernelConfig, Module, SAMPLING};
use crate::engine::sampling::Sampler;
use crate::error::{Error, Result};
use std::sync::Arc;

/// Threads per row (`SAMPLE_THREADS` in kernels/sample.cu).
const THREADS: u32 = 1024;

/// One row's options (twin of `RowOptions` in kernels/sample.cu: 12 words).
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
    /// Per row: options; the bias list; the scratch row (`ld` floats); id and finiteness.
    row_opts: DevBuf,
    bias: DevBuf,
    scratch: DevBuf,
    out: DevBuf,
    out_host: PinnedBuf<u32>,
    /// What `row_opts`/`bias` hold now.
    uploaded: (Vec<RowOptions>, Vec<[u32; 2]>),
    /// Where the last sampled step's logits are (address, row stride), until the next pass.
    pub(crate) last_logits: Option<(u64, usize)>,
    /// The backend's pass counter when the last step was sampled (its logits are valid
    /// while no other pass has run).
    pub(crate) pass: u64,
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
            uploaded: (Vec::new(), Vec::new()),
            last_logits: None,
            pass: 0,
        })
    }

    /// Sample row `b` of the `[samplers.len(), ld]` logits at device address `logits`
    /// with `samplers[b]` into `ids[b]`. With `check_finite`, `finite[b]` says whether the
    /// row's first `vocab` entries were finite, and a row that was not is not sampled (id
    /// 0); without, every row is sampled (NaN never chosen). Counts each id as generated
    /// on the device: the caller accepts it into the host sampler.
    pub fn sample(
        &mut self,
        logits: u64,
        ld: usize,
        samplers: &mut [&mut Sampler],
        check_finite: bool,
        ids: &mut Vec<u32>,
        finite: &mut Vec<bool>,
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
        let finite_at = self.out.at::<u32>(nb);
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
            ],
        )?;
        let host = &mut self.out_host.as_mut_slice()[..2 * nb];
        g.dtoh(out, host)?;
        ids.clear();
        ids.extend_from_slice(&host[..nb]);
        finite.clear();
        finite.extend(host[nb..].iter().map(|&f| f != 0));
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
                }
            })
            .collect();
        let nb = samplers.len();
        let g = &self.gpu;
        if self.row_opts.bytes < nb * std::mem::size_of::<RowOptions>() {
            let n = nb.next_power_of_two();
            self.row_opts = g.alloc::<RowOptions>(n)?;
            self.out = g.alloc::<u32>(2 * n)?;
            self.out_host = PinnedBuf::new(g, 2 * n)?;
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
