//! The vocabulary of one forward call that every engine speaks: which logits rows to compute
//! ([`LogitRows`]) and what comes back ([`Logits`]); the phase ([`Phase`]) and the refusals
//! ([`ForwardError`]) are re-exported here so an engine imports them from one place. It sits below
//! the engines: `gpu/`, `moe/` and `engine/` all import it, and it imports none of them but the
//! phase and the oracle's error type.

use crate::moe::math::argmax;
pub use crate::moe::phase::Phase;
pub use crate::reference::ForwardError;

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
