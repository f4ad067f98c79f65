//! Element types of weights and activations, and the conversions between them.
//!
//! Storage dtypes are f32, bf16 and f16 (what checkpoints hold and what users pick);
//! f64 exists for the CPU oracle and tests. Arithmetic always happens in f32 or f64;
//! the narrow types are only ever rounded *to* at the points the official model rounds.

use crate::error::{Error, Result};
use half::{bf16, f16};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
    F16,
    F64,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::F64 => 8,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F64 => "f64",
        }
    }
    /// Round an f64 value to this dtype and back (the identity for f64).
    #[inline]
    pub fn round(self, x: f64) -> f64 {
        match self {
            DType::F32 => x as f32 as f64,
            DType::BF16 => bf16::from_f64(x).to_f64(),
            DType::F16 => f16::from_f64(x).to_f64(),
            DType::F64 => x,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" | "fp32" => Ok(DType::F32),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            "f16" | "float16" | "fp16" | "half" => Ok(DType::F16),
            "f64" | "float64" | "fp64" => Ok(DType::F64),
            _ => Err(Error::input(format!(
                "unknown dtype `{s}`: expected one of f32, bf16, f16, f64"
            ))),
        }
    }
}

/// A storage element: anything a weight matrix can be held in.
pub trait Element: Copy + Send + Sync + Default + 'static + bytemuck::Pod {
    const DTYPE: DType;
    fn to_f32(self) -> f32;
    fn to_f64(self) -> f64;
    fn from_f32(x: f32) -> Self;
    fn from_f64(x: f64) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self as f64
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline(always)]
    fn from_f64(x: f64) -> Self {
        x as f32
    }
}

impl Element for f64 {
    const DTYPE: DType = DType::F64;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self as f32
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x as f64
    }
    #[inline(always)]
    fn from_f64(x: f64) -> Self {
        x
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        // bf16 is the top half of an f32: widening is a shift.
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self.to_f32() as f64
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    #[inline(always)]
    fn from_f64(x: f64) -> Self {
        bf16::from_f64(x)
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    #[inline(always)]
    fn from_f64(x: f64) -> Self {
        f16::from_f64(x)
    }
}

/// Owned, typed storage of one tensor's elements (row-major).
#[derive(Clone, Debug, PartialEq)]
pub enum TensorData {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
    F64(Vec<f64>),
}

/// Calls `$body` with `$v` bound to the typed vector inside a `TensorData`.
#[macro_export]
macro_rules! with_data {
    ($data:expr, $v:ident => $body:expr) => {
        match $data {
            $crate::model::dtype::TensorData::F32($v) => $body,
            $crate::model::dtype::TensorData::BF16($v) => $body,
            $crate::model::dtype::TensorData::F16($v) => $body,
            $crate::model::dtype::TensorData::F64($v) => $body,
        }
    };
}

impl TensorData {
    pub fn dtype(&self) -> DType {
        match self {
            TensorData::F32(_) => DType::F32,
            TensorData::BF16(_) => DType::BF16,
            TensorData::F16(_) => DType::F16,
            TensorData::F64(_) => DType::F64,
        }
    }
    pub fn len(&self) -> usize {
        with_data!(self, v => v.len())
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Build from f32 values, rounding to `dtype`.
    pub fn from_f32(values: &[f32], dtype: DType) -> Self {
        Self::from_fn(values.len(), dtype, |i| values[i] as f64)
    }
    pub fn from_fn(n: usize, dtype: DType, f: impl Fn(usize) -> f64) -> Self {
        match dtype {
            DType::F32 => TensorData::F32((0..n).map(|i| f(i) as f32).collect()),
            DType::BF16 => TensorData::BF16((0..n).map(|i| bf16::from_f64(f(i))).collect()),
            DType::F16 => TensorData::F16((0..n).map(|i| f16::from_f64(f(i))).collect()),
            DType::F64 => TensorData::F64((0..n).map(&f).collect()),
        }
    }
    pub fn get_f64(&self, i: usize) -> f64 {
        with_data!(self, v => v[i].to_f64())
    }
    pub fn to_f32_vec(&self) -> Vec<f32> {
        with_data!(self, v => v.iter().map(|x| x.to_f32()).collect())
    }
    pub fn to_f64_vec(&self) -> Vec<f64> {
        with_data!(self, v => v.iter().map(|x| x.to_f64()).collect())
    }
    /// Convert to another dtype (a copy; rounding to nearest even, once). Large tensors are
    /// converted on all cores: this is most of the time a checkpoint takes to load.
    pub fn convert(&self, dtype: DType) -> TensorData {
        if self.dtype() == dtype {
            return self.clone();
        }
        with_data!(self, v => convert_slice(v, dtype))
    }

    /// The largest absolute value (0 for an empty tensor).
    pub fn max_abs(&self) -> f64 {
        with_data!(self, v => v.iter().fold(0f64, |m, x| m.max(x.to_f64().abs())))
    }
    pub fn as_bytes(&self) -> &[u8] {
        with_data!(self, v => bytemuck::cast_slice(v.as_slice()))
    }
    /// Decode little-endian bytes of `disk` straight into `dtype` (one copy when the bytes
    /// are aligned for their type, as in a memory-mapped safetensors file).
    pub fn decode(bytes: &[u8], disk: DType, dtype: DType) -> Result<Self> {
        fn cast<T: bytemuck::Pod>(b: &[u8]) -> Option<&[T]> {
            bytemuck::try_cast_slice(b).ok()
        }
        if disk != dtype && cfg!(target_endian = "little") {
            let direct = match disk {
                DType::F32 => cast::<f32>(bytes).map(|v| convert_slice(v, dtype)),
                DType::BF16 => cast::<bf16>(bytes).map(|v| convert_slice(v, dtype)),
                DType::F16 => cast::<f16>(bytes).map(|v| convert_slice(v, dtype)),
                DType::F64 => cast::<f64>(bytes).map(|v| convert_slice(v, dtype)),
            };
            if let Some(d) = direct {
                return Ok(d);
            }
        }
        Ok(Self::from_le_bytes(bytes, disk)?.convert(dtype))
    }

    /// Decode little-endian bytes of `dtype` into owned storage.
    pub fn from_le_bytes(bytes: &[u8], dtype: DType) -> Result<Self> {
        if !bytes.len().is_multiple_of(dtype.size()) {
            return Err(Error::Other(format!(
                "{} bytes is not a whole number of {} elements",
                bytes.len(),
                dtype
            )));
        }
        fn read<T: bytemuck::Pod>(b: &[u8]) -> Vec<T> {
            // pod_collect_to_vec copies, so unaligned input (an mmap offset) is fine.
            bytemuck::pod_collect_to_vec(b)
        }
        Ok(match dtype {
            DType::F32 => TensorData::F32(read(bytes)),
            DType::BF16 => TensorData::BF16(read(bytes)),
            DType::F16 => TensorData::F16(read(bytes)),
            DType::F64 => TensorData::F64(read(bytes)),
        })
    }
}

/// `src` converted to `dtype`, rounding to nearest even once (every narrower type widens
/// to f32 exactly; f64 rounds directly). Large tensors are converted on all cores: this is
/// most of the time a checkpoint takes to load.
fn convert_slice<S: Element>(src: &[S], dtype: DType) -> TensorData {
    fn map<S: Element, D: Element>(src: &[S], f: impl Fn(S) -> D + Sync) -> Vec<D> {
        use rayon::prelude::*;
        let mut out = vec![D::default(); src.len()];
        out.par_chunks_mut(1 << 16)
            .zip(src.par_chunks(1 << 16))
            .for_each(|(o, s)| o.iter_mut().zip(s).for_each(|(o, &x)| *o = f(x)));
        out
    }
    match (S::DTYPE, dtype) {
        (DType::F64, DType::BF16) => TensorData::BF16(map(src, |x| bf16::from_f64(x.to_f64()))),
        (DType::F64, DType::F16) => TensorData::F16(map(src, |x| f16::from_f64(x.to_f64()))),
        (_, DType::F64) => TensorData::F64(map(src, |x| x.to_f64())),
        (_, DType::F32) => TensorData::F32(map(src, |x| x.to_f32())),
        (_, DType::BF16) => TensorData::BF16(map(src, |x| bf16::from_f32(x.to_f32()))),
        (_, DType::F16) => TensorData::F16(map(src, |x| f16::from_f32(x.to_f32()))),
    }
}
