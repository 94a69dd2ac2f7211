//! Byte-level BPE (GGUF `tokenizer.ggml.model = "gpt2"`): each pre-tokenized word is spelled in
//! GPT-2's printable byte alphabet, one symbol per byte, then the adjacent pair of lowest merge
//! rank is merged (leftmost first on ties) until no pair has a rank — llama.cpp's and Hugging
//! Face's algorithm. Symbols are token ids and merges an id-pair hash map, so no strings are
//! built per step.

use super::vocab::GgufVocab;
use crate::vocab::byte_to_unicode;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// GPT-2's byte alphabet both ways, and each byte's token id.
#[derive(Debug)]
pub struct ByteLevel {
    /// Token id of each byte's one-char token, if the vocabulary has it.
    pub byte_ids: [Option<u32>; 256],
    /// Printable char -> byte.
    pub char_to_byte: HashMap<char, u8>,
    /// Byte -> printable char.
    byte_chars: [char; 256],
}

impl ByteLevel {
    pub fn new(ids: &HashMap<String, u32>) -> ByteLevel {
        let mut byte_ids = [None; 256];
        let mut char_to_byte = HashMap::with_capacity(256);
        let mut byte_chars = ['\0'; 256];
        for b in 0..=255u8 {
            let c = byte_to_unicode(b);
            char_to_byte.insert(c, b);
            byte_chars[b as usize] = c;
            byte_ids[b as usize] = ids.get(c.encode_utf8(&mut [0; 4]) as &str).copied();
        }
        ByteLevel { byte_ids, char_to_byte, byte_chars }
    }

    /// The byte-level spelling of `word` (for the whole-word lookup of `ignore_merges`).
    pub fn spell(&self, word: &[u8]) -> String {
        word.iter().map(|&b| self.byte_chars[b as usize]).collect()
    }

    /// The raw bytes a byte-level token text stands for. A char outside the alphabet (only in a
    /// malformed vocabulary) stands for its own UTF-8 bytes.
    pub fn decode_text(&self, text: &str, out: &mut Vec<u8>) {
        for c in text.chars() {
            match self.char_to_byte.get(&c) {
                Some(&b) => out.push(b),
                None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
            }
        }
    }
}

/// One symbol of a word being merged: a token id and its neighbours.
#[derive(Clone, Copy)]
struct Symbol {
    id: u32,
    prev: Option<usize>,
    next: Option<usize>,
    alive: bool,
}

/// Encode one word (raw bytes of a pre-tokenized piece) and append its ids to `out`.
pub fn encode_word(vocab: &GgufVocab, bytes: &ByteLevel, word: &[u8], out: &mut Vec<u32>) {
    let mut symbols: Vec<Symbol> = Vec::with_capacity(word.len());
    for &b in word {
        match bytes.byte_ids[b as usize] {
            Some(id) => {
                let i = symbols.len();
                symbols.push(Symbol { id, prev: i.checked_sub(1), next: Some(i + 1), alive: true });
            }
            // A byte with no token (malformed vocabulary): llama.cpp drops it; so do we.
            None => continue,
        }
    }
    let Some(last) = symbols.last_mut() else { return };
    last.next = None;
    // Min-heap of (rank, left index, left id, right id); stale entries are skipped on pop.
    let mut heap = BinaryHeap::new();
    let push = |heap: &mut BinaryHeap<_>, symbols: &[Symbol], left: usize| {
        let Some(right) = symbols[left].next else { return };
        if let Some(&(rank, _)) = vocab.merges.get(&(symbols[left].id, symbols[right].id)) {
            heap.push(Reverse((rank, left, symbols[left].id, symbols[right].id)));
        }
    };
    for i in 0..symbols.len() {
        push(&mut heap, &symbols, i);
    }
    while let Some(Reverse((_, left, left_id, right_id))) = heap.pop() {
        let l = symbols[left];
        let Some(right) = l.next else { continue };
        if !l.alive || l.id != left_id || symbols[right].id != right_id {
            continue;
        }
        let (_, merged) = vocab.merges[&(left_id, right_id)];
        let after = symbols[right].next;
        symbols[left].id = merged;
        symbols[left].next = after;
        symbols[right].alive = false;
        if let Some(a) = after {
            symbols[a].prev = Some(left);
        }
        if let Some(p) = symbols[left].prev {
            push(&mut heap, &symbols, p);
        }
        push(&mut heap, &symbols, left);
    }
    out.extend(symbols.iter().filter(|s| s.alive).map(|s| s.id));
}
