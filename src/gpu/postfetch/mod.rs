//! Post-Fetch (seed 001, generalised) for prefill on the host path: each cold expert of a layer
//! is either computed on the CPU (the cold lane, as without it) or copied to a VRAM scratchpad
//! and computed on the GPU, chosen by a cost model ([`plan::assign`]: CPU time = bytes / CPU
//! read rate + tokens x CPU time per token; GPU = bytes / PCIe rate + a small GPU time; the CPU
//! lane and the copy lane run at once, so the busiest experts move while that lowers the later
//! lane's finish). Decode is untouched.
//!
//! Per layer, as soon as the routing is on the host (before the CPU lane starts): the chosen
//! experts are staged into pinned buffers and queued on the copy stream(s), one CUDA event per
//! expert (`CpuOnly -> CopyInFlight -> GpuReady`, [`plan::TransferTracker`]), bounded by
//! `max_transfers` in flight (`block_on_miss`: wait for the oldest, else the rest run on the
//! CPU) and by the slots of the scratchpad half (the rest run on the CPU); misses are counted by
//! reason. The scratchpad has the hot cache's layout (gate/up `[slots, ff, hidden]`, down
//! `[slots, hidden, ff]`, bf16) in two halves used by alternate layers: a half is overwritten
//! only after the compute stream recorded `free` behind the GEMMs that read it. The compute
//! stream waits for the layer's copies (events) and runs the fetched experts through the same
//! grouped GEMM kernels as the hot lane (their own tiles, a second launch); their rows join the
//! hot entries in the one weighted scatter into the layer output.
//!
//! Staging: the expert bytes live in the memory-mapped model file. They are copied into pinned
//! buffers (one per scratchpad slot, so staging a slot waits only for that slot's previous copy)
//! by [`STAGE_THREADS`] scoped threads, then copied asynchronously. Registering the mapped pages
//! with `cuMemHostRegister` (read-only) would skip that host copy, but the format layer does not
//! expose the mapping, experts of one stacked tensor share pages (overlapping registrations are
//! refused), it pins the whole file for the engine's life, and it cannot be tested without a
//! GPU here: staging is sound with safe code, and its host time is in the cost model
//! (`stage_bytes_per_s`).
//!
//! Only files whose experts are stored as bf16 are fetched (the bytes are copied as they are);
//! quantized and f16/f32 files keep every cold expert on the CPU (no scratchpad is allocated).
//! The PCIe rate is measured once at engine start (one pinned copy of [`PCIE_PROBE_BYTES`]); the
//! CPU rates are configured ([`plan::DEFAULT_CPU_BYTES_PER_S`],
//! [`plan::DEFAULT_CPU_FLOP_PER_S_PER_THREAD`] x cold threads).

pub(crate) mod plan;

use super::model::{GpuModel, HotGemm};
use super::GpuError;
use crate::format::dtype::DType;
use crate::model::Model;
use crate::moe::phase::Phase;
use moe_lanes_kernels::cuda::{CopyStream, CudaBackend, DPtr, DeviceBuffer, GpuEvent, PinnedBuffer};
use plan::{assign, issue_step, ExpertLoad, IssueStep, PostFetchCosts, PostFetchOptions, PostFetchTotals};
use plan::{PostFetchMode, TransferTracker};
use std::time::Instant;

/// Threads that stage expert bytes from the mapped file into pinned memory.
pub const STAGE_THREADS: usize = 4;
/// Bytes of the one timed pinned copy that measures the PCIe rate at engine start.
pub const PCIE_PROBE_BYTES: usize = 64 << 20;
/// Copy streams at most.
const MAX_STREAMS: usize = 4;

/// Events of one scratchpad half for the layer that last used it.
struct Half {
    copy_start: GpuEvent,
    /// Per copy stream, after the layer's last copy there.
    copy_end: Vec<GpuEvent>,
    /// Compute stream, around its wait for the copies.
    pre_wait: GpuEvent,
    post_wait: GpuEvent,
    /// Compute stream, after the GEMMs that read the half.
    free: GpuEvent,
    /// The layer's copies were queued; not yet folded into the totals.
    pending: Option<Pending>,
}

#[derive(Clone, Copy)]
struct Pending {
    launched: bool,
    host_wait_us: Option<f64>,
}

/// The scratchpad, its staging, streams and events, and the running totals.
pub(crate) struct PostFetch {
    pub opts: PostFetchOptions,
    pub costs: PostFetchCosts,
    /// Expert slots per half.
    pub slots: usize,
    /// Bytes of one expert's gate, up, down.
    bytes: [usize; 3],
    /// Gate, up, down: `[2 * slots]` experts each.
    bufs: [DeviceBuffer<u8>; 3],
    /// One pinned buffer per slot (both halves).
    staging: Vec<PinnedBuffer<u8>>,
    streams: Vec<CopyStream>,
    /// Per slot (both halves), recorded after its copies.
    slot_ready: Vec<GpuEvent>,
    halves: [Half; 2],
    next_half: usize,
    tracker: TransferTracker,
    pub totals: PostFetchTotals,
    /// The half the current layer fetched into (none: nothing fetched).
    pub current: Option<usize>,
    pub pcie_bytes_per_s: f64,
}

/// Whether every expert of `model` is stored as bf16 with the bytes its shape needs.
fn bf16_experts(model: &Model) -> bool {
    let c = model.config();
    (0..c.n_layers).all(|l| {
        let x = model.expert(l, 0);
        [x.gate, x.up, x.down].iter().all(|t| t.dtype == DType::BF16 && t.data.len() == 2 * t.n_elems())
    })
}

impl PostFetch {
    /// The scratchpad for `model`, or none when Post-Fetch is off, has no VRAM, the prefill hot
    /// lane is not grouped, or the experts are not bf16. Measures the PCIe rate.
    pub fn new(
        be: &CudaBackend,
        model: &Model,
        opts: PostFetchOptions,
        hot_gemm: HotGemm,
    ) -> Result<Option<PostFetch>, GpuError> {
        let off = opts.mode == PostFetchMode::Off || opts.scratch_bytes == 0;
        if off || hot_gemm != HotGemm::Grouped || !bf16_experts(model) {
            return Ok(None);
        }
        let c = model.config();
        let (h, ff) = (c.hidden, c.expert_ff);
        let bytes = [2 * ff * h, 2 * ff * h, 2 * h * ff];
        let expert = bytes.iter().sum::<usize>();
        let slots = (opts.scratch_bytes / 2 / expert).clamp(1, c.n_experts.max(1));
        let bufs = [0, 1, 2].map(|i| be.alloc_zeros::<u8>(2 * slots * bytes[i]));
        let [g, u, d] = bufs;
        let staging = (0..2 * slots).map(|_| be.alloc_pinned::<u8>(expert)).collect::<Result<_, _>>()?;
        let n_streams = opts.streams.clamp(1, MAX_STREAMS);
        let streams = (0..n_streams).map(|_| be.copy_stream()).collect::<Result<Vec<_>, _>>()?;
        let slot_ready = (0..2 * slots).map(|_| be.event()).collect::<Result<_, _>>()?;
        let half = || -> Result<Half, GpuError> {
            Ok(Half {
                copy_start: be.event()?,
                copy_end: (0..n_streams).map(|_| be.event()).collect::<Result<_, _>>()?,
                pre_wait: be.event()?,
                post_wait: be.event()?,
                free: be.event()?,
                pending: None,
            })
        };
        let pcie = measure_pcie(be, &streams[0])?;
        let costs = PostFetchCosts { pcie_bytes_per_s: pcie, ..PostFetchCosts::configured(h, ff, 1, STAGE_THREADS) };
        Ok(Some(PostFetch {
            opts,
            costs,
            slots,
            bytes,
            bufs: [g?, u?, d?],
            staging,
            streams,
            slot_ready,
            halves: [half()?, half()?],
            next_half: 0,
            tracker: TransferTracker::new(2 * slots, opts.max_transfers),
            totals: PostFetchTotals::default(),
            current: None,
            pcie_bytes_per_s: pcie,
        }))
    }

    pub fn expert_bytes(&self) -> usize {
        self.bytes.iter().sum()
    }

    /// VRAM of the scratchpad.
    pub fn scratch_bytes(&self) -> usize {
        self.bufs.iter().map(DeviceBuffer::bytes).sum()
    }

    /// Gate, up and down of half `b` (`slots` experts each, bf16).
    fn half_views(&self, b: usize) -> [DPtr<u16>; 3] {
        [0, 1, 2].map(|i| {
            let n = self.slots * self.bytes[i];
            self.bufs[i].ptr().sub(b * n, n).as_u16()
        })
    }

    /// Fold half `b`'s last layer into the totals (its events are complete or about to be).
    fn harvest(&mut self, b: usize) -> Result<(), GpuError> {
        let hf = &mut self.halves[b];
        let Some(p) = hf.pending.take() else { return Ok(()) };
        let (true, Some(host_wait_us)) = (p.launched, p.host_wait_us) else { return Ok(()) };
        let mut copy_us = 0f64;
        for end in &hf.copy_end {
            end.synchronize()?;
            copy_us = copy_us.max(hf.copy_start.elapsed_ms(end)? as f64 * 1e3);
        }
        hf.post_wait.synchronize()?;
        let stall_us = hf.pre_wait.elapsed_ms(&hf.post_wait)? as f64 * 1e3;
        self.totals.copy_us += copy_us;
        self.totals.exposed_us += host_wait_us.min(stall_us).min(copy_us).max(0.0);
        Ok(())
    }

    /// Fold every pending layer into the totals (after a call).
    pub fn harvest_all(&mut self) -> Result<(), GpuError> {
        self.harvest(0)?;
        self.harvest(1)
    }
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

impl GpuModel {
    /// Forget the previous layer's fetch (before each MoE block).
    pub(super) fn postfetch_reset(&mut self) {
        let hs = &mut self.host;
        hs.pf_fetch.fill(-1);
        hs.pf_slot.clear();
        hs.pf_token.clear();
        hs.pf_weight.clear();
        if let Some(pf) = self.postfetch.as_mut() {
            pf.current = None;
        }
    }

    /// Prefill, host path, worklist built: choose layer `l`'s experts for the GPU, queue their
    /// copies, and list their worklist entries (`HostScratch::pf_*`; the cold lane skips them).
    pub(super) fn postfetch_issue(&mut self, l: usize, phase: Phase) -> Result<(), GpuError> {
        let Some(pf) = self.postfetch.as_mut() else { return Ok(()) };
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
        let n_chosen = assign(&mut hs.pf_loads, pf.expert_bytes(), &pf.costs, pf.opts.mode, limit);
        pf.totals.layer_calls += 1;
        pf.totals.experts_chosen += n_chosen as u64;
        if n_chosen == 0 {
            return self.postfetch_debug(l, 0, 0);
        }
        let b = pf.next_half;
        pf.next_half ^= 1;
        pf.harvest(b)?;
        pf.tracker.release(b * pf.slots..(b + 1) * pf.slots);
        let issued = self.postfetch_copies(l, b, n_chosen)?;
        let pf = self.postfetch.as_mut().expect("checked above");
        if issued > 0 {
            pf.current = Some(b);
            pf.halves[b].pending = Some(Pending { launched: false, host_wait_us: None });
        }
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
        self.postfetch_debug(l, n_chosen, issued)
    }

    /// Queue the copies of the first `n_chosen` of `pf_loads` into half `b` (in steps bounded
    /// by free slots and transfers in flight); returns how many were queued.
    fn postfetch_copies(&mut self, l: usize, b: usize, n_chosen: usize) -> Result<usize, GpuError> {
        let pf = self.postfetch.as_mut().expect("called with post-fetch");
        for cs in &pf.streams {
            self.be.wait_event_on(cs, &pf.halves[b].free)?;
        }
        self.be.record_on(&pf.streams[0], &pf.halves[b].copy_start)?;
        let (mut next, mut issued) = (0, 0);
        loop {
            let slot_ready = &pf.slot_ready;
            pf.tracker.poll(|s| slot_ready[s].is_done());
            let step = issue_step(n_chosen - next, pf.slots - issued, pf.tracker.room(), pf.opts.block_on_miss);
            match step {
                IssueStep::Done => break,
                IssueStep::Fallback(why) => {
                    pf.totals.add_fallbacks(why, n_chosen - next);
                    break;
                }
                IssueStep::Block => {
                    let oldest = pf.tracker.oldest().expect("no room implies a copy in flight");
                    let wait = Instant::now();
                    pf.slot_ready[oldest].synchronize()?;
                    pf.tracker.ready(oldest)?;
                    pf.totals.block_waits += 1;
                    pf.totals.block_wait_us += wait.elapsed().as_secs_f64() * 1e6;
                }
                IssueStep::Issue(n) => {
                    let experts: Vec<u32> = self.host.pf_loads[next..next + n].iter().map(|x| x.expert).collect();
                    issue_experts(&self.be, &self.model, pf, l, b * pf.slots + issued, &experts)?;
                    for (j, &e) in experts.iter().enumerate() {
                        self.host.pf_fetch[e as usize] = (issued + j) as i32;
                    }
                    (next, issued) = (next + n, issued + n);
                }
            }
        }
        for (cs, end) in pf.streams.iter().zip(&pf.halves[b].copy_end) {
            self.be.record_on(cs, end)?;
        }
        Ok(issued)
    }

    fn postfetch_debug(&self, l: usize, n_chosen: usize, issued: usize) -> Result<(), GpuError> {
        let Some(pf) = self.postfetch.as_ref().filter(|p| p.opts.debug) else { return Ok(()) };
        let hs = &self.host;
        eprintln!(
            "postfetch layer {l}: {} cold experts ({} cold slots), chose {n_chosen} for the GPU, fetched {issued}, \
             {} to the CPU after all, {} copies in flight, {} block waits so far",
            hs.pf_loads.len(),
            hs.worklist.cold_count,
            n_chosen - issued,
            pf.tracker.in_flight(),
            pf.totals.block_waits
        );
        Ok(())
    }

    /// The fetched experts' GEMMs over their entries (`n_all` entry rows in all, the fetched
    /// ones after the hot ones), once the compute stream has waited for their copies.
    pub(super) fn postfetch_gemm(&self, t: usize, n_all: usize) -> Result<(), GpuError> {
        let Some((pf, b)) = self.postfetch.as_ref().and_then(|p| p.current.map(|b| (p, b))) else {
            return Ok(());
        };
        let (h, ff) = (self.cfg.hidden, self.cfg.expert_ff);
        let s = self.scratch.as_ref().expect("reserved");
        let hf = &pf.halves[b];
        self.be.record(&hf.pre_wait)?;
        for end in &hf.copy_end {
            self.be.wait_event(end)?;
        }
        self.be.record(&hf.post_wait)?;
        let [gate, up, down] = pf.half_views(b);
        let (lay, wi, split) = (s.layout, s.work_i.ptr(), self.opts.split_bf16_activations);
        let nt = self.host.pf_tiles;
        let tiles = wi.sub(lay.tiles + self.host.pf_tile_at, 3 * nt);
        let (x, toks, hbuf, y) = (s.normed.ptr(), wi.sub(lay.tokens, n_all), s.h.ptr(), s.y.ptr());
        let n = pf.slots;
        self.be.grouped_gate_up(gate, up, n, x, toks, t, tiles, nt, hbuf, n_all, ff, h, split)?;
        self.be.grouped_gemm(down, n, hbuf, None, n_all, tiles, nt, y, n_all, h, ff, split)?;
        self.be.record(&hf.free)?;
        Ok(())
    }

    /// The layer's GPU lanes were queued (its fetched GEMMs included).
    pub(super) fn postfetch_launched(&mut self) {
        if let Some(pf) = self.postfetch.as_mut() {
            if let Some(p) = pf.current.and_then(|b| pf.halves[b].pending.as_mut()) {
                p.launched = true;
            }
        }
    }

    /// After the CPU lane: wait on the host for the layer's copies (the join needs them anyway)
    /// and keep that wait as the copy time the CPU lane did not hide.
    pub(super) fn postfetch_join(&mut self) -> Result<(), GpuError> {
        let Some(pf) = self.postfetch.as_mut() else { return Ok(()) };
        let Some(b) = pf.current else { return Ok(()) };
        let wait = Instant::now();
        for end in &pf.halves[b].copy_end {
            end.synchronize()?;
        }
        let slot_ready = &pf.slot_ready;
        pf.tracker.poll(|s| slot_ready[s].is_done());
        if let Some(p) = pf.halves[b].pending.as_mut() {
            p.host_wait_us = Some(wait.elapsed().as_secs_f64() * 1e6);
        }
        Ok(())
    }

    /// After a call: fold the pending layers into the totals and the perf JSON.
    pub(super) fn postfetch_finish(&mut self) -> Result<(), GpuError> {
        let hot_bytes = self.hot.bytes();
        let Some(pf) = self.postfetch.as_mut() else { return Ok(()) };
        pf.harvest_all()?;
        let report = pf.totals.perf(pf.opts.mode, pf.scratch_bytes(), hot_bytes, pf.pcie_bytes_per_s);
        self.perf.set_postfetch(Some(report));
        Ok(())
    }
}

/// Stage `experts` of layer `l` into the pinned buffers of slots `first..` and queue their
/// copies into the same scratchpad slots, one event per slot (`CpuOnly -> CopyInFlight`).
fn issue_experts(
    be: &CudaBackend,
    model: &Model,
    pf: &mut PostFetch,
    l: usize,
    first: usize,
    experts: &[u32],
) -> Result<(), GpuError> {
    let [g, u, _] = pf.bytes;
    let mut jobs = Vec::with_capacity(3 * experts.len());
    for (buf, &e) in pf.staging[first..first + experts.len()].iter_mut().zip(experts) {
        let x = model.expert(l, e as usize);
        let host = buf.as_mut_slice()?;
        let (gate, rest) = host.split_at_mut(g);
        let (up, down) = rest.split_at_mut(u);
        jobs.extend([(x.gate.data, gate), (x.up.data, up), (x.down.data, down)]);
    }
    stage_parallel(jobs, STAGE_THREADS);
    for j in 0..experts.len() {
        let slot = first + j;
        let cs = &pf.streams[j % pf.streams.len()];
        let mut at = 0;
        for (dev, n) in pf.bufs.iter().zip(pf.bytes) {
            be.write_async_on(cs, &pf.staging[slot], at..at + n, dev.ptr().sub(slot * n, n))?;
            at += n;
        }
        be.record_on(cs, &pf.slot_ready[slot])?;
        pf.tracker.start(slot)?;
        pf.totals.experts_fetched += 1;
        pf.totals.bytes_copied += at as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_copies_every_pair_on_any_thread_count() {
        let src: Vec<Vec<u8>> = (0..7u8).map(|i| vec![i; 1000 + i as usize]).collect();
        for threads in [1, 3, 16] {
            let mut dst: Vec<Vec<u8>> = src.iter().map(|s| vec![0xff; s.len()]).collect();
            let jobs = src.iter().map(|s| s.as_slice()).zip(dst.iter_mut().map(|d| d.as_mut_slice())).collect();
            stage_parallel(jobs, threads);
            assert_eq!(dst, src, "{threads} threads");
        }
        stage_parallel(Vec::new(), 4);
    }
}
