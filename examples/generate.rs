//! The library as a Rust user meets it: load a model, prefill a prompt, decode greedily.
//!
//! `cargo run --release --example generate -- "And God said"` (the built-in default model;
//! `MODEL_DIR=/path/to/model` for another).

use mamba3::model::default_model;
use mamba3::text::tokenizer::Tokenizer;
use mamba3::{DType, Device, LogitsWant, Model};
use std::path::PathBuf;

fn main() -> mamba3::Result<()> {
    let prompt = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "And God said".into());
    let dir = match std::env::var_os("MODEL_DIR") {
        Some(d) => PathBuf::from(d),
        None => default_model::dir()?,
    };
    let model = Model::load(&dir, Device::Cpu, DType::F32)?;
    let tokenizer = Tokenizer::from_file(&dir.join("tokenizer.json"))?;

    // A fresh state, the prompt read in one prefill, the last position's logits back.
    let mut state = model.new_state();
    let ids = tokenizer.encode(&prompt, false)?;
    let logits = model.prefill(&ids, &mut state, LogitsWant::Last)?;
    let mut next = mamba3::text::sampling::argmax(logits.row(0));

    // Then one token at a time from the same state.
    let mut out = Vec::new();
    let mut last = logits.row(0).to_vec();
    for _ in 0..40 {
        out.push(next);
        let logits = model.decode(&[next], &mut [&mut state])?;
        last = logits.row(0)[..model.dims().vocab_size].to_vec();
        next = mamba3::text::sampling::argmax(&last);
    }
    println!("{prompt}{}", tokenizer.decode(&out, true)?);

    // How sure the model was of the token after those: its log-probability and the three
    // most likely tokens' (log-softmax of the raw logits).
    let lp = mamba3::engine::row_logprobs(&last, next, 3);
    let name = |t: u32| tokenizer.decode(&[t], false);
    println!("next: {:?} at {:.3}", name(next)?, lp.logprob);
    for (t, v) in lp.top {
        println!("  {:?} {v:.3}", name(t)?);
    }
    Ok(())
}
