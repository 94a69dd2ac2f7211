// The hot lane in prefill: grouped expert GEMMs over every cached expert of a layer in one launch,
// on tensor cores (mma.sync m16n8k16, bf16 inputs, f32 accumulation; sm_80 and later).
// Part of the moe-lanes kernels: compiled together with common.cuh prepended (kernels/src/cuda/kernel.rs).
//
// Rows are the layer's hot entries in expert-major order (rows of one cache slot are contiguous).
// The host cuts them into tiles of at most GG_BM rows of one slot: tiles[3*i..3*i+3] =
// (slot, first row, row count) (kernels/src/cuda/ops.rs, grouped_tiles). A block computes one tile
// against GG_BN output columns: Y[rows, cols] = X[rows, :] . W_slot[cols, :]^T with W_slot the
// slot's bf16 [N, K] row-major matrix of the per-layer cache [n_slots, N, K].
// X is f32; each element is rounded to bf16 hi (+ the remainder lo = bf16(x - hi) when `split`),
// and both parts go through the tensor cores into the same f32 accumulator (hi.W + lo.W carries
// ~16 mantissa bits of x, as the cuBLAS path's two GEMMs do).
// A tile outside (n_slots, n_rows) or with more than GG_BM rows is skipped, never read past.
// grid (n_tiles, ceil(N / GG_BN)), block GG_THREADS (4 warps, 2 x 2 over the 64 x 64 tile).

#define GG_BK 64
#define GG_LD (GG_BK + 8)  // smem row stride in bf16: 144 bytes, fragment loads hit distinct banks

#if GG_BM != 64 || GG_BN != 64 || GG_THREADS != 128
#error "grouped_gemm.cu is written for 64 x 64 tiles and 128 threads"
#endif

// The A fragment of m16n8k16 (rows rb..rb+15, columns ks..ks+15 of a [GG_BM][GG_LD] tile):
// a[0] (row g, k 2t), a[1] (row g + 8), a[2] (k 2t + 8), a[3] (both), g = lane / 4, t = lane % 4.
// One ldmatrix.x4 (lane i names row rb + i % 16, column ks + 8 (i / 16)); rows are 144 bytes,
// 16-byte aligned, and the 8-element pad puts a matrix's rows in distinct banks.
__device__ __forceinline__ void gg_frag_a(unsigned* a, const bf16 (*s)[GG_LD], int rb, int ks) {
    int lane = threadIdx.x & 31;
#if __CUDA_ARCH__ >= 750
    unsigned addr = (unsigned)__cvta_generic_to_shared(&s[rb + (lane & 15)][ks + 8 * (lane >> 4)]);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
                 : "r"(addr));
#else
    int g = lane >> 2, t = lane & 3;
    a[0] = *(const unsigned*)&s[rb + g][ks + t * 2];
    a[1] = *(const unsigned*)&s[rb + g + 8][ks + t * 2];
    a[2] = *(const unsigned*)&s[rb + g][ks + t * 2 + 8];
    a[3] = *(const unsigned*)&s[rb + g + 8][ks + t * 2 + 8];
#endif
}

// The B fragments of two column groups cb..cb+7 and cb+8..cb+15 (W rows of a [GG_BN][GG_LD]
// tile, columns ks..ks+15): b[0], b[1] of the first (k 2t and 2t + 8 of row cb + g), b[2], b[3]
// of the second. One ldmatrix.x4 (lane i names row cb + i % 8 + 8 (i / 16), column ks + 8 (i / 8 % 2)).
__device__ __forceinline__ void gg_frag_b(unsigned* b, const bf16 (*s)[GG_LD], int cb, int ks) {
    int lane = threadIdx.x & 31;
#if __CUDA_ARCH__ >= 750
    unsigned addr = (unsigned)__cvta_generic_to_shared(&s[cb + (lane & 7) + 8 * (lane >> 4)][ks + 8 * ((lane >> 3) & 1)]);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
                 : "r"(addr));
#else
    int g = lane >> 2, t = lane & 3;
    for (int h = 0; h < 2; h++) {
        b[2 * h] = *(const unsigned*)&s[cb + 8 * h + g][ks + t * 2];
        b[2 * h + 1] = *(const unsigned*)&s[cb + 8 * h + g][ks + t * 2 + 8];
    }
#endif
}

// Load the X tile (rows of the tile, columns k0..k0+GG_BK) into hi (and lo) bf16 shared memory.
// Rows past the tile, a source row out of range and columns past K are zero.
__device__ __forceinline__ void gg_load_x(bf16 (*sx)[GG_BM][GG_LD], const float* __restrict__ x,
                                          const int* __restrict__ rows, int n_x_rows, int row0, int nr, int K,
                                          int k0, int split) {
    bool vec = (K & 3) == 0 && (((size_t)x) & 15) == 0;
    for (int c = threadIdx.x; c < GG_BM * (GG_BK / 4); c += GG_THREADS) {
        int r = c / (GG_BK / 4), kq = (c % (GG_BK / 4)) * 4;
        float v[4] = {0.f, 0.f, 0.f, 0.f};
        if (r < nr) {
            int src = rows ? rows[row0 + r] : row0 + r;
            if (src >= 0 && src < n_x_rows) {
                const float* p = x + (size_t)src * K + k0 + kq;
                if (vec && k0 + kq < K) {
                    float4 f = *(const float4*)p;
                    v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
                } else if (!vec) {
                    for (int j = 0; j < 4; j++)
                        if (k0 + kq + j < K) v[j] = p[j];
                }
            }
        }
        __nv_bfloat162 hi[2], lo[2];
#pragma unroll
        for (int j = 0; j < 2; j++) {
            hi[j] = __floats2bfloat162_rn(v[2 * j], v[2 * j + 1]);
            lo[j] = __floats2bfloat162_rn(v[2 * j] - __low2float(hi[j]), v[2 * j + 1] - __high2float(hi[j]));
        }
        *(uint2*)&sx[0][r][kq] = *(const uint2*)hi;  // 8-byte aligned: kq % 4 == 0, rows 144 bytes
        if (split) *(uint2*)&sx[1][r][kq] = *(const uint2*)lo;
    }
}

// Load the W tile (output columns col0..col0+GG_BN of the slot's matrix, k0..k0+GG_BK) into
// shared memory; columns past N and past K are zero.
__device__ __forceinline__ void gg_load_w(bf16 (*sw)[GG_LD], const bf16* __restrict__ W, int N, int K,
                                          int col0, int k0) {
    bool vec = (K & 7) == 0 && (((size_t)W) & 15) == 0;
    for (int c = threadIdx.x; c < GG_BN * (GG_BK / 8); c += GG_THREADS) {
        int n = c / (GG_BK / 8), kq = (c % (GG_BK / 8)) * 8;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (col0 + n < N) {
            const bf16* p = W + (size_t)(col0 + n) * K + k0 + kq;
            if (vec) {
                if (k0 + kq < K) v = *(const uint4*)p;
            } else {
                unsigned short e[8];
                for (int j = 0; j < 8; j++)
                    e[j] = k0 + kq + j < K ? __bfloat16_as_ushort(p[j]) : (unsigned short)0;
                v = make_uint4(e[0] | ((unsigned)e[1] << 16), e[2] | ((unsigned)e[3] << 16),
                               e[4] | ((unsigned)e[5] << 16), e[6] | ((unsigned)e[7] << 16));
            }
        }
        *(uint4*)&sw[n][kq] = v;
    }
}

// The weight tiles of bf16 caches [n_slots, N, K]: load(sw, m, slot, col0, k0) stages matrix m's
// tile of that slot. gg_tile takes any loader with this `load` (quant.cu's GgTyped decodes
// quantized blocks into the same bf16 tile).
struct GgBf16 {
    const bf16* W[2];
    int N, K;
    __device__ __forceinline__ void load(bf16 (*sw)[GG_LD], int m, int slot, int col0, int k0) const {
        gg_load_w(sw, W[m] + (size_t)slot * N * K, N, K, col0, k0);
    }
};

// One block's tile for NW matrices sharing the input (gate and up: NW = 2), their weight tiles
// staged by `wl` (a loader as GgBf16). acc[m][mi][ni][c] is the thread's part of the m16n8
// fragments: warp (wm, wn) owns rows wm*32 + mi*16 and columns wn*32 + ni*8 of the tile. Returns
// false when the tile is refused (nothing computed).
template <int NW, class L>
__device__ __forceinline__ bool gg_tile(const L& wl, const float* __restrict__ x, const int* __restrict__ rows,
                                        int n_x_rows, const int* __restrict__ tiles, int n_rows, int n_slots,
                                        int N, int K, int split, float acc[NW][2][4][4], int* tile_out) {
    __shared__ __align__(16) bf16 sx[2][GG_BM][GG_LD];
    __shared__ __align__(16) bf16 sw[NW][GG_BN][GG_LD];
    const int* tl = tiles + 3 * (size_t)blockIdx.x;
    int slot = tl[0], row0 = tl[1], nr = tl[2], col0 = blockIdx.y * GG_BN;
    if (slot < 0 || slot >= n_slots || row0 < 0 || nr <= 0 || nr > GG_BM || row0 > n_rows - nr) return false;
    tile_out[0] = row0, tile_out[1] = nr, tile_out[2] = col0, tile_out[3] = slot;
#pragma unroll
    for (int m = 0; m < NW; m++)
#pragma unroll
        for (int mi = 0; mi < 2; mi++)
#pragma unroll
            for (int ni = 0; ni < 4; ni++)
#pragma unroll
                for (int c = 0; c < 4; c++) acc[m][mi][ni][c] = 0.f;
    int warp = threadIdx.x >> 5, wm = warp & 1, wn = warp >> 1;
    int parts = split ? 2 : 1;
    for (int k0 = 0; k0 < K; k0 += GG_BK) {
        gg_load_x(sx, x, rows, n_x_rows, row0, nr, K, k0, split);
        for (int m = 0; m < NW; m++) wl.load(sw[m], m, slot, col0, k0);
        __syncthreads();
        if (wm * 32 < nr) {
            for (int ks = 0; ks < GG_BK && k0 + ks < K; ks += 16) {
                // b[m][ni]: the B fragments of the warp's 4 column groups, loaded once for both parts
                unsigned b[NW][4][2];
#pragma unroll
                for (int m = 0; m < NW; m++)
#pragma unroll
                    for (int np = 0; np < 2; np++) gg_frag_b(&b[m][2 * np][0], sw[m], wn * 32 + np * 16, ks);
                for (int p = 0; p < parts; p++) {
                    unsigned a[2][4];
#pragma unroll
                    for (int mi = 0; mi < 2; mi++) gg_frag_a(a[mi], sx[p], wm * 32 + mi * 16, ks);
#pragma unroll
                    for (int m = 0; m < NW; m++)
#pragma unroll
                        for (int ni = 0; ni < 4; ni++) {
                            if (col0 + wn * 32 + ni * 8 >= N) continue;
#pragma unroll
                            for (int mi = 0; mi < 2; mi++)
                                if (wm * 32 + mi * 16 < nr) mma_bf16_16816(acc[m][mi][ni], a[mi], b[m][ni][0], b[m][ni][1]);
                        }
                }
            }
        }
        __syncthreads();
    }
    return true;
}

// Calls f(row in the tile, output column, mi, ni, c) for each accumulator element of this thread
// inside the tile (rows < nr, columns < N).
template <typename F>
__device__ __forceinline__ void gg_for_output(int nr, int N, int col0, F f) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int g = lane >> 2, t = lane & 3, wm = warp & 1, wn = warp >> 1;
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int ni = 0; ni < 4; ni++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                int row = wm * 32 + mi * 16 + g + (c >= 2 ? 8 : 0);
                int col = col0 + wn * 32 + ni * 8 + t * 2 + (c & 1);
                if (row < nr && col < N) f(row, col, mi, ni, c);
            }
}

// Gate, up and the activation over one tile (weights staged by `wl`): h[r, :] =
// glu(act, G_s . x_r + bg[s], U_s . x_r + bu[s]) for the tile's rows r of slot s (common.cuh's
// glu; bg, bu per-slot biases [n_slots, N], null: none).
template <bool EPI, class L>
__device__ __forceinline__ void gg_gate_up(const L& wl, const float* __restrict__ x, const int* __restrict__ rows,
                                           int n_x_rows, const int* __restrict__ tiles, int n_rows, int n_slots,
                                           float* __restrict__ h, int N, int K, int split, int act,
                                           const float* __restrict__ bg, const float* __restrict__ bu) {
    float acc[2][2][4][4];
    int tile[4];
    if (!gg_tile<2>(wl, x, rows, n_x_rows, tiles, n_rows, n_slots, N, K, split, acc, tile)) return;
    int row0 = tile[0], nr = tile[1], col0 = tile[2], slot = tile[3];
    // the plain epilogue (the !EPI instance keeps no epilogue state over its main loop)
    if (!EPI || (act == GLU_SILU && !bg && !bu)) {
        gg_for_output(nr, N, col0, [&](int row, int col, int mi, int ni, int c) {
            h[(size_t)(row0 + row) * N + col] = silu(acc[0][mi][ni][c]) * acc[1][mi][ni][c];
        });
        return;
    }
    gg_for_output(nr, N, col0, [&](int row, int col, int mi, int ni, int c) {
        h[(size_t)(row0 + row) * N + col] = glu_biased(act, acc[0][mi][ni][c], acc[1][mi][ni][c], bg, bu, slot, col, N);
    });
}

// One projection over one tile (weights staged by `wl`): y[r, :] = W_s . x_r + b[s] (b per-slot
// biases [n_slots, N], null: none).
template <bool EPI, class L>
__device__ __forceinline__ void gg_gemm(const L& wl, const float* __restrict__ x, const int* __restrict__ rows,
                                        int n_x_rows, const int* __restrict__ tiles, int n_rows, int n_slots,
                                        float* __restrict__ y, int N, int K, int split, const float* __restrict__ b) {
    float acc[1][2][4][4];
    int tile[4];
    if (!gg_tile<1>(wl, x, rows, n_x_rows, tiles, n_rows, n_slots, N, K, split, acc, tile)) return;
    int row0 = tile[0], nr = tile[1], col0 = tile[2], slot = tile[3];
    if (!EPI || !b) {  // no bias: the plain store
        gg_for_output(nr, N, col0, [&](int row, int col, int mi, int ni, int c) {
            y[(size_t)(row0 + row) * N + col] = acc[0][mi][ni][c];
        });
        return;
    }
    gg_for_output(nr, N, col0, [&](int row, int col, int mi, int ni, int c) {
        y[(size_t)(row0 + row) * N + col] = acc[0][mi][ni][c] + b[(size_t)slot * N + col];
    });
}

// Prefill hot lane, first half: for hot entry r (token rows[r] of x [n_x_rows, K]) in a tile of
// slot s, h[r, :] = silu(G_s . x) * (U_s . x), G and U the caches [n_slots, N = ff, K = hidden].
// `_epi`: h[r, :] = glu(act, G_s . x + bg[s], U_s . x + bu[s]), bg and bu per-slot biases
// [n_slots, ff] (null: none). Two instances, so that the plain one keeps no epilogue state in
// registers over its main loop (one kernel with both epilogues cost 6% of the all-hot prefill).
// grid (n_tiles, ceil(ff / GG_BN)), block GG_THREADS.
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gate_up_bf16(
    const bf16* __restrict__ G, const bf16* __restrict__ U, const float* __restrict__ x,
    const int* __restrict__ rows, int n_x_rows, const int* __restrict__ tiles, int n_rows, int n_slots,
    float* __restrict__ h, int N, int K, int split, int act, const float* __restrict__ bg,
    const float* __restrict__ bu) {
    pdl_enter();
    gg_gate_up<false>(GgBf16{{G, U}, N, K}, x, rows, n_x_rows, tiles, n_rows, n_slots, h, N, K, split, act, bg, bu);
}

extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gate_up_bf16_epi(
    const bf16* __restrict__ G, const bf16* __restrict__ U, const float* __restrict__ x,
    const int* __restrict__ rows, int n_x_rows, const int* __restrict__ tiles, int n_rows, int n_slots,
    float* __restrict__ h, int N, int K, int split, int act, const float* __restrict__ bg,
    const float* __restrict__ bu) {
    pdl_enter();
    gg_gate_up<true>(GgBf16{{G, U}, N, K}, x, rows, n_x_rows, tiles, n_rows, n_slots, h, N, K, split, act, bg, bu);
}

// Prefill hot lane, second half (and any grouped projection): y[r, :] = W_s . x[r, :] for row r
// in a tile of slot s; W the cache [n_slots, N, K]; x [n_rows, K] (rows = null) or gathered
// (row r is x[rows[r]], rows in 0..n_x_rows). `_bias`: + b[s], b per-slot biases [n_slots, N].
// grid (n_tiles, ceil(N / GG_BN)), block GG_THREADS.
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gemm_bf16(
    const bf16* __restrict__ W, const float* __restrict__ x, const int* __restrict__ rows, int n_x_rows,
    const int* __restrict__ tiles, int n_rows, int n_slots, float* __restrict__ y, int N, int K, int split,
    const float* __restrict__ b) {
    pdl_enter();
    gg_gemm<false>(GgBf16{{W, W}, N, K}, x, rows, n_x_rows, tiles, n_rows, n_slots, y, N, K, split, b);
}

extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gemm_bf16_bias(
    const bf16* __restrict__ W, const float* __restrict__ x, const int* __restrict__ rows, int n_x_rows,
    const int* __restrict__ tiles, int n_rows, int n_slots, float* __restrict__ y, int N, int K, int split,
    const float* __restrict__ b) {
    pdl_enter();
    gg_gemm<true>(GgBf16{{W, W}, N, K}, x, rows, n_x_rows, tiles, n_rows, n_slots, y, N, K, split, b);
}

// ---- the same tiles, pipelined (sm_80+, K % 8 == 0, 16-byte aligned caches and x) ----
// The synchronous kernels above load a k step's x and weight tiles, wait, multiply, and wait
// again: ncu on the H100 showed their tensor pipes 13% busy and DRAM at 0.6 TB/s. Here the
// loads are cp.async copies GG_STAGES - 1 k steps ahead of the MMAs, into a ring of GG_STAGES
// shared-memory stages (dynamic shared memory: CudaBackend sets the limit), and x stays f32 in
// shared memory (the gather by token row is the copy's source address); each warp rounds its own
// A fragments to bf16 hi (and lo) as it multiplies. Every accumulator takes the same MMAs in the
// same order as gg_tile (k ascending, hi before lo), so the results are gg_tile's bits.
// Stage layout: x [BM][GP_LDA] f32, then NW weight tiles [GG_BN][GP_LDW] bf16.
// Two tile shapes (GpShape): prefill's GG_BM rows in GG_STAGES stages, and the decode shape
// (batched steps: one or two rows an expert) of GG_DEC_BM rows in GG_DEC_STAGES stages, whose
// smaller x stage leaves shared memory for more stages and blocks, so more weight bytes in flight.

#define GP_BK GG_PIPE_BK
#define GP_LDA (GP_BK + 8)  // f32 stride: a half-warp's float2 fragment loads hit distinct banks
#define GP_LDW (GP_BK + 8)  // bf16 stride (80 bytes): ldmatrix's 8 rows hit distinct banks

#if GP_BK % 16 != 0 || GG_STAGES < 2 || GG_DEC_STAGES < 2 || GG_DEC_BM % 16 != 0
#error "GG_PIPE_BK and GG_DEC_BM must be multiples of 16 and GG_STAGES, GG_DEC_STAGES at least 2"
#endif

// A tile shape: BM rows (MI groups of 16) in a ring of STAGES stages. A thread's fixed share of a
// stage's copies: X_CHUNKS x chunks c = tid + i * GG_THREADS (row c / (GP_BK / 4), 4 floats at
// column (c % (GP_BK / 4)) * 4), GP_W_CHUNKS weight chunks likewise (8 bf16 each).
template <int BM_, int STAGES_>
struct GpShape {
    static constexpr int BM = BM_, STAGES = STAGES_, MI = BM_ / 16, X_CHUNKS = BM_ * GP_BK / 4 / GG_THREADS;
    static_assert(X_CHUNKS >= 1 && X_CHUNKS * 4 * GG_THREADS == BM_ * GP_BK, "x chunks cover the stage");
};
typedef GpShape<GG_BM, GG_STAGES> GpPrefill;
typedef GpShape<GG_DEC_BM, GG_DEC_STAGES> GpDecode;
#define GP_W_CHUNKS (GG_BN * GP_BK / 8 / GG_THREADS)

// cp.async (common.cuh) under this file's names; gp_wait: at most STAGES - 2 groups in flight.
__device__ __forceinline__ void gp_copy16(void* dst, const void* src, bool valid) { cp_async16(dst, src, valid); }
__device__ __forceinline__ void gp_commit() { cp_async_commit(); }
template <class S>
__device__ __forceinline__ void gp_wait() { cp_async_wait<S::STAGES - 2>(); }

// The x rows of this thread's chunks: the tile's row r is token rows[row0 + r] (or row0 + r),
// null past the tile's rows or out of range (a zero row).
template <class S>
struct GpX {
    const float* x[S::X_CHUNKS];
    const float* any;  // a valid global address for the zero-filling copies (not read)
    __device__ __forceinline__ void init(const float* x0, const int* rows, int n_x_rows, int row0, int nr, int K) {
        any = x0;
#pragma unroll
        for (int i = 0; i < S::X_CHUNKS; i++) {
            int r = (threadIdx.x + i * GG_THREADS) / (GP_BK / 4);
            int src = r < nr ? (rows ? rows[row0 + r] : row0 + r) : -1;
            x[i] = src >= 0 && src < n_x_rows ? x0 + (size_t)src * K : nullptr;
        }
    }
    // Queue the copies of k step k0 into the stage's x tile (columns past K are zeros).
    __device__ __forceinline__ void load(float* sa, int K, int k0) const {
#pragma unroll
        for (int i = 0; i < S::X_CHUNKS; i++) {
            int c = threadIdx.x + i * GG_THREADS, r = c / (GP_BK / 4), kq = (c % (GP_BK / 4)) * 4;
            bool ok = x[i] != nullptr && k0 + kq < K;
            gp_copy16(sa + r * GP_LDA + kq, ok ? (const void*)(x[i] + k0 + kq) : (const void*)any, ok);
        }
    }
};

// gp_tile's loader over NW bf16 caches [n_slots, N, K]: `init` finds the weight rows of this
// thread's chunks (null past N), `load` queues 16-byte copies of them into a stage.
template <int NW>
struct GpBf16Cache {
    const bf16* W[NW];
    int N, K;
    const bf16* w[NW][GP_W_CHUNKS];
    __device__ __forceinline__ void init(int slot, int col0) {
#pragma unroll
        for (int m = 0; m < NW; m++)
#pragma unroll
            for (int i = 0; i < GP_W_CHUNKS; i++) {
                int n = (threadIdx.x + i * GG_THREADS) / (GP_BK / 8);
                w[m][i] = col0 + n < N ? W[m] + ((size_t)slot * N + col0 + n) * K : nullptr;
            }
    }
    __device__ __forceinline__ void load(bf16* sw, int K_, int k0) const {
#pragma unroll
        for (int m = 0; m < NW; m++)
#pragma unroll
            for (int i = 0; i < GP_W_CHUNKS; i++) {
                int c = threadIdx.x + i * GG_THREADS, n = c / (GP_BK / 8), kq = (c % (GP_BK / 8)) * 8;
                bool ok = w[m][i] != nullptr && k0 + kq < K_;
                // a zero-filling copy reads nothing, but still names a valid global address
                const void* src = ok ? (const void*)(w[m][i] + k0 + kq) : (const void*)W[0];
                gp_copy16(sw + (m * GG_BN + n) * GP_LDW + kq, src, ok);
            }
    }
};

// The A fragment (hi, and lo = the remainder) of rows rb..rb+15, columns ks..ks+15 of the f32 x
// stage, rounded as gg_load_x rounds (same bits).
__device__ __forceinline__ void gp_frag_a(unsigned* hi, unsigned* lo, const float* sa, int rb, int ks) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float* p = sa + (rb + g) * GP_LDA + ks + 2 * t;
    float2 v[4] = {*(const float2*)p, *(const float2*)(p + 8 * GP_LDA), *(const float2*)(p + 8),
                   *(const float2*)(p + 8 * GP_LDA + 8)};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        __nv_bfloat162 h = __floats2bfloat162_rn(v[j].x, v[j].y);
        __nv_bfloat162 l = __floats2bfloat162_rn(v[j].x - __low2float(h), v[j].y - __high2float(h));
        hi[j] = *(const unsigned*)&h;
        lo[j] = *(const unsigned*)&l;
    }
}

// gg_frag_b over a [GG_BN][GP_LDW] weight stage.
__device__ __forceinline__ void gp_frag_b(unsigned* b, const bf16* sw, int cb, int ks) {
    int lane = threadIdx.x & 31;
    const bf16* p = sw + (cb + (lane & 7) + 8 * (lane >> 4)) * GP_LDW + ks + 8 * ((lane >> 3) & 1);
#if __CUDA_ARCH__ >= 750
    unsigned addr = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
                 : "r"(addr));
#else
    int g = lane >> 2, t = lane & 3;
    for (int h = 0; h < 2; h++) {
        b[2 * h] = *(const unsigned*)&sw[(cb + 8 * h + g) * GP_LDW + ks + t * 2];
        b[2 * h + 1] = *(const unsigned*)&sw[(cb + 8 * h + g) * GP_LDW + ks + t * 2 + 8];
    }
#endif
}

// The MMAs of one stage (k columns k0..k0+GP_BK, of which `kvalid` before K) for warp w: all
// the tile's rows (16-row groups mi from 0 while mi * 16 < nr) against columns w * 16..w * 16 + 15
// (every warp busy whatever the tile's rows; gg_tile's 2 x 2 warps left two idle in a tile of 32
// rows or fewer). PARTS 2: the hi and lo MMAs, in gg_tile's order for each accumulator.
template <int NW, int PARTS, class S>
__device__ __forceinline__ void gp_multiply(const unsigned char* stage, int kvalid, int nr, int col0, int N,
                                            float acc[NW][S::MI][2][4]) {
    const float* sa = (const float*)stage;
    const bf16* sw = (const bf16*)(stage + S::BM * GP_LDA * sizeof(float));
    int wn = threadIdx.x >> 5;
#pragma unroll
    for (int ks = 0; ks < GP_BK; ks += 16) {
        if (ks >= kvalid) break;
        unsigned b[NW][4];  // [m]: b0, b1 of columns wn*16..+7, then of wn*16+8..+15
#pragma unroll
        for (int m = 0; m < NW; m++) gp_frag_b(b[m], sw + m * GG_BN * GP_LDW, wn * 16, ks);
#pragma unroll
        for (int mi = 0; mi < S::MI; mi++) {
            if (mi * 16 >= nr) break;
            unsigned a[2][4];  // hi, lo
            gp_frag_a(a[0], a[1], sa, mi * 16, ks);
#pragma unroll
            for (int p = 0; p < PARTS; p++)
#pragma unroll
                for (int m = 0; m < NW; m++)
#pragma unroll
                    for (int ni = 0; ni < 2; ni++)
                        if (col0 + wn * 16 + ni * 8 < N) mma_bf16_16816(acc[m][mi][ni], a[p], b[m][2 * ni], b[m][2 * ni + 1]);
        }
    }
}

// gg_tile, pipelined over NW weight matrices; the same refusals and sums.
// The weights come from `wl` (a loader with init(slot, col0) and load(stage tiles, K, k0), as
// GpBf16Cache: copies queued; quant.cu's typed loader decodes blocks into the stage instead).
template <int NW, int PARTS, class S, class WL>
__device__ __forceinline__ bool gp_tile(WL& wl, const float* __restrict__ x, const int* __restrict__ rows,
                                        int n_x_rows, const int* __restrict__ tiles, int n_rows, int n_slots, int N,
                                        int K, float acc[NW][S::MI][2][4], int* tile_out) {
    extern __shared__ __align__(16) unsigned char gp_smem[];
    const int stage_bytes = S::BM * GP_LDA * sizeof(float) + NW * GG_BN * GP_LDW * sizeof(bf16);
    const int* tl = tiles + 3 * (size_t)blockIdx.x;
    int slot = tl[0], row0 = tl[1], nr = tl[2], col0 = blockIdx.y * GG_BN;
    if (slot < 0 || slot >= n_slots || row0 < 0 || nr <= 0 || nr > S::BM || row0 > n_rows - nr) return false;
    tile_out[0] = row0, tile_out[1] = nr, tile_out[2] = col0, tile_out[3] = slot;
#pragma unroll
    for (int m = 0; m < NW; m++)
#pragma unroll
        for (int mi = 0; mi < S::MI; mi++)
#pragma unroll
            for (int ni = 0; ni < 2; ni++)
#pragma unroll
                for (int c = 0; c < 4; c++) acc[m][mi][ni][c] = 0.f;
    GpX<S> xs;
    xs.init(x, rows, n_x_rows, row0, nr, K);
    wl.init(slot, col0);
    auto load = [&](int stage, int k0) {
        unsigned char* p = gp_smem + stage * stage_bytes;
        xs.load((float*)p, K, k0);
        wl.load((bf16*)(p + S::BM * GP_LDA * sizeof(float)), K, k0);
    };
    int n_k = (K + GP_BK - 1) / GP_BK;
#pragma unroll
    for (int s = 0; s < S::STAGES - 1; s++) {
        if (s < n_k) load(s, s * GP_BK);
        gp_commit();
    }
    for (int kt = 0; kt < n_k; kt++) {
        gp_wait<S>();
        __syncthreads();  // stage kt landed for every thread; stage kt - 1 is free again
        int next = kt + S::STAGES - 1;
        if (next < n_k) load(next % S::STAGES, next * GP_BK);
        gp_commit();
        gp_multiply<NW, PARTS, S>(gp_smem + (kt % S::STAGES) * stage_bytes, K - kt * GP_BK, nr, col0, N, acc);
    }
    return true;
}

// Calls f(row in the tile, output column, mi, ni, c) for each accumulator element of this thread
// inside the tile (rows < nr, columns < N), in gp_multiply's warp layout.
template <class S, typename F>
__device__ __forceinline__ void gp_for_output(int nr, int N, int col0, F f) {
    int lane = threadIdx.x & 31, wn = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mi = 0; mi < S::MI; mi++)
#pragma unroll
        for (int ni = 0; ni < 2; ni++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                int row = mi * 16 + g + (c >= 2 ? 8 : 0), col = col0 + wn * 16 + ni * 8 + t * 2 + (c & 1);
                if (row < nr && col < N) f(row, col, mi, ni, c);
            }
}

// Gate, up and the activation over one tile, pipelined: h[r, :] = glu(act, G_s . x_r + bg[s],
// U_s . x_r + bu[s]) as gg_gate_up.
template <int PARTS, bool EPI, class S, class WL>
__device__ __forceinline__ void gp_gate_up(WL& wl, const float* __restrict__ x, const int* __restrict__ rows,
                                           int n_x_rows, const int* __restrict__ tiles, int n_rows, int n_slots,
                                           float* __restrict__ h, int N, int K, int act, const float* __restrict__ bg,
                                           const float* __restrict__ bu) {
    float acc[2][S::MI][2][4];
    int tile[4];
    if (!gp_tile<2, PARTS, S>(wl, x, rows, n_x_rows, tiles, n_rows, n_slots, N, K, acc, tile)) return;
    int row0 = tile[0], nr = tile[1], col0 = tile[2], slot = tile[3];
    // the plain epilogue (the !EPI instance keeps no epilogue state over its main loop)
    if (!EPI || (act == GLU_SILU && !bg && !bu)) {
        gp_for_output<S>(nr, N, col0, [&](int row, int col, int mi, int ni, int c) {
            h[(size_t)(row0 + row) * N + col] = silu(acc[0][mi][ni][c]) * acc[1][mi][ni][c];
        });
        return;
    }
    gp_for_output<S>(nr, N, col0, [&](int row, int col, int mi, int ni, int c) {
        h[(size_t)(row0 + row) * N + col] = glu_biased(act, acc[0][mi][ni][c], acc[1][mi][ni][c], bg, bu, slot, col, N);
    });
}

// One projection over one tile, pipelined: y[r, :] = W_s . x_r + b[s] as gg_gemm.
template <int PARTS, bool EPI, class S, class WL>
__device__ __forceinline__ void gp_gemm(WL& wl, const float* __restrict__ x, const int* __restrict__ rows,
                                        int n_x_rows, const int* __restrict__ tiles, int n_rows, int n_slots,
                                        float* __restrict__ y, int N, int K, const float* __restrict__ b) {
    float acc[1][S::MI][2][4];
    int tile[4];
    if (!gp_tile<1, PARTS, S>(wl, x, rows, n_x_rows, tiles, n_rows, n_slots, N, K, acc, tile)) return;
    int row0 = tile[0], nr = tile[1], col0 = tile[2], slot = tile[3];
    if (!EPI || !b) {  // no bias: the plain store
        gp_for_output<S>(nr, N, col0, [&](int row, int col, int mi, int ni, int c) {
            y[(size_t)(row0 + row) * N + col] = acc[0][mi][ni][c];
        });
        return;
    }
    gp_for_output<S>(nr, N, col0, [&](int row, int col, int mi, int ni, int c) {
        y[(size_t)(row0 + row) * N + col] = acc[0][mi][ni][c] + b[(size_t)slot * N + col];
    });
}

// grouped_gate_up_bf16 (and `_epi`), pipelined (same arguments and results), in tile shape S.
template <class S, bool EPI>
__device__ __forceinline__ void gate_up_bf16_pipe(const bf16* G, const bf16* U, const float* x, const int* rows,
                                                  int n_x_rows, const int* tiles, int n_rows, int n_slots, float* h,
                                                  int N, int K, int split, int act, const float* bg, const float* bu) {
    GpBf16Cache<2> wl = {{G, U}, N, K};
    if (split)
        gp_gate_up<2, EPI, S>(wl, x, rows, n_x_rows, tiles, n_rows, n_slots, h, N, K, act, bg, bu);
    else
        gp_gate_up<1, EPI, S>(wl, x, rows, n_x_rows, tiles, n_rows, n_slots, h, N, K, act, bg, bu);
}

// grouped_gemm_bf16 (and `_bias`), pipelined (same arguments and results), in tile shape S.
template <class S, bool EPI>
__device__ __forceinline__ void gemm_bf16_pipe(const bf16* W, const float* x, const int* rows, int n_x_rows,
                                               const int* tiles, int n_rows, int n_slots, float* y, int N, int K,
                                               int split, const float* b) {
    GpBf16Cache<1> wl = {{W}, N, K};
    if (split)
        gp_gemm<2, EPI, S>(wl, x, rows, n_x_rows, tiles, n_rows, n_slots, y, N, K, b);
    else
        gp_gemm<1, EPI, S>(wl, x, rows, n_x_rows, tiles, n_rows, n_slots, y, N, K, b);
}

// The kernels: dynamic shared memory S::STAGES stages of x and the weight tiles (CudaBackend
// sets the limit); grid (n_tiles, ceil(N / GG_BN)), block GG_THREADS. `_pipe`: prefill's tiles of
// GG_BM rows; `_dec`: the decode shape's GG_DEC_BM rows.
#define GATE_UP_BF16_PARAMS                                                                                    \
    const bf16 *__restrict__ G, const bf16 *__restrict__ U, const float *__restrict__ x,                        \
        const int *__restrict__ rows, int n_x_rows, const int *__restrict__ tiles, int n_rows, int n_slots,     \
        float *__restrict__ h, int N, int K, int split, int act, const float *__restrict__ bg,                  \
        const float *__restrict__ bu
#define GATE_UP_BF16_ARGS G, U, x, rows, n_x_rows, tiles, n_rows, n_slots, h, N, K, split, act, bg, bu
#define GEMM_BF16_PARAMS                                                                                       \
    const bf16 *__restrict__ W, const float *__restrict__ x, const int *__restrict__ rows, int n_x_rows,       \
        const int *__restrict__ tiles, int n_rows, int n_slots, float *__restrict__ y, int N, int K, int split,  \
        const float *__restrict__ b
#define GEMM_BF16_ARGS W, x, rows, n_x_rows, tiles, n_rows, n_slots, y, N, K, split, b
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gate_up_bf16_pipe(GATE_UP_BF16_PARAMS) {
    pdl_enter();
    gate_up_bf16_pipe<GpPrefill, false>(GATE_UP_BF16_ARGS);
}
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gate_up_bf16_pipe_epi(GATE_UP_BF16_PARAMS) {
    pdl_enter();
    gate_up_bf16_pipe<GpPrefill, true>(GATE_UP_BF16_ARGS);
}
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gate_up_bf16_dec(GATE_UP_BF16_PARAMS) {
    pdl_enter();
    gate_up_bf16_pipe<GpDecode, false>(GATE_UP_BF16_ARGS);
}
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gate_up_bf16_dec_epi(GATE_UP_BF16_PARAMS) {
    pdl_enter();
    gate_up_bf16_pipe<GpDecode, true>(GATE_UP_BF16_ARGS);
}
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gemm_bf16_pipe(GEMM_BF16_PARAMS) {
    pdl_enter();
    gemm_bf16_pipe<GpPrefill, false>(GEMM_BF16_ARGS);
}
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gemm_bf16_pipe_bias(GEMM_BF16_PARAMS) {
    pdl_enter();
    gemm_bf16_pipe<GpPrefill, true>(GEMM_BF16_ARGS);
}
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gemm_bf16_dec(GEMM_BF16_PARAMS) {
    pdl_enter();
    gemm_bf16_pipe<GpDecode, false>(GEMM_BF16_ARGS);
}
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gemm_bf16_dec_bias(GEMM_BF16_PARAMS) {
    pdl_enter();
    gemm_bf16_pipe<GpDecode, true>(GEMM_BF16_ARGS);
}

// ---- the decode shape without shared-memory stages (sm_80+, K % 32 == 0, 16-byte aligned) ----
// A batched decode step routes one or two rows to most experts. ncu on the H200 (8-layer BF16,
// all hot, B = 16) put the pipelined _dec tiles at 48% of DRAM bandwidth with 25% occupancy (51
// KiB of stages a gate/up block). Here, as gemv_mma_bf16: a block owns 16 output columns of one
// tile (at most 16 rows: two 8-row tiles of the MMA's n) and its GEMV_MMA_WARPS warps take
// interleaved 32-column slabs of K. Lane (g, c) loads the weights of columns g and g + 8 at slab
// column 8c straight into A fragments (GR_UNROLL(NW) slabs' loads in flight before their MMAs)
// and splits its 8 x values of row g of each 8-row tile into bf16 hi (+ lo) B fragments in
// registers; the warps' sums meet in warp order in shared memory (gr_sum). Rows past the tile
// read its last row and are not stored; a token row out of range is a zero row.
// Gate/up: the gate's and the up's 16 columns. The down projection: two neighbouring 16-column
// groups of its one matrix (COLS), so a block's registers and loads match gate/up's: with one
// 16-column group (k = ff = 768, 3 slabs a warp, 142 registers, 12.5% occupancy) it took 214-222
// us a layer where the pipelined _dec tiles take 120-122 (ncu, same call, B = 16); gate/up
// 158-164 here against 236-238.
#define GR_UNROLL(NW) (4 / (NW))

// The two bf16 pairs of hi (and lo = the remainder) of four f32 values, as gp_frag_a rounds.
__device__ __forceinline__ void gr_split(float4 v, unsigned* hi, unsigned* lo) {
    __nv_bfloat162 h0 = __floats2bfloat162_rn(v.x, v.y), h1 = __floats2bfloat162_rn(v.z, v.w);
    __nv_bfloat162 l0 = __floats2bfloat162_rn(v.x - __low2float(h0), v.y - __high2float(h0));
    __nv_bfloat162 l1 = __floats2bfloat162_rn(v.z - __low2float(h1), v.w - __high2float(h1));
    hi[0] = *(const unsigned*)&h0, hi[1] = *(const unsigned*)&h1;
    lo[0] = *(const unsigned*)&l0, lo[1] = *(const unsigned*)&l1;
}

// One block's partial sums for NW caches [n_slots, N, K] sharing the input (COLS: NW column
// groups of W[0], group m at columns col0 + 16 m): part[w][m * 8 + j * 4 + r][lane] is warp w's
// accumulator r of matrix (group) m, token tile j. Returns the tile (row0, nr, col0, slot) in tl,
// false when refused (nothing computed, no barrier passed).
template <int NW, bool COLS = false>
__device__ __forceinline__ bool gr_tile(const bf16* const* W, const float* __restrict__ x, const int* __restrict__ rows,
                                        int n_x_rows, const int* __restrict__ tiles, int n_rows, int n_slots, int N,
                                        int K, int split, float (*part)[NW * 8][32], int* tl) {
    const int* t3 = tiles + 3 * (size_t)blockIdx.x;
    int slot = t3[0], row0 = t3[1], nr = t3[2], col0 = blockIdx.y * 16 * (COLS ? NW : 1);
    if (slot < 0 || slot >= n_slots || row0 < 0 || nr <= 0 || nr > 16 || row0 > n_rows - nr) return false;
    tl[0] = row0, tl[1] = nr, tl[2] = col0, tl[3] = slot;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3, nt = (nr + 7) >> 3;
    const float* xr[2];
#pragma unroll
    for (int j = 0; j < 2; j++) {
        int r = row0 + min(8 * j + g, nr - 1), src = rows ? rows[r] : r;
        xr[j] = src >= 0 && src < n_x_rows ? x + (size_t)src * K + 8 * c : nullptr;
    }
    const bf16 *wa[NW], *wb[NW];
#pragma unroll
    for (int m = 0; m < NW; m++) {
        const bf16* w = COLS ? W[0] : W[m];
        int cm = col0 + (COLS ? 16 * m : 0);
        wa[m] = w + ((size_t)slot * N + min(cm + g, N - 1)) * K + 8 * c;
        wb[m] = w + ((size_t)slot * N + min(cm + g + 8, N - 1)) * K + 8 * c;
    }
    constexpr int U = GR_UNROLL(NW);
    float acc[NW][2][4] = {};
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = warp; s0 < (K >> 5); s0 += U * GEMV_MMA_WARPS) {
        uint4 a[U][NW], b[U][NW];
        float4 xv[U][2][2];
#pragma unroll
        for (int u = 0; u < U; u++) {
            int k0 = (s0 + u * GEMV_MMA_WARPS) * 32;
            if (k0 >= K) continue;
#pragma unroll
            for (int m = 0; m < NW; m++) a[u][m] = *(const uint4*)(wa[m] + k0), b[u][m] = *(const uint4*)(wb[m] + k0);
#pragma unroll
            for (int j = 0; j < 2; j++) {
                bool ok = j < nt && xr[j];
                xv[u][j][0] = ok ? *(const float4*)(xr[j] + k0) : zero;
                xv[u][j][1] = ok ? *(const float4*)(xr[j] + k0 + 4) : zero;
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            if ((s0 + u * GEMV_MMA_WARPS) * 32 >= K) continue;
#pragma unroll
            for (int j = 0; j < 2; j++) {
                if (j >= nt) continue;
                unsigned hi[4], lo[4];
                gr_split(xv[u][j][0], hi, lo);
                gr_split(xv[u][j][1], hi + 2, lo + 2);
#pragma unroll
                for (int m = 0; m < NW; m++) {
                    unsigned a1[4] = {a[u][m].x, b[u][m].x, a[u][m].y, b[u][m].y};
                    unsigned a2[4] = {a[u][m].z, b[u][m].z, a[u][m].w, b[u][m].w};
                    mma_bf16_16816(acc[m][j], a1, hi[0], hi[1]);
                    mma_bf16_16816(acc[m][j], a2, hi[2], hi[3]);
                    if (split) {
                        mma_bf16_16816(acc[m][j], a1, lo[0], lo[1]);
                        mma_bf16_16816(acc[m][j], a2, lo[2], lo[3]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int m = 0; m < NW; m++)
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int r = 0; r < 4; r++) part[warp][m * 8 + j * 4 + r][lane] = acc[m][j][r];
    __syncthreads();
    return true;
}

// The sum over warps (in warp order) of partial q = m * 8 + j * 4 + r at lane l.
template <int NW>
__device__ __forceinline__ float gr_sum(float (*part)[NW * 8][32], int q, int l) {
    float v = 0.f;
    for (int w = 0; w < GEMV_MMA_WARPS; w++) v += part[w][q][l];
    return v;
}

// Calls f(row in the tile, output column, j * 4 + r, lane) for each output of the tile (rows <
// nr, columns < N), spread over the block's threads.
template <typename F>
__device__ __forceinline__ void gr_for_output(int nr, int N, int col0, F f) {
    for (int e = threadIdx.x; e < ((nr + 7) >> 3) * 128; e += blockDim.x) {
        int jr = e >> 5, l = e & 31, r = jr & 3;
        int col = col0 + (l >> 2) + (r >= 2 ? 8 : 0), row = 8 * (jr >> 2) + 2 * (l & 3) + (r & 1);
        if (col < N && row < nr) f(row, col, jr, l);
    }
}

template <bool EPI>
__device__ __forceinline__ void gr_gate_up(GATE_UP_BF16_PARAMS) {
    __shared__ float part[GEMV_MMA_WARPS][16][32];
    const bf16* W[2] = {G, U};
    int tl[4];
    if (!gr_tile<2>(W, x, rows, n_x_rows, tiles, n_rows, n_slots, N, K, split, part, tl)) return;
    int row0 = tl[0], slot = tl[3];
    gr_for_output(tl[1], N, tl[2], [&](int row, int col, int q, int l) {
        float gv = gr_sum<2>(part, q, l), uv = gr_sum<2>(part, 8 + q, l);
        h[(size_t)(row0 + row) * N + col] = EPI ? glu_biased(act, gv, uv, bg, bu, slot, col, N) : silu(gv) * uv;
    });
}

// grouped_gate_up_bf16(_epi) in the decode shape above: tiles of at most 16 rows. grid (n_tiles,
// ceil(N / 16)), block 32 * GEMV_MMA_WARPS.
extern "C" __global__ __launch_bounds__(32 * GEMV_MMA_WARPS) void grouped_gate_up_bf16_rows(GATE_UP_BF16_PARAMS) {
    pdl_enter();
    gr_gate_up<false>(GATE_UP_BF16_ARGS);
}

extern "C" __global__ __launch_bounds__(32 * GEMV_MMA_WARPS) void grouped_gate_up_bf16_rows_epi(GATE_UP_BF16_PARAMS) {
    pdl_enter();
    gr_gate_up<true>(GATE_UP_BF16_ARGS);
}

// The down projection in the decode shape: y[r] = W_s · x_r (+ b_s), 32 output columns a block
// as two column groups of gr_tile. grid (n_tiles, ceil(N / 32)), block 32 * GEMV_MMA_WARPS.
template <bool BIAS>
__device__ __forceinline__ void gr_down(GEMM_BF16_PARAMS) {
    __shared__ float part[GEMV_MMA_WARPS][16][32];
    const bf16* Ws[1] = {W};
    int tl[4];
    if (!gr_tile<2, true>(Ws, x, rows, n_x_rows, tiles, n_rows, n_slots, N, K, split, part, tl)) return;
    int row0 = tl[0], slot = tl[3];
#pragma unroll
    for (int m = 0; m < 2; m++) {
        gr_for_output(tl[1], N, tl[2] + 16 * m, [&](int row, int col, int q, int l) {
            float v = gr_sum<2>(part, m * 8 + q, l);
            y[(size_t)(row0 + row) * N + col] = BIAS ? v + b[(size_t)slot * N + col] : v;
        });
    }
}

extern "C" __global__ __launch_bounds__(32 * GEMV_MMA_WARPS) void grouped_gemm_bf16_rows(GEMM_BF16_PARAMS) {
    pdl_enter();
    gr_down<false>(GEMM_BF16_ARGS);
}

extern "C" __global__ __launch_bounds__(32 * GEMV_MMA_WARPS) void grouped_gemm_bf16_rows_bias(GEMM_BF16_PARAMS) {
    pdl_enter();
    gr_down<true>(GEMM_BF16_ARGS);
}
