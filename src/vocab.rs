//! A small, valid byte-level BPE tokenizer for synthetic GGUF files, so llama.cpp's loader (which
//! needs tokens, token types and merges, and tokenizes "\n" at load) accepts them.
//!
//! Layout of the vocabulary: the 256 byte tokens in GPT-2's byte-to-unicode spelling, then tokens
//! made by merges (each merge joins an existing token with one lowercase letter), then the special
//! tokens at the end.

use crate::format::gguf::TokenType;

/// Special tokens placed at the end of every synthetic vocabulary; the first is BOS/EOS.
pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// Smallest vocabulary that holds the byte tokens and the specials.
pub const MIN_VOCAB: usize = 256 + SPECIAL_TOKENS.len();

/// A synthetic tokenizer.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticVocab {
    pub tokens: Vec<String>,
    pub token_types: Vec<i32>,
    pub merges: Vec<String>,
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
    if vocab_size < MIN_VOCAB {
        return Err(format!(
            "vocab size {vocab_size} is below {MIN_VOCAB}, the minimum for a byte-level tokenizer"
        ));
    }
    let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_to_unicode(b).to_string()).collect();
    let n_merged = vocab_size - 256 - SPECIAL_TOKENS.len();
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
    let eos_id = tokens.len() as u32;
    for special in SPECIAL_TOKENS {
        tokens.push(special.to_string());
        token_types.push(TokenType::Control.gguf_value());
    }
    debug_assert_eq!(tokens.len(), vocab_size);
    Ok(SyntheticVocab { tokens, token_types, merges, eos_id })
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
