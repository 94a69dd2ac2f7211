//! Seeded lane faults for deterministic fault tests (TigerBeetle's VOPR is the model): a
//! schedule decides, from `(seed, call, layer, lane)` alone, whether a lane task fails with an
//! error, panics, or stalls past the join's timeout. The join decides when it sends the task and
//! the lane acts on it, so a run with the same seed injects the same faults at the same places,
//! whatever the thread timing. The engine's answer must stay exact (the layer falls back to
//! all-cold) and every fault must be counted with its reason.

use crate::cache::perf::FallbackReason;
use std::time::Duration;

/// Why a layer could not be computed split, in either engine: the layer is recomputed all-cold
/// ([`crate::moe::cold::all_cold`]) and the fallback counted by `reason`.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerFailure {
    pub reason: FallbackReason,
    /// The cold lane itself failed: the fallback must not run on it (the GPU engine takes the
    /// plain lane then; the CPU pipeline's fallback never runs on a lane's threads).
    pub cold_lane_failed: bool,
    pub detail: String,
}

impl LayerFailure {
    /// A failure that leaves the cold lane usable.
    pub fn new(reason: FallbackReason, detail: impl Into<String>) -> LayerFailure {
        LayerFailure { reason, cold_lane_failed: false, detail: detail.into() }
    }

    /// The cold lane failed (`reason`: failed, or did not take its task).
    pub fn of_cold_lane(reason: FallbackReason, detail: impl Into<String>) -> LayerFailure {
        LayerFailure { reason, cold_lane_failed: true, detail: detail.into() }
    }
}

/// Which lane a task goes to, as the schedule sees it (the actors' `LaneId`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FaultLane {
    Hot(u8),
    Cold(u8),
}

/// What a lane does wrong with one task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LaneFault {
    /// Return an error instead of rows (counted as `lane_failed`).
    Error,
    /// Panic inside the task (caught; counted as `lane_failed`).
    Panic,
    /// Sleep for the schedule's stall before computing: past the join's timeout this is a lane
    /// that did not answer in time (`lane_unavailable`), and its late answer must be discarded.
    Stall,
}

/// A seeded fault schedule over lane tasks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaneFaultSchedule {
    pub seed: u64,
    /// Chance of a fault per lane task, in thousandths (0..=1000).
    pub per_mille: u32,
    /// How long a stalled task sleeps.
    pub stall: Duration,
}

impl LaneFaultSchedule {
    /// About one lane task in ten faulted; stalls of a quarter second.
    pub fn seeded(seed: u64) -> LaneFaultSchedule {
        LaneFaultSchedule { seed, per_mille: 100, stall: Duration::from_millis(250) }
    }

    /// The fault (if any) of `lane`'s task in layer `layer_idx` of forward call `call_idx`.
    /// `can_stall`: false for the driver's own cold share (the driver cannot time itself out).
    pub fn fault(
        &self,
        call_idx: u64,
        layer_idx: usize,
        lane: FaultLane,
        can_stall: bool,
    ) -> Option<LaneFault> {
        let lane_code = match lane {
            FaultLane::Hot(i) => u64::from(i),
            FaultLane::Cold(i) => 0x100 + u64::from(i),
        };
        let h =
            splitmix64(self.seed ^ splitmix64(call_idx ^ splitmix64(layer_idx as u64 ^ (lane_code << 32))));
        if (h % 1000) as u32 >= self.per_mille {
            return None;
        }
        // Stalls are the slow kind (each costs the stall's time), so they come a fifth of the time.
        match (h >> 32) % 5 {
            0 | 1 => Some(LaneFault::Error),
            2 | 3 => Some(LaneFault::Panic),
            _ if can_stall => Some(LaneFault::Stall),
            _ => Some(LaneFault::Error),
        }
    }
}

/// SplitMix64: a fast, well-mixed 64-bit hash (a schedule needs no more).
fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schedule_is_a_function_of_its_inputs_at_about_its_rate() {
        let s = LaneFaultSchedule { seed: 7, per_mille: 200, stall: Duration::ZERO };
        let mut n = [0usize; 3];
        for call in 0..100 {
            for layer in 0..10 {
                let f = s.fault(call, layer, FaultLane::Cold(2), true);
                assert_eq!(f, s.fault(call, layer, FaultLane::Cold(2), true));
                if let Some(f) = f {
                    n[f as usize] += 1;
                }
                assert_ne!(s.fault(call, layer, FaultLane::Cold(0), false), Some(LaneFault::Stall));
            }
        }
        let total: usize = n.iter().sum();
        assert!((120..=280).contains(&total), "{total} faults in 1000 tasks at 20%");
        assert!(n.iter().all(|&k| k > 10), "every kind occurs: {n:?}");
        let other = LaneFaultSchedule { seed: 8, ..s };
        let differs = (0..100)
            .any(|c| s.fault(c, 0, FaultLane::Hot(0), true) != other.fault(c, 0, FaultLane::Hot(0), true));
        assert!(differs, "the seed matters");
    }
}
