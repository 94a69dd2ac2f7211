//! The hot cache's bookkeeping: which experts are hot (`hot_set`), the planner that packs
//! experts into a VRAM budget (`planner`), and the perf state / perf JSON that learn passes,
//! the updater and the metrics read (`perf`); typed observations parsed from perf JSON
//! (`observe`), the weighting modes (`weighting`), the what-if planner (`whatif`) and its
//! per-layer-call cost fit (`cost_fit`), the online updater's planning and statistics
//! (`update`), and the expert usage tracer and its replay (`trace`).

pub mod cost_fit;
pub mod hot_set;
pub mod observe;
pub mod perf;
pub mod planner;
pub mod policy;
pub mod replay;
pub mod trace;
pub mod update;
pub mod weighting;
pub mod whatif;
