//! Choosing a large GEMM's algorithm by timing. cuBLASLt's heuristic ranks the algorithms
//! it proposes for a shape by a model of the GPU, and its first guess is not always its
//! fastest: at the benchmark shape's B=8 T=4096 prefill on an H100 the third of in_proj's
//! was 4 % faster than the first, and the eighth of out_proj's 13 % (docs/decisions.md, "GEMM algorithms chosen by timing").
//!
//! So the plan of a product of at least [`TUNE_MACS`] multiply-adds times the first
//! [`TRIED`] candidates once, on the operands of its first call, and keeps the fastest
//! **whose output is bit for bit the first candidate's** (the whole output compared on the
//! host): what the engine computes never depends on the choice, only how long it takes.
//! Products over [`MAX_TUNE_ROWS`] rows are timed on their first `MAX_TUNE_ROWS` rows,
//! which bounds the scratch memory (two copies of that part of D) and the time.
//!
//! A choice holds for a *row bucket* (the power of two at or above `rows`), so prompts of
//! many lengths do not each pay a tuning, and it is kept on disk beside the kernel cache
//! (`gemm-algos.tsv`: GPU, cuBLASLt version, bucket, the algorithm's opaque words), so a
//! machine pays it once; a kept choice is used only where cuBLASLt accepts it for the
//! actual shape (`cublasLtMatmulAlgoCheck`), else the heuristic's first guess.
//! `MAMBA3_GPU_GEMM_TUNE=0` turns tuning off: the first guess everywhere.

use super::context::Gpu;
use super::gemm_spec::GemmSpec;
use crate::error::Result;
use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Instant;

/// The smallest product (rows · n · k) that is tuned: below it a candidate's load (tens of
/// milliseconds the first time) costs more than the product could gain in many calls.
pub const TUNE_MACS: usize = 1 << 30;
/// How many of the heuristic's candidates are timed.
pub const TRIED: usize = 8;
/// The most rows a tuning runs.
pub const MAX_TUNE_ROWS: usize = 32768;
/// A candidate must be this much faster than the first guess to replace it.
const MIN_GAIN: f64 = 0.01;

/// cuBLASLt's opaque algorithm words (`cublasLtMatmulAlgo_t::data`).
pub type AlgoWords = [u64; 8];

/// Whether tuning is on (`MAMBA3_GPU_GEMM_TUNE`, default on).
pub fn enabled_by_env() -> bool {
    crate::options::env().gemm_tune
}

/// Whether `s` is large enough to tune.
pub fn worth_tuning(s: &GemmSpec) -> bool {
    s.rows.saturating_mul(s.n).saturating_mul(s.k) >= TUNE_MACS
}

/// The rows a choice for `rows` holds for: the power of two at or above it (the buckets
/// above [`MAX_TUNE_ROWS`] are all tuned on that many rows).
pub fn row_bucket(rows: usize) -> usize {
    rows.next_power_of_two()
}

/// The key of `s`'s choice: its shape and types with `rows` replaced by its bucket.
pub fn choice_key(s: &GemmSpec) -> String {
    format!(
        "{:?} rows≤{} n {} k {} ldd {} lda {} ldw {} {:?}·{:?}→{:?}{}{}",
        s.op,
        row_bucket(s.rows),
        s.n,
        s.k,
        s.ldd,
        s.lda,
        s.ldw,
        s.a,
        s.w,
        s.d,
        if s.accumulate { " +=" } else { "" },
        if s.tf32 { " tf32" } else { "" }
    )
}

/// The choices made so far, this process's and the disk's, for one GPU model and
/// cuBLASLt version.
pub struct Choices {
    /// "GPU\tcuBLASLt version": the first two fields of this GPU's lines.
    scope: String,
    file: Option<PathBuf>,
    known: Mutex<HashMap<String, AlgoWords>>,
}

impl Choices {
    /// The choices of `gpu_name` under cuBLASLt `version`, read from `file` (`None`: kept in
    /// memory only). Lines that do not parse, or are another GPU's or version's, are
    /// skipped: a damaged file costs a tuning, never an error.
    pub fn open(gpu_name: &str, version: usize, file: Option<PathBuf>) -> Choices {
        let scope = format!("{}\t{version}", gpu_name.replace(['\t', '\n'], " "));
        let mut known = HashMap::new();
        if let Some(text) = file.as_ref().and_then(|f| std::fs::read_to_string(f).ok()) {
            for line in text.lines() {
                if let Some((key, words)) = parse_line(&scope, line) {
                    known.insert(key, words);
                }
            }
        }
        Choices {
            scope,
            file,
            known: Mutex::new(known),
        }
    }

    /// The file beside the kernel cache (`None` where there is no cache directory).
    pub fn default_file() -> Option<PathBuf> {
        super::kernels::cache_dir().map(|d| d.join("gemm-algos.tsv"))
    }

    pub fn get(&self, key: &str) -> Option<AlgoWords> {
        self.known.lock().ok()?.get(key).copied()
    }

    /// Keep `words` for `key`, and append it to the file (best effort: a read-only cache
    /// directory only means tuning again in the next process).
    pub fn put(&self, key: String, words: AlgoWords) {
        if let Some(f) = &self.file {
            let line = format!("{}\t{key}\t{}\n", self.scope, hex_words(&words));
            let _ = f.parent().map(std::fs::create_dir_all);
            // (one short append per line: concurrent processes do not interleave inside it)
            let _ = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(f)
                .and_then(|mut out| out.write_all(line.as_bytes()));
        }
        if let Ok(mut known) = self.known.lock() {
            known.insert(key, words);
        }
    }
}

fn hex_words(w: &AlgoWords) -> String {
    w.iter()
        .map(|x| format!("{x:016x}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// `line`'s key and words where it belongs to `scope` and is whole.
fn parse_line(scope: &str, line: &str) -> Option<(String, AlgoWords)> {
    let rest = line.strip_prefix(scope)?.strip_prefix('\t')?;
    let (key, words) = rest.split_once('\t')?;
    let parsed: Vec<u64> = words
        .split(' ')
        .map(|w| u64::from_str_radix(w, 16))
        .collect::<std::result::Result<_, _>>()
        .ok()?;
    Some((key.to_string(), parsed.try_into().ok()?))
}

/// What a tuning found: the chosen candidate and every candidate's time per launch.
pub struct Tuning {
    pub chosen: usize,
    pub seconds: Vec<f64>,
}

/// Time `candidates` algorithms and pick the fastest whose output equals candidate 0's bit
/// for bit. `run(i, d)` queues the product with candidate `i` into D at `d` (a scratch of
/// `d_bytes`); where the product accumulates, each run's D starts as a copy of `d_init`.
/// Runs on the GPU's main stream and waits for it.
pub fn fastest(
    gpu: &Gpu,
    candidates: usize,
    (d_init, d_bytes): (Option<u64>, usize),
    mut run: impl FnMut(usize, u64) -> Result<()>,
) -> Result<Tuning> {
    const LAUNCHES: usize = 4;
    let scratch = gpu.alloc::<u8>(d_bytes)?;
    let reference = gpu.alloc::<u8>(d_bytes)?;
    let init = |d: u64| d_init.map_or(Ok(()), |src| gpu.dtod(src, d, d_bytes));
    let mut seconds = Vec::with_capacity(candidates);
    for i in 0..candidates {
        init(scratch.ptr)?;
        run(i, scratch.ptr)?; // (loads the candidate's kernel)
        gpu.sync()?;
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let start = Instant::now();
            for _ in 0..LAUNCHES {
                run(i, scratch.ptr)?;
            }
            gpu.sync()?;
            best = best.min(start.elapsed().as_secs_f64() / LAUNCHES as f64);
        }
        seconds.push(best);
    }
    let mut order: Vec<usize> = (1..candidates)
        .filter(|&i| seconds[i] < seconds[0] * (1.0 - MIN_GAIN))
        .collect();
    order.sort_by(|&x, &y| seconds[x].total_cmp(&seconds[y]));
    if !order.is_empty() {
        init(reference.ptr)?;
        run(0, reference.ptr)?;
    }
    for i in order {
        init(scratch.ptr)?;
        run(i, scratch.ptr)?;
        if same_bytes(gpu, reference.ptr, scratch.ptr, d_bytes)? {
            return Ok(Tuning { chosen: i, seconds });
        }
    }
    Ok(Tuning { chosen: 0, seconds })
}

/// Whether two device buffers hold the same bytes (compared on the host, 16 MB at a time).
fn same_bytes(gpu: &Gpu, x: u64, y: u64, bytes: usize) -> Result<bool> {
    const PIECE: usize = 16 << 20;
    let (mut hx, mut hy) = (vec![0u8; PIECE.min(bytes)], vec![0u8; PIECE.min(bytes)]);
    let mut at = 0;
    while at < bytes {
        let n = PIECE.min(bytes - at);
        gpu.dtoh(x + at as u64, &mut hx[..n])?;
        gpu.dtoh(y + at as u64, &mut hy[..n])?;
        if hx[..n] != hy[..n] {
            return Ok(false);
        }
        at += n;
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::gemm_spec::ElemType;

    fn spec(rows: usize) -> GemmSpec {
        GemmSpec::linear(
            rows,
            3432,
            768,
            ElemType::BF16,
            ElemType::F16,
            3432,
            false,
            false,
        )
    }

    #[test]
    fn prompts_in_one_bucket_share_a_choice() {
        assert_eq!(choice_key(&spec(20000)), choice_key(&spec(32768)));
        assert_ne!(choice_key(&spec(32768)), choice_key(&spec(32769)));
        assert_ne!(choice_key(&spec(4096)), choice_key(&spec(32768)));
        let mut acc = spec(32768);
        acc.accumulate = true;
        assert_ne!(choice_key(&acc), choice_key(&spec(32768)));
        // the smallest tuned product: 2³⁰ multiply-adds
        assert!(!worth_tuning(&spec(407)) && worth_tuning(&spec(408)));
    }

    #[test]
    fn choices_survive_a_file_and_skip_damaged_or_foreign_lines() {
        let dir = std::env::temp_dir().join(format!("mamba3-gemm-algos-{}", std::process::id()));
        let file = dir.join("gemm-algos.tsv");
        let _ = std::fs::remove_file(&file);
        let words: AlgoWords = [1, 2, 3, u64::MAX, 5, 6, 7, 0x66];
        let key = choice_key(&spec(32768));
        Choices::open("NVIDIA H200", 130100, Some(file.clone())).put(key.clone(), words);
        // damage: a cut line, a bad word; and another GPU's line
        let text = std::fs::read_to_string(&file).unwrap();
        let line = text.lines().next().unwrap();
        let cut = line.rsplit_once(' ').unwrap().0;
        let bad = line.replace("0000000000000066", "zz");
        let other_gpu = line.replace("NVIDIA H200", "NVIDIA H100");
        let text = format!("{text}{cut}\n{bad}\n{other_gpu}\n");
        std::fs::write(&file, &text).unwrap();
        let again = Choices::open("NVIDIA H200", 130100, Some(file.clone()));
        assert_eq!(again.get(&key), Some(words));
        assert_eq!(again.known.lock().unwrap().len(), 1);
        let other = Choices::open("NVIDIA H100", 130100, Some(file.clone()));
        assert_eq!(other.get(&key), Some(words));
        assert_eq!(
            Choices::open("NVIDIA H200", 130200, Some(file.clone())).get(&key),
            None
        );
        // a missing file: nothing known, no error
        assert_eq!(
            Choices::open("x", 1, Some(dir.join("absent.tsv"))).get(&key),
            None
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
