//! Read the CUDA libraries into the page cache ahead of their use, when a device is
//! opened (`Gpu::new`, at the start of a model's load): libcublasLt alone is ≈ 540 MB,
//! and the first process on a freshly booted machine pages it in by faults, scattered
//! small reads — the likely reason why the first model load after a boot took 13.1–13.8 s
//! against ≈ 1.1 s for the next (docs/benchmarks.md). One sequential read per file would
//! turn those faults into hits; but it also reads the parts of the libraries that are
//! never touched, so whether it pays on a cold disk is for a measurement on a fresh
//! machine to say. Until then it is opt-in: `MAMBA3_READAHEAD=1`. When the files are
//! cached already it is a memory copy beside the rest of the load.

use std::collections::BTreeSet;
use std::io::Read;
use std::path::PathBuf;

/// The libraries a GPU model loads, by file-name prefix (any version).
const STEMS: [&str; 4] = [
    "libcublasLt.so",
    "libnvrtc.so",
    "libnvrtc-builtins.so",
    "libcuda.so",
];

/// Where the dynamic loader looks for them: `LD_LIBRARY_PATH`, then the usual places.
fn search_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("LD_LIBRARY_PATH")
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default();
    for d in [
        "/usr/local/cuda/lib64",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
    ] {
        dirs.push(PathBuf::from(d));
    }
    dirs
}

/// Each library's file in `dirs` (symbolic links resolved; for each stem, the first
/// directory that has one).
fn library_files(dirs: &[PathBuf]) -> BTreeSet<PathBuf> {
    let mut files = BTreeSet::new();
    for stem in STEMS {
        for d in dirs {
            let Ok(entries) = std::fs::read_dir(d) else {
                continue;
            };
            let found: Vec<PathBuf> = entries
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with(stem))
                .filter_map(|e| std::fs::canonicalize(e.path()).ok())
                .collect();
            if !found.is_empty() {
                files.extend(found);
                break;
            }
        }
    }
    files
}

/// With `MAMBA3_READAHEAD=1`, start reading the libraries, a thread per file so that a disk
/// that serves several reads at once serves them all (once per process). Nothing waits for
/// them, and a file that cannot be read is skipped: this only saves time.
pub fn start() {
    static STARTED: std::sync::Once = std::sync::Once::new();
    if std::env::var("MAMBA3_READAHEAD").as_deref() != Ok("1") {
        return;
    }
    STARTED.call_once(|| {
        std::thread::spawn(|| {
            for f in library_files(&search_dirs()) {
                std::thread::spawn(move || {
                    let bytes = read_through(&f);
                    crate::timeline::mark(|| {
                        format!("read ahead: {} ({} MB)", f.display(), bytes >> 20)
                    });
                });
            }
        });
    });
}

/// Read `path` to its end (into the page cache; the bytes are dropped). Returns how many
/// bytes were read (0 when it cannot be opened).
fn read_through(path: &std::path::Path) -> usize {
    let Ok(mut file) = std::fs::File::open(path) else {
        return 0;
    };
    let mut buf = vec![0u8; 8 << 20];
    let mut bytes = 0usize;
    while let Ok(n @ 1..) = file.read(&mut buf) {
        bytes += n;
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_each_library_once_in_the_first_directory_that_has_it() {
        let root = std::env::temp_dir().join(format!("mamba3-readahead-{}", std::process::id()));
        let (a, b) = (root.join("a"), root.join("b"));
        for d in [&a, &b] {
            std::fs::create_dir_all(d).unwrap();
        }
        let write = |p: PathBuf| std::fs::write(p, b"x").unwrap();
        write(a.join("libnvrtc.so.13.0.88"));
        std::os::unix::fs::symlink("libnvrtc.so.13.0.88", a.join("libnvrtc.so.13")).unwrap();
        write(a.join("libnvrtc.alt.so.13")); // another library
        write(a.join("libcudart.so.13")); // not libcuda
        write(b.join("libnvrtc.so.12")); // a later directory: not read
        write(b.join("libcublasLt.so.13"));
        let found = library_files(&[root.join("missing"), a.clone(), b.clone()]);
        let names: Vec<String> = found
            .iter()
            .map(|p| {
                p.strip_prefix(std::fs::canonicalize(&root).unwrap())
                    .unwrap()
            })
            .map(|p| p.to_string_lossy().into_owned())
            .collect();
        std::fs::remove_dir_all(&root).unwrap();
        assert_eq!(names, ["a/libnvrtc.so.13.0.88", "b/libcublasLt.so.13"]);
    }

    #[test]
    fn reads_a_file_to_its_end() {
        let p = std::env::temp_dir().join(format!("mamba3-read-through-{}", std::process::id()));
        let len = (8 << 20) + 12_345; // more than one buffer
        std::fs::write(&p, vec![7u8; len]).unwrap();
        let read = read_through(&p);
        std::fs::remove_file(&p).unwrap();
        assert_eq!(read, len);
        assert_eq!(read_through(&p), 0, "a file that is gone reads as nothing");
    }
}
