// Greedy tokens: argmax per row, one block per row or split over many blocks.
// Part of the moe-lanes kernels: compiled together with common.cuh prepended (kernels/src/cuda/kernel.rs).

// Index of the largest value per row (first on ties). grid (rows), block ARGMAX_BLOCK (a power of two).
extern "C" __global__ void argmax_f32(const float* __restrict__ x, int n, int* __restrict__ out) {
    pdl_enter();
    __shared__ float sv[ARGMAX_BLOCK];
    __shared__ int si[ARGMAX_BLOCK];
    const float* xr = x + (size_t)blockIdx.x * n;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
#pragma unroll 4
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = xr[i];
        if (v > bv) { bv = v; bi = i; }
    }
    sv[threadIdx.x] = bv;
    si[threadIdx.x] = bi;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            float ov = sv[threadIdx.x + s];
            int oi = si[threadIdx.x + s];
            if (ov > sv[threadIdx.x] || (ov == sv[threadIdx.x] && oi < si[threadIdx.x])) {
                sv[threadIdx.x] = ov;
                si[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = si[0] == 0x7fffffff ? 0 : si[0];
}

// Two-pass argmax over many blocks per row, same result as argmax_f32 (largest value, first index
// on ties, NaNs never win, 0 when nothing beats -inf). Pass 1: block (b, r) reduces its slice of
// row r to (value, index) at part[(r * nb + b) * 2] (index as int bits, INT_MAX for none).
// grid (nb, rows), block 256.
__device__ __forceinline__ void argmax_merge(float& bv, int& bi, float ov, int oi) {
    if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
}
__device__ void block_argmax(float& bv, int& bi) {
    __shared__ float sv[32];
    __shared__ int si[32];
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        argmax_merge(bv, bi, ov, oi);
    }
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    if (lane == 0) { sv[wid] = bv; si[wid] = bi; }
    __syncthreads();
    if (wid == 0) {
        bv = lane < nw ? sv[lane] : -INFINITY;
        bi = lane < nw ? si[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            argmax_merge(bv, bi, ov, oi);
        }
    }
}

extern "C" __global__ void argmax_partial_f32(const float* __restrict__ x, int n, float* __restrict__ part) {
    pdl_enter();
    int b = blockIdx.x, nb = gridDim.x, r = blockIdx.y;
    int chunk = (n + nb - 1) / nb;
    int lo = b * chunk, hi = min(n, lo + chunk);
    const float* xr = x + (size_t)r * n;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float v = xr[i];
        if (v > bv) { bv = v; bi = i; }
    }
    block_argmax(bv, bi);
    if (threadIdx.x == 0) {
        part[((size_t)r * nb + b) * 2] = bv;
        part[((size_t)r * nb + b) * 2 + 1] = __int_as_float(bi);
    }
}

// Pass 2: out[r] from the nb partials of row r. grid (rows), block 32.
extern "C" __global__ void argmax_final_f32(const float* __restrict__ part, int nb, int* __restrict__ out) {
    pdl_enter();
    int r = blockIdx.x;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int b = threadIdx.x; b < nb; b += blockDim.x)
        argmax_merge(bv, bi, part[((size_t)r * nb + b) * 2], __float_as_int(part[((size_t)r * nb + b) * 2 + 1]));
    block_argmax(bv, bi);
    if (threadIdx.x == 0) out[r] = bi == 0x7fffffff ? 0 : bi;
}
