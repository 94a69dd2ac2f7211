// Latent attention (DeepSeek-V3 / Kimi K2 "MLA") in the absorbed form: the cache holds, per
// position, the RMS-normed latent (rank values) and the rotated key part shared by every head
// (rope values), one row of width = rank + rope; each head's query is absorbed into the latent
// space (k_b[h] times its no-RoPE part) so its scores are q_abs . row and its output is the
// softmax-weighted latent, which v_b[h] turns into the head's value.
// Part of the moe-lanes kernels: compiled together with common.cuh prepended, after
// norm_rope.cu (kv_store_row, rope_angle) and attention.cu (kv_at, kv_wrap, att_split_span,
// att_row_range, attention_combine_f32, which combines this file's split partials, and the
// tensor-core helpers AmF16 / AmBf16, am_ldsm4 and am_softmax).
// MLA_HEADS, MLA_TOKENS, MLA_MAX_RANK, MLA_MAX_ROPE, MLA_MMA_GROUPS, MLA_MMA_KEYS: -D defines
// (kernels/src/cuda/kernel.rs).
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

// ---- split latent attention on tensor cores over a 16-bit cache ----
// mla_attention_span's job (the same spans, partials and combine) as a flash-attention tile loop
// on mma.sync (m16n8k16, the cache's type in, f32 accumulate). Every head reads the same cache
// rows, so a query row is a (token, head) pair, row r = t * heads + h, and a block takes
// MLA_MMA_ROWS of them (MLA_MMA_GROUPS groups of 16) against tiles of MLA_MMA_KEYS positions
// staged by cp.async in two stages. The 4 warps of a group split the work two ways:
// - scores: warp c takes the 16-dim steps c, c + 4, .. of the row's rank + rope values (its
//   queries' fragments stay in registers for the whole span); the four partial score tiles meet
//   in shared memory, where every warp of the group sums the same fragments in the same order,
//   so all four hold the same scores and run the same online softmax (max m, sums l, per row);
// - values: warp c accumulates the latent's n8 column tiles c, c + 4, .. (P from its registers as
//   the A fragments, the staged rows transposed as B).
// Accuracy as attention_mma16_tiles' decode: q and p split hi + lo in the cache's type (22 / 16
// significant bits), cache values exact, f32 accumulation. Needs width % 16 == 0 and rank % 32
// == 0 (CudaBackend::mla_attention checks). grid (ceil(T * heads / MLA_MMA_ROWS), max_splits),
// block 32 * 4 * MLA_MMA_GROUPS, dynamic shared memory mla_mma_shared_bytes (kernel.rs).
#define MLA_MMA_ROWS (16 * MLA_MMA_GROUPS)
#define MLA_MMA_KQ ((MLA_MAX_WIDTH + 63) / 64)  // a warp's 16-dim score steps, at most
#define MLA_MMA_NO (MLA_MAX_RANK / 32)          // a warp's n8 latent column tiles (even: am_softmax's pairs)
#define MLA_MMA_LD (MLA_MAX_WIDTH + 8)          // staged row stride (16-bit values)
static_assert(MLA_MMA_KEYS == 32, "a warp's scores are four n8 key tiles; P . V takes two k16 steps");

// The span of positions row r sees in split s (first, last inclusive; last < first: none).
__device__ __forceinline__ void mla_row_span(int r, int n_rows, int heads, int pos0, int s, int max_splits,
                                             int* lo, int* hi) {
    *lo = 1;
    *hi = 0;
    if (r >= n_rows) return;
    int n = pos0 + r / heads + 1, per = att_split_span(n, max_splits);
    *lo = s * per;
    *hi = min(n, *lo + per) - 1;
}

// Positions k0.. k0 + MLA_MMA_KEYS - 1 (zeros past hi) into stage `dst`, asynchronously.
template <typename T>
__device__ __forceinline__ void mla_mma_stage(const T* __restrict__ cache, T* dst, int k0, int hi, int width) {
    const int per_row = width / 8;  // 16-byte chunks
    for (int e = threadIdx.x; e < MLA_MMA_KEYS * per_row; e += blockDim.x) {
        int j = e / per_row, i = (e % per_row) * 8, p = k0 + j;
        bool ok = p <= hi;
        cp_async16(dst + j * MLA_MMA_LD + i, cache + (size_t)(ok ? p : k0) * width + i, ok);
    }
}

// This warp's query fragments (hi, lo) of rows ra and ra + 8, 16-dim steps c, c + 4, ...
template <typename M>
__device__ __forceinline__ void mla_mma_load_q(unsigned (*qh)[4], unsigned (*ql)[4], const float* __restrict__ q_abs,
                                               int ra, int n_rows, int c, int width) {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int j = 0; j < MLA_MMA_KQ; j++) {
        int d = (c + 4 * j) * 16 + 2 * t;
#pragma unroll
        for (int x = 0; x < 4; x++) {  // a[0]: row ra, a[1]: ra + 8, a[2], a[3]: dims + 8
            int row = ra + 8 * (x & 1), dim = d + 8 * (x >> 1);
            float2 v = make_float2(0.f, 0.f);
            if (row < n_rows && dim < width) v = *(const float2*)(q_abs + (size_t)row * width + dim);
            M::split2(v.x, v.y, qh[j][x], ql[j][x]);
        }
    }
}

// The partial scores of this warp's dim steps: s[n] = rows against keys 8n.. 8n + 7 of the tile.
// No branch in the unrolled loops (ptxas schedules within a basic block only: with a break per
// step every step waited for its own loads and products): a step past the row (a latent
// narrower than the largest) reads the last step's staged values against the zero query
// fragments mla_mma_load_q left there. The lo parts accumulate apart (sl), two product chains
// a key tile instead of one.
template <typename M, typename T>
__device__ __forceinline__ void mla_mma_scores(float (*s)[4], const unsigned (*qh)[4], const unsigned (*ql)[4],
                                               const T* kt, int c, int width) {
    const int lane = threadIdx.x & 31, last = width / 16 - 1;
    const int off = ((lane & 7) + 8 * (lane >> 4)) * MLA_MMA_LD + 8 * ((lane >> 3) & 1);
    float sl[4][4];
#pragma unroll
    for (int n = 0; n < 4; n++)
#pragma unroll
        for (int x = 0; x < 4; x++) s[n][x] = 0.f, sl[n][x] = 0.f;
#pragma unroll
    for (int j = 0; j < MLA_MMA_KQ; j++) {
        int kk = min(c + 4 * j, last);
#pragma unroll
        for (int np = 0; np < 2; np++) {
            unsigned b[4];
            am_ldsm4<false>(b, (const bf16*)(kt + np * 16 * MLA_MMA_LD + kk * 16 + off));
            M::mma(s[2 * np], qh[j], b[0], b[1]);
            M::mma(sl[2 * np], ql[j], b[0], b[1]);
            M::mma(s[2 * np + 1], qh[j], b[2], b[3]);
            M::mma(sl[2 * np + 1], ql[j], b[2], b[3]);
        }
    }
#pragma unroll
    for (int n = 0; n < 4; n++)
#pragma unroll
        for (int x = 0; x < 4; x++) s[n][x] += sl[n][x];
}

// The group's four partial score tiles summed (red: [4 warps][32 lanes][16]; this warp's is
// written, the barrier between is the caller's).
__device__ __forceinline__ void mla_mma_put(float* red, const float (*s)[4], int c) {
    float4* dst = (float4*)(red + (c * 32 + (threadIdx.x & 31)) * 16);
#pragma unroll
    for (int n = 0; n < 4; n++) dst[n] = make_float4(s[n][0], s[n][1], s[n][2], s[n][3]);
}
__device__ __forceinline__ void mla_mma_sum(const float* red, float (*s)[4]) {
#pragma unroll
    for (int n = 0; n < 4; n++)
#pragma unroll
        for (int x = 0; x < 4; x++) s[n][x] = 0.f;
#pragma unroll
    for (int w = 0; w < 4; w++) {
        const float4* src = (const float4*)(red + (w * 32 + (threadIdx.x & 31)) * 16);
#pragma unroll
        for (int n = 0; n < 4; n++) {
            float4 v = src[n];
            s[n][0] += v.x;
            s[n][1] += v.y;
            s[n][2] += v.z;
            s[n][3] += v.w;
        }
    }
}

// o += p . V for this warp's latent column tiles c, c + 4, ... (the staged rows' first rank
// values are the values): p hi + lo as A fragments, each n8 tile's 32 rows by one transposed x4.
template <typename M, typename T>
__device__ __forceinline__ void mla_mma_pv(float (*o)[4], const float (*p)[4], const T* vt, int c, int n_tiles) {
    const int lane = threadIdx.x & 31;
    unsigned ah[2][4], al[2][4];
#pragma unroll
    for (int kc = 0; kc < 2; kc++) {
        M::split2(p[2 * kc][0], p[2 * kc][1], ah[kc][0], al[kc][0]);
        M::split2(p[2 * kc][2], p[2 * kc][3], ah[kc][1], al[kc][1]);
        M::split2(p[2 * kc + 1][0], p[2 * kc + 1][1], ah[kc][2], al[kc][2]);
        M::split2(p[2 * kc + 1][2], p[2 * kc + 1][3], ah[kc][3], al[kc][3]);
    }
#pragma unroll
    for (int j = 0; j < MLA_MMA_NO; j++) {  // no branch (as mla_mma_scores): tiles past the latent
        unsigned b[4];                        // redo the last one into o[j] that is never stored
        // keys 0-7, 8-15 (k step 0), 16-23, 24-31 (k step 1) of columns 8 (c + 4j)..
        am_ldsm4<true>(b, (const bf16*)(vt + lane * MLA_MMA_LD + 8 * (c + 4 * min(j, n_tiles - 1))));
        M::mma(o[j], ah[0], b[0], b[1]);
        M::mma(o[j], al[0], b[0], b[1]);
        M::mma(o[j], ah[1], b[2], b[3]);
        M::mma(o[j], al[1], b[2], b[3]);
    }
}

// This thread's rows' partials: its latent columns (unnormalised), and m, l from warp 0 of the
// group (every warp holds the same).
__device__ __forceinline__ void mla_mma_store(float* __restrict__ part, const float (*o)[4], const float* m,
                                              const float* l, const int* lo, const int* hi, int ra, int s,
                                              int max_splits, int rank, int c) {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float sum = l[h];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        if (hi[h] < lo[h]) continue;
        float* pr = part + ((size_t)(ra + 8 * h) * max_splits + s) * (rank + 2);
#pragma unroll
        for (int j = 0; j < MLA_MMA_NO; j++) {
            if (j >= rank / 32) break;
            *(float2*)(pr + 8 * (c + 4 * j) + 2 * t) = make_float2(o[j][2 * h], o[j][2 * h + 1]);
        }
        if (c == 0 && t == 0) {
            pr[rank] = m[h];
            pr[rank + 1] = sum;
        }
    }
}

template <typename M, typename T>
__device__ __forceinline__ void mla_attention_mma_tiles(const float* __restrict__ q_abs, const T* __restrict__ cache,
                                                        float* __restrict__ part, int n_tokens, int pos0, int heads,
                                                        int rank, int rope, int max_splits,
                                                        const int* __restrict__ pos_ptr) {
    extern __shared__ __align__(16) unsigned char mla_mma_smem[];
    __shared__ int span_s[2];
    T* stages = (T*)mla_mma_smem;  // 2 x MLA_MMA_KEYS x MLA_MMA_LD
    float* red = (float*)(mla_mma_smem + 2 * MLA_MMA_KEYS * MLA_MMA_LD * sizeof(T));
    if (pos_ptr) pos0 = *pos_ptr;
    const int width = rank + rope, n_rows = n_tokens * heads, s = blockIdx.y, n_tiles = rank / 32;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, grp = w >> 2, c = w & 3;
    const int ra = blockIdx.x * MLA_MMA_ROWS + 16 * grp + (lane >> 2);
    int lo[2], hi[2];
    mla_row_span(ra, n_rows, heads, pos0, s, max_splits, &lo[0], &hi[0]);
    mla_row_span(ra + 8, n_rows, heads, pos0, s, max_splits, &lo[1], &hi[1]);
    // the group's and the block's key ranges (rows without a span count for nothing)
    int glo = 0x7fffffff, ghi = -1;
#pragma unroll
    for (int h = 0; h < 2; h++)
        if (lo[h] <= hi[h]) glo = min(glo, lo[h]), ghi = max(ghi, hi[h]);
#pragma unroll
    for (int x = 16; x > 0; x >>= 1) {
        glo = min(glo, __shfl_xor_sync(0xffffffffu, glo, x));
        ghi = max(ghi, __shfl_xor_sync(0xffffffffu, ghi, x));
    }
    if (threadIdx.x == 0) span_s[0] = 0x7fffffff, span_s[1] = -1;
    __syncthreads();
    if (lane == 0) atomicMin(&span_s[0], glo), atomicMax(&span_s[1], ghi);
    __syncthreads();
    const int key_lo = span_s[0], key_hi = span_s[1];
    if (key_hi < key_lo) return;  // no row of the block has positions in this split
    unsigned qh[MLA_MMA_KQ][4], ql[MLA_MMA_KQ][4];
    mla_mma_load_q<M>(qh, ql, q_abs, ra, n_rows, c, width);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, o[MLA_MMA_NO][4];
#pragma unroll
    for (int j = 0; j < MLA_MMA_NO; j++)
#pragma unroll
        for (int x = 0; x < 4; x++) o[j][x] = 0.f;
    const int stage = MLA_MMA_KEYS * MLA_MMA_LD;
    float* gred = red + grp * 4 * 32 * 16;
    mla_mma_stage(cache, stages, key_lo, key_hi, width);
    cp_async_commit();
    for (int k0 = key_lo, i = 0; k0 <= key_hi; k0 += MLA_MMA_KEYS, i ^= 1) {
        const T* kt = stages + i * stage;
        if (k0 + MLA_MMA_KEYS <= key_hi) mla_mma_stage(cache, stages + (i ^ 1) * stage, k0 + MLA_MMA_KEYS, key_hi, width);
        cp_async_commit();
        cp_async_wait<1>();  // this tile's copies have landed (the next tile's may fly)
        __syncthreads();
        const bool sees = ghi >= glo && k0 <= ghi && k0 + MLA_MMA_KEYS - 1 >= glo;  // the group's rows
        float sc[4][4];
        if (sees) {
            mla_mma_scores<M>(sc, qh, ql, kt, c, width);
            mla_mma_put(gred, sc, c);
        }
        __syncthreads();
        if (sees) {
            mla_mma_sum(gred, sc);
            // the visible span [lo, hi] as am_softmax's (first, last) positions; unscaled (q_abs is);
            // every o tile rescaled (a constant width: no branch)
            am_softmax<4, MLA_MMA_NO / 2>(sc, o, m, l, hi, lo, k0, 1.f, 8 * MLA_MMA_NO);
            mla_mma_pv<M>(o, sc, kt, c, n_tiles);
        }
        __syncthreads();  // the stage and the partial scores are consumed before they are refilled
    }
    mla_mma_store(part, o, m, l, lo, hi, ra, s, max_splits, rank, c);
}
extern "C" __global__ __launch_bounds__(128 * MLA_MMA_GROUPS) void mla_attention_mma_f16(const float* __restrict__ q_abs,
    const __half* __restrict__ cache, float* __restrict__ part, int n_tokens, int pos0, int heads, int rank, int rope,
    int max_splits, const int* __restrict__ pos_ptr) {
    pdl_enter();
    mla_attention_mma_tiles<AmF16>(q_abs, cache, part, n_tokens, pos0, heads, rank, rope, max_splits, pos_ptr);
}
extern "C" __global__ __launch_bounds__(128 * MLA_MMA_GROUPS) void mla_attention_mma_bf16(const float* __restrict__ q_abs,
    const bf16* __restrict__ cache, float* __restrict__ part, int n_tokens, int pos0, int heads, int rank, int rope,
    int max_splits, const int* __restrict__ pos_ptr) {
    pdl_enter();
    mla_attention_mma_tiles<AmBf16>(q_abs, cache, part, n_tokens, pos0, heads, rank, rope, max_splits, pos_ptr);
}
