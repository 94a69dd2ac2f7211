//! [`Tokenizer`]: one API over the GGUF and Hugging Face tokenizers (see the module docs).

use super::gguf_tok::GgufTokenizer;
#[cfg(feature = "hf-tokenizer")]
use super::hf::HfTokenizer;
use super::vocab::{GgufVocab, VocabKind};
use super::{hf_export, HfTokenizerFiles, StreamDecoder, TokenizerError};
use crate::format::gguf::GgufFile;
use crate::format::gguf::TokenType;
use crate::model::{Model, ModelFormat};
use std::path::Path;

/// Boxed: the two differ much in size, and a `Tokenizer` is moved around whole.
enum Inner {
    Gguf(Box<GgufTokenizer>),
    #[cfg(feature = "hf-tokenizer")]
    Hf(Box<HfTokenizer>),
}

/// A model's tokenizer. `Send + Sync`: share one behind an `Arc` between requests.
pub struct Tokenizer {
    inner: Inner,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.inner {
            Inner::Gguf(g) => format!("{:?}", g.vocab.kind),
            #[cfg(feature = "hf-tokenizer")]
            Inner::Hf(_) => "tokenizer.json".to_string(),
        };
        f.debug_struct("Tokenizer").field("kind", &kind).field("n_vocab", &self.n_vocab()).finish()
    }
}

impl Tokenizer {
    /// The tokenizer of an opened model: its GGUF metadata, or the `tokenizer.json` of its
    /// safetensors directory.
    pub fn from_model(model: &Model) -> Result<Tokenizer, TokenizerError> {
        match (model.format(), model.gguf()) {
            (ModelFormat::Gguf, Some(file)) => Tokenizer::from_gguf(file),
            _ => Tokenizer::from_hf_dir(model.path()),
        }
    }

    /// The tokenizer of a GGUF file; a vocabulary-only GGUF (no tensors) works too.
    pub fn from_gguf_path(path: &Path) -> Result<Tokenizer, TokenizerError> {
        Tokenizer::from_gguf(&GgufFile::open(path)?)
    }

    /// The tokenizer in an opened GGUF file's metadata.
    pub fn from_gguf(file: &GgufFile) -> Result<Tokenizer, TokenizerError> {
        let vocab = GgufVocab::from_gguf(file)?;
        Ok(Tokenizer { inner: Inner::Gguf(Box::new(GgufTokenizer::new(vocab))) })
    }

    /// The tokenizer of a Hugging Face model directory (`tokenizer.json`, and
    /// `tokenizer_config.json` for BOS/EOS and the chat template).
    pub fn from_hf_dir(dir: &Path) -> Result<Tokenizer, TokenizerError> {
        let json = dir.join("tokenizer.json");
        if !json.is_file() {
            return Err(TokenizerError::NoTokenizerJson { path: dir.into() });
        }
        #[cfg(feature = "hf-tokenizer")]
        return Ok(Tokenizer { inner: Inner::Hf(Box::new(HfTokenizer::open(dir)?)) });
        #[cfg(not(feature = "hf-tokenizer"))]
        Err(TokenizerError::HfDisabled { path: json })
    }

    /// Text to ids. `add_special`: BOS/EOS as the tokenizer's metadata says; `parse_special`:
    /// control tokens written in the text become those tokens.
    pub fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        match &self.inner {
            Inner::Gguf(g) => Ok(g.encode(text, add_special, parse_special)),
            #[cfg(feature = "hf-tokenizer")]
            Inner::Hf(h) => h.encode(text, add_special, parse_special),
        }
    }

    /// Ids to text: the tokens' bytes joined, then converted to UTF-8 (invalid sequences become
    /// U+FFFD only here). `skip_special` drops control and unknown tokens.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        let mut strip_space = self.strips_leading_space();
        for &id in ids {
            self.check(id)?;
            let special = self.is_special(id);
            if skip_special && special {
                continue;
            }
            let start = bytes.len();
            self.append_bytes(id, &mut bytes);
            if strip_space && !special {
                if bytes.get(start) == Some(&b' ') {
                    bytes.remove(start);
                }
                strip_space = false;
            }
        }
        Ok(String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned()))
    }

    /// The raw bytes token `id` stands for (a byte-fallback token is one byte, possibly part of a
    /// UTF-8 sequence; a special token is its text).
    pub fn token_bytes(&self, id: u32) -> Result<Vec<u8>, TokenizerError> {
        self.check(id)?;
        let mut out = Vec::new();
        self.append_bytes(id, &mut out);
        Ok(out)
    }

    /// The number of token ids (ids are `0..n_vocab`).
    pub fn n_vocab(&self) -> usize {
        match &self.inner {
            Inner::Gguf(g) => g.vocab.tokens.len(),
            #[cfg(feature = "hf-tokenizer")]
            Inner::Hf(h) => h.n_vocab(),
        }
    }

    pub fn bos(&self) -> Option<u32> {
        match &self.inner {
            Inner::Gguf(g) => g.vocab.bos,
            #[cfg(feature = "hf-tokenizer")]
            Inner::Hf(h) => h.bos,
        }
    }

    pub fn eos(&self) -> Option<u32> {
        match &self.inner {
            Inner::Gguf(g) => g.vocab.eos,
            #[cfg(feature = "hf-tokenizer")]
            Inner::Hf(h) => h.eos,
        }
    }

    /// Whether `id` ends generation: EOS, EOT, or an end-of-turn token such as `<|im_end|>`.
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog_ids().binary_search(&id).is_ok()
    }

    /// Every end-of-generation id, sorted.
    pub fn eog_ids(&self) -> &[u32] {
        match &self.inner {
            Inner::Gguf(g) => &g.vocab.eog,
            #[cfg(feature = "hf-tokenizer")]
            Inner::Hf(h) => &h.eog,
        }
    }

    /// Whether `id` is a control or unknown token (what `skip_special` drops). False for an id
    /// out of range.
    pub fn is_special(&self, id: u32) -> bool {
        match &self.inner {
            Inner::Gguf(g) => g.vocab.types.get(id as usize).is_some_and(|t| t.is_special()),
            #[cfg(feature = "hf-tokenizer")]
            Inner::Hf(h) => h.is_special(id),
        }
    }

    /// The vocabulary string of `id` (e.g. `<|im_start|>`, `Ġworld`, `▁world`), for chat
    /// templates' `bos_token`/`eos_token`; `None` when out of range.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        match &self.inner {
            Inner::Gguf(g) => g.vocab.tokens.get(id as usize).map(String::as_str),
            #[cfg(feature = "hf-tokenizer")]
            Inner::Hf(h) => h.token_text(id),
        }
    }

    /// The id whose vocabulary string is exactly `text`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        match &self.inner {
            Inner::Gguf(g) => g.vocab.ids.get(text).copied(),
            #[cfg(feature = "hf-tokenizer")]
            Inner::Hf(h) => h.token_id(text),
        }
    }

    /// The token type of `id` (GGUF), `None` when out of range; Hugging Face added tokens are
    /// `Control` when special, `UserDefined` otherwise.
    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        match &self.inner {
            Inner::Gguf(g) => g.vocab.types.get(id as usize).copied(),
            #[cfg(feature = "hf-tokenizer")]
            Inner::Hf(h) => h.token_type(id),
        }
    }

    /// Whether `encode(.., add_special = true, ..)` adds BOS.
    pub fn add_bos(&self) -> bool {
        match &self.inner {
            Inner::Gguf(g) => g.vocab.add_bos,
            #[cfg(feature = "hf-tokenizer")]
            Inner::Hf(h) => h.add_bos,
        }
    }

    /// The Jinja chat template (`tokenizer.chat_template`), if the model has one.
    pub fn chat_template(&self) -> Option<&str> {
        match &self.inner {
            Inner::Gguf(g) => g.vocab.chat_template.as_deref(),
            #[cfg(feature = "hf-tokenizer")]
            Inner::Hf(h) => h.chat_template.as_deref(),
        }
    }

    /// The tokenizer as Hugging Face `tokenizer.json` and `tokenizer_config.json` contents, which
    /// the `tokenizers` crate (and `transformers`) load to the same ids. GGUF byte-level BPE only.
    pub fn to_hf_files(&self) -> Result<HfTokenizerFiles, TokenizerError> {
        match &self.inner {
            Inner::Gguf(g) => hf_export::export(&g.vocab).ok_or(TokenizerError::NoHfExport {
                kind: match g.vocab.kind {
                    VocabKind::Spm => "a SentencePiece (llama)",
                    VocabKind::Bpe(_) => "this",
                },
            }),
            #[cfg(feature = "hf-tokenizer")]
            Inner::Hf(_) => {
                Err(TokenizerError::NoHfExport { kind: "a tokenizer.json-based (copy the file)" })
            }
        }
    }

    /// A decoder that streams text as ids arrive (see [`StreamDecoder`]).
    pub fn stream(&self, skip_special: bool) -> StreamDecoder<'_> {
        StreamDecoder::new(self, skip_special)
    }

    /// Whether decoding drops one leading space of the first non-special token.
    pub(crate) fn strips_leading_space(&self) -> bool {
        match &self.inner {
            Inner::Gguf(g) => g.strips_leading_space(),
            #[cfg(feature = "hf-tokenizer")]
            Inner::Hf(h) => h.strips_leading_space(),
        }
    }

    pub(crate) fn check(&self, id: u32) -> Result<(), TokenizerError> {
        let n_vocab = self.n_vocab();
        if (id as usize) < n_vocab {
            Ok(())
        } else {
            Err(TokenizerError::IdOutOfRange { id, n_vocab })
        }
    }

    /// Append the bytes of `id` (checked by the caller).
    pub(crate) fn append_bytes(&self, id: u32, out: &mut Vec<u8>) {
        match &self.inner {
            Inner::Gguf(g) => g.token_bytes(id, out),
            #[cfg(feature = "hf-tokenizer")]
            Inner::Hf(h) => h.token_bytes(id, out),
        }
    }
}
