//! `MAMBA3_GPU_DEBUG=1`: after each step of a pass, wait for the GPU and check that what
//! the step wrote holds only finite numbers. The first non-finite value is reported as an
//! error naming the step, the layer, the row and the column, so a bad kernel is found by
//! one run instead of by bisection. Off by default (it synchronises after every step).

use super::context::Gpu;
use crate::error::{Error, Result};
use crate::model::DType;

/// Whether probing is on for this process.
pub fn enabled() -> bool {
    crate::options::env().gpu_debug
}

/// A matrix on the device to check: `rows × cols` elements, rows `ld` elements apart,
/// of `dtype` (f32, or the activation dtype).
pub struct Region {
    pub ptr: u64,
    pub rows: usize,
    pub cols: usize,
    pub ld: usize,
    pub dtype: DType,
}

/// Check `r`; `what` and `layer` name it in the error.
pub fn check(gpu: &Gpu, what: &str, layer: Option<usize>, r: Region) -> Result<()> {
    if r.rows == 0 || r.cols == 0 {
        return Ok(());
    }
    let n = (r.rows - 1) * r.ld + r.cols;
    let vals: Vec<f32> = match r.dtype {
        DType::BF16 | DType::F16 => {
            let mut raw = vec![0u16; n];
            gpu.dtoh(r.ptr, &mut raw)?;
            raw.iter()
                .map(|&b| match r.dtype {
                    DType::BF16 => half::bf16::from_bits(b).to_f32(),
                    _ => half::f16::from_bits(b).to_f32(),
                })
                .collect()
        }
        _ => {
            let mut v = vec![0f32; n];
            gpu.dtoh(r.ptr, &mut v)?;
            v
        }
    };
    for row in 0..r.rows {
        for col in 0..r.cols {
            let v = vals[row * r.ld + col];
            if !v.is_finite() {
                let at = layer.map_or(String::new(), |l| format!(" of layer {l}"));
                return Err(Error::Device(format!(
                    "MAMBA3_GPU_DEBUG: {what}{at} holds {v} at row {row}, column {col} \
                     ({} × {} checked)",
                    r.rows, r.cols
                )));
            }
        }
    }
    Ok(())
}
