//! Logits as the engine hands them out: [`Logits`], owned rows of any pass, and
//! [`StepLogits`], the rows of a decode step in a buffer that a serving loop keeps from
//! step to step.

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
        m: &crate::cuda::CudaModel,
        len: usize,
    ) -> crate::error::Result<&mut [f32]> {
        let fits = matches!(&self.buf, HostBuf::Pinned(p) if p.len() >= len);
        if !fits {
            let p = crate::cuda::context::PinnedBuf::new(m.gpu(), len.next_power_of_two())?;
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
