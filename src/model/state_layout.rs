//! The shape of one sequence's recurrent state, whatever the mixer: per layer, a list of
//! named tensors (Mamba-3: `angle`, `ssm`, `k`, `v`; Mamba-1/2: `conv`, `ssm`), and a
//! flat buffer holding them layer after layer in that order.
//!
//! Each tensor has a storage dtype: f32, except `ssm` under `--state-dtype bf16|f16`
//! ([`StateLayout::with_state_dtype`]). The arithmetic is f32 whatever it is stored in. The
//! host buffer ([`StateBuf`]) keeps f32 elements (16-bit values widened, which is exact);
//! a device keeps each tensor in its own dtype, at the byte offsets of
//! [`StateLayout::byte_offset_in_layer`], and converts on the way ([`StateLayout::to_bytes`],
//! [`StateLayout::from_bytes`]) — a 16-bit state moved to the host and back is unchanged.
//!
//! The mixer says what its layout is (`crate::mixers::state_layout`); everything that moves
//! states around without computing with them — snapshots, state files, the prefix cache,
//! uploads to a device — works on the flat buffer and the names, so it needs no change when
//! a mixer is added.

use crate::error::{Error, Result};
use crate::model::DType;
use half::{bf16, f16};

/// The tensor whose storage dtype `--state-dtype` picks: the large one of every mixer.
pub const SSM: &str = "ssm";

/// On a device a narrow tensor's bytes are padded to a multiple of this, so that the f32
/// tensors after it keep the 16-byte alignment they have in an all-f32 state (the kernels
/// read them as float4s). An all-f32 state has no padding: its device bytes are the host's.
pub const DEVICE_ALIGN: usize = 16;

/// One named tensor of a layer's state.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StateTensor {
    pub name: &'static str,
    pub shape: Vec<usize>,
    /// How it is stored: f32, bf16 or f16.
    pub dtype: DType,
}

impl StateTensor {
    /// An f32 tensor.
    pub fn new(name: &'static str, shape: &[usize]) -> StateTensor {
        StateTensor {
            name,
            shape: shape.to_vec(),
            dtype: DType::F32,
        }
    }
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }
    /// Bytes it takes on a device (a narrow tensor padded to [`DEVICE_ALIGN`]).
    pub fn device_bytes(&self) -> usize {
        match self.dtype {
            DType::F32 => self.len() * 4,
            d => (self.len() * d.size()).next_multiple_of(DEVICE_ALIGN),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Every layer's state tensors, in the order they are stored.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StateLayout {
    pub n_layer: usize,
    /// The tensors of one layer (every layer has the same).
    pub tensors: Vec<StateTensor>,
}

impl StateLayout {
    /// f32 elements of one layer.
    pub fn layer_len(&self) -> usize {
        self.tensors.iter().map(StateTensor::len).sum()
    }
    /// f32 elements of a whole sequence's state.
    pub fn len(&self) -> usize {
        self.n_layer * self.layer_len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Offset of tensor `i` inside a layer.
    pub fn offset_in_layer(&self, i: usize) -> usize {
        self.tensors[..i].iter().map(StateTensor::len).sum()
    }
    /// The name a state file gives tensor `i` of layer `l`: `state.{l}.{name}`.
    pub fn file_name(&self, l: usize, i: usize) -> String {
        format!("state.{l}.{}", self.tensors[i].name)
    }
    /// `"2 layers of angle [8, 4], ssm [8, 16, 32], …"`, for messages and file metadata
    /// (a tensor not stored in f32 names its dtype: `ssm [8, 16, 32] bf16`).
    pub fn describe(&self) -> String {
        let parts: Vec<String> = self
            .tensors
            .iter()
            .map(|t| match t.dtype {
                DType::F32 => format!("{} {:?}", t.name, t.shape),
                d => format!("{} {:?} {d}", t.name, t.shape),
            })
            .collect();
        format!("{} layers of {}", self.n_layer, parts.join(", "))
    }

    /// The same layout with the `ssm` tensor stored in `dtype` (f32, bf16 or f16).
    pub fn with_state_dtype(mut self, dtype: DType) -> Result<StateLayout> {
        check_state_dtype(dtype)?;
        for t in &mut self.tensors {
            if t.name == SSM {
                t.dtype = dtype;
            }
        }
        Ok(self)
    }
    /// The storage dtype of the `ssm` tensor (f32 when there is none).
    pub fn state_dtype(&self) -> DType {
        self.tensors
            .iter()
            .find(|t| t.name == SSM)
            .map_or(DType::F32, |t| t.dtype)
    }
    /// Whether some tensor is stored narrower than f32.
    pub fn is_narrow(&self) -> bool {
        self.tensors.iter().any(|t| t.dtype != DType::F32)
    }

    /// Byte offset of tensor `i` inside a layer on a device.
    pub fn byte_offset_in_layer(&self, i: usize) -> usize {
        self.tensors[..i]
            .iter()
            .map(StateTensor::device_bytes)
            .sum()
    }
    /// Bytes of one layer on a device.
    pub fn layer_bytes(&self) -> usize {
        self.tensors.iter().map(StateTensor::device_bytes).sum()
    }
    /// Bytes of a whole sequence's state on a device.
    pub fn device_bytes(&self) -> usize {
        self.n_layer * self.layer_bytes()
    }

    /// Round every narrow tensor of a host state to its dtype (round to nearest even), in
    /// place: what storing it would do. Values already representable are unchanged.
    pub fn round_host(&self, host: &mut StateBuf<f32>) {
        if !self.is_narrow() {
            return;
        }
        for layer in host.layers_mut() {
            for (i, t) in self.tensors.iter().enumerate() {
                let off = self.offset_in_layer(i);
                round_slice(t.dtype, &mut layer[off..off + t.len()]);
            }
        }
    }

    /// A host state's device bytes: each tensor converted to its dtype (round to nearest
    /// even), at its byte offset, padding zero.
    pub fn to_bytes(&self, host: &StateBuf<f32>) -> Vec<u8> {
        let mut out = vec![0u8; self.device_bytes()];
        let lb = self.layer_bytes();
        for l in 0..self.n_layer {
            let src = host.layer(l);
            for (i, t) in self.tensors.iter().enumerate() {
                let (off, at) = (
                    self.offset_in_layer(i),
                    l * lb + self.byte_offset_in_layer(i),
                );
                let vals = &src[off..off + t.len()];
                let dst = &mut out[at..at + t.len() * t.dtype.size()];
                match t.dtype {
                    DType::BF16 => put(dst, vals, |x| bf16::from_f32(x).to_bits().to_le_bytes()),
                    DType::F16 => put(dst, vals, |x| f16::from_f32(x).to_bits().to_le_bytes()),
                    _ => put(dst, vals, f32::to_le_bytes),
                }
            }
        }
        out
    }

    /// The host state of device bytes laid out as [`StateLayout::to_bytes`] writes them.
    pub fn from_bytes(&self, bytes: &[u8]) -> Result<StateBuf<f32>> {
        if bytes.len() != self.device_bytes() {
            return Err(Error::State(format!(
                "a device state of {} bytes does not fit this model's layout ({}: {} bytes)",
                bytes.len(),
                self.describe(),
                self.device_bytes()
            )));
        }
        let mut host = StateBuf::zeros(self);
        let lb = self.layer_bytes();
        for l in 0..self.n_layer {
            let dst = host.layer_mut(l);
            for (i, t) in self.tensors.iter().enumerate() {
                let (off, at) = (
                    self.offset_in_layer(i),
                    l * lb + self.byte_offset_in_layer(i),
                );
                let src = &bytes[at..at + t.len() * t.dtype.size()];
                let vals = &mut dst[off..off + t.len()];
                match t.dtype {
                    DType::BF16 => get(vals, src, |b| {
                        bf16::from_bits(u16::from_le_bytes(b)).to_f32()
                    }),
                    DType::F16 => get(vals, src, |b| {
                        f16::from_bits(u16::from_le_bytes(b)).to_f32()
                    }),
                    _ => get(vals, src, f32::from_le_bytes),
                }
            }
        }
        Ok(host)
    }
}

/// Refuse a state dtype other than f32, bf16 or f16.
pub fn check_state_dtype(dtype: DType) -> Result<()> {
    if dtype == DType::F64 {
        return Err(Error::input(
            "--state-dtype f64 is not a storage dtype of states: expected f32, bf16 or f16",
        ));
    }
    Ok(())
}

/// Round values to `dtype` and back to f32 (round to nearest even).
pub fn round_slice(dtype: DType, vals: &mut [f32]) {
    match dtype {
        DType::BF16 => vals
            .iter_mut()
            .for_each(|x| *x = bf16::from_f32(*x).to_f32()),
        DType::F16 => vals
            .iter_mut()
            .for_each(|x| *x = f16::from_f32(*x).to_f32()),
        _ => {}
    }
}

fn put<const N: usize>(dst: &mut [u8], vals: &[f32], f: impl Fn(f32) -> [u8; N]) {
    for (d, &v) in dst.chunks_exact_mut(N).zip(vals) {
        d.copy_from_slice(&f(v));
    }
}

fn get<const N: usize>(vals: &mut [f32], src: &[u8], f: impl Fn([u8; N]) -> f32) {
    for (v, b) in vals.iter_mut().zip(src.chunks_exact(N)) {
        *v = f(b.try_into().expect("chunks of N bytes"));
    }
}

/// A sequence's state: every layer's tensors, flat, in layout order. `F` is f32 in the
/// engine and f64 in the references' tests.
#[derive(Clone, Debug, PartialEq)]
pub struct StateBuf<F> {
    pub layer_len: usize,
    pub data: Vec<F>,
}

impl<F: Copy + num_traits::Zero> StateBuf<F> {
    /// All zeros: a fresh sequence.
    pub fn zeros(layout: &StateLayout) -> StateBuf<F> {
        StateBuf {
            layer_len: layout.layer_len(),
            data: vec![F::zero(); layout.len()],
        }
    }
    /// Wrap flat values, checking their count against the layout.
    pub fn from_flat(layout: &StateLayout, data: Vec<F>) -> Result<StateBuf<F>> {
        if data.len() != layout.len() {
            return Err(Error::State(format!(
                "a state of {} values does not fit this model's layout ({}: {} values)",
                data.len(),
                layout.describe(),
                layout.len()
            )));
        }
        Ok(StateBuf {
            layer_len: layout.layer_len(),
            data,
        })
    }
    pub fn n_layer(&self) -> usize {
        self.data.len().checked_div(self.layer_len).unwrap_or(0)
    }
    /// Layer `l`'s values.
    pub fn layer(&self, l: usize) -> &[F] {
        &self.data[l * self.layer_len..(l + 1) * self.layer_len]
    }
    pub fn layer_mut(&mut self, l: usize) -> &mut [F] {
        &mut self.data[l * self.layer_len..(l + 1) * self.layer_len]
    }
    /// Every layer's values, in order.
    pub fn layers_mut(&mut self) -> std::slice::ChunksExactMut<'_, F> {
        self.data.chunks_exact_mut(self.layer_len.max(1))
    }
    /// Whether it has the layout's size.
    pub fn fits(&self, layout: &StateLayout) -> bool {
        self.layer_len == layout.layer_len() && self.data.len() == layout.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_and_names_follow_the_layout() {
        let l = StateLayout {
            n_layer: 2,
            tensors: vec![
                StateTensor::new("conv", &[3, 4]),
                StateTensor::new("ssm", &[3, 5]),
            ],
        };
        assert_eq!((l.layer_len(), l.len(), l.offset_in_layer(1)), (27, 54, 12));
        assert_eq!(l.file_name(1, 0), "state.1.conv");
        let mut s = StateBuf::<f32>::zeros(&l);
        s.layer_mut(1)[0] = 2.0;
        assert_eq!(s.data[27], 2.0);
        assert_eq!(s.n_layer(), 2);
        assert!(StateBuf::from_flat(&l, vec![0f32; 53]).is_err());
    }

    fn siso_like() -> StateLayout {
        StateLayout {
            n_layer: 2,
            tensors: vec![
                StateTensor::new("angle", &[2, 2]),
                StateTensor::new("ssm", &[2, 3, 4]),
                StateTensor::new("k", &[2, 4]),
                StateTensor::new("v", &[2, 3]),
            ],
        }
    }

    #[test]
    fn byte_offsets_follow_the_state_dtype() {
        // f32: the host's flat layout, no padding
        let f = siso_like();
        let offs: Vec<usize> = (0..4).map(|i| f.byte_offset_in_layer(i)).collect();
        assert_eq!(offs, [0, 16, 112, 144]);
        assert_eq!((f.layer_bytes(), f.device_bytes()), (168, 336));
        assert_eq!(f.layer_bytes(), 4 * f.layer_len());
        // 16-bit ssm: 24 values, 48 bytes, padded to 48 (a multiple of 16); the f32
        // tensors after it stay 16-byte aligned
        for d in [DType::BF16, DType::F16] {
            let h = siso_like().with_state_dtype(d).unwrap();
            assert_eq!(h.state_dtype(), d);
            assert!(h.is_narrow());
            let offs: Vec<usize> = (0..4).map(|i| h.byte_offset_in_layer(i)).collect();
            assert_eq!(offs, [0, 16, 64, 96]);
            assert_eq!((h.layer_bytes(), h.device_bytes()), (120, 240));
            // the host layout (f32 elements) does not change
            assert_eq!(
                (h.layer_len(), h.offset_in_layer(2)),
                (f.layer_len(), f.offset_in_layer(2))
            );
            assert!(h.describe().contains(&format!("ssm [2, 3, 4] {d}")));
            assert_ne!(h, f, "layouts of two state dtypes are not the same layout");
        }
        // an odd-sized 16-bit tensor is padded to 16 bytes
        let odd = StateLayout {
            n_layer: 1,
            tensors: vec![StateTensor::new("ssm", &[5]), StateTensor::new("k", &[4])],
        }
        .with_state_dtype(DType::BF16)
        .unwrap();
        assert_eq!((odd.byte_offset_in_layer(1), odd.layer_bytes()), (16, 32));
    }

    #[test]
    fn f64_is_no_state_dtype() {
        let e = siso_like()
            .with_state_dtype(DType::F64)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--state-dtype f64") && e.contains("f32, bf16 or f16"),
            "{e}"
        );
    }

    /// Values of a 16-bit state survive host → bytes → host unchanged; f32 values are
    /// rounded to nearest even on the way, the f32 tensors are untouched.
    #[test]
    fn bytes_round_trip_and_rounding() {
        for d in [DType::BF16, DType::F16] {
            let l = siso_like().with_state_dtype(d).unwrap();
            let vals: Vec<f32> = (0..l.len())
                .map(|i| (i as f32 * 0.7311).sin() * 3.1)
                .collect();
            let host = StateBuf::from_flat(&l, vals.clone()).unwrap();
            let back = l.from_bytes(&l.to_bytes(&host)).unwrap();
            let mut rounded = host.clone();
            l.round_host(&mut rounded);
            assert_eq!(back, rounded, "{d}");
            // exact for representable values
            assert_eq!(l.from_bytes(&l.to_bytes(&rounded)).unwrap(), rounded, "{d}");
            for layer in 0..2 {
                let (a, b) = (host.layer(layer), rounded.layer(layer));
                let ssm = l.offset_in_layer(1)..l.offset_in_layer(2);
                assert_eq!(a[..ssm.start], b[..ssm.start], "{d}: angle");
                assert_eq!(a[ssm.end..], b[ssm.end..], "{d}: k, v");
                for (x, y) in a[ssm.clone()].iter().zip(&b[ssm]) {
                    let want = match d {
                        DType::BF16 => bf16::from_f32(*x).to_f32(),
                        _ => f16::from_f32(*x).to_f32(),
                    };
                    assert_eq!(*y, want);
                }
            }
            assert!(l.from_bytes(&[0u8; 7]).is_err());
        }
        // round to nearest even: 1 + 2^-8 is halfway between two bf16 values, the even one is 1
        let mut v = [1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8)];
        round_slice(DType::BF16, &mut v);
        assert_eq!(v, [1.0, 1.0 + 4.0 * 2f32.powi(-8)]);
    }
}
