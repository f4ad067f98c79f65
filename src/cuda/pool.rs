//! Device memory for sequence states, recycled: a [`Slot`] is one state's bytes, taken
//! from the GPU's [`StatePool`] and given back when dropped.

use super::context::{DevBuf, Gpu};
use crate::error::{Error, Result};
use std::sync::{Arc, Mutex};

/// Device memory for states: slabs of several states each, cut into pieces that are
/// recycled. Allocating and freeing device memory are slow driver calls (a free waits for
/// the whole device), and a server makes states with every request (a fresh one, the
/// copy-on-write copy after a cache snapshot): a slab makes one allocation serve several,
/// and a dropped state's piece goes back to the free list for the next one. Slabs are
/// freed with the pool, so it holds the peak of states alive at once (which the prefix
/// cache's budget bounds). All work runs in order on one stream, so a piece can be handed
/// out again at once: its new owner's work is queued after the old owner's.
#[derive(Default)]
pub struct StatePool {
    pub(crate) free: Mutex<Vec<Piece>>,
}

/// Bytes a slab aims at (a larger state gets a slab of its own), ...
const SLAB_BYTES: usize = 64 << 20;
/// ... holding at most this many states.
const SLAB_STATES: usize = 16;
/// Pieces start at multiples of this (the kernels' vector loads).
const PIECE_ALIGN: usize = 256;

/// One state's bytes in a slab.
pub(crate) struct Piece {
    slab: Arc<DevBuf>,
    offset: usize,
    bytes: usize,
}

impl Piece {
    fn ptr(&self) -> u64 {
        self.slab.ptr + self.offset as u64
    }
}

impl StatePool {
    fn take(&self, gpu: &Gpu, bytes: usize) -> Result<Piece> {
        let mut free = self
            .free
            .lock()
            .map_err(|_| Error::Device("the state pool's lock is poisoned".into()))?;
        if let Some(i) = free.iter().rposition(|p| p.bytes == bytes) {
            return Ok(free.swap_remove(i));
        }
        let stride = bytes.div_ceil(PIECE_ALIGN) * PIECE_ALIGN;
        let n = (SLAB_BYTES / stride).clamp(1, SLAB_STATES);
        // (short of memory for a whole slab, a state may still fit alone)
        let (slab, n) = match DevBuf::new(&gpu.ctx, stride * n) {
            Ok(b) => (b, n),
            Err(_) if n > 1 => (DevBuf::new(&gpu.ctx, bytes)?, 1),
            Err(e) => return Err(e),
        };
        let slab = Arc::new(slab);
        free.extend((1..n).map(|i| Piece {
            slab: slab.clone(),
            offset: i * stride,
            bytes,
        }));
        Ok(Piece {
            slab,
            offset: 0,
            bytes,
        })
    }

    fn put(&self, p: Piece) {
        if let Ok(mut f) = self.free.lock() {
            f.push(p);
        }
    }
}

/// A state's device memory; it goes back to the pool when the last clone is dropped.
pub struct Slot {
    piece: Option<Piece>,
    gpu: Arc<Gpu>,
}

impl Slot {
    pub fn new(gpu: &Arc<Gpu>, bytes: usize) -> Result<Slot> {
        Ok(Slot {
            piece: Some(gpu.state_pool.take(gpu, bytes)?),
            gpu: gpu.clone(),
        })
    }
    pub fn ptr(&self) -> u64 {
        self.piece.as_ref().map_or(0, Piece::ptr)
    }
    pub fn bytes(&self) -> usize {
        self.piece.as_ref().map_or(0, |p| p.bytes)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(p) = self.piece.take() {
            self.gpu.state_pool.put(p);
        }
    }
}
