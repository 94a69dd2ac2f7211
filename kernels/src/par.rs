//! Data-parallel loops over disjoint chunks of one buffer on the pool's threads, for per-row work
//! of the library (norms, RoPE) that has no kernel of its own.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::error::KernelError;
use crate::pool::ColdPool;

/// A buffer's base pointer shared with the pool's threads.
struct Base(*mut f32);

// SAFETY: threads only form slices of disjoint chunks from it (see `par_chunks_mut`), and the
// buffer outlives the broadcast that uses it.
unsafe impl Sync for Base {}

impl Base {
    /// Through a method, so closures capture the whole `Base` (Sync), not its raw field.
    fn at(&self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }
}

/// Calls `f(i, chunk)` for every `chunk_len`-long chunk `i` of `data` (the last may be shorter)
/// on the pool's threads, which claim chunks in groups; every chunk goes to exactly one call.
pub fn par_chunks_mut(
    pool: &mut ColdPool,
    data: &mut [f32],
    chunk_len: usize,
    f: &(dyn Fn(usize, &mut [f32]) + Sync),
) -> Result<(), KernelError> {
    assert!(chunk_len > 0, "par_chunks_mut: chunk_len 0");
    let (len, n_chunks) = (data.len(), data.len().div_ceil(chunk_len));
    let group = (n_chunks / (4 * pool.n_threads())).max(1);
    let (next, base) = (AtomicUsize::new(0), Base(data.as_mut_ptr()));
    pool.broadcast(&|_, _| loop {
        let first = next.fetch_add(group, Ordering::Relaxed);
        if first >= n_chunks {
            return;
        }
        for i in first..(first + group).min(n_chunks) {
            let (lo, hi) = (i * chunk_len, ((i + 1) * chunk_len).min(len));
            // SAFETY: chunk i is data[lo..hi], inside `data`; `next` hands each i to exactly one
            // thread, so the slices never overlap; `data` is borrowed for the whole broadcast.
            let chunk = unsafe { std::slice::from_raw_parts_mut(base.at(lo), hi - lo) };
            f(i, chunk);
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_chunk_once_with_its_index() {
        let mut pool = ColdPool::new(3);
        let mut data = vec![0.0f32; 1000];
        par_chunks_mut(&mut pool, &mut data, 7, &|i, chunk| {
            chunk.iter_mut().for_each(|v| *v += i as f32 + 1.0)
        })
        .unwrap();
        for (j, v) in data.iter().enumerate() {
            assert_eq!(*v, (j / 7) as f32 + 1.0, "element {j}");
        }
    }
}
