//! The ends of a forward call on the GPU: the embedding of the call's tokens, and the head
//! (final norm, lm_head, greedy tokens on the device) with the copies back.

use super::device::Device;
use super::GpuError;
use crate::cache::perf::PerfMode;
use crate::forward::{LogitRows, Logits};
use crate::model::config::ModelConfig;
use crate::moe::phase::Phase;
use moe_lanes_kernels::cuda::{CudaBackend, DPtr, PinnedBuffer};

/// The embedding and head stage; owns the token ids' host buffer and the pinned tail.
pub(crate) struct HeadStage {
    tokens: Vec<i32>,
    /// Host copy of `Scratch::tail_i` (tokens, then every layer's routing ids), filled by the
    /// call's final copy when the perf state records.
    pub pin_tail: PinnedBuffer<i32>,
}

impl HeadStage {
    pub fn new(be: &CudaBackend, cfg: &ModelConfig, cap: usize) -> Result<HeadStage, GpuError> {
        let pin_tail = be.alloc_pinned::<i32>(cap + cfg.n_layers * cap * cfg.n_experts_used)?;
        Ok(HeadStage { tokens: Vec::with_capacity(cap), pin_tail })
    }

    /// The call's token ids onto the device and their embedding rows into the hidden rows.
    pub fn embed(&mut self, dev: &Device, tokens: &[u32]) -> Result<(), GpuError> {
        let s = dev.s();
        self.tokens.clear();
        self.tokens.extend(tokens.iter().map(|&x| x as i32));
        dev.mark_tail(0)?;
        dev.be.write(&self.tokens, s.tokens.ptr())?;
        embed_rows(dev, s.tokens.ptr().sub(0, tokens.len()))
    }

    /// The head's copies back: every logits row when asked for, and the greedy tokens; when
    /// the perf state records (`perf_mode`), the same copy also brings every layer's routing
    /// ids of the call's `t` tokens into [`HeadStage::pin_tail`] (one transfer).
    pub fn copies(
        &mut self,
        dev: &Device,
        perf_mode: PerfMode,
        t: usize,
        n: usize,
    ) -> Result<Logits, GpuError> {
        let (c, be, s) = (&dev.cfg, &dev.be, dev.s());
        let mut data = Vec::new();
        if dev.opts.copy_logits {
            data = vec![0f32; n * c.vocab];
            be.read(s.logits.ptr().sub(0, n * c.vocab), &mut data)?;
        }
        let argmax = if perf_mode == PerfMode::Off {
            let mut am = vec![0i32; n];
            be.read(s.argmax().sub(0, n), &mut am)?;
            am.into_iter().map(|x| x as u32).collect()
        } else {
            let len = s.cap + c.n_layers * t * c.n_experts_used;
            be.read_async(s.tail_i.ptr().sub(0, len), &mut self.pin_tail, len)?;
            self.pin_tail.as_slice()?[..n].iter().map(|&x| x as u32).collect()
        };
        Ok(Logits { n_rows: n, vocab: c.vocab, data, argmax })
    }
}

/// The embedding rows of the token ids at `ids` (on the device) into the hidden rows (times the
/// config's embedding scale, Gemma 4's `sqrt(hidden)`).
pub(crate) fn embed_rows(dev: &Device, ids: DPtr<i32>) -> Result<(), GpuError> {
    let s = dev.s();
    let (table, n, h) = (dev.w.embed(), ids.len(), dev.cfg.hidden);
    match table.bf16() {
        Some(bf) => dev.be.embed(bf, ids, s.hidden.ptr(), n, h)?,
        None => dev.be.embed_typed(table, dev.cfg.vocab, ids, s.hidden.ptr(), n, h)?,
    }
    if let Some(scale) = dev.cfg.embedding_scale {
        dev.be.scale(s.hidden.ptr(), n * h, scale)?;
    }
    Ok(())
}

/// The head's kernels (final norm, lm_head, the logits' soft cap, argmax) for the `rows` asked for (`Last`: the last
/// token's row alone, by the one-row GEMV); returns how many logits rows they wrote.
pub(crate) fn head_kernels(dev: &Device, phase: Phase, t: usize, rows: LogitRows) -> Result<usize, GpuError> {
    let (c, be, s) = (&dev.cfg, &dev.be, dev.s());
    let (first, n, phase) = match rows {
        LogitRows::All => (0, t, phase),
        LogitRows::Last => (t - 1, 1, Phase::Decode),
    };
    let x = s.hidden.ptr().sub(first * c.hidden, n * c.hidden);
    let (final_norm, head) = dev.w.head();
    be.rmsnorm(x, final_norm.ptr(), s.normed.ptr(), n, c.hidden, c.rms_eps)?;
    dev.linear(phase, s.normed.ptr(), head, s.logits.ptr(), n, c.vocab, c.hidden, false)?;
    if let Some(cap) = c.final_logit_softcap {
        be.softcap(s.logits.ptr(), n * c.vocab, cap)?;
    }
    dev.mark_tail(1)?;
    if n < be.info().multiprocessors.max(1) as usize {
        // decode and batched decode: each row over many blocks (one block a row leaves SMs idle
        // and is latency bound: 58 us for 16 rows of a 151936-token vocabulary on the H200)
        be.argmax_split(s.logits.ptr(), n, c.vocab, s.argmax(), s.argmax_part.ptr())?;
    } else {
        be.argmax(s.logits.ptr(), n, c.vocab, s.argmax())?;
    }
    dev.mark_tail(2)?;
    Ok(n)
}
