//! A model's weights going up: host → device copies through page-locked staging buffers.
//!
//! A copy from pageable host memory is staged by the driver through a small buffer of its
//! own and, for each piece, waits for the one before; at start-up the weights (≈ 310 MB
//! with the in_proj input copies of the benchmark model) took 267–284 ms that way on the
//! H200 (docs/gpu-check.md, 2026-12-05 07:30). Here the host copies each tensor into one of
//! `STAGES` pinned buffers while the DMA engine empties the others, so the two overlap and
//! the copy to the device runs at the bus's speed. Off until it is measured on the GPU
//! (built 2026-12-05, when no machine was lent): `MAMBA3_GPU_STAGED_UPLOAD=1` turns it on;
//! otherwise every tensor goes up through `Gpu::upload` as before.

use super::context::{dev_err, DevBuf, Gpu, PinnedBuf};
use crate::error::{Error, Result};
use cudarc::driver::{result, sys};
use std::sync::Mutex;

/// Pinned buffers the copies rotate through, and the size of each.
const STAGES: usize = 3;
const STAGE_BYTES: usize = 8 << 20;

struct Stage {
    buf: PinnedBuf,
    /// recorded on the stream after the copy out of `buf`: reuse waits for it
    done: sys::CUevent,
    pending: bool,
}

/// Uploads to `gpu` on its main stream; callable from several threads (the copies are
/// serialised: one host thread fills the pinned buffers, the DMA engine does the rest).
pub struct Uploader<'a> {
    gpu: &'a Gpu,
    stages: Option<Mutex<(Vec<Stage>, usize)>>,
}

// The events and pinned buffers are only touched under the mutex.
unsafe impl Send for Stage {}

impl<'a> Uploader<'a> {
    /// Staged when `MAMBA3_GPU_STAGED_UPLOAD=1` (module doc), else the driver's copies.
    pub fn new(gpu: &'a Gpu) -> Result<Uploader<'a>> {
        match std::env::var("MAMBA3_GPU_STAGED_UPLOAD").as_deref() {
            Ok("1") => Self::staged(gpu),
            _ => Ok(Uploader { gpu, stages: None }),
        }
    }

    /// Through pinned staging buffers.
    pub fn staged(gpu: &'a Gpu) -> Result<Uploader<'a>> {
        gpu.bind()?;
        let stages = (0..STAGES)
            .map(|_| {
                let buf = PinnedBuf::new(gpu, STAGE_BYTES / 4)?;
                let done = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                    .map_err(|e| dev_err("creating an event", e))?;
                Ok(Stage {
                    buf,
                    done,
                    pending: false,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Uploader {
            gpu,
            stages: Some(Mutex::new((stages, 0))),
        })
    }

    /// A device buffer holding `data` (queued: [`Uploader::finish`] waits for all).
    pub fn upload<T: Copy>(&self, data: &[T]) -> Result<DevBuf> {
        let Some(stages) = &self.stages else {
            return self.gpu.upload(data);
        };
        let b = self.gpu.alloc::<T>(data.len().max(1))?;
        // (plain old data: the bytes as they lie)
        let bytes = unsafe {
            std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data))
        };
        let mut guard = stages
            .lock()
            .map_err(|_| Error::Device("the upload's staging buffers are poisoned".into()))?;
        let (stages, next) = &mut *guard;
        self.gpu.bind()?;
        for (i, piece) in bytes.chunks(STAGE_BYTES).enumerate() {
            let s = &mut stages[*next];
            *next = (*next + 1) % STAGES;
            if s.pending {
                unsafe { result::event::synchronize(s.done) }
                    .map_err(|e| dev_err("waiting for a staged copy", e))?;
            }
            let pinned = &mut s.buf.as_bytes_mut()[..piece.len()];
            pinned.copy_from_slice(piece);
            let dst = b.ptr + (i * STAGE_BYTES) as u64;
            unsafe {
                result::memcpy_htod_async(dst, &*pinned, self.gpu.cu_stream())
                    .map_err(|e| dev_err("copying to the device", e))?;
                result::event::record(s.done, self.gpu.cu_stream())
                    .map_err(|e| dev_err("recording an event", e))?;
            }
            s.pending = true;
        }
        Ok(b)
    }

    /// Wait for every staged copy (the driver's copies have left the host memory when
    /// `upload` returns, and later work on the stream comes after them).
    pub fn finish(self) -> Result<()> {
        match self.stages {
            Some(_) => self.gpu.sync(),
            None => Ok(()),
        }
    }
}

impl Drop for Uploader<'_> {
    fn drop(&mut self) {
        if let Some(stages) = self.stages.take() {
            // the pinned buffers must outlive the copies out of them
            let _ = self.gpu.sync();
            let (stages, _) = stages.into_inner().unwrap_or_else(|p| p.into_inner());
            for s in stages {
                let _ = unsafe { result::event::destroy(s.done) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Uploader, STAGES, STAGE_BYTES};
    use crate::cuda::context::Gpu;

    /// Buffers larger than all the staging buffers together, odd sizes and empty ones, from
    /// several threads at once, arrive intact.
    /// `cargo test --release --features cuda --lib staged_upload -- --include-ignored`.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn staged_upload_round_trips() {
        let gpu = Gpu::new(0).unwrap();
        let up = Uploader::staged(&gpu).unwrap();
        let sizes = [
            0,
            1,
            4097,
            STAGE_BYTES - 3,
            STAGE_BYTES + 5,
            STAGES * STAGE_BYTES + 77,
        ];
        let data: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n).map(|j| (j * 31 + i * 7 + j / 4099) as u8).collect())
            .collect();
        let bufs: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = data
                .iter()
                .map(|d| s.spawn(|| up.upload(d).unwrap()))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        up.finish().unwrap();
        for (d, b) in data.iter().zip(&bufs) {
            let mut back = vec![0u8; d.len()];
            gpu.dtoh(b.ptr, &mut back).unwrap();
            assert!(
                back == *d,
                "a buffer of {} bytes came back changed",
                d.len()
            );
        }
    }
}
