//! Named tensors on disk: reading safetensors (memory-mapped) and the official
//! `pytorch_model.bin`, and writing safetensors.
//!
//! Both readers hand out [`RawTensor`]s: dtype, shape and little-endian bytes, contiguous.
//! Checking names and shapes against a config is the job of `weights.rs`.

use crate::error::{Error, Result};
use crate::model::dtype::DType;
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub use super::raw_tensor::{DiskDType, RawTensor};

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
