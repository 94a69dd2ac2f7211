//! A small, valid byte-level BPE tokenizer for synthetic GGUF files, so llama.cpp's loader (which
//! needs tokens, token types and merges, and tokenizes "\n" at load) accepts them.
//!
//! Layout of the vocabulary: the 256 byte tokens in GPT-2's byte-to-unicode spelling, then tokens
//! made by merges (each merge joins an existing token with one lowercase letter), then the special
//! tokens at the end: ChatML's ([`SPECIAL_TOKENS`]), or for GPT-OSS Harmony's ([`HARMONY_SPECIAL_TOKENS`]:
//! o200k_harmony's strings in its order; the real vocabulary is not shipped, so the ids differ from it).

use crate::format::gguf::{MetaValue, TokenType};

/// Special tokens placed at the end of every synthetic vocabulary; the first is BOS/EOS.
pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// Harmony's special tokens as o200k_harmony orders them (ids 199998..=200012 there, reserved
/// ones left out): the synthetic GPT-OSS vocabulary's end. BOS is `<|startoftext|>`, EOS
/// `<|return|>` (as GPT-OSS's tokenizer config has them).
pub const HARMONY_SPECIAL_TOKENS: [&str; 9] = [
    "<|startoftext|>",
    "<|endoftext|>",
    "<|return|>",
    "<|constrain|>",
    "<|channel|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|call|>",
];

/// Which special tokens a synthetic vocabulary ends with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VocabSpecials {
    /// [`SPECIAL_TOKENS`], with the ChatML template.
    ChatMl,
    /// [`HARMONY_SPECIAL_TOKENS`], for GPT-OSS (no template in the file: the built-in Harmony one).
    Harmony,
}

impl VocabSpecials {
    pub fn tokens(self) -> &'static [&'static str] {
        match self {
            VocabSpecials::ChatMl => &SPECIAL_TOKENS,
            VocabSpecials::Harmony => &HARMONY_SPECIAL_TOKENS,
        }
    }
}

/// Smallest vocabulary that holds the byte tokens and the specials.
pub const MIN_VOCAB: usize = 256 + SPECIAL_TOKENS.len();

/// A synthetic tokenizer.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticVocab {
    pub tokens: Vec<String>,
    pub token_types: Vec<i32>,
    pub merges: Vec<String>,
    pub bos_id: u32,
    pub eos_id: u32,
}

/// GPT-2's reversible mapping from bytes to printable unicode characters.
pub fn byte_to_unicode(byte: u8) -> char {
    let b = byte as u32;
    let printable = (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
    if printable {
        return char::from_u32(b).expect("printable byte is a char");
    }
    // Non-printable bytes map, in byte order, to 256, 257, ...
    let rank = (0..byte as u32)
        .filter(|c| !((0x21..=0x7e).contains(c) || (0xa1..=0xac).contains(c) || (0xae..=0xff).contains(c)))
        .count() as u32;
    char::from_u32(256 + rank).expect("valid code point")
}

/// Build a vocabulary of exactly `vocab_size` tokens. Fails when it cannot hold the byte tokens
/// and specials.
pub fn synthetic_vocab(vocab_size: usize) -> Result<SyntheticVocab, String> {
    synthetic_vocab_with(vocab_size, VocabSpecials::ChatMl)
}

/// [`synthetic_vocab`] ending in the given specials.
pub fn synthetic_vocab_with(vocab_size: usize, specials: VocabSpecials) -> Result<SyntheticVocab, String> {
    let specials = specials.tokens();
    let min = 256 + specials.len();
    if vocab_size < min {
        return Err(format!(
            "vocab size {vocab_size} is below {min}, the minimum for a byte-level tokenizer"
        ));
    }
    let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_to_unicode(b).to_string()).collect();
    let n_merged = vocab_size - 256 - specials.len();
    let mut merges = Vec::with_capacity(n_merged);
    // Breadth-first: every token of length L joined with each letter gives distinct tokens of
    // length L + 1, so no text repeats.
    let mut parent_idx = usize::from(b'a');
    let letters: Vec<char> = ('a'..='z').collect();
    'outer: while merges.len() < n_merged {
        let parent = tokens[parent_idx].clone();
        if parent.chars().all(|c| c.is_ascii_lowercase()) {
            for &letter in &letters {
                if merges.len() == n_merged {
                    break 'outer;
                }
                merges.push(format!("{parent} {letter}"));
                tokens.push(format!("{parent}{letter}"));
            }
        }
        parent_idx += 1;
    }
    let mut token_types = vec![TokenType::Normal.gguf_value(); tokens.len()];
    let first = tokens.len() as u32;
    for special in specials {
        tokens.push(special.to_string());
        token_types.push(TokenType::Control.gguf_value());
    }
    debug_assert_eq!(tokens.len(), vocab_size);
    let id = |text: &str, default: u32| {
        specials.iter().position(|s| *s == text).map_or(default, |i| first + i as u32)
    };
    let (bos_id, eos_id) = (id("<|startoftext|>", first), id("<|return|>", first));
    Ok(SyntheticVocab { tokens, token_types, merges, bos_id, eos_id })
}

impl SyntheticVocab {
    /// The GGUF tokenizer metadata (`tokenizer.ggml.*`) of this vocabulary, without a template.
    pub fn gguf_metadata(&self) -> Vec<(String, MetaValue)> {
        let mut m = vec![
            ("tokenizer.ggml.model", MetaValue::String("gpt2".into())),
            ("tokenizer.ggml.pre", MetaValue::String("default".into())),
            ("tokenizer.ggml.tokens", MetaValue::string_array(self.tokens.clone())),
            ("tokenizer.ggml.token_type", MetaValue::i32_array(self.token_types.clone())),
            ("tokenizer.ggml.merges", MetaValue::string_array(self.merges.clone())),
            ("tokenizer.ggml.bos_token_id", MetaValue::U32(self.bos_id)),
            ("tokenizer.ggml.eos_token_id", MetaValue::U32(self.eos_id)),
            ("tokenizer.ggml.padding_token_id", MetaValue::U32(self.eos_id)),
            ("tokenizer.ggml.add_bos_token", MetaValue::Bool(false)),
        ];
        m.drain(..).map(|(k, v)| (k.to_string(), v)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn vocab_has_exact_size_unique_tokens_and_valid_merges() {
        for size in [MIN_VOCAB, 300, 1000, 5000] {
            let v = synthetic_vocab(size).unwrap();
            assert_eq!(v.tokens.len(), size);
            assert_eq!(v.token_types.len(), size);
            let set: HashSet<_> = v.tokens.iter().collect();
            assert_eq!(set.len(), size, "tokens must be unique");
            for m in &v.merges {
                let (a, b) = m.split_once(' ').unwrap();
                assert!(set.contains(&a.to_string()) && set.contains(&b.to_string()));
                assert!(set.contains(&format!("{a}{b}")));
            }
        }
        assert!(synthetic_vocab(100).is_err());
    }

    #[test]
    fn byte_mapping_is_a_bijection() {
        let chars: HashSet<char> = (0..=255u8).map(byte_to_unicode).collect();
        assert_eq!(chars.len(), 256);
        assert_eq!(byte_to_unicode(b'a'), 'a');
        assert_eq!(byte_to_unicode(b' '), 'Ġ');
        assert_eq!(byte_to_unicode(b'\n'), 'Ċ');
    }
}
