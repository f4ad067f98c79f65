//! The shipped default model: its files materialise, its tokenizer.json is read by the
//! project's `tokenizers`-based text layer as the byte tokenizer it was trained with, and
//! the weights are the trained ones (English Bible text is cheap for it, noise is not).

use mamba3::model::default_model;
use mamba3::text::tokenizer::Tokenizer;
use mamba3::{DType, Device, LogitsWant, Model};

#[test]
fn tokenizer_json_is_the_byte_tokenizer() {
    let dir = default_model::dir().unwrap();
    let tok = Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
    let text = "In the beginning God created the heaven and the earth.\n\tÉ naïve — ✓";
    let ids = tok.encode(text, false).unwrap();
    let bytes: Vec<u32> = text.bytes().map(u32::from).collect();
    assert_eq!(ids, bytes);
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
    // `mamba3 train` writes this very file for a byte-level run.
    let file = std::fs::read_to_string(dir.join("tokenizer.json")).unwrap();
    assert_eq!(file, mamba3::train::data::byte_tokenizer_json());
}

/// Mean bits per byte the model spends on `text` (predicting bytes 1.. from a fresh state).
fn bits_per_byte(model: &Model, text: &[u8]) -> f64 {
    let ids: Vec<u32> = text.iter().map(|&b| b as u32).collect();
    let mut st = model.new_state();
    let lg = model.prefill(&ids, &mut st, LogitsWant::All).unwrap();
    let mut bits = 0.0;
    for (i, &next) in ids[1..].iter().enumerate() {
        let row = lg.row(i);
        let m = row.iter().cloned().fold(f32::MIN, f32::max) as f64;
        let lse = m + row.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
        bits += (lse - row[next as usize] as f64) / std::f64::consts::LN_2;
    }
    bits / (ids.len() - 1) as f64
}

#[test]
fn default_model_knows_its_bible() {
    let model = Model::load(&default_model::dir().unwrap(), Device::Cpu, DType::F32).unwrap();
    let verse = b"1 In the beginning God created the heaven and the earth.\n\
                  2 And the earth was without form, and void; and darkness was upon the face of the deep.";
    let good = bits_per_byte(&model, verse);
    // The same bytes in a fixed shuffled order: same unigram statistics, no language.
    let mut shuffled = verse.to_vec();
    let mut rng = mamba3::model::rng::Rng::new(3);
    for i in (1..shuffled.len()).rev() {
        shuffled.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let bad = bits_per_byte(&model, &shuffled);
    eprintln!("bits/byte: verse {good:.3}, shuffled {bad:.3}");
    assert!(
        good < 2.0,
        "the default model spends {good} bits/byte on Genesis 1:1-2"
    );
    assert!(bad > 4.0, "shuffled text costs only {bad} bits/byte");
}
