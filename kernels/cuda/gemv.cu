// GEMV: decode matrix-vector products over bf16 weights.
// Part of the moe-lanes kernels: compiled together with common.cuh prepended (kernels/src/cuda/kernel.rs).

// y[t, n] = (accumulate ? y[t, n] : 0) + W[n, :] . x[t, :]
// grid (ceil(N / 8), T), block 256: one warp per output row, one grid row per token.
extern "C" __global__ void gemv_bf16(const bf16* __restrict__ W, const float* __restrict__ x,
                                     float* __restrict__ y, int N, int K, int accumulate) {
    pdl_enter();
    int n = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
    int t = blockIdx.y;
    if (n >= N) return;
    float d = warp_dot_bf16(W + (size_t)n * K, x + (size_t)t * K, K);
    if ((threadIdx.x & 31) == 0) {
        float* o = y + (size_t)t * N + n;
        *o = accumulate ? *o + d : d;
    }
}

// One-token GEMV for matrices with too few rows to fill the GPU at one warp a row:
// y[n] = (accumulate ? y[n] : 0) + W[n, :] . x with GEMV_SPLIT warps a row, each over one
// contiguous range of the row's 8-value groups (summed as warp_dot_bf16 sums a row), the parts
// added in range order by one thread. Needs K % 8 == 0 and W, x 16-byte aligned (the launcher
// checks). grid ceil(N / (ROWS_PER_BLOCK / GEMV_SPLIT)), block 32 * ROWS_PER_BLOCK.
extern "C" __global__ void gemv_bf16_split(const bf16* __restrict__ W, const float* __restrict__ x,
                                           float* __restrict__ y, int N, int K, int accumulate) {
    pdl_enter();
    __shared__ float part[ROWS_PER_BLOCK];
    const int rows = ROWS_PER_BLOCK / GEMV_SPLIT;
    int warp = threadIdx.x >> 5, n = blockIdx.x * rows + warp / GEMV_SPLIT, q = warp % GEMV_SPLIT;
    int n8 = K >> 3, len = (n8 + GEMV_SPLIT - 1) / GEMV_SPLIT, i1 = min(n8, (q + 1) * len);
    float acc = 0.f;
    if (n < N) {
        const uint4* w8 = (const uint4*)(W + (size_t)n * K);
        const float4* x4 = (const float4*)x;
        for (int i = q * len + (threadIdx.x & 31); i < i1; i += WARP) acc = dot8_bf16(w8[i], x4[2 * i], x4[2 * i + 1], acc);
    }
    acc = warp_sum(acc);
    if ((threadIdx.x & 31) == 0) part[warp] = acc;
    __syncthreads();
    int r = blockIdx.x * rows + threadIdx.x;
    if (threadIdx.x < rows && r < N) {
        float d = 0.f;
        for (int j = 0; j < GEMV_SPLIT; j++) d += part[threadIdx.x * GEMV_SPLIT + j];
        y[r] = accumulate ? y[r] + d : d;
    }
}

// Three GEMVs over one input in one launch (decode q/k/v): rows 0..N0 of the concatenation go to
// y0 = W0 . x, the next N1 to y1, the last N2 to y2 (no accumulation). Output rows of token t are
// at t * Ni. grid (ceil((N0 + N1 + N2) / 8), T), block 256: one warp per output row.
extern "C" __global__ void gemv3_bf16(const bf16* __restrict__ W0, const bf16* __restrict__ W1,
                                      const bf16* __restrict__ W2, const float* __restrict__ x,
                                      float* __restrict__ y0, float* __restrict__ y1, float* __restrict__ y2,
                                      int N0, int N1, int N2, int K) {
    pdl_enter();
    int n = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
    int t = blockIdx.y;
    const bf16* W;
    float* y;
    int N;
    if (n < N0) {
        W = W0, y = y0, N = N0;
    } else if (n < N0 + N1) {
        n -= N0, W = W1, y = y1, N = N1;
    } else if (n < N0 + N1 + N2) {
        n -= N0 + N1, W = W2, y = y2, N = N2;
    } else {
        return;
    }
    float d = warp_dot_bf16(W + (size_t)n * K, x + (size_t)t * K, K);
    if ((threadIdx.x & 31) == 0) y[(size_t)t * N + n] = d;
}

// Decode projections of a batched step on the tensor cores, each weight read once for up to
// GEMV_MMA_TOKENS rows: y_m[t, n] (+)= W_m[n, :] . (x_hi[t, :] + x_lo[t, :]) (the rows split into
// bf16 hi + lo, as the GEMMs take them: f32 accuracy) for up to three matrices over one input
// (q/k/v; one matrix: N1 = N2 = 0). A block owns G groups of 16 rows of one matrix for tokens
// blockIdx.y * GEMV_MMA_TOKENS onwards; its NW warps take interleaved 32-column slabs of K,
// GM_UNROLL / G slabs' weight loads in flight before their MMAs, summed in warp order through
// shared memory (a 16-warp block: warps 8-15 store, 0-7 add theirs, then the sum over 8). Lane
// (g, c) loads 8 weights of rows g and g + 8 of each group and 8 activations of token g of each
// 8-token tile at slab column 8c: the MMAs see the slab's columns in another order, the same for
// both operands (rows and tokens past the ends read the last one, their results are not stored).
// Needs K % 32 == 0, W and x 16-byte aligned (the launcher checks). grid (sum_m ceil(N_m / (16 G)),
// ceil(T / GEMV_MMA_TOKENS)), block 32 * NW: 8 warps (GEMV_MMA_WARPS) where the grid fills the
// device, 16 (_w16) for the few-block projections (o: 128 blocks of 16 rows). Each block reads its
// tokens' activations (4 bytes a value, hi + lo) once for its 16 G rows' weights (2 bytes a
// value): at G = 1 and 16 tokens twice the weights' bytes, from L2; _r32 (G = 2) halves that.
// The activations of the first GM_HOIST_TILES token tiles load with the slabs' weights, before
// any MMA (one round trip a slab group; loaded beside their MMAs, each tile's was one more L2
// round trip: ncu on the H200 put q/k/v and o at 19% of DRAM bandwidth at 16 tokens); later
// tiles, past 16 tokens, still load beside their MMAs (their registers would cost occupancy).
// Session 48, H200, 16-layer BF16 all hot, `bench --parallel 16`, in turns with the build
// before: 2894.9 / 2892.5 / 2881.4 against 2851.8 / 2848.1 / 2821.3 t/s. ptxas: 128 registers
// (48 bytes spilled) for the 8- and 16-warp blocks; the 8-warp block is held to two blocks an SM
// by its launch bounds (154 registers, one block, without them).
#define GM_UNROLL 4
#define GM_HOIST_TILES 2
#define GEMV_MMA_PARAMS                                                                                         \
    const bf16 *__restrict__ W0, const bf16 *__restrict__ W1, const bf16 *__restrict__ W2,                     \
        const bf16 *__restrict__ xh, const bf16 *__restrict__ xl, float *__restrict__ y0, float *__restrict__ y1, \
        float *__restrict__ y2, int N0, int N1, int N2, int K, int T, int accumulate
#define GEMV_MMA_ARGS W0, W1, W2, xh, xl, y0, y1, y2, N0, N1, N2, K, T, accumulate
template <int NW, int G>
__device__ __forceinline__ void gemv_mma(GEMV_MMA_PARAMS) {
    constexpr int TILES = GEMV_MMA_TOKENS / 8, PW = NW < GEMV_MMA_WARPS ? NW : GEMV_MMA_WARPS, U = GM_UNROLL / G;
    // the first HT token tiles' activations load with the weights (one round trip a slab group);
    // further tiles (more than 16 tokens) load as their MMAs need them
    constexpr int HT = TILES < GM_HOIST_TILES ? TILES : GM_HOIST_TILES;
    static_assert(NW == PW || NW == 2 * PW, "GEMV_MMA_WARPS warps or twice as many");
    __shared__ float part[PW][G * TILES * 4][32];
    int b = blockIdx.x, b0 = (N0 + 16 * G - 1) / (16 * G), b1 = (N1 + 16 * G - 1) / (16 * G);
    const bf16* W = W0;
    float* y = y0;
    int N = N0;
    if (b >= b0 + b1) {
        b -= b0 + b1, W = W2, y = y2, N = N2;
    } else if (b >= b0) {
        b -= b0, W = W1, y = y1, N = N1;
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    int n0 = b * 16 * G, t0 = blockIdx.y * GEMV_MMA_TOKENS, nt = min(TILES, (T - t0 + 7) >> 3), slabs = K >> 5;
    const uint4 *wa[G], *wb[G];
#pragma unroll
    for (int q = 0; q < G; q++) {
        wa[q] = (const uint4*)(W + (size_t)min(n0 + 16 * q + g, N - 1) * K) + c;
        wb[q] = (const uint4*)(W + (size_t)min(n0 + 16 * q + g + 8, N - 1) * K) + c;
    }
    size_t xrow[TILES];
#pragma unroll
    for (int j = 0; j < TILES; j++) xrow[j] = (size_t)min(t0 + 8 * j + g, T - 1) * (K >> 3) + c;
    const uint4 *h4 = (const uint4*)xh, *l4 = (const uint4*)xl;
    float acc[G][TILES][4] = {};
    for (int s0 = warp; s0 < slabs; s0 += U * NW) {
        uint4 a[U][G], e[U][G], xh0[U][HT], xl0[U][HT];
#pragma unroll
        for (int u = 0; u < U; u++) {
            int s = s0 + u * NW;
            if (s >= slabs) continue;
#pragma unroll
            for (int q = 0; q < G; q++) a[u][q] = wa[q][s * 4], e[u][q] = wb[q][s * 4];
#pragma unroll
            for (int j = 0; j < HT; j++)
                if (j < nt) xh0[u][j] = h4[xrow[j] + s * 4], xl0[u][j] = l4[xrow[j] + s * 4];
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            int s = s0 + u * NW;
            if (s >= slabs) continue;
#pragma unroll
            for (int j = 0; j < TILES; j++) {
                if (j >= nt) continue;
                uint4 h = j < HT ? xh0[u][j < HT ? j : 0] : h4[xrow[j] + s * 4];
                uint4 l = j < HT ? xl0[u][j < HT ? j : 0] : l4[xrow[j] + s * 4];
#pragma unroll
                for (int q = 0; q < G; q++) {
                    unsigned a1[4] = {a[u][q].x, e[u][q].x, a[u][q].y, e[u][q].y};
                    unsigned a2[4] = {a[u][q].z, e[u][q].z, a[u][q].w, e[u][q].w};
                    mma_bf16_16816(acc[q][j], a1, h.x, h.y);
                    mma_bf16_16816(acc[q][j], a1, l.x, l.y);
                    mma_bf16_16816(acc[q][j], a2, h.z, h.w);
                    mma_bf16_16816(acc[q][j], a2, l.z, l.w);
                }
            }
        }
    }
    if (NW > PW) {
        if (warp >= PW)
#pragma unroll
            for (int q = 0; q < G; q++)
#pragma unroll
                for (int j = 0; j < TILES; j++)
#pragma unroll
                    for (int r = 0; r < 4; r++) part[warp - PW][(q * TILES + j) * 4 + r][lane] = acc[q][j][r];
        __syncthreads();
    }
    if (warp < PW)
#pragma unroll
        for (int q = 0; q < G; q++)
#pragma unroll
            for (int j = 0; j < TILES; j++)
#pragma unroll
                for (int r = 0; r < 4; r++) {
                    float* p = &part[warp][(q * TILES + j) * 4 + r][lane];
                    *p = NW > PW ? acc[q][j][r] + *p : acc[q][j][r];
                }
    __syncthreads();
    for (int e = threadIdx.x; e < G * TILES * 4 * 32; e += blockDim.x) {
        int qjr = e >> 5, l = e & 31, r = qjr & 3, jr = qjr % (TILES * 4), q = qjr / (TILES * 4);
        if ((jr >> 2) >= nt) continue;
        float v = 0.f;
        for (int w = 0; w < PW; w++) v += part[w][qjr][l];
        int n = n0 + 16 * q + (l >> 2) + (r >= 2 ? 8 : 0), t = t0 + 8 * (jr >> 2) + 2 * (l & 3) + (r & 1);
        if (n < N && t < T) {
            float* o = y + (size_t)t * N + n;
            *o = accumulate ? *o + v : v;
        }
    }
}

extern "C" __global__ __launch_bounds__(32 * GEMV_MMA_WARPS, 2) void gemv_mma_bf16(GEMV_MMA_PARAMS) {
    pdl_enter();
    gemv_mma<GEMV_MMA_WARPS, 1>(GEMV_MMA_ARGS);
}

extern "C" __global__ __launch_bounds__(64 * GEMV_MMA_WARPS) void gemv_mma_bf16_w16(GEMV_MMA_PARAMS) {
    pdl_enter();
    gemv_mma<2 * GEMV_MMA_WARPS, 1>(GEMV_MMA_ARGS);
}

extern "C" __global__ __launch_bounds__(32 * GEMV_MMA_WARPS) void gemv_mma_bf16_r32(GEMV_MMA_PARAMS) {
    pdl_enter();
    gemv_mma<GEMV_MMA_WARPS, 2>(GEMV_MMA_ARGS);
}
