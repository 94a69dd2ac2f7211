//! `GpuModel`: a model resident on one GPU, or split by layers over several (on each device the
//! non-expert weights and the VRAM hot cache of its layers, `shard`), and the forward call that
//! drives it: a loop over the plan's layers, each running the mixer stage (`mixer`: attention or
//! DeltaNet) and the MoE stage (`moe`, `route`: the hot/cold split, the lanes, the join and the
//! fallback) over its device's shared [`Device`](super::device::Device) (`device`), between the
//! embedding (first device) and the head (last device, `head`); one-token decode calls replay
//! graphs (`graph`), per device; statistics in `stats`. Between devices the hidden rows hop
//! through host memory ([`GpuModel::hop`]); on one device nothing is added to the single-device
//! walk.

use super::head::head_kernels;
use super::hot_cache::HotCache;
use super::kv::GpuKvCache;
use super::options::GpuOptions;
use super::postfetch::plan::PostFetchTotals;
use super::shard::{DeviceReport, Shard};
use super::split::SplitError;
use super::stats::{self, CallTimes, ForwardStats, Profiler, StageProfile};
use super::weights::{DenseWeights, Ends};
use super::{GpuError, RecurrentState};
use crate::cache::hot_set::HotSet;
use crate::cache::perf::{PerfMode, PerfState};
use crate::forward::LogitRows;
use crate::forward::Logits;
use crate::model::arch::LayerPlan;
use crate::model::config::ModelConfig;
use crate::model::context::KvType;
use crate::model::Model;
use crate::moe::cold::ColdLane;
use crate::moe::phase::Phase;
use crate::reference::ForwardError;
use moe_lanes_kernels::cuda::{CudaBackend, DeviceBuffer, Glu};
use moe_lanes_kernels::kv::KV_RING_CHUNK_POSITIONS;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

/// One sequence's rows in a forward call: `n` rows from `row0`, the first at position `pos0`
/// of `cache`.
#[derive(Clone, Copy)]
pub(crate) struct GpuSeg<'c> {
    pub row0: usize,
    pub n: usize,
    pub pos0: usize,
    pub cache: &'c GpuKvCache,
}

impl<'c> GpuSeg<'c> {
    /// A call's only sequence: its `n` rows from row 0, after what `cache` holds.
    pub fn whole(cache: &'c GpuKvCache, n: usize) -> GpuSeg<'c> {
        GpuSeg { row0: 0, n, pos0: cache.n_positions, cache }
    }
}

/// Elements of the prefill dequantization scratch (bf16, 32 MiB): a quantized matrix with more
/// elements is dequantized and multiplied in row ranges.
const DEQUANT_SCRATCH_ELEMS: usize = 16 << 20;

/// The dequantization scratch a model needs: none for a float model, else room for the largest
/// quantized matrix (dense or expert) up to [`DEQUANT_SCRATCH_ELEMS`].
pub(super) fn dequant_scratch(
    be: &CudaBackend,
    (cfg, plan): (&ModelConfig, &LayerPlan),
    w: &DenseWeights,
    hot: &HotCache,
) -> Result<Option<DeviceBuffer<u16>>, GpuError> {
    let experts = if hot.any_quantized() { cfg.expert_ff * cfg.hidden } else { 0 };
    let most = w.max_quantized_elems.max(experts);
    if most == 0 {
        return Ok(None);
    }
    let widest_row =
        cfg.hidden.max(widest_attention(plan, cfg).0).max(cfg.expert_ff).max(cfg.shared_expert_ff);
    Ok(Some(be.alloc_zeros::<u16>(most.min(DEQUANT_SCRATCH_ELEMS.max(widest_row)))?))
}

/// The widest attention layer's query and key rows `(q_dim, kv_dim)` (the config's where no
/// layer has its own sizes).
pub(super) fn widest_attention(plan: &LayerPlan, cfg: &ModelConfig) -> (usize, usize) {
    let layers = plan.layers().iter().filter_map(|l| l.as_attention());
    layers.fold((cfg.q_dim(), cfg.kv_dim()), |(q, kv), a| (q.max(a.q_dim(cfg.n_heads)), kv.max(a.kv_dim())))
}

/// A model resident on one GPU or split by layers over several: one `Shard` per device, in
/// layer order, each a loop over owned stages (mixers, MoE layers with its hot cache, lanes,
/// join and Post-Fetch) over its layers; the embedding on the first device, the head and the
/// copies back on the last. The perf state and the call's statistics are the model's.
pub struct GpuModel {
    pub(super) shards: Vec<Shard>,
    stats: ForwardStats,
    pub(super) perf: PerfState,
    pub(super) call_idx: u64,
    /// Decode calls that could run as graphs (the timing sample's count,
    /// [`super::graph::HOT_TIMING_EVERY_CALLS`]).
    pub(super) graph_calls: u64,
    /// Every layer's hot set when the model is split (each device's cache holds its own
    /// layers'); `None` on one device, whose cache's set is the model's.
    split_hot: Option<HotSet>,
    /// Host rows of a hop between devices ([`GpuModel::hop`]).
    hop_rows: Vec<f32>,
    /// A split call's routing ids of the devices before the last, `[n_layers, t * k]`.
    split_ids: Vec<i32>,
}

/// The devices' layer ranges: contiguous, in order, each non-empty, covering `0..n_layers`.
fn check_ranges(ranges: Vec<Range<usize>>, n_layers: usize) -> Result<(), GpuError> {
    let mut next = 0;
    let in_order = ranges.iter().all(|r| {
        let fits = r.start == next && r.end > r.start;
        next = r.end;
        fits
    });
    if ranges.is_empty() {
        return Err(SplitError::NoDevices.into());
    }
    match in_order && next == n_layers {
        true => Ok(()),
        false => Err(GpuError::LayerRanges { ranges, n_layers }),
    }
}

impl GpuModel {
    /// Whether the GPU engine runs every layer kind of `model`'s plan; the first it lacks, by
    /// name, otherwise (checked before anything touches the device).
    pub fn supports(model: &Model) -> Result<(), GpuError> {
        let cfg = model.config();
        let head_dims = model.plan().layers().iter().filter_map(|l| l.as_attention().map(|a| a.head_dim));
        if let Some(head_dim) = std::iter::once(cfg.head_dim).chain(head_dims).find(|d| d % 2 == 1) {
            return Err(GpuError::OddHeadDim { head_dim });
        }
        let iq4_nl = crate::format::dtype::DType::IQ4_NL;
        if let Some((tensor, ..)) = model.tensor_list().into_iter().find(|(_, d, ..)| *d == iq4_nl) {
            return Err(GpuError::TensorType { tensor, dtype: iq4_nl.ggml_name() });
        }
        if let Some((layer_idx, kind)) = model.plan().first_unsupported(super::mixer::runs_mixer) {
            return Err(GpuError::Mixer { layer_idx, kind });
        }
        let attention =
            model.plan().layers().iter().enumerate().filter_map(|(l, s)| Some((l, s.as_attention()?)));
        if let Some(e) = attention.filter_map(|(l, a)| super::mixer::unsupported_attention(l, a)).next() {
            return Err(e);
        }
        // SiLU, GPT-OSS's clamped SwiGLU and Gemma 4's tanh GELU experts have hot-lane kernels;
        // the erf GELU none.
        super::hot_cache::expert_glu(model)?;
        // Dense FFN layers run the same gated activations.
        if let Some((layer_idx, kind)) = model.plan().first_unsupported_ffn(|f| match f {
            crate::model::arch::Ffn::Moe(_) => true,
            crate::model::arch::Ffn::Dense(d) => Glu::of(d.activation.kernel()).is_some(),
        }) {
            return Err(GpuError::Ffn { layer_idx, kind });
        }
        // Per-branch norms normalise the dense (shared) branch's output: they come with one.
        let branch = |l: &crate::model::arch::LayerSpec| {
            l.as_moe().is_some_and(|m| m.branch_norms && m.shared.is_none())
        };
        if let Some(layer_idx) = model.plan().layers().iter().position(branch) {
            return Err(GpuError::Ffn {
                layer_idx,
                kind: "mixture of experts with branch norms but no dense branch",
            });
        }
        Ok(())
    }

    /// Upload every non-expert weight to `be`'s device, which runs every layer; the hot cache
    /// starts empty (every expert cold) until [`GpuModel::allocate_hot`].
    pub fn new(model: Arc<Model>, be: Arc<CudaBackend>, opts: GpuOptions) -> Result<GpuModel, GpuError> {
        let n_layers = model.config().n_layers;
        GpuModel::on_devices(model, vec![(be, 0..n_layers)], opts)
    }

    /// The model split over devices: `parts[d]` is device d's backend and the layers it runs
    /// (contiguous, in order, covering every layer: [`super::split::assign_layers`]); the first
    /// runs the embedding, the last the head. Every device's non-expert weights are uploaded;
    /// the hot caches start empty until [`GpuModel::allocate_hot`]. One part is the
    /// single-device engine.
    pub fn on_devices(
        model: Arc<Model>,
        parts: Vec<(Arc<CudaBackend>, Range<usize>)>,
        opts: GpuOptions,
    ) -> Result<GpuModel, GpuError> {
        if let Some((be, _)) = parts.first() {
            be.bind_to_thread()?;
        }
        let cfg = model.config().clone();
        GpuModel::supports(&model)?;
        super::kv::check_kv_blocks(model.plan(), opts.kv_type)?;
        check_ranges(parts.iter().map(|(_, r)| r.clone()).collect(), cfg.n_layers)?;
        let n = parts.len();
        if opts.profile && n > 1 {
            return Err(GpuError::SplitProfile { devices: n });
        }
        let shards = parts
            .into_iter()
            .enumerate()
            .map(|(d, (be, layers))| {
                let ends = Ends { embed: d == 0, head: d + 1 == n };
                Shard::new(model.clone(), be, (layers, ends), opts.clone())
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut gm = GpuModel {
            shards,
            perf: PerfState::new(opts.perf_mode, cfg.n_layers, cfg.n_experts, cfg.n_experts_used),
            stats: ForwardStats::default(),
            call_idx: 0,
            graph_calls: 0,
            split_hot: (n > 1).then(|| HotSet::empty(cfg.n_layers, cfg.n_experts, 1)),
            hop_rows: Vec::new(),
            split_ids: Vec::new(),
        };
        if opts.profile {
            gm.enable_profile()?;
        }
        Ok(gm)
    }

    /// Allocate the hot caches once (capacity = each layer's hot count, on the device that
    /// runs the layer) and fill them.
    pub fn allocate_hot(&mut self, set: &HotSet) -> Result<(), GpuError> {
        let Some(split) = self.split_hot.as_mut() else { return self.shards[0].allocate_hot(set) };
        let n_layers = split.layers.len();
        if set.layers.len() != n_layers {
            return Err(GpuError::HotLayers { given: set.layers.len(), expected: n_layers });
        }
        for sh in &mut self.shards {
            let mut part = HotSet::empty(n_layers, set.n_experts, set.n_lanes);
            for l in sh.layers() {
                part.layers[l] = set.layers[l].clone();
            }
            sh.allocate_hot(&part)?;
        }
        *split = set.clone();
        Ok(())
    }

    /// Exchange one cache slot between calls: `add` takes the slot of `evict` (on the device
    /// that runs `layer_idx`).
    pub fn exchange(&mut self, layer_idx: usize, evict: usize, add: usize) -> Result<(), GpuError> {
        let d = self.device_of(layer_idx);
        self.shards[d].exchange(layer_idx, evict, add)?;
        if let Some(split) = self.split_hot.as_mut() {
            split.layers[layer_idx] = self.shards[d].moe.hot.set().layers[layer_idx].clone();
        }
        Ok(())
    }

    /// The device that runs layer `l` (the last for a layer past the model's: its checks refuse
    /// it by name).
    fn device_of(&self, l: usize) -> usize {
        self.shards.iter().position(|s| s.dev.layers.contains(&l)).unwrap_or(self.shards.len() - 1)
    }

    pub fn hot_set(&self) -> &HotSet {
        self.split_hot.as_ref().unwrap_or_else(|| self.shards[0].moe.hot.set())
    }

    pub fn config(&self) -> &ModelConfig {
        &self.shards[0].dev.cfg
    }

    /// The most tokens one call appends to a sequence: [`GpuOptions::max_call_tokens`], and
    /// [`KV_RING_CHUNK_POSITIONS`] for a model with sliding-window layers (what their rings
    /// hold past the window).
    pub fn call_token_limit(&self) -> usize {
        let dev = &self.shards[0].dev;
        let ring = if dev.plan.has_window() { KV_RING_CHUNK_POSITIONS } else { usize::MAX };
        dev.opts.max_call_tokens.clamp(1, ring)
    }

    /// The first device's backend (the only one unless the model is split).
    pub fn backend(&self) -> &Arc<CudaBackend> {
        &self.shards[0].dev.be
    }

    /// Every device's backend, in layer order.
    pub fn backends(&self) -> impl Iterator<Item = &Arc<CudaBackend>> {
        self.shards.iter().map(|s| &s.dev.be)
    }

    /// The layers each device runs, in order (one range on one device).
    pub fn device_layers(&self) -> Vec<Range<usize>> {
        self.shards.iter().map(Shard::layers).collect()
    }

    /// Per device: its layers, dense and hot bytes, cached experts (one entry on one device).
    pub fn device_reports(&self) -> Vec<DeviceReport> {
        self.shards.iter().map(Shard::report).collect()
    }

    /// The KV cache's element type.
    pub fn kv_type(&self) -> KvType {
        self.shards[0].dev.opts.kv_type
    }

    pub fn perf(&self) -> &PerfState {
        &self.perf
    }

    /// Start the perf state over (after a learn pass, say).
    pub fn reset_perf(&mut self) {
        let c = self.config();
        let mode = self.shards[0].dev.opts.perf_mode;
        self.perf = PerfState::new(mode, c.n_layers, c.n_experts, c.n_experts_used);
        for pf in self.shards.iter_mut().filter_map(|s| s.moe.postfetch.as_mut()) {
            pf.totals = PostFetchTotals::default();
        }
    }

    /// The cold lane's thread count: Post-Fetch's CPU cost per token and its staging threads.
    pub fn set_cold_threads(&mut self, n_threads: usize) {
        let (h, ff) = (self.config().hidden, self.config().expert_ff);
        for pf in self.shards.iter_mut().filter_map(|s| s.moe.postfetch.as_mut()) {
            pf.set_cold_threads(h, ff, n_threads);
        }
    }

    /// Learn passes count routed slots in the cold lane: fetch nothing while `paused`.
    pub fn pause_postfetch(&mut self, paused: bool) {
        self.shards.iter_mut().for_each(|s| s.moe.pause_postfetch(paused));
    }

    pub fn perf_mut(&mut self) -> &mut PerfState {
        &mut self.perf
    }

    /// Bytes of the hot expert caches (all layers, every device).
    pub fn hot_cache_bytes(&self) -> usize {
        self.shards.iter().map(|s| s.moe.hot.bytes()).sum()
    }

    /// Bytes of the non-expert matrices on the devices.
    pub fn weight_bytes(&self) -> usize {
        self.shards.iter().map(|s| s.dev.w.matrix_bytes).sum()
    }

    pub fn set_copy_logits(&mut self, on: bool) {
        self.shards.iter_mut().for_each(|s| s.dev.opts.copy_logits = on);
    }

    pub fn copies_logits(&self) -> bool {
        self.shards[0].dev.opts.copy_logits
    }

    /// Statistics of the last forward call.
    pub fn last_stats(&self) -> &ForwardStats {
        &self.stats
    }

    /// A KV cache for up to `capacity` positions, each layer's on the device that runs it; its
    /// paged buffers (`GpuOptions::kv_paging`) commit memory as calls need it (or
    /// [`Self::commit_kv_cache`]).
    pub fn new_kv_cache(&self, capacity: usize) -> Result<GpuKvCache, GpuError> {
        let c = self.config();
        if capacity == 0 || capacity > c.max_positions {
            return Err(GpuError::CacheCapacity { capacity, max_positions: c.max_positions });
        }
        let bes: Vec<&CudaBackend> =
            self.shards.iter().flat_map(|s| std::iter::repeat_n(&*s.dev.be, s.dev.layers.len())).collect();
        let (plan, paging) = (&self.shards[0].dev.plan, self.shards[0].dev.opts.kv_paging);
        GpuKvCache::new(&bes, plan, (c.kv_dim(), capacity), self.kv_type(), paging)
    }

    /// Commit `kv`'s paged buffers for its first `n_positions` (rounded up as a call commits,
    /// `kv::committed_positions`; its capacity commits it whole), on every device.
    pub fn commit_kv_cache(&self, kv: &mut GpuKvCache, n_positions: usize) -> Result<(), GpuError> {
        for (d, shard) in self.shards.iter().enumerate() {
            self.enter(d)?;
            kv.commit(&shard.dev.be, shard.layers(), n_positions)?;
        }
        self.enter(0)
    }

    /// A cache of `capacity` positions holding what `old` holds (its positions and recurrent
    /// state copied on the devices): a kept prefix taken by a longer request. `None` where a
    /// sliding-window layer's rows would change layout (`GpuKvCache::can_grow_to`); fails as
    /// [`Self::new_kv_cache`] does (`capacity` past the model's positions, device memory).
    pub fn grow_kv_cache(&self, old: &GpuKvCache, capacity: usize) -> Result<Option<GpuKvCache>, GpuError> {
        if !old.can_grow_to(&self.shards[0].dev.plan, capacity) {
            return Ok(None);
        }
        let mut new = self.new_kv_cache(capacity.max(old.capacity()))?;
        self.commit_kv_cache(&mut new, old.n_positions())?;
        for (d, shard) in self.shards.iter().enumerate() {
            self.enter(d)?;
            for l in shard.dev.layers.clone() {
                old.copy_layer_into(&new, &shard.dev.be, &shard.dev.plan.layers()[l].mixer, l)?;
            }
        }
        self.enter(0)?;
        new.n_positions = old.n_positions();
        Ok(Some(new))
    }

    /// `kv`'s recurrent (DeltaNet) state copied to the host, each layer's from its device: a
    /// checkpoint for prefix reuse (`GpuModel::write_recurrent` puts it back).
    pub fn read_recurrent(&self, kv: &GpuKvCache) -> Result<RecurrentState, GpuError> {
        let mut layers = Vec::with_capacity(self.config().n_layers);
        for (d, shard) in self.shards.iter().enumerate() {
            self.enter(d)?;
            for l in shard.dev.layers.clone() {
                layers.push(match kv.delta_state_of(l) {
                    Some(p) => Some((shard.dev.be.read_vec(p.conv)?, shard.dev.be.read_vec(p.matrix)?)),
                    None => None,
                });
            }
        }
        self.enter(0)?;
        Ok(RecurrentState { layers })
    }

    /// Put a state `read_recurrent` took back into `kv`'s device buffers (queued on each
    /// device's stream, before any later call's kernels).
    pub fn write_recurrent(&self, kv: &GpuKvCache, state: &RecurrentState) -> Result<(), GpuError> {
        for (d, shard) in self.shards.iter().enumerate() {
            self.enter(d)?;
            for l in shard.dev.layers.clone() {
                if let (Some(p), Some(Some((conv, matrix)))) = (kv.delta_state_of(l), state.layers.get(l)) {
                    shard.dev.be.write(conv, p.conv)?;
                    shard.dev.be.write(matrix, p.matrix)?;
                }
            }
        }
        self.enter(0)
    }

    /// Device scratch (and the stages' host twins) for calls of up to `t` tokens, on every
    /// device; grows, never shrinks.
    pub fn reserve_tokens(&mut self, t: usize) -> Result<(), GpuError> {
        for d in 0..self.shards.len() {
            self.enter(d)?;
            self.shards[d].reserve_tokens(t)?;
        }
        Ok(())
    }

    /// Make device `d`'s context current when the model is split (one device's stays bound).
    pub(super) fn enter(&self, d: usize) -> Result<(), GpuError> {
        if self.shards.len() > 1 {
            self.shards[d].dev.be.bind_to_thread()?;
        }
        Ok(())
    }

    /// The device that runs the head.
    pub(super) fn last_mut(&mut self) -> &mut Shard {
        self.shards.last_mut().expect("a model runs on a device")
    }

    pub(super) fn check_call(&self, tokens: &[u32], cache: &GpuKvCache) -> Result<(), GpuError> {
        let c = self.config();
        if tokens.is_empty() {
            return Err(ForwardError::EmptyInput.into());
        }
        let pos0 = cache.n_positions;
        if let Some((i, &token)) = tokens.iter().enumerate().find(|(_, &t)| t as usize >= c.vocab) {
            return Err(ForwardError::TokenOutOfRange { token, position: pos0 + i, vocab: c.vocab }.into());
        }
        if cache.n_layers() != c.n_layers || cache.kv_dim != c.kv_dim() {
            return Err(GpuError::CacheModel {
                cache_layers: cache.n_layers(),
                cache_kv_dim: cache.kv_dim,
                model_layers: c.n_layers,
                model_kv_dim: c.kv_dim(),
            });
        }
        if pos0 + tokens.len() > cache.capacity {
            return Err(ForwardError::ContextFull { max_positions: cache.capacity }.into());
        }
        Ok(())
    }
    /// Run `tokens` after what `cache` holds, in the caller's `phase` (decided once per call);
    /// the hot and cold lanes of every MoE layer split the routed slots; returns one logits row
    /// per token (or only the greedy tokens when logits copies are off).
    pub fn forward(
        &mut self,
        tokens: &[u32],
        phase: Phase,
        cache: &mut GpuKvCache,
        cold: &mut dyn ColdLane,
    ) -> Result<Logits, GpuError> {
        self.forward_rows(tokens, phase, cache, cold, LogitRows::All)
    }

    /// As [`GpuModel::forward`], with the lm_head run only for the `rows` asked for
    /// ([`LogitRows::Last`]: the last token's row, as generation and prompt processing need).
    /// A call longer than [`GpuOptions::max_call_tokens`] runs as consecutive calls of at most
    /// that many tokens (scratch grows with a call's tokens; a 32768-token prompt of a
    /// DeepSeek-V3-shaped model asked for about 94 GB of it in one call), after the whole call
    /// is checked, so a bad token or a full context changes nothing.
    pub fn forward_rows(
        &mut self,
        tokens: &[u32],
        phase: Phase,
        cache: &mut GpuKvCache,
        cold: &mut dyn ColdLane,
        rows: LogitRows,
    ) -> Result<Logits, GpuError> {
        let limit = self.call_token_limit();
        if tokens.len() <= limit {
            return self.forward_call(tokens, phase, cache, cold, rows);
        }
        self.check_call(tokens, cache)?;
        let mut logits = Logits::empty(self.config().vocab);
        for chunk in tokens.chunks(limit) {
            let part = self.forward_call(chunk, phase, cache, cold, rows)?;
            match rows {
                LogitRows::All => logits.append(part),
                LogitRows::Last => logits = part,
            }
        }
        Ok(logits)
    }

    /// One engine call of at most [`GpuOptions::max_call_tokens`] tokens.
    fn forward_call(
        &mut self,
        tokens: &[u32],
        phase: Phase,
        cache: &mut GpuKvCache,
        cold: &mut dyn ColdLane,
        rows: LogitRows,
    ) -> Result<Logits, GpuError> {
        let call_start = Instant::now();
        self.start_call(&mut [(tokens, &mut *cache)])?;
        let eager = self.timing_sample(tokens, phase);
        if !eager && self.graphs_apply(tokens, phase) {
            return self.forward_graphs(tokens[0], cache, cold, rows, call_start);
        }
        let t = tokens.len();
        self.enter(0)?;
        self.shards[0].embed(tokens)?;
        self.run_shards(phase, t, &[GpuSeg::whole(cache, t)], cold)?;
        let copy_start = Instant::now();
        let mode = self.perf.mode();
        let last = self.last_mut();
        let n = head_kernels(&last.dev, phase, t, rows)?;
        let logits = last.head_copies(mode, t, n)?;
        let copy_us = copy_start.elapsed().as_secs_f64() * 1e6;
        cache.n_positions += t;
        self.finish_call(phase, t, call_start, copy_start, copy_us)?;
        Ok(logits)
    }

    /// A call's start, after checking each sequence's tokens against its cache: counted (an
    /// injected device loss fails it here), then on every device its context bound, exchanges
    /// that landed admitted, scratch for every row, each cache's paged buffers committed for the
    /// call's positions, and a new (or cleared) session's recurrent state zeroed.
    pub(super) fn start_call(&mut self, seqs: &mut [(&[u32], &mut GpuKvCache)]) -> Result<(), GpuError> {
        for (tokens, cache) in seqs.iter() {
            self.check_call(tokens, cache)?;
        }
        self.call_idx += 1;
        if self.shards[0].dev.opts.faults.gpu_lost_at_call == Some(self.call_idx) {
            return Err(GpuError::Injected { what: "gpu lost" });
        }
        let t = seqs.iter().map(|(tokens, _)| tokens.len()).sum();
        for sh in &mut self.shards {
            let landed = sh.start(self.call_idx, t, &mut *seqs)?;
            if landed > 0 {
                self.perf.record_landed_exchanges(landed as u64);
            }
        }
        Ok(())
    }

    /// Every device's layers over the call's `t` rows (the embedding is in the first device's
    /// hidden rows), the rows hopping to the next device after each device's last layer.
    pub(super) fn run_shards(
        &mut self,
        phase: Phase,
        t: usize,
        segs: &[GpuSeg<'_>],
        cold: &mut dyn ColdLane,
    ) -> Result<(), GpuError> {
        for d in 0..self.shards.len() {
            if d > 0 {
                self.hop(d, t)?;
            }
            let sh = &mut self.shards[d];
            sh.run_layers(sh.layers(), phase, (t, segs), cold, &mut self.perf)?;
        }
        Ok(())
    }

    /// The first `rows` hidden rows of device `to - 1` copied into device `to`'s (through host
    /// memory: a synchronous read, which waits for the device's work, then a copy queued on the
    /// next device's stream), whose context is current after.
    pub(super) fn hop(&mut self, to: usize, rows: usize) -> Result<(), GpuError> {
        let n = rows * self.config().hidden;
        if self.hop_rows.len() < n {
            self.hop_rows.resize(n, 0.0);
        }
        let from = &self.shards[to - 1].dev;
        from.be.bind_to_thread()?;
        from.be.read(from.s().hidden.ptr().sub(0, n), &mut self.hop_rows[..n])?;
        let dest = &self.shards[to].dev;
        dest.be.bind_to_thread()?;
        dest.be.write(&self.hop_rows[..n], dest.s().hidden.ptr().sub(0, n))?;
        Ok(())
    }

    /// After the streams are idle: lane statistics, perf state, profile.
    pub(super) fn finish_call(
        &mut self,
        phase: Phase,
        t: usize,
        call_start: Instant,
        copy_start: Instant,
        copy_us: f64,
    ) -> Result<(), GpuError> {
        let mut layers = std::mem::take(&mut self.stats.layers);
        layers.clear();
        for d in 0..self.shards.len() {
            self.enter(d)?;
            self.shards[d].finish_lanes(phase, &mut layers, &mut self.perf)?;
        }
        let total_us = call_start.elapsed().as_secs_f64() * 1e6;
        let ping_pong = self.shards[0].ping_pong.is_some();
        if ping_pong {
            self.perf.mark_ping_pong();
        }
        self.stats =
            ForwardStats { n_tokens: t, ping_pong, prefill: phase != Phase::Decode, layers, total_us };
        if self.perf.mode() != PerfMode::Off {
            self.record_routing(t)?;
        }
        if let Some(p) = &mut self.shards[0].dev.profiler {
            let enqueue_us = (copy_start - call_start).as_secs_f64() * 1e6;
            p.collect(&CallTimes {
                decode: phase == Phase::Decode,
                n_tokens: t,
                copy_us,
                enqueue_us,
                total_us,
            })?;
        }
        Ok(())
    }

    /// Every layer's routed experts of the call into the perf state, hot by the map each ran
    /// with: the last device's ids came back with the greedy tokens (`HeadStage::copies`), the
    /// other devices' (when split) are read back here.
    fn record_routing(&mut self, t: usize) -> Result<(), GpuError> {
        let (n_layers, stride) = (self.config().n_layers, t * self.config().n_experts_used);
        let last = self.shards.len() - 1;
        for d in 0..=last {
            let sh = &self.shards[d];
            let range = sh.layers();
            let ids: &[i32] = if d == last {
                let cap = sh.dev.s().cap;
                let tail = &sh.head.pin_tail.as_slice()?[cap..];
                match sh.ping_pong {
                    Some(rows) => {
                        sh.merged_ids(rows, tail, &mut self.split_ids)?;
                        &self.split_ids
                    }
                    None => &tail[..n_layers * stride],
                }
            } else {
                self.split_ids.resize(n_layers * stride, 0);
                sh.dev.be.bind_to_thread()?;
                let src = sh.dev.s().ids().sub(range.start * stride, range.len() * stride);
                sh.dev.be.read(src, &mut self.split_ids[range.start * stride..range.end * stride])?;
                &self.split_ids
            };
            let (hot, experts) = (sh.moe.hot.resident(), &sh.dev.expert_layers);
            stats::record_call(&mut self.perf, &self.stats, (ids, stride, stride), hot, experts, range);
        }
        Ok(())
    }

    /// Turn on the per-stage GPU timing breakdown: CUDA event records at stage boundaries,
    /// read after each call's final copy (one device only).
    pub fn enable_profile(&mut self) -> Result<(), GpuError> {
        if self.shards.len() > 1 {
            return Err(GpuError::SplitProfile { devices: self.shards.len() });
        }
        let dev = &mut self.shards[0].dev;
        let (be, n_layers) = (&dev.be, dev.cfg.n_layers);
        let n_marks = stats::PROFILE_LAYER_STAGES.len() + 1;
        let layer_marks = (0..n_layers)
            .map(|_| (0..n_marks).map(|_| be.event()).collect::<Result<Vec<_>, _>>())
            .collect::<Result<Vec<_>, _>>()?;
        let tail_marks = (0..3).map(|_| be.event()).collect::<Result<Vec<_>, _>>()?;
        dev.profiler = Some(Profiler {
            layer_marks,
            tail_marks,
            decode: StageProfile::default(),
            prefill: StageProfile::default(),
        });
        Ok(())
    }

    /// The profile as text (decode and prefill), when profiling is on.
    pub fn profile_report(&self) -> Option<String> {
        let p = self.shards[0].dev.profiler.as_ref()?;
        Some(format!("{}{}", p.decode.report("decode"), p.prefill.report("prefill")))
    }

    /// Clear the accumulated profile.
    pub fn reset_profile(&mut self) {
        if let Some(p) = &mut self.shards[0].dev.profiler {
            p.decode = StageProfile::default();
            p.prefill = StageProfile::default();
        }
    }
}
