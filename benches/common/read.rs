//! A plain read of memory, the rate the weight-streaming kernels are judged against.

use rayon::prelude::*;

/// The wrapping sum of `words`, in pieces over the pool's threads, each piece summed in
/// 16 independent lanes so that the adds vectorise and the loop is bound by the reads.
pub fn sum_words(words: &[u32]) -> u32 {
    words
        .par_chunks(1 << 14)
        .map(|c| {
            let mut acc = [0u32; 16];
            for v in c.chunks_exact(16) {
                for i in 0..16 {
                    acc[i] = acc[i].wrapping_add(v[i]);
                }
            }
            acc.iter().fold(0u32, |a, &b| a.wrapping_add(b))
        })
        .reduce(|| 0, u32::wrapping_add)
}
