//! The hot cache's bookkeeping: which experts are hot (`hot_set`), the planner that packs
//! experts into a VRAM budget (`planner`), and the perf state / perf JSON that learn passes,
//! the updater and the metrics read (`perf`).

pub mod hot_set;
pub mod perf;
pub mod planner;
