//! Batched calls (continuous batching): several sequences, each with its own KV cache, in one
//! forward call. The row-wise stages (projections, router, hot and cold lanes, lm_head) run
//! once over every sequence's rows, so a hot expert's weights are read once per call and a
//! cold expert is computed once for all the tokens routed to it. Each row's q/k norm, RoPE and
//! KV append run in one launch, and the decode rows' attention in one (split over positions,
//! then combined), over per-row positions and cache addresses on the device ([`BatchRows`]);
//! prefill chunks' attention and the recurrent state run per sequence ([`GpuSeg`]). A
//! one-sequence call takes [`GpuModel::forward_rows`] (and so the decode graphs).

use super::head::head_kernels;
use super::kv::GpuKvCache;
use super::mixer::decode_attention;
use super::model::{GpuModel, GpuSeg};
use super::shard::Shard;
use super::GpuError;
use crate::cache::perf::PerfState;
use crate::forward::{LogitRows, Logits};
use crate::model::context::KvType;
use crate::moe::cold::ColdLane;
use crate::moe::phase::Phase;
use crate::reference::ForwardError;
use moe_lanes_kernels::cuda::ops::BatchKv;
use moe_lanes_kernels::cuda::{CudaBackend, DPtr, DeviceBuffer};
use std::time::Instant;

/// One sequence of a batched call: its tokens and its cache.
pub struct GpuSeqInput<'a> {
    pub tokens: &'a [u32],
    pub cache: &'a mut GpuKvCache,
}

impl GpuModel {
    /// Run each sequence's tokens after what its cache holds, in one call; returns each
    /// sequence's last logits row (or greedy token), in order. Every sequence is checked before
    /// anything runs. A model split over devices runs each device's layers over every row, the
    /// rows hopping between devices.
    pub fn forward_batch(
        &mut self,
        seqs: &mut [GpuSeqInput<'_>],
        phase: Phase,
        cold: &mut dyn ColdLane,
    ) -> Result<Logits, GpuError> {
        if let [one] = seqs {
            return self.forward_rows(one.tokens, phase, one.cache, cold, LogitRows::Last);
        }
        let limit = self.call_token_limit();
        if seqs.iter().any(|s| s.tokens.len() > limit) {
            return self.forward_each(seqs, phase, cold);
        }
        let call_start = Instant::now();
        let t = self.start_batch(seqs)?;
        if self.ping_pong_applies(seqs, phase) {
            let halves = seqs.split_at(seqs.len().div_ceil(2));
            self.shards[0].ping_pong_layers(halves, cold, &mut self.perf)?;
        } else {
            for d in 0..self.shards.len() {
                if d > 0 {
                    self.hop(d, t)?;
                }
                self.shards[d].batch_layers(seqs, phase, t, cold, &mut self.perf)?;
            }
        }
        self.finish_batch(seqs, phase, t, call_start)
    }

    /// A batched call's start: every sequence checked and the call counted
    /// ([`GpuModel::start_call`]), the tokens embedded on the first device; the call's rows.
    fn start_batch(&mut self, seqs: &mut [GpuSeqInput<'_>]) -> Result<usize, GpuError> {
        let mut calls: Vec<(&[u32], &mut GpuKvCache)> =
            seqs.iter_mut().map(|s| (s.tokens, &mut *s.cache)).collect();
        self.start_call(&mut calls)?;
        drop(calls);
        let tokens: Vec<u32> = seqs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        self.enter(0)?;
        self.shards[0].embed(&tokens)?;
        Ok(tokens.len())
    }

    /// A batched call's end on the last device: each sequence's last row through the head, its
    /// logits row (or greedy token), the caches' positions moved on, the call's statistics.
    fn finish_batch(
        &mut self,
        seqs: &mut [GpuSeqInput<'_>],
        phase: Phase,
        t: usize,
        call_start: Instant,
    ) -> Result<Logits, GpuError> {
        let n = seqs.len();
        let mode = self.perf.mode();
        let last = self.last_mut();
        last.gather_last_rows(seqs)?;
        let copy_start = Instant::now();
        head_kernels(&last.dev, phase, n, LogitRows::All)?;
        let logits = last.head_copies(mode, t, n)?;
        let copy_us = copy_start.elapsed().as_secs_f64() * 1e6;
        for s in seqs.iter_mut() {
            s.cache.n_positions += s.tokens.len();
        }
        self.finish_call(phase, t, call_start, copy_start, copy_us)?;
        Ok(logits)
    }
}

impl GpuModel {
    /// [`GpuModel::forward_batch`] one sequence after another, each in calls of at most
    /// [`GpuModel::call_token_limit`] tokens (a prompt chunk longer than a sliding-window ring
    /// takes; the batcher's steps stay under it by default). Every sequence is checked first.
    fn forward_each(
        &mut self,
        seqs: &mut [GpuSeqInput<'_>],
        phase: Phase,
        cold: &mut dyn ColdLane,
    ) -> Result<Logits, GpuError> {
        for s in seqs.iter() {
            self.check_call(s.tokens, s.cache)?;
        }
        let mut logits = Logits::empty(self.config().vocab);
        for s in seqs.iter_mut() {
            logits.append(self.forward_rows(s.tokens, phase, s.cache, cold, LogitRows::Last)?);
        }
        Ok(logits)
    }
}

impl Shard {
    /// This device's layers over the call's rows; the q/k norm + RoPE + append of every row in
    /// one launch and the decode rows' attention in one (`BatchRows`), the rest per sequence.
    fn batch_layers(
        &mut self,
        seqs: &[GpuSeqInput<'_>],
        phase: Phase,
        t: usize,
        cold: &mut dyn ColdLane,
        perf: &mut PerfState,
    ) -> Result<(), GpuError> {
        let segs = segments(seqs);
        let dev = &mut self.dev;
        let kept = dev.rows.take();
        dev.rows = Some(BatchRows::build(&dev.be, kept, &segs, phase, dev.cfg.n_layers)?);
        let ran = self.run_layers(self.layers(), phase, (t, &segs), cold, perf);
        if let Some(r) = self.dev.rows.as_mut() {
            r.active = false;
        }
        ran
    }

    /// Each sequence's last hidden row moved to row `i` (its index), so the head runs over one
    /// row per sequence. Row `i` is never a later sequence's last row (that is at least its
    /// index), so the moves do not collide.
    pub(super) fn gather_last_rows(&self, seqs: &[GpuSeqInput<'_>]) -> Result<(), GpuError> {
        let dev = &self.dev;
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

/// The sequences' segments of a call's rows, in order from row 0.
pub(super) fn segments<'a>(seqs: &'a [GpuSeqInput<'_>]) -> Vec<GpuSeg<'a>> {
    let mut row0 = 0;
    let seg = |s: &'a GpuSeqInput<'_>| {
        let seg = GpuSeg { row0, n: s.tokens.len(), pos0: s.cache.n_positions, cache: &*s.cache };
        row0 += seg.n;
        seg
    };
    seqs.iter().map(seg).collect()
}

/// A batched call's rows on the device, for the one-launch q/k norm + RoPE + append and decode
/// attention: `ints` holds every row's position (`t`), then the call rows of the decode
/// sequences (`n_decode`: the rows whose attention takes the split kernel); `ptrs` holds, per
/// layer, every row's key cache address (`t`) then its value cache address (`t`). Uploaded once
/// per call; the buffers grow, never shrink.
pub(crate) struct BatchRows {
    ints: DeviceBuffer<i32>,
    ptrs: DeviceBuffer<u64>,
    /// Rows of the call.
    pub t: usize,
    /// Rows whose attention runs in the one batched launch.
    pub n_decode: usize,
    /// The most positions a decode row sees (its position + 1).
    pub max_positions: usize,
    kv_type: KvType,
    /// Set for the call's layers (`Device::batch_rows`).
    pub active: bool,
}

impl BatchRows {
    /// The tables of `segs` (every sequence's cache of one type), uploaded into `kept`'s buffers
    /// when they are large enough.
    pub fn build(
        be: &CudaBackend,
        kept: Option<BatchRows>,
        segs: &[GpuSeg<'_>],
        phase: Phase,
        n_layers: usize,
    ) -> Result<BatchRows, GpuError> {
        let Some(first) = segs.first() else { return Err(ForwardError::EmptyInput.into()) };
        let t: usize = segs.iter().map(|s| s.n).sum();
        let mut ints: Vec<i32> = Vec::with_capacity(2 * t);
        for seg in segs {
            ints.extend((seg.pos0..seg.pos0 + seg.n).map(|p| p as i32));
        }
        let decode = segs.iter().filter(|s| decode_attention(phase, s));
        let max_positions = decode.clone().map(|s| s.pos0 + s.n).max().unwrap_or(0);
        for seg in decode {
            ints.extend((seg.row0..seg.row0 + seg.n).map(|r| r as i32));
        }
        let n_decode = ints.len() - t;
        let mut ptrs: Vec<u64> = Vec::with_capacity(2 * n_layers * t);
        for l in 0..n_layers {
            ptrs.extend(segs.iter().flat_map(|s| std::iter::repeat_n(s.cache.k(l).raw(), s.n)));
            ptrs.extend(segs.iter().flat_map(|s| std::iter::repeat_n(s.cache.v(l).raw(), s.n)));
        }
        let kv_type = first.cache.kv_type();
        let (ints_buf, ptrs_buf) = match kept {
            Some(k) if k.ints.len() >= ints.len() && k.ptrs.len() >= ptrs.len() => (k.ints, k.ptrs),
            _ => (be.alloc_zeros::<i32>(2 * ints.len())?, be.alloc_zeros::<u64>(2 * ptrs.len())?),
        };
        be.write(&ints, ints_buf.ptr())?;
        be.write(&ptrs, ptrs_buf.ptr())?;
        Ok(BatchRows { ints: ints_buf, ptrs: ptrs_buf, t, n_decode, max_positions, kv_type, active: true })
    }

    /// Layer `l`'s rows for the kernels: positions and cache addresses of every row of the call.
    pub fn kv(&self, l: usize, window: usize) -> BatchKv {
        let (t, p) = (self.t, self.ptrs.ptr());
        BatchKv {
            pos: self.ints.ptr().sub(0, t),
            k: p.sub(2 * l * t, t),
            v: p.sub((2 * l + 1) * t, t),
            kv_type: self.kv_type,
            n_rows: t,
            max_positions: self.max_positions,
            window,
        }
    }

    /// The call rows of the batched attention launch (`n_decode`).
    pub fn decode_rows(&self) -> DPtr<i32> {
        self.ints.ptr().sub(self.t, self.n_decode)
    }
}
