//! Prefill attention in tiles: a work unit is one KV head and a block of tokens, i.e. every
//! query row (token, head of that KV head's group) of the block, at most [`TILE_ROWS`] rows.
//! The unit walks the keys its rows see in chunks of [`KEY_CHUNK`] positions: the rows' scores are
//! dot products of the keys as stored with the queries (the SIMD tiles keep a few keys x rows in
//! registers, reading f16 / bf16 / q8_0 keys themselves), masked (causal, window) and folded
//! into a running max / sum per row (online softmax); the weighted sum of the values accumulates
//! `p[j] * v[j, ..]` along head_dim. Every K/V value read
//! feeds up to `TILE_ROWS` rows, where the per-(token, head) path reads the cache once per row.
//! Decode (fewer than [`SPLIT_BELOW_TOKENS`] tokens) also splits the keys into ranges, one unit
//! each, and combines the ranges' partial sums per row afterwards. A unit's result does not
//! depend on which thread ran it.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::attention::{AttentionInput, AttentionShape};
use crate::ffn::dot_tiles;
use crate::kv::{KvRows, Q8_0_BLOCK, Q8_0_BLOCK_BYTES};
use crate::simd::SimdLevel;
use crate::weights::WeightDType;

/// Query rows per unit (a GQA group wider than this makes one-token units of the group's width).
pub const TILE_ROWS: usize = 32;
/// Key positions per chunk: the scores (rows x chunk) and decoded values (chunk x head_dim) of
/// one unit stay in L2.
pub const KEY_CHUNK: usize = 256;
/// Calls with fewer tokens (decode) also split each KV head's keys into ranges of about
/// [`DECODE_SPLIT_KEYS`] positions, one unit each, combined after the units (flash-decoding):
/// one token's units alone would be only `n_kv_heads`.
pub const SPLIT_BELOW_TOKENS: usize = 4;
/// Key positions per split unit in decode.
pub const DECODE_SPLIT_KEYS: usize = 128;

/// Floats of one thread's scratch for `shape`: scores, accumulators, max and sum per row, and a
/// chunk's values decoded to f32 (caches of other types).
pub(crate) fn thread_scratch_floats(shape: AttentionShape) -> usize {
    let rows = max_rows(shape);
    rows * KEY_CHUNK + rows * shape.head_dim + 2 * rows + decoded_floats(shape)
}

/// Floats of one chunk's keys (or values) decoded to f32.
fn decoded_floats(shape: AttentionShape) -> usize {
    KEY_CHUNK * shape.head_dim
}

/// Positions `k0..k0 + n` of a head's cache as f32 rows of `hd`: the cache itself when it is
/// f32, else decoded into `scratch` (F16C / the bf16 shift / q8_0 blocks, [`KvRows::decode`]),
/// one chunk at a time, so the SIMD loops below read f32 whatever the cache holds.
fn chunk_rows<'s>(cache: &'s KvRows, k0: usize, n: usize, hd: usize, scratch: &'s mut [f32]) -> &'s [f32] {
    match cache.as_f32() {
        Some(values) => &values[k0 * hd..(k0 + n) * hd],
        None => {
            let out = &mut scratch[..n * hd];
            cache.decode(k0 * hd, out);
            out
        }
    }
}

fn group(shape: AttentionShape) -> usize {
    shape.n_heads / shape.n_kv_heads
}

fn tokens_per_unit(shape: AttentionShape) -> usize {
    (TILE_ROWS / group(shape)).max(1)
}

fn max_rows(shape: AttentionShape) -> usize {
    tokens_per_unit(shape) * group(shape)
}

/// One call's units, claimed by the threads through `next_unit`.
pub(crate) struct TiledCall<'a> {
    pub input: AttentionInput<'a>,
    pub level: SimdLevel,
    pub n_tokens: usize,
    /// `n_threads` regions of [`thread_scratch_floats`].
    pub scratch: *mut f32,
    pub out: *mut f32,
    pub next_unit: AtomicUsize,
    /// Key ranges per (kv head, token block); > 1 only in decode ([`split_count`]).
    pub splits: usize,
    /// With splits: per unit, per row, the unnormalised sum (head_dim), running max and sum
    /// ([`partial_floats`]); the combine step writes `out`.
    pub partials: *mut f32,
}

// SAFETY: scratch regions are per thread index (each thread writes only its own); `out` rows
// (without splits) and partial regions (with splits) are written per unit, and units own disjoint
// ones, each unit claimed by exactly one thread through `next_unit`; the buffers outlive the call.
unsafe impl Sync for TiledCall<'_> {}

/// Key ranges per (kv head, token block) of a call: 1 from [`SPLIT_BELOW_TOKENS`] tokens on,
/// else the visible positions over [`DECODE_SPLIT_KEYS`]. Depends only on the call, never on the
/// thread count, so the result's bits do not either.
pub(crate) fn split_count(input: &AttentionInput<'_>, n_tokens: usize) -> usize {
    if n_tokens == 0 || n_tokens >= SPLIT_BELOW_TOKENS {
        return 1;
    }
    let (lo, hi) = (visible(input, 0).0, visible(input, n_tokens - 1).1);
    (hi + 1 - lo).div_ceil(DECODE_SPLIT_KEYS).max(1)
}

/// Floats of the partials buffer for a call with `splits` > 1.
pub(crate) fn partial_floats(shape: AttentionShape, n_tokens: usize, splits: usize) -> usize {
    n_units(shape, n_tokens, splits) * max_rows(shape) * (shape.head_dim + 2)
}

fn n_units(shape: AttentionShape, n_tokens: usize, splits: usize) -> usize {
    shape.n_kv_heads * n_tokens.div_ceil(tokens_per_unit(shape)) * splits
}

/// First and last position token `t` of the call sees.
fn visible(input: &AttentionInput<'_>, t: usize) -> (usize, usize) {
    let pos = input.first_pos + t;
    (input.window.map_or(0, |w| (pos + 1).saturating_sub(w)), pos)
}

impl TiledCall<'_> {
    fn n_units(&self) -> usize {
        n_units(self.input.shape, self.n_tokens, self.splits)
    }

    /// Claims and runs units until none are left; `index` picks this thread's scratch region.
    pub(crate) fn work(&self, index: usize) {
        let shape = self.input.shape;
        let per_thread = thread_scratch_floats(shape);
        let blocks = self.n_tokens.div_ceil(tokens_per_unit(shape));
        loop {
            let unit = self.next_unit.fetch_add(1, Ordering::Relaxed);
            if unit >= self.n_units() {
                return;
            }
            // SAFETY: region `index` belongs to this thread (index < n_threads regions).
            let scratch =
                unsafe { std::slice::from_raw_parts_mut(self.scratch.add(index * per_thread), per_thread) };
            let (split, rest) = (unit % self.splits, unit / self.splits);
            let t0 = (rest % blocks) * tokens_per_unit(shape);
            let t1 = (t0 + tokens_per_unit(shape)).min(self.n_tokens);
            self.unit(rest / blocks, t0..t1, (unit, split), scratch);
        }
    }

    /// Rows of kv head `kv` for tokens `tokens`: row `r` is token `tokens.start + r / group`,
    /// head `kv * group + r % group`; `(unit, split)`: the unit's index and its key range.
    fn unit(
        &self,
        kv: usize,
        tokens: std::ops::Range<usize>,
        (unit, split): (usize, usize),
        scratch: &mut [f32],
    ) {
        let shape = self.input.shape;
        let (hd, g) = (shape.head_dim, group(shape));
        let rows = tokens.len() * g;
        let mut tile = UnitTile::split(scratch, self.level, max_rows(shape), hd, rows);
        let q_row = |r: usize| (tokens.start + r / g) * shape.n_heads + kv * g + r % g;
        let (lo, hi) = (visible(&self.input, tokens.start).0, visible(&self.input, tokens.end - 1).1);
        let len = hi + 1 - lo;
        let (mut k0, end) = (lo + split * len / self.splits, lo + (split + 1) * len / self.splits);
        while k0 < end {
            let n = KEY_CHUNK.min(end - k0);
            let chunk = Chunk { kv, k0, n, rows };
            self.scores(&mut tile, chunk, &q_row);
            for r in 0..rows {
                let (first, last) = visible(&self.input, tokens.start + r / g);
                tile.fold_row(r, k0, n, first, last);
            }
            self.weigh_values(&mut tile, chunk);
            k0 += n;
        }
        for r in 0..rows {
            if self.splits == 1 {
                // SAFETY: this unit alone writes the (token, head) row q_row(r); validate checked
                // that `out` holds n_tokens * n_heads rows of hd.
                let out = unsafe { std::slice::from_raw_parts_mut(self.out.add(q_row(r) * hd), hd) };
                tile.finish_row(r, self.input.sinks.map(|s| s[kv * g + r % g]), out);
            } else {
                let at = (unit * max_rows(shape) + r) * (hd + 2);
                // SAFETY: this unit alone writes its partial rows; the buffer holds
                // partial_floats (every unit's max_rows rows of hd + 2).
                let part = unsafe { std::slice::from_raw_parts_mut(self.partials.add(at), hd + 2) };
                tile.partial_row(r, part);
            }
        }
    }

    /// With splits, after every unit ran: each row's output from its units' partials,
    /// `sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M)` with `M = max_s m_s`.
    pub(crate) fn combine(&self) {
        if self.splits == 1 {
            return;
        }
        let shape = self.input.shape;
        let (hd, g, per_unit) = (shape.head_dim, group(shape), max_rows(shape) * (shape.head_dim + 2));
        let blocks = self.n_tokens.div_ceil(tokens_per_unit(shape));
        // SAFETY: the units are done (the broadcast returned); the buffers hold what they say.
        let (partials, out) = unsafe {
            (
                std::slice::from_raw_parts(self.partials, self.n_units() * per_unit),
                std::slice::from_raw_parts_mut(self.out, self.n_tokens * shape.n_heads * hd),
            )
        };
        for (group_idx, units) in partials.chunks_exact(self.splits * per_unit).enumerate() {
            let (kv, t0) = (group_idx / blocks, (group_idx % blocks) * tokens_per_unit(shape));
            let rows = (tokens_per_unit(shape).min(self.n_tokens - t0)) * g;
            for r in 0..rows {
                let row = (t0 + r / g) * shape.n_heads + kv * g + r % g;
                let parts = (0..self.splits).map(|s| &units[s * per_unit + r * (hd + 2)..][..hd + 2]);
                let sink = self.input.sinks.map(|s| s[kv * g + r % g]);
                combine_row(parts, sink, &mut out[row * hd..(row + 1) * hd]);
            }
        }
    }

    /// Scores of keys `k0..k0 + n` for every row into `tile.scores` (scaled), as dot products of
    /// the key rows as stored with the query rows (the SIMD tile kernels keep a few keys x rows
    /// in registers). Transposing a chunk's keys (decoded to f32) for row-times-matrix products
    /// instead was 1.65x slower at depth 4096 (pp256, 4 Qwen3-30B-A3B layers, f16 cache, 2 cores).
    fn scores(&self, tile: &mut UnitTile<'_>, chunk: Chunk, q_row: &dyn Fn(usize) -> usize) {
        let Chunk { kv, k0, n, rows } = chunk;
        let hd = self.input.shape.head_dim;
        let scale = 1.0 / (hd as f32).sqrt();
        let (keys, dtype, row_bytes) = raw_rows(&self.input.keys[kv], k0 - self.input.kv_start, n, hd);
        // The bf16 levels' tiles round the query to bf16 (`vdpbf16ps`): bf16 keys take the plain
        // AVX-512 tile, which widens them exactly.
        let level = match (dtype, self.level) {
            (WeightDType::BF16, SimdLevel::Avx512Bf16 | SimdLevel::Amx) => SimdLevel::Avx512,
            (_, level) => level,
        };
        let key_base = keys.as_ptr();
        let q = self.input.q.as_ptr();
        let scores = &mut *tile.scores;
        // SAFETY: key_base holds the chunk's n key rows of row_bytes each in dtype (raw_rows;
        // validate checked positions up to the call's last token); query rows q_row(r) <
        // n_tokens * n_heads hold hd f32 each; the level was checked by the caller.
        unsafe {
            dot_tiles(
                level,
                dtype,
                hd,
                n,
                n,
                |j| key_base.add(j * row_bytes),
                rows,
                |r| q.add(q_row(r) * hd),
                None,
                |j, r, value| scores[r * KEY_CHUNK + j] = value * scale,
            )
        };
    }

    /// `acc[r] += sum_j p[r, j] * v[k0 + j]`: each row accumulates probability-weighted value
    /// rows (contiguous along head_dim).
    fn weigh_values(&self, tile: &mut UnitTile<'_>, chunk: Chunk) {
        let Chunk { kv, k0, n, rows } = chunk;
        let hd = self.input.shape.head_dim;
        let values = chunk_rows(&self.input.values[kv], k0 - self.input.kv_start, n, hd, tile.values);
        rows_times_matrix(
            self.level,
            (&tile.scores[..], KEY_CHUNK, n),
            values,
            hd,
            &mut tile.acc[..rows * hd],
        );
    }
}

/// Rows `k0..k0 + n` of a head's cache as they are stored, for the dot-product tiles, which read
/// f32, f16 (F16C), bf16 and q8_0 rows themselves (the expert weights' kernels): the bytes, their
/// type and the bytes of one row.
fn raw_rows(cache: &KvRows, k0: usize, n: usize, hd: usize) -> (&[u8], WeightDType, usize) {
    match cache {
        KvRows::F32(v) => (bytemuck::cast_slice(&v[k0 * hd..(k0 + n) * hd]), WeightDType::F32, hd * 4),
        KvRows::F16(v) => (bytemuck::cast_slice(&v[k0 * hd..(k0 + n) * hd]), WeightDType::F16, hd * 2),
        KvRows::Bf16(v) => (bytemuck::cast_slice(&v[k0 * hd..(k0 + n) * hd]), WeightDType::BF16, hd * 2),
        KvRows::Q8_0(b) => {
            let row = hd / Q8_0_BLOCK * Q8_0_BLOCK_BYTES;
            (&b[k0 * row..(k0 + n) * row], WeightDType::Q8_0, row)
        }
    }
}

/// Probability rows: `(p, p_stride, n)`, row r's `n` weights at `p[r * p_stride..]`.
type PRows<'a> = (&'a [f32], usize, usize);

/// For every row r of `out` (rows of `width`): `out_r += sum_i p_r[i] * m[i * stride ..
/// i * stride + width]`, vectorised along the row for the level (no horizontal sums: the rows
/// are short, head_dim). SIMD levels take four rows at a time, so each matrix vector is loaded
/// once for four rows; every row's sum runs in the same order as alone (the same values).
fn rows_times_matrix(level: SimdLevel, p: PRows<'_>, m: &[f32], width: usize, out: &mut [f32]) {
    let (n, rows) = (p.2, out.len() / width);
    assert!(n == 0 || (n - 1) * width + width <= m.len(), "rows_times_matrix: m too short");
    assert!(rows == 0 || (rows - 1) * p.1 + n <= p.0.len(), "rows_times_matrix: p too short");
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller checked that the CPU supports the level's features.
        SimdLevel::Avx512 | SimdLevel::Avx512Bf16 | SimdLevel::Amx => unsafe {
            rows_times_matrix_avx512(p, m, width, out)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        SimdLevel::Avx2 => unsafe { rows_times_matrix_avx2(p, m, width, out) },
        _ => {
            for (r, o) in out.chunks_exact_mut(width).enumerate() {
                row_times_matrix_plain(&p.0[r * p.1..r * p.1 + n], m, width, o);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
// SAFETY (callers): the CPU has these features; the body is safe code, compiled for them.
unsafe fn rows_times_matrix_avx512(p: PRows<'_>, m: &[f32], width: usize, out: &mut [f32]) {
    rows_times_matrix_fma(p, m, width, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
// SAFETY (callers): the CPU has these features; the body is safe code, compiled for them.
unsafe fn rows_times_matrix_avx2(p: PRows<'_>, m: &[f32], width: usize, out: &mut [f32]) {
    rows_times_matrix_fma(p, m, width, out)
}

/// Rows of one [`four_rows_times_matrix`] block.
const ROWS_BLOCK: usize = 4;

/// [`rows_times_matrix`] with FMAs: blocks of [`ROWS_BLOCK`] rows, the rest one by one.
#[inline(always)]
fn rows_times_matrix_fma((p, p_stride, n): PRows<'_>, m: &[f32], width: usize, out: &mut [f32]) {
    let rows = out.len() / width;
    let full = rows / ROWS_BLOCK * ROWS_BLOCK;
    for r0 in (0..full).step_by(ROWS_BLOCK) {
        let ps: [&[f32]; ROWS_BLOCK] =
            std::array::from_fn(|k| &p[(r0 + k) * p_stride..(r0 + k) * p_stride + n]);
        four_rows_times_matrix(ps, m, width, &mut out[r0 * width..(r0 + ROWS_BLOCK) * width]);
    }
    for r in full..rows {
        row_times_matrix_fma(
            &p[r * p_stride..r * p_stride + n],
            m,
            width,
            &mut out[r * width..(r + 1) * width],
        );
    }
}

/// Four rows' `out_r += sum_i a_r[i] * m[i * width ..]` (`out`: the four rows of `width`): per
/// block of [`OUT_BLOCK`] columns the four rows' accumulators stay in registers and each
/// matrix vector feeds all four; columns past the last whole block go row by row.
#[inline(always)]
fn four_rows_times_matrix(a: [&[f32]; ROWS_BLOCK], m: &[f32], width: usize, out: &mut [f32]) {
    let n = a[0].len();
    let blocks = width / OUT_BLOCK * OUT_BLOCK;
    for c0 in (0..blocks).step_by(OUT_BLOCK) {
        let mut acc = [[0.0f32; OUT_BLOCK]; ROWS_BLOCK];
        for (r, acc) in acc.iter_mut().enumerate() {
            acc.copy_from_slice(&out[r * width + c0..r * width + c0 + OUT_BLOCK]);
        }
        for i in 0..n {
            let row: &[f32; OUT_BLOCK] =
                m[i * width + c0..i * width + c0 + OUT_BLOCK].try_into().expect("block");
            for (acc, a) in acc.iter_mut().zip(&a) {
                let ai = a[i];
                for k in 0..OUT_BLOCK {
                    acc[k] = ai.mul_add(row[k], acc[k]);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            out[r * width + c0..r * width + c0 + OUT_BLOCK].copy_from_slice(acc);
        }
    }
    for (r, a) in a.iter().enumerate() {
        for (i, &ai) in a.iter().enumerate() {
            let o = &mut out[r * width + blocks..(r + 1) * width];
            for (o, &x) in o.iter_mut().zip(&m[i * width + blocks..i * width + width]) {
                *o = ai.mul_add(x, *o);
            }
        }
    }
}

/// Columns of `out` kept in registers across all of `a` (four 16-lane or eight 8-lane vectors).
const OUT_BLOCK: usize = 64;

/// Fused multiply-adds (inlined into the feature-enabled callers, where they vectorise): `out`
/// in blocks of [`OUT_BLOCK`] columns accumulated in a local array over every `a[i]`, so each
/// step loads one matrix vector and no accumulator; the tail column by column.
#[inline(always)]
fn row_times_matrix_fma(a: &[f32], m: &[f32], stride: usize, out: &mut [f32]) {
    let n = out.len();
    let blocks = n / OUT_BLOCK * OUT_BLOCK;
    for c0 in (0..blocks).step_by(OUT_BLOCK) {
        let mut acc = [0.0f32; OUT_BLOCK];
        acc.copy_from_slice(&out[c0..c0 + OUT_BLOCK]);
        for (i, &ai) in a.iter().enumerate() {
            let row: &[f32; OUT_BLOCK] =
                m[i * stride + c0..i * stride + c0 + OUT_BLOCK].try_into().expect("block");
            for k in 0..OUT_BLOCK {
                acc[k] = ai.mul_add(row[k], acc[k]);
            }
        }
        out[c0..c0 + OUT_BLOCK].copy_from_slice(&acc);
    }
    for (i, &ai) in a.iter().enumerate() {
        for (o, &x) in out[blocks..].iter_mut().zip(&m[i * stride + blocks..i * stride + n]) {
            *o = ai.mul_add(x, *o);
        }
    }
}

/// The scalar level: separate multiply and add (no FMA unit assumed).
fn row_times_matrix_plain(a: &[f32], m: &[f32], stride: usize, out: &mut [f32]) {
    let n = out.len();
    for (i, &ai) in a.iter().enumerate() {
        if ai == 0.0 {
            continue;
        }
        for (o, &x) in out.iter_mut().zip(&m[i * stride..i * stride + n]) {
            *o += ai * x;
        }
    }
}

/// Keys `k0..k0 + n` of kv head `kv` for a unit's `rows` query rows.
#[derive(Clone, Copy)]
struct Chunk {
    kv: usize,
    k0: usize,
    n: usize,
    rows: usize,
}

/// One row's output from partials `[acc (hd), max, sum]` of disjoint key ranges (and a sink
/// logit, a partial of sum 1 that attends nothing).
fn combine_row<'p>(parts: impl Iterator<Item = &'p [f32]> + Clone, sink: Option<f32>, out: &mut [f32]) {
    let hd = out.len();
    let max = parts.clone().map(|p| p[hd]).chain(sink).fold(f32::NEG_INFINITY, f32::max);
    out.fill(0.0);
    let mut sum = sink.map_or(0.0f32, |s| (s - max).exp());
    for p in parts {
        if p[hd] == f32::NEG_INFINITY {
            continue; // a range this row sees nothing of
        }
        let w = (p[hd] - max).exp();
        sum += p[hd + 1] * w;
        out.iter_mut().zip(&p[..hd]).for_each(|(o, a)| *o += a * w);
    }
    let inv = 1.0 / sum;
    out.iter_mut().for_each(|o| *o *= inv);
}

/// One unit's views of its thread's scratch.
struct UnitTile<'s> {
    /// rows x KEY_CHUNK: scores, then probabilities.
    scores: &'s mut [f32],
    /// rows x head_dim.
    acc: &'s mut [f32],
    max: &'s mut [f32],
    sum: &'s mut [f32],
    /// KEY_CHUNK x head_dim: the chunk's values decoded to f32 (non-f32 caches).
    values: &'s mut [f32],
    hd: usize,
    level: SimdLevel,
}

impl<'s> UnitTile<'s> {
    fn split(
        scratch: &'s mut [f32],
        level: SimdLevel,
        max_rows: usize,
        hd: usize,
        rows: usize,
    ) -> UnitTile<'s> {
        let (scores, rest) = scratch.split_at_mut(max_rows * KEY_CHUNK);
        let (acc, rest) = rest.split_at_mut(max_rows * hd);
        let (max, rest) = rest.split_at_mut(max_rows);
        let (sum, rest) = rest.split_at_mut(max_rows);
        let values = &mut rest[..KEY_CHUNK * hd];
        acc[..rows * hd].fill(0.0);
        max[..rows].fill(f32::NEG_INFINITY);
        sum[..rows].fill(0.0);
        UnitTile { scores, acc, max, sum, values, hd, level }
    }

    /// Masks row `r`'s scores of keys `k0..k0 + n` to `first..=last`, turns them into
    /// `exp(score - running max)` and rescales the row's sum and accumulator to the new max.
    fn fold_row(&mut self, r: usize, k0: usize, n: usize, first: usize, last: usize) {
        let level = self.level;
        let row = &mut self.scores[r * KEY_CHUNK..r * KEY_CHUNK + n];
        let mut chunk_max = f32::NEG_INFINITY;
        for (j, s) in row.iter_mut().enumerate() {
            let p = k0 + j;
            if p < first || p > last {
                *s = f32::NEG_INFINITY;
            }
            chunk_max = chunk_max.max(*s);
        }
        if chunk_max == f32::NEG_INFINITY {
            row.fill(0.0); // nothing visible in this chunk: it adds nothing
            return;
        }
        let new_max = self.max[r].max(chunk_max);
        let correction = (self.max[r] - new_max).exp(); // 0 while the max was -inf
        exp_shifted(level, row, new_max);
        let chunk_sum: f32 = row.iter().sum();
        self.sum[r] = self.sum[r] * correction + chunk_sum;
        self.max[r] = new_max;
        if correction != 1.0 {
            self.acc[r * self.hd..(r + 1) * self.hd].iter_mut().for_each(|a| *a *= correction);
        }
    }

    /// Row `r`'s unnormalised sum, running max and sum, for [`combine_row`].
    fn partial_row(&self, r: usize, part: &mut [f32]) {
        part[..self.hd].copy_from_slice(&self.acc[r * self.hd..(r + 1) * self.hd]);
        part[self.hd] = self.max[r];
        part[self.hd + 1] = self.sum[r];
    }

    /// Row `r`'s output; a sink logit joins the denominator (`acc e^(m-M) / (sum e^(m-M) +
    /// e^(sink-M))`, `M` the larger of the row's max and the sink).
    fn finish_row(&self, r: usize, sink: Option<f32>, out: &mut [f32]) {
        let inv = match sink {
            None => 1.0 / self.sum[r],
            Some(s) => {
                let m = self.max[r].max(s);
                let w = (self.max[r] - m).exp();
                w / (self.sum[r] * w + (s - m).exp())
            }
        };
        for (o, a) in out.iter_mut().zip(&self.acc[r * self.hd..(r + 1) * self.hd]) {
            *o = a * inv;
        }
    }
}

/// `x = exp(x - shift)` for every value (all `<= shift`: softmax arguments), vectorised for the
/// level. Masked values (`-inf`) become exactly 0.
fn exp_shifted(level: SimdLevel, x: &mut [f32], shift: f32) {
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller checked that the CPU supports the level's features.
        SimdLevel::Avx512 | SimdLevel::Avx512Bf16 | SimdLevel::Amx => unsafe { exp_shifted_avx512(x, shift) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        SimdLevel::Avx2 => unsafe { exp_shifted_avx2(x, shift) },
        _ => x.iter_mut().for_each(|v| *v = exp_nonpositive(*v - shift)),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
// SAFETY (callers): the CPU has these features; the body is safe code, compiled for them.
unsafe fn exp_shifted_avx512(x: &mut [f32], shift: f32) {
    x.iter_mut().for_each(|v| *v = exp_nonpositive(*v - shift))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
// SAFETY (callers): the CPU has these features; the body is safe code, compiled for them.
unsafe fn exp_shifted_avx2(x: &mut [f32], shift: f32) {
    x.iter_mut().for_each(|v| *v = exp_nonpositive(*v - shift))
}

/// `e^x` for `x <= 0` without a libm call, so that loops of it vectorise: `x = n ln2 + f` with
/// `|f| <= ln2 / 2` (Cody-Waite split of ln2), `e^f` by its degree-6 Taylor polynomial (relative
/// error below 2e-7 there), `2^n` through the exponent bits. Below -87 (where `e^x` leaves the
/// normal floats) it returns 0, so `-inf` gives exactly 0.
#[inline(always)]
pub(crate) fn exp_nonpositive(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    let clamped = x.max(-87.0);
    let n = (clamped * LOG2_E + ROUND) - ROUND;
    let f = (clamped - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + f * (1.0 + f * (0.5 + f * (1.0 / 6.0 + f * (1.0 / 24.0 + f * (1.0 / 120.0 + f * (1.0 / 720.0))))));
    let scale = f32::from_bits((((n as i32) + 127) as u32) << 23);
    if x < -87.0 {
        0.0
    } else {
        p * scale
    }
}

#[cfg(test)]
mod tests {
    use super::exp_nonpositive;

    #[test]
    fn exp_nonpositive_is_close_to_libm() {
        let mut worst = 0.0f32;
        for i in 0..=200_000 {
            let x = -87.0 * i as f32 / 200_000.0;
            let (got, want) = (exp_nonpositive(x), x.exp());
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 5e-7, "relative error {worst:e}");
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpositive(-100.0), 0.0);
        assert_eq!(exp_nonpositive(0.0), 1.0);
    }
}
