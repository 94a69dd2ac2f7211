//! The vocabulary of one forward call that every engine speaks: its phase ([`Phase`]), which
//! logits rows to compute ([`LogitRows`]) and what comes back ([`Logits`], with each row's greedy
//! token by [`argmax`]); the refusals ([`ForwardError`]) are re-exported here so an engine imports
//! them from one place. It sits below the engines: `gpu/`, `moe/`, `engine/`, `cache/` and
//! `sample/` import it, and it imports none of them, only the oracle's error type.

pub use crate::reference::ForwardError;

/// The phase of one forward call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// First calls after start-up: conservative plan.
    Warmup,
    /// Prompt processing (PP).
    Prefill,
    /// Token generation (TG), including multi-token verify batches.
    Decode,
}

impl Phase {
    /// The name used in the perf JSON's `phases` section.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Warmup => "warmup",
            Phase::Prefill => "prefill",
            Phase::Decode => "decode",
        }
    }
}

/// Which logits rows a forward call computes (the lm_head runs only for those).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitRows {
    /// One row per token (the `logits` command).
    All,
    /// The last token's row only (generation: prefill and decode).
    Last,
}

/// Logits of one forward call: `n_rows` rows of `vocab` (empty `data` when the engine was told
/// not to copy them), plus the greedy token of each row (the first index of the maximum).
#[derive(Debug, Clone)]
pub struct Logits {
    pub n_rows: usize,
    pub vocab: usize,
    pub data: Vec<f32>,
    pub argmax: Vec<u32>,
}

impl Logits {
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }

    /// From one row per token (the CPU engines' form).
    /// One row (every decode step) is moved, not copied.
    pub fn from_rows(mut rows: Vec<Vec<f32>>, vocab: usize) -> Logits {
        let argmax = rows.iter().map(|r| argmax(r)).collect();
        let n_rows = rows.len();
        let data = if n_rows == 1 { rows.pop().expect("one row") } else { rows.concat() };
        Logits { n_rows, vocab, data, argmax }
    }

    /// No rows yet (a batched call's result, filled by [`Logits::append`]).
    pub fn empty(vocab: usize) -> Logits {
        Logits { n_rows: 0, vocab, data: Vec::new(), argmax: Vec::new() }
    }

    /// `other`'s rows after these.
    pub fn append(&mut self, mut other: Logits) {
        self.n_rows += other.n_rows;
        self.data.append(&mut other.data);
        self.argmax.append(&mut other.argmax);
    }

    /// The last row alone (its logits, when copied, and its greedy token).
    pub fn last_row(self) -> Logits {
        let last = self.n_rows.checked_sub(1).expect("one row per token");
        let data = if self.data.is_empty() { Vec::new() } else { self.row(last).to_vec() };
        Logits { n_rows: 1, vocab: self.vocab, data, argmax: vec![self.argmax[last]] }
    }

    pub fn rows(&self) -> Vec<Vec<f32>> {
        self.data.chunks_exact(self.vocab.max(1)).map(<[f32]>::to_vec).collect()
    }
}

/// Index of the largest value (the first one on ties), as a scan keeping the first `v >
/// best` gives: NaNs never win over a number, and a NaN at index 0 makes the answer 0.
///
/// Two vectorised passes over 16-value chunks, so a vocabulary row (152k logits on Qwen3) is
/// read at memory speed, not one compare-and-branch per value: lane-wise maxima (`v > lane ?
/// v : lane` is one `maxps`), then the first chunk holding the maximum.
pub fn argmax(values: &[f32]) -> u32 {
    const LANES: usize = 16;
    let Some(&first) = values.first() else { return 0 };
    if first.is_nan() {
        return 0;
    }
    let mut lanes = [first; LANES];
    for chunk in values.chunks_exact(LANES) {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane = if v > *lane { v } else { *lane };
        }
    }
    let rest = values.chunks_exact(LANES).remainder();
    let max = lanes.iter().chain(rest).fold(first, |m, &v| if v > m { v } else { m });
    // `max` is a number (never NaN), and it occurs: the first chunk with an equal value holds
    // the answer (== treats -0.0 and 0.0 alike, as `>` does in the scan).
    let hit = |chunk: &[f32]| chunk.iter().fold(false, |any, &v| any | (v == max));
    let chunk = values.chunks(LANES).position(hit).unwrap_or(0);
    let at = values[chunk * LANES..].iter().position(|&v| v == max).unwrap_or(0);
    (chunk * LANES + at) as u32
}

/// One piece of a sub-batch: `tokens` of sequence `seq` of a batched call (a range of that
/// sequence's tokens; a long sequence is cut over several sub-batches, in order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchPiece {
    pub seq: usize,
    pub tokens: std::ops::Range<usize>,
}

/// A batched call's sequences (their token counts, in order) packed into sub-batches of at most
/// `max_tokens` tokens: sequences fill a sub-batch in order, a sequence that does not fit is cut
/// and continues in the next. Every sub-batch holds a sequence at most once, so each sequence's
/// cache sees its tokens in order.
pub fn pack_batch(lens: &[usize], max_tokens: usize) -> Vec<Vec<BatchPiece>> {
    assert!(max_tokens > 0, "a sub-batch holds at least one token");
    let mut batches = Vec::new();
    let mut current: Vec<BatchPiece> = Vec::new();
    let mut room = max_tokens;
    for (seq, &len) in lens.iter().enumerate() {
        let mut at = 0;
        while at < len {
            let take = room.min(len - at);
            current.push(BatchPiece { seq, tokens: at..at + take });
            at += take;
            room -= take;
            if room == 0 {
                batches.push(std::mem::take(&mut current));
                room = max_tokens;
            }
        }
    }
    if !current.is_empty() {
        batches.push(current);
    }
    batches
}

#[cfg(test)]
mod batch_tests {
    use super::*;

    #[test]
    fn packing_keeps_every_token_in_order_and_each_batch_under_the_limit() {
        for max in 1..9 {
            let lens = [3, 0, 7, 1, 1, 12, 2];
            let batches = pack_batch(&lens, max);
            let mut next = [0usize; 7];
            for b in &batches {
                assert!(b.iter().map(|p| p.tokens.len()).sum::<usize>() <= max);
                let mut seen = std::collections::HashSet::new();
                for p in b {
                    assert!(seen.insert(p.seq), "sequence {} twice in one sub-batch", p.seq);
                    assert_eq!(p.tokens.start, next[p.seq]);
                    assert!(!p.tokens.is_empty());
                    next[p.seq] = p.tokens.end;
                }
            }
            assert_eq!(next, lens);
        }
    }

    #[test]
    fn sequences_that_fit_share_one_sub_batch() {
        let b = pack_batch(&[1, 1, 1, 1], 512);
        assert_eq!(b.len(), 1);
        assert_eq!(b[0].len(), 4);
    }
}
