//! The default model: a small Mamba-3 this project trained itself (byte-level, on the
//! King James Bible; `models/default/README.md` says how), embedded in the binary so that
//! every command has a model when `--model` is not given, on any machine.
//!
//! The files are written once to a cache directory named after a hash of their contents
//! (`$XDG_CACHE_HOME/mamba3/default-<hash>/`, else `~/.cache/mamba3/...`, else the temp
//! directory), so the binary works wherever it is moved and a changed model never meets
//! stale files.

use crate::error::{Error, Result};
use crate::model::weights::Fnv;
use std::path::{Path, PathBuf};

/// (file name, contents) of the default model directory.
pub const FILES: [(&str, &[u8]); 3] = [
    (
        "config.json",
        include_bytes!("../../models/default/config.json"),
    ),
    (
        "model.safetensors",
        include_bytes!("../../models/default/model.safetensors"),
    ),
    (
        "tokenizer.json",
        include_bytes!("../../models/default/tokenizer.json"),
    ),
];

/// A short description for help texts and logs.
pub const DESCRIPTION: &str =
    "built-in default: Mamba-3 SISO, 2.8M parameters, byte-level, trained on the King James Bible";

/// Hash of the embedded files (names and contents).
pub fn hash() -> u64 {
    FILES
        .iter()
        .fold(Fnv::new(), |h, (n, b)| h.bytes(n.as_bytes()).bytes(b))
        .0
}

fn cache_roots() -> Vec<PathBuf> {
    let mut roots = Vec::new();
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        roots.push(PathBuf::from(x).join("mamba3"));
    }
    if let Some(h) = std::env::var_os("HOME").filter(|v| !v.is_empty()) {
        roots.push(PathBuf::from(h).join(".cache").join("mamba3"));
    }
    roots.push(std::env::temp_dir().join("mamba3"));
    roots
}

/// Whether `dir` already holds exactly the embedded files.
fn complete(dir: &Path) -> bool {
    FILES
        .iter()
        .all(|(n, b)| std::fs::metadata(dir.join(n)).is_ok_and(|m| m.len() == b.len() as u64))
}

fn materialise_in(root: &Path) -> std::io::Result<PathBuf> {
    let dir = root.join(format!("default-{:016x}", hash()));
    if complete(&dir) {
        return Ok(dir);
    }
    std::fs::create_dir_all(&dir)?;
    for (name, bytes) in FILES {
        // Write beside and rename, so a concurrent reader never sees half a file.
        let tmp = dir.join(format!("{name}.{}.tmp", std::process::id()));
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, dir.join(name))?;
    }
    Ok(dir)
}

/// The default model's directory (config.json, model.safetensors, tokenizer.json),
/// written to the cache on first use.
pub fn dir() -> Result<PathBuf> {
    let mut errors = Vec::new();
    for root in cache_roots() {
        match materialise_in(&root) {
            Ok(d) => return Ok(d),
            Err(e) => errors.push(format!("{}: {e}", root.display())),
        }
    }
    Err(Error::Other(format!(
        "cannot write the built-in default model to any cache directory ({})",
        errors.join("; ")
    )))
}

/// Whether `dir` is a copy of the built-in default model written by [`dir`].
pub fn is_default_dir(dir: &Path) -> bool {
    dir.file_name()
        .is_some_and(|n| n.to_string_lossy() == format!("default-{:016x}", hash()))
}

/// `path` if given, else the default model's directory.
pub fn resolve(path: Option<&Path>) -> Result<PathBuf> {
    match path {
        Some(p) => Ok(p.to_path_buf()),
        None => dir(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn materialises_a_loadable_model_once() {
        let tmp = tempfile::tempdir().unwrap();
        let d = materialise_in(tmp.path()).unwrap();
        assert!(complete(&d));
        let again = materialise_in(tmp.path()).unwrap();
        assert_eq!(d, again);
        // its files parse (the engine's own tests load and run it)
        let config = crate::model::config::Config::from_file(&d.join("config.json")).unwrap();
        assert_eq!(config.vocab_size, 256);
        let weights =
            crate::model::tensor_file::TensorFile::open(&d.join("model.safetensors")).unwrap();
        assert!(weights
            .names()
            .iter()
            .any(|n| n == "backbone.embedding.weight"));
        let tok = std::fs::read_to_string(d.join("tokenizer.json")).unwrap();
        assert!(tok.contains("ByteLevel"));
    }
}
