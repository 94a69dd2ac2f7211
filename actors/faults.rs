//! Acting out the seeded lane faults of [`crate::moe::faults`] inside a lane task.

use super::messages::{LaneError, LaneId};
pub use crate::moe::faults::{FaultLane, LaneFault, LaneFaultSchedule};
use std::time::Duration;

impl From<LaneId> for FaultLane {
    fn from(lane: LaneId) -> FaultLane {
        match lane {
            LaneId::Hot(i) => FaultLane::Hot(i),
            LaneId::Cold(i) => FaultLane::Cold(i),
        }
    }
}

/// Act out `fault` at the start of a task (inside the lane's `catch_unwind`).
pub fn act_out(fault: Option<(LaneFault, Duration)>, lane: LaneId) -> Result<(), LaneError> {
    match fault {
        None => Ok(()),
        Some((LaneFault::Error, _)) => Err(LaneError::Failed { lane, reason: "injected fault".into() }),
        Some((LaneFault::Panic, _)) => panic!("injected lane panic ({lane:?})"),
        Some((LaneFault::Stall, stall)) => {
            std::thread::sleep(stall);
            Ok(())
        }
    }
}

