// moe-lanes CUDA kernels. Compiled at start-up with NVRTC for the device's own architecture
// (kernels/src/cuda/mod.rs). Conventions: weights are bf16 row-major [out, in]; activations,
// norms, biases and the KV cache are f32; every kernel states its launch configuration.
#include <cuda_bf16.h>

typedef __nv_bfloat16 bf16;

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

#define WARP 32
#define ROWS_PER_BLOCK 8  // warps per block in the warp-per-row kernels (block = 256 threads)

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide reductions; every thread of the block must call them.
__device__ float block_sum(float v) {
    __shared__ float s[33];
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    if (lane == 0) s[wid] = v;
    __syncthreads();
    if (wid == 0) {
        float t = lane < nw ? s[lane] : 0.f;
        t = warp_sum(t);
        if (lane == 0) s[32] = t;
    }
    __syncthreads();
    float r = s[32];
    __syncthreads();
    return r;
}

__device__ float block_max(float v) {
    __shared__ float s[33];
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    if (lane == 0) s[wid] = v;
    __syncthreads();
    if (wid == 0) {
        float t = lane < nw ? s[lane] : -INFINITY;
        t = warp_max(t);
        if (lane == 0) s[32] = t;
    }
    __syncthreads();
    float r = s[32];
    __syncthreads();
    return r;
}

__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }

// Dot product of a bf16 row with an f32 vector, one warp, result in every lane.
__device__ __forceinline__ float warp_dot_bf16(const bf16* __restrict__ w, const float* __restrict__ x, int k) {
    float acc = 0.f;
    if ((k & 7) == 0 && ((((size_t)w) & 15) == 0) && ((((size_t)x) & 15) == 0)) {
        const uint4* w8 = (const uint4*)w;
        const float4* x4 = (const float4*)x;
        int n8 = k >> 3;
        for (int i = threadIdx.x & 31; i < n8; i += WARP) {
            uint4 p = w8[i];
            float4 a = x4[2 * i], b = x4[2 * i + 1];
            const __nv_bfloat162* h = (const __nv_bfloat162*)&p;
            float2 f0 = __bfloat1622float2(h[0]), f1 = __bfloat1622float2(h[1]);
            float2 f2 = __bfloat1622float2(h[2]), f3 = __bfloat1622float2(h[3]);
            acc += f0.x * a.x + f0.y * a.y + f1.x * a.z + f1.y * a.w;
            acc += f2.x * b.x + f2.y * b.y + f3.x * b.z + f3.y * b.w;
        }
    } else {
        for (int i = threadIdx.x & 31; i < k; i += WARP) acc += __bfloat162float(w[i]) * x[i];
    }
    return warp_sum(acc);
}

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

// One row of `dim` per block: y = x * rsqrt(mean(x^2) + eps) * w. In place allowed (x == y).
// Per-head q/k norms: rows = T * heads, dim = head_dim. grid (rows), block 256.
extern "C" __global__ void rmsnorm_f32(const float* x, const float* __restrict__ w, float* y, int dim, float eps) {
    const float* xr = x + (size_t)blockIdx.x * dim;
    float* yr = y + (size_t)blockIdx.x * dim;
    float ss = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss);
    float inv = 1.f / sqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) yr[i] = xr[i] * inv * w[i];
}

// x[r, :] += b for every row. grid ceil(rows*dim/256), block 256.
extern "C" __global__ void add_bias_rows(float* x, const float* __restrict__ b, int rows, int dim) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (size_t)rows * dim) x[i] += b[i % dim];
}

// x = clamp(x, -c, c). grid ceil(n/256), block 256.
extern "C" __global__ void clamp_f32(float* x, int n, float c) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = fminf(fmaxf(x[i], -c), c);
}

// acc += x. grid ceil(n/256), block 256.
extern "C" __global__ void add_f32(float* acc, const float* __restrict__ x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) acc[i] += x[i];
}

// out = silu(g) * u. grid ceil(n/256), block 256.
extern "C" __global__ void silu_mul_f32(const float* g, const float* u, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = silu(g[i]) * u[i];
}

// RoPE for token t (position pos0 + t), head h: rotate pairs (i, i + d/2) (half_split) or
// (2i, 2i + 1) (interleaved) by pos * theta^(-2i/d), angles in double as the reference does.
// x rows are [T, row_stride]; heads at h * head_dim. grid (T, n_heads), block 64.
extern "C" __global__ void rope_f32(float* x, int row_stride, int head_dim, int pos0, float theta, int interleaved) {
    int t = blockIdx.x, h = blockIdx.y, half = head_dim / 2;
    float* xh = x + (size_t)t * row_stride + (size_t)h * head_dim;
    double pos = (double)(pos0 + t);
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        double inv_freq = 1.0 / pow((double)theta, 2.0 * (double)i / (double)head_dim);
        double ang = pos * inv_freq;
        float s = (float)sin(ang), c = (float)cos(ang);
        int a = interleaved ? 2 * i : i;
        int b = interleaved ? 2 * i + 1 : i + half;
        float x0 = xh[a], x1 = xh[b];
        xh[a] = x0 * c - x1 * s;
        xh[b] = x1 * c + x0 * s;
    }
}

// Fused decode/prefill q/k post-processing: optional per-head RMSNorm (qw / kw, null for none),
// then RoPE, for the nh query heads and nkv key heads of token t (position pos0 + t). Same math and
// summation order as rmsnorm_f32 (block 256) followed by rope_f32. grid (T, nh + nkv), block 256.
extern "C" __global__ void qk_norm_rope_f32(float* q, float* k, const float* __restrict__ qw,
                                            const float* __restrict__ kw, int q_stride, int k_stride, int nh,
                                            int hd, int pos0, float theta, int interleaved, float eps) {
    int t = blockIdx.x, h = blockIdx.y, half = hd / 2;
    bool is_q = h < nh;
    float* xh = is_q ? q + (size_t)t * q_stride + (size_t)h * hd : k + (size_t)t * k_stride + (size_t)(h - nh) * hd;
    const float* w = is_q ? qw : kw;
    float inv = 1.f;
    if (w) {
        float ss = 0.f;
        for (int i = threadIdx.x; i < hd; i += blockDim.x) ss += xh[i] * xh[i];
        ss = block_sum(ss);  // ends with a barrier: every read of xh is done
        inv = 1.f / sqrtf(ss / (float)hd + eps);
    }
    double pos = (double)(pos0 + t);
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        double inv_freq = 1.0 / pow((double)theta, 2.0 * (double)i / (double)hd);
        double ang = pos * inv_freq;
        float s = (float)sin(ang), c = (float)cos(ang);
        int a = interleaved ? 2 * i : i;
        int b = interleaved ? 2 * i + 1 : i + half;
        float x0 = xh[a], x1 = xh[b];
        if (w) {
            x0 = x0 * inv * w[a];
            x1 = x1 * inv * w[b];
        }
        xh[a] = x0 * c - x1 * s;
        xh[b] = x1 * c + x0 * s;
    }
}

// Causal GQA attention of T query rows (positions pos0..pos0+T-1) against the layer's KV cache,
// which already holds positions 0..pos0+T-1 ([positions, kv_dim] f32). Decode is T = 1.
// window > 0 limits each query to its last `window` positions. head_dim <= 256.
// Scores: one warp per position (coalesced K rows, 4 positions in flight per warp); values: each
// warp accumulates its positions for all dims, then the warps' partials are summed.
// grid (T, n_heads), block 256, dynamic shared memory: max(visible positions, 8 * hd) * 4 bytes.
#define ATT_MAXC 8  // head_dim / 32, at most
extern "C" __global__ void attention_f32(const float* __restrict__ q, const float* __restrict__ kc,
                                         const float* __restrict__ vc, float* __restrict__ out, int pos0,
                                         int n_heads, int n_kv, int hd, int window, float scale) {
    extern __shared__ float sc[];
    int t = blockIdx.x, h = blockIdx.y;
    int pos = pos0 + t;
    int kvh = h / (n_heads / n_kv);
    int kv_dim = n_kv * hd, q_dim = n_heads * hd;
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const float* qh = q + (size_t)t * q_dim + (size_t)h * hd;
    const float* kb = kc + (size_t)kvh * hd;
    const float* vb = vc + (size_t)kvh * hd;
    int first = window > 0 ? max(0, pos + 1 - window) : 0;
    int n = pos + 1 - first;
    float qr[ATT_MAXC];
#pragma unroll
    for (int c = 0; c < ATT_MAXC; c++) {
        int i = lane + 32 * c;
        qr[c] = i < hd ? qh[i] : 0.f;
    }
    float mx = -INFINITY;
    for (int j0 = wid; j0 < n; j0 += 4 * nw) {
        float d[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int j = j0 + u * nw;
            d[u] = 0.f;
            if (j < n) {
                const float* kr = kb + (size_t)(first + j) * kv_dim;
#pragma unroll
                for (int c = 0; c < ATT_MAXC; c++) {
                    int i = lane + 32 * c;
                    if (i < hd) d[u] += qr[c] * kr[i];
                }
            }
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int j = j0 + u * nw;
            float v = warp_sum(d[u]) * scale;
            if (j < n) {
                if (lane == 0) sc[j] = v;
                mx = fmaxf(mx, v);
            }
        }
    }
    mx = block_max(mx);
    float s = 0.f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        float e = expf(sc[j] - mx);
        sc[j] = e;
        s += e;
    }
    s = block_sum(s);
    float acc[ATT_MAXC];
#pragma unroll
    for (int c = 0; c < ATT_MAXC; c++) acc[c] = 0.f;
#pragma unroll 4
    for (int j = wid; j < n; j += nw) {
        float p = sc[j];
        const float* vr = vb + (size_t)(first + j) * kv_dim;
#pragma unroll
        for (int c = 0; c < ATT_MAXC; c++) {
            int i = lane + 32 * c;
            if (i < hd) acc[c] += p * vr[i];
        }
    }
    __syncthreads();  // every warp is done with the scores: reuse sc for the partials
#pragma unroll
    for (int c = 0; c < ATT_MAXC; c++) {
        int i = lane + 32 * c;
        if (i < hd) sc[wid * hd + i] = acc[c];
    }
    __syncthreads();
    float inv = 1.f / s;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        float a = 0.f;
        for (int w = 0; w < nw; w++) a += sc[w * hd + i];
        out[(size_t)t * q_dim + (size_t)h * hd + i] = a * inv;
    }
}

// Split-position ("flash-decoding") attention, pass 1: block (s, h, t) scores the ATT_CHUNK
// positions s*ATT_CHUNK.. of query row t / head h (one per warp-slot, all loads in flight at once)
// and writes a partial (max m, sum l of exp(score - m), acc[hd] = sum exp(score - m) * v) to
// part[((t * n_heads + h) * splits + s) * (hd + 2)]: acc, then m, then l. An empty chunk writes
// m = -inf, l = 0, acc = 0. grid (splits, n_heads, T), block 256 (8 warps x 4 positions).
#define ATT_CHUNK 32
extern "C" __global__ void attention_split_f32(const float* __restrict__ q, const float* __restrict__ kc,
                                               const float* __restrict__ vc, float* __restrict__ part, int pos0,
                                               int n_heads, int n_kv, int hd, int window, float scale, int splits) {
    __shared__ float sc[ATT_CHUNK];
    __shared__ float red[8 * 256];
    int s = blockIdx.x, h = blockIdx.y, t = blockIdx.z;
    int pos = pos0 + t;
    int kvh = h / (n_heads / n_kv);
    int kv_dim = n_kv * hd, q_dim = n_heads * hd;
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    int first = window > 0 ? max(0, pos + 1 - window) : 0;
    int n = pos + 1 - first;
    int j0 = s * ATT_CHUNK, cnt = min(ATT_CHUNK, n - j0);
    float* pr = part + ((size_t)(t * n_heads + h) * splits + s) * (hd + 2);
    if (cnt <= 0) {
        for (int i = threadIdx.x; i < hd; i += blockDim.x) pr[i] = 0.f;
        if (threadIdx.x == 0) {
            pr[hd] = -INFINITY;
            pr[hd + 1] = 0.f;
        }
        return;
    }
    const float* qh = q + (size_t)t * q_dim + (size_t)h * hd;
    const float* kb = kc + (size_t)kvh * hd + (size_t)(first + j0) * kv_dim;
    const float* vb = vc + (size_t)kvh * hd + (size_t)(first + j0) * kv_dim;
    float qr[ATT_MAXC];
#pragma unroll
    for (int c = 0; c < ATT_MAXC; c++) {
        int i = lane + 32 * c;
        qr[c] = i < hd ? qh[i] : 0.f;
    }
    float d[4];
#pragma unroll
    for (int u = 0; u < 4; u++) {
        int j = wid + 8 * u;
        d[u] = 0.f;
        if (j < cnt) {
            const float* kr = kb + (size_t)j * kv_dim;
#pragma unroll
            for (int c = 0; c < ATT_MAXC; c++) {
                int i = lane + 32 * c;
                if (i < hd) d[u] += qr[c] * kr[i];
            }
        }
    }
#pragma unroll
    for (int u = 0; u < 4; u++) {
        int j = wid + 8 * u;
        float v = warp_sum(d[u]) * scale;
        if (lane == 0 && j < cnt) sc[j] = v;
    }
    __syncthreads();
    float m = -INFINITY;
    for (int j = 0; j < cnt; j++) m = fmaxf(m, sc[j]);
    float acc[ATT_MAXC];
#pragma unroll
    for (int c = 0; c < ATT_MAXC; c++) acc[c] = 0.f;
#pragma unroll
    for (int u = 0; u < 4; u++) {
        int j = wid + 8 * u;
        if (j < cnt) {
            float p = expf(sc[j] - m);
            const float* vr = vb + (size_t)j * kv_dim;
#pragma unroll
            for (int c = 0; c < ATT_MAXC; c++) {
                int i = lane + 32 * c;
                if (i < hd) acc[c] += p * vr[i];
            }
        }
    }
#pragma unroll
    for (int c = 0; c < ATT_MAXC; c++) {
        int i = lane + 32 * c;
        if (i < hd) red[wid * hd + i] = acc[c];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        float a = 0.f;
        for (int w = 0; w < 8; w++) a += red[w * hd + i];
        pr[i] = a;
    }
    if (threadIdx.x == 0) {
        float l = 0.f;
        for (int j = 0; j < cnt; j++) l += expf(sc[j] - m);
        pr[hd] = m;
        pr[hd + 1] = l;
    }
}

// Split attention, pass 2: out[t, h, :] = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M) with
// M = max_s m_s. grid (n_heads, T), block 128.
extern "C" __global__ void attention_combine_f32(const float* __restrict__ part, float* __restrict__ out,
                                                 int n_heads, int hd, int splits) {
    int h = blockIdx.x, t = blockIdx.y;
    const float* pr = part + (size_t)(t * n_heads + h) * splits * (hd + 2);
    float M = -INFINITY;
    for (int s = 0; s < splits; s++) M = fmaxf(M, pr[(size_t)s * (hd + 2) + hd]);
    float L = 0.f;
    for (int s = 0; s < splits; s++) {
        const float* ps = pr + (size_t)s * (hd + 2);
        L += ps[hd + 1] * expf(ps[hd] - M);
    }
    float inv = 1.f / L;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        float a = 0.f;
        for (int s = 0; s < splits; s++) {
            const float* ps = pr + (size_t)s * (hd + 2);
            a += ps[i] * expf(ps[hd] - M);
        }
        out[((size_t)t * n_heads + h) * hd + i] = a * inv;
    }
}

// Index of the largest value per row (first on ties). grid (rows), block 1024.
extern "C" __global__ void argmax_f32(const float* __restrict__ x, int n, int* __restrict__ out) {
    __shared__ float sv[1024];
    __shared__ int si[1024];
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
    int r = blockIdx.x;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int b = threadIdx.x; b < nb; b += blockDim.x)
        argmax_merge(bv, bi, part[((size_t)r * nb + b) * 2], __float_as_int(part[((size_t)r * nb + b) * 2 + 1]));
    block_argmax(bv, bi);
    if (threadIdx.x == 0) out[r] = bi == 0x7fffffff ? 0 : bi;
}

// out[t, :] = table[tokens[t], :] as f32. grid (T), block 256.
extern "C" __global__ void embed_bf16(const bf16* __restrict__ table, const int* __restrict__ tokens,
                                      float* __restrict__ out, int hidden) {
    const bf16* row = table + (size_t)tokens[blockIdx.x] * hidden;
    float* o = out + (size_t)blockIdx.x * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = __bfloat162float(row[i]);
}

// f32 -> bf16 hi (+ optional bf16 lo = x - hi) for cuBLAS inputs; hi + lo carries ~16 bits of
// mantissa. Gathers rows: src row = rows ? rows[r] : r. grid (n_rows), block 256.
extern "C" __global__ void gather_split_bf16(const float* __restrict__ x, const int* __restrict__ rows,
                                             bf16* __restrict__ hi, bf16* __restrict__ lo, int dim) {
    int r = blockIdx.x;
    const float* xr = x + (size_t)(rows ? rows[r] : r) * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = xr[i];
        bf16 h = __float2bfloat16_rn(v);
        hi[(size_t)r * dim + i] = h;
        if (lo) lo[(size_t)r * dim + i] = __float2bfloat16_rn(v - __bfloat162float(h));
    }
}

// out[r, :] = x[rows[r], :]. grid (n_rows), block 256.
extern "C" __global__ void gather_rows_f32(const float* __restrict__ x, const int* __restrict__ rows,
                                           float* __restrict__ out, int dim) {
    const float* xr = x + (size_t)rows[blockIdx.x] * dim;
    float* o = out + (size_t)blockIdx.x * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = xr[i];
}

// out[rows[r], :] += src[r, :] (rows distinct). grid (n_rows), block 256.
extern "C" __global__ void scatter_add_rows_f32(const float* __restrict__ src, const int* __restrict__ rows,
                                                float* __restrict__ out, int dim) {
    const float* s = src + (size_t)blockIdx.x * dim;
    float* o = out + (size_t)rows[blockIdx.x] * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] += s[i];
}

// out[t, :] += sigmoid(gate_logit[t]) * x[t, :] (shared expert). grid (T), block 256.
extern "C" __global__ void add_sigmoid_scaled_rows(float* __restrict__ out, const float* __restrict__ x,
                                                   const float* __restrict__ gate_logit, int dim) {
    float g = 1.f / (1.f + expf(-gate_logit[blockIdx.x]));
    const float* xr = x + (size_t)blockIdx.x * dim;
    float* o = out + (size_t)blockIdx.x * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] += g * xr[i];
}

// Router: top-k expert ids and weights per token from logits [T, E]. Ties go to the lower id.
// variant 0: softmax over all experts, then top-k (renormalised when norm != 0);
// variant 1: top-k on logits, then softmax over the k. One warp per token: each of the k rounds
// is a warp argmax (larger value, then lower id) over the experts after the previous pick.
// grid ceil(T/8), block 256.
extern "C" __global__ void route_topk(const float* __restrict__ logits, int T, int E, int k, int variant,
                                      int norm, int* __restrict__ ids, float* __restrict__ weights) {
    int t = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (t >= T) return;  // whole warps
    const float* l = logits + (size_t)t * E;
    float pv = INFINITY;
    int pi = -1;
    float mx = -INFINITY;
    for (int j = 0; j < k; j++) {
        float bv = -INFINITY;
        int bi = -1;
        for (int e = lane; e < E; e += WARP) {
            float v = l[e];
            bool after = (v < pv) || (v == pv && e > pi);
            if (!after) continue;
            if (bi < 0 || v > bv) { bv = v; bi = e; }
        }
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) { bv = ov; bi = oi; }
        }
        if (lane == 0) {
            ids[t * k + j] = bi;
            weights[t * k + j] = bv;
        }
        if (j == 0) mx = bv;  // the largest logit overall
        pv = bv;
        pi = bi;
    }
    if (variant == 0) {
        float sum = 0.f;
        for (int e = lane; e < E; e += WARP) sum += expf(l[e] - mx);
        sum = warp_sum(sum);
        if (lane == 0) {
            float sel = 0.f;
            for (int j = 0; j < k; j++) {
                float p = expf(weights[t * k + j] - mx) / sum;
                weights[t * k + j] = p;
                sel += p;
            }
            if (norm)
                for (int j = 0; j < k; j++) weights[t * k + j] /= sel;
        }
    } else if (lane == 0) {
        float sum = 0.f;
        for (int j = 0; j < k; j++) sum += expf(weights[t * k + j] - mx);
        for (int j = 0; j < k; j++) weights[t * k + j] = expf(weights[t * k + j] - mx) / sum;
    }
}

// Hot lane, decode: for worklist entry e (cache slot slots[e], token row tokens[e]),
// h[e, r] = silu(G_s[r] . x_t) * (U_s[r] . x_t) over the per-layer cache [n_slots, ff, hidden].
// grid (ceil(ff/8), n_entries), block 256: one warp per ff row.
extern "C" __global__ void moe_gate_up_gemv(const bf16* __restrict__ G, const bf16* __restrict__ U,
                                            const float* __restrict__ x, const int* __restrict__ slots,
                                            const int* __restrict__ tokens, float* __restrict__ h, int ff,
                                            int hidden) {
    int r = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
    int e = blockIdx.y;
    if (r >= ff || slots[e] < 0) return;  // slot -1: a cold entry of a device-built worklist
    size_t off = ((size_t)slots[e] * ff + r) * hidden;
    const float* xt = x + (size_t)tokens[e] * hidden;
    float g = warp_dot_bf16(G + off, xt, hidden);
    float u = warp_dot_bf16(U + off, xt, hidden);
    if ((threadIdx.x & 31) == 0) h[(size_t)e * ff + r] = silu(g) * u;
}

// Hot lane, decode: weighted down projections accumulated into token rows, deterministic (no
// atomics): output row i is token tok_rows[i], whose entries are tok_off[i]..tok_off[i+1]
// (token-major worklist). out[t, r] += sum_e weights[e] * (D_{slots[e]}[r] . h[e]).
// D is the cache [n_slots, hidden, ff]. grid (ceil(hidden/8), n_rows), block 256.
extern "C" __global__ void moe_down_accum(const bf16* __restrict__ D, const float* __restrict__ h,
                                          const int* __restrict__ slots, const float* __restrict__ weights,
                                          const int* __restrict__ tok_off, const int* __restrict__ tok_rows,
                                          float* __restrict__ out, int hidden, int ff) {
    int r = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
    int i = blockIdx.y;
    if (r >= hidden) return;
    float acc = 0.f;
    for (int e = tok_off[i]; e < tok_off[i + 1]; e++) {
        if (slots[e] < 0) continue;  // cold entry (device-built worklist)
        float d = warp_dot_bf16(D + ((size_t)slots[e] * hidden + r) * ff, h + (size_t)e * ff, ff);
        acc += weights[e] * d;
    }
    if ((threadIdx.x & 31) == 0) out[(size_t)tok_rows[i] * hidden + r] += acc;
}

// Hot lane, prefill: after the expert-major grouped GEMMs, y holds one row per entry. Output row i
// (token tok_rows[i]) adds its entries entries[tok_off[i]..tok_off[i+1]] weighted.
// grid (n_rows), block 256.
extern "C" __global__ void moe_scatter_accum(const float* __restrict__ y, const int* __restrict__ entries,
                                             const float* __restrict__ weights, const int* __restrict__ tok_off,
                                             const int* __restrict__ tok_rows, float* __restrict__ out, int hidden) {
    int i = blockIdx.x;
    float* o = out + (size_t)tok_rows[i] * hidden;
    for (int d = threadIdx.x; d < hidden; d += blockDim.x) {
        float acc = 0.f;
        for (int j = tok_off[i]; j < tok_off[i + 1]; j++) {
            int e = entries[j];
            acc += weights[e] * y[(size_t)e * hidden + d];
        }
        o[d] += acc;
    }
}

// Decode hot worklist built on the GPU from the router's ids, token-major with every routed entry:
// entry e = t * k + j has slot map[ids[e]] (-1 for a cold expert or an out-of-range id; the hot
// kernels skip it) and token t; token row r is token r with entries r*k..(r+1)*k.
// grid ceil(max(T*k, T+1)/256), block 256.
extern "C" __global__ void hot_worklist_tokens(const int* __restrict__ map, const int* __restrict__ ids, int T,
                                               int k, int E, int* __restrict__ slots, int* __restrict__ tokens,
                                               int* __restrict__ tok_off, int* __restrict__ tok_rows) {
    int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e < T * k) {
        int id = ids[e];
        slots[e] = (id >= 0 && id < E) ? map[id] : -1;
        tokens[e] = e / k;
    }
    if (e < T) tok_rows[e] = e;
    if (e <= T) tok_off[e] = e * k;
}
