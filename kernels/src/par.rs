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

/// Work on chunk `i` of two buffers: `(i, a_i, b_i)`.
pub type PairChunkFn<'a> = dyn Fn(usize, &mut [f32], &mut [f32]) + Sync + 'a;

/// Calls `f(i, a_i, b_i)` for every chunk `i` of two buffers cut in the same number of chunks
/// (`a` in `a_len`-long chunks, `b` in `b_len`-long ones, both exact), on the pool's threads:
/// per-item work that owns a piece of each (a head's state and its scratch, say).
pub fn par_chunk_pairs_mut(
    pool: &mut ColdPool,
    (a, a_len): (&mut [f32], usize),
    (b, b_len): (&mut [f32], usize),
    f: &PairChunkFn<'_>,
) -> Result<(), KernelError> {
    assert!(a_len > 0 && b_len > 0, "par_chunk_pairs_mut: chunk length 0");
    let n_chunks = a.len() / a_len;
    assert!(
        a.len() == n_chunks * a_len && b.len() == n_chunks * b_len,
        "par_chunk_pairs_mut: uneven buffers"
    );
    let (next, base_a, base_b) = (AtomicUsize::new(0), Base(a.as_mut_ptr()), Base(b.as_mut_ptr()));
    pool.broadcast(&|_, _| loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        if i >= n_chunks {
            return;
        }
        // SAFETY: chunk i of each buffer lies inside it (both hold exactly n_chunks chunks);
        // `next` hands each i to exactly one thread, so no two slices overlap; both buffers are
        // borrowed for the whole broadcast.
        let (ca, cb) = unsafe {
            (
                std::slice::from_raw_parts_mut(base_a.at(i * a_len), a_len),
                std::slice::from_raw_parts_mut(base_b.at(i * b_len), b_len),
            )
        };
        f(i, ca, cb);
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

    #[test]
    fn every_pair_once_with_its_index() {
        let mut pool = ColdPool::new(3);
        let (mut a, mut b) = (vec![0.0f32; 5 * 4], vec![0.0f32; 5 * 9]);
        par_chunk_pairs_mut(&mut pool, (&mut a, 4), (&mut b, 9), &|i, x, y| {
            x.iter_mut().for_each(|v| *v += i as f32);
            y.iter_mut().for_each(|v| *v -= i as f32);
        })
        .unwrap();
        assert!(a.iter().enumerate().all(|(j, v)| *v == (j / 4) as f32));
        assert!(b.iter().enumerate().all(|(j, v)| *v == -((j / 9) as f32)));
    }
}
