// Attention over the KV cache: one block per (token, head), and the split-position decode form.
// Part of the moe-lanes kernels: compiled together with common.cuh prepended (kernels/src/cuda/kernel.rs).

// Causal GQA attention of T query rows (positions pos0..pos0+T-1) against the layer's KV cache,
// which already holds positions 0..pos0+T-1 ([positions, kv_dim] f32). Decode is T = 1.
// window > 0 limits each query to its last `window` positions. head_dim <= 256.
// Scores: one warp per position (coalesced K rows, 4 positions in flight per warp); values: each
// warp accumulates its positions for all dims, then the warps' partials are summed.
// grid (T, n_heads), block 256, dynamic shared memory: max(visible positions, 8 * hd) * 4 bytes.
extern "C" __global__ void attention_f32(const float* __restrict__ q, const float* __restrict__ kc,
                                         const float* __restrict__ vc, float* __restrict__ out, int pos0,
                                         int n_heads, int n_kv, int hd, int window, float scale) {
    pdl_enter();
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
// m = -inf, l = 0, acc = 0. grid (splits, n_heads, T), block 32 * ATT_SPLIT_WARPS (each warp scores
// ATT_CHUNK / ATT_SPLIT_WARPS positions). pos_ptr non-null (the decode graph): the first query's
// position comes from device memory, and the grid may hold more splits than the keys need (the
// extra chunks are empty).
#define ATT_SPLIT_PER_WARP (ATT_CHUNK / ATT_SPLIT_WARPS)
static_assert(ATT_CHUNK % ATT_SPLIT_WARPS == 0, "every warp scores the same number of positions");
static_assert(ATT_MAXC * 32 == ATT_MAX_HEAD_DIM, "ATT_MAXC values per lane cover the largest head");
extern "C" __global__ void attention_split_f32(const float* __restrict__ q, const float* __restrict__ kc,
                                               const float* __restrict__ vc, float* __restrict__ part, int pos0,
                                               int n_heads, int n_kv, int hd, int window, float scale, int splits,
                                               const int* __restrict__ pos_ptr) {
    pdl_enter();
    __shared__ float sc[ATT_CHUNK];
    if (pos_ptr) pos0 = *pos_ptr;
    __shared__ float red[ATT_SPLIT_WARPS * ATT_MAX_HEAD_DIM];
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
    float d[ATT_SPLIT_PER_WARP];
#pragma unroll
    for (int u = 0; u < ATT_SPLIT_PER_WARP; u++) {
        int j = wid + ATT_SPLIT_WARPS * u;
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
    for (int u = 0; u < ATT_SPLIT_PER_WARP; u++) {
        int j = wid + ATT_SPLIT_WARPS * u;
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
    for (int u = 0; u < ATT_SPLIT_PER_WARP; u++) {
        int j = wid + ATT_SPLIT_WARPS * u;
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
        for (int w = 0; w < ATT_SPLIT_WARPS; w++) a += red[w * hd + i];
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
    pdl_enter();
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
extern "C" __global__ void attention_tiled_f32(const float* __restrict__ q, const float* __restrict__ kc,
                                               const float* __restrict__ vc, float* __restrict__ out,
                                               int n_tokens, int pos0, int n_heads, int n_kv, int hd,
                                               int window, float scale) {
    pdl_enter();
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
            ks[j * ks_stride + i] = p <= key_hi ? kc[src] : 0.f;
            vs[j * hd + i] = p <= key_hi ? vc[src] : 0.f;
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
        float inv = 1.f / l[r];
        float* o = out + (size_t)(rg / g) * q_dim + (size_t)(kvh * g + rg % g) * hd;
#pragma unroll
        for (int c = 0; c < ATT_TILE_MAXC; c++) {
            int i = lane + 32 * c;
            if (i < hd) o[i] = acc[r][c] * inv;
        }
    }
}
