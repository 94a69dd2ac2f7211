//! The per-layer pipeline as actors: Router, Dispatcher, HotLane, ColdPool, Join, Updater.
//!
//! This directory is compiled as part of the `moe_lanes` library crate, as the module
//! `moe::actors` of the lanes' home (`#[path]` in `src/moe/mod.rs`; the crate root re-exports it
//! as `crate::actors`), not as a crate of its own: the CLI in the library package needs both the
//! library and the actors, and the actors need the library, so a separate crate would have to
//! be depended on by the package that it depends on.
//!
//! Two planes:
//! - **Data plane** (per layer, latency-critical): the layer driver (the thread that called
//!   `forward`) runs the Router and Dispatcher stages and the Join; the HotLane(s) and the
//!   ColdPool workers are dedicated threads fed through bounded crossbeam channels with typed
//!   messages ([`messages`]). Buffers travel inside the messages (ownership moves lane <-> join),
//!   so nothing is locked and nothing is allocated per layer. The benchmark
//!   (`benches/pipeline_overhead.rs`) measured kameo mailboxes against these channels for the
//!   per-layer hop; see ARCHITECTURE.md for the numbers that led to this split.
//! - **Control plane** (between calls): the [`updater::Updater`] is a kameo actor that queues
//!   slot exchanges; the engine drains it between forward calls, never during one.

pub mod faults;
pub mod join;
pub mod lanes;
pub mod messages;
pub mod updater;
pub use updater::UpdaterError;

pub use faults::{LaneFault, LaneFaultSchedule};
pub use join::{InjectedFault, LaneSet};
pub use lanes::{CpuHotLane, HotLane};
pub use messages::{LaneError, LaneId};
pub use updater::{apply_exchanges, Exchange, Updater, UpdaterHandle};
