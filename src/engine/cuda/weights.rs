//! A model's parameters on the device: matrices in the model dtype, vectors in f32 (as in
//! `model::weights`). For bf16/f16 models the in_proj GEMM of a prefill also gets a weight
//! matched to its input (see [`InProjInput`]).

use crate::cuda::context::{DevBuf, Gpu};
use crate::error::{Error, Result};
use crate::mixers::mamba3::{LayerWeights, Weights};
use crate::model::weights::Matrix;
use crate::model::{DType, Element};

/// How the normed residual enters the in_proj GEMM of a 16-bit model. The input's rounding
/// costs more accuracy than any other activation's (docs/decisions.md, "bf16 mode: which activations are rounded"), so it is not
/// rounded to bf16 unless asked (`fast`).
pub enum InProjInput {
    /// f16 input (rounding error 2⁻¹¹ instead of bf16's 2⁻⁸) against an f16 copy of the
    /// weights (bf16 → f16 is exact above 2⁻¹⁴ and within 2⁻²⁵ below). Used when the normed
    /// input is sure to stay inside f16's range: |rmsnorm(x)ᵢ·wᵢ| ≤ √d_model·max|w|.
    F16(DevBuf),
    /// f32 input split into hi + lo halves in the model dtype (~2⁻¹⁶), against `[W | W]`:
    /// for models whose norm weights could overflow f16.
    Split(DevBuf),
}

impl InProjInput {
    pub fn kind(&self) -> InProjKind {
        match self {
            InProjInput::F16(_) => InProjKind::F16,
            InProjInput::Split(_) => InProjKind::Split,
        }
    }
}

/// Which [`InProjInput`] a model gets, known from the host weights before any upload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InProjKind {
    F16,
    Split,
}

/// The in_proj input of a 16-bit model's layers (`None` for f32 models): f16 when the
/// normed input is sure to stay inside f16's range, |rmsnorm(x)ᵢ·wᵢ| ≤ √d_model·max|w|.
pub fn in_proj_kind(w: &Weights) -> Option<InProjKind> {
    if w.dtype == DType::F32 {
        return None;
    }
    use rayon::prelude::*;
    let bound = (w.dims.d_model as f64).sqrt();
    let fits = w.layers.par_iter().all(|l| {
        let wmax = max_abs(&l.norm);
        let inmax = l.in_proj.data.max_abs();
        bound * wmax < F16_SAFE && inmax < F16_SAFE
    });
    Some(if fits {
        InProjKind::F16
    } else {
        InProjKind::Split
    })
}

/// Whether a prefill may write the in_proj output in f16 (`PROJ_F16` of the kernels): a
/// 16-bit model whose every output stays well inside f16's range whatever the input. Row i
/// of the output is ⟨W_i, rmsnorm(x) ⊙ w⟩, and rmsnorm(x) has 2-norm at most √d_model, so
/// |out_i| ≤ |W_i|₂·max|w|·√d_model. (f16 rounds the output by 2⁻¹¹ relative, against the
/// f32 accumulation; docs/decisions.md, "in_proj output in f16", says what it costs in accuracy and buys in time.)
/// `MAMBA3_GPU_PROJ_F16=0` keeps f32, a diagnostic for A/B runs.
pub fn proj_f16(w: &Weights) -> bool {
    if w.dtype == DType::F32 || !crate::options::env().proj_f16 {
        return false;
    }
    use rayon::prelude::*;
    let root_d = (w.dims.d_model as f64).sqrt();
    w.layers.par_iter().all(|l| {
        let m = &l.in_proj;
        let widest = crate::with_data!(&m.data, v => v
            .chunks(m.cols.max(1))
            .map(|row| row.iter().map(|x| x.to_f64() * x.to_f64()).sum::<f64>())
            .fold(0f64, f64::max))
        .sqrt();
        widest * max_abs(&l.norm) * root_d < F16_SAFE
    })
}

/// The largest |v| (0 for an empty vector).
fn max_abs(v: &[f32]) -> f64 {
    v.iter().fold(0f64, |m, &x| m.max((x as f64).abs()))
}

/// Largest normed value allowed on the f16 path (half of f16's maximum, for margin).
pub(crate) const F16_SAFE: f64 = 32752.0;

/// The in_proj input of a 16-bit model (`None` for f32 models) of kind `kind`.
fn in_proj_input(
    gpu: &Gpu,
    w: &Weights,
    kind: Option<InProjKind>,
) -> Result<Option<Vec<InProjInput>>> {
    let Some(kind) = kind else {
        return Ok(None);
    };
    use rayon::prelude::*;
    // Layers in parallel: the host side (a converted or doubled copy of every in_proj
    // weight) is long on one thread, and each copy goes up as soon as it is made
    // (`Gpu::upload` binds the context on the calling thread; the order is kept).
    let out = w
        .layers
        .par_iter()
        .map(|l| {
            Ok(if kind == InProjKind::F16 {
                InProjInput::F16(gpu.upload(l.in_proj.data.convert(DType::F16).as_bytes())?)
            } else {
                let row = l.in_proj.cols * w.dtype.size();
                let src = l.in_proj.data.as_bytes();
                let mut twice = Vec::with_capacity(src.len() * 2);
                for r in src.chunks(row) {
                    twice.extend_from_slice(r);
                    twice.extend_from_slice(r);
                }
                InProjInput::Split(gpu.upload(&twice)?)
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Some(out))
}

/// Whether the scan may take f16 operands: a 16-bit model whose scan operands fit
/// (`scan_operands_fit_f16`). Decided from the host weights, before any upload.
pub fn scan_f16(w: &Weights) -> bool {
    w.dtype != DType::F32 && scan_operands_fit_f16(w)
}

/// Whether the scan's q̃ and k̃ (spec §2.5: RMS-normed B, C times their norm weights, plus
/// the biases, rotated) stay below 2¹⁴ whatever the input, so that a 16-bit model's scan
/// may take f16 operands (kernels/scan.cu scales the data-dependent ones itself): a normed
/// entry is at most √d_state·max|w|, and a rotation mixes two entries, ×√2.
fn scan_operands_fit_f16(w: &Weights) -> bool {
    let root_n = (w.dims.d_state as f64).sqrt();
    w.layers.iter().all(|l| {
        let b = std::f64::consts::SQRT_2 * (root_n * max_abs(&l.b_norm) + max_abs(&l.b_bias));
        let c = std::f64::consts::SQRT_2 * (root_n * max_abs(&l.c_norm) + max_abs(&l.c_bias));
        b < 16384.0 && c < 16384.0
    })
}

/// A bound on |⟨q̃, k̃⟩| for a layer's scan: the RMS-normed B (or C) row has 2-norm ≤ √N,
/// so with its weights and biases |k̃|₂ ≤ √N·(max|w| + max|bias|) (a rotation keeps the
/// norm), and the product is at most N times both factors.
fn scan_qk(d_state: usize, l: &LayerWeights) -> f32 {
    let b = max_abs(&l.b_norm) + max_abs(&l.b_bias);
    let c = max_abs(&l.c_norm) + max_abs(&l.c_bias);
    (d_state as f64 * b * c) as f32
}

pub struct GpuMlp {
    pub norm: DevBuf,
    pub fc1: DevBuf,
    pub fc2: DevBuf,
}

pub struct GpuLayer {
    pub norm: DevBuf,
    pub in_proj: DevBuf,
    /// 16-bit models: the prefill in_proj's input and weight
    pub in_proj_input: Option<InProjInput>,
    pub dt_bias: DevBuf,
    pub b_bias: DevBuf,
    pub c_bias: DevBuf,
    pub b_norm: DevBuf,
    pub c_norm: DevBuf,
    pub d: DevBuf,
    pub out_norm: Option<DevBuf>,
    /// a bound on |⟨q̃, k̃⟩| over the layer's heads (`scan_qk`)
    pub scan_qk: f32,
    pub out_proj: DevBuf,
    pub mlp: Option<GpuMlp>,
}

pub struct GpuWeights {
    pub embedding: DevBuf,
    pub layers: Vec<GpuLayer>,
    pub norm_f: DevBuf,
    /// `None`: the head is the embedding.
    pub lm_head: Option<DevBuf>,
    /// 16-bit models: every layer's parameter addresses, `LayerW` of
    /// kernels/decode_layers.cu (13 per layer; 0 for what the layer lacks)
    pub layer_table: Option<DevBuf>,
    pub bytes: usize,
}

/// The addresses of each layer's parameters in the order of `LayerW`
/// (kernels/decode_layers.cu): norm, in_proj, the mixer's b_norm, c_norm, dt_bias, b_bias,
/// c_bias, D, out_norm, then out_proj and the MLP's norm, fc1, fc2.
fn layer_table(layers: &[GpuLayer]) -> Vec<u64> {
    let opt = |b: Option<&DevBuf>| b.map_or(0, |b| b.ptr);
    layers
        .iter()
        .flat_map(|l| {
            let m = l.mlp.as_ref();
            [
                l.norm.ptr,
                l.in_proj.ptr,
                l.b_norm.ptr,
                l.c_norm.ptr,
                l.dt_bias.ptr,
                l.b_bias.ptr,
                l.c_bias.ptr,
                l.d.ptr,
                opt(l.out_norm.as_ref()),
                l.out_proj.ptr,
                opt(m.map(|m| &m.norm)),
                opt(m.map(|m| &m.fc1)),
                opt(m.map(|m| &m.fc2)),
            ]
        })
        .collect()
}

impl GpuWeights {
    /// `w` on the device; `input` is `in_proj_kind(w)`, which the caller needs before the
    /// upload ends (for the warm-up).
    pub fn upload(gpu: &Gpu, w: &Weights, input: Option<InProjKind>) -> Result<GpuWeights> {
        if w.dtype == DType::F64 {
            return Err(Error::Device(
                "the GPU runs f32, bf16 or f16 models, not f64".into(),
            ));
        }
        let mut bytes = 0usize;
        let mut mat = |m: &Matrix| -> Result<DevBuf> {
            let b = gpu.upload(m.data.as_bytes())?;
            bytes += b.bytes;
            Ok(b)
        };
        let vec = |v: &[f32]| gpu.upload(v);
        let mut layers = Vec::with_capacity(w.layers.len());
        let mut inputs = in_proj_input(gpu, w, input)?.map(|v| v.into_iter());
        crate::timeline::mark(|| "in_proj input weights prepared and queued".into());
        let mut input_bytes = 0;
        for l in &w.layers {
            let input = inputs.as_mut().and_then(|it| it.next());
            if let Some(InProjInput::F16(b) | InProjInput::Split(b)) = &input {
                input_bytes += b.bytes;
            }
            layers.push(GpuLayer {
                norm: vec(&l.norm)?,
                in_proj: mat(&l.in_proj)?,
                in_proj_input: input,
                dt_bias: vec(&l.dt_bias)?,
                b_bias: vec(&l.b_bias)?,
                c_bias: vec(&l.c_bias)?,
                b_norm: vec(&l.b_norm)?,
                c_norm: vec(&l.c_norm)?,
                d: vec(&l.d)?,
                out_norm: l.out_norm.as_deref().map(vec).transpose()?,
                scan_qk: scan_qk(w.dims.d_state, l),
                out_proj: mat(&l.out_proj)?,
                mlp: match &l.mlp {
                    Some(m) => Some(GpuMlp {
                        norm: vec(&m.norm)?,
                        fc1: mat(&m.fc1)?,
                        fc2: mat(&m.fc2)?,
                    }),
                    None => None,
                },
            });
        }
        let embedding = mat(&w.embedding)?;
        let lm_head = w.lm_head.as_ref().map(&mut mat).transpose()?;
        let layer_table = match w.dtype {
            DType::F32 => None,
            _ => Some(gpu.upload(&layer_table(&layers))?),
        };
        let norm_f = gpu.upload(&w.norm_f)?;
        Ok(GpuWeights {
            embedding,
            norm_f,
            lm_head,
            layer_table,
            layers,
            bytes: bytes + input_bytes,
        })
    }

    pub fn head(&self) -> &DevBuf {
        self.lm_head.as_ref().unwrap_or(&self.embedding)
    }
}

#[cfg(test)]
mod tests {
    use super::proj_f16;
    use crate::mixers::mamba3::Weights;
    use crate::model::{Config, DType, TensorData};

    #[test]
    fn the_in_proj_output_is_f16_only_for_16_bit_models_whose_range_fits() {
        let cfg = Config::synthetic(64, 2, 16, 16, 2, 1, 300);
        assert!(proj_f16(
            &Weights::synthetic(cfg.clone(), DType::BF16, 1).unwrap()
        ));
        assert!(proj_f16(
            &Weights::synthetic(cfg.clone(), DType::F16, 1).unwrap()
        ));
        assert!(!proj_f16(
            &Weights::synthetic(cfg.clone(), DType::F32, 1).unwrap()
        ));
        // one row of one layer's in_proj scaled until |W_i|₂·max|w|·√d_model passes 32752
        let mut w = Weights::synthetic(cfg, DType::BF16, 1).unwrap();
        let norm_max = super::max_abs(&w.layers[1].norm);
        let root_d = (w.dims.d_model as f64).sqrt();
        let m = &mut w.layers[1].in_proj;
        let mut v = m.data.to_f32_vec();
        let row: f64 = v[..m.cols]
            .iter()
            .map(|x| (*x as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        let over = 40_000.0 / (row * norm_max * root_d);
        for x in &mut v[..m.cols] {
            *x *= over as f32;
        }
        m.data = TensorData::F32(v).convert(DType::BF16);
        assert!(!proj_f16(&w));
    }
}
