// Router: top-k expert ids and weights from router logits (softmax variants; sigmoid routing).
// Part of the moe-lanes kernels: compiled together with common.cuh prepended (kernels/src/cuda/kernel.rs).

// TOPK_PER_LANE (-D, kernels/src/cuda/kernel.rs): picks of a row's top-k one lane holds at most,
// lane j picks j, j + WARP, ... (ROUTE_MAX_TOPK = WARP * TOPK_PER_LANE picks). The top-k helpers
// take R, the picks a lane holds in a call: 1 for k <= WARP (every model's routing), else
// TOPK_PER_LANE.

// The weights of a row's top-k picks, by one warp (every lane calls it): v[r] is the logit of pick
// lane + WARP * r (picks largest first; -inf past the last; mx: the largest), p[r] gets its weight.
// variant 0: softmax over all E logits l, then the picked probabilities (renormalised when norm !=
// 0); variant 1: softmax over the k. Each lane computes its picks' values in registers, and the sums
// over the picks add them in pick order through shuffles: the arithmetic of one thread walking the
// picks, without a round trip through memory per pick.
template <int R>
__device__ __forceinline__ void topk_weights(const float* l, int E, int k, int variant, int norm, const float* v,
                                             float mx, float* p) {
    int lane = threadIdx.x & 31;
    float sum = 0.f;
    if (variant == 0) {
        for (int e = lane; e < E; e += WARP) sum += expf(l[e] - mx);
        sum = warp_sum(sum);
    } else {
#pragma unroll
        for (int r = 0; r < R; r++)
            for (int j = 0; j < WARP && r * WARP + j < k; j++)
                sum += expf(__shfl_sync(0xffffffffu, v[r], j) - mx);
    }
#pragma unroll
    for (int r = 0; r < R; r++) p[r] = expf(v[r] - mx) / sum;
    if (variant != 0 || !norm) return;
    float sel = 0.f;
#pragma unroll
    for (int r = 0; r < R; r++)
        for (int j = 0; j < WARP && r * WARP + j < k; j++) sel += __shfl_sync(0xffffffffu, p[r], j);
#pragma unroll
    for (int r = 0; r < R; r++) p[r] /= sel;
}

// Lane's picks (ids id[r], logits v[r] of pick lane + WARP * r) written out with their weights:
// ids[j], weights[j] for j < k.
template <int R>
__device__ __forceinline__ void topk_store(const float* l, int E, int k, int variant, int norm, const int* id,
                                           const float* v, float mx, int* __restrict__ ids,
                                           float* __restrict__ weights) {
    float p[R];
    topk_weights<R>(l, E, k, variant, norm, v, mx, p);
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; r++)
        if (lane + r * WARP < k) ids[lane + r * WARP] = id[r], weights[lane + r * WARP] = p[r];
}

// The top-k of one logits row `l` by one warp (every lane calls it): each of the k rounds is a
// warp argmax (larger value, then lower id) over the experts after the previous pick; lane j
// keeps picks j, j + WARP, ... and writes them (see route_topk for the variants).
template <int R>
__device__ __forceinline__ void topk_row(const float* l, int E, int k, int variant, int norm, int* __restrict__ ids,
                                         float* __restrict__ weights) {
    int lane = threadIdx.x & 31;
    float pv = INFINITY, mine[R];
    int pi = -1, mine_id[R];
#pragma unroll
    for (int r = 0; r < R; r++) mine[r] = -INFINITY, mine_id[r] = -1;
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
#pragma unroll
        for (int r = 0; r < R; r++)
            if (j == lane + r * WARP) mine[r] = bv, mine_id[r] = bi;
        if (j == 0) mx = bv;  // the largest logit overall
        pv = bv;
        pi = bi;
    }
    topk_store<R>(l, E, k, variant, norm, mine_id, mine, mx, ids, weights);
}

// The top-k of a logits row `ls` (shared memory) by the whole block (every thread calls it): the
// picks of topk_row (larger value first, ties to the lower id, NaN never picked, id -1 and
// weight -inf past the last non-NaN logit) and its weights. Each thread ranks its experts against
// all E at once instead of k warp argmax rounds one after another; the picks meet in shared
// memory and warp 0 writes them. Lane j of warp 0 gets picks j, j + WARP, ... in id.
template <int R>
__device__ __forceinline__ void topk_block(const float* ls, int E, int k, int variant, int norm, int* __restrict__ ids,
                                           float* __restrict__ weights, int* id) {
    __shared__ int pick_id[WARP * TOPK_PER_LANE];
    __shared__ float pick_v[WARP * TOPK_PER_LANE];
    for (int j = threadIdx.x; j < k; j += blockDim.x) pick_id[j] = -1, pick_v[j] = -INFINITY;
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        float v = ls[e];
        if (v != v) continue;  // NaN
        int rank = 0;
        for (int j = 0; j < E; j++) rank += (ls[j] > v) || (ls[j] == v && j < e);
        if (rank < k) pick_id[rank] = e, pick_v[rank] = v;
    }
    __syncthreads();
    if (threadIdx.x >= WARP) return;
    float v[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        int j = threadIdx.x + r * WARP;
        v[r] = j < k ? pick_v[j] : -INFINITY;
        id[r] = j < k ? pick_id[j] : -1;
    }
    topk_store<R>(ls, E, k, variant, norm, id, v, pick_v[0], ids, weights);
}

// Router: top-k expert ids and weights per token from logits [T, E]. Ties go to the lower id.
// variant 0: softmax over all experts, then top-k (renormalised when norm != 0);
// variant 1: top-k on logits, then softmax over the k. One warp per token: each of the k rounds
// is a warp argmax (larger value, then lower id) over the experts after the previous pick.
// grid ceil(T/8), block 256.
extern "C" __global__ void route_topk(const float* __restrict__ logits, int T, int E, int k, int variant,
                                      int norm, int* __restrict__ ids, float* __restrict__ weights) {
    pdl_enter();
    int t = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
    if (t >= T) return;  // whole warps
    const float* l = logits + (size_t)t * E;
    if (k <= WARP)
        topk_row<1>(l, E, k, variant, norm, ids + (size_t)t * k, weights + (size_t)t * k);
    else
        topk_row<TOPK_PER_LANE>(l, E, k, variant, norm, ids + (size_t)t * k, weights + (size_t)t * k);
}

// Sigmoid routing (DeepSeek-V3, Kimi K2, GLM-4.5), one block per token row, the CPU router's
// arithmetic (src/moe/routing.rs): scores p = 1 / (1 + e^-logit), choices c = p + the selection
// bias (bias null: none); with n_group > 1 the E experts fall in n_group equal groups, a group
// scores the sum of its two largest choices, and only the best topk_group groups (ties to the
// lower group) stay eligible; the k largest eligible choices (ties to the lower id) are picked,
// largest first, each weighted by its score p, times 1 / (sum of the picks' scores + 1e-20) when
// norm, times scale. Each thread ranks its experts (and groups) against all at once.
// grid (T), block ROUTE_SIGMOID_THREADS; E <= ROUTE_SIG_MAXE, n_group <= ROUTE_SIG_MAXG,
// k <= WARP * TOPK_PER_LANE.
extern "C" __global__ void route_sigmoid(const float* __restrict__ logits, int T, int E, int k,
                                         const float* __restrict__ bias, int n_group, int topk_group, int norm,
                                         float scale, int* __restrict__ ids, float* __restrict__ weights) {
    pdl_enter();
    __shared__ float p[ROUTE_SIG_MAXE], c[ROUTE_SIG_MAXE], gs[ROUTE_SIG_MAXG];
    __shared__ int keep[ROUTE_SIG_MAXG], pick[WARP * TOPK_PER_LANE];
    int t = blockIdx.x;
    const float* l = logits + (size_t)t * E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        float s = 1.f / (1.f + expf(-l[e]));
        p[e] = s;
        c[e] = bias ? s + bias[e] : s;
    }
    __syncthreads();
    if (n_group > 1) {
        int per = E / n_group;
        for (int g = threadIdx.x; g < n_group; g += blockDim.x) {
            float best = -INFINITY, second = -INFINITY;
            for (int e = g * per; e < (g + 1) * per; e++) {
                float v = c[e];
                if (v > best) second = best, best = v;
                else if (v > second) second = v;
            }
            gs[g] = best + second;
        }
        __syncthreads();
        for (int g = threadIdx.x; g < n_group; g += blockDim.x) {
            int rank = 0;
            for (int j = 0; j < n_group; j++) rank += (gs[j] > gs[g]) || (gs[j] == gs[g] && j < g);
            keep[g] = rank < topk_group;
        }
        __syncthreads();
        for (int e = threadIdx.x; e < E; e += blockDim.x)
            if (!keep[e / per]) c[e] = -INFINITY;
        __syncthreads();
    }
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        float v = c[e];
        int rank = 0;
        for (int j = 0; j < E; j++) rank += (c[j] > v) || (c[j] == v && j < e);
        if (rank < k) pick[rank] = e;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float sum = 0.f;
        for (int j = 0; j < k; j++) sum += p[pick[j]];
        float f = norm ? 1.f / (sum + 1e-20f) : 1.f;
        for (int j = 0; j < k; j++) {
            ids[(size_t)t * k + j] = pick[j];
            weights[(size_t)t * k + j] = p[pick[j]] * f * scale;
        }
    }
}

// One warp's router row, its first ROUTE_PRELOAD 8-value groups a lane loaded before the block's
// RMSNorm (static weights: their memory latency overlaps the norm's); dot() takes the row against
// x as warp_dot_bf16 does, in its order (the same bits). Rows that are not 16-byte aligned whole
// groups take warp_dot_bf16 itself.
#define ROUTE_PRELOAD 8
struct RouterRow {
    const bf16* w;
    bool vec;
    uint4 pre[ROUTE_PRELOAD];

    __device__ void load(const bf16* row, int k) {
        w = row;
        vec = (k & 7) == 0 && (((size_t)row) & 15) == 0;
        if (!vec) return;
        int lane = threadIdx.x & 31;
#pragma unroll
        for (int u = 0; u < ROUTE_PRELOAD; u++)
            if (lane + u * WARP < (k >> 3)) pre[u] = ((const uint4*)row)[lane + u * WARP];
    }

    // x: 16-byte aligned (shared memory)
    __device__ float dot(const float* x, int k) const {
        if (!vec) return warp_dot_bf16(w, x, k);
        int lane = threadIdx.x & 31, n8 = k >> 3;
        const float4* x4 = (const float4*)x;
        float acc = 0.f;
#pragma unroll
        for (int u = 0; u < ROUTE_PRELOAD; u++) {
            int i = lane + u * WARP;
            if (i < n8) acc = dot8_bf16(pre[u], x4[2 * i], x4[2 * i + 1], acc);
        }
        for (int i = lane + ROUTE_PRELOAD * WARP; i < n8; i += WARP)
            acc = dot8_bf16(((const uint4*)w)[i], x4[2 * i], x4[2 * i + 1], acc);
        return warp_sum(acc);
    }
};

// Decode routing in one launch, for the decode graph's fewer launches: the FFN RMSNorm of token
// row t (every block normalises the row into shared memory with rmsnorm_f32's math and order, so
// the bits are the same; block 0 also writes it to `normed`), one warp per router row (bf16
// weights, warp_dot_bf16 as gemv_bf16) into `logits`, and the block that finishes row t last
// (a per-row counter, reset by that block, so a replayed graph finds it at zero) copies the row's
// logits (past L1) and takes its top-k (topk_block: topk_row's picks) and, when `map` is given, the row's hot
// worklist entries (hot_worklist_tokens's layout). grid (ceil(E / ROWS_PER_BLOCK), T), block
// 32 * ROWS_PER_BLOCK, dynamic shared (H + E) floats.
extern "C" __global__ void route_decode(const float* __restrict__ x, const float* __restrict__ nw,
                                        float* __restrict__ normed, const bf16* __restrict__ W, int H, int E,
                                        float eps, float* __restrict__ logits, int k, int variant, int norm,
                                        int* __restrict__ ids, float* __restrict__ weights,
                                        unsigned* __restrict__ counter, const int* __restrict__ map,
                                        int* __restrict__ slots, int* __restrict__ tokens,
                                        int* __restrict__ tok_off, int* __restrict__ tok_rows) {
    pdl_enter();
    extern __shared__ float4 route_sm4[];
    float* xs = (float*)route_sm4;  // [H] the normed row, then [E] the logits row
    __shared__ int last;
    int t = blockIdx.y, T = gridDim.y;
    int e = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
    RouterRow row;
    if (e < E) row.load(W + (size_t)e * H, H);  // in flight during the norm
    norm_row(x + (size_t)t * H, nw, H, eps, xs);
    if (blockIdx.x == 0)
        for (int i = threadIdx.x; i < H; i += blockDim.x) normed[(size_t)t * H + i] = xs[i];
    if (e < E) {
        float d = row.dot(xs, H);
        if ((threadIdx.x & 31) == 0) logits[(size_t)t * E + e] = d;
    }
    __threadfence();  // this block's logits are visible before its count
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&counter[t], 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    float* ls = xs + H;
    for (int i = threadIdx.x; i < E; i += blockDim.x) ls[i] = __ldcg(logits + (size_t)t * E + i);
    __syncthreads();
    int id[TOPK_PER_LANE];  // warp 0, lane j: picks j, j + WARP, ...
    if (k <= WARP)  // one pick a lane: fewer registers and shorter loops (2 us of 12 in ncu)
        topk_block<1>(ls, E, k, variant, norm, ids + (size_t)t * k, weights + (size_t)t * k, id);
    else
        topk_block<TOPK_PER_LANE>(ls, E, k, variant, norm, ids + (size_t)t * k, weights + (size_t)t * k, id);
    if (threadIdx.x >= WARP) return;
    if (threadIdx.x == 0) counter[t] = 0;
    if (!map) return;
#pragma unroll
    for (int r = 0; r < TOPK_PER_LANE; r++) {
        int j = threadIdx.x + r * WARP, ej = j < k ? id[r] : -1;
        if (j < k) {
            slots[t * k + j] = (ej >= 0 && ej < E) ? map[ej] : -1;
            tokens[t * k + j] = t;
        }
    }
    if (threadIdx.x == 0) {
        tok_rows[t] = t;
        tok_off[t] = t * k;
        if (t == T - 1) tok_off[T] = T * k;
    }
}
