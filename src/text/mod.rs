//! Text in and out: tokenizers from GGUF metadata or a Hugging Face `tokenizer.json`, and
//! decoding that streams whole UTF-8.
//!
//! # API
//! ```no_run
//! use moe_lanes::text::{StreamDecoder, Tokenizer};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let tok = Tokenizer::from_gguf_path("ggml-vocab-qwen2.gguf".as_ref())?; // or from_model(&model)
//! let ids = tok.encode("Hello, world!", /* add_special */ false, /* parse_special */ true)?;
//! assert_eq!(tok.decode(&ids, /* skip_special */ false)?, "Hello, world!");
//! let mut stream = StreamDecoder::new(&tok, /* skip_special */ true);
//! for &id in &ids {
//!     print!("{}", stream.push(id)?); // only whole chars; a split emoji waits for its last byte
//! }
//! print!("{}", stream.finish());
//! # Ok(()) }
//! ```
//!
//! - [`Tokenizer::encode`]`(text, add_special, parse_special)`: `add_special` adds BOS/EOS as the
//!   metadata says (`tokenizer.ggml.add_bos_token`/`add_eos_token`, llama.cpp's defaults when
//!   absent); `parse_special` lets control tokens written in the text (`<|im_start|>`) become
//!   those tokens — user-defined (added) tokens are always matched, as in llama.cpp.
//! - [`Tokenizer::decode`]`(ids, skip_special)` joins the tokens' raw bytes ([`Tokenizer::token_bytes`])
//!   and converts to UTF-8 once at the end (lossy only there); `skip_special` drops control and
//!   unknown tokens. SentencePiece vocabularies (`llama`) with `add_space_prefix` drop one
//!   leading space of the first non-special token: the space encoding added, so
//!   `decode(encode(x)) == x`.
//! - [`StreamDecoder`] emits text as ids arrive, holding back an incomplete UTF-8 sequence.
//! - [`Tokenizer::is_eog`]: EOS, EOT/EOM and llama.cpp's end-of-generation token texts
//!   (`<|im_end|>`, `<|eot_id|>`, `<|endoftext|>`, ...).
//! - Every method taking an id returns [`TokenizerError::IdOutOfRange`] for `id >= n_vocab`.
//!
//! # Chat, stop strings, generation
//! - [`ChatTemplate`] renders a conversation ([`ChatMessage`]s) with the model's Jinja template
//!   as `transformers`' `apply_chat_template` does (see `chat_template.rs`).
//! - GPT-OSS's Harmony format (`harmony.rs`): [`HARMONY_TEMPLATE`] for files without a template
//!   ([`ChatTemplate::for_model`]), and [`HarmonyStream`] / [`parse_harmony`], which split a
//!   completion's `analysis` channel (reasoning) from its `final` one (content) on token ids.
//! - [`StopStrings`] cuts streamed text at the first stop string, holding back a possible start.
//! - [`generate_text`] runs a [`Generation`](crate::engine::Generation) on an engine and streams
//!   text ([`TextStream`]: whole UTF-8, stop strings); [`TextGenerator`] does so for async code,
//!   with the engine on its own thread.
//!
//! # GGUF (`tokenizer.ggml.*`)
//! `model = "gpt2"`: byte-level BPE with the pre-tokenizer `pre` names ([`PreTokenizer`]:
//! `qwen2`, `qwen35`, `llama-bpe`, `gpt-2`, `olmo`, `default`, and their llama.cpp aliases).
//! `model = "llama"`: SentencePiece-style merges by score with `<0xNN>` byte fallback and
//! llama.cpp's leading-space rule (a `▁` before the text and after each special token).
//! Not supported (a typed error): other models (`bert`, `t5`, `rwkv`) and other pre names.
//! Token attributes llama.cpp hard-codes per model name (lstrip/rstrip of `<mask>`, Phi-3's
//! rstrip) are not applied.
//!
//! # Hugging Face `tokenizer.json` (feature `hf-tokenizer`, on by default)
//! A safetensors model directory's `tokenizer.json` is run by the `tokenizers` crate; BOS/EOS
//! and the chat template come from `tokenizer_config.json` beside it.
//! [`Tokenizer::to_hf_files`] writes a GGUF byte-level BPE tokenizer as those two files.

mod bpe;
mod chat_template;
mod generate;
mod gguf_tok;
mod harmony;
#[cfg(feature = "hf-tokenizer")]
mod hf;
mod hf_export;
mod pretokenize;
mod service;
mod special;
mod spm;
mod stop;
mod stream;
mod tokenizer;
mod vocab;

pub use crate::format::gguf::TokenType;
pub use chat_template::{
    is_chatml_capable, ChatMessage, ChatTemplate, ChatTemplateError, RenderOptions, CHATML_TEMPLATE,
};
pub use generate::{
    generate_text, TextFinish, TextGenerationError, TextOptions, TextOutcome, TextPiece, TextStream,
};
pub use harmony::{
    is_harmony_capable, parse_harmony, HarmonyDelta, HarmonyMessage, HarmonyParsed, HarmonyRoute,
    HarmonyStream, HarmonyTokens, ReasoningEffort, ReasoningEffortError, HARMONY_TEMPLATE, MAX_HEADER_BYTES,
};
pub use hf_export::HfTokenizerFiles;
pub use pretokenize::PreTokenizer;
pub use service::{TextEvent, TextEvents, TextGenerator, TEXT_EVENTS_BUFFER};
pub use stop::{StopPush, StopStringError, StopStrings, MAX_STOP_STRINGS, MAX_STOP_STRING_BYTES};
pub use stream::{StreamDecoder, TokenizerRef};
pub use tokenizer::Tokenizer;

use crate::format::gguf::GgufError;
use std::path::PathBuf;

/// Anything that stops a tokenizer from loading or a call from succeeding; load errors name
/// the file and the metadata key (and the index of a bad entry).
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("{path}: missing metadata key '{key}' (the file has no tokenizer)")]
    MissingKey { path: PathBuf, key: String },
    #[error("{path}: metadata key '{key}' must be {expected}")]
    BadKey { path: PathBuf, key: String, expected: &'static str },
    #[error("{path}: metadata key '{key}', entry {index}: must be {expected}")]
    BadEntry { path: PathBuf, key: String, index: usize, expected: &'static str },
    #[error("{path}: metadata key '{key}' has {found} entries, but 'tokenizer.ggml.tokens' has {expected}")]
    LengthMismatch { path: PathBuf, key: String, found: usize, expected: usize },
    #[error("{path}: metadata key '{key}' is token id {id}, but the vocabulary has {n_vocab} tokens")]
    SpecialIdOutOfRange { path: PathBuf, key: String, id: u64, n_vocab: usize },
    #[error("{path}: metadata key '{flag_key}' is true, but '{id_key}' is not set")]
    AddWithoutId { path: PathBuf, flag_key: &'static str, id_key: &'static str },
    #[error(
        "{path}: tokenizer model '{model}' (metadata key 'tokenizer.ggml.model') is not supported; supported: gpt2, llama"
    )]
    UnknownModel { path: PathBuf, model: String },
    #[error(
        "{path}: pre-tokenizer '{pre}' (metadata key 'tokenizer.ggml.pre') is not supported; supported: qwen2, qwen35, llama-bpe, gpt-2, olmo, default (and llama.cpp's aliases of them)"
    )]
    UnknownPre { path: PathBuf, pre: String },
    #[error("{path}: no tokenizer.json in the model directory")]
    NoTokenizerJson { path: PathBuf },
    #[error("{path}: Hugging Face tokenizers are not built in (cargo feature 'hf-tokenizer' is off)")]
    HfDisabled { path: PathBuf },
    #[error("{path}: cannot read: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    HfJson { path: PathBuf, message: String },
    #[error("{path}: field '{field}' {problem}")]
    HfConfig { path: PathBuf, field: String, problem: &'static str },
    #[error("Hugging Face tokenizer failed on the input: {message}")]
    HfEncode { message: String },
    #[error(
        "cannot write {kind} tokenizer as tokenizer.json (only GGUF byte-level BPE ones); use GGUF output"
    )]
    NoHfExport { kind: &'static str },
    #[error("token id {id} is out of range: the vocabulary has {n_vocab} tokens")]
    IdOutOfRange { id: u32, n_vocab: usize },
}
