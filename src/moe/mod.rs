//! The MoE layer machinery of the fast paths: routing, the worklist, phases and the PP policy,
//! the cold lane's expert math, the CPU lane pipeline, and the small numeric helpers they share
//! (the oracle in `crate::reference` keeps its own arithmetic on purpose).

pub mod cold;
pub mod dense;
pub mod expert_groups;
pub mod expert_math;
pub mod faults;
pub mod math;
pub mod phase;
pub mod pipeline;
pub mod pool_lane;
pub mod profile;
pub mod routing;
pub mod worklist;
