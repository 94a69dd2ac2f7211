//! The kernels by typed id, their op-family source files, and the constants shared by the
//! Rust launchers and the CUDA code (passed to NVRTC as `-D` defines, defined only here).

use super::ops::{
    ATTENTION_GQA_HEADS, ATTENTION_GQA_MAX_HEAD_DIM, ATTENTION_MAX_HEAD_DIM, ATTENTION_SPLIT_CHUNK,
    ROUTE_MAX_TOPK,
};

/// Most experts of a sigmoid router row (`-DROUTE_SIG_MAXE`): the block keeps every expert's
/// score and choice in shared memory (8 KiB). DeepSeek-V3 and GLM-4.5 have 256 or 128, Kimi K2
/// 384.
pub const ROUTE_SIGMOID_MAX_EXPERTS: usize = 1024;
/// Most expert groups of a sigmoid router (`-DROUTE_SIG_MAXG`; DeepSeek-V3 has 8).
pub const ROUTE_SIGMOID_MAX_GROUPS: usize = 64;
/// Threads of the one-block-per-row sigmoid router.
pub const ROUTE_SIGMOID_THREADS: u32 = 256;

/// Warps per block in the warp-per-row kernels (`-DROWS_PER_BLOCK`).
pub const ROWS_PER_BLOCK: u32 = 8;
/// Threads of a warp-per-row block: one warp per output row.
pub const ROW_BLOCK_THREADS: u32 = 32 * ROWS_PER_BLOCK;
/// Threads of the one-block-per-row argmax, also its shared-memory slots (`-DARGMAX_BLOCK`).
pub const ARGMAX_BLOCK: u32 = 1024;
/// Warps of the split attention kernel (`-DATT_SPLIT_WARPS`); each scores
/// `ATTENTION_SPLIT_CHUNK / ATTENTION_SPLIT_WARPS` positions of its chunk.
pub const ATTENTION_SPLIT_WARPS: u32 = 8;
/// Activation rows one launch of a quantized GEMV multiplies with each weight it decodes
/// (`-DQUANT_MAX_TOKENS`; its accumulators live in registers).
pub const QUANT_MAX_TOKENS: u32 = 8;
/// Rows of one warp in the one-token quantized GEMV (`-DQUANT_WIDE_ROWS`): they share the
/// warp's loads of x, so more rows read x less often but leave fewer warps for small matrices.
pub const QUANT_WIDE_ROWS: u32 = 2;
/// Query rows ((token, head) pairs of one kv head's group) of a tiled prefill attention block
/// (`-DATT_TILE_ROWS`): four per warp.
pub const ATTENTION_TILE_ROWS: usize = 16;
/// Key positions of a tiled prefill attention tile staged in shared memory (`-DATT_TILE_KEYS`):
/// one per lane.
pub const ATTENTION_TILE_KEYS: usize = 32;
/// Largest head dimension of the tiled prefill attention (`-DATT_TILE_MAXC` = this / 32 values
/// per lane and row; Qwen3.5/3.6 and Qwen3-Next heads are 256): K, V and query tiles take
/// [`attention_tile_shared_bytes`], 41.5 KiB for 128-dim heads and 80.5 KiB for 256 (past the
/// default 48 KiB: the kernels opt in to more), and a thread holds 4 x this / 32 accumulators.
pub const ATTENTION_TILE_MAX_HEAD_DIM: usize = 256;

/// Dynamic shared memory of a tiled prefill attention block over `head_dim`-value heads: K rows
/// padded to `head_dim + 4` floats, V rows, and the block's query rows.
pub const fn attention_tile_shared_bytes(head_dim: usize) -> usize {
    4 * (ATTENTION_TILE_KEYS * (2 * head_dim + 4) + ATTENTION_TILE_ROWS * head_dim)
}
/// Threads of a tiled prefill attention block.
pub const ATTENTION_TILE_THREADS: u32 = 32 * (ATTENTION_TILE_ROWS as u32 / 4);
/// Head dims one block of the split attention's combine sums (`-DATT_COMBINE_DIMS`, a lane's
/// dim each): its grid has `head_dim / ATTENTION_COMBINE_DIMS` blocks (rounded up) a head.
pub const ATTENTION_COMBINE_DIMS: usize = 32;
/// Warps of a tensor-core prefill attention block (`-DATT_MMA_WARPS`), 16 query rows each.
pub const ATTENTION_MMA_WARPS: u32 = 4;
/// Key positions of one tensor-core attention tile (`-DATT_MMA_KEYS`), staged as bf16 hi + lo.
pub const ATTENTION_MMA_KEYS: usize = 32;
/// Largest head dimension of the tensor-core attention (`-DATT_MMA_MAXD`). Cost: a thread holds
/// 2 x this / 4 registers of query fragments and this / 2 accumulators (128: ~130 registers), and
/// a block 4 x keys x (this + 8) bf16 of shared memory (34 KiB).
pub const ATTENTION_MMA_MAX_HEAD_DIM: usize = 128;
/// Largest head dimension of the wide-head tensor-core attention over f16 and bf16 caches
/// (`-DATT_MMA_WIDE_MAXD`; heads past [`ATTENTION_MMA_MAX_HEAD_DIM`]: Qwen3.5/3.6 and Qwen3-Next
/// full attention and Gemma 4's sliding layers have 256). Cost: a thread holds this / 2 o
/// accumulators in registers (256: 128 of them, ~180 registers in all); the query fragments go
/// to shared memory instead, 64 x head dim bytes a warp ([`attention_mma_wide_shared_bytes`]).
pub const ATTENTION_MMA_WIDE_MAX_HEAD_DIM: usize = 256;
/// Key positions of one wide-head tensor-core tile (`-DATT_MMA_WIDE_KEYS`): 16, half the narrow
/// kernels' tile, so that a prefill block at 256 dims (two stages of K and V tiles plus four
/// warps' queries: 97 KiB) stays under the 99 KiB a block may opt in to on sm_86 / sm_89 /
/// sm_120 (the smallest of sm_80+). Cost: twice the barriers a key of the 32-key tiles.
pub const ATTENTION_MMA_WIDE_KEYS: usize = 16;

/// Dynamic shared memory of a wide-head tensor-core attention block over `head_dim`-value heads
/// with `q_warps` warps holding queries: two stages of K and V tiles (16-bit, rows padded by 8
/// values), then each warp's query fragments hi + lo (`head_dim / 16` steps of 32 lanes x 2 x 16
/// bytes). The kernels (`amw_kv_bytes`, `amw_q_slice` in attention.cu) use the same layout.
pub const fn attention_mma_wide_shared_bytes(head_dim: usize, q_warps: usize) -> usize {
    2 * 2 * ATTENTION_MMA_WIDE_KEYS * (head_dim + 8) * 2 + q_warps * 64 * head_dim
}
/// Threads of a tensor-core prefill attention block.
pub const ATTENTION_MMA_THREADS: u32 = 32 * ATTENTION_MMA_WARPS;
/// Threads of the split attention kernel.
pub const ATTENTION_SPLIT_THREADS: u32 = 32 * ATTENTION_SPLIT_WARPS;
/// Rows (hot entries of one cache slot) of a grouped expert GEMM tile (`-DGG_BM`).
pub const GROUPED_TILE_ROWS: usize = 64;
/// Output columns of a grouped expert GEMM tile (`-DGG_BN`).
pub const GROUPED_TILE_COLS: usize = 64;
/// Threads of a grouped expert GEMM block (`-DGG_THREADS`): 4 warps, 2 x 2 over the tile.
pub const GROUPED_THREADS: u32 = 128;
/// k columns of one stage of the pipelined grouped GEMM (`-DGG_PIPE_BK`).
pub const GROUPED_PIPE_BK: usize = 32;
/// Shared-memory stages of the pipelined grouped GEMM (`-DGG_STAGES`): copies run this many
/// less one k steps ahead of the MMAs. Cost: [`grouped_pipe_shared_bytes`] a block (gate and
/// up: 60 KiB, three blocks an SM of the H100's 228 KiB).
pub const GROUPED_PIPE_STAGES: usize = 3;
/// Rows of a grouped GEMM tile in the decode shape (`-DGG_DEC_BM`), the pipelined kernels'
/// `_dec` instances: a batched decode step routes one or two rows to most experts, and a 64-row
/// tile staged its f32 x rows (mostly zeros) in 10 KiB a stage, half of a gate/up stage. Here 2.5.
pub const GROUPED_DECODE_TILE_ROWS: usize = 16;
/// Stages of the decode shape (`-DGG_DEC_STAGES`). Cost: [`grouped_pipe_shared_bytes`] 50 KiB a
/// gate/up block, four blocks an SM (prefill's shape: three), so twice the weight bytes in flight.
pub const GROUPED_DECODE_STAGES: usize = 4;
/// Most tokens of a device-path call (a batched decode step) whose worklist is cut into tiles of
/// [`GROUPED_DECODE_TILE_ROWS`]; more take prefill's tiles. At top-8 of 128 experts, 64 tokens route
/// about 4 rows to each expert.
pub const GROUPED_DECODE_MAX_TOKENS: usize = 64;

/// Largest key head dim of the Gated DeltaNet kernels (`-DDELTA_MAX_DK`; Qwen3-Next and Qwen3.5:
/// 128): a decode thread keeps a quarter of this many rows of its state column in registers, a
/// scan block a chunk's rows of this many floats in shared memory (4 x [`DELTA_CHUNK`]).
pub const DELTA_MAX_KEY_DIM: usize = 128;
/// Widest causal conv of the Gated DeltaNet kernel (`-DDELTA_MAX_KERNEL`; the models use 4): the
/// history a thread keeps in registers.
pub const DELTA_MAX_CONV_KERNEL: usize = 8;
/// Tokens per chunk of the chunked DeltaNet prefill kernels (`-DDELTA_CHUNK`): a prep block keeps a
/// chunk's normalised q and k (`[chunk, dk + 1]` each) and its `chunk x chunk` system in static
/// shared memory, a scan thread its `chunk` partial sums in registers.
pub const DELTA_CHUNK: usize = 32;
/// Value columns of a head's state one block of the chunked DeltaNet scan keeps
/// (`-DDELTA_SCAN_COLS`): a thread per chunk row and 4 columns, so
/// [`DELTA_CHUNK`] x this / 4 threads a block ([`DELTA_SCAN_THREADS`]).
pub const DELTA_SCAN_COLS: usize = 32;
/// Threads of a chunked DeltaNet scan block.
pub const DELTA_SCAN_THREADS: usize = DELTA_CHUNK * DELTA_SCAN_COLS / 4;

/// Dynamic shared memory of a chunked DeltaNet scan block (`DeltaScanSmem` in delta_net.cu): a
/// chunk's W, QG and KG rows (padded to [`DELTA_MAX_KEY_DIM`] + 4), its U0 columns and QK rows
/// (padded to [`DELTA_CHUNK`] + 4), the decay, the state's rows and u. 78 KiB: under the 99 KiB
/// a block may opt in to on every sm_80+ device.
pub const fn delta_scan_shared_bytes() -> usize {
    let (c, cols) = (DELTA_CHUNK, DELTA_SCAN_COLS);
    4 * (3 * c * (DELTA_MAX_KEY_DIM + 4) + c * cols + c * (c + 4) + 4 + DELTA_MAX_KEY_DIM * cols + c * cols)
}

/// Query heads of one latent attention block (`-DMLA_HEADS`): each cache row a block reads feeds
/// this many heads (warp g runs head g's softmax, so it equals [`ATTENTION_SPLIT_WARPS`]).
pub const MLA_HEADS: usize = 8;
/// Tokens of one per-head latent product block (`-DMLA_TOKENS`): each weight it reads feeds this
/// many tokens (their accumulators live in registers).
pub const MLA_TOKENS: usize = 8;
/// Largest latent (`kv_lora_rank`) of the latent attention kernels (`-DMLA_MAX_RANK`, a multiple
/// of 256: a thread keeps `MLA_HEADS x this / 256` accumulators; DeepSeek-V3 and Kimi K2: 512).
pub const MLA_MAX_RANK: usize = 512;
/// Largest rotated key part of the latent attention kernels (`-DMLA_MAX_ROPE`; the models: 64).
/// A block stages `MLA_HEADS` queries of `MLA_MAX_RANK + this` floats in shared memory (18 KiB).
pub const MLA_MAX_ROPE: usize = 64;
/// Groups of 16 query rows of one tensor-core latent attention block (`-DMLA_MMA_GROUPS`; four
/// warps a group): each staged cache tile feeds `16 x this` (token, head) rows. 2: 256 threads
/// of about 190 registers, one block an SM.
pub const MLA_MMA_GROUPS: usize = 2;
/// Cache positions of one tensor-core latent attention tile (`-DMLA_MMA_KEYS`): two stages of
/// `this x (MLA_MAX_RANK + MLA_MAX_ROPE + 8)` 16-bit values ([`mla_mma_shared_bytes`]).
pub const MLA_MMA_KEYS: usize = 32;

/// Dynamic shared memory of a tensor-core latent attention block: the two stages of cache rows
/// (16-bit, rows padded by 8) and each group's four warps' partial score tiles (16 floats a lane).
pub const fn mla_mma_shared_bytes() -> usize {
    2 * MLA_MMA_KEYS * (MLA_MAX_RANK + MLA_MAX_ROPE + 8) * 2 + MLA_MMA_GROUPS * 4 * 32 * 16 * 4
}

/// k columns of one stage of the int8 grouped GEMMs (`-DGQ_BK`: two blocks of 32).
pub const GROUPED_Q8_BK: usize = 64;

/// Dynamic shared memory of an int8 grouped GEMM block (`grouped_*_mxfp4_q8`) over `matrices`
/// weight tiles: [`GROUPED_PIPE_STAGES`] stages of prefill's tile, each the int8 x and weight
/// tiles (rows padded by 16 bytes) and their f32 block scales (`quant.cu`'s `GqStage`). Gate and
/// up: 49.5 KiB, four blocks an SM of the H100's 228 KiB.
pub const fn grouped_q8_shared_bytes(matrices: usize) -> usize {
    let (pad, blocks) = (GROUPED_Q8_BK + 16, GROUPED_Q8_BK / 32);
    let stage = GROUPED_TILE_ROWS * (pad + blocks * 4) + matrices * GROUPED_TILE_COLS * (pad + blocks * 4);
    GROUPED_PIPE_STAGES * stage
}

/// Dynamic shared memory of a pipelined grouped GEMM block over `matrices` weight tiles (gate
/// and up: 2) in the shape of tiles of at most `tile_rows` rows (the decode shape up to
/// [`GROUPED_DECODE_TILE_ROWS`], else prefill's): per stage the f32 x tile and the bf16 weight
/// tiles, rows padded by 8 elements.
pub const fn grouped_pipe_shared_bytes(matrices: usize, tile_rows: usize) -> usize {
    let pad = GROUPED_PIPE_BK + 8;
    let (stages, rows) = if tile_rows <= GROUPED_DECODE_TILE_ROWS {
        (GROUPED_DECODE_STAGES, GROUPED_DECODE_TILE_ROWS)
    } else {
        (GROUPED_PIPE_STAGES, GROUPED_TILE_ROWS)
    };
    stages * (rows * pad * 4 + matrices * GROUPED_TILE_COLS * pad * 2)
}
/// Output rows of one decode down-projection block (`-DDOWN_ROWS`): its warps take one entry
/// each over these rows, so a hidden size of 2048 gives 8192 warps (every SM full) where one
/// warp per row walking the entries in turn gave 2048.
pub const HOT_DOWN_ROWS: u32 = 2;
/// Warps that share one row of the split one-token bf16 GEMV (`-DGEMV_SPLIT`), each over a
/// contiguous range of the row: a 2048-row output projection gets 4096 warps instead of 2048,
/// 512 blocks that the H100 holds at once (4: 8192 warps, 1.3 waves of blocks; all-hot tg128 of
/// a 4-layer file 1927 -> 1944 t/s with 2, session 20).
pub const GEMV_SPLIT_WARPS: u32 = 2;
const _: () = assert!(ROWS_PER_BLOCK.is_multiple_of(GEMV_SPLIT_WARPS));
/// Warps of one block of the batched-decode tensor-core GEMV (`-DGEMV_MMA_WARPS`; twice as many
/// in `gemv_mma_bf16_w16`): they share the block's 16 (or 32) output rows, each over every
/// this-many-th 32-column slab of k, so a 2048-row output projection still gets 1024 warps.
/// Cost: a shared-memory sum of this x 16 x 32 floats a 16-row group at [`GEMV_MMA_TOKENS`] 32
/// (16 KiB; 32 KiB for 32 rows).
pub const GEMV_MMA_WARPS: u32 = 8;
/// Warps per SM below which the batched-decode tensor-core GEMV runs blocks of twice
/// [`GEMV_MMA_WARPS`] warps (`gemv_mma_bf16_w16`): a projection of few 16-row blocks (o: 128 for
/// 2048 rows) otherwise leaves each SM 8 warps to keep the weights' loads in flight.
pub const GEMV_MMA_MIN_WARPS_PER_SM: usize = 32;
/// Tokens one block of the batched-decode tensor-core GEMV multiplies with each weight it reads
/// (`-DGEMV_MMA_TOKENS`, a multiple of 8: its accumulators, this / 2 a thread, live in registers);
/// more tokens take more grid rows, each reading the weights again.
pub const GEMV_MMA_TOKENS: usize = 32;
const _: () = assert!(GEMV_MMA_TOKENS.is_multiple_of(8) && GEMV_MMA_TOKENS <= 32);
/// Most rows of a decode call (a batched step) whose projections take GEMVs, each weight read once
/// a launch: bf16 the tensor-core GEMV ([`GEMV_MMA_TOKENS`] rows a launch), quantized the
/// quantized GEMV ([`QUANT_MAX_TOKENS`] rows a launch); more take cuBLAS GEMMs (quantized weights
/// dequantized to bf16 first). Cost: each launch past the first reads the weights again; at this
/// many rows a Q4_K matrix is read 8 times, 4.5 bytes a weight, against the dequantize-then-GEMM
/// path's 6.5 (0.56 read, 2 written, 2 read by each of the hi and lo GEMMs).
pub const DECODE_GEMV_MAX_TOKENS: usize = 2 * GEMV_MMA_TOKENS;
const _: () = assert!(GROUPED_PIPE_BK.is_multiple_of(16) && GROUPED_PIPE_STAGES >= 2);
const _: () = assert!((GROUPED_TILE_ROWS * GROUPED_PIPE_BK / 4).is_multiple_of(GROUPED_THREADS as usize));
const _: () = assert!(
    (GROUPED_DECODE_TILE_ROWS * GROUPED_PIPE_BK / 4).is_multiple_of(GROUPED_THREADS as usize)
        && GROUPED_DECODE_TILE_ROWS.is_multiple_of(16)
        && GROUPED_DECODE_TILE_ROWS < GROUPED_TILE_ROWS
        && GROUPED_DECODE_STAGES >= 2
);
const _: () = assert!((GROUPED_TILE_COLS * GROUPED_PIPE_BK / 8).is_multiple_of(GROUPED_THREADS as usize));
const _: () = assert!(ATTENTION_SPLIT_CHUNK.is_multiple_of(ATTENTION_SPLIT_WARPS as usize));
const _: () = assert!(MLA_HEADS == ATTENTION_SPLIT_WARPS as usize && MLA_MAX_RANK.is_multiple_of(256));
const _: () = assert!(ATTENTION_MAX_HEAD_DIM.is_multiple_of(32));
const _: () = assert!(ATTENTION_TILE_ROWS.is_multiple_of(4) && ATTENTION_TILE_KEYS == 32);
const _: () = assert!(ATTENTION_TILE_MAX_HEAD_DIM.is_multiple_of(32));
const _: () = assert!(ATTENTION_MMA_KEYS.is_multiple_of(16) && ATTENTION_MMA_MAX_HEAD_DIM.is_multiple_of(16));
const _: () =
    assert!(ATTENTION_MMA_WIDE_KEYS.is_multiple_of(16) && ATTENTION_MMA_WIDE_MAX_HEAD_DIM.is_multiple_of(16));
// the widest blocks fit the 99 KiB opt-in limit of every sm_80+ device
const _: () = assert!(
    attention_mma_wide_shared_bytes(ATTENTION_MMA_WIDE_MAX_HEAD_DIM, ATTENTION_MMA_WARPS as usize)
        <= 99 << 10
);
const _: () = assert!(mla_mma_shared_bytes() <= 99 << 10 && MLA_MMA_KEYS == 32);

/// Shared device helpers (types, warp and block reductions), prepended to the families.
pub const COMMON_CUH: &str = include_str!("../../cuda/common.cuh");

/// An op family: one `kernels/cuda/*.cu` file, compiled after [`COMMON_CUH`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    Gemv,
    NormRope,
    Elementwise,
    Attention,
    Argmax,
    Route,
    Moe,
    GroupedGemm,
    Quant,
    DeltaNet,
    Gemma,
    Mla,
}

impl Family {
    /// Every family, in compile order.
    pub const ALL: [Family; 12] = [
        Family::Gemv,
        Family::NormRope,
        Family::Elementwise,
        Family::Attention,
        Family::Argmax,
        Family::Route,
        Family::Moe,
        Family::GroupedGemm,
        Family::Quant,
        Family::DeltaNet,
        Family::Gemma,
        Family::Mla,
    ];

    /// The file under `kernels/cuda/`.
    pub fn file_name(self) -> &'static str {
        match self {
            Family::Gemv => "gemv.cu",
            Family::NormRope => "norm_rope.cu",
            Family::Elementwise => "elementwise.cu",
            Family::Attention => "attention.cu",
            Family::Argmax => "argmax.cu",
            Family::Route => "route.cu",
            Family::Moe => "moe.cu",
            Family::GroupedGemm => "grouped_gemm.cu",
            Family::Quant => "quant.cu",
            Family::DeltaNet => "delta_net.cu",
            Family::Gemma => "gemma.cu",
            Family::Mla => "mla.cu",
        }
    }

    /// The file's text (embedded at build time).
    pub fn source(self) -> &'static str {
        match self {
            Family::Gemv => include_str!("../../cuda/gemv.cu"),
            Family::NormRope => include_str!("../../cuda/norm_rope.cu"),
            Family::Elementwise => include_str!("../../cuda/elementwise.cu"),
            Family::Attention => include_str!("../../cuda/attention.cu"),
            Family::Argmax => include_str!("../../cuda/argmax.cu"),
            Family::Route => include_str!("../../cuda/route.cu"),
            Family::Moe => include_str!("../../cuda/moe.cu"),
            Family::GroupedGemm => include_str!("../../cuda/grouped_gemm.cu"),
            Family::Quant => include_str!("../../cuda/quant.cu"),
            Family::DeltaNet => include_str!("../../cuda/delta_net.cu"),
            Family::Gemma => include_str!("../../cuda/gemma.cu"),
            Family::Mla => include_str!("../../cuda/mla.cu"),
        }
    }

    /// The families whose device code this one builds on (compiled before it: [`Family::ALL`]
    /// lists them earlier): quant.cu's grouped GEMM over typed caches uses grouped_gemm.cu's tiles.
    pub fn needs(self) -> &'static [Family] {
        match self {
            Family::Quant => &[Family::GroupedGemm],
            // mla.cu stores rows with norm_rope.cu's kv_store_row and reads them with
            // attention.cu's readers; its partials go through attention_combine_f32.
            Family::Mla => &[Family::NormRope, Family::Attention],
            _ => &[],
        }
    }

    /// This family alone as a program: the shared header, the families it needs, then the file
    /// (to check that each family compiles without the others).
    pub fn standalone_source(self) -> String {
        let mut src = String::from(COMMON_CUH);
        for f in self.needs().iter().chain([&self]) {
            src.push_str(&format!("\n// ---- {} ----\n{}", f.file_name(), f.source()));
        }
        src
    }
}

/// The whole program NVRTC compiles: the shared header, then every family.
pub fn kernel_source() -> String {
    let mut src = String::from(COMMON_CUH);
    for family in Family::ALL {
        src.push_str(&format!("\n// ---- {} ----\n", family.file_name()));
        src.push_str(family.source());
    }
    src
}

/// The names [`shared_defines`] defines (common.cuh refuses to compile without each).
pub const SHARED_DEFINE_NAMES: [&str; 45] = [
    "ROWS_PER_BLOCK",
    "ATT_CHUNK",
    "ATT_MAXC",
    "ATT_MAX_HEAD_DIM",
    "ATT_SPLIT_WARPS",
    "ARGMAX_BLOCK",
    "GG_BM",
    "GG_BN",
    "GG_THREADS",
    "QUANT_MAX_TOKENS",
    "ATT_TILE_ROWS",
    "ATT_TILE_KEYS",
    "ATT_TILE_MAXC",
    "QUANT_WIDE_ROWS",
    "DOWN_ROWS",
    "GEMV_SPLIT",
    "GG_PIPE_BK",
    "GG_STAGES",
    "GG_DEC_BM",
    "GG_DEC_STAGES",
    "ATT_MMA_WARPS",
    "ATT_MMA_KEYS",
    "ATT_MMA_MAXD",
    "TOPK_PER_LANE",
    "ATT_GQA_HEADS",
    "ATT_GQA_MAXD",
    "DELTA_MAX_DK",
    "DELTA_MAX_KERNEL",
    "DELTA_CHUNK",
    "DELTA_SCAN_COLS",
    "ROUTE_SIG_MAXE",
    "ROUTE_SIG_MAXG",
    "ATT_COMBINE_DIMS",
    "MLA_HEADS",
    "MLA_TOKENS",
    "MLA_MAX_RANK",
    "MLA_MAX_ROPE",
    "MLA_MMA_GROUPS",
    "MLA_MMA_KEYS",
    "ATT_MMA_WIDE_KEYS",
    "ATT_MMA_WIDE_MAXD",
    "GQ_BK",
    "KV_RING_CHUNK",
    "GEMV_MMA_WARPS",
    "GEMV_MMA_TOKENS",
];

/// `-D` options for the constants the launchers and the kernels share.
pub fn shared_defines() -> Vec<String> {
    vec![
        format!("-DROWS_PER_BLOCK={ROWS_PER_BLOCK}"),
        format!("-DATT_CHUNK={ATTENTION_SPLIT_CHUNK}"),
        format!("-DATT_MAXC={}", ATTENTION_MAX_HEAD_DIM / 32),
        format!("-DATT_MAX_HEAD_DIM={ATTENTION_MAX_HEAD_DIM}"),
        format!("-DATT_SPLIT_WARPS={ATTENTION_SPLIT_WARPS}"),
        format!("-DARGMAX_BLOCK={ARGMAX_BLOCK}"),
        format!("-DGG_BM={GROUPED_TILE_ROWS}"),
        format!("-DGG_BN={GROUPED_TILE_COLS}"),
        format!("-DGG_THREADS={GROUPED_THREADS}"),
        format!("-DQUANT_MAX_TOKENS={QUANT_MAX_TOKENS}"),
        format!("-DATT_TILE_ROWS={ATTENTION_TILE_ROWS}"),
        format!("-DATT_TILE_KEYS={ATTENTION_TILE_KEYS}"),
        format!("-DATT_TILE_MAXC={}", ATTENTION_TILE_MAX_HEAD_DIM / 32),
        format!("-DQUANT_WIDE_ROWS={QUANT_WIDE_ROWS}"),
        format!("-DDOWN_ROWS={HOT_DOWN_ROWS}"),
        format!("-DGEMV_SPLIT={GEMV_SPLIT_WARPS}"),
        format!("-DGG_PIPE_BK={GROUPED_PIPE_BK}"),
        format!("-DGG_STAGES={GROUPED_PIPE_STAGES}"),
        format!("-DGG_DEC_BM={GROUPED_DECODE_TILE_ROWS}"),
        format!("-DGG_DEC_STAGES={GROUPED_DECODE_STAGES}"),
        format!("-DATT_MMA_WARPS={ATTENTION_MMA_WARPS}"),
        format!("-DATT_MMA_KEYS={ATTENTION_MMA_KEYS}"),
        format!("-DATT_MMA_MAXD={ATTENTION_MMA_MAX_HEAD_DIM}"),
        format!("-DTOPK_PER_LANE={}", ROUTE_MAX_TOPK / 32),
        format!("-DATT_GQA_HEADS={ATTENTION_GQA_HEADS}"),
        format!("-DATT_GQA_MAXD={ATTENTION_GQA_MAX_HEAD_DIM}"),
        format!("-DDELTA_MAX_DK={DELTA_MAX_KEY_DIM}"),
        format!("-DDELTA_MAX_KERNEL={DELTA_MAX_CONV_KERNEL}"),
        format!("-DDELTA_CHUNK={DELTA_CHUNK}"),
        format!("-DDELTA_SCAN_COLS={DELTA_SCAN_COLS}"),
        format!("-DROUTE_SIG_MAXE={ROUTE_SIGMOID_MAX_EXPERTS}"),
        format!("-DROUTE_SIG_MAXG={ROUTE_SIGMOID_MAX_GROUPS}"),
        format!("-DATT_COMBINE_DIMS={ATTENTION_COMBINE_DIMS}"),
        format!("-DMLA_HEADS={MLA_HEADS}"),
        format!("-DMLA_TOKENS={MLA_TOKENS}"),
        format!("-DMLA_MAX_RANK={MLA_MAX_RANK}"),
        format!("-DMLA_MAX_ROPE={MLA_MAX_ROPE}"),
        format!("-DMLA_MMA_GROUPS={MLA_MMA_GROUPS}"),
        format!("-DMLA_MMA_KEYS={MLA_MMA_KEYS}"),
        format!("-DATT_MMA_WIDE_KEYS={ATTENTION_MMA_WIDE_KEYS}"),
        format!("-DATT_MMA_WIDE_MAXD={ATTENTION_MMA_WIDE_MAX_HEAD_DIM}"),
        format!("-DGQ_BK={GROUPED_Q8_BK}"),
        format!("-DKV_RING_CHUNK={}", crate::kv::KV_RING_CHUNK_POSITIONS),
        format!("-DGEMV_MMA_WARPS={GEMV_MMA_WARPS}"),
        format!("-DGEMV_MMA_TOKENS={GEMV_MMA_TOKENS}"),
    ]
}

/// Every kernel entry point, one row each: its id, `extern "C"` symbol and op family. The macro
/// makes the enum (the table index, in row order), [`Kernel::ALL`], [`Kernel::symbol`] and
/// [`Kernel::family`] from the one list, so a new kernel is one row.
macro_rules! kernel_table {
    ($($variant:ident = $symbol:literal in $family:ident,)*) => {
        /// Every kernel entry point, looked up once at start-up into a table indexed by this id.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Kernel {
            $($variant,)*
        }

        impl Kernel {
            /// Every kernel, in declaration order (`k as usize` is its index).
            pub const ALL: [Kernel; [$($symbol),*].len()] = [$(Kernel::$variant),*];

            /// The `extern "C"` symbol.
            pub fn symbol(self) -> &'static str {
                match self {
                    $(Kernel::$variant => $symbol,)*
                }
            }

            /// The op family whose file defines it.
            pub fn family(self) -> Family {
                match self {
                    $(Kernel::$variant => Family::$family,)*
                }
            }
        }
    };
}

kernel_table! {
    GemvBf16 = "gemv_bf16" in Gemv,
    GemvBf16Split = "gemv_bf16_split" in Gemv,
    Gemv3Bf16 = "gemv3_bf16" in Gemv,
    GemvMmaBf16 = "gemv_mma_bf16" in Gemv,
    GemvMmaBf16W16 = "gemv_mma_bf16_w16" in Gemv,
    GemvMmaBf16R32 = "gemv_mma_bf16_r32" in Gemv,
    RmsnormF32 = "rmsnorm_f32" in NormRope,
    AddBiasRows = "add_bias_rows" in Elementwise,
    ClampF32 = "clamp_f32" in Elementwise,
    AddF32 = "add_f32" in Elementwise,
    SiluMulF32 = "silu_mul_f32" in Elementwise,
    RopeF32 = "rope_f32" in NormRope,
    QkNormRopeF32 = "qk_norm_rope_f32" in NormRope,
    AttentionF32 = "attention_f32" in Attention,
    AttentionSplitF32 = "attention_split_f32" in Attention,
    AttentionTiledF32 = "attention_tiled_f32" in Attention,
    AttentionMmaF32 = "attention_mma_f32" in Attention,
    AttentionCombineF32 = "attention_combine_f32" in Attention,
    AttentionF16 = "attention_f16" in Attention,
    AttentionSplitF16 = "attention_split_f16" in Attention,
    AttentionTiledF16 = "attention_tiled_f16" in Attention,
    AttentionMmaF16 = "attention_mma_f16" in Attention,
    KvStoreRows = "kv_store_rows" in NormRope,
    AttentionSplitGqaF32 = "attention_split_gqa_f32" in Attention,
    AttentionSplitGqaF16 = "attention_split_gqa_f16" in Attention,
    AttentionSplitMmaF16 = "attention_split_mma_f16" in Attention,
    AttentionSplitMmaBf16 = "attention_split_mma_bf16" in Attention,
    AttentionSplitMmaRowsF16 = "attention_split_mma_rows_f16" in Attention,
    AttentionSplitMmaRowsBf16 = "attention_split_mma_rows_bf16" in Attention,
    AttentionBf16 = "attention_bf16" in Attention,
    AttentionQ8_0 = "attention_q8_0" in Attention,
    AttentionSplitBf16 = "attention_split_bf16" in Attention,
    AttentionSplitQ8_0 = "attention_split_q8_0" in Attention,
    AttentionTiledBf16 = "attention_tiled_bf16" in Attention,
    AttentionTiledQ8_0 = "attention_tiled_q8_0" in Attention,
    AttentionMmaBf16 = "attention_mma_bf16" in Attention,
    AttentionMmaQ8_0 = "attention_mma_q8_0" in Attention,
    AttentionSplitGqaBf16 = "attention_split_gqa_bf16" in Attention,
    AttentionSplitGqaQ8_0 = "attention_split_gqa_q8_0" in Attention,
    AttentionMmaWideF16 = "attention_mma_wide_f16" in Attention,
    AttentionMmaWideBf16 = "attention_mma_wide_bf16" in Attention,
    AttentionSplitMmaWideF16 = "attention_split_mma_wide_f16" in Attention,
    AttentionSplitMmaWideBf16 = "attention_split_mma_wide_bf16" in Attention,
    AttentionSplitMmaRowsWideF16 = "attention_split_mma_rows_wide_f16" in Attention,
    AttentionSplitMmaRowsWideBf16 = "attention_split_mma_rows_wide_bf16" in Attention,
    ArgmaxF32 = "argmax_f32" in Argmax,
    ArgmaxPartialF32 = "argmax_partial_f32" in Argmax,
    ArgmaxFinalF32 = "argmax_final_f32" in Argmax,
    EmbedBf16 = "embed_bf16" in Elementwise,
    GatherSplitBf16 = "gather_split_bf16" in Elementwise,
    GatherRowsF32 = "gather_rows_f32" in Elementwise,
    ScatterAddRowsF32 = "scatter_add_rows_f32" in Elementwise,
    AddSigmoidScaledRows = "add_sigmoid_scaled_rows" in Elementwise,
    RouteTopk = "route_topk" in Route,
    RouteSigmoid = "route_sigmoid" in Route,
    RouteDecode = "route_decode" in Route,
    MoeGateUpGemv = "moe_gate_up_gemv" in Moe,
    MoeDownAccum = "moe_down_accum" in Moe,
    MoeScatterAccum = "moe_scatter_accum" in Moe,
    HotWorklistTokens = "hot_worklist_tokens" in Moe,
    GroupedGateUpBf16 = "grouped_gate_up_bf16" in GroupedGemm,
    GroupedGemmBf16 = "grouped_gemm_bf16" in GroupedGemm,
    GroupedGateUpBf16Pipe = "grouped_gate_up_bf16_pipe" in GroupedGemm,
    GroupedGemmBf16Pipe = "grouped_gemm_bf16_pipe" in GroupedGemm,
    GroupedGateUpBf16Epi = "grouped_gate_up_bf16_epi" in GroupedGemm,
    GroupedGemmBf16Bias = "grouped_gemm_bf16_bias" in GroupedGemm,
    GroupedGateUpBf16PipeEpi = "grouped_gate_up_bf16_pipe_epi" in GroupedGemm,
    GroupedGemmBf16PipeBias = "grouped_gemm_bf16_pipe_bias" in GroupedGemm,
    GroupedGateUpBf16Dec = "grouped_gate_up_bf16_dec" in GroupedGemm,
    GroupedGateUpBf16DecEpi = "grouped_gate_up_bf16_dec_epi" in GroupedGemm,
    GroupedGemmBf16Dec = "grouped_gemm_bf16_dec" in GroupedGemm,
    GroupedGemmBf16DecBias = "grouped_gemm_bf16_dec_bias" in GroupedGemm,
    GroupedGateUpBf16Rows = "grouped_gate_up_bf16_rows" in GroupedGemm,
    GroupedGateUpBf16RowsEpi = "grouped_gate_up_bf16_rows_epi" in GroupedGemm,
    GroupedGemmBf16Rows = "grouped_gemm_bf16_rows" in GroupedGemm,
    GroupedGemmBf16RowsBias = "grouped_gemm_bf16_rows_bias" in GroupedGemm,
    GemvQ8_0 = "gemv_q8_0" in Quant,
    GemvQ4_0 = "gemv_q4_0" in Quant,
    GemvQ4K = "gemv_q4_k" in Quant,
    GemvQ5K = "gemv_q5_k" in Quant,
    GemvQ6K = "gemv_q6_k" in Quant,
    GemvMxfp4 = "gemv_mxfp4" in Quant,
    GemvQ5_0 = "gemv_q5_0" in Quant,
    GemvQ5_1 = "gemv_q5_1" in Quant,
    GemvIq4Nl = "gemv_iq4_nl" in Quant,
    DequantQ8_0Bf16 = "dequant_q8_0_bf16" in Quant,
    DequantQ4_0Bf16 = "dequant_q4_0_bf16" in Quant,
    DequantQ4KBf16 = "dequant_q4_k_bf16" in Quant,
    DequantQ5KBf16 = "dequant_q5_k_bf16" in Quant,
    DequantQ6KBf16 = "dequant_q6_k_bf16" in Quant,
    DequantMxfp4Bf16 = "dequant_mxfp4_bf16" in Quant,
    DequantQ5_0Bf16 = "dequant_q5_0_bf16" in Quant,
    DequantQ5_1Bf16 = "dequant_q5_1_bf16" in Quant,
    DequantIq4NlBf16 = "dequant_iq4_nl_bf16" in Quant,
    MoeGateUpGemvQ = "moe_gate_up_gemv_q" in Quant,
    MoeDownAccumQ = "moe_down_accum_q" in Quant,
    EmbedQ = "embed_q" in Quant,
    Gemv1Q8_0 = "gemv1_q8_0" in Quant,
    Gemv1Q4_0 = "gemv1_q4_0" in Quant,
    Gemv1Q4K = "gemv1_q4_k" in Quant,
    Gemv1Q5K = "gemv1_q5_k" in Quant,
    Gemv1Q6K = "gemv1_q6_k" in Quant,
    Gemv1Mxfp4 = "gemv1_mxfp4" in Quant,
    Gemv1Q5_0 = "gemv1_q5_0" in Quant,
    Gemv1Q5_1 = "gemv1_q5_1" in Quant,
    Gemv1Iq4Nl = "gemv1_iq4_nl" in Quant,
    Gemv3Typed = "gemv3_typed" in Quant,
    GroupedGateUpQ = "grouped_gate_up_q" in Quant,
    GroupedGemmQ = "grouped_gemm_q" in Quant,
    GroupedGateUpQPipe = "grouped_gate_up_q_pipe" in Quant,
    GroupedGemmQPipe = "grouped_gemm_q_pipe" in Quant,
    GroupedGateUpQ8_0Pipe = "grouped_gate_up_q8_0_pipe" in Quant,
    GroupedGateUpQ4KPipe = "grouped_gate_up_q4_k_pipe" in Quant,
    GroupedGateUpQ5KPipe = "grouped_gate_up_q5_k_pipe" in Quant,
    GroupedGateUpQ6KPipe = "grouped_gate_up_q6_k_pipe" in Quant,
    GroupedGemmQ8_0Pipe = "grouped_gemm_q8_0_pipe" in Quant,
    GroupedGemmQ4KPipe = "grouped_gemm_q4_k_pipe" in Quant,
    GroupedGemmQ5KPipe = "grouped_gemm_q5_k_pipe" in Quant,
    GroupedGemmQ6KPipe = "grouped_gemm_q6_k_pipe" in Quant,
    GroupedGateUpMxfp4Pipe = "grouped_gate_up_mxfp4_pipe" in Quant,
    GroupedGemmMxfp4Pipe = "grouped_gemm_mxfp4_pipe" in Quant,
    GroupedGateUpQDec = "grouped_gate_up_q_dec" in Quant,
    GroupedGemmQDec = "grouped_gemm_q_dec" in Quant,
    GroupedGateUpQ8_0Dec = "grouped_gate_up_q8_0_dec" in Quant,
    GroupedGateUpQ4KDec = "grouped_gate_up_q4_k_dec" in Quant,
    GroupedGateUpQ5KDec = "grouped_gate_up_q5_k_dec" in Quant,
    GroupedGateUpQ6KDec = "grouped_gate_up_q6_k_dec" in Quant,
    GroupedGemmQ8_0Dec = "grouped_gemm_q8_0_dec" in Quant,
    GroupedGemmQ4KDec = "grouped_gemm_q4_k_dec" in Quant,
    GroupedGemmQ5KDec = "grouped_gemm_q5_k_dec" in Quant,
    GroupedGemmQ6KDec = "grouped_gemm_q6_k_dec" in Quant,
    GroupedGateUpMxfp4Dec = "grouped_gate_up_mxfp4_dec" in Quant,
    GroupedGemmMxfp4Dec = "grouped_gemm_mxfp4_dec" in Quant,
    GroupedGateUpMxfp4Q8 = "grouped_gate_up_mxfp4_q8" in Quant,
    GroupedGemmMxfp4Q8 = "grouped_gemm_mxfp4_q8" in Quant,
    QuantizeQ8F32 = "quantize_q8_f32" in Quant,
    Gemv1Q8 = "gemv1_q8" in Quant,
    GemvQ8Tokens = "gemv_q8_tokens" in Quant,
    MoeGateUpGemvQ8 = "moe_gate_up_gemv_q8" in Quant,
    MoeDownAccumQ8 = "moe_down_accum_q8" in Quant,
    Gemv3TypedQ8 = "gemv3_typed_q8" in Quant,
    MulSigmoidF32 = "mul_sigmoid_f32" in Elementwise,
    DeltaConvF32 = "delta_conv_f32" in DeltaNet,
    DeltaRuleF32 = "delta_rule_f32" in DeltaNet,
    DeltaChunkPrepF32 = "delta_chunk_prep_f32" in DeltaNet,
    DeltaChunkScanF32 = "delta_chunk_scan_f32" in DeltaNet,
    DeltaGatedNormF32 = "delta_gated_norm_f32" in DeltaNet,
    DeltaConvGatherF32 = "delta_conv_gather_f32" in DeltaNet,
    DeltaConvRowsF32 = "delta_conv_rows_f32" in DeltaNet,
    DeltaConvAdvanceF32 = "delta_conv_advance_f32" in DeltaNet,
    AttentionSplitRowsF32 = "attention_split_rows_f32" in Attention,
    AttentionSplitRowsF16 = "attention_split_rows_f16" in Attention,
    AttentionSplitRowsBf16 = "attention_split_rows_bf16" in Attention,
    AttentionSplitRowsQ8_0 = "attention_split_rows_q8_0" in Attention,
    AttentionSplitGqaRowsF32 = "attention_split_gqa_rows_f32" in Attention,
    AttentionSplitGqaRowsF16 = "attention_split_gqa_rows_f16" in Attention,
    AttentionSplitGqaRowsBf16 = "attention_split_gqa_rows_bf16" in Attention,
    AttentionSplitGqaRowsQ8_0 = "attention_split_gqa_rows_q8_0" in Attention,
    AttentionCombineRowsF32 = "attention_combine_rows_f32" in Attention,
    QkNormRopeRowsF32 = "qk_norm_rope_rows_f32" in NormRope,
    HotWorklistGrouped = "hot_worklist_grouped" in Moe,
    ScaleF32 = "scale_f32" in Gemma,
    SoftcapF32 = "softcap_f32" in Gemma,
    RouteExpertScaleF32 = "route_expert_scale_f32" in Gemma,
    GluMulF32 = "glu_mul_f32" in Gemma,
    MlaPrepF32 = "mla_prep_f32" in Mla,
    MlaHeadGemvBf16 = "mla_head_gemv_bf16" in Mla,
    MlaAttentionSplitF32 = "mla_attention_split_f32" in Mla,
    MlaAttentionSplitF16 = "mla_attention_split_f16" in Mla,
    MlaAttentionSplitBf16 = "mla_attention_split_bf16" in Mla,
    MlaAttentionSplitQ8_0 = "mla_attention_split_q8_0" in Mla,
    MlaAttentionMmaF16 = "mla_attention_mma_f16" in Mla,
    MlaAttentionMmaBf16 = "mla_attention_mma_bf16" in Mla,
}

impl Kernel {
    // Each attention kernel's instances per KV cache type: f32, f16, bf16, q8_0 (`KvPtr`).
    pub const ATTENTION: [Kernel; 4] =
        [Kernel::AttentionF32, Kernel::AttentionF16, Kernel::AttentionBf16, Kernel::AttentionQ8_0];
    pub const ATTENTION_SPLIT: [Kernel; 4] = [
        Kernel::AttentionSplitF32,
        Kernel::AttentionSplitF16,
        Kernel::AttentionSplitBf16,
        Kernel::AttentionSplitQ8_0,
    ];
    pub const ATTENTION_TILED: [Kernel; 4] = [
        Kernel::AttentionTiledF32,
        Kernel::AttentionTiledF16,
        Kernel::AttentionTiledBf16,
        Kernel::AttentionTiledQ8_0,
    ];
    pub const ATTENTION_MMA: [Kernel; 4] = [
        Kernel::AttentionMmaF32,
        Kernel::AttentionMmaF16,
        Kernel::AttentionMmaBf16,
        Kernel::AttentionMmaQ8_0,
    ];
    pub const ATTENTION_SPLIT_GQA: [Kernel; 4] = [
        Kernel::AttentionSplitGqaF32,
        Kernel::AttentionSplitGqaF16,
        Kernel::AttentionSplitGqaBf16,
        Kernel::AttentionSplitGqaQ8_0,
    ];
    pub const ATTENTION_SPLIT_ROWS: [Kernel; 4] = [
        Kernel::AttentionSplitRowsF32,
        Kernel::AttentionSplitRowsF16,
        Kernel::AttentionSplitRowsBf16,
        Kernel::AttentionSplitRowsQ8_0,
    ];
    pub const ATTENTION_SPLIT_GQA_ROWS: [Kernel; 4] = [
        Kernel::AttentionSplitGqaRowsF32,
        Kernel::AttentionSplitGqaRowsF16,
        Kernel::AttentionSplitGqaRowsBf16,
        Kernel::AttentionSplitGqaRowsQ8_0,
    ];
    /// The wide-head tensor-core kernels (prefill, split decode, batched decode rows; f16 and
    /// bf16 caches each), whose dynamic shared memory may pass the default 48 KiB.
    pub const ATTENTION_MMA_WIDE: [Kernel; 6] = [
        Kernel::AttentionMmaWideF16,
        Kernel::AttentionMmaWideBf16,
        Kernel::AttentionSplitMmaWideF16,
        Kernel::AttentionSplitMmaWideBf16,
        Kernel::AttentionSplitMmaRowsWideF16,
        Kernel::AttentionSplitMmaRowsWideBf16,
    ];
    /// The latent attention's tensor-core split pass over 16-bit caches (f16, bf16), whose
    /// dynamic shared memory passes the default 48 KiB.
    pub const MLA_ATTENTION_MMA: [Kernel; 2] = [Kernel::MlaAttentionMmaF16, Kernel::MlaAttentionMmaBf16];
    /// The latent attention's split pass per KV cache type.
    pub const MLA_ATTENTION_SPLIT: [Kernel; 4] = [
        Kernel::MlaAttentionSplitF32,
        Kernel::MlaAttentionSplitF16,
        Kernel::MlaAttentionSplitBf16,
        Kernel::MlaAttentionSplitQ8_0,
    ];
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shared_define_is_passed_and_required() {
        let defines = shared_defines();
        assert_eq!(defines.len(), SHARED_DEFINE_NAMES.len());
        for (d, name) in defines.iter().zip(SHARED_DEFINE_NAMES) {
            assert!(d.starts_with(&format!("-D{name}=")), "{d} vs {name}");
            assert!(COMMON_CUH.contains(&format!("!defined({name})")), "common.cuh does not require {name}");
        }
    }

    #[test]
    fn every_kernel_is_defined_once_in_its_family_and_ids_index_the_table() {
        for (i, k) in Kernel::ALL.iter().enumerate() {
            assert_eq!(*k as usize, i, "Kernel::ALL is in declaration order");
            assert_eq!(k.family().source().matches(&format!("void {}(", k.symbol())).count(), 1, "{k:?}");
        }
        let all = kernel_source();
        assert_eq!(all.matches("__global__").count(), Kernel::ALL.len(), "no kernel without an id");
    }

    /// Kernels are launched with programmatic stream serialization (they may start before the
    /// kernel before them ends): each must wait for it before its first memory access.
    #[test]
    fn every_kernel_first_waits_for_the_one_before_it() {
        for k in Kernel::ALL {
            let src = k.family().source();
            let at = src.find(&format!("void {}(", k.symbol())).expect("defined");
            let body = &src[at + src[at..].find('{').expect("a body") + 1..];
            let first = body.trim_start().split(';').next().unwrap_or("");
            assert_eq!(
                first,
                "pdl_enter()",
                "{} in {} does not begin with pdl_enter();",
                k.symbol(),
                k.family().file_name()
            );
        }
    }

    #[test]
    fn families_need_only_earlier_ones() {
        for (i, f) in Family::ALL.iter().enumerate() {
            for n in f.needs() {
                assert!(Family::ALL[..i].contains(n), "{f:?} needs {n:?}, compiled after it");
            }
        }
    }

    #[test]
    fn shared_constants_are_defines_not_literals() {
        let files = Family::ALL.iter().map(|f| (f.file_name(), f.source()));
        for (name, text) in files.chain([("common.cuh", COMMON_CUH)]) {
            for c in SHARED_DEFINE_NAMES {
                let own = format!("#define {c}");
                assert!(!text.contains(&own), "{name} defines {c} itself; it comes from shared_defines()");
            }
        }
    }
}
