//! SentencePiece-style tokenization (GGUF `tokenizer.ggml.model = "llama"`), as llama.cpp does
//! it: spaces become `▁`, the text is split into UTF-8 chars, and the adjacent pair whose
//! concatenation is a token of highest score is merged (leftmost first on ties) until no pair
//! is a token. A char that is no token is spelled in its `<0xNN>` byte tokens.

use super::vocab::GgufVocab;
use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// `▁` (U+2581), SentencePiece's visible space.
pub const SPACE: &str = "\u{2581}";

/// A candidate merge; ordered so the heap pops the highest score, then the leftmost.
#[derive(PartialEq)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

impl Eq for Bigram {}

impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score.total_cmp(&other.score).then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// One symbol: a byte range of the text and its neighbours; `len == 0` once merged away.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// Each byte's `<0xNN>` token id.
pub fn byte_tokens(vocab: &GgufVocab) -> [Option<u32>; 256] {
    let mut out = [None; 256];
    for (b, slot) in out.iter_mut().enumerate() {
        *slot = vocab.ids.get(&format!("<0x{b:02X}>")).copied();
        if slot.is_none() && b < 0x80 {
            // llama.cpp falls back to the char itself when the byte token is missing.
            *slot = vocab.ids.get((b as u8 as char).encode_utf8(&mut [0; 4]) as &str).copied();
        }
    }
    out
}

/// Tokenize `text` (already `▁`-escaped) and append the ids to `out`.
pub fn encode(vocab: &GgufVocab, bytes: &[Option<u32>; 256], text: &str, out: &mut Vec<u32>) {
    let mut symbols: Vec<Symbol> = text
        .char_indices()
        .enumerate()
        .map(|(i, (start, c))| Symbol { start, len: c.len_utf8(), prev: i.checked_sub(1), next: Some(i + 1) })
        .collect();
    let Some(last) = symbols.last_mut() else { return };
    last.next = None;
    let mut heap = BinaryHeap::new();
    let try_push = |heap: &mut BinaryHeap<Bigram>, symbols: &[Symbol], left: usize| {
        let Some(right) = symbols[left].next else { return };
        let (l, r) = (symbols[left], symbols[right]);
        let piece = &text[l.start..r.start + r.len];
        if let Some(&id) = vocab.ids.get(piece) {
            heap.push(Bigram { score: vocab.scores[id as usize], left, right, len: piece.len() });
        }
    };
    for i in 0..symbols.len() {
        try_push(&mut heap, &symbols, i);
    }
    while let Some(bigram) = heap.pop() {
        let (l, r) = (symbols[bigram.left], symbols[bigram.right]);
        // Skip a pair one of whose symbols has merged since.
        if l.len == 0 || r.len == 0 || l.len + r.len != bigram.len || l.next != Some(bigram.right) {
            continue;
        }
        symbols[bigram.left].len += r.len;
        symbols[bigram.left].next = r.next;
        symbols[bigram.right].len = 0;
        if let Some(n) = r.next {
            symbols[n].prev = Some(bigram.left);
        }
        if let Some(p) = l.prev {
            try_push(&mut heap, &symbols, p);
        }
        try_push(&mut heap, &symbols, bigram.left);
    }
    let mut i = Some(0);
    while let Some(idx) = i {
        let s = symbols[idx];
        let piece = &text[s.start..s.start + s.len];
        match vocab.ids.get(piece) {
            Some(&id) => out.push(id),
            None => out.extend(piece.bytes().filter_map(|b| bytes[b as usize])),
        }
        i = s.next;
    }
}

/// `<0xNN>` -> the byte.
pub fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}
