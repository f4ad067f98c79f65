//! `MAMBA3_TIMELINE=1`: print to stderr, as it happens, when each stage of starting up
//! ends — the checkpoint read, the device opened, the kernels compiled or loaded, the
//! weights uploaded, the work buffers of the first pass, each pass — in seconds since
//! the process started and milliseconds since the previous mark. `MAMBA3_TIMELINE=2`
//! also waits for the GPU after every step of an eager pass (not inside a graph capture)
//! and marks it, so that a one-time cost (a library loading its kernels on first use, a
//! first allocation) shows against the step that paid it. Off by default: a diagnostic
//! for the start-up target, which a process that has finished cannot explain afterwards.

use std::sync::{Mutex, OnceLock};
use std::time::Instant;

fn start() -> Instant {
    static START: OnceLock<Instant> = OnceLock::new();
    *START.get_or_init(Instant::now)
}

/// The timeline's level: 0 off, 1 stages, 2 stages and every GPU step (synchronising).
pub fn level() -> u8 {
    crate::options::env().timeline
}

/// Note the process start (the first call sets the origin; `main` makes it early).
pub fn begin() {
    if level() > 0 {
        start();
        mark(|| "process started".into());
    }
}

/// Print `what()` with the time since the start and since the previous mark, when the
/// timeline is on (the label is only formatted then).
pub fn mark(what: impl FnOnce() -> String) {
    if level() == 0 {
        return;
    }
    static LAST: Mutex<Option<Instant>> = Mutex::new(None);
    let now = Instant::now();
    let since = {
        // (a poisoned lock only loses the delta of one line)
        let mut last = LAST.lock().unwrap_or_else(|p| p.into_inner());
        let since = last.map_or(0.0, |t| now.duration_since(t).as_secs_f64() * 1e3);
        *last = Some(now);
        since
    };
    eprintln!(
        "[timeline] {:8.3} s {:+9.1} ms  {}",
        now.duration_since(start()).as_secs_f64(),
        since,
        what()
    );
}

/// Run `f` and mark its end as `what`.
pub fn stage<T>(what: &str, f: impl FnOnce() -> T) -> T {
    let out = f();
    mark(|| what.to_string());
    out
}
