//! How many cold-lane threads an engine runs: `--cold-threads auto` (the default) or a number,
//! and the one rule `auto` follows for every engine ([`auto_cold_threads`]).

use serde::Serialize;

/// Most cold-lane threads a caller may ask for. Each costs a thread; in the CPU pipeline also a
/// channel and one lane buffer of `ceil(max_tokens * k / n_workers) * hidden` floats.
pub const MAX_COLD_THREADS: usize = 64;
const _: () = assert!(MAX_COLD_THREADS <= moe_lanes_kernels::pool::MAX_POOL_THREADS);

/// A `--cold-threads` value, parsed once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ColdThreads {
    /// [`auto_cold_threads`] for the engine's lanes.
    #[default]
    Auto,
    /// This many, the driver included where it is a cold participant.
    Fixed(usize),
}

/// A `--cold-threads` value that is neither `auto` nor 1..=[`MAX_COLD_THREADS`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cold threads '{given}': expected auto or 1..={max}")]
pub struct BadColdThreads {
    pub given: String,
    pub max: usize,
}

impl std::str::FromStr for ColdThreads {
    type Err = BadColdThreads;
    fn from_str(s: &str) -> Result<ColdThreads, BadColdThreads> {
        let bad = || BadColdThreads { given: s.to_string(), max: MAX_COLD_THREADS };
        match s.trim() {
            "auto" => Ok(ColdThreads::Auto),
            n => match n.parse::<usize>() {
                Ok(n) if (1..=MAX_COLD_THREADS).contains(&n) => Ok(ColdThreads::Fixed(n)),
                _ => Err(bad()),
            },
        }
    }
}

impl std::fmt::Display for ColdThreads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ColdThreads::Auto => f.write_str("auto"),
            ColdThreads::Fixed(n) => write!(f, "{n}"),
        }
    }
}

/// What shares the machine's cores with the cold pool: the inputs of [`auto_cold_threads`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThreadInputs {
    /// Cores this process may run on.
    pub n_cores: usize,
    /// The driver thread computes a cold share itself (pipeline `driver_cold`, or thread 0 of
    /// the GPU engine's pool); when false it needs a core of its own.
    pub driver_in_pool: bool,
    /// A GPU lane with hot experts: its host thread launches and waits on the device.
    pub gpu_lane: bool,
    /// CPU hot lanes that hold experts: each is a busy thread of its own.
    pub busy_cpu_hot_lanes: usize,
}

impl ThreadInputs {
    /// The cores of this process (its affinity set as the standard library reports it).
    pub fn this_machine() -> ThreadInputs {
        ThreadInputs {
            n_cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            driver_in_pool: true,
            gpu_lane: false,
            busy_cpu_hot_lanes: 0,
        }
    }
}

/// Cores kept free for an active GPU lane. Measured on the H100 machine's 16-core host (issue
/// 16, uniform routing, 50% of expert bytes in VRAM): 14 cold threads gave 124.0 t/s, 16 gave
/// 81–94, 12 gave 118.1. The GPU lane's host thread and the driver's launches and copies compete
/// with the pool for two cores. With no hot experts (budget 0) 16 was best: reserve nothing.
pub const GPU_LANE_RESERVED_CORES: usize = 2;

/// The rule behind `--cold-threads auto`, for every engine: every core the process may use,
/// less one for a driver that is not a cold participant, [`GPU_LANE_RESERVED_CORES`] for an
/// active GPU lane, and one per busy CPU hot lane; at least one. The pool pins its workers to
/// the first cores, so the reserved (last) cores stay free for the lanes.
pub fn auto_cold_threads(inputs: &ThreadInputs) -> usize {
    let reserved = usize::from(!inputs.driver_in_pool)
        + if inputs.gpu_lane { GPU_LANE_RESERVED_CORES } else { 0 }
        + inputs.busy_cpu_hot_lanes;
    inputs.n_cores.saturating_sub(reserved).clamp(1, MAX_COLD_THREADS)
}

impl ColdThreads {
    /// The count for an engine with these inputs.
    pub fn resolve(self, inputs: &ThreadInputs) -> usize {
        match self {
            ColdThreads::Auto => auto_cold_threads(inputs),
            ColdThreads::Fixed(n) => n,
        }
    }
}

/// The threads an engine runs, as reports (bench, perf JSON) show them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize, Default)]
pub struct ThreadReport {
    /// Cold-lane participants (the driver included where it is one).
    pub cold: usize,
    /// Dense-stage threads of the CPU pipeline (0 for the GPU engine, whose dense stage is on
    /// the device).
    pub dense: usize,
    /// `auto` or `fixed` (given with `--cold-threads N`).
    pub chosen_by: ThreadChoice,
}

/// How the cold-thread count was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ThreadChoice {
    #[default]
    Auto,
    Fixed,
}

impl From<ColdThreads> for ThreadChoice {
    fn from(c: ColdThreads) -> ThreadChoice {
        match c {
            ColdThreads::Auto => ThreadChoice::Auto,
            ColdThreads::Fixed(_) => ThreadChoice::Fixed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_auto_and_counts_and_refuses_the_rest() {
        assert_eq!("auto".parse::<ColdThreads>(), Ok(ColdThreads::Auto));
        assert_eq!("3".parse::<ColdThreads>(), Ok(ColdThreads::Fixed(3)));
        for bad in ["0", "-1", "many", ""] {
            assert!(bad.parse::<ColdThreads>().is_err(), "{bad}");
        }
        assert!((MAX_COLD_THREADS + 1).to_string().parse::<ColdThreads>().is_err());
    }

    #[test]
    fn the_rule_reserves_cores_for_what_competes_with_the_pool() {
        let base = ThreadInputs { n_cores: 16, driver_in_pool: true, gpu_lane: false, busy_cpu_hot_lanes: 0 };
        assert_eq!(auto_cold_threads(&base), 16, "budget 0: every core");
        assert_eq!(auto_cold_threads(&ThreadInputs { gpu_lane: true, ..base }), 14, "GPU lane active");
        assert_eq!(auto_cold_threads(&ThreadInputs { busy_cpu_hot_lanes: 2, ..base }), 14);
        assert_eq!(auto_cold_threads(&ThreadInputs { driver_in_pool: false, ..base }), 15);
        let tiny = ThreadInputs { n_cores: 2, gpu_lane: true, busy_cpu_hot_lanes: 1, ..base };
        assert_eq!(auto_cold_threads(&tiny), 1, "never fewer than one");
        assert_eq!(ColdThreads::Fixed(5).resolve(&tiny), 5);
    }
}
