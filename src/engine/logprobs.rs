//! Log-probabilities of a decode step's tokens, as a user asks for them (OpenAI's
//! `logprobs` / `top_logprobs`): the chosen token's and the `n` most likely tokens' (n ≤
//! [`MAX_TOP_LOGPROBS`]), from the model's raw logits of that position — before
//! temperature, penalties and bias, the distribution of the model itself.
//!
//! For a row `x` of `vocab_size` logits, with `m` the largest entry that is a number:
//!
//! ```text
//! logprob(i) = d_i − ln Σ_j e^{d_j},   d_i = x_i − m   (d_i = 0 where x_i = m)
//! ```
//!
//! summed over the entries that are numbers (NaN entries take no part and are never among
//! the best). The `d_i = 0` rule keeps rows whose largest entry is ±∞ defined: the entries
//! equal to it share the mass. The sum is taken in f64. The `n` best are ordered by value,
//! ties broken by the lower id. On a GPU the same numbers are computed in the sampling
//! kernel's block (`src/cuda/kernels/sample.cu`) and only they come back.

/// The most alternatives a step reports per token (OpenAI's bound).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// The log-probabilities of one sampled token.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    /// The chosen token and its log-probability.
    pub token: u32,
    pub logprob: f32,
    /// The most likely tokens, best first (ties: the lower id first), with theirs.
    pub top: Vec<(u32, f32)>,
}

/// `x_i − m`, with the entries equal to `m` at 0 (see the module doc).
fn shifted(x: f32, m: f32) -> f64 {
    if x == m {
        0.0
    } else {
        x as f64 - m as f64
    }
}

/// The log-probabilities of `chosen` and of the `n` best tokens of `row` (the first
/// `vocab_size` entries of a step's logits; `n` ≤ [`MAX_TOP_LOGPROBS`], fewer when fewer
/// entries are numbers).
pub fn row_logprobs(row: &[f32], chosen: u32, n: usize) -> TokenLogprobs {
    let m = row
        .iter()
        .filter(|x| !x.is_nan())
        .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let sum: f64 = row
        .iter()
        .filter(|x| !x.is_nan())
        .map(|&x| shifted(x, m).exp())
        .sum();
    let log_sum = sum.ln();
    let lp = |x: f32| (shifted(x, m) - log_sum) as f32;
    let top = top_n(row, n.min(MAX_TOP_LOGPROBS))
        .into_iter()
        .map(|i| (i, lp(row[i as usize])))
        .collect();
    let logprob = row.get(chosen as usize).map_or(f32::NAN, |&x| lp(x));
    TokenLogprobs {
        token: chosen,
        logprob,
        top,
    }
}

/// The ids of the `n` largest entries that are numbers, largest first, ties to the lower
/// id: one pass keeping a sorted list of at most `n`.
fn top_n(row: &[f32], n: usize) -> Vec<u32> {
    let mut best: Vec<(f32, u32)> = Vec::with_capacity(n + 1);
    if n == 0 {
        return Vec::new();
    }
    for (i, &x) in row.iter().enumerate() {
        if x.is_nan() || (best.len() == n && x <= best[n - 1].0) {
            continue; // (an equal value at a higher id loses the tie)
        }
        let at = best.partition_point(|&(v, _)| v >= x);
        best.insert(at, (x, i as u32));
        best.truncate(n);
    }
    best.into_iter().map(|(_, i)| i).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// log_softmax in f64, the plain way.
    fn reference(row: &[f32]) -> Vec<f64> {
        let m = row
            .iter()
            .filter(|x| !x.is_nan())
            .fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
        let s: f64 = row
            .iter()
            .filter(|x| !x.is_nan())
            .map(|&x| (x as f64 - m).exp())
            .sum();
        row.iter().map(|&x| x as f64 - m - s.ln()).collect()
    }

    #[test]
    fn values_are_log_softmax_and_the_best_come_first() {
        let mut rng = crate::model::rng::Rng::new(3);
        let row: Vec<f32> = (0..5000)
            .map(|_| (rng.uniform() as f32) * 20.0 - 10.0)
            .collect();
        let want = reference(&row);
        let got = row_logprobs(&row, 17, 20);
        assert!((got.logprob as f64 - want[17]).abs() <= 1e-6 * want[17].abs().max(1.0));
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        assert_eq!(got.top.len(), 20);
        for (k, &(id, lp)) in got.top.iter().enumerate() {
            assert_eq!(id as usize, order[k]);
            assert!((lp as f64 - want[order[k]]).abs() <= 1e-6 * want[order[k]].abs().max(1.0));
        }
    }

    #[test]
    fn ties_go_to_the_lower_id_and_nan_never_counts() {
        let row = [1.0, 3.0, f32::NAN, 3.0, 2.0, 3.0, f32::NEG_INFINITY];
        let got = row_logprobs(&row, 6, 4);
        let ids: Vec<u32> = got.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 3, 5, 4]);
        assert_eq!(got.logprob, f32::NEG_INFINITY);
        let total: f64 = reference(&row)
            .iter()
            .filter(|x| !x.is_nan())
            .map(|x| x.exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-12);
        // More asked for than there are numbers: only the numbers.
        assert_eq!(row_logprobs(&[f32::NAN, 0.5], 1, 5).top, vec![(1, 0.0)]);
        // A row whose largest entry is +∞: the infinite entries share the mass.
        let got = row_logprobs(&[f32::INFINITY, 0.0, f32::INFINITY], 2, 3);
        let half = -(2f64.ln()) as f32;
        assert_eq!(got.top, vec![(0, half), (2, half), (1, f32::NEG_INFINITY)]);
        // All −∞: uniform, nothing undefined.
        let got = row_logprobs(&[f32::NEG_INFINITY; 4], 0, 1);
        assert_eq!(got.logprob, -(4f64.ln()) as f32);
        assert_eq!(row_logprobs(&[1.0, 2.0], 0, 0).top, vec![]);
    }
}
