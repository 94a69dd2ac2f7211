//! The model-aware GPU engine: uploads non-expert weights and a per-layer VRAM hot cache of
//! experts, runs the dense path on the GPU for every adapter, and splits each MoE layer's routed
//! slots into a hot lane (GPU, from the cache) and a cold lane (a [`ColdExperts`] callback on the
//! CPU, overlapped with the GPU work), joined per layer.
//!
//! Precision: matrices (embeddings, q/k/v/o, router, shared expert, lm_head, cached experts) are
//! stored as bf16 on the device — bf16 files are copied bit-exactly, f16/f32 files are rounded to
//! bf16 (lossy for f32 checkpoints). Norm weights, biases, activations, accumulations and the KV
//! cache are f32. Decode (GEMV kernels) multiplies bf16 weights by f32 activations exactly in f32.
//! Prefill uses cuBLAS bf16 GEMMs (f32 compute) on activations split into bf16 hi + lo parts
//! (two GEMMs, ~16 mantissa bits) unless [`GpuOptions::split_bf16_activations`] is off; the
//! router always uses the f32-activation GEMV so routing matches the reference closely.

use super::cold::{ColdExperts, ColdSlot};
use crate::format::dtype::DType;
use crate::format::tensor::{TensorError, TensorRef};
use crate::model::adapter::{Adapter, QkNorm, RopeStyle, RoutingVariant};
use crate::model::config::ModelConfig;
use crate::model::naming::{GlobalRole, LayerRole};
use crate::model::Model;
use crate::reference::ForwardError;
use half::bf16;
use moe_lanes_kernels::cuda::ops::RouteVariant;
use moe_lanes_kernels::cuda::{CudaBackend, CudaError, DPtr, DeviceBuffer, GpuEvent, PinnedBuffer};
use std::sync::Arc;
use std::time::Instant;

/// Anything the GPU engine refuses or fails at.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error(transparent)]
    Cuda(#[from] CudaError),
    #[error(transparent)]
    Forward(#[from] ForwardError),
    #[error(transparent)]
    Tensor(#[from] TensorError),
    #[error("not supported on the GPU path: {0}")]
    Unsupported(String),
    #[error("hot assignment: {0}")]
    Hot(String),
    #[error("KV cache: {0}")]
    Cache(String),
}

/// Which experts of each layer live in the VRAM hot cache; every other expert is cold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HotAssignment {
    /// `per_layer[l]` = expert ids of layer `l`, in slot order.
    pub per_layer: Vec<Vec<usize>>,
}

impl HotAssignment {
    /// No hot experts: every slot goes to the cold lane.
    pub fn none(n_layers: usize) -> HotAssignment {
        HotAssignment { per_layer: vec![Vec::new(); n_layers] }
    }
    /// Every expert hot.
    pub fn all(n_layers: usize, n_experts: usize) -> HotAssignment {
        HotAssignment { per_layer: vec![(0..n_experts).collect(); n_layers] }
    }
    /// Expert `e` of layer `l` is hot when `hot(l, e)`.
    pub fn from_fn(n_layers: usize, n_experts: usize, hot: impl Fn(usize, usize) -> bool) -> HotAssignment {
        HotAssignment {
            per_layer: (0..n_layers).map(|l| (0..n_experts).filter(|&e| hot(l, e)).collect()).collect(),
        }
    }
    pub fn n_hot(&self) -> usize {
        self.per_layer.iter().map(Vec::len).sum()
    }
}

/// The phase of one forward call, decided once per call (DESIGN.md "One forward call").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Prompt processing: cuBLAS GEMMs, expert-major hot worklist.
    Prefill,
    /// Token generation: GEMV kernels, token-major hot worklist.
    Decode,
}

/// Engine switches.
#[derive(Debug, Clone, Copy)]
pub struct GpuOptions {
    /// Prefill GEMMs take activations as bf16 hi + lo (two GEMMs, ~f32 accuracy); off: bf16 only.
    pub split_bf16_activations: bool,
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions { split_bf16_activations: true }
    }
}

/// Lane timings and slot counts of one MoE layer in one forward call.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LayerLaneStats {
    pub hot_slots: usize,
    pub cold_slots: usize,
    /// Token rows handed to the cold lane.
    pub cold_rows: usize,
    /// GPU time of the hot lane (CUDA events around its kernels).
    pub hot_us: f64,
    /// CPU time of the cold callback.
    pub cold_us: f64,
    /// From the split (routing known on the host) to the join (both lanes done).
    pub wall_us: f64,
    /// Time both lanes were busy at once. Estimate: the hot lane is placed on the host clock at
    /// its launch time and lasts `hot_us` (it may start slightly later on the GPU).
    pub overlap_us: f64,
    /// Time the join waited for the later lane. Host join: the host's wait for the hot lane after
    /// the cold lane finished. GPU-stream join (decode with a GPU-built worklist): the gap between
    /// the two lanes' estimated ends.
    pub join_wait_us: f64,
}

/// Statistics of the last forward call.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ForwardStats {
    pub n_tokens: usize,
    pub prefill: bool,
    pub layers: Vec<LayerLaneStats>,
    /// Host wall time of the whole call, logits copy included.
    pub total_us: f64,
}

/// Logits of one forward call: `n_rows` rows of `vocab`, plus the greedy token of each row
/// (computed on the GPU: the first index of the maximum). `data` is empty when the model was told
/// not to copy logits ([`GpuModel::set_copy_logits`]).
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
}

/// Stage names of the opt-in per-stage GPU timing breakdown (`MOE_LANES_GPU_PROFILE=1`): the
/// time on the GPU timeline between consecutive CUDA events recorded at stage boundaries, so a
/// stage includes any time the GPU sat idle waiting for the host (synchronisation, host work).
pub const PROFILE_LAYER_STAGES: [&str; 9] = [
    "qkv+norm+rope",
    "attention kernel",
    "o proj",
    "ffn norm+router+topk+D2H",
    "shared expert",
    "worklist: host sync+build+H2D | decode: GPU kernel",
    "hot lane",
    "cold lane: (decode: host sync) compute+H2D+add",
    "residual add",
];
/// Stages outside the layers: embedding, final norm + lm_head, argmax.
pub const PROFILE_TAIL_STAGES: [&str; 3] = ["embed", "final norm+lm_head", "argmax"];

/// Accumulated per-stage times (microseconds) over forward calls, per phase.
#[derive(Debug, Clone, Default)]
pub struct StageProfile {
    pub calls: usize,
    pub tokens: usize,
    pub layer_calls: usize,
    /// Summed over layers and calls.
    pub layer_us: [f64; 9],
    pub tail_us: [f64; 3],
    /// Host time of the logits + argmax copies.
    pub copy_us: f64,
    /// Host wall time of the calls.
    pub total_us: f64,
    /// Host time from the call's start to the start of the final copy (all work enqueued). Close
    /// to `total_us` with a short final copy: the host, not the GPU, sets the pace.
    pub enqueue_us: f64,
}

impl StageProfile {
    pub fn report(&self, name: &str) -> String {
        if self.calls == 0 {
            return String::new();
        }
        let per = |v: f64| v / self.calls as f64;
        let lc = self.layer_calls.max(1) as f64;
        let mut out = format!(
            "{name}: {} calls, {:.1} tokens/call, wall {:.1} us/call\n",
            self.calls,
            self.tokens as f64 / self.calls as f64,
            per(self.total_us)
        );
        let mut gpu_sum = 0.0;
        for (i, n) in PROFILE_LAYER_STAGES.iter().enumerate() {
            gpu_sum += self.layer_us[i];
            out += &format!(
                "  layer  {n:40} {:10.1} us/layer {:10.1} us/call\n",
                self.layer_us[i] / lc,
                per(self.layer_us[i])
            );
        }
        for (i, n) in PROFILE_TAIL_STAGES.iter().enumerate() {
            gpu_sum += self.tail_us[i];
            out += &format!("  tail   {n:40} {:>10} {:10.1} us/call\n", "", per(self.tail_us[i]));
        }
        out +=
            &format!("  host   {:40} {:>10} {:10.1} us/call\n", "logits+argmax copy", "", per(self.copy_us));
        out += &format!("  sum of GPU stages {:.1} us/call\n", per(gpu_sum));
        out +=
            &format!("  host enqueue (call start -> final copy start) {:.1} us/call\n", per(self.enqueue_us));
        out
    }
}

/// Events and sums of the per-stage profile.
struct Profiler {
    /// `[layer][mark]`, marks 0..=9 (stage i runs from mark i to mark i + 1).
    layer_marks: Vec<Vec<GpuEvent>>,
    /// start, before embed; after lm_head; after argmax.
    tail_marks: Vec<GpuEvent>,
    decode: StageProfile,
    prefill: StageProfile,
}

/// Per-layer K and V on the device, f32 `[capacity, kv_dim]` each.
pub struct GpuKvCache {
    k: Vec<DeviceBuffer<f32>>,
    v: Vec<DeviceBuffer<f32>>,
    capacity: usize,
    kv_dim: usize,
    n_positions: usize,
}

impl GpuKvCache {
    pub fn n_positions(&self) -> usize {
        self.n_positions
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// Forget every position (the memory stays allocated).
    pub fn clear(&mut self) {
        self.n_positions = 0;
    }
    pub fn bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(DeviceBuffer::bytes).sum()
    }
}

struct SharedWeights {
    gate: DeviceBuffer<u16>,
    up: DeviceBuffer<u16>,
    down: DeviceBuffer<u16>,
    gate_logit: DeviceBuffer<u16>,
}

struct LayerWeights {
    attn_norm: DeviceBuffer<f32>,
    q: DeviceBuffer<u16>,
    k: DeviceBuffer<u16>,
    v: DeviceBuffer<u16>,
    o: DeviceBuffer<u16>,
    q_bias: Option<DeviceBuffer<f32>>,
    k_bias: Option<DeviceBuffer<f32>>,
    v_bias: Option<DeviceBuffer<f32>>,
    q_norm: Option<DeviceBuffer<f32>>,
    k_norm: Option<DeviceBuffer<f32>>,
    ffn_norm: DeviceBuffer<f32>,
    router: DeviceBuffer<u16>,
    shared: Option<SharedWeights>,
}

/// One layer's hot cache: `capacity` slots, allocated once.
struct HotLayer {
    /// slot -> expert id (`None`: empty slot).
    slots: Vec<Option<usize>>,
    /// `[capacity, ff, hidden]`
    gate: Option<DeviceBuffer<u16>>,
    up: Option<DeviceBuffer<u16>>,
    /// `[capacity, hidden, ff]`
    down: Option<DeviceBuffer<u16>>,
}

/// Device scratch sized for `cap` tokens.
struct Scratch {
    cap: usize,
    tokens: DeviceBuffer<i32>,
    hidden: DeviceBuffer<f32>,
    normed: DeviceBuffer<f32>,
    moe_out: DeviceBuffer<f32>,
    q: DeviceBuffer<f32>,
    attn: DeviceBuffer<f32>,
    router_logits: DeviceBuffer<f32>,
    ids: DeviceBuffer<i32>,
    weights: DeviceBuffer<f32>,
    g: DeviceBuffer<f32>,
    u: DeviceBuffer<f32>,
    h: DeviceBuffer<f32>,
    y: DeviceBuffer<f32>,
    shared_out: DeviceBuffer<f32>,
    shared_gl: DeviceBuffer<f32>,
    x_hi: DeviceBuffer<u16>,
    x_lo: DeviceBuffer<u16>,
    work_i: DeviceBuffer<i32>,
    work_f: DeviceBuffer<f32>,
    cold_in: DeviceBuffer<f32>,
    cold_out: DeviceBuffer<f32>,
    logits: DeviceBuffer<f32>,
    argmax: DeviceBuffer<i32>,
    argmax_part: DeviceBuffer<f32>,
    pin_ids: PinnedBuffer<i32>,
    pin_w: PinnedBuffer<f32>,
    pin_cold_in: PinnedBuffer<f32>,
    pin_cold_out: PinnedBuffer<f32>,
}

/// Offsets of the sections of the integer worklist (one upload per layer).
struct WorkLayout {
    slots: usize,
    tokens: usize,
    tok_off: usize,
    tok_rows: usize,
    entries: usize,
    cold_rows: usize,
    len: usize,
}

impl WorkLayout {
    fn new(cap: usize, k: usize) -> WorkLayout {
        let n = cap * k;
        let slots = 0;
        let tokens = slots + n;
        let tok_off = tokens + n;
        let tok_rows = tok_off + cap + 1;
        let entries = tok_rows + cap;
        let cold_rows = entries + n;
        WorkLayout { slots, tokens, tok_off, tok_rows, entries, cold_rows, len: cold_rows + cap }
    }
}

/// A model resident on one GPU (non-expert weights + hot expert cache).
/// Host buffers of one forward call (worklists, cold-lane rows, per-layer timing marks), kept
/// between calls so a steady-state call allocates nothing on the host besides its result.
#[derive(Default)]
struct HostScratch {
    work_i: Vec<i32>,
    work_f: Vec<f32>,
    cold_slots: Vec<ColdSlot>,
    cold_row_tok: Vec<usize>,
    cold_in_host: Vec<f32>,
    cold_out_host: Vec<f32>,
    hot_launch_at: Vec<Instant>,
    gpu_joined: Vec<bool>,
    cold_window: Vec<Option<(Instant, Instant)>>,
    tok_i32: Vec<i32>,
}

pub struct GpuModel {
    be: Arc<CudaBackend>,
    cfg: ModelConfig,
    adapter: &'static Adapter,
    opts: GpuOptions,
    embed: DeviceBuffer<u16>,
    final_norm: DeviceBuffer<f32>,
    /// `None`: tied, the embedding is the lm_head.
    lm_head: Option<DeviceBuffer<u16>>,
    layers: Vec<LayerWeights>,
    hot: Vec<HotLayer>,
    /// `[layer][expert]` -> slot, -1 when cold (host copy).
    hot_id_map: Vec<Vec<i32>>,
    /// Same map on the device, `[n_layers * n_experts]`.
    hot_id_map_dev: DeviceBuffer<i32>,
    scratch: Option<Scratch>,
    /// Per layer: hot lane start/end events.
    events: Vec<(GpuEvent, GpuEvent)>,
    cold_ready: GpuEvent,
    route_ready: GpuEvent,
    stats: ForwardStats,
    /// Host-side per-call buffers, reused across calls.
    host: HostScratch,
    weight_bytes: usize,
    profiler: Option<Profiler>,
    /// Partials of the split decode attention (grown to the cache's capacity on demand).
    attn_part: Option<DeviceBuffer<f32>>,
    /// Copy every logits row to the host (default); off: only the argmax comes back.
    copy_logits: bool,
}

/// bf16 bit patterns of a float tensor (bf16 copied exactly; f16/f32 rounded to nearest even).
fn bf16_bits(t: TensorRef<'_>) -> Result<Vec<u16>, GpuError> {
    match t.dtype {
        DType::BF16 => {
            let n = t.n_elems();
            if t.data.len() != 2 * n {
                return Err(TensorError::SizeMismatch {
                    name: t.name.into(),
                    dtype: t.dtype,
                    shape: t.shape.to_vec(),
                    n_bytes: t.data.len(),
                }
                .into());
            }
            Ok(t.data.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect())
        }
        DType::F16 | DType::F32 => {
            Ok(t.to_f32_vec()?.into_iter().map(|v| bf16::from_f32(v).to_bits()).collect())
        }
        other => Err(GpuError::Unsupported(format!(
            "tensor '{}' has dtype {other}; the GPU path takes F32, F16 or BF16",
            t.name
        ))),
    }
}

impl GpuModel {
    /// Upload every non-expert weight and the hot experts of `hot` (one cache tensor per layer,
    /// capacity = that layer's hot count, allocated once).
    pub fn new(model: &Model, backend: Arc<CudaBackend>, hot: &HotAssignment) -> Result<GpuModel, GpuError> {
        GpuModel::with_options(model, backend, hot, GpuOptions::default())
    }

    pub fn with_options(
        model: &Model,
        backend: Arc<CudaBackend>,
        hot: &HotAssignment,
        opts: GpuOptions,
    ) -> Result<GpuModel, GpuError> {
        let be = backend;
        be.bind_to_thread()?;
        let cfg = model.config().clone();
        let adapter = model.adapter();
        if hot.per_layer.len() != cfg.n_layers {
            return Err(GpuError::Hot(format!(
                "{} layers given, the model has {}",
                hot.per_layer.len(),
                cfg.n_layers
            )));
        }
        if cfg.head_dim & 1 == 1 {
            return Err(GpuError::Unsupported(format!("odd head_dim {}", cfg.head_dim)));
        }
        let mut weight_bytes = 0usize;
        let mut up_mat = |t: TensorRef<'_>| -> Result<DeviceBuffer<u16>, GpuError> {
            let b = be.upload(&bf16_bits(t)?)?;
            weight_bytes += b.bytes();
            Ok(b)
        };
        let up_vec =
            |t: TensorRef<'_>| -> Result<DeviceBuffer<f32>, GpuError> { Ok(be.upload(&t.to_f32_vec()?)?) };
        let embed = up_mat(model.global(GlobalRole::TokenEmbedding).expect("validated at open"))?;
        let final_norm = up_vec(model.global(GlobalRole::OutputNorm).expect("validated at open"))?;
        let lm_head = model.global(GlobalRole::Output).map(&mut up_mat).transpose()?;
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            let req = |r| model.required(l, r);
            let opt_vec = |r| model.layer(l, r).map(up_vec).transpose();
            let shared = if adapter.shared_expert {
                Some(SharedWeights {
                    gate: up_mat(req(LayerRole::SharedGate))?,
                    up: up_mat(req(LayerRole::SharedUp))?,
                    down: up_mat(req(LayerRole::SharedDown))?,
                    gate_logit: up_mat(req(LayerRole::SharedExpertGate))?,
                })
            } else {
                None
            };
            layers.push(LayerWeights {
                attn_norm: up_vec(req(LayerRole::AttnNorm))?,
                q: up_mat(req(LayerRole::Q))?,
                k: up_mat(req(LayerRole::K))?,
                v: up_mat(req(LayerRole::V))?,
                o: up_mat(req(LayerRole::O))?,
                q_bias: opt_vec(LayerRole::QBias)?,
                k_bias: opt_vec(LayerRole::KBias)?,
                v_bias: opt_vec(LayerRole::VBias)?,
                q_norm: opt_vec(LayerRole::QNorm)?,
                k_norm: opt_vec(LayerRole::KNorm)?,
                ffn_norm: up_vec(req(LayerRole::FfnNorm))?,
                router: up_mat(req(LayerRole::Router))?,
                shared,
            });
        }
        let (ff, hidden, n_exp) = (cfg.expert_ff, cfg.hidden, cfg.n_experts);
        let mut hot_layers = Vec::with_capacity(cfg.n_layers);
        let mut hot_id_map = vec![vec![-1i32; n_exp]; cfg.n_layers];
        for (l, experts) in hot.per_layer.iter().enumerate() {
            let cap = experts.len();
            if cap > n_exp {
                return Err(GpuError::Hot(format!("layer {l}: {cap} hot experts, the layer has {n_exp}")));
            }
            let alloc = |n: usize| -> Result<Option<DeviceBuffer<u16>>, GpuError> {
                if cap == 0 {
                    Ok(None)
                } else {
                    Ok(Some(be.alloc_zeros::<u16>(n)?))
                }
            };
            let layer = HotLayer {
                slots: vec![None; cap],
                gate: alloc(cap * ff * hidden)?,
                up: alloc(cap * ff * hidden)?,
                down: alloc(cap * hidden * ff)?,
            };
            hot_layers.push(layer);
            for &e in experts {
                if e >= n_exp {
                    return Err(GpuError::Hot(format!(
                        "layer {l}: expert {e} out of range ({n_exp} experts)"
                    )));
                }
                if hot_id_map[l][e] >= 0 {
                    return Err(GpuError::Hot(format!("layer {l}: expert {e} listed twice")));
                }
                hot_id_map[l][e] = 0; // placeholder; real slot written by fill_slot
            }
        }
        let flat: Vec<i32> = vec![-1; cfg.n_layers * n_exp];
        let hot_id_map_dev = be.upload(&flat)?;
        let events = (0..cfg.n_layers)
            .map(|_| Ok((be.event()?, be.event()?)))
            .collect::<Result<Vec<_>, CudaError>>()?;
        let cold_ready = be.event()?;
        let route_ready = be.event()?;
        let mut gm = GpuModel {
            cold_ready,
            route_ready,
            be,
            cfg,
            adapter,
            opts,
            embed,
            final_norm,
            lm_head,
            layers,
            hot: hot_layers,
            hot_id_map: vec![vec![-1; n_exp]; hot_id_map.len()],
            hot_id_map_dev,
            scratch: None,
            events,
            stats: ForwardStats::default(),
            host: HostScratch::default(),
            weight_bytes,
            profiler: None,
            attn_part: None,
            copy_logits: true,
        };
        if std::env::var_os("MOE_LANES_GPU_PROFILE").is_some_and(|v| v != "0" && !v.is_empty()) {
            gm.enable_profile()?;
        }
        for (l, experts) in hot.per_layer.iter().enumerate() {
            for (slot, &e) in experts.iter().enumerate() {
                gm.fill_slot(model, l, slot, e)?;
            }
        }
        gm.be.synchronize()?;
        Ok(gm)
    }

    /// Put expert `expert_idx` into cache slot `slot` of layer `layer_idx` (evicting whatever was
    /// there), updating `hot_id_map` on host and device. Capacity never changes.
    pub fn replace_hot(
        &mut self,
        model: &Model,
        layer_idx: usize,
        slot: usize,
        expert_idx: usize,
    ) -> Result<(), GpuError> {
        if layer_idx >= self.cfg.n_layers
            || slot >= self.hot[layer_idx].slots.len()
            || expert_idx >= self.cfg.n_experts
        {
            return Err(GpuError::Hot(format!(
                "layer {layer_idx} slot {slot} expert {expert_idx} out of range"
            )));
        }
        let current = self.hot_id_map[layer_idx][expert_idx];
        if current >= 0 && current as usize != slot {
            return Err(GpuError::Hot(format!(
                "layer {layer_idx}: expert {expert_idx} is already in slot {current}"
            )));
        }
        self.be.synchronize()?;
        self.fill_slot(model, layer_idx, slot, expert_idx)?;
        self.be.synchronize()?;
        Ok(())
    }

    fn fill_slot(&mut self, model: &Model, l: usize, slot: usize, e: usize) -> Result<(), GpuError> {
        let (ff, hidden, n_exp) = (self.cfg.expert_ff, self.cfg.hidden, self.cfg.n_experts);
        let x = model.expert(l, e);
        let hl = &mut self.hot[l];
        let n = ff * hidden;
        for (buf, t) in [(&hl.gate, x.gate), (&hl.up, x.up), (&hl.down, x.down)] {
            let buf = buf.as_ref().expect("slot exists, so the cache is allocated");
            self.be.write(&bf16_bits(t)?, buf.ptr().sub(slot * n, n))?;
        }
        if let Some(old) = hl.slots[slot].replace(e) {
            self.hot_id_map[l][old] = -1;
            self.be.write(&[-1i32], self.hot_id_map_dev.ptr().sub(l * n_exp + old, 1))?;
        }
        self.hot_id_map[l][e] = slot as i32;
        self.be.write(&[slot as i32], self.hot_id_map_dev.ptr().sub(l * n_exp + e, 1))?;
        Ok(())
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn backend(&self) -> &Arc<CudaBackend> {
        &self.be
    }

    /// `[layer][expert]` -> cache slot, or -1 when the expert is cold.
    pub fn hot_id_map(&self) -> &[Vec<i32>] {
        &self.hot_id_map
    }

    /// The device copy of [`GpuModel::hot_id_map`], `[n_layers * n_experts]` i32.
    pub fn hot_id_map_device(&self) -> DPtr<i32> {
        self.hot_id_map_dev.ptr()
    }

    /// Bytes of the hot expert caches (all layers).
    pub fn hot_cache_bytes(&self) -> usize {
        self.hot.iter().flat_map(|h| [&h.gate, &h.up, &h.down]).flatten().map(DeviceBuffer::bytes).sum()
    }

    /// Bytes of the non-expert matrices on the device.
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// Whether forward calls copy the full logits rows to the host (default true). Off, only the
    /// greedy tokens come back ([`Logits::data`] is empty and [`Logits::row`] must not be called):
    /// a `[tokens, vocab]` f32 copy per call saved (600 KB per decode token at a 152K vocabulary,
    /// 311 MB for a 512-token prompt).
    pub fn set_copy_logits(&mut self, on: bool) {
        self.copy_logits = on;
    }

    /// Turn on the per-stage GPU timing breakdown (also on when `MOE_LANES_GPU_PROFILE=1` at
    /// construction). Adds CUDA event records at stage boundaries; timings are read after each
    /// forward call's final copy.
    pub fn enable_profile(&mut self) -> Result<(), GpuError> {
        let n = self.cfg.n_layers;
        let layer_marks = (0..n)
            .map(|_| (0..=PROFILE_LAYER_STAGES.len()).map(|_| self.be.event()).collect::<Result<Vec<_>, _>>())
            .collect::<Result<Vec<_>, _>>()?;
        let tail_marks = (0..3).map(|_| self.be.event()).collect::<Result<Vec<_>, _>>()?;
        self.profiler = Some(Profiler {
            layer_marks,
            tail_marks,
            decode: StageProfile::default(),
            prefill: StageProfile::default(),
        });
        Ok(())
    }

    /// Accumulated (decode, prefill) stage profiles, when profiling is on.
    pub fn stage_profile(&self) -> Option<(&StageProfile, &StageProfile)> {
        self.profiler.as_ref().map(|p| (&p.decode, &p.prefill))
    }

    /// The profile as text (decode and prefill), when profiling is on.
    pub fn profile_report(&self) -> Option<String> {
        self.profiler
            .as_ref()
            .map(|p| format!("{}{}", p.decode.report("decode"), p.prefill.report("prefill")))
    }

    /// Clear the accumulated profile.
    pub fn reset_profile(&mut self) {
        if let Some(p) = &mut self.profiler {
            p.decode = StageProfile::default();
            p.prefill = StageProfile::default();
        }
    }

    fn mark(&self, l: usize, m: usize) -> Result<(), GpuError> {
        if let Some(p) = &self.profiler {
            self.be.record(&p.layer_marks[l][m])?;
        }
        Ok(())
    }

    fn mark_tail(&self, m: usize) -> Result<(), GpuError> {
        if let Some(p) = &self.profiler {
            self.be.record(&p.tail_marks[m])?;
        }
        Ok(())
    }

    /// After the stream is idle: add this call's stage times to the profile.
    fn collect_profile(
        &mut self,
        phase: Phase,
        t: usize,
        copy_us: f64,
        enqueue_us: f64,
        total_us: f64,
    ) -> Result<(), GpuError> {
        let Some(p) = &mut self.profiler else { return Ok(()) };
        let prof = if phase == Phase::Decode { &mut p.decode } else { &mut p.prefill };
        prof.calls += 1;
        prof.tokens += t;
        prof.layer_calls += p.layer_marks.len();
        prof.copy_us += copy_us;
        prof.total_us += total_us;
        prof.enqueue_us += enqueue_us;
        for marks in &p.layer_marks {
            for i in 0..PROFILE_LAYER_STAGES.len() {
                prof.layer_us[i] += marks[i].elapsed_ms(&marks[i + 1])? as f64 * 1e3;
            }
        }
        let first = &p.layer_marks[0][0];
        let last = &p.layer_marks[p.layer_marks.len() - 1][PROFILE_LAYER_STAGES.len()];
        prof.tail_us[0] += p.tail_marks[0].elapsed_ms(first)? as f64 * 1e3;
        prof.tail_us[1] += last.elapsed_ms(&p.tail_marks[1])? as f64 * 1e3;
        prof.tail_us[2] += p.tail_marks[1].elapsed_ms(&p.tail_marks[2])? as f64 * 1e3;
        Ok(())
    }

    /// Statistics of the last forward call.
    pub fn last_stats(&self) -> &ForwardStats {
        &self.stats
    }

    /// A KV cache for up to `capacity` positions.
    pub fn new_kv_cache(&self, capacity: usize) -> Result<GpuKvCache, GpuError> {
        if capacity == 0 || capacity > self.cfg.max_positions {
            return Err(GpuError::Cache(format!(
                "capacity {capacity} outside 1..={}",
                self.cfg.max_positions
            )));
        }
        let kv_dim = self.cfg.kv_dim();
        let mut k = Vec::new();
        let mut v = Vec::new();
        for _ in 0..self.cfg.n_layers {
            k.push(self.be.alloc_zeros::<f32>(capacity * kv_dim)?);
            v.push(self.be.alloc_zeros::<f32>(capacity * kv_dim)?);
        }
        Ok(GpuKvCache { k, v, capacity, kv_dim, n_positions: 0 })
    }

    fn ensure_scratch(&mut self, t: usize) -> Result<(), GpuError> {
        if self.scratch.as_ref().is_some_and(|s| s.cap >= t) {
            return Ok(());
        }
        self.scratch = None; // free first
        let cap = t.next_power_of_two().max(8);
        let c = &self.cfg;
        let be = &self.be;
        let k = c.n_experts_used;
        let inner = (k * c.expert_ff).max(c.shared_expert_ff);
        let widest = c.hidden.max(c.q_dim()).max(c.expert_ff).max(c.shared_expert_ff);
        let f = |n: usize| be.alloc_zeros::<f32>(n);
        self.scratch = Some(Scratch {
            cap,
            tokens: be.alloc_zeros::<i32>(cap)?,
            hidden: f(cap * c.hidden)?,
            normed: f(cap * c.hidden)?,
            moe_out: f(cap * c.hidden)?,
            q: f(cap * c.q_dim())?,
            attn: f(cap * c.q_dim())?,
            router_logits: f(cap * c.n_experts)?,
            ids: be.alloc_zeros::<i32>(cap * k)?,
            weights: f(cap * k)?,
            g: f(cap * inner)?,
            u: f(cap * inner)?,
            h: f(cap * inner)?,
            y: f(cap * k * c.hidden)?,
            shared_out: f(cap * c.hidden)?,
            shared_gl: f(cap)?,
            x_hi: be.alloc_zeros::<u16>(cap * k.max(1) * widest)?,
            x_lo: be.alloc_zeros::<u16>(cap * k.max(1) * widest)?,
            work_i: be.alloc_zeros::<i32>(WorkLayout::new(cap, k).len)?,
            work_f: f(cap * k)?,
            cold_in: f(cap * c.hidden)?,
            cold_out: f(cap * c.hidden)?,
            logits: f(cap * c.vocab)?,
            argmax: be.alloc_zeros::<i32>(cap)?,
            argmax_part: f(CudaBackend::argmax_split_scratch(cap))?,
            pin_ids: be.alloc_pinned::<i32>(cap * k)?,
            pin_w: be.alloc_pinned::<f32>(cap * k)?,
            pin_cold_in: be.alloc_pinned::<f32>(cap * c.hidden)?,
            pin_cold_out: be.alloc_pinned::<f32>(cap * c.hidden)?,
        });
        Ok(())
    }

    /// `y (+)= W x` for `t` rows: GEMV kernel in decode, cuBLAS in prefill.
    #[allow(clippy::too_many_arguments)]
    fn linear(
        &self,
        phase: Phase,
        x: DPtr<f32>,
        w: DPtr<u16>,
        y: DPtr<f32>,
        t: usize,
        n: usize,
        k: usize,
        accumulate: bool,
    ) -> Result<(), GpuError> {
        match phase {
            Phase::Decode => self.be.gemv_bf16(w, x, y, t, n, k, accumulate)?,
            Phase::Prefill => {
                let s = self.scratch.as_ref().expect("scratch allocated");
                let lo = self.opts.split_bf16_activations.then(|| s.x_lo.ptr());
                self.be.gather_split_bf16(x, None, s.x_hi.ptr(), lo, t, k)?;
                self.be.gemm_bf16(w, s.x_hi.ptr(), lo, y, t, n, k, accumulate)?;
            }
        }
        Ok(())
    }

    /// Run `tokens` after what `cache` holds: phase `Decode` for one token, `Prefill` otherwise.
    pub fn forward(
        &mut self,
        tokens: &[u32],
        cache: &mut GpuKvCache,
        cold: &mut dyn ColdExperts,
    ) -> Result<Logits, GpuError> {
        let phase = if tokens.len() == 1 { Phase::Decode } else { Phase::Prefill };
        self.forward_phase(tokens, phase, cache, cold)
    }

    /// Run `tokens` with an explicit phase; returns one logits row per token.
    pub fn forward_phase(
        &mut self,
        tokens: &[u32],
        phase: Phase,
        cache: &mut GpuKvCache,
        cold: &mut dyn ColdExperts,
    ) -> Result<Logits, GpuError> {
        let call_start = Instant::now();
        let c = self.cfg.clone();
        if tokens.is_empty() {
            return Err(ForwardError::EmptyInput.into());
        }
        let pos0 = cache.n_positions;
        for (i, &tok) in tokens.iter().enumerate() {
            if tok as usize >= c.vocab {
                return Err(
                    ForwardError::TokenOutOfRange { token: tok, position: pos0 + i, vocab: c.vocab }.into()
                );
            }
        }
        if cache.k.len() != c.n_layers || cache.kv_dim != c.kv_dim() {
            return Err(GpuError::Cache("this cache was made for another model".into()));
        }
        if pos0 + tokens.len() > cache.capacity {
            return Err(ForwardError::ContextFull { max_positions: cache.capacity }.into());
        }
        self.be.bind_to_thread()?;
        let t = tokens.len();
        self.ensure_scratch(t)?;
        let be = self.be.clone();
        let (h, qd, kvd, e_n, k) = (c.hidden, c.q_dim(), c.kv_dim(), c.n_experts, c.n_experts_used);
        let (hd, nh, nkv) = (c.head_dim, c.n_heads, c.n_kv_heads);
        let interleaved = c.rope_style == RopeStyle::Interleaved;
        let window = c.sliding_window.unwrap_or(0);
        let variant = match self.adapter.routing {
            RoutingVariant::SoftmaxThenTopK => RouteVariant::SoftmaxThenTopK,
            RoutingVariant::TopKThenSoftmax => RouteVariant::TopKThenSoftmax,
        };
        let layout = WorkLayout::new(self.scratch.as_ref().unwrap().cap, k);
        // Host buffers live in `self.host` between calls, so steady-state calls do not allocate;
        // they are moved out here and back before returning (an error just drops them).
        let HostScratch {
            mut work_i,
            mut work_f,
            mut cold_slots,
            mut cold_row_tok,
            mut cold_in_host,
            mut cold_out_host,
            mut hot_launch_at,
            mut gpu_joined,
            mut cold_window,
            mut tok_i32,
        } = std::mem::take(&mut self.host);
        work_i.clear();
        work_i.resize(layout.len, 0);
        work_f.clear();
        work_f.resize(t * k, 0.0);
        cold_slots.clear();
        cold_row_tok.clear();
        hot_launch_at.clear();
        // Layers whose join ran on the GPU stream (no host wait): their join wait is derived below.
        gpu_joined.clear();
        gpu_joined.resize(c.n_layers, false);
        cold_window.clear();
        let mut layers = std::mem::take(&mut self.stats.layers);
        layers.clear();
        let mut stats = ForwardStats { n_tokens: t, prefill: phase == Phase::Prefill, layers, total_us: 0.0 };

        // Pointers are Copy; take them once so the borrow checker leaves `self` usable.
        let s = self.scratch.as_ref().unwrap();
        let (p_tokens, p_hidden, p_normed, p_moe) =
            (s.tokens.ptr(), s.hidden.ptr(), s.normed.ptr(), s.moe_out.ptr());
        let (p_q, p_attn, p_rl, p_ids, p_w) =
            (s.q.ptr(), s.attn.ptr(), s.router_logits.ptr(), s.ids.ptr(), s.weights.ptr());
        let (p_g, p_u, p_h, p_y) = (s.g.ptr(), s.u.ptr(), s.h.ptr(), s.y.ptr());
        let (p_sout, p_sgl, p_xhi, p_xlo) =
            (s.shared_out.ptr(), s.shared_gl.ptr(), s.x_hi.ptr(), s.x_lo.ptr());
        let (p_wi, p_wf, p_cin, p_cout) = (s.work_i.ptr(), s.work_f.ptr(), s.cold_in.ptr(), s.cold_out.ptr());
        let (p_logits, p_argmax, p_am_part) = (s.logits.ptr(), s.argmax.ptr(), s.argmax_part.ptr());
        let lo = self.opts.split_bf16_activations.then_some(p_xlo);

        // decode attention: positions split over many blocks, partials combined by a second kernel
        let split_attention = phase == Phase::Decode;
        if split_attention {
            let need = CudaBackend::attention_split_scratch(t, c.n_heads, c.head_dim, cache.capacity);
            if self.attn_part.as_ref().is_none_or(|b| b.len() < need) {
                self.attn_part = Some(be.alloc_zeros::<f32>(need)?);
            }
        }
        let p_part = self.attn_part.as_ref().map(|b| b.ptr());
        tok_i32.clear();
        tok_i32.extend(tokens.iter().map(|&x| x as i32));
        self.mark_tail(0)?;
        be.write(&tok_i32, p_tokens)?;
        be.embed(self.embed.ptr(), p_tokens, p_hidden, t, h)?;

        for l in 0..c.n_layers {
            self.mark(l, 0)?;
            let w = &self.layers[l];
            // ---- attention block ----
            be.rmsnorm(p_hidden, w.attn_norm.ptr(), p_normed, t, h, c.rms_eps)?;
            let k_new = cache.k[l].ptr().sub(pos0 * kvd, t * kvd);
            let v_new = cache.v[l].ptr().sub(pos0 * kvd, t * kvd);
            if phase == Phase::Decode {
                // one launch for the three projections (GEMV rows of q, k, v)
                be.gemv3_bf16(
                    [w.q.ptr(), w.k.ptr(), w.v.ptr()],
                    p_normed,
                    [p_q, k_new, v_new],
                    [qd, kvd, kvd],
                    t,
                    h,
                )?;
            } else {
                self.linear(phase, p_normed, w.q.ptr(), p_q, t, qd, h, false)?;
                self.linear(phase, p_normed, w.k.ptr(), k_new, t, kvd, h, false)?;
                self.linear(phase, p_normed, w.v.ptr(), v_new, t, kvd, h, false)?;
            }
            for (dst, bias, dim) in [(p_q, &w.q_bias, qd), (k_new, &w.k_bias, kvd), (v_new, &w.v_bias, kvd)] {
                if let Some(b) = bias {
                    be.add_bias_rows(dst, b.ptr(), t, dim)?;
                }
            }
            // per-head q/k norm (or none) and RoPE fused into one launch when no clamp sits between
            let fused_qk =
                c.clip_qkv.is_none() && matches!(self.adapter.qk_norm, QkNorm::None | QkNorm::PerHead);
            match self.adapter.qk_norm {
                _ if fused_qk => {}
                QkNorm::None => {}
                QkNorm::PerHead => {
                    be.rmsnorm(p_q, w.q_norm.as_ref().unwrap().ptr(), p_q, t * nh, hd, c.rms_eps)?;
                    be.rmsnorm(k_new, w.k_norm.as_ref().unwrap().ptr(), k_new, t * nkv, hd, c.rms_eps)?;
                }
                QkNorm::WholeProjection => {
                    be.rmsnorm(p_q, w.q_norm.as_ref().unwrap().ptr(), p_q, t, qd, c.rms_eps)?;
                    be.rmsnorm(k_new, w.k_norm.as_ref().unwrap().ptr(), k_new, t, kvd, c.rms_eps)?;
                }
            }
            if let Some(clip) = c.clip_qkv {
                be.clamp(p_q, t * qd, clip)?;
                be.clamp(k_new, t * kvd, clip)?;
                be.clamp(v_new, t * kvd, clip)?;
            }
            if fused_qk {
                let norm = match self.adapter.qk_norm {
                    QkNorm::PerHead => {
                        Some((w.q_norm.as_ref().unwrap().ptr(), w.k_norm.as_ref().unwrap().ptr()))
                    }
                    _ => None,
                };
                be.qk_norm_rope(
                    p_q,
                    k_new,
                    norm,
                    t,
                    nh,
                    nkv,
                    qd,
                    kvd,
                    hd,
                    pos0,
                    c.rope_theta,
                    interleaved,
                    c.rms_eps,
                )?;
            } else {
                be.rope(p_q, t, nh, qd, hd, pos0, c.rope_theta, interleaved)?;
                be.rope(k_new, t, nkv, kvd, hd, pos0, c.rope_theta, interleaved)?;
            }
            self.mark(l, 1)?;
            match p_part {
                Some(part) if split_attention => be.attention_split(
                    p_q,
                    cache.k[l].ptr(),
                    cache.v[l].ptr(),
                    p_attn,
                    part,
                    t,
                    pos0,
                    nh,
                    nkv,
                    hd,
                    window,
                )?,
                _ => be.attention(
                    p_q,
                    cache.k[l].ptr(),
                    cache.v[l].ptr(),
                    p_attn,
                    t,
                    pos0,
                    nh,
                    nkv,
                    hd,
                    window,
                )?,
            }
            self.mark(l, 2)?;
            // o projection accumulates straight into the residual stream.
            self.linear(phase, p_attn, w.o.ptr(), p_hidden, t, h, qd, true)?;
            self.mark(l, 3)?;

            // ---- MoE block: dense stage ----
            // Decode builds the hot worklist on the GPU; the host sees the routing only when the
            // layer has cold experts (then the normed rows come along for the cold lane).
            let device_worklist = phase == Phase::Decode;
            let n_hot_experts = self.hot_id_map[l].iter().filter(|&&x| x >= 0).count();
            let all_hot = n_hot_experts == e_n;
            // All-hot decode without a shared expert: the hot lane accumulates straight into the
            // residual stream (hidden + sum, as hidden + (0 + sum) before), no zero fill, no add.
            let direct_residual = device_worklist && all_hot && w.shared.is_none();
            be.rmsnorm(p_hidden, w.ffn_norm.ptr(), p_normed, t, h, c.rms_eps)?;
            if !direct_residual {
                be.zero(p_moe.sub(0, t * h))?;
            }
            be.gemv_bf16(w.router.ptr(), p_normed, p_rl, t, e_n, h, false)?;
            be.route_topk(p_rl, t, e_n, k, variant, c.norm_topk_prob, p_ids, p_w)?;
            let s = self.scratch.as_mut().unwrap();
            if !(device_worklist && all_hot) {
                unsafe {
                    be.read_async(p_ids, &mut s.pin_ids, t * k)?;
                    be.read_async(p_w, &mut s.pin_w, t * k)?;
                    if device_worklist {
                        be.read_async(p_normed, &mut s.pin_cold_in, t * h)?;
                    }
                }
                be.record(&self.route_ready)?;
            }
            self.mark(l, 4)?;
            if let Some(sw) = &w.shared {
                let sff = c.shared_expert_ff;
                self.linear(phase, p_normed, sw.gate.ptr(), p_g, t, sff, h, false)?;
                self.linear(phase, p_normed, sw.up.ptr(), p_u, t, sff, h, false)?;
                be.silu_mul(p_g, p_u, p_h, t * sff)?;
                self.linear(phase, p_h, sw.down.ptr(), p_sout, t, h, sff, false)?;
                be.gemv_bf16(sw.gate_logit.ptr(), p_normed, p_sgl, t, 1, h, false)?;
                be.add_sigmoid_scaled_rows(p_moe, p_sout, p_sgl, t, h)?;
            }
            self.mark(l, 5)?;
            if device_worklist {
                let wi = |o: usize, n: usize| p_wi.sub(o, n);
                let n_ent = t * k;
                be.hot_worklist_tokens(
                    self.hot_id_map_dev.ptr().sub(l * e_n, e_n),
                    p_ids,
                    t,
                    k,
                    e_n,
                    wi(layout.slots, n_ent),
                    wi(layout.tokens, n_ent),
                    wi(layout.tok_off, t + 1),
                    wi(layout.tok_rows, t),
                )?;
                self.mark(l, 6)?;
                let (ev_start, ev_end) = &self.events[l];
                hot_launch_at.push(Instant::now());
                be.record(ev_start)?;
                if n_hot_experts > 0 {
                    let hl = &self.hot[l];
                    let (gc, uc, dc) = (
                        hl.gate.as_ref().unwrap().ptr(),
                        hl.up.as_ref().unwrap().ptr(),
                        hl.down.as_ref().unwrap().ptr(),
                    );
                    let ff = c.expert_ff;
                    // entries routed to cold experts have slot -1: the kernels skip them
                    be.moe_gate_up_gemv(
                        gc,
                        uc,
                        p_normed,
                        wi(layout.slots, n_ent),
                        wi(layout.tokens, n_ent),
                        p_h,
                        n_ent,
                        ff,
                        h,
                    )?;
                    be.moe_down_accum(
                        dc,
                        p_h,
                        wi(layout.slots, n_ent),
                        p_w,
                        wi(layout.tok_off, t + 1),
                        wi(layout.tok_rows, t),
                        if direct_residual { p_hidden } else { p_moe },
                        t,
                        h,
                        ff,
                    )?;
                }
                be.record(ev_end)?;
                self.mark(l, 7)?;
                let split_at = Instant::now();
                let mut lane = LayerLaneStats::default();
                if all_hot {
                    lane.hot_slots = n_ent;
                    cold_window.push(None);
                } else {
                    // the hot lane is queued: the CPU works while the GPU runs it
                    self.route_ready.synchronize()?;
                    // The host runs ahead of the GPU: the hot lane cannot start before routing
                    // is done, so its start (for the overlap estimate) is now, not its enqueue.
                    if let Some(hot_start) = hot_launch_at.last_mut() {
                        *hot_start = Instant::now();
                    }
                    if let Some(joined) = gpu_joined.get_mut(l) {
                        *joined = true;
                    }
                    let s = self.scratch.as_mut().unwrap();
                    let ids = &s.pin_ids.as_slice()[..n_ent];
                    let wts = &s.pin_w.as_slice()[..n_ent];
                    let map = &self.hot_id_map[l];
                    cold_slots.clear();
                    cold_row_tok.clear();
                    for ti in 0..t {
                        let mut row: Option<usize> = None;
                        for j in 0..k {
                            let e = ids[ti * k + j];
                            if e < 0 || e as usize >= e_n {
                                return Err(GpuError::Unsupported(format!(
                                    "router produced expert id {e} (NaN logits?)"
                                )));
                            }
                            if map[e as usize] >= 0 {
                                lane.hot_slots += 1;
                                continue;
                            }
                            let r = *row.get_or_insert_with(|| {
                                cold_row_tok.push(ti);
                                cold_row_tok.len() - 1
                            });
                            cold_slots.push(ColdSlot {
                                row_idx: r,
                                expert_idx: e as usize,
                                weight: wts[ti * k + j],
                            });
                        }
                    }
                    let n_cold_rows = cold_row_tok.len();
                    lane.cold_slots = cold_slots.len();
                    lane.cold_rows = n_cold_rows;
                    if n_cold_rows > 0 {
                        let cold_start = Instant::now();
                        let normed_rows = &s.pin_cold_in.as_slice()[..t * h];
                        // compact rows (identity when every token has a cold slot, as in t = 1)
                        let input: &[f32] = if n_cold_rows == t {
                            normed_rows
                        } else {
                            cold_in_host.clear();
                            for &ti in &cold_row_tok {
                                cold_in_host.extend_from_slice(&normed_rows[ti * h..][..h]);
                            }
                            &cold_in_host
                        };
                        cold_out_host.clear();
                        cold_out_host.resize(n_cold_rows * h, 0.0);
                        cold.compute(l, input, &cold_slots, &mut cold_out_host);
                        let out = &mut s.pin_cold_out.as_mut_slice()[..t * h];
                        if n_cold_rows == t {
                            out.copy_from_slice(&cold_out_host);
                        } else {
                            out.fill(0.0);
                            for (r, &ti) in cold_row_tok.iter().enumerate() {
                                out[ti * h..][..h].copy_from_slice(&cold_out_host[r * h..][..h]);
                            }
                        }
                        let cold_end = Instant::now();
                        lane.cold_us = (cold_end - cold_start).as_secs_f64() * 1e6;
                        cold_window.push(Some((cold_start, cold_end)));
                        // join on the GPU stream: no host wait for the hot lane
                        unsafe { be.write_async(&s.pin_cold_out, t * h, p_cout)? };
                        be.add(p_moe, p_cout, t * h)?;
                    } else {
                        cold_window.push(None);
                    }
                }
                self.mark(l, 8)?;
                lane.wall_us = split_at.elapsed().as_secs_f64() * 1e6;
                stats.layers.push(lane);
                if !direct_residual {
                    be.add(p_hidden, p_moe, t * h)?;
                }
                self.mark(l, 9)?;
                continue;
            }
            self.route_ready.synchronize()?;
            let split_at = Instant::now();

            // ---- split: worklist on the host ----
            let s = self.scratch.as_mut().unwrap();
            let ids = &s.pin_ids.as_slice()[..t * k];
            let wts = &s.pin_w.as_slice()[..t * k];
            let map = &self.hot_id_map[l];
            // hot entries (slot, token, weight); cold rows and slots
            let mut hot: Vec<(i32, i32, f32)> = Vec::with_capacity(t * k);
            cold_slots.clear();
            let mut n_cold_rows = 0usize;
            for ti in 0..t {
                let mut row: Option<usize> = None;
                for j in 0..k {
                    let e = ids[ti * k + j];
                    if e < 0 || e as usize >= e_n {
                        return Err(GpuError::Unsupported(format!(
                            "router produced expert id {e} (NaN logits?)"
                        )));
                    }
                    let slot = map[e as usize];
                    if slot >= 0 {
                        hot.push((slot, ti as i32, wts[ti * k + j]));
                    } else {
                        let r = *row.get_or_insert_with(|| {
                            work_i[layout.cold_rows + n_cold_rows] = ti as i32;
                            n_cold_rows += 1;
                            n_cold_rows - 1
                        });
                        cold_slots.push(ColdSlot {
                            row_idx: r,
                            expert_idx: e as usize,
                            weight: wts[ti * k + j],
                        });
                    }
                }
            }
            if phase == Phase::Prefill {
                hot.sort_by_key(|&(slot, tok, _)| (slot, tok)); // expert-major (stable per token)
            }
            let n_hot = hot.len();
            for (i, &(slot, tok, wt)) in hot.iter().enumerate() {
                work_i[layout.slots + i] = slot;
                work_i[layout.tokens + i] = tok;
                work_f[i] = wt;
            }
            // token rows with hot entries: offsets into `entries` (indices of `hot`)
            let mut per_tok: Vec<Vec<i32>> = vec![Vec::new(); t];
            for (i, &(_, tok, _)) in hot.iter().enumerate() {
                per_tok[tok as usize].push(i as i32);
            }
            let mut n_rows = 0usize;
            let mut off = 0usize;
            work_i[layout.tok_off] = 0;
            for (ti, list) in per_tok.iter().enumerate() {
                if list.is_empty() {
                    continue;
                }
                work_i[layout.tok_rows + n_rows] = ti as i32;
                for &e in list {
                    work_i[layout.entries + off] = e;
                    off += 1;
                }
                n_rows += 1;
                work_i[layout.tok_off + n_rows] = off as i32;
            }
            be.write(&work_i, p_wi)?;
            be.write(&work_f[..n_hot.max(1)], p_wf)?;
            let wi = |o: usize, n: usize| p_wi.sub(o, n);

            // ---- cold lane input: gather rows, copy to pinned memory ----
            if n_cold_rows > 0 {
                be.gather_rows(p_normed, wi(layout.cold_rows, n_cold_rows), p_cin, n_cold_rows, h)?;
                unsafe { be.read_async(p_cin, &mut s.pin_cold_in, n_cold_rows * h)? };
                be.record(&self.cold_ready)?;
            }

            // ---- hot lane on the GPU ----
            self.mark(l, 6)?;
            let (ev_start, ev_end) = &self.events[l];
            hot_launch_at.push(Instant::now());
            be.record(ev_start)?;
            if n_hot > 0 {
                let hl = &self.hot[l];
                let (gc, uc, dc) = (
                    hl.gate.as_ref().unwrap().ptr(),
                    hl.up.as_ref().unwrap().ptr(),
                    hl.down.as_ref().unwrap().ptr(),
                );
                let (ff, nf) = (c.expert_ff, c.expert_ff * h);
                match phase {
                    Phase::Decode => {
                        be.moe_gate_up_gemv(
                            gc,
                            uc,
                            p_normed,
                            wi(layout.slots, n_hot),
                            wi(layout.tokens, n_hot),
                            p_h,
                            n_hot,
                            ff,
                            h,
                        )?;
                        be.moe_down_accum(
                            dc,
                            p_h,
                            wi(layout.slots, n_hot),
                            p_wf,
                            wi(layout.tok_off, n_rows + 1),
                            wi(layout.tok_rows, n_rows),
                            p_moe,
                            n_rows,
                            h,
                            ff,
                        )?;
                    }
                    Phase::Prefill => {
                        // grouped GEMM: one cuBLAS GEMM per used slot over its gathered token rows
                        be.gather_split_bf16(p_normed, Some(wi(layout.tokens, n_hot)), p_xhi, lo, n_hot, h)?;
                        let mut start = 0;
                        while start < n_hot {
                            let slot = hot[start].0 as usize;
                            let end =
                                start + hot[start..].iter().take_while(|x| x.0 as usize == slot).count();
                            let n_s = end - start;
                            let xs = p_xhi.sub(start * h, n_s * h);
                            let xl = lo.map(|p| p.sub(start * h, n_s * h));
                            be.gemm_bf16(
                                gc.sub(slot * nf, nf),
                                xs,
                                xl,
                                p_g.sub(start * ff, n_s * ff),
                                n_s,
                                ff,
                                h,
                                false,
                            )?;
                            be.gemm_bf16(
                                uc.sub(slot * nf, nf),
                                xs,
                                xl,
                                p_u.sub(start * ff, n_s * ff),
                                n_s,
                                ff,
                                h,
                                false,
                            )?;
                            start = end;
                        }
                        be.silu_mul(p_g, p_u, p_h, n_hot * ff)?;
                        be.gather_split_bf16(p_h, None, p_xhi, lo, n_hot, ff)?;
                        let mut start = 0;
                        while start < n_hot {
                            let slot = hot[start].0 as usize;
                            let end =
                                start + hot[start..].iter().take_while(|x| x.0 as usize == slot).count();
                            let n_s = end - start;
                            let xs = p_xhi.sub(start * ff, n_s * ff);
                            let xl = lo.map(|p| p.sub(start * ff, n_s * ff));
                            be.gemm_bf16(
                                dc.sub(slot * nf, nf),
                                xs,
                                xl,
                                p_y.sub(start * h, n_s * h),
                                n_s,
                                h,
                                ff,
                                false,
                            )?;
                            start = end;
                        }
                        be.moe_scatter_accum(
                            p_y,
                            wi(layout.entries, n_hot),
                            p_wf,
                            wi(layout.tok_off, n_rows + 1),
                            wi(layout.tok_rows, n_rows),
                            p_moe,
                            n_rows,
                            h,
                        )?;
                    }
                }
            }
            be.record(ev_end)?;
            self.mark(l, 7)?;

            // ---- cold lane on the CPU, overlapping the GPU ----
            let mut lane = LayerLaneStats {
                hot_slots: n_hot,
                cold_slots: cold_slots.len(),
                cold_rows: n_cold_rows,
                ..Default::default()
            };
            if n_cold_rows > 0 {
                self.cold_ready.synchronize()?;
                let cold_start = Instant::now();
                let s = self.scratch.as_mut().unwrap();
                let out = &mut s.pin_cold_out.as_mut_slice()[..n_cold_rows * h];
                out.fill(0.0);
                cold.compute(l, &s.pin_cold_in.as_slice()[..n_cold_rows * h], &cold_slots, out);
                let cold_end = Instant::now();
                lane.cold_us = (cold_end - cold_start).as_secs_f64() * 1e6;
                cold_window.push(Some((cold_start, cold_end)));
                unsafe { be.write_async(&s.pin_cold_out, n_cold_rows * h, p_cout)? };
                be.scatter_add_rows(p_cout, wi(layout.cold_rows, n_cold_rows), p_moe, n_cold_rows, h)?;
                // join: wait for the hot lane
                let wait_start = Instant::now();
                ev_end.synchronize()?;
                lane.join_wait_us = wait_start.elapsed().as_secs_f64() * 1e6;
            } else {
                cold_window.push(None);
            }
            self.mark(l, 8)?;
            lane.wall_us = split_at.elapsed().as_secs_f64() * 1e6;
            stats.layers.push(lane);
            be.add(p_hidden, p_moe, t * h)?;
            self.mark(l, 9)?;
        }

        // ---- final norm, lm_head, greedy ----
        be.rmsnorm(p_hidden, self.final_norm.ptr(), p_normed, t, h, c.rms_eps)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed).ptr();
        self.linear(phase, p_normed, head, p_logits, t, c.vocab, h, false)?;
        self.mark_tail(1)?;
        if t <= 8 {
            // decode: one row over many blocks (the one-block-per-row kernel is latency bound)
            be.argmax_split(p_logits, t, c.vocab, p_argmax, p_am_part)?;
        } else {
            be.argmax(p_logits, t, c.vocab, p_argmax)?;
        }
        self.mark_tail(2)?;
        let copy_start = Instant::now();
        let data = if self.copy_logits {
            let mut data = vec![0f32; t * c.vocab];
            be.read(p_logits.sub(0, t * c.vocab), &mut data)?;
            data
        } else {
            Vec::new()
        };
        let mut am = vec![0i32; t];
        be.read(p_argmax.sub(0, t), &mut am)?;
        let copy_us = copy_start.elapsed().as_secs_f64() * 1e6;
        cache.n_positions += t;

        for (l, lane) in stats.layers.iter_mut().enumerate() {
            let (a, b) = &self.events[l];
            lane.hot_us = a.elapsed_ms(b)? as f64 * 1e3;
            if let Some((cs, ce)) = cold_window[l] {
                let hs = hot_launch_at[l];
                let he = hs + std::time::Duration::from_secs_f64(lane.hot_us / 1e6);
                let start = hs.max(cs);
                let end = he.min(ce);
                lane.overlap_us = end.checked_duration_since(start).map_or(0.0, |d| d.as_secs_f64() * 1e6);
                if gpu_joined[l] {
                    // The join waits for the later lane: the gap between the two lanes' ends.
                    let gap = if ce > he { ce - he } else { he - ce };
                    lane.join_wait_us = gap.as_secs_f64() * 1e6;
                }
            }
        }
        stats.total_us = call_start.elapsed().as_secs_f64() * 1e6;
        let enqueue_us = (copy_start - call_start).as_secs_f64() * 1e6;
        self.collect_profile(phase, t, copy_us, enqueue_us, stats.total_us)?;
        self.stats = stats;
        self.host = HostScratch {
            work_i,
            work_f,
            cold_slots,
            cold_row_tok,
            cold_in_host,
            cold_out_host,
            hot_launch_at,
            gpu_joined,
            cold_window,
            tok_i32,
        };
        Ok(Logits { n_rows: t, vocab: c.vocab, data, argmax: am.into_iter().map(|x| x as u32).collect() })
    }
}
