//! The finite-difference walk of the gradient checks (tests/train_grad.rs for Mamba-3
//! SISO, tests/train_mimo_grad.rs for MIMO): every parameter tensor's analytic gradient
//! against central differences in f64.

use mamba3::model::rng::Rng;
use mamba3::train::{loss_and_grad, Batch, Params};

/// Check `g` (the gradient of `p`'s loss on `b`) at seven coordinates of every tensor —
/// six drawn at random and the one of largest gradient — against central differences with
/// step 1e-5: the error, relative to the larger of the coordinate's gradient and the
/// tensor's RMS gradient, must stay under 1e-5. Panics naming the first coordinate past
/// it (or a tensor whose gradient is all zero); returns the worst error.
pub fn check_against_finite_differences(
    case: &str,
    p: &mut Params<f64>,
    g: &Params<f64>,
    b: &Batch,
) -> f64 {
    let names: Vec<String> = p.tensors().into_iter().map(|(n, _)| n).collect();
    let grads: Vec<Vec<f64>> = g.tensors().into_iter().map(|(_, t)| t.clone()).collect();
    let mut rng = Rng::new(11);
    let h = 1e-5;
    let mut worst = 0.0f64;
    for (ti, name) in names.iter().enumerate() {
        let n = grads[ti].len();
        // Sample coordinates, biased towards ones with a visible gradient.
        let mut idx: Vec<usize> = (0..6).map(|_| rng.below(n as u64) as usize).collect();
        let imax = (0..n)
            .max_by(|&a, &b| grads[ti][a].abs().total_cmp(&grads[ti][b].abs()))
            .unwrap();
        idx.push(imax);
        let gnorm = grads[ti].iter().map(|v| v * v).sum::<f64>().sqrt();
        assert!(gnorm > 0.0, "{case}: {name} has an all-zero gradient");
        for &i in &idx {
            let orig = p.tensors_mut()[ti][i];
            p.tensors_mut()[ti][i] = orig + h;
            let lp = loss_and_grad(p, b, None).unwrap();
            p.tensors_mut()[ti][i] = orig - h;
            let lm = loss_and_grad(p, b, None).unwrap();
            p.tensors_mut()[ti][i] = orig;
            let fd = (lp - lm) / (2.0 * h);
            let an = grads[ti][i];
            // Error relative to the tensor's gradient scale (a coordinate's own gradient
            // may be ~0).
            let scale = an.abs().max(gnorm / (n as f64).sqrt()).max(1e-8);
            let err = (fd - an).abs() / scale;
            worst = worst.max(err);
            assert!(
                err < 1e-5,
                "{case}: {name}[{i}]: analytic {an:e}, finite difference {fd:e}, rel err {err:e}"
            );
        }
    }
    worst
}
