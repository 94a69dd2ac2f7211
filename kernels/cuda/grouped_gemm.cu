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

__device__ __forceinline__ void mma_bf16_16816(float* d, const unsigned* a, unsigned b0, unsigned b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    // Same fragment layout by plain FMAs (pre-sm_80 devices; never the fast path).
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    for (int c = 0; c < 4; c++) {
        int row = g + (c >= 2 ? 8 : 0), col = t * 2 + (c & 1);
        float acc = 0.f;
        for (int kk = 0; kk < 16; kk++) {
            int al = ((row & 7) << 2) | ((kk & 7) >> 1);
            unsigned aw = __shfl_sync(0xffffffffu, a[((kk >> 3) << 1) | (row >> 3)], al);
            int bl = (col << 2) | ((kk & 7) >> 1);
            unsigned bw = __shfl_sync(0xffffffffu, kk < 8 ? b0 : b1, bl);
            unsigned short ah = (kk & 1) ? (aw >> 16) : (aw & 0xffffu);
            unsigned short bh = (kk & 1) ? (bw >> 16) : (bw & 0xffffu);
            acc += __uint_as_float((unsigned)ah << 16) * __uint_as_float((unsigned)bh << 16);
        }
        d[c] += acc;
    }
#endif
}

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
    tile_out[0] = row0, tile_out[1] = nr, tile_out[2] = col0;
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

// Gate, up and the activation over one tile (weights staged by `wl`): h[r, :] = silu(G_s . x_r) *
// (U_s . x_r) for the tile's rows r of slot s.
template <class L>
__device__ __forceinline__ void gg_gate_up(const L& wl, const float* __restrict__ x, const int* __restrict__ rows,
                                           int n_x_rows, const int* __restrict__ tiles, int n_rows, int n_slots,
                                           float* __restrict__ h, int N, int K, int split) {
    float acc[2][2][4][4];
    int tile[3];
    if (!gg_tile<2>(wl, x, rows, n_x_rows, tiles, n_rows, n_slots, N, K, split, acc, tile)) return;
    int row0 = tile[0], nr = tile[1], col0 = tile[2];
    gg_for_output(nr, N, col0, [&](int row, int col, int mi, int ni, int c) {
        h[(size_t)(row0 + row) * N + col] = silu(acc[0][mi][ni][c]) * acc[1][mi][ni][c];
    });
}

// One projection over one tile (weights staged by `wl`): y[r, :] = W_s . x_r.
template <class L>
__device__ __forceinline__ void gg_gemm(const L& wl, const float* __restrict__ x, const int* __restrict__ rows,
                                        int n_x_rows, const int* __restrict__ tiles, int n_rows, int n_slots,
                                        float* __restrict__ y, int N, int K, int split) {
    float acc[1][2][4][4];
    int tile[3];
    if (!gg_tile<1>(wl, x, rows, n_x_rows, tiles, n_rows, n_slots, N, K, split, acc, tile)) return;
    int row0 = tile[0], nr = tile[1], col0 = tile[2];
    gg_for_output(nr, N, col0, [&](int row, int col, int mi, int ni, int c) {
        y[(size_t)(row0 + row) * N + col] = acc[0][mi][ni][c];
    });
}

// Prefill hot lane, first half: for hot entry r (token rows[r] of x [n_x_rows, K]) in a tile of
// slot s, h[r, :] = silu(G_s . x) * (U_s . x), G and U the caches [n_slots, N = ff, K = hidden].
// grid (n_tiles, ceil(ff / GG_BN)), block GG_THREADS.
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gate_up_bf16(
    const bf16* __restrict__ G, const bf16* __restrict__ U, const float* __restrict__ x, const int* __restrict__ rows,
    int n_x_rows, const int* __restrict__ tiles, int n_rows, int n_slots, float* __restrict__ h, int N, int K,
    int split) {
    pdl_enter();
    gg_gate_up(GgBf16{{G, U}, N, K}, x, rows, n_x_rows, tiles, n_rows, n_slots, h, N, K, split);
}

// Prefill hot lane, second half (and any grouped projection): y[r, :] = W_s . x[r, :] for row r
// in a tile of slot s; W the cache [n_slots, N, K]; x [n_rows, K] (rows = null) or gathered
// (row r is x[rows[r]], rows in 0..n_x_rows). grid (n_tiles, ceil(N / GG_BN)), block GG_THREADS.
extern "C" __global__ __launch_bounds__(GG_THREADS) void grouped_gemm_bf16(
    const bf16* __restrict__ W, const float* __restrict__ x, const int* __restrict__ rows, int n_x_rows,
    const int* __restrict__ tiles, int n_rows, int n_slots, float* __restrict__ y, int N, int K, int split) {
    pdl_enter();
    gg_gemm(GgBf16{{W, W}, N, K}, x, rows, n_x_rows, tiles, n_rows, n_slots, y, N, K, split);
}
