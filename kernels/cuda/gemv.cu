// GEMV: decode matrix-vector products over bf16 weights.
// Part of the moe-lanes kernels: compiled together with common.cuh prepended (kernels/src/cuda/kernel.rs).

// y[t, n] = (accumulate ? y[t, n] : 0) + W[n, :] . x[t, :]
// grid (ceil(N / 8), T), block 256: one warp per output row, one grid row per token.
extern "C" __global__ void gemv_bf16(const bf16* __restrict__ W, const float* __restrict__ x,
                                     float* __restrict__ y, int N, int K, int accumulate) {
    int n = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
    int t = blockIdx.y;
    if (n >= N) return;
    float d = warp_dot_bf16(W + (size_t)n * K, x + (size_t)t * K, K);
    if ((threadIdx.x & 31) == 0) {
        float* o = y + (size_t)t * N + n;
        *o = accumulate ? *o + d : d;
    }
}

// Three GEMVs over one input in one launch (decode q/k/v): rows 0..N0 of the concatenation go to
// y0 = W0 . x, the next N1 to y1, the last N2 to y2 (no accumulation). Output rows of token t are
// at t * Ni. grid (ceil((N0 + N1 + N2) / 8), T), block 256: one warp per output row.
extern "C" __global__ void gemv3_bf16(const bf16* __restrict__ W0, const bf16* __restrict__ W1,
                                      const bf16* __restrict__ W2, const float* __restrict__ x,
                                      float* __restrict__ y0, float* __restrict__ y1, float* __restrict__ y2,
                                      int N0, int N1, int N2, int K) {
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
