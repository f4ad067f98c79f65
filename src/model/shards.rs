//! One source of named tensors over the files a checkpoint may come in (spec §4, §5):
//! a single `model.safetensors` or `pytorch_model.bin`, or shards listed by a
//! `model.safetensors.index.json` (`{"weight_map": {name: shard file}}`).
//!
//! Aliases recorded in a safetensors file's metadata (transformers' converter stores a tied
//! `lm_head.weight` once and writes `{"lm_head.weight": "backbone.embeddings.weight"}`
//! there, spec §5.2) are resolved by [`TensorSource::get`].

use crate::error::{Error, Result};
use crate::model::tensor_file::{RawTensor, TensorFile};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The files looked for in a model folder, in order.
pub const WEIGHT_FILES: [&str; 4] = [
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
];

pub struct TensorSource {
    files: Vec<TensorFile>,
    /// tensor name → index into `files`
    index: BTreeMap<String, usize>,
    /// name → the stored tensor it stands for
    aliases: BTreeMap<String, String>,
    origin: PathBuf,
}

impl TensorSource {
    /// A weights file, a shard index, or a folder holding one of [`WEIGHT_FILES`].
    pub fn open(path: &Path) -> Result<TensorSource> {
        let file = if path.is_dir() {
            WEIGHT_FILES
                .iter()
                .map(|n| path.join(n))
                .find(|p| p.is_file())
                .ok_or_else(|| {
                    Error::checkpoint(
                        path.display(),
                        format!(
                            "no weights found: expected one of {}",
                            WEIGHT_FILES.join(", ")
                        ),
                    )
                })?
        } else {
            path.to_path_buf()
        };
        if file.to_string_lossy().ends_with(".index.json") {
            Self::open_index(&file)
        } else {
            Ok(Self::from_file(TensorFile::open(&file)?))
        }
    }

    /// One open file as a source.
    pub fn from_file(file: TensorFile) -> TensorSource {
        let origin = file.path().to_path_buf();
        let index = file.names().into_iter().map(|n| (n, 0)).collect();
        let mut s = TensorSource {
            files: vec![file],
            index,
            aliases: BTreeMap::new(),
            origin,
        };
        s.collect_aliases();
        s
    }

    /// Shards listed by an index file, opened (each once) beside it.
    pub fn open_index(index_path: &Path) -> Result<TensorSource> {
        let text = std::fs::read_to_string(index_path).map_err(|e| Error::io(index_path, e))?;
        let bad = |msg: String| Error::checkpoint(index_path.display(), msg);
        let root: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        let map = root
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| bad("expected an object `weight_map` of tensor name → shard".into()))?;
        let dir = index_path.parent().unwrap_or(Path::new("."));
        let mut shard_of: BTreeMap<String, usize> = BTreeMap::new();
        let mut files = Vec::new();
        let mut index = BTreeMap::new();
        for (name, shard) in map {
            let shard = shard.as_str().ok_or_else(|| {
                bad(format!(
                    "weight_map[{name:?}]: expected a file name, found {shard}"
                ))
            })?;
            // Shards live beside the index; a path elsewhere is not a checkpoint we wrote.
            if shard.is_empty() || shard.contains(['/', '\\']) || shard == ".." {
                return Err(bad(format!(
                    "weight_map[{name:?}]: expected a file name beside the index, found {shard:?}"
                )));
            }
            let i = match shard_of.get(shard) {
                Some(&i) => i,
                None => {
                    files.push(TensorFile::open(&dir.join(shard))?);
                    shard_of.insert(shard.to_string(), files.len() - 1);
                    files.len() - 1
                }
            };
            index.insert(name.clone(), i);
        }
        if files.is_empty() {
            return Err(bad("weight_map lists no tensors".into()));
        }
        for (name, &i) in &index {
            if files[i].get(name).is_none() {
                return Err(bad(format!(
                    "tensor `{name}` is mapped to {} but is not in it",
                    files[i].path().display()
                )));
            }
        }
        let mut s = TensorSource {
            files,
            index,
            aliases: BTreeMap::new(),
            origin: index_path.to_path_buf(),
        };
        s.collect_aliases();
        Ok(s)
    }

    /// Metadata entries `name → stored name` where the value is a stored tensor and the key
    /// is not one (safetensors' `save_model` records removed shared tensors that way).
    fn collect_aliases(&mut self) {
        for f in &self.files {
            for (k, v) in f.metadata() {
                if self.index.contains_key(&v) && !self.index.contains_key(&k) {
                    self.aliases.insert(k, v);
                }
            }
        }
    }

    /// The file (or index) this source was opened from.
    pub fn origin(&self) -> &Path {
        &self.origin
    }

    /// Stored tensor names, sorted (aliases not included).
    pub fn names(&self) -> Vec<String> {
        self.index.keys().cloned().collect()
    }

    /// The stored name `name` resolves to, if any.
    pub fn resolve<'a>(&'a self, name: &'a str) -> Option<&'a str> {
        if self.index.contains_key(name) {
            return Some(name);
        }
        self.aliases.get(name).map(|s| s.as_str())
    }

    pub fn get(&self, name: &str) -> Option<RawTensor<'_>> {
        let stored = self.resolve(name)?;
        self.files[self.index[stored]].get(stored)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tensor_file::write_safetensors;

    fn fixture(rel: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../shared/fixtures")
            .join(rel)
    }

    #[test]
    fn resolves_the_metadata_alias_of_a_tied_head() {
        let s = TensorSource::open(&fixture("m2-tiny/hf")).unwrap();
        assert!(!s.names().contains(&"lm_head.weight".to_string()));
        let head = s.get("lm_head.weight").unwrap();
        let emb = s.get("backbone.embeddings.weight").unwrap();
        assert_eq!(head.shape, vec![256, 64]);
        assert_eq!(head.bytes, emb.bytes);
        // `format: pt` is metadata, not an alias
        assert!(s.get("format").is_none());
    }

    #[test]
    fn a_sharded_checkpoint_reads_as_one_file() {
        let dir = tempfile::tempdir().unwrap();
        let whole = TensorSource::open(&fixture("m1-tiny/model.safetensors")).unwrap();
        let names = whole.names();
        let (a, b) = names.split_at(names.len() / 2);
        let mut map = serde_json::Map::new();
        for (shard, part) in [
            ("model-00001-of-00002.safetensors", a),
            ("model-00002-of-00002.safetensors", b),
        ] {
            let tensors: Vec<(String, RawTensor)> = part
                .iter()
                .map(|n| (n.clone(), whole.get(n).unwrap()))
                .collect();
            write_safetensors(&dir.path().join(shard), &tensors, None).unwrap();
            for n in part {
                map.insert(n.clone(), shard.into());
            }
        }
        let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
        let index_path = dir.path().join("model.safetensors.index.json");
        std::fs::write(&index_path, index.to_string()).unwrap();
        let sharded = TensorSource::open(dir.path()).unwrap();
        assert_eq!(sharded.names(), names);
        for n in &names {
            assert_eq!(
                sharded.get(n).unwrap().bytes,
                whole.get(n).unwrap().bytes,
                "{n}"
            );
        }

        // a tensor mapped to the wrong shard, and a shard path outside the folder
        let mut bad = map.clone();
        bad.insert(a[0].clone(), "model-00002-of-00002.safetensors".into());
        std::fs::write(
            &index_path,
            serde_json::json!({"weight_map": bad}).to_string(),
        )
        .unwrap();
        let e = TensorSource::open(&index_path).err().unwrap().to_string();
        assert!(e.contains(&a[0]) && e.contains("00002"), "{e}");
        let mut bad = map.clone();
        bad.insert(a[0].clone(), "../x.safetensors".into());
        std::fs::write(
            &index_path,
            serde_json::json!({"weight_map": bad}).to_string(),
        )
        .unwrap();
        let e = TensorSource::open(&index_path).err().unwrap().to_string();
        assert!(e.contains("beside the index"), "{e}");
        std::fs::write(&index_path, "{}").unwrap();
        let e = TensorSource::open(&index_path).err().unwrap().to_string();
        assert!(e.contains("weight_map"), "{e}");
    }

    #[test]
    fn a_folder_without_weights_is_an_error_naming_the_files() {
        let dir = tempfile::tempdir().unwrap();
        let e = TensorSource::open(dir.path()).err().unwrap().to_string();
        assert!(e.contains("model.safetensors.index.json"), "{e}");
    }
}
