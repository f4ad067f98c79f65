//! Logits as the engine hands them out: [`Logits`], owned rows of any pass, and
//! [`StepLogits`], the rows of a decode step in a buffer that a serving loop keeps from
//! step to step.

pub use crate::mixers::LogitsWant;

/// Logits of some positions: `[rows, vocab]` row-major, `vocab = vocab_padded` (the rows
/// past `vocab_size` are padding and never a valid token).
#[derive(Clone, Debug, PartialEq)]
pub struct Logits {
    pub rows: usize,
    pub vocab: usize,
    pub data: Vec<f32>,
}

impl Logits {
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }
    pub(crate) fn from_rows(data: Vec<f32>, vocab: usize) -> Logits {
        Logits {
            rows: data.len() / vocab,
            vocab,
            data,
        }
    }
}

/// Where a step's logits live.
pub(crate) enum HostBuf {
    Heap(Vec<f32>),
    /// Page-locked memory the device copies into directly, reused while it is large
    /// enough (pinning memory is a slow driver call).
    #[cfg(feature = "cuda")]
    Pinned(crate::cuda::context::PinnedBuf),
}

/// The `[rows, vocab_padded]` logits of one decode step ([`crate::engine::Model::decode_into`]),
/// in a buffer reused by the next step: no allocation, and on a GPU one copy from the
/// device straight into memory the sampler reads.
pub struct StepLogits {
    pub(crate) rows: usize,
    pub(crate) vocab: usize,
    pub(crate) buf: HostBuf,
}

impl Default for StepLogits {
    fn default() -> Self {
        StepLogits::new()
    }
}

impl StepLogits {
    pub fn new() -> StepLogits {
        StepLogits {
            rows: 0,
            vocab: 0,
            buf: HostBuf::Heap(Vec::new()),
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Row `i`: `vocab_padded` entries.
    pub fn row(&self, i: usize) -> &[f32] {
        assert!(i < self.rows, "row {i} of a step of {} rows", self.rows);
        &self.all()[i * self.vocab..(i + 1) * self.vocab]
    }

    fn all(&self) -> &[f32] {
        match &self.buf {
            HostBuf::Heap(v) => v,
            #[cfg(feature = "cuda")]
            HostBuf::Pinned(p) => p.as_slice(),
        }
    }

    /// A pinned buffer of at least `len` entries (kept while it is large enough), its first
    /// `len` as a slice for the device to copy into.
    #[cfg(feature = "cuda")]
    pub(crate) fn pinned(
        &mut self,
        gpu: &crate::cuda::context::Gpu,
        len: usize,
    ) -> crate::error::Result<&mut [f32]> {
        let fits = matches!(&self.buf, HostBuf::Pinned(p) if p.len() >= len);
        if !fits {
            let p = crate::cuda::context::PinnedBuf::new(gpu, len.next_power_of_two())?;
            self.buf = HostBuf::Pinned(p);
        }
        match &mut self.buf {
            HostBuf::Pinned(p) => Ok(&mut p.as_mut_slice()[..len]),
            HostBuf::Heap(_) => unreachable!("made pinned above"),
        }
    }

    /// The rows as owned [`Logits`] (a copy).
    pub fn to_logits(&self) -> Logits {
        Logits {
            rows: self.rows,
            vocab: self.vocab,
            data: self.all()[..self.rows * self.vocab].to_vec(),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::engine::{Device, LogitsWant, Model, State, StepLogits};
    use crate::mixers::mamba3::Weights;
    use crate::model::{Config, DType};

    fn model(device: Device) -> Model {
        let cfg = Config::synthetic(64, 2, 16, 16, 2, 1, 300);
        Model::from_weights(Weights::synthetic(cfg, DType::F32, 5).unwrap(), device).unwrap()
    }

    fn primed(m: &Model, n: usize) -> Vec<State> {
        (0..n)
            .map(|i| {
                let mut s = m.new_state();
                let p: Vec<u32> = (0..5 + i as u32).map(|t| (t * 37 + 11) % 300).collect();
                m.prefill(&p, &mut s, LogitsWant::None).unwrap();
                s
            })
            .collect()
    }

    /// Steps of `decode_into` through one buffer equal `decode`'s owned rows, bit for bit,
    /// and advance the states alike; a failed step leaves no rows.
    fn into_equals_decode(m: &Model, batches: &[usize]) {
        let mut buf = StepLogits::new();
        for &n in batches {
            let (mut a, mut b) = (primed(m, n), primed(m, n));
            for step in 0..3u32 {
                let toks: Vec<u32> = (0..n as u32).map(|i| (i * 7 + step * 3) % 300).collect();
                let want = m
                    .decode(&toks, &mut a.iter_mut().collect::<Vec<_>>())
                    .unwrap();
                m.decode_into(&toks, &mut b.iter_mut().collect::<Vec<_>>(), &mut buf)
                    .unwrap();
                assert_eq!(buf.rows(), n);
                assert_eq!(buf.to_logits(), want, "batch {n}, step {step}");
                for (x, y) in a.iter().zip(&b) {
                    assert_eq!(x.position(), y.position());
                    assert_eq!(x.to_host().unwrap(), y.to_host().unwrap());
                }
            }
        }
        let mut s = primed(m, 1);
        let bad = m.decode_into(&[300], &mut s.iter_mut().collect::<Vec<_>>(), &mut buf);
        assert!(bad.is_err());
        assert_eq!(buf.rows(), 0);
    }

    #[test]
    fn decode_into_equals_decode_on_the_cpu() {
        into_equals_decode(&model(Device::Cpu), &[1, 3, 9, 1]);
    }

    /// On a GPU: graph replays (batches up to 4 here) and eager steps, through one pinned
    /// buffer that grows. Run on a machine with a CUDA device:
    /// `cargo test --release --lib decode_into -- --include-ignored`.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn decode_into_equals_decode_on_the_gpu() {
        let m = model(Device::Cuda(0));
        for bucket in [1, 2, 4] {
            m.capture_decode_graph(bucket).unwrap();
        }
        into_equals_decode(&m, &[1, 3, 9, 2, 20, 4]);
    }
}
