//! Training with a BPE tokenizer: the tokenizer trained on the text round-trips any input
//! and is the same file every time; a tiny model learns with it; a resumed run equals the
//! unbroken one; `mamba3 train --tokenizer bpe` writes a checkpoint that `mamba3 generate`
//! runs; bad settings fail with a clear message.
mod common;
use common::{sentences_text, short_run};

use mamba3::model::Config;
use mamba3::text::tokenizer::Tokenizer;
use mamba3::train::data::Dataset;
use mamba3::train::tokenizer::{TokenizerSpec, TrainTokenizer};
use mamba3::train::trainer::{RunConfig, Trainer};
use mamba3::train::CpuBackend;
use proptest::prelude::*;
use std::path::Path;

/// A fixed text with structure a small model can learn, some of it beyond ASCII.
fn text() -> Vec<u8> {
    let mut t = sentences_text(
        &[
            "In the beginning was the word. ",
            "And the light shone in the darkness. ",
            "The quick brown fox jumps over the lazy dog. ",
            "Seven swans a swimming, six geese a laying. ",
            "She sells sea shells by the sea shore.\n",
            "Ça coûte 5 € — un café naïve. ",
            "Ελληνικά, русский, 日本語 and 🦀 crabs.\n",
        ],
        60_000,
    );
    t.push(b'\n'); // as a file read for training ends
    t
}

const VAL_EVERY: usize = 5;

fn bpe(vocab_size: usize) -> TrainTokenizer {
    Dataset::prepare(&text(), VAL_EVERY, &TokenizerSpec::Bpe { vocab_size })
        .unwrap()
        .tokenizer
}

/// The BPE as the inference side loads it (`mamba3 generate/serve --model DIR`).
fn served(tok: &TrainTokenizer) -> (tempfile::TempDir, Tokenizer) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("tokenizer.json");
    std::fs::write(&p, tok.json().as_bytes()).unwrap();
    let t = Tokenizer::from_file(&p).unwrap();
    (dir, t)
}

const TRICKY: &[&str] = &[
    "",
    " ",
    "  leading and trailing  ",
    "\n\n\t\r\n",
    "don't 'quote' \"these\"",
    "In the beginning was the word.",
    "naïve café — 5 €, ÇA!",
    "日本語のテキスト 🦀🦀 👩‍👩‍👧",
    "\u{0}\u{1}\u{7f} control",
    "the the the the the the the the",
];

#[test]
fn bpe_round_trips_any_text_and_matches_the_inference_side() {
    let tok = bpe(400);
    let (_dir, inference) = served(&tok);
    assert_eq!(inference.vocab_size(), tok.vocab_size());
    assert!(tok.vocab_size() > 256, "no merges learnt");
    let check_str = |s: &str| {
        let e = tok.encode(s.as_bytes(), true).unwrap();
        // What the model is trained on is what it is served.
        assert_eq!(e.ids, inference.encode(s, false).unwrap(), "{s:?}");
        assert_eq!(inference.decode(&e.ids, false).unwrap(), s);
        assert_eq!(tok.decode_bytes(&e.ids).unwrap(), s.as_bytes());
        assert_eq!(e.ends.last().copied().unwrap_or(0), s.len());
    };
    for s in TRICKY {
        check_str(s);
    }
    // The text's most frequent word became one token.
    let word = tok.encode(b" the", false).unwrap().ids;
    assert_eq!(word.len(), 1, "{word:?}");
    let cases = ProptestConfig {
        cases: 300,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    proptest!(cases.clone(), |(s in any::<String>())| check_str(&s));
    // Bytes that are not UTF-8 still encode, one token per stray byte, and come back.
    proptest!(cases, |(b in proptest::collection::vec(any::<u8>(), 0..300))| {
        let e = tok.encode(&b, true).unwrap();
        prop_assert_eq!(tok.decode_bytes(&e.ids).unwrap(), b.clone());
        prop_assert_eq!(e.ends.len(), e.ids.len());
        prop_assert!(e.ends.windows(2).all(|w| w[0] <= w[1]));
        prop_assert_eq!(e.ends.last().copied().unwrap_or(0), b.len());
    });
    let odd = b"caf\xe9 \xff\xfe the \xc3";
    let e = tok.encode(odd, false).unwrap();
    assert_eq!(tok.decode_bytes(&e.ids).unwrap(), odd);
}

#[test]
fn bpe_training_is_deterministic() {
    let a = bpe(400).json().into_owned();
    let b = bpe(400).json().into_owned();
    assert!(a == b, "two trainings on the same text differ");
    let c = bpe(300).json().into_owned();
    assert_ne!(a, c);
    // GPT-2's recipe: byte-level pieces and no normaliser, so decoding inverts encoding.
    let v: serde_json::Value = serde_json::from_str(&a).unwrap();
    assert_eq!(v["model"]["type"], "BPE");
    assert_eq!(v["pre_tokenizer"]["type"], "ByteLevel");
    assert_eq!(v["decoder"]["type"], "ByteLevel");
    assert!(v["normalizer"].is_null());
}

#[test]
fn the_split_holds_out_the_same_bytes_whatever_the_tokenizer() {
    let bytes = Dataset::from_bytes(&text(), VAL_EVERY);
    let bpe = Dataset::prepare(&text(), VAL_EVERY, &TokenizerSpec::Bpe { vocab_size: 400 });
    let bpe = bpe.unwrap();
    let spell = |ids: &[u32]| bpe.tokenizer.decode_bytes(ids).unwrap();
    let as_bytes = |ids: &[u32]| ids.iter().map(|&b| b as u8).collect::<Vec<u8>>();
    assert_eq!(spell(&bpe.val), as_bytes(&bytes.val));
    assert_eq!(spell(&bpe.train), as_bytes(&bytes.train));
    assert_eq!(
        (bpe.train_bytes, bpe.val_bytes),
        (bytes.train.len(), bytes.val.len())
    );
    assert!(
        bpe.val.len() * 2 < bytes.val.len(),
        "BPE tokens should span bytes"
    );
    // The bytes the validation windows predict are exactly the text of their targets.
    let (tokens, span) = bpe.val_window_span(16, 24);
    assert_eq!(tokens, 16 * 24);
    assert_eq!(span, spell(&bpe.val[1..=tokens]).len());
    assert_eq!(bytes.val_window_span(16, 24), (16 * 24, 16 * 24));
}

/// A tokenizer.json that is not byte-level (words, an unknown token) is used as is.
#[test]
fn a_word_level_tokenizer_file_is_used_as_is() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("words.json");
    let vocab: serde_json::Map<String, serde_json::Value> = ["[UNK]", "the", "sea", ".", "fox"]
        .iter()
        .enumerate()
        .map(|(i, w)| (w.to_string(), i.into()))
        .collect();
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    });
    std::fs::write(&p, json.to_string()).unwrap();
    let d = Dataset::prepare(&text(), VAL_EVERY, &TokenizerSpec::File(p.clone())).unwrap();
    assert_eq!(d.tokenizer.vocab_size(), 5);
    assert!(d.counts[1] > 0 && d.counts[2] > 0 && d.counts[0] > 0);
    let e = d.tokenizer.encode(b"the sea, the fox", true).unwrap();
    assert_eq!(e.ids, [1, 2, 0, 1, 4]);
    assert_eq!(e.ends, [3, 7, 8, 12, 16]);
    assert!(d.tokenizer.decode_bytes(&e.ids).is_none());
    // It cannot spell a stray byte: say so.
    let err = d.tokenizer.encode(b"the \xff sea", false).err().unwrap();
    assert!(err.to_string().contains("0xFF"), "{err}");
}

fn run_config(tok: &TrainTokenizer, spec: &str, steps: u64, accum: usize) -> RunConfig {
    let mut model = Config::synthetic(32, 2, 16, 16, 2, 1, tok.vocab_size());
    model.ssm_cfg.chunk_size = 16;
    RunConfig {
        tokenizer: spec.into(),
        val_every_block: VAL_EVERY,
        ..short_run(model, steps, 4, accum, 24)
    }
}

/// Validation loss (nats/token) and bits/byte before and after `steps` steps.
fn train(spec: &TokenizerSpec, steps: u64) -> ((f64, f64), (f64, f64), f64) {
    let data = Dataset::prepare(&text(), VAL_EVERY, spec).unwrap();
    let rc = run_config(&data.tokenizer, &spec.to_string(), steps, 1);
    let mut t = Trainer::with_data(rc, CpuBackend, data).unwrap();
    let before = t.validate().unwrap();
    while t.progress.step < t.run.steps {
        t.step().unwrap();
    }
    let after = t.validate().unwrap();
    let (b0, b1) = (t.bits_per_byte(before), t.bits_per_byte(after));
    ((before, b0), (after, b1), t.progress.unigram_bpb)
}

#[test]
fn a_tiny_model_learns_with_bpe() {
    let steps = 40;
    let ((l0, b0), (l1, b1), uni) = train(&TokenizerSpec::Bpe { vocab_size: 400 }, steps);
    eprintln!(
        "BPE: validation {l0:.3} -> {l1:.3} nats/token, {b0:.3} -> {b1:.3} bits/byte \
         (unigram {uni:.3} bits/byte) in {steps} steps"
    );
    let ((_, c0), (_, c1), cuni) = train(&TokenizerSpec::Byte, steps);
    eprintln!("bytes: {c0:.3} -> {c1:.3} bits/byte (unigram {cuni:.3}) in {steps} steps");
    // From about ln 400 ≈ 6 nats/token at the start to well under the unigram baseline.
    assert!(l0 > 5.0, "initial loss {l0}");
    assert!(b1 < 0.5 * b0, "{b0} -> {b1} bits/byte");
    assert!(b1 < 0.75 * uni, "{b1} bits/byte against the unigram {uni}");
}

fn write_text(dir: &Path) -> std::path::PathBuf {
    let p = dir.join("text.txt");
    std::fs::write(&p, text()).unwrap();
    p
}

#[test]
fn resume_with_bpe_equals_the_unbroken_run() {
    let tmp = tempfile::tempdir().unwrap();
    let file = write_text(tmp.path());
    let spec = TokenizerSpec::Bpe { vocab_size: 400 };
    let tok = bpe(400);
    let mut rc = run_config(&tok, &spec.to_string(), 8, 2);
    rc.data = vec![file.clone()];
    rc.eval_every = 4;
    let mut full = Trainer::new(rc.clone(), CpuBackend).unwrap();
    assert!(!full.dataset().tokenizer.is_byte());
    full.train(&tmp.path().join("full"), &mut |_, _, _, _, _| {}, None)
        .unwrap();

    let dir = tmp.path().join("ckpt");
    let mut first = Trainer::new(rc, CpuBackend).unwrap();
    while first.progress.step < 3 {
        first.step().unwrap();
    }
    std::fs::create_dir_all(&dir).unwrap();
    first.save(&dir).unwrap();
    drop(first);
    // The tokenizer comes back from the checkpoint, not from a new training: without
    // the file, resuming fails.
    let saved = std::fs::read(dir.join("tokenizer.json")).unwrap();
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    let err = Trainer::resume(&dir, CpuBackend, None).err().unwrap();
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
    std::fs::write(dir.join("tokenizer.json"), &saved).unwrap();

    let mut second = Trainer::resume(&dir, CpuBackend, None).unwrap();
    assert_eq!(second.progress.step, 3);
    second.train(&dir, &mut |_, _, _, _, _| {}, None).unwrap();
    assert_eq!(second.progress.train_loss, full.progress.train_loss);
    assert_eq!(second.progress.val_loss, full.progress.val_loss);
    assert_eq!(second.progress.val_bpb, full.progress.val_bpb);
    assert_eq!(
        second.params, full.params,
        "resumed run differs from the unbroken one"
    );
    assert_eq!(second.opt.m, full.opt.m);
    assert_eq!(second.opt.v, full.opt.v);
    let saved_run = mamba3::train::trainer::saved_run(&dir).unwrap();
    assert_eq!(saved_run.tokenizer, "bpe:400");
    assert_eq!(saved_run.model.vocab_size, tok.vocab_size());
    assert_eq!(std::fs::read(dir.join("tokenizer.json")).unwrap(), saved);
    assert_eq!(saved, tok.json().as_bytes());
}

/// Run the binary with whitespace-separated arguments (the temporary paths have no spaces).
fn mamba3(args: &str) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_mamba3"))
        .args(args.split_whitespace())
        .output()
        .unwrap()
}

const TINY: &str = "--d-model 32 --n-layer 1 --d-state 16 --headdim 16 --chunk-size 16 \
                    --batch 4 --seq-len 32 --threads 2 --val-every-block 5";

#[test]
fn cli_trains_a_bpe_model_that_generate_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let f = write_text(tmp.path());
    let (f, out) = (f.display(), tmp.path().join("run"));
    let o = out.display();
    let r = mamba3(&format!(
        "train --data {f} --out {o} {TINY} --steps 6 --eval-every 3 --eval-windows 8 \
         --tokenizer bpe --vocab-size 400"
    ));
    let log = String::from_utf8_lossy(&r.stderr);
    assert!(r.status.success(), "{log}");
    assert!(log.contains("bits/byte"), "{log}");
    let tok = Tokenizer::from_file(&out.join("tokenizer.json")).unwrap();
    assert_eq!(tok.vocab_size(), bpe(400).vocab_size());
    let cfg = Config::from_file(&out.join("config.json")).unwrap();
    assert_eq!(cfg.vocab_size, tok.vocab_size());
    let g = mamba3(&format!(
        "generate --model {o} The --max-tokens 12 --seed 1"
    ));
    assert!(g.status.success(), "{}", String::from_utf8_lossy(&g.stderr));
    assert!(!g.stdout.is_empty());

    // The tokenizer.json just written, given as a file, is used as is.
    let again = tmp.path().join("again");
    let r = mamba3(&format!(
        "train --data {f} --out {} {TINY} --steps 1 --eval-every 0 --tokenizer {o}/tokenizer.json",
        again.display()
    ));
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(
        std::fs::read(again.join("tokenizer.json")).unwrap(),
        std::fs::read(out.join("tokenizer.json")).unwrap()
    );
}

#[test]
fn bad_tokenizer_settings_fail_clearly() {
    let tmp = tempfile::tempdir().unwrap();
    let file = write_text(tmp.path());
    let junk = tmp.path().join("junk.json");
    std::fs::write(&junk, "{\"model\": 3}").unwrap();
    let fails = |extra: &str, want: &str| {
        let r = mamba3(&format!(
            "train --data {} --out {} --steps 1 {extra}",
            file.display(),
            tmp.path().join("run").display()
        ));
        let err = String::from_utf8_lossy(&r.stderr);
        assert_eq!(r.status.code(), Some(1), "{extra}: {err}");
        assert!(err.contains(want), "{extra}: {err}");
    };
    fails("--tokenizer bpe --vocab-size 256", "257..=65536");
    fails("--tokenizer bpe --vocab-size 100000", "257..=65536");
    fails(
        "--vocab-size 4096",
        "--vocab-size applies to --tokenizer bpe",
    );
    fails("--tokenizer /nonexistent/tok.json", "/nonexistent/tok.json");
    fails(&format!("--tokenizer {}", junk.display()), "junk.json");

    // The same through the library.
    let text = text();
    for n in [0, 256, 65_537] {
        let e = Dataset::prepare(&text, VAL_EVERY, &TokenizerSpec::Bpe { vocab_size: n });
        assert!(e.err().unwrap().to_string().contains("257..=65536"));
    }
    let e = Dataset::prepare(&text, VAL_EVERY, &TokenizerSpec::File(junk.clone()));
    assert!(e
        .err()
        .unwrap()
        .to_string()
        .contains("not a tokenizer.json"));
    // A model whose vocabulary is not the tokenizer's is refused.
    let data = Dataset::prepare(&text, VAL_EVERY, &TokenizerSpec::Bpe { vocab_size: 400 });
    let data = data.unwrap();
    let mut rc = run_config(&data.tokenizer, "bpe:400", 1, 1);
    rc.model.vocab_size = 256;
    let e = Trainer::with_data(rc, CpuBackend, data).err().unwrap();
    assert!(e.to_string().contains("vocab_size"), "{e}");
}
