//! Reading `torch.save` checkpoints (the zip format of PyTorch ≥ 1.6, which is how official
//! `pytorch_model.bin` files are published) without Python.
//!
//! The zip holds `<archive>/data.pkl`, a pickle of the state dict, and one record
//! `<archive>/data/<key>` per storage with its raw bytes (little-endian, as
//! `<archive>/byteorder` says when present). In the pickle each tensor is a call
//! `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)` whose storage is the
//! persistent id `("storage", torch.FloatStorage, key, location, numel)`.
//!
//! The pickle is run by [`super::torch_pickle`], which calls nothing; this module finds the
//! state dict in its result and copies each tensor's view out of its zip record.

use super::torch_pickle::{TensorRef, Value, Vm, R, STORAGES};
use crate::error::{Error, Result};
use crate::model::raw_tensor::RawTensor;
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;
use std::rc::Rc;

type Zip = zip::ZipArchive<std::io::BufReader<std::fs::File>>;

/// Read every tensor of a `torch.save` zip (a state dict, possibly nested one level in
/// a dict under a key such as "state_dict" or "model"), as contiguous little-endian bytes.
pub fn read(path: &Path) -> Result<BTreeMap<String, RawTensor<'static>>> {
    let bad = |msg: String| Error::checkpoint(path.display(), msg);
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let file_len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let mut zip = zip::ZipArchive::new(std::io::BufReader::new(file))
        .map_err(|e| bad(format!("expected a torch.save zip archive, found: {e}")))?;

    // The archive prefix is the saved file's stem (`archive/`, `pytorch_model/`, ...).
    let pkl = (zip.file_names())
        .filter(|n| n.ends_with("/data.pkl") || *n == "data.pkl")
        .min_by_key(|n| n.len())
        .map(str::to_owned)
        .ok_or_else(|| bad("expected a zip entry `<archive>/data.pkl`, found none".into()))?;
    let prefix = &pkl[..pkl.len() - "data.pkl".len()];
    let mut entry = |name: &str| read_entry(&mut zip, name, file_len).map_err(bad);

    if let Some(order) = entry(&format!("{prefix}byteorder"))? {
        let order = String::from_utf8_lossy(&order);
        let order = order.trim();
        if order != "little" {
            let msg = format!("expected byte order \"little\", found {order:?}");
            return Err(bad(format!("`{prefix}byteorder`: {msg}")));
        }
    }
    let pickle = entry(&pkl)?.ok_or_else(|| bad(format!("zip entry `{pkl}` vanished")))?;
    let in_pkl = |e: String| bad(format!("`{pkl}`: {e}"));
    let root = Vm::new(&pickle).run().map_err(in_pkl)?;
    let tensors = select_state_dict(&root).map_err(in_pkl)?;

    // Group by storage so each record is read once (tied weights share one) and dropped after.
    let mut by_storage: BTreeMap<&str, Vec<(&str, &TensorRef)>> = BTreeMap::new();
    for (name, t) in &tensors {
        let users = by_storage.entry(&t.storage.key).or_default();
        users.push((name, t));
    }
    let mut out = BTreeMap::new();
    for (key, users) in by_storage {
        let record = format!("{prefix}data/{key}");
        let bytes = entry(&record)?.ok_or_else(|| {
            let user = users.first().map_or("", |u| u.0);
            bad(format!(
                "tensor `{user}` needs zip entry `{record}`, which is missing"
            ))
        })?;
        for (name, t) in users {
            let tensor = materialise(name, t, &record, &bytes).map_err(bad)?;
            out.insert(name.to_owned(), tensor);
        }
    }
    Ok(out)
}

/// The bytes of one zip entry, or `None` if there is no such entry.
fn read_entry(zip: &mut Zip, name: &str, file_len: u64) -> R<Option<Vec<u8>>> {
    let bad = |e: &dyn std::fmt::Display| format!("zip entry `{name}` cannot be read: {e}");
    let mut f = match zip.by_name(name) {
        Ok(f) => f,
        Err(zip::result::ZipError::FileNotFound) => return Ok(None),
        Err(e) => return Err(bad(&e)),
    };
    // The declared size comes from the file: trust it no further than the file's length.
    let mut buf = Vec::with_capacity(f.size().min(file_len) as usize);
    f.read_to_end(&mut buf).map_err(|e| bad(&e))?;
    Ok(Some(buf))
}

/// The (name, tensor) entries of the state dict: the top-level dict's tensors, or those of a
/// dict nested under "state_dict", "model" or "module". Non-tensor values are skipped.
fn select_state_dict(root: &Value) -> R<Vec<(String, Rc<TensorRef>)>> {
    let Value::Dict(top) = root else {
        return Err(format!("expected a dict of name → tensor, found {root}"));
    };
    let tensors_of = |v: &Value| match v {
        Value::Dict(d) => (d.borrow().iter())
            .filter_map(|kv| match kv {
                (Value::Str(k), Value::Tensor(t)) => Some((k.to_string(), t.clone())),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    };
    let top = top.borrow();
    let direct = tensors_of(root);
    if !direct.is_empty() || top.is_empty() {
        return Ok(direct);
    }
    for key in ["state_dict", "model", "module"] {
        let is_key = |k: &Value| matches!(k, Value::Str(s) if &**s == key);
        let nested = top.iter().rev().find(|(k, _)| is_key(k));
        let found = nested.map(|(_, v)| tensors_of(v)).unwrap_or_default();
        if !found.is_empty() {
            return Ok(found);
        }
    }
    let keys: Vec<String> = top.iter().take(8).map(|(k, _)| k.to_string()).collect();
    Err(format!(
        "expected a dict of name → tensor (maybe under \"state_dict\", \"model\" or \"module\"), \
         found a dict without tensors, with keys {}",
        keys.join(", ")
    ))
}

/// Copy a (possibly strided) view out of its storage's bytes, in row-major order.
fn materialise(name: &str, t: &TensorRef, record: &str, bytes: &[u8]) -> R<RawTensor<'static>> {
    let (st, shape, stride) = (&t.storage, &t.shape, &t.stride);
    let Some(dtype) = st.dtype else {
        let known = STORAGES.map(|(n, _)| n).join(", ");
        return Err(format!(
            "tensor `{name}` is a {}; expected one of {known}",
            st.type_name
        ));
    };
    let es = dtype.size();
    let overflow = || format!("tensor `{name}`: shape {shape:?} with stride {stride:?} overflows");
    let numel = (shape.iter()).try_fold(1usize, |a, &n| a.checked_mul(n));
    let numel = numel.ok_or_else(overflow)?;
    let raw = |data| RawTensor {
        dtype,
        shape: shape.clone(),
        bytes: Cow::Owned(data),
    };
    if numel == 0 {
        return Ok(raw(Vec::new()));
    }
    // One past the last element the view touches.
    let last = (shape.iter().zip(stride)).try_fold(t.offset, |e, (&n, &s)| {
        e.checked_add((n - 1).checked_mul(s)?)
    });
    let end = last.and_then(|e| e.checked_add(1)).ok_or_else(overflow)?;
    let view = format!(
        "storage offset {}, shape {shape:?}, stride {stride:?}, {dtype}",
        t.offset
    );
    if end > st.numel {
        let (key, n) = (&st.key, st.numel);
        return Err(format!(
            "tensor `{name}` reads up to element {end} of storage `{key}`, which holds {n} ({view})"
        ));
    }
    let need = end.checked_mul(es).ok_or_else(overflow)?;
    if bytes.len() < need {
        let have = bytes.len();
        return Err(format!(
            "zip entry `{record}` holds {have} bytes but tensor `{name}` needs {need} ({view})"
        ));
    }
    // Trailing dims laid out contiguously form one run, copied at once; an odometer walks
    // the rest. Every offset is below `end`, checked above.
    let (mut run, mut k) = (1, shape.len());
    while k > 0 && (shape[k - 1] == 1 || stride[k - 1] == run) {
        run *= shape[k - 1];
        k -= 1;
    }
    // Views with zero strides (expanded tensors) may need more bytes than the storage has.
    let total = numel.checked_mul(es).ok_or_else(overflow)?;
    let mut out = Vec::new();
    let oom = |_| format!("tensor `{name}` needs {total} bytes, which cannot be allocated");
    out.try_reserve_exact(total).map_err(oom)?;
    let mut idx = vec![0usize; k];
    for _ in 0..numel / run {
        let off = t.offset + idx.iter().zip(stride).map(|(i, s)| i * s).sum::<usize>();
        out.extend_from_slice(&bytes[off * es..(off + run) * es]);
        for d in (0..k).rev() {
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    Ok(raw(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::dtype::DType;
    use crate::model::raw_tensor::DiskDType;
    use std::io::Write;

    fn fixtures() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
    }

    #[test]
    fn fixtures_match_safetensors() {
        for model in ["siso-tiny", "siso-mlp-norm"] {
            let dir = fixtures().join(model);
            let bin = read(&dir.join("pytorch_model.bin")).unwrap();
            let st_bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
            let st = safetensors::SafeTensors::deserialize(&st_bytes).unwrap();
            let tied = st.tensor("lm_head.weight").is_err();
            assert_eq!(bin.len(), st.len() + tied as usize, "{model}");
            for (name, t) in &bin {
                let (dtype, shape, bytes) = match st.tensor(name) {
                    Ok(s) => (s.dtype(), s.shape().to_vec(), s.data().to_vec()),
                    Err(_) if name == "lm_head.weight" => {
                        let s = st.tensor("backbone.embedding.weight").unwrap();
                        (s.dtype(), s.shape().to_vec(), s.data().to_vec())
                    }
                    Err(_) => panic!("{model}: `{name}` is not in the safetensors"),
                };
                assert_eq!(dtype, safetensors::Dtype::F32, "{model} {name}");
                assert_eq!(t.dtype, DiskDType::Float(DType::F32), "{model} {name}");
                assert_eq!(
                    (&t.shape, &t.bytes[..]),
                    (&shape, &bytes[..]),
                    "{model} {name}"
                );
            }
            assert!(model != "siso-tiny" || tied && bin.contains_key("lm_head.weight"));
        }
    }

    #[test]
    fn truncated_files_are_errors() {
        let full = std::fs::read(fixtures().join("siso-tiny/pytorch_model.bin")).unwrap();
        let n = full.len();
        for len in [0, 10, 100, 2100, n / 2, n - 10, n - 1] {
            let mut f = tempfile::NamedTempFile::new().unwrap();
            f.write_all(&full[..len]).unwrap();
            assert!(read(f.path()).is_err(), "cut at {len}");
        }
    }

    // Hand-assembled pickles: BINUNICODE strings, MARK ... TUPLE tuples, BININT1 ints.
    fn s(x: &str) -> Vec<u8> {
        [&[b'X'][..], &(x.len() as u32).to_le_bytes(), x.as_bytes()].concat()
    }
    fn tup(items: &[Vec<u8>]) -> Vec<u8> {
        [vec![b'('], items.concat(), vec![b't']].concat()
    }
    fn ints(xs: &[u8]) -> Vec<u8> {
        tup(&xs.iter().map(|&x| vec![b'K', x]).collect::<Vec<_>>())
    }
    const ORDERED_DICT: &[u8] = b"ccollections\nOrderedDict\n)R";
    /// `_rebuild_tensor_v2(("storage", torch.<ty>, key, "cpu", numel), offset, size, stride,
    /// False, OrderedDict())`
    fn tensor(ty: &str, key: &str, numel: u8, offset: u8, size: &[u8], stride: &[u8]) -> Vec<u8> {
        let ty = format!("ctorch\n{ty}\n").into_bytes();
        let pid = tup(&[s("storage"), ty, s(key), s("cpu"), vec![b'K', numel]]);
        let args = [
            pid,
            vec![b'Q', b'K', offset],
            ints(size),
            ints(stride),
            vec![0x89],
        ];
        let args = tup(&[args.concat(), ORDERED_DICT.to_vec()]);
        [&b"ctorch._utils\n_rebuild_tensor_v2\n"[..], &args, b"R"].concat()
    }
    /// A float tensor over storage "0", which holds 0.0, 1.0, ..., 9.0.
    fn f32_view(offset: u8, size: &[u8], stride: &[u8]) -> Vec<u8> {
        tensor("FloatStorage", "0", 10, offset, size, stride)
    }
    fn storage0() -> Vec<u8> {
        (0..10).flat_map(|i| (i as f32).to_le_bytes()).collect()
    }
    fn dict(entries: &[(&str, Vec<u8>)]) -> Vec<u8> {
        let body = entries.iter().map(|(k, v)| [s(k), v.clone()].concat());
        [
            b"}(".to_vec(),
            body.collect::<Vec<_>>().concat(),
            b"u".to_vec(),
        ]
        .concat()
    }
    fn pickle(body: Vec<u8>) -> Vec<u8> {
        [vec![0x80, 2], body, vec![b'.']].concat()
    }
    fn zip_file(entries: &[(&str, &[u8])]) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        let mut z = zip::ZipWriter::new(f.reopen().unwrap());
        let stored = zip::CompressionMethod::Stored;
        let opts = zip::write::SimpleFileOptions::default().compression_method(stored);
        for (name, data) in entries {
            z.start_file(*name, opts).unwrap();
            z.write_all(data).unwrap();
        }
        z.finish().unwrap();
        f
    }
    fn f32s(t: &RawTensor) -> (Vec<usize>, Vec<f32>) {
        let v = t
            .bytes
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()));
        (t.shape.clone(), v.collect())
    }

    #[test]
    fn strided_views_offsets_and_nesting() {
        // A transposed 3×2 view starting at element 1, memoised (BINPUT 9) and reused below.
        let t = [f32_view(1, &[2, 3], &[1, 2]), vec![b'q', 9]].concat();
        let p = [f32_view(2, &[2], &[3]), vec![0x88], ORDERED_DICT.into()];
        let param = [&b"ctorch._utils\n_rebuild_parameter\n"[..], &tup(&p), b"R"].concat();
        let state = dict(&[
            ("t", t),
            ("scalar", f32_view(9, &[], &[])),
            ("empty", f32_view(0, &[0, 4], &[4, 1])),
            ("param", param),
            ("step", vec![b'K', 7]),
            ("ids", tensor("LongStorage", "1", 3, 0, &[3], &[1])),
            ("tied", vec![b'h', 9]),
        ]);
        // Nested one level, as training scripts save it.
        let body = dict(&[("epoch", vec![b'K', 3]), ("state_dict", state)]);
        let ids: Vec<u8> = [10i64, 20, 30]
            .iter()
            .flat_map(|i| i.to_le_bytes())
            .collect();
        let f = zip_file(&[
            ("archive/data.pkl", &pickle(body)),
            ("archive/byteorder", b"little"),
            ("archive/data/0", &storage0()),
            ("archive/data/1", &ids),
        ]);
        let m = read(f.path()).unwrap();
        let names = ["empty", "ids", "param", "scalar", "t", "tied"];
        assert_eq!(m.keys().collect::<Vec<_>>(), names);
        assert_eq!(f32s(&m["t"]), (vec![2, 3], vec![1., 3., 5., 2., 4., 6.]));
        assert_eq!(f32s(&m["tied"]), f32s(&m["t"]));
        assert_eq!(f32s(&m["scalar"]), (vec![], vec![9.]));
        assert_eq!(f32s(&m["empty"]), (vec![0, 4], vec![]));
        assert_eq!(f32s(&m["param"]), (vec![2], vec![2., 5.]));
        assert_eq!(
            (m["ids"].dtype, &m["ids"].bytes[..]),
            (DiskDType::I64, &ids[..])
        );
    }

    fn read_err(pkl: &[u8], extra: &[(&str, &[u8])]) -> String {
        let f = zip_file(&[&[("archive/data.pkl", pkl)], extra].concat());
        read(f.path()).map(|_| ()).unwrap_err().to_string()
    }

    #[test]
    fn malformed_pickles_are_errors() {
        let e = read_err(&[0x80, 2, b'}', 0xff, b'.'], &[]);
        assert!(e.contains("opcode 0xff at byte 3"), "{e}");
        // Underflow, an unset memo entry, no STOP, truncated text, popping below a MARK.
        for bad in [
            &b"\x80\x02R."[..],
            b"\x80\x02h\x05.",
            b"\x80\x02}",
            b"X\x09\0\0\0a",
            b"(00.",
        ] {
            let e = read_err(bad, &[]);
            assert!(e.contains("archive/data.pkl"), "{e}");
        }
        let e = read_err(&pickle(b"K\x07".to_vec()), &[]);
        assert!(e.contains("expected a dict"), "{e}");
        // Protocol 0: DICT, UNICODE (latin-1 and an escape), PUT/GET, INT/LONG, SETITEM.
        let e = read_err(b"(dp0\nV\xe9\\u00e9\np1\nI01\nsg1\nL5L\ns.", &[]);
        assert!(
            e.contains(r#"without tensors, with keys the string "éé""#),
            "{e}"
        );
    }

    #[test]
    fn bad_storage_and_archives_are_errors() {
        let data = storage0();
        let pkl = pickle(dict(&[("w", f32_view(8, &[4], &[1]))]));
        let e = read_err(&pkl, &[("archive/data/0", &data)]);
        assert!(
            e.contains("element 12 of storage `0`, which holds 10"),
            "{e}"
        );
        // The persistent id claims 20 elements; the record holds 10.
        let pkl = pickle(dict(&[(
            "w",
            tensor("FloatStorage", "0", 20, 8, &[4], &[1]),
        )]));
        let e = read_err(&pkl, &[("archive/data/0", &data)]);
        assert!(e.contains("holds 40 bytes but tensor `w` needs 48"), "{e}");
        let e = read_err(&pkl, &[]);
        assert!(e.contains("`archive/data/0`, which is missing"), "{e}");
        let e = read_err(
            &pkl,
            &[("archive/byteorder", b"big"), ("archive/data/0", &data)],
        );
        assert!(e.contains("\"little\""), "{e}");
        let f = zip_file(&[("archive/other", b"x")]);
        assert!(read(f.path()).unwrap_err().to_string().contains("data.pkl"));
    }
}
