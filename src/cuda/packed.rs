//! A packed pass on the device: the rows of several sequences laid end to end, each
//! sequence continuing from its own state, and the tables that tell kernels which row is
//! whose (the Mamba-1/Mamba-2 kernels read them: `mixers/mamba1/cuda/kernels/conv.cu`).
//!
//! Each sequence's rows are also cut into chunks of at most `chunk_len` rows, so that a scan
//! can run its chunks in parallel and carry the states between them afterwards.

use super::context::{DevBuf, Gpu, Kernel};
use super::gemm::Lt;
use super::gemm_spec::{ElemType, GemmSpec};
use crate::error::Result;
use crate::model::weights::Matrix;
use crate::model::DType;

/// The host side of a pass's tables.
pub struct PackedPass {
    pub rows: usize,
    pub seqs: usize,
    pub chunks: usize,
    /// whether every sequence is a single chunk (a scan then needs no carry step)
    pub one_chunk_each: bool,
    /// the device address of the tables (`offsets` into it)
    base: u64,
    offsets: [usize; 8],
}

/// Which table.
#[derive(Clone, Copy)]
pub enum Table {
    /// `u64 [seqs]`: the device address of each sequence's state
    SeqState = 0,
    /// `i32 [rows]`: the sequence of each row
    RowSeq,
    /// `i32 [seqs]`: each sequence's first row, and its row count
    SeqRow0,
    SeqLen,
    /// `i32 [chunks]`: each chunk's first row, row count and sequence
    ChunkRow0,
    ChunkLen,
    ChunkSeq,
    /// `i32 [seqs]`: each sequence's first chunk
    SeqChunk0,
}

impl PackedPass {
    /// The tables of sequences of `lens` rows (each ≥ 1) whose states are at `states`, cut
    /// into chunks of ≤ `chunk_len` rows, uploaded to `gpu` into `tables`.
    pub fn new(
        gpu: &Gpu,
        tables: &mut Scratch,
        lens: &[usize],
        states: &[u64],
        chunk_len: usize,
    ) -> Result<PackedPass> {
        debug_assert_eq!(lens.len(), states.len());
        let chunk_len = chunk_len.max(1);
        let (mut row_seq, mut seq_row0, mut seq_len) = (vec![], vec![], vec![]);
        let (mut chunk_row0, mut chunk_len_t, mut chunk_seq, mut seq_chunk0, mut seq_nchunks) =
            (vec![], vec![], vec![], vec![], vec![]);
        let mut row = 0usize;
        for (s, &len) in lens.iter().enumerate() {
            seq_row0.push(row as i32);
            seq_len.push(len as i32);
            row_seq.extend(std::iter::repeat_n(s as i32, len));
            seq_chunk0.push(chunk_row0.len() as i32);
            let mut start = 0;
            while start < len {
                let n = chunk_len.min(len - start);
                chunk_row0.push((row + start) as i32);
                chunk_len_t.push(n as i32);
                chunk_seq.push(s as i32);
                start += n;
            }
            seq_nchunks.push(chunk_row0.len() as i32 - seq_chunk0[s]);
            row += len;
        }
        let ints: [&[i32]; 8] = [
            &[],
            &row_seq,
            &seq_row0,
            &seq_len,
            &chunk_row0,
            &chunk_len_t,
            &chunk_seq,
            &seq_chunk0,
        ];
        // One upload: the u64 addresses first (aligned), then the i32 tables, then the
        // chunk counts per sequence (read with `seq_chunk0`: `SeqChunk0 + seqs`).
        let mut bytes: Vec<u8> = states.iter().flat_map(|a| a.to_le_bytes()).collect();
        let mut offsets = [0usize; 8];
        for (i, t) in ints.iter().enumerate().skip(1) {
            offsets[i] = bytes.len();
            bytes.extend(t.iter().flat_map(|v| v.to_le_bytes()));
        }
        bytes.extend(seq_nchunks.iter().flat_map(|v| v.to_le_bytes()));
        let base = tables.reserve(gpu, bytes.len())?;
        gpu.htod(&bytes, base)?;
        Ok(PackedPass {
            rows: row,
            seqs: lens.len(),
            chunks: chunk_row0.len(),
            one_chunk_each: chunk_row0.len() == lens.len(),
            base,
            offsets,
        })
    }

    /// The device address of a table.
    pub fn at(&self, t: Table) -> u64 {
        self.base + self.offsets[t as usize] as u64
    }

    /// `i32 [seqs]`: each sequence's chunk count.
    pub fn seq_nchunks(&self) -> u64 {
        self.at(Table::SeqChunk0) + 4 * self.seqs as u64
    }

    /// The tables a chunk-parallel scan reads, as one kernel argument.
    pub fn chunk_table(&self) -> ChunkTable {
        ChunkTable {
            row0: self.at(Table::ChunkRow0),
            len: self.at(Table::ChunkLen),
            seq: self.at(Table::ChunkSeq),
            seq_chunk0: self.at(Table::SeqChunk0),
            seq_nchunks: self.seq_nchunks(),
            seq_state: self.at(Table::SeqState),
        }
    }
}

/// A pass's tables for the chunk-parallel scans (`ChunkTable` in
/// `kernels/chunk_scan.cuh`: the same fields in the same order).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ChunkTable {
    pub row0: u64,
    pub len: u64,
    pub seq: u64,
    pub seq_chunk0: u64,
    pub seq_nchunks: u64,
    pub seq_state: u64,
}

super::context::karg!(ChunkTable);

/// Device scratch handed out in pieces, grown when a pass needs more (grown buffers are
/// freed only when the model is).
#[derive(Default)]
pub struct Scratch {
    buf: Option<DevBuf>,
}

impl Scratch {
    /// The base address of at least `bytes` of scratch (contents undefined).
    pub fn reserve(&mut self, gpu: &Gpu, bytes: usize) -> Result<u64> {
        if self.buf.as_ref().is_none_or(|b| b.bytes < bytes) {
            self.buf = None; // free the old one first
            self.buf = Some(gpu.alloc::<u8>(bytes.max(1) + bytes / 4)?);
        }
        Ok(self.buf.as_ref().map_or(0, |b| b.ptr))
    }
}

/// Carves a scratch region into consecutive pieces, each 256-byte aligned.
pub struct Carve {
    base: u64,
    used: usize,
}

impl Carve {
    pub fn new(base: u64) -> Carve {
        Carve { base, used: 0 }
    }
    /// The next piece of `n` elements of `elem_bytes` each.
    pub fn take(&mut self, n: usize, elem_bytes: usize) -> u64 {
        let at = self.base + self.used as u64;
        self.used += (n * elem_bytes).div_ceil(256) * 256;
        at
    }
    /// Bytes handed out so far.
    pub fn used(&self) -> usize {
        self.used
    }
}

/// What one layer of a mixer needs to run a pass: the device, cuBLASLt, the pass's tables,
/// where this layer's tensors sit in every state, and the GEMM input dtype.
pub struct LayerRun<'a> {
    pub gpu: &'a Gpu,
    pub lt: &'a Lt,
    pub pass: &'a PackedPass,
    /// this layer's first value in a state (in floats: every tensor of a device state
    /// starts at a multiple of 4 bytes, `model::state_layout`)
    pub state_off: usize,
    /// the `ssm` tensor's size on the device, in floats (half its values when 16-bit,
    /// padded)
    pub ssm_floats: usize,
    /// the dtype of GEMM inputs and weights (the model's)
    pub act: ElemType,
    /// `fam_add_bias` of lm_rows.cu
    pub add_bias: &'a Kernel,
    /// GEMMs whose rows do not depend on the pass's row count (`GemmSpec::invariant`)
    pub batch_invariant: bool,
}

impl LayerRun<'_> {
    /// One thread per item, blocks of 256.
    pub fn grid_1d(items: usize) -> (u32, u32, u32) {
        (items.div_ceil(256) as u32, 1, 1)
    }
}

/// A linear layer on the device: `W [n, k]` in `dtype` (the model's, or f16 for a bf16
/// model's matrices that read normed rows: `norm_t` of dtypes.cuh), an optional f32 bias.
pub struct DevLinear {
    pub w: DevBuf,
    pub bias: Option<DevBuf>,
    pub n: usize,
    pub k: usize,
    /// the dtype of W and of the input rows
    pub dtype: ElemType,
}

impl DevLinear {
    pub fn upload(gpu: &Gpu, m: &Matrix, bias: Option<&[f32]>, dtype: DType) -> Result<DevLinear> {
        Ok(DevLinear {
            w: upload_matrix(gpu, m, dtype)?,
            bias: upload_opt(gpu, bias)?,
            n: m.rows,
            k: m.cols,
            dtype: ElemType::of(dtype),
        })
    }

    /// `D[rows, n] (+)= A[rows, k]·Wᵀ + bias` over the pass's rows: A in W's dtype, D
    /// f32, packed, exact f32 products for f32 models (no TF32); `acc` adds into D (the
    /// residual).
    pub fn apply(&self, run: &LayerRun, a: u64, d: u64, acc: bool) -> Result<()> {
        let rows = run.pass.rows;
        let spec = GemmSpec::linear(
            rows,
            self.n,
            self.k,
            self.dtype,
            ElemType::F32,
            self.n,
            acc,
            false,
        )
        .invariant(run.batch_invariant);
        run.lt.gemm(run.gpu, &spec, a, self.w.ptr, d)?;
        if let Some(b) = &self.bias {
            let (cols, ld) = (self.n as i32, self.n as i32);
            let grid = (rows as u32, 1, 1);
            run.gpu
                .launch(run.add_bias, grid, 256, 0, false, &[&d, &b.ptr, &cols, &ld])?;
        }
        Ok(())
    }
}

/// A matrix on the device in `dtype`.
pub fn upload_matrix(gpu: &Gpu, m: &Matrix, dtype: DType) -> Result<DevBuf> {
    gpu.upload(m.data.convert(dtype).as_bytes())
}

/// An optional f32 vector on the device; 0 (a null pointer for the kernels) when absent.
pub fn upload_opt(gpu: &Gpu, v: Option<&[f32]>) -> Result<Option<DevBuf>> {
    v.map(|v| gpu.upload(v)).transpose()
}

/// The device address of an optional buffer, 0 when absent.
pub fn ptr_or_null(b: &Option<DevBuf>) -> u64 {
    b.as_ref().map_or(0, |b| b.ptr)
}
