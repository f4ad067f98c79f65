//! Choosing the next token from a row of logits.
//!
//! Order of operations (HF's): logit bias, repetition penalty (over prompt and generated
//! tokens: positive logits divided by it, negative ones multiplied), frequency and presence
//! penalties (OpenAI's, over generated tokens), then greedy argmax when the temperature is
//! 0, else temperature, top-k, top-p, min-p, and a draw from the deterministic generator
//! seeded by `seed` (same seed and logits, same token). Only the first `vocab_size` entries
//! of a row are ever considered: the padded rows of the head are not tokens.
//!
//! The engine holds these rules (not `text/`) because a GPU decode step applies them on the
//! device (`src/cuda/kernels/sample.cu`, through [`crate::engine::Model::decode_sample`]),
//! with its own generator: the same candidates and probabilities, other draws.

use crate::cpu::fastmath::exp_f32;
use crate::error::{Error, Result};
use crate::model::rng::Rng;
use std::collections::{HashMap, HashSet};

#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1 = off.
    pub top_p: f32,
    /// 0 = off.
    pub min_p: f32,
    /// 1 = off.
    pub repetition_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    pub seed: Option<u64>,
    pub logit_bias: Vec<(u32, f32)>,
    /// Not a rule of the choice but what a step reports with it: `Some(n)` asks for the
    /// chosen token's log-probability and the `n` (≤ 20) most likely tokens' (of the raw
    /// logits: `engine::logprobs`); `None` for none.
    pub logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: None,
            logit_bias: Vec::new(),
            logprobs: None,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> SamplingParams {
        SamplingParams {
            temperature: 0.0,
            ..Default::default()
        }
    }

    /// Refuse values outside their ranges, naming the field (`param`), what is allowed and
    /// what was given.
    pub fn validate(&self) -> std::result::Result<(), (String, String)> {
        let bad = |field: &str, want: &str, v: f32| {
            Err((
                field.to_string(),
                format!("`{field}` must be {want}, found {v}"),
            ))
        };
        if !(self.temperature.is_finite() && (0.0..=100.0).contains(&self.temperature)) {
            return bad("temperature", "in [0, 100]", self.temperature);
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", "in (0, 1]", self.top_p);
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", "in [0, 1]", self.min_p);
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad(
                "repetition_penalty",
                "a positive number",
                self.repetition_penalty,
            );
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return bad("frequency_penalty", "in [-2, 2]", self.frequency_penalty);
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return bad("presence_penalty", "in [-2, 2]", self.presence_penalty);
        }
        if let Some((_, b)) = self.logit_bias.iter().find(|(_, b)| !b.is_finite()) {
            return bad("logit_bias", "finite numbers", *b);
        }
        let most = super::logprobs::MAX_TOP_LOGPROBS;
        if let Some(n) = self.logprobs.filter(|&n| n > most) {
            return Err((
                "logprobs".into(),
                format!("`logprobs` must be in 0..={most}, found {n}"),
            ));
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature < 1e-5
    }
}

/// Sampling state of one sequence: its generator and the tokens it has seen.
pub struct Sampler {
    params: SamplingParams,
    /// The seed of `rng` (given or fresh): a device draws from its own stream of it.
    seed: u64,
    /// Names this sampler while it lives (a device keeps its counts under it).
    key: u64,
    /// Steps a device has taken for it (the position of its device stream).
    pub(crate) device_steps: u64,
    rng: Rng,
    /// Prompt and generated tokens (repetition penalty).
    seen: HashSet<u32>,
    /// Generated tokens and their counts (frequency and presence penalties).
    counts: HashMap<u32, u32>,
    scratch: Vec<f32>,
    idx: Vec<(u32, f32)>,
    /// Softmax weights of a row and their block sums (draws).
    weights: Vec<f32>,
    block_sums: Vec<f64>,
}

static SAMPLER_KEYS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

static SEED_COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn fresh_seed() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    t ^ SEED_COUNTER
        .fetch_add(0x9E37_79B9_7F4A_7C15, std::sync::atomic::Ordering::Relaxed)
        .rotate_left(17)
}

/// Index of the largest value (the first one on ties; NaN never wins; 0 when nothing
/// beats −∞).
///
/// Greedy decoding calls this once per sequence and step over the whole vocabulary, so it
/// runs in independent lanes (each keeps its first maximum) that the compiler turns into
/// vector compares and blends (~15x the plain scan on 32k entries); the lanes are then
/// merged by value, ties to the lower index.
pub fn argmax(row: &[f32]) -> u32 {
    const L: usize = 16;
    let mut best = [f32::NEG_INFINITY; L];
    let mut at = [0u32; L];
    let mut idx: [u32; L] = std::array::from_fn(|l| l as u32);
    let (chunks, rest) = row.as_chunks::<L>();
    for ch in chunks {
        for l in 0..L {
            let win = ch[l] > best[l];
            best[l] = if win { ch[l] } else { best[l] };
            at[l] = if win { idx[l] } else { at[l] };
            idx[l] += L as u32;
        }
    }
    let (mut bv, mut bi) = (f32::NEG_INFINITY, 0u32);
    for l in 0..L {
        if best[l] > bv || (best[l] == bv && at[l] < bi) {
            (bv, bi) = (best[l], at[l]);
        }
    }
    let tail = row.len() - rest.len();
    for (i, &v) in rest.iter().enumerate() {
        if v > bv {
            (bv, bi) = (v, (tail + i) as u32);
        }
    }
    bi
}

impl Sampler {
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Sampler {
        let seed = params.seed.unwrap_or_else(fresh_seed);
        let rng = Rng::new(seed);
        let key = SAMPLER_KEYS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let seen = if params.repetition_penalty != 1.0 {
            prompt.iter().copied().collect()
        } else {
            HashSet::new()
        };
        Sampler {
            params,
            seed,
            key,
            device_steps: 0,
            rng,
            seen,
            counts: HashMap::new(),
            scratch: Vec::new(),
            idx: Vec::new(),
            weights: Vec::new(),
            block_sums: Vec::new(),
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The seed of its draws (the one given, or the fresh one it took).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// A number no other sampler of this process has.
    pub fn key(&self) -> u64 {
        self.key
    }

    /// The count word of every token it has seen, as a device keeps them
    /// (`kernels/sample.cu`): bit 31 for a token of the prompt or generated (kept only
    /// under a repetition penalty), the bits below for how often it was generated (kept
    /// only under a frequency or presence penalty).
    pub fn count_words(&self) -> Vec<(u32, u32)> {
        let mut words: HashMap<u32, u32> = self.counts.clone();
        for &t in &self.seen {
            *words.entry(t).or_insert(0) |= SEEN_BIT;
        }
        let mut v: Vec<(u32, u32)> = words.into_iter().collect();
        v.sort_unstable();
        v
    }

    /// Record a token as generated (for the penalties).
    pub fn accept(&mut self, token: u32) {
        if self.params.repetition_penalty != 1.0 {
            self.seen.insert(token);
        }
        if self.params.frequency_penalty != 0.0 || self.params.presence_penalty != 0.0 {
            *self.counts.entry(token).or_insert(0) += 1;
        }
    }

    /// The next token from `logits`, a row of exactly `vocab_size` entries (the caller cuts
    /// the padding off). Does not record it: call [`Sampler::accept`].
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        let plain = p.logit_bias.is_empty()
            && p.repetition_penalty == 1.0
            && p.frequency_penalty == 0.0
            && p.presence_penalty == 0.0;
        if plain && p.is_greedy() {
            return argmax(logits);
        }
        let mut l = std::mem::take(&mut self.scratch);
        l.clear();
        l.extend_from_slice(logits);
        let n = l.len();
        for &(t, b) in &p.logit_bias {
            if (t as usize) < n {
                l[t as usize] += b;
            }
        }
        if p.repetition_penalty != 1.0 {
            for &t in &self.seen {
                if let Some(x) = l.get_mut(t as usize) {
                    *x = if *x > 0.0 {
                        *x / p.repetition_penalty
                    } else {
                        *x * p.repetition_penalty
                    };
                }
            }
        }
        for (&t, &c) in &self.counts {
            if let Some(x) = l.get_mut(t as usize) {
                *x -= c as f32 * p.frequency_penalty + p.presence_penalty;
            }
        }
        let tok = if p.is_greedy() {
            argmax(&l)
        } else {
            self.draw(&l)
        };
        self.scratch = l;
        tok
    }

    /// Temperature, top-k, top-p, min-p, then a draw. Without top-k the softmax weights of
    /// the whole row come from vectorised passes (a scalar `exp` per vocabulary entry was
    /// most of a draw's time), and the draw walks the row by blocks.
    fn draw(&mut self, l: &[f32]) -> u32 {
        let p = &self.params;
        let inv_t = 1.0 / p.temperature;
        if p.top_k > 0 {
            return self.draw_top_k(l, inv_t);
        }
        let (top_p, floor) = (p.top_p, p.min_p);
        let w = &mut self.weights;
        if !softmax_weights(l, inv_t, w) {
            return 0; // every entry is NaN
        }
        let u = self.rng.uniform();
        if top_p < 1.0 {
            let target = top_p as f64 * lane_sum(w);
            // The top-p set is the head of the weights in decreasing order: look for it
            // among the weights ≥ 1e-4 of the largest (a few hundred for a trained model),
            // and among all only if those do not reach the target.
            for least in [1e-4, f32::NEG_INFINITY] {
                let cand = &mut self.idx;
                cand.clear();
                cand.extend(
                    w.iter()
                        .zip(l)
                        .enumerate()
                        .filter(|(_, (&x, v))| x >= least && !v.is_nan())
                        .map(|(i, (&x, _))| (i as u32, x)),
                );
                if let Some(t) = top_p_draw(cand, target, floor, u, least.is_finite()) {
                    return t;
                }
            }
            unreachable!("with every candidate, top_p_draw always draws");
        }
        // Temperature (and min-p) over the whole row in index order: skip whole blocks by
        // their sums, then walk the one the draw falls in.
        if floor > 0.0 {
            // The max weight is exp(0) = 1 (it is always a candidate).
            w.iter_mut()
                .for_each(|x| *x = if *x >= floor { *x } else { 0.0 });
        }
        let sums = &mut self.block_sums;
        sums.clear();
        sums.extend(w.chunks(DRAW_BLOCK).map(lane_sum));
        let mut r = u * sums.iter().sum::<f64>();
        let mut b = 0;
        while b + 1 < sums.len() && r - sums[b] >= 0.0 {
            r -= sums[b];
            b += 1;
        }
        for (i, &x) in w.iter().enumerate().skip(b * DRAW_BLOCK) {
            r -= x as f64;
            if r < 0.0 {
                return i as u32;
            }
        }
        // (rounding carried the draw past the end: the last candidate)
        let cand = |&i: &usize| !l[i].is_nan() && (floor <= 0.0 || w[i] >= floor);
        (0..w.len()).rev().find(cand).map_or(0, |i| i as u32)
    }

    /// [`Sampler::draw`] with top-k: the candidates are cut to the k largest first.
    fn draw_top_k(&mut self, l: &[f32], inv_t: f32) -> u32 {
        let p = &self.params;
        let desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let cand = &mut self.idx;
        cand.clear();
        cand.extend(
            l.iter()
                .enumerate()
                .filter(|(_, v)| !v.is_nan())
                .map(|(i, &v)| (i as u32, v * inv_t)),
        );
        if cand.is_empty() {
            return 0;
        }
        let mut sorted = false;
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.select_nth_unstable_by(p.top_k - 1, desc);
            cand.truncate(p.top_k);
            cand.sort_unstable_by(desc);
            sorted = true;
        }
        // Softmax weights (unnormalised), max-subtracted.
        let max = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
        for c in cand.iter_mut() {
            c.1 = weight(c.1 - max);
        }
        let total: f64 = cand.iter().map(|c| c.1 as f64).sum();
        if p.top_p < 1.0 {
            if !sorted {
                // Most of the mass usually sits in a few hundred tokens: sort those first.
                let m = cand.len().min(1024);
                if m < cand.len() {
                    cand.select_nth_unstable_by(m - 1, desc);
                }
                cand[..m].sort_unstable_by(desc);
                let head: f64 = cand[..m].iter().map(|c| c.1 as f64).sum();
                if head < p.top_p as f64 * total && m < cand.len() {
                    cand.sort_unstable_by(desc);
                }
            }
            let target = p.top_p as f64 * total;
            let mut acc = 0.0;
            let mut keep = cand.len();
            for (i, c) in cand.iter().enumerate() {
                acc += c.1 as f64;
                if acc >= target {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep.max(1));
        }
        if p.min_p > 0.0 {
            // The max weight is exp(0) = 1 (it is always a candidate).
            let floor = p.min_p;
            cand.retain(|c| c.1 >= floor);
        }
        let total: f64 = cand.iter().map(|c| c.1 as f64).sum();
        let mut r = self.rng.uniform() * total;
        for c in cand.iter() {
            r -= c.1 as f64;
            if r < 0.0 {
                return c.0;
            }
        }
        cand.last().map_or(0, |c| c.0)
    }
}

/// The "seen" bit of a device count word (`SEEN_BIT` in kernels/sample.cu).
pub const SEEN_BIT: u32 = 0x8000_0000;

/// Entries of the row per block of the draw's walk.
const DRAW_BLOCK: usize = 256;

/// A softmax weight `eᵈ` for `d = x − max ≤ 0`: vectorisable, within 2 ulp; 0 below e⁻⁸⁷
/// (and for NaN), so that such an entry is never drawn.
#[inline(always)]
fn weight(d: f32) -> f32 {
    let e = exp_f32(d);
    if d >= -87.0 {
        e
    } else {
        0.0
    }
}

/// The unnormalised softmax weights of `l · inv_t` into `w`: `exp(x − max)`, the max over
/// the non-NaN entries, 0 for NaN entries. False when every entry is NaN.
fn softmax_weights(l: &[f32], inv_t: f32, w: &mut Vec<f32>) -> bool {
    const L: usize = 16;
    w.clear();
    w.extend(l.iter().map(|&v| v * inv_t));
    let (mut best, mut any) = ([f32::NEG_INFINITY; L], [false; L]);
    let (chunks, rest) = w.as_chunks::<L>();
    for c in chunks {
        for j in 0..L {
            best[j] = if c[j] > best[j] { c[j] } else { best[j] };
            any[j] |= !c[j].is_nan();
        }
    }
    if !(any.contains(&true) || rest.iter().any(|x| !x.is_nan())) {
        return false;
    }
    let mut max = f32::NEG_INFINITY;
    for &x in best.iter().chain(rest) {
        if x > max {
            max = x;
        }
    }
    w.iter_mut().for_each(|x| *x = weight(*x - max));
    true
}

/// Sum in f64, in lanes that vectorise.
fn lane_sum(w: &[f32]) -> f64 {
    let mut acc = [0f64; 8];
    let (chunks, rest) = w.as_chunks::<8>();
    for c in chunks {
        for j in 0..8 {
            acc[j] += c[j] as f64;
        }
    }
    acc.iter().sum::<f64>() + rest.iter().map(|&x| x as f64).sum::<f64>()
}

/// The top-p draw over candidates (index, weight): in decreasing weight, the shortest
/// head that reaches `target`, then min-p, then the draw at `u`. `None` when `filtered`
/// (only the largest weights are candidates) and they do not reach the target.
fn top_p_draw(
    cand: &mut Vec<(u32, f32)>,
    target: f64,
    min_p: f32,
    u: f64,
    filtered: bool,
) -> Option<u32> {
    let desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    // Most of the mass usually sits in a few hundred tokens: sort those first.
    let m = cand.len().min(1024);
    if m < cand.len() {
        cand.select_nth_unstable_by(m - 1, desc);
    }
    cand[..m].sort_unstable_by(desc);
    let head: f64 = cand[..m].iter().map(|c| c.1 as f64).sum();
    if head < target && m < cand.len() {
        cand.sort_unstable_by(desc);
    }
    let mut acc = 0.0;
    let mut keep = None;
    for (i, c) in cand.iter().enumerate() {
        acc += c.1 as f64;
        if acc >= target {
            keep = Some(i + 1);
            break;
        }
    }
    let keep = match keep {
        Some(k) => k,
        None if filtered => return None,
        None => cand.len(),
    };
    cand.truncate(keep.max(1));
    if min_p > 0.0 {
        // The max weight is exp(0) = 1 (it is always a candidate).
        cand.retain(|c| c.1 >= min_p);
    }
    let total: f64 = cand.iter().map(|c| c.1 as f64).sum();
    let mut r = u * total;
    for c in cand.iter() {
        r -= c.1 as f64;
        if r < 0.0 {
            return Some(c.0);
        }
    }
    Some(cand.last().map_or(0, |c| c.0))
}

/// Parse OpenAI's `logit_bias` (`{"token id": bias}`) against the vocabulary.
pub fn parse_logit_bias(
    map: &std::collections::BTreeMap<String, f32>,
    vocab: usize,
) -> Result<Vec<(u32, f32)>> {
    map.iter()
        .map(|(k, &v)| match k.parse::<u32>() {
            Ok(t) if (t as usize) < vocab => Ok((t, v)),
            _ => Err(Error::input(format!(
                "logit_bias key `{k}` is not a token id in 0..{vocab}"
            ))),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams {
            seed: Some(7),
            ..Default::default()
        };
        f(&mut p);
        p
    }

    #[test]
    fn greedy_is_argmax_and_penalties_apply() {
        let logits = [0.1, 3.0, 2.9, -1.0];
        let mut s = Sampler::new(SamplingParams::greedy(), &[]);
        assert_eq!(s.sample(&logits), 1);
        // Token 1 seen in the prompt: 3.0/1.2 = 2.5 < 2.9.
        let mut s = Sampler::new(
            SamplingParams {
                repetition_penalty: 1.2,
                ..SamplingParams::greedy()
            },
            &[1],
        );
        assert_eq!(s.sample(&logits), 2);
        let mut s = Sampler::new(
            SamplingParams {
                logit_bias: vec![(3, 10.0)],
                ..SamplingParams::greedy()
            },
            &[],
        );
        assert_eq!(s.sample(&logits), 3);
        let mut s = Sampler::new(
            SamplingParams {
                frequency_penalty: 0.5,
                ..SamplingParams::greedy()
            },
            &[],
        );
        s.accept(1);
        assert_eq!(s.sample(&logits), 2);
    }

    #[test]
    fn same_seed_same_draws_and_top_k_one_is_greedy() {
        let logits: Vec<f32> = (0..500).map(|i| ((i * 37) % 500) as f32 * 0.01).collect();
        let draw = |p: SamplingParams| {
            let mut s = Sampler::new(p, &[]);
            (0..50).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(params(|_| {})), draw(params(|_| {})));
        assert_ne!(draw(params(|_| {})), draw(params(|p| p.seed = Some(8))));
        let g = argmax(&logits);
        assert!(draw(params(|p| p.top_k = 1)).iter().all(|&t| t == g));
        assert!(draw(params(|p| p.top_p = 1e-6)).iter().all(|&t| t == g));
        assert!(draw(params(|p| p.min_p = 1.0)).iter().all(|&t| t == g));
    }

    #[test]
    fn top_k_and_top_p_keep_only_their_sets() {
        // Probabilities ∝ exp(logit): tokens 0..4 hold almost all the mass.
        let mut logits = vec![-30.0f32; 3000];
        for (i, v) in [5.0, 4.0, 3.0, 2.0].iter().enumerate() {
            logits[i] = *v;
        }
        let mut s = Sampler::new(params(|p| p.top_k = 2), &[]);
        for _ in 0..200 {
            assert!(s.sample(&logits) < 2);
        }
        // top_p 0.7: token 0 has ~64%, tokens 0+1 ~88%: the set is {0, 1}.
        let mut s = Sampler::new(params(|p| p.top_p = 0.7), &[]);
        let draws: Vec<u32> = (0..400).map(|_| s.sample(&logits)).collect();
        assert!(draws.iter().all(|&t| t < 2));
        assert!(draws.contains(&0) && draws.contains(&1));
        // min_p 0.2 of the top: exp(-1)=0.37 and exp(-2)=0.14: {0, 1}.
        let mut s = Sampler::new(params(|p| p.min_p = 0.2), &[]);
        assert!((0..200).all(|_| s.sample(&logits) < 2));
    }

    #[test]
    fn argmax_is_the_first_maximum() {
        // The plain scan it replaces.
        let scan = |row: &[f32]| {
            let (mut bv, mut bi) = (f32::NEG_INFINITY, 0);
            for (i, &v) in row.iter().enumerate() {
                if v > bv {
                    (bv, bi) = (v, i as u32);
                }
            }
            bi
        };
        let mut rng = Rng::new(3);
        for n in [0usize, 1, 5, 16, 17, 31, 32, 33, 1000, 32000] {
            for _ in 0..20 {
                // Few distinct values: many ties, across lanes and into the tail.
                let mut row: Vec<f32> = (0..n).map(|_| rng.below(7) as f32).collect();
                if n > 3 && rng.below(2) == 0 {
                    row[rng.below(n as u64) as usize] = f32::NAN;
                    row[rng.below(n as u64) as usize] = f32::NEG_INFINITY;
                }
                assert_eq!(argmax(&row), scan(&row), "{row:?}");
            }
        }
        assert_eq!(argmax(&[f32::NAN; 40]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY; 40]), 0);
        let mut row = vec![f32::NAN; 40];
        row[37] = -5.0;
        assert_eq!(argmax(&row), 37);
    }

    /// The draw as it was written first: a candidate list of the whole row, sorted for
    /// top-p (with the same `weight` as the draw now).
    fn reference_draw(l: &[f32], p: &SamplingParams, u: f64) -> u32 {
        let desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let mut cand: Vec<(u32, f32)> = l
            .iter()
            .enumerate()
            .filter(|(_, v)| !v.is_nan())
            .map(|(i, &v)| (i as u32, v * (1.0 / p.temperature)))
            .collect();
        let max = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
        cand.iter_mut().for_each(|c| c.1 = weight(c.1 - max));
        let total: f64 = cand.iter().map(|c| c.1 as f64).sum();
        if p.top_p < 1.0 {
            cand.sort_by(desc);
            let mut acc = 0.0;
            let keep = cand.iter().position(|c| {
                acc += c.1 as f64;
                acc >= p.top_p as f64 * total
            });
            cand.truncate(keep.map_or(cand.len(), |k| k + 1));
        }
        if p.min_p > 0.0 {
            cand.retain(|c| c.1 >= p.min_p);
        }
        let mut r = u * cand.iter().map(|c| c.1 as f64).sum::<f64>();
        for c in &cand {
            r -= c.1 as f64;
            if r < 0.0 {
                return c.0;
            }
        }
        cand.last().map_or(0, |c| c.0)
    }

    #[test]
    fn draws_match_the_plain_candidate_list() {
        let mut rng = Rng::new(11);
        for n in [1usize, 7, 300, 5000] {
            // A peaked row (a trained model's) and a flat one, with NaN holes.
            for peak in [12.0f32, 1.0] {
                let mut row: Vec<f32> = (0..n)
                    .map(|_| (rng.uniform() as f32).powi(4) * peak * 3.0 - peak)
                    .collect();
                if n > 10 {
                    row[3] = f32::NAN;
                    row[n - 2] = f32::NAN;
                }
                for (t, top_p, min_p) in [(1.0, 1.0, 0.0), (0.7, 0.9, 0.0), (1.3, 1.0, 0.05)] {
                    let p = params(|p| (p.temperature, p.top_p, p.min_p) = (t, top_p, min_p));
                    let mut s = Sampler::new(p.clone(), &[]);
                    for _ in 0..200 {
                        // The next uniform the sampler will draw.
                        let u = s.rng.clone().uniform();
                        assert_eq!(s.sample(&row), reference_draw(&row, &p, u), "{p:?}");
                    }
                }
            }
        }
        let mut s = Sampler::new(params(|_| {}), &[]);
        assert_eq!(s.sample(&[f32::NAN; 40]), 0);
    }

    #[test]
    fn validate_names_the_field() {
        let (f, msg) = params(|p| p.top_p = 0.0).validate().unwrap_err();
        assert_eq!(f, "top_p");
        assert!(msg.contains("(0, 1]") && msg.contains("found 0"), "{msg}");
        assert!(params(|p| p.temperature = -1.0).validate().is_err());
        assert!(params(|_| {}).validate().is_ok());
    }
}
