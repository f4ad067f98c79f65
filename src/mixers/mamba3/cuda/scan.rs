//! The launches of one layer's chunked mixer (spec §4): `prefill_pre` and `angle_pass`
//! (per-token scalars, B̄/C̄, the angle cumsum), then the scan's three phases
//! `scan_states` → `scan_pass` → `scan_outputs` (kernels/prefill_pre.cu, kernels/scan.cu).
//! The prefill (src/engine/cuda/forward.rs) and the training forward (src/train/cuda/pass.rs) run
//! the same sequence over their own buffers. CPU twins: `token_pre` in
//! src/mixers/mamba3/token.rs and `HeadScan::chunk` in src/mixers/mamba3/chunk.rs, whose
//! module doc holds the mathematics.

use crate::cuda::context::{Gpu, KArg, Kernel};
pub use crate::cuda::kernels::check_smem;
use crate::cuda::kernels::Module;
use crate::error::Result;
use crate::model::Dims;

/// Kernel parameters of `scan_states`/`scan_outputs` (`ScanArgs` in kernels/scan.cu).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct ScanArgs {
    pub proj: u64,
    pub bcn: u64,
    pub tok: u64,
    pub theta: u64,
    pub phi0: u64,
    pub chunks: u64,
    pub segs: u64,
    /// segments in launch order (`Layout::order`)
    pub order: u64,
    pub b_bias: u64,
    pub c_bias: u64,
    pub d_skip: u64,
    pub out_norm: u64,
    pub sbuf: u64,
    pub sdecay: u64,
    pub y: u64,
    /// y before the gate, f32 (training; 0 in inference)
    pub y_pre: u64,
    pub states: u64,
    pub layer: i32,
    /// a bound on |⟨q̃, k̃⟩| (`GpuLayer::scan_qk`)
    pub qk: f32,
    /// the grid's shape (`launches`)
    pub heads_fastest: i32,
}

impl ScanArgs {
    /// The launches of phase A (`scan_states`, every segment but a sequence's last: its
    /// list follows phase C's in the order table) or C (`scan_outputs`, every segment) of
    /// a layout of `nseg` segments and `nseq` sequences over `heads`, on a GPU that runs
    /// `slots` scan blocks at once: the arguments and the grid of each. Blocks that fill
    /// more than one wave go heads fastest, so that the longest segments start first;
    /// one wave goes segments fastest, as before the order table, which measured faster
    /// (docs/decisions.md, "Scan grid order"). At most 65535 positions of the
    /// order per launch (the grid's y).
    pub(crate) fn launches(
        &self,
        phase_a: bool,
        (nseg, nseq): (usize, usize),
        heads: u32,
        slots: usize,
    ) -> Vec<(ScanArgs, (u32, u32, u32))> {
        const MAX_Y: usize = 65535;
        let (first, n) = if phase_a {
            (nseg, nseg - nseq)
        } else {
            (0, nseg)
        };
        let heads_fastest = n * heads as usize > slots;
        (0..n)
            .step_by(MAX_Y)
            .map(|p| {
                let a = ScanArgs {
                    order: self.order + 4 * (first + p) as u64,
                    heads_fastest: i32::from(heads_fastest),
                    ..*self
                };
                let k = (n - p).min(MAX_Y) as u32;
                (
                    a,
                    if heads_fastest {
                        (heads, k, 1)
                    } else {
                        (k, heads, 1)
                    },
                )
            })
            .collect()
    }
}

impl KArg for ScanArgs {
    fn ptr(&self) -> *mut std::ffi::c_void {
        self as *const ScanArgs as *mut std::ffi::c_void
    }
}

/// The kernels of the chunked mixer, as the inference and the training programs both
/// compile them, with their launch sizes.
pub struct ScanKernels {
    pub prefill_pre: Kernel,
    pub angle_pass: Kernel,
    pub scan_states: Kernel,
    pub scan_pass: Kernel,
    pub scan_outputs: Kernel,
    /// dynamic shared memory of `prefill_pre` and of a scan block, bytes
    pub pre_smem: u32,
    pub scan_smem: u32,
    /// threads of a scan block as the module was compiled: 256, or 512 for large
    /// f32-operand tiles (src/cuda/kernels/scan_tiles.cuh)
    pub scan_threads: u32,
    /// scan blocks the GPU runs at once: SMs × the blocks that fit on one
    /// (`ScanArgs::launches`, `Layout::new`)
    pub scan_slots: usize,
}

impl ScanKernels {
    /// Take the kernels from `module`, check that their shared memory fits `gpu` and allow
    /// it, and count the scan's slots.
    pub fn load(gpu: &Gpu, module: &Module) -> Result<ScanKernels> {
        let mut k = ScanKernels {
            prefill_pre: module.kernel("prefill_pre")?,
            angle_pass: module.kernel("angle_pass")?,
            scan_states: module.kernel("scan_states")?,
            scan_pass: module.kernel("scan_pass")?,
            scan_outputs: module.kernel("scan_outputs")?,
            pre_smem: module.global("prefill_pre_smem_bytes")?,
            scan_smem: module.global("scan_smem_bytes")?,
            scan_threads: module.global("scan_threads")?,
            scan_slots: 1,
        };
        for (kern, bytes) in [
            (&k.scan_states, k.scan_smem),
            (&k.scan_outputs, k.scan_smem),
            (&k.prefill_pre, k.pre_smem),
        ] {
            check_smem(gpu, kern, bytes)?;
            kern.allow_smem(bytes as usize)?;
        }
        k.scan_slots = gpu.resident_blocks(&k.scan_outputs, k.scan_threads, k.scan_smem)?;
        Ok(k)
    }
}

/// A kernel launch: the kernel, its grid, threads per block, dynamic shared memory and
/// arguments (each caller launches on its own stream with its own options).
pub(crate) type Launch<'a> =
    &'a dyn Fn(&Kernel, (u32, u32, u32), u32, u32, &[&dyn KArg]) -> Result<()>;

/// One layer's chunked mixer over a batch laid out in chunks, segments and sequences:
/// the scan's arguments and what the two launches before it read besides them.
pub(crate) struct ChunkScan {
    pub args: ScanArgs,
    /// the sequence table (`Layout::seqs`) and the angle partial sums of every chunk
    pub seqs: u64,
    pub csum: u64,
    /// this layer's B/C norm weights and Δ bias
    pub b_norm: u64,
    pub c_norm: u64,
    pub dt_bias: u64,
    pub nchunk: usize,
    pub nseg: usize,
    pub nseq: usize,
}

impl ChunkScan {
    /// `prefill_pre` (per chunk) then `angle_pass` (per sequence): the B̄/C̄ rows, the
    /// token scalars and the phases the scan reads.
    pub fn pre(&self, d: &Dims, k: &ScanKernels, launch: Launch) -> Result<()> {
        let a = &self.args;
        launch(
            &k.prefill_pre,
            (self.nchunk as u32, 1, 1),
            256,
            k.pre_smem,
            &[
                &a.proj,
                &a.chunks,
                &self.b_norm,
                &self.c_norm,
                &self.dt_bias,
                &a.bcn,
                &a.tok,
                &a.theta,
                &self.csum,
            ],
        )?;
        let angle_tiles = (d.nheads * d.num_rope_angles).div_ceil(128) as u32;
        launch(
            &k.angle_pass,
            (self.nseq as u32, angle_tiles, 1),
            128,
            0,
            &[&self.seqs, &self.csum, &a.phi0, &a.states, &a.layer],
        )
    }

    /// The scan's three phases: the states of every segment but a sequence's last, their
    /// passing along each sequence, then every segment's outputs (and final states).
    pub fn scan(&self, d: &Dims, k: &ScanKernels, launch: Launch) -> Result<()> {
        let (a, h, shape) = (&self.args, d.nheads as u32, (self.nseg, self.nseq));
        let (threads, smem) = (k.scan_threads, k.scan_smem);
        for (args, grid) in a.launches(true, shape, h, k.scan_slots) {
            launch(&k.scan_states, grid, threads, smem, &[&args])?;
        }
        let tiles = (d.headdim * d.d_state).div_ceil(4 * 256) as u32;
        launch(
            &k.scan_pass,
            (self.nseq as u32, h, tiles),
            256,
            0,
            &[
                &self.seqs, &a.chunks, &a.tok, &a.sbuf, &a.sdecay, &a.states, &a.layer,
            ],
        )?;
        for (args, grid) in a.launches(false, shape, h, k.scan_slots) {
            launch(&k.scan_outputs, grid, threads, smem, &[&args])?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::ScanArgs;

    #[test]
    fn scan_launches_cover_the_order_in_pieces_the_grid_takes() {
        let args = ScanArgs {
            order: 1 << 20,
            ..ScanArgs::default()
        };
        let (nseg, nseq) = (70_000, 3);
        let pieces = |a: bool| -> Vec<(u64, i32, (u32, u32, u32))> {
            let l = args.launches(a, (nseg, nseq), 24, 264);
            l.iter()
                .map(|(a, g)| (a.order, a.heads_fastest, *g))
                .collect()
        };
        let rest = (nseg - 65535) as u32;
        assert_eq!(
            pieces(false),
            [
                (1 << 20, 1, (24, 65535, 1)),
                ((1 << 20) + 4 * 65535, 1, (24, rest, 1))
            ]
        );
        let first = (1 << 20) + 4 * nseg as u64;
        assert_eq!(
            pieces(true),
            [
                (first, 1, (24, 65535, 1)),
                (first + 4 * 65535, 1, (24, rest - 3, 1))
            ]
        );
        // one segment per sequence: no phase A; one wave: segments fastest
        assert!(args.launches(true, (5, 5), 24, 264).is_empty());
        let one = args.launches(false, (11, 1), 24, 264);
        assert_eq!(one.len(), 1);
        assert_eq!((one[0].0.heads_fastest, one[0].1), (0, (11, 24, 1)));
    }
}
