//! Special and added tokens in text: before any pre-tokenizing, the text is cut at every
//! occurrence of a control or user-defined token's text (longest tokens first), and the
//! occurrences become those tokens, never split by BPE or SentencePiece. As in llama.cpp,
//! user-defined tokens are always matched; control and unknown tokens only with
//! `parse_special`.

use super::vocab::GgufVocab;
use crate::format::gguf::TokenType;
use std::ops::Range;

/// A piece of the input: text still to tokenize, or a token found in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fragment {
    Text(Range<usize>),
    Token(u32),
}

/// The ids matched in text, longest text first (ties by id, for determinism).
pub fn special_tokens(vocab: &GgufVocab) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..vocab.tokens.len() as u32)
        .filter(|&id| {
            let t = vocab.types[id as usize];
            matches!(t, TokenType::Control | TokenType::UserDefined | TokenType::Unknown)
                && !vocab.tokens[id as usize].is_empty()
        })
        .collect();
    ids.sort_by_key(|&id| (std::cmp::Reverse(vocab.tokens[id as usize].len()), id));
    ids
}

/// Cut `text` into fragments at the special tokens in `specials` (see the module docs).
pub fn partition(vocab: &GgufVocab, specials: &[u32], text: &str, parse_special: bool) -> Vec<Fragment> {
    let mut fragments = vec![Fragment::Text(0..text.len())];
    if text.is_empty() {
        fragments.clear();
        return fragments;
    }
    for &id in specials {
        if !parse_special && vocab.types[id as usize].is_special() {
            continue;
        }
        let needle = vocab.tokens[id as usize].as_str();
        if !fragments.iter().any(|f| matches!(f, Fragment::Text(r) if text[r.clone()].contains(needle))) {
            continue;
        }
        let mut next = Vec::with_capacity(fragments.len() + 2);
        for fragment in fragments {
            let Fragment::Text(range) = fragment else {
                next.push(fragment);
                continue;
            };
            let mut start = range.start;
            for (at, _) in text[range.clone()].match_indices(needle) {
                let at = range.start + at;
                if at > start {
                    next.push(Fragment::Text(start..at));
                }
                next.push(Fragment::Token(id));
                start = at + needle.len();
            }
            if start < range.end {
                next.push(Fragment::Text(start..range.end));
            }
        }
        fragments = next;
    }
    fragments
}
