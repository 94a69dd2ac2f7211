//! Post-Fetch (seed 001, generalised) for prefill on the host path: each cold expert of a layer
//! is either computed on the CPU (the cold lane, as without it) or copied to a VRAM scratchpad
//! and computed on the GPU, chosen by a cost model ([`plan::assign`]: CPU time = bytes / CPU
//! read rate + tokens x CPU time per token; GPU = bytes / PCIe rate + a small GPU time; the CPU
//! lane and the copy lane run at once, so the busiest experts move while that lowers the later
//! lane's finish).
//!
//! Per layer, as soon as the routing is on the host (before the CPU lane starts): the chosen
//! experts are staged into pinned buffers and queued on the copy stream(s), one CUDA event per
//! expert (`CpuOnly -> CopyInFlight -> GpuReady`, [`plan::TransferTracker`]), bounded by the
//! slots of the scratchpad and by `max_transfers` copies in flight (the rest run on the CPU,
//! counted by reason, [`plan::plan_issue`]). When the CPU lane is done with its own experts,
//! the readiness query ([`plan::on_use`]) decides for each fetched expert whose copy is still in
//! flight: `block_on_miss` waits for it (its GEMMs were queued on the GPU at once, behind the
//! copies' events, and the host's wait is the exposed copy time), otherwise the CPU computes it
//! (counted as `not_ready`) and the GPU runs only the fetched experts whose copies are complete,
//! queued after that query.
//!
//! Decode ([`decode`], `PostFetchOptions::decode`): a split layer's one token splits its cold
//! experts the same way, the fetched ones run by the decode GEMVs over the scratchpad.
//!
//! The scratchpad has the hot cache's layout (gate/up `[slots, ff, hidden]`, down
//! `[slots, hidden, ff]`, in the file's block types: each matrix sized for the layer whose type
//! takes the most bytes, a layer's slots packed at its own size), nothing kept across layers:
//! each fetching layer writes it from slot 0, after the copy streams waited (on the GPU) for the
//! `free` event the compute stream recorded behind the GEMMs that read it last, and for the
//! previous layer's copies on every copy stream. One region, not two halves for alternate layers: a layer's routing reaches the
//! host only after the compute stream has run everything before it, the previous layer's
//! fetched GEMMs included, so a second half could never be written while the first is read; it
//! would only halve the experts a layer can fetch for the same VRAM. The fetched experts run
//! through the same grouped GEMM kernels as the hot lane (their own tiles, rows after the hot
//! entries); their rows join the layer output through the same weighted scatter.
//!
//! Copy source: the expert bytes live in the memory-mapped model file. When the driver takes
//! it (`PostFetchOptions::register`, the default), each map is registered read-only with the
//! device once at engine start (`cuMemHostRegister`: about 0.5 s for 12 GiB on the H100
//! machine) and the copies run as DMA straight from the file's pages: no host thread touches
//! the bytes, so nothing delays the CPU lane (the cost model's staging time is zero). One
//! registration per map, so experts of one stacked tensor sharing pages are no problem, and it
//! lives as long as the scratchpad (the map stays mapped for the engine's life anyway). Where
//! the driver refuses (no read-only registration, pages it cannot pin), the bytes are staged:
//! copied into pinned buffers (one per scratchpad slot, so staging a slot waits only for that
//! slot's previous copy, [`PinnedBuffer`]'s fence) by up to [`plan::MAX_STAGE_THREADS`] scoped
//! threads (the cold lane's, idle until the CPU lane starts), a chunk of experts at a time, each
//! chunk's copies queued as soon as it is staged; that host time is in the cost model
//! (`stage_bytes_per_s`).
//!
//! Files whose experts are stored as bf16 or in quantized blocks are fetched (the bytes are copied
//! as they are; quantized experts run through the typed grouped kernels, which decode their tiles);
//! f16/f32 files keep every cold expert on the CPU (no scratchpad is allocated), and so do models
//! whose experts carry biases (GPT-OSS): their biases are not in the file in the form the kernels
//! read (decoded to f32 at open, `Model::expert_bias`; a transformers checkpoint stores them bf16
//! and gate/up interleaved), so the copy-from-the-registered-file path cannot fetch them, and a
//! second, staged copy per expert would cost more than the ~0.3% of an MXFP4 expert's bytes they
//! are. (A follow-up: every expert's biases resident in VRAM, ~160 MB for GPT-OSS-120B, copied on
//! the device into the scratchpad's slots.) The fetched experts run with the model's activation.
//! The PCIe rate is measured once at engine start (one pinned copy of [`PCIE_PROBE_BYTES`]); the
//! CPU rates are configured ([`plan::DEFAULT_CPU_BYTES_PER_S`],
//! [`plan::DEFAULT_CPU_FLOP_PER_S_PER_THREAD`] x cold threads).

mod decode;
pub(crate) mod plan;

use super::device::Device;
use super::hot_cache::{expert_glu, RegisteredSource, SlotEpilogue, SlotShape};
use super::moe::MoeStage;
use super::GpuError;
use crate::cache::perf::PerfState;
use crate::format::dtype::DType;
use crate::model::Model;
use crate::moe::phase::Phase;
use moe_lanes_kernels::cuda::kernel::GROUPED_TILE_ROWS;
use moe_lanes_kernels::cuda::{
    CopyStream, CudaBackend, DeviceBuffer, GpuEvent, HostRegistration, PinnedBuffer,
};
use moe_lanes_kernels::cuda::{Glu, TypedWeights};
use plan::{assign, on_use, plan_issue, ExpertLoad, FetchState, OnUse, PostFetchCosts, PostFetchMiss};
use plan::{PostFetchMode, PostFetchOptions, PostFetchTotals, TransferTracker};
use std::time::Instant;

/// Bytes of the one timed pinned copy that measures the PCIe rate at engine start.
pub const PCIE_PROBE_BYTES: usize = 64 << 20;
/// `HostScratch::pf_fetch` of an expert the CPU lane computes.
pub(crate) const PF_CPU: i32 = -1;
/// `HostScratch::pf_fetch` of a fetched expert whose copy was late: the CPU computes it after
/// its own lane (`block_on_miss` off).
pub(crate) const PF_LATE: i32 = -2;

/// Events of the layer that last fetched into the scratchpad.
struct LayerEvents {
    copy_start: GpuEvent,
    /// Per copy stream, after the layer's last copy there.
    copy_end: Vec<GpuEvent>,
    /// Compute stream, around its wait for the copies.
    pre_wait: GpuEvent,
    post_wait: GpuEvent,
    /// Compute stream, after the GEMMs that read the scratchpad.
    free: GpuEvent,
    /// The layer's copies were queued; not yet folded into the totals.
    pending: Option<Pending>,
}

#[derive(Clone, Copy, Default)]
struct Pending {
    /// The fetched GEMMs were queued behind the copies (`pre_wait`/`post_wait` recorded).
    launched: bool,
    /// The host's wait for the copies once its CPU lane was done (none: the layer fell back
    /// before that).
    host_wait_us: Option<f64>,
}

/// The layer whose experts are being fetched.
#[derive(Clone, Copy)]
pub(crate) struct Current {
    /// `HostScratch::pf_loads[..issued]` were copied, `pf_loads[i]` into slot `i`.
    pub issued: usize,
    /// `block_on_miss` off: the fetched GEMMs wait for the readiness query.
    pub deferred: bool,
    /// The layer (its block types lay out the scratchpad).
    pub layer: usize,
}

/// The scratchpad, its staging, streams and events, and the running totals.
pub(crate) struct PostFetch {
    pub opts: PostFetchOptions,
    pub costs: PostFetchCosts,
    /// Expert slots of the scratchpad.
    pub slots: usize,
    /// The experts' gated activation (fetched experts carry no biases: `fetchable_experts`).
    glu: Glu,
    /// Per layer: the stored types and bytes of one expert's gate, up, down.
    layers: Vec<SlotShape>,
    /// Gate, up, down: `slots` experts each, at the largest layer's bytes.
    bufs: [DeviceBuffer<u8>; 3],
    /// Decode: the scratchpad slot of each of a token's routed entries (-1: the CPU's).
    decode_slots: DeviceBuffer<i32>,
    /// The model's maps registered with the device: copies read the file's pages directly.
    /// Empty when the driver refused (or `register` is off): then `staging` is used.
    registered: Vec<HostRegistration>,
    /// Why the maps are not registered although `register` is on (the driver's error).
    register_error: Option<String>,
    /// One pinned buffer per slot (none when `registered`).
    staging: Vec<PinnedBuffer<u8>>,
    streams: Vec<CopyStream>,
    /// The hot cache's exchanges copy on it from the registered maps (`exchange_source`).
    exchange_stream: CopyStream,
    /// Per slot, recorded after its copies.
    slot_ready: Vec<GpuEvent>,
    events: LayerEvents,
    tracker: TransferTracker,
    stage_threads: usize,
    pub totals: PostFetchTotals,
    pub current: Option<Current>,
    pub pcie_bytes_per_s: f64,
    /// Learn passes count routed slots in the cold lane: nothing is fetched meanwhile.
    paused: bool,
}

/// Each layer's expert shape, when every expert of `model` is stored as bf16 or quantized
/// blocks (bytes the device uses as they are) with the bytes its shape needs and carries no
/// biases (see the module docs).
fn fetchable_experts(model: &Model) -> Option<Vec<SlotShape>> {
    let c = model.config();
    if (0..c.n_layers).any(|l| model.expert_bias(l, 0).is_some()) {
        return None;
    }
    let raw = |t: &crate::format::tensor::TensorRef<'_>| {
        let kept = t.dtype == DType::BF16 || super::weights::stored_dtype(t.dtype).is_quantized();
        kept && t.dtype.bytes_for(t.n_elems()) == Some(t.data.len())
    };
    let expert_layers = model.plan().expert_layers();
    let every = (0..c.n_layers).filter(|&l| expert_layers[l]).all(|l| {
        (0..c.n_experts).all(|e| {
            let x = model.expert(l, e);
            [x.gate, x.up, x.down].iter().all(raw)
        })
    });
    every.then(|| (0..c.n_layers).map(|l| SlotShape::of(model, l)).collect())
}

impl PostFetch {
    /// The scratchpad for `model`, or none when Post-Fetch is off, has no VRAM, or the experts
    /// are f16/f32. Measures the PCIe rate.
    pub fn new(
        be: &CudaBackend,
        model: &Model,
        opts: PostFetchOptions,
    ) -> Result<Option<PostFetch>, GpuError> {
        let off = opts.mode == PostFetchMode::Off || opts.scratch_bytes == 0;
        if off {
            return Ok(None);
        }
        let Some(layers) = fetchable_experts(model) else { return Ok(None) };
        let c = model.config();
        let (h, ff) = (c.hidden, c.expert_ff);
        let bytes = [0, 1, 2].map(|i| layers.iter().map(|s| s.bytes[i]).max().unwrap_or(0));
        let expert = bytes.iter().sum::<usize>().max(1);
        let slots = (opts.scratch_bytes / expert).clamp(1, c.n_experts.max(1));
        let [g, u, d] = [0, 1, 2].map(|i| be.alloc_zeros::<u8>(slots * bytes[i]));
        let decode_slots = be.alloc_zeros::<i32>(c.n_experts_used.max(1))?;
        let n_streams = opts.streams.clamp(1, plan::MAX_STREAMS);
        // one stream more: the hot cache's exchanges (`exchange_source`), registered with the rest
        let mut streams = (0..=n_streams).map(|_| be.copy_stream()).collect::<Result<Vec<_>, _>>()?;
        let (registered, register_error) = match opts.register {
            true => register_maps(be, model, &streams).map_or_else(|e| (Vec::new(), Some(e)), |r| (r, None)),
            false => (Vec::new(), None),
        };
        let exchange_stream = streams.pop().expect("n_streams + 1 streams");
        let n_staged = if registered.is_empty() { slots } else { 0 };
        let staging = (0..n_staged).map(|_| be.alloc_pinned::<u8>(expert)).collect::<Result<_, _>>()?;
        let slot_ready = (0..slots).map(|_| be.event()).collect::<Result<_, _>>()?;
        let events = LayerEvents {
            copy_start: be.event()?,
            copy_end: (0..n_streams).map(|_| be.event()).collect::<Result<_, _>>()?,
            pre_wait: be.event()?,
            post_wait: be.event()?,
            free: be.event()?,
            pending: None,
        };
        let pcie = measure_pcie(be, &streams[0])?;
        let mut pf = PostFetch {
            opts,
            costs: PostFetchCosts::configured(h, ff, 1),
            slots,
            glu: expert_glu(model)?,
            layers,
            bufs: [g?, u?, d?],
            decode_slots,
            registered,
            register_error,
            staging,
            streams,
            exchange_stream,
            slot_ready,
            events,
            tracker: TransferTracker::new(slots, opts.max_transfers),
            stage_threads: plan::stage_threads(1),
            totals: PostFetchTotals::default(),
            current: None,
            pcie_bytes_per_s: pcie,
            paused: false,
        };
        pf.set_cold_threads(h, ff, 1);
        Ok(Some(pf))
    }

    /// The CPU costs and the staging threads for a cold lane of `n_threads` (the measured PCIe
    /// rate stays; no staging time when the copies read the registered maps).
    pub fn set_cold_threads(&mut self, hidden: usize, ff: usize, n_threads: usize) {
        let configured = PostFetchCosts::configured(hidden, ff, n_threads);
        let stage_bytes_per_s = if self.direct() { f64::INFINITY } else { configured.stage_bytes_per_s };
        self.costs =
            PostFetchCosts { pcie_bytes_per_s: self.pcie_bytes_per_s, stage_bytes_per_s, ..configured };
        self.stage_threads = plan::stage_threads(n_threads);
    }

    /// Slot `slot`'s copies (of an expert of `bytes`) are queued on its stream: its ready event,
    /// its transfer state, the totals.
    fn slot_queued(&mut self, be: &CudaBackend, slot: usize, bytes: [usize; 3]) -> Result<(), GpuError> {
        be.record_on(&self.streams[slot % self.streams.len()], &self.slot_ready[slot])?;
        self.tracker.start(slot)?;
        self.totals.experts_fetched += 1;
        self.totals.bytes_copied += bytes.iter().sum::<usize>() as u64;
        Ok(())
    }

    /// Shrink the scratchpad to `slots` experts ([`plan::fitted_slots`] of the allocated hot
    /// cache): slots beyond a layer's cold experts are VRAM for nothing. With half the experts
    /// cached this keeps the default 1 GiB scratchpad under seed 001's 10% of the hot cache
    /// (BF16 Qwen3-30B-A3B: 64 cold experts a layer, 576 MiB, against a 9 GiB hot cache).
    /// Between calls only.
    pub fn fit_slots(&mut self, be: &CudaBackend, slots: usize) -> Result<(), GpuError> {
        assert!(slots >= 1, "at least one slot");
        if slots >= self.slots {
            return Ok(());
        }
        for cs in &self.streams {
            cs.synchronize()?; // no copy still writes the old buffers
        }
        let per_slot = [0, 1, 2].map(|i| self.bufs[i].bytes() / self.slots);
        let [g, u, d] = per_slot.map(|n| be.alloc_zeros::<u8>(slots * n));
        self.bufs = [g?, u?, d?];
        self.staging.truncate(slots);
        self.slot_ready.truncate(slots);
        self.tracker = TransferTracker::new(slots, self.opts.max_transfers);
        self.slots = slots;
        Ok(())
    }

    /// Copies read the model's registered maps (no staging).
    pub fn direct(&self) -> bool {
        !self.registered.is_empty()
    }

    /// Where the hot cache's exchanges copy from without staging: the registered maps and the
    /// stream registered for them (none when the maps are not registered).
    pub fn exchange_source(&self) -> Option<RegisteredSource<'_>> {
        let maps = self.registered.as_slice();
        (!maps.is_empty()).then_some(RegisteredSource { stream: &self.exchange_stream, maps })
    }

    /// The registered map holding `bytes` and where in it.
    fn source_of(&self, bytes: &[u8]) -> Option<(&HostRegistration, std::ops::Range<usize>)> {
        self.registered.iter().find_map(|r| r.range_of(bytes).map(|at| (r, at)))
    }

    /// Bytes of one expert of layer `l`.
    pub fn expert_bytes(&self, l: usize) -> usize {
        self.layers[l].bytes.iter().sum()
    }

    /// VRAM of the scratchpad.
    pub fn scratch_bytes(&self) -> usize {
        self.bufs.iter().map(DeviceBuffer::bytes).sum()
    }

    /// Gate, up and down of layer `l` (`slots` experts each, in the layer's types).
    fn views(&self, l: usize) -> [TypedWeights; 3] {
        let s = self.layers[l];
        [0, 1, 2].map(|i| TypedWeights { bytes: self.bufs[i].ptr(), dtype: s.dtypes[i] })
    }

    /// What the kernels apply around the fetched experts' products: the activation alone.
    fn epilogue(&self) -> SlotEpilogue {
        SlotEpilogue::plain(self.glu)
    }

    /// Layer `l` chose its first `n_chosen` loads for the GPU: the issue plan against the free
    /// slots and transfers, the totals, and when any is issued the previous fetching layer folded
    /// in ([`PostFetch::harvest`]), the slots released and the layer made current (`pending`
    /// its events' state). Returns how many are issued (the first ones).
    fn start_layer(
        &mut self,
        l: usize,
        n_chosen: usize,
        deferred: bool,
        pending: Pending,
    ) -> Result<usize, GpuError> {
        let plan = plan_issue(n_chosen, self.slots, self.tracker.room());
        self.totals.layer_calls += 1;
        self.totals.experts_chosen += n_chosen as u64;
        self.totals.add_fallbacks(PostFetchMiss::ScratchFull, plan.scratch_full);
        self.totals.add_fallbacks(PostFetchMiss::TransfersBound, plan.transfers_bound);
        if plan.issue > 0 {
            self.harvest()?;
            self.tracker.release(0..self.slots);
            self.current = Some(Current { issued: plan.issue, deferred, layer: l });
            self.events.pending = Some(pending);
        }
        Ok(plan.issue)
    }

    /// Fold the last fetching layer into the totals: copy time, and the part of it not hidden
    /// (the host's wait after its CPU lane, capped by the compute stream's stall when the
    /// fetched GEMMs were queued behind the copies). A layer that fell back before its
    /// readiness query is left out.
    fn harvest(&mut self) -> Result<(), GpuError> {
        let hf = &mut self.events;
        let Some(p) = hf.pending.take() else { return Ok(()) };
        let Some(host_wait_us) = p.host_wait_us else { return Ok(()) };
        let mut copy_us = 0f64;
        for end in &hf.copy_end {
            end.synchronize()?;
            copy_us = copy_us.max(hf.copy_start.elapsed_ms(end)? as f64 * 1e3);
        }
        let mut exposed_us = host_wait_us.min(copy_us);
        if p.launched {
            hf.post_wait.synchronize()?;
            exposed_us = exposed_us.min(hf.pre_wait.elapsed_ms(&hf.post_wait)? as f64 * 1e3);
        }
        self.totals.copy_us += copy_us;
        self.totals.exposed_us += exposed_us.max(0.0);
        Ok(())
    }
}

impl Drop for PostFetch {
    /// The scratchpad and the staging buffers go only after every copy into them is done (a
    /// layer that fell back may leave copies in flight).
    fn drop(&mut self) {
        for cs in &self.streams {
            let _ = cs.synchronize();
        }
    }
}

/// Every map of `model` registered with the device for copies on `streams`, or why not (the driver's refusal of one, or
/// an expert whose bytes lie outside them): the copies are staged then, and the perf JSON says
/// why. Checked here once, so a copy always finds its registered source.
fn register_maps(
    be: &CudaBackend,
    model: &Model,
    streams: &[CopyStream],
) -> Result<Vec<HostRegistration>, String> {
    let register = |m| be.register_mapping(m, streams).map_err(|e| e.to_string());
    let maps = model.mappings().into_iter().map(register);
    let registered = maps.collect::<Result<Vec<_>, _>>()?;
    let c = model.config();
    let inside = |b: &[u8]| registered.iter().any(|r| r.range_of(b).is_some());
    let expert_layers = model.plan().expert_layers();
    let covered = (0..c.n_layers).filter(|&l| expert_layers[l]).all(|l| {
        (0..c.n_experts).all(|e| {
            let x = model.expert(l, e);
            [x.gate.data, x.up.data, x.down.data].iter().all(|b| inside(b))
        })
    });
    if !covered {
        return Err("expert bytes outside the model's maps".to_string());
    }
    Ok(registered)
}

/// Time one pinned host-to-device copy of [`PCIE_PROBE_BYTES`] on `cs` (after a small warm-up
/// copy); bytes per second.
fn measure_pcie(be: &CudaBackend, cs: &CopyStream) -> Result<f64, GpuError> {
    let host = be.alloc_pinned::<u8>(PCIE_PROBE_BYTES)?;
    let dev = be.alloc_zeros::<u8>(PCIE_PROBE_BYTES)?;
    let (start, end) = (be.event()?, be.event()?);
    be.write_async_on(cs, &host, 0..1 << 20, dev.ptr())?;
    be.record_on(cs, &start)?;
    be.write_async_on(cs, &host, 0..PCIE_PROBE_BYTES, dev.ptr())?;
    be.record_on(cs, &end)?;
    end.synchronize()?;
    let s = start.elapsed_ms(&end)? as f64 * 1e-3;
    Ok(if s > 0.0 { PCIE_PROBE_BYTES as f64 / s } else { plan::DEFAULT_PCIE_BYTES_PER_S })
}

/// Copy every `(src, dst)` pair (equal lengths), the pairs dealt round-robin over up to
/// `threads` scoped threads (one thread copies at ~10 GB/s, below PCIe).
pub(crate) fn stage_parallel(jobs: Vec<(&[u8], &mut [u8])>, threads: usize) {
    let threads = threads.clamp(1, jobs.len().max(1));
    if threads == 1 {
        jobs.into_iter().for_each(|(s, d)| d.copy_from_slice(s));
        return;
    }
    let mut per: Vec<Vec<(&[u8], &mut [u8])>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, job) in jobs.into_iter().enumerate() {
        per[i % threads].push(job);
    }
    std::thread::scope(|scope| {
        for mine in per {
            scope.spawn(move || mine.into_iter().for_each(|(s, d)| d.copy_from_slice(s)));
        }
    });
}

/// Stage `experts` of layer `l` into the pinned buffers `staging` (one each, in order): gate,
/// up, down back to back. Each buffer's accessor waits for its previous copy first.
fn stage(
    model: &Model,
    staging: &mut [PinnedBuffer<u8>],
    bytes: [usize; 3],
    l: usize,
    experts: &[ExpertLoad],
    threads: usize,
) -> Result<(), GpuError> {
    let bufs = staging.iter_mut().map(|b| b.as_mut_slice()).collect::<Result<Vec<_>, _>>()?;
    stage_parallel(stage_jobs(model, bufs, bytes, l, experts), threads);
    Ok(())
}

/// The copies that stage `experts` of layer `l` into `bufs` (one each, in order): gate, up,
/// down back to back from each buffer's start. A buffer holds the largest layer's expert, so
/// this layer's may fill only its front.
fn stage_jobs<'a>(
    model: &'a Model,
    bufs: Vec<&'a mut [u8]>,
    bytes: [usize; 3],
    l: usize,
    experts: &[ExpertLoad],
) -> Vec<(&'a [u8], &'a mut [u8])> {
    let mut jobs = Vec::with_capacity(3 * experts.len());
    for (buf, x) in bufs.into_iter().zip(experts) {
        let w = model.expert(l, x.expert as usize);
        let (gate, rest) = buf.split_at_mut(bytes[0]);
        let (up, rest) = rest.split_at_mut(bytes[1]);
        jobs.extend([(w.gate.data, gate), (w.up.data, up), (w.down.data, &mut rest[..bytes[2]])]);
    }
    jobs
}

impl MoeStage {
    /// Forget the previous layer's fetch (before each MoE block).
    pub(crate) fn postfetch_reset(&mut self) {
        let hs = &mut self.host;
        hs.pf_fetch.fill(PF_CPU);
        hs.pf_slot.clear();
        hs.pf_token.clear();
        hs.pf_weight.clear();
        if let Some(pf) = self.postfetch.as_mut() {
            pf.current = None;
        }
    }

    /// Learn passes count routed slots in the cold lane: fetch nothing while `paused`.
    pub fn pause_postfetch(&mut self, paused: bool) {
        if let Some(pf) = self.postfetch.as_mut() {
            pf.paused = paused;
        }
    }

    /// Prefill, host path, worklist built: choose layer `l`'s experts for the GPU and queue
    /// their copies (`HostScratch::pf_fetch`: the cold lane skips them). With `block_on_miss`
    /// their worklist entries are listed at once (`pf_*`), else after the readiness query.
    pub(crate) fn postfetch_issue(&mut self, l: usize, phase: Phase) -> Result<(), GpuError> {
        let Some(pf) = self.postfetch.as_mut().filter(|p| !p.paused) else { return Ok(()) };
        if phase != Phase::Prefill {
            return Ok(());
        }
        let hs = &mut self.host;
        let wl = &hs.worklist;
        hs.pf_count.fill(0);
        for &e in &wl.cold_id[..wl.cold_count] {
            hs.pf_count[e as usize] += 1;
        }
        hs.pf_loads.clear();
        let counts = hs.pf_count.iter().enumerate().filter(|(_, &n)| n > 0);
        hs.pf_loads.extend(counts.map(|(e, &n)| ExpertLoad { expert: e as u32, tokens: n }));
        let slot_ready = &pf.slot_ready;
        pf.tracker.poll(|s| slot_ready[s].is_done());
        let limit = pf.slots.min(pf.tracker.room());
        // expert-major: the cached experts this layer runs are the runs of equal slots
        let hot = &wl.hot[0].hot_id[..wl.hot[0].hot_count];
        let hot_experts = hot.iter().enumerate().filter(|&(i, s)| i == 0 || hot[i - 1] != *s).count();
        let n_chosen =
            assign(&mut hs.pf_loads, pf.expert_bytes(l), &pf.costs, pf.opts.mode, (limit, hot_experts));
        let deferred = !pf.opts.block_on_miss;
        let issued = pf.start_layer(l, n_chosen, deferred, Pending::default())?;
        for (i, x) in self.host.pf_loads[..issued].iter().enumerate() {
            self.host.pf_fetch[x.expert as usize] = i as i32;
        }
        if issued > 0 && !deferred {
            self.postfetch_entries();
        }
        self.postfetch_debug(l, n_chosen, issued)
    }

    /// Queue the copies [`MoeStage::postfetch_issue`] chose, once the layer's worklist is on
    /// the compute stream: a host-to-device copy queued after them (the worklist upload) could
    /// wait behind them for the copy engine, delaying the hot lane by the whole fetch.
    pub(crate) fn postfetch_start_copies(&mut self, dev: &Device) -> Result<(), GpuError> {
        match self.postfetch.as_ref().and_then(|p| p.current) {
            Some(cur) => self.postfetch_copies(dev, cur.layer, cur.issued),
            None => Ok(()),
        }
    }

    /// Queue the copies of the first `n` of `pf_loads`, slot `i` for the `i`-th.
    fn postfetch_copies(&mut self, dev: &Device, l: usize, n: usize) -> Result<(), GpuError> {
        let pf = self.postfetch.as_mut().expect("called with post-fetch");
        let ev = &pf.events;
        // The scratchpad is read by the previous fetching layer's GEMMs (`free`) and may still
        // be written by that layer's copies on any stream (late ones, or a layer that fell back).
        for cs in &pf.streams {
            dev.be.wait_event_on(cs, &ev.free)?;
            for end in &ev.copy_end {
                dev.be.wait_event_on(cs, end)?;
            }
        }
        if pf.direct() {
            self.copies_direct(dev, l, n)?;
        } else {
            self.copies_staged(dev, l, n)?;
        }
        let pf = self.postfetch.as_mut().expect("called with post-fetch");
        for (cs, end) in pf.streams.iter().zip(&pf.events.copy_end) {
            dev.be.record_on(cs, end)?;
        }
        Ok(())
    }

    /// Slot `i`'s copies of the `i`-th of the first `n` of `pf_loads`, straight from the
    /// registered maps.
    fn copies_direct(&mut self, dev: &Device, l: usize, n: usize) -> Result<(), GpuError> {
        let pf = self.postfetch.as_mut().expect("called with post-fetch");
        let bytes = pf.layers[l].bytes;
        dev.be.record_on(&pf.streams[0], &pf.events.copy_start)?;
        for (slot, x) in self.host.pf_loads[..n].iter().enumerate() {
            let cs = &pf.streams[slot % pf.streams.len()];
            let w = dev.model.expert(l, x.expert as usize);
            for ((buf, len), src) in pf.bufs.iter().zip(bytes).zip([w.gate.data, w.up.data, w.down.data]) {
                let (reg, at) = pf.source_of(src).expect("register_maps checked every expert");
                assert_eq!(at.len(), len, "layer {l}: the scratchpad's shape is the expert's");
                dev.be.write_registered_on(cs, reg, at, buf.ptr().sub(slot * len, len))?;
            }
            pf.slot_queued(&dev.be, slot, bytes)?;
        }
        Ok(())
    }

    /// As [`MoeStage::copies_direct`], staged through the pinned buffers a chunk of experts at a
    /// time (the copies of one chunk overlap the staging of the next).
    fn copies_staged(&mut self, dev: &Device, l: usize, n: usize) -> Result<(), GpuError> {
        let pf = self.postfetch.as_mut().expect("called with post-fetch");
        let chunk = pf.stage_threads;
        let bytes = pf.layers[l].bytes;
        for (c, group) in self.host.pf_loads[..n].chunks(chunk).enumerate() {
            let at = c * chunk;
            stage(&dev.model, &mut pf.staging[at..at + group.len()], bytes, l, group, pf.stage_threads)?;
            if c == 0 {
                dev.be.record_on(&pf.streams[0], &pf.events.copy_start)?;
            }
            for slot in at..at + group.len() {
                let cs = &pf.streams[slot % pf.streams.len()];
                let mut from = 0;
                for (buf, n) in pf.bufs.iter().zip(bytes) {
                    dev.be.write_async_on(
                        cs,
                        &pf.staging[slot],
                        from..from + n,
                        buf.ptr().sub(slot * n, n),
                    )?;
                    from += n;
                }
                pf.slot_queued(&dev.be, slot, bytes)?;
            }
        }
        Ok(())
    }

    /// The worklist entries of the experts the GPU computes from the scratchpad (`pf_fetch` a
    /// slot), in worklist order: slot, token, weight.
    pub(crate) fn postfetch_entries(&mut self) {
        let hs = &mut self.host;
        let wl = &hs.worklist;
        for i in 0..wl.cold_count {
            let slot = hs.pf_fetch[wl.cold_id[i] as usize];
            if slot >= 0 {
                hs.pf_slot.push(slot as u32);
                hs.pf_token.push(wl.cold_token_id[i]);
                hs.pf_weight.push(wl.cold_weight[i]);
            }
        }
    }

    fn postfetch_debug(&self, l: usize, n_chosen: usize, issued: usize) -> Result<(), GpuError> {
        let Some(pf) = self.postfetch.as_ref().filter(|p| p.opts.debug) else { return Ok(()) };
        let hs = &self.host;
        eprintln!(
            "postfetch layer {l}: {} cold experts ({} cold slots), chose {n_chosen} for the GPU, fetched {issued}, \
             {} copies in flight, fallbacks so far {:?} (scratch_full, transfers_bound, not_ready)",
            hs.pf_loads.len(),
            hs.worklist.cold_count,
            pf.tracker.in_flight(),
            pf.totals.fallbacks,
        );
        Ok(())
    }

    /// The fetched experts' GEMMs over their entries (`n_all` entry rows in all, the fetched
    /// ones after the hot ones), once the compute stream has waited for their copies: every
    /// copy of the layer (`block_on_miss`), or those of the experts it runs (after the
    /// readiness query). `free` is recorded behind them even when a launch fails.
    pub(crate) fn postfetch_gemm(&self, dev: &Device, t: usize, n_all: usize) -> Result<(), GpuError> {
        let Some((pf, cur)) = self.postfetch.as_ref().and_then(|p| p.current.map(|c| (p, c))) else {
            return Ok(());
        };
        let hf = &pf.events;
        dev.be.record(&hf.pre_wait)?;
        if cur.deferred {
            for (i, x) in self.host.pf_loads[..cur.issued].iter().enumerate() {
                if self.host.pf_fetch[x.expert as usize] >= 0 {
                    dev.be.wait_event(&pf.slot_ready[i])?;
                }
            }
        } else {
            for end in &hf.copy_end {
                dev.be.wait_event(end)?;
            }
        }
        dev.be.record(&hf.post_wait)?;
        let gemms = || -> Result<(), GpuError> {
            let s = dev.s();
            let (nt, at) = (self.host.pf_tiles, s.layout.tiles + self.host.pf_tile_at);
            let tiles = s.work_i.ptr().sub(at, 3 * nt);
            let tiles = (tiles, nt, GROUPED_TILE_ROWS);
            super::moe::grouped_ffn(dev, pf.views(cur.layer), &pf.epilogue(), pf.slots, tiles, n_all, t)
        };
        let launched = gemms();
        dev.be.record(&hf.free)?;
        launched
    }

    /// The layer's fetched GEMMs were queued.
    pub(crate) fn postfetch_launched(&mut self) {
        if let Some(pf) = self.postfetch.as_mut() {
            if let Some(p) = pf.current.and(pf.events.pending.as_mut()) {
                p.launched = true;
            }
        }
    }

    /// The readiness query, once the CPU lane is done with its own experts: for each fetched
    /// expert, [`on_use`] of its copy's state (`late`: a fault injection that finds every copy
    /// still in flight). `block_on_miss`: wait on the host for the copies in flight (counted;
    /// the exposed copy time). Otherwise the late ones become [`PF_LATE`] (counted `not_ready`)
    /// and the rest keep their slots. Returns whether the caller runs the deferred part: the
    /// late experts on the CPU, then the fetched GEMMs.
    pub(crate) fn postfetch_ready(&mut self, late: bool) -> Result<bool, GpuError> {
        let Some(pf) = self.postfetch.as_mut() else { return Ok(false) };
        let Some(cur) = pf.current else { return Ok(false) };
        let slot_ready = &pf.slot_ready;
        pf.tracker.poll(|s| slot_ready[s].is_done());
        let (mut n_wait, mut n_late) = (0, 0);
        for (i, x) in self.host.pf_loads[..cur.issued].iter().enumerate() {
            let state = if late { FetchState::CopyInFlight } else { pf.tracker.state(i) };
            match on_use(state, pf.opts.block_on_miss) {
                OnUse::Gpu => {}
                OnUse::Wait => n_wait += 1,
                OnUse::Cpu => {
                    self.host.pf_fetch[x.expert as usize] = PF_LATE;
                    n_late += 1;
                }
            }
        }
        let mut host_wait_us = 0.0;
        if n_wait > 0 {
            let wait = Instant::now();
            for end in &pf.events.copy_end {
                end.synchronize()?;
            }
            host_wait_us = wait.elapsed().as_secs_f64() * 1e6;
            pf.tracker.poll(|s| slot_ready[s].is_done());
            pf.totals.block_waits += n_wait;
            pf.totals.block_wait_us += host_wait_us;
        }
        pf.totals.add_fallbacks(PostFetchMiss::NotReady, n_late);
        if let Some(p) = pf.events.pending.as_mut() {
            p.host_wait_us = Some(host_wait_us);
        }
        Ok(cur.deferred)
    }

    /// After a call: fold the pending layers into the totals and the perf JSON.
    pub(crate) fn postfetch_finish(&mut self, perf: &mut PerfState) -> Result<(), GpuError> {
        let hot_bytes = self.hot.bytes();
        let Some(pf) = self.postfetch.as_mut() else { return Ok(()) };
        pf.harvest()?;
        let mut report = pf.totals.perf(pf.opts.mode, pf.scratch_bytes(), hot_bytes, pf.pcie_bytes_per_s);
        report.copy_source = (if pf.direct() { "registered" } else { "staged" }).to_string();
        report.register_error = pf.register_error.clone();
        perf.set_postfetch(report);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_copies_every_pair_on_any_thread_count() {
        let src: Vec<Vec<u8>> = (0..7u8).map(|i| vec![i; 1000 + i as usize]).collect();
        for threads in [1, 3, 16] {
            let mut dst: Vec<Vec<u8>> = src.iter().map(|s| vec![0xff; s.len()]).collect();
            let jobs =
                src.iter().map(|s| s.as_slice()).zip(dst.iter_mut().map(|d| d.as_mut_slice())).collect();
            stage_parallel(jobs, threads);
            assert_eq!(dst, src, "{threads} threads");
        }
        stage_parallel(Vec::new(), 4);
    }

    fn tiny(dir: &std::path::Path, dtype: DType, mix: Option<crate::quantize::QuantMix>) -> Model {
        use crate::synth::{
            tiny_test_options, write_synthetic, write_synthetic_quantized, DimOverrides, Skew,
        };
        let dims = DimOverrides {
            hidden: Some(256),
            head_dim: Some(64),
            expert_ff: Some(256),
            ..Default::default()
        };
        let opts =
            tiny_test_options(dir.join(format!("{dtype:?}-{mix:?}.gguf")), dims, dtype, 5, Skew::Skewed);
        match mix {
            Some(m) => write_synthetic_quantized(&opts, m, &mut |_, _| {}).map(|_| ()),
            None => write_synthetic(&opts, &mut |_, _| {}).map(|_| ()),
        }
        .unwrap();
        Model::open(&opts.out).unwrap()
    }

    /// Experts with biases (GPT-OSS's), which the registered file does not hold in the kernels'
    /// form: none is fetched (every cold expert stays on the CPU lane), though their MXFP4
    /// weights alone would be.
    #[test]
    fn experts_with_biases_are_not_fetched() {
        use crate::synth::{tiny_biased_experts_options, write_synthetic_quantized, DimOverrides};
        let dir = tempfile::tempdir().unwrap();
        let dims = DimOverrides {
            hidden: Some(256),
            head_dim: Some(64),
            expert_ff: Some(256),
            ..Default::default()
        };
        let opts = tiny_biased_experts_options(dir.path().join("biased.gguf"), dims, DType::BF16);
        write_synthetic_quantized(&opts, crate::quantize::QuantMix::MXFP4_MOE, &mut |_, _| {}).unwrap();
        let m = Model::open(&opts.out).unwrap();
        assert!(m.expert_bias(0, 0).is_some(), "GPT-OSS's experts carry biases");
        let x = m.expert(0, 0);
        assert!([x.gate.dtype, x.up.dtype, x.down.dtype].iter().all(|&d| d == DType::MXFP4));
        assert!(fetchable_experts(&m).is_none(), "biased experts stay on the CPU lane");
    }

    /// Staging a mixed file: buffers sized for the largest layer's expert take every layer's
    /// expert at its front, gate, up, down back to back, byte for byte.
    #[test]
    fn staging_a_smaller_layer_fills_the_front_of_the_largest_layers_buffer() {
        let dir = tempfile::tempdir().unwrap();
        let q = tiny(dir.path(), DType::BF16, Some(crate::quantize::QuantMix::Q4_K_M));
        let shapes = fetchable_experts(&q).unwrap();
        let largest = shapes.iter().map(|s| s.bytes.iter().sum::<usize>()).max().unwrap();
        assert!(shapes.iter().any(|s| s.bytes.iter().sum::<usize>() < largest), "a mixed file");
        let experts = [ExpertLoad { expert: 3, tokens: 1 }, ExpertLoad { expert: 0, tokens: 1 }];
        for (l, shape) in shapes.iter().enumerate() {
            let mut bufs = vec![vec![0xAAu8; largest]; experts.len()];
            let slices = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
            stage_parallel(stage_jobs(&q, slices, shape.bytes, l, &experts), 2);
            for (buf, x) in bufs.iter().zip(&experts) {
                let w = q.expert(l, x.expert as usize);
                let want = [w.gate.data, w.up.data, w.down.data].concat();
                assert_eq!(&buf[..want.len()], &want[..], "layer {l} expert {}", x.expert);
                assert!(buf[want.len()..].iter().all(|&b| b == 0xAA), "layer {l}: nothing past the expert");
            }
        }
    }

    /// An `mxfp4_moe` file's experts are fetched in MXFP4 at their file size (17 bytes a 32
    /// values) and staged byte for byte: what the hot cache and the scratchpad hold.
    #[test]
    fn mxfp4_experts_are_fetched_and_staged_at_their_file_size() {
        use moe_lanes_kernels::WeightDType;
        let dir = tempfile::tempdir().unwrap();
        let q = tiny(dir.path(), DType::BF16, Some(crate::quantize::QuantMix::MXFP4_MOE));
        let shapes = fetchable_experts(&q).expect("MXFP4 experts are fetched");
        let file_bytes = 3 * 256 * 256 / 32 * 17;
        for (l, shape) in shapes.iter().enumerate() {
            assert_eq!(shape.dtypes, [WeightDType::Mxfp4; 3], "layer {l}");
            assert_eq!(shape.bytes.iter().sum::<usize>(), file_bytes, "layer {l}");
            let experts = [ExpertLoad { expert: 2, tokens: 1 }];
            let mut buf = vec![0u8; file_bytes];
            stage_parallel(stage_jobs(&q, vec![buf.as_mut_slice()], shape.bytes, l, &experts), 2);
            let w = q.expert(l, 2);
            assert_eq!(buf, [w.gate.data, w.up.data, w.down.data].concat(), "layer {l}");
        }
    }

    /// `q5_0`, `q5_1` and `iq4_nl` files' experts are fetched in their block type at file size
    /// (22, 24 and 18 bytes a 32 values) and staged byte for byte.
    #[test]
    fn q5_and_iq4_nl_experts_are_fetched_and_staged_at_their_file_size() {
        use crate::quantize::QuantMix;
        use moe_lanes_kernels::WeightDType;
        let dir = tempfile::tempdir().unwrap();
        for (mix, dtype) in [
            (QuantMix::Q5_0, WeightDType::Q5_0),
            (QuantMix::Q5_1, WeightDType::Q5_1),
            (QuantMix::IQ4_NL, WeightDType::Iq4Nl),
        ] {
            let q = tiny(dir.path(), DType::BF16, Some(mix));
            let shapes = fetchable_experts(&q).expect("quantized experts are fetched");
            let file_bytes = 3 * 256 * 256 / 32 * dtype.block_bytes();
            for (l, shape) in shapes.iter().enumerate() {
                assert_eq!(shape.dtypes, [dtype; 3], "{mix} layer {l}");
                assert_eq!(shape.bytes.iter().sum::<usize>(), file_bytes, "{mix} layer {l}");
                let experts = [ExpertLoad { expert: 1, tokens: 1 }];
                let mut buf = vec![0u8; file_bytes];
                stage_parallel(stage_jobs(&q, vec![buf.as_mut_slice()], shape.bytes, l, &experts), 2);
                let w = q.expert(l, 1);
                assert_eq!(buf, [w.gate.data, w.up.data, w.down.data].concat(), "{mix} layer {l}");
            }
        }
    }

    /// The scratchpad's per-layer shapes: a Q4_K_M file's layers in their own block types and
    /// bytes (Q6_K down projections in some), bf16 as it is, and no Post-Fetch for f32 experts
    /// (their bytes are not what the device stores).
    #[test]
    fn fetchable_experts_keep_each_layers_types_and_bytes() {
        use crate::quantize::QuantMix;
        use moe_lanes_kernels::WeightDType;
        let dir = tempfile::tempdir().unwrap();
        let q = tiny(dir.path(), DType::BF16, Some(QuantMix::Q4_K_M));
        let shapes = fetchable_experts(&q).expect("quantized experts are fetched");
        let bytes: Vec<u64> = shapes.iter().map(|s| s.bytes.iter().sum::<usize>() as u64).collect();
        assert_eq!(bytes, q.layer_expert_bytes());
        assert!(shapes.iter().all(|s| s.dtypes[0] == WeightDType::Q4_K && s.dtypes[1] == WeightDType::Q4_K));
        let downs: Vec<WeightDType> = shapes.iter().map(|s| s.dtypes[2]).collect();
        assert!(downs.contains(&WeightDType::Q6_K) && downs.contains(&WeightDType::Q4_K), "{downs:?}");
        let bf = tiny(dir.path(), DType::BF16, None);
        let shapes = fetchable_experts(&bf).expect("bf16 experts are fetched");
        assert!(shapes.iter().all(|s| s.dtypes == [WeightDType::BF16; 3]));
        assert_eq!(
            shapes.iter().map(|s| s.bytes.iter().sum::<usize>() as u64).collect::<Vec<_>>(),
            bf.layer_expert_bytes()
        );
        assert!(fetchable_experts(&tiny(dir.path(), DType::F32, None)).is_none());
    }
}
