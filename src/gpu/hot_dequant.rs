//! Prefill's hot lane over quantized cache slots through a bf16 scratch (the A/B baseline of the
//! default, which decodes quantized tiles inside the grouped kernels: `grouped_*_typed`, the same
//! bits without the scratch): the slots the worklist uses are dequantized to bf16 into a bounded
//! VRAM scratch (`GpuOptions::hot_dequant_bytes`, allocated with the engine, so it comes out of
//! the automatic hot-cache budget), a chunk of consecutive slot indices at a time, and the grouped
//! kernels (`grouped_gate_up`, `grouped_gemm`) run each chunk's tiles on that scratch. The host
//! sorts the worklist's tiles by slot (the kernels write disjoint rows, so tile order changes
//! nothing), cuts them into chunks of at most [`HotDequant::slots`] slot indices and rewrites each
//! tile's slot to its chunk-local index. With `GpuOptions::hot_dequant_overlap` chunks alternate
//! between two halves of the scratch and a chunk's dequantization runs on the side stream beside
//! the previous chunk's GEMMs, ordered by events (off: one chunk the size of the scratch, all on
//! the compute stream). Measured before the fused kernels (H100, 512-token prefill, Q4_K_M
//! Qwen3-30B-A3B, all 128 experts hot): hot lane 2.58 ms a layer at 3 chunks of 512 MiB, 2.18 ms
//! at 1 chunk of 1.2 GiB, 3.24 ms at 5, 4.34 ms at 10 chunks with overlap; the dequantization
//! itself about 0.7 ms a layer.

use super::device::Device;
use super::moe::MoeStage;
use super::GpuError;
use crate::model::config::ModelConfig;
use moe_lanes_kernels::cuda::kernel::GROUPED_TILE_ROWS;
use moe_lanes_kernels::cuda::{CudaBackend, DPtr, DeviceBuffer, GpuEvent, TypedWeights};

/// A contiguous range of the slot-sorted tiles whose slots lie in
/// `first_slot..first_slot + n_slots`; its tiles carry chunk-local slot indices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SlotChunk {
    pub first_tile: usize,
    pub n_tiles: usize,
    pub first_slot: usize,
    pub n_slots: usize,
}

/// Slots per chunk: as many as fit `limit_bytes / halves` in bf16, at least one, at most every
/// expert.
pub(crate) fn hot_dequant_slots(cfg: &ModelConfig, limit_bytes: usize, halves: usize) -> usize {
    let slot_bytes = 3 * cfg.expert_ff * cfg.hidden * std::mem::size_of::<u16>();
    (limit_bytes / halves / slot_bytes.max(1)).clamp(1, cfg.n_experts.max(1))
}

/// The bf16 scratch (one chunk, or two with overlap) and its events: `ready[b]` on the side
/// stream when half `b` holds its chunk, `free[b]` on the compute stream when the GEMMs that
/// read it are queued before it.
pub(crate) struct HotDequant {
    buf: DeviceBuffer<u16>,
    /// Slots per chunk (per half).
    pub slots: usize,
    /// Two halves: chunks dequantized on the side stream beside the previous chunk's GEMMs.
    overlap: bool,
    ready: [GpuEvent; 2],
    free: [GpuEvent; 2],
}

impl HotDequant {
    pub fn new(
        be: &CudaBackend,
        cfg: &ModelConfig,
        limit_bytes: usize,
        overlap: bool,
    ) -> Result<HotDequant, GpuError> {
        let halves = if overlap { 2 } else { 1 };
        let slots = hot_dequant_slots(cfg, limit_bytes, halves);
        let buf = be.alloc_zeros::<u16>(halves * slots * 3 * cfg.expert_ff * cfg.hidden)?;
        let (ready, free) = ([be.event()?, be.event()?], [be.event()?, be.event()?]);
        Ok(HotDequant { buf, slots, overlap, ready, free })
    }

    /// The half of chunk `i`: its index and gate, up and down views (`per` elements each).
    fn half(&self, i: usize, per: usize) -> (usize, [DPtr<u16>; 3]) {
        let b = if self.overlap { i % 2 } else { 0 };
        let p = self.buf.ptr();
        (b, [0, 1, 2].map(|m| p.sub((3 * b + m) * per, per)))
    }
}

/// Sort `tiles` (`(slot, first row, rows)` triples) by slot, cut them into chunks of at most
/// `max_slots` slot indices (from each chunk's lowest slot) and rewrite each tile's slot to its
/// chunk-local index. `chunks` is cleared first.
pub(crate) fn plan_chunks(tiles: &mut [i32], max_slots: usize, chunks: &mut Vec<SlotChunk>) {
    chunks.clear();
    let tiles: &mut [[i32; 3]] = bytemuck::cast_slice_mut(tiles);
    tiles.sort_unstable_by_key(|t| (t[0], t[1]));
    let max_slots = max_slots.max(1);
    let mut first_tile = 0;
    while first_tile < tiles.len() {
        let first_slot = tiles[first_tile][0];
        let end_slot = first_slot as usize + max_slots;
        let n_tiles = tiles[first_tile..].iter().take_while(|t| (t[0] as usize) < end_slot).count();
        let chunk = &mut tiles[first_tile..first_tile + n_tiles];
        let n_slots = (chunk[n_tiles - 1][0] - first_slot) as usize + 1;
        chunk.iter_mut().for_each(|t| t[0] -= first_slot);
        chunks.push(SlotChunk { first_tile, n_tiles, first_slot: first_slot as usize, n_slots });
        first_tile += n_tiles;
    }
}

impl MoeStage {
    /// Grouped hot lane over a layer with quantized slots: per chunk of slots, dequantize the
    /// chunk's gate, up and down to bf16 (with overlap into the half the chunk before last used,
    /// on the side stream, so it runs beside the previous chunk's GEMMs), then one launch
    /// for gate, up and the activation and one for down over the chunk's tiles.
    pub(super) fn hot_lane_dequant_grouped(&self, dev: &Device, l: usize, t: usize) -> Result<(), GpuError> {
        let (h, ff) = (dev.cfg.hidden, dev.cfg.expert_ff);
        let s = dev.s();
        let n_hot = self.host.worklist.hot[0].hot_count;
        let c = self.hot.slots(l).expect("hot entries imply a cache");
        let d = self.hot_dequant.as_ref().expect("allocated for quantized caches");
        let (per, side) = (d.slots * ff * h, d.overlap);
        let (lay, wi, split) = (s.layout, s.work_i.ptr(), dev.opts.prefill_activations.split(c.gate.dtype));
        let (x, toks, hbuf, y) = (s.normed.ptr(), wi.sub(lay.tokens, n_hot), s.h.ptr(), s.y.ptr());
        for (i, ch) in self.host.chunks.iter().enumerate() {
            let (n, (b, [gate, up, down])) = (ch.n_slots, d.half(i, per));
            if side {
                dev.be.wait_event_side(&d.free[b])?;
            }
            stage_bf16(&dev.be, c.gate, ch.first_slot, n, ff, h, gate, side)?;
            stage_bf16(&dev.be, c.up, ch.first_slot, n, ff, h, up, side)?;
            stage_bf16(&dev.be, c.down, ch.first_slot, n, h, ff, down, side)?;
            if side {
                dev.be.record_side(&d.ready[b])?;
                dev.be.wait_event(&d.ready[b])?;
            }
            let tiles = wi.sub(lay.tiles + 3 * ch.first_tile, 3 * ch.n_tiles);
            let nt = ch.n_tiles;
            // the chunk's tiles carry chunk-local slots: so do its biases
            let epi = c.epi.slots(ch.first_slot, n, ff, h);
            dev.be.grouped_gate_up(
                gate,
                up,
                n,
                x,
                toks,
                t,
                tiles,
                nt,
                GROUPED_TILE_ROWS,
                hbuf,
                n_hot,
                ff,
                h,
                split,
                &epi.gate_up,
            )?;
            dev.be.grouped_gemm(
                down,
                n,
                hbuf,
                None,
                n_hot,
                tiles,
                nt,
                GROUPED_TILE_ROWS,
                y,
                n_hot,
                h,
                ff,
                split,
                epi.down_bias,
            )?;
            if side {
                dev.be.record(&d.free[b])?;
            }
        }
        Ok(())
    }
}

/// Matrices `first..first + n` of a stack of `[rows, k]` matrices as bf16 into `dst`:
/// dequantized (a quantized type; on the side stream with `side`) or copied (bf16, on the
/// compute stream: after the GEMMs that last read `dst`, before the ones that read it next).
#[allow(clippy::too_many_arguments)]
fn stage_bf16(
    be: &CudaBackend,
    m: TypedWeights,
    first: usize,
    n: usize,
    rows: usize,
    k: usize,
    dst: DPtr<u16>,
    side: bool,
) -> Result<(), GpuError> {
    let (r0, r) = (first * rows, n * rows);
    match m.bf16() {
        Some(bf) => be.copy(bf.sub(r0 * k, r * k), dst.sub(0, r * k))?,
        None if side => be.dequantize_bf16_side(m.dtype, m.bytes, r0, r, k, dst)?,
        None => be.dequantize_bf16(m.dtype, m.bytes, r0, r, k, dst)?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiles_of(t: &[[i32; 3]]) -> Vec<i32> {
        t.iter().flatten().copied().collect()
    }

    #[test]
    fn chunks_cover_sorted_tiles_with_local_slots() {
        // expert-major order: slots out of order, slot 5 split in two tiles
        let mut tiles = tiles_of(&[[5, 0, 64], [5, 64, 3], [1, 67, 2], [7, 69, 1], [2, 70, 4], [9, 74, 1]]);
        let mut chunks = Vec::new();
        plan_chunks(&mut tiles, 3, &mut chunks);
        let want = [[0, 67, 2], [1, 70, 4], [0, 0, 64], [0, 64, 3], [2, 69, 1], [0, 74, 1]];
        assert_eq!(tiles, tiles_of(&want));
        assert_eq!(
            chunks,
            [
                SlotChunk { first_tile: 0, n_tiles: 2, first_slot: 1, n_slots: 2 },
                SlotChunk { first_tile: 2, n_tiles: 3, first_slot: 5, n_slots: 3 },
                SlotChunk { first_tile: 5, n_tiles: 1, first_slot: 9, n_slots: 1 },
            ]
        );
    }

    #[test]
    fn one_chunk_when_every_slot_fits_and_none_without_tiles() {
        let mut tiles = tiles_of(&[[3, 0, 1], [0, 1, 1]]);
        let mut chunks = vec![SlotChunk { first_tile: 9, n_tiles: 9, first_slot: 9, n_slots: 9 }];
        plan_chunks(&mut tiles, 128, &mut chunks);
        assert_eq!(tiles, tiles_of(&[[0, 1, 1], [3, 0, 1]]));
        assert_eq!(chunks, [SlotChunk { first_tile: 0, n_tiles: 2, first_slot: 0, n_slots: 4 }]);
        plan_chunks(&mut [], 4, &mut chunks);
        assert!(chunks.is_empty());
    }
}
