//! What the GPU's synchronisation and shared-memory primitives cost, for sizing the decode
//! step (kernels/probes.cu says why): per call, the time of a thread-block cluster barrier,
//! of an exchange of one vector through distributed shared memory, of a grid-wide hand-over
//! through one global counter (the fused decode's, kernels/decode_layers.cu) and through
//! arrivals spread over many addresses (a flag per block, split counters), and the rate
//! at which each SM fills its shared memory from DRAM and from L2 while all do. Also how
//! many clusters of each size fit at once with one block per SM, and how fast a large
//! batch's f32 decode state can stream through at all (read and written once per layer,
//! in mixer_step's blocks and in the shapes most likely to stream faster: the floor of
//! decode at B=64), how short a B=1 step of the fused decode could be with infinitely fast
//! projections (its hand-overs and the data each phase waits for), and what a decode step costs
//! around its kernels: a CUDA graph shaped like the step (the token copied in, a one-block
//! kernel, a cooperative grid, a head-sized kernel, the logits copied out) with kernels
//! that do nothing, launched and waited for from the host.
//!
//! `cargo bench --features cuda --bench gpu_floors` (on the GPU machine: the binary that
//! `scripts/gpu-check pack` builds, run by `scripts/gpu-check run floors`). Each time is
//! (t(N) − t(N/10)) / (0.9·N) over whole launches, N large, the best of 5: the launch cost
//! cancels.

use cudarc::driver::CudaGraph;
use mamba3::cuda::context::{dev_err, Gpu, KArg, Kernel, PinnedBuf};
use mamba3::cuda::kernels::{KernelConfig, Module};

#[path = "kernels/program.rs"]
mod probe_kernels;
use mamba3::error::Result;
use std::time::Instant;

const THREADS: u32 = 256;
/// Dynamic shared memory that keeps every probe at one block per SM (as the decode kernels).
const ONE_PER_SM: u32 = 160 * 1024;

/// The best of 5 timings of `launch` with `iters`, in seconds (each synchronised).
fn best(gpu: &Gpu, iters: i32, launch: &dyn Fn(i32) -> Result<()>) -> Result<f64> {
    launch(iters)?; // warm-up
    gpu.sync()?;
    let mut t = f64::INFINITY;
    for _ in 0..5 {
        let start = Instant::now();
        launch(iters)?;
        gpu.sync()?;
        t = t.min(start.elapsed().as_secs_f64());
    }
    Ok(t)
}

/// Seconds per iteration: the difference between `n` and `n / 10` iterations.
fn per_iter(gpu: &Gpu, n: i32, launch: &dyn Fn(i32) -> Result<()>) -> Result<f64> {
    let (long, short) = (best(gpu, n, launch)?, best(gpu, n / 10, launch)?);
    Ok((long - short) / (n - n / 10) as f64)
}

fn main() -> Result<()> {
    let gpu = Gpu::new(0)?;
    let (m, _) = Module::load(
        &gpu,
        probe_kernels::PROBES,
        &KernelConfig { defines: vec![] },
    )?;
    let kernel = |name| -> Result<Kernel> {
        let k = m.kernel(name)?;
        k.allow_smem(ONE_PER_SM as usize)?;
        Ok(k)
    };
    let (barrier, exchange) = (
        kernel("probe_cluster_barrier")?,
        kernel("probe_cluster_exchange")?,
    );
    let (handover, fill) = (kernel("probe_grid_handover")?, kernel("probe_smem_fill")?);
    println!(
        "{} ({} SMs, {} KB shared memory per block at most)",
        gpu.name,
        gpu.sms,
        gpu.max_smem / 1024
    );

    println!(
        "\nclusters (one block of {THREADS} threads per SM, {} KB shared memory each):",
        ONE_PER_SM / 1024
    );
    println!(
        "{:>8} {:>12} {:>12} {:>16} {:>16}",
        "blocks", "at once", "SMs busy", "barrier µs", "exchange µs"
    );
    let out = gpu.alloc::<f32>(gpu.sms * 8)?;
    for size in [2u32, 4, 5, 6, 8] {
        let fit = gpu.max_active_clusters(&barrier, size, THREADS, ONE_PER_SM)?;
        if fit == 0 {
            println!("{size:>8} {:>12}", "none fit");
            continue;
        }
        let grid = fit as u32 * size;
        let bar = per_iter(&gpu, 20_000, &|n: i32| {
            gpu.launch_cluster(&barrier, grid, size, THREADS, ONE_PER_SM, &[&n])
        })?;
        // one residual row of the benchmark shape (d_model 768, f32)
        let width = 768i32;
        let exch = per_iter(&gpu, 20_000, &|n: i32| {
            gpu.launch_cluster(
                &exchange,
                grid,
                size,
                THREADS,
                ONE_PER_SM,
                &[&n, &width, &out.ptr],
            )
        })?;
        println!(
            "{size:>8} {fit:>12} {grid:>12} {:>16.3} {:>16.3}",
            bar * 1e6,
            exch * 1e6
        );
    }

    handovers(&gpu, &m, &handover)?;

    println!("\nshared-memory fill by 16-byte cp.async (every block at once):");
    println!(
        "{:>8} {:>10} {:>8} {:>14} {:>14}",
        "blocks", "KB/block", "from", "GB/s per SM", "GB/s in all"
    );
    let src_bytes = 1usize << 30; // past the 50 MB L2
    let src = gpu.alloc::<u8>(src_bytes)?;
    gpu.zero(src.ptr, src_bytes)?; // (the values do not matter; the pages must exist)
    let sink = gpu.alloc::<u32>(1)?;
    for blocks in [24u32, 96, 120, gpu.sms as u32] {
        for kb in [32i32, 150] {
            let bytes = kb * 1024;
            for (from, parts) in [
                ("DRAM", (src_bytes / bytes as usize) as i32),
                ("L2", blocks as i32),
            ] {
                let t = per_iter(&gpu, 2_000, &|n: i32| {
                    let args: [&dyn KArg; 5] = [&src.ptr, &bytes, &parts, &n, &sink.ptr];
                    gpu.launch(&fill, (blocks, 1, 1), THREADS, ONE_PER_SM, false, &args)
                })?;
                let per_sm = bytes as f64 / t / 1e9;
                println!(
                    "{blocks:>8} {kb:>10} {from:>8} {per_sm:>14.1} {:>14.1}",
                    per_sm * blocks as f64
                );
            }
        }
    }
    state_stream(&gpu, &m.kernel("probe_state_stream")?)?;
    stream_shapes(&gpu, &m)?;
    decode_skeleton(&gpu, &m)?;
    step_round_trip(&gpu, &m, &handover)
}

/// The grid-wide hand-over of the fused decode (one counter) against two ways of spreading
/// the arrivals over many addresses: a flag per block (packed, or a 128-byte line each),
/// and the counter split in 4 or 16. µs per hand-over, cooperative launches.
fn handovers(gpu: &Gpu, m: &Module, one_counter: &Kernel) -> Result<()> {
    let kernel = |name| -> Result<Kernel> {
        let k = m.kernel(name)?;
        k.allow_smem(ONE_PER_SM as usize)?;
        Ok(k)
    };
    let (flags_k, split_k) = (
        kernel("probe_grid_handover_flags")?,
        kernel("probe_grid_handover_split")?,
    );
    println!(
        "\ngrid-wide hand-over, µs (a fence and an arrival; warp 1 polls with acquire loads):"
    );
    println!(
        "{:>8} {:>12} {:>14} {:>14} {:>12} {:>12}",
        "blocks", "one counter", "flags packed", "flags 128 B", "4 counters", "16 counters"
    );
    let words = gpu.sms * 32;
    let buf = gpu.alloc::<u64>(words)?;
    let zeroed = |launch: &dyn Fn(i32) -> Result<()>| {
        per_iter(gpu, 20_000, &|n: i32| {
            gpu.zero(buf.ptr, words * 8)?;
            launch(n)
        })
    };
    for blocks in [24u32, 48, 96, 120, gpu.sms as u32] {
        let coop = |k: &Kernel, n: i32, third: Option<i32>| match third {
            None => gpu.launch_cooperative(k, blocks, THREADS, ONE_PER_SM, false, &[&n, &buf.ptr]),
            Some(x) => {
                gpu.launch_cooperative(k, blocks, THREADS, ONE_PER_SM, false, &[&n, &buf.ptr, &x])
            }
        };
        let one = zeroed(&|n| coop(one_counter, n, None))?;
        let packed = zeroed(&|n| coop(&flags_k, n, Some(1)))?;
        let lines = zeroed(&|n| coop(&flags_k, n, Some(32)))?;
        let split4 = zeroed(&|n| coop(&split_k, n, Some(4)))?;
        let split16 = zeroed(&|n| coop(&split_k, n, Some(16)))?;
        println!(
            "{blocks:>8} {:>12.3} {:>14.3} {:>14.3} {:>12.3} {:>12.3}",
            one * 1e6,
            packed * 1e6,
            lines * 1e6,
            split4 * 1e6,
            split16 * 1e6
        );
    }
    Ok(())
}

/// B=64's whole step of f32 state (24 layers · 24 heads · 64 sequences · 64 × 128, 1.21 GB)
/// streamed in the shapes of kernels/probes_decode.cu: mixer_step's blocks in one launch
/// for all layers, a grid walking the buffer (in place, read only, out of place), and bulk
/// copies through shared memory. TB/s count every byte read and every byte written. What
/// the best of them takes per step is the floor of decode at B=64 on this GPU.
fn stream_shapes(gpu: &Gpu, m: &Module) -> Result<()> {
    const ITEM: usize = 64 * 128 * 4;
    const ITEMS: usize = 24 * 24 * 64;
    const BYTES: usize = ITEM * ITEMS;
    let (shaped, flat, bulk) = (
        m.kernel("probe_state_stream")?,
        m.kernel("probe_stream_flat")?,
        m.kernel("probe_stream_bulk")?,
    );
    let buf = gpu.alloc::<u8>(2 * BYTES)?; // (the second half: the out-of-place copy's)
    gpu.zero(buf.ptr, buf.bytes)?;
    let sink = gpu.alloc::<f32>(1)?;
    println!(
        "\nB=64's step of f32 state ({:.2} GB read, as much written unless read only), shapes:",
        BYTES as f64 / 1e9
    );
    println!(
        "{:<58} {:>10} {:>8} {:>12}",
        "shape", "µs/step", "TB/s", "k tokens/s"
    );
    let (scale, n4) = (1.0f32, (BYTES / 16) as i64);
    let row = |what: &str, moved: usize, launch: &dyn Fn() -> Result<()>| -> Result<()> {
        const ROUNDS: usize = 5;
        let t = best(gpu, 0, &|_| {
            for _ in 0..ROUNDS {
                launch()?;
            }
            Ok(())
        })? / ROUNDS as f64;
        println!(
            "{what:<58} {:>10.1} {:>8.2} {:>12.1}",
            t * 1e6,
            moved as f64 / t / 1e12,
            64.0 / t / 1e3
        );
        Ok(())
    };
    let per_block = ITEM as i32;
    row(
        "mixer_step's blocks, every layer in one launch",
        2 * BYTES,
        &|| {
            let args: [&dyn KArg; 3] = [&buf.ptr, &per_block, &scale];
            gpu.launch(&shaped, (ITEMS as u32, 1, 1), THREADS, 0, false, &args)
        },
    )?;
    for (mode, moved, what) in [
        (0i32, 2 * BYTES, "in place"),
        (1, BYTES, "read only"),
        (2, 2 * BYTES, "out of place"),
    ] {
        for per_sm in [2u32, 4, 8] {
            let grid = gpu.sms as u32 * per_sm;
            row(
                &format!("a grid of {per_sm} blocks per SM walking it, {what}"),
                moved,
                &|| {
                    let args: [&dyn KArg; 5] = [&buf.ptr, &n4, &scale, &mode, &sink.ptr];
                    gpu.launch(&flat, (grid, 1, 1), THREADS, 0, false, &args)
                },
            )?;
        }
    }
    bulk.allow_smem(3 * ITEM)?;
    for (item, per_sm) in [(ITEM, 2u32), (ITEM / 2, 4)] {
        let (item_bytes, items) = (item as i32, (BYTES / item) as i32);
        let grid = gpu.sms as u32 * per_sm;
        row(
            &format!(
                "bulk copies of {} KB, 3 in flight, {per_sm} blocks per SM",
                item / 1024
            ),
            2 * BYTES,
            &|| {
                let args: [&dyn KArg; 4] = [&buf.ptr, &item_bytes, &items, &scale];
                gpu.launch(&bulk, (grid, 1, 1), THREADS, 3 * item as u32, false, &args)
            },
        )?;
    }
    Ok(())
}

/// A B=1 step of the fused decode without its projections' work (kernels/probes_decode.cu
/// `probe_decode_skeleton`): per layer its three grid-wide hand-overs, alone and with the
/// data each phase waits for. µs per layer, and per step of 24 layers.
fn decode_skeleton(gpu: &Gpu, m: &Module) -> Result<()> {
    let k = m.kernel("probe_decode_skeleton")?;
    k.allow_smem(ONE_PER_SM as usize)?;
    let (count, res, proj, y) = (
        gpu.alloc::<u64>(1)?,
        gpu.alloc::<f32>(768)?,
        gpu.alloc::<f32>(3432)?,
        gpu.alloc::<f32>(1536)?,
    );
    let state = gpu.alloc::<f32>(24 * 24 * 64 * 128)?;
    for b in [&res, &proj, &y, &state] {
        gpu.zero(b.ptr, b.bytes)?;
    }
    println!(
        "\na B=1 fused decode step without its projections' work ({} blocks, 3 hand-overs per layer):",
        gpu.sms
    );
    println!("{:<44} {:>12} {:>14}", "", "µs/layer", "µs/24 layers");
    for (data, what) in [
        (0i32, "the hand-overs alone"),
        (1, "with the data each phase waits for"),
    ] {
        let t = per_iter(gpu, 2400, &|n: i32| {
            gpu.zero(count.ptr, 8)?;
            let args: [&dyn KArg; 7] = [
                &n, &count.ptr, &res.ptr, &proj.ptr, &y.ptr, &state.ptr, &data,
            ];
            gpu.launch_cooperative(&k, gpu.sms as u32, THREADS, ONE_PER_SM, false, &args)
        })?;
        println!("{what:<44} {:>12.2} {:>14.1}", t * 1e6, t * 24e6);
    }
    Ok(())
}

/// The decode state of the benchmark shape (24 layers, 24 heads × 64 × 128 f32) at
/// batches 16 … 128, read and written in place once per layer by one block per (head,
/// sequence), one launch per layer; against it, mixer_step's time per layer
/// (docs/performance.md, "Decode floors").
fn state_stream(gpu: &Gpu, k: &Kernel) -> Result<()> {
    const LAYERS: usize = 24;
    const HEADS: usize = 24;
    let per_block: i32 = 64 * 128 * 4;
    let scale = 1.0f32;
    println!(
        "
f32 decode state, read and written in place (one block per head and sequence, a launch per layer):"
    );
    println!(
        "{:>8} {:>12} {:>14} {:>14} {:>12}",
        "batch", "MB/layer", "µs per layer", "µs per step", "TB/s"
    );
    for batch in [16usize, 64, 128] {
        let blocks = HEADS * batch;
        let layer_bytes = blocks * per_block as usize;
        let buf = gpu.alloc::<u8>(layer_bytes * LAYERS)?;
        gpu.zero(buf.ptr, buf.bytes)?;
        const ROUNDS: usize = 10;
        let t = best(gpu, 0, &|_| {
            for _ in 0..ROUNDS {
                for l in 0..LAYERS {
                    let at = buf.ptr + (l * layer_bytes) as u64;
                    let args: [&dyn KArg; 3] = [&at, &per_block, &scale];
                    gpu.launch(k, (blocks as u32, 1, 1), THREADS, 0, false, &args)?;
                }
            }
            Ok(())
        })? / (ROUNDS * LAYERS) as f64;
        println!(
            "{batch:>8} {:>12.1} {:>14.2} {:>14.1} {:>12.2}",
            layer_bytes as f64 / 1e6,
            t * 1e6,
            t * 1e6 * LAYERS as f64,
            2.0 * layer_bytes as f64 / t / 1e12
        );
    }
    Ok(())
}

/// `body`'s launches captured into a graph (after one eager run).
fn capture(gpu: &Gpu, body: &dyn Fn() -> Result<()>) -> Result<CudaGraph> {
    body()?;
    gpu.sync()?;
    gpu.capture_graph(body)
}

/// The median of 2000 timings of `step` (after 200 unrecorded), in seconds.
fn median_of(step: &dyn Fn() -> Result<()>) -> Result<f64> {
    for _ in 0..200 {
        step()?;
    }
    let mut t = Vec::with_capacity(2000);
    for _ in 0..2000 {
        let start = Instant::now();
        step()?;
        t.push(start.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// What a decode step at B=1 costs besides its kernels' work: graphs with the step's nodes
/// (kernels/probes.cu `probe_empty` for the embedding and the head, the hand-over probe
/// with no rounds as the fused step's cooperative grid, PDL between them), each launched
/// and waited for from the host, as `mamba3 bench` times a step.
fn step_round_trip(gpu: &Gpu, m: &Module, coop: &Kernel) -> Result<()> {
    let empty = m.kernel("probe_empty")?;
    let mut tokens_in = PinnedBuf::<u32>::new(gpu, 1)?;
    tokens_in.as_mut_slice()[0] = 7;
    let mut logits_out = PinnedBuf::<f32>::new(gpu, 256)?;
    let (tokens, logits, count) = (
        gpu.alloc::<u32>(1)?,
        gpu.alloc::<f32>(256)?,
        gpu.alloc::<u64>(1)?,
    );
    gpu.zero(logits.ptr, logits.bytes)?;
    let zero = 0i32;
    let kernels = || -> Result<()> {
        gpu.launch(&empty, (1, 1, 1), THREADS, 0, true, &[&zero])?;
        gpu.launch_cooperative(
            coop,
            gpu.sms as u32,
            THREADS,
            ONE_PER_SM,
            true,
            &[&zero, &count.ptr],
        )?;
        gpu.launch(&empty, (16, 1, 1), THREADS, 0, true, &[&zero])
    };
    let copy_in = || gpu.htod(tokens_in.as_slice(), tokens.ptr);
    let copy_out = |dst: &mut [f32]| -> Result<()> {
        unsafe { cudarc::driver::result::memcpy_dtoh_async(dst, logits.ptr, gpu.cu_stream()) }
            .map_err(|e| dev_err("copying from the device", e))
    };
    let launch = |g: &CudaGraph| g.launch().map_err(|e| dev_err("launching a graph", e));
    let out_ptr = logits_out.as_mut_slice().as_mut_ptr();
    // (the graph that copies the logits out writes them to `logits_out` on every launch)
    let out = || unsafe { std::slice::from_raw_parts_mut(out_ptr, 256) };
    let one = capture(gpu, &|| {
        gpu.launch(&empty, (1, 1, 1), THREADS, 0, true, &[&zero])
    })?;
    let bare = capture(gpu, &kernels)?;
    let replay = capture(gpu, &|| {
        copy_in()?;
        kernels()
    })?;
    let whole = capture(gpu, &|| {
        copy_in()?;
        kernels()?;
        copy_out(out())
    })?;
    println!(
        "
a decode step's round trip without its work, µs (launch and wait; median of 2000):"
    );
    let rows: [(&str, f64); 4] = [
        (
            "one empty kernel",
            median_of(&|| {
                launch(&one)?;
                gpu.sync()
            })?,
        ),
        (
            "the step's kernels: 1 block, cooperative grid, 16 blocks (PDL)",
            median_of(&|| {
                launch(&bare)?;
                gpu.sync()
            })?,
        ),
        (
            "+ the token copied in by the graph, logits (1 KB) out by a call (as replay)",
            median_of(&|| {
                launch(&replay)?;
                copy_out(out())?;
                gpu.sync()
            })?,
        ),
        (
            "+ both copies inside the graph",
            median_of(&|| {
                launch(&whole)?;
                gpu.sync()
            })?,
        ),
    ];
    for (what, t) in rows {
        println!("{:>10.2}  {what}", t * 1e6);
    }
    Ok(())
}
