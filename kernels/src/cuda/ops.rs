//! Typed launchers for the kernels in `kernels/cuda/*.cu` (looked up by [`Kernel`] id). Each checks its views against the
//! shapes it is given (a mismatch is [`CudaError::Shape`], never an out-of-bounds launch) and
//! queues the kernel on the backend's stream. bf16 data is passed as `u16` bit patterns.

#![allow(clippy::too_many_arguments)] // launchers mirror their kernels' parameter lists

use super::epilogue::{bias_arg, cache_slots, GateUpEpilogue};
use super::kernel::{
    attention_mma_wide_shared_bytes, delta_scan_shared_bytes, grouped_pipe_shared_bytes, Kernel,
    ARGMAX_BLOCK, ATTENTION_COMBINE_DIMS, ATTENTION_MMA_MAX_HEAD_DIM, ATTENTION_MMA_THREADS,
    ATTENTION_MMA_WARPS, ATTENTION_MMA_WIDE_MAX_HEAD_DIM, ATTENTION_SPLIT_THREADS,
    ATTENTION_TILE_MAX_HEAD_DIM, ATTENTION_TILE_ROWS, ATTENTION_TILE_THREADS, DELTA_CHUNK,
    DELTA_MAX_CONV_KERNEL, DELTA_MAX_KEY_DIM, DELTA_SCAN_COLS, DELTA_SCAN_THREADS, GEMV_MMA_MIN_WARPS_PER_SM,
    GEMV_MMA_TOKENS, GEMV_MMA_WARPS, GEMV_SPLIT_WARPS, GROUPED_DECODE_TILE_ROWS, GROUPED_THREADS,
    GROUPED_TILE_COLS, GROUPED_TILE_ROWS, HOT_DOWN_ROWS, ROWS_PER_BLOCK, ROW_BLOCK_THREADS,
};
use super::{CudaBackend, CudaError, DPtr, Result};
use crate::kv::{kv_ring_positions, kv_ring_rows, KvType, KV_RING_CHUNK_POSITIONS};
use cudarc::cublas::{result as br, sys as bs};
use std::ffi::c_void;
use std::sync::atomic::Ordering;

const BLOCK: u32 = 256;
/// Shared memory of [`CudaBackend::route_decode`]: a normed row and a logits row (the default
/// 48 KiB a block may take without opting in).
const ROUTE_DECODE_SHARED_BYTES: usize = 48 << 10;
/// Attention keeps one score per visible position in shared memory (48 KiB default limit).
pub const ATTENTION_MAX_POSITIONS: usize = 12 * 1024;
/// Largest head dimension of the attention kernels (`-DATT_MAX_HEAD_DIM`; `-DATT_MAXC` values per
/// lane).
pub const ATTENTION_MAX_HEAD_DIM: usize = 256;
/// Positions per block of the split attention kernel (`-DATT_CHUNK`; a multiple of
/// [`super::kernel::ATTENTION_SPLIT_WARPS`]).
pub const ATTENTION_SPLIT_CHUNK: usize = 32;
/// Query heads of one block of the grouped split attention kernel (`ATT_GQA_HEADS` in the
/// source), all of one kv head.
pub const ATTENTION_GQA_HEADS: usize = 8;
/// Largest head dimension of the grouped split attention kernel (`ATT_GQA_MAXD` in the source).
pub const ATTENTION_GQA_MAX_HEAD_DIM: usize = 128;
/// Blocks a grouped split attention launch aims at (each reads its rows once for 8 heads).
pub const ATTENTION_GQA_TARGET_BLOCKS: usize = 512;
/// Blocks a split attention launch aims at (the H100 / H200 hold 132 x 8 of its 256-thread
/// blocks at once): the cap on its spans per row and head.
pub const ATTENTION_SPLIT_TARGET_BLOCKS: usize = 1024;
/// Most experts a token's routing picks on the GPU: the lanes of one warp hold the picks and
/// their weights in registers (`-DTOPK_PER_LANE` = this / 32 each). Cost: 8 registers a lane;
/// models pick 1-8.
pub const ROUTE_MAX_TOPK: usize = 128;
const _: () = assert!(ROUTE_MAX_TOPK.is_multiple_of(32));

/// Whether the GPU routing takes a top-`k` of `n_experts`.
fn topk_fits(k: usize, n_experts: usize) -> bool {
    (1..=n_experts.min(ROUTE_MAX_TOPK)).contains(&k)
}

/// Blocks per row of the split argmax.
pub const ARGMAX_SPLIT_BLOCKS: usize = 128;
/// Threads of the attention kernel (one warp per position in the score pass).
const ATTENTION_BLOCK: u32 = 256;

/// How router logits become expert weights (kernel argument `variant`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteVariant {
    SoftmaxThenTopK = 0,
    TopKThenSoftmax = 1,
}

/// The options of [`CudaBackend::route_sigmoid`]: a per-expert bias added to the scores for the
/// choice only, `n_group` groups of which the best `topk_group` stay eligible (1 and 1: no
/// groups), renormalisation of the picks' scores, and a factor on the weights.
#[derive(Debug, Clone, Copy)]
pub struct SigmoidRoute {
    pub selection_bias: Option<DPtr<f32>>,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm: bool,
    pub scale: f32,
}

macro_rules! args {
    ($($a:expr),* $(,)?) => {
        &mut [$( &$a as *const _ as *mut std::ffi::c_void ),*]
    };
}
pub(super) use args;

/// A kernel id or the name of a library call (cuBLAS), for error messages.
pub(super) trait KernelName: Copy {
    fn name(self) -> &'static str;
}

impl KernelName for Kernel {
    fn name(self) -> &'static str {
        self.symbol()
    }
}

impl KernelName for &'static str {
    fn name(self) -> &'static str {
        self
    }
}

/// The blocks of a flash-style prefill attention launch: query rows and threads of one block.
#[derive(Clone, Copy)]
struct TileBlock {
    rows: usize,
    threads: u32,
}

/// Head layout of an attention launch: `n_tokens` queries against `total` cached positions.
#[derive(Clone, Copy)]
struct AttentionHeads {
    n_tokens: usize,
    total: usize,
    n_heads: usize,
    n_kv: usize,
    head_dim: usize,
}

/// A KV cache (or rows of one) on the device, in its element type: f32, f16 or bf16 (as `u16`
/// bit patterns), or q8_0 (llama.cpp's blocks of 32 values, 34 bytes: an f16 scale, 32 int8).
/// Every attention launcher reads each; `DPtr<f32>` converts into the f32 form. Offsets and
/// lengths count values (q8_0: whole blocks).
#[derive(Debug, Clone, Copy)]
pub enum KvPtr {
    F32(DPtr<f32>),
    F16(DPtr<u16>),
    Bf16(DPtr<u16>),
    Q8_0(DPtr<u8>),
}

impl From<DPtr<f32>> for KvPtr {
    fn from(p: DPtr<f32>) -> KvPtr {
        KvPtr::F32(p)
    }
}

/// Values per q8_0 block, and its bytes.
const Q8_0_VALUES: usize = crate::kv::Q8_0_BLOCK;
const Q8_0_BYTES: usize = crate::kv::Q8_0_BLOCK_BYTES;

impl KvPtr {
    pub fn raw(&self) -> u64 {
        match self {
            KvPtr::F32(p) => p.raw(),
            KvPtr::F16(p) | KvPtr::Bf16(p) => p.raw(),
            KvPtr::Q8_0(p) => p.raw(),
        }
    }
    /// Values (whatever their type).
    pub fn len(&self) -> usize {
        match self {
            KvPtr::F32(p) => p.len(),
            KvPtr::F16(p) | KvPtr::Bf16(p) => p.len(),
            KvPtr::Q8_0(p) => p.len() / Q8_0_BYTES * Q8_0_VALUES,
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn kv_type(&self) -> KvType {
        match self {
            KvPtr::F32(_) => KvType::F32,
            KvPtr::F16(_) => KvType::F16,
            KvPtr::Bf16(_) => KvType::Bf16,
            KvPtr::Q8_0(_) => KvType::Q8_0,
        }
    }
    pub fn is_f16(&self) -> bool {
        matches!(self, KvPtr::F16(_))
    }
    /// Values `[offset, offset + len)`; panics when out of range or, for q8_0, not whole blocks
    /// (a programming error).
    pub fn sub(&self, offset: usize, len: usize) -> KvPtr {
        match self {
            KvPtr::F32(p) => KvPtr::F32(p.sub(offset, len)),
            KvPtr::F16(p) => KvPtr::F16(p.sub(offset, len)),
            KvPtr::Bf16(p) => KvPtr::Bf16(p.sub(offset, len)),
            KvPtr::Q8_0(p) => {
                assert!(
                    offset.is_multiple_of(Q8_0_VALUES) && len.is_multiple_of(Q8_0_VALUES),
                    "q8_0 rows are whole blocks"
                );
                KvPtr::Q8_0(p.sub(offset / Q8_0_VALUES * Q8_0_BYTES, len / Q8_0_VALUES * Q8_0_BYTES))
            }
        }
    }
    /// The kernel argument that says the type (`kv_type` of norm_rope.cu: 0 f32, 1 f16, 2 bf16,
    /// 3 q8_0).
    pub(super) fn type_code(&self) -> i32 {
        match self {
            KvPtr::F32(_) => 0,
            KvPtr::F16(_) => 1,
            KvPtr::Bf16(_) => 2,
            KvPtr::Q8_0(_) => 3,
        }
    }
}

/// The kernel code of a cache type (`KvPtr::type_code`): the index of its instance in a
/// kernel's `[f32, f16, bf16, q8_0]`.
fn kv_type_code(t: KvType) -> usize {
    match t {
        KvType::F32 => 0,
        KvType::F16 => 1,
        KvType::Bf16 => 2,
        KvType::Q8_0 => 3,
    }
}

/// Dynamic shared memory of [`CudaBackend::hot_worklist_grouped`]'s one block (under the
/// default 48 KiB, beside its static counters).
const HOT_GROUPED_SHARED_BYTES: usize = 47 << 10;

/// The longest head the fused q/k norm + RoPE stages for a q8_0 append (`KV_STAGE_MAX` of
/// norm_rope.cu).
const QK_STAGE_MAX_HEAD_DIM: usize = 512;

fn need_kv(kernel: impl KernelName, what: &str, p: KvPtr, n: usize) -> Result<()> {
    match p {
        KvPtr::F32(d) => need(kernel, what, d, n),
        KvPtr::F16(d) | KvPtr::Bf16(d) => need(kernel, what, d, n),
        KvPtr::Q8_0(d) => need(kernel, what, d, n.div_ceil(Q8_0_VALUES) * Q8_0_BYTES),
    }
}

/// The instance of an attention kernel for caches of `k`'s type: `[f32, f16, bf16, q8_0]`.
pub(super) fn kv_kernel(instances: [Kernel; 4], k: KvPtr) -> Kernel {
    instances[k.type_code() as usize]
}

/// Both caches of one type, and (q8_0) rows of whole blocks: every `width` (a head, a row)
/// a multiple of 32.
fn check_kv_pair(kernel: Kernel, k: KvPtr, v: KvPtr, widths: &[usize]) -> Result<()> {
    if k.kv_type() != v.kv_type() {
        let reason = format!("the key ({}) and value ({}) caches differ in type", k.kv_type(), v.kv_type());
        return Err(CudaError::Shape { kernel: kernel.symbol(), reason });
    }
    check_kv_widths(kernel, k.kv_type(), widths)
}

/// A block type's (q8_0) rows are whole blocks: every `width` (a head, a row) a multiple of 32.
fn check_kv_widths(kernel: Kernel, kv_type: KvType, widths: &[usize]) -> Result<()> {
    let block = kv_type.block_len();
    if let Some(w) = widths.iter().find(|w| !w.is_multiple_of(block)) {
        let reason =
            format!("{kv_type} caches store blocks of {block} values; a row or head of {w} splits one");
        return Err(CudaError::Shape { kernel: kernel.symbol(), reason });
    }
    Ok(())
}

/// The checks every attention launcher makes: the heads group over the kv heads, the head
/// dimension is within the kernel's `max_head_dim`, the two caches have one type, and q, the two
/// caches and out hold what the shapes say.
fn check_attention(
    kernel: Kernel,
    (q, k, v, out): (DPtr<f32>, KvPtr, KvPtr, DPtr<f32>),
    h: AttentionHeads,
    max_head_dim: usize,
    window: usize,
) -> Result<()> {
    let AttentionHeads { n_tokens, total, n_heads, n_kv, head_dim } = h;
    check_ring_call(kernel, window, n_tokens)?;
    let total = kv_ring_rows(window, total);
    check_kv_pair(kernel, k, v, &[head_dim])?;
    if n_kv == 0 || n_heads / n_kv * n_kv != n_heads {
        let reason = format!("{n_heads} heads do not group over {n_kv} kv heads");
        return Err(CudaError::Shape { kernel: kernel.symbol(), reason });
    }
    if head_dim == 0 || head_dim > max_head_dim {
        let reason = format!("head_dim {head_dim} not in 1..={max_head_dim}");
        return Err(CudaError::Shape { kernel: kernel.symbol(), reason });
    }
    need(kernel, "q", q, n_tokens * n_heads * head_dim)?;
    need_kv(kernel, "k_cache", k, total * n_kv * head_dim)?;
    need_kv(kernel, "v_cache", v, total * n_kv * head_dim)?;
    need(kernel, "out", out, n_tokens * n_heads * head_dim)
}

/// A sliding-window layer's ring holds one call's [`KV_RING_CHUNK_POSITIONS`] new positions
/// past the window: a longer call would overwrite keys its first rows still see.
fn check_ring_call(kernel: Kernel, window: usize, n_tokens: usize) -> Result<()> {
    if window > 0 && n_tokens > KV_RING_CHUNK_POSITIONS {
        let reason = format!(
            "{n_tokens} tokens in one call over a sliding window's ring: at most {KV_RING_CHUNK_POSITIONS}"
        );
        return Err(CudaError::Shape { kernel: kernel.symbol(), reason });
    }
    Ok(())
}

/// Every address a multiple of 16 bytes (what the 16-byte vector loads and `cp.async` copies of
/// the tensor-core kernels need).
pub(super) fn aligned16(addrs: &[u64]) -> bool {
    addrs.iter().all(|a| a.is_multiple_of(16))
}

/// RoPE over the first `rot_dims` of a head: an even number, at most `head_dim`.
fn check_rope(kernel: Kernel, head_dim: usize, rot_dims: usize) -> Result<()> {
    if head_dim & 1 == 1 || rot_dims & 1 == 1 || rot_dims == 0 || rot_dims > head_dim {
        return Err(CudaError::Shape {
            kernel: kernel.symbol(),
            reason: format!("RoPE over {rot_dims} of head_dim {head_dim}: both even, 2..=head_dim"),
        });
    }
    Ok(())
}

/// A Gated DeltaNet layer's sizes, as its kernels take them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaShape {
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    pub k_head_dim: usize,
    pub v_head_dim: usize,
    pub conv_kernel: usize,
    /// Value head `j` reads key head `j % n_k_heads` (llama.cpp's Qwen3.5 order), else
    /// `j / (n_v_heads / n_k_heads)` (transformers').
    pub tiled_v_heads: bool,
}

impl DeltaShape {
    /// q, k and v channels: what the conv runs over.
    pub fn conv_dim(&self) -> usize {
        2 * self.n_k_heads * self.k_head_dim + self.n_v_heads * self.v_head_dim
    }
    /// A row of the projections: `[q | k | v | z]`.
    pub fn p_stride(&self) -> usize {
        self.conv_dim() + self.n_v_heads * self.v_head_dim
    }
    /// Floats of the chunked prefill's work buffer for `n_tokens` ([`CudaBackend::delta_rule_chunked`]):
    /// one record per value head and chunk of [`DELTA_CHUNK`] tokens (`kernels/cuda/delta_net.cu`).
    pub fn chunk_work_floats(&self, n_tokens: usize) -> usize {
        let (dk, dv, c) =
            (self.k_head_dim.next_multiple_of(4), self.v_head_dim.next_multiple_of(4), DELTA_CHUNK);
        self.n_v_heads * n_tokens.div_ceil(c) * (c * (3 * dk + dv + c) + 4)
    }
    /// Floats of the work buffer a prefill of `n_tokens` needs: the conv's raw inputs
    /// ([`CudaBackend::delta_conv_rows`]), then the chunk records (one after the other, so one
    /// buffer serves both).
    pub fn prefill_work_floats(&self, n_tokens: usize) -> usize {
        self.chunk_work_floats(n_tokens).max(n_tokens * self.conv_dim())
    }
    fn check(&self, kernel: Kernel) -> Result<()> {
        let ok = self.n_k_heads > 0
            && self.n_v_heads.is_multiple_of(self.n_k_heads)
            && (1..=DELTA_MAX_KEY_DIM).contains(&self.k_head_dim)
            && (1..=1024).contains(&self.v_head_dim)
            && (2..=DELTA_MAX_CONV_KERNEL).contains(&self.conv_kernel);
        if ok {
            return Ok(());
        }
        Err(CudaError::Shape {
            kernel: kernel.symbol(),
            reason: format!(
                "{self:?}: key head dim up to {DELTA_MAX_KEY_DIM}, value head dim up to 1024, conv 2..={DELTA_MAX_CONV_KERNEL}, v heads a multiple of k heads"
            ),
        })
    }
}

pub(super) fn need<T>(kernel: impl KernelName, what: &str, p: DPtr<T>, n: usize) -> Result<()> {
    let kernel = kernel.name();
    if p.len() < n {
        return Err(CudaError::Shape {
            kernel,
            reason: format!("{what} holds {} elements, {n} needed", p.len()),
        });
    }
    Ok(())
}

pub(super) fn i(v: usize) -> i32 {
    i32::try_from(v).expect("dimension fits in i32")
}

/// The block of [`CudaBackend::gemv_mma_bf16`]: how many rows and warps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemvMmaBlock {
    /// 16 rows, [`GEMV_MMA_WARPS`] warps (`gemv_mma_bf16`): the base shape the other two widen,
    /// which the kernel tests compare them with.
    Rows16,
    /// 16 rows, twice [`GEMV_MMA_WARPS`] warps (`gemv_mma_bf16_w16`): projections of few blocks.
    Wide,
    /// 32 rows, [`GEMV_MMA_WARPS`] warps (`gemv_mma_bf16_r32`): each block's activations read
    /// once for twice the weights; projections of many blocks (the lm_head). On the H200 the
    /// 16-row blocks they replaced gave 2839.9 / 1499.6 t/s at 16 / 4 sequences against 2884.2 /
    /// 1551.6 (16-layer Qwen3-30B-A3B-shaped BF16, all hot; session 41).
    RowPairs,
}

/// What [`CudaBackend::gemv_bf16_split`] reads with vector loads: `k` a multiple of 8, W and x
/// 16-byte aligned.
fn split_views_aligned(w: DPtr<u16>, x: DPtr<f32>, k: usize) -> bool {
    k.is_multiple_of(8) && w.raw().is_multiple_of(16) && x.raw().is_multiple_of(16)
}

/// The grid and block of a grouped bf16 kernel: the decode shape's register-direct kernels take
/// [`GEMV_MMA_WARPS`] warps a block and 16 output columns of gate and of up
/// (`grouped_gate_up_bf16_rows*`) or 32 of the down projection (`grouped_gemm_bf16_rows*`), the
/// others [`GROUPED_TILE_COLS`] over [`GROUPED_THREADS`].
fn grouped_launch(kernel: Kernel, shape: &GroupedShape) -> ((u32, u32, u32), u32) {
    match kernel {
        Kernel::GroupedGateUpBf16Rows | Kernel::GroupedGateUpBf16RowsEpi => {
            ((shape.n_tiles as u32, blocks(shape.n, 16), 1), 32 * GEMV_MMA_WARPS)
        }
        Kernel::GroupedGemmBf16Rows | Kernel::GroupedGemmBf16RowsBias => {
            ((shape.n_tiles as u32, blocks(shape.n, 32), 1), 32 * GEMV_MMA_WARPS)
        }
        _ => (shape.grid(), GROUPED_THREADS),
    }
}

pub(super) fn blocks(n: usize, per: u32) -> u32 {
    (n as u32).div_ceil(per)
}

/// The tiles of a grouped expert GEMM over rows whose cache slots are `slot_of_row` (rows of one
/// slot contiguous, as in an expert-major worklist): each run of equal slots cut into tiles of at
/// most [`GROUPED_TILE_ROWS`] rows, written to `tiles` as `(slot, first row, row count)` triples.
/// Returns the tile count. A tile holds at least one row, so `tiles` needs at most
/// `3 * slot_of_row.len()` entries; a shorter `tiles` is [`CudaError::Shape`].
pub fn grouped_tiles(slot_of_row: &[u32], tiles: &mut [i32]) -> Result<usize> {
    let mut n_tiles = 0;
    let mut start = 0;
    while start < slot_of_row.len() {
        let slot = slot_of_row[start];
        let run = slot_of_row[start..].iter().take_while(|&&s| s == slot).count();
        for first in (start..start + run).step_by(GROUPED_TILE_ROWS) {
            let rows = GROUPED_TILE_ROWS.min(start + run - first);
            let Some(t) = tiles.get_mut(3 * n_tiles..3 * n_tiles + 3) else {
                return Err(CudaError::Shape {
                    kernel: "grouped_tiles",
                    reason: format!("tiles holds {} entries, more are needed", tiles.len()),
                });
            };
            t.copy_from_slice(&[slot as i32, first as i32, rows as i32]);
            n_tiles += 1;
        }
        start += run;
    }
    Ok(n_tiles)
}

/// One grouped GEMM's operands for the shape checks: the per-slot matrices, the f32 input
/// (gathered by `rows` or taken row by row), the tiles and the output.
pub(super) struct GroupedShape {
    pub n_slots: usize,
    pub n_x_rows: usize,
    pub n_rows: usize,
    pub n_tiles: usize,
    /// The most rows of any tile in the list (the kernels refuse, so skip, a longer one): at most
    /// [`GROUPED_DECODE_TILE_ROWS`] takes the decode shape's kernels, at most [`GROUPED_TILE_ROWS`]
    /// prefill's.
    pub tile_rows: usize,
    pub n: usize,
    pub k: usize,
}

impl GroupedShape {
    pub(super) fn check(
        &self,
        kernel: Kernel,
        ws: &[DPtr<u16>],
        x: DPtr<f32>,
        rows: Option<DPtr<i32>>,
        tiles: DPtr<i32>,
        out: DPtr<f32>,
    ) -> Result<()> {
        self.check_layout(kernel, ws, rows, tiles, out)?;
        need(kernel, "x", x, self.n_x_rows * self.k)
    }

    /// [`GroupedShape::check`] but x, which the caller checks in its own form (8-bit rows).
    pub(super) fn check_layout(
        &self,
        kernel: Kernel,
        ws: &[DPtr<u16>],
        rows: Option<DPtr<i32>>,
        tiles: DPtr<i32>,
        out: DPtr<f32>,
    ) -> Result<()> {
        if self.tile_rows == 0 || self.tile_rows > GROUPED_TILE_ROWS {
            let reason = format!("tiles of {} rows (1..={GROUPED_TILE_ROWS})", self.tile_rows);
            return Err(CudaError::Shape { kernel: kernel.symbol(), reason });
        }
        for w in ws {
            need(kernel, "weight cache", *w, self.n_slots * self.n * self.k)?;
        }
        match rows {
            Some(r) => need(kernel, "rows", r, self.n_rows)?,
            None if self.n_x_rows < self.n_rows => {
                return Err(CudaError::Shape {
                    kernel: kernel.symbol(),
                    reason: format!(
                        "x has {} rows, {} needed without a row gather",
                        self.n_x_rows, self.n_rows
                    ),
                })
            }
            None => {}
        }
        need(kernel, "tiles", tiles, 3 * self.n_tiles)?;
        need(kernel, "out", out, self.n_rows * self.n)
    }

    pub(super) fn grid(&self) -> (u32, u32, u32) {
        (self.n_tiles as u32, blocks(self.n, GROUPED_TILE_COLS as u32), 1)
    }
}

/// Rows to RMS-normalise: `x` `[n_rows, dim]` with the norm's `weight`, into `normed`.
#[derive(Debug, Clone, Copy)]
pub struct NormRows {
    pub x: DPtr<f32>,
    pub weight: DPtr<f32>,
    pub normed: DPtr<f32>,
    pub n_rows: usize,
    pub dim: usize,
    pub eps: f32,
}

impl NormRows {
    fn check(&self, kernel: Kernel) -> Result<()> {
        need(kernel, "x", self.x, self.n_rows * self.dim)?;
        need(kernel, "norm weight", self.weight, self.dim)?;
        need(kernel, "normed", self.normed, self.n_rows * self.dim)
    }
}

/// A layer's hot worklist in the token-major layout of [`CudaBackend::hot_worklist_tokens`]:
/// the layer's expert -> slot `map` and the sections it fills.
#[derive(Debug, Clone, Copy)]
pub struct HotWorklist {
    pub map: DPtr<i32>,
    pub slots: DPtr<i32>,
    pub tokens: DPtr<i32>,
    pub tok_off: DPtr<i32>,
    pub tok_rows: DPtr<i32>,
}

impl HotWorklist {
    /// Checks the sections for `t` rows of top-`k` over `n_experts`; the raw pointers in order.
    fn check(&self, kernel: Kernel, t: usize, k: usize, n_experts: usize) -> Result<[u64; 5]> {
        need(kernel, "map", self.map, n_experts)?;
        need(kernel, "slots", self.slots, t * k)?;
        need(kernel, "tokens", self.tokens, t * k)?;
        need(kernel, "tok_off", self.tok_off, t + 1)?;
        need(kernel, "tok_rows", self.tok_rows, t)?;
        Ok([self.map, self.slots, self.tokens, self.tok_off, self.tok_rows].map(|p| p.raw()))
    }
}

/// Which positions a query row attends and what joins its softmax: the last `window` positions
/// (0: all), and per query head a learned sink logit (`sinks`, `[n_heads]` f32: GPT-OSS) that
/// takes probability and attends nothing. A bare window converts into a mask without sinks.
#[derive(Debug, Clone, Copy, Default)]
pub struct AttentionMask {
    pub window: usize,
    pub sinks: Option<DPtr<f32>>,
}

impl From<usize> for AttentionMask {
    fn from(window: usize) -> AttentionMask {
        AttentionMask { window, sinks: None }
    }
}

impl AttentionMask {
    /// The window, and the sinks' raw address (0: none) checked for `n_heads` values.
    fn parts(self, kernel: Kernel, n_heads: usize) -> Result<(usize, u64)> {
        match self.sinks {
            Some(s) => {
                need(kernel, "sinks", s, n_heads)?;
                Ok((self.window, s.raw()))
            }
            None => Ok((self.window, 0)),
        }
    }
}

/// RoPE frequencies other than `theta^(-2i/rot)`: a table of one inverse frequency per rotated
/// pair (f64, computed on the host as the reference does: YaRN) and a factor on sin and cos.
#[derive(Debug, Clone, Copy)]
pub struct RopeScaling {
    pub freqs: DPtr<f64>,
    pub scale: f32,
}

/// A [`RopeScaling`]'s kernel arguments (null table and scale 1 without one), its table checked
/// for `rot / 2` pairs.
pub(super) fn rope_scaling_args(
    kernel: Kernel,
    scaling: Option<RopeScaling>,
    rot: usize,
) -> Result<(u64, f32)> {
    match scaling {
        Some(r) => {
            need(kernel, "rope freqs", r.freqs, rot / 2)?;
            Ok((r.freqs.raw(), r.scale))
        }
        None => Ok((0, 1.0)),
    }
}

/// The decode graph's key/value append ([`CudaBackend::qk_norm_rope`]): the call's first position
/// is read from `pos` on the device, the new key rows (roped in the kernel) and value rows `v`
/// (`[n_tokens, kv_dim]`) go to rows `pos..` of the caches (`[capacity, kv_dim]`). The host
/// writes a position below `capacity - n_tokens + 1` (the kernel cannot check it). A
/// sliding-window layer's caches (`window` > 0) are its mirrored ring
/// ([`crate::kv::kv_ring_positions`]).
#[derive(Debug, Clone, Copy)]
pub struct KvAppend {
    /// Device memory holding the first token's position (the decode graph); `None`: the
    /// launcher's `pos0` (prefill into an f16 cache).
    pub pos: Option<DPtr<i32>>,
    pub v: DPtr<f32>,
    pub k_cache: KvPtr,
    pub v_cache: KvPtr,
    /// The layer's sliding window (0: a full layer).
    pub window: usize,
}

impl KvAppend {
    fn check(&self, kernel: Kernel, n_tokens: usize, kv_dim: usize, pos0: usize) -> Result<()> {
        if let Some(p) = self.pos {
            need(kernel, "pos", p, 1)?;
        }
        check_kv_pair(kernel, self.k_cache, self.v_cache, &[kv_dim])?;
        // From device memory the position is unknown here: the rows fit from position 0.
        let positions = if self.pos.is_some() { n_tokens } else { pos0 + n_tokens };
        let rows = kv_ring_rows(self.window, positions);
        need(kernel, "v", self.v, n_tokens * kv_dim)?;
        need_kv(kernel, "k cache", self.k_cache, rows * kv_dim)?;
        need_kv(kernel, "v cache", self.v_cache, self.k_cache.len())
    }
}

/// A query position held in device memory (the decode graph replays for every token), and the
/// most positions before it the call may see (the split attention's grid is sized for them).
#[derive(Debug, Clone, Copy)]
pub struct DevicePos {
    pub pos: DPtr<i32>,
    pub max_positions: usize,
}

/// A batched step's rows, each of its own sequence with its own KV cache, for the one-launch
/// q/k norm + RoPE + append ([`CudaBackend::qk_norm_rope_rows`]) and decode attention
/// ([`CudaBackend::attention_split_rows`]): in device memory, for every row `r` of the call, its
/// position `pos[r]` and the raw addresses `k[r]`, `v[r]` of its sequence's key and value caches
/// of one layer (`[capacity, kv_dim]` each, all of `kv_type`). The host that writes them
/// guarantees each cache holds row `r`'s position (the launchers cannot read device memory);
/// `max_positions` is the most positions a row sees (its position + 1), which sizes the split
/// attention's grid.
#[derive(Debug, Clone, Copy)]
pub struct BatchKv {
    pub pos: DPtr<i32>,
    pub k: DPtr<u64>,
    pub v: DPtr<u64>,
    pub kv_type: KvType,
    pub n_rows: usize,
    pub max_positions: usize,
    /// The layer's sliding window (0: a full layer): its caches are rings
    /// ([`crate::kv::kv_ring_positions`]).
    pub window: usize,
}

impl BatchKv {
    fn check(&self, kernel: Kernel, widths: &[usize]) -> Result<()> {
        check_kv_widths(kernel, self.kv_type, widths)?;
        need(kernel, "row positions", self.pos, self.n_rows)?;
        need(kernel, "row key caches", self.k, self.n_rows)?;
        need(kernel, "row value caches", self.v, self.n_rows)
    }
}

impl CudaBackend {
    /// `y[t, :] (+)= W · x[t, :]` for `t < n_tokens`; W `[n, k]` bf16. Decode GEMV.
    pub fn gemv_bf16(
        &self,
        w: DPtr<u16>,
        x: DPtr<f32>,
        y: DPtr<f32>,
        n_tokens: usize,
        n: usize,
        k: usize,
        accumulate: bool,
    ) -> Result<()> {
        const K: Kernel = Kernel::GemvBf16;
        need(K, "W", w, n * k)?;
        need(K, "x", x, n_tokens * k)?;
        need(K, "y", y, n_tokens * n)?;
        let acc = accumulate as i32;
        self.launch(
            K,
            (blocks(n, ROWS_PER_BLOCK), n_tokens as u32, 1),
            ROW_BLOCK_THREADS,
            0,
            args![w.raw(), x.raw(), y.raw(), i(n), i(k), acc],
        )
    }

    /// One-token `y (+)= W · x`, W `[n, k]` bf16, with [`GEMV_SPLIT_WARPS`] warps a row (each a
    /// contiguous part of it, the parts added in order): for matrices whose rows alone leave the
    /// GPU short of warps ([`CudaBackend::split_gemv_pays`]). Sums in another order than
    /// [`Self::gemv_bf16`] (within f32 rounding of it). `k` a multiple of 8; W and x 16-byte
    /// aligned.
    pub fn gemv_bf16_split(
        &self,
        w: DPtr<u16>,
        x: DPtr<f32>,
        y: DPtr<f32>,
        n: usize,
        k: usize,
        accumulate: bool,
    ) -> Result<()> {
        const K: Kernel = Kernel::GemvBf16Split;
        if !split_views_aligned(w, x, k) {
            return Err(CudaError::Shape {
                kernel: K.symbol(),
                reason: format!(
                    "k = {k} (a multiple of 8), W at {:#x}, x at {:#x} (16-byte aligned)",
                    w.raw(),
                    x.raw()
                ),
            });
        }
        need(K, "W", w, n * k)?;
        need(K, "x", x, k)?;
        need(K, "y", y, n)?;
        let grid = (blocks(n, ROWS_PER_BLOCK / GEMV_SPLIT_WARPS), 1, 1);
        let args = args![w.raw(), x.raw(), y.raw(), i(n), i(k), accumulate as i32];
        self.launch(K, grid, ROW_BLOCK_THREADS, 0, args)
    }

    /// Whether a one-token GEMV of `w` (`n` rows of `k`) over `x` takes
    /// [`Self::gemv_bf16_split`]: one warp a row would leave the GPU short of warps (the rule of
    /// [`CudaBackend::wide_rows_per_warp`]), every split warp still has an 8-value group a lane,
    /// and the views are aligned.
    pub fn split_gemv_pays(&self, w: DPtr<u16>, x: DPtr<f32>, n: usize, k: usize) -> bool {
        split_views_aligned(w, x, k) && self.short_of_warps(n) && k / 8 >= 32 * GEMV_SPLIT_WARPS as usize
    }

    /// Whether [`Self::gemv_mma_bf16`] takes `w` and the split rows `x_hi`, `x_lo` of `k` columns:
    /// whole 32-column slabs, every view 16-byte aligned.
    pub fn gemv_mma_fits(w: DPtr<u16>, x_hi: DPtr<u16>, x_lo: DPtr<u16>, k: usize) -> bool {
        k.is_multiple_of(32) && [w.raw(), x_hi.raw(), x_lo.raw()].iter().all(|a| a.is_multiple_of(16))
    }

    /// The projections of a batched decode step on the tensor cores, each weight read once for
    /// up to [`GEMV_MMA_TOKENS`] rows: `y_m (+)= W_m · (x_hi + x_lo)` over `n_tokens` rows of `k`
    /// (the rows split into bf16 hi + lo, as [`Self::gather_split_bf16`] writes them: f32
    /// accuracy) for one to three matrices `W_m` `[n_m, k]` bf16 over the one input (q/k/v), `y_m`
    /// rows of `n_m`. [`Self::gemv_mma_fits`] each matrix.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_mma_bf16(
        &self,
        w: &[DPtr<u16>],
        x: (DPtr<u16>, DPtr<u16>),
        y: &[DPtr<f32>],
        n: &[usize],
        n_tokens: usize,
        k: usize,
        accumulate: bool,
    ) -> Result<()> {
        let row_blocks = n.iter().map(|&r| blocks(r, 16) as usize).sum::<usize>();
        let warps = row_blocks * n_tokens.div_ceil(GEMV_MMA_TOKENS) * GEMV_MMA_WARPS as usize;
        let sms = self.info().multiprocessors.max(1) as usize;
        let block = match warps < sms * GEMV_MMA_MIN_WARPS_PER_SM {
            true => GemvMmaBlock::Wide,
            false => GemvMmaBlock::RowPairs,
        };
        self.gemv_mma_bf16_blocks(block, w, x, y, n, n_tokens, k, accumulate)
    }

    /// [`Self::gemv_mma_bf16`] with the block chosen ([`GemvMmaBlock`]); the same sums in
    /// another order.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_mma_bf16_blocks(
        &self,
        block: GemvMmaBlock,
        w: &[DPtr<u16>],
        (x_hi, x_lo): (DPtr<u16>, DPtr<u16>),
        y: &[DPtr<f32>],
        n: &[usize],
        n_tokens: usize,
        k: usize,
        accumulate: bool,
    ) -> Result<()> {
        const K: Kernel = Kernel::GemvMmaBf16;
        let m = w.len();
        if !(1..=3).contains(&m) || y.len() != m || n.len() != m {
            let reason = format!("{m} matrices, {} outputs, {} row counts (1 to 3 each)", y.len(), n.len());
            return Err(CudaError::Shape { kernel: K.symbol(), reason });
        }
        for j in 0..m {
            if !Self::gemv_mma_fits(w[j], x_hi, x_lo, k) {
                let reason = format!("k = {k} (a multiple of 32), W, x_hi, x_lo 16-byte aligned");
                return Err(CudaError::Shape { kernel: K.symbol(), reason });
            }
            need(K, "W", w[j], n[j] * k)?;
            need(K, "y", y[j], n_tokens * n[j])?;
        }
        need(K, "x_hi", x_hi, n_tokens * k)?;
        need(K, "x_lo", x_lo, n_tokens * k)?;
        if n_tokens == 0 {
            return Ok(());
        }
        let at = |j: usize| if j < m { (w[j].raw(), y[j].raw(), n[j]) } else { (w[0].raw(), y[0].raw(), 0) };
        let [(w0, y0, n0), (w1, y1, n1), (w2, y2, n2)] = [at(0), at(1), at(2)];
        let (kernel, rows, threads) = match block {
            GemvMmaBlock::Rows16 => (K, 16, 32 * GEMV_MMA_WARPS),
            GemvMmaBlock::Wide => (Kernel::GemvMmaBf16W16, 16, 64 * GEMV_MMA_WARPS),
            GemvMmaBlock::RowPairs => (Kernel::GemvMmaBf16R32, 32, 32 * GEMV_MMA_WARPS),
        };
        let row_blocks = [n0, n1, n2].iter().map(|&r| blocks(r, rows)).sum::<u32>();
        let grid = (row_blocks, n_tokens.div_ceil(GEMV_MMA_TOKENS) as u32, 1);
        let args = args![
            w0,
            w1,
            w2,
            x_hi.raw(),
            x_lo.raw(),
            y0,
            y1,
            y2,
            i(n0),
            i(n1),
            i(n2),
            i(k),
            i(n_tokens),
            accumulate as i32
        ];
        self.launch(kernel, grid, threads, 0, args)
    }

    /// Three GEMVs over one input in one launch: `y0 = W0 · x`, `y1 = W1 · x`, `y2 = W2 · x` for
    /// `t < n_tokens` (no accumulation); `Wi` `[ni, k]` bf16, `yi` rows of `ni`. Decode q/k/v.
    pub fn gemv3_bf16(
        &self,
        w: [DPtr<u16>; 3],
        x: DPtr<f32>,
        y: [DPtr<f32>; 3],
        n: [usize; 3],
        n_tokens: usize,
        k: usize,
    ) -> Result<()> {
        const K: Kernel = Kernel::Gemv3Bf16;
        for j in 0..3 {
            need(K, "W", w[j], n[j] * k)?;
            need(K, "y", y[j], n_tokens * n[j])?;
        }
        need(K, "x", x, n_tokens * k)?;
        self.launch(
            K,
            (blocks(n[0] + n[1] + n[2], ROWS_PER_BLOCK), n_tokens as u32, 1),
            ROW_BLOCK_THREADS,
            0,
            args![
                w[0].raw(),
                w[1].raw(),
                w[2].raw(),
                x.raw(),
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

    /// `y[r] = x[r] / rms(x[r]) * w` over `rows` rows of `dim` (in place when x == y).
    pub fn rmsnorm(
        &self,
        x: DPtr<f32>,
        w: DPtr<f32>,
        y: DPtr<f32>,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        const K: Kernel = Kernel::RmsnormF32;
        need(K, "x", x, rows * dim)?;
        need(K, "w", w, dim)?;
        need(K, "y", y, rows * dim)?;
        self.launch(K, (rows as u32, 1, 1), BLOCK, 0, args![x.raw(), w.raw(), y.raw(), i(dim), eps])
    }

    /// `x[r, :] += b` for every row.
    pub fn add_bias_rows(&self, x: DPtr<f32>, b: DPtr<f32>, rows: usize, dim: usize) -> Result<()> {
        const K: Kernel = Kernel::AddBiasRows;
        need(K, "x", x, rows * dim)?;
        need(K, "b", b, dim)?;
        self.launch(K, (blocks(rows * dim, BLOCK), 1, 1), BLOCK, 0, args![x.raw(), b.raw(), i(rows), i(dim)])
    }

    /// `x = clamp(x, -c, c)` on the first `n` elements.
    pub fn clamp(&self, x: DPtr<f32>, n: usize, c: f32) -> Result<()> {
        const K: Kernel = Kernel::ClampF32;
        need(K, "x", x, n)?;
        self.launch(K, (blocks(n, BLOCK), 1, 1), BLOCK, 0, args![x.raw(), i(n), c])
    }

    /// `acc += x` on the first `n` elements.
    pub fn add(&self, acc: DPtr<f32>, x: DPtr<f32>, n: usize) -> Result<()> {
        const K: Kernel = Kernel::AddF32;
        need(K, "acc", acc, n)?;
        need(K, "x", x, n)?;
        self.launch(K, (blocks(n, BLOCK), 1, 1), BLOCK, 0, args![acc.raw(), x.raw(), i(n)])
    }

    /// `x *= sigmoid(gate)` on the first `n` elements (gated attention's output).
    pub fn mul_sigmoid(&self, x: DPtr<f32>, gate: DPtr<f32>, n: usize) -> Result<()> {
        const K: Kernel = Kernel::MulSigmoidF32;
        need(K, "x", x, n)?;
        need(K, "gate", gate, n)?;
        self.launch(K, (blocks(n, BLOCK), 1, 1), BLOCK, 0, args![x.raw(), gate.raw(), i(n)])
    }

    /// A Gated DeltaNet layer's causal conv + SiLU over the first `d.conv_dim()` channels of
    /// `n_tokens` rows of `p` (row stride [`DeltaShape::p_stride`]), in place, moving `conv_state`
    /// (`[kernel - 1, conv_dim]`) on.
    pub fn delta_conv(
        &self,
        d: DeltaShape,
        p: DPtr<f32>,
        conv_state: DPtr<f32>,
        weight: DPtr<f32>,
        n_tokens: usize,
    ) -> Result<()> {
        const K: Kernel = Kernel::DeltaConvF32;
        d.check(K)?;
        let conv_dim = d.conv_dim();
        need(K, "p", p, n_tokens * d.p_stride())?;
        need(K, "conv state", conv_state, (d.conv_kernel - 1) * conv_dim)?;
        need(K, "conv weight", weight, d.conv_kernel * conv_dim)?;
        let args = args![
            p.raw(),
            i(d.p_stride()),
            conv_state.raw(),
            weight.raw(),
            i(conv_dim),
            i(d.conv_kernel),
            i(n_tokens)
        ];
        self.launch(K, (blocks(conv_dim, BLOCK), 1, 1), BLOCK, 0, args)
    }

    /// The same as [`CudaBackend::delta_conv`] with every (token, channel) in parallel (a run of
    /// tokens): the call's raw inputs copied to `raw` (at least `n_tokens * conv_dim`), the outputs
    /// written in place from them and the old state, then the state moved on; three launches.
    pub fn delta_conv_rows(
        &self,
        d: DeltaShape,
        p: DPtr<f32>,
        conv_state: DPtr<f32>,
        weight: DPtr<f32>,
        raw: DPtr<f32>,
        n_tokens: usize,
    ) -> Result<()> {
        const K: Kernel = Kernel::DeltaConvRowsF32;
        d.check(K)?;
        let conv_dim = d.conv_dim();
        need(K, "p", p, n_tokens * d.p_stride())?;
        need(K, "conv state", conv_state, (d.conv_kernel - 1) * conv_dim)?;
        need(K, "conv weight", weight, d.conv_kernel * conv_dim)?;
        need(K, "raw", raw, n_tokens * conv_dim)?;
        // Grids of at most 65535 rows (CUDA's limit on grid y).
        let pieces = || (0..n_tokens).step_by(65535).map(move |t0| (t0, (n_tokens - t0).min(65535) as u32));
        let cols = blocks(conv_dim, BLOCK);
        for (t0, rows) in pieces() {
            let args = args![p.raw(), i(d.p_stride()), raw.raw(), i(conv_dim), i(t0)];
            self.launch(Kernel::DeltaConvGatherF32, (cols, rows, 1), BLOCK, 0, args)?;
        }
        for (t0, rows) in pieces() {
            let args = args![
                p.raw(),
                i(d.p_stride()),
                raw.raw(),
                conv_state.raw(),
                weight.raw(),
                i(conv_dim),
                i(d.conv_kernel),
                i(t0)
            ];
            self.launch(K, (cols, rows, 1), BLOCK, 0, args)?;
        }
        let args = args![raw.raw(), conv_state.raw(), i(conv_dim), i(d.conv_kernel), i(n_tokens)];
        self.launch(Kernel::DeltaConvAdvanceF32, (cols, 1, 1), BLOCK, 0, args)
    }

    /// The gated delta rule and gated RMSNorm of a DeltaNet layer over `n_tokens` rows of `p`
    /// (after [`CudaBackend::delta_conv`]) and `ba` (`[b | a]`, `2 * n_v_heads` a row), moving
    /// `state` (`[n_v_heads, k_head_dim, v_head_dim]`) on; `out` gets `value_dim` a row. Two
    /// launches: the rule token by token over blocks of 32 value columns of each head (four
    /// warps splitting the key rows), then the norm (`delta_gated_norm_f32`).
    #[allow(clippy::too_many_arguments)]
    pub fn delta_rule(
        &self,
        d: DeltaShape,
        p: DPtr<f32>,
        ba: DPtr<f32>,
        state: DPtr<f32>,
        [dt_bias, neg_a, norm]: [DPtr<f32>; 3],
        out: DPtr<f32>,
        n_tokens: usize,
        eps: f32,
    ) -> Result<()> {
        const K: Kernel = Kernel::DeltaRuleF32;
        d.check(K)?;
        need(K, "p", p, n_tokens * d.p_stride())?;
        need(K, "ba", ba, n_tokens * 2 * d.n_v_heads)?;
        need(K, "state", state, d.n_v_heads * d.k_head_dim * d.v_head_dim)?;
        need(K, "dt_bias", dt_bias, d.n_v_heads)?;
        need(K, "neg_a", neg_a, d.n_v_heads)?;
        need(K, "norm", norm, d.v_head_dim)?;
        need(K, "out", out, n_tokens * d.n_v_heads * d.v_head_dim)?;
        let (nk, nv, dk, dv) = (i(d.n_k_heads), i(d.n_v_heads), i(d.k_head_dim), i(d.v_head_dim));
        let tiled = i(d.tiled_v_heads as usize);
        let args = args![
            p.raw(),
            i(d.p_stride()),
            ba.raw(),
            state.raw(),
            dt_bias.raw(),
            neg_a.raw(),
            out.raw(),
            nk,
            nv,
            dk,
            dv,
            i(n_tokens),
            tiled
        ];
        let col_blocks = d.v_head_dim.div_ceil(32) as u32;
        self.launch(K, (d.n_v_heads as u32, col_blocks, 1), 128, 0, args)?;
        self.delta_gated_norm(d, p, norm, out, n_tokens, eps)
    }

    /// The gated RMSNorm of the delta rule's read-outs in `out`, in place (`z` from `p`).
    #[allow(clippy::too_many_arguments)]
    fn delta_gated_norm(
        &self,
        d: DeltaShape,
        p: DPtr<f32>,
        norm: DPtr<f32>,
        out: DPtr<f32>,
        n_tokens: usize,
        eps: f32,
    ) -> Result<()> {
        let (nk, nv, dk, dv) = (i(d.n_k_heads), i(d.n_v_heads), i(d.k_head_dim), i(d.v_head_dim));
        let threads = d.v_head_dim.div_ceil(32) as u32 * 32;
        let args = args![p.raw(), i(d.p_stride()), norm.raw(), out.raw(), nk, nv, dk, dv, eps];
        self.launch(Kernel::DeltaGatedNormF32, (n_tokens as u32, d.n_v_heads as u32, 1), threads, 0, args)
    }

    /// The same as [`CudaBackend::delta_rule`] over a run of tokens in its chunked form, three
    /// launches: every chunk's intra-chunk part at once (`delta_chunk_prep_f32`, into `work`, at
    /// least [`DeltaShape::chunk_work_floats`]), the chunks one after another over the state
    /// (`delta_chunk_scan_f32`, value columns in blocks of 32 per head), then the gated RMSNorm
    /// (`delta_gated_norm_f32`).
    #[allow(clippy::too_many_arguments)]
    pub fn delta_rule_chunked(
        &self,
        d: DeltaShape,
        p: DPtr<f32>,
        ba: DPtr<f32>,
        state: DPtr<f32>,
        [dt_bias, neg_a, norm]: [DPtr<f32>; 3],
        work: DPtr<f32>,
        out: DPtr<f32>,
        n_tokens: usize,
        eps: f32,
    ) -> Result<()> {
        const PREP: Kernel = Kernel::DeltaChunkPrepF32;
        d.check(PREP)?;
        need(PREP, "p", p, n_tokens * d.p_stride())?;
        need(PREP, "ba", ba, n_tokens * 2 * d.n_v_heads)?;
        need(PREP, "state", state, d.n_v_heads * d.k_head_dim * d.v_head_dim)?;
        need(PREP, "dt_bias", dt_bias, d.n_v_heads)?;
        need(PREP, "neg_a", neg_a, d.n_v_heads)?;
        need(PREP, "norm", norm, d.v_head_dim)?;
        need(PREP, "work", work, d.chunk_work_floats(n_tokens))?;
        need(PREP, "out", out, n_tokens * d.n_v_heads * d.v_head_dim)?;
        let (nk, nv, dk, dv) = (i(d.n_k_heads), i(d.n_v_heads), i(d.k_head_dim), i(d.v_head_dim));
        let chunks = n_tokens.div_ceil(DELTA_CHUNK) as u32;
        let tiled = i(d.tiled_v_heads as usize);
        let args = args![
            p.raw(),
            i(d.p_stride()),
            ba.raw(),
            dt_bias.raw(),
            neg_a.raw(),
            work.raw(),
            nk,
            nv,
            dk,
            dv,
            i(n_tokens),
            tiled
        ];
        self.launch(PREP, (d.n_v_heads as u32, chunks, 1), 128, 0, args)?;
        let col_blocks = d.v_head_dim.div_ceil(DELTA_SCAN_COLS) as u32;
        let args = args![work.raw(), state.raw(), out.raw(), nv, dk, dv, i(n_tokens)];
        let (threads, smem) = (DELTA_SCAN_THREADS as u32, delta_scan_shared_bytes() as u32);
        self.launch(Kernel::DeltaChunkScanF32, (d.n_v_heads as u32, col_blocks, 1), threads, smem, args)?;
        self.delta_gated_norm(d, p, norm, out, n_tokens, eps)
    }

    /// `out = silu(g) * u` on the first `n` elements.
    pub fn silu_mul(&self, g: DPtr<f32>, u: DPtr<f32>, out: DPtr<f32>, n: usize) -> Result<()> {
        const K: Kernel = Kernel::SiluMulF32;
        need(K, "g", g, n)?;
        need(K, "u", u, n)?;
        need(K, "out", out, n)?;
        self.launch(K, (blocks(n, BLOCK), 1, 1), BLOCK, 0, args![g.raw(), u.raw(), out.raw(), i(n)])
    }

    /// RoPE on `n_heads` heads of `head_dim` in each of `n_tokens` rows of `row_stride`; token `t`
    /// is at position `pos0 + t`. The first `rot_dims` values of a head rotate (`head_dim`, or
    /// fewer for partial RoPE). `interleaved`: pairs (2i, 2i+1), else (i, i + rot_dims/2).
    pub fn rope(
        &self,
        x: DPtr<f32>,
        n_tokens: usize,
        n_heads: usize,
        row_stride: usize,
        head_dim: usize,
        rot_dims: usize,
        pos0: usize,
        theta: f32,
        interleaved: bool,
        scaling: Option<RopeScaling>,
    ) -> Result<()> {
        const K: Kernel = Kernel::RopeF32;
        check_rope(K, head_dim, rot_dims)?;
        let (freqs, scale) = rope_scaling_args(K, scaling, rot_dims)?;
        if n_heads * head_dim > row_stride {
            return Err(CudaError::Shape {
                kernel: K.symbol(),
                reason: format!("head_dim {head_dim} x {n_heads} heads in rows of {row_stride}"),
            });
        }
        need(K, "x", x, n_tokens.saturating_sub(1) * row_stride + n_heads * head_dim)?;
        let il = interleaved as i32;
        self.launch(
            K,
            (n_tokens as u32, n_heads as u32, 1),
            64,
            0,
            args![x.raw(), i(row_stride), i(head_dim), i(rot_dims), i(pos0), theta, il, freqs, scale],
        )
    }

    /// Per-head RMSNorm (weights `qw` / `kw` of `head_dim`, or none) then RoPE on the `n_heads`
    /// query heads of `q` (rows of `q_stride`) and `n_kv` key heads of `k` (rows of `k_stride`),
    /// token `t` at position `pos0 + t`, in one launch. Same results as [`Self::rmsnorm`] per head
    /// followed by [`Self::rope`]. With `append` (the decode graph) the position is read from
    /// device memory and the new key and value rows go into the caches (see [`KvAppend`]).
    pub fn qk_norm_rope(
        &self,
        q: DPtr<f32>,
        k: DPtr<f32>,
        norm: Option<(DPtr<f32>, DPtr<f32>)>,
        n_tokens: usize,
        n_heads: usize,
        n_kv: usize,
        q_stride: usize,
        k_stride: usize,
        head_dim: usize,
        rot_dims: usize,
        pos0: usize,
        theta: f32,
        interleaved: bool,
        eps: f32,
        append: Option<KvAppend>,
        scaling: Option<RopeScaling>,
    ) -> Result<()> {
        const K: Kernel = Kernel::QkNormRopeF32;
        check_rope(K, head_dim, rot_dims)?;
        let (freqs, scale) = rope_scaling_args(K, scaling, rot_dims)?;
        if n_heads * head_dim > q_stride || n_kv * head_dim > k_stride {
            return Err(CudaError::Shape {
                kernel: K.symbol(),
                reason: format!(
                    "head_dim {head_dim} x {n_heads}/{n_kv} heads in rows of {q_stride}/{k_stride}"
                ),
            });
        }
        need(K, "q", q, n_tokens.saturating_sub(1) * q_stride + n_heads * head_dim)?;
        need(K, "k", k, n_tokens.saturating_sub(1) * k_stride + n_kv * head_dim)?;
        let (qw, kw) = match norm {
            Some((qw, kw)) => {
                need(K, "q norm", qw, head_dim)?;
                need(K, "k norm", kw, head_dim)?;
                (qw.raw(), kw.raw())
            }
            None => (0, 0),
        };
        let il = interleaved as i32;
        let (pos, kv, heads, half) = match append {
            Some(a) => {
                a.check(K, n_tokens, k_stride, pos0)?;
                check_ring_call(K, a.window, n_tokens)?;
                check_kv_pair(K, a.k_cache, a.v_cache, &[head_dim])?;
                if a.k_cache.kv_type() == KvType::Q8_0 && head_dim > QK_STAGE_MAX_HEAD_DIM {
                    let reason =
                        format!("q8_0 appends stage heads of up to {QK_STAGE_MAX_HEAD_DIM}, not {head_dim}");
                    return Err(CudaError::Shape { kernel: K.symbol(), reason });
                }
                let pos = a.pos.map_or(0, |p| p.raw());
                let kv = (a.k_cache.raw(), a.v_cache.raw(), a.v.raw(), kv_ring_positions(a.window));
                (pos, kv, n_heads + 2 * n_kv, a.k_cache.type_code())
            }
            None => (0, (0, 0, 0, 0), n_heads + n_kv, 0),
        };
        let (kc, vc, v, ring) = kv;
        self.launch(
            K,
            (n_tokens as u32, heads as u32, 1),
            BLOCK,
            0,
            args![
                q.raw(),
                k.raw(),
                qw,
                kw,
                i(q_stride),
                i(k_stride),
                i(n_heads),
                i(head_dim),
                i(rot_dims),
                i(pos0),
                theta,
                il,
                eps,
                pos,
                kc,
                vc,
                v,
                i(n_kv),
                half,
                freqs,
                scale,
                i(ring)
            ],
        )
    }

    /// `n_tokens` rows of new keys `k` and values `v` (f32, rows of `kv_dim`) into the caches'
    /// rows of positions `pos0..` (a sliding-window layer's ring when `window` > 0), converted to
    /// the caches' type (the append of the unfused q/k path).
    #[allow(clippy::too_many_arguments)]
    pub fn kv_store_rows(
        &self,
        k: DPtr<f32>,
        v: DPtr<f32>,
        k_cache: KvPtr,
        v_cache: KvPtr,
        n_tokens: usize,
        pos0: usize,
        kv_dim: usize,
        window: usize,
    ) -> Result<()> {
        const K: Kernel = Kernel::KvStoreRows;
        let append = KvAppend { pos: None, v, k_cache, v_cache, window };
        append.check(K, n_tokens, kv_dim, pos0)?;
        check_ring_call(K, window, n_tokens)?;
        need(K, "k", k, n_tokens * kv_dim)?;
        let caches = (k_cache.raw(), v_cache.raw(), k_cache.type_code());
        self.launch(
            K,
            (n_tokens as u32, 2, 1),
            BLOCK,
            0,
            args![
                k.raw(),
                v.raw(),
                caches.0,
                caches.1,
                i(pos0),
                i(kv_dim),
                caches.2,
                i(kv_ring_positions(window))
            ],
        )
    }

    /// Causal GQA attention for `n_tokens` queries at positions `pos0..`, against caches that
    /// already hold positions `0..pos0 + n_tokens` (`[positions, n_kv * head_dim]`).
    /// `window` = 0: unlimited. Scale is `1/sqrt(head_dim)`.
    pub fn attention(
        &self,
        q: DPtr<f32>,
        k_cache: impl Into<KvPtr>,
        v_cache: impl Into<KvPtr>,
        out: DPtr<f32>,
        n_tokens: usize,
        pos0: usize,
        n_heads: usize,
        n_kv: usize,
        head_dim: usize,
        mask: impl Into<AttentionMask>,
    ) -> Result<()> {
        let (k_cache, v_cache) = (k_cache.into(), v_cache.into());
        let kn = kv_kernel(Kernel::ATTENTION, k_cache);
        let (window, sinks) = mask.into().parts(kn, n_heads)?;
        let total = pos0 + n_tokens;
        let heads = AttentionHeads { n_tokens, total, n_heads, n_kv, head_dim };
        check_attention(kn, (q, k_cache, v_cache, out), heads, ATTENTION_MAX_HEAD_DIM, window)?;
        let visible = if window > 0 { window.min(total) } else { total };
        if visible > ATTENTION_MAX_POSITIONS {
            return Err(CudaError::Shape {
                kernel: kn.symbol(),
                reason: format!(
                    "{visible} visible positions > {ATTENTION_MAX_POSITIONS} (shared-memory score buffer)"
                ),
            });
        }
        let scale = 1.0 / (head_dim as f32).sqrt();
        self.launch(
            kn,
            (n_tokens as u32, n_heads as u32, 1),
            ATTENTION_BLOCK,
            (visible.max((ATTENTION_BLOCK / 32) as usize * head_dim) * 4) as u32,
            args![
                q.raw(),
                k_cache.raw(),
                v_cache.raw(),
                out.raw(),
                i(pos0),
                i(n_heads),
                i(n_kv),
                i(head_dim),
                i(window),
                scale,
                sinks
            ],
        )
    }

    /// Whether [`Self::attention_tiled`] takes heads of `head_dim`.
    pub fn attention_tiled_fits(head_dim: usize) -> bool {
        head_dim > 0 && head_dim.is_multiple_of(4) && head_dim <= ATTENTION_TILE_MAX_HEAD_DIM
    }

    /// Same result as [`Self::attention`] (another summation order) for prefill: each block
    /// stages [`ATTENTION_TILE_ROWS`] query rows of one kv head's group and walks their keys in
    /// shared-memory tiles of [`ATTENTION_TILE_KEYS`](super::kernel::ATTENTION_TILE_KEYS) positions with an online softmax, so the
    /// cache is read once per tile of rows instead of once per row; no limit on the positions.
    /// `head_dim` must pass [`Self::attention_tiled_fits`].
    pub fn attention_tiled(
        &self,
        q: DPtr<f32>,
        k_cache: impl Into<KvPtr>,
        v_cache: impl Into<KvPtr>,
        out: DPtr<f32>,
        n_tokens: usize,
        pos0: usize,
        n_heads: usize,
        n_kv: usize,
        head_dim: usize,
        mask: impl Into<AttentionMask>,
    ) -> Result<()> {
        let (k_cache, v_cache) = (k_cache.into(), v_cache.into());
        let kn = kv_kernel(Kernel::ATTENTION_TILED, k_cache);
        let mask = mask.into();
        let heads = AttentionHeads { n_tokens, total: pos0 + n_tokens, n_heads, n_kv, head_dim };
        check_attention(kn, (q, k_cache, v_cache, out), heads, ATTENTION_TILE_MAX_HEAD_DIM, mask.window)?;
        if !head_dim.is_multiple_of(4) {
            return Err(CudaError::Shape {
                kernel: kn.symbol(),
                reason: format!("head_dim {head_dim} is not a multiple of 4 (float4 tiles)"),
            });
        }
        let shared_bytes = super::kernel::attention_tile_shared_bytes(head_dim) as u32;
        let block = TileBlock { rows: ATTENTION_TILE_ROWS, threads: ATTENTION_TILE_THREADS };
        let bufs = (q, k_cache, v_cache, out);
        self.launch_attention_tiles(kn, block, shared_bytes, bufs, heads, pos0, mask)
    }

    /// Launch a flash-style prefill kernel (tiled or mma; they take the same arguments): a
    /// block per `block.rows` query rows ((token, head) pairs) of one kv head's group.
    fn launch_attention_tiles(
        &self,
        kernel: Kernel,
        block: TileBlock,
        shared_bytes: u32,
        (q, k_cache, v_cache, out): (DPtr<f32>, KvPtr, KvPtr, DPtr<f32>),
        h: AttentionHeads,
        pos0: usize,
        mask: AttentionMask,
    ) -> Result<()> {
        let AttentionHeads { n_tokens, n_heads, n_kv, head_dim, .. } = h;
        let (window, sinks) = mask.parts(kernel, n_heads)?;
        let rows = n_tokens * (n_heads / n_kv);
        self.launch(
            kernel,
            (rows.div_ceil(block.rows) as u32, n_kv as u32, 1),
            block.threads,
            shared_bytes,
            args![
                q.raw(),
                k_cache.raw(),
                v_cache.raw(),
                out.raw(),
                i(n_tokens),
                i(pos0),
                i(n_heads),
                i(n_kv),
                i(head_dim),
                i(window),
                1.0f32 / (head_dim as f32).sqrt(),
                sinks
            ],
        )
    }

    /// Largest head dimension of the tensor-core attention over a `kv_type` cache: f16 and bf16
    /// caches take [`ATTENTION_MMA_WIDE_MAX_HEAD_DIM`] (heads past [`ATTENTION_MMA_MAX_HEAD_DIM`]
    /// run the wide-head kernels), f32 and q8_0 caches [`ATTENTION_MMA_MAX_HEAD_DIM`].
    pub fn attention_mma_max_head_dim(kv_type: KvType) -> usize {
        match kv_type {
            KvType::F16 | KvType::Bf16 => ATTENTION_MMA_WIDE_MAX_HEAD_DIM,
            _ => ATTENTION_MMA_MAX_HEAD_DIM,
        }
    }

    /// The tensor-core kernels' head shapes over a `kv_type` cache (but for the device): a
    /// multiple of 16 dims up to [`Self::attention_mma_max_head_dim`].
    fn attention_mma_head(head_dim: usize, kv_type: KvType) -> bool {
        head_dim > 0 && head_dim.is_multiple_of(16) && head_dim <= Self::attention_mma_max_head_dim(kv_type)
    }

    /// Whether [`Self::attention_mma`] takes heads of `head_dim` over a `kv_type` cache on this
    /// device (tensor-core `mma.sync` of bf16: compute capability 8.0 and later).
    pub fn attention_mma_fits(&self, head_dim: usize, kv_type: KvType) -> bool {
        Self::attention_mma_head(head_dim, kv_type) && self.info().has_sm80()
    }

    /// Whether [`Self::attention_mma`] takes this call: heads that fit the cache type and the
    /// four buffers (q, k cache, v cache, out) 16-byte aligned.
    pub fn attention_mma_takes(
        &self,
        head_dim: usize,
        (q, k, v, out): (DPtr<f32>, KvPtr, KvPtr, DPtr<f32>),
    ) -> bool {
        self.attention_mma_fits(head_dim, k.kv_type()) && aligned16(&[q.raw(), k.raw(), v.raw(), out.raw()])
    }

    /// The wide-head kernel of a tensor-core launch (`[f16, bf16]` instances) with its dynamic
    /// shared memory for `q_warps` warps of queries, for heads past [`ATTENTION_MMA_MAX_HEAD_DIM`]
    /// over a 16-bit cache; `None` for the narrow kernels (static shared memory).
    fn attention_mma_wide(
        wide: [Kernel; 2],
        head_dim: usize,
        k: KvPtr,
        q_warps: usize,
    ) -> Option<(Kernel, u32)> {
        let kn = match k {
            KvPtr::F16(_) => wide[0],
            KvPtr::Bf16(_) => wide[1],
            _ => return None,
        };
        let bytes = attention_mma_wide_shared_bytes(head_dim, q_warps) as u32;
        (head_dim > ATTENTION_MMA_MAX_HEAD_DIM).then_some((kn, bytes))
    }

    /// [`Self::attention_tiled`]'s result (about f32 accuracy, another summation order) with
    /// both products on the tensor cores: blocks of `16 x ATTENTION_MMA_WARPS` query rows, keys
    /// in tiles of [`ATTENTION_MMA_KEYS`](super::kernel::ATTENTION_MMA_KEYS). f32 and q8_0 caches are staged as bf16 hi + lo, three
    /// MMAs a fragment; f16 and bf16 caches are copied to shared memory as they are (cp.async,
    /// two stages) and only q and p are split: over f16 the softmax weights are rounded to f16
    /// for p . V (at most 2^-12 of each weight), over bf16 split as q is. Over f16 and bf16,
    /// heads of 144..=[`ATTENTION_MMA_WIDE_MAX_HEAD_DIM`] run the wide-head kernels (queries in
    /// shared memory, tiles of [`ATTENTION_MMA_WIDE_KEYS`](super::kernel::ATTENTION_MMA_WIDE_KEYS) keys), same results.
    /// `head_dim` must pass [`Self::attention_mma_fits`]; the four buffers 16-byte aligned.
    pub fn attention_mma(
        &self,
        q: DPtr<f32>,
        k_cache: impl Into<KvPtr>,
        v_cache: impl Into<KvPtr>,
        out: DPtr<f32>,
        n_tokens: usize,
        pos0: usize,
        n_heads: usize,
        n_kv: usize,
        head_dim: usize,
        mask: impl Into<AttentionMask>,
    ) -> Result<()> {
        let (k_cache, v_cache) = (k_cache.into(), v_cache.into());
        let wide = [Kernel::AttentionMmaWideF16, Kernel::AttentionMmaWideBf16];
        let (kn, shared_bytes) =
            Self::attention_mma_wide(wide, head_dim, k_cache, ATTENTION_MMA_WARPS as usize)
                .unwrap_or((kv_kernel(Kernel::ATTENTION_MMA, k_cache), 0));
        let mask = mask.into();
        let heads = AttentionHeads { n_tokens, total: pos0 + n_tokens, n_heads, n_kv, head_dim };
        let bufs = (q, k_cache, v_cache, out);
        check_attention(kn, bufs, heads, Self::attention_mma_max_head_dim(k_cache.kv_type()), mask.window)?;
        if !self.attention_mma_takes(head_dim, bufs) {
            let reason =
                format!("head_dim {head_dim} (a multiple of 16 on sm_80+) or buffers not 16-byte aligned");
            return Err(CudaError::Shape { kernel: kn.symbol(), reason });
        }
        let block = TileBlock { rows: 16 * ATTENTION_MMA_WARPS as usize, threads: ATTENTION_MMA_THREADS };
        self.launch_attention_tiles(kn, block, shared_bytes, bufs, heads, pos0, mask)
    }

    /// Most spans (blocks per query row and head) of [`Self::attention_split`] for `n_tokens`
    /// rows of `n_heads` heads over at most `positions` visible positions: one per
    /// [`ATTENTION_SPLIT_CHUNK`] positions, capped so the launch holds about
    /// [`ATTENTION_SPLIT_TARGET_BLOCKS`] blocks (longer contexts give each block more chunks).
    pub fn attention_split_max_splits(n_tokens: usize, n_heads: usize, positions: usize) -> usize {
        let cap = (ATTENTION_SPLIT_TARGET_BLOCKS / (n_tokens * n_heads).max(1)).max(1);
        positions.div_ceil(ATTENTION_SPLIT_CHUNK).clamp(1, cap)
    }

    /// Whether [`Self::attention_split`] runs the grouped kernel, which reads each key and value
    /// row once for [`ATTENTION_GQA_HEADS`] query heads: groups of a multiple of that many query
    /// heads per kv head, heads of a multiple of 4 dims up to [`ATTENTION_GQA_MAX_HEAD_DIM`].
    pub fn attention_split_grouped(n_heads: usize, n_kv: usize, head_dim: usize) -> bool {
        let g = n_heads / n_kv.max(1);
        g.is_multiple_of(ATTENTION_GQA_HEADS)
            && head_dim.is_multiple_of(4)
            && head_dim <= ATTENTION_GQA_MAX_HEAD_DIM
            && g * n_kv == n_heads
    }

    /// The tensor-core split kernel [`Self::attention_split`] runs instead of the CUDA-core ones,
    /// if it takes the call: an f16 or bf16 cache (its values are the MMA's inputs as they are),
    /// heads of a multiple of 16 dims up to [`ATTENTION_MMA_WIDE_MAX_HEAD_DIM`] (past
    /// [`ATTENTION_MMA_MAX_HEAD_DIM`] the wide-head kernel), groups of at most
    /// `16 x ATTENTION_MMA_WARPS` query heads (one block's rows), 16-byte aligned buffers; with
    /// its dynamic shared memory.
    fn attention_split_mma_takes(
        &self,
        n_heads: usize,
        n_kv: usize,
        head_dim: usize,
        (q, k, v): (DPtr<f32>, KvPtr, KvPtr),
    ) -> Option<(Kernel, u32)> {
        let narrow = [Kernel::AttentionSplitMmaF16, Kernel::AttentionSplitMmaBf16];
        let wide = [Kernel::AttentionSplitMmaWideF16, Kernel::AttentionSplitMmaWideBf16];
        let kn = Self::attention_split_mma_kernel(narrow, wide, n_heads, n_kv, head_dim, k.kv_type())?;
        self.attention_mma_takes(head_dim, (q, k, v, q)).then_some(kn)
    }

    /// Whether [`Self::attention_split`] and [`Self::attention_split_rows`] run the tensor-core
    /// split kernels (narrow or wide heads) for these shapes over a `kv_type` cache on this device
    /// (buffers 16-byte aligned).
    pub fn attention_split_mma_fits(
        &self,
        n_heads: usize,
        n_kv: usize,
        head_dim: usize,
        kv_type: KvType,
    ) -> bool {
        let any = [Kernel::AttentionSplitMmaF16, Kernel::AttentionSplitMmaBf16];
        self.info().has_sm80()
            && Self::attention_split_mma_kernel(any, any, n_heads, n_kv, head_dim, kv_type).is_some()
    }

    /// The tensor-core split kernel of `[f16, bf16]` instances (narrow or wide heads) for these
    /// shapes over a `kv_type` cache, and its dynamic shared memory (the wide kernel's queries:
    /// one warp's slice per 16 heads of the group): heads [`Self::attention_mma_fits`] takes
    /// (but for the device), groups of at most `16 x ATTENTION_MMA_WARPS` heads.
    fn attention_split_mma_kernel(
        narrow: [Kernel; 2],
        wide: [Kernel; 2],
        n_heads: usize,
        n_kv: usize,
        head_dim: usize,
        kv_type: KvType,
    ) -> Option<(Kernel, u32)> {
        let g = n_heads / n_kv.max(1);
        let i = match kv_type {
            KvType::F16 => 0,
            KvType::Bf16 => 1,
            _ => return None,
        };
        let shape = g * n_kv == n_heads && g <= 16 * ATTENTION_MMA_WARPS as usize;
        if !shape || !Self::attention_mma_head(head_dim, kv_type) {
            return None;
        }
        Some(match head_dim > ATTENTION_MMA_MAX_HEAD_DIM {
            true => (wide[i], attention_mma_wide_shared_bytes(head_dim, g.div_ceil(16)) as u32),
            false => (narrow[i], 0),
        })
    }

    /// Spans of the grouped kernel: as [`Self::attention_split_max_splits`] over blocks of
    /// [`ATTENTION_GQA_HEADS`] heads, aiming at [`ATTENTION_GQA_TARGET_BLOCKS`] blocks.
    fn attention_split_gqa_max_splits(n_tokens: usize, n_heads: usize, positions: usize) -> usize {
        let blocks_per_split = (n_tokens * n_heads).div_ceil(ATTENTION_GQA_HEADS).max(1);
        let cap = (ATTENTION_GQA_TARGET_BLOCKS / blocks_per_split).max(1);
        positions.div_ceil(ATTENTION_SPLIT_CHUNK).clamp(1, cap)
    }

    /// Floats of the partials buffer [`Self::attention_split`] needs for `n_tokens` rows of
    /// `n_heads` heads over at most `positions` visible positions.
    pub fn attention_split_scratch(
        n_tokens: usize,
        n_heads: usize,
        head_dim: usize,
        positions: usize,
    ) -> usize {
        let splits = Self::attention_split_max_splits(n_tokens, n_heads, positions)
            .max(Self::attention_split_gqa_max_splits(n_tokens, n_heads, positions));
        n_tokens * n_heads * splits * (head_dim + 2)
    }

    /// Same as [`Self::attention`] ("flash decoding"): each row's visible positions are cut
    /// into spans of whole [`ATTENTION_SPLIT_CHUNK`]s, at most
    /// [`Self::attention_split_max_splits`] of them, each scored by its own block with an online
    /// softmax, then combined: two launches. The span length is computed on the device from the
    /// row's position (from `at` in the decode graph), so one captured grid serves every length
    /// (blocks past the used spans exit at once). `part` holds [`Self::attention_split_scratch`]
    /// floats.
    pub fn attention_split(
        &self,
        q: DPtr<f32>,
        k_cache: impl Into<KvPtr>,
        v_cache: impl Into<KvPtr>,
        out: DPtr<f32>,
        part: DPtr<f32>,
        n_tokens: usize,
        pos0: usize,
        n_heads: usize,
        n_kv: usize,
        head_dim: usize,
        mask: impl Into<AttentionMask>,
        at: Option<DevicePos>,
    ) -> Result<()> {
        let (k_cache, v_cache) = (k_cache.into(), v_cache.into());
        let (window, sinks) = mask.into().parts(Kernel::AttentionCombineF32, n_heads)?;
        let grouped = Self::attention_split_grouped(n_heads, n_kv, head_dim);
        let mma = self.attention_split_mma_takes(n_heads, n_kv, head_dim, (q, k_cache, v_cache));
        let kn = match (mma, grouped) {
            (Some((kn, _)), _) => kn,
            (None, true) => kv_kernel(Kernel::ATTENTION_SPLIT_GQA, k_cache),
            (None, false) => kv_kernel(Kernel::ATTENTION_SPLIT, k_cache),
        };
        // From device memory the position is unknown here: check (and size the grid) for the
        // most positions the call may see.
        let total = at.map_or(pos0, |a| a.max_positions) + n_tokens;
        let heads = AttentionHeads { n_tokens, total, n_heads, n_kv, head_dim };
        check_attention(kn, (q, k_cache, v_cache, out), heads, ATTENTION_MAX_HEAD_DIM, window)?;
        if let Some(a) = at {
            need(kn, "pos", a.pos, 1)?;
        }
        let visible = if window > 0 { window.min(total) } else { total };
        // the tensor-core kernel: a block per kv head's group, spans as the grouped kernel's
        let (splits, grid_heads) = match (mma.is_some(), grouped) {
            (true, _) => (Self::attention_split_gqa_max_splits(n_tokens, n_heads, visible), n_kv),
            (false, true) => (
                Self::attention_split_gqa_max_splits(n_tokens, n_heads, visible),
                n_heads / ATTENTION_GQA_HEADS,
            ),
            (false, false) => (Self::attention_split_max_splits(n_tokens, n_heads, visible), n_heads),
        };
        need(kn, "part", part, Self::attention_split_scratch(n_tokens, n_heads, head_dim, visible))?;
        let scale = 1.0 / (head_dim as f32).sqrt();
        let pos_ptr = at.map_or(0, |a| a.pos.raw());
        let threads = if mma.is_some() { ATTENTION_MMA_THREADS } else { ATTENTION_SPLIT_THREADS };
        let shared_bytes = mma.map_or(0, |(_, bytes)| bytes);
        self.launch(
            kn,
            (grid_heads as u32, splits as u32, n_tokens as u32),
            threads,
            shared_bytes,
            args![
                q.raw(),
                k_cache.raw(),
                v_cache.raw(),
                part.raw(),
                i(pos0),
                i(n_heads),
                i(n_kv),
                i(head_dim),
                i(window),
                scale,
                i(splits),
                pos_ptr
            ],
        )?;
        self.launch(
            Kernel::AttentionCombineF32,
            (n_heads as u32, n_tokens as u32, head_dim.div_ceil(ATTENTION_COMBINE_DIMS) as u32),
            128,
            0,
            args![
                part.raw(),
                out.raw(),
                i(n_heads),
                i(head_dim),
                i(splits),
                i(pos0),
                i(window),
                pos_ptr,
                sinks
            ],
        )
    }

    /// [`Self::attention_split`] over a batched step whose rows have their own caches and
    /// positions (`kv`): launch row `i` is the call's row `rows[i]` (`n_launch` of them, read
    /// from device memory), its queries and output rows of `q` and `out` (`kv.n_rows` rows of
    /// `n_heads x head_dim`), its position and caches `kv`'s. Two launches for every sequence of
    /// the step. `part` holds [`Self::attention_split_scratch`] floats for `n_launch` rows over
    /// `kv.max_positions` positions.
    pub fn attention_split_rows(
        &self,
        q: DPtr<f32>,
        out: DPtr<f32>,
        part: DPtr<f32>,
        (rows, n_launch): (DPtr<i32>, usize),
        kv: BatchKv,
        n_heads: usize,
        n_kv: usize,
        head_dim: usize,
        mask: impl Into<AttentionMask>,
    ) -> Result<()> {
        let (window, sinks) = mask.into().parts(Kernel::AttentionCombineRowsF32, n_heads)?;
        if kv.window != window {
            let reason =
                format!("the mask's window {window} and the caches' ring window {} differ", kv.window);
            return Err(CudaError::Shape { kernel: Kernel::AttentionCombineRowsF32.symbol(), reason });
        }
        let grouped = Self::attention_split_grouped(n_heads, n_kv, head_dim);
        let family = if grouped { Kernel::ATTENTION_SPLIT_GQA_ROWS } else { Kernel::ATTENTION_SPLIT_ROWS };
        // the tensor-core kernel where it takes the shape (the caches' addresses are the
        // sequences' layer rows: whole allocations apart by a multiple of 16 bytes)
        let narrow = [Kernel::AttentionSplitMmaRowsF16, Kernel::AttentionSplitMmaRowsBf16];
        let wide = [Kernel::AttentionSplitMmaRowsWideF16, Kernel::AttentionSplitMmaRowsWideBf16];
        let mma = Self::attention_split_mma_kernel(narrow, wide, n_heads, n_kv, head_dim, kv.kv_type)
            .filter(|_| self.info().has_sm80());
        let kn = mma.map_or(family[kv_type_code(kv.kv_type)], |(kn, _)| kn);
        kv.check(kn, &[head_dim])?;
        if n_kv == 0 || n_heads / n_kv * n_kv != n_heads || head_dim == 0 || head_dim > ATTENTION_MAX_HEAD_DIM
        {
            let reason = format!(
                "{n_heads} heads over {n_kv} kv heads of {head_dim} (at most {ATTENTION_MAX_HEAD_DIM})"
            );
            return Err(CudaError::Shape { kernel: kn.symbol(), reason });
        }
        let q_dim = n_heads * head_dim;
        need(kn, "q", q, kv.n_rows * q_dim)?;
        need(kn, "out", out, kv.n_rows * q_dim)?;
        need(kn, "rows", rows, n_launch)?;
        if n_launch == 0 {
            return Ok(());
        }
        let visible = if window > 0 { window.min(kv.max_positions) } else { kv.max_positions };
        let (splits, grid_heads) = match (mma.is_some(), grouped) {
            (true, _) => (Self::attention_split_gqa_max_splits(n_launch, n_heads, visible), n_kv),
            (false, true) => (
                Self::attention_split_gqa_max_splits(n_launch, n_heads, visible),
                n_heads / ATTENTION_GQA_HEADS,
            ),
            (false, false) => (Self::attention_split_max_splits(n_launch, n_heads, visible), n_heads),
        };
        need(kn, "part", part, Self::attention_split_scratch(n_launch, n_heads, head_dim, visible))?;
        let scale = 1.0 / (head_dim as f32).sqrt();
        let threads = if mma.is_some() { ATTENTION_MMA_THREADS } else { ATTENTION_SPLIT_THREADS };
        let shared_bytes = mma.map_or(0, |(_, bytes)| bytes);
        self.launch(
            kn,
            (grid_heads as u32, splits as u32, n_launch as u32),
            threads,
            shared_bytes,
            args![
                q.raw(),
                kv.k.raw(),
                kv.v.raw(),
                part.raw(),
                rows.raw(),
                kv.pos.raw(),
                i(n_heads),
                i(n_kv),
                i(head_dim),
                i(window),
                scale,
                i(splits)
            ],
        )?;
        self.launch(
            Kernel::AttentionCombineRowsF32,
            (n_heads as u32, n_launch as u32, head_dim.div_ceil(ATTENTION_COMBINE_DIMS) as u32),
            128,
            0,
            args![
                part.raw(),
                out.raw(),
                rows.raw(),
                kv.pos.raw(),
                i(n_heads),
                i(head_dim),
                i(splits),
                i(window),
                sinks
            ],
        )
    }

    /// [`Self::qk_norm_rope`] with its append over a batched step: row `t` of `q`, `k` and `v`
    /// (`kv.n_rows` rows of `q_stride`, `k_stride` = kv_dim) at its own position, appended to its
    /// own sequence's caches (`kv`), one launch for every sequence.
    pub fn qk_norm_rope_rows(
        &self,
        (q, k, v): (DPtr<f32>, DPtr<f32>, DPtr<f32>),
        norm: Option<(DPtr<f32>, DPtr<f32>)>,
        kv: BatchKv,
        (n_heads, n_kv, q_stride, k_stride): (usize, usize, usize, usize),
        (head_dim, rot_dims): (usize, usize),
        (theta, interleaved, eps): (f32, bool, f32),
        scaling: Option<RopeScaling>,
    ) -> Result<()> {
        const K: Kernel = Kernel::QkNormRopeRowsF32;
        check_rope(K, head_dim, rot_dims)?;
        kv.check(K, &[head_dim, k_stride])?;
        let (freqs, scale) = rope_scaling_args(K, scaling, rot_dims)?;
        if n_heads * head_dim > q_stride || n_kv * head_dim != k_stride {
            let reason =
                format!("head_dim {head_dim} x {n_heads}/{n_kv} heads in rows of {q_stride}/{k_stride}");
            return Err(CudaError::Shape { kernel: K.symbol(), reason });
        }
        if kv.kv_type == KvType::Q8_0 && head_dim > QK_STAGE_MAX_HEAD_DIM {
            let reason = format!("q8_0 appends stage heads of up to {QK_STAGE_MAX_HEAD_DIM}, not {head_dim}");
            return Err(CudaError::Shape { kernel: K.symbol(), reason });
        }
        let t = kv.n_rows;
        need(K, "q", q, t * q_stride)?;
        need(K, "k", k, t * k_stride)?;
        need(K, "v", v, t * k_stride)?;
        let (qw, kw) = match norm {
            Some((qw, kw)) => {
                need(K, "q norm", qw, head_dim)?;
                need(K, "k norm", kw, head_dim)?;
                (qw.raw(), kw.raw())
            }
            None => (0, 0),
        };
        if t == 0 {
            return Ok(());
        }
        self.launch(
            K,
            (t as u32, (n_heads + 2 * n_kv) as u32, 1),
            BLOCK,
            0,
            args![
                q.raw(),
                k.raw(),
                qw,
                kw,
                i(q_stride),
                i(k_stride),
                i(n_heads),
                i(head_dim),
                i(rot_dims),
                theta,
                interleaved as i32,
                eps,
                kv.pos.raw(),
                kv.k.raw(),
                kv.v.raw(),
                v.raw(),
                i(n_kv),
                kv_type_code(kv.kv_type) as i32,
                freqs,
                scale,
                i(kv_ring_positions(kv.window))
            ],
        )
    }

    /// Index of the largest value of each of `rows` rows of `n` (first on ties).
    pub fn argmax(&self, x: DPtr<f32>, rows: usize, n: usize, out: DPtr<i32>) -> Result<()> {
        const K: Kernel = Kernel::ArgmaxF32;
        need(K, "x", x, rows * n)?;
        need(K, "out", out, rows)?;
        self.launch(K, (rows as u32, 1, 1), ARGMAX_BLOCK, 0, args![x.raw(), i(n), out.raw()])
    }

    /// Floats of the partials buffer [`Self::argmax_split`] needs for `rows` rows.
    pub fn argmax_split_scratch(rows: usize) -> usize {
        rows * ARGMAX_SPLIT_BLOCKS * 2
    }

    /// Same result as [`Self::argmax`], each row spread over [`ARGMAX_SPLIT_BLOCKS`] blocks, then
    /// reduced by a second kernel. `part` holds [`Self::argmax_split_scratch`] floats.
    pub fn argmax_split(
        &self,
        x: DPtr<f32>,
        rows: usize,
        n: usize,
        out: DPtr<i32>,
        part: DPtr<f32>,
    ) -> Result<()> {
        const K: Kernel = Kernel::ArgmaxPartialF32;
        need(K, "x", x, rows * n)?;
        need(K, "out", out, rows)?;
        need(K, "part", part, Self::argmax_split_scratch(rows))?;
        let nb = ARGMAX_SPLIT_BLOCKS as u32;
        self.launch(K, (nb, rows as u32, 1), BLOCK, 0, args![x.raw(), i(n), part.raw()])?;
        self.launch(
            Kernel::ArgmaxFinalF32,
            (rows as u32, 1, 1),
            32,
            0,
            args![part.raw(), i(nb as usize), out.raw()],
        )
    }

    /// `out[t] = table[tokens[t]]` widened to f32. Token ids must be checked by the caller.
    pub fn embed(
        &self,
        table: DPtr<u16>,
        tokens: DPtr<i32>,
        out: DPtr<f32>,
        n_tokens: usize,
        hidden: usize,
    ) -> Result<()> {
        const K: Kernel = Kernel::EmbedBf16;
        need(K, "tokens", tokens, n_tokens)?;
        need(K, "out", out, n_tokens * hidden)?;
        self.launch(
            K,
            (n_tokens as u32, 1, 1),
            BLOCK,
            0,
            args![table.raw(), tokens.raw(), out.raw(), i(hidden)],
        )
    }

    /// Rows of f32 `x` (gathered by `rows`, or the first `n_rows`) rounded to bf16 `hi`, with the
    /// rounding remainder in `lo` when given (`hi + lo` ≈ x to ~16 mantissa bits).
    pub fn gather_split_bf16(
        &self,
        x: DPtr<f32>,
        rows: Option<DPtr<i32>>,
        hi: DPtr<u16>,
        lo: Option<DPtr<u16>>,
        n_rows: usize,
        dim: usize,
    ) -> Result<()> {
        const K: Kernel = Kernel::GatherSplitBf16;
        if let Some(r) = rows {
            need(K, "rows", r, n_rows)?;
        } else {
            need(K, "x", x, n_rows * dim)?;
        }
        need(K, "hi", hi, n_rows * dim)?;
        if let Some(l) = lo {
            need(K, "lo", l, n_rows * dim)?;
        }
        let (r, l) = (rows.map_or(0, |p| p.raw()), lo.map_or(0, |p| p.raw()));
        self.launch(K, (n_rows as u32, 1, 1), BLOCK, 0, args![x.raw(), r, hi.raw(), l, i(dim)])
    }

    /// `out[r] = x[rows[r]]`.
    pub fn gather_rows(
        &self,
        x: DPtr<f32>,
        rows: DPtr<i32>,
        out: DPtr<f32>,
        n_rows: usize,
        dim: usize,
    ) -> Result<()> {
        const K: Kernel = Kernel::GatherRowsF32;
        need(K, "rows", rows, n_rows)?;
        need(K, "out", out, n_rows * dim)?;
        self.launch(K, (n_rows as u32, 1, 1), BLOCK, 0, args![x.raw(), rows.raw(), out.raw(), i(dim)])
    }

    /// `out[rows[r]] += src[r]` (rows distinct).
    pub fn scatter_add_rows(
        &self,
        src: DPtr<f32>,
        rows: DPtr<i32>,
        out: DPtr<f32>,
        n_rows: usize,
        dim: usize,
    ) -> Result<()> {
        const K: Kernel = Kernel::ScatterAddRowsF32;
        need(K, "rows", rows, n_rows)?;
        need(K, "src", src, n_rows * dim)?;
        self.launch(K, (n_rows as u32, 1, 1), BLOCK, 0, args![src.raw(), rows.raw(), out.raw(), i(dim)])
    }

    /// `out[t] += sigmoid(gate_logit[t]) * x[t]` (shared expert).
    pub fn add_sigmoid_scaled_rows(
        &self,
        out: DPtr<f32>,
        x: DPtr<f32>,
        gate_logit: DPtr<f32>,
        n_tokens: usize,
        dim: usize,
    ) -> Result<()> {
        const K: Kernel = Kernel::AddSigmoidScaledRows;
        need(K, "out", out, n_tokens * dim)?;
        need(K, "x", x, n_tokens * dim)?;
        need(K, "gate_logit", gate_logit, n_tokens)?;
        self.launch(K, (n_tokens as u32, 1, 1), BLOCK, 0, args![out.raw(), x.raw(), gate_logit.raw(), i(dim)])
    }

    /// Router: top-`k` ids and weights per token from logits `[n_tokens, n_experts]`
    /// (`k` <= [`ROUTE_MAX_TOPK`]).
    pub fn route_topk(
        &self,
        logits: DPtr<f32>,
        n_tokens: usize,
        n_experts: usize,
        k: usize,
        variant: RouteVariant,
        norm_topk: bool,
        ids: DPtr<i32>,
        weights: DPtr<f32>,
    ) -> Result<()> {
        const K: Kernel = Kernel::RouteTopk;
        if !topk_fits(k, n_experts) {
            return Err(CudaError::Shape {
                kernel: K.symbol(),
                reason: format!("top-{k} of {n_experts} experts (at most {ROUTE_MAX_TOPK} picks)"),
            });
        }
        need(K, "logits", logits, n_tokens * n_experts)?;
        need(K, "ids", ids, n_tokens * k)?;
        need(K, "weights", weights, n_tokens * k)?;
        let (v, nm) = (variant as i32, norm_topk as i32);
        self.launch(
            K,
            (blocks(n_tokens, ROWS_PER_BLOCK), 1, 1),
            ROW_BLOCK_THREADS,
            0,
            args![logits.raw(), i(n_tokens), i(n_experts), i(k), v, nm, ids.raw(), weights.raw()],
        )
    }

    /// Sigmoid routing (`route_sigmoid` in route.cu; DeepSeek-V3, Kimi K2, GLM-4.5): per token,
    /// scores `sigmoid(logit)`, the choice `score + selection bias`, group-limited when
    /// `r.n_group > 1`, the top `k` choices weighted by their scores (renormalised with
    /// `r.norm`, times `r.scale`). The CPU router's arithmetic.
    #[allow(clippy::too_many_arguments)]
    pub fn route_sigmoid(
        &self,
        logits: DPtr<f32>,
        n_tokens: usize,
        n_experts: usize,
        k: usize,
        r: SigmoidRoute,
        ids: DPtr<i32>,
        weights: DPtr<f32>,
    ) -> Result<()> {
        const K: Kernel = Kernel::RouteSigmoid;
        let (max_e, max_g) =
            (super::kernel::ROUTE_SIGMOID_MAX_EXPERTS, super::kernel::ROUTE_SIGMOID_MAX_GROUPS);
        let groups_ok = (1..=max_g).contains(&r.n_group)
            && n_experts.is_multiple_of(r.n_group)
            && (1..=r.n_group).contains(&r.topk_group);
        if !topk_fits(k, n_experts) || n_experts > max_e || !groups_ok {
            let reason = format!(
                "top-{k} of {n_experts} experts in {} groups keeping {} (at most {max_e} experts, {max_g} \
                 groups, {ROUTE_MAX_TOPK} picks)",
                r.n_group, r.topk_group
            );
            return Err(CudaError::Shape { kernel: K.symbol(), reason });
        }
        need(K, "logits", logits, n_tokens * n_experts)?;
        need(K, "ids", ids, n_tokens * k)?;
        need(K, "weights", weights, n_tokens * k)?;
        let bias = match r.selection_bias {
            Some(b) => {
                need(K, "selection bias", b, n_experts)?;
                b.raw()
            }
            None => 0,
        };
        let (ng, tg, nm) = (i(r.n_group), i(r.topk_group), r.norm as i32);
        self.launch(
            K,
            (n_tokens as u32, 1, 1),
            super::kernel::ROUTE_SIGMOID_THREADS,
            0,
            args![
                logits.raw(),
                i(n_tokens),
                i(n_experts),
                i(k),
                bias,
                ng,
                tg,
                nm,
                r.scale,
                ids.raw(),
                weights.raw()
            ],
        )
    }

    /// Decode routing in one launch (`route_decode` in route.cu): the FFN RMSNorm of each row
    /// (written to `rows.normed`), the bf16 router's logits, the top-`k` ids and weights (as
    /// [`Self::route_topk`]) and, with `worklist`, the rows' hot worklist entries (as
    /// [`Self::hot_worklist_tokens`]). `counter` holds one zero per row and is zero again after.
    /// The same bits as [`Self::rmsnorm`], [`Self::gemv_bf16`], [`Self::route_topk`] and
    /// [`Self::hot_worklist_tokens`] in turn.
    #[allow(clippy::too_many_arguments)]
    pub fn route_decode(
        &self,
        rows: NormRows,
        router: DPtr<u16>,
        n_experts: usize,
        k: usize,
        variant: RouteVariant,
        norm_topk: bool,
        logits: DPtr<f32>,
        ids: DPtr<i32>,
        weights: DPtr<f32>,
        counter: DPtr<u32>,
        worklist: Option<HotWorklist>,
    ) -> Result<()> {
        const K: Kernel = Kernel::RouteDecode;
        let (t, h) = (rows.n_rows, rows.dim);
        if !topk_fits(k, n_experts) || !Self::route_decode_fits(h, n_experts) {
            return Err(CudaError::Shape {
                kernel: K.symbol(),
                reason: format!(
                    "top-{k} of {n_experts} experts over rows of {h} (at most {ROUTE_MAX_TOPK} picks)"
                ),
            });
        }
        rows.check(K)?;
        need(K, "router", router, n_experts * h)?;
        need(K, "logits", logits, t * n_experts)?;
        need(K, "ids", ids, t * k)?;
        need(K, "weights", weights, t * k)?;
        need(K, "counter", counter, t)?;
        let [map, slots, tokens, tok_off, tok_rows] = match worklist {
            Some(w) => w.check(K, t, k, n_experts)?,
            None => [0; 5],
        };
        let smem = ((h + n_experts) * 4) as u32;
        let (v, nm) = (variant as i32, norm_topk as i32);
        self.launch(
            K,
            (blocks(n_experts, ROWS_PER_BLOCK), t as u32, 1),
            ROW_BLOCK_THREADS,
            smem,
            args![
                rows.x.raw(),
                rows.weight.raw(),
                rows.normed.raw(),
                router.raw(),
                i(h),
                i(n_experts),
                rows.eps,
                logits.raw(),
                i(k),
                v,
                nm,
                ids.raw(),
                weights.raw(),
                counter.raw(),
                map,
                slots,
                tokens,
                tok_off,
                tok_rows
            ],
        )
    }

    /// Whether [`Self::route_decode`] takes rows of `hidden` over `n_experts` (its shared memory
    /// holds a normed row and a logits row).
    pub fn route_decode_fits(hidden: usize, n_experts: usize) -> bool {
        (hidden + n_experts) * 4 <= ROUTE_DECODE_SHARED_BYTES
    }

    /// Hot lane decode, first half: `h[e] = glu(G_s · x_t + bg_s, U_s · x_t + bu_s)` for each
    /// worklist entry `e` (slot `slots[e]`, token row `tokens[e]`), caches `[n_slots, ff, hidden]`,
    /// the activation and per-slot biases `[n_slots, ff]` from `epi` (SiLU, none: `silu(g) * u`).
    pub fn moe_gate_up_gemv(
        &self,
        gate_cache: DPtr<u16>,
        up_cache: DPtr<u16>,
        x: DPtr<f32>,
        slots: DPtr<i32>,
        tokens: DPtr<i32>,
        h: DPtr<f32>,
        n_entries: usize,
        ff: usize,
        hidden: usize,
        epi: &GateUpEpilogue,
    ) -> Result<()> {
        const K: Kernel = Kernel::MoeGateUpGemv;
        need(K, "slots", slots, n_entries)?;
        need(K, "tokens", tokens, n_entries)?;
        need(K, "h", h, n_entries * ff)?;
        need(K, "gate_cache", gate_cache, ff * hidden)?;
        need(K, "up_cache", up_cache, ff * hidden)?;
        let (act, bg, bu) = epi.args(K, cache_slots(gate_cache.len(), ff * hidden), ff)?;
        self.launch(
            K,
            (blocks(ff, ROWS_PER_BLOCK), n_entries as u32, 1),
            ROW_BLOCK_THREADS,
            0,
            args![
                gate_cache.raw(),
                up_cache.raw(),
                x.raw(),
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

    /// Hot lane decode, second half: for output row `r` (token `tok_rows[r]`, entries
    /// `tok_off[r]..tok_off[r+1]`), `out[token] += Σ weights[e] · (D_{slots[e]} · h[e] + b_{slots[e]})`,
    /// cache `[n_slots, hidden, ff]`, `down_bias` per-slot `[n_slots, hidden]` (none: no bias).
    /// Deterministic (no atomics).
    pub fn moe_down_accum(
        &self,
        down_cache: DPtr<u16>,
        h: DPtr<f32>,
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
        const K: Kernel = Kernel::MoeDownAccum;
        need(K, "tok_off", tok_off, n_rows + 1)?;
        need(K, "tok_rows", tok_rows, n_rows)?;
        need(K, "down_cache", down_cache, hidden * ff)?;
        let n_slots = cache_slots(down_cache.len(), hidden * ff);
        let bd = bias_arg(K, "down bias", down_bias, n_slots * hidden)?;
        self.launch(
            K,
            (blocks(hidden, HOT_DOWN_ROWS), n_rows as u32, 1),
            ROW_BLOCK_THREADS,
            0,
            args![
                down_cache.raw(),
                h.raw(),
                slots.raw(),
                weights.raw(),
                tok_off.raw(),
                tok_rows.raw(),
                out.raw(),
                i(hidden),
                i(ff),
                bd
            ],
        )
    }

    /// Hot lane prefill, final step: output row `r` (token `tok_rows[r]`) adds
    /// `Σ weights[e] · y[e]` over `e` in `entries[tok_off[r]..tok_off[r+1]]`.
    pub fn moe_scatter_accum(
        &self,
        y: DPtr<f32>,
        entries: DPtr<i32>,
        weights: DPtr<f32>,
        tok_off: DPtr<i32>,
        tok_rows: DPtr<i32>,
        out: DPtr<f32>,
        n_rows: usize,
        hidden: usize,
    ) -> Result<()> {
        const K: Kernel = Kernel::MoeScatterAccum;
        need(K, "tok_off", tok_off, n_rows + 1)?;
        need(K, "tok_rows", tok_rows, n_rows)?;
        self.launch(
            K,
            (n_rows as u32, 1, 1),
            BLOCK,
            0,
            args![y.raw(), entries.raw(), weights.raw(), tok_off.raw(), tok_rows.raw(), out.raw(), i(hidden)],
        )
    }

    /// Decode hot worklist on the GPU: for entry `e = t * k + j`, `slots[e] = map[ids[e]]` (-1 when
    /// cold or out of range: the hot kernels skip such entries) and `tokens[e] = t`; token row `r`
    /// is token `r` with entries `tok_off[r]..tok_off[r + 1]` = `r*k..(r+1)*k`. `map` is one
    /// layer's expert -> cache slot map (`n_experts` entries).
    pub fn hot_worklist_tokens(
        &self,
        map: DPtr<i32>,
        ids: DPtr<i32>,
        n_tokens: usize,
        k: usize,
        n_experts: usize,
        slots: DPtr<i32>,
        tokens: DPtr<i32>,
        tok_off: DPtr<i32>,
        tok_rows: DPtr<i32>,
    ) -> Result<()> {
        const K: Kernel = Kernel::HotWorklistTokens;
        need(K, "map", map, n_experts)?;
        need(K, "ids", ids, n_tokens * k)?;
        need(K, "slots", slots, n_tokens * k)?;
        need(K, "tokens", tokens, n_tokens * k)?;
        need(K, "tok_off", tok_off, n_tokens + 1)?;
        need(K, "tok_rows", tok_rows, n_tokens)?;
        let n = (n_tokens * k).max(n_tokens + 1);
        self.launch(
            K,
            (blocks(n, BLOCK), 1, 1),
            BLOCK,
            0,
            args![
                map.raw(),
                ids.raw(),
                i(n_tokens),
                i(k),
                i(n_experts),
                slots.raw(),
                tokens.raw(),
                tok_off.raw(),
                tok_rows.raw()
            ],
        )
    }

    /// Whether [`Self::hot_worklist_grouped`] takes `n_tokens` rows of `k` entries over
    /// `n_slots` cache slots (its one block sorts them in shared memory).
    pub fn hot_worklist_grouped_fits(n_tokens: usize, k: usize, n_slots: usize) -> bool {
        Self::hot_worklist_grouped_shared_bytes(n_tokens * k, n_slots) <= HOT_GROUPED_SHARED_BYTES
            && n_slots > 0
    }

    /// The dynamic shared memory of [`Self::hot_worklist_grouped`] over `n` entries: the slot of
    /// each, then the count, first row and first tile of each slot, then each warp's count per
    /// slot.
    fn hot_worklist_grouped_shared_bytes(n: usize, n_slots: usize) -> usize {
        (n + (3 + (BLOCK / 32) as usize) * n_slots) * 4
    }

    /// Most tiles of at most `tile_rows` rows [`Self::hot_worklist_grouped`] writes for
    /// `n_entries` routed entries over `n_slots` slots: a tile has at least one entry, and each
    /// used slot's run adds at most one partial tile to its full ones.
    pub fn hot_grouped_max_tiles(n_entries: usize, n_slots: usize, tile_rows: usize) -> usize {
        n_entries.min(n_entries.min(n_slots) + n_entries / tile_rows.max(1))
    }

    /// The hot lane's worklist for the grouped GEMMs over a batched decode step or an all-hot
    /// prefill call, built on the device from the routing (`ids`, `weights`: `[n_tokens, k]`) and
    /// the layer's expert-to-slot `map`: the hot entries sorted by slot (`tokens`, `wsorted`: one
    /// per sorted row, `n_tokens * k` rows with the unused ones token 0, weight 0), `entries` (the
    /// sorted row of each routed entry, -1 for a cold one), the token rows (`tok_off`,
    /// `tok_rows`: token `t`, entries `t * k..`) for [`Self::moe_scatter_accum`], and
    /// [`Self::hot_grouped_max_tiles`] tiles (`(slot, first row, rows)` with at most `tile_rows`
    /// rows, the grouped GEMMs' shape; unused ones slot -1) for the grouped GEMMs. One block.
    pub fn hot_worklist_grouped(
        &self,
        (map, ids, weights): (DPtr<i32>, DPtr<i32>, DPtr<f32>),
        (n_tokens, k, n_experts, n_slots, tile_rows): (usize, usize, usize, usize, usize),
        (tokens, wsorted, entries): (DPtr<i32>, DPtr<f32>, DPtr<i32>),
        (tok_off, tok_rows, tiles): (DPtr<i32>, DPtr<i32>, DPtr<i32>),
    ) -> Result<()> {
        const K: Kernel = Kernel::HotWorklistGrouped;
        let n = n_tokens * k;
        if !Self::hot_worklist_grouped_fits(n_tokens, k, n_slots) {
            let reason = format!("{n} entries over {n_slots} slots do not fit one block's shared memory");
            return Err(CudaError::Shape { kernel: K.symbol(), reason });
        }
        if tile_rows == 0 || tile_rows > GROUPED_TILE_ROWS {
            let reason = format!("tiles of {tile_rows} rows (1..={GROUPED_TILE_ROWS})");
            return Err(CudaError::Shape { kernel: K.symbol(), reason });
        }
        let n_tiles = Self::hot_grouped_max_tiles(n, n_slots, tile_rows);
        need(K, "map", map, n_experts)?;
        need(K, "ids", ids, n)?;
        need(K, "weights", weights, n)?;
        need(K, "tokens", tokens, n)?;
        need(K, "wsorted", wsorted, n)?;
        need(K, "entries", entries, n)?;
        need(K, "tok_off", tok_off, n_tokens + 1)?;
        need(K, "tok_rows", tok_rows, n_tokens)?;
        need(K, "tiles", tiles, 3 * n_tiles)?;
        self.launch(
            K,
            (1, 1, 1),
            BLOCK,
            Self::hot_worklist_grouped_shared_bytes(n, n_slots) as u32,
            args![
                map.raw(),
                ids.raw(),
                weights.raw(),
                i(n_tokens),
                i(k),
                i(n_experts),
                i(n_slots),
                i(n_tiles),
                i(tile_rows),
                tokens.raw(),
                wsorted.raw(),
                entries.raw(),
                tok_off.raw(),
                tok_rows.raw(),
                tiles.raw()
            ],
        )
    }

    /// cuBLAS: `y[t, :] (+)= W · x[t, :]` for `n_tokens` rows with W `[n, k]` bf16 and x given as
    /// bf16 `x_hi` (+ `x_lo`, the rounding remainder, as a second accumulated GEMM when given),
    /// f32 output and f32 compute (`cublasGemmEx`, CUBLAS_COMPUTE_32F).
    pub fn gemm_bf16(
        &self,
        w: DPtr<u16>,
        x_hi: DPtr<u16>,
        x_lo: Option<DPtr<u16>>,
        y: DPtr<f32>,
        n_tokens: usize,
        n: usize,
        k: usize,
        accumulate: bool,
    ) -> Result<()> {
        self.gemm_bf16_strided(w, x_hi, x_lo, y, n_tokens, n, k, n, accumulate)
    }

    /// As [`CudaBackend::gemm_bf16`] into columns `0..n` of a row-major `y` whose rows are
    /// `ldy >= n` apart (a column range of a wider output: W holds a row range of a matrix).
    pub fn gemm_bf16_strided(
        &self,
        w: DPtr<u16>,
        x_hi: DPtr<u16>,
        x_lo: Option<DPtr<u16>>,
        y: DPtr<f32>,
        n_tokens: usize,
        n: usize,
        k: usize,
        ldy: usize,
        accumulate: bool,
    ) -> Result<()> {
        const K: &str = "gemm_bf16";
        need(K, "W", w, n * k)?;
        need(K, "x_hi", x_hi, n_tokens * k)?;
        if n_tokens == 0 {
            return Ok(());
        }
        if ldy < n {
            return Err(CudaError::Shape { kernel: K, reason: format!("ldy = {ldy} < n = {n}") });
        }
        need(K, "y", y, (n_tokens - 1) * ldy + n)?;
        let alpha: f32 = 1.0;
        let parts: Vec<DPtr<u16>> = std::iter::once(x_hi).chain(x_lo).collect();
        for (idx, x) in parts.iter().enumerate() {
            need(K, "x_lo", *x, n_tokens * k)?;
            let beta: f32 = if accumulate || idx > 0 { 1.0 } else { 0.0 };
            // Row-major y[T, n] = x[T, k] · W[n, k]^T is column-major y^T[n, T] = W^T' · x^T:
            // A = W (col-major k x n, op T), B = x (col-major k x T, op N).
            // SAFETY: the cuBLAS handle is live and bound to this backend's stream; `w`, `x` and `y`
            // are checked `DPtr`s into live buffers of the sizes `need` verified above, and the scalars
            // live across the call.
            unsafe {
                br::gemm_ex(
                    *self.blas.handle(),
                    bs::cublasOperation_t::CUBLAS_OP_T,
                    bs::cublasOperation_t::CUBLAS_OP_N,
                    i(n),
                    i(n_tokens),
                    i(k),
                    &alpha as *const f32 as *const c_void,
                    w.raw() as *const c_void,
                    bs::cudaDataType::CUDA_R_16BF,
                    i(k),
                    x.raw() as *const c_void,
                    bs::cudaDataType::CUDA_R_16BF,
                    i(k),
                    &beta as *const f32 as *const c_void,
                    y.raw() as *mut c_void,
                    bs::cudaDataType::CUDA_R_32F,
                    i(ldy),
                    bs::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    bs::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(|source| CudaError::Cublas { what: "cublasGemmEx", source })?;
        }
        Ok(())
    }

    /// Whether the grouped GEMMs (bf16 and quantized caches) may take the pipelined kernels (on
    /// where the device has `cp.async`, unless [`CudaBackend::set_grouped_pipeline`] turned it off).
    pub fn grouped_pipeline(&self) -> bool {
        self.grouped_pipeline.load(Ordering::Relaxed)
    }

    /// Switch the pipelined grouped GEMMs on or off (for the tests that compare the two bit for
    /// bit); on takes effect only where the device has them. Same results either way.
    pub fn set_grouped_pipeline(&self, on: bool) {
        self.grouped_pipeline.store(on && self.info().has_sm80(), Ordering::Relaxed);
    }

    /// The grouped kernel for bf16 caches `ws` (gate and up, or one matrix) over `x` with `k`
    /// columns, and its dynamic shared memory: the pipelined one where its 16-byte copies fit
    /// (k a multiple of 8, caches and x 16-byte aligned; in the decode shape for tiles of at most
    /// [`GROUPED_DECODE_TILE_ROWS`] rows), else the synchronous one; `epi`: the instance with the
    /// general epilogue (an activation other than SiLU, biases).
    fn grouped_kernel<const N: usize>(
        &self,
        ws: [DPtr<u16>; N],
        x: DPtr<f32>,
        k: usize,
        epi: bool,
        tile_rows: usize,
    ) -> (Kernel, u32) {
        let aligned = k.is_multiple_of(8) && aligned16(&[x.raw()]) && aligned16(&ws.map(|w| w.raw()));
        let pipe = self.grouped_pipeline() && aligned;
        let dec = tile_rows <= GROUPED_DECODE_TILE_ROWS;
        if pipe && dec && k.is_multiple_of(32) {
            // the decode shape: the register-direct kernels (grouped_gemm.cu)
            let kernel = match (ws.len() == 2, epi) {
                (true, false) => Kernel::GroupedGateUpBf16Rows,
                (true, true) => Kernel::GroupedGateUpBf16RowsEpi,
                (false, false) => Kernel::GroupedGemmBf16Rows,
                (false, true) => Kernel::GroupedGemmBf16RowsBias,
            };
            return (kernel, 0);
        }
        let kernel = match (pipe, ws.len() == 2, epi) {
            (true, true, false) if dec => Kernel::GroupedGateUpBf16Dec,
            (true, true, true) if dec => Kernel::GroupedGateUpBf16DecEpi,
            (true, false, false) if dec => Kernel::GroupedGemmBf16Dec,
            (true, false, true) if dec => Kernel::GroupedGemmBf16DecBias,
            (true, true, false) => Kernel::GroupedGateUpBf16Pipe,
            (true, true, true) => Kernel::GroupedGateUpBf16PipeEpi,
            (true, false, false) => Kernel::GroupedGemmBf16Pipe,
            (true, false, true) => Kernel::GroupedGemmBf16PipeBias,
            (false, true, false) => Kernel::GroupedGateUpBf16,
            (false, true, true) => Kernel::GroupedGateUpBf16Epi,
            (false, false, false) => Kernel::GroupedGemmBf16,
            (false, false, true) => Kernel::GroupedGemmBf16Bias,
        };
        (kernel, if pipe { grouped_pipe_shared_bytes(N, tile_rows) as u32 } else { 0 })
    }

    /// Grouped expert GEMM, gate and up fused (the prefill hot lane's first half, one launch
    /// for every cached expert of a layer): for row `r` of a tile of slot `s` ([`grouped_tiles`]),
    /// `h[r] = glu(G_s · x[rows[r]] + bg_s, U_s · x[rows[r]] + bu_s)` (`epi`: the activation and
    /// per-slot biases `[n_slots, ff]`); caches `[n_slots, ff, hidden]` bf16,
    /// `x` f32 `[n_x_rows, hidden]`, `h` f32 `[n_rows, ff]`. Tensor cores (sm_80+), bf16 inputs,
    /// f32 accumulation; `split`: the input as bf16 hi + lo (two MMAs into one accumulator).
    pub fn grouped_gate_up(
        &self,
        gate_cache: DPtr<u16>,
        up_cache: DPtr<u16>,
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
        let shape = GroupedShape { n_slots, n_x_rows, n_rows, n_tiles, tile_rows, n: ff, k: hidden };
        shape.check(Kernel::GroupedGateUpBf16, &[gate_cache, up_cache], x, Some(rows), tiles, h)?;
        let (act, bg, bu) = epi.args(Kernel::GroupedGateUpBf16, n_slots, ff)?;
        if n_tiles == 0 || ff == 0 {
            return Ok(());
        }
        let (kernel, shared) =
            self.grouped_kernel([gate_cache, up_cache], x, hidden, !epi.is_plain(), tile_rows);
        let (grid, threads) = grouped_launch(kernel, &shape);
        self.launch(
            kernel,
            grid,
            threads,
            shared,
            args![
                gate_cache.raw(),
                up_cache.raw(),
                x.raw(),
                rows.raw(),
                i(n_x_rows),
                tiles.raw(),
                i(n_rows),
                i(n_slots),
                h.raw(),
                i(ff),
                i(hidden),
                i32::from(split),
                act,
                bg,
                bu
            ],
        )
    }

    /// Grouped expert GEMM (the prefill hot lane's down projection, one launch for every cached
    /// expert of a layer): for row `r` of a tile of slot `s`, `y[r] = W_s · x_r + b_s` with `x_r` =
    /// `x[rows[r]]` (or `x[r]` without `rows`); cache `[n_slots, n, k]` bf16, `x` f32
    /// `[n_x_rows, k]`, `y` f32 `[n_rows, n]`, `bias` per-slot `[n_slots, n]` (none: no bias).
    /// Tensor cores as [`CudaBackend::grouped_gate_up`].
    pub fn grouped_gemm(
        &self,
        w_cache: DPtr<u16>,
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
        let shape = GroupedShape { n_slots, n_x_rows, n_rows, n_tiles, tile_rows, n, k };
        shape.check(Kernel::GroupedGemmBf16, &[w_cache], x, rows, tiles, y)?;
        let b = bias_arg(Kernel::GroupedGemmBf16, "bias", bias, n_slots * n)?;
        if n_tiles == 0 || n == 0 {
            return Ok(());
        }
        let r = rows.map_or(0, |p| p.raw());
        let (kernel, shared) = self.grouped_kernel([w_cache], x, k, bias.is_some(), tile_rows);
        let (grid, threads) = grouped_launch(kernel, &shape);
        self.launch(
            kernel,
            grid,
            threads,
            shared,
            args![
                w_cache.raw(),
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
            ],
        )
    }
}
