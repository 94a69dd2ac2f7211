//! The vocabulary of a GGUF tokenizer, read from `tokenizer.ggml.*` metadata with errors naming
//! the key (and the index of a bad entry).

use super::pretokenize::PreTokenizer;
use super::TokenizerError;
use crate::format::gguf::{GgufFile, MetaValue, TokenType};
use std::collections::HashMap;
use std::path::PathBuf;

/// BPE merges: (left id, right id) -> (rank, merged id).
pub type MergeMap = HashMap<(u32, u32), (u32, u32)>;

/// Which algorithm `tokenizer.ggml.model` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VocabKind {
    /// `gpt2`: byte-level BPE with a pre-tokenizer.
    Bpe(PreTokenizer),
    /// `llama`: SentencePiece-style, score-ordered merges with `<0xNN>` byte fallback.
    Spm,
}

/// Token texts that end generation although no id key names them (llama.cpp's list).
pub(crate) const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
];

/// Everything a GGUF tokenizer needs, validated.
#[derive(Debug)]
pub struct GgufVocab {
    pub kind: VocabKind,
    pub tokens: Vec<String>,
    pub types: Vec<TokenType>,
    pub scores: Vec<f32>,
    pub ids: HashMap<String, u32>,
    /// BPE merges: (left id, right id) -> (rank, merged id).
    pub merges: MergeMap,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eog: Vec<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    pub add_space_prefix: bool,
    pub chat_template: Option<String>,
}

/// Typed access to `tokenizer.*` keys, errors naming the file and key.
struct Meta<'a> {
    file: &'a GgufFile,
}

impl<'a> Meta<'a> {
    fn path(&self) -> PathBuf {
        self.file.path().to_path_buf()
    }

    fn bad(&self, key: &str, expected: &'static str) -> TokenizerError {
        TokenizerError::BadKey { path: self.path(), key: key.into(), expected }
    }

    fn opt_str(&self, key: &str) -> Result<Option<&'a str>, TokenizerError> {
        self.file.get(key).map(|v| v.as_str().ok_or_else(|| self.bad(key, "a string"))).transpose()
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>, TokenizerError> {
        self.file.get(key).map(|v| v.as_bool().ok_or_else(|| self.bad(key, "a bool"))).transpose()
    }

    fn opt_id(&self, key: &str, n_vocab: usize) -> Result<Option<u32>, TokenizerError> {
        let Some(v) = self.file.get(key) else { return Ok(None) };
        // Some converters write -1 (as u32::MAX or i32) for "none".
        if v.as_i64() == Some(-1) || v.as_u64() == Some(u64::from(u32::MAX)) {
            return Ok(None);
        }
        let id = v.as_u64().ok_or_else(|| self.bad(key, "a token id (non-negative integer)"))?;
        if id >= n_vocab as u64 {
            return Err(TokenizerError::SpecialIdOutOfRange {
                path: self.path(),
                key: key.into(),
                id,
                n_vocab,
            });
        }
        Ok(Some(id as u32))
    }

    fn array(&self, key: &str, expected: &'static str) -> Result<Option<&'a [MetaValue]>, TokenizerError> {
        self.file
            .get(key)
            .map(|v| v.as_array().map(|a| a.values.as_slice()).ok_or_else(|| self.bad(key, expected)))
            .transpose()
    }

    fn required_array(&self, key: &str, expected: &'static str) -> Result<&'a [MetaValue], TokenizerError> {
        self.array(key, expected)?
            .ok_or_else(|| TokenizerError::MissingKey { path: self.path(), key: key.into() })
    }

    fn entry_error(&self, key: &str, index: usize, expected: &'static str) -> TokenizerError {
        TokenizerError::BadEntry { path: self.path(), key: key.into(), index, expected }
    }

    /// A per-token array: `len` entries converted by `conv`, or `default` when the key is absent.
    fn per_token<T: Clone>(
        &self,
        key: &str,
        len: usize,
        default: T,
        expected: &'static str,
        conv: impl Fn(&MetaValue) -> Option<T>,
    ) -> Result<Vec<T>, TokenizerError> {
        let Some(values) = self.array(key, expected)? else { return Ok(vec![default; len]) };
        if values.len() != len {
            return Err(TokenizerError::LengthMismatch {
                path: self.path(),
                key: key.into(),
                found: values.len(),
                expected: len,
            });
        }
        values
            .iter()
            .enumerate()
            .map(|(i, v)| conv(v).ok_or_else(|| self.entry_error(key, i, expected)))
            .collect()
    }
}

impl GgufVocab {
    /// Read and validate the tokenizer of a GGUF file.
    pub fn from_gguf(file: &GgufFile) -> Result<GgufVocab, TokenizerError> {
        let meta = Meta { file };
        let kind = read_kind(&meta)?;
        let tokens: Vec<String> = {
            let key = "tokenizer.ggml.tokens";
            let values = meta.required_array(key, "an array of strings")?;
            let conv = |(i, v): (usize, &MetaValue)| {
                v.as_str().map(str::to_owned).ok_or_else(|| meta.entry_error(key, i, "a string"))
            };
            values.iter().enumerate().map(conv).collect::<Result<_, _>>()?
        };
        let n = tokens.len();
        let types =
            meta.per_token("tokenizer.ggml.token_type", n, TokenType::Normal, "a token type (0..=6)", |v| {
                v.as_i64().and_then(TokenType::from_i64)
            })?;
        let scores =
            meta.per_token("tokenizer.ggml.scores", n, 0.0f32, "a number", |v| v.as_f64().map(|x| x as f32))?;
        let mut ids = HashMap::with_capacity(n);
        for (i, t) in tokens.iter().enumerate() {
            // The first of duplicate texts wins, as in llama.cpp's token_to_id.
            ids.entry(t.clone()).or_insert(i as u32);
        }
        let merges = match kind {
            VocabKind::Bpe(_) => read_merges(&meta, &ids)?,
            VocabKind::Spm => HashMap::new(),
        };
        let mut vocab = GgufVocab {
            kind,
            tokens,
            types,
            scores,
            ids,
            merges,
            bos: None,
            eos: None,
            eog: Vec::new(),
            add_bos: false,
            add_eos: false,
            add_space_prefix: false,
            chat_template: meta.opt_str("tokenizer.chat_template")?.map(str::to_owned),
        };
        vocab.read_specials(&meta)?;
        Ok(vocab)
    }

    fn read_specials(&mut self, meta: &Meta<'_>) -> Result<(), TokenizerError> {
        let n = self.tokens.len();
        let spm = self.kind == VocabKind::Spm;
        // llama.cpp's defaults: SPM has <unk>=0, <s>=1, </s>=2 and adds BOS; Llama 3 adds BOS.
        let default_id = |id: u32| (spm && (id as usize) < n).then_some(id);
        self.bos = meta.opt_id("tokenizer.ggml.bos_token_id", n)?.or(default_id(1));
        self.eos = meta.opt_id("tokenizer.ggml.eos_token_id", n)?.or(default_id(2));
        let eot = meta.opt_id("tokenizer.ggml.eot_token_id", n)?;
        let eom = meta.opt_id("tokenizer.ggml.eom_token_id", n)?;
        let default_add_bos = spm || self.kind == VocabKind::Bpe(PreTokenizer::Llama3);
        self.add_bos = meta.opt_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(default_add_bos);
        self.add_eos = meta.opt_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
        self.add_space_prefix = meta.opt_bool("tokenizer.ggml.add_space_prefix")?.unwrap_or(spm);
        for (flag, id, flag_key, id_key) in [
            (self.add_bos, self.bos, "tokenizer.ggml.add_bos_token", "tokenizer.ggml.bos_token_id"),
            (self.add_eos, self.eos, "tokenizer.ggml.add_eos_token", "tokenizer.ggml.eos_token_id"),
        ] {
            if flag && id.is_none() {
                return Err(TokenizerError::AddWithoutId { path: meta.path(), flag_key, id_key });
            }
        }
        let mut eog: Vec<u32> = [self.eos, eot, eom].into_iter().flatten().collect();
        for text in EOG_TEXTS {
            if let Some(&id) = self.ids.get(*text) {
                eog.push(id);
                // llama.cpp treats these as control tokens whatever the file says.
                if self.types[id as usize] == TokenType::Normal {
                    self.types[id as usize] = TokenType::Control;
                }
            }
        }
        eog.sort_unstable();
        eog.dedup();
        drop_harmony_end(&mut eog, |id| self.tokens.get(id as usize).map(String::as_str));
        self.eog = eog;
        Ok(())
    }
}

/// llama.cpp's rule for Harmony (o200k_harmony) vocabularies: with `<|return|>` and `<|call|>`
/// both ending generation, `<|end|>` does not (it ends one message of a completion, e.g. the
/// reasoning before the final answer).
pub(crate) fn drop_harmony_end<'a>(eog: &mut Vec<u32>, text: impl Fn(u32) -> Option<&'a str>) {
    let has = |t: &str| eog.iter().any(|&id| text(id) == Some(t));
    if has("<|return|>") && has("<|call|>") {
        eog.retain(|&id| text(id) != Some("<|end|>"));
    }
}

fn read_kind(meta: &Meta<'_>) -> Result<VocabKind, TokenizerError> {
    let key = "tokenizer.ggml.model";
    let model = meta
        .opt_str(key)?
        .ok_or_else(|| TokenizerError::MissingKey { path: meta.path(), key: key.into() })?;
    match model {
        "gpt2" => {
            // llama.cpp falls back to `default` (with a warning) when the key is missing.
            let pre_name = meta.opt_str("tokenizer.ggml.pre")?.unwrap_or("default");
            let pre = PreTokenizer::from_name(pre_name)
                .ok_or_else(|| TokenizerError::UnknownPre { path: meta.path(), pre: pre_name.into() })?;
            Ok(VocabKind::Bpe(pre))
        }
        "llama" => Ok(VocabKind::Spm),
        other => Err(TokenizerError::UnknownModel { path: meta.path(), model: other.into() }),
    }
}

/// `tokenizer.ggml.merges`: "left right" strings in rank order. A merge whose parts or result
/// are not tokens can never fire in an id-level BPE, so it is left out (llama.cpp would try it on
/// strings and then fall back to bytes; no real vocabulary has one).
fn read_merges(meta: &Meta<'_>, ids: &HashMap<String, u32>) -> Result<MergeMap, TokenizerError> {
    let key = "tokenizer.ggml.merges";
    let values = meta.required_array(key, "an array of strings")?;
    let mut merges = HashMap::with_capacity(values.len());
    let mut joined = String::new();
    for (rank, v) in values.iter().enumerate() {
        let text = v.as_str().ok_or_else(|| meta.entry_error(key, rank, "a string"))?;
        // Split at the first space after the first byte (a part may itself be a space).
        let split = text.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1);
        let Some(split) = split else {
            return Err(meta.entry_error(key, rank, "two tokens joined by a space"));
        };
        let (left, right) = (&text[..split], &text[split + 1..]);
        joined.clear();
        joined.push_str(left);
        joined.push_str(right);
        if let (Some(&l), Some(&r), Some(&m)) = (ids.get(left), ids.get(right), ids.get(joined.as_str())) {
            merges.entry((l, r)).or_insert((rank as u32, m));
        }
    }
    Ok(merges)
}
