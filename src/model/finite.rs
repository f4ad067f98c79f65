//! The check that numbers read from files (weights, saved states) are finite: a NaN or an
//! infinity would otherwise run silently through every token and come out as garbage.
//!
//! The scan reads each value's exponent bits (all set = NaN or infinite) and folds them
//! without an early exit per block, so the compiler vectorises it; it runs at memory
//! speed (docs/reliability.md has the measured cost).

use crate::error::{Error, Result};
use crate::model::dtype::TensorData;

const BLOCK: usize = 4096;

/// The index of the first non-finite value of `bits` (values as raw bits: a value is
/// non-finite when `bits & mask == mask`).
fn first_bad<T: Copy + Into<u64>>(bits: &[T], mask: u64) -> Option<usize> {
    for (b, block) in bits.chunks(BLOCK).enumerate() {
        let any = block
            .iter()
            .fold(false, |acc, &x| acc | (x.into() & mask == mask));
        if any {
            let i = block.iter().position(|&x| x.into() & mask == mask)?;
            return Some(b * BLOCK + i);
        }
    }
    None
}

/// The first non-finite value of `data`: (index, value).
pub fn first_non_finite(data: &TensorData) -> Option<(usize, f64)> {
    let i = match data {
        TensorData::F32(v) => first_bad(bytemuck::cast_slice::<f32, u32>(v), 0x7f80_0000),
        TensorData::BF16(v) => first_bad(bytemuck::cast_slice::<_, u16>(v), 0x7f80),
        TensorData::F16(v) => first_bad(bytemuck::cast_slice::<_, u16>(v), 0x7c00),
        TensorData::F64(v) => first_bad(bytemuck::cast_slice::<f64, u64>(v), 0x7ff0 << 48),
    }?;
    Some((i, data.get_f64(i)))
}

/// Refuse a tensor holding a NaN or an infinity, naming it and the first such element.
pub fn check_tensor(name: &str, data: &TensorData) -> Result<()> {
    match first_non_finite(data) {
        None => Ok(()),
        Some((i, v)) => Err(Error::NonFinite(format!(
            "tensor `{name}` holds {v} at element {i} (of {}, as {}): expected finite values; \
             the file is corrupt, the model diverged in training, or a value is beyond the \
             range of the dtype asked for",
            data.len(),
            data.dtype()
        ))),
    }
}

/// [`check_tensor`] for f32 values.
pub fn check_f32(name: &str, values: &[f32]) -> Result<()> {
    match first_bad(bytemuck::cast_slice::<f32, u32>(values), 0x7f80_0000) {
        None => Ok(()),
        Some(i) => Err(Error::NonFinite(format!(
            "tensor `{name}` holds {} at element {i} (of {}): expected finite values",
            values[i],
            values.len()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    #[test]
    fn finds_every_kind_of_non_finite_value_in_every_dtype() {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for at in [0usize, 1, 4095, 4096, 9999] {
                let mut v = vec![1.5f32; 10_000];
                v[at] = bad;
                let f = |d: TensorData| first_non_finite(&d).map(|(i, _)| i);
                assert_eq!(f(TensorData::F32(v.clone())), Some(at));
                let b: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
                assert_eq!(f(TensorData::BF16(b)), Some(at));
                let h: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
                assert_eq!(f(TensorData::F16(h)), Some(at));
                let d: Vec<f64> = v.iter().map(|&x| x as f64).collect();
                assert_eq!(f(TensorData::F64(d)), Some(at));
            }
        }
        // The largest finite values and subnormals are finite.
        let ok = TensorData::F32(vec![f32::MAX, f32::MIN, 1e-45, 0.0, -0.0]);
        assert_eq!(first_non_finite(&ok), None);
        let ok = TensorData::F16(vec![f16::MAX, f16::MIN, f16::from_f32(6e-8)]);
        assert_eq!(first_non_finite(&ok), None);
        let e = check_tensor("x.weight", &TensorData::F32(vec![0.0, f32::NAN])).unwrap_err();
        assert!(e.to_string().contains("`x.weight`") && e.to_string().contains("element 1"));
    }
}
