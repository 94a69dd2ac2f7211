//! Per-call buffers of the GPU engine, sized once for a token capacity and reused: device
//! activations, the integer worklist upload, pinned staging for the cold lane ([`MoePinned`]), and
//! the host-side worklist and cold-slot lists. A steady-state call allocates nothing here.

use super::GpuError;
use crate::model::arch::VHeadOrder;
use crate::model::config::ModelConfig;
use crate::moe::cold::ColdSlot;
use crate::moe::worklist::Worklist;
use moe_lanes_kernels::cuda::ops::DeltaShape;
use moe_lanes_kernels::cuda::{CudaBackend, DPtr, DeviceBuffer, PinnedBuffer, Q8Rows};
use moe_lanes_kernels::q8::Q8_BLOCK;

/// Offsets of the sections of the integer worklist (one upload per layer):
/// `slots`/`tokens` per hot entry, `tok_off`/`tok_rows` per token row with hot entries,
/// `entries` (hot entry indices grouped by token row), `cold_rows` (token of each cold row) and
/// `tiles` (the grouped hot-lane GEMM's `(slot, first row, rows)` triples, at most one per entry).
#[derive(Clone, Copy)]
pub(crate) struct WorkLayout {
    pub slots: usize,
    pub tokens: usize,
    pub tok_off: usize,
    pub tok_rows: usize,
    pub entries: usize,
    pub cold_rows: usize,
    pub tiles: usize,
    pub len: usize,
}

impl WorkLayout {
    pub fn new(cap: usize, k: usize) -> WorkLayout {
        let n = cap * k;
        let slots = 0;
        let tokens = slots + n;
        let tok_off = tokens + n;
        let tok_rows = tok_off + cap + 1;
        let entries = tok_rows + cap;
        let cold_rows = entries + n;
        let tiles = cold_rows + cap;
        WorkLayout { slots, tokens, tok_off, tok_rows, entries, cold_rows, tiles, len: tiles + 3 * n }
    }
}

/// Device scratch sized for `cap` tokens.
pub(crate) struct Scratch {
    pub cap: usize,
    pub layout: WorkLayout,
    pub tokens: DeviceBuffer<i32>,
    /// The decode graph's per-token input: the token and its position (one upload per token).
    pub step: DeviceBuffer<i32>,
    /// New key rows then value rows of a call (`2 * cap * kv_dim`; a call of `t` tokens uses `t`
    /// key rows then `t` value rows): the q/k/v projections write here when the cache does not
    /// take them in place (the decode graph, an f16 cache), and the q/k norm + RoPE appends them
    /// (converted) at the device position or the call's (or `kv_store_rows` does, unfused).
    pub kv_step: DeviceBuffer<f32>,
    pub hidden: DeviceBuffer<f32>,
    pub normed: DeviceBuffer<f32>,
    pub moe_out: DeviceBuffer<f32>,
    pub q: DeviceBuffer<f32>,
    /// A gated attention layer's output gate logits (`q_dim` a row).
    pub gate: DeviceBuffer<f32>,
    /// A DeltaNet layer's `[q|k|v|z]` projections (the conv runs in place over them), its
    /// `[b|a]` projections and its per-head outputs.
    pub delta_p: DeviceBuffer<f32>,
    pub delta_ba: DeviceBuffer<f32>,
    pub delta_out: DeviceBuffer<f32>,
    /// The DeltaNet prefill's work: the conv's raw inputs, then the chunked delta rule's
    /// per-(head, chunk) records (`DeltaShape::prefill_work_floats`).
    pub delta_work: DeviceBuffer<f32>,
    pub attn: DeviceBuffer<f32>,
    /// A latent attention layer's rows (empty without one): `q_a`'s output, `kv_a`'s, q, the
    /// absorbed queries (`heads * (rank + rope)` a row), the latent each head attends to
    /// (`heads * rank`) and the heads' values (`heads * v`, `o`'s input).
    pub mla: MlaScratch,
    pub router_logits: DeviceBuffer<f32>,
    /// Per token row: blocks of the fused decode routing done (zero between launches).
    pub route_counter: DeviceBuffer<u32>,
    /// The call's greedy tokens (`cap`, [`Scratch::argmax`]) followed by every layer's routing
    /// ids (`[n_layers, cap * k]`, [`Scratch::ids`]): one buffer, so when the perf state counts
    /// the ids they come back in the same copy as the tokens (no second transfer per call).
    pub tail_i: DeviceBuffer<i32>,
    /// Routing weights of every layer of the call: `[n_layers, cap * k]`.
    pub weights: DeviceBuffer<f32>,
    pub g: DeviceBuffer<f32>,
    pub u: DeviceBuffer<f32>,
    pub h: DeviceBuffer<f32>,
    pub y: DeviceBuffer<f32>,
    pub shared_out: DeviceBuffer<f32>,
    pub shared_gl: DeviceBuffer<f32>,
    pub x_hi: DeviceBuffer<u16>,
    pub x_lo: DeviceBuffer<u16>,
    /// 8-bit activations of the quantized decode GEMVs (`GpuOptions::q8_activations`): the
    /// dense matrices' input (`q8_dense`: rows of the widest input), the hot lane's normed rows
    /// (`q8_moe`) and its h rows (`q8_h`), each quantized just before its GEMV.
    pub q8_dense: Q8Buf,
    pub q8_moe: Q8Buf,
    pub q8_h: Q8Buf,
    pub work_i: DeviceBuffer<i32>,
    pub work_f: DeviceBuffer<f32>,
    pub cold_in: DeviceBuffer<f32>,
    pub cold_out: DeviceBuffer<f32>,
    pub logits: DeviceBuffer<f32>,
    pub argmax_part: DeviceBuffer<f32>,
}

impl Scratch {
    /// `gated`: some attention layer has an output gate (its logits need a buffer); `dense_ff`:
    /// the widest dense FFN layer's intermediate size (0: none); `(q_dim, kv_dim)`: the widest
    /// attention layer's query and key rows (layers may have their own, Gemma 4's global ones);
    /// `head`: the device runs the head (the logits rows; one element otherwise).
    pub fn new(
        be: &CudaBackend,
        c: &ModelConfig,
        t: usize,
        head: bool,
        gated: bool,
        dense_ff: usize,
        (q_dim, kv_dim): (usize, usize),
    ) -> Result<Scratch, GpuError> {
        let cap = t.next_power_of_two().max(8);
        let k = c.n_experts_used;
        let inner = (k * c.expert_ff).max(c.shared_expert_ff).max(dense_ff);
        // A DeltaNet layer's row widths (0 without one).
        let (p_stride, ba, vd, work) = c.hybrid.as_ref().map_or((0, 0, 0, 0), |h| {
            let vd = h.n_v_heads * h.v_head_dim;
            let shape = DeltaShape {
                n_k_heads: h.n_k_heads,
                n_v_heads: h.n_v_heads,
                k_head_dim: h.k_head_dim,
                v_head_dim: h.v_head_dim,
                conv_kernel: h.conv_kernel,
                tiled_v_heads: h.v_heads == VHeadOrder::Tiled,
            };
            (2 * h.n_k_heads * h.k_head_dim + 2 * vd, 2 * h.n_v_heads, vd, shape.prefill_work_floats(cap))
        });
        let mla = MlaScratch::new(be, c, cap)?;
        let widest = c.hidden.max(q_dim).max(c.expert_ff).max(c.shared_expert_ff).max(vd).max(dense_ff);
        // A latent layer's projections read `q_a`'s rows (`q_b`) and the heads' values (`o`).
        let widest = widest
            .max(c.mla.as_ref().map_or(0, |m| m.q_lora_rank.unwrap_or(0).max(c.n_heads * m.v_head_dim)));
        let f = |n: usize| be.alloc_zeros::<f32>(n.max(1));
        let layout = WorkLayout::new(cap, k);
        Ok(Scratch {
            cap,
            layout,
            tokens: be.alloc_zeros::<i32>(cap)?,
            step: be.alloc_zeros::<i32>(2)?,
            kv_step: f(2 * cap * kv_dim)?,
            hidden: f(cap * c.hidden)?,
            normed: f(cap * c.hidden)?,
            moe_out: f(cap * c.hidden)?,
            q: f(cap * q_dim)?,
            gate: f(if gated { cap * q_dim } else { 0 })?,
            delta_p: f(cap * p_stride)?,
            delta_ba: f(cap * ba)?,
            delta_out: f(cap * vd)?,
            delta_work: f(work)?,
            attn: f(cap * q_dim)?,
            mla,
            router_logits: f(cap * c.n_experts)?,
            route_counter: be.alloc_zeros::<u32>(cap)?,
            tail_i: be.alloc_zeros::<i32>(cap + c.n_layers * cap * k)?,
            weights: f(c.n_layers * cap * k)?,
            g: f(cap * inner)?,
            u: f(cap * inner)?,
            h: f(cap * inner)?,
            y: f(cap * k * c.hidden)?,
            shared_out: f(cap * c.hidden)?,
            shared_gl: f(cap)?,
            x_hi: be.alloc_zeros::<u16>(cap * k.max(1) * widest)?,
            x_lo: be.alloc_zeros::<u16>(cap * k.max(1) * widest)?,
            q8_dense: Q8Buf::new(be, cap * widest)?,
            q8_moe: Q8Buf::new(be, cap * c.hidden)?,
            q8_h: Q8Buf::new(be, cap * inner)?,
            work_i: be.alloc_zeros::<i32>(layout.len)?,
            work_f: f(cap * k)?,
            cold_in: f(cap * c.hidden)?,
            cold_out: f(cap * c.hidden)?,
            logits: f(if head { cap * c.vocab } else { 0 })?,
            argmax_part: f(CudaBackend::argmax_split_scratch(cap))?,
        })
    }
}

impl Scratch {
    /// The call's greedy tokens (`cap` entries of `tail_i`).
    pub fn argmax(&self) -> DPtr<i32> {
        self.tail_i.ptr().sub(0, self.cap)
    }

    /// Every layer's routing ids (`tail_i` after the tokens).
    pub fn ids(&self) -> DPtr<i32> {
        self.tail_i.ptr().from(self.cap)
    }
}

/// A latent attention layer's per-call rows, for `cap` tokens (one element each without latent
/// layers).
pub(crate) struct MlaScratch {
    pub qa: DeviceBuffer<f32>,
    pub kv: DeviceBuffer<f32>,
    pub q: DeviceBuffer<f32>,
    pub q_abs: DeviceBuffer<f32>,
    pub out: DeviceBuffer<f32>,
    pub values: DeviceBuffer<f32>,
}

impl MlaScratch {
    fn new(be: &CudaBackend, c: &ModelConfig, cap: usize) -> Result<MlaScratch, GpuError> {
        let f = |n: usize| be.alloc_zeros::<f32>((cap * n).max(1));
        let (qa, width, q, rank, v) = c.mla.as_ref().map_or((0, 0, 0, 0, 0), |m| {
            let (rank, rope) = (m.kv_lora_rank, m.qk_rope_head_dim);
            let q = c.n_heads * (m.qk_nope_head_dim + rope);
            (m.q_lora_rank.unwrap_or(0), rank + rope, q, rank, m.v_head_dim)
        });
        let heads = if c.mla.is_some() { c.n_heads } else { 0 };
        Ok(MlaScratch {
            qa: f(qa)?,
            kv: f(width)?,
            q: f(q)?,
            q_abs: f(heads * width)?,
            out: f(heads * rank)?,
            values: f(heads * v)?,
        })
    }
}

/// The MoE stage's pinned host buffers for calls of up to `cap` tokens.
pub(crate) struct MoePinned {
    /// The layer's routing on the host, one copy batch and one fence: ids (i32 bits) at 0,
    /// weights (f32 bits) at `cap * k`, and in decode with cold slots the normed rows (f32 bits)
    /// at `2 * cap * k`. See [`RouteView`].
    pub route: PinnedBuffer<u32>,
    /// Gathered cold rows (host path).
    pub cold_in: PinnedBuffer<f32>,
    pub cold_out: PinnedBuffer<f32>,
}

impl MoePinned {
    pub fn new(be: &CudaBackend, c: &ModelConfig, cap: usize) -> Result<MoePinned, GpuError> {
        let k = c.n_experts_used;
        Ok(MoePinned {
            route: be.alloc_pinned::<u32>(2 * cap * k + cap * c.hidden)?,
            cold_in: be.alloc_pinned::<f32>(cap * c.hidden)?,
            cold_out: be.alloc_pinned::<f32>(cap * c.hidden)?,
        })
    }
}

/// Device room for `n` activations in 8 bits (values and block scales).
pub(crate) struct Q8Buf {
    q: DeviceBuffer<i8>,
    d: DeviceBuffer<f32>,
}

impl Q8Buf {
    fn new(be: &CudaBackend, n: usize) -> Result<Q8Buf, GpuError> {
        Ok(Q8Buf { q: be.alloc_zeros::<i8>(n)?, d: be.alloc_zeros::<f32>(n.div_ceil(Q8_BLOCK))? })
    }

    pub fn rows(&self) -> Q8Rows {
        Q8Rows { q: self.q.ptr(), d: self.d.ptr() }
    }
}

/// Typed views of [`MoePinned::route`] for a call of `t` tokens.
pub(crate) struct RouteView<'a> {
    pub ids: &'a [i32],
    pub weights: &'a [f32],
    pub rows: &'a [f32],
}

impl RouteView<'_> {
    pub fn of(pinned: &[u32], cap: usize, k: usize, t: usize, hidden: usize) -> RouteView<'_> {
        RouteView {
            ids: bytemuck::cast_slice(&pinned[..t * k]),
            weights: bytemuck::cast_slice(&pinned[cap * k..][..t * k]),
            rows: bytemuck::cast_slice(&pinned[2 * cap * k..][..t * hidden]),
        }
    }
}

/// Host buffers of one call, reused between calls.
pub(crate) struct HostScratch {
    /// The layer's worklist (the same type the CPU pipeline dispatches), built on the host for
    /// the host path (prefill, warmup, fault-injected layers).
    pub worklist: Worklist,
    pub expert_ids: Vec<u32>,
    pub work_i: Vec<i32>,
    pub work_f: Vec<f32>,
    /// Per token: hot entries seen (counting sort of entries by token row).
    pub tok_count: Vec<u32>,
    /// Token rows with hot entries in the last encoded worklist.
    pub tok_rows: usize,
    /// Tiles of the grouped hot-lane GEMM in the last encoded worklist.
    pub n_tiles: usize,
    pub cold_slots: Vec<ColdSlot>,
    pub cold_row_tok: Vec<usize>,
    pub cold_in: Vec<f32>,
    pub cold_out: Vec<f32>,
    /// The routing ids of every layer after the call (perf counting).
    pub route_ids: Vec<i32>,
    /// Post-Fetch, per expert: its slot in the scratchpad, or `PF_CPU` / `PF_LATE` (the CPU).
    pub pf_fetch: Vec<i32>,
    /// Post-Fetch, per expert: cold slots routed to it in the layer.
    pub pf_count: Vec<u32>,
    /// Post-Fetch: the layer's cold experts and their tokens (the chosen ones first).
    pub pf_loads: Vec<super::postfetch::plan::ExpertLoad>,
    /// Post-Fetch: the fetched experts' worklist entries (scratchpad slot, token, weight), in
    /// worklist order; they follow the hot entries on the GPU.
    pub pf_slot: Vec<u32>,
    pub pf_token: Vec<u32>,
    pub pf_weight: Vec<f32>,
    /// Post-Fetch: tiles of the fetched entries and where they start in the tiles section.
    pub pf_tiles: usize,
    pub pf_tile_at: usize,
    /// Post-Fetch in decode: each routed entry's scratchpad slot, -1 for the CPU's.
    pub pf_entry_slot: Vec<i32>,
}

impl HostScratch {
    pub fn new(c: &ModelConfig, cap: usize) -> HostScratch {
        let k = c.n_experts_used;
        HostScratch {
            worklist: Worklist::new(cap, k, c.n_experts),
            expert_ids: Vec::with_capacity(cap * k),
            work_i: vec![0; WorkLayout::new(cap, k).len],
            work_f: vec![0.0; cap * k],
            tok_count: vec![0; cap],
            tok_rows: 0,
            n_tiles: 0,
            cold_slots: Vec::with_capacity(cap * k),
            cold_row_tok: Vec::with_capacity(cap),
            cold_in: Vec::with_capacity(cap * c.hidden),
            cold_out: Vec::with_capacity(cap * c.hidden),
            route_ids: Vec::with_capacity(c.n_layers * cap * k),
            pf_fetch: vec![-1; c.n_experts],
            pf_count: vec![0; c.n_experts],
            pf_loads: Vec::with_capacity(c.n_experts),
            pf_slot: Vec::with_capacity(cap * k),
            pf_token: Vec::with_capacity(cap * k),
            pf_weight: Vec::with_capacity(cap * k),
            pf_tiles: 0,
            pf_tile_at: 0,
            pf_entry_slot: Vec::with_capacity(k),
        }
    }
}
