//! One tensor as a checkpoint file holds it ([`RawTensor`]: dtype, shape, contiguous
//! little-endian bytes), whichever reader produced it (safetensors or `pytorch_model.bin`).

use crate::error::{Error, Result};
use crate::model::dtype::{DType, TensorData};
use std::borrow::Cow;

/// What a tensor holds on disk. Float types are what weights use; integer types appear in
/// token-id files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiskDType {
    Float(DType),
    I64,
    I32,
    I16,
    U16,
    U32,
    I8,
    U8,
    Bool,
    Other,
}

impl DiskDType {
    pub fn size(self) -> usize {
        match self {
            DiskDType::Float(d) => d.size(),
            DiskDType::I64 => 8,
            DiskDType::I32 | DiskDType::U32 => 4,
            DiskDType::I16 | DiskDType::U16 => 2,
            DiskDType::I8 | DiskDType::U8 | DiskDType::Bool => 1,
            DiskDType::Other => 0,
        }
    }
}

impl std::fmt::Display for DiskDType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DiskDType::Float(d) => write!(f, "{d}"),
            other => write!(f, "{}", format!("{other:?}").to_lowercase()),
        }
    }
}

/// One tensor read from a file: contiguous little-endian bytes.
#[derive(Clone, Debug)]
pub struct RawTensor<'a> {
    pub dtype: DiskDType,
    pub shape: Vec<usize>,
    pub bytes: Cow<'a, [u8]>,
}

impl RawTensor<'_> {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Element `i` of a float tensor, as f64 (none for other dtypes or out of range).
    pub fn float_at(&self, i: usize) -> Option<f64> {
        let DiskDType::Float(d) = self.dtype else {
            return None;
        };
        let b = self.bytes.get(i * d.size()..(i + 1) * d.size())?;
        Some(match d {
            DType::F32 => f32::from_le_bytes(b.try_into().ok()?) as f64,
            DType::BF16 => half::bf16::from_bits(u16::from_le_bytes(b.try_into().ok()?)).to_f64(),
            DType::F16 => half::f16::from_bits(u16::from_le_bytes(b.try_into().ok()?)).to_f64(),
            DType::F64 => f64::from_le_bytes(b.try_into().ok()?),
        })
    }

    /// The elements as floats in `dtype`; an error if the tensor is not a float tensor.
    pub fn to_float(&self, name: &str, dtype: DType) -> Result<TensorData> {
        match self.dtype {
            DiskDType::Float(d) => TensorData::decode(&self.bytes, d, dtype),
            other => Err(Error::Tensor {
                name: name.into(),
                expected: "a float tensor (f32, bf16, f16 or f64)".into(),
                found: format!("dtype {other}"),
            }),
        }
    }
    /// The elements as integers; an error for float tensors.
    pub fn to_i64(&self, name: &str) -> Result<Vec<i64>> {
        let b = &self.bytes;
        let n = self.numel();
        let get = |sz: usize, f: &dyn Fn(&[u8]) -> i64| -> Vec<i64> {
            (0..n).map(|i| f(&b[i * sz..(i + 1) * sz])).collect()
        };
        Ok(match self.dtype {
            DiskDType::I64 => get(8, &|c| i64::from_le_bytes(c.try_into().unwrap())),
            DiskDType::I32 => get(4, &|c| i32::from_le_bytes(c.try_into().unwrap()) as i64),
            DiskDType::U32 => get(4, &|c| u32::from_le_bytes(c.try_into().unwrap()) as i64),
            DiskDType::I16 => get(2, &|c| i16::from_le_bytes(c.try_into().unwrap()) as i64),
            DiskDType::U16 => get(2, &|c| u16::from_le_bytes(c.try_into().unwrap()) as i64),
            DiskDType::I8 => get(1, &|c| c[0] as i8 as i64),
            DiskDType::U8 | DiskDType::Bool => get(1, &|c| c[0] as i64),
            other => {
                return Err(Error::Tensor {
                    name: name.into(),
                    expected: "an integer tensor".into(),
                    found: format!("dtype {other}"),
                })
            }
        })
    }
}

impl RawTensor<'static> {
    pub fn from_f32(shape: Vec<usize>, values: &[f32]) -> Self {
        RawTensor {
            dtype: DiskDType::Float(DType::F32),
            shape,
            bytes: Cow::Owned(bytemuck::cast_slice(values).to_vec()),
        }
    }
    pub fn from_data(shape: Vec<usize>, data: &TensorData) -> Self {
        RawTensor {
            dtype: DiskDType::Float(data.dtype()),
            shape,
            bytes: Cow::Owned(data.as_bytes().to_vec()),
        }
    }
    pub fn from_i64(shape: Vec<usize>, values: &[i64]) -> Self {
        RawTensor {
            dtype: DiskDType::I64,
            shape,
            bytes: Cow::Owned(bytemuck::cast_slice(values).to_vec()),
        }
    }
}
