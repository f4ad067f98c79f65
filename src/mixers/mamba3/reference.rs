//! The token-by-token Mamba-3 SISO language model: spec §2.9 for the mixer and §2.7 for
//! the blocks, written to be read beside the spec. It is the oracle every fast path is
//! checked against, generic over f32/f64 so tests can run it in f64. No chunking, no
//! activation rounding, no tricks.

use super::state::{layer, LayerState, SeqState};
use super::weights::{LayerWeights, Weights};
use crate::cpu::math::{a_value, rms_norm, rotate_pairs, sigmoid, silu, softplus, wrap_angle};
use crate::cpu::real::Real;
use crate::model::config::{AActivation, Dims, NORM_EPS};
use crate::model::weights::Matrix;

/// A matrix converted to the arithmetic type (the MIMO reference uses it too).
pub(crate) struct Mat<F> {
    cols: usize,
    data: Vec<F>,
}

impl<F: Real> Mat<F> {
    pub(crate) fn new(m: &Matrix) -> Self {
        Mat {
            cols: m.cols,
            data: (0..m.rows * m.cols)
                .map(|i| F::from_f(m.data.get_f64(i)))
                .collect(),
        }
    }
    /// Row `i` (an embedding lookup).
    pub(crate) fn row(&self, i: usize) -> &[F] {
        &self.data[i * self.cols..(i + 1) * self.cols]
    }
    /// `y = W·x`
    pub(crate) fn apply(&self, x: &[F]) -> Vec<F> {
        self.data
            .chunks(self.cols)
            .map(|row| row.iter().zip(x).map(|(&a, &b)| a * b).sum())
            .collect()
    }
}

struct RefLayer<F> {
    in_proj: Mat<F>,
    out_proj: Mat<F>,
    mlp: Option<(Mat<F>, Mat<F>)>,
}

pub struct Reference<'w, F> {
    w: &'w Weights,
    d: Dims,
    a_floor: F,
    a_act: AActivation,
    embedding: Mat<F>,
    head: Mat<F>,
    layers: Vec<RefLayer<F>>,
}

impl<'w, F: Real> Reference<'w, F> {
    pub fn new(w: &'w Weights) -> Self {
        Reference {
            w,
            d: w.dims,
            a_floor: F::from_f(w.config.ssm_cfg.a_floor),
            a_act: w.config.ssm_cfg.a_activation,
            embedding: Mat::new(&w.embedding),
            head: Mat::new(w.head()),
            layers: w
                .layers
                .iter()
                .map(|l| RefLayer {
                    in_proj: Mat::new(&l.in_proj),
                    out_proj: Mat::new(&l.out_proj),
                    mlp: l.mlp.as_ref().map(|m| (Mat::new(&m.fc1), Mat::new(&m.fc2))),
                })
                .collect(),
        }
    }

    /// One token through the whole model; returns the logits over `vocab_padded` rows.
    pub fn step(&self, token: u32, state: &mut SeqState<F>) -> Vec<F> {
        let dm = self.d.d_model;
        let eps = F::from_f(NORM_EPS);
        let mut hs: Vec<F> = self.embedding.row(token as usize).to_vec();
        let mut res: Vec<F> = vec![F::zero(); dm];
        let mut n = vec![F::zero(); dm];
        for (l, (lw, rl)) in self.w.layers.iter().zip(&self.layers).enumerate() {
            add_into(&mut res, &hs);
            rms_norm(&res, &lw.norm, eps, &mut n);
            hs = self.mixer(lw, rl, &n, &mut layer(state, l, &self.d));
            if let (Some(mw), Some((fc1, fc2))) = (&lw.mlp, &rl.mlp) {
                add_into(&mut res, &hs);
                rms_norm(&res, &mw.norm, eps, &mut n);
                let h = self.d.mlp_hidden;
                let vg = fc1.apply(&n);
                let act: Vec<F> = (0..h).map(|i| vg[i] * silu(vg[h + i])).collect();
                hs = fc2.apply(&act);
            }
        }
        add_into(&mut res, &hs);
        rms_norm(&res, &self.w.norm_f, eps, &mut n);
        self.head.apply(&n)
    }

    /// Run a sequence of tokens, returning every position's logits.
    pub fn run(&self, tokens: &[u32], state: &mut SeqState<F>) -> Vec<Vec<F>> {
        tokens.iter().map(|&t| self.step(t, state)).collect()
    }

    /// Spec §2.9: one token of one mixer, updating its carried state.
    fn mixer(
        &self,
        lw: &LayerWeights,
        rl: &RefLayer<F>,
        u: &[F],
        st: &mut LayerState<F>,
    ) -> Vec<F> {
        let d = &self.d;
        let (h_n, p_n, n_n, s_n) = (d.nheads, d.headdim, d.d_state, d.num_rope_angles);
        let eps = F::from_f(NORM_EPS);
        let pi_ = rl.in_proj.apply(u);
        let z = &pi_[d.z_off()..d.z_off() + d.d_inner];
        let x = &pi_[d.x_off()..d.x_off() + d.d_inner];
        let mut bn = vec![F::zero(); d.ngroups * n_n];
        let mut cn = vec![F::zero(); d.ngroups * n_n];
        for g in 0..d.ngroups {
            let b = &pi_[d.b_off() + g * n_n..d.b_off() + (g + 1) * n_n];
            let c = &pi_[d.c_off() + g * n_n..d.c_off() + (g + 1) * n_n];
            rms_norm(b, &lw.b_norm, eps, &mut bn[g * n_n..(g + 1) * n_n]);
            rms_norm(c, &lw.c_norm, eps, &mut cn[g * n_n..(g + 1) * n_n]);
        }
        let theta: Vec<F> = (0..s_n)
            .map(|i| F::PI() * pi_[d.angle_off() + i].tanh())
            .collect();
        let mut y = vec![F::zero(); d.d_inner];
        for h in 0..h_n {
            let g = d.group_of(h);
            let delta = softplus(pi_[d.dt_off() + h] + F::from_f(lw.dt_bias[h] as f64));
            let a = a_value(pi_[d.a_off() + h], self.a_floor, self.a_act);
            let lambda = sigmoid(pi_[d.trap_off() + h]);
            let phi = &mut st.angle[h * s_n..(h + 1) * s_n];
            for i in 0..s_n {
                phi[i] = wrap_angle(phi[i] + theta[i] * delta);
            }
            let cos: Vec<F> = phi.iter().map(|p| p.cos()).collect();
            let sin: Vec<F> = phi.iter().map(|p| p.sin()).collect();
            let bias = |v: &[f32], i: usize| F::from_f(v[h * n_n + i] as f64);
            let mut k: Vec<F> = (0..n_n)
                .map(|i| bn[g * n_n + i] + bias(&lw.b_bias, i))
                .collect();
            let mut q: Vec<F> = (0..n_n)
                .map(|i| cn[g * n_n + i] + bias(&lw.c_bias, i))
                .collect();
            rotate_pairs(&mut k, &cos, &sin);
            rotate_pairs(&mut q, &cos, &sin);
            let alpha = (a * delta).exp();
            let beta = alpha * delta * (F::one() - lambda);
            let gamma = lambda * delta;
            let xh = &x[h * p_n..(h + 1) * p_n];
            let kprev = &mut st.k[h * n_n..(h + 1) * n_n];
            let xprev = &mut st.v[h * p_n..(h + 1) * p_n];
            let s = &mut st.ssm[h * p_n * n_n..(h + 1) * p_n * n_n];
            let dh = F::from_f(lw.d[h] as f64);
            for p in 0..p_n {
                let row = &mut s[p * n_n..(p + 1) * n_n];
                let mut acc = F::zero();
                for nn in 0..n_n {
                    row[nn] = alpha * row[nn] + beta * xprev[p] * kprev[nn] + gamma * xh[p] * k[nn];
                    acc = acc + row[nn] * q[nn];
                }
                y[h * p_n + p] = acc + dh * xh[p];
            }
            kprev.copy_from_slice(&k);
            xprev.copy_from_slice(xh);
        }
        let o: Vec<F> = match &lw.out_norm {
            None => y.iter().zip(z).map(|(&yv, &zv)| yv * silu(zv)).collect(),
            Some(w) => {
                let mut o = vec![F::zero(); d.d_inner];
                for h in 0..h_n {
                    let r = h * p_n..(h + 1) * p_n;
                    rms_norm(&y[r.clone()], &w[r.clone()], eps, &mut o[r.clone()]);
                    for i in r {
                        o[i] = o[i] * silu(z[i]);
                    }
                }
                o
            }
        };
        rl.out_proj.apply(&o)
    }
}

fn add_into<F: Real>(acc: &mut [F], x: &[F]) {
    for (a, &b) in acc.iter_mut().zip(x) {
        *a = *a + b;
    }
}
