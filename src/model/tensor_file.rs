//! Named tensors on disk: reading safetensors (memory-mapped) and the official
//! `pytorch_model.bin`, and writing safetensors.
//!
//! Both readers hand out [`RawTensor`]s: dtype, shape and little-endian bytes, contiguous.
//! Checking names and shapes against a config is the job of `weights.rs`.

use crate::error::{Error, Result};
use crate::model::dtype::{DType, TensorData};
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

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

/// A file of named tensors, opened.
pub enum TensorFile {
    Safetensors {
        path: PathBuf,
        mmap: memmap2::Mmap,
    },
    Torch {
        path: PathBuf,
        tensors: BTreeMap<String, RawTensor<'static>>,
    },
}

impl TensorFile {
    /// Open a `.safetensors` file (memory-mapped) or a `torch.save` zip (`.bin`, `.pt`).
    pub fn open(path: &Path) -> Result<TensorFile> {
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let mut magic = [0u8; 4];
        {
            use std::io::Read;
            let mut f = &file;
            let n = f.read(&mut magic).map_err(|e| Error::io(path, e))?;
            if n < 4 {
                return Err(Error::checkpoint(
                    path.display(),
                    format!("file is {n} bytes long: too short to be a checkpoint"),
                ));
            }
        }
        if magic == *b"PK\x03\x04" {
            let tensors = crate::model::torch_bin::read(path)?;
            return Ok(TensorFile::Torch {
                path: path.into(),
                tensors,
            });
        }
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        if ["bin", "pt", "pth"].contains(&ext) {
            let what = if magic[0] == 0x80 {
                "a pickle without the zip around it (the legacy torch.save format, before \
                 PyTorch 1.6; save it again with a newer PyTorch)"
                    .to_string()
            } else {
                format!("first bytes {magic:02x?}")
            };
            return Err(Error::checkpoint(
                path.display(),
                format!(
                    "not a zip archive, so not a torch.save checkpoint (expected the bytes \
                     PK\\x03\\x04 first): {what}"
                ),
            ));
        }
        // SAFETY: the file is opened read-only; a checkpoint changing under a running
        // engine is outside what we can defend against (as in every mmap-based loader).
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        // Validate the header and every tensor's byte range once, up front.
        safetensors::SafeTensors::deserialize(&mmap).map_err(|e| {
            Error::checkpoint(path.display(), format!("not a valid safetensors file: {e}"))
        })?;
        Ok(TensorFile::Safetensors {
            path: path.into(),
            mmap,
        })
    }

    pub fn path(&self) -> &Path {
        match self {
            TensorFile::Safetensors { path, .. } | TensorFile::Torch { path, .. } => path,
        }
    }

    pub fn names(&self) -> Vec<String> {
        match self {
            TensorFile::Safetensors { mmap, .. } => {
                let st = safetensors::SafeTensors::deserialize(mmap).expect("validated at open");
                let mut v: Vec<String> = st.names().into_iter().map(String::from).collect();
                v.sort();
                v
            }
            TensorFile::Torch { tensors, .. } => tensors.keys().cloned().collect(),
        }
    }

    pub fn get(&self, name: &str) -> Option<RawTensor<'_>> {
        match self {
            TensorFile::Safetensors { mmap, .. } => {
                let st = safetensors::SafeTensors::deserialize(mmap).expect("validated at open");
                let view = st.tensor(name).ok()?;
                Some(RawTensor {
                    dtype: from_st_dtype(view.dtype()),
                    shape: view.shape().to_vec(),
                    bytes: Cow::Borrowed(view.data()),
                })
            }
            TensorFile::Torch { tensors, .. } => tensors.get(name).map(|t| RawTensor {
                dtype: t.dtype,
                shape: t.shape.clone(),
                bytes: Cow::Borrowed(&t.bytes),
            }),
        }
    }

    /// The safetensors `__metadata__` map (empty for other formats).
    pub fn metadata(&self) -> BTreeMap<String, String> {
        match self {
            TensorFile::Safetensors { mmap, .. } => safetensors::SafeTensors::read_metadata(mmap)
                .ok()
                .and_then(|(_, m)| m.metadata().clone())
                .map(|m| m.into_iter().collect())
                .unwrap_or_default(),
            TensorFile::Torch { .. } => BTreeMap::new(),
        }
    }
}

fn from_st_dtype(d: safetensors::Dtype) -> DiskDType {
    use safetensors::Dtype as S;
    match d {
        S::F32 => DiskDType::Float(DType::F32),
        S::BF16 => DiskDType::Float(DType::BF16),
        S::F16 => DiskDType::Float(DType::F16),
        S::F64 => DiskDType::Float(DType::F64),
        S::I64 => DiskDType::I64,
        S::I32 => DiskDType::I32,
        S::U32 => DiskDType::U32,
        S::I16 => DiskDType::I16,
        S::U16 => DiskDType::U16,
        S::I8 => DiskDType::I8,
        S::U8 => DiskDType::U8,
        S::BOOL => DiskDType::Bool,
        _ => DiskDType::Other,
    }
}

fn to_st_dtype(d: DiskDType) -> safetensors::Dtype {
    use safetensors::Dtype as S;
    match d {
        DiskDType::Float(DType::F32) => S::F32,
        DiskDType::Float(DType::BF16) => S::BF16,
        DiskDType::Float(DType::F16) => S::F16,
        DiskDType::Float(DType::F64) => S::F64,
        DiskDType::I64 => S::I64,
        DiskDType::I32 => S::I32,
        DiskDType::U32 => S::U32,
        DiskDType::I16 => S::I16,
        DiskDType::U16 => S::U16,
        DiskDType::I8 => S::I8,
        DiskDType::U8 => S::U8,
        DiskDType::Bool => S::BOOL,
        DiskDType::Other => S::U8,
    }
}

impl safetensors::View for &RawTensor<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        to_st_dtype(self.dtype)
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
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

/// Write named tensors (sorted by name, as safetensors requires) with optional metadata.
/// Streamed through [`crate::atomic::write_with`]: a temporary file, synced and renamed,
/// so a crash never leaves half a file, and the file's mode follows the umask.
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, RawTensor<'_>)],
    metadata: Option<std::collections::HashMap<String, String>>,
) -> Result<()> {
    // The header: each tensor's dtype, shape and byte range, in the order written.
    let mut header = serde_json::Map::new();
    if let Some(meta) = metadata {
        let meta: serde_json::Map<String, serde_json::Value> =
            meta.into_iter().map(|(k, v)| (k, v.into())).collect();
        header.insert("__metadata__".into(), meta.into());
    }
    let mut offset = 0usize;
    for (name, t) in tensors {
        let want = t.numel() * t.dtype.size();
        if t.bytes.len() != want {
            return Err(Error::Tensor {
                name: name.clone(),
                expected: format!("{want} bytes for shape {:?} of {}", t.shape, t.dtype),
                found: format!("{} bytes", t.bytes.len()),
            });
        }
        header.insert(
            name.clone(),
            serde_json::json!({
                "dtype": to_st_dtype(t.dtype).to_string(),
                "shape": t.shape,
                "data_offsets": [offset, offset + t.bytes.len()],
            }),
        );
        offset += t.bytes.len();
    }
    let mut text = serde_json::Value::Object(header).to_string().into_bytes();
    // The data starts on an 8-byte boundary, padded with spaces as the format allows.
    text.resize(text.len().next_multiple_of(8), b' ');
    crate::atomic::write_with(path, |w| {
        use std::io::Write;
        w.write_all(&(text.len() as u64).to_le_bytes())?;
        w.write_all(&text)?;
        for (_, t) in tensors {
            w.write_all(&t.bytes)?;
        }
        Ok(())
    })
}
