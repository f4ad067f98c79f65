//! The language model for training (spec §2.7): a forward that keeps its activations and
//! the matching backward, for a batch of equal-length windows, each from a zero state.
//!
//! With the pre-norm residual stream `r` (f32 or f64 throughout):
//!
//! ```text
//! r ← E[tokens]
//! per layer:  r ← r + W_out·gate(scan(W_in·rms(r; w_norm)))
//!             r ← r + W_fc2·(v ⊙ silu(g)),  [v ‖ g] = W_fc1·rms(r; w_norm2)     (MLP)
//! logits = W_head·rms(r; w_norm_f);   loss = mean over tokens of −log softmax(logits)[target]
//! ```
//!
//! which is the official fused add-norm of spec §2.7 written without the `(hs, res)` pair.
//! The backward walks the same list in reverse; the mixer's part is in
//! [`crate::mixers::mamba3::train::forward`] (SISO) or [`crate::mixers::mimo::train`]
//! (MIMO, `ssm_cfg.is_mimo`) — [`LayerMixer`] is the one place that chooses. After each
//! stage of the backward (the head, each layer, the embedding) it tells a
//! [`GradReady`] hook that those gradients are final (data-parallel overlap).

use super::ready::{GradReady, NoHook, Stage};
use crate::cpu::math::silu;
use crate::cpu::ops::{linear, linear_dw, linear_dx, rms_bwd, rms_fwd, silu_grad};
use crate::cpu::Real;
use crate::error::{Error, Result};
use crate::mixers::mamba3::params::{param_dims, LayerParams, Params};
use crate::mixers::mamba3::train::backward::mixer_backward;
use crate::mixers::mamba3::train::forward::{mixer_forward, MixerSaved, MixerShape};
use crate::mixers::mimo::train::{mimo_mixer_backward, mimo_mixer_forward, MimoSaved, MimoShape};
use crate::mixers::mimo::weights::mimo_dims;
use crate::model::config::Config;
use crate::model::dtype::Element;
use crate::model::Dims;
use rayon::prelude::*;

/// `batch` windows of `seq_len` input tokens with their next-token targets, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    pub batch: usize,
    pub seq_len: usize,
    pub inputs: Vec<u32>,
    pub targets: Vec<u32>,
}

impl Batch {
    /// From windows of `seq_len + 1` tokens each.
    pub fn from_windows(windows: &[&[u32]]) -> Batch {
        let seq_len = windows[0].len() - 1;
        let mut b = Batch {
            batch: windows.len(),
            seq_len,
            inputs: Vec::with_capacity(windows.len() * seq_len),
            targets: Vec::with_capacity(windows.len() * seq_len),
        };
        for w in windows {
            assert_eq!(w.len(), seq_len + 1, "windows must have equal lengths");
            b.inputs.extend_from_slice(&w[..seq_len]);
            b.targets.extend_from_slice(&w[1..]);
        }
        b
    }
    pub fn tokens(&self) -> usize {
        self.batch * self.seq_len
    }
}

/// The mixer of every layer of a model, SISO or MIMO: the one place the LM chooses.
enum LayerMixer {
    Siso(MixerShape),
    Mimo(MimoShape),
}

/// What a layer's mixer kept for its backward.
enum MixerRun<F> {
    Siso(MixerSaved<F>),
    Mimo(MimoSaved<F>),
}

impl<F> MixerRun<F> {
    /// The mixer's output `[rows, D_i]`, the input of `out_proj`.
    fn o(&self) -> &[F] {
        match self {
            MixerRun::Siso(s) => &s.o,
            MixerRun::Mimo(s) => &s.o,
        }
    }
}

impl LayerMixer {
    fn of(cfg: &Config, batch: &Batch) -> LayerMixer {
        let s = &cfg.ssm_cfg;
        if s.is_mimo {
            LayerMixer::Mimo(MimoShape {
                d: mimo_dims(cfg),
                a_floor: s.a_floor,
                a_act: s.a_activation,
                batch: batch.batch,
                seq_len: batch.seq_len,
            })
        } else {
            LayerMixer::Siso(MixerShape {
                d: cfg.dims(),
                a_floor: s.a_floor,
                a_act: s.a_activation,
                batch: batch.batch,
                seq_len: batch.seq_len,
            })
        }
    }

    fn forward<F: Real>(&self, lp: &LayerParams<F>, proj: &[F]) -> MixerRun<F> {
        match self {
            LayerMixer::Siso(sh) => MixerRun::Siso(mixer_forward(sh, lp, proj)),
            LayerMixer::Mimo(sh) => MixerRun::Mimo(mimo_mixer_forward(sh, lp, proj)),
        }
    }

    /// Gradient of `proj` into `dproj` (overwritten) from that of the mixer's output
    /// `d_o`; the mixer's parameter gradients added into `grad`.
    fn backward<F: Real>(
        &self,
        lp: &LayerParams<F>,
        proj: &[F],
        saved: &MixerRun<F>,
        d_o: &[F],
        dproj: &mut [F],
        grad: &mut LayerParams<F>,
    ) {
        match (self, saved) {
            (LayerMixer::Siso(sh), MixerRun::Siso(sv)) => {
                mixer_backward(sh, lp, proj, sv, d_o, dproj, grad)
            }
            (LayerMixer::Mimo(sh), MixerRun::Mimo(sv)) => {
                mimo_mixer_backward(sh, lp, proj, sv, d_o, dproj, grad)
            }
            _ => unreachable!("a layer's saved activations come from its own mixer"),
        }
    }
}

struct LayerSaved<F> {
    r_in: Vec<F>,
    n: Vec<F>,
    rn: Vec<F>,
    proj: Vec<F>,
    mixer: MixerRun<F>,
    mlp: Option<MlpSaved<F>>,
}

struct MlpSaved<F> {
    r_mid: Vec<F>,
    n2: Vec<F>,
    rn2: Vec<F>,
    vg: Vec<F>,
    act: Vec<F>,
}

fn norm_rows<F: Real>(x: &[F], w: &[F], width: usize) -> (Vec<F>, Vec<F>) {
    let rows = x.len() / width;
    let mut out = vec![F::zero(); x.len()];
    let mut r = vec![F::zero(); rows];
    out.par_chunks_mut(width)
        .zip(r.par_iter_mut())
        .zip(x.par_chunks(width))
        .for_each(|((o, rr), xr)| *rr = rms_fwd(xr, w, o));
    (out, r)
}

fn norm_rows_bwd<F: Real>(x: &[F], w: &[F], r: &[F], dout: &[F], dx: &mut [F], dw: &mut [F]) {
    let width = w.len();
    for (i, &ri) in r.iter().enumerate() {
        let rg = i * width..(i + 1) * width;
        rms_bwd(
            &x[rg.clone()],
            w,
            ri,
            &dout[rg.clone()],
            &mut dx[rg],
            dw,
            true,
        );
    }
}

/// A batch fits a model of dims `d`: not empty, consistent, every token in the vocabulary.
pub fn check_batch(d: &Dims, b: &Batch) -> Result<()> {
    if b.batch == 0 || b.seq_len == 0 {
        return Err(Error::input("empty training batch"));
    }
    if b.inputs.len() != b.tokens() || b.targets.len() != b.tokens() {
        return Err(Error::input(format!(
            "batch of {}×{} needs {} inputs and targets, found {} and {}",
            b.batch,
            b.seq_len,
            b.tokens(),
            b.inputs.len(),
            b.targets.len()
        )));
    }
    if let Some(&t) = b
        .inputs
        .iter()
        .chain(&b.targets)
        .find(|&&t| t as usize >= d.vocab_size)
    {
        return Err(Error::input(format!(
            "token {t} out of range: vocabulary has {} entries",
            d.vocab_size
        )));
    }
    Ok(())
}

/// The forward with its saved activations: per layer, the final residual `r`, its norm
/// `nf` with RMS factors `rf`, and the logits `[rows, vocab_padded]`.
struct Forward<F> {
    saved: Vec<LayerSaved<F>>,
    r: Vec<F>,
    nf: Vec<F>,
    rf: Vec<F>,
    logits: Vec<F>,
}

fn forward<F: Real>(p: &Params<F>, batch: &Batch, mixer: &LayerMixer, th: usize) -> Forward<F> {
    let d = param_dims(&p.config);
    let (dm, rows, vp) = (d.d_model, batch.tokens(), d.vocab_padded);
    let mut r = vec![F::zero(); rows * dm];
    for (row, &t) in r.chunks_mut(dm).zip(&batch.inputs) {
        row.copy_from_slice(&p.embedding[t as usize * dm..(t as usize + 1) * dm]);
    }
    let mut saved: Vec<LayerSaved<F>> = Vec::with_capacity(d.n_layer);
    for lp in &p.layers {
        let r_in = r.clone();
        let (n, rn) = norm_rows(&r, &lp.norm, dm);
        let mut proj = vec![F::zero(); rows * d.d_in_proj];
        linear(&n, rows, &lp.in_proj, d.d_in_proj, dm, &mut proj, th);
        let mixer = mixer.forward(lp, &proj);
        let mut out = vec![F::zero(); rows * dm];
        linear(mixer.o(), rows, &lp.out_proj, dm, d.d_inner, &mut out, th);
        r.iter_mut().zip(&out).for_each(|(a, &b)| *a = *a + b);
        let mlp = lp.mlp.as_ref().map(|mp| {
            let hid = d.mlp_hidden;
            let r_mid = r.clone();
            let (n2, rn2) = norm_rows(&r, &mp.norm, dm);
            let mut vg = vec![F::zero(); rows * 2 * hid];
            linear(&n2, rows, &mp.fc1, 2 * hid, dm, &mut vg, th);
            let mut act = vec![F::zero(); rows * hid];
            for (a, v) in act.chunks_mut(hid).zip(vg.chunks(2 * hid)) {
                for i in 0..hid {
                    a[i] = v[i] * silu(v[hid + i]);
                }
            }
            linear(&act, rows, &mp.fc2, dm, hid, &mut out, th);
            r.iter_mut().zip(&out).for_each(|(a, &b)| *a = *a + b);
            MlpSaved {
                r_mid,
                n2,
                rn2,
                vg,
                act,
            }
        });
        saved.push(LayerSaved {
            r_in,
            n,
            rn,
            proj,
            mixer,
            mlp,
        });
    }
    let (nf, rf) = norm_rows(&r, &p.norm_f, dm);
    let mut logits = vec![F::zero(); rows * vp];
    linear(&nf, rows, p.head(), vp, dm, &mut logits, th);
    Forward {
        saved,
        r,
        nf,
        rf,
        logits,
    }
}

/// The training forward's logits of `batch` (`[tokens, vocab_padded]`, windows from a
/// zero state), for checks against the inference paths.
pub fn logits<F: Real>(p: &Params<F>, batch: &Batch) -> Result<Vec<F>> {
    check_batch(&param_dims(&p.config), batch)?;
    let mixer = LayerMixer::of(&p.config, batch);
    Ok(forward(p, batch, &mixer, rayon::current_num_threads()).logits)
}

/// Mean cross-entropy (nats per token) of `batch` under `p`; with `grad`, also adds the
/// gradient of that mean loss to `grad`.
pub fn loss_and_grad<F: Real>(
    p: &Params<F>,
    batch: &Batch,
    grad: Option<&mut Params<F>>,
) -> Result<f64> {
    match grad {
        Some(g) => loss_and_grad_ready(p, batch, Some((g, &mut NoHook))),
        None => loss_and_grad_ready(p, batch, None),
    }
}

/// [`loss_and_grad`] that tells `ready` after each stage of the backward that the stage's
/// gradients are final (`super::ready`: the head, the layers last to first, the embedding).
pub fn loss_and_grad_ready<F: Real>(
    p: &Params<F>,
    batch: &Batch,
    grad: Option<(&mut Params<F>, &mut dyn GradReady<Params<F>>)>,
) -> Result<f64> {
    let d = param_dims(&p.config);
    check_batch(&d, batch)?;
    let th = rayon::current_num_threads();
    let (dm, rows, vp) = (d.d_model, batch.tokens(), d.vocab_padded);
    let mixer = LayerMixer::of(&p.config, batch);
    let Forward {
        saved,
        r,
        nf,
        rf,
        mut logits,
    } = forward(p, batch, &mixer, th);
    // Softmax cross-entropy; logits become dlogits in place.
    let inv = F::one() / F::from_f(rows as f64);
    let losses: Vec<f64> = logits
        .par_chunks_mut(vp)
        .zip(batch.targets.par_iter())
        .map(|(l, &t)| {
            let m = l.iter().copied().fold(F::neg_infinity(), F::max);
            let mut sum = F::zero();
            for v in l.iter_mut() {
                *v = (*v - m).exp();
                sum = sum + *v;
            }
            let lt = l[t as usize];
            let loss = Element::to_f64(sum.ln() - lt.ln());
            for v in l.iter_mut() {
                *v = *v / sum * inv;
            }
            l[t as usize] = l[t as usize] - inv;
            loss
        })
        .collect();
    let loss = losses.iter().sum::<f64>() / rows as f64;
    let Some((g, ready)) = grad else {
        return Ok(loss);
    };
    // Backward.
    let dlogits = logits;
    let mut dnf = vec![F::zero(); rows * dm];
    {
        let dhead: &mut Vec<F> = g.lm_head.as_mut().unwrap_or(&mut g.embedding);
        linear_dw(&dlogits, &nf, rows, vp, dm, dhead, th);
    }
    linear_dx(&dlogits, p.head(), rows, vp, dm, &mut dnf, false, th);
    drop(dlogits);
    let mut dr = vec![F::zero(); rows * dm];
    norm_rows_bwd(&r, &p.norm_f, &rf, &dnf, &mut dr, &mut g.norm_f);
    ready.ready(Stage::Head, g)?;
    let mut dproj = vec![F::zero(); rows * d.d_in_proj];
    let mut d_o = vec![F::zero(); rows * d.d_inner];
    let mut dn = vec![F::zero(); rows * dm];
    for (l, s) in saved.into_iter().enumerate().rev() {
        let (lp, gl) = (&p.layers[l], &mut g.layers[l]);
        if let (Some(mp), Some(ms), Some(gm)) = (&lp.mlp, &s.mlp, gl.mlp.as_mut()) {
            let hid = d.mlp_hidden;
            linear_dw(&dr, &ms.act, rows, dm, hid, &mut gm.fc2, th);
            let mut dact = vec![F::zero(); rows * hid];
            linear_dx(&dr, &mp.fc2, rows, dm, hid, &mut dact, false, th);
            let mut dvg = vec![F::zero(); rows * 2 * hid];
            for ((dv, v), da) in dvg
                .chunks_mut(2 * hid)
                .zip(ms.vg.chunks(2 * hid))
                .zip(dact.chunks(hid))
            {
                for i in 0..hid {
                    dv[i] = da[i] * silu(v[hid + i]);
                    dv[hid + i] = da[i] * v[i] * silu_grad(v[hid + i]);
                }
            }
            linear_dw(&dvg, &ms.n2, rows, 2 * hid, dm, &mut gm.fc1, th);
            linear_dx(&dvg, &mp.fc1, rows, 2 * hid, dm, &mut dn, false, th);
            norm_rows_bwd(&ms.r_mid, &mp.norm, &ms.rn2, &dn, &mut dr, &mut gm.norm);
        }
        linear_dw(&dr, s.mixer.o(), rows, dm, d.d_inner, &mut gl.out_proj, th);
        linear_dx(&dr, &lp.out_proj, rows, dm, d.d_inner, &mut d_o, false, th);
        mixer.backward(lp, &s.proj, &s.mixer, &d_o, &mut dproj, gl);
        linear_dw(&dproj, &s.n, rows, d.d_in_proj, dm, &mut gl.in_proj, th);
        linear_dx(
            &dproj,
            &lp.in_proj,
            rows,
            d.d_in_proj,
            dm,
            &mut dn,
            false,
            th,
        );
        norm_rows_bwd(&s.r_in, &lp.norm, &s.rn, &dn, &mut dr, &mut gl.norm);
        ready.ready(Stage::Layer(l), g)?;
    }
    for (row, &t) in dr.chunks(dm).zip(&batch.inputs) {
        let e = &mut g.embedding[t as usize * dm..(t as usize + 1) * dm];
        e.iter_mut().zip(row).for_each(|(a, &b)| *a = *a + b);
    }
    ready.ready(Stage::Embedding, g)?;
    Ok(loss)
}
