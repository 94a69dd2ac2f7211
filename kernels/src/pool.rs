//! The cold pool: a fixed set of pinned worker threads that run one cold-lane MoE job per call.
//!
//! A [`ColdJob`] is expert-major: each cold expert comes with the tokens routed to it and their
//! routing weights. [`ColdPool::run`] splits it in two phases separated by a barrier:
//! 1. gate/up + activation: the (expert, unit of 4 ff rows) space of all experts that have
//!    tokens is split by rows, not by expert, so every thread streams weights at once even
//!    when a single expert carries all the work; each thread writes its rows of the
//!    intermediate `h` into a pool-owned scratch buffer;
//! 2. down + weighted accumulation: the hidden output rows (units of 8) are split and each
//!    thread walks all experts for the rows it claimed, so threads own disjoint output rows (no
//!    locks, no atomics on data), and a token routed to several experts is accumulated by one
//!    thread per row.
//!
//! Both phases hand out contiguous unit ranges by guided self-scheduling: one atomic counter
//! per phase, each claim takes `remaining / (2 * threads)` units (at least one). Early claims
//! are long (weights stream sequentially, the next-block prefetch runs on), late claims are
//! short, so the split adapts to the number of cold slots and experts and to a thread that
//! was slowed down (another process on its core) without any per-token allocation or lock.
//!
//! The caller's thread works as thread 0; the other threads are spawned once and pinned to
//! cores (pinning failure is ignored). Dispatch is one epoch bump per call; workers spin
//! briefly and then sleep on a condvar. The scratch buffers only grow, so steady-state calls do
//! not allocate.

use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::KernelError;
use crate::ffn::{down_unchecked, gate_up_unchecked, ROW_BLOCK};
use crate::scalar::dot_row;
use crate::simd::SimdLevel;
use crate::weights::{Activation, ExpertWeights};

/// ff rows per phase-1 work unit: gate and up rows interleave into one 8-row tile block.
const FF_ROWS_PER_UNIT: usize = ROW_BLOCK / 2;
/// How long an idle worker spins before it sleeps.
const IDLE_SPIN: Duration = Duration::from_micros(200);

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
        if self.hidden == 0 || self.x.len() % self.hidden != 0 {
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

/// What one dispatch asks every thread to do.
enum Task<'t> {
    Cold(ColdTask<'t>),
    Broadcast(&'t (dyn Fn(usize, usize) + Sync)),
}

struct ColdTask<'t> {
    job: &'t ColdJob<'t>,
    out: *mut f32,
    h_scratch: *mut f32,
    h_offsets: &'t [usize],
    /// Next unclaimed phase-1 unit (over the concatenated experts that have tokens).
    next_gate_up_unit: AtomicUsize,
    /// Next unclaimed phase-2 unit (row block of the hidden output rows).
    next_down_unit: AtomicUsize,
}

/// Claims the next range of units by guided self-scheduling; `None` when all are claimed.
fn claim_units(next: &AtomicUsize, total: usize, n_threads: usize) -> Option<Range<usize>> {
    let mut start = next.load(Ordering::Relaxed);
    loop {
        if start >= total {
            return None;
        }
        let len = ((total - start) / (2 * n_threads)).max(1);
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
    epoch: AtomicU64,
    task: AtomicPtr<()>,
    workers_done: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    barrier: SpinBarrier,
    sleep_lock: Mutex<()>,
    wake: Condvar,
    n_threads: usize,
}

/// Fixed pool of pinned threads for cold-lane expert jobs. See the module docs.
pub struct ColdPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    h_scratch: Vec<f32>,
    h_offsets: Vec<usize>,
    pinned_cpus: Vec<Option<usize>>,
}

impl ColdPool {
    /// Spawns `n_threads - 1` workers (the caller is thread 0), pinned to distinct cores of the
    /// process's CPU set where possible. `n_threads == 0` is treated as 1.
    pub fn new(n_threads: usize) -> ColdPool {
        let n_threads = n_threads.max(1);
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            task: AtomicPtr::new(std::ptr::null_mut()),
            workers_done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            barrier: SpinBarrier { arrived: AtomicUsize::new(0), generation: AtomicUsize::new(0), n_threads },
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
            let shared = Arc::clone(&shared);
            let handle = std::thread::Builder::new()
                .name(format!("moe-cold-{index}"))
                .spawn(move || worker_main(shared, index, cpu))
                .expect("spawning a cold pool worker thread");
            workers.push(handle);
        }
        ColdPool { shared, workers, h_scratch: Vec::new(), h_offsets: Vec::new(), pinned_cpus }
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
        job.validate(out.len())?;
        // Lay out h: expert e's tokens x ff block at h_offsets[e].
        self.h_offsets.clear();
        let mut h_len = 0;
        for expert in job.experts {
            self.h_offsets.push(h_len);
            h_len += expert.token_idx.len() * job.ff;
        }
        if self.h_scratch.len() < h_len {
            self.h_scratch.resize(h_len, 0.0);
        }
        let task = Task::Cold(ColdTask {
            job,
            out: out.as_mut_ptr(),
            h_scratch: self.h_scratch.as_mut_ptr(),
            h_offsets: &self.h_offsets,
            next_gate_up_unit: AtomicUsize::new(0),
            next_down_unit: AtomicUsize::new(0),
        });
        dispatch(&self.shared, &task)
    }

    /// Runs `f(thread_index, n_threads)` once on every pool thread (the caller is index 0) and
    /// returns when all are done. Used by the bench for bandwidth probes on the same threads.
    pub fn broadcast(&mut self, f: &(dyn Fn(usize, usize) + Sync)) -> Result<(), KernelError> {
        dispatch(&self.shared, &Task::Broadcast(f))
    }

    /// Single-thread scalar oracle for [`ColdPool::run`]: plain loops over experts, tokens and
    /// rows with sequential f32 dot products, independent of the tiled kernels.
    pub fn run_reference(job: &ColdJob<'_>, out: &mut [f32]) -> Result<(), KernelError> {
        job.validate(out.len())?;
        let (hidden, ff) = (job.hidden, job.ff);
        let mut h = vec![0.0f32; ff];
        for expert in job.experts {
            let w = &expert.weights;
            let (gate_row_bytes, down_row_bytes) = (hidden * w.dtype.size_bytes(), ff * w.dtype.size_bytes());
            for (&token, &token_weight) in expert.token_idx.iter().zip(expert.token_weight) {
                let x = &job.x[token as usize * hidden..][..hidden];
                for (k, hk) in h.iter_mut().enumerate() {
                    let gate = dot_row(w.dtype, &w.gate[k * gate_row_bytes..][..gate_row_bytes], x);
                    let up = dot_row(w.dtype, &w.up[k * gate_row_bytes..][..gate_row_bytes], x);
                    *hk = job.act.gated(gate, up);
                }
                let out_row = &mut out[token as usize * hidden..][..hidden];
                for (row, o) in out_row.iter_mut().enumerate() {
                    *o += token_weight
                        * dot_row(w.dtype, &w.down[row * down_row_bytes..][..down_row_bytes], &h);
                }
            }
        }
        Ok(())
    }
}

/// Publishes `task` to the workers, runs thread 0's share and waits for all workers.
fn dispatch(shared: &Shared, task: &Task<'_>) -> Result<(), KernelError> {
    shared.panicked.store(false, Ordering::Relaxed);
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
        self.shared.shutdown.store(true, Ordering::Release);
        self.shared.epoch.fetch_add(1, Ordering::AcqRel);
        drop(self.shared.sleep_lock.lock().unwrap_or_else(|poisoned| poisoned.into_inner()));
        self.shared.wake.notify_all();
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
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
        if spins % 64 == 0 && spin_start.elapsed() > IDLE_SPIN {
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
        Task::Cold(cold) => {
            if catch_unwind(AssertUnwindSafe(|| gate_up_phase(cold, n_threads))).is_err() {
                shared.panicked.store(true, Ordering::Relaxed);
            }
            shared.barrier.wait();
            if catch_unwind(AssertUnwindSafe(|| down_phase(cold, n_threads))).is_err() {
                shared.panicked.store(true, Ordering::Relaxed);
            }
        }
    }
}

/// Phase 1: claims ranges of (expert, 4-ff-row unit) and computes gate/up + activation there.
fn gate_up_phase(task: &ColdTask<'_>, n_threads: usize) {
    let job = task.job;
    let units_per_expert = job.ff.div_ceil(FF_ROWS_PER_UNIT);
    let total_units = units_per_expert * job.experts.iter().filter(|e| !e.token_idx.is_empty()).count();
    // Claims are increasing per thread, so a forward-only cursor maps units to experts.
    let (mut expert_index, mut expert_first_unit) = (0usize, 0usize);
    while let Some(claim) = claim_units(&task.next_gate_up_unit, total_units, n_threads) {
        let mut unit = claim.start;
        while unit < claim.end {
            while job.experts[expert_index].token_idx.is_empty()
                || unit >= expert_first_unit + units_per_expert
            {
                if !job.experts[expert_index].token_idx.is_empty() {
                    expert_first_unit += units_per_expert;
                }
                expert_index += 1;
            }
            let expert = &job.experts[expert_index];
            let local_end = (claim.end - expert_first_unit).min(units_per_expert);
            let local_start = unit - expert_first_unit;
            let ff_rows = local_start * FF_ROWS_PER_UNIT..(local_end * FF_ROWS_PER_UNIT).min(job.ff);
            unit = expert_first_unit + local_end;
            let (x, hidden, token_idx) = (job.x.as_ptr(), job.hidden, expert.token_idx);
            // SAFETY: the job was validated (level supported, weights sized, token indices <
            // n_tokens); claimed units are disjoint across threads, so are these ff rows of h,
            // and h for this expert spans h_offsets[e] .. + n_tokens_e * ff of the scratch.
            unsafe {
                gate_up_unchecked(
                    job.level,
                    &expert.weights,
                    job.act,
                    ff_rows,
                    token_idx.len(),
                    |t| x.add(token_idx[t] as usize * hidden),
                    task.h_scratch.add(task.h_offsets[expert_index]),
                )
            };
        }
    }
}

/// Phase 2: claims ranges of hidden row blocks and runs every expert's down rows there.
fn down_phase(task: &ColdTask<'_>, n_threads: usize) {
    let job = task.job;
    let total_units = job.hidden.div_ceil(ROW_BLOCK);
    while let Some(claim) = claim_units(&task.next_down_unit, total_units, n_threads) {
        let hidden_rows = claim.start * ROW_BLOCK..(claim.end * ROW_BLOCK).min(job.hidden);
        for (expert_index, expert) in job.experts.iter().enumerate() {
            if expert.token_idx.is_empty() {
                continue;
            }
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
                    task.h_scratch.add(task.h_offsets[expert_index]),
                    expert.token_weight,
                    |t| out.add(token_idx[t] as usize * hidden),
                )
            };
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
