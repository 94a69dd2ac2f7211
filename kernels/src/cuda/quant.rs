//! Typed launchers for the quantized-block kernels (`kernels/cuda/quant.cu`), dispatched by
//! [`WeightDType`]: the dequantizing GEMV for decode ([`CudaBackend::gemv_quant`], the
//! counterpart of [`CudaBackend::gemv_bf16`]) and the dequantization of a row range to bf16 for
//! prefill ([`CudaBackend::dequantize_bf16`], whose output feeds [`CudaBackend::gemm_bf16`]).
//! Weights are raw GGUF blocks (`DPtr<u8>`), rows of `k` values as `k / block_elems`
//! consecutive blocks. Type, shapes, byte lengths and alignment are checked before any launch
//! ([`CudaError::Shape`], never an out-of-bounds launch).

#![allow(clippy::too_many_arguments)] // launchers mirror their kernels' parameter lists

use super::epilogue::{bias_arg, cache_slots, GateUpEpilogue};
use super::kernel::{
    grouped_pipe_shared_bytes, grouped_q8_shared_bytes, Kernel, GROUPED_DECODE_TILE_ROWS, GROUPED_THREADS,
    GROUPED_TILE_ROWS, QUANT_MAX_TOKENS, QUANT_WIDE_ROWS, ROWS_PER_BLOCK, ROW_BLOCK_THREADS,
};
use super::ops::{aligned16, args, blocks, i, need, GroupedShape};
use super::{CudaBackend, CudaError, DPtr, Result};
use crate::q8::Q8_BLOCK;
use crate::weights::WeightDType;

/// Threads per block of the dequantization kernels.
const DEQUANT_BLOCK: u32 = 256;
/// Error name of the GEMV launcher before a kernel is chosen.
const GEMV_NAME: &str = "gemv_quant";
/// Fewest warps an SM the one-token wide GEMV keeps before it takes one row a warp (two blocks
/// of [`ROWS_PER_BLOCK`] warps).
pub const WIDE_MIN_WARPS_PER_SM: usize = 2 * ROWS_PER_BLOCK as usize;
/// Error name of the dequantization launcher before a kernel is chosen.
const DEQUANT_NAME: &str = "dequantize_bf16";

/// The GEMV and the dequantization kernel of a quantized type (none for a float type).
pub fn quant_kernels(dtype: WeightDType) -> Option<(Kernel, Kernel)> {
    match dtype {
        WeightDType::Q8_0 => Some((Kernel::GemvQ8_0, Kernel::DequantQ8_0Bf16)),
        WeightDType::Q4_0 => Some((Kernel::GemvQ4_0, Kernel::DequantQ4_0Bf16)),
        WeightDType::Q4_K => Some((Kernel::GemvQ4K, Kernel::DequantQ4KBf16)),
        WeightDType::Q5_K => Some((Kernel::GemvQ5K, Kernel::DequantQ5KBf16)),
        WeightDType::Q6_K => Some((Kernel::GemvQ6K, Kernel::DequantQ6KBf16)),
        WeightDType::Mxfp4 => Some((Kernel::GemvMxfp4, Kernel::DequantMxfp4Bf16)),
        WeightDType::Q5_0 => Some((Kernel::GemvQ5_0, Kernel::DequantQ5_0Bf16)),
        WeightDType::Q5_1 => Some((Kernel::GemvQ5_1, Kernel::DequantQ5_1Bf16)),
        WeightDType::Iq4Nl => Some((Kernel::GemvIq4Nl, Kernel::DequantIq4NlBf16)),
        WeightDType::F32 | WeightDType::F16 | WeightDType::BF16 => None,
    }
}

/// The one-token GEMV of a quantized type (`gemv1_*`: wide 32-value chunks, several rows a warp).
fn wide_gemv_kernel(dtype: WeightDType) -> Option<Kernel> {
    match dtype {
        WeightDType::Q8_0 => Some(Kernel::Gemv1Q8_0),
        WeightDType::Q4_0 => Some(Kernel::Gemv1Q4_0),
        WeightDType::Q4_K => Some(Kernel::Gemv1Q4K),
        WeightDType::Q5_K => Some(Kernel::Gemv1Q5K),
        WeightDType::Q6_K => Some(Kernel::Gemv1Q6K),
        WeightDType::Mxfp4 => Some(Kernel::Gemv1Mxfp4),
        WeightDType::Q5_0 => Some(Kernel::Gemv1Q5_0),
        WeightDType::Q5_1 => Some(Kernel::Gemv1Q5_1),
        WeightDType::Iq4Nl => Some(Kernel::Gemv1Iq4Nl),
        WeightDType::F32 | WeightDType::F16 | WeightDType::BF16 => None,
    }
}

/// Byte alignment of the wide chunks' loads: 16 for Q4_K/Q5_K (uint4 loads; their blocks are
/// multiples of 16 bytes), 1 for MXFP4 (17-byte blocks: byte loads), 2 for the others (aligned
/// words and shifts).
pub fn wide_alignment_bytes(dtype: WeightDType) -> u64 {
    match dtype {
        WeightDType::Q4_K | WeightDType::Q5_K => 16,
        WeightDType::Mxfp4 => 1,
        _ => 2,
    }
}

/// Threads that decode one block in `quant.cu` (its `LANES`: 8 values each).
fn units_per_block(dtype: WeightDType) -> usize {
    dtype.block_elems() / 8
}

/// Byte alignment the kernels need for the blocks: word loads, 4 bytes for Q4_K/Q5_K (block
/// sizes multiples of 16), none for MXFP4 (odd 17-byte blocks, read byte by byte), 2 for the
/// others (block sizes only even).
pub fn quant_alignment_bytes(dtype: WeightDType) -> u64 {
    match dtype {
        WeightDType::Q4_K | WeightDType::Q5_K => 4,
        WeightDType::Mxfp4 => 1,
        _ => 2,
    }
}

/// Bytes a typed cache needs past its last row for MXFP4's pipelined grouped kernels, which load
/// each 8-value run (8 nibble bytes at any address: 17-byte blocks) as the 2 or 3 aligned words
/// that hold it, up to 3 bytes past the run. A cache without them takes the runtime-typed
/// kernel (byte loads). The cost: 4 bytes a cache.
pub const TYPED_TAIL_BYTES: usize = 4;

/// The pipelined grouped kernel of one weight type (`grouped_*_<type>_pipe`: each stage's raw
/// words fetched a stage ahead, decoded with the type known at compile time), for caches all of
/// that type; `None` for mixed types and types without one (the runtime-typed kernel). Q4_K and
/// Q5_K read 16-byte block headers: their caches and rows must be 16-byte aligned. MXFP4 reads
/// aligned words around each run: its caches of `rows` rows need [`TYPED_TAIL_BYTES`] past them.
fn typed_run_kernel(
    gate_up: bool,
    dec: bool,
    caches: &[TypedWeights],
    row_bytes: &[i32],
    rows: usize,
) -> Option<Kernel> {
    use WeightDType::{Mxfp4, Q4_K, Q5_K, Q6_K, Q8_0};
    let dtype = caches.first()?.dtype;
    if caches.iter().any(|c| c.dtype != dtype) {
        return None;
    }
    let aligned = caches.iter().all(|c| c.bytes.raw() % 16 == 0) && row_bytes.iter().all(|r| r % 16 == 0);
    if matches!(dtype, Q4_K | Q5_K) && !aligned {
        return None;
    }
    let tailed =
        caches.iter().zip(row_bytes).all(|(c, &rb)| c.bytes.len() >= rows * rb as usize + TYPED_TAIL_BYTES);
    if dtype == Mxfp4 && !tailed {
        return None;
    }
    Some(match (dtype, gate_up, dec) {
        (Q8_0, true, true) => Kernel::GroupedGateUpQ8_0Dec,
        (Q4_K, true, true) => Kernel::GroupedGateUpQ4KDec,
        (Q5_K, true, true) => Kernel::GroupedGateUpQ5KDec,
        (Q6_K, true, true) => Kernel::GroupedGateUpQ6KDec,
        (Q8_0, false, true) => Kernel::GroupedGemmQ8_0Dec,
        (Q4_K, false, true) => Kernel::GroupedGemmQ4KDec,
        (Q5_K, false, true) => Kernel::GroupedGemmQ5KDec,
        (Q6_K, false, true) => Kernel::GroupedGemmQ6KDec,
        (Mxfp4, true, true) => Kernel::GroupedGateUpMxfp4Dec,
        (Mxfp4, false, true) => Kernel::GroupedGemmMxfp4Dec,
        (Q8_0, true, false) => Kernel::GroupedGateUpQ8_0Pipe,
        (Q4_K, true, false) => Kernel::GroupedGateUpQ4KPipe,
        (Q5_K, true, false) => Kernel::GroupedGateUpQ5KPipe,
        (Q6_K, true, false) => Kernel::GroupedGateUpQ6KPipe,
        (Q8_0, false, false) => Kernel::GroupedGemmQ8_0Pipe,
        (Q4_K, false, false) => Kernel::GroupedGemmQ4KPipe,
        (Q5_K, false, false) => Kernel::GroupedGemmQ5KPipe,
        (Q6_K, false, false) => Kernel::GroupedGemmQ6KPipe,
        (Mxfp4, true, false) => Kernel::GroupedGateUpMxfp4Pipe,
        (Mxfp4, false, false) => Kernel::GroupedGemmMxfp4Pipe,
        _ => return None,
    })
}

fn shape(kernel: &'static str, reason: String) -> CudaError {
    CudaError::Shape { kernel, reason }
}

/// A `rows` x `k` matrix of `dtype` blocks starting at `w`: the type's kernels, once the type is
/// quantized, `k` whole blocks, `w` aligned for the kernel's loads and holding the rows' bytes.
fn check_matrix(
    name: &'static str,
    dtype: WeightDType,
    w: DPtr<u8>,
    rows: usize,
    k: usize,
) -> Result<(Kernel, Kernel)> {
    let kernels = quant_kernels(dtype)
        .ok_or_else(|| shape(name, format!("{} is not a quantized block type", dtype.name())))?;
    if !k.is_multiple_of(dtype.block_elems()) {
        let reason =
            format!("k = {k} is not a multiple of the {} block ({})", dtype.name(), dtype.block_elems());
        return Err(shape(name, reason));
    }
    let align = quant_alignment_bytes(dtype);
    if !w.raw().is_multiple_of(align) {
        return Err(shape(name, format!("W at {:#x} is not {align}-byte aligned", w.raw())));
    }
    let bytes =
        rows.checked_mul(dtype.row_bytes(k)).ok_or_else(|| shape(name, format!("{rows} rows overflow")))?;
    need(name, "W bytes", w, bytes)?;
    Ok(kernels)
}

/// The checks of [`CudaBackend::gemv_quant`]; its kernel.
pub(super) fn check_gemv(
    dtype: WeightDType,
    w: DPtr<u8>,
    x: DPtr<f32>,
    y: DPtr<f32>,
    n_tokens: usize,
    n: usize,
    k: usize,
) -> Result<Kernel> {
    let (gemv, _) = check_matrix(GEMV_NAME, dtype, w, n, k)?;
    need(gemv, "x", x, n_tokens * k)?;
    need(gemv, "y", y, n_tokens * n)?;
    if i32::try_from(n * k).is_err() {
        return Err(shape(gemv.symbol(), format!("{n} x {k} does not fit the kernel's int indices")));
    }
    Ok(gemv)
}

/// The checks of [`CudaBackend::dequantize_bf16`]: its kernel, the byte view of the row range
/// and its number of blocks.
pub(super) fn check_dequantize(
    dtype: WeightDType,
    w: DPtr<u8>,
    row0: usize,
    rows: usize,
    k: usize,
    out: DPtr<u16>,
) -> Result<(Kernel, DPtr<u8>, usize)> {
    let end = row0.checked_add(rows).ok_or_else(|| shape(DEQUANT_NAME, format!("row {row0} + {rows}")))?;
    let (_, dequant) = check_matrix(DEQUANT_NAME, dtype, w, end, k)?;
    need(dequant, "out", out, rows * k)?;
    let n_blocks = rows * (k / dtype.block_elems());
    if i32::try_from(n_blocks * units_per_block(dtype)).is_err() {
        return Err(shape(dequant.symbol(), format!("{n_blocks} blocks in one launch")));
    }
    let row_bytes = dtype.row_bytes(k);
    Ok((dequant, w.sub(row0 * row_bytes, rows * row_bytes), n_blocks))
}

/// Device weights in one block type: GGUF blocks as the file stores them, or bf16 bit patterns
/// ([`WeightDType::BF16`], float files). A stack of `[rows, k]` matrices (a hot cache's slots)
/// lies matrix after matrix, each `rows * dtype.row_bytes(k)` bytes.
#[derive(Clone, Copy, Debug)]
pub struct TypedWeights {
    pub bytes: DPtr<u8>,
    pub dtype: WeightDType,
}

impl TypedWeights {
    /// The bf16 view, when the type is bf16.
    pub fn bf16(&self) -> Option<DPtr<u16>> {
        (self.dtype == WeightDType::BF16).then(|| self.bytes.as_u16())
    }

    /// Matrix `idx` of a stack of `[rows, k]` matrices; panics beyond the stack (a programming
    /// error).
    pub fn matrix(&self, idx: usize, rows: usize, k: usize) -> TypedWeights {
        let n = rows * self.dtype.row_bytes(k);
        TypedWeights { bytes: self.bytes.sub(idx * n, n), dtype: self.dtype }
    }
}

/// Rows of 8-bit activations on the device, as [`crate::q8::Q8Activations`] holds them on the
/// CPU (and bit for bit what it computes): `q` `[rows, k]` i8, `d` `[rows, k / 32]` block scales.
/// Written by [`CudaBackend::quantize_q8`]; the one-token GEMVs of quantized weights dot them
/// with dp4a (`quant.cu`, error bound in `kernels/src/q8.rs`).
#[derive(Clone, Copy, Debug)]
pub struct Q8Rows {
    pub q: DPtr<i8>,
    pub d: DPtr<f32>,
}

/// `xq` holds `rows` rows of `k` values (`k` whole blocks of 32) at a 16-byte aligned base.
fn check_q8(kernel: Kernel, what: &str, xq: Q8Rows, rows: usize, k: usize) -> Result<()> {
    if !k.is_multiple_of(Q8_BLOCK) {
        return Err(shape(kernel.symbol(), format!("{what}: k = {k} is not whole blocks of {Q8_BLOCK}")));
    }
    if !xq.q.raw().is_multiple_of(16) {
        return Err(shape(kernel.symbol(), format!("{what} at {:#x} is not 16-byte aligned", xq.q.raw())));
    }
    need(kernel, what, xq.q, rows * k)?;
    need(kernel, what, xq.d, rows * k / Q8_BLOCK)
}

/// The kernel arguments of an optional [`Q8Rows`] (null pointers: f32 activations).
fn q8_args(xq: Option<Q8Rows>) -> (u64, u64) {
    xq.map_or((0, 0), |q| (q.q.raw(), q.d.raw()))
}

/// The hot-lane kernels' code for a type (`quant.cu`, `warp_dot_typed`); none for f32/f16,
/// which the device never stores.
fn type_code(dtype: WeightDType) -> Option<i32> {
    match dtype {
        WeightDType::Q8_0 => Some(0),
        WeightDType::Q4_0 => Some(1),
        WeightDType::Q4_K => Some(2),
        WeightDType::Q5_K => Some(3),
        WeightDType::Q6_K => Some(4),
        WeightDType::BF16 => Some(5),
        WeightDType::Mxfp4 => Some(6),
        WeightDType::Q5_0 => Some(7),
        WeightDType::Q5_1 => Some(8),
        WeightDType::Iq4Nl => Some(9),
        WeightDType::F32 | WeightDType::F16 => None,
    }
}

/// A stack of `[rows, k]` matrices for the typed hot-lane kernels: its type code and row bytes,
/// once the type has kernels, `k` is whole blocks, the base is aligned and one matrix fits.
fn check_typed(kernel: Kernel, what: &str, w: TypedWeights, rows: usize, k: usize) -> Result<(i32, i32)> {
    let name = kernel.symbol();
    let code = type_code(w.dtype)
        .ok_or_else(|| shape(name, format!("{what}: no hot-lane kernel for {}", w.dtype.name())))?;
    if !k.is_multiple_of(w.dtype.block_elems()) {
        let reason = format!("{what}: k = {k} is not whole {} blocks", w.dtype.name());
        return Err(shape(name, reason));
    }
    let align = wide_alignment_bytes(w.dtype);
    if !w.bytes.raw().is_multiple_of(align) {
        return Err(shape(name, format!("{what} at {:#x} is not {align}-byte aligned", w.bytes.raw())));
    }
    let row_bytes = w.dtype.row_bytes(k);
    need(kernel, what, w.bytes, rows * row_bytes)?;
    Ok((code, i(row_bytes)))
}

impl CudaBackend {
    /// `y[t, :] (+)= W · x[t, :]` for `t < n_tokens`; W `[n, k]` in `dtype` blocks (a quantized
    /// type, `k` a multiple of its block). Decode GEMV: each launch decodes every weight once and
    /// multiplies it with up to [`QUANT_MAX_TOKENS`] token rows (more tokens take more launches);
    /// one token with aligned views takes the wide kernel (`gemv1_*`: 32 values per lane and
    /// load, [`QUANT_WIDE_ROWS`] rows per warp sharing the loads of x, or one row per warp when
    /// that leaves too few warps: [`CudaBackend::wide_rows_per_warp`]; the sums are the same).
    pub fn gemv_quant(
        &self,
        dtype: WeightDType,
        w: DPtr<u8>,
        x: DPtr<f32>,
        y: DPtr<f32>,
        n_tokens: usize,
        n: usize,
        k: usize,
        accumulate: bool,
    ) -> Result<()> {
        let kernel = check_gemv(dtype, w, x, y, n_tokens, n, k)?;
        let acc = accumulate as i32;
        let wide = wide_gemv_kernel(dtype)
            .filter(|_| n_tokens == 1 && x.raw().is_multiple_of(16))
            .filter(|_| w.raw().is_multiple_of(wide_alignment_bytes(dtype)));
        if let Some(wide) = wide {
            let rows = self.wide_rows_per_warp(n);
            let grid = (blocks(n, ROWS_PER_BLOCK * rows), 1, 1);
            let args = args![w.raw(), x.raw(), y.raw(), i(n), i(k), acc, rows as i32];
            return self.launch(wide, grid, ROW_BLOCK_THREADS, 0, args);
        }
        let per = QUANT_MAX_TOKENS as usize;
        for t0 in (0..n_tokens).step_by(per) {
            let (xs, ys) = (x.from(t0 * k), y.from(t0 * n));
            let t = i(per.min(n_tokens - t0));
            self.launch(
                kernel,
                (blocks(n, ROWS_PER_BLOCK), 1, 1),
                ROW_BLOCK_THREADS,
                0,
                args![w.raw(), xs.raw(), ys.raw(), i(n), i(k), t, acc],
            )?;
        }
        Ok(())
    }

    /// Rows per warp of the one-token wide GEMV over `n` rows: [`QUANT_WIDE_ROWS`], or 1 when
    /// that would leave fewer than [`WIDE_MIN_WARPS_PER_SM`] warps an SM (a 2048-row output
    /// projection had 8 warps an SM and ran latency-bound at 400 GB/s on the H100).
    pub fn wide_rows_per_warp(&self, n: usize) -> u32 {
        if self.short_of_warps(n.div_ceil(QUANT_WIDE_ROWS as usize)) {
            1
        } else {
            QUANT_WIDE_ROWS
        }
    }

    /// Whether a launch of `warps` warps leaves fewer than [`WIDE_MIN_WARPS_PER_SM`] an SM (the
    /// decode GEMVs then spread a row over more warps).
    pub(crate) fn short_of_warps(&self, warps: usize) -> bool {
        warps < self.info().multiprocessors.max(1) as usize * WIDE_MIN_WARPS_PER_SM
    }

    /// `out = q8(x)` for `rows` rows of `k` values (`k` whole blocks of 32): each block of 32 as
    /// [`crate::q8::Q8Activations::quantize_row`] computes it, bit for bit.
    pub fn quantize_q8(&self, x: DPtr<f32>, rows: usize, k: usize, out: Q8Rows) -> Result<()> {
        const K: Kernel = Kernel::QuantizeQ8F32;
        check_q8(K, "out", out, rows, k)?;
        need(K, "x", x, rows * k)?;
        let n_blocks = rows * k / Q8_BLOCK;
        if n_blocks == 0 {
            return Ok(());
        }
        let grid = (blocks(rows * k, DEQUANT_BLOCK), 1, 1);
        self.launch(K, grid, DEQUANT_BLOCK, 0, args![x.raw(), out.q.raw(), out.d.raw(), i(n_blocks)])
    }

    /// `y (+)= W · x` for one token with x in its 8-bit form ([`Self::quantize_q8`]): the wide
    /// chunks of [`Self::gemv_quant`]'s one-token kernel (same rows per warp), each chunk's dot in
    /// integers (dp4a) against the weight levels. W `[n, k]` in a quantized `dtype`.
    pub fn gemv_quant_q8(
        &self,
        dtype: WeightDType,
        w: DPtr<u8>,
        xq: Q8Rows,
        y: DPtr<f32>,
        n: usize,
        k: usize,
        accumulate: bool,
    ) -> Result<()> {
        const K: Kernel = Kernel::Gemv1Q8;
        check_matrix(K.symbol(), dtype, w, n, k)?;
        let (code, row_bytes) = check_typed(K, "W", TypedWeights { bytes: w, dtype }, n, k)?;
        check_q8(K, "xq", xq, 1, k)?;
        need(K, "y", y, n)?;
        let rows = self.wide_rows_per_warp(n);
        let grid = (blocks(n, ROWS_PER_BLOCK * rows), 1, 1);
        let (q, d) = (xq.q.raw(), xq.d.raw());
        let args = args![w.raw(), code, row_bytes, q, d, y.raw(), i(n), i(k), accumulate as i32, rows as i32];
        self.launch(K, grid, ROW_BLOCK_THREADS, 0, args)
    }

    /// `y[t] (+)= W · x_t` for `n_tokens` tokens in their 8-bit form (`xq` `[n_tokens, k]`, y
    /// `[n_tokens, n]`): one token takes [`Self::gemv_quant_q8`]; more read each chunk of W once
    /// for up to [`QUANT_MAX_TOKENS`] tokens (one launch each), every token's sum the one-row
    /// kernel's (one row a warp) for that token alone.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_quant_q8_tokens(
        &self,
        dtype: WeightDType,
        w: DPtr<u8>,
        xq: Q8Rows,
        y: DPtr<f32>,
        n_tokens: usize,
        n: usize,
        k: usize,
        accumulate: bool,
    ) -> Result<()> {
        if n_tokens == 1 {
            return self.gemv_quant_q8(dtype, w, xq, y, n, k, accumulate);
        }
        const K: Kernel = Kernel::GemvQ8Tokens;
        check_matrix(K.symbol(), dtype, w, n, k)?;
        let (code, row_bytes) = check_typed(K, "W", TypedWeights { bytes: w, dtype }, n, k)?;
        check_q8(K, "xq", xq, n_tokens, k)?;
        need(K, "y", y, n_tokens * n)?;
        let per = QUANT_MAX_TOKENS as usize;
        for t0 in (0..n_tokens).step_by(per) {
            let t = per.min(n_tokens - t0);
            let (q, d) = (xq.q.from(t0 * k).raw(), xq.d.from(t0 * k / Q8_BLOCK).raw());
            let args = args![
                w.raw(),
                code,
                row_bytes,
                q,
                d,
                y.from(t0 * n).raw(),
                i(n),
                i(k),
                i(t),
                accumulate as i32
            ];
            self.launch(K, (blocks(n, ROWS_PER_BLOCK), 1, 1), ROW_BLOCK_THREADS, 0, args)?;
        }
        Ok(())
    }

    /// `out[r - row0, :] = bf16(W[r, :])` for `row0 <= r < row0 + rows` (round to nearest even;
    /// the values before rounding equal the CPU's `quant::dequantize_block`); W `[>= row0 + rows,
    /// k]` in `dtype` blocks, `out` `[rows, k]` bf16. Prefill: dequantized tiles for
    /// [`CudaBackend::gemm_bf16`].
    pub fn dequantize_bf16(
        &self,
        dtype: WeightDType,
        w: DPtr<u8>,
        row0: usize,
        rows: usize,
        k: usize,
        out: DPtr<u16>,
    ) -> Result<()> {
        self.dequantize_bf16_on(false, dtype, w, row0, rows, k, out)
    }

    /// [`CudaBackend::dequantize_bf16`] on the side stream (after the side stream's queued
    /// copies; the caller orders it against the compute stream with events).
    pub fn dequantize_bf16_side(
        &self,
        dtype: WeightDType,
        w: DPtr<u8>,
        row0: usize,
        rows: usize,
        k: usize,
        out: DPtr<u16>,
    ) -> Result<()> {
        self.dequantize_bf16_on(true, dtype, w, row0, rows, k, out)
    }

    fn dequantize_bf16_on(
        &self,
        side: bool,
        dtype: WeightDType,
        w: DPtr<u8>,
        row0: usize,
        rows: usize,
        k: usize,
        out: DPtr<u16>,
    ) -> Result<()> {
        let (kernel, range, n_blocks) = check_dequantize(dtype, w, row0, rows, k, out)?;
        let units = n_blocks * units_per_block(dtype);
        self.launch_on(
            side,
            kernel,
            (blocks(units, DEQUANT_BLOCK), 1, 1),
            DEQUANT_BLOCK,
            0,
            args![range.raw(), out.raw(), i(n_blocks)],
        )
    }
}

/// The wide chunks read x as float4: its base must be 16-byte aligned.
fn check_x16(kernel: Kernel, what: &str, x: DPtr<f32>) -> Result<()> {
    if !x.raw().is_multiple_of(16) {
        return Err(shape(kernel.symbol(), format!("{what} at {:#x} is not 16-byte aligned", x.raw())));
    }
    Ok(())
}

impl CudaBackend {
    /// Hot lane decode, first half, over caches of any stored type (the counterpart of
    /// [`CudaBackend::moe_gate_up_gemv`]): `h[e] = glu(G_s · x_t + bg_s, U_s · x_t + bu_s)` for
    /// entry `e` (slot `slots[e]`, -1 skipped; token row `tokens[e]`), caches
    /// `[n_slots, ff, hidden]`, the activation and per-slot biases `[n_slots, ff]` from `epi`.
    pub fn moe_gate_up_gemv_typed(
        &self,
        gate: TypedWeights,
        up: TypedWeights,
        x: DPtr<f32>,
        xq: Option<Q8Rows>,
        slots: DPtr<i32>,
        tokens: DPtr<i32>,
        h: DPtr<f32>,
        n_entries: usize,
        ff: usize,
        hidden: usize,
        epi: &GateUpEpilogue,
    ) -> Result<()> {
        const K: Kernel = Kernel::MoeGateUpGemvQ;
        let (g_type, g_row) = check_typed(K, "gate_cache", gate, ff, hidden)?;
        let (u_type, u_row) = check_typed(K, "up_cache", up, ff, hidden)?;
        let n_slots = cache_slots(gate.bytes.len(), ff * g_row as usize);
        let (act, bg, bu) = epi.args(K, n_slots, ff)?;
        check_x16(K, "x", x)?;
        let x_rows = x.len() / hidden.max(1);
        if let Some(q) = xq {
            check_q8(K, "xq", q, x_rows, hidden)?;
        }
        let (qp, dp) = q8_args(xq);
        need(K, "slots", slots, n_entries)?;
        need(K, "tokens", tokens, n_entries)?;
        need(K, "h", h, n_entries * ff)?;
        let (g, u) = (gate.bytes.raw(), up.bytes.raw());
        let kernel = if xq.is_some() { Kernel::MoeGateUpGemvQ8 } else { K };
        self.launch(
            kernel,
            (blocks(ff, ROWS_PER_BLOCK), n_entries as u32, 1),
            ROW_BLOCK_THREADS,
            0,
            args![
                g,
                u,
                g_type,
                u_type,
                g_row,
                u_row,
                x.raw(),
                qp,
                dp,
                slots.raw(),
                tokens.raw(),
                h.raw(),
                i(ff),
                i(hidden),
                act,
                bg,
                bu
            ],
        )
    }

    /// Decode q/k/v in one launch (`gemv3_typed`): `y[j] = w[j] · x` for one token, each matrix
    /// `[n[j], k]` in any stored type (quantized or bf16); the bits of [`Self::gemv_quant`]'s
    /// one-token kernel and of [`CudaBackend::gemv_bf16`] per matrix. `x` 16-byte aligned.
    pub fn gemv3_typed(
        &self,
        w: [TypedWeights; 3],
        x: DPtr<f32>,
        xq: Option<Q8Rows>,
        y: [DPtr<f32>; 3],
        n: [usize; 3],
        k: usize,
    ) -> Result<()> {
        const K: Kernel = Kernel::Gemv3Typed;
        let mut ty = [0i32; 3];
        let mut rb = [0i32; 3];
        for j in 0..3 {
            (ty[j], rb[j]) = check_typed(K, ["q", "k", "v"][j], w[j], n[j], k)?;
            need(K, "y", y[j], n[j])?;
        }
        check_x16(K, "x", x)?;
        need(K, "x", x, k)?;
        if let Some(q) = xq {
            check_q8(K, "xq", q, 1, k)?;
        }
        let (qp, dp) = q8_args(xq);
        let warps: usize = n.iter().map(|nj| nj.div_ceil(QUANT_WIDE_ROWS as usize)).sum();
        let kernel = if xq.is_some() { Kernel::Gemv3TypedQ8 } else { K };
        self.launch(
            kernel,
            (blocks(warps, ROWS_PER_BLOCK), 1, 1),
            ROW_BLOCK_THREADS,
            0,
            args![
                w[0].bytes.raw(),
                w[1].bytes.raw(),
                w[2].bytes.raw(),
                ty[0],
                ty[1],
                ty[2],
                rb[0],
                rb[1],
                rb[2],
                x.raw(),
                qp,
                dp,
                y[0].raw(),
                y[1].raw(),
                y[2].raw(),
                i(n[0]),
                i(n[1]),
                i(n[2]),
                i(k)
            ],
        )
    }

    /// [`CudaBackend::grouped_gate_up`] over typed caches `[n_slots, ff, hidden]` (any stored type;
    /// gate and up may differ): each weight tile is decoded into shared memory as bf16, so the
    /// result equals dequantizing the slots with [`CudaBackend::dequantize_bf16`] and running the
    /// bf16 kernel, without a bf16 copy in VRAM. Two bf16 caches take the bf16 kernel itself.
    pub fn grouped_gate_up_typed(
        &self,
        gate_cache: TypedWeights,
        up_cache: TypedWeights,
        n_slots: usize,
        x: DPtr<f32>,
        rows: DPtr<i32>,
        n_x_rows: usize,
        tiles: DPtr<i32>,
        n_tiles: usize,
        tile_rows: usize,
        h: DPtr<f32>,
        n_rows: usize,
        ff: usize,
        hidden: usize,
        split: bool,
        epi: &GateUpEpilogue,
    ) -> Result<()> {
        if let (Some(g), Some(u)) = (gate_cache.bf16(), up_cache.bf16()) {
            let (r, t, tr) = (rows, tiles, tile_rows);
            return self.grouped_gate_up(
                g, u, n_slots, x, r, n_x_rows, t, n_tiles, tr, h, n_rows, ff, hidden, split, epi,
            );
        }
        const K: Kernel = Kernel::GroupedGateUpQ;
        let shape = GroupedShape { n_slots, n_x_rows, n_rows, n_tiles, tile_rows, n: ff, k: hidden };
        shape.check(K, &[], x, Some(rows), tiles, h)?;
        let (act, bg, bu) = epi.args(K, n_slots, ff)?;
        let (gt, grb) = check_typed(K, "gate cache", gate_cache, n_slots * ff, hidden)?;
        let (ut, urb) = check_typed(K, "up cache", up_cache, n_slots * ff, hidden)?;
        if n_tiles == 0 || ff == 0 {
            return Ok(());
        }
        let (g, u) = (gate_cache.bytes.raw(), up_cache.bytes.raw());
        let (xr, rr, tr, hr) = (x.raw(), rows.raw(), tiles.raw(), h.raw());
        let args = args![
            g,
            u,
            gt,
            ut,
            grb,
            urb,
            xr,
            rr,
            i(n_x_rows),
            tr,
            i(n_rows),
            i(n_slots),
            hr,
            i(ff),
            i(hidden),
            i32::from(split),
            act,
            bg,
            bu
        ];
        let (caches, row_bytes) = ([gate_cache, up_cache], [grb, urb]);
        let typed = (&caches[..], &row_bytes[..], n_slots * ff);
        let (kernel, shared) = self.grouped_typed_kernel(K, x, hidden, typed, tile_rows);
        self.launch(kernel, shape.grid(), GROUPED_THREADS, shared, args)
    }

    /// [`CudaBackend::grouped_gemm`] over a typed cache `[n_slots, n, k]`, decoded tile by tile
    /// as [`CudaBackend::grouped_gate_up_typed`] (a bf16 cache takes the bf16 kernel); `bias`
    /// per-slot `[n_slots, n]` added to each row (none: no bias).
    pub fn grouped_gemm_typed(
        &self,
        w_cache: TypedWeights,
        n_slots: usize,
        x: DPtr<f32>,
        rows: Option<DPtr<i32>>,
        n_x_rows: usize,
        tiles: DPtr<i32>,
        n_tiles: usize,
        tile_rows: usize,
        y: DPtr<f32>,
        n_rows: usize,
        n: usize,
        k: usize,
        split: bool,
        bias: Option<DPtr<f32>>,
    ) -> Result<()> {
        if let Some(w) = w_cache.bf16() {
            let (t, nt, tr) = (tiles, n_tiles, tile_rows);
            return self.grouped_gemm(w, n_slots, x, rows, n_x_rows, t, nt, tr, y, n_rows, n, k, split, bias);
        }
        const K: Kernel = Kernel::GroupedGemmQ;
        let shape = GroupedShape { n_slots, n_x_rows, n_rows, n_tiles, tile_rows, n, k };
        shape.check(K, &[], x, rows, tiles, y)?;
        let b = bias_arg(K, "bias", bias, n_slots * n)?;
        let (wt, rb) = check_typed(K, "weight cache", w_cache, n_slots * n, k)?;
        if n_tiles == 0 || n == 0 {
            return Ok(());
        }
        let (w, r) = (w_cache.bytes.raw(), rows.map_or(0, |p| p.raw()));
        let args = args![
            w,
            wt,
            rb,
            x.raw(),
            r,
            i(n_x_rows),
            tiles.raw(),
            i(n_rows),
            i(n_slots),
            y.raw(),
            i(n),
            i(k),
            i32::from(split),
            b
        ];
        let (kernel, shared) =
            self.grouped_typed_kernel(K, x, k, (&[w_cache], &[rb], n_slots * n), tile_rows);
        self.launch(kernel, shape.grid(), GROUPED_THREADS, shared, args)
    }

    /// [`CudaBackend::grouped_gate_up_typed`] over MXFP4 caches with 8-bit activations, as
    /// llama.cpp's MMQ multiplies: `xq` holds x's rows as [`CudaBackend::quantize_q8`] writes
    /// them, and int8 tensor-core tiles give each block's integer dot, scaled by its x and weight
    /// scales (the 8-bit GEMV's value of a block; sums in k order). Prefill's tiles (at most
    /// [`GROUPED_TILE_ROWS`] rows); sm_80 and later; each cache needs [`TYPED_TAIL_BYTES`] past
    /// its rows (the hot cache has them).
    pub fn grouped_gate_up_q8(
        &self,
        (gate_cache, up_cache): (TypedWeights, TypedWeights),
        n_slots: usize,
        (xq, rows, n_x_rows): (Q8Rows, DPtr<i32>, usize),
        (tiles, n_tiles): (DPtr<i32>, usize),
        (h, n_rows): (DPtr<f32>, usize),
        (ff, hidden): (usize, usize),
        epi: &GateUpEpilogue,
    ) -> Result<()> {
        const K: Kernel = Kernel::GroupedGateUpMxfp4Q8;
        let shape = GroupedShape {
            n_slots,
            n_x_rows,
            n_rows,
            n_tiles,
            tile_rows: GROUPED_TILE_ROWS,
            n: ff,
            k: hidden,
        };
        shape.check_layout(K, &[], Some(rows), tiles, h)?;
        check_q8(K, "x", xq, n_x_rows, hidden)?;
        let (act, bg, bu) = epi.args(K, n_slots, ff)?;
        let grb = self.check_q8_cache(K, "gate cache", gate_cache, n_slots * ff, hidden)?;
        let urb = self.check_q8_cache(K, "up cache", up_cache, n_slots * ff, hidden)?;
        if n_tiles == 0 || ff == 0 {
            return Ok(());
        }
        let (g, u) = (gate_cache.bytes.raw(), up_cache.bytes.raw());
        let (q, d, rr, tr, hr) = (xq.q.raw(), xq.d.raw(), rows.raw(), tiles.raw(), h.raw());
        let args = args![
            g,
            u,
            grb,
            urb,
            q,
            d,
            rr,
            i(n_x_rows),
            tr,
            i(n_rows),
            i(n_slots),
            hr,
            i(ff),
            i(hidden),
            act,
            bg,
            bu
        ];
        let shared = grouped_q8_shared_bytes(2) as u32;
        self.launch(K, shape.grid(), GROUPED_THREADS, shared, args)
    }

    /// [`CudaBackend::grouped_gemm_typed`] over an MXFP4 cache with 8-bit activations, as
    /// [`CudaBackend::grouped_gate_up_q8`]; `bias` per-slot `[n_slots, n]` (none: no bias).
    pub fn grouped_gemm_q8(
        &self,
        w_cache: TypedWeights,
        n_slots: usize,
        (xq, rows, n_x_rows): (Q8Rows, Option<DPtr<i32>>, usize),
        (tiles, n_tiles): (DPtr<i32>, usize),
        (y, n_rows): (DPtr<f32>, usize),
        (n, k): (usize, usize),
        bias: Option<DPtr<f32>>,
    ) -> Result<()> {
        const K: Kernel = Kernel::GroupedGemmMxfp4Q8;
        let shape = GroupedShape { n_slots, n_x_rows, n_rows, n_tiles, tile_rows: GROUPED_TILE_ROWS, n, k };
        shape.check_layout(K, &[], rows, tiles, y)?;
        check_q8(K, "x", xq, n_x_rows, k)?;
        let b = bias_arg(K, "bias", bias, n_slots * n)?;
        let rb = self.check_q8_cache(K, "weight cache", w_cache, n_slots * n, k)?;
        if n_tiles == 0 || n == 0 {
            return Ok(());
        }
        let (w, r) = (w_cache.bytes.raw(), rows.map_or(0, |p| p.raw()));
        let args = args![
            w,
            rb,
            xq.q.raw(),
            xq.d.raw(),
            r,
            i(n_x_rows),
            tiles.raw(),
            i(n_rows),
            i(n_slots),
            y.raw(),
            i(n),
            i(k),
            b
        ];
        self.launch(K, shape.grid(), GROUPED_THREADS, grouped_q8_shared_bytes(1) as u32, args)
    }

    /// An int8 tile's cache of `rows` rows of `k` values: MXFP4 (the one type with int8 tiles),
    /// with [`TYPED_TAIL_BYTES`] past its rows, on a device with the int8 MMAs (sm_80); its row
    /// bytes.
    fn check_q8_cache(
        &self,
        kernel: Kernel,
        what: &str,
        w: TypedWeights,
        rows: usize,
        k: usize,
    ) -> Result<i32> {
        let name = kernel.symbol();
        if w.dtype != WeightDType::Mxfp4 {
            return Err(shape(name, format!("{what}: int8 tiles take MXFP4 caches, not {}", w.dtype.name())));
        }
        if !self.info().has_sm80() {
            return Err(shape(name, "int8 tiles need sm_80 or later".to_string()));
        }
        let (_, row_bytes) = check_typed(kernel, what, w, rows, k)?;
        need(kernel, what, w.bytes, rows * row_bytes as usize + TYPED_TAIL_BYTES)?;
        Ok(row_bytes)
    }

    /// The typed grouped kernel `sync` (gate/up or one matrix) or its pipelined form, which
    /// takes the same arguments: pipelined where the x copies fit (k a multiple of 8, x 16-byte
    /// aligned) and [`CudaBackend::grouped_pipeline`] is on; there, caches of one type take that
    /// type's instance where it has one ([`typed_run_kernel`]), and tiles of at most
    /// [`GROUPED_DECODE_TILE_ROWS`] rows the decode shape's. With its dynamic shared memory.
    /// The caches hold `rows` rows each.
    fn grouped_typed_kernel(
        &self,
        sync: Kernel,
        x: DPtr<f32>,
        k: usize,
        (caches, row_bytes, rows): (&[TypedWeights], &[i32], usize),
        tile_rows: usize,
    ) -> (Kernel, u32) {
        let fits = self.grouped_pipeline() && k.is_multiple_of(8) && aligned16(&[x.raw()]);
        let gate_up = sync == Kernel::GroupedGateUpQ;
        let dec = tile_rows <= GROUPED_DECODE_TILE_ROWS;
        let shared = grouped_pipe_shared_bytes(if gate_up { 2 } else { 1 }, tile_rows) as u32;
        let generic = match (gate_up, dec) {
            (true, true) => Kernel::GroupedGateUpQDec,
            (true, false) => Kernel::GroupedGateUpQPipe,
            (false, true) => Kernel::GroupedGemmQDec,
            (false, false) => Kernel::GroupedGemmQPipe,
        };
        match fits {
            true => (typed_run_kernel(gate_up, dec, caches, row_bytes, rows).unwrap_or(generic), shared),
            false => (sync, 0),
        }
    }

    /// `out[t] = table[tokens[t]]` widened to f32 for a table `[vocab, hidden]` in any stored
    /// type (quantized rows decode to the CPU's values exactly). Token ids must be checked by the
    /// caller.
    pub fn embed_typed(
        &self,
        table: TypedWeights,
        vocab: usize,
        tokens: DPtr<i32>,
        out: DPtr<f32>,
        n_tokens: usize,
        hidden: usize,
    ) -> Result<()> {
        const K: Kernel = Kernel::EmbedQ;
        let (code, row_bytes) = check_typed(K, "table", table, vocab, hidden)?;
        need(K, "tokens", tokens, n_tokens)?;
        need(K, "out", out, n_tokens * hidden)?;
        let args = args![table.bytes.raw(), code, row_bytes, tokens.raw(), out.raw(), i(hidden)];
        self.launch(K, (n_tokens as u32, 1, 1), DEQUANT_BLOCK, 0, args)
    }

    /// Hot lane decode, second half, over a cache of any stored type (the counterpart of
    /// [`CudaBackend::moe_down_accum`]): output row `r` (token `tok_rows[r]`, entries
    /// `tok_off[r]..tok_off[r+1]`) adds `Σ weights[e] · (D_{slots[e]} · h[e] + b_{slots[e]})`; cache
    /// `[n_slots, hidden, ff]`, `down_bias` per-slot `[n_slots, hidden]` (none: no bias).
    /// Deterministic (no atomics).
    pub fn moe_down_accum_typed(
        &self,
        down: TypedWeights,
        h: DPtr<f32>,
        hq: Option<Q8Rows>,
        slots: DPtr<i32>,
        weights: DPtr<f32>,
        tok_off: DPtr<i32>,
        tok_rows: DPtr<i32>,
        out: DPtr<f32>,
        n_rows: usize,
        hidden: usize,
        ff: usize,
        down_bias: Option<DPtr<f32>>,
    ) -> Result<()> {
        const K: Kernel = Kernel::MoeDownAccumQ;
        let (d_type, d_row) = check_typed(K, "down_cache", down, hidden, ff)?;
        let n_slots = cache_slots(down.bytes.len(), hidden * d_row as usize);
        let bd = bias_arg(K, "down bias", down_bias, n_slots * hidden)?;
        check_x16(K, "h", h)?;
        if let Some(q) = hq {
            check_q8(K, "hq", q, h.len() / ff.max(1), ff)?;
        }
        let (qp, dp) = q8_args(hq);
        need(K, "tok_off", tok_off, n_rows + 1)?;
        need(K, "tok_rows", tok_rows, n_rows)?;
        let (p, o) = (down.bytes.raw(), out.raw());
        let kernel = if hq.is_some() { Kernel::MoeDownAccumQ8 } else { K };
        self.launch(
            kernel,
            (blocks(hidden, ROWS_PER_BLOCK), n_rows as u32, 1),
            ROW_BLOCK_THREADS,
            0,
            args![
                p,
                d_type,
                d_row,
                h.raw(),
                qp,
                dp,
                slots.raw(),
                weights.raw(),
                tok_off.raw(),
                tok_rows.raw(),
                o,
                i(hidden),
                i(ff),
                bd
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::marker::PhantomData;

    fn view<T>(raw: u64, len: usize) -> DPtr<T> {
        DPtr { raw, len, _m: PhantomData }
    }

    fn is_shape(r: Result<impl std::fmt::Debug>, needle: &str) -> bool {
        matches!(&r, Err(CudaError::Shape { reason, .. }) if reason.contains(needle))
    }

    #[test]
    fn every_quantized_type_has_its_kernels_and_floats_none() {
        for dtype in WeightDType::QUANTIZED {
            let (gemv, dequant) = quant_kernels(dtype).unwrap();
            let name = dtype.name();
            assert_eq!(
                (gemv.symbol(), dequant.symbol()),
                (&*format!("gemv_{name}"), &*format!("dequant_{name}_bf16"))
            );
            assert!(dtype.block_bytes().is_multiple_of(quant_alignment_bytes(dtype) as usize));
        }
        for dtype in WeightDType::FLOATS {
            assert!(quant_kernels(dtype).is_none());
        }
    }

    #[test]
    fn gemv_checks_type_blocks_bytes_alignment_and_views() {
        let (n, k, t) = (3, 512, 2);
        let x = view::<f32>(0x1000, t * k);
        let y = view::<f32>(0x1000, t * n);
        for dtype in WeightDType::QUANTIZED {
            let w = view::<u8>(0x1000, n * dtype.row_bytes(k));
            assert_eq!(check_gemv(dtype, w, x, y, t, n, k).unwrap(), quant_kernels(dtype).unwrap().0);
            assert!(is_shape(
                check_gemv(dtype, w, x, y, t, n, k + 32 - dtype.block_elems() / 2),
                "not a multiple"
            ));
            assert!(is_shape(check_gemv(dtype, w.sub(0, w.len() - 1), x, y, t, n, k), "W bytes"));
            let odd = check_gemv(dtype, view(0x1001, w.len()), x, y, t, n, k);
            if dtype == WeightDType::Mxfp4 {
                assert!(odd.is_ok(), "MXFP4's 17-byte blocks are read byte by byte, at any address");
            } else {
                assert!(is_shape(odd, "aligned"));
            }
            assert!(is_shape(check_gemv(dtype, w, x.sub(0, t * k - 1), y, t, n, k), "x holds"));
            assert!(is_shape(check_gemv(dtype, w, x, y.sub(0, t * n - 1), t, n, k), "y holds"));
        }
        let w = view::<u8>(0x1002, n * WeightDType::Q4_K.row_bytes(k));
        assert!(is_shape(check_gemv(WeightDType::Q4_K, w, x, y, t, n, k), "4-byte aligned"));
        assert!(check_gemv(WeightDType::Q6_K, view(0x1002, n * 420), x, y, t, n, k).is_ok());
        assert!(is_shape(check_gemv(WeightDType::BF16, w, x, y, t, n, k), "not a quantized"));
    }

    #[test]
    fn dequantize_checks_the_row_range_and_output() {
        let (rows, k) = (5, 256);
        for dtype in WeightDType::QUANTIZED {
            let rb = dtype.row_bytes(k);
            let w = view::<u8>(0x2000, rows * rb);
            let out = view::<u16>(0x8000, 2 * k);
            let (kernel, range, n_blocks) = check_dequantize(dtype, w, 3, 2, k, out).unwrap();
            assert_eq!(kernel, quant_kernels(dtype).unwrap().1);
            assert_eq!(
                (range.raw(), range.len(), n_blocks),
                (0x2000 + 3 * rb as u64, 2 * rb, 2 * k / dtype.block_elems())
            );
            assert!(is_shape(check_dequantize(dtype, w, 4, 2, k, out), "W bytes"));
            assert!(is_shape(check_dequantize(dtype, w, usize::MAX, 2, k, out), "row"));
            assert!(is_shape(check_dequantize(dtype, w, 0, 3, k, out), "out holds"));
            assert!(is_shape(check_dequantize(dtype, w, 0, 1, k - 16, out), "not a multiple"));
        }
        let w = view::<u8>(0x2000, 100);
        assert!(is_shape(
            check_dequantize(WeightDType::F16, w, 0, 1, 32, view(0x8000, 32)),
            "not a quantized"
        ));
    }
}
