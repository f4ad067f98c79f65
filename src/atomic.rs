//! Files written so that a crash or `kill -9` at any moment leaves the old file or the new
//! one, never a torn one: each is written under a temporary name in the same folder,
//! synced, renamed over the target and the folder synced. Files are created with mode
//! 0666 less the umask, as any other program's.
//!
//! Also the checks that keep a command from overwriting what it must not.

use crate::error::{Error, Result};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// The temporary sibling `path` is written under: hidden, and named by process so that
/// two writers do not share one.
fn temp_name(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "file".into());
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

/// Remove what an earlier writer of `path` killed mid-write left: its temporary siblings
/// whose process is gone (a live one may still be writing).
fn remove_stale_temps(path: &Path) {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return;
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let prefix = format!(".{}.tmp-", name.to_string_lossy());
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let n = e.file_name();
        let Some(pid) = n.to_str().and_then(|n| n.strip_prefix(&prefix)) else {
            continue;
        };
        let alive = pid
            .parse::<u32>()
            .is_ok_and(|p| p == std::process::id() || Path::new(&format!("/proc/{p}")).exists());
        if !alive {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Write `path` atomically: `fill` writes the contents into a buffered writer.
pub fn write_with(
    path: &Path,
    fill: impl FnOnce(&mut BufWriter<&File>) -> std::io::Result<()>,
) -> Result<()> {
    remove_stale_temps(path);
    let tmp = temp_name(path);
    let result = (|| -> std::io::Result<()> {
        let file = File::create(&tmp)?;
        {
            let mut w = BufWriter::with_capacity(1 << 20, &file);
            fill(&mut w)?;
            w.flush()?;
        }
        file.sync_all()?;
        std::fs::rename(&tmp, path)?;
        sync_dir(path);
        Ok(())
    })();
    result.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::io(path, e)
    })
}

/// Write `bytes` to `path` atomically.
pub fn write(path: &Path, bytes: &[u8]) -> Result<()> {
    write_with(path, |w| w.write_all(bytes))
}

/// Make the rename durable: sync the folder that holds `path` (best effort; some file
/// systems refuse to sync a folder).
fn sync_dir(path: &Path) {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

/// The files that make a folder a model (or a training run's checkpoint).
pub const MODEL_FILES: &[&str] = &[
    "config.json",
    "model.safetensors",
    "pytorch_model.bin",
    "trainer.json",
    "optimizer.safetensors",
];

/// The model files `dir` holds (none when it does not exist).
pub fn model_files_in(dir: &Path) -> Vec<&'static str> {
    MODEL_FILES
        .iter()
        .copied()
        .filter(|f| dir.join(f).exists())
        .collect()
}

/// Refuse to write `path` when it is one of a model's files (a folder holding
/// `config.json` and weights, or a training run): an output given by mistake as a model
/// file would destroy it. `what` names the option (`--out`, `--save-state`).
pub fn refuse_model_file(path: &Path, what: &str) -> Result<()> {
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
        return Ok(());
    };
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let is_model_dir = dir.join("config.json").exists()
        && (dir.join("model.safetensors").exists() || dir.join("pytorch_model.bin").exists());
    if MODEL_FILES.contains(&name) && (path.exists() || is_model_dir) {
        return Err(Error::input(format!(
            "{what} {}: that is a model's file ({name}); refusing to overwrite it, give \
             another path",
            path.display()
        )));
    }
    if is_model_dir && path.exists() && ["tokenizer.json", "tokenizer_config.json"].contains(&name)
    {
        return Err(Error::input(format!(
            "{what} {}: that is the model's {name}; refusing to overwrite it, give another path",
            path.display()
        )));
    }
    Ok(())
}

/// Check before any long work that `path` can be written: its folder exists and is a
/// folder, and `path` itself is not a folder.
pub fn check_writable(path: &Path, what: &str) -> Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        return Err(Error::input(format!(
            "{what} {}: the folder {} does not exist",
            path.display(),
            dir.display()
        )));
    }
    if path.is_dir() {
        return Err(Error::input(format!(
            "{what} {}: that is a folder, expected a file name",
            path.display()
        )));
    }
    // Creating and removing a probe finds a read-only folder now, not after the work.
    let probe = temp_name(path);
    File::create(&probe).map_err(|e| Error::io(&probe, e))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn writes_replace_and_follow_the_umask() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.bin");
        write(&p, b"old").unwrap();
        write(&p, b"new").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"new");
        // Nothing left behind under a temporary name.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        // The umask as the kernel reports it (reading it with umask(2) would change it
        // for the other tests' threads).
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("Umask:")).unwrap();
        let umask = u32::from_str_radix(line["Umask:".len()..].trim(), 8).unwrap();
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o666 & !umask);
    }

    #[test]
    fn a_failed_fill_keeps_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.bin");
        write(&p, b"old").unwrap();
        let e = write_with(&p, |w| {
            w.write_all(b"half")?;
            Err(std::io::Error::other("disk full"))
        });
        assert!(e.is_err());
        assert_eq!(std::fs::read(&p).unwrap(), b"old");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        // What a killed writer left is cleared by the next write.
        let stale = dir.path().join(".a.bin.tmp-4000000000");
        std::fs::write(&stale, b"torn").unwrap();
        write(&p, b"newer").unwrap();
        assert!(!stale.exists());
        assert_eq!(std::fs::read(&p).unwrap(), b"newer");
    }

    #[test]
    fn model_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), "{}").unwrap();
        std::fs::write(dir.path().join("model.safetensors"), "x").unwrap();
        for f in ["config.json", "model.safetensors", "pytorch_model.bin"] {
            let e = refuse_model_file(&dir.path().join(f), "--out").unwrap_err();
            assert!(e.to_string().contains("refusing to overwrite"), "{e}");
        }
        refuse_model_file(&dir.path().join("logits.safetensors"), "--out").unwrap();
        let missing = dir.path().join("nope/x.safetensors");
        let e = check_writable(&missing, "--save-state").unwrap_err();
        assert!(e.to_string().contains("does not exist"), "{e}");
        check_writable(&dir.path().join("s.safetensors"), "--save-state").unwrap();
    }
}
