//! Batched calls (continuous batching): several sequences, each with its own KV cache, in one
//! forward call. The row-wise stages (projections, router, hot and cold lanes, lm_head) run
//! once over every sequence's rows, so a hot expert's weights are read once per call and a
//! cold expert is computed once for all the tokens routed to it; RoPE, the KV append,
//! attention and the recurrent state run per sequence ([`GpuSeg`]). A one-sequence call takes
//! [`GpuModel::forward_rows`] (and so the decode graphs).

use super::head::head_kernels;
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
        let mut calls: Vec<(&[u32], &mut GpuKvCache)> =
            seqs.iter_mut().map(|s| (s.tokens, &mut *s.cache)).collect();
        self.start_call(&mut calls)?;
        drop(calls);
        let tokens: Vec<u32> = seqs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let t = tokens.len();
        self.embed(&tokens)?;
        self.batch_layers(seqs, phase, t, cold)?;
        let n = seqs.len();
        self.gather_last_rows(seqs)?;
        let copy_start = Instant::now();
        head_kernels(self.dev(), phase, n, LogitRows::All)?;
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
        self.layers(0..self.dev().cfg.n_layers, phase, t, &segs, cold)
    }

    /// Each sequence's last hidden row moved to row `i` (its index), so the head runs over one
    /// row per sequence. Row `i` is never a later sequence's last row (that is at least its
    /// index), so the moves do not collide.
    fn gather_last_rows(&self, seqs: &[GpuSeqInput<'_>]) -> Result<(), GpuError> {
        let dev = self.dev();
        let (h, s) = (dev.cfg.hidden, dev.s());
        let mut end = 0;
        for (i, seq) in seqs.iter().enumerate() {
            end += seq.tokens.len();
            if end - 1 != i {
                let hidden = s.hidden.ptr();
                dev.be.copy(hidden.sub((end - 1) * h, h), hidden.sub(i * h, h))?;
            }
        }
        Ok(())
    }
}
