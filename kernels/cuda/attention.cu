// Attention over the KV cache: one block per (token, head), and the split-position decode form.
// Part of the moe-lanes kernels: compiled together with common.cuh prepended (kernels/src/cuda/kernel.rs).

// KV cache elements: the attention kernels are templates over a pointer-like type `KV` that reads
// the cache's values as f32 (`kv_at`: value i; `kv_ld4`: four values at an offset of a multiple of
// 4; `+`: advance by values): `const float*`, `const __half*`, `const bf16*`, or `kv_q8_ptr` over
// llama.cpp's q8_0 blocks (32 values: an f16 scale d, then 32 int8 q; value d * q). Each kernel is
// one code path, instantiated by a thin extern "C" entry point per type (`*_f32`, `*_f16`,
// `*_bf16`, `*_q8_0`), and computes in f32. Reads go through the
// read-only cache (__ldg).
__device__ __forceinline__ float kv_at(const float* p, size_t i) { return __ldg(p + i); }
__device__ __forceinline__ float kv_at(const __half* p, size_t i) {
    return __half2float(__ushort_as_half(__ldg((const unsigned short*)(p + i))));
}
__device__ __forceinline__ float kv_at(const bf16* p, size_t i) {
    return __uint_as_float((unsigned)__ldg((const unsigned short*)(p + i)) << 16);
}
__device__ __forceinline__ float4 kv_ld4(const float* p) { return __ldg((const float4*)p); }
__device__ __forceinline__ float4 kv_ld4(const __half* p) {
    uint2 u = __ldg((const uint2*)p);
    float2 a = __half22float2(*(const __half2*)&u.x), b = __half22float2(*(const __half2*)&u.y);
    return make_float4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ float4 kv_ld4(const bf16* p) {
    uint2 u = __ldg((const uint2*)p);
    return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16),
                       __uint_as_float(u.y & 0xffff0000u));
}

#define KV_Q8_0_BLOCK 32
#define KV_Q8_0_BYTES 34
// A q8_0 cache as a pointer over its values: `off` values past block 0 at `base`.
struct kv_q8_ptr {
    const unsigned char* base;
    size_t off;
    __device__ __forceinline__ kv_q8_ptr operator+(size_t n) const { return kv_q8_ptr{base, off + n}; }
};
__device__ __forceinline__ const unsigned char* kv_q8_block(kv_q8_ptr p, size_t v, float* d) {
    const unsigned char* b = p.base + (v / KV_Q8_0_BLOCK) * KV_Q8_0_BYTES;
    *d = __half2float(__ushort_as_half(__ldg((const unsigned short*)b)));  // blocks of 34: 2-byte aligned
    return b + 2;
}
__device__ __forceinline__ float kv_at(kv_q8_ptr p, size_t i) {
    size_t v = p.off + i;
    float d;
    const unsigned char* q = kv_q8_block(p, v, &d);
    return d * (float)(signed char)__ldg((const char*)q + v % KV_Q8_0_BLOCK);
}
// Four values of one block (the offset a multiple of 4): two 2-byte loads (a block's int8 start
// at 2 mod 4).
__device__ __forceinline__ float4 kv_ld4(kv_q8_ptr p) {
    float d;
    const unsigned char* q = kv_q8_block(p, p.off, &d);
    const unsigned short* u = (const unsigned short*)(q + p.off % KV_Q8_0_BLOCK);
    unsigned short lo = __ldg(u), hi = __ldg(u + 1);
    return make_float4(d * (float)(signed char)(lo & 0xff), d * (float)(signed char)(lo >> 8),
                       d * (float)(signed char)(hi & 0xff), d * (float)(signed char)(hi >> 8));
}

// Each attention kernel's entry points, one per cache type (`*_f32`, `*_f16`, `*_bf16`, `*_q8_0`),
// take the caches as `const T*` and call the kernel's one template with them through kv_wrap
// (q8_0: as kv_q8_ptr).
__device__ __forceinline__ const float* kv_wrap(const float* p) { return p; }
__device__ __forceinline__ const __half* kv_wrap(const __half* p) { return p; }
__device__ __forceinline__ const bf16* kv_wrap(const bf16* p) { return p; }
__device__ __forceinline__ kv_q8_ptr kv_wrap(const unsigned char* p) { return kv_q8_ptr{p, 0}; }

// A sliding-window layer's cache is a mirrored ring (kernels/src/kv.rs, `kv_ring_positions`): of
// R = window + KV_RING_CHUNK positions, position p at row p % R and, from p >= R on, again at
// row p % R + R, so any R consecutive positions lo.. are contiguous rows from lo % R on. A kernel
// reading keys of positions lo..hi (hi - lo < R, none overwritten: a call appends at most
// KV_RING_CHUNK positions) moves its cache pointers back by kv_ring_base(lo, window) rows and
// then addresses rows by position, as a full layer's cache. window 0: base 0, the plain layout.
__device__ __forceinline__ size_t kv_ring_base(int lo, int window) {
    if (window <= 0) return 0;
    int r = window + KV_RING_CHUNK;
    return (size_t)(lo / r) * r;
}
// p moved back by n values (the sum with a later offset wraps back into the buffer).
template <typename T>
__device__ __forceinline__ const T* kv_back(const T* p, size_t n) { return p - n; }
__device__ __forceinline__ kv_q8_ptr kv_back(kv_q8_ptr p, size_t n) { return kv_q8_ptr{p.base, p.off - n}; }
// Both caches moved back for a read of positions lo.. (rows of kv_dim values).
template <typename KV>
__device__ __forceinline__ void kv_ring_back(KV& kc, KV& vc, int lo, int window, size_t kv_dim) {
    const size_t n = kv_ring_base(lo, window) * kv_dim;
    kc = kv_back(kc, n);
    vc = kv_back(vc, n);
}

// The factor that turns a row's accumulated values (max score m, sum l of exp(score - m)) into
// its output. sinks non-null (GPT-OSS): head h's learned sink logit joins the softmax and takes
// its share of the probability while attending nothing. Without sinks: 1 / l, as before.
__device__ __forceinline__ float att_finish(const float* __restrict__ sinks, int h, float m, float l) {
    if (!sinks) return 1.f / l;
    float sk = sinks[h], mn = fmaxf(m, sk), corr = expf(m - mn);
    return corr / (l * corr + expf(sk - mn));
}

// Causal GQA attention of T query rows (positions pos0..pos0+T-1) against the layer's KV cache,
// which already holds positions 0..pos0+T-1 ([positions, kv_dim] f32). Decode is T = 1.
// window > 0 limits each query to its last `window` positions. head_dim <= 256.
// Scores: one warp per position (coalesced K rows, 4 positions in flight per warp); values: each
// warp accumulates its positions for all dims, then the warps' partials are summed.
// grid (T, n_heads), block 256, dynamic shared memory: max(visible positions, 8 * hd) * 4 bytes.
template <typename KV>
__device__ __forceinline__ void attention_rows(const float* __restrict__ q, KV kc,
                                               KV vc, float* __restrict__ out, int pos0,
                                               int n_heads, int n_kv, int hd, int window, float scale,
                                               const float* __restrict__ sinks) {
    extern __shared__ float sc[];
    int t = blockIdx.x, h = blockIdx.y;
    int pos = pos0 + t;
    int kvh = h / (n_heads / n_kv);
    int kv_dim = n_kv * hd, q_dim = n_heads * hd;
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const float* qh = q + (size_t)t * q_dim + (size_t)h * hd;
    KV kb = kc + (size_t)kvh * hd;
    KV vb = vc + (size_t)kvh * hd;
    int first = window > 0 ? max(0, pos + 1 - window) : 0;
    int n = pos + 1 - first;
    kv_ring_back(kb, vb, first, window, kv_dim);
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
                KV kr = kb + (size_t)(first + j) * kv_dim;
#pragma unroll
                for (int c = 0; c < ATT_MAXC; c++) {
                    int i = lane + 32 * c;
                    if (i < hd) d[u] += qr[c] * kv_at(kr, i);
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
        KV vr = vb + (size_t)(first + j) * kv_dim;
#pragma unroll
        for (int c = 0; c < ATT_MAXC; c++) {
            int i = lane + 32 * c;
            if (i < hd) acc[c] += p * kv_at(vr, i);
        }
    }
    __syncthreads();  // every warp is done with the scores: reuse sc for the partials
#pragma unroll
    for (int c = 0; c < ATT_MAXC; c++) {
        int i = lane + 32 * c;
        if (i < hd) sc[wid * hd + i] = acc[c];
    }
    __syncthreads();
    float inv = att_finish(sinks, h, mx, s);
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        float a = 0.f;
        for (int w = 0; w < nw; w++) a += sc[w * hd + i];
        out[(size_t)t * q_dim + (size_t)h * hd + i] = a * inv;
    }
}
extern "C" __global__ void attention_f32(const float* __restrict__ q, const float* __restrict__ kc,
    const float* __restrict__ vc, float* __restrict__ out, int pos0, int n_heads, int n_kv, int hd, int window, float scale,
    const float* __restrict__ sinks) {
    pdl_enter();
    attention_rows(q, kv_wrap(kc), kv_wrap(vc), out, pos0, n_heads, n_kv, hd, window, scale, sinks);
}
extern "C" __global__ void attention_f16(const float* __restrict__ q, const __half* __restrict__ kc,
    const __half* __restrict__ vc, float* __restrict__ out, int pos0, int n_heads, int n_kv, int hd, int window, float scale,
    const float* __restrict__ sinks) {
    pdl_enter();
    attention_rows(q, kv_wrap(kc), kv_wrap(vc), out, pos0, n_heads, n_kv, hd, window, scale, sinks);
}
extern "C" __global__ void attention_bf16(const float* __restrict__ q, const bf16* __restrict__ kc,
    const bf16* __restrict__ vc, float* __restrict__ out, int pos0, int n_heads, int n_kv, int hd, int window, float scale,
    const float* __restrict__ sinks) {
    pdl_enter();
    attention_rows(q, kv_wrap(kc), kv_wrap(vc), out, pos0, n_heads, n_kv, hd, window, scale, sinks);
}
extern "C" __global__ void attention_q8_0(const float* __restrict__ q, const unsigned char* __restrict__ kc,
    const unsigned char* __restrict__ vc, float* __restrict__ out, int pos0, int n_heads, int n_kv, int hd, int window, float scale,
    const float* __restrict__ sinks) {
    pdl_enter();
    attention_rows(q, kv_wrap(kc), kv_wrap(vc), out, pos0, n_heads, n_kv, hd, window, scale, sinks);
}

// Split-position ("flash-decoding") attention, pass 1. Row t (position pos0 + t) of head h sees
// n positions; they are cut into `used` spans of `per` positions (a multiple of ATT_CHUNK), where
// per is the smallest such span that needs at most `max_splits` spans (att_split_span): short
// contexts get one ATT_CHUNK per block, long ones max_splits blocks of many chunks each. Block
// (h, s, t) walks span s in chunks of ATT_CHUNK positions (one per warp-slot, all loads of a chunk
// in flight at once) with an online softmax and writes its partial (max m, sum l of
// exp(score - m), acc[hd] = sum exp(score - m) * v) to part[((t * n_heads + h) * max_splits + s) *
// (hd + 2)]: acc, then m, then l. Blocks past `used` write nothing (the combine reads `used`
// partials). The head is the fastest grid index, so the heads of one kv head's group, which read
// the same keys and values, run side by side and share them through L2.
// grid (n_heads, max_splits, T), block 32 * ATT_SPLIT_WARPS. pos_ptr non-null (the decode graph):
// the first query's position comes from device memory, so the span and `used` are computed here
// for every replay while the grid stays the one captured. Lane owns dims 4 lane + 128 c .. + 3
// (float4 / 4-half loads when hd % 4 == 0, else one value at a time).
#define ATT_SPLIT_PER_WARP (ATT_CHUNK / ATT_SPLIT_WARPS)
#define ATT_SPLIT_C4 (ATT_MAX_HEAD_DIM / 128)
static_assert(ATT_CHUNK == 32, "a chunk is one score per lane");
static_assert(ATT_CHUNK % ATT_SPLIT_WARPS == 0, "every warp scores the same number of positions");
static_assert(ATT_MAXC * 32 == ATT_MAX_HEAD_DIM, "ATT_MAXC values per lane cover the largest head");
static_assert(ATT_MAX_HEAD_DIM % 128 == 0, "four values per lane in steps of 128");

// Positions per span of a row that sees n positions, at most max_splits spans.
__device__ __forceinline__ int att_split_span(int n, int max_splits) {
    int chunks = (n + ATT_CHUNK - 1) / ATT_CHUNK;
    return ATT_CHUNK * ((chunks + max_splits - 1) / max_splits);
}

// The visible range of row t: first position and count.
__device__ __forceinline__ void att_row_range(int pos0, int t, int window, int* first, int* n) {
    int pos = pos0 + t;
    *first = window > 0 ? max(0, pos + 1 - window) : 0;
    *n = pos + 1 - *first;
}

// Offsets of query row t in q (and out) and in the partials; row t's position (pos_ptr non-null:
// the decode graph's, from device memory).
__device__ __forceinline__ size_t att_q_row(int t, int n_heads, int hd) { return (size_t)t * n_heads * hd; }
__device__ __forceinline__ size_t att_part_row(int t, int n_heads, int hd, int max_splits) {
    return (size_t)t * n_heads * max_splits * (hd + 2);
}
__device__ __forceinline__ int att_pos(int pos0, const int* __restrict__ pos_ptr, int t) {
    return (pos_ptr ? *pos_ptr : pos0) + t;
}

// A batched decode step (many sequences, each with its own cache): launch row t is the call's
// row r = rows[t], at position pos[r], over the caches at kcs[r], vcs[r] (the layer's K and V of
// row r's sequence, as raw device addresses of the launch's cache type).
struct AttRow {
    const float* q;
    float* part;
    int pos;
    unsigned long long kc, vc;
};
__device__ __forceinline__ AttRow att_batch_row(const float* q, float* part, const unsigned long long* kcs,
                                                const unsigned long long* vcs, const int* rows, const int* pos,
                                                int n_heads, int hd, int max_splits) {
    int t = blockIdx.z, r = rows[t];
    return AttRow{q + att_q_row(r, n_heads, hd), part + att_part_row(t, n_heads, hd, max_splits), pos[r], kcs[r],
                  vcs[r]};
}

// This lane's dims (4 lane + 128 c + e) of a cache row r.
template <typename KV>
__device__ __forceinline__ void kv_lane_row(KV r, int hd, bool vec, float (*x)[4]) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int c = 0; c < ATT_SPLIT_C4; c++) {
        int i = 4 * lane + 128 * c;
        if (vec && i < hd) {
            float4 v = kv_ld4(r + i);
            x[c][0] = v.x, x[c][1] = v.y, x[c][2] = v.z, x[c][3] = v.w;
        } else {
#pragma unroll
            for (int e = 0; e < 4; e++) x[c][e] = i + e < hd ? kv_at(r, i + e) : 0.f;
        }
    }
}

// One query row per blockIdx.z: its queries `q` ([n_heads * hd], the row's), its partials `part`
// (the row's [n_heads, max_splits, hd + 2]) and its position `pos`; the entry points below find
// them (one sequence's rows after pos0, or a batched step's rows with their own caches).
template <typename KV>
__device__ __forceinline__ void attention_split_span(const float* __restrict__ q, KV kc,
                                                     KV vc, float* __restrict__ part,
                                                     int pos, int n_heads, int n_kv, int hd, int window,
                                                     float scale, int max_splits) {
    __shared__ float sc[ATT_CHUNK];
    __shared__ float red[ATT_SPLIT_WARPS * ATT_MAX_HEAD_DIM];
    int h = blockIdx.x, s = blockIdx.y;
    int first, n;
    att_row_range(pos, 0, window, &first, &n);
    int per = att_split_span(n, max_splits);
    int j0 = s * per, jend = min(n, j0 + per);
    if (j0 >= jend) return;
    int kvh = h / (n_heads / n_kv);
    int kv_dim = n_kv * hd;
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    bool vec = (hd & 3) == 0;
    float* pr = part + ((size_t)h * max_splits + s) * (hd + 2);
    const float* qh = q + (size_t)h * hd;
    const size_t ring = kv_ring_base(first, window);
    KV kb = kv_back(kc + (size_t)kvh * hd + (size_t)first * kv_dim, ring * kv_dim);
    KV vb = kv_back(vc + (size_t)kvh * hd + (size_t)first * kv_dim, ring * kv_dim);
    float qr[ATT_SPLIT_C4][4], acc[ATT_SPLIT_C4][4];
#pragma unroll
    for (int c = 0; c < ATT_SPLIT_C4; c++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int i = 4 * lane + 128 * c + e;
            qr[c][e] = i < hd ? qh[i] * scale : 0.f;
            acc[c][e] = 0.f;
        }
    float m = -INFINITY, l = 0.f;  // the same in every thread
    for (int c0 = j0; c0 < jend; c0 += ATT_CHUNK) {
        int cnt = min(ATT_CHUNK, jend - c0);
        float d[ATT_SPLIT_PER_WARP];
#pragma unroll
        for (int u = 0; u < ATT_SPLIT_PER_WARP; u++) {
            int j = wid + ATT_SPLIT_WARPS * u;
            d[u] = 0.f;
            if (j < cnt) {
                float kr[ATT_SPLIT_C4][4];
                kv_lane_row(kb + (size_t)(c0 + j) * kv_dim, hd, vec, kr);
#pragma unroll
                for (int c = 0; c < ATT_SPLIT_C4; c++)
#pragma unroll
                    for (int e = 0; e < 4; e++) d[u] += qr[c][e] * kr[c][e];
            }
        }
#pragma unroll
        for (int u = 0; u < ATT_SPLIT_PER_WARP; u++) {
            int j = wid + ATT_SPLIT_WARPS * u;
            float v = warp_sum(d[u]);
            if (lane == 0 && j < cnt) sc[j] = v;
        }
        __syncthreads();
        float v = lane < cnt ? sc[lane] : -INFINITY;
        float mn = fmaxf(m, warp_max(v));
        float p = lane < cnt ? expf(v - mn) : 0.f;
        float corr = expf(m - mn);  // m = -inf (first chunk): 0
        l = l * corr + warp_sum(p);
        m = mn;
#pragma unroll
        for (int c = 0; c < ATT_SPLIT_C4; c++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[c][e] *= corr;
#pragma unroll
        for (int u = 0; u < ATT_SPLIT_PER_WARP; u++) {
            int j = wid + ATT_SPLIT_WARPS * u;
            float pj = __shfl_sync(0xffffffffu, p, j);
            if (j < cnt) {
                float vr[ATT_SPLIT_C4][4];
                kv_lane_row(vb + (size_t)(c0 + j) * kv_dim, hd, vec, vr);
#pragma unroll
                for (int c = 0; c < ATT_SPLIT_C4; c++)
#pragma unroll
                    for (int e = 0; e < 4; e++) acc[c][e] += pj * vr[c][e];
            }
        }
        __syncthreads();  // every warp read sc before the next chunk's scores
    }
#pragma unroll
    for (int c = 0; c < ATT_SPLIT_C4; c++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int i = 4 * lane + 128 * c + e;
            if (i < hd) red[wid * hd + i] = acc[c][e];
        }
    __syncthreads();
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        float a = 0.f;
        for (int w = 0; w < ATT_SPLIT_WARPS; w++) a += red[w * hd + i];
        pr[i] = a;
    }
    if (threadIdx.x == 0) {
        pr[hd] = m;
        pr[hd + 1] = l;
    }
}
extern "C" __global__ void attention_split_f32(const float* __restrict__ q, const float* __restrict__ kc,
    const float* __restrict__ vc, float* __restrict__ part, int pos0, int n_heads, int n_kv, int hd, int window, float scale, int max_splits, const int* __restrict__ pos_ptr) {
    pdl_enter();
    int t = blockIdx.z;
    attention_split_span(q + att_q_row(t, n_heads, hd), kv_wrap(kc), kv_wrap(vc), part + att_part_row(t, n_heads, hd, max_splits),
                         att_pos(pos0, pos_ptr, t), n_heads, n_kv, hd, window, scale, max_splits);
}
extern "C" __global__ void attention_split_f16(const float* __restrict__ q, const __half* __restrict__ kc,
    const __half* __restrict__ vc, float* __restrict__ part, int pos0, int n_heads, int n_kv, int hd, int window, float scale, int max_splits, const int* __restrict__ pos_ptr) {
    pdl_enter();
    int t = blockIdx.z;
    attention_split_span(q + att_q_row(t, n_heads, hd), kv_wrap(kc), kv_wrap(vc), part + att_part_row(t, n_heads, hd, max_splits),
                         att_pos(pos0, pos_ptr, t), n_heads, n_kv, hd, window, scale, max_splits);
}
extern "C" __global__ void attention_split_bf16(const float* __restrict__ q, const bf16* __restrict__ kc,
    const bf16* __restrict__ vc, float* __restrict__ part, int pos0, int n_heads, int n_kv, int hd, int window, float scale, int max_splits, const int* __restrict__ pos_ptr) {
    pdl_enter();
    int t = blockIdx.z;
    attention_split_span(q + att_q_row(t, n_heads, hd), kv_wrap(kc), kv_wrap(vc), part + att_part_row(t, n_heads, hd, max_splits),
                         att_pos(pos0, pos_ptr, t), n_heads, n_kv, hd, window, scale, max_splits);
}
extern "C" __global__ void attention_split_q8_0(const float* __restrict__ q, const unsigned char* __restrict__ kc,
    const unsigned char* __restrict__ vc, float* __restrict__ part, int pos0, int n_heads, int n_kv, int hd, int window, float scale, int max_splits, const int* __restrict__ pos_ptr) {
    pdl_enter();
    int t = blockIdx.z;
    attention_split_span(q + att_q_row(t, n_heads, hd), kv_wrap(kc), kv_wrap(vc), part + att_part_row(t, n_heads, hd, max_splits),
                         att_pos(pos0, pos_ptr, t), n_heads, n_kv, hd, window, scale, max_splits);
}

// Pass 1 for kv heads of a group of ATT_GQA_HEADS (8) query heads or a multiple (g % 8 == 0,
// hd % 4 == 0, hd <= 128): block (b, s, t) takes query heads 8b..8b+7, which share one kv head,
// over span s (att_split_span), so each key and value row is read once for the 8 heads (the
// per-head kernel above reads it once per head). Per chunk of ATT_CHUNK positions: each warp
// scores its positions for the 8 heads (lane owns dims 4 lane..+3; the 8 partial dots are
// reduced over the warp by a transposing butterfly, 9 shuffles, after which lanes 4h'.. hold
// head h' = (lane >> 2) & 7), warp w then runs head w's online softmax over the chunk, and every
// warp adds p * v of its positions for the 8 heads. Partials as the per-head kernel writes them
// (same layout, same combine). grid (n_heads / 8, max_splits, T), block 32 * ATT_SPLIT_WARPS.
// ATT_GQA_HEADS (8: att_reduce8), ATT_GQA_MAXD: -D defines (kernels/src/cuda/kernel.rs).
static_assert(ATT_GQA_HEADS == 8, "att_reduce8 reduces 8 heads");
static_assert(ATT_GQA_MAXD == 128, "one float4 a lane covers the head");
static_assert(ATT_SPLIT_WARPS == ATT_GQA_HEADS, "warp w runs head w's softmax");

// Sum of d[h] over the warp for the 8 heads; lane returns head (lane >> 2) & 7's sum.
__device__ __forceinline__ float att_reduce8(const float* d) {
    int lane = threadIdx.x & 31;
    bool b4 = (lane >> 4) & 1, b3 = (lane >> 3) & 1, b2 = (lane >> 2) & 1;
    float k4[4], k2[2];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        float send = b4 ? d[k] : d[k + 4];
        k4[k] = (b4 ? d[k + 4] : d[k]) + __shfl_xor_sync(0xffffffffu, send, 16);
    }
#pragma unroll
    for (int k = 0; k < 2; k++) {
        float send = b3 ? k4[k] : k4[k + 2];
        k2[k] = (b3 ? k4[k + 2] : k4[k]) + __shfl_xor_sync(0xffffffffu, send, 8);
    }
    float send = b2 ? k2[0] : k2[1];
    float r = (b2 ? k2[1] : k2[0]) + __shfl_xor_sync(0xffffffffu, send, 4);
    r += __shfl_xor_sync(0xffffffffu, r, 2);
    r += __shfl_xor_sync(0xffffffffu, r, 1);
    return r;
}

template <typename KV>
__device__ __forceinline__ float4 kv_lane4(KV row, int hd) {
    int i = 4 * (threadIdx.x & 31);
    return i < hd ? kv_ld4(row + i) : make_float4(0.f, 0.f, 0.f, 0.f);
}

// One query row per blockIdx.z, found as for attention_split_span.
template <typename KV>
__device__ __forceinline__ void attention_split_gqa_span(const float* __restrict__ q, KV kc,
                                                         KV vc, float* __restrict__ part,
                                                         int pos, int n_heads, int n_kv, int hd, int window,
                                                         float scale, int max_splits) {
    __shared__ float sc[ATT_GQA_HEADS][ATT_CHUNK];
    __shared__ float corr_s[ATT_GQA_HEADS];
    __shared__ __align__(16) float red[ATT_SPLIT_WARPS][ATT_GQA_HEADS][ATT_GQA_MAXD];
    int b = blockIdx.x, s = blockIdx.y;
    int first, n;
    att_row_range(pos, 0, window, &first, &n);
    int per = att_split_span(n, max_splits);
    int j0 = s * per, jend = min(n, j0 + per);
    if (j0 >= jend) return;
    int h0 = b * ATT_GQA_HEADS, kvh = h0 / (n_heads / n_kv);
    int kv_dim = n_kv * hd;
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, i4 = 4 * lane;
    float qr[ATT_GQA_HEADS][4], acc[ATT_GQA_HEADS][4];
#pragma unroll
    for (int hh = 0; hh < ATT_GQA_HEADS; hh++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            qr[hh][e] = i4 < hd ? q[(size_t)(h0 + hh) * hd + i4 + e] * scale : 0.f;
            acc[hh][e] = 0.f;
        }
    const size_t ring = kv_ring_base(first, window);
    KV kb = kv_back(kc + (size_t)kvh * hd + (size_t)first * kv_dim, ring * kv_dim);
    KV vb = kv_back(vc + (size_t)kvh * hd + (size_t)first * kv_dim, ring * kv_dim);
    float m = -INFINITY, l = 0.f;  // head wid's, the same in every lane of the warp
    for (int c0 = j0; c0 < jend; c0 += ATT_CHUNK) {
        int cnt = min(ATT_CHUNK, jend - c0);
        // keys and values of the warp's positions all in flight at once (the values do not
        // wait for the softmax: one memory round trip a chunk)
        float4 kr[ATT_SPLIT_PER_WARP], vr[ATT_SPLIT_PER_WARP];
#pragma unroll
        for (int u = 0; u < ATT_SPLIT_PER_WARP; u++) {
            int j = wid + ATT_SPLIT_WARPS * u;
            float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
            kr[u] = j < cnt ? kv_lane4(kb + (size_t)(c0 + j) * kv_dim, hd) : z;
            vr[u] = j < cnt ? kv_lane4(vb + (size_t)(c0 + j) * kv_dim, hd) : z;
        }
#pragma unroll
        for (int u = 0; u < ATT_SPLIT_PER_WARP; u++) {
            int j = wid + ATT_SPLIT_WARPS * u;
            float d[ATT_GQA_HEADS];
#pragma unroll
            for (int hh = 0; hh < ATT_GQA_HEADS; hh++)
                d[hh] = qr[hh][0] * kr[u].x + qr[hh][1] * kr[u].y + qr[hh][2] * kr[u].z + qr[hh][3] * kr[u].w;
            float r = att_reduce8(d);
            if (j < cnt && (lane & 3) == 0) sc[(lane >> 2) & 7][j] = r;
        }
        __syncthreads();
        {
            float v = lane < cnt ? sc[wid][lane] : -INFINITY;
            float mn = fmaxf(m, warp_max(v));
            float p = lane < cnt ? expf(v - mn) : 0.f;
            float corr = expf(m - mn);  // m = -inf (first chunk): 0
            l = l * corr + warp_sum(p);
            m = mn;
            sc[wid][lane] = p;
            if (lane == 0) corr_s[wid] = corr;
        }
        __syncthreads();
#pragma unroll
        for (int hh = 0; hh < ATT_GQA_HEADS; hh++) {
            float cr = corr_s[hh];
#pragma unroll
            for (int e = 0; e < 4; e++) acc[hh][e] *= cr;
        }
#pragma unroll
        for (int u = 0; u < ATT_SPLIT_PER_WARP; u++) {
            int j = wid + ATT_SPLIT_WARPS * u;
            if (j < cnt) {
                float4 v = vr[u];
#pragma unroll
                for (int hh = 0; hh < ATT_GQA_HEADS; hh++) {
                    float p = sc[hh][j];
                    acc[hh][0] += p * v.x, acc[hh][1] += p * v.y, acc[hh][2] += p * v.z, acc[hh][3] += p * v.w;
                }
            }
        }
        __syncthreads();  // every warp read sc and corr_s before the next chunk
    }
    if (i4 < hd) {
#pragma unroll
        for (int hh = 0; hh < ATT_GQA_HEADS; hh++)
            *(float4*)&red[wid][hh][i4] = make_float4(acc[hh][0], acc[hh][1], acc[hh][2], acc[hh][3]);
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < ATT_GQA_HEADS * hd; idx += blockDim.x) {
        int hh = idx / hd, i = idx % hd;
        float a = 0.f;
        for (int w = 0; w < ATT_SPLIT_WARPS; w++) a += red[w][hh][i];
        part[((size_t)(h0 + hh) * max_splits + s) * (hd + 2) + i] = a;
    }
    if (lane == 0) {
        float* pr = part + ((size_t)(h0 + wid) * max_splits + s) * (hd + 2);
        pr[hd] = m;
        pr[hd + 1] = l;
    }
}
extern "C" __global__ __launch_bounds__(32 * ATT_SPLIT_WARPS) void attention_split_gqa_f32(const float* __restrict__ q, const float* __restrict__ kc,
    const float* __restrict__ vc, float* __restrict__ part, int pos0, int n_heads, int n_kv, int hd, int window, float scale, int max_splits, const int* __restrict__ pos_ptr) {
    pdl_enter();
    int t = blockIdx.z;
    attention_split_gqa_span(q + att_q_row(t, n_heads, hd), kv_wrap(kc), kv_wrap(vc), part + att_part_row(t, n_heads, hd, max_splits),
                             att_pos(pos0, pos_ptr, t), n_heads, n_kv, hd, window, scale, max_splits);
}
extern "C" __global__ __launch_bounds__(32 * ATT_SPLIT_WARPS) void attention_split_gqa_f16(const float* __restrict__ q, const __half* __restrict__ kc,
    const __half* __restrict__ vc, float* __restrict__ part, int pos0, int n_heads, int n_kv, int hd, int window, float scale, int max_splits, const int* __restrict__ pos_ptr) {
    pdl_enter();
    int t = blockIdx.z;
    attention_split_gqa_span(q + att_q_row(t, n_heads, hd), kv_wrap(kc), kv_wrap(vc), part + att_part_row(t, n_heads, hd, max_splits),
                             att_pos(pos0, pos_ptr, t), n_heads, n_kv, hd, window, scale, max_splits);
}
extern "C" __global__ __launch_bounds__(32 * ATT_SPLIT_WARPS) void attention_split_gqa_bf16(const float* __restrict__ q, const bf16* __restrict__ kc,
    const bf16* __restrict__ vc, float* __restrict__ part, int pos0, int n_heads, int n_kv, int hd, int window, float scale, int max_splits, const int* __restrict__ pos_ptr) {
    pdl_enter();
    int t = blockIdx.z;
    attention_split_gqa_span(q + att_q_row(t, n_heads, hd), kv_wrap(kc), kv_wrap(vc), part + att_part_row(t, n_heads, hd, max_splits),
                             att_pos(pos0, pos_ptr, t), n_heads, n_kv, hd, window, scale, max_splits);
}
extern "C" __global__ __launch_bounds__(32 * ATT_SPLIT_WARPS) void attention_split_gqa_q8_0(const float* __restrict__ q, const unsigned char* __restrict__ kc,
    const unsigned char* __restrict__ vc, float* __restrict__ part, int pos0, int n_heads, int n_kv, int hd, int window, float scale, int max_splits, const int* __restrict__ pos_ptr) {
    pdl_enter();
    int t = blockIdx.z;
    attention_split_gqa_span(q + att_q_row(t, n_heads, hd), kv_wrap(kc), kv_wrap(vc), part + att_part_row(t, n_heads, hd, max_splits),
                             att_pos(pos0, pos_ptr, t), n_heads, n_kv, hd, window, scale, max_splits);
}

// Pass 1 of a batched decode step (att_batch_row): launch row t is the call's row rows[t] at its
// own position over its own sequence's caches; otherwise attention_split_* (per head) and
// attention_split_gqa_* (8 heads a block) as above. Partials by launch row; pass 2 is
// attention_combine_rows_f32. grid as theirs, blockIdx.z over the launch rows.

extern "C" __global__ void attention_split_rows_f32(const float* __restrict__ q, const unsigned long long* __restrict__ kcs,
    const unsigned long long* __restrict__ vcs, float* __restrict__ part, const int* __restrict__ rows, const int* __restrict__ pos, int n_heads, int n_kv, int hd, int window, float scale, int max_splits) {
    pdl_enter();
    AttRow r = att_batch_row(q, part, kcs, vcs, rows, pos, n_heads, hd, max_splits);
    attention_split_span(r.q, kv_wrap((const float*)r.kc), kv_wrap((const float*)r.vc), r.part, r.pos, n_heads, n_kv, hd, window, scale, max_splits);
}

extern "C" __global__ void attention_split_rows_f16(const float* __restrict__ q, const unsigned long long* __restrict__ kcs,
    const unsigned long long* __restrict__ vcs, float* __restrict__ part, const int* __restrict__ rows, const int* __restrict__ pos, int n_heads, int n_kv, int hd, int window, float scale, int max_splits) {
    pdl_enter();
    AttRow r = att_batch_row(q, part, kcs, vcs, rows, pos, n_heads, hd, max_splits);
    attention_split_span(r.q, kv_wrap((const __half*)r.kc), kv_wrap((const __half*)r.vc), r.part, r.pos, n_heads, n_kv, hd, window, scale, max_splits);
}

extern "C" __global__ void attention_split_rows_bf16(const float* __restrict__ q, const unsigned long long* __restrict__ kcs,
    const unsigned long long* __restrict__ vcs, float* __restrict__ part, const int* __restrict__ rows, const int* __restrict__ pos, int n_heads, int n_kv, int hd, int window, float scale, int max_splits) {
    pdl_enter();
    AttRow r = att_batch_row(q, part, kcs, vcs, rows, pos, n_heads, hd, max_splits);
    attention_split_span(r.q, kv_wrap((const bf16*)r.kc), kv_wrap((const bf16*)r.vc), r.part, r.pos, n_heads, n_kv, hd, window, scale, max_splits);
}

extern "C" __global__ void attention_split_rows_q8_0(const float* __restrict__ q, const unsigned long long* __restrict__ kcs,
    const unsigned long long* __restrict__ vcs, float* __restrict__ part, const int* __restrict__ rows, const int* __restrict__ pos, int n_heads, int n_kv, int hd, int window, float scale, int max_splits) {
    pdl_enter();
    AttRow r = att_batch_row(q, part, kcs, vcs, rows, pos, n_heads, hd, max_splits);
    attention_split_span(r.q, kv_wrap((const unsigned char*)r.kc), kv_wrap((const unsigned char*)r.vc), r.part, r.pos, n_heads, n_kv, hd, window, scale, max_splits);
}

extern "C" __global__ __launch_bounds__(32 * ATT_SPLIT_WARPS) void attention_split_gqa_rows_f32(const float* __restrict__ q, const unsigned long long* __restrict__ kcs,
    const unsigned long long* __restrict__ vcs, float* __restrict__ part, const int* __restrict__ rows, const int* __restrict__ pos, int n_heads, int n_kv, int hd, int window, float scale, int max_splits) {
    pdl_enter();
    AttRow r = att_batch_row(q, part, kcs, vcs, rows, pos, n_heads, hd, max_splits);
    attention_split_gqa_span(r.q, kv_wrap((const float*)r.kc), kv_wrap((const float*)r.vc), r.part, r.pos, n_heads, n_kv, hd, window, scale, max_splits);
}

extern "C" __global__ __launch_bounds__(32 * ATT_SPLIT_WARPS) void attention_split_gqa_rows_f16(const float* __restrict__ q, const unsigned long long* __restrict__ kcs,
    const unsigned long long* __restrict__ vcs, float* __restrict__ part, const int* __restrict__ rows, const int* __restrict__ pos, int n_heads, int n_kv, int hd, int window, float scale, int max_splits) {
    pdl_enter();
    AttRow r = att_batch_row(q, part, kcs, vcs, rows, pos, n_heads, hd, max_splits);
    attention_split_gqa_span(r.q, kv_wrap((const __half*)r.kc), kv_wrap((const __half*)r.vc), r.part, r.pos, n_heads, n_kv, hd, window, scale, max_splits);
}

extern "C" __global__ __launch_bounds__(32 * ATT_SPLIT_WARPS) void attention_split_gqa_rows_bf16(const float* __restrict__ q, const unsigned long long* __restrict__ kcs,
    const unsigned long long* __restrict__ vcs, float* __restrict__ part, const int* __restrict__ rows, const int* __restrict__ pos, int n_heads, int n_kv, int hd, int window, float scale, int max_splits) {
    pdl_enter();
    AttRow r = att_batch_row(q, part, kcs, vcs, rows, pos, n_heads, hd, max_splits);
    attention_split_gqa_span(r.q, kv_wrap((const bf16*)r.kc), kv_wrap((const bf16*)r.vc), r.part, r.pos, n_heads, n_kv, hd, window, scale, max_splits);
}

extern "C" __global__ __launch_bounds__(32 * ATT_SPLIT_WARPS) void attention_split_gqa_rows_q8_0(const float* __restrict__ q, const unsigned long long* __restrict__ kcs,
    const unsigned long long* __restrict__ vcs, float* __restrict__ part, const int* __restrict__ rows, const int* __restrict__ pos, int n_heads, int n_kv, int hd, int window, float scale, int max_splits) {
    pdl_enter();
    AttRow r = att_batch_row(q, part, kcs, vcs, rows, pos, n_heads, hd, max_splits);
    attention_split_gqa_span(r.q, kv_wrap((const unsigned char*)r.kc), kv_wrap((const unsigned char*)r.vc), r.part, r.pos, n_heads, n_kv, hd, window, scale, max_splits);
}

// Split attention, pass 2: out[t, h, :] = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M) with
// M = max_s m_s over the `used` spans of row t (computed as pass 1 does, from pos_ptr when
// non-null), the head's sink logit joining the sum when sinks is non-null (att_finish).
// grid (n_heads, T, ceil(hd / ATT_COMBINE_DIMS)), block 128.
// Head h of the row whose partials are `pr` ([n_heads, max_splits, hd + 2]), at position pos, into
// `out` (the row's [n_heads * hd]).
// Block z sums dims 32 z..32 z + 31 (lane = dim): the spans' weights e^(m_s - M) are computed
// once per span into shared memory (ATT_COMBINE_CHUNK spans at a time), each warp sums its lane's
// dim over every nw-th span, four spans' loads in flight, and warp 0 adds the warps' sums (a
// block per head walking every span serially per dim left most SMs idle and was latency-bound).
// Every block of a head finds the same M and L.
#define ATT_COMBINE_CHUNK 256
#if ATT_COMBINE_DIMS != 32
#error "ATT_COMBINE_DIMS is a warp's lanes"
#endif
__device__ __forceinline__ void attention_combine_row(const float* __restrict__ pr, float* __restrict__ out, int h,
                                                      int n_heads, int hd, int max_splits, int pos, int window,
                                                      const float* __restrict__ sinks) {
    __shared__ float wts[ATT_COMBINE_CHUNK];
    __shared__ float sums[32][ATT_COMBINE_DIMS];
    int first, n;
    att_row_range(pos, 0, window, &first, &n);
    const int per = att_split_span(n, max_splits), used = (n + per - 1) / per, stride = hd + 2;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int i = blockIdx.z * ATT_COMBINE_DIMS + lane;
    pr += (size_t)h * max_splits * stride;
    float mx = -INFINITY;
    for (int s = threadIdx.x; s < used; s += blockDim.x) mx = fmaxf(mx, pr[(size_t)s * stride + hd]);
    const float M = block_max(mx);
    float lsum = 0.f, a = 0.f;
    for (int c0 = 0; c0 < used; c0 += ATT_COMBINE_CHUNK) {
        const int cn = min(ATT_COMBINE_CHUNK, used - c0);
        __syncthreads();  // the previous chunk's weights are read
        for (int s = threadIdx.x; s < cn; s += blockDim.x) {
            const float* ps = pr + (size_t)(c0 + s) * stride;
            float wt = expf(ps[hd] - M);
            wts[s] = wt;
            lsum += ps[hd + 1] * wt;
        }
        __syncthreads();
        if (i < hd) {
            const float* col = pr + (size_t)c0 * stride + i;
#pragma unroll 4
            for (int s = w; s < cn; s += nw) a += col[(size_t)s * stride] * wts[s];
        }
    }
    sums[w][lane] = a;
    const float inv = att_finish(sinks, h, M, block_sum(lsum));  // block_sum: a barrier after sums
    if (w == 0 && i < hd) {
        float t = 0.f;
        for (int k = 0; k < nw; k++) t += sums[k][lane];
        out[(size_t)h * hd + i] = t * inv;
    }
}
extern "C" __global__ void attention_combine_f32(const float* __restrict__ part, float* __restrict__ out,
                                                 int n_heads, int hd, int max_splits, int pos0, int window,
                                                 const int* __restrict__ pos_ptr, const float* __restrict__ sinks) {
    pdl_enter();
    int h = blockIdx.x, t = blockIdx.y;
    attention_combine_row(part + att_part_row(t, n_heads, hd, max_splits), out + att_q_row(t, n_heads, hd), h, n_heads,
                          hd, max_splits, att_pos(pos0, pos_ptr, t), window, sinks);
}

// Pass 2 of a batched decode step: launch row t's partials into the call's row rows[t] of out, at
// that row's position pos[rows[t]]. grid (n_heads, launch rows, ceil(hd / ATT_COMBINE_DIMS)),
// block 128.
extern "C" __global__ void attention_combine_rows_f32(const float* __restrict__ part, float* __restrict__ out,
                                                      const int* __restrict__ rows, const int* __restrict__ pos,
                                                      int n_heads, int hd, int max_splits, int window,
                                                      const float* __restrict__ sinks) {
    pdl_enter();
    int h = blockIdx.x, t = blockIdx.y, r = rows[t];
    attention_combine_row(part + att_part_row(t, n_heads, hd, max_splits), out + att_q_row(r, n_heads, hd), h, n_heads,
                          hd, max_splits, pos[r], window, sinks);
}

// Prefill attention, flash style (tiles of queries x tiles of keys, online softmax). A "row" is a
// (token, head of kv head kvh's group) pair, token-major; block (b, kvh) owns rows
// b*ATT_TILE_ROWS.. and stages their queries once, then walks the keys they see in tiles of
// ATT_TILE_KEYS positions staged in shared memory, so every K/V value read from memory feeds
// ATT_TILE_ROWS query rows (the per-(token, head) kernel above reads the cache once per row).
// ATT_TILE_ROWS, ATT_TILE_KEYS, ATT_TILE_MAXC: -D defines (kernels/src/cuda/kernel.rs). Warp w owns rows 4w..4w+3; lane j scores key j of the tile for them (K rows padded to hd + 4
// floats: float4 loads without bank conflicts), then a running max m / sum l per row and
// acc[row][lane + 32c] += p * v. Same math as attention_f32 in another summation order.
// grid (ceil(T * group / ATT_TILE_ROWS), n_kv), block 32 * ATT_TILE_ROWS / 4, dynamic shared
// (ATT_TILE_KEYS * (2 hd + 4) + ATT_TILE_ROWS * hd) * 4 bytes. hd % 4 == 0, hd <= 32 * ATT_TILE_MAXC.
template <typename KV>
__device__ __forceinline__ void attention_tiles(const float* __restrict__ q, KV kc,
                                                KV vc, float* __restrict__ out, int n_tokens,
                                                int pos0, int n_heads, int n_kv, int hd, int window, float scale,
                                                const float* __restrict__ sinks) {
    extern __shared__ float4 sm4[];
    float* ks = (float*)sm4;                        // [ATT_TILE_KEYS][hd + 4]
    float* vs = ks + ATT_TILE_KEYS * (hd + 4);      // [ATT_TILE_KEYS][hd]
    float* qs = vs + ATT_TILE_KEYS * hd;            // [ATT_TILE_ROWS][hd]
    const int g = n_heads / n_kv, kvh = blockIdx.y, row0 = blockIdx.x * ATT_TILE_ROWS;
    const int n_rows = n_tokens * g, kv_dim = n_kv * hd, q_dim = n_heads * hd, ks_stride = hd + 4;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    for (int e = threadIdx.x; e < ATT_TILE_ROWS * hd; e += blockDim.x) {
        int rg = row0 + e / hd, i = e % hd;
        qs[e] = rg < n_rows ? q[(size_t)(rg / g) * q_dim + (size_t)(kvh * g + rg % g) * hd + i] : 0.f;
    }
    int last_row = min(n_rows, row0 + ATT_TILE_ROWS) - 1;
    int key_hi = pos0 + last_row / g;  // inclusive
    int key_lo = window > 0 ? max(0, pos0 + row0 / g + 1 - window) : 0;
    kv_ring_back(kc, vc, key_lo, window, kv_dim);
    int rpos[4], rfirst[4];
    float m[4], l[4], acc[4][ATT_TILE_MAXC];
#pragma unroll
    for (int r = 0; r < 4; r++) {
        int rg = row0 + 4 * w + r;
        rpos[r] = rg < n_rows ? pos0 + rg / g : -1;  // -1: padding row, sees nothing
        rfirst[r] = window > 0 ? max(0, rpos[r] + 1 - window) : 0;
        m[r] = -INFINITY;
        l[r] = 0.f;
#pragma unroll
        for (int c = 0; c < ATT_TILE_MAXC; c++) acc[r][c] = 0.f;
    }
    for (int k0 = key_lo; k0 <= key_hi; k0 += ATT_TILE_KEYS) {
        __syncthreads();  // the previous tile is consumed (and, first time, the queries are staged)
        for (int e = threadIdx.x; e < ATT_TILE_KEYS * hd; e += blockDim.x) {
            int j = e / hd, i = e % hd, p = k0 + j;
            size_t src = (size_t)p * kv_dim + (size_t)kvh * hd + i;
            ks[j * ks_stride + i] = p <= key_hi ? kv_at(kc, src) : 0.f;
            vs[j * hd + i] = p <= key_hi ? kv_at(vc, src) : 0.f;
        }
        __syncthreads();
        float s[4] = {0.f, 0.f, 0.f, 0.f};
        const float4* kr = (const float4*)(ks + lane * ks_stride);
        const float4* qr = (const float4*)(qs + 4 * w * hd);
        for (int i4 = 0; i4 < hd / 4; i4++) {
            float4 k = kr[i4];
#pragma unroll
            for (int r = 0; r < 4; r++) {
                float4 a = qr[r * (hd / 4) + i4];
                s[r] += a.x * k.x + a.y * k.y + a.z * k.z + a.w * k.w;
            }
        }
        int p = k0 + lane;
        float pr[4];
#pragma unroll
        for (int r = 0; r < 4; r++) {
            bool vis = p <= rpos[r] && p >= rfirst[r];
            float sc = vis ? s[r] * scale : -INFINITY;
            float mn = fmaxf(m[r], warp_max(sc));  // warp-uniform
            if (mn == -INFINITY) {                 // nothing visible yet for this row
                pr[r] = 0.f;
                continue;
            }
            float corr = expf(m[r] - mn);  // m = -inf: 0
            pr[r] = vis ? expf(sc - mn) : 0.f;
            l[r] = l[r] * corr + warp_sum(pr[r]);
            m[r] = mn;
#pragma unroll
            for (int c = 0; c < ATT_TILE_MAXC; c++) acc[r][c] *= corr;
        }
        int nk = min(ATT_TILE_KEYS, key_hi - k0 + 1);
        for (int j = 0; j < nk; j++) {
            float pj[4];
#pragma unroll
            for (int r = 0; r < 4; r++) pj[r] = __shfl_sync(0xffffffffu, pr[r], j);
#pragma unroll
            for (int c = 0; c < ATT_TILE_MAXC; c++) {
                int i = lane + 32 * c;
                if (i < hd) {
                    float v = vs[j * hd + i];
#pragma unroll
                    for (int r = 0; r < 4; r++) acc[r][c] += pj[r] * v;
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 4; r++) {
        int rg = row0 + 4 * w + r;
        if (rg >= n_rows) continue;
        float inv = att_finish(sinks, kvh * g + rg % g, m[r], l[r]);
        float* o = out + (size_t)(rg / g) * q_dim + (size_t)(kvh * g + rg % g) * hd;
#pragma unroll
        for (int c = 0; c < ATT_TILE_MAXC; c++) {
            int i = lane + 32 * c;
            if (i < hd) o[i] = acc[r][c] * inv;
        }
    }
}

extern "C" __global__ void attention_tiled_f32(const float* __restrict__ q, const float* __restrict__ kc,
    const float* __restrict__ vc, float* __restrict__ out, int n_tokens, int pos0, int n_heads, int n_kv, int hd, int window, float scale,
    const float* __restrict__ sinks) {
    pdl_enter();
    attention_tiles(q, kv_wrap(kc), kv_wrap(vc), out, n_tokens, pos0, n_heads, n_kv, hd, window, scale, sinks);
}
extern "C" __global__ void attention_tiled_f16(const float* __restrict__ q, const __half* __restrict__ kc,
    const __half* __restrict__ vc, float* __restrict__ out, int n_tokens, int pos0, int n_heads, int n_kv, int hd, int window, float scale,
    const float* __restrict__ sinks) {
    pdl_enter();
    attention_tiles(q, kv_wrap(kc), kv_wrap(vc), out, n_tokens, pos0, n_heads, n_kv, hd, window, scale, sinks);
}
extern "C" __global__ void attention_tiled_bf16(const float* __restrict__ q, const bf16* __restrict__ kc,
    const bf16* __restrict__ vc, float* __restrict__ out, int n_tokens, int pos0, int n_heads, int n_kv, int hd, int window, float scale,
    const float* __restrict__ sinks) {
    pdl_enter();
    attention_tiles(q, kv_wrap(kc), kv_wrap(vc), out, n_tokens, pos0, n_heads, n_kv, hd, window, scale, sinks);
}
extern "C" __global__ void attention_tiled_q8_0(const float* __restrict__ q, const unsigned char* __restrict__ kc,
    const unsigned char* __restrict__ vc, float* __restrict__ out, int n_tokens, int pos0, int n_heads, int n_kv, int hd, int window, float scale,
    const float* __restrict__ sinks) {
    pdl_enter();
    attention_tiles(q, kv_wrap(kc), kv_wrap(vc), out, n_tokens, pos0, n_heads, n_kv, hd, window, scale, sinks);
}

// ---- prefill attention on tensor cores (f32 and q8_0 caches; f16 and bf16 further down) ----
// attention_tiled_f32's rows and blocks with both products on mma.sync (m16n8k16, bf16 in, f32
// accumulate): block (b, kvh) owns rows b * AM_ROWS.. (16 a warp); the keys it sees are staged in
// tiles of AM_KEYS positions as bf16 hi + lo (hi + lo = the f32 cache value to ~2^-17), the
// queries sit in registers split the same way, and S = Q K^T and O += P V each take three MMAs a
// fragment (hi.hi + hi.lo + lo.hi; lo.lo is below the f32 rounding of the sum): about f32
// accuracy, like the CUDA-core kernels, in another summation order. Online softmax as
// FlashAttention-2: per row a running max m, per thread partial sums l over its own columns
// (summed over the row's quad at the end), O rescaled when m grows.
// ATT_MMA_WARPS, ATT_MMA_KEYS, ATT_MMA_MAXD: -D defines (kernels/src/cuda/kernel.rs).
// grid (ceil(T * group / AM_ROWS), n_kv), block 32 * ATT_MMA_WARPS, static shared
// 4 * AM_KEYS * (ATT_MMA_MAXD + 8) bf16. hd % 16 == 0, hd <= ATT_MMA_MAXD.
#define AM_ROWS (16 * ATT_MMA_WARPS)
#define AM_KEYS ATT_MMA_KEYS
#define AM_K16 (ATT_MMA_MAXD / 16)  // k steps of 16 dims (S), dim pairs of n8 tiles (O)
#define AM_N8 (AM_KEYS / 8)         // key n8 tiles of S
#if AM_KEYS % 16 != 0 || ATT_MMA_MAXD % 16 != 0
#error "ATT_MMA_KEYS and ATT_MMA_MAXD must be multiples of 16"
#endif

// (x, y) as bf16 pairs hi and lo = bf16 of the remainder (low half: x).
__device__ __forceinline__ void am_split2(float x, float y, unsigned& hi, unsigned& lo) {
    __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    __nv_bfloat162 l = __floats2bfloat162_rn(x - __low2float(h), y - __high2float(h));
    hi = *(const unsigned*)&h;
    lo = *(const unsigned*)&l;
}

// The 16-bit types the MMAs take, as what the kernels need of each: `split2` (two floats as hi
// and lo pairs of the type) and `mma` (d += a . b, m16n8k16, f32 accumulation).
struct AmBf16 {
    static __device__ __forceinline__ void split2(float x, float y, unsigned& hi, unsigned& lo) {
        am_split2(x, y, hi, lo);
    }
    static __device__ __forceinline__ void mma(float* d, const unsigned* a, unsigned b0, unsigned b1) {
        mma_bf16_16816(d, a, b0, b1);
    }
};
struct AmF16 {
    static __device__ __forceinline__ void split2(float x, float y, unsigned& hi, unsigned& lo) {
        __half2 h = __floats2half2_rn(x, y);
        __half2 l = __floats2half2_rn(x - __low2float(h), y - __high2float(h));
        hi = *(const unsigned*)&h;
        lo = *(const unsigned*)&l;
    }
    static __device__ __forceinline__ void mma(float* d, const unsigned* a, unsigned b0, unsigned b1) {
        mma_f16_16816(d, a, b0, b1);
    }
};

// Four 8 x 8 b16 matrices from shared memory, lane i naming row i % 8 of matrix i / 8 (`p`);
// `trans`: each matrix transposed (ldmatrix .trans). Without ldmatrix (before sm_75) the lanes
// read the rows the others name, through shuffles of the addresses.
template <bool TRANS>
__device__ __forceinline__ void am_ldsm4(unsigned* r, const bf16* p) {
#if __CUDA_ARCH__ >= 750
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
#else
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    unsigned long long me = (unsigned long long)p;
    for (int m = 0; m < 4; m++) {
        if (TRANS) {
            const bf16* r0 = (const bf16*)__shfl_sync(0xffffffffu, me, m * 8 + 2 * t);
            const bf16* r1 = (const bf16*)__shfl_sync(0xffffffffu, me, m * 8 + 2 * t + 1);
            __nv_bfloat162 v = __halves2bfloat162(r0[g], r1[g]);
            r[m] = *(const unsigned*)&v;
        } else {
            const bf16* row = (const bf16*)__shfl_sync(0xffffffffu, me, m * 8 + g);
            r[m] = *(const unsigned*)(row + 2 * t);
        }
    }
#endif
}

// d += (ah + al) . (bh + bl) without the lo.lo term (below the f32 rounding of the sum): three
// MMAs, hi.hi then hi.lo then lo.hi; b* hold one n8 tile's b0, b1.
__device__ __forceinline__ void am_mma3(float* d, const unsigned* ah, const unsigned* al, const unsigned* bh,
                                        const unsigned* bl) {
    mma_bf16_16816(d, ah, bh[0], bh[1]);
    mma_bf16_16816(d, ah, bl[0], bl[1]);
    mma_bf16_16816(d, al, bh[0], bh[1]);
}

// This thread's query fragments (hi, lo) of rows ra (a[0], a[2]) and ra + 8 (a[1], a[3]); rows
// past n_rows are zeros. q row r is token r / g, head kvh * g + r % g.
template <typename SPLIT>
__device__ __forceinline__ void am_load_q(unsigned (*qh)[4], unsigned (*ql)[4], const float* __restrict__ q,
                                          int ra, int n_rows, int g, int kvh, int q_dim, int hd) {
    int t = threadIdx.x & 3;
    const float* row[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int r = ra + 8 * h;
        row[h] = r < n_rows ? q + (size_t)(r / g) * q_dim + (size_t)(kvh * g + r % g) * hd : nullptr;
    }
#pragma unroll
    for (int kk = 0; kk < AM_K16; kk++) {
        if (kk * 16 >= hd) break;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float* r = row[j & 1];
            float2 v = r ? *(const float2*)(r + kk * 16 + 2 * t + 8 * (j >> 1)) : make_float2(0.f, 0.f);
            SPLIT::split2(v.x, v.y, qh[kk][j], ql[kk][j]);
        }
    }
}

// Stage positions k0.. k0 + AM_KEYS - 1 of kv head kvh (zeros past key_hi) as bf16 hi / lo rows
// of stride ld into kh, kl, vh, vl. Every thread of the block calls it.
template <typename KV>
__device__ __forceinline__ void am_stage_kv(KV kc, KV vc, bf16* kh,
                                            bf16* kl, bf16* vh, bf16* vl, int k0, int key_hi, int kv_dim, int kvh,
                                            int hd, int ld) {
    const int per_row = hd / 4;
    for (int e = threadIdx.x; e < AM_KEYS * per_row; e += blockDim.x) {
        int j = e / per_row, i = (e % per_row) * 4, p = k0 + j;
        size_t src = (size_t)p * kv_dim + (size_t)kvh * hd + i;
        float4 k = p <= key_hi ? kv_ld4(kc + src) : make_float4(0.f, 0.f, 0.f, 0.f);
        float4 v = p <= key_hi ? kv_ld4(vc + src) : make_float4(0.f, 0.f, 0.f, 0.f);
        uint2 h, l;
        am_split2(k.x, k.y, h.x, l.x);
        am_split2(k.z, k.w, h.y, l.y);
        *(uint2*)(kh + j * ld + i) = h;
        *(uint2*)(kl + j * ld + i) = l;
        am_split2(v.x, v.y, h.x, l.x);
        am_split2(v.z, v.w, h.y, l.y);
        *(uint2*)(vh + j * ld + i) = h;
        *(uint2*)(vl + j * ld + i) = l;
    }
}

// s[n] = the warp's 16 rows against keys 8n..8n+7 of the staged tile (unscaled).
__device__ __forceinline__ void am_scores(float (*s)[4], const unsigned (*qh)[4], const unsigned (*ql)[4],
                                          const bf16* kh, const bf16* kl, int ld, int hd) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int n = 0; n < AM_N8; n++)
#pragma unroll
        for (int c = 0; c < 4; c++) s[n][c] = 0.f;
    int off = ((lane & 7) + 8 * (lane >> 4)) * ld + 8 * ((lane >> 3) & 1);
#pragma unroll
    for (int kk = 0; kk < AM_K16; kk++) {
        if (kk * 16 >= hd) break;
#pragma unroll
        for (int np = 0; np < AM_N8 / 2; np++) {
            unsigned bh[4], bl[4];
            am_ldsm4<false>(bh, kh + np * 16 * ld + kk * 16 + off);
            am_ldsm4<false>(bl, kl + np * 16 * ld + kk * 16 + off);
            am_mma3(s[2 * np], qh[kk], ql[kk], bh, bl);
            am_mma3(s[2 * np + 1], qh[kk], ql[kk], bh + 2, bl + 2);
        }
    }
}

// The online softmax step of the tile at k0 for this thread's rows (rpos: position, -1 for a
// padding row; rfirst: first visible position): s becomes p = exp(s * scale - m), zero where not
// visible; m, l and o (rows' accumulators, c 0-1: row a, 2-3: row a + 8) rescaled.
// N8, K16: the key n8 tiles of s and the 16-dim steps of o (the wide heads' kernels pass theirs).
template <int N8 = AM_N8, int K16 = AM_K16>
__device__ __forceinline__ void am_softmax(float (*s)[4], float (*o)[4], float* m, float* l, const int* rpos,
                                           const int* rfirst, int k0, float scale, int hd) {
    int t = threadIdx.x & 3;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < N8; n++)
#pragma unroll
            for (int c = 2 * h; c < 2 * h + 2; c++) {
                int p = k0 + 8 * n + 2 * t + (c & 1);
                bool vis = p <= rpos[h] && p >= rfirst[h];
                s[n][c] = vis ? s[n][c] * scale : -INFINITY;
                mx = fmaxf(mx, s[n][c]);
            }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        float mn = fmaxf(m[h], mx);
        float corr = mn == -INFINITY ? 1.f : expf(m[h] - mn);  // m = -inf: 0
        l[h] *= corr;
        // invisible: exp(-inf) = 0, also when the whole row is (mn = -inf, base 0); a select
        // instead of a branch around each exp, so the exps of the tile issue back to back
        const float base = mn == -INFINITY ? 0.f : mn;
#pragma unroll
        for (int n = 0; n < N8; n++)
#pragma unroll
            for (int c = 2 * h; c < 2 * h + 2; c++) {
                s[n][c] = expf(s[n][c] - base);
                l[h] += s[n][c];
            }
        m[h] = mn;
#pragma unroll
        for (int dn = 0; dn < 2 * K16; dn++) {
            if (dn * 8 >= hd) break;
            o[dn][2 * h] *= corr;
            o[dn][2 * h + 1] *= corr;
        }
    }
}

// o += p . V over the staged tile: p (s's layout) as A fragments hi + lo, V rows transposed.
__device__ __forceinline__ void am_pv(float (*o)[4], const float (*p)[4], const bf16* vh, const bf16* vl, int ld,
                                      int hd) {
    int lane = threadIdx.x & 31;
    int off = ((lane & 7) + 8 * ((lane >> 3) & 1)) * ld + 8 * (lane >> 4);
#pragma unroll
    for (int kc = 0; kc < AM_KEYS / 16; kc++) {
        unsigned ah[4], al[4];
        am_split2(p[2 * kc][0], p[2 * kc][1], ah[0], al[0]);
        am_split2(p[2 * kc][2], p[2 * kc][3], ah[1], al[1]);
        am_split2(p[2 * kc + 1][0], p[2 * kc + 1][1], ah[2], al[2]);
        am_split2(p[2 * kc + 1][2], p[2 * kc + 1][3], ah[3], al[3]);
#pragma unroll
        for (int dp = 0; dp < AM_K16; dp++) {
            if (dp * 16 >= hd) break;
            unsigned bh[4], bl[4];
            am_ldsm4<true>(bh, vh + kc * 16 * ld + dp * 16 + off);
            am_ldsm4<true>(bl, vl + kc * 16 * ld + dp * 16 + off);
            am_mma3(o[2 * dp], ah, al, bh, bl);
            am_mma3(o[2 * dp + 1], ah, al, bh + 2, bl + 2);
        }
    }
}

// A warp's rows of a tensor-core block and the keys they see: ra, this thread's first row (the
// second is ra + 8); rpos, each row's position (-1: a padding row, sees nothing); rfirst, its
// first visible position; the block's key range [key_lo, key_hi] and the warp's [w_lo, w_hi].
struct AmRows {
    int ra, rpos[2], rfirst[2], key_lo, key_hi, w_lo, w_hi;
    bool w_rows;
};
__device__ __forceinline__ AmRows am_rows(int n_rows, int g, int pos0, int window) {
    const int row0 = blockIdx.x * AM_ROWS, w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    AmRows r;
    r.ra = row0 + 16 * w + (lane >> 2);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int row = r.ra + 8 * h;
        r.rpos[h] = row < n_rows ? pos0 + row / g : -1;
        r.rfirst[h] = window > 0 ? max(0, r.rpos[h] + 1 - window) : 0;
    }
    const int last_row = min(n_rows, row0 + AM_ROWS) - 1, w_last = min(n_rows - 1, row0 + 16 * w + 15);
    r.key_hi = pos0 + last_row / g;  // inclusive
    r.key_lo = window > 0 ? max(0, pos0 + row0 / g + 1 - window) : 0;
    r.w_hi = pos0 + w_last / g;
    r.w_lo = window > 0 ? max(0, pos0 + (row0 + 16 * w) / g + 1 - window) : 0;
    r.w_rows = row0 + 16 * w < n_rows;
    return r;
}
// Whether any of the warp's rows sees a key of the tile of KEYS positions at k0.
template <int KEYS = AM_KEYS>
__device__ __forceinline__ bool am_warp_sees(const AmRows& r, int k0) {
    return r.w_rows && k0 <= r.w_hi && k0 + KEYS - 1 >= r.w_lo;
}

// The rows' outputs: o over the row's sum of p (its quad's partial sums l), through the sinks.
template <int K16 = AM_K16>
__device__ __forceinline__ void am_store(const AmRows& r, const float (*o)[4], const float* m, const float* l,
                                         float* __restrict__ out, const float* __restrict__ sinks, int g, int kvh,
                                         int q_dim, int hd) {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float sum = l[h];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        int row = r.ra + 8 * h;
        if (r.rpos[h] < 0) continue;
        float inv = att_finish(sinks, kvh * g + row % g, m[h], sum);
        float* dst = out + (size_t)(row / g) * q_dim + (size_t)(kvh * g + row % g) * hd + 2 * t;
#pragma unroll
        for (int dn = 0; dn < 2 * K16; dn++) {
            if (dn * 8 >= hd) break;
            *(float2*)(dst + dn * 8) = make_float2(o[dn][2 * h] * inv, o[dn][2 * h + 1] * inv);
        }
    }
}

template <typename KV>
__device__ __forceinline__ void attention_mma_tiles(const float* __restrict__ q, KV kc,
                                                    KV vc, float* __restrict__ out, int n_tokens,
                                                    int pos0, int n_heads, int n_kv, int hd, int window, float scale,
                                                    const float* __restrict__ sinks) {
    __shared__ __align__(16) bf16 am_kv[4 * AM_KEYS * (ATT_MMA_MAXD + 8)];
    const int ld = hd + 8, g = n_heads / n_kv, kvh = blockIdx.y;
    bf16 *kh = am_kv, *kl = kh + AM_KEYS * ld, *vh = kl + AM_KEYS * ld, *vl = vh + AM_KEYS * ld;
    const int n_rows = n_tokens * g, kv_dim = n_kv * hd, q_dim = n_heads * hd;
    const AmRows r = am_rows(n_rows, g, pos0, window);
    kv_ring_back(kc, vc, r.key_lo, window, kv_dim);
    unsigned qh[AM_K16][4], ql[AM_K16][4];
    am_load_q<AmBf16>(qh, ql, q, r.ra, n_rows, g, kvh, q_dim, hd);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, o[2 * AM_K16][4];
#pragma unroll
    for (int dn = 0; dn < 2 * AM_K16; dn++)
#pragma unroll
        for (int c = 0; c < 4; c++) o[dn][c] = 0.f;
    for (int k0 = r.key_lo; k0 <= r.key_hi; k0 += AM_KEYS) {
        __syncthreads();  // the previous tile is consumed
        am_stage_kv(kc, vc, kh, kl, vh, vl, k0, r.key_hi, kv_dim, kvh, hd, ld);
        __syncthreads();
        if (!am_warp_sees(r, k0)) continue;  // nothing this warp sees
        float s[AM_N8][4];
        am_scores(s, qh, ql, kh, kl, ld, hd);
        am_softmax(s, o, m, l, r.rpos, r.rfirst, k0, scale, hd);
        am_pv(o, s, vh, vl, ld, hd);
    }
    am_store(r, o, m, l, out, sinks, g, kvh, q_dim, hd);
}
// The f32 and q8_0 caches widen to f32 and split as bf16 hi + lo (above).
extern "C" __global__ __launch_bounds__(32 * ATT_MMA_WARPS) void attention_mma_f32(const float* __restrict__ q, const float* __restrict__ kc,
    const float* __restrict__ vc, float* __restrict__ out, int n_tokens, int pos0, int n_heads, int n_kv, int hd, int window, float scale,
    const float* __restrict__ sinks) {
    pdl_enter();
    attention_mma_tiles(q, kv_wrap(kc), kv_wrap(vc), out, n_tokens, pos0, n_heads, n_kv, hd, window, scale, sinks);
}
extern "C" __global__ __launch_bounds__(32 * ATT_MMA_WARPS) void attention_mma_q8_0(const float* __restrict__ q, const unsigned char* __restrict__ kc,
    const unsigned char* __restrict__ vc, float* __restrict__ out, int n_tokens, int pos0, int n_heads, int n_kv, int hd, int window, float scale,
    const float* __restrict__ sinks) {
    pdl_enter();
    attention_mma_tiles(q, kv_wrap(kc), kv_wrap(vc), out, n_tokens, pos0, n_heads, n_kv, hd, window, scale, sinks);
}

// ---- prefill attention on tensor cores over a 16-bit cache ----
// An f16 or bf16 cache's values are exact in the MMA's own input type, so keys and values go from
// the cache to shared memory unchanged: cp.async copies into two stages, the next tile's copies in
// flight while this one multiplies (the f32 kernel above converts as it stages and waits for every
// load). Only the queries and the probabilities are split hi + lo, in the cache's type: S = Qhi K
// + Qlo K and O += Phi V + Plo V, two MMAs a fragment instead of three, half the staged bytes and
// ldmatrix loads. Accuracy: q keeps 22 (f16) or 16 (bf16) significant bits, K and V are exact,
// f32 accumulation; p (in [0, 1]) keeps 16 bits over bf16 and 11 over f16, where the prefill
// drops p's lo MMA (PLO false: a quarter of the MMAs; each weight off by at most 2^-12 of itself,
// the size of the f16 cache's own rounding of each value) and the decode keeps it. Same rows, blocks, grid and online softmax as attention_mma_tiles;
// static shared 2 stages x (K + V) x AM_KEYS x (ATT_MMA_MAXD + 8) 16-bit values.

// Positions k0.. k0 + AM_KEYS - 1 of kv head kvh into stage kt / vt (row stride ld), asynchronously;
// zeros past key_hi (the probabilities there are 0, and 0 x a stale value could be NaN).
template <typename T, int KEYS = AM_KEYS>
__device__ __forceinline__ void am16_stage(const T* __restrict__ kc, const T* __restrict__ vc, T* kt, T* vt, int k0,
                                           int key_hi, int kv_dim, int kvh, int hd, int ld) {
    const int per_row = hd / 8;  // 16-byte chunks
    for (int e = threadIdx.x; e < KEYS * per_row; e += blockDim.x) {
        int j = e / per_row, i = (e % per_row) * 8, p = k0 + j;
        bool ok = p <= key_hi;
        size_t src = (size_t)(ok ? p : k0) * kv_dim + (size_t)kvh * hd + i;
        cp_async16(kt + j * ld + i, kc + src, ok);
        cp_async16(vt + j * ld + i, vc + src, ok);
    }
}

// s[n] = the warp's 16 rows against keys 8n..8n+7 of the staged tile (unscaled): hi then lo.
template <typename M, typename T>
__device__ __forceinline__ void am16_scores(float (*s)[4], const unsigned (*qh)[4], const unsigned (*ql)[4],
                                            const T* kt, int ld, int hd) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int n = 0; n < AM_N8; n++)
#pragma unroll
        for (int c = 0; c < 4; c++) s[n][c] = 0.f;
    int off = ((lane & 7) + 8 * (lane >> 4)) * ld + 8 * ((lane >> 3) & 1);
#pragma unroll
    for (int kk = 0; kk < AM_K16; kk++) {
        if (kk * 16 >= hd) break;
#pragma unroll
        for (int np = 0; np < AM_N8 / 2; np++) {
            unsigned b[4];
            am_ldsm4<false>(b, (const bf16*)(kt + np * 16 * ld + kk * 16 + off));
            M::mma(s[2 * np], qh[kk], b[0], b[1]);
            M::mma(s[2 * np], ql[kk], b[0], b[1]);
            M::mma(s[2 * np + 1], qh[kk], b[2], b[3]);
            M::mma(s[2 * np + 1], ql[kk], b[2], b[3]);
        }
    }
}

// o += p . V over the staged tile: p (s's layout) as A fragments hi (+ lo when PLO), V rows
// transposed.
template <typename M, bool PLO, typename T, int KEYS = AM_KEYS, int K16 = AM_K16>
__device__ __forceinline__ void am16_pv(float (*o)[4], const float (*p)[4], const T* vt, int ld, int hd) {
    int lane = threadIdx.x & 31;
    int off = ((lane & 7) + 8 * ((lane >> 3) & 1)) * ld + 8 * (lane >> 4);
#pragma unroll
    for (int kc = 0; kc < KEYS / 16; kc++) {
        unsigned ah[4], al[4];
        M::split2(p[2 * kc][0], p[2 * kc][1], ah[0], al[0]);
        M::split2(p[2 * kc][2], p[2 * kc][3], ah[1], al[1]);
        M::split2(p[2 * kc + 1][0], p[2 * kc + 1][1], ah[2], al[2]);
        M::split2(p[2 * kc + 1][2], p[2 * kc + 1][3], ah[3], al[3]);
#pragma unroll
        for (int dp = 0; dp < K16; dp++) {
            if (dp * 16 >= hd) break;
            unsigned b[4];
            am_ldsm4<true>(b, (const bf16*)(vt + kc * 16 * ld + dp * 16 + off));
            M::mma(o[2 * dp], ah, b[0], b[1]);
            if (PLO) M::mma(o[2 * dp], al, b[0], b[1]);
            M::mma(o[2 * dp + 1], ah, b[2], b[3]);
            if (PLO) M::mma(o[2 * dp + 1], al, b[2], b[3]);
        }
    }
}

// Runs body(hd) with hd as a literal where it is a common head size (128, 64; 256 for the wide
// kernels), else with the run-time value. Every tile function below is force-inlined, so the
// literal folds each hd-bounded loop's break and the row strides: ptxas schedules within a basic
// block, and with a break per 16-dim step each step waited for its own ldmatrix and products.
template <typename F>
__device__ __forceinline__ void am_fold_hd(int hd, F body) {
    if (hd == 128)
        body(128);
    else if (hd == 64)
        body(64);
    else
        body(hd);
}
template <typename F>
__device__ __forceinline__ void amw_fold_hd(int hd, F body) {
    if (hd == 256)
        body(256);
    else
        body(hd);
}

template <typename M, bool PLO, typename T>
__device__ __forceinline__ void attention_mma16_tiles(const float* __restrict__ q, const T* __restrict__ kc,
                                                      const T* __restrict__ vc, float* __restrict__ out, int n_tokens,
                                                      int pos0, int n_heads, int n_kv, int hd, int window, float scale,
                                                      const float* __restrict__ sinks) {
    __shared__ __align__(16) unsigned short am16_kv[4 * AM_KEYS * (ATT_MMA_MAXD + 8)];
    const int ld = hd + 8, g = n_heads / n_kv, kvh = blockIdx.y, stage = 2 * AM_KEYS * ld;
    T* buf = (T*)am16_kv;  // stage i: keys at buf + i * stage, values AM_KEYS * ld after them
    const int n_rows = n_tokens * g, kv_dim = n_kv * hd, q_dim = n_heads * hd;
    const AmRows r = am_rows(n_rows, g, pos0, window);
    kv_ring_back(kc, vc, r.key_lo, window, kv_dim);
    unsigned qh[AM_K16][4], ql[AM_K16][4];
    am_load_q<M>(qh, ql, q, r.ra, n_rows, g, kvh, q_dim, hd);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, o[2 * AM_K16][4];
#pragma unroll
    for (int dn = 0; dn < 2 * AM_K16; dn++)
#pragma unroll
        for (int c = 0; c < 4; c++) o[dn][c] = 0.f;
    am16_stage(kc, vc, buf, buf + AM_KEYS * ld, r.key_lo, r.key_hi, kv_dim, kvh, hd, ld);
    cp_async_commit();
    for (int k0 = r.key_lo, i = 0; k0 <= r.key_hi; k0 += AM_KEYS, i ^= 1) {
        const T* kt = buf + i * stage;
        if (k0 + AM_KEYS <= r.key_hi) {  // the next tile into the other stage, consumed last round
            T* nk = buf + (i ^ 1) * stage;
            am16_stage(kc, vc, nk, nk + AM_KEYS * ld, k0 + AM_KEYS, r.key_hi, kv_dim, kvh, hd, ld);
        }
        cp_async_commit();
        cp_async_wait<1>();  // this tile's copies have landed (the next tile's may fly)
        __syncthreads();
        if (am_warp_sees(r, k0)) {
            float s[AM_N8][4];
            am16_scores<M>(s, qh, ql, kt, ld, hd);
            am_softmax(s, o, m, l, r.rpos, r.rfirst, k0, scale, hd);
            am16_pv<M, PLO>(o, s, kt + AM_KEYS * ld, ld, hd);
        }
        __syncthreads();  // this stage is consumed before the next round's copies refill it
    }
    am_store(r, o, m, l, out, sinks, g, kvh, q_dim, hd);
}
extern "C" __global__ __launch_bounds__(32 * ATT_MMA_WARPS) void attention_mma_f16(const float* __restrict__ q, const __half* __restrict__ kc,
    const __half* __restrict__ vc, float* __restrict__ out, int n_tokens, int pos0, int n_heads, int n_kv, int hd, int window, float scale,
    const float* __restrict__ sinks) {
    pdl_enter();
    am_fold_hd(hd, [&](int d) {
        attention_mma16_tiles<AmF16, false>(q, kc, vc, out, n_tokens, pos0, n_heads, n_kv, d, window, scale, sinks);
    });
}
extern "C" __global__ __launch_bounds__(32 * ATT_MMA_WARPS) void attention_mma_bf16(const float* __restrict__ q, const bf16* __restrict__ kc,
    const bf16* __restrict__ vc, float* __restrict__ out, int n_tokens, int pos0, int n_heads, int n_kv, int hd, int window, float scale,
    const float* __restrict__ sinks) {
    pdl_enter();
    am_fold_hd(hd, [&](int d) {
        attention_mma16_tiles<AmBf16, true>(q, kc, vc, out, n_tokens, pos0, n_heads, n_kv, d, window, scale, sinks);
    });
}

// ---- split decode attention on tensor cores over a 16-bit cache ----
// attention_split_gqa's job (one token's row against its visible positions, cut into the spans of
// att_split_span, partials for attention_combine_f32) as attention_mma16_tiles computes it: the
// group's g query heads of kv head kvh are the rows (16 a warp, g <= AM_ROWS), every span's keys
// and values go through the two cp.async stages, and each row's partial (unnormalised o, max m,
// sum l) lands where attention_split_gqa writes it. The CUDA-core kernels dot each key with the 8
// heads lane by lane and reduce over the warp; here one MMA scores 8 keys against 16 rows.
// grid (n_kv, max_splits, T), block 32 * ATT_MMA_WARPS, static shared as attention_mma16_tiles.
template <typename M, typename T>
__device__ __forceinline__ void attention_split_mma_span(const float* __restrict__ q, const T* __restrict__ kc,
                                                         const T* __restrict__ vc, float* __restrict__ part, int pos,
                                                         int n_heads, int n_kv, int hd, int window, float scale,
                                                         int max_splits) {
    __shared__ __align__(16) unsigned short am16_kv[4 * AM_KEYS * (ATT_MMA_MAXD + 8)];
    int first, n;
    att_row_range(pos, 0, window, &first, &n);
    const int per = att_split_span(n, max_splits), s = blockIdx.y, j0 = s * per;
    if (j0 >= n) return;  // past the used spans
    const int g = n_heads / n_kv, kvh = blockIdx.x, ld = hd + 8, stage = 2 * AM_KEYS * ld;
    const int key_lo = first + j0, key_hi = first + min(n, j0 + per) - 1, kv_dim = n_kv * hd;
    kv_ring_back(kc, vc, first, window, kv_dim);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, t = lane & 3, ra = 16 * w + (lane >> 2);
    T* buf = (T*)am16_kv;
    unsigned qh[AM_K16][4], ql[AM_K16][4];
    am_load_q<M>(qh, ql, q, ra, g, g, kvh, n_heads * hd, hd);
    const int rpos[2] = {ra < g ? pos : -1, ra + 8 < g ? pos : -1}, rfirst[2] = {first, first};
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, o[2 * AM_K16][4];
#pragma unroll
    for (int dn = 0; dn < 2 * AM_K16; dn++)
#pragma unroll
        for (int c = 0; c < 4; c++) o[dn][c] = 0.f;
    am16_stage(kc, vc, buf, buf + AM_KEYS * ld, key_lo, key_hi, kv_dim, kvh, hd, ld);
    cp_async_commit();
    for (int k0 = key_lo, i = 0; k0 <= key_hi; k0 += AM_KEYS, i ^= 1) {
        const T* kt = buf + i * stage;
        if (k0 + AM_KEYS <= key_hi) {
            T* nk = buf + (i ^ 1) * stage;
            am16_stage(kc, vc, nk, nk + AM_KEYS * ld, k0 + AM_KEYS, key_hi, kv_dim, kvh, hd, ld);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        if (16 * w < g) {
            float sc[AM_N8][4];
            am16_scores<M>(sc, qh, ql, kt, ld, hd);
            am_softmax(sc, o, m, l, rpos, rfirst, k0, scale, hd);
            am16_pv<M, true>(o, sc, kt + AM_KEYS * ld, ld, hd);
        }
        __syncthreads();
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float sum = l[h];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        if (rpos[h] < 0) continue;
        float* pr = part + ((size_t)(kvh * g + ra + 8 * h) * max_splits + s) * (hd + 2);
#pragma unroll
        for (int dn = 0; dn < 2 * AM_K16; dn++) {
            if (dn * 8 >= hd) break;
            *(float2*)(pr + dn * 8 + 2 * t) = make_float2(o[dn][2 * h], o[dn][2 * h + 1]);
        }
        if (t == 0) pr[hd] = m[h], pr[hd + 1] = sum;
    }
}
extern "C" __global__ __launch_bounds__(32 * ATT_MMA_WARPS) void attention_split_mma_f16(const float* __restrict__ q, const __half* __restrict__ kc,
    const __half* __restrict__ vc, float* __restrict__ part, int pos0, int n_heads, int n_kv, int hd, int window, float scale, int max_splits, const int* __restrict__ pos_ptr) {
    pdl_enter();
    int t = blockIdx.z;
    const float* qt = q + att_q_row(t, n_heads, hd);
    float* pt = part + att_part_row(t, n_heads, hd, max_splits);
    const int pos = att_pos(pos0, pos_ptr, t);
    am_fold_hd(hd, [&](int d) {
        attention_split_mma_span<AmF16>(qt, kc, vc, pt, pos, n_heads, n_kv, d, window, scale, max_splits);
    });
}
extern "C" __global__ __launch_bounds__(32 * ATT_MMA_WARPS) void attention_split_mma_bf16(const float* __restrict__ q, const bf16* __restrict__ kc,
    const bf16* __restrict__ vc, float* __restrict__ part, int pos0, int n_heads, int n_kv, int hd, int window, float scale, int max_splits, const int* __restrict__ pos_ptr) {
    pdl_enter();
    int t = blockIdx.z;
    const float* qt = q + att_q_row(t, n_heads, hd);
    float* pt = part + att_part_row(t, n_heads, hd, max_splits);
    const int pos = att_pos(pos0, pos_ptr, t);
    am_fold_hd(hd, [&](int d) {
        attention_split_mma_span<AmBf16>(qt, kc, vc, pt, pos, n_heads, n_kv, d, window, scale, max_splits);
    });
}
// A batched decode step's rows (att_batch_row), each over its own sequence's cache.
// grid (n_kv, max_splits, launch rows), block 32 * ATT_MMA_WARPS.
extern "C" __global__ __launch_bounds__(32 * ATT_MMA_WARPS) void attention_split_mma_rows_f16(const float* __restrict__ q, const unsigned long long* __restrict__ kcs,
    const unsigned long long* __restrict__ vcs, float* __restrict__ part, const int* __restrict__ rows, const int* __restrict__ pos, int n_heads, int n_kv, int hd, int window, float scale, int max_splits) {
    pdl_enter();
    AttRow r = att_batch_row(q, part, kcs, vcs, rows, pos, n_heads, hd, max_splits);
    am_fold_hd(hd, [&](int d) {
        attention_split_mma_span<AmF16>(r.q, (const __half*)r.kc, (const __half*)r.vc, r.part, r.pos, n_heads, n_kv, d, window, scale,
                                    max_splits);
    });
}
extern "C" __global__ __launch_bounds__(32 * ATT_MMA_WARPS) void attention_split_mma_rows_bf16(const float* __restrict__ q, const unsigned long long* __restrict__ kcs,
    const unsigned long long* __restrict__ vcs, float* __restrict__ part, const int* __restrict__ rows, const int* __restrict__ pos, int n_heads, int n_kv, int hd, int window, float scale, int max_splits) {
    pdl_enter();
    AttRow r = att_batch_row(q, part, kcs, vcs, rows, pos, n_heads, hd, max_splits);
    am_fold_hd(hd, [&](int d) {
        attention_split_mma_span<AmBf16>(r.q, (const bf16*)r.kc, (const bf16*)r.vc, r.part, r.pos, n_heads, n_kv, d, window, scale,
                                    max_splits);
    });
}

// ---- tensor-core attention for wide heads (144..256 dims) over a 16-bit cache ----
// attention_mma16_tiles' and attention_split_mma_span's jobs for heads past ATT_MMA_MAXD, as
// their own instantiation so the <= 128 kernels keep their registers. At 256 dims a thread's
// query fragments hi + lo (2 x 64 registers) and o accumulators (128) do not fit the 255
// registers, so the queries leave the registers: each thread writes its own fragments (the
// ones am_load_q computes) once to a private slice of the warp's shared region, in fragment
// order (16-dim step kk: the lane's hi as one uint4 at [2 kk][lane], lo at [2 kk + 1][lane],
// conflict-free 16-byte loads), and reads them back per 16-dim step as it reads K by ldmatrix;
// o stays in registers (~180 a thread). The queries take 64 x hd bytes a warp (16 KiB at 256),
// so the keys shrink to ATT_MMA_WIDE_KEYS (16) a tile to keep the block (2 stages x K and V +
// four warps' queries: 97 KiB at 256) under the 99 KiB that sm_86 / sm_89 / sm_120 let a block
// opt in to (the smallest of sm_80+; an H100 holds two such blocks an SM). Same rows, grid,
// stages and online softmax as the kernels above; dynamic shared memory (the launcher's
// attention_mma_wide_shared_bytes). ATT_MMA_WIDE_KEYS, ATT_MMA_WIDE_MAXD: -D defines.
#define AMW_KEYS ATT_MMA_WIDE_KEYS
#define AMW_K16 (ATT_MMA_WIDE_MAXD / 16)
#define AMW_N8 (AMW_KEYS / 8)
#if AMW_KEYS % 16 != 0 || ATT_MMA_WIDE_MAXD % 16 != 0
#error "ATT_MMA_WIDE_KEYS and ATT_MMA_WIDE_MAXD must be multiples of 16"
#endif

// Bytes of the two K + V stages (the warps' query slices follow them).
__device__ __forceinline__ int amw_kv_bytes(int hd) { return 2 * 2 * AMW_KEYS * (hd + 8) * 2; }

// The warp's query slice: 16-dim steps x (hi, lo) x 32 lanes of uint4.
__device__ __forceinline__ uint4* amw_q_slice(unsigned char* smem, int hd) {
    return (uint4*)(smem + amw_kv_bytes(hd)) + (size_t)(threadIdx.x >> 5) * (hd / 16) * 2 * 32;
}

// am_load_q's fragments of this thread (rows ra, ra + 8; zeros past n_rows) into its slots of
// the warp's slice qs. Only this thread reads them back: no barrier.
template <typename SPLIT>
__device__ __forceinline__ void amw_store_q(uint4* qs, const float* __restrict__ q, int ra, int n_rows, int g,
                                            int kvh, int q_dim, int hd) {
    const int lane = threadIdx.x & 31, t = lane & 3;
    const float* row[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int r = ra + 8 * h;
        row[h] = r < n_rows ? q + (size_t)(r / g) * q_dim + (size_t)(kvh * g + r % g) * hd : nullptr;
    }
    for (int kk = 0; kk < hd / 16; kk++) {
        unsigned hi[4], lo[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float* r = row[j & 1];
            float2 v = r ? *(const float2*)(r + kk * 16 + 2 * t + 8 * (j >> 1)) : make_float2(0.f, 0.f);
            SPLIT::split2(v.x, v.y, hi[j], lo[j]);
        }
        qs[2 * kk * 32 + lane] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        qs[(2 * kk + 1) * 32 + lane] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    }
}

// am16_scores with the query fragments read from the thread's slots of qs per 16-dim step.
template <typename M, typename T>
__device__ __forceinline__ void amw_scores(float (*s)[4], const uint4* qs, const T* kt, int ld, int hd) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int n = 0; n < AMW_N8; n++)
#pragma unroll
        for (int c = 0; c < 4; c++) s[n][c] = 0.f;
    const int off = ((lane & 7) + 8 * (lane >> 4)) * ld + 8 * ((lane >> 3) & 1);
#pragma unroll
    for (int kk = 0; kk < AMW_K16; kk++) {
        if (kk * 16 >= hd) break;
        const uint4 h4 = qs[2 * kk * 32 + lane], l4 = qs[(2 * kk + 1) * 32 + lane];
        const unsigned qh[4] = {h4.x, h4.y, h4.z, h4.w}, ql[4] = {l4.x, l4.y, l4.z, l4.w};
#pragma unroll
        for (int np = 0; np < AMW_N8 / 2; np++) {
            unsigned b[4];
            am_ldsm4<false>(b, (const bf16*)(kt + np * 16 * ld + kk * 16 + off));
            M::mma(s[2 * np], qh, b[0], b[1]);
            M::mma(s[2 * np], ql, b[0], b[1]);
            M::mma(s[2 * np + 1], qh, b[2], b[3]);
            M::mma(s[2 * np + 1], ql, b[2], b[3]);
        }
    }
}

// The tiles [key_lo, key_hi] of kv head kvh through the two cp.async stages at smem into the
// thread's m, l and o (each warp's rows where `sees` says it sees the tile; rpos, rfirst: its
// rows' positions and first visible positions). Every thread of the block calls it.
template <typename M, bool PLO, typename T, typename SEES>
__device__ __forceinline__ void amw_walk(const T* __restrict__ kc, const T* __restrict__ vc, unsigned char* smem,
                                         const uint4* qs, float (*o)[4], float* m, float* l, const int* rpos,
                                         const int* rfirst, int key_lo, int key_hi, int n_kv, int kvh, int hd,
                                         float scale, SEES sees) {
    const int ld = hd + 8, stage = 2 * AMW_KEYS * ld, kv_dim = n_kv * hd;
    T* buf = (T*)smem;  // stage i: keys at buf + i * stage, values AMW_KEYS * ld after them
    am16_stage<T, AMW_KEYS>(kc, vc, buf, buf + AMW_KEYS * ld, key_lo, key_hi, kv_dim, kvh, hd, ld);
    cp_async_commit();
    for (int k0 = key_lo, i = 0; k0 <= key_hi; k0 += AMW_KEYS, i ^= 1) {
        const T* kt = buf + i * stage;
        if (k0 + AMW_KEYS <= key_hi) {  // the next tile into the other stage, consumed last round
            T* nk = buf + (i ^ 1) * stage;
            am16_stage<T, AMW_KEYS>(kc, vc, nk, nk + AMW_KEYS * ld, k0 + AMW_KEYS, key_hi, kv_dim, kvh, hd, ld);
        }
        cp_async_commit();
        cp_async_wait<1>();  // this tile's copies have landed (the next tile's may fly)
        __syncthreads();
        if (sees(k0)) {
            float s[AMW_N8][4];
            amw_scores<M>(s, qs, kt, ld, hd);
            am_softmax<AMW_N8, AMW_K16>(s, o, m, l, rpos, rfirst, k0, scale, hd);
            am16_pv<M, PLO, T, AMW_KEYS, AMW_K16>(o, s, kt + AMW_KEYS * ld, ld, hd);
        }
        __syncthreads();  // this stage is consumed before the next round's copies refill it
    }
}

// attention_mma16_tiles for wide heads. Dynamic shared: attention_mma_wide_shared_bytes(hd, 4).
template <typename M, bool PLO, typename T>
__device__ __forceinline__ void attention_mma16w_tiles(const float* __restrict__ q, const T* __restrict__ kc,
                                                       const T* __restrict__ vc, float* __restrict__ out, int n_tokens,
                                                       int pos0, int n_heads, int n_kv, int hd, int window, float scale,
                                                       const float* __restrict__ sinks) {
    extern __shared__ __align__(16) unsigned char amw_smem[];
    const int g = n_heads / n_kv, kvh = blockIdx.y, n_rows = n_tokens * g, q_dim = n_heads * hd;
    const AmRows r = am_rows(n_rows, g, pos0, window);
    kv_ring_back(kc, vc, r.key_lo, window, (size_t)(n_kv * hd));
    uint4* qs = amw_q_slice(amw_smem, hd);
    amw_store_q<M>(qs, q, r.ra, n_rows, g, kvh, q_dim, hd);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, o[2 * AMW_K16][4];
#pragma unroll
    for (int dn = 0; dn < 2 * AMW_K16; dn++)
#pragma unroll
        for (int c = 0; c < 4; c++) o[dn][c] = 0.f;
    amw_walk<M, PLO>(kc, vc, amw_smem, qs, o, m, l, r.rpos, r.rfirst, r.key_lo, r.key_hi, n_kv, kvh, hd, scale,
                     [&](int k0) { return am_warp_sees<AMW_KEYS>(r, k0); });
    am_store<AMW_K16>(r, o, m, l, out, sinks, g, kvh, q_dim, hd);
}
extern "C" __global__ __launch_bounds__(32 * ATT_MMA_WARPS) void attention_mma_wide_f16(const float* __restrict__ q, const __half* __restrict__ kc,
    const __half* __restrict__ vc, float* __restrict__ out, int n_tokens, int pos0, int n_heads, int n_kv, int hd, int window, float scale,
    const float* __restrict__ sinks) {
    pdl_enter();
    amw_fold_hd(hd, [&](int d) {
        attention_mma16w_tiles<AmF16, false>(q, kc, vc, out, n_tokens, pos0, n_heads, n_kv, d, window, scale, sinks);
    });
}
extern "C" __global__ __launch_bounds__(32 * ATT_MMA_WARPS) void attention_mma_wide_bf16(const float* __restrict__ q, const bf16* __restrict__ kc,
    const bf16* __restrict__ vc, float* __restrict__ out, int n_tokens, int pos0, int n_heads, int n_kv, int hd, int window, float scale,
    const float* __restrict__ sinks) {
    pdl_enter();
    amw_fold_hd(hd, [&](int d) {
        attention_mma16w_tiles<AmBf16, true>(q, kc, vc, out, n_tokens, pos0, n_heads, n_kv, d, window, scale, sinks);
    });
}

// A span's partials of this thread's rows (rpos < 0: none): unnormalised o, then m and the row's
// sum of p (its quad's partial sums l); part points at the thread's first row's partials (split 0),
// the second row's are 8 rows further.
template <int K16>
__device__ __forceinline__ void am_store_part(const float (*o)[4], const float* m, const float* l, const int* rpos,
                                              float* __restrict__ part, int s, int max_splits, int hd) {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float sum = l[h];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        if (rpos[h] < 0) continue;
        float* pr = part + ((size_t)(8 * h) * max_splits + s) * (hd + 2);
#pragma unroll
        for (int dn = 0; dn < 2 * K16; dn++) {
            if (dn * 8 >= hd) break;
            *(float2*)(pr + dn * 8 + 2 * t) = make_float2(o[dn][2 * h], o[dn][2 * h + 1]);
        }
        if (t == 0) pr[hd] = m[h], pr[hd + 1] = sum;
    }
}

// attention_split_mma_span for wide heads: only the warps with rows (16 w < g) write and read
// query slices, so the launch gives attention_mma_wide_shared_bytes(hd, ceil(g / 16)) bytes.
template <typename M, typename T>
__device__ __forceinline__ void attention_split_mma16w_span(const float* __restrict__ q, const T* __restrict__ kc,
                                                            const T* __restrict__ vc, float* __restrict__ part, int pos,
                                                            int n_heads, int n_kv, int hd, int window, float scale,
                                                            int max_splits) {
    extern __shared__ __align__(16) unsigned char amw_smem[];
    int first, n;
    att_row_range(pos, 0, window, &first, &n);
    const int per = att_split_span(n, max_splits), s = blockIdx.y, j0 = s * per;
    if (j0 >= n) return;  // past the used spans
    const int g = n_heads / n_kv, kvh = blockIdx.x, key_lo = first + j0, key_hi = first + min(n, j0 + per) - 1;
    kv_ring_back(kc, vc, first, window, (size_t)(n_kv * hd));
    const int w = threadIdx.x >> 5, ra = 16 * w + ((threadIdx.x & 31) >> 2);
    const bool rows = 16 * w < g;
    uint4* qs = amw_q_slice(amw_smem, hd);
    if (rows) amw_store_q<M>(qs, q, ra, g, g, kvh, n_heads * hd, hd);
    const int rpos[2] = {ra < g ? pos : -1, ra + 8 < g ? pos : -1}, rfirst[2] = {first, first};
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, o[2 * AMW_K16][4];
#pragma unroll
    for (int dn = 0; dn < 2 * AMW_K16; dn++)
#pragma unroll
        for (int c = 0; c < 4; c++) o[dn][c] = 0.f;
    amw_walk<M, true>(kc, vc, amw_smem, qs, o, m, l, rpos, rfirst, key_lo, key_hi, n_kv, kvh, hd, scale,
                      [rows](int) { return rows; });
    am_store_part<AMW_K16>(o, m, l, rpos, part + (size_t)(kvh * g + ra) * max_splits * (hd + 2), s, max_splits, hd);
}
extern "C" __global__ __launch_bounds__(32 * ATT_MMA_WARPS) void attention_split_mma_wide_f16(const float* __restrict__ q, const __half* __restrict__ kc,
    const __half* __restrict__ vc, float* __restrict__ part, int pos0, int n_heads, int n_kv, int hd, int window, float scale, int max_splits, const int* __restrict__ pos_ptr) {
    pdl_enter();
    int t = blockIdx.z;
    const float* qt = q + att_q_row(t, n_heads, hd);
    float* pt = part + att_part_row(t, n_heads, hd, max_splits);
    const int pos = att_pos(pos0, pos_ptr, t);
    amw_fold_hd(hd, [&](int d) {
        attention_split_mma16w_span<AmF16>(qt, kc, vc, pt, pos, n_heads, n_kv, d, window, scale, max_splits);
    });
}
extern "C" __global__ __launch_bounds__(32 * ATT_MMA_WARPS) void attention_split_mma_wide_bf16(const float* __restrict__ q, const bf16* __restrict__ kc,
    const bf16* __restrict__ vc, float* __restrict__ part, int pos0, int n_heads, int n_kv, int hd, int window, float scale, int max_splits, const int* __restrict__ pos_ptr) {
    pdl_enter();
    int t = blockIdx.z;
    const float* qt = q + att_q_row(t, n_heads, hd);
    float* pt = part + att_part_row(t, n_heads, hd, max_splits);
    const int pos = att_pos(pos0, pos_ptr, t);
    amw_fold_hd(hd, [&](int d) {
        attention_split_mma16w_span<AmBf16>(qt, kc, vc, pt, pos, n_heads, n_kv, d, window, scale, max_splits);
    });
}
// The batched decode rows (att_batch_row) for wide heads. grid (n_kv, max_splits, launch rows).
extern "C" __global__ __launch_bounds__(32 * ATT_MMA_WARPS) void attention_split_mma_rows_wide_f16(const float* __restrict__ q, const unsigned long long* __restrict__ kcs,
    const unsigned long long* __restrict__ vcs, float* __restrict__ part, const int* __restrict__ rows, const int* __restrict__ pos, int n_heads, int n_kv, int hd, int window, float scale, int max_splits) {
    pdl_enter();
    AttRow r = att_batch_row(q, part, kcs, vcs, rows, pos, n_heads, hd, max_splits);
    amw_fold_hd(hd, [&](int d) {
        attention_split_mma16w_span<AmF16>(r.q, (const __half*)r.kc, (const __half*)r.vc, r.part, r.pos, n_heads, n_kv, d, window, scale,
                                         max_splits);
    });
}
extern "C" __global__ __launch_bounds__(32 * ATT_MMA_WARPS) void attention_split_mma_rows_wide_bf16(const float* __restrict__ q, const unsigned long long* __restrict__ kcs,
    const unsigned long long* __restrict__ vcs, float* __restrict__ part, const int* __restrict__ rows, const int* __restrict__ pos, int n_heads, int n_kv, int hd, int window, float scale, int max_splits) {
    pdl_enter();
    AttRow r = att_batch_row(q, part, kcs, vcs, rows, pos, n_heads, hd, max_splits);
    amw_fold_hd(hd, [&](int d) {
        attention_split_mma16w_span<AmBf16>(r.q, (const bf16*)r.kc, (const bf16*)r.vc, r.part, r.pos, n_heads, n_kv, d, window, scale,
                                         max_splits);
    });
}
