// Latent attention (DeepSeek-V3 / Kimi K2 "MLA") in the absorbed form: the cache holds, per
// position, the RMS-normed latent (rank values) and the rotated key part shared by every head
// (rope values), one row of width = rank + rope; each head's query is absorbed into the latent
// space (k_b[h] times its no-RoPE part) so its scores are q_abs . row and its output is the
// softmax-weighted latent, which v_b[h] turns into the head's value.
// Part of the moe-lanes kernels: compiled together with common.cuh prepended, after
// norm_rope.cu (kv_store_row, rope_angle) and attention.cu (kv_at, kv_wrap, att_split_span,
// att_row_range, and attention_combine_f32, which combines this file's split partials).
// MLA_HEADS, MLA_TOKENS, MLA_MAX_RANK, MLA_MAX_ROPE: -D defines (kernels/src/cuda/kernel.rs).
#define MLA_MAX_WIDTH (MLA_MAX_RANK + MLA_MAX_ROPE)
#define MLA_RANK_PER_THREAD (MLA_MAX_RANK / 256)
static_assert(MLA_MAX_RANK % 256 == 0, "a block of 256 threads covers the latent in whole steps");
static_assert(ATT_CHUNK == 32 && ATT_SPLIT_WARPS == MLA_HEADS, "warp g runs head g's softmax over a chunk of 32");

// Per token t of T (position pos0 + t, or *pos_ptr + t in the decode graph), grid (T, heads + 1),
// block 256:
// - blocks h < heads: RoPE of head h's rope part of q (rows of heads * (nope + rope)), written
//   times `scale` to q_abs[t, h, rank..rank + rope] (rows of heads * (rank + rope));
// - block heads: the latent kv[t, :rank] RMS-normed (weight kv_norm), its rope part rotated, the
//   row stored at cache row pos0 + t in the cache's type (kv_type as kv_store_row), through
//   shared memory (q8_0 quantizes whole blocks).
// RoPE pairs as rope_f32: (i, i + rope/2) or interleaved (2i, 2i + 1), angles in double.
extern "C" __global__ void mla_prep_f32(const float* __restrict__ q, const float* __restrict__ kv,
                                        const float* __restrict__ kv_norm, float* __restrict__ q_abs,
                                        void* __restrict__ cache, int heads, int nope, int rope, int rank,
                                        int pos0, const int* __restrict__ pos_ptr, float theta, int interleaved,
                                        float eps, float scale, int kv_type, const double* __restrict__ freqs,
                                        float rope_scale) {
    pdl_enter();
    __shared__ float row[MLA_MAX_WIDTH];
    int t = blockIdx.x, h = blockIdx.y, half = rope / 2, width = rank + rope;
    if (pos_ptr) pos0 = *pos_ptr;
    double pos = (double)(pos0 + t);
    if (h < heads) {
        const float* qh = q + (size_t)t * heads * (nope + rope) + (size_t)h * (nope + rope) + nope;
        float* dst = q_abs + ((size_t)t * heads + h) * width + rank;
        for (int i = threadIdx.x; i < half; i += blockDim.x) {
            float s, c;
            rope_angle(i, rope, theta, pos, &s, &c, freqs, rope_scale);
            int a = interleaved ? 2 * i : i;
            int b = interleaved ? 2 * i + 1 : i + half;
            float x0 = qh[a], x1 = qh[b];
            dst[a] = (x0 * c - x1 * s) * scale;
            dst[b] = (x1 * c + x0 * s) * scale;
        }
        return;
    }
    const float* x = kv + (size_t)t * width;
    float ss = 0.f;
    for (int i = threadIdx.x; i < rank; i += blockDim.x) ss += x[i] * x[i];
    ss = block_sum(ss);
    float inv = 1.f / sqrtf(ss / (float)rank + eps);
    for (int i = threadIdx.x; i < rank; i += blockDim.x) row[i] = x[i] * inv * kv_norm[i];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float s, c;
        rope_angle(i, rope, theta, pos, &s, &c, freqs, rope_scale);
        int a = interleaved ? 2 * i : i;
        int b = interleaved ? 2 * i + 1 : i + half;
        float x0 = x[rank + a], x1 = x[rank + b];
        row[rank + a] = x0 * c - x1 * s;
        row[rank + b] = x1 * c + x0 * s;
    }
    __syncthreads();
    kv_store_row(cache, (size_t)(pos0 + t) * width, row, width, kv_type);
}

// Per head h, one small product per token: y[t, h, r] = scale * sum_i w[h][r][i] * x[t, h, i] for
// r < rows, i < cols, w bf16 `[heads, rows, cols]`; x rows of x_row (head h at h * x_head), y rows
// of y_row (head h at h * y_head). The query absorption (w = k_b, x = q's no-RoPE parts, y =
// q_abs's latent parts) and the value projection (w = v_b, x = the attention's latents, y = the
// heads' values). Block (r tile, h, token tile): MLA_TOKENS tokens' x of head h staged in
// dynamic shared memory (MLA_TOKENS * cols floats), warp w takes row r = 8 * blockIdx.x + w,
// lanes over its columns (coalesced bf16 reads, each weight read once for the tile's tokens).
// grid (ceil(rows / 8), heads, ceil(T / MLA_TOKENS)), block 256.
extern "C" __global__ void mla_head_gemv_bf16(const float* __restrict__ x, const unsigned short* __restrict__ w,
                                              float* __restrict__ y, int T, int rows, int cols, int x_row,
                                              int x_head, int y_row, int y_head, float scale) {
    pdl_enter();
    extern __shared__ float xs[];
    int h = blockIdx.y, t0 = blockIdx.z * MLA_TOKENS, nt = min(MLA_TOKENS, T - t0);
    for (int i = threadIdx.x; i < MLA_TOKENS * cols; i += blockDim.x) {
        int u = i / cols, c = i % cols;
        xs[i] = u < nt ? x[(size_t)(t0 + u) * x_row + (size_t)h * x_head + c] : 0.f;
    }
    __syncthreads();
    int lane = threadIdx.x & 31, r = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (r >= rows) return;
    const unsigned short* wr = w + ((size_t)h * rows + r) * cols;
    float acc[MLA_TOKENS];
#pragma unroll
    for (int u = 0; u < MLA_TOKENS; u++) acc[u] = 0.f;
    for (int c = lane; c < cols; c += 32) {
        float wv = __uint_as_float((unsigned)__ldg(wr + c) << 16);
#pragma unroll
        for (int u = 0; u < MLA_TOKENS; u++) acc[u] += wv * xs[u * cols + c];
    }
#pragma unroll
    for (int u = 0; u < MLA_TOKENS; u++) {
        float v = warp_sum(acc[u]);
        if (lane == 0 && u < nt) y[(size_t)(t0 + u) * y_row + (size_t)h * y_head + r] = v * scale;
    }
}

// Split attention over the latent cache, pass 1 (pass 2 is attention_combine_f32 with hd = rank,
// no window, no sinks). Row t's query heads (q_abs [T, heads, width], already scaled) see
// positions 0..pos0 + t; they are cut into spans as attention_split_f32 cuts them
// (att_split_span over max_splits). Block (g, s, t) takes heads MLA_HEADS g.. over span s, so
// each cache row is read once for MLA_HEADS heads: per chunk of ATT_CHUNK positions warp w
// scores positions w, w + 8, .. for every head of the block (lanes over the row's width), warp g
// then runs head g's online softmax over the chunk, and thread i adds p * latent for dims
// i + 256 k of every head. Writes the partial (acc[rank], m, l) of (t, h, s) at
// part[((t * heads + h) * max_splits + s) * (rank + 2)]; blocks past the used spans write
// nothing. grid (ceil(heads / MLA_HEADS), max_splits, T), block 256. pos_ptr non-null: the first
// query's position from device memory (the decode graph).
template <typename KV>
__device__ __forceinline__ void mla_attention_span(const float* __restrict__ q_abs, KV cache,
                                                   float* __restrict__ part, int pos0, int heads, int rank,
                                                   int rope, int max_splits, const int* __restrict__ pos_ptr) {
    __shared__ float qs[MLA_HEADS][MLA_MAX_WIDTH];
    __shared__ float sc[MLA_HEADS][ATT_CHUNK];
    __shared__ float corr_s[MLA_HEADS];
    if (pos_ptr) pos0 = *pos_ptr;
    int g0 = blockIdx.x * MLA_HEADS, s = blockIdx.y, t = blockIdx.z;
    int width = rank + rope;
    int first, n;
    att_row_range(pos0, t, 0, &first, &n);
    int per = att_split_span(n, max_splits);
    int j0 = s * per, jend = min(n, j0 + per);
    if (j0 >= jend) return;
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    for (int i = threadIdx.x; i < MLA_HEADS * width; i += blockDim.x) {
        int g = i / width, c = i % width;
        qs[g][c] = g0 + g < heads ? q_abs[((size_t)t * heads + g0 + g) * width + c] : 0.f;
    }
    float acc[MLA_HEADS][MLA_RANK_PER_THREAD];
#pragma unroll
    for (int g = 0; g < MLA_HEADS; g++)
#pragma unroll
        for (int k = 0; k < MLA_RANK_PER_THREAD; k++) acc[g][k] = 0.f;
    float m = -INFINITY, l = 0.f;  // head wid's, the same in every lane of warp wid
    __syncthreads();
    for (int c0 = j0; c0 < jend; c0 += ATT_CHUNK) {
        int cnt = min(ATT_CHUNK, jend - c0);
        for (int j = wid; j < cnt; j += ATT_SPLIT_WARPS) {
            KV r = cache + (size_t)(c0 + j) * width;
            float d[MLA_HEADS];
#pragma unroll
            for (int g = 0; g < MLA_HEADS; g++) d[g] = 0.f;
            for (int c = lane; c < width; c += 32) {
                float v = kv_at(r, c);
#pragma unroll
                for (int g = 0; g < MLA_HEADS; g++) d[g] += qs[g][c] * v;
            }
#pragma unroll
            for (int g = 0; g < MLA_HEADS; g++) {
                float v = warp_sum(d[g]);
                if (lane == 0) sc[g][j] = v;
            }
        }
        __syncthreads();
        {  // warp wid: head wid's online softmax over the chunk
            float v = lane < cnt ? sc[wid][lane] : -INFINITY;
            float mn = fmaxf(m, warp_max(v));
            float p = lane < cnt ? expf(v - mn) : 0.f;
            float corr = expf(m - mn);  // m = -inf (first chunk): 0
            l = l * corr + warp_sum(p);
            m = mn;
            if (lane < cnt) sc[wid][lane] = p;
            if (lane == 0) corr_s[wid] = corr;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < MLA_RANK_PER_THREAD; k++) {
            int dim = threadIdx.x + 256 * k;
            if (dim >= rank) break;
            float a[MLA_HEADS];
#pragma unroll
            for (int g = 0; g < MLA_HEADS; g++) a[g] = acc[g][k] * corr_s[g];
            for (int j = 0; j < cnt; j++) {
                float v = kv_at(cache + (size_t)(c0 + j) * width, dim);
#pragma unroll
                for (int g = 0; g < MLA_HEADS; g++) a[g] += sc[g][j] * v;
            }
#pragma unroll
            for (int g = 0; g < MLA_HEADS; g++) acc[g][k] = a[g];
        }
        __syncthreads();  // every thread read sc and corr_s before the next chunk's
    }
#pragma unroll
    for (int g = 0; g < MLA_HEADS; g++) {
        if (g0 + g >= heads) break;
        float* pr = part + ((size_t)(t * heads + g0 + g) * max_splits + s) * (rank + 2);
#pragma unroll
        for (int k = 0; k < MLA_RANK_PER_THREAD; k++) {
            int dim = threadIdx.x + 256 * k;
            if (dim < rank) pr[dim] = acc[g][k];
        }
        if (wid == g && lane == 0) {
            pr[rank] = m;
            pr[rank + 1] = l;
        }
    }
}
extern "C" __global__ __launch_bounds__(256) void mla_attention_split_f32(const float* __restrict__ q_abs,
    const float* __restrict__ cache, float* __restrict__ part, int pos0, int heads, int rank, int rope, int max_splits,
    const int* __restrict__ pos_ptr) {
    pdl_enter();
    mla_attention_span(q_abs, kv_wrap(cache), part, pos0, heads, rank, rope, max_splits, pos_ptr);
}
extern "C" __global__ __launch_bounds__(256) void mla_attention_split_f16(const float* __restrict__ q_abs,
    const __half* __restrict__ cache, float* __restrict__ part, int pos0, int heads, int rank, int rope, int max_splits,
    const int* __restrict__ pos_ptr) {
    pdl_enter();
    mla_attention_span(q_abs, kv_wrap(cache), part, pos0, heads, rank, rope, max_splits, pos_ptr);
}
extern "C" __global__ __launch_bounds__(256) void mla_attention_split_bf16(const float* __restrict__ q_abs,
    const bf16* __restrict__ cache, float* __restrict__ part, int pos0, int heads, int rank, int rope, int max_splits,
    const int* __restrict__ pos_ptr) {
    pdl_enter();
    mla_attention_span(q_abs, kv_wrap(cache), part, pos0, heads, rank, rope, max_splits, pos_ptr);
}
extern "C" __global__ __launch_bounds__(256) void mla_attention_split_q8_0(const float* __restrict__ q_abs,
    const unsigned char* __restrict__ cache, float* __restrict__ part, int pos0, int heads, int rank, int rope,
    int max_splits, const int* __restrict__ pos_ptr) {
    pdl_enter();
    mla_attention_span(q_abs, kv_wrap(cache), part, pos0, heads, rank, rope, max_splits, pos_ptr);
}
