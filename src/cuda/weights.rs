//! A model's parameters on the device: matrices in the model dtype, vectors in f32 (as in
//! `model::weights`). For bf16/f16 models `in_proj` is also kept as `[W | W]` (each row
//! twice), the weight of the split-activation GEMM (see kernels/dense.cu `rms_norm_rows`).

use super::context::{DevBuf, Gpu};
use crate::error::{Error, Result};
use crate::model::weights::Matrix;
use crate::model::{DType, Weights};

pub struct GpuMlp {
    pub norm: DevBuf,
    pub fc1: DevBuf,
    pub fc2: DevBuf,
}

pub struct GpuLayer {
    pub norm: DevBuf,
    pub in_proj: DevBuf,
    pub in_proj_split: Option<DevBuf>,
    pub dt_bias: DevBuf,
    pub b_bias: DevBuf,
    pub c_bias: DevBuf,
    pub b_norm: DevBuf,
    pub c_norm: DevBuf,
    pub d: DevBuf,
    pub out_norm: Option<DevBuf>,
    pub out_proj: DevBuf,
    pub mlp: Option<GpuMlp>,
}

pub struct GpuWeights {
    pub embedding: DevBuf,
    pub layers: Vec<GpuLayer>,
    pub norm_f: DevBuf,
    /// `None`: the head is the embedding.
    pub lm_head: Option<DevBuf>,
    pub bytes: usize,
}

impl GpuWeights {
    pub fn upload(gpu: &Gpu, w: &Weights) -> Result<GpuWeights> {
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
        for l in &w.layers {
            let split = if w.dtype != DType::F32 {
                let row = l.in_proj.cols * w.dtype.size();
                let src = l.in_proj.data.as_bytes();
                let mut twice = Vec::with_capacity(src.len() * 2);
                for r in src.chunks(row) {
                    twice.extend_from_slice(r);
                    twice.extend_from_slice(r);
                }
                Some(gpu.upload(&twice)?)
            } else {
                None
            };
            layers.push(GpuLayer {
                norm: vec(&l.norm)?,
                in_proj: mat(&l.in_proj)?,
                in_proj_split: split,
                dt_bias: vec(&l.dt_bias)?,
                b_bias: vec(&l.b_bias)?,
                c_bias: vec(&l.c_bias)?,
                b_norm: vec(&l.b_norm)?,
                c_norm: vec(&l.c_norm)?,
                d: vec(&l.d)?,
                out_norm: l.out_norm.as_deref().map(vec).transpose()?,
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
        Ok(GpuWeights {
            embedding: mat(&w.embedding)?,
            norm_f: vec(&w.norm_f)?,
            lm_head: w.lm_head.as_ref().map(&mut mat).transpose()?,
            layers,
            bytes,
        })
    }

    pub fn head(&self) -> &DevBuf {
        self.lm_head.as_ref().unwrap_or(&self.embedding)
    }
}
