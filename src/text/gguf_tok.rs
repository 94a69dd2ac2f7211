//! The tokenizer of a GGUF file: special-token partition, then byte-level BPE or
//! SentencePiece per text fragment; decoding token by token to raw bytes.

use super::bpe::{self, ByteLevel};
use super::special::{self, Fragment};
use super::spm;
use super::vocab::{GgufVocab, VocabKind};
use crate::format::gguf::TokenType;

/// A GGUF tokenizer, ready to encode and decode.
#[derive(Debug)]
pub struct GgufTokenizer {
    pub vocab: GgufVocab,
    /// BPE: the byte alphabet.
    byte_level: ByteLevel,
    /// SPM: each byte's `<0xNN>` token.
    spm_bytes: [Option<u32>; 256],
    /// Control, user-defined and unknown tokens, longest first.
    specials: Vec<u32>,
}

impl GgufTokenizer {
    pub fn new(vocab: GgufVocab) -> GgufTokenizer {
        let byte_level = ByteLevel::new(&vocab.ids);
        let spm_bytes = spm::byte_tokens(&vocab);
        let specials = special::special_tokens(&vocab);
        GgufTokenizer { vocab, byte_level, spm_bytes, specials }
    }

    /// llama.cpp's `llama_tokenize(text, add_special, parse_special)`.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        let v = &self.vocab;
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && v.add_bos {
            out.extend(v.bos);
        }
        // SentencePiece: a space goes before the first text and any text after a special token.
        let mut after_special = true;
        for fragment in special::partition(v, &self.specials, text, parse_special) {
            match fragment {
                Fragment::Token(id) => {
                    out.push(id);
                    after_special = true;
                }
                Fragment::Text(range) => {
                    self.encode_text(&text[range], after_special, &mut out);
                    after_special = false;
                }
            }
        }
        if add_special && v.add_eos {
            out.extend(v.eos);
        }
        out
    }

    fn encode_text(&self, text: &str, after_special: bool, out: &mut Vec<u32>) {
        match self.vocab.kind {
            VocabKind::Spm => {
                let mut escaped = String::with_capacity(text.len() + 4);
                if self.vocab.add_space_prefix && after_special {
                    escaped.push_str(spm::SPACE);
                }
                escaped.push_str(&text.replace(' ', spm::SPACE));
                spm::encode(&self.vocab, &self.spm_bytes, &escaped, out);
            }
            VocabKind::Bpe(pre) => {
                for word in pre.split(text) {
                    let bytes = text[word].as_bytes();
                    if pre.ignores_merges() {
                        if let Some(&id) = self.vocab.ids.get(&self.byte_level.spell(bytes)) {
                            out.push(id);
                            continue;
                        }
                    }
                    bpe::encode_word(&self.vocab, &self.byte_level, bytes, out);
                }
            }
        }
    }

    /// The raw bytes of token `id` (< n_vocab), as llama.cpp's `token_to_piece(.., special = true)`.
    pub fn token_bytes(&self, id: u32, out: &mut Vec<u8>) {
        let text = self.vocab.tokens[id as usize].as_str();
        match self.vocab.types[id as usize] {
            TokenType::Control | TokenType::Unknown | TokenType::UserDefined => {
                out.extend_from_slice(text.as_bytes())
            }
            TokenType::Normal => match self.vocab.kind {
                VocabKind::Bpe(_) => self.byte_level.decode_text(text, out),
                VocabKind::Spm => out.extend_from_slice(text.replace(spm::SPACE, " ").as_bytes()),
            },
            TokenType::Byte => out.extend(spm::parse_byte_token(text)),
            // llama.cpp renders unused and undefined tokens as nothing.
            TokenType::Unused | TokenType::Undefined => {}
        }
    }

    /// Whether decoding drops one leading space of the first text (SentencePiece's prefix).
    pub fn strips_leading_space(&self) -> bool {
        self.vocab.kind == VocabKind::Spm && self.vocab.add_space_prefix
    }
}
