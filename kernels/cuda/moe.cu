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

// Causal GQA attention of T query rows (positions pos0..pos0+T-1) against the layer's KV cache,
// which already holds positions 0..pos0+T-1 ([positions, kv_dim] f32). Decode is T = 1.
// window > 0 limits each query to its last `window` positions.
// grid (T, n_heads), block 128, dynamic shared memory: max visible positions * 4 bytes.
extern "C" __global__ void attention_f32(const float* __restrict__ q, const float* __restrict__ kc,
                                         const float* __restrict__ vc, float* __restrict__ out, int pos0,
                                         int n_heads, int n_kv, int hd, int window, float scale) {
    extern __shared__ float sc[];
    int t = blockIdx.x, h = blockIdx.y;
    int pos = pos0 + t;
    int kvh = h / (n_heads / n_kv);
    int kv_dim = n_kv * hd, q_dim = n_heads * hd;
    const float* qh = q + (size_t)t * q_dim + (size_t)h * hd;
    int first = window > 0 ? max(0, pos + 1 - window) : 0;
    int n = pos + 1 - first;
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const float* kr = kc + (size_t)(first + j) * kv_dim + (size_t)kvh * hd;
        float d = 0.f;
        for (int i = 0; i < hd; i++) d += qh[i] * kr[i];
        d *= scale;
        sc[j] = d;
        mx = fmaxf(mx, d);
    }
    mx = block_max(mx);
    float s = 0.f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        float e = expf(sc[j] - mx);
        sc[j] = e;
        s += e;
    }
    s = block_sum(s);
    float inv = 1.f / s;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        float acc = 0.f;
        const float* vr = vc + (size_t)first * kv_dim + (size_t)kvh * hd + i;
        for (int j = 0; j < n; j++) acc += sc[j] * vr[(size_t)j * kv_dim];
        out[(size_t)t * q_dim + (size_t)h * hd + i] = acc * inv;
    }
}

// Index of the largest value per row (first on ties). grid (rows), block 256.
extern "C" __global__ void argmax_f32(const float* __restrict__ x, int n, int* __restrict__ out) {
    __shared__ float sv[256];
    __shared__ int si[256];
    const float* xr = x + (size_t)blockIdx.x * n;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
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
// variant 1: top-k on logits, then softmax over the k. grid ceil(T/64), block 64.
extern "C" __global__ void route_topk(const float* __restrict__ logits, int T, int E, int k, int variant,
                                      int norm, int* __restrict__ ids, float* __restrict__ weights) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    const float* l = logits + (size_t)t * E;
    float pv = INFINITY;
    int pi = -1;
    for (int j = 0; j < k; j++) {
        float bv = -INFINITY;
        int bi = -1;
        for (int e = 0; e < E; e++) {
            float v = l[e];
            bool after = (v < pv) || (v == pv && e > pi);
            if (!after) continue;
            if (bi < 0 || v > bv) { bv = v; bi = e; }
        }
        ids[t * k + j] = bi;
        weights[t * k + j] = bv;
        pv = bv;
        pi = bi;
    }
    float mx = weights[t * k];  // the largest logit overall
    if (variant == 0) {
        float sum = 0.f;
        for (int e = 0; e < E; e++) sum += expf(l[e] - mx);
        float sel = 0.f;
        for (int j = 0; j < k; j++) {
            float p = expf(weights[t * k + j] - mx) / sum;
            weights[t * k + j] = p;
            sel += p;
        }
        if (norm)
            for (int j = 0; j < k; j++) weights[t * k + j] /= sel;
    } else {
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
    if (r >= ff) return;
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
