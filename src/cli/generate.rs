//! `mamba3 generate`: continue a prompt, streaming the text to stdout as it is produced,
//! with a summary on stderr. `--save-state` keeps the state after the whole text so that
//! `--load-state` can continue it later.

use super::{PathArg, RunOpts};
use crate::engine::Model;
use crate::error::{Error, Result};
use crate::text::generate::{generate, GenStats};
use crate::text::{Continuation, GenParams, ModelSource, SamplingParams};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::{IsTerminal, Read, Write};
use std::time::Duration;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model directory (config.json, weights, tokenizer.json).
    #[arg(long)]
    pub model: Option<PathArg>,
    /// Prompt text (default: read stdin).
    #[arg(value_name = "PROMPT", conflicts_with = "prompt_flag")]
    pub prompt: Option<String>,
    /// Prompt text, as an option (same as the positional PROMPT).
    #[arg(long = "prompt", id = "prompt_flag", value_name = "TEXT")]
    pub prompt_flag: Option<String>,
    /// Prompt as token ids: a JSON array (inline, `'[1, 2, 3]'`, or a file) or a
    /// safetensors file with `input_ids`.
    #[arg(long, conflicts_with_all = ["prompt", "prompt_flag"])]
    pub input_ids: Option<PathArg>,
    /// tokenizer.json to use instead of the model directory's.
    #[arg(long)]
    pub tokenizer: Option<PathArg>,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    /// Keep the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus sampling: keep the most likely tokens holding this much probability.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Drop tokens less likely than this fraction of the most likely one.
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// Random seed (same seed, same text).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop before this text (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Stop at this token id (repeatable).
    #[arg(long)]
    pub stop_token_id: Vec<u32>,
    /// Do not stop at the tokenizer's end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Prompt tokens read per prefill window.
    #[arg(long, default_value_t = 512)]
    pub prefill_chunk: usize,
    /// Save the state after the whole text (prompt and answer) to this file.
    #[arg(long)]
    pub save_state: Option<PathArg>,
    /// Start from a state saved by --save-state; the prompt continues its text.
    #[arg(long)]
    pub load_state: Option<PathArg>,
    /// Print the generated token ids (one line) instead of text.
    #[arg(long)]
    pub print_ids: bool,
    /// Print only the continuation, not the prompt before it.
    #[arg(long)]
    pub no_echo: bool,
    #[command(flatten)]
    pub run: RunOpts,
}

fn spinner(msg: &str) -> Option<ProgressBar> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let pb = ProgressBar::new_spinner();
    pb.set_message(msg.to_string());
    pb.enable_steady_tick(Duration::from_millis(100));
    Some(pb)
}

pub fn run(a: Args) -> Result<()> {
    a.run.init_threads();
    // Before the model loads and the text is generated: a bad path fails now.
    if let Some(p) = &a.save_state {
        crate::atomic::refuse_model_file(p, "--save-state")?;
        crate::atomic::check_writable(p, "--save-state")?;
    }
    let source = ModelSource::resolve(a.model.as_deref())?;
    let text = source.load_text(a.tokenizer.as_deref())?;
    let tokenizer = text.tokenizer;
    crate::timeline::mark(|| "tokenizer read".into());
    let pb = spinner("loading weights");
    let model: Model = source.load_model(a.run.device.resolve(), a.run.dtype)?;
    crate::timeline::mark(|| format!("model ready on {}", model.device_name()));
    if let Some(pb) = pb {
        pb.finish_and_clear();
    }
    let vocab = model.dims().vocab_size;

    let (mut state, resumed) = match &a.load_state {
        Some(p) => (model.load_state(p)?, true),
        None => (model.new_state(), false),
    };
    let start = state.position();
    let prompt_text = a.prompt.as_ref().or(a.prompt_flag.as_ref());
    // The prompt's text as given, echoed before the continuation.
    let mut given_text: Option<String> = None;
    let prompt: Vec<u32> = match (&a.input_ids, prompt_text) {
        (Some(p), _) => super::logits::to_tokens(&super::logits::read_input_ids(p)?, vocab)?,
        (None, text) => {
            let text = match text {
                Some(t) => t.to_string(),
                None => {
                    let mut s = String::new();
                    std::io::stdin().read_to_string(&mut s).map_err(|e| {
                        Error::input(format!("reading the prompt from stdin failed: {e}"))
                    })?;
                    s
                }
            };
            let tok = tokenizer.as_ref().ok_or_else(|| {
                Error::input(
                    "this model has no tokenizer.json (pass --tokenizer FILE), so a text prompt \
                     cannot be read: give the prompt as token ids with --input-ids",
                )
            })?;
            // A resumed text already has its BOS.
            let ids = tok.encode(&text, !resumed)?;
            given_text = Some(text);
            ids
        }
    };
    if prompt.is_empty() {
        return Err(Error::input(if resumed {
            "the prompt is empty: a state saved by --save-state has read its whole text, so \
             continuing needs at least one new token (give the next words with --prompt)"
        } else {
            "the prompt is empty: expected at least one token"
        }));
    }
    if let Some(t) = prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(Error::input(format!(
            "the tokenizer produced id {t}, outside the model's vocabulary of {vocab}: the \
             tokenizer does not belong to this model"
        )));
    }
    let params = GenParams {
        sampling: SamplingParams {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            min_p: a.min_p,
            repetition_penalty: a.repetition_penalty,
            seed: a.seed,
            ..Default::default()
        },
        // 0 reads the prompt and generates nothing (--save-state then keeps its state).
        max_tokens: a.max_tokens,
        stop: a.stop.clone(),
        stop_token_ids: a.stop_token_id.clone(),
        ignore_eos: a.ignore_eos,
    };
    params
        .sampling
        .validate()
        .map_err(|(_, msg)| Error::input(msg))?;
    if !params.stop.is_empty() && tokenizer.is_none() {
        return Err(Error::input(
            "--stop needs a tokenizer; use --stop-token-id",
        ));
    }
    let print_ids = a.print_ids || tokenizer.is_none();
    let mut cont = Continuation::new(&params, &prompt, tokenizer.clone());

    let chunk = a.prefill_chunk.max(1);
    let bar = (std::io::stderr().is_terminal() && prompt.len() > 2 * chunk).then(|| {
        let pb = ProgressBar::new(prompt.len() as u64);
        pb.set_style(
            ProgressStyle::with_template("prefill {bar:40} {pos}/{len} tokens ({per_sec})")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        pb
    });
    let mut out = std::io::stdout().lock();
    let mut ids = Vec::new();
    let mut write_err = None;
    if !print_ids && !a.no_echo {
        // The prompt as given (ids through the tokenizer), then the continuation.
        let echo = match (given_text, &tokenizer) {
            (Some(t), _) => Some(t),
            (None, Some(tok)) => Some(tok.decode(&prompt, true)?),
            (None, None) => None,
        };
        if let Some(e) = echo {
            if let Err(e) = out.write_all(e.as_bytes()).and_then(|_| out.flush()) {
                write_err.get_or_insert(e);
            }
        }
    }
    let mut first_sampled = false;
    let stats: GenStats = generate(
        &model,
        &mut state,
        &prompt,
        None,
        &mut cont,
        chunk,
        a.save_state.is_some(),
        |done, _| {
            if let Some(pb) = &bar {
                pb.set_position(done as u64);
            }
        },
        |step| {
            if !first_sampled {
                first_sampled = true;
                crate::timeline::mark(|| "first token sampled".into());
            }
            if let Some(pb) = &bar {
                if !pb.is_finished() {
                    pb.finish_and_clear();
                }
            }
            if print_ids {
                ids.push(step.token.to_string());
            } else if !step.text.is_empty() {
                if let Err(e) = out
                    .write_all(step.text.as_bytes())
                    .and_then(|_| out.flush())
                {
                    write_err.get_or_insert(e);
                }
            }
        },
    )?;
    if print_ids {
        let _ = writeln!(out, "{}", ids.join(" "));
    } else {
        let _ = writeln!(out);
    }
    let _ = out.flush(); // before the summary on stderr
    if let Some(e) = write_err {
        return Err(Error::Other(format!("writing to stdout failed: {e}")));
    }
    if let Some(p) = &a.save_state {
        state.save(p)?;
    }
    let prefill_ms = stats.prefill.as_secs_f64() * 1e3;
    let decode_s = stats.decode.as_secs_f64();
    eprintln!(
        "prompt {} tokens{} · prefill {:.1} ms ({:.0} tok/s) · generated {} tokens in {:.1} ms ({:.1} tok/s) · finish {}{}",
        stats.prompt_tokens,
        if resumed {
            format!(" (after {start} from the state)")
        } else {
            String::new()
        },
        prefill_ms,
        stats.prompt_tokens as f64 / stats.prefill.as_secs_f64().max(1e-9),
        stats.generated,
        decode_s * 1e3,
        stats.generated as f64 / decode_s.max(1e-9),
        stats.finish.map_or("?", |f| f.as_str()),
        a.save_state
            .as_ref()
            .map(|p| format!(" · state saved to {} ({} tokens)", p.display(), state.position()))
            .unwrap_or_default(),
    );
    Ok(())
}
