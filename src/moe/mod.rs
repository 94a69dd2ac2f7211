//! The MoE layer machinery of the fast paths and the one home of the lanes: routing, the
//! worklist, phases and the PP policy, the cold lane (`cold`, `pool_lane`), failures and faults,
//! the expert kernels, the lane actors, the CPU lane pipeline, and the small numeric helpers they
//! share (the oracle in `crate::reference` keeps its own arithmetic on purpose).

// The lane actors live in the top-level `actors/` directory (DESIGN.md layout) but are a module
// of the lanes' home: they run the lanes of this module on threads, and the pipeline here drives
// them (the crate root re-exports them as `crate::actors`).
#[path = "../../actors/mod.rs"]
pub mod actors;
pub mod cold;
pub mod delta_net;
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
