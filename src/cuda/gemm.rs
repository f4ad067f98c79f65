//! Row-major GEMMs through cuBLASLt. [`GemmOp::Linear`] is `D[rows, n] (+)= A[rows, k] ·
//! W[n, k]ᵀ`, the shape of every projection (PyTorch `nn.Linear` weights are `[out, in]`;
//! CPU twin `matmul_t` in src/cpu/matmul.rs); training adds the two backward shapes of a
//! linear layer (CPU twins `linear_dx`, `linear_dw` in src/train/ops.rs):
//! [`GemmOp::Dx`] `D[rows, n] (+)= A[rows, k] · W[k, n]` and [`GemmOp::Dw`]
//! `D[rows, n] (+)= A[k, rows]ᵀ · W[k, n]`.
//!
//! In cuBLAS's column-major terms a row-major `X[r, c]` is `Xᵀ` with the same leading
//! dimension, so `Linear` is `Dᵀ = op_T(W)·Aᵀ` ("TN"), `Dx` is `Dᵀ = Wᵀ·Aᵀ` ("NN") and `Dw`
//! is `Dᵀ = Wᵀ·op_T(Aᵀ)` ("NT"). A and W are f32, bf16 or f16, D is f32 (the in_proj output, the
//! residual stream, the logits) or the activation dtype; accumulation is always f32
//! (`CUBLAS_COMPUTE_32F`, or `…_FAST_TF32` when asked for with f32 operands). With
//! `accumulate`, D is also the addend (β = 1): the residual add of out_proj and fc2 rides
//! in the GEMM epilogue.
//!
//! Each shape's descriptors and algorithm are chosen once and kept, so that eager runs and
//! graph captures replay the very same kernel; split-K reductions that use atomics are
//! excluded, so results are bit-reproducible. The algorithm is the heuristic's first guess,
//! or for a large product the fastest of its guesses that gives the same bits
//! (`gemm_tune`). A batch-invariant product ([`GemmSpec::batch_invariant`]) takes the
//! algorithm the heuristic proposes for the same shape at [`INVARIANT_ROWS`] rows without
//! split-K, whatever its own row count, and is never tuned: every row is then computed
//! by the same kernel in the same order, however many rows share the launch.

use super::context::{dev_err, DevBuf, Gpu};
pub use super::gemm_spec::{ElemType, GemmOp, GemmSpec};
use super::gemm_tune::{self as tune, Choices};
use crate::error::{Error, Result};
use cudarc::cublaslt::{result as lt, sys};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

const WORKSPACE_BYTES: usize = 32 << 20;
/// The most algorithms asked of cuBLASLt's heuristic for one shape.
const MAX_CANDIDATES: usize = 16;
/// The row count whose algorithm every batch-invariant product of a shape runs.
pub const INVARIANT_ROWS: usize = 1024;

struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algo: sys::cublasLtMatmulAlgo_t,
    /// A product worth tuning, planned where it could not be timed (a side lane, e.g. the
    /// start-up's warm-up, or inside a capture) with no choice kept: the heuristic's first
    /// guess until the next call on the main stream plans it again.
    untuned: bool,
}

pub struct Lt {
    handle: sys::cublasLtHandle_t,
    workspace: DevBuf,
    /// Workspaces of the side lanes (a decode step's rows on side streams run their GEMMs
    /// concurrently), allocated on their first use.
    lane_workspaces: Mutex<Vec<DevBuf>>,
    plans: Mutex<HashMap<GemmSpec, Plan>>,
    /// The algorithms chosen by timing (`gemm_tune`), this process's and the disk's.
    choices: Choices,
    /// Whether large products are tuned (`MAMBA3_GPU_GEMM_TUNE`, [`Lt::set_tuning`]).
    tuning: std::sync::atomic::AtomicBool,
    /// How many tunings this `Lt` timed (a diagnostic for tests).
    tunings: std::sync::atomic::AtomicUsize,
}

// The handle and descriptors are only used under the model's lock, on its stream.
unsafe impl Send for Lt {}
unsafe impl Sync for Lt {}

fn blas_err(what: &str, e: lt::CublasError) -> Error {
    dev_err(&format!("cuBLASLt {what}"), e)
}

impl Lt {
    /// Load libcublasLt (a large library: opening cuBLASLt took 116–150 ms at start-up on
    /// the H200), once per process. It needs no device, so `Model::load` starts it on a
    /// thread of its own at once; `Lt::new` waits for that if it is still under way.
    pub fn load_library() -> Result<()> {
        static LOADED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let loaded = *LOADED.get_or_init(|| {
            // (`is_culib_present` closes what it opened; `culib` keeps it open, and panics
            // where `is_culib_present` said no)
            let ok = std::panic::catch_unwind(|| unsafe {
                sys::is_culib_present() && {
                    sys::culib();
                    true
                }
            });
            crate::timeline::mark(|| "cuBLASLt library loaded".into());
            ok.unwrap_or(false)
        });
        if loaded {
            Ok(())
        } else {
            Err(Error::Device(
                "libcublasLt was not found: put the CUDA toolkit's lib directory \
                 (e.g. /usr/local/cuda/lib64) on LD_LIBRARY_PATH"
                    .into(),
            ))
        }
    }

    pub fn new(gpu: &Gpu) -> Result<Lt> {
        Self::with_choices_file(gpu, Choices::default_file())
    }

    /// [`Lt::new`] keeping its tuned choices in `file` (`None`: in memory only).
    pub fn with_choices_file(gpu: &Gpu, file: Option<std::path::PathBuf>) -> Result<Lt> {
        Self::load_library()?;
        gpu.bind()?;
        let handle = lt::create_handle().map_err(|e| blas_err("handle", e))?;
        Ok(Lt {
            handle,
            workspace: gpu.alloc::<u8>(WORKSPACE_BYTES)?,
            lane_workspaces: Mutex::new(Vec::new()),
            plans: Mutex::new(HashMap::new()),
            choices: Choices::open(&gpu.name, unsafe { sys::cublasLtGetVersion() }, file),
            tuning: tune::enabled_by_env().into(),
            tunings: 0.into(),
        })
    }

    /// Tune the plans made from now on (`gemm_tune`), or take the heuristic's first guess.
    pub fn set_tuning(&self, on: bool) {
        self.tuning.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// How many tunings this `Lt` has timed (choices found on disk are not counted).
    pub fn tunings(&self) -> usize {
        self.tunings.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The descriptors of `s` and cuBLASLt's heuristic's algorithms for it, best guess
    /// first (at most `MAX_CANDIDATES`).
    fn candidates(&self, s: &GemmSpec) -> Result<(Plan, Vec<sys::cublasLtMatmulAlgo_t>)> {
        let compute = if s.tf32 && s.a == ElemType::F32 && s.w == ElemType::F32 {
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
        } else {
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
        };
        let desc = lt::create_matmul_desc(compute, sys::cudaDataType::CUDA_R_32F)
            .map_err(|e| blas_err("matmul descriptor", e))?;
        let set = |attr, v: i32| unsafe {
            lt::set_matmul_desc_attribute(desc, attr, (&v as *const i32).cast(), 4)
        };
        use sys::cublasLtMatmulDescAttributes_t as D;
        let ([ta, tb], [a_shape, b_shape]) = s.operands();
        set(D::CUBLASLT_MATMUL_DESC_TRANSA, ta).map_err(|e| blas_err("transa", e))?;
        set(D::CUBLASLT_MATMUL_DESC_TRANSB, tb).map_err(|e| blas_err("transb", e))?;
        let lay = |t: ElemType, (r, c, ld): (usize, usize, usize)| {
            lt::create_matrix_layout(t.cuda(), r as u64, c as u64, ld as i64)
                .map_err(|e| blas_err("matrix layout", e))
        };
        let layouts = [
            lay(s.w, a_shape)?,
            lay(s.a, b_shape)?,
            lay(s.d, (s.n, s.rows, s.ldd))?,
        ];
        let pref = lt::create_matmul_pref().map_err(|e| blas_err("preference", e))?;
        use sys::cublasLtMatmulPreferenceAttributes_t as P;
        let ws = WORKSPACE_BYTES as u64;
        // No in-place (atomic) split-K reduction: keep results reproducible; no split-K
        // at all for a batch-invariant product (its splits would follow the row count).
        let mask: u32 = if s.batch_invariant { 0 } else { 2 | 4 };
        let mut found = [std::mem::MaybeUninit::<sys::cublasLtMatmulHeuristicResult_t>::uninit();
            MAX_CANDIDATES];
        let mut count = 0i32;
        let r = unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&ws as *const u64).cast(),
                8,
            )
            .and_then(|_| {
                lt::set_matmul_pref_attribute(
                    pref,
                    P::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                    (&mask as *const u32).cast(),
                    4,
                )
            })
            .and_then(|_| {
                sys::cublasLtMatmulAlgoGetHeuristic(
                    self.handle,
                    desc,
                    layouts[0],
                    layouts[1],
                    layouts[2],
                    layouts[2],
                    pref,
                    MAX_CANDIDATES as i32,
                    found.as_mut_ptr().cast(),
                    &mut count,
                )
                .result()
            })
        };
        let _ = unsafe { lt::destroy_matmul_pref(pref) };
        let plan = Plan {
            desc,
            layouts,
            algo: unsafe { std::mem::zeroed() },
            untuned: false,
        };
        let algos: Vec<sys::cublasLtMatmulAlgo_t> = found
            [..count.clamp(0, MAX_CANDIDATES as i32) as usize]
            .iter()
            // (the heuristic writes each result it counts)
            .map(|f| unsafe { f.assume_init() })
            .filter(|f| f.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
            .map(|f| f.algo)
            .collect();
        match r {
            Ok(()) if !algos.is_empty() => Ok((plan, algos)),
            r => {
                drop(plan);
                let why = r.err().map_or("none proposed".into(), |e| format!("{e:?}"));
                Err(Error::Device(format!(
                    "cuBLASLt has no algorithm for a {}×{}×{} GEMM ({:?}·{:?} → {:?}): {why}",
                    s.rows, s.n, s.k, s.a, s.w, s.d
                )))
            }
        }
    }

    /// The plan of `s`: the heuristic's first algorithm, or for a large product on the main
    /// stream the tuned one (`gemm_tune`) — found among the choices kept, else timed now
    /// on the operands of this first call (`a`, `w`, `d`: D is left as it was where the
    /// product accumulates; otherwise the caller's product overwrites it next).
    fn plan(
        &self,
        gpu: &Gpu,
        lane: usize,
        s: &GemmSpec,
        (a, w, d): (u64, u64, u64),
    ) -> Result<Plan> {
        if s.batch_invariant {
            return self.invariant_plan(s);
        }
        let (mut plan, algos) = self.candidates(s)?;
        plan.algo = algos[0];
        let on = self.tuning.load(std::sync::atomic::Ordering::Relaxed);
        if !on || !tune::worth_tuning(s) || algos.len() < 2 {
            return Ok(plan);
        }
        let key = tune::choice_key(s);
        if let Some(data) = self.choices.get(&key) {
            let kept = sys::cublasLtMatmulAlgo_t { data };
            if self.accepts(&plan, &kept) {
                plan.algo = kept;
            }
            return Ok(plan);
        }
        let status = unsafe { cudarc::driver::result::stream::is_capturing(gpu.cu_stream()) };
        let capturing = !status.is_ok_and(|c| {
            c == cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
        });
        if lane != 0 || capturing {
            plan.untuned = true; // (no waiting on a side lane or inside a capture)
            return Ok(plan);
        }
        // Timed on at most MAX_TUNE_ROWS rows: the first ones of A and D.
        let sub = match s.rows > tune::MAX_TUNE_ROWS {
            true => GemmSpec {
                rows: tune::MAX_TUNE_ROWS,
                // (Dw's packed A is rows wide: the first columns keep its stride)
                lda: if s.op == GemmOp::Dw && s.lda == 0 {
                    s.rows
                } else {
                    s.lda
                },
                ..*s
            },
            false => *s,
        };
        let owned;
        let (sub_plan, sub_algos) = if sub == *s {
            (&plan, &algos)
        } else {
            owned = self.candidates(&sub)?;
            (&owned.0, &owned.1)
        };
        let d_bytes = ((sub.rows - 1) * sub.ldd + sub.n) * s.d.size();
        let tried = sub_algos.len().min(tune::TRIED);
        let start = std::time::Instant::now();
        let found = tune::fastest(gpu, tried, (s.accumulate.then_some(d), d_bytes), |i, dd| {
            self.matmul(
                sub_plan,
                &sub_algos[i],
                &sub,
                (a, w, dd),
                (self.workspace.ptr, 0),
                gpu,
            )
        });
        let t = match found {
            Ok(t) => t,
            Err(e) => {
                // (scratch memory may be short: the first guess then, for this process)
                crate::timeline::mark(|| format!("cuBLASLt tuning skipped: {e}"));
                return Ok(plan);
            }
        };
        self.tunings
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let chosen = sub_algos[t.chosen];
        if self.accepts(&plan, &chosen) {
            plan.algo = chosen;
        }
        self.choices.put(key, chosen.data);
        crate::timeline::mark(|| {
            let us: Vec<String> = t
                .seconds
                .iter()
                .map(|x| format!("{:.1}", x * 1e6))
                .collect();
            format!(
                "cuBLASLt tuned {}×{}×{} ({:?}·{:?} → {:?}) on {} rows in {:.0} ms: candidate {} \
                 of µs [{}]",
                s.rows,
                s.n,
                s.k,
                s.a,
                s.w,
                s.d,
                sub.rows,
                start.elapsed().as_secs_f64() * 1e3,
                t.chosen,
                us.join(", ")
            )
        });
        Ok(plan)
    }

    /// The plan of a batch-invariant `s`: the first algorithm the heuristic proposes for
    /// the shape at [`INVARIANT_ROWS`] rows (no split-K) that also runs `s`'s row count.
    fn invariant_plan(&self, s: &GemmSpec) -> Result<Plan> {
        let canonical = GemmSpec {
            rows: INVARIANT_ROWS,
            ..*s
        };
        let (_, algos) = self.candidates(&canonical)?;
        let (mut plan, _) = self.candidates(s)?;
        match algos.iter().find(|a| self.accepts(&plan, a)) {
            Some(a) => {
                plan.algo = *a;
                Ok(plan)
            }
            None => Err(Error::Device(format!(
                "cuBLASLt: none of the {} algorithms of a {}×{}×{} GEMM runs {} rows \
                 (batch-invariant mode)",
                algos.len(),
                INVARIANT_ROWS,
                s.n,
                s.k,
                s.rows
            ))),
        }
    }

    /// Whether cuBLASLt runs `algo` for `plan`'s shape within our workspace.
    fn accepts(&self, plan: &Plan, algo: &sys::cublasLtMatmulAlgo_t) -> bool {
        let mut r = std::mem::MaybeUninit::<sys::cublasLtMatmulHeuristicResult_t>::uninit();
        let status = unsafe {
            sys::cublasLtMatmulAlgoCheck(
                self.handle,
                plan.desc,
                plan.layouts[0],
                plan.layouts[1],
                plan.layouts[2],
                plan.layouts[2],
                algo,
                r.as_mut_ptr(),
            )
        };
        status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            && unsafe { r.assume_init() }.workspaceSize <= WORKSPACE_BYTES
    }

    /// The descriptors of `s` and the heuristic's `i`-th algorithm for it.
    fn candidate(&self, s: &GemmSpec, i: usize) -> Result<(Plan, sys::cublasLtMatmulAlgo_t)> {
        let (plan, algos) = self.candidates(s)?;
        match algos.get(i) {
            Some(&algo) => Ok((plan, algo)),
            None => Err(Error::Device(format!(
                "cuBLASLt proposes {} algorithms for a {}×{}×{} GEMM; asked for number {i}",
                algos.len(),
                s.rows,
                s.n,
                s.k
            ))),
        }
    }

    /// How many algorithms cuBLASLt proposes for `s` (a diagnostic: `benches/gpu_gemms.rs`
    /// times each through [`Lt::use_candidate`]).
    pub fn candidate_count(&self, s: &GemmSpec) -> Result<usize> {
        Ok(self.candidates(s)?.1.len())
    }

    /// What the heuristic's `i`-th algorithm for `s` is: cuBLASLt's algorithm id, tile,
    /// stages, split-K count, cluster shape and swizzle (its `CUBLASLT_ALGO_CONFIG_*` ids).
    pub fn candidate_config(&self, s: &GemmSpec, i: usize) -> Result<[u32; 6]> {
        let (_, algo) = self.candidate(s, i)?;
        let algo = &algo;
        use sys::cublasLtMatmulAlgoConfigAttributes_t as C;
        // (an integer of 2, 4 or 8 bytes, and the buffer must be its size; u32::MAX where
        // none is accepted)
        let get = |attr| -> u32 {
            for size in [4usize, 2, 8] {
                let (mut v, mut written) = (0u64, 0usize);
                let r = unsafe {
                    sys::cublasLtMatmulAlgoConfigGetAttribute(
                        algo,
                        attr,
                        (&mut v as *mut u64).cast(),
                        size,
                        &mut written,
                    )
                };
                if r == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                    return v as u32;
                }
            }
            u32::MAX
        };
        Ok([
            get(C::CUBLASLT_ALGO_CONFIG_ID),
            get(C::CUBLASLT_ALGO_CONFIG_TILE_ID),
            get(C::CUBLASLT_ALGO_CONFIG_STAGES_ID),
            get(C::CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
            get(C::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
            get(C::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
        ])
    }

    /// Run `s` from now on with the heuristic's `i`-th algorithm (0: the one [`Lt::gemm`]
    /// takes by itself). A graph captured before keeps the kernel it captured.
    pub fn use_candidate(&self, s: &GemmSpec, i: usize) -> Result<()> {
        let (mut plan, algo) = self.candidate(s, i)?;
        plan.algo = algo;
        self.plans()?.insert(*s, plan); // (the plan it replaces is dropped: its descriptors freed)
        Ok(())
    }

    fn plans(&self) -> Result<std::sync::MutexGuard<'_, HashMap<GemmSpec, Plan>>> {
        self.plans
            .lock()
            .map_err(|_| Error::Device("cuBLASLt plan cache poisoned".into()))
    }

    /// [`Lt::use_candidate`] with the candidate's K split in `splits` parts, summed in f32
    /// in the workspace (deterministic: no atomics). Whether cuBLASLt accepts that for `s`
    /// (a diagnostic: `benches/gpu_gemms.rs` asks whether small products gain by it).
    pub fn use_split_candidate(&self, s: &GemmSpec, i: usize, splits: u32) -> Result<bool> {
        let (mut plan, mut algo) = self.candidate(s, i)?;
        use sys::cublasLtMatmulAlgoConfigAttributes_t as C;
        let scheme = sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32;
        for (attr, v) in [
            (C::CUBLASLT_ALGO_CONFIG_SPLITK_NUM, splits),
            (C::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, scheme),
        ] {
            let r = unsafe {
                sys::cublasLtMatmulAlgoConfigSetAttribute(
                    &mut algo,
                    attr,
                    (&v as *const u32).cast(),
                    4,
                )
            };
            if r != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return Ok(false);
            }
        }
        if !self.accepts(&plan, &algo) {
            return Ok(false);
        }
        plan.algo = algo;
        self.plans()?.insert(*s, plan);
        Ok(true)
    }

    /// Make the plans of `specs` and run each once on lane `lane`'s stream over scratch
    /// operands, waiting for them. cuBLASLt loads a kernel on its first use, ≈ 50 ms each
    /// on the H200 (docs/benchmarks.md); a thread can pay that while the weights upload
    /// rather than the first prefill after it. (From a thread per product they took as
    /// long: docs/benchmarks.md, 2026-12-05 14:03.)
    pub fn warm(&self, gpu: &Gpu, lane: usize, specs: &[GemmSpec]) -> Result<()> {
        for (i, s) in specs.iter().enumerate() {
            if specs[..i].contains(s) {
                continue; // (fc2's product is out_proj's when the MLP is d_inner wide)
            }
            let (_, [(_, w_cols, w_ld), (_, a_cols, a_ld)]) = s.operands();
            let a = gpu.alloc::<u8>(a_cols * a_ld * s.a.size())?;
            let w = gpu.alloc::<u8>(w_cols * w_ld * s.w.size())?;
            let d = gpu.alloc::<u8>(s.rows * s.ldd * s.d.size())?;
            self.gemm_on(gpu, lane, s, a.ptr, w.ptr, d.ptr)?;
            gpu.sync_lane(lane)?; // before the scratch is freed
            crate::timeline::mark(|| {
                format!(
                    "cuBLASLt warmed: {}×{}×{} ({:?}·{:?} → {:?})",
                    s.rows, s.n, s.k, s.a, s.w, s.d
                )
            });
        }
        Ok(())
    }

    /// `D (+)= op(A, W)` on the GPU's stream. Device addresses; `spec` gives the shape.
    pub fn gemm(&self, gpu: &Gpu, s: &GemmSpec, a: u64, w: u64, d: u64) -> Result<()> {
        self.gemm_on(gpu, 0, s, a, w, d)
    }

    /// [`Lt::gemm`] on the stream of lane `lane`, with that lane's workspace.
    pub fn gemm_on(
        &self,
        gpu: &Gpu,
        lane: usize,
        s: &GemmSpec,
        a: u64,
        w: u64,
        d: u64,
    ) -> Result<()> {
        if s.rows == 0 || s.n == 0 {
            return Ok(());
        }
        let workspace = if lane == 0 {
            self.workspace.ptr
        } else {
            let mut ws = self
                .lane_workspaces
                .lock()
                .map_err(|_| Error::Device("cuBLASLt workspaces poisoned".into()))?;
            while ws.len() < lane {
                ws.push(gpu.alloc::<u8>(WORKSPACE_BYTES)?);
            }
            ws[lane - 1].ptr
        };
        let mut plans = self.plans()?;
        if plans.get(s).is_none_or(|p| p.untuned && lane == 0) {
            let p = self.plan(gpu, lane, s, (a, w, d))?;
            plans.insert(*s, p);
        }
        let p = &plans[s];
        self.matmul(p, &p.algo, s, (a, w, d), (workspace, lane), gpu)
    }

    /// One cuBLASLt call: `s` with `plan`'s descriptors and `algo`, on lane `lane`'s stream
    /// with the workspace at `workspace`.
    fn matmul(
        &self,
        plan: &Plan,
        algo: &sys::cublasLtMatmulAlgo_t,
        s: &GemmSpec,
        (a, w, d): (u64, u64, u64),
        (workspace, lane): (u64, usize),
        gpu: &Gpu,
    ) -> Result<()> {
        let alpha = 1.0f32;
        let beta = if s.accumulate { 1.0f32 } else { 0.0 };
        gpu.bind()?;
        unsafe {
            lt::matmul(
                self.handle,
                plan.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                w as *const c_void,
                plan.layouts[0],
                a as *const c_void,
                plan.layouts[1],
                d as *const c_void,
                plan.layouts[2],
                d as *mut c_void,
                plan.layouts[2],
                algo,
                workspace as *mut c_void,
                WORKSPACE_BYTES,
                gpu.lane_stream(lane) as sys::cudaStream_t,
            )
        }
        .map_err(|e| blas_err(&format!("GEMM {}×{}×{}", s.rows, s.n, s.k), e))
    }

    /// How many shapes have a plan (a diagnostic for tests).
    pub fn plan_count(&self) -> usize {
        self.plans.lock().map_or(0, |p| p.len())
    }
}

impl Drop for Plan {
    fn drop(&mut self) {
        unsafe {
            let _ = lt::destroy_matmul_desc(self.desc);
            for l in self.layouts {
                let _ = lt::destroy_matrix_layout(l);
            }
        }
    }
}

impl Drop for Lt {
    fn drop(&mut self) {
        if let Ok(plans) = self.plans.get_mut() {
            plans.clear(); // (before the handle goes)
        }
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

/// `n` small pseudo-random values (in −0.5 … 0.5) of type `t`, as bytes, for benches and
/// tests: not zeros, which would run the tensor cores at less power than real data and
/// hide reduction-order differences.
pub fn pseudo_random_bytes(t: ElemType, n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::with_capacity(n * t.size());
    for _ in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let v = (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
        match t {
            ElemType::F32 => out.extend_from_slice(&v.to_le_bytes()),
            ElemType::BF16 => out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
            ElemType::F16 => out.extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// D's bytes after `lt`'s product of `s` (A and W at `a`, `w`) into D starting as `d0`.
    fn product(gpu: &Gpu, lt: &Lt, s: &GemmSpec, (a, w): (u64, u64), d0: &[u8]) -> Vec<u8> {
        let d = gpu.upload(d0).unwrap();
        lt.gemm(gpu, s, a, w, d.ptr).unwrap();
        let mut out = vec![0u8; d0.len()];
        gpu.dtoh(d.ptr, &mut out).unwrap();
        out
    }

    /// Tuned large products (gemm_tune) give the bits of the heuristic's first guess —
    /// in_proj's shape into f16, out_proj's adding into f32 (D must come out of the tuning
    /// as it went in), and one over MAX_TUNE_ROWS rows (tuned on its first rows) — also
    /// when a side lane planned them first, and a second `Lt` takes the choices from the
    /// file without timing again.
    /// `cargo test --release --features cuda --lib gemm_tuning -- --include-ignored`.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn gemm_tuning_keeps_the_bits_and_the_choice() {
        let gpu = Gpu::new(0).unwrap();
        let dir = std::env::temp_dir().join(format!("mamba3-tuning-{}", std::process::id()));
        let file = dir.join("gemm-algos.tsv");
        let _ = std::fs::remove_dir_all(&dir);
        let plain = Lt::with_choices_file(&gpu, None).unwrap();
        plain.set_tuning(false);
        let tuned = Lt::with_choices_file(&gpu, Some(file.clone())).unwrap();
        tuned.set_tuning(true);
        let (bf, f16, f32) = (ElemType::BF16, ElemType::F16, ElemType::F32);
        // (rows, n, k, operand type, D type, accumulate); cuBLASLt has no bf16 → f16 product
        let shapes = [
            (8192, 3432, 768, f16, f16, false),
            (8192, 768, 1536, bf, f32, true),
            (40000, 768, 1536, bf, f32, true),
        ];
        let mut runs = Vec::new();
        for (i, &(rows, n, k, ab, dt, accumulate)) in shapes.iter().enumerate() {
            let s = GemmSpec::linear(rows, n, k, ab, dt, n, accumulate, false);
            let a = gpu
                .upload(&pseudo_random_bytes(ab, rows * k, 1 + i as u64))
                .unwrap();
            let w = gpu
                .upload(&pseudo_random_bytes(ab, n * k, 7 + i as u64))
                .unwrap();
            let d0 = pseudo_random_bytes(dt, rows * n, 13 + i as u64);
            let want = product(&gpu, &plain, &s, (a.ptr, w.ptr), &d0);
            // a plan made first on a side lane (the start-up's warm-up) is tuned later
            tuned.warm(&gpu, 1, &[s]).unwrap();
            assert_eq!(
                tuned.tunings(),
                i,
                "{rows}×{n}×{k} was timed on a side lane"
            );
            assert!(
                product(&gpu, &tuned, &s, (a.ptr, w.ptr), &d0) == want,
                "{rows}×{n}×{k}: tuned bits differ"
            );
            assert_eq!(tuned.tunings(), i + 1, "{rows}×{n}×{k} was not tuned");
            runs.push((s, a, w, d0, want));
        }
        let again = Lt::with_choices_file(&gpu, Some(file)).unwrap();
        again.set_tuning(true);
        for (s, a, w, d0, want) in &runs {
            assert!(
                product(&gpu, &again, s, (a.ptr, w.ptr), d0) == *want,
                "{}×{}×{}: the kept choice's bits differ",
                s.rows,
                s.n,
                s.k
            );
        }
        assert_eq!(again.tunings(), 0, "the kept choices were timed again");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
