//! Phases and the PP policy (DESIGN.md "Phases and policies").
//!
//! The phase is decided once per forward call by the caller — never from the size of a
//! sub-batch: a 512 + 1 prompt keeps its one-token tail in `Prefill`, and a multi-token
//! verification batch during generation is `Decode`. [`PpPolicy::plan`] turns (phase, token
//! count, cache capacity, cold-lane state, profile) into an [`ExecPlan`] (execution plan).
//!
//! Environment switches (`MOE_LANES_ORDER`, `MOE_LANES_REDUCE_MERGE`,
//! `MOE_LANES_COMPACT_COLD_REDUCE`) exist for A/B diagnosis only; they are read once when the
//! engine is built ([`crate::env::engine_tuning`], the `cpu` section), never per call.

use crate::model::arch::Profile;
use crate::moe::worklist::WorklistOrder;

pub use crate::forward::Phase;

/// Off / on / decided by the policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Switch {
    Off,
    On,
    #[default]
    Auto,
}

impl std::str::FromStr for Switch {
    type Err = String;
    fn from_str(s: &str) -> Result<Switch, String> {
        match s {
            "off" | "0" | "false" => Ok(Switch::Off),
            "on" | "1" | "true" => Ok(Switch::On),
            "auto" => Ok(Switch::Auto),
            other => Err(format!("'{other}': expected off, on or auto")),
        }
    }
}

/// Where cold slots run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ColdPlacement {
    /// The CPU cold-lane pool.
    Cpu,
    /// The primary GPU (only with a GPU hot lane; never chosen by the CPU engine).
    PrimaryGpu,
}

/// How the join merges lane outputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MergeKind {
    /// One-token decode: add the k rows straight into the token row.
    Direct,
    /// Lanes return one row per slot; the join sums each token's rows in slot order.
    SlotRows,
    /// Lanes reduce their slots into token rows first; the join adds the lane rows
    /// (PP reduce-merge).
    ReduceMerge,
}

/// The execution plan of one forward call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ExecPlan {
    pub phase: Phase,
    pub order: WorklistOrder,
    pub merge: MergeKind,
    /// The cold lane accumulates weighted outputs straight into token rows.
    pub compact_cold_reduce: bool,
    /// Dense prompt processing (all experts for all tokens). Planned from the profile; the CPU
    /// engine has no dense execution path yet and runs such plans sparse (same result).
    pub dense_pp: bool,
    pub cold_placement: ColdPlacement,
    /// Route on the CPU (tiny decode batches, profile `cpu_decode_routing`).
    pub cpu_routing: bool,
}

/// Caller- or environment-supplied overrides; `None` / `Auto` leave the decision to the policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PolicySwitches {
    pub reduce_merge: Switch,
    pub compact_cold_reduce: Option<bool>,
    pub order: Option<WorklistOrder>,
    pub dense_pp: Option<bool>,
}

/// Cache state the policy looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheState {
    pub n_hot_slots: usize,
    pub n_experts: usize,
}

/// Cold-lane state the policy looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ColdState {
    pub n_workers: usize,
    /// False after a cold worker died: the plan then keeps everything on surviving paths.
    pub healthy: bool,
}

/// Smallest prompt (tokens) for which `Auto` reduce-merge turns on: below it the extra
/// per-lane token-row pass costs more than the join's slot-row merge saves.
pub const REDUCE_MERGE_MIN_TOKENS: usize = 16;

/// The PP policy: profile + switches.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PpPolicy {
    pub profile: Profile,
    pub switches: PolicySwitches,
}

impl PpPolicy {
    pub fn plan(&self, phase: Phase, n_tokens: usize, cache: CacheState, cold: ColdState) -> ExecPlan {
        let p = &self.profile;
        let s = &self.switches;
        let cpu_routing =
            phase == Phase::Decode && p.cpu_decode_routing && n_tokens <= p.cpu_decode_routing_max_tokens;
        let mut plan = match phase {
            // Warmup is conservative: token-major, every PP path off, slot-row merge.
            Phase::Warmup => ExecPlan {
                phase,
                order: WorklistOrder::TokenMajor,
                merge: MergeKind::SlotRows,
                compact_cold_reduce: false,
                dense_pp: false,
                cold_placement: ColdPlacement::Cpu,
                cpu_routing: false,
            },
            Phase::Decode => ExecPlan {
                phase,
                order: WorklistOrder::TokenMajor,
                merge: if n_tokens == 1 && p.decode_direct_merge {
                    MergeKind::Direct
                } else {
                    MergeKind::SlotRows
                },
                compact_cold_reduce: false,
                dense_pp: false,
                cold_placement: ColdPlacement::Cpu,
                cpu_routing,
            },
            Phase::Prefill => {
                let reduce_merge = match s.reduce_merge {
                    Switch::On => true,
                    Switch::Off => false,
                    Switch::Auto => p.pp_reduce_merge && n_tokens >= REDUCE_MERGE_MIN_TOKENS,
                };
                ExecPlan {
                    phase,
                    order: WorklistOrder::ExpertMajor,
                    merge: if reduce_merge { MergeKind::ReduceMerge } else { MergeKind::SlotRows },
                    compact_cold_reduce: p.compact_cold_reduce && cold.healthy && n_tokens > 1,
                    dense_pp: p.pp_dense && cache.n_hot_slots == 0,
                    cold_placement: ColdPlacement::Cpu,
                    cpu_routing: false,
                }
            }
        };
        if phase != Phase::Warmup {
            if let Some(order) = s.order {
                plan.order = order;
            }
            if let Some(c) = s.compact_cold_reduce {
                plan.compact_cold_reduce = c;
            }
            if let Some(d) = s.dense_pp {
                plan.dense_pp = d;
            }
            if phase == Phase::Decode && s.reduce_merge == Switch::On {
                plan.merge = MergeKind::ReduceMerge;
            }
        }
        plan
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::arch::DEFAULT_PROFILE;

    fn policy(switches: PolicySwitches) -> PpPolicy {
        PpPolicy { profile: DEFAULT_PROFILE, switches }
    }
    const CACHE: CacheState = CacheState { n_hot_slots: 4, n_experts: 8 };
    const COLD: ColdState = ColdState { n_workers: 2, healthy: true };

    #[test]
    fn plans_follow_the_phase_not_the_token_count() {
        let p = policy(PolicySwitches::default());
        let tail = p.plan(Phase::Prefill, 1, CACHE, COLD);
        assert_eq!(tail.phase, Phase::Prefill);
        assert_eq!(tail.order, WorklistOrder::ExpertMajor);
        let verify = p.plan(Phase::Decode, 5, CACHE, COLD);
        assert_eq!(verify.phase, Phase::Decode);
        assert_eq!(verify.order, WorklistOrder::TokenMajor);
        assert_eq!(p.plan(Phase::Decode, 1, CACHE, COLD).merge, MergeKind::Direct);
        assert!(p.plan(Phase::Decode, 1, CACHE, COLD).cpu_routing);
        assert!(!verify.cpu_routing);
        assert_eq!(p.plan(Phase::Prefill, 512, CACHE, COLD).merge, MergeKind::ReduceMerge);
    }

    #[test]
    fn warmup_is_conservative_even_with_switches() {
        let sw = PolicySwitches {
            reduce_merge: Switch::On,
            compact_cold_reduce: Some(true),
            order: Some(WorklistOrder::ExpertMajor),
            dense_pp: Some(true),
        };
        let w = policy(sw).plan(Phase::Warmup, 512, CACHE, COLD);
        assert_eq!(w.order, WorklistOrder::TokenMajor);
        assert_eq!(w.merge, MergeKind::SlotRows);
        assert!(!w.compact_cold_reduce && !w.dense_pp);
        let pf = policy(sw).plan(Phase::Prefill, 2, CACHE, COLD);
        assert!(pf.compact_cold_reduce && pf.dense_pp && pf.merge == MergeKind::ReduceMerge);
    }
}
