//! Typed messages of the per-layer data plane and the limits that size their channels.

use crate::moe::worklist::Worklist;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

/// Capacity of each lane's task channel. One task per layer is in flight per lane, so 2 is
/// enough (one running, one queued); a larger bound only hides a stuck lane for longer.
pub const LANE_MAILBOX_CAPACITY: usize = 2;

/// Most cold-lane worker threads: [`crate::threads::MAX_COLD_THREADS`] (its cost is there).
pub const MAX_COLD_WORKERS: usize = crate::threads::MAX_COLD_THREADS;

/// Most tokens one lane computes together per expert: defined with the expert math that
/// sizes its scratch.
pub use crate::moe::expert_math::GROUP_TOKENS_MAX;

/// How long the join waits for a lane before the layer falls back to all-cold. Generous: a
/// cold lane over a large prompt on a slow machine can take seconds per layer.
pub const LANE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

/// How long an idle lane polls its channel before parking its thread. A parked thread costs a
/// futex wake-up (several microseconds, tens under load or in a VM) when the next layer's task
/// arrives; polling costs one core per lane for this long after each task. The join uses the
/// same window. [`super::LaneSet::start`] polls only when there is a core for every lane thread
/// and the driver; on an oversubscribed machine polling steals the cores the lanes need.
pub const LANE_SPIN: std::time::Duration = std::time::Duration::from_micros(50);

/// Receive from `rx`, polling for `spin` before blocking (up to `timeout` in all).
pub fn recv_spin<T>(
    rx: &crossbeam_channel::Receiver<T>,
    spin: std::time::Duration,
    timeout: Option<std::time::Duration>,
) -> Result<T, crossbeam_channel::RecvTimeoutError> {
    let start = std::time::Instant::now();
    loop {
        match rx.try_recv() {
            Ok(v) => return Ok(v),
            Err(crossbeam_channel::TryRecvError::Disconnected) => {
                return Err(crossbeam_channel::RecvTimeoutError::Disconnected)
            }
            Err(crossbeam_channel::TryRecvError::Empty) => {}
        }
        if start.elapsed() >= spin {
            break;
        }
        std::hint::spin_loop();
    }
    match timeout {
        Some(t) => rx.recv_timeout(t.saturating_sub(spin)),
        None => rx.recv().map_err(|_| crossbeam_channel::RecvTimeoutError::Disconnected),
    }
}

/// Which lane a message is from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LaneId {
    Hot(u8),
    Cold(u8),
}

/// A lane could not compute its share.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum LaneError {
    #[error("{lane:?}: {reason}")]
    Failed { lane: LaneId, reason: String },
    #[error("{lane:?} panicked: {message}")]
    Panicked { lane: LaneId, message: String },
    #[error("{lane:?}: slot {slot_idx} of layer {layer_idx} is empty")]
    EmptySlot { lane: LaneId, layer_idx: usize, slot_idx: u32 },
    #[error("{lane:?} is gone")]
    Disconnected { lane: LaneId },
}

impl LaneError {
    /// Lane `lane` panicked with `payload` (`catch_unwind`'s), its message kept.
    pub fn panicked(lane: LaneId, payload: Box<dyn std::any::Any + Send>) -> LaneError {
        LaneError::Panicked { lane, message: moe_lanes_kernels::panic_message(payload) }
    }
}

/// What every lane reads for one layer: the FFN inputs and the worklist. Shared read-only
/// through an `Arc`; the driver regains `&mut` (no copy) once every lane has dropped its clone.
#[derive(Debug)]
pub struct LayerInput {
    pub call_idx: u64,
    pub layer_idx: usize,
    pub n_tokens: usize,
    pub hidden: usize,
    /// `[n_tokens, hidden]` (capacity `max_tokens * hidden`).
    pub x: Vec<f32>,
    pub worklist: Worklist,
}

/// A lane's output buffers; they travel with the task and come back with [`LaneDone`].
#[derive(Debug, Default)]
pub struct LaneBuffer {
    /// One unweighted output row per entry of the task's range (row `i - range.start`).
    pub entry_rows: Vec<f32>,
    /// `[n_tokens, hidden]`: weighted sums, when the task reduces into token rows.
    pub token_rows: Vec<f32>,
}

/// One lane's share of one layer.
#[derive(Debug)]
pub struct LaneTask {
    pub input: Arc<LayerInput>,
    /// Entries of the lane's section (hot section `lane_idx`, or the cold section).
    pub range: Range<usize>,
    /// Accumulate `weight * y` into `token_rows` instead of writing `entry_rows`.
    pub reduce_into_tokens: bool,
    pub out: LaneBuffer,
    pub sent_at: Instant,
    /// A fault to act out first (seeded fault tests only; see [`super::faults`]).
    pub fault: Option<(super::faults::LaneFault, std::time::Duration)>,
}

/// A lane finished (or failed) its task.
#[derive(Debug)]
pub struct LaneDone {
    pub lane: LaneId,
    pub call_idx: u64,
    pub layer_idx: usize,
    pub started_at: Instant,
    pub finished_at: Instant,
    pub out: LaneBuffer,
    pub result: Result<(), LaneError>,
}

/// Messages a hot lane thread accepts.
#[derive(Debug)]
pub enum HotMsg {
    Task(LaneTask),
    /// Load expert `expert_idx` into slot `slot_idx` of layer `layer_idx` (Updater; between calls).
    Exchange {
        layer_idx: usize,
        slot_idx: u32,
        expert_idx: usize,
        reply: crossbeam_channel::Sender<Result<(), LaneError>>,
    },
    Stop,
}

/// Messages a cold worker thread accepts.
#[derive(Debug)]
pub enum ColdMsg {
    Task(LaneTask),
    Stop,
}
