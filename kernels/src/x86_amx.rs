//! AMX-BF16 tiles for the cold lane's prefill ([`crate::SimdLevel::Amx`]: Sapphire Rapids and
//! later): the gate/up and down projections of BF16 or quantised expert weights for many tokens
//! at once.
//!
//! BF16 weights are the A operand, read in place (a tile is 16 rows x 32 columns of a matrix, rows
//! `row_bytes` apart: nothing is copied or transposed per row), the tokens the B operand: once per
//! call they are split into a BF16 high part and a BF16 rest (`x - hi`, exact in f32, rounded
//! again) and transposed into AMX's pair layout (B row kk holds, for each of 16 tokens, its columns
//! 2kk and 2kk + 1). Both parts are multiplied (`tdpbf16ps` twice): the products are those of x to
//! about 2^-17 relative, like the f32 kernels, not the 2^-9 of one BF16 rounding (the AVX-512 BF16
//! level's); the GPU's prefill GEMMs split the same way. One pass takes four 16-row blocks and one
//! 16-token tile: C tiles tmm0-3, the weights tmm4, the token parts tmm5-6.
//!
//! Quantised weights (every GGML block type the AVX-512 decoders read) are decoded once per group
//! of rows, before the group's token tiles run: each row to f32 by the level's decoder (the same
//! values as the oracle's dequantisation), then split like the tokens into a BF16 high part and a
//! rest (tmm7), so a pass adds `w_hi x_hi + w_hi x_rest + w_rest x_hi`: about 2^-16 relative, where
//! rounding the weights to BF16 once would give 2^-9. The group's decoded rows (both parts) stay
//! under [`DECODED_BUDGET_BYTES`] so its token tiles read them from L2.
//!
//! Which path a row takes depends only on the call's token count, the type and the level
//! ([`usable`]), never on which rows a thread claimed: a 16-row block is always computed whole (a
//! claim's rows outside it are computed and not written), so every schedule gives the same bits.

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;
use std::ops::Range;

use crate::weights::WeightDType;

/// Fewest tokens of one call that take the tiles: below it the AVX-512 tile kernels (f32 FMAs over
/// up to 6 tokens) are already bound by memory, and a 16-token tile would be mostly padding.
pub(crate) const AMX_MIN_TOKENS: usize = 8;
/// Rows of a tile (weight rows of A, pair rows of B, weight rows of C) and its 32-bit columns.
const TILE: usize = 16;
/// BF16 columns of one A tile row (64 bytes): one k step.
const K_STEP: usize = 32;
/// 16-row weight blocks of one pass (C tiles tmm0..tmm3).
const ROW_BLOCKS: usize = 4;
/// 32-bit words of one tile (1 KiB).
const TILE_WORDS: usize = TILE * TILE;
/// Most bytes of decoded quantised rows (both BF16 parts, every matrix of a call) one group holds:
/// half the 2 MiB L2 of a Sapphire Rapids core, so the group's token tiles read them from L2. A
/// group of four 16-row blocks at 2048 columns, gate and up, is exactly this.
const DECODED_BUDGET_BYTES: usize = 1 << 20;

/// Whether a call of `n_tokens` tokens over `dtype` rows of `cols` columns runs on the tiles: BF16
/// rows in place, quantised rows decoded (whole blocks, which the matrix validation guarantees).
pub(crate) fn usable(dtype: WeightDType, n_tokens: usize, cols: usize) -> bool {
    let decodable = dtype.is_quantized() && cols.is_multiple_of(dtype.block_elems());
    (dtype == WeightDType::BF16 || decodable) && n_tokens >= AMX_MIN_TOKENS && cols.is_multiple_of(K_STEP)
}

/// Whether this CPU and OS run AMX-BF16: CPUID leaf 7 (AMX-TILE, AMX-BF16), the OS saving tile
/// state (XCR0 bits 17-18), and Linux granting this process the tile data (`arch_prctl`).
pub(crate) fn detect() -> bool {
    if __cpuid(0).eax < 7 {
        return false;
    }
    let edx = __cpuid_count(7, 0).edx;
    let (amx_bf16, amx_tile) = (edx & (1 << 22) != 0, edx & (1 << 24) != 0);
    let osxsave = __cpuid(1).ecx & (1 << 27) != 0;
    if !(amx_bf16 && amx_tile && osxsave) {
        return false;
    }
    // SAFETY: OSXSAVE is set, so XGETBV is enabled.
    let xcr0 = unsafe { xcr0() };
    if xcr0 & (0b11 << 17) != 0b11 << 17 {
        return false;
    }
    request_tile_data()
}

/// XCR0 (XGETBV with ECX = 0).
///
/// # Safety
/// CPUID.1:ECX.OSXSAVE must be set.
unsafe fn xcr0() -> u64 {
    let (lo, hi): (u32, u32);
    // SAFETY: the caller checked OSXSAVE; XGETBV reads a register, touches no memory.
    unsafe { asm!("xgetbv", in("ecx") 0u32, out("eax") lo, out("edx") hi, options(nomem, nostack)) };
    (u64::from(hi) << 32) | u64::from(lo)
}

#[cfg(target_os = "linux")]
fn request_tile_data() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with these arguments only changes this process's permission to use the
    // AMX tile state; it reads and writes no memory of ours.
    unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
}

#[cfg(not(target_os = "linux"))]
fn request_tile_data() -> bool {
    false
}

/// The tile palette: tiles 0..7 all 16 rows of 64 bytes (A: 16 weight rows x 32 BF16, B: 16 pair
/// rows x 16 tokens, C: 16 weight rows x 16 tokens of f32).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

const CONFIG: TileConfig = TileConfig {
    palette: 1,
    start_row: 0,
    reserved: [0; 14],
    colsb: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
    rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
};

/// Per-thread buffers: the call's tokens as B tiles (high and rest parts), per matrix the group's
/// decoded rows or a zero-padded copy of its last partial row block, one decoded f32 row, and the
/// C tiles of one pass.
#[derive(Default)]
struct Scratch {
    b: Vec<u32>,
    decoded: [Vec<u16>; MAX_MATS],
    row_f32: Vec<f32>,
    c: Vec<f32>,
}

/// Most matrices of one call (gate and up).
const MAX_MATS: usize = 2;

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Token tiles `tiles` of tokens `t < n_tokens` (`k` f32 each at `token_ptr(t)`) as B tiles in
/// `b`: token tile `tt`, k step `s`, part `p` (0 high, 1 rest) at `((tt * steps + s) * 2 + p) *
/// 256`, entry `kk * 16 + j` = token `16 tt + j`'s columns `32 s + 2kk` and `+ 1` as two BF16;
/// padding tokens are zero. Only the words of `tiles` are written.
///
/// # Safety
/// The CPU has AVX-512F and AVX-512 BF16; `token_ptr(t)` addresses `k` f32 for every
/// `t < n_tokens`; `k % 32 == 0`; `tiles.end <= n_tokens.div_ceil(16)`; `b` addresses
/// [`packed_words`] words, of which nobody else touches those of `tiles` meanwhile.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn pack_tokens(
    n_tokens: usize,
    k: usize,
    token_ptr: &impl Fn(usize) -> *const f32,
    tiles: Range<usize>,
    b: *mut u32,
) {
    let steps = k / K_STEP;
    debug_assert!(tiles.end <= n_tokens.div_ceil(TILE));
    for tt in tiles {
        for s in 0..steps {
            let (mut hi, mut lo) = ([_mm512_setzero_si512(); TILE], [_mm512_setzero_si512(); TILE]);
            for j in 0..TILE.min(n_tokens - tt * TILE) {
                // SAFETY: token 16 tt + j exists; columns 32 s .. 32 s + 32 are inside its row.
                let x = unsafe { token_ptr(tt * TILE + j).add(s * K_STEP) };
                // SAFETY: as above.
                (hi[j], lo[j]) = unsafe { split32(x) };
            }
            let at = (tt * steps + s) * 2 * TILE_WORDS;
            for (p, part) in [transpose16(hi), transpose16(lo)].iter().enumerate() {
                for (kk, v) in part.iter().enumerate() {
                    // SAFETY: the tile at `at + p * 256` lies inside `b`'s words of `tiles`.
                    unsafe { _mm512_storeu_si512(b.add(at + p * TILE_WORDS + kk * TILE) as *mut _, *v) };
                }
            }
        }
    }
}

/// The 32 f32 at `x` as BF16, in order: their high parts and the rests `x - hi`, each rounded to
/// nearest even.
///
/// # Safety
/// The CPU has AVX-512F and AVX-512 BF16; `x` addresses 32 f32.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn split32(x: *const f32) -> (__m512i, __m512i) {
    // SAFETY: x addresses 32 f32 (caller).
    let (x0, x1) = unsafe { (_mm512_loadu_ps(x), _mm512_loadu_ps(x.add(16))) };
    let h = _mm512_cvtne2ps_pbh(x1, x0);
    let (h0, h1) = widen_bf16(h);
    let l = _mm512_cvtne2ps_pbh(_mm512_sub_ps(x1, h1), _mm512_sub_ps(x0, h0));
    // SAFETY of the transmutes: __m512bh and __m512i are the same 64 bytes.
    unsafe { (std::mem::transmute::<__m512bh, __m512i>(h), std::mem::transmute::<__m512bh, __m512i>(l)) }
}

/// `n` f32 at `x` split by [`split32`] into BF16 high parts at `hi` and rests at `lo`.
///
/// # Safety
/// The CPU has AVX-512F and AVX-512 BF16; `n % 32 == 0`; `x` addresses `n` f32, `hi` and `lo`
/// room for `n` BF16 each.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn split_row(x: *const f32, n: usize, hi: *mut u16, lo: *mut u16) {
    for i in (0..n).step_by(K_STEP) {
        // SAFETY: values i..i + 32 lie inside all three rows (caller).
        unsafe {
            let (h, l) = split32(x.add(i));
            _mm512_storeu_si512(hi.add(i) as *mut _, h);
            _mm512_storeu_si512(lo.add(i) as *mut _, l);
        }
    }
}

/// The 32 BF16 values of `v` as f32: the low 16 and the high 16.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
fn widen_bf16(v: __m512bh) -> (__m512, __m512) {
    // SAFETY of the transmute: __m512bh and __m512i are the same 64 bytes.
    let bits: __m512i = unsafe { std::mem::transmute::<__m512bh, __m512i>(v) };
    let lo16 = _mm512_castsi512_si256(bits);
    let hi16 = _mm512_extracti64x4_epi64::<1>(bits);
    let widen = |h: __m256i| _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)));
    (widen(lo16), widen(hi16))
}

/// Transpose of a 16 x 16 matrix of 32-bit words (row i in `r[i]`): 32-bit then 64-bit
/// interleaves within 128-bit lanes, then lane shuffles.
#[inline]
#[target_feature(enable = "avx512f")]
fn transpose16(r: [__m512i; 16]) -> [__m512i; 16] {
    let mut t = [_mm512_setzero_si512(); 16];
    for p in 0..8 {
        t[2 * p] = _mm512_unpacklo_epi32(r[2 * p], r[2 * p + 1]);
        t[2 * p + 1] = _mm512_unpackhi_epi32(r[2 * p], r[2 * p + 1]);
    }
    // u[4g + j]: rows 4g..4g+4 of column 4L + j in lane L.
    let mut u = [_mm512_setzero_si512(); 16];
    for g in 0..4 {
        let (a, b, c, d) = (t[4 * g], t[4 * g + 1], t[4 * g + 2], t[4 * g + 3]);
        u[4 * g] = _mm512_unpacklo_epi64(a, c);
        u[4 * g + 1] = _mm512_unpackhi_epi64(a, c);
        u[4 * g + 2] = _mm512_unpacklo_epi64(b, d);
        u[4 * g + 3] = _mm512_unpackhi_epi64(b, d);
    }
    let mut out = [_mm512_setzero_si512(); 16];
    for j in 0..4 {
        let v01 = _mm512_shuffle_i32x4::<0b01_00_01_00>(u[j], u[4 + j]);
        let w01 = _mm512_shuffle_i32x4::<0b01_00_01_00>(u[8 + j], u[12 + j]);
        let v23 = _mm512_shuffle_i32x4::<0b11_10_11_10>(u[j], u[4 + j]);
        let w23 = _mm512_shuffle_i32x4::<0b11_10_11_10>(u[8 + j], u[12 + j]);
        out[j] = _mm512_shuffle_i32x4::<0b10_00_10_00>(v01, w01);
        out[4 + j] = _mm512_shuffle_i32x4::<0b11_01_11_01>(v01, w01);
        out[8 + j] = _mm512_shuffle_i32x4::<0b10_00_10_00>(v23, w23);
        out[12 + j] = _mm512_shuffle_i32x4::<0b11_01_11_01>(v23, w23);
    }
    out
}

/// One tile instruction on C tile register `$t` (0..3), the rest of the text as given.
macro_rules! on_c_tile {
    ($t:expr, $fmt:literal, $($args:tt)*) => {
        match $t {
            0 => asm!(concat!($fmt, "tmm0"), $($args)*),
            1 => asm!(concat!($fmt, "tmm1"), $($args)*),
            2 => asm!(concat!($fmt, "tmm2"), $($args)*),
            _ => asm!(concat!($fmt, "tmm3"), $($args)*),
        }
    };
}

/// 16 weight rows starting at `p`, `stride` bytes apart: the A operand of one pass block; `lo`,
/// when not null, the rests of decoded rows (same stride), multiplied by the tokens' high parts.
#[derive(Clone, Copy)]
struct BlockRows {
    p: *const u8,
    lo: *const u8,
    stride: usize,
}

/// C tiles `0..blocks.len()` = weight blocks `blocks` (A, k steps of 64 bytes) times token tile
/// `tt`'s B tiles in `b`, stored to `c` (tile i at `c[i * 256..]`: 16 rows x 16 tokens); a block
/// with rests adds them times the tokens' high parts.
///
/// # Safety
/// The tile palette [`CONFIG`] is loaded on this thread; every block has 16 rows of `steps * 64`
/// readable bytes (its rests too, where given); `b` holds token tile `tt`'s `2 * steps` tiles; `c`
/// holds `blocks.len() * 256` f32; `blocks.len() <= 4`.
unsafe fn pass(blocks: &[BlockRows], b: &[u32], tt: usize, steps: usize, c: &mut [f32]) {
    for i in 0..blocks.len() {
        // SAFETY: tile register i < 4 is a C tile of the loaded palette.
        unsafe { on_c_tile!(i, "tilezero ", options(nostack, nomem)) };
    }
    for s in 0..steps {
        let bt = b[(tt * steps + s) * 2 * TILE_WORDS..].as_ptr();
        // SAFETY: the high and rest tiles of step s are inside `b`: 16 rows of 64 bytes each.
        unsafe {
            asm!("tileloadd tmm5, [{p} + {st}*1]", "tileloadd tmm6, [{q} + {st}*1]", p = in(reg) bt,
                q = in(reg) bt.add(TILE_WORDS), st = in(reg) 64usize, options(nostack, readonly))
        };
        for (i, blk) in blocks.iter().enumerate() {
            // SAFETY: the block's 16 rows (and rests) have step s's 64 bytes (caller).
            unsafe {
                asm!("tileloadd tmm4, [{p} + {st}*1]", p = in(reg) blk.p.add(s * 64), st = in(reg) blk.stride,
                    options(nostack, readonly));
                match i {
                    0 => asm!(
                        "tdpbf16ps tmm0, tmm4, tmm5",
                        "tdpbf16ps tmm0, tmm4, tmm6",
                        options(nostack, nomem)
                    ),
                    1 => asm!(
                        "tdpbf16ps tmm1, tmm4, tmm5",
                        "tdpbf16ps tmm1, tmm4, tmm6",
                        options(nostack, nomem)
                    ),
                    2 => asm!(
                        "tdpbf16ps tmm2, tmm4, tmm5",
                        "tdpbf16ps tmm2, tmm4, tmm6",
                        options(nostack, nomem)
                    ),
                    _ => asm!(
                        "tdpbf16ps tmm3, tmm4, tmm5",
                        "tdpbf16ps tmm3, tmm4, tmm6",
                        options(nostack, nomem)
                    ),
                }
                if !blk.lo.is_null() {
                    asm!("tileloadd tmm7, [{p} + {st}*1]", p = in(reg) blk.lo.add(s * 64), st = in(reg) blk.stride,
                        options(nostack, readonly));
                    match i {
                        0 => asm!("tdpbf16ps tmm0, tmm7, tmm5", options(nostack, nomem)),
                        1 => asm!("tdpbf16ps tmm1, tmm7, tmm5", options(nostack, nomem)),
                        2 => asm!("tdpbf16ps tmm2, tmm7, tmm5", options(nostack, nomem)),
                        _ => asm!("tdpbf16ps tmm3, tmm7, tmm5", options(nostack, nomem)),
                    }
                }
            }
        }
    }
    for i in 0..blocks.len() {
        let p = c[i * TILE_WORDS..].as_mut_ptr();
        // SAFETY: c holds 256 f32 from p: 16 rows of 64 bytes.
        unsafe {
            on_c_tile!(i, "tilestored [{p} + {st}*1], ", p = in(reg) p, st = in(reg) 64usize, options(nostack))
        };
    }
}

/// A matrix of BF16 or quantised rows for [`rows_times_tokens`].
#[derive(Clone, Copy)]
pub(crate) struct Rows {
    pub base: *const u8,
    pub row_bytes: usize,
    pub n_rows: usize,
    pub dtype: WeightDType,
}

/// Words of `n_tokens` tokens of `k` columns packed as B tiles ([`pack`]).
pub(crate) fn packed_words(n_tokens: usize, k: usize) -> usize {
    n_tokens.div_ceil(TILE) * (k / K_STEP) * 2 * TILE_WORDS
}

/// Packs tokens `t < n_tokens` (`k` f32 each at `token_ptr(t)`) as B tiles into `out`
/// ([`packed_words`] words), for [`rows_times_packed`]: done once for tokens that several calls
/// multiply (the pool packs an expert's `h` once for all its down row ranges).
///
/// # Safety
/// The CPU has AVX-512F and AVX-512 BF16 ([`crate::SimdLevel::Amx`] detected); `k % 32 == 0`;
/// `token_ptr(t)` addresses `k` f32 for `t < n_tokens`.
pub(crate) unsafe fn pack(
    n_tokens: usize,
    k: usize,
    token_ptr: impl Fn(usize) -> *const f32,
    out: &mut [u32],
) {
    assert!(out.len() >= packed_words(n_tokens, k), "packed tokens buffer");
    // SAFETY: forwarded contract; the buffer size is checked above and this thread owns it.
    unsafe { pack_tiles(n_tokens, k, token_ptr, 0..token_tiles(n_tokens), out.as_mut_ptr()) };
}

/// Token tiles (of 16 tokens) of a whole call.
pub(crate) fn token_tiles(n_tokens: usize) -> usize {
    n_tokens.div_ceil(TILE)
}

/// [`pack`] of token tiles `tiles` alone into the [`packed_words`] words at `out`: threads that
/// pack disjoint tile ranges of one call fill one buffer together.
///
/// # Safety
/// As [`pack`]; `out` addresses [`packed_words`] words, `tiles.end <=` [`token_tiles`], and no
/// other thread touches the words of `tiles` meanwhile.
pub(crate) unsafe fn pack_tiles(
    n_tokens: usize,
    k: usize,
    token_ptr: impl Fn(usize) -> *const f32,
    tiles: Range<usize>,
    out: *mut u32,
) {
    assert!(tiles.end <= token_tiles(n_tokens) && k.is_multiple_of(K_STEP), "packed token tiles");
    // SAFETY: forwarded contract.
    unsafe { pack_tokens(n_tokens, k, &token_ptr, tiles, out) };
}

/// For every row of `rows` (of each of the `M` matrices, same shape) and token tile `tt`:
/// `sink(row, tokens, [[row of matrix m · x_t for the tile's 16 tokens]; M])`, `tokens` the tile's
/// real tokens (lanes past them hold padding). The tokens are `token_ptr(t)`, `k` f32 each.
///
/// # Safety
/// The CPU has AMX-BF16, AVX-512F and AVX-512 BF16 ([`crate::SimdLevel::Amx`] detected);
/// [`usable`] holds for the call; every matrix has `n_rows` rows of at least `k` BF16 and
/// `rows.end <= n_rows`; `token_ptr(t)` addresses `k` f32 for `t < n_tokens`.
pub(crate) unsafe fn rows_times_tokens<const M: usize>(
    mats: [Rows; M],
    rows: Range<usize>,
    k: usize,
    n_tokens: usize,
    token_ptr: impl Fn(usize) -> *const f32,
    sink: impl FnMut(usize, Range<usize>, [&[f32; TILE]; M]),
) {
    let mut b = SCRATCH.with_borrow_mut(|s| std::mem::take(&mut s.b));
    b.resize(packed_words(n_tokens, k), 0);
    // SAFETY: the level has AVX-512 BF16; token rows and the buffer size as required.
    unsafe { pack_tokens(n_tokens, k, &token_ptr, 0..n_tokens.div_ceil(TILE), b.as_mut_ptr()) };
    // SAFETY: forwarded contract; b holds the packed tokens.
    unsafe { rows_times_packed(mats, rows, k, n_tokens, &b, sink) };
    SCRATCH.with_borrow_mut(|s| s.b = b);
}

/// [`rows_times_tokens`] over tokens already packed by [`pack`].
///
/// # Safety
/// As [`rows_times_tokens`], with `b` the [`pack`] of the `n_tokens` tokens (of `k` columns).
pub(crate) unsafe fn rows_times_packed<const M: usize>(
    mats: [Rows; M],
    rows: Range<usize>,
    k: usize,
    n_tokens: usize,
    b: &[u32],
    mut sink: impl FnMut(usize, Range<usize>, [&[f32; TILE]; M]),
) {
    assert!(b.len() >= packed_words(n_tokens, k), "packed tokens");
    assert!(M <= MAX_MATS && mats.iter().all(|m| m.dtype == mats[0].dtype), "matrices of one call");
    SCRATCH.with_borrow_mut(|s| {
        let (steps, n_tt) = (k / K_STEP, n_tokens.div_ceil(TILE));
        let group_rows = group_blocks(mats[0].dtype, M, k) * TILE;
        s.c.resize(M * ROW_BLOCKS * TILE_WORDS, 0.0);
        // SAFETY: the CPU has AMX (caller); the config is a valid palette-1 layout.
        unsafe { asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly)) };
        let mut group = rows.start / TILE * TILE;
        while group < rows.end {
            let group_end = (group + group_rows).min(rows.end.next_multiple_of(TILE));
            let n_blocks = (group_end - group) / TILE;
            let (decoded, row_f32) = (&mut s.decoded, &mut s.row_f32);
            let mut blocks =
                [[BlockRows { p: std::ptr::null(), lo: std::ptr::null(), stride: 0 }; ROW_BLOCKS]; M];
            for (m, (mat, out)) in mats.iter().zip(decoded.iter_mut()).enumerate() {
                // SAFETY: forwarded contract (the matrix's rows, the CPU's features).
                blocks[m] = unsafe { block_rows(mat, group..group_end, k, out, row_f32) };
            }
            for tt in 0..n_tt {
                for (m, blocks) in blocks.iter().enumerate() {
                    let c = &mut s.c[m * ROW_BLOCKS * TILE_WORDS..(m + 1) * ROW_BLOCKS * TILE_WORDS];
                    // SAFETY: the palette is loaded; the blocks hold 16 rows of k BF16 (whole
                    // rows of the matrix, the padded tail or the decoded group, whose buffers are
                    // not touched again before the group ends); b holds every token tile.
                    unsafe { pass(&blocks[..n_blocks], b, tt, steps, c) };
                }
                let live = group.max(rows.start)..group_end.min(rows.end);
                let tokens = tt * TILE..(tt * TILE + TILE).min(n_tokens);
                for row in live {
                    let at = (row - group) / TILE * TILE_WORDS + (row - group) % TILE * TILE;
                    let lanes = |m: usize| -> &[f32; TILE] {
                        let o = m * ROW_BLOCKS * TILE_WORDS + at;
                        s.c[o..o + TILE].try_into().expect("16 lanes")
                    };
                    sink(row, tokens.clone(), std::array::from_fn(lanes));
                }
            }
            group = group_end;
        }
        // SAFETY: releases this thread's tile state (no tile is live after this point).
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    });
}

/// 16-row blocks of one group: [`ROW_BLOCKS`] for BF16 rows read in place, fewer for quantised
/// rows where `n_mats` matrices' decoded groups (two BF16 parts) would pass [`DECODED_BUDGET_BYTES`].
fn group_blocks(dtype: WeightDType, n_mats: usize, k: usize) -> usize {
    if dtype == WeightDType::BF16 {
        return ROW_BLOCKS;
    }
    (DECODED_BUDGET_BYTES / (n_mats * TILE * k * 2 * std::mem::size_of::<u16>())).clamp(1, ROW_BLOCKS)
}

/// The 16-row blocks of `group` (at most four, 16-aligned) of `mat`. BF16 rows in place, except a
/// last block that runs past the matrix, copied zero-padded into `out`; quantised rows decoded
/// into `out` (high parts of every row of the group, then their rests; rows past the matrix zero).
///
/// # Safety
/// The CPU has AVX-512F and AVX-512 BF16; every row of `mat` holds `k` values of its type (whole
/// blocks), and `k % 32 == 0`.
unsafe fn block_rows(
    mat: &Rows,
    group: Range<usize>,
    k: usize,
    out: &mut Vec<u16>,
    row_f32: &mut Vec<f32>,
) -> [BlockRows; ROW_BLOCKS] {
    let null = std::ptr::null();
    let mut blocks = [BlockRows { p: mat.base, lo: null, stride: mat.row_bytes }; ROW_BLOCKS];
    let n_blocks = (group.end - group.start) / TILE;
    if mat.dtype != WeightDType::BF16 {
        // SAFETY: forwarded contract.
        unsafe { decode_group(mat, group.clone(), k, out, row_f32) };
        let lo_at = n_blocks * TILE * k;
        for (i, b) in blocks.iter_mut().enumerate().take(n_blocks) {
            let at = i * TILE * k;
            let (p, lo) = (out[at..].as_ptr() as *const u8, out[lo_at + at..].as_ptr() as *const u8);
            *b = BlockRows { p, lo, stride: k * 2 };
        }
        return blocks;
    }
    for (i, b) in blocks.iter_mut().enumerate().take(n_blocks) {
        let row0 = group.start + i * TILE;
        if row0 + TILE <= mat.n_rows {
            // SAFETY (pointer arithmetic only): row0 < n_rows, inside the matrix.
            b.p = unsafe { mat.base.add(row0 * mat.row_bytes) };
        } else {
            out.clear();
            out.resize(TILE * k, 0);
            for r in row0..mat.n_rows {
                // SAFETY: row r < n_rows holds k BF16 (the caller's contract for the matrix).
                let src = unsafe { std::slice::from_raw_parts(mat.base.add(r * mat.row_bytes), k * 2) };
                for (j, v) in out[(r - row0) * k..(r - row0 + 1) * k].iter_mut().enumerate() {
                    *v = u16::from_le_bytes([src[2 * j], src[2 * j + 1]]);
                }
            }
            *b = BlockRows { p: out.as_ptr() as *const u8, lo: null, stride: k * 2 };
        }
    }
    blocks
}

/// Rows `group` of quantised `mat` decoded into `out` (grown when short, never cleared: every
/// word of the group is written): row `r`'s high parts at `(r - start) * k`, its rests
/// `group.len() * k` further; rows past the matrix zero.
///
/// # Safety
/// As [`block_rows`].
unsafe fn decode_group(
    mat: &Rows,
    group: Range<usize>,
    k: usize,
    out: &mut Vec<u16>,
    row_f32: &mut Vec<f32>,
) {
    let n = group.end - group.start;
    if out.len() < 2 * n * k {
        out.resize(2 * n * k, 0);
    }
    row_f32.resize(k, 0.0);
    let n_blocks = k / mat.dtype.block_elems();
    let real = group.start..group.end.min(mat.n_rows).max(group.start);
    // rows past the matrix (a last partial tile) are zero in both parts
    for r in real.end..group.end {
        let at = (r - group.start) * k;
        out[at..at + k].fill(0);
        out[n * k + at..n * k + at + k].fill(0);
    }
    for r in real {
        let at = (r - group.start) * k;
        // SAFETY: row r < n_rows holds k values of the type in whole blocks (caller); the level
        // Amx has the AVX-512 decoders; row_f32 holds k f32; out holds both parts of n rows.
        unsafe {
            crate::ffn::dequantize_rows(
                crate::SimdLevel::Amx,
                mat.dtype,
                mat.base.add(r * mat.row_bytes),
                n_blocks,
                row_f32.as_mut_ptr(),
            );
            split_row(row_f32.as_ptr(), k, out.as_mut_ptr().add(at), out.as_mut_ptr().add(n * k + at));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decoded_groups_hold_each_rows_value_as_high_part_and_rest() {
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16")) {
            return;
        }
        let (rows, k) = (20usize, 512usize);
        // random blocks with small f16 scales at each type's scale offsets
        for (dtype, scales) in
            [(WeightDType::Q4_K, &[0, 2][..]), (WeightDType::Q6_K, &[208]), (WeightDType::Q8_0, &[0])]
        {
            let mut bytes = crate::test_random_bytes(rows * dtype.row_bytes(k));
            for (i, block) in bytes.chunks_exact_mut(dtype.block_bytes()).enumerate() {
                for &at in scales {
                    let d = half::f16::from_f32(0.001 + (i % 7) as f32 * 3e-4).to_bits().to_le_bytes();
                    block[at..at + 2].copy_from_slice(&d);
                }
            }
            let mut plain = vec![0.0f32; rows * k];
            dtype.decode_row(&bytes, &mut plain);
            let mat = Rows { base: bytes.as_ptr(), row_bytes: dtype.row_bytes(k), n_rows: rows, dtype };
            let (mut out, mut row_f32) = (Vec::new(), Vec::new());
            // SAFETY: features checked; the matrix holds `rows` rows of k values in whole blocks.
            unsafe { decode_group(&mat, 16..32, k, &mut out, &mut row_f32) };
            let f = |bits: u16| f32::from_bits(u32::from(bits) << 16);
            for r in 16..32 {
                for c in 0..k {
                    let at = (r - 16) * k + c;
                    let (h, l) = (f(out[at]), f(out[16 * k + at]));
                    if r >= rows {
                        assert_eq!((h, l), (0.0, 0.0), "{dtype:?} padding row {r}");
                        continue;
                    }
                    let v = plain[r * k + c];
                    assert_eq!(h, half::bf16::from_f32(v).to_f32(), "{dtype:?} high part of {r},{c}");
                    assert!(((h + l) - v).abs() <= v.abs() * 2f32.powi(-16), "{dtype:?} rest of {r},{c}");
                }
            }
        }
    }

    #[test]
    fn packed_tokens_hold_each_tokens_column_pairs_split_in_two_parts() {
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16")) {
            return;
        }
        let (n, k) = (19usize, 64usize);
        let x: Vec<f32> = (0..n * k).map(|i| ((i as f32) * 0.37).sin() * 3.0 + 1e-3).collect();
        let steps = k / K_STEP;
        let mut b = vec![7u32; n.div_ceil(TILE) * steps * 2 * TILE_WORDS];
        // SAFETY: features checked; token rows of k f32; b sized as pack_tokens needs.
        unsafe { pack_tokens(n, k, &|t| x[t * k..].as_ptr(), 0..n.div_ceil(TILE), b.as_mut_ptr()) };
        let f = |bits: u32| f32::from_bits(bits << 16);
        for tt in 0..n.div_ceil(TILE) {
            for s in 0..steps {
                for kk in 0..TILE {
                    for j in 0..TILE {
                        let at = (tt * steps + s) * 2 * TILE_WORDS + kk * TILE + j;
                        let (hi, lo) = (b[at], b[at + TILE_WORDS]);
                        let t = tt * TILE + j;
                        for half in 0..2 {
                            let (h, l) = (f((hi >> (16 * half)) & 0xffff), f((lo >> (16 * half)) & 0xffff));
                            if t >= n {
                                assert_eq!((h, l), (0.0, 0.0), "padding token {t}");
                                continue;
                            }
                            let v = x[t * k + s * K_STEP + 2 * kk + half];
                            assert_eq!(
                                h,
                                half::bf16::from_f32(v).to_f32(),
                                "hi of token {t} step {s} pair {kk}"
                            );
                            assert!(((h + l) - v).abs() <= v.abs() * 2f32.powi(-16), "hi + lo of token {t}");
                        }
                    }
                }
            }
        }
    }
}
