//! The cold pool: a fixed set of pinned worker threads that run one cold-lane MoE job per call.
//!
//! A [`ColdJob`] is expert-major: each cold expert comes with the tokens routed to it and their
//! routing weights. A call has two kinds of work: gate/up + activation, which writes the
//! intermediate `h` of each expert, and the down projection, which reads it. Two schedules
//! (see [`ColdSchedule`]) order them.
//!
//! **Pipelined** (small jobs: decode and small batches, where the routed slots' partial outputs
//! fit in [`PIPELINED_MAX_PARTIAL`] floats): one unit space without a barrier, all gate/up units
//! (expert, 4 ff rows) of the experts that have tokens, then all down units (expert, 8 hidden
//! rows), both expert-major. A thread that reaches a down unit of expert `e` waits on `e`'s
//! readiness counter (gate/up units of `e` completed); since `e`'s gate/up units were handed
//! out long before, it almost never waits, so memory streams stay busy across the phase change.
//! Down units stream one expert's rows sequentially and store the weighted rows into a
//! per-slot partial buffer; per group of 64 hidden rows a counter collects the completed
//! (expert, row block) units and the thread that completes a group adds the partials into `out`
//! in expert order: the same additions in the same order as the phased schedule, so both give
//! bit-identical results, whatever thread computed what. Claims never mix gate/up and down
//! units, their guided length follows the units left in their own segment, and they are capped
//! at [`PIPELINED_MAX_CLAIM`] units, so that the last experts' `h` is complete soon after its
//! units were handed out.
//!
//! **Phased** (large jobs, e.g. prefill), two phases separated by a barrier:
//! 1. gate/up + activation: the (expert, unit of 4 ff rows) space of all experts that have
//!    tokens is split by rows, not by expert, so every thread streams weights at once even
//!    when a single expert carries all the work; each thread writes its rows of the
//!    intermediate `h` into a pool-owned scratch buffer. A unit costs its expert's tokens (plus
//!    a constant for streaming its weight rows), so with skewed routing units differ by 100x:
//!    experts are handed out most tokens first and claims are guided by remaining *cost*, not
//!    units (see `claim_units_by_cost`), so the last claims are cheap and threads reach the
//!    barrier together;
//! 2. down + weighted accumulation: the hidden output rows (units of 8) are split and each
//!    thread walks all experts for the rows it claimed, so threads own disjoint output rows (no
//!    locks, no atomics on data), and a token routed to several experts is accumulated by one
//!    thread per row.
//!
//! Both schedules hand out contiguous unit ranges by guided self-scheduling: one atomic counter
//! per unit space, each claim takes `remaining / (2 * threads)` units (at least one). Early claims
//! are long (weights stream sequentially, the next-block prefetch runs on), late claims are
//! short, so the split adapts to the number of cold slots and experts and to a thread that
//! was slowed down (another process on its core) without any per-token allocation or lock.
//!
//! The caller's thread works as thread 0; the other threads are spawned once and pinned to
//! cores (pinning failure is ignored). Dispatch is one epoch bump per call; workers spin
//! briefly and then sleep on a condvar. Shared counters sit on their own 128-byte lines (two
//! cache lines: the adjacent-line prefetcher pairs them). The scratch buffers and counter
//! arrays only grow, so steady-state calls do not allocate.

use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::KernelError;
use crate::ffn::{
    amx_pack, amx_packed_words, down_store_unchecked, down_unchecked, gate_up_unchecked, ROW_BLOCK,
};
use crate::q8::{quantize_raw, DecodeActivations, Q8Activations, Q8RowIds, Q8Rows, Q8_BLOCK, Q8_MAX_TOKENS};
use crate::scalar::dot_row;
use crate::simd::SimdLevel;
use crate::weights::{Activation, ExpertWeights};

/// ff rows per phase-1 work unit: gate and up rows interleave into one 8-row tile block.
const FF_ROWS_PER_UNIT: usize = ROW_BLOCK / 2;
/// How long an idle worker spins before it sleeps. The GPU engine's partial-hit decode calls the
/// pool only in the layers that route to a cold expert, often a few layers (hundreds of us)
/// apart: a worker that went to sleep in between is woken through the condvar, and the call
/// waits for the slowest waker. On the H100 machine (4-layer Q4_K_M file, half its experts hot,
/// 93% hit) 200 us gave tg128 1426 / 1390 and a cold lane of 39-42 us a layer, 2 ms 1468 / 1466
/// and 32 us, 20 ms no better (1472 / 1383). The cost: up to this long of spinning on the pool's
/// own cores after the last call.
const IDLE_SPIN: Duration = Duration::from_millis(2);
/// Row blocks of one reduce group of the pipelined schedule (64 hidden rows).
const REDUCE_GROUP_BLOCKS: usize = 8;
/// Longest claim of the pipelined schedule, in units (64 gate/up units are 256 ff rows of gate
/// and up, 2 MiB of BF16 weights at hidden 2048; 64 down units are 512 hidden rows, 768 KiB at
/// ff 768): long sequential streams early on, while the per-segment guided length keeps the
/// last experts' gate/up claims short, so their `h` is complete before their down units come.
pub const PIPELINED_MAX_CLAIM: usize = 64;
/// [`ColdSchedule::Auto`] picks the pipelined schedule when the partial outputs (routed slots x
/// hidden f32) are at most this many values (4 MiB).
pub const PIPELINED_MAX_PARTIAL: usize = 1 << 20;
/// Phased phase 1: cost of one (expert, ff unit) is the expert's tokens plus this many tokens'
/// worth for streaming the unit's weight rows (a thin tile is dominated by its weight loads).
const UNIT_WEIGHT_COST: u64 = 4;

/// How [`ColdPool::run`] orders a job's work; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ColdSchedule {
    /// Pipelined when the partial outputs fit in [`PIPELINED_MAX_PARTIAL`], else phased.
    Auto,
    /// Gate/up of all experts, a barrier, then down split by hidden rows.
    Phased,
    /// One barrier-free unit space with per-expert readiness counters.
    Pipelined,
}

impl ColdSchedule {
    /// Parses `auto`, `phased` or `pipelined`.
    pub fn parse(name: &str) -> Option<ColdSchedule> {
        match name.trim().to_ascii_lowercase().as_str() {
            "auto" => Some(ColdSchedule::Auto),
            "phased" => Some(ColdSchedule::Phased),
            "pipelined" => Some(ColdSchedule::Pipelined),
            _ => None,
        }
    }
}

/// A value on its own 128 bytes, so that writers of neighbouring counters do not share lines.
#[repr(align(128))]
#[derive(Default)]
struct Padded<T>(T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// One cold expert of a job: its weights and the tokens routed to it.
#[derive(Debug, Clone, Copy)]
pub struct ColdExpertWork<'a> {
    pub weights: ExpertWeights<'a>,
    /// Rows of `ColdJob::x` (and of `out`) routed to this expert; may repeat across experts.
    pub token_idx: &'a [u32],
    /// Routing weight of each token in `token_idx`.
    pub token_weight: &'a [f32],
}

/// One cold-lane MoE layer call: `out[t] += Σ_e w_{e,t} · FFN_e(x_t)` over the listed experts.
#[derive(Debug, Clone, Copy)]
pub struct ColdJob<'a> {
    pub level: SimdLevel,
    /// Activations of the one-token decode tiles: [`DecodeActivations::Q8`] (or `Auto`, for the
    /// types it picks) quantises `x` (the rows of experts with one token) and those experts' `h`
    /// to 8 bits once per call and runs the VNNI tiles where the level has VNNI; F32 (or no
    /// VNNI) keeps f32 activations.
    pub activations: DecodeActivations,
    pub act: Activation,
    pub hidden: usize,
    pub ff: usize,
    /// `n_tokens x hidden` activations, row-major.
    pub x: &'a [f32],
    pub experts: &'a [ColdExpertWork<'a>],
}

impl<'a> ColdJob<'a> {
    /// Checks shapes and token indices against an output of `out_len` values; returns the
    /// number of token rows.
    pub fn validate(&self, out_len: usize) -> Result<usize, KernelError> {
        self.level.ensure_supported()?;
        if self.hidden == 0 || !self.x.len().is_multiple_of(self.hidden) {
            return Err(KernelError::ShapeMismatch {
                what: "x (tokens x hidden)",
                expected: self.hidden,
                actual: self.x.len(),
            });
        }
        if out_len != self.x.len() {
            return Err(KernelError::ShapeMismatch {
                what: "out (tokens x hidden)",
                expected: self.x.len(),
                actual: out_len,
            });
        }
        let n_tokens = self.x.len() / self.hidden;
        for expert in self.experts {
            let w = &expert.weights;
            if w.hidden != self.hidden || w.ff != self.ff {
                return Err(KernelError::ShapeMismatch {
                    what: "expert hidden x ff",
                    expected: self.hidden * self.ff,
                    actual: w.hidden * w.ff,
                });
            }
            w.validate()?;
            if expert.token_weight.len() != expert.token_idx.len() {
                return Err(KernelError::ShapeMismatch {
                    what: "token_weight",
                    expected: expert.token_idx.len(),
                    actual: expert.token_weight.len(),
                });
            }
            if let Some(&bad) = expert.token_idx.iter().find(|&&t| t as usize >= n_tokens) {
                return Err(KernelError::TokenIndexOutOfBounds { index: bad as usize, n_tokens });
            }
        }
        Ok(n_tokens)
    }

    /// Weight bytes a call reads: all three matrices of every expert that has tokens.
    pub fn weight_bytes(&self) -> usize {
        self.experts.iter().filter(|e| !e.token_idx.is_empty()).map(|e| e.weights.total_bytes()).sum()
    }

    /// Floating-point operations of a call: `2 * 3 * hidden * ff` per routed (token, expert).
    pub fn flops(&self) -> f64 {
        let slots: usize = self.experts.iter().map(|e| e.token_idx.len()).sum();
        6.0 * self.hidden as f64 * self.ff as f64 * slots as f64
    }
}

/// What one dispatch asks every thread to do. It lives on the dispatcher's stack for one call,
/// so the padded counters of the cold variant cost no allocation.
#[allow(clippy::large_enum_variant)]
enum Task<'t> {
    Cold(ColdTask<'t>),
    Broadcast(&'t (dyn Fn(usize, usize) + Sync)),
}

/// Base pointers `(qs, d, sum)` of the pool's quantised `x` and `h` rows (see `ColdTask::q8`).
#[derive(Clone, Copy)]
struct Q8Scratch {
    x: (*mut i8, *mut f32, *mut f32),
    h: (*mut i8, *mut f32, *mut f32),
}

/// Whether `expert`'s gate/up and its down take 8-bit activations under `activations` at
/// `level` ([`DecodeActivations::takes`], over the expert's tokens).
fn q8_expert(level: SimdLevel, activations: DecodeActivations, expert: &ColdExpertWork<'_>) -> (bool, bool) {
    let takes = |dtype| activations.takes(level, dtype, expert.token_idx.len());
    (takes(expert.weights.dtype), takes(expert.weights.down_dtype))
}

/// Rows of a quantised buffer (base pointers `base`, rows of `cols` values) that `ids` name.
fn q8_rows(base: (*mut i8, *mut f32, *mut f32), cols: usize, ids: Q8RowIds<'_>) -> Q8Rows<'_> {
    Q8Rows { base: (base.0.cast_const(), base.1.cast_const(), base.2.cast_const()), cols, ids }
}

impl ColdTask<'_> {
    /// The quantised `x` rows of active expert `a`'s tokens (rows by token id), if its gate/up
    /// run 8-bit (few tokens, a type the setting takes 8-bit).
    fn q8_x(&self, a: usize) -> Option<Q8Rows<'_>> {
        let expert = &self.job.experts[self.active[a]];
        let q8 = self.q8.filter(|_| q8_expert(self.job.level, self.job.activations, expert).0)?;
        Some(q8_rows(q8.x, self.job.hidden, Q8RowIds::Listed(expert.token_idx)))
    }

    /// The quantised `h` rows of active expert `a`'s slots, if its down runs 8-bit.
    fn q8_h(&self, a: usize) -> Option<Q8Rows<'_>> {
        let expert = &self.job.experts[self.active[a]];
        let q8 = self.q8.filter(|_| q8_expert(self.job.level, self.job.activations, expert).1)?;
        Some(q8_rows(q8.h, self.job.ff, Q8RowIds::From(self.slot_start[a])))
    }

    /// Active expert `a`'s packed `h` for the AMX tiles, if its down runs on them. Complete once
    /// its gate/up is (phased: after the barrier; pipelined: after the readiness count).
    fn amx_h(&self, a: usize) -> Option<&[u32]> {
        let words = self.amx_h_at[a].clone()?;
        // SAFETY: `prepare_amx_h` sized the buffer for every expert's range; the words are only
        // read once the completing thread has packed them (see above).
        Some(unsafe { std::slice::from_raw_parts(self.amx_h.add(words.start), words.len()) })
    }

    /// Counts `n` completed gate/up units of active expert `a`; the thread that completes them
    /// quantises its `h` (8-bit, one token) or packs it for the AMX tiles and, pipelined, adds
    /// one more to say `h` is ready.
    fn gate_up_done(&self, a: usize, n: usize) {
        let ff_units = self.job.ff.div_ceil(FF_ROWS_PER_UNIT);
        if !self.pipelined && self.q8.is_none() && !self.any_amx_h {
            return;
        }
        // AcqRel: releases this thread's rows of h; the completing thread acquires all of them.
        if self.h_done[a].fetch_add(n, Ordering::AcqRel) + n != ff_units {
            return;
        }
        if let Some(rows) = self.q8_h(a) {
            let (ff, n_tokens) = (self.job.ff, self.job.experts[self.active[a]].token_idx.len());
            for t in 0..n_tokens {
                let row = rows.row(t);
                // SAFETY: all gate/up units of expert a are complete (acquired above), so its h
                // slots (`ff` f32 each in the scratch) are written and only read from now on; the
                // quantised slot rows lie in `q8_h` (reserved slots x ff in `prepare_q8`) and only
                // this thread, the one that completed the expert, writes them.
                unsafe {
                    quantize_raw(
                        self.h_scratch.add((self.slot_start[a] + t) * ff),
                        ff,
                        row.qs as *mut i8,
                        row.d as *mut f32,
                        row.sum as *mut f32,
                    )
                };
            }
        }
        if let Some(words) = self.amx_h_at[a].clone() {
            let (ff, n_tokens) = (self.job.ff, self.job.experts[self.active[a]].token_idx.len());
            // SAFETY: as for the quantised h above (complete, acquired); the packed words of
            // expert a lie in the buffer `prepare_amx_h` sized, written only by this thread; the
            // level is AMX (the words were reserved for it).
            unsafe {
                let out = std::slice::from_raw_parts_mut(self.amx_h.add(words.start), words.len());
                amx_pack(self.job.level, n_tokens, ff, self.h_scratch.add(self.slot_start[a] * ff), out);
            }
        }
        if self.pipelined {
            // Release: publishes the quantised h to the down units of expert a.
            self.h_done[a].fetch_add(1, Ordering::Release);
        }
    }
}

struct ColdTask<'t> {
    job: &'t ColdJob<'t>,
    pipelined: bool,
    /// Threads that take work (the first ones, thread 0 included); the others only keep the
    /// phased schedule's barrier.
    participants: usize,
    out: *mut f32,
    h_scratch: *mut f32,
    /// Indices (into `job.experts`) of the experts that have tokens, in order.
    active: &'t [usize],
    /// First routed slot of each active expert: its `h` starts at `slot * ff` of the scratch,
    /// its partial outputs (pipelined) at `slot * hidden`.
    slot_start: &'t [usize],
    /// Phased: active expert positions in phase-1 order (most tokens first).
    gate_up_order: &'t [usize],
    /// Phased: cost of the phase-1 units before each entry of `gate_up_order` (one more entry:
    /// the total); an expert's units each cost its tokens + [`UNIT_WEIGHT_COST`].
    gate_up_cost: &'t [u64],
    /// Pipelined: weighted down rows of every slot (`slots x hidden`).
    partial: *mut f32,
    /// Active expert `a`'s `h` packed for the AMX tiles at the words `amx_h_at[a]` of `amx_h`
    /// (written by the thread that completes its gate/up, read by all its down calls); `None`:
    /// its down does not run on the tiles.
    amx_h: *mut u32,
    amx_h_at: &'t [Option<Range<usize>>],
    /// Whether any active expert's `h` is packed (the phased gate/up then counts its units).
    any_amx_h: bool,
    /// Gate/up units completed per active expert (pipelined; phased only when `q8` or `amx_h`); pipelined,
    /// the thread that completes them adds one more once `h` is quantised (or right away).
    h_done: &'t [Padded<AtomicUsize>],
    /// 8-bit activations ([`ColdJob::activations`] Q8 on a VNNI level): the quantised rows of
    /// `x` (`n_tokens x hidden`, those of one-token experts written) and of `h` (`slots x ff`,
    /// the slots of one-token experts, written by the thread that completes their gate/up).
    q8: Option<Q8Scratch>,
    /// Pipelined: (expert, row block) down units completed per reduce group.
    group_done: &'t [Padded<AtomicUsize>],
    /// Next unclaimed unit: phase 1 (phased) or the whole unit space (pipelined).
    next_gate_up_unit: Padded<AtomicUsize>,
    /// Next unclaimed phase-2 unit (row block of the hidden output rows; phased only).
    next_down_unit: Padded<AtomicUsize>,
}

/// Claims the next range of at most `max_len` units by guided self-scheduling; `None` when all
/// are claimed. A claim does not cross `boundary`, and its length is guided by the units left
/// before `boundary` (or `total` past it), so claims shrink towards the end of each segment.
fn claim_units(
    next: &AtomicUsize,
    total: usize,
    boundary: usize,
    n_threads: usize,
    max_len: usize,
) -> Option<Range<usize>> {
    let mut start = next.load(Ordering::Relaxed);
    loop {
        if start >= total {
            return None;
        }
        let segment_end = if start < boundary { boundary } else { total };
        let len = ((segment_end - start) / (2 * n_threads)).clamp(1, max_len);
        match next.compare_exchange_weak(start, start + len, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return Some(start..start + len),
            Err(current) => start = current,
        }
    }
}

/// A sense-reversing spin barrier that yields the CPU when it waits long.
struct SpinBarrier {
    arrived: AtomicUsize,
    generation: AtomicUsize,
    n_threads: usize,
}

impl SpinBarrier {
    fn wait(&self) {
        let generation = self.generation.load(Ordering::Acquire);
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.n_threads {
            self.arrived.store(0, Ordering::Relaxed);
            self.generation.fetch_add(1, Ordering::AcqRel);
        } else {
            let mut spins = 0u32;
            while self.generation.load(Ordering::Acquire) == generation {
                backoff(&mut spins);
            }
        }
    }
}

fn backoff(spins: &mut u32) {
    *spins += 1;
    if *spins < 4096 {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

struct Shared {
    epoch: Padded<AtomicU64>,
    task: AtomicPtr<()>,
    workers_done: Padded<AtomicUsize>,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    /// Set by [`ColdPool::park_workers`]: idle workers stop spinning and sleep until the next
    /// dispatch (which clears it).
    park_hint: AtomicBool,
    barrier: Padded<SpinBarrier>,
    sleep_lock: Mutex<()>,
    wake: Condvar,
    n_threads: usize,
}

/// Fixed pool of pinned threads for cold-lane expert jobs. See the module docs.
pub struct ColdPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    h_scratch: Vec<f32>,
    /// Active experts' `h` packed for the AMX tiles (expert `a` at the words `amx_h_at[a]`).
    amx_h: Vec<u32>,
    amx_h_at: Vec<Option<Range<usize>>>,
    q8_x: Q8Activations,
    q8_h: Q8Activations,
    partial: Vec<f32>,
    active: Vec<usize>,
    slot_start: Vec<usize>,
    gate_up_order: Vec<usize>,
    gate_up_cost: Vec<u64>,
    h_done: Vec<Padded<AtomicUsize>>,
    group_done: Vec<Padded<AtomicUsize>>,
    schedule: ColdSchedule,
    pinned_cpus: Vec<Option<usize>>,
}

/// The most threads a pool may have (every thread count the CLI accepts is checked against it;
/// `moe_lanes::threads::MAX_COLD_THREADS` is at most this).
pub const MAX_POOL_THREADS: usize = 256;

impl ColdPool {
    /// Spawns `n_threads - 1` workers (the caller is thread 0), pinned to distinct cores of the
    /// process's CPU set where possible. `n_threads == 0` is treated as 1. Panics where
    /// [`ColdPool::try_new`] fails.
    pub fn new(n_threads: usize) -> ColdPool {
        ColdPool::try_new(n_threads).expect("starting the cold pool")
    }

    /// [`ColdPool::new`], with more than [`MAX_POOL_THREADS`] threads or a thread the system
    /// refuses as an error (the workers already started are stopped).
    pub fn try_new(n_threads: usize) -> Result<ColdPool, KernelError> {
        let n_threads = n_threads.max(1);
        if n_threads > MAX_POOL_THREADS {
            return Err(KernelError::InvalidOption(format!(
                "{n_threads} pool threads: at most {MAX_POOL_THREADS}"
            )));
        }
        let shared = Arc::new(Shared {
            epoch: Padded(AtomicU64::new(0)),
            task: AtomicPtr::new(std::ptr::null_mut()),
            workers_done: Padded(AtomicUsize::new(0)),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            park_hint: AtomicBool::new(false),
            barrier: Padded(SpinBarrier {
                arrived: AtomicUsize::new(0),
                generation: AtomicUsize::new(0),
                n_threads,
            }),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
            n_threads,
        });
        let cpus = allowed_cpus();
        let mut workers = Vec::with_capacity(n_threads - 1);
        let mut pinned_cpus = vec![None];
        for index in 1..n_threads {
            // Thread 0 (the caller) is left unpinned on the first CPU; workers take the next ones.
            let cpu = if cpus.is_empty() { None } else { Some(cpus[index % cpus.len()]) };
            pinned_cpus.push(cpu);
            let worker_shared = Arc::clone(&shared);
            let spawned = std::thread::Builder::new()
                .name(format!("moe-cold-{index}"))
                .spawn(move || worker_main(worker_shared, index, cpu));
            match spawned {
                Ok(handle) => workers.push(handle),
                Err(source) => {
                    stop_workers(&shared, workers);
                    return Err(KernelError::Spawn { index, n_threads, reason: source.to_string() });
                }
            }
        }
        let schedule = ColdSchedule::Auto;
        Ok(ColdPool {
            shared,
            workers,
            h_scratch: Vec::new(),
            amx_h: Vec::new(),
            amx_h_at: Vec::new(),
            q8_x: Q8Activations::new(),
            q8_h: Q8Activations::new(),
            partial: Vec::new(),
            active: Vec::new(),
            slot_start: Vec::new(),
            gate_up_order: Vec::new(),
            gate_up_cost: Vec::new(),
            h_done: Vec::new(),
            group_done: Vec::new(),
            schedule,
            pinned_cpus,
        })
    }

    /// The schedule used by [`ColdPool::run`] (default `Auto`; the caller may set another).
    pub fn schedule(&self) -> ColdSchedule {
        self.schedule
    }

    /// Sets the schedule; results are the same bits under every schedule.
    pub fn set_schedule(&mut self, schedule: ColdSchedule) {
        self.schedule = schedule;
    }

    /// Threads working on each call, the caller included.
    pub fn n_threads(&self) -> usize {
        self.shared.n_threads
    }

    /// CPU each thread asked to be pinned to (`None` for the unpinned caller thread 0).
    pub fn pinned_cpus(&self) -> &[Option<usize>] {
        &self.pinned_cpus
    }

    /// Runs `job`, accumulating into `out` (`n_tokens x hidden`, `+=`).
    pub fn run(&mut self, job: &ColdJob<'_>, out: &mut [f32]) -> Result<(), KernelError> {
        self.run_on(self.n_threads(), job, out)
    }

    /// [`ColdPool::run`] on the first `participants` threads only (clamped to 1..=`n_threads`;
    /// the caller is one of them): a pool shared with other work (the CPU pipeline's dense
    /// stage) can give the cold lane fewer threads than it has. The result is the same bits for
    /// any count.
    pub fn run_on(
        &mut self,
        participants: usize,
        job: &ColdJob<'_>,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        job.validate(out.len())?;
        // Lay out h (and the partials): active expert a's tokens x ff block at slot_start[a] * ff.
        self.active.clear();
        self.slot_start.clear();
        let mut slots = 0;
        for (index, expert) in job.experts.iter().enumerate() {
            if !expert.token_idx.is_empty() {
                self.active.push(index);
                self.slot_start.push(slots);
                slots += expert.token_idx.len();
            }
        }
        if self.h_scratch.len() < slots * job.ff {
            self.h_scratch.resize(slots * job.ff, 0.0);
        }
        let pipelined = match self.schedule {
            ColdSchedule::Auto => slots * job.hidden <= PIPELINED_MAX_PARTIAL,
            ColdSchedule::Phased => false,
            ColdSchedule::Pipelined => true,
        };
        self.gate_up_order.clear();
        self.gate_up_cost.clear();
        if !pipelined {
            // Phase 1 hands out the most expensive experts' units first and sizes claims by
            // cost, so the last claims are cheap whatever the routing skew. The order only
            // changes who computes which rows of h, never the values or the accumulation order.
            let n_tokens_of = |a: usize| job.experts[self.active[a]].token_idx.len();
            self.gate_up_order.extend(0..self.active.len());
            self.gate_up_order.sort_unstable_by_key(|&a| (std::cmp::Reverse(n_tokens_of(a)), a));
            let units_per_expert = job.ff.div_ceil(FF_ROWS_PER_UNIT) as u64;
            let mut cost = 0u64;
            self.gate_up_cost.push(0);
            for &a in &self.gate_up_order {
                cost += units_per_expert * (n_tokens_of(a) as u64 + UNIT_WEIGHT_COST);
                self.gate_up_cost.push(cost);
            }
        }
        let q8 = self.prepare_q8(job, slots)?;
        self.prepare_amx_h(job, q8.is_some());
        let n_groups =
            if pipelined { job.hidden.div_ceil(ROW_BLOCK).div_ceil(REDUCE_GROUP_BLOCKS) } else { 0 };
        if pipelined && self.partial.len() < slots * job.hidden {
            self.partial.resize(slots * job.hidden, 0.0);
        }
        if self.h_done.len() < self.active.len() {
            self.h_done.resize_with(self.active.len(), Padded::default);
        }
        if self.group_done.len() < n_groups {
            self.group_done.resize_with(n_groups, Padded::default);
        }
        // Exclusive access here; the epoch bump in dispatch publishes the zeros.
        for counter in self.h_done[..self.active.len()].iter_mut().chain(&mut self.group_done[..n_groups]) {
            *counter.0.get_mut() = 0;
        }
        let task = Task::Cold(ColdTask {
            job,
            pipelined,
            participants: participants.clamp(1, self.n_threads()),
            out: out.as_mut_ptr(),
            h_scratch: self.h_scratch.as_mut_ptr(),
            amx_h: self.amx_h.as_mut_ptr(),
            amx_h_at: &self.amx_h_at,
            any_amx_h: self.amx_h_at.iter().any(Option::is_some),
            active: &self.active,
            slot_start: &self.slot_start,
            gate_up_order: &self.gate_up_order,
            gate_up_cost: &self.gate_up_cost,
            partial: self.partial.as_mut_ptr(),
            h_done: &self.h_done,
            q8,
            group_done: &self.group_done,
            next_gate_up_unit: Padded(AtomicUsize::new(0)),
            next_down_unit: Padded(AtomicUsize::new(0)),
        });
        dispatch(&self.shared, &task)
    }

    /// Room for the packed `h` of every active expert whose down runs on the AMX tiles (the
    /// level is AMX, the weights BF16 or quantised, 8 or more tokens): packed once, read by all its
    /// down calls.
    fn prepare_amx_h(&mut self, job: &ColdJob<'_>, q8: bool) {
        self.amx_h_at.clear();
        let mut words = 0;
        let activations = job.activations.at(job.level);
        for &e in &self.active {
            let expert = &job.experts[e];
            // a down that takes 8-bit tokens runs the VNNI tiles, not AMX's
            let n = match q8 && q8_expert(job.level, activations, expert).1 {
                true => None,
                false => {
                    amx_packed_words(job.level, expert.weights.down_dtype, expert.token_idx.len(), job.ff)
                }
            };
            self.amx_h_at.push(n.map(|n| words..words + n));
            words += n.unwrap_or(0);
        }
        if self.amx_h.len() < words {
            self.amx_h.resize(words, 0);
        }
    }

    /// For 8-bit activations ([`ColdJob::activations`] Q8 or Auto on a VNNI level, and an
    /// expert that takes them): room for the quantised `x` and `h` rows, and the rows of `x`
    /// that few-token experts read quantised (each once); `None` when nothing runs 8-bit.
    fn prepare_q8(&mut self, job: &ColdJob<'_>, slots: usize) -> Result<Option<Q8Scratch>, KernelError> {
        let activations = job.activations.at(job.level);
        let uses = |e: &ColdExpertWork<'_>| q8_expert(job.level, activations, e);
        if !job.experts.iter().any(|e| uses(e) != (false, false))
            || !job.hidden.is_multiple_of(Q8_BLOCK)
            || !job.ff.is_multiple_of(Q8_BLOCK)
        {
            return Ok(None);
        }
        let n_tokens = job.x.len() / job.hidden;
        self.q8_x.reserve_rows(n_tokens, job.hidden)?;
        self.q8_h.reserve_rows(slots, job.ff)?;
        if n_tokens > Q8_MAX_TOKENS && job.experts.iter().any(|e| uses(e).0) {
            // A prefill whose gate/up take 8 bits: every row once (most are read by several experts).
            for t in 0..n_tokens {
                self.q8_x.quantize_row(t, &job.x[t * job.hidden..][..job.hidden]);
            }
        } else {
            // A small cache of rows done (a row quantised twice gives the same bytes).
            let mut done = [usize::MAX; 8];
            for expert in job.experts.iter().filter(|e| uses(e).0) {
                for &t in expert.token_idx {
                    let t = t as usize;
                    if done.contains(&t) {
                        continue;
                    }
                    done[t % done.len()] = t;
                    self.q8_x.quantize_row(t, &job.x[t * job.hidden..][..job.hidden]);
                }
            }
        }
        let (x, h) = (self.q8_x.raw_mut(), self.q8_h.raw_mut());
        Ok(Some(Q8Scratch { x, h }))
    }

    /// Runs `f(thread_index, n_threads)` once on every pool thread (the caller is index 0) and
    /// returns when all are done. Used by the bench for bandwidth probes on the same threads.
    pub fn broadcast(&mut self, f: &(dyn Fn(usize, usize) + Sync)) -> Result<(), KernelError> {
        dispatch(&self.shared, &Task::Broadcast(f))
    }

    /// Tells idle workers to sleep now instead of spinning for the next call: for a caller that
    /// hands the cores to other threads (the pipeline's lanes) until its next dispatch.
    pub fn park_workers(&self) {
        self.shared.park_hint.store(true, Ordering::Relaxed);
    }

    /// Single-thread scalar oracle for [`ColdPool::run`]: plain loops over experts, tokens and
    /// rows with sequential f32 dot products, independent of the tiled kernels.
    pub fn run_reference(job: &ColdJob<'_>, out: &mut [f32]) -> Result<(), KernelError> {
        job.validate(out.len())?;
        let (hidden, ff) = (job.hidden, job.ff);
        let mut h = vec![0.0f32; ff];
        for expert in job.experts {
            let w = &expert.weights;
            let (gate_row_bytes, down_row_bytes) = (w.dtype.row_bytes(hidden), w.down_dtype.row_bytes(ff));
            for (&token, &token_weight) in expert.token_idx.iter().zip(expert.token_weight) {
                let x = &job.x[token as usize * hidden..][..hidden];
                let bias = w.bias;
                for (k, hk) in h.iter_mut().enumerate() {
                    let gate = dot_row(w.dtype, &w.gate[k * gate_row_bytes..][..gate_row_bytes], x);
                    let up = dot_row(w.dtype, &w.up[k * gate_row_bytes..][..gate_row_bytes], x);
                    let (gate, up) = bias.map_or((gate, up), |b| (gate + b.gate[k], up + b.up[k]));
                    *hk = job.act.gated(gate, up);
                }
                let out_row = &mut out[token as usize * hidden..][..hidden];
                for (row, o) in out_row.iter_mut().enumerate() {
                    let y = dot_row(w.down_dtype, &w.down[row * down_row_bytes..][..down_row_bytes], &h);
                    *o += token_weight * bias.map_or(y, |b| y + b.down[row]);
                }
            }
        }
        Ok(())
    }
}

/// Publishes `task` to the workers, runs thread 0's share and waits for all workers.
fn dispatch(shared: &Shared, task: &Task<'_>) -> Result<(), KernelError> {
    shared.panicked.store(false, Ordering::Relaxed);
    shared.park_hint.store(false, Ordering::Relaxed);
    if shared.n_threads > 1 {
        shared.workers_done.store(0, Ordering::Relaxed);
        shared.task.store(task as *const Task<'_> as *mut (), Ordering::Relaxed);
        shared.epoch.fetch_add(1, Ordering::AcqRel);
        // Take the lock so a worker between its epoch check and its wait cannot miss this.
        drop(shared.sleep_lock.lock().unwrap_or_else(|poisoned| poisoned.into_inner()));
        shared.wake.notify_all();
    }
    execute(shared, task, 0);
    let mut spins = 0u32;
    while shared.workers_done.load(Ordering::Acquire) != shared.n_threads - 1 {
        backoff(&mut spins);
    }
    shared.task.store(std::ptr::null_mut(), Ordering::Relaxed);
    if shared.panicked.load(Ordering::Relaxed) {
        Err(KernelError::WorkerPanicked)
    } else {
        Ok(())
    }
}

impl Drop for ColdPool {
    fn drop(&mut self) {
        stop_workers(&self.shared, std::mem::take(&mut self.workers));
    }
}

/// Wake every worker with the shutdown flag set and wait for them.
fn stop_workers(shared: &Shared, workers: Vec<std::thread::JoinHandle<()>>) {
    shared.shutdown.store(true, Ordering::Release);
    shared.epoch.fetch_add(1, Ordering::AcqRel);
    drop(shared.sleep_lock.lock().unwrap_or_else(|poisoned| poisoned.into_inner()));
    shared.wake.notify_all();
    for worker in workers {
        let _ = worker.join();
    }
}

fn worker_main(shared: Arc<Shared>, index: usize, cpu: Option<usize>) {
    if let Some(cpu) = cpu {
        pin_current_thread(cpu);
    }
    let mut seen_epoch = 0u64;
    loop {
        seen_epoch = wait_for_epoch_change(&shared, seen_epoch);
        if shared.shutdown.load(Ordering::Acquire) {
            return;
        }
        let task = shared.task.load(Ordering::Relaxed) as *const Task<'_>;
        // SAFETY: the dispatcher stored a pointer to a Task that lives on its stack before bumping
        // the epoch (AcqRel, observed with Acquire here) and does not return, so the Task and
        // everything it borrows stay alive, until this worker has bumped `workers_done` below.
        execute(&shared, unsafe { &*task }, index);
        shared.workers_done.fetch_add(1, Ordering::AcqRel);
    }
}

fn wait_for_epoch_change(shared: &Shared, seen_epoch: u64) -> u64 {
    let spin_start = Instant::now();
    let mut spins = 0u32;
    loop {
        let epoch = shared.epoch.load(Ordering::Acquire);
        if epoch != seen_epoch {
            return epoch;
        }
        std::hint::spin_loop();
        spins += 1;
        if spins.is_multiple_of(64)
            && (spin_start.elapsed() > IDLE_SPIN || shared.park_hint.load(Ordering::Relaxed))
        {
            break;
        }
    }
    let mut guard = shared.sleep_lock.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    loop {
        let epoch = shared.epoch.load(Ordering::Acquire);
        if epoch != seen_epoch {
            return epoch;
        }
        guard = shared.wake.wait(guard).unwrap_or_else(|poisoned| poisoned.into_inner());
    }
}

/// Runs thread `index`'s share of `task`; panics are caught and flagged so the barrier and the
/// completion count are always reached.
fn execute(shared: &Shared, task: &Task<'_>, index: usize) {
    let n_threads = shared.n_threads;
    match task {
        Task::Broadcast(f) => {
            if catch_unwind(AssertUnwindSafe(|| f(index, n_threads))).is_err() {
                shared.panicked.store(true, Ordering::Relaxed);
            }
        }
        Task::Cold(cold) if cold.pipelined => {
            if index < cold.participants
                && catch_unwind(AssertUnwindSafe(|| pipelined_work(shared, cold, cold.participants))).is_err()
            {
                shared.panicked.store(true, Ordering::Relaxed);
            }
        }
        Task::Cold(cold) => {
            let n = cold.participants;
            if index < n && catch_unwind(AssertUnwindSafe(|| gate_up_phase(cold, n))).is_err() {
                shared.panicked.store(true, Ordering::Relaxed);
            }
            // Every pool thread keeps the barrier (it counts them all), participant or not.
            shared.barrier.wait();
            if index < n && catch_unwind(AssertUnwindSafe(|| down_phase(cold, n))).is_err() {
                shared.panicked.store(true, Ordering::Relaxed);
            }
        }
    }
}

/// Gate/up + activation of active expert `a` for its ff units `units` (4 ff rows each).
fn gate_up_units(task: &ColdTask<'_>, a: usize, units: Range<usize>) {
    let job = task.job;
    let expert = &job.experts[task.active[a]];
    let ff_rows = units.start * FF_ROWS_PER_UNIT..(units.end * FF_ROWS_PER_UNIT).min(job.ff);
    let (x, hidden, token_idx) = (job.x.as_ptr(), job.hidden, expert.token_idx);
    // SAFETY: the job was validated (level supported, weights sized, token indices < n_tokens);
    // claimed units are disjoint across threads, so are these ff rows of h, and h for this
    // expert spans slot_start[a] * ff .. + n_tokens_e * ff of the scratch (sized in `run`).
    unsafe {
        gate_up_unchecked(
            job.level,
            &expert.weights,
            job.act,
            ff_rows,
            token_idx.len(),
            |t| x.add(token_idx[t] as usize * hidden),
            task.q8_x(a),
            task.h_scratch.add(task.slot_start[a] * job.ff),
        )
    };
}

/// Phase 1 (phased): claims ranges of (expert, 4-ff-row unit), experts in `gate_up_order`, and
/// computes gate/up there. Claims are guided by cost, not units: each takes about
/// `remaining cost / (2 * threads)`, so a claim of a popular expert's units is short.
fn gate_up_phase(task: &ColdTask<'_>, n_threads: usize) {
    let units_per_expert = task.job.ff.div_ceil(FF_ROWS_PER_UNIT);
    let total_units = units_per_expert * task.gate_up_order.len();
    while let Some(claim) = claim_units_by_cost(
        &task.next_gate_up_unit,
        task.gate_up_cost,
        units_per_expert,
        total_units,
        n_threads,
    ) {
        let mut unit = claim.start;
        while unit < claim.end {
            let k = unit / units_per_expert;
            let first = k * units_per_expert;
            let end = claim.end.min(first + units_per_expert);
            gate_up_units(task, task.gate_up_order[k], unit - first..end - first);
            task.gate_up_done(task.gate_up_order[k], end - unit);
            unit = end;
        }
    }
}

/// Guided self-scheduling over a unit space whose expert `k` (in order) has `units_per_expert`
/// units of equal cost, `cum_cost[k]` being the cost before it: claims the next range worth about
/// `remaining cost / (2 * threads)` (at least one unit); `None` when all are claimed.
fn claim_units_by_cost(
    next: &AtomicUsize,
    cum_cost: &[u64],
    units_per_expert: usize,
    total_units: usize,
    n_threads: usize,
) -> Option<Range<usize>> {
    let n_experts = cum_cost.len() - 1;
    let total_cost = cum_cost[n_experts];
    let unit_cost = |k: usize| (cum_cost[k + 1] - cum_cost[k]) / units_per_expert as u64;
    let mut start = next.load(Ordering::Relaxed);
    loop {
        if start >= total_units {
            return None;
        }
        let k = start / units_per_expert;
        let done = cum_cost[k] + (start - k * units_per_expert) as u64 * unit_cost(k);
        let target = done + ((total_cost - done) / (2 * n_threads as u64)).max(1);
        // Last expert whose units start at or before `target` (k at least: cum_cost[k] <= done).
        let k_end = cum_cost[..n_experts].partition_point(|&c| c <= target) - 1;
        let end_in_expert = (target - cum_cost[k_end]).div_ceil(unit_cost(k_end).max(1)) as usize;
        let end =
            (k_end * units_per_expert + end_in_expert.min(units_per_expert)).clamp(start + 1, total_units);
        match next.compare_exchange_weak(start, end, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return Some(start..end),
            Err(current) => start = current,
        }
    }
}

/// Phase 2 (phased): claims ranges of hidden row blocks and runs every expert's down rows there.
fn down_phase(task: &ColdTask<'_>, n_threads: usize) {
    let job = task.job;
    let total_units = job.hidden.div_ceil(ROW_BLOCK);
    while let Some(claim) = claim_units(&task.next_down_unit, total_units, total_units, n_threads, usize::MAX)
    {
        let hidden_rows = claim.start * ROW_BLOCK..(claim.end * ROW_BLOCK).min(job.hidden);
        for (a, &expert_index) in task.active.iter().enumerate() {
            let expert = &job.experts[expert_index];
            let (out, hidden, token_idx) = (task.out, job.hidden, expert.token_idx);
            // SAFETY: job validated; after the barrier all of h is written and only read; this
            // thread alone claimed `hidden_rows`, so it is the only one touching those columns
            // of any output row.
            unsafe {
                down_unchecked(
                    job.level,
                    &expert.weights,
                    hidden_rows.clone(),
                    token_idx.len(),
                    task.h_scratch.add(task.slot_start[a] * job.ff),
                    task.q8_h(a),
                    task.amx_h(a),
                    expert.token_weight,
                    |t| out.add(token_idx[t] as usize * hidden),
                )
            };
        }
    }
}

/// Pipelined schedule: claims ranges of the unit space [gate/up units of every active expert,
/// then down units of every active expert] and works through them; see the module docs.
fn pipelined_work(shared: &Shared, task: &ColdTask<'_>, n_threads: usize) {
    let job = task.job;
    let n_active = task.active.len();
    let ff_units = job.ff.div_ceil(FF_ROWS_PER_UNIT);
    let row_blocks = job.hidden.div_ceil(ROW_BLOCK);
    let gate_up_total = ff_units * n_active;
    let total = gate_up_total + row_blocks * n_active;
    let next = &task.next_gate_up_unit;
    while let Some(claim) = claim_units(next, total, gate_up_total, n_threads, PIPELINED_MAX_CLAIM) {
        let mut unit = claim.start;
        while unit < claim.end {
            if unit < gate_up_total {
                let a = unit / ff_units;
                let first = a * ff_units;
                let end = claim.end.min(first + ff_units);
                gate_up_units(task, a, unit - first..end - first);
                task.gate_up_done(a, end - unit);
                unit = end;
            } else {
                let a = (unit - gate_up_total) / row_blocks;
                let first = gate_up_total + a * row_blocks;
                let end = claim.end.min(first + row_blocks);
                let mut spins = 0u32;
                // Acquire: pairs with the Release of the extra increment that follows the last
                // gate/up unit of expert a (and the quantisation of its h, when 8-bit).
                while task.h_done[a].load(Ordering::Acquire) <= ff_units {
                    if shared.panicked.load(Ordering::Relaxed) {
                        // A gate/up unit of expert a panicked; the call reports the panic.
                        return;
                    }
                    backoff(&mut spins);
                }
                down_units(task, a, unit - first..end - first);
                unit = end;
            }
        }
    }
}

/// Pipelined: down rows of active expert `a` for its row blocks `blocks` into the partials,
/// then the reduce of every group this completes.
fn down_units(task: &ColdTask<'_>, a: usize, blocks: Range<usize>) {
    let job = task.job;
    let expert = &job.experts[task.active[a]];
    let hidden = job.hidden;
    let hidden_rows = blocks.start * ROW_BLOCK..(blocks.end * ROW_BLOCK).min(hidden);
    let partial = task.partial;
    let slot = task.slot_start[a];
    // SAFETY: job validated; h of expert a is complete (readiness counter, Acquire) and only
    // read from now on; the partial rows `hidden_rows` of this expert's slots belong to this
    // claim alone, and partial holds slots x hidden values (sized in `run`).
    unsafe {
        down_store_unchecked(
            job.level,
            &expert.weights,
            hidden_rows,
            expert.token_idx.len(),
            task.h_scratch.add(slot * job.ff),
            task.q8_h(a),
            task.amx_h(a),
            expert.token_weight,
            |t| partial.add((slot + t) * hidden),
        )
    };
    let row_blocks = hidden.div_ceil(ROW_BLOCK);
    let n_active = task.active.len();
    let mut block = blocks.start;
    while block < blocks.end {
        let group = block / REDUCE_GROUP_BLOCKS;
        let group_end = blocks.end.min((group + 1) * REDUCE_GROUP_BLOCKS);
        let blocks_in_group = row_blocks.min((group + 1) * REDUCE_GROUP_BLOCKS) - group * REDUCE_GROUP_BLOCKS;
        let done = group_end - block;
        // AcqRel: releases this thread's partial rows; the thread that completes the group
        // acquires those of every other contributor (one release sequence of RMWs).
        if task.group_done[group].fetch_add(done, Ordering::AcqRel) + done == n_active * blocks_in_group {
            reduce_group(task, group);
        }
        block = group_end;
    }
}

/// Pipelined: `out[t][rows] += partial[slot][rows]` for every slot in expert then token order,
/// the rows being reduce group `group`'s.
fn reduce_group(task: &ColdTask<'_>, group: usize) {
    let job = task.job;
    let hidden = job.hidden;
    let row0 = group * REDUCE_GROUP_BLOCKS * ROW_BLOCK;
    let len = hidden.min(row0 + REDUCE_GROUP_BLOCKS * ROW_BLOCK) - row0;
    for (a, &expert_index) in task.active.iter().enumerate() {
        for (t, &token) in job.experts[expert_index].token_idx.iter().enumerate() {
            // SAFETY: every (expert, row block) unit of this group is complete and acquired
            // (see down_units); only this thread reduces the group, so it alone touches these
            // rows of `out` (token < n_tokens: validated) and reads these partial rows; the two
            // buffers do not overlap (out is the caller's slice, partial the pool's scratch).
            let (dst, src) = unsafe {
                (
                    std::slice::from_raw_parts_mut(task.out.add(token as usize * hidden + row0), len),
                    std::slice::from_raw_parts(
                        task.partial.add((task.slot_start[a] + t) * hidden + row0),
                        len,
                    ),
                )
            };
            for (d, s) in dst.iter_mut().zip(src) {
                *d += *s;
            }
        }
    }
}

/// CPUs this process may run on, in increasing order (empty if unknown).
fn allowed_cpus() -> Vec<usize> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: cpu_set_t is plain data; zeroed is a valid empty set, and sched_getaffinity
        // writes at most size_of::<cpu_set_t>() bytes into it.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0 {
                return (0..libc::CPU_SETSIZE as usize).filter(|&cpu| libc::CPU_ISSET(cpu, &set)).collect();
            }
        }
    }
    Vec::new()
}

/// Pins the calling thread to `cpu`; failure is ignored (the pool still works unpinned).
fn pin_current_thread(cpu: usize) {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: as in allowed_cpus; CPU_SET bounds-checks `cpu` against the set size, and
        // sched_setaffinity(0, ..) only reads the set and affects the calling thread.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            let _ = libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cpu;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcast_reaches_every_thread_once() {
        let mut pool = ColdPool::new(3);
        let hits: Vec<AtomicUsize> = (0..3).map(|_| AtomicUsize::new(0)).collect();
        for _ in 0..50 {
            pool.broadcast(&|index, n| {
                assert_eq!(n, 3);
                hits[index].fetch_add(1, Ordering::Relaxed);
            })
            .unwrap();
        }
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 50));
    }

    /// Random little-endian weight bytes of `dtype` (F32 or BF16), values in [-0.3, 0.3).
    fn random_bytes(seed: &mut u64, dtype: crate::weights::WeightDType, n: usize) -> Vec<u8> {
        let mut bytes = Vec::new();
        for _ in 0..n {
            let value = random_f32(seed) * 0.3;
            match dtype {
                crate::weights::WeightDType::BF16 => {
                    bytes.extend_from_slice(&half::bf16::from_f32(value).to_bits().to_le_bytes())
                }
                _ => bytes.extend_from_slice(&value.to_le_bytes()),
            }
        }
        bytes
    }

    fn random_f32(seed: &mut u64) -> f32 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        (*seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }

    #[test]
    fn schedules_give_identical_bits_and_match_reference() {
        use crate::weights::WeightDType;
        let mut seed = 0x5EED_1234_u64;
        // (hidden, ff, tokens, experts): odd shapes, more threads than row blocks, a hidden size
        // that is not a whole number of reduce groups, and a token repeated inside one expert.
        for (hidden, ff, n_tokens, n_experts) in
            [(5, 3, 1, 3), (37, 53, 7, 5), (200, 40, 1, 9), (130, 21, 19, 6)]
        {
            for dtype in [WeightDType::F32, WeightDType::BF16] {
                let weights: Vec<[Vec<u8>; 3]> = (0..n_experts)
                    .map(|_| std::array::from_fn(|_| random_bytes(&mut seed, dtype, hidden * ff)))
                    .collect();
                let x: Vec<f32> = (0..n_tokens * hidden).map(|_| random_f32(&mut seed)).collect();
                let token_idx: Vec<Vec<u32>> = (0..n_experts)
                    .map(|e| match e {
                        1 => Vec::new(),
                        2 => vec![0, (n_tokens - 1) as u32, 0],
                        _ => (0..n_tokens as u32).filter(|t| !(t + e as u32).is_multiple_of(3)).collect(),
                    })
                    .collect();
                let token_weight: Vec<Vec<f32>> =
                    token_idx.iter().map(|t| t.iter().map(|_| random_f32(&mut seed)).collect()).collect();
                let work: Vec<ColdExpertWork<'_>> = (0..n_experts)
                    .map(|e| ColdExpertWork {
                        weights: ExpertWeights {
                            gate: &weights[e][0],
                            up: &weights[e][1],
                            down: &weights[e][2],
                            dtype,
                            down_dtype: dtype,
                            hidden,
                            ff,
                            bias: None,
                        },
                        token_idx: &token_idx[e],
                        token_weight: &token_weight[e],
                    })
                    .collect();
                let initial: Vec<f32> = (0..n_tokens * hidden).map(|_| random_f32(&mut seed)).collect();
                let job = ColdJob {
                    level: SimdLevel::Scalar,
                    activations: DecodeActivations::F32,
                    act: Activation::Silu,
                    hidden,
                    ff,
                    x: &x,
                    experts: &work,
                };
                let mut reference = initial.clone();
                ColdPool::run_reference(&job, &mut reference).unwrap();
                for level in crate::simd::available() {
                    let job = ColdJob { level, ..job };
                    let mut results = Vec::new();
                    for n_threads in [1, 3, 8] {
                        let mut pool = ColdPool::new(n_threads);
                        for schedule in [ColdSchedule::Phased, ColdSchedule::Pipelined, ColdSchedule::Auto] {
                            pool.set_schedule(schedule);
                            // Twice: the second call reuses scratch and counters. Then on part
                            // of the pool (the other threads idle, or keep only the barrier).
                            for participants in [n_threads, n_threads, n_threads.div_ceil(2)] {
                                let mut out = initial.clone();
                                pool.run_on(participants, &job, &mut out).unwrap();
                                results.push(out);
                            }
                        }
                    }
                    for out in &results[1..] {
                        assert!(
                            out.iter().zip(&results[0]).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{level} {dtype:?} {hidden}x{ff}: schedules or thread counts differ"
                        );
                    }
                    let scale = reference.iter().fold(1.0f32, |m, v| m.max(v.abs()));
                    let error =
                        results[0].iter().zip(&reference).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
                    assert!(error <= 2e-2 * scale, "{level} {dtype:?} {hidden}x{ff}: error {error}");
                }
            }
        }
    }

    #[test]
    fn schedule_names_parse() {
        assert_eq!(ColdSchedule::parse("Pipelined"), Some(ColdSchedule::Pipelined));
        assert_eq!(ColdSchedule::parse("phased"), Some(ColdSchedule::Phased));
        assert_eq!(ColdSchedule::parse("auto"), Some(ColdSchedule::Auto));
        assert_eq!(ColdSchedule::parse("fast"), None);
    }

    #[test]
    fn worker_panic_is_reported_not_hung() {
        let mut pool = ColdPool::new(2);
        let result = pool.broadcast(&|index, _| {
            if index == 1 {
                panic!("test panic in worker");
            }
        });
        assert_eq!(result, Err(KernelError::WorkerPanicked));
        pool.broadcast(&|_, _| {}).unwrap();
    }
}
