// RMSNorm and RoPE (separate and fused with per-head q/k norms).
// Part of the moe-lanes kernels: compiled together with common.cuh prepended (kernels/src/cuda/kernel.rs).

// One row of `dim` per block: y = x * rsqrt(mean(x^2) + eps) * w. In place allowed (x == y).
// Per-head q/k norms: rows = T * heads, dim = head_dim. grid (rows), block 256.
extern "C" __global__ void rmsnorm_f32(const float* x, const float* __restrict__ w, float* y, int dim, float eps) {
    pdl_enter();
    norm_row_to(x + (size_t)blockIdx.x * dim, w, dim, eps, y + (size_t)blockIdx.x * dim);
}

// The rotation of pair i of a head of hd at position pos: angle pos * theta^(-2i/hd) in double,
// as the reference computes it.
__device__ __forceinline__ void rope_angle(int i, int hd, float theta, double pos, float* s, float* c) {
    double inv_freq = 1.0 / pow((double)theta, 2.0 * (double)i / (double)hd);
    double ds, dc;
    sincos(pos * inv_freq, &ds, &dc);  // one argument reduction for both
    *s = (float)ds, *c = (float)dc;
}

// RoPE for token t (position pos0 + t), head h: rotate pairs (i, i + rot/2) (half_split) or
// (2i, 2i + 1) (interleaved) of the first rot values (rot <= head_dim; partial RoPE leaves the rest)
// by pos * theta^(-2i/rot), angles in double as the reference does.
// x rows are [T, row_stride]; heads at h * head_dim. grid (T, n_heads), block 64.
extern "C" __global__ void rope_f32(float* x, int row_stride, int head_dim, int rot, int pos0, float theta,
                                    int interleaved) {
    pdl_enter();
    int t = blockIdx.x, h = blockIdx.y, half = rot / 2;
    float* xh = x + (size_t)t * row_stride + (size_t)h * head_dim;
    double pos = (double)(pos0 + t);
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float s, c;
        rope_angle(i, rot, theta, pos, &s, &c);
        int a = interleaved ? 2 * i : i;
        int b = interleaved ? 2 * i + 1 : i + half;
        float x0 = xh[a], x1 = xh[b];
        xh[a] = x0 * c - x1 * s;
        xh[b] = x1 * c + x0 * s;
    }
}

// One value into a KV cache row of f32 (kv_half 0) or f16 (kv_half 1).
__device__ __forceinline__ void kv_store(void* cache, size_t i, float x, int kv_half) {
    if (kv_half)
        ((__half*)cache)[i] = __float2half_rn(x);
    else
        ((float*)cache)[i] = x;
}

// Fused decode/prefill q/k post-processing: optional per-head RMSNorm (qw / kw, null for none),
// then RoPE of the first rot values of each head (rot < hd: partial RoPE, the rest normed only), for
// the nh query heads and nkv key heads of token t (position pos0 + t). Same math and
// summation order as rmsnorm_f32 (block 256) followed by rope_f32. grid (T, nh + nkv), block 256.
// Appending (kc non-null: the decode graph, and prefill into an f16 cache): the roped key heads
// go to the key cache row pos0 + t instead of back into k, and nkv more blocks (grid (T, nh + 2
// nkv)) copy the value heads of v into the value cache row pos0 + t (rows of kv_dim = k_stride),
// both converted to the cache's type (kv_half: f16, else f32). pos_ptr non-null (the decode
// graph): the position comes from device memory, so a captured graph replays for every token.
extern "C" __global__ void qk_norm_rope_f32(float* q, float* k, const float* __restrict__ qw,
                                            const float* __restrict__ kw, int q_stride, int k_stride, int nh,
                                            int hd, int rot, int pos0, float theta, int interleaved, float eps,
                                            const int* __restrict__ pos_ptr, void* __restrict__ kc,
                                            void* __restrict__ vc, const float* __restrict__ v, int nkv,
                                            int kv_half) {
    pdl_enter();
    int t = blockIdx.x, h = blockIdx.y, half = rot / 2;
    if (pos_ptr) pos0 = *pos_ptr;
    if (kc && h >= nh + nkv) {  // value head copy into the cache
        size_t off = (size_t)(h - nh - nkv) * hd;
        const float* src = v + (size_t)t * k_stride + off;
        size_t dst = (size_t)(pos0 + t) * k_stride + off;
        for (int i = threadIdx.x; i < hd; i += blockDim.x) kv_store(vc, dst + i, src[i], kv_half);
        return;
    }
    bool is_q = h < nh;
    float* xh = is_q ? q + (size_t)t * q_stride + (size_t)h * hd : k + (size_t)t * k_stride + (size_t)(h - nh) * hd;
    bool to_cache = !is_q && kc;
    size_t yc = (size_t)(pos0 + t) * k_stride + (size_t)(h - nh) * hd;
    const float* w = is_q ? qw : kw;
    float inv = 1.f;
    if (w) {
        float ss = 0.f;
        for (int i = threadIdx.x; i < hd; i += blockDim.x) ss += xh[i] * xh[i];
        ss = block_sum(ss);  // ends with a barrier: every read of xh is done
        inv = 1.f / sqrtf(ss / (float)hd + eps);
    }
    double pos = (double)(pos0 + t);
    for (int i = rot + threadIdx.x; i < hd; i += blockDim.x) {  // past the rotated part: norm only
        float y = w ? xh[i] * inv * w[i] : xh[i];
        if (to_cache)
            kv_store(kc, yc + i, y, kv_half);
        else
            xh[i] = y;
    }
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float s, c;
        rope_angle(i, rot, theta, pos, &s, &c);
        int a = interleaved ? 2 * i : i;
        int b = interleaved ? 2 * i + 1 : i + half;
        float x0 = xh[a], x1 = xh[b];
        if (w) {
            x0 = x0 * inv * w[a];
            x1 = x1 * inv * w[b];
        }
        float ya = x0 * c - x1 * s, yb = x1 * c + x0 * s;
        if (to_cache) {
            kv_store(kc, yc + a, ya, kv_half);
            kv_store(kc, yc + b, yb, kv_half);
        } else {
            xh[a] = ya;
            xh[b] = yb;
        }
    }
}

// T rows of new keys and values (f32, rows of kv_dim) into the caches' rows pos0.. converted to
// the cache's type (kv_half: f16, else f32): the unfused q/k path's append. grid (T, 2), block 256.
extern "C" __global__ void kv_store_rows(const float* __restrict__ k, const float* __restrict__ v,
                                         void* __restrict__ kc, void* __restrict__ vc, int pos0, int kv_dim,
                                         int kv_half) {
    pdl_enter();
    int t = blockIdx.x;
    const float* src = (blockIdx.y == 0 ? k : v) + (size_t)t * kv_dim;
    void* dst = blockIdx.y == 0 ? kc : vc;
    size_t row = (size_t)(pos0 + t) * kv_dim;
    for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) kv_store(dst, row + i, src[i], kv_half);
}
