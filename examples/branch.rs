//! A state is a value: snapshot it after a shared prefix and branch two continuations from
//! the snapshot, without reading the prefix again. Each branch matches a full read of its
//! text to f32 rounding (the two read the text in different windows).
//!
//! `cargo run --release --example branch`

use mamba3::model::default_model;
use mamba3::text::tokenizer::Tokenizer;
use mamba3::{DType, Device, LogitsWant, Model};

fn main() -> mamba3::Result<()> {
    let dir = default_model::dir()?;
    let model = Model::load(&dir, Device::Cpu, DType::F32)?;
    let tok = Tokenizer::from_file(&dir.join("tokenizer.json"))?;

    let prefix = tok.encode("In the beginning God created", false)?;
    let mut shared = model.new_state();
    model.prefill(&prefix, &mut shared, LogitsWant::None)?;
    // Snapshots are clones; they share the buffer until one side writes.
    let snapshot = shared.clone();

    for ending in [" the heaven", " the earth"] {
        let tail = tok.encode(ending, false)?;
        let mut branch = snapshot.clone();
        let from_snapshot = model.prefill(&tail, &mut branch, LogitsWant::Last)?;

        let mut whole = model.new_state();
        let full: Vec<u32> = prefix.iter().chain(&tail).copied().collect();
        let from_scratch = model.prefill(&full, &mut whole, LogitsWant::Last)?;

        let diff = from_snapshot
            .row(0)
            .iter()
            .zip(from_scratch.row(0))
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        println!(
            "{ending:>12}: {} tokens read from the snapshot; largest logit difference against a full read {diff:.2e}",
            tail.len()
        );
    }
    Ok(())
}
