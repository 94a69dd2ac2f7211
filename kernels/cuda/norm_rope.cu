// RMSNorm and RoPE (separate and fused with per-head q/k norms).
// Part of the moe-lanes kernels: compiled together with common.cuh prepended (kernels/src/cuda/kernel.rs).

// One row of `dim` per block: y = x * rsqrt(mean(x^2) + eps) * w. In place allowed (x == y).
// Per-head q/k norms: rows = T * heads, dim = head_dim. grid (rows), block 256.
extern "C" __global__ void rmsnorm_f32(const float* x, const float* __restrict__ w, float* y, int dim, float eps) {
    pdl_enter();
    norm_row_to(x + (size_t)blockIdx.x * dim, w, dim, eps, y + (size_t)blockIdx.x * dim);
}

// The rotation of pair i of a head of hd at position pos: angle pos * theta^(-2i/hd) in double,
// as the reference computes it; with a frequency table (freqs non-null: YaRN, computed on the
// host as the reference does) pos * freqs[i], and sin/cos scaled by `scale` (YaRN's attention
// factor; 1 otherwise, which leaves the values as they were).
__device__ __forceinline__ void rope_angle(int i, int hd, float theta, double pos, float* s, float* c,
                                           const double* __restrict__ freqs, float scale) {
    double inv_freq = freqs ? freqs[i] : 1.0 / pow((double)theta, 2.0 * (double)i / (double)hd);
    double ds, dc;
    sincos(pos * inv_freq, &ds, &dc);  // one argument reduction for both
    *s = (float)(ds * (double)scale), *c = (float)(dc * (double)scale);
}

// RoPE for token t (position pos0 + t), head h: rotate pairs (i, i + rot/2) (half_split) or
// (2i, 2i + 1) (interleaved) of the first rot values (rot <= head_dim; partial RoPE leaves the rest)
// by pos * theta^(-2i/rot), angles in double as the reference does.
// x rows are [T, row_stride]; heads at h * head_dim. grid (T, n_heads), block 64.
extern "C" __global__ void rope_f32(float* x, int row_stride, int head_dim, int rot, int pos0, float theta,
                                    int interleaved, const double* __restrict__ freqs, float scale) {
    pdl_enter();
    int t = blockIdx.x, h = blockIdx.y, half = rot / 2;
    float* xh = x + (size_t)t * row_stride + (size_t)h * head_dim;
    double pos = (double)(pos0 + t);
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float s, c;
        rope_angle(i, rot, theta, pos, &s, &c, freqs, scale);
        int a = interleaved ? 2 * i : i;
        int b = interleaved ? 2 * i + 1 : i + half;
        float x0 = xh[a], x1 = xh[b];
        xh[a] = x0 * c - x1 * s;
        xh[b] = x1 * c + x0 * s;
    }
}

// KV cache types (kv_type, as the launchers' KvPtr::type_code): f32, f16, bf16 (both rounded to
// nearest even), q8_0 (llama.cpp's blocks of 32: f16 d = max|x| / 127, then 32 int8 round(x / d)).
#define KV_F32 0
#define KV_F16 1
#define KV_BF16 2
#define KV_Q8_0 3
// The most values of one q8_0 head row staged in shared memory (the launchers check hd).
#define KV_STAGE_MAX 512

// One value into a KV cache of f32, f16 or bf16 (value index i).
__device__ __forceinline__ void kv_store(void* cache, size_t i, float x, int kv_type) {
    if (kv_type == KV_F16)
        ((__half*)cache)[i] = __float2half_rn(x);
    else if (kv_type == KV_BF16)
        ((bf16*)cache)[i] = __float2bfloat16_rn(x);
    else
        ((float*)cache)[i] = x;
}

// n values of src (n % 32 == 0) into a q8_0 cache from value index i (i % 32 == 0): each warp of
// the block quantizes whole blocks (lane = value), as llama.cpp's quantize_row_q8_0_ref.
__device__ __forceinline__ void kv_store_q8_0(void* cache, size_t i, const float* src, int n) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    unsigned char* base = (unsigned char*)cache + (i / 32) * 34;
    for (int b = wid; b < n / 32; b += nw) {
        float x = src[32 * b + lane];
        float d = warp_max(fabsf(x)) / 127.f;
        float id = d != 0.f ? 1.f / d : 0.f;
        unsigned char* blk = base + (size_t)b * 34;
        blk[2 + lane] = (unsigned char)(signed char)roundf(x * id);
        if (lane == 0) *(__half*)blk = __float2half_rn(d);
    }
}

// n values of src into the cache row from value index i, every thread of the block taking part.
__device__ __forceinline__ void kv_store_row(void* cache, size_t i, const float* src, int n, int kv_type) {
    if (kv_type == KV_Q8_0) {
        kv_store_q8_0(cache, i, src, n);
        return;
    }
    for (int j = threadIdx.x; j < n; j += blockDim.x) kv_store(cache, i + j, src[j], kv_type);
}

// Fused decode/prefill q/k post-processing: optional per-head RMSNorm (qw / kw, null for none),
// then RoPE of the first rot values of each head (rot < hd: partial RoPE, the rest normed only), for
// the nh query heads and nkv key heads of token t (position pos0 + t). Same math and
// summation order as rmsnorm_f32 (block 256) followed by rope_f32. grid (T, nh + nkv), block 256.
// Appending (kc non-null: the decode graph, and prefill into an f16 cache): the roped key heads
// go to the key cache row pos0 + t instead of back into k, and nkv more blocks (grid (T, nh + 2
// nkv)) copy the value heads of v into the value cache row pos0 + t (rows of kv_dim = k_stride),
// both converted to the cache's type (kv_type; q8_0: the roped key head is staged in shared
// memory, then quantized block by block). pos_ptr non-null (the decode graph): the position comes
// from device memory, so a captured graph replays for every token.
// The cache rows position pos is stored at: pos itself without a ring (ring 0); in a sliding-window
// layer's mirrored ring of `ring` positions (attention.cu's kv_ring_base, kernels/src/kv.rs)
// pos % ring and, from pos >= ring on, pos % ring + ring as well (y -1: no second row).
__device__ __forceinline__ int2 kv_ring_rows(int pos, int ring) {
    if (ring <= 0) return make_int2(pos, -1);
    int r = pos % ring;
    return make_int2(r, pos >= ring ? r + ring : -1);
}
// One value into the row offsets at (second < 0: none) of a cache.
__device__ __forceinline__ void kv_store2(void* cache, long long at, long long second, int i, float x, int kv_type) {
    kv_store(cache, (size_t)(at + i), x, kv_type);
    if (second >= 0) kv_store(cache, (size_t)(second + i), x, kv_type);
}
// A row of n values (kv_store_row) at row offsets at and second (< 0: none).
__device__ __forceinline__ void kv_store_row2(void* cache, long long at, long long second, const float* src, int n,
                                              int kv_type) {
    kv_store_row(cache, (size_t)at, src, n, kv_type);
    if (second >= 0) kv_store_row(cache, (size_t)second, src, n, kv_type);
}
// Head h of query row t (its q, k and v rows at t; kc non-null: appended at position pos of the
// caches kc, vc, through the layer's ring when `ring` > 0), the body of qk_norm_rope_f32 and
// qk_norm_rope_rows_f32.
__device__ __forceinline__ void qk_norm_rope_head(float* q, float* k, const float* __restrict__ qw,
                                                  const float* __restrict__ kw, int q_stride, int k_stride, int nh,
                                                  int hd, int rot, float theta, int interleaved, float eps, int t,
                                                  int h, int pos, void* __restrict__ kc, void* __restrict__ vc,
                                                  const float* __restrict__ v, int nkv, int kv_type,
                                                  const double* __restrict__ freqs, float scale, int ring) {
    __shared__ float stage[KV_STAGE_MAX];
    int half = rot / 2;
    const int2 rows = kv_ring_rows(pos, ring);
    if (kc && h >= nh + nkv) {  // value head copy into the cache
        long long off = (long long)(h - nh - nkv) * hd;
        const float* src = v + (size_t)t * k_stride + off;
        long long second = rows.y < 0 ? -1 : (long long)rows.y * k_stride + off;
        kv_store_row2(vc, (long long)rows.x * k_stride + off, second, src, hd, kv_type);
        return;
    }
    bool is_q = h < nh;
    float* xh = is_q ? q + (size_t)t * q_stride + (size_t)h * hd : k + (size_t)t * k_stride + (size_t)(h - nh) * hd;
    bool to_cache = !is_q && kc;
    bool staged = to_cache && kv_type == KV_Q8_0;  // whole blocks: through `stage`
    long long yc = (long long)rows.x * k_stride + (long long)(h - nh) * hd;
    long long ym = rows.y < 0 ? -1 : (long long)rows.y * k_stride + (long long)(h - nh) * hd;
    const float* w = is_q ? qw : kw;
    float inv = 1.f;
    if (w) {
        float ss = 0.f;
        for (int i = threadIdx.x; i < hd; i += blockDim.x) ss += xh[i] * xh[i];
        ss = block_sum(ss);  // ends with a barrier: every read of xh is done
        inv = 1.f / sqrtf(ss / (float)hd + eps);
    }
    double dpos = (double)pos;
    for (int i = rot + threadIdx.x; i < hd; i += blockDim.x) {  // past the rotated part: norm only
        float y = w ? xh[i] * inv * w[i] : xh[i];
        if (staged)
            stage[i] = y;
        else if (to_cache)
            kv_store2(kc, yc, ym, i, y, kv_type);
        else
            xh[i] = y;
    }
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float s, c;
        rope_angle(i, rot, theta, dpos, &s, &c, freqs, scale);
        int a = interleaved ? 2 * i : i;
        int b = interleaved ? 2 * i + 1 : i + half;
        float x0 = xh[a], x1 = xh[b];
        if (w) {
            x0 = x0 * inv * w[a];
            x1 = x1 * inv * w[b];
        }
        float ya = x0 * c - x1 * s, yb = x1 * c + x0 * s;
        if (staged) {
            stage[a] = ya;
            stage[b] = yb;
        } else if (to_cache) {
            kv_store2(kc, yc, ym, a, ya, kv_type);
            kv_store2(kc, yc, ym, b, yb, kv_type);
        } else {
            xh[a] = ya;
            xh[b] = yb;
        }
    }
    if (staged) {
        __syncthreads();  // the head is staged
        kv_store_row2(kc, yc, ym, stage, hd, kv_type);
    }
}
extern "C" __global__ void qk_norm_rope_f32(float* q, float* k, const float* __restrict__ qw,
                                            const float* __restrict__ kw, int q_stride, int k_stride, int nh,
                                            int hd, int rot, int pos0, float theta, int interleaved, float eps,
                                            const int* __restrict__ pos_ptr, void* __restrict__ kc,
                                            void* __restrict__ vc, const float* __restrict__ v, int nkv,
                                            int kv_type, const double* __restrict__ freqs, float scale, int ring) {
    pdl_enter();
    int t = blockIdx.x;
    int pos = (pos_ptr ? *pos_ptr : pos0) + t;
    qk_norm_rope_head(q, k, qw, kw, q_stride, k_stride, nh, hd, rot, theta, interleaved, eps, t, blockIdx.y, pos, kc,
                      vc, v, nkv, kv_type, freqs, scale, ring);
}

// qk_norm_rope_f32 over a batched step's rows, each appended to its own sequence's caches: row t
// at position pos[t] into the caches at kcs[t], vcs[t] (raw device addresses of the launch's cache
// type). grid (T, nh + 2 nkv), block 256.
extern "C" __global__ void qk_norm_rope_rows_f32(float* q, float* k, const float* __restrict__ qw,
                                                 const float* __restrict__ kw, int q_stride, int k_stride, int nh,
                                                 int hd, int rot, float theta, int interleaved, float eps,
                                                 const int* __restrict__ pos, const unsigned long long* __restrict__ kcs,
                                                 const unsigned long long* __restrict__ vcs,
                                                 const float* __restrict__ v, int nkv, int kv_type,
                                                 const double* __restrict__ freqs, float scale, int ring) {
    pdl_enter();
    int t = blockIdx.x;
    qk_norm_rope_head(q, k, qw, kw, q_stride, k_stride, nh, hd, rot, theta, interleaved, eps, t, blockIdx.y, pos[t],
                      (void*)kcs[t], (void*)vcs[t], v, nkv, kv_type, freqs, scale, ring);
}

// T rows of new keys and values (f32, rows of kv_dim) into the caches' rows of positions pos0..
// (through the layer's ring when `ring` > 0) converted to the cache's type (kv_type): the
// unfused q/k path's append. grid (T, 2), block 256.
extern "C" __global__ void kv_store_rows(const float* __restrict__ k, const float* __restrict__ v,
                                         void* __restrict__ kc, void* __restrict__ vc, int pos0, int kv_dim,
                                         int kv_type, int ring) {
    pdl_enter();
    int t = blockIdx.x;
    const float* src = (blockIdx.y == 0 ? k : v) + (size_t)t * kv_dim;
    void* dst = blockIdx.y == 0 ? kc : vc;
    const int2 rows = kv_ring_rows(pos0 + t, ring);
    long long second = rows.y < 0 ? -1 : (long long)rows.y * kv_dim;
    kv_store_row2(dst, (long long)rows.x * kv_dim, second, src, kv_dim, kv_type);
}
