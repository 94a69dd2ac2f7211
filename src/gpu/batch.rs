//! Batched calls (continuous batching): several sequences, each with its own KV cache, in one
//! forward call. The row-wise stages (projections, router, hot and cold lanes, lm_head) run
//! once over every sequence's rows, so a hot expert's weights are read once per call and a
//! cold expert is computed once for all the tokens routed to it; RoPE, the KV append,
//! attention and the recurrent state run per sequence ([`GpuSeg`]). A one-sequence call takes
//! [`GpuModel::forward_rows`] (and so the decode graphs).

use super::kv::GpuKvCache;
use super::model::{GpuModel, GpuSeg};
use super::GpuError;
use crate::forward::{LogitRows, Logits};
use crate::moe::cold::ColdLane;
use crate::moe::phase::Phase;
use std::time::Instant;

/// One sequence of a batched call: its tokens and its cache.
pub struct GpuSeqInput<'a> {
    pub tokens: &'a [u32],
    pub cache: &'a mut GpuKvCache,
}

impl GpuModel {
    /// Run each sequence's tokens after what its cache holds, in one call; returns each
    /// sequence's last logits row (or greedy token), in order. Every sequence is checked before
    /// anything runs.
    pub fn forward_batch(
        &mut self,
        seqs: &mut [GpuSeqInput<'_>],
        phase: Phase,
        cold: &mut dyn ColdLane,
    ) -> Result<Logits, GpuError> {
        if let [one] = seqs {
            return self.forward_rows(one.tokens, phase, one.cache, cold, LogitRows::Last);
        }
        let call_start = Instant::now();
        for s in seqs.iter() {
            self.check_call(s.tokens, s.cache)?;
        }
        self.call_idx += 1;
        if self.opts.faults.gpu_lost_at_call == Some(self.call_idx) {
            return Err(GpuError::Injected { what: "gpu lost" });
        }
        self.be.bind_to_thread()?;
        let tokens: Vec<u32> = seqs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let t = tokens.len();
        self.reserve_tokens(t)?;
        for s in seqs.iter() {
            if s.cache.n_positions == 0 {
                // A new (or cleared) session: recurrent layers start from zero state.
                s.cache.reset_recurrent(&self.be)?;
            }
        }
        self.embed(&tokens)?;
        self.batch_layers(seqs, phase, t, cold)?;
        let n = seqs.len();
        self.gather_last_rows(seqs)?;
        let copy_start = Instant::now();
        self.head_kernels(phase, n, LogitRows::All)?;
        let logits = self.head_copies(t, n)?;
        let copy_us = copy_start.elapsed().as_secs_f64() * 1e6;
        for s in seqs.iter_mut() {
            s.cache.n_positions += s.tokens.len();
        }
        self.finish_call(phase, t, call_start, copy_start, copy_us)?;
        Ok(logits)
    }

    /// Every layer over the call's rows, the mixers per sequence.
    fn batch_layers(
        &mut self,
        seqs: &[GpuSeqInput<'_>],
        phase: Phase,
        t: usize,
        cold: &mut dyn ColdLane,
    ) -> Result<(), GpuError> {
        let mut row0 = 0;
        let segs: Vec<GpuSeg<'_>> = seqs
            .iter()
            .map(|s| {
                let seg = GpuSeg { row0, n: s.tokens.len(), pos0: s.cache.n_positions, cache: &*s.cache };
                row0 += seg.n;
                seg
            })
            .collect();
        for l in 0..self.cfg.n_layers {
            self.mark(l, 0)?;
            self.mixer_block(l, phase, t, &segs)?;
            self.moe_block(l, phase, t, cold)?;
        }
        Ok(())
    }

    /// Each sequence's last hidden row moved to row `i` (its index), so the head runs over one
    /// row per sequence. Row `i` is never a later sequence's last row (that is at least its
    /// index), so the moves do not collide.
    fn gather_last_rows(&self, seqs: &[GpuSeqInput<'_>]) -> Result<(), GpuError> {
        let (h, s) = (self.cfg.hidden, self.scratch.as_ref().expect("reserved"));
        let mut end = 0;
        for (i, seq) in seqs.iter().enumerate() {
            end += seq.tokens.len();
            if end - 1 != i {
                let hidden = s.hidden.ptr();
                self.be.copy(hidden.sub((end - 1) * h, h), hidden.sub(i * h, h))?;
            }
        }
        Ok(())
    }
}
