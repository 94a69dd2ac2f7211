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
