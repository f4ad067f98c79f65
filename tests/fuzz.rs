//! Mutation fuzzing of every file the engine reads: `model.safetensors`,
//! `pytorch_model.bin` (the zip, and the pickle inside it), `config.json`, state files and
//! `tokenizer.json`. Each mutant goes through the loader a user's command would use, then
//! (when it loads) through a short generation. What must hold for every one: no panic, no
//! crash (an abort ends the test binary), no hang (a watchdog fails the test when a mutant
//! takes more than 20 s), and no non-finite value accepted (weights and states that load
//! are finite; a generation that succeeds came from finite logits).
//!
//! `FUZZ_MUTANTS` (default 400, split over the formats) and `FUZZ_SEED` (default 1) size
//! and vary the run; `scripts/fuzz` runs it longer with a random seed.

use mamba3::engine::{Device, LogitsWant, Model};
use mamba3::model::finite::first_non_finite;
use mamba3::model::DType;
use mamba3::text::generate::{all_finite, generate};
use mamba3::text::{Continuation, GenParams, SamplingParams, Tokenizer};
use std::io::{Read, Write};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn shared_fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../shared/fixtures")
        .join(name)
}

fn local_fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// xorshift64*: reproducible mutants from a seed.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Values that break parsers: boundaries, signs, NaN/infinity bit patterns.
const INTERESTING: [u8; 10] = [0x00, 0xff, 0x7f, 0x80, 0x7f, 0xc0, 0x01, b'"', b'{', b'['];

/// A byte-level mutant of `data`; `hot` is a prefix worth most of the attention (a
/// safetensors header), where mutations are aimed half the time.
fn mutate_bytes(rng: &mut Rng, data: &[u8], hot: usize) -> Vec<u8> {
    let mut d = data.to_vec();
    let pos = |rng: &mut Rng, len: usize| {
        if hot > 0 && rng.below(2) == 0 {
            rng.below(hot.min(len))
        } else {
            rng.below(len)
        }
    };
    for _ in 0..1 + rng.below(4) {
        if d.is_empty() {
            d.push(rng.next() as u8);
            continue;
        }
        match rng.below(8) {
            0 => {
                let i = pos(rng, d.len());
                d[i] ^= 1 << rng.below(8);
            }
            1 => {
                let i = pos(rng, d.len());
                d[i] = INTERESTING[rng.below(INTERESTING.len())];
            }
            2 => d.truncate(rng.below(d.len())),
            3 => {
                let i = pos(rng, d.len());
                let n = 1 + rng.below(16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                d.splice(i..i, bytes);
            }
            4 => {
                let i = pos(rng, d.len());
                let n = rng.below(64).min(d.len() - i);
                d.drain(i..i + n);
            }
            5 => {
                // A run of 0xff: NaN f32/bf16 values in a data region.
                let i = rng.below(d.len());
                let n = (1 + rng.below(8)).min(d.len() - i);
                d[i..i + n].fill(0xff);
            }
            6 => {
                let i = pos(rng, d.len());
                let n = (1 + rng.below(32)).min(d.len() - i);
                let chunk = d[i..i + n].to_vec();
                let j = rng.below(d.len());
                d.splice(j..j, chunk);
            }
            _ => {
                // An ASCII digit changed: lengths, offsets and shapes in a header.
                let digits: Vec<usize> = (0..hot.min(d.len()))
                    .filter(|&i| d[i].is_ascii_digit())
                    .collect();
                if let Some(&i) = digits.get(rng.below(digits.len().max(1))) {
                    d[i] = b'0' + rng.below(10) as u8;
                    if rng.below(3) == 0 {
                        d.splice(i..i, *b"999999");
                    }
                }
            }
        }
    }
    d
}

/// Replacement values for a JSON node.
fn wild_value(rng: &mut Rng) -> serde_json::Value {
    use serde_json::json;
    match rng.below(14) {
        0 => json!(10_000_000u64),
        1 => json!(-1),
        2 => json!(0),
        3 => json!(1e300),
        4 => json!(u64::MAX),
        5 => json!(4_294_967_297u64),
        6 => json!("x"),
        7 => json!(null),
        8 => json!([]),
        9 => json!({}),
        10 => json!(true),
        11 => json!(0.5),
        12 => json!(65_537),
        _ => json!([[[[[[[[1]]]]]]]]),
    }
}

/// A structural mutant of a JSON document: a node replaced or removed, at a random
/// depth (up to `depth` containers down).
fn mutate_json(rng: &mut Rng, v: &mut serde_json::Value, depth: usize) {
    use serde_json::Value;
    let is_container = |x: &Value| x.is_object() || x.is_array();
    // Which child to go down into, decided before borrowing it.
    let down = match &*v {
        Value::Object(m) if !m.is_empty() => {
            let k = m.keys().nth(rng.below(m.len())).cloned().unwrap();
            is_container(&m[&k]).then_some(Ok(k))
        }
        Value::Array(a) if !a.is_empty() => {
            let i = rng.below(a.len());
            is_container(&a[i]).then_some(Err(i))
        }
        _ => None,
    };
    if let (true, Some(child)) = (depth > 0 && rng.below(4) != 0, down) {
        let next = match child {
            Ok(k) => v.get_mut(&k).unwrap(),
            Err(i) => v.get_mut(i).unwrap(),
        };
        return mutate_json(rng, next, depth - 1);
    }
    match v {
        Value::Object(m) if !m.is_empty() && rng.below(3) == 0 => {
            let k = m.keys().nth(rng.below(m.len())).cloned().unwrap();
            m.remove(&k);
        }
        Value::Object(m) if !m.is_empty() => {
            let k = m.keys().nth(rng.below(m.len())).cloned().unwrap();
            m.insert(k, wild_value(rng));
        }
        Value::Array(a) if !a.is_empty() => {
            let i = rng.below(a.len());
            a[i] = wild_value(rng);
        }
        other => *other = wild_value(rng),
    }
}

/// A JSON file's mutant: structural most of the time, else its bytes.
fn mutate_json_text(rng: &mut Rng, text: &[u8]) -> Vec<u8> {
    if rng.below(4) == 0 {
        return mutate_bytes(rng, text, text.len());
    }
    let mut v: serde_json::Value = serde_json::from_slice(text).unwrap();
    for _ in 0..1 + rng.below(3) {
        mutate_json(rng, &mut v, 5);
    }
    serde_json::to_vec(&v).unwrap()
}

/// The zip of a `pytorch_model.bin` with its pickle (`*/data.pkl`) mutated and every
/// entry stored again, so that the mutant gets past the zip's checksums to the unpickler.
fn mutate_pickle(rng: &mut Rng, zip_bytes: &[u8]) -> Vec<u8> {
    let mut zin = zip::ZipArchive::new(std::io::Cursor::new(zip_bytes)).unwrap();
    let mut out = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let opts =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    for i in 0..zin.len() {
        let mut f = zin.by_index(i).unwrap();
        let name = f.name().to_string();
        let mut data = Vec::new();
        f.read_to_end(&mut data).unwrap();
        if name.ends_with("data.pkl") {
            data = mutate_bytes(rng, &data, data.len());
        } else if name.contains("/data/") && rng.below(4) == 0 {
            data = mutate_bytes(rng, &data, 0);
        }
        out.start_file(name, opts).unwrap();
        out.write_all(&data).unwrap();
    }
    out.finish().unwrap().into_inner()
}

#[derive(Default)]
struct Tally {
    mutants: usize,
    loaded: usize,
    refused: usize,
    panics: Vec<String>,
    non_finite_accepted: Vec<String>,
}

/// A short greedy generation from `state`'s model; `Ok(true)` when it succeeded and its
/// logits were finite, `Ok(false)` when it succeeded on non-finite logits (a failure of
/// the contract), `Err` when it was refused (which is fine).
fn generation_is_sound(model: &Model, state: &mut mamba3::State) -> mamba3::Result<bool> {
    let params = GenParams {
        sampling: SamplingParams {
            temperature: 0.0,
            ..Default::default()
        },
        max_tokens: 3,
        ..Default::default()
    };
    let prompt = [1u32, 2, 3];
    let mut check = state.clone();
    let mut cont = Continuation::new(&params, &prompt, None);
    generate(
        model,
        state,
        &prompt,
        None,
        &mut cont,
        16,
        false,
        |_, _| {},
        |_| {},
    )?;
    // The same prompt again, straight from the engine: what the loop sampled from.
    let vocab = model.dims().vocab_size;
    let logits = model.prefill(&prompt, &mut check, LogitsWant::Last)?;
    Ok(all_finite(&logits.data[..vocab]))
}

/// Load a model directory as `generate` does and run it; record what happened.
fn try_model_dir(dir: &Path, what: &str, tally: &mut Tally) {
    let model = match Model::load(dir, Device::Cpu, DType::F32) {
        Ok(m) => m,
        Err(_) => {
            tally.refused += 1;
            return;
        }
    };
    tally.loaded += 1;
    let Some(weights) = model.mamba3() else {
        return;
    };
    for (name, raw) in weights.to_tensors() {
        let data = raw.to_float(&name, DType::F32).unwrap();
        if let Some((i, v)) = first_non_finite(&data) {
            tally
                .non_finite_accepted
                .push(format!("{what}: weight {name}[{i}] = {v} loaded"));
        }
    }
    let mut st = model.new_state();
    if let Ok(false) = generation_is_sound(&model, &mut st) {
        tally
            .non_finite_accepted
            .push(format!("{what}: generation accepted non-finite logits"));
    }
}

fn copy_model(from: &Path, to: &Path, weights: &str) {
    std::fs::copy(from.join("config.json"), to.join("config.json")).unwrap();
    std::fs::copy(from.join(weights), to.join(weights)).unwrap();
}

/// The length of a safetensors file's header (its hot region for mutations).
fn safetensors_header_len(b: &[u8]) -> usize {
    8 + u64::from_le_bytes(b[..8].try_into().unwrap()) as usize
}

fn run_one(format: usize, rng: &mut Rng, work: &Path, tally: &mut Tally) {
    let tiny = shared_fixture("siso-tiny");
    let _ = std::fs::remove_dir_all(work);
    std::fs::create_dir_all(work).unwrap();
    match format {
        0 => {
            let bytes = std::fs::read(tiny.join("model.safetensors")).unwrap();
            let hot = safetensors_header_len(&bytes);
            copy_model(&tiny, work, "model.safetensors");
            std::fs::write(
                work.join("model.safetensors"),
                mutate_bytes(rng, &bytes, hot),
            )
            .unwrap();
            try_model_dir(work, "model.safetensors", tally);
        }
        1 => {
            let bytes = std::fs::read(tiny.join("pytorch_model.bin")).unwrap();
            let mutant = if rng.below(3) == 0 {
                mutate_bytes(rng, &bytes, 0)
            } else {
                mutate_pickle(rng, &bytes)
            };
            copy_model(&tiny, work, "pytorch_model.bin");
            std::fs::write(work.join("pytorch_model.bin"), mutant).unwrap();
            try_model_dir(work, "pytorch_model.bin", tally);
        }
        2 => {
            let text = std::fs::read(tiny.join("config.json")).unwrap();
            copy_model(&tiny, work, "model.safetensors");
            std::fs::write(work.join("config.json"), mutate_json_text(rng, &text)).unwrap();
            try_model_dir(work, "config.json", tally);
        }
        3 => {
            let model = Model::load(&tiny, Device::Cpu, DType::F32).unwrap();
            let mut st = model.new_state();
            model
                .prefill(&[5, 6, 7, 8], &mut st, LogitsWant::None)
                .unwrap();
            let good = work.join("good.safetensors");
            st.save(&good).unwrap();
            let bytes = std::fs::read(&good).unwrap();
            let hot = safetensors_header_len(&bytes);
            let path = work.join("state.safetensors");
            std::fs::write(&path, mutate_bytes(rng, &bytes, hot)).unwrap();
            match model.load_state(&path) {
                Err(_) => tally.refused += 1,
                Ok(mut s) => {
                    tally.loaded += 1;
                    for (name, raw) in s.tensors().unwrap() {
                        let data = raw.to_float(&name, DType::F32).unwrap();
                        if first_non_finite(&data).is_some() {
                            tally
                                .non_finite_accepted
                                .push(format!("state: {name} non-finite, loaded"));
                        }
                    }
                    if let Ok(false) = generation_is_sound(&model, &mut s) {
                        tally
                            .non_finite_accepted
                            .push("state: generation accepted non-finite logits".into());
                    }
                }
            }
        }
        _ => {
            let src = local_fixture("byte-tokenizer");
            let text = std::fs::read(src.join("tokenizer.json")).unwrap();
            std::fs::copy(
                src.join("tokenizer_config.json"),
                work.join("tokenizer_config.json"),
            )
            .unwrap();
            let path = work.join("tokenizer.json");
            std::fs::write(&path, mutate_json_text(rng, &text)).unwrap();
            match Tokenizer::from_file(&path) {
                Err(_) => tally.refused += 1,
                Ok(t) => {
                    tally.loaded += 1;
                    for s in ["In the beginning", "", "ü\u{0}\u{1F600} <|eot_id|>"] {
                        if let Ok(ids) = t.encode(s, true) {
                            let _ = t.decode(&ids, false);
                        }
                    }
                    let _ = t.decode(&[0, 1, 268, 100_000], true);
                    let _ = t.max_token_bytes();
                }
            }
            let source = mamba3::text::ModelSource::Dir(work.to_path_buf());
            let _ = source.load_text(None);
        }
    }
}

const FORMATS: [&str; 5] = [
    "model.safetensors",
    "pytorch_model.bin",
    "config.json",
    "state file",
    "tokenizer.json",
];

#[test]
fn mutants_of_every_format_never_panic_hang_or_pass_non_finite_values() {
    let n: usize = std::env::var("FUZZ_MUTANTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(400);
    let seed: u64 = std::env::var("FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    // Refused loads print nothing, but the panics we look for would: keep their message
    // and location, without the default hook's output for each.
    let last_panic = Arc::new(Mutex::new(String::new()));
    let lp = last_panic.clone();
    std::panic::set_hook(Box::new(move |info| {
        *lp.lock().unwrap() = info.to_string();
    }));
    let progress = Arc::new(AtomicUsize::new(0));
    let tally = Arc::new(Mutex::new(Tally::default()));
    let (p, t, lp) = (progress.clone(), tally.clone(), last_panic.clone());
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().to_path_buf();
    let worker = std::thread::spawn(move || {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        for i in 0..n {
            let format = i % FORMATS.len();
            let mut local = Tally::default();
            let r = catch_unwind(AssertUnwindSafe(|| {
                run_one(format, &mut rng, &work, &mut local)
            }));
            let mut tl = t.lock().unwrap();
            tl.mutants += 1;
            tl.loaded += local.loaded;
            tl.refused += local.refused;
            tl.non_finite_accepted.extend(local.non_finite_accepted);
            if r.is_err() {
                let msg = lp.lock().unwrap().clone();
                tl.panics.push(format!(
                    "mutant {i} ({}, seed {seed}): {msg}",
                    FORMATS[format]
                ));
            }
            p.store(i + 1, Ordering::SeqCst);
        }
    });
    // The watchdog: every mutant must finish within 20 s.
    let (mut last, mut since) = (0, Instant::now());
    while !worker.is_finished() {
        std::thread::sleep(Duration::from_millis(50));
        let now = progress.load(Ordering::SeqCst);
        if now != last {
            (last, since) = (now, Instant::now());
        }
        assert!(
            since.elapsed() < Duration::from_secs(20),
            "mutant {now} ({}, seed {seed}) hangs",
            FORMATS[now % FORMATS.len()]
        );
    }
    let _ = std::panic::take_hook();
    worker.join().unwrap();
    let t = tally.lock().unwrap();
    println!(
        "{} mutants (seed {seed}): {} loaded, {} refused, {} panics, {} non-finite accepted",
        t.mutants,
        t.loaded,
        t.refused,
        t.panics.len(),
        t.non_finite_accepted.len()
    );
    assert_eq!(t.mutants, n);
    assert!(t.panics.is_empty(), "panics:\n{}", t.panics.join("\n"));
    assert!(
        t.non_finite_accepted.is_empty(),
        "non-finite values accepted:\n{}",
        t.non_finite_accepted.join("\n")
    );
    // The mutants reached past the first checks: some loaded, some were refused.
    assert!(
        t.loaded > 0 && t.refused > 0,
        "{} / {}",
        t.loaded,
        t.refused
    );
}
