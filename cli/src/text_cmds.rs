//! `moe-lanes tokenize` and `moe-lanes detokenize`: thin layers over `moe_lanes::text`.

use crate::emit;
use anyhow::{bail, Context, Result};
use clap::Args;
use moe_lanes::text::Tokenizer;
use std::io::Read;
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct TokenizeArgs {
    /// A GGUF file (a vocabulary-only GGUF works too) or a model directory with tokenizer.json.
    #[arg(long)]
    model: PathBuf,
    /// The text to tokenize (default: --text-file, else standard input).
    #[arg(long, conflicts_with = "text_file")]
    text: Option<String>,
    /// Read the text from this file (UTF-8).
    #[arg(long)]
    text_file: Option<PathBuf>,
    /// Add BOS/EOS as the model's tokenizer metadata says.
    #[arg(long)]
    special: bool,
    /// Treat special-token texts written in the input (e.g. <|im_start|>) as plain text.
    #[arg(long)]
    no_parse_special: bool,
    /// Print {"tokens": [...], "pieces": [...]} (each piece is the token's text, U+FFFD where a
    /// token holds part of a character) instead of the bare id array.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct DetokenizeArgs {
    /// A GGUF file (a vocabulary-only GGUF works too) or a model directory with tokenizer.json.
    #[arg(long)]
    model: PathBuf,
    /// Comma-separated token ids (default: ids separated by commas or white space on standard input).
    #[arg(long, value_delimiter = ',')]
    tokens: Vec<u32>,
    /// Leave out control tokens (BOS, <|im_end|>, ...).
    #[arg(long)]
    skip_special: bool,
    /// Print {"text": "..."} instead of the text and a newline.
    #[arg(long)]
    json: bool,
}

/// The tokenizer of a GGUF file or a model directory, without opening the weights.
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer> {
    let tok = if path.is_dir() {
        Tokenizer::from_hf_dir(path)?
    } else if path.exists() {
        Tokenizer::from_gguf_path(path)?
    } else {
        bail!("{}: no such file or directory", path.display());
    };
    Ok(tok)
}

pub fn tokenize(args: TokenizeArgs) -> Result<()> {
    let tok = load_tokenizer(&args.model)?;
    let text = match (&args.text, &args.text_file) {
        (Some(text), _) => text.clone(),
        (None, Some(path)) => std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {} as UTF-8 text", path.display()))?,
        (None, None) => read_stdin()?,
    };
    let ids = tok.encode(&text, args.special, !args.no_parse_special)?;
    if args.json {
        let pieces = ids
            .iter()
            .map(|&id| Ok(String::from_utf8_lossy(&tok.token_bytes(id)?).into_owned()))
            .collect::<Result<Vec<_>>>()?;
        let value = serde_json::json!({ "tokens": ids, "pieces": pieces });
        out!("{}", serde_json::to_string(&value)?)
    } else {
        out!("{}", serde_json::to_string(&ids)?)
    }
}

pub fn detokenize(args: DetokenizeArgs) -> Result<()> {
    let tok = load_tokenizer(&args.model)?;
    let ids = if args.tokens.is_empty() { ids_from_stdin()? } else { args.tokens.clone() };
    let text = tok.decode(&ids, args.skip_special)?;
    if args.json {
        out!("{}", serde_json::to_string(&serde_json::json!({ "text": text }))?)
    } else {
        out!("{text}")
    }
}

fn read_stdin() -> Result<String> {
    let mut text = String::new();
    std::io::stdin().read_to_string(&mut text).context("cannot read standard input as UTF-8 text")?;
    Ok(text)
}

fn ids_from_stdin() -> Result<Vec<u32>> {
    let text = read_stdin()?;
    let words = text.split(|c: char| c == ',' || c.is_whitespace() || c == '[' || c == ']');
    words
        .filter(|w| !w.is_empty())
        .enumerate()
        .map(|(i, w)| {
            w.parse::<u32>()
                .with_context(|| format!("standard input: token {} is '{w}', not a token id", i + 1))
        })
        .collect()
}
