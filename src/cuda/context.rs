//! One GPU: its context and stream, device memory, and kernel launches.
//!
//! Everything runs on one stream, in order, so no event tracking is needed: buffers are
//! raw device allocations (`DevBuf`) and kernels are launched through `cuLaunchKernelEx`,
//! with programmatic dependent launch when enabled (each kernel calls
//! `griddepcontrol.wait` before it touches what the previous one wrote, see
//! kernels/common.cuh). The one exception: a large decode batch may run as independent
//! lanes of rows on side streams (`fork_lanes` … `join_lanes`, src/engine/cuda/decode.rs), which
//! start after and end before the main stream's work around them. The side streams have
//! the device's greatest priority and a lane's bandwidth-bound kernels are launched at the
//! least (`launch_on`'s `background`): when one lane's latency-bound projections are queued
//! while another lane's mixer fills the GPU, the block scheduler gives them the next free
//! slots instead of finishing the mixer's queue first.

use crate::error::{Error, Result};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{result, sys, CudaContext, CudaFunction, CudaGraph, CudaStream};
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// A driver (or library) failure as our error, naming what was being done.
pub fn dev_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Device(format!("{what}: {e:?}"))
}

/// The most lanes a decode step may run on (one side stream each).
pub const MAX_LANES: usize = 4;

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    /// Side streams for lanes 1 … MAX_LANES (lane 0 is `stream`).
    side: Vec<Arc<CudaStream>>,
    /// The least stream priority, for background kernels of the lanes; None when the
    /// lanes run at the default priority (`MAMBA3_GPU_LANE_PRIORITY=0`, a diagnostic).
    background_priority: Option<i32>,
    pub name: String,
    pub ordinal: usize,
    /// Compute capability.
    pub cc: (i32, i32),
    pub sms: usize,
    /// The most dynamic shared memory one block may ask for.
    pub max_smem: usize,
    /// Buffers of dropped sequence states, for the next ones.
    pub state_pool: StatePool,
}

impl Gpu {
    pub fn new(ordinal: usize) -> Result<Gpu> {
        let n = super::device_count();
        if ordinal >= n {
            return Err(Error::Device(format!(
                "CUDA device {ordinal} requested, but {n} device(s) are visible"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| dev_err("creating the CUDA context", e))?;
        crate::timeline::mark(|| format!("CUDA context of device {ordinal} created"));
        // One stream, used in order: cudarc's per-buffer events are not needed.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(|e| dev_err("creating a stream", e))?;
        let (least, greatest) = result::stream::get_priority_range()
            .map_err(|e| dev_err("reading the stream priority range", e))?;
        let prioritised = crate::options::env().lane_priority;
        let side = (0..MAX_LANES)
            .map(|_| ctx.new_stream_with_priority(if prioritised { greatest } else { least }))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| dev_err("creating a side stream", e))?;
        let attr = |a| {
            ctx.attribute(a)
                .map_err(|e| dev_err("reading a device attribute", e))
        };
        use sys::CUdevice_attribute as A;
        let cc = (
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        );
        Ok(Gpu {
            name: ctx
                .name()
                .map_err(|e| dev_err("reading the device name", e))?,
            sms: attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as usize,
            max_smem: attr(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)? as usize,
            cc,
            ordinal,
            ctx,
            stream,
            side,
            background_priority: (prioritised && greatest < least).then_some(least),
            state_pool: Default::default(),
        })
    }

    pub fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| dev_err("binding the CUDA context", e))
    }

    pub fn cu_stream(&self) -> sys::CUstream {
        self.stream.cu_stream()
    }

    /// The stream of lane `lane` (0: the main stream).
    pub fn lane_stream(&self, lane: usize) -> sys::CUstream {
        match lane {
            0 => self.cu_stream(),
            l => self.side[l - 1].cu_stream(),
        }
    }

    /// Lanes 1 … n start after everything queued on the main stream so far.
    pub fn fork_lanes(&self, n: usize) -> Result<()> {
        if n > 0 {
            let ev = self
                .stream
                .record_event(None)
                .map_err(|e| dev_err("recording a fork event", e))?;
            for s in &self.side[..n] {
                s.wait(&ev)
                    .map_err(|e| dev_err("a side stream waiting at the fork", e))?;
            }
        }
        Ok(())
    }

    /// The main stream goes on after everything queued on lanes 1 … n.
    pub fn join_lanes(&self, n: usize) -> Result<()> {
        for s in &self.side[..n] {
            self.stream
                .join(s)
                .map_err(|e| dev_err("joining a side stream", e))?;
        }
        Ok(())
    }

    pub fn sync(&self) -> Result<()> {
        self.sync_lane(0)
    }

    /// Wait for the stream of lane `lane` (0: the main stream).
    pub fn sync_lane(&self, lane: usize) -> Result<()> {
        let s = if lane == 0 {
            &self.stream
        } else {
            &self.side[lane - 1]
        };
        s.synchronize()
            .map_err(|e| dev_err("synchronizing the stream (a kernel failed)", e))
    }

    /// An uninitialised device buffer of `n` elements of `T`.
    pub fn alloc<T>(&self, n: usize) -> Result<DevBuf> {
        DevBuf::new(&self.ctx, n * std::mem::size_of::<T>())
    }

    /// A device buffer holding `data`.
    pub fn upload<T: Copy>(&self, data: &[T]) -> Result<DevBuf> {
        let b = self.alloc::<T>(data.len().max(1))?;
        self.htod(data, b.ptr)?;
        Ok(b)
    }

    /// Queue a copy host → device (the host slice may be dropped on return).
    pub fn htod<T: Copy>(&self, src: &[T], dst: u64) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        unsafe { result::memcpy_htod_async(dst, src, self.cu_stream()) }
            .map_err(|e| dev_err("copying to the device", e))
    }

    /// Copy device → host, waiting for the stream first.
    pub fn dtoh<T: Copy>(&self, src: u64, dst: &mut [T]) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        self.bind()?;
        unsafe { result::memcpy_dtoh_async(dst, src, self.cu_stream()) }
            .map_err(|e| dev_err("copying from the device", e))?;
        self.sync()
    }

    pub fn dtod(&self, src: u64, dst: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.cu_stream()) }
            .map_err(|e| dev_err("copying on the device", e))
    }

    pub fn zero(&self, dst: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        unsafe { result::memset_d8_async(dst, 0, bytes, self.cu_stream()) }
            .map_err(|e| dev_err("clearing device memory", e))
    }

    /// Launch `k` on the stream: `grid` blocks of `block` threads, `smem` bytes of dynamic
    /// shared memory. `pdl` lets it start before the previous kernel has finished (the
    /// kernel waits with `griddepcontrol.wait` before reading its inputs).
    pub fn launch(
        &self,
        k: &Kernel,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        pdl: bool,
        args: &[&dyn KArg],
    ) -> Result<()> {
        self.launch_on(0, false, k, grid, block, smem, pdl, args)
    }

    /// [`Gpu::launch`] on the stream of lane `lane`; `background` launches it at the least
    /// priority when that is a side stream (see the module doc): for a lane's kernels that
    /// are bound by memory traffic, not latency.
    #[allow(clippy::too_many_arguments)]
    pub fn launch_on(
        &self,
        lane: usize,
        background: bool,
        k: &Kernel,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        pdl: bool,
        args: &[&dyn KArg],
    ) -> Result<()> {
        let priority = match (lane, background) {
            (1.., true) => self.background_priority,
            _ => None,
        };
        let mut attrs = launch_attrs(pdl, priority);
        self.launch_with(lane, k, grid, block, smem, &mut attrs, args)
    }

    /// What `body` queues on the stream, captured into a graph (instantiated with the node
    /// priorities, uploaded) instead of run. Nothing in `body` may synchronise.
    pub fn capture_graph(&self, body: impl FnOnce() -> Result<()>) -> Result<CudaGraph> {
        self.bind()?;
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| dev_err("beginning a graph capture", e))?;
        let captured = body();
        // (ended whatever `body` returned, so that the stream leaves capture mode)
        let ended = self
            .stream
            .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY)
            .map_err(|e| dev_err("ending a graph capture", e));
        captured?;
        let graph =
            ended?.ok_or_else(|| Error::Device("the graph capture recorded nothing".into()))?;
        graph
            .upload()
            .map_err(|e| dev_err("uploading the graph", e))?;
        Ok(graph)
    }

    /// Launch `k` as a cooperative grid: every block resident at once (the driver refuses
    /// the launch otherwise), so that blocks may wait for each other. `pdl` as in
    /// [`Gpu::launch`].
    pub fn launch_cooperative(
        &self,
        k: &Kernel,
        grid: u32,
        block: u32,
        smem: u32,
        pdl: bool,
        args: &[&dyn KArg],
    ) -> Result<()> {
        let mut attrs = launch_attrs(pdl, None);
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
        attr.value.cooperative = 1;
        attrs.push(attr);
        self.launch_with(0, k, (grid, 1, 1), block, smem, &mut attrs, args)
    }

    /// Launch `k` as `grid` blocks in clusters of `cluster` consecutive blocks (Hopper
    /// thread-block clusters: the blocks of a cluster run at once, on SMs of one GPC, and
    /// share their shared memory). `grid` must be a multiple of `cluster`.
    pub fn launch_cluster(
        &self,
        k: &Kernel,
        grid: u32,
        cluster: u32,
        block: u32,
        smem: u32,
        args: &[&dyn KArg],
    ) -> Result<()> {
        let mut attr = cluster_attr(cluster);
        let attrs = std::slice::from_mut(&mut attr);
        self.launch_with(0, k, (grid, 1, 1), block, smem, attrs, args)
    }

    /// How many clusters of `cluster` blocks of `k` (`block` threads, `smem` bytes of
    /// dynamic shared memory each) the GPU runs at once.
    pub fn max_active_clusters(
        &self,
        k: &Kernel,
        cluster: u32,
        block: u32,
        smem: u32,
    ) -> Result<usize> {
        let mut attr = cluster_attr(cluster);
        let attrs = std::slice::from_mut(&mut attr);
        let cfg = launch_config((cluster, 1, 1), block, smem, self.cu_stream(), attrs);
        let mut n = 0;
        unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, k.func.cu_function(), &cfg) }
            .result()
            .map_err(|e| dev_err(&format!("asking the cluster occupancy of `{}`", k.name), e))?;
        Ok(n.max(0) as usize)
    }

    /// How many blocks of `k` (`block` threads, `smem` bytes of dynamic shared memory each)
    /// the GPU runs at once (at least one an SM).
    pub fn resident_blocks(&self, k: &Kernel, block: u32, smem: u32) -> Result<usize> {
        let per_sm = k
            .func
            .occupancy_max_active_blocks_per_multiprocessor(block, smem as usize, None)
            .map_err(|e| dev_err(&format!("asking the occupancy of `{}`", k.name), e))?;
        Ok(self.sms * per_sm.max(1) as usize)
    }

    #[allow(clippy::too_many_arguments)]
    fn launch_with(
        &self,
        lane: usize,
        k: &Kernel,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        attrs: &mut [sys::CUlaunchAttribute],
        args: &[&dyn KArg],
    ) -> Result<()> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        let mut params: Vec<*mut c_void> = args.iter().map(|a| a.ptr()).collect();
        let cfg = launch_config(grid, block, smem, self.lane_stream(lane), attrs);
        unsafe {
            sys::cuLaunchKernelEx(
                &cfg,
                k.func.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(|e| dev_err(&format!("launching kernel `{}`", k.name), e))
    }
}

/// A launch of `grid` blocks of `block` threads with `smem` bytes of dynamic shared memory
/// on `stream`, with `attrs`.
fn launch_config(
    grid: (u32, u32, u32),
    block: u32,
    smem: u32,
    stream: sys::CUstream,
    attrs: &mut [sys::CUlaunchAttribute],
) -> sys::CUlaunchConfig {
    sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: smem,
        hStream: stream,
        attrs: attrs.as_mut_ptr(),
        numAttrs: attrs.len() as u32,
    }
}

/// The launch attribute of clusters of `blocks` blocks along x.
fn cluster_attr(blocks: u32) -> sys::CUlaunchAttribute {
    let mut a: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    a.value.clusterDim.x = blocks;
    a.value.clusterDim.y = 1;
    a.value.clusterDim.z = 1;
    a
}

/// The launch attributes: programmatic dependent launch, a priority.
fn launch_attrs(pdl: bool, priority: Option<i32>) -> Vec<sys::CUlaunchAttribute> {
    let mut attrs = Vec::with_capacity(2);
    if pdl {
        let mut a: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        a.value.programmaticStreamSerializationAllowed = 1;
        attrs.push(a);
    }
    if let Some(p) = priority {
        let mut a: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PRIORITY;
        a.value.priority = p;
        attrs.push(a);
    }
    attrs
}

/// A loaded kernel.
pub struct Kernel {
    pub name: &'static str,
    pub func: CudaFunction,
}

impl Kernel {
    /// Let a launch of this kernel take `bytes` of dynamic shared memory (above the 48 KB
    /// every kernel may take).
    pub fn allow_smem(&self, bytes: usize) -> Result<()> {
        use cudarc::driver::sys::CUfunction_attribute as FA;
        self.func
            .set_attribute(
                FA::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .map_err(|e| dev_err(&format!("raising the shared memory of `{}`", self.name), e))
    }
}

/// A kernel argument: anything whose bytes are passed by value.
pub trait KArg {
    fn ptr(&self) -> *mut c_void;
}
/// `KArg` for types passed by value: scalars, and `#[repr(C)]` argument structs that mirror
/// a kernel's (e.g. `M1Scan`).
macro_rules! karg {
    ($($t:ty),*) => {$(
        impl $crate::cuda::context::KArg for $t {
            fn ptr(&self) -> *mut std::ffi::c_void {
                self as *const $t as *mut std::ffi::c_void
            }
        }
    )*};
}
pub(crate) use karg;
karg!(u64, i64, i32, u32, f32);

/// Raw device memory, freed on drop. `ptr` is the device address.
pub struct DevBuf {
    pub ptr: u64,
    pub bytes: usize,
    ctx: Arc<CudaContext>,
}

impl DevBuf {
    pub fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<DevBuf> {
        ctx.bind_to_thread()
            .map_err(|e| dev_err("binding the CUDA context", e))?;
        let ptr = unsafe { result::malloc_sync(bytes.max(1)) }.map_err(|e| {
            let free = result::mem_get_info().map(|m| m.0).unwrap_or(0);
            Error::Device(format!(
                "allocating {bytes} bytes of device memory failed ({e:?}; {free} bytes free)"
            ))
        })?;
        Ok(DevBuf {
            ptr,
            bytes,
            ctx: ctx.clone(),
        })
    }
    /// The address `elems` elements of `T` in.
    pub fn at<T>(&self, elems: usize) -> u64 {
        self.ptr + (elems * std::mem::size_of::<T>()) as u64
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // Nothing useful to do with an error while dropping.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// Page-locked host memory of `T`s (`f32` by default) that copies between host and device
/// move by DMA directly (with pageable memory the driver stages every copy through a
/// buffer of its own and copies again), and that a CUDA graph may copy from or into.
/// Cacheable, not write-combined: the host reads it.
pub struct PinnedBuf<T: PinnedElem = f32> {
    ptr: *mut T,
    len: usize,
    ctx: Arc<CudaContext>,
}

// The memory is plain host memory owned by this value.
unsafe impl<T: PinnedElem> Send for PinnedBuf<T> {}
unsafe impl<T: PinnedElem> Sync for PinnedBuf<T> {}

/// The plain number types a [`PinnedBuf`] holds: all-zero bytes are a value of each.
pub trait PinnedElem: Copy {}
impl PinnedElem for f32 {}
impl PinnedElem for u32 {}

impl<T: PinnedElem> PinnedBuf<T> {
    /// `len` zeros.
    pub fn new(gpu: &Gpu, len: usize) -> Result<PinnedBuf<T>> {
        gpu.bind()?;
        let bytes = len.max(1) * std::mem::size_of::<T>();
        // (portable: a buffer stays pinned for every context, whichever model reuses it)
        let what = format!("allocating {bytes} bytes of pinned host memory");
        let ptr = unsafe { result::malloc_host(bytes, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(|e| dev_err(&what, e))? as *mut T;
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(PinnedBuf {
            ptr,
            len,
            ctx: gpu.ctx.clone(),
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[T] {
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [T] {
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl<T: PinnedElem> Drop for PinnedBuf<T> {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            let _ = unsafe { result::free_host(self.ptr as *mut c_void) };
        }
    }
}

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
