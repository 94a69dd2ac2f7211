//! Decode graphs for batched steps: a batched decode step's layers as the decode segments of
//! `graph` (parts between the split layers' host steps, each split layer's hot lane a graph of
//! its own, the cold lanes on the host between), over the step's rows. Every per-row value the
//! kernels need lives in device memory uploaded before the launch (the tokens, whose embedding
//! runs eagerly, and `BatchRows`' positions and cache addresses), so one capture serves every
//! later step over the same sequences: its key is the allocations it points into (each
//! sequence's cache, the scratch, the batch tables, the attention partials) and the step's
//! shape (rows per sequence, the attention bucket of positions). A batch whose sequences change
//! captures again; one whose capture fails runs eagerly from then on.
//!
//! What it saves: the launches of every layer (a dozen or more) become one graph launch per
//! part, so after each cold lane's join the GPU is not paced by the host's launches. The
//! attention grid covers a bucket of positions (powers of two, as the one-token graphs), its
//! extra splits empty; the same kernels in the same order as the eager step otherwise.

use super::batch::BatchRows;
use super::graph::{SegmentRows, Segments, StepLanes};
use super::model::GpuSeg;
use super::shard::Shard;
use super::GpuError;
use crate::cache::perf::PerfState;
use crate::forward::LogitRows;
use crate::moe::cold::ColdLane;
use moe_lanes_kernels::cuda::kernel::DECODE_GEMV_MAX_TOKENS;

/// Smallest attention bucket of a batched step's graphs.
const MIN_BATCH_POSITIONS: usize = 256;

/// What a batched step's captured graphs point into and are shaped by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BatchGraphKey {
    /// Each sequence's cache (allocation serial) and rows, in order.
    seqs: Vec<(u64, usize)>,
    scratch: u64,
    tables: [u64; 2],
    attn_part: u64,
    max_positions: usize,
}

/// A batched decode step's captured segments and their key.
pub(crate) struct BatchSegments {
    key: BatchGraphKey,
    segs: Segments,
}

/// The attention bucket of a batched step whose decode rows see at most `max_positions`.
pub(super) fn positions_bucket(max_positions: usize) -> usize {
    max_positions.next_power_of_two().max(MIN_BATCH_POSITIONS)
}

impl Shard {
    /// Whether this device's batched decode step of `t` rows runs as graphs: decode graphs on,
    /// no injected faults, the fused q/k norm + RoPE (the batch tables' append), no stage
    /// profile, at most [`DECODE_GEMV_MAX_TOKENS`] rows (the projections' GEMVs: no cuBLAS in a
    /// capture), and no capture of this model failed before.
    pub(super) fn batch_graphs_apply(&self, t: usize) -> bool {
        let opts = &self.dev.opts;
        opts.decode_graph
            && opts.faults == super::GpuFaults::default()
            && self.mixer.qk_fused_all
            && self.dev.profiler.is_none()
            && t <= DECODE_GEMV_MAX_TOKENS
            && !self.graphs.batch_failed
    }

    /// This device's layers of a batched decode step through its segments (captured first when
    /// the key or the split layers changed; eagerly when the capture fails).
    pub(super) fn batch_graph_layers(
        &mut self,
        segs: &[GpuSeg<'_>],
        t: usize,
        cold: &mut dyn ColdLane,
        perf: &mut PerfState,
    ) -> Result<(), GpuError> {
        let rows = self.dev.rows.as_ref().expect("the batch tables are built");
        self.mixer.reserve_batch(&self.dev, segs, rows)?;
        let key = self.batch_key(segs, rows);
        let mut lanes = StepLanes { cold, perf, rows: LogitRows::All };
        let stale = |g: &BatchSegments| g.key != key || !g.segs.splits_at(self.split_layers());
        if self.graphs.batch.as_ref().is_none_or(stale) {
            self.graphs.batch = None;
            match self.capture_segments(SegmentRows { t, segs, step: None }, &mut lanes) {
                Ok(captured) => self.graphs.batch = Some(BatchSegments { key, segs: captured }),
                Err(e) if e.is_device_loss() => return Err(e),
                Err(_) => {
                    self.graphs.batch_failed = true;
                    let (layers, decode) = (self.layers(), crate::moe::phase::Phase::Decode);
                    return self.run_layers(layers, decode, (t, segs), lanes.cold, lanes.perf);
                }
            }
        }
        let g = self.graphs.batch.take().expect("captured above");
        let run = self.run_segments(&g.segs, t, &mut lanes);
        self.graphs.batch = Some(g);
        run
    }

    fn batch_key(&self, segs: &[GpuSeg<'_>], rows: &BatchRows) -> BatchGraphKey {
        BatchGraphKey {
            seqs: segs.iter().map(|s| (s.cache.serial(), s.n)).collect(),
            scratch: self.dev.s().hidden.serial(),
            tables: rows.serials(),
            attn_part: self.mixer.part_serial(),
            max_positions: rows.max_positions,
        }
    }
}
