//! The timing loop of the benches that time one pass over and over.

use std::time::Instant;

/// Median and best seconds of `passes` calls of `f`, after one untimed.
pub fn median_best(passes: usize, f: &mut dyn FnMut()) -> (f64, f64) {
    f();
    let mut times: Vec<f64> = (0..passes.max(1))
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    (times[times.len() / 2], times[0])
}
