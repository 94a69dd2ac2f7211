//! Post-Fetch's host-side decisions, pure and unit-tested without a GPU: the settings, the cost
//! model that splits a layer's cold experts between the CPU lane and the copy lane
//! ([`assign`]), how the chosen ones are issued against the scratchpad and the transfer bound
//! ([`plan_issue`]), the per-slot transfer state machine ([`TransferTracker`]), the readiness
//! query when a fetched expert is needed ([`on_use`]) and the statistics ([`PostFetchTotals`]).

use crate::cache::perf::PostFetchPerf;
use std::collections::BTreeMap;

/// Whether prefill fetches cold experts to the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PostFetchMode {
    /// The cost model decides per expert (`assign`).
    #[default]
    Auto,
    /// Fetch every cold expert that fits (the rest fall back to the CPU, counted): tests, A/B.
    On,
    /// Every cold expert on the CPU (no scratchpad is allocated).
    Off,
    /// Every cold expert on the CPU with the scratchpad allocated (seed 001's "force CPU": an
    /// A/B run at the same VRAM and hot budget as `auto`).
    Cpu,
}

impl PostFetchMode {
    pub fn name(self) -> &'static str {
        match self {
            PostFetchMode::Auto => "auto",
            PostFetchMode::On => "on",
            PostFetchMode::Off => "off",
            PostFetchMode::Cpu => "cpu",
        }
    }
}

/// A Post-Fetch mode that is not `auto`, `on`, `off` or `cpu`.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("post-fetch mode: expected auto, on, off or cpu")]
pub struct BadPostFetchMode;

impl std::str::FromStr for PostFetchMode {
    type Err = BadPostFetchMode;
    fn from_str(s: &str) -> Result<PostFetchMode, BadPostFetchMode> {
        match s {
            "auto" => Ok(PostFetchMode::Auto),
            "on" => Ok(PostFetchMode::On),
            "off" => Ok(PostFetchMode::Off),
            "cpu" => Ok(PostFetchMode::Cpu),
            _ => Err(BadPostFetchMode),
        }
    }
}

/// Default VRAM of the scratchpad: 1 GiB, 113 bf16 experts of 768 x 2048 (Qwen3-30B-A3B; a
/// 512-token prefill routes to about all 128 of a layer). As much pinned host memory stages them.
pub const DEFAULT_SCRATCH_BYTES: usize = 1 << 30;
/// Default bound on expert copies queued and not yet complete. It costs nothing (the pinned
/// staging is per scratchpad slot, the copies queue in order on their stream), and as the
/// previous layer's copies are complete when a layer issues (waited for, or computed on the CPU
/// and long done), it caps the experts one layer fetches: above any layer's cold experts of the
/// models in view, so that the scratchpad's slots bind.
pub const DEFAULT_MAX_TRANSFERS: usize = 256;
/// Copy streams at most. Each is a CUDA stream with an end event, and every stream waits for
/// every stream's previous copies before writing the scratchpad again (streams squared waits a
/// fetching layer); one host-to-device DMA direction gains little beyond a few.
pub const MAX_STREAMS: usize = 4;

/// Post-Fetch settings (the CLI and `env` parse them at the edge).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PostFetchOptions {
    pub mode: PostFetchMode,
    /// A fetched expert whose copy is still in flight when the CPU lane is done with its own
    /// experts: wait for the copy (`true`: its GEMMs are queued on the GPU at once, behind the
    /// copy's event) or compute it on the CPU (`false`: the fetched GEMMs are queued only after
    /// that check). Counted either way.
    pub block_on_miss: bool,
    /// Expert copies queued and not complete at most; a chosen expert beyond it runs on the CPU.
    pub max_transfers: usize,
    /// VRAM of the scratchpad (at least one expert slot when not 0; 0: off).
    pub scratch_bytes: usize,
    /// Copy streams (experts dealt round-robin over them).
    pub streams: usize,
    /// A log line per layer with the decision (stderr).
    pub debug: bool,
    /// Register the model's maps with the device and copy from the file's pages (no staging);
    /// staged through pinned buffers when off or when the driver refuses.
    pub register: bool,
    /// Decode too: a split layer's cold experts are divided between the CPU lane and copies to
    /// the scratchpad (run by the decode GEMVs) by the same cost model, with
    /// `DECODE_GPU_EXPERT_S` for the GPU's part.
    pub decode: bool,
}

/// `auto` by default: on the H100 machine (16-layer Qwen3-30B-A3B-shaped files, one lease,
/// 2026-11-25), with the copies read from the registered file and queued after the layer's
/// worklist upload, `auto` against `off`: BF16 budget 0 pp512 846 -> 2850 t/s, 50% skewed 7750
/// -> 8364; Q4_K_M budget 0 291 -> 4779, 50% skewed 6426 -> 10362 (benches/RESULTS.md). Before
/// that (host staging before the CPU lane, copies ahead of the worklist on the copy engine) it
/// lost at 50% skewed and was off by default.
impl Default for PostFetchOptions {
    fn default() -> Self {
        PostFetchOptions {
            mode: PostFetchMode::Auto,
            block_on_miss: true,
            max_transfers: DEFAULT_MAX_TRANSFERS,
            scratch_bytes: DEFAULT_SCRATCH_BYTES,
            streams: 1,
            debug: false,
            register: true,
            decode: false,
        }
    }
}

/// Cold-lane read bandwidth of expert weights (configured: the H100 machine's 16-core host reads
/// 100-120 GB/s in `bench-kernels`' probe). At 40 GB/s the model fetched the few-token cold
/// experts of a 50%-skewed prefill, whose copies took twice as long as the CPU did: pp512 on
/// the 4-layer skewed BF16 file fell from 13741 / 14232 t/s (off) to 5406 / 7157 (auto).
pub const DEFAULT_CPU_BYTES_PER_S: f64 = 100e9;
/// Cold-lane arithmetic per thread (f32 FMAs of the SIMD tiles). Derived from issue 14's
/// budget-0 prefill on the H100 machine (512 tokens, 16 threads, 1.26 s over 16 layers = 79 ms
/// a layer): 128 experts of 768 x 2048 bf16 read at 100 GB/s take ~12 ms, the rest, 4096 slots
/// x 6 x 768 x 2048 flop, leaves ~36 GFLOP/s a thread. Not measured on its own.
pub const DEFAULT_CPU_FLOP_PER_S_PER_THREAD: f64 = 36e9;
/// Host staging rate of one thread (memcpy from the mapped file into pinned memory).
pub const STAGE_BYTES_PER_S_PER_THREAD: f64 = 8e9;
/// Threads that stage expert bytes at most (the cold lane's threads, idle while staging runs
/// before the CPU lane; beyond this the copy is bound by DRAM, and each chunk of experts spawns
/// them anew).
pub const MAX_STAGE_THREADS: usize = 8;
/// GPU time of one expert's grouped GEMMs in prefill (a fetched one's beyond its copy, and each
/// cached expert the layer runs: the H100's hot lane took 12-15 us an expert at 512 tokens).
pub const DEFAULT_GPU_EXPERT_S: f64 = 20e-6;
/// GPU time of one fetched expert's decode GEMVs beyond its copy (one token: gate/up and down of
/// one expert read its 2.9-9.4 MB at HBM speed in a few microseconds).
pub const DECODE_GPU_EXPERT_S: f64 = 3e-6;
/// PCIe rate assumed until measured (pinned host-to-device, PCIe 5 x16 in practice ~55 GB/s).
pub const DEFAULT_PCIE_BYTES_PER_S: f64 = 25e9;

/// Scratchpad slots once the hot cache is known: at most the most cold experts any layer has
/// (`cold_per_layer`; a layer never fetches more than its cold experts), at least one, never
/// more than `slots`.
pub fn fitted_slots(slots: usize, cold_per_layer: impl IntoIterator<Item = usize>) -> usize {
    let most_cold = cold_per_layer.into_iter().max().unwrap_or(slots);
    slots.min(most_cold.max(1))
}

/// Threads that stage the copies beside a cold lane of `cold_threads`.
pub fn stage_threads(cold_threads: usize) -> usize {
    cold_threads.clamp(1, MAX_STAGE_THREADS)
}

/// The rates the cost model weighs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PostFetchCosts {
    /// Host-to-device rate of a pinned copy (measured once at engine start).
    pub pcie_bytes_per_s: f64,
    /// Rate at which the cold lane reads an expert's weights.
    pub cpu_bytes_per_s: f64,
    /// CPU time of one routed token of one expert (its three projections).
    pub cpu_token_s: f64,
    /// Host time to stage the bytes into pinned memory (`f64::INFINITY`: no staging).
    pub stage_bytes_per_s: f64,
    /// GPU time of one fetched expert beyond its copy.
    pub gpu_expert_s: f64,
}

impl PostFetchCosts {
    /// Configured CPU rates for `cold_threads` threads and experts of `hidden x ff`;
    /// `stage_threads(cold_threads)` threads stage the copies.
    pub fn configured(hidden: usize, ff: usize, cold_threads: usize) -> Self {
        let flop_per_token = 6.0 * hidden as f64 * ff as f64;
        PostFetchCosts {
            pcie_bytes_per_s: DEFAULT_PCIE_BYTES_PER_S,
            cpu_bytes_per_s: DEFAULT_CPU_BYTES_PER_S,
            cpu_token_s: flop_per_token / (DEFAULT_CPU_FLOP_PER_S_PER_THREAD * cold_threads.max(1) as f64),
            stage_bytes_per_s: STAGE_BYTES_PER_S_PER_THREAD * stage_threads(cold_threads) as f64,
            gpu_expert_s: DEFAULT_GPU_EXPERT_S,
        }
    }

    /// CPU lane time of an expert of `bytes` with `tokens` routed tokens.
    pub fn cpu_s(&self, bytes: usize, tokens: u32) -> f64 {
        bytes as f64 / self.cpu_bytes_per_s + tokens as f64 * self.cpu_token_s
    }

    /// Host-to-device time of one expert's bytes.
    pub fn pcie_s(&self, bytes: usize) -> f64 {
        bytes as f64 / self.pcie_bytes_per_s
    }

    /// Host time to stage one expert before its copy (delays the CPU lane).
    pub fn stage_s(&self, bytes: usize) -> f64 {
        bytes as f64 / self.stage_bytes_per_s
    }
}

/// A cold expert of a layer call and the tokens routed to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertLoad {
    pub expert: u32,
    pub tokens: u32,
}

/// Sort `loads` by tokens (most first, then expert id) and return how many of the first go to
/// the GPU. `On`: all of them ([`plan_issue`] bounds them). `Auto`: greedily, while moving one
/// more expert lowers the layer's finish time `stage + max(cpu lane, GPU lane)`, at most
/// `max_experts`. The CPU lane and the GPU lane run at once; staging runs before the CPU lane;
/// the GPU lane is the layer's `hot_experts` cached experts' GEMMs beside the copies, then the
/// fetched experts' GEMMs (`gpu_expert_s` each): while the hot lane is busy a cold expert is
/// cheaper where it is. `Off` and `Cpu`: none.
pub fn assign(
    loads: &mut [ExpertLoad],
    bytes: usize,
    costs: &PostFetchCosts,
    mode: PostFetchMode,
    (max_experts, hot_experts): (usize, usize),
) -> usize {
    loads.sort_unstable_by(|a, b| b.tokens.cmp(&a.tokens).then(a.expert.cmp(&b.expert)));
    match mode {
        PostFetchMode::Off | PostFetchMode::Cpu => return 0,
        PostFetchMode::On => return loads.len(),
        PostFetchMode::Auto => {}
    }
    let hot_s = hot_experts as f64 * costs.gpu_expert_s;
    let gpu = |n: usize| f64::max(hot_s, n as f64 * costs.pcie_s(bytes)) + n as f64 * costs.gpu_expert_s;
    let mut cpu: f64 = loads.iter().map(|x| costs.cpu_s(bytes, x.tokens)).sum();
    let (mut stage, mut n) = (0.0, 0);
    for x in loads.iter().take(max_experts) {
        let now = stage + f64::max(cpu, gpu(n));
        let (s, c) = (stage + costs.stage_s(bytes), cpu - costs.cpu_s(bytes, x.tokens));
        if s + f64::max(c, gpu(n + 1)) >= now {
            break;
        }
        (stage, cpu, n) = (s, c, n + 1);
    }
    n
}

/// Why a chosen expert ran on the CPU after all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PostFetchMiss {
    /// Every slot of the scratchpad was taken (at issue).
    ScratchFull,
    /// `max_transfers` copies were in flight (at issue).
    TransfersBound,
    /// Its copy was still in flight when the CPU lane was done and `block_on_miss` is off.
    NotReady,
}

impl PostFetchMiss {
    pub const ALL: [PostFetchMiss; 3] =
        [PostFetchMiss::ScratchFull, PostFetchMiss::TransfersBound, PostFetchMiss::NotReady];

    pub fn name(self) -> &'static str {
        match self {
            PostFetchMiss::ScratchFull => "scratch_full",
            PostFetchMiss::TransfersBound => "transfers_bound",
            PostFetchMiss::NotReady => "not_ready",
        }
    }
}

/// How a layer's chosen experts are issued: the first `issue` are copied, the next
/// `scratch_full` found no slot and the last `transfers_bound` no room among the copies in
/// flight (both run on the CPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IssuePlan {
    pub issue: usize,
    pub scratch_full: usize,
    pub transfers_bound: usize,
}

/// Issue `chosen` experts into a scratchpad of `free_slots` free slots while `room` more copies may
/// be in flight. The host never waits here: waiting for room would delay the CPU lane, which
/// starts after the issue.
pub fn plan_issue(chosen: usize, free_slots: usize, room: usize) -> IssuePlan {
    let fit = chosen.min(free_slots);
    let issue = fit.min(room);
    IssuePlan { issue, scratch_full: chosen - fit, transfers_bound: fit - issue }
}

/// Where a fetched expert runs, asked when the CPU lane is done with its own experts (seed 001's
/// readiness query).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnUse {
    /// Its copy is complete: the GPU.
    Gpu,
    /// Its copy is in flight and `block_on_miss`: wait for it, then the GPU.
    Wait,
    /// Its copy is in flight and not `block_on_miss` (or it was never copied): the CPU.
    Cpu,
}

pub fn on_use(state: FetchState, block_on_miss: bool) -> OnUse {
    match state {
        FetchState::GpuReady => OnUse::Gpu,
        FetchState::CopyInFlight if block_on_miss => OnUse::Wait,
        FetchState::CopyInFlight | FetchState::CpuOnly => OnUse::Cpu,
    }
}

/// A scratchpad slot's expert: `CpuOnly` (nothing fetched), `CopyInFlight` (queued on a copy
/// stream, its event not yet complete), `GpuReady` (its copy is done). Nothing is cached across
/// calls or layers: the slots go back to `CpuOnly` when the next layer fetches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FetchState {
    CpuOnly,
    CopyInFlight,
    GpuReady,
}

/// A transition the state machine does not allow (a programming error, reported as such).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("post-fetch slot {slot}: {from:?} cannot become {to:?}")]
pub struct BadTransition {
    pub slot: usize,
    pub from: FetchState,
    pub to: FetchState,
}

/// Per slot state and the copies in flight, bounded by `max_in_flight`.
#[derive(Debug, Clone)]
pub struct TransferTracker {
    states: Vec<FetchState>,
    in_flight: Vec<usize>,
    max_in_flight: usize,
}

impl TransferTracker {
    pub fn new(n_slots: usize, max_in_flight: usize) -> TransferTracker {
        TransferTracker {
            states: vec![FetchState::CpuOnly; n_slots],
            in_flight: Vec::with_capacity(n_slots),
            max_in_flight: max_in_flight.max(1),
        }
    }

    pub fn state(&self, slot: usize) -> FetchState {
        self.states[slot]
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Copies that may still be queued.
    pub fn room(&self) -> usize {
        self.max_in_flight.saturating_sub(self.in_flight.len())
    }

    /// `CpuOnly -> CopyInFlight` (a slot reused before it was released is refused).
    pub fn start(&mut self, slot: usize) -> Result<(), BadTransition> {
        let from = self.states[slot];
        if from != FetchState::CpuOnly {
            return Err(BadTransition { slot, from, to: FetchState::CopyInFlight });
        }
        self.states[slot] = FetchState::CopyInFlight;
        self.in_flight.push(slot);
        Ok(())
    }

    /// `CopyInFlight -> GpuReady` for every slot in flight whose copy is `done` (any order).
    pub fn poll(&mut self, mut done: impl FnMut(usize) -> bool) {
        let states = &mut self.states;
        self.in_flight.retain(|&s| {
            let d = done(s);
            if d {
                states[s] = FetchState::GpuReady;
            }
            !d
        });
    }

    /// Slots `range` go back to `CpuOnly` (the next layer fetches); copies still in flight there
    /// are forgotten (the copy streams wait for them before writing the slots again).
    pub fn release(&mut self, range: std::ops::Range<usize>) {
        self.in_flight.retain(|s| !range.contains(s));
        self.states[range].fill(FetchState::CpuOnly);
    }
}

/// What Post-Fetch did, summed over calls (rendered as the perf JSON's `postfetch` object).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PostFetchTotals {
    /// Prefill layer calls planned.
    pub layer_calls: u64,
    /// Experts the cost model (or `on`) sent to the GPU.
    pub experts_chosen: u64,
    pub experts_fetched: u64,
    pub bytes_copied: u64,
    /// Copy-lane GPU time (first copy queued to last copy done, per layer call).
    pub copy_us: f64,
    /// Copy time not hidden: the least of the host's wait after its CPU lane and the compute
    /// stream's stall before the fetched GEMMs.
    pub exposed_us: f64,
    /// Per [`PostFetchMiss::ALL`].
    pub fallbacks: [u64; 3],
    /// Fetched experts whose copy was still in flight when the CPU lane was done, waited for
    /// (`block_on_miss`), and the host's time in those waits.
    pub block_waits: u64,
    pub block_wait_us: f64,
}

impl PostFetchTotals {
    /// Share of the copy time hidden behind compute (none before any copy).
    pub fn overlap(&self) -> Option<f64> {
        (self.copy_us > 0.0).then(|| (1.0 - self.exposed_us / self.copy_us).clamp(0.0, 1.0))
    }

    /// Fallbacks per chosen expert (none before any was chosen).
    pub fn fallback_rate(&self) -> Option<f64> {
        let n: u64 = self.fallbacks.iter().sum();
        (self.experts_chosen > 0).then(|| n as f64 / self.experts_chosen as f64)
    }

    pub fn add_fallbacks(&mut self, why: PostFetchMiss, n: usize) {
        self.fallbacks[why as usize] += n as u64;
    }

    /// The perf JSON object: `scratch_bytes` of VRAM beside a hot cache of `hot_bytes`.
    pub fn perf(
        &self,
        mode: PostFetchMode,
        scratch_bytes: usize,
        hot_bytes: usize,
        pcie: f64,
    ) -> PostFetchPerf {
        let reasons: BTreeMap<String, u64> =
            PostFetchMiss::ALL.iter().map(|m| (m.name().to_string(), self.fallbacks[*m as usize])).collect();
        PostFetchPerf {
            mode: mode.name().to_string(),
            layer_calls: self.layer_calls,
            experts_chosen: self.experts_chosen,
            experts_fetched: self.experts_fetched,
            bytes_copied: self.bytes_copied,
            copy_time_us: self.copy_us as u64,
            copy_exposed_us: self.exposed_us as u64,
            transfer_overlap: self.overlap(),
            fallbacks: self.fallbacks.iter().sum(),
            fallback_reasons: reasons,
            fallback_rate: self.fallback_rate(),
            block_waits: self.block_waits,
            block_wait_us: self.block_wait_us as u64,
            scratch_bytes: scratch_bytes as u64,
            hot_cache_bytes: hot_bytes as u64,
            vram_overhead: (hot_bytes > 0).then(|| scratch_bytes as f64 / hot_bytes as f64),
            pcie_bytes_per_s: pcie,
            copy_source: "staged".to_string(),
            register_error: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn costs() -> PostFetchCosts {
        // 1 MB experts: copy 1 ms, CPU read 1 ms + 0.1 ms a token, no staging, no GPU time
        PostFetchCosts {
            pcie_bytes_per_s: 1e9,
            cpu_bytes_per_s: 1e9,
            cpu_token_s: 1e-4,
            stage_bytes_per_s: f64::INFINITY,
            gpu_expert_s: 0.0,
        }
    }

    fn loads(tokens: &[u32]) -> Vec<ExpertLoad> {
        tokens.iter().enumerate().map(|(e, &t)| ExpertLoad { expert: e as u32, tokens: t }).collect()
    }

    fn experts(l: &[ExpertLoad]) -> Vec<u32> {
        l.iter().map(|x| x.expert).collect()
    }

    #[test]
    fn auto_moves_the_busiest_experts_until_the_lanes_balance() {
        // CPU costs 3, 2, 1.5, 1.1, 1.1 ms (sum 8.7); copies 1 ms each:
        // 1 -> max(5.7, 1); 2 -> max(3.7, 2); 3 -> max(2.2, 3) = 3 < 3.7; 4 -> max(1.1, 4) worse
        let mut l = loads(&[5, 20, 1, 10, 1]);
        let n = assign(&mut l, 1_000_000, &costs(), PostFetchMode::Auto, (64, 0));
        assert_eq!(n, 3);
        assert_eq!(experts(&l), [1, 3, 0, 2, 4]);
        // equal tokens: the lower expert id first, so the choice does not depend on input order
        let mut l = loads(&[7, 7, 9]);
        assign(&mut l, 1_000_000, &costs(), PostFetchMode::Auto, (64, 0));
        assert_eq!(experts(&l), [2, 0, 1]);
    }

    #[test]
    fn decode_splits_a_tokens_cold_experts_between_the_lanes() {
        // one token on 8 Q4_K_M experts of Qwen3-30B-A3B (2.86 MB), the configured CPU rates of
        // 16 threads (28.6 us of reading + 16.4 us of the prefill FLOP model an expert: 360 us
        // for all 8), the H200 machine's PCIe (54 GB/s), registered copies; n on the GPU:
        // max(CPU rest, n x 53 us + n x 3 us): 3 -> 225, 4 -> 224, 5 -> 280. The H200 run chose
        // 3 or 4 a layer (a Q6_K down matrix makes an expert larger).
        let costs = PostFetchCosts {
            pcie_bytes_per_s: 54e9,
            stage_bytes_per_s: f64::INFINITY,
            gpu_expert_s: DECODE_GPU_EXPERT_S,
            ..PostFetchCosts::configured(2048, 768, 16)
        };
        let mut l = loads(&[1; 8]);
        assert_eq!(assign(&mut l, 2_860_000, &costs, PostFetchMode::Auto, (64, 0)), 4);
    }

    #[test]
    fn auto_respects_the_expert_limit_and_staging() {
        let mut l = loads(&[5, 20, 1, 10, 1]);
        assert_eq!(assign(&mut l, 1_000_000, &costs(), PostFetchMode::Auto, (1, 0)), 1);
        assert_eq!(assign(&mut l, 1_000_000, &costs(), PostFetchMode::Auto, (0, 0)), 0);
        // staging at 1 GB/s puts 1 ms per expert on the host before the CPU lane:
        // 1 + max(5.7, 1) = 6.7; 2 + max(3.7, 2) = 5.7; 3 + max(2.2, 3) = 6 is worse
        let slow = PostFetchCosts { stage_bytes_per_s: 1e9, ..costs() };
        assert_eq!(assign(&mut l, 1_000_000, &slow, PostFetchMode::Auto, (64, 0)), 2);
        // a copy lane slower than the whole CPU lane: nothing moves
        let pcie = PostFetchCosts { pcie_bytes_per_s: 1e7, ..costs() };
        assert_eq!(assign(&mut l, 1_000_000, &pcie, PostFetchMode::Auto, (64, 0)), 0);
        // GPU time per fetched expert counts on the copy lane: 1 ms more per expert stops at 2
        // (1 -> max(5.7, 2); 2 -> max(3.7, 4) = 4 < 5.7; 3 -> max(2.2, 6) worse)
        let gpu = PostFetchCosts { gpu_expert_s: 1e-3, ..costs() };
        assert_eq!(assign(&mut l, 1_000_000, &gpu, PostFetchMode::Auto, (64, 0)), 2);
    }

    #[test]
    fn a_busy_hot_lane_keeps_cold_experts_on_the_cpu() {
        // CPU lane 8.7 ms as above; GPU lane: 10 hot experts at 0.5 ms = 5 ms beside the copies
        let busy = PostFetchCosts { gpu_expert_s: 5e-4, ..costs() };
        let mut l = loads(&[5, 20, 1, 10, 1]);
        // 1 -> max(5.7, max(5, 1) + 0.5) = 5.7 < 8.7; 2 -> max(3.7, 6) = 6 worse
        assert_eq!(assign(&mut l, 1_000_000, &busy, PostFetchMode::Auto, (64, 10)), 1);
        // a hot lane longer than the whole CPU lane: nothing moves
        assert_eq!(assign(&mut l, 1_000_000, &busy, PostFetchMode::Auto, (64, 20)), 0);
        // no hot lane (budget 0): as without the term, 1 -> max(5.7, 1.5), 2 -> max(3.7, 3), 3 -> max(2.2, 4.5) worse
        assert_eq!(assign(&mut l, 1_000_000, &busy, PostFetchMode::Auto, (64, 0)), 2);
    }

    #[test]
    fn on_takes_every_expert_and_off_and_cpu_none() {
        let mut l = loads(&[1, 1, 1]);
        assert_eq!(assign(&mut l, 1 << 30, &costs(), PostFetchMode::On, (0, 0)), 3);
        assert_eq!(assign(&mut l, 1, &costs(), PostFetchMode::Off, (64, 0)), 0);
        assert_eq!(assign(&mut l, 1, &costs(), PostFetchMode::Cpu, (64, 0)), 0);
        assert_eq!(assign(&mut [], 1, &costs(), PostFetchMode::Auto, (64, 0)), 0);
    }

    #[test]
    fn modes_parse_and_name_themselves() {
        for m in [PostFetchMode::Auto, PostFetchMode::On, PostFetchMode::Off, PostFetchMode::Cpu] {
            assert_eq!(m.name().parse::<PostFetchMode>(), Ok(m));
        }
        assert_eq!("yes".parse::<PostFetchMode>(), Err(BadPostFetchMode));
    }

    #[test]
    fn configured_costs_scale_with_threads() {
        let one = PostFetchCosts::configured(2048, 768, 1);
        let sixteen = PostFetchCosts::configured(2048, 768, 16);
        assert!((one.cpu_token_s / sixteen.cpu_token_s - 16.0).abs() < 1e-9);
        assert_eq!(one.stage_bytes_per_s, STAGE_BYTES_PER_S_PER_THREAD);
        let max = MAX_STAGE_THREADS as f64 * STAGE_BYTES_PER_S_PER_THREAD;
        assert_eq!(sixteen.stage_bytes_per_s, max);
        assert_eq!((stage_threads(0), stage_threads(3), stage_threads(64)), (1, 3, MAX_STAGE_THREADS));
        assert!(one.cpu_s(1 << 20, 2) > one.cpu_s(1 << 20, 1));
        assert!((one.pcie_s(1 << 20) - (1 << 20) as f64 / DEFAULT_PCIE_BYTES_PER_S).abs() < 1e-15);
    }

    #[test]
    fn the_scratchpad_fits_the_layer_with_the_most_cold_experts() {
        assert_eq!(fitted_slots(113, [64, 70, 12]), 70);
        assert_eq!(fitted_slots(40, [64, 70]), 40, "never more than configured");
        assert_eq!(fitted_slots(113, [0, 0]), 1, "all hot: one slot");
        assert_eq!(fitted_slots(113, []), 113, "no layers: as configured");
    }

    #[test]
    fn issue_plans_split_by_slots_then_room() {
        let p = |issue, scratch_full, transfers_bound| IssuePlan { issue, scratch_full, transfers_bound };
        assert_eq!(plan_issue(5, 8, 8), p(5, 0, 0));
        assert_eq!(plan_issue(5, 2, 8), p(2, 3, 0));
        assert_eq!(plan_issue(5, 8, 3), p(3, 0, 2));
        assert_eq!(plan_issue(9, 4, 1), p(1, 5, 3));
        assert_eq!(plan_issue(5, 0, 3), p(0, 5, 0));
        assert_eq!(plan_issue(0, 0, 0), p(0, 0, 0));
    }

    #[test]
    fn readiness_follows_seed_001() {
        assert_eq!(on_use(FetchState::GpuReady, true), OnUse::Gpu);
        assert_eq!(on_use(FetchState::GpuReady, false), OnUse::Gpu);
        assert_eq!(on_use(FetchState::CopyInFlight, true), OnUse::Wait);
        assert_eq!(on_use(FetchState::CopyInFlight, false), OnUse::Cpu);
        assert_eq!(on_use(FetchState::CpuOnly, true), OnUse::Cpu);
    }

    #[test]
    fn tracker_walks_cpu_only_in_flight_ready() {
        let mut t = TransferTracker::new(4, 2);
        assert_eq!(t.room(), 2);
        t.start(0).unwrap();
        t.start(1).unwrap();
        assert_eq!((t.room(), t.in_flight()), (0, 2));
        assert_eq!(t.state(1), FetchState::CopyInFlight);
        // a slot in flight cannot start again
        assert_eq!(
            t.start(1),
            Err(BadTransition { slot: 1, from: FetchState::CopyInFlight, to: FetchState::CopyInFlight })
        );
        t.poll(|s| s == 1);
        assert_eq!(
            (t.state(0), t.state(1), t.in_flight()),
            (FetchState::CopyInFlight, FetchState::GpuReady, 1)
        );
        t.poll(|_| true);
        assert_eq!((t.state(0), t.room()), (FetchState::GpuReady, 2));
        // ready slots are not reused until they are released
        assert!(t.start(0).is_err());
        t.start(2).unwrap();
        t.start(3).unwrap();
        // releasing slots forgets their copies in flight and frees their room
        t.release(2..4);
        assert_eq!(
            (t.state(2), t.state(3), t.in_flight(), t.room()),
            (FetchState::CpuOnly, FetchState::CpuOnly, 0, 2)
        );
        assert_eq!(t.state(0), FetchState::GpuReady, "slots outside the range are untouched");
        t.release(0..2);
        t.start(0).unwrap();
        // a bound of 0 still lets one copy through
        assert_eq!(TransferTracker::new(1, 0).room(), 1);
    }

    #[test]
    fn totals_report_the_seed_targets() {
        let mut t =
            PostFetchTotals { experts_chosen: 40, copy_us: 100.0, exposed_us: 20.0, ..Default::default() };
        t.add_fallbacks(PostFetchMiss::TransfersBound, 1);
        t.add_fallbacks(PostFetchMiss::NotReady, 1);
        assert!((t.overlap().unwrap() - 0.8).abs() < 1e-12);
        assert!((t.fallback_rate().unwrap() - 0.05).abs() < 1e-12);
        let p = t.perf(PostFetchMode::On, 100, 1000, 5e10);
        assert_eq!(p.fallbacks, 2);
        let reasons: Vec<(&str, u64)> = p.fallback_reasons.iter().map(|(k, &v)| (k.as_str(), v)).collect();
        assert_eq!(reasons, [("not_ready", 1), ("scratch_full", 0), ("transfers_bound", 1)]);
        assert_eq!(p.vram_overhead, Some(0.1));
        assert_eq!(PostFetchTotals::default().perf(PostFetchMode::Auto, 1, 0, 1.0).vram_overhead, None);
        assert_eq!(PostFetchTotals::default().overlap(), None);
        assert_eq!(PostFetchTotals::default().fallback_rate(), None);
        // exposure beyond the copy time clamps to no overlap
        assert_eq!(
            PostFetchTotals { copy_us: 1.0, exposed_us: 2.0, ..Default::default() }.overlap(),
            Some(0.0)
        );
    }
}
