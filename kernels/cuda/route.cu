// Router: top-k expert ids and weights from router logits (both routing variants).
// Part of the moe-lanes kernels: compiled together with common.cuh prepended (kernels/src/cuda/kernel.rs).

// The weights of a row's top-k (weights[0..k) hold the k picked logits, largest first = mx),
// one warp (every lane calls it; lane 0 writes). variant 0: softmax over all E logits l, then the
// picked probabilities (renormalised when norm != 0); variant 1: softmax over the k.
__device__ void topk_weights(const float* l, int E, int k, int variant, int norm, float mx,
                             float* __restrict__ weights) {
    int lane = threadIdx.x & 31;
    if (variant == 0) {
        float sum = 0.f;
        for (int e = lane; e < E; e += WARP) sum += expf(l[e] - mx);
        sum = warp_sum(sum);
        if (lane == 0) {
            float sel = 0.f;
            for (int j = 0; j < k; j++) {
                float p = expf(weights[j] - mx) / sum;
                weights[j] = p;
                sel += p;
            }
            if (norm)
                for (int j = 0; j < k; j++) weights[j] /= sel;
        }
    } else if (lane == 0) {
        float sum = 0.f;
        for (int j = 0; j < k; j++) sum += expf(weights[j] - mx);
        for (int j = 0; j < k; j++) weights[j] = expf(weights[j] - mx) / sum;
    }
}

// The top-k of one logits row `l` by one warp (every lane calls it): each of the k rounds is a
// warp argmax (larger value, then lower id) over the experts after the previous pick; lane 0
// writes ids[0..k] and weights[0..k] (see route_topk for the variants).
__device__ void topk_row(const float* l, int E, int k, int variant, int norm, int* __restrict__ ids,
                         float* __restrict__ weights) {
    int lane = threadIdx.x & 31;
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
            ids[j] = bi;
            weights[j] = bv;
        }
        if (j == 0) mx = bv;  // the largest logit overall
        pv = bv;
        pi = bi;
    }
    topk_weights(l, E, k, variant, norm, mx, weights);
}

// The top-k of a logits row `ls` (shared memory) by the whole block (every thread calls it): the
// picks of topk_row (larger value first, ties to the lower id, NaN never picked, id -1 and
// weight -inf past the last non-NaN logit) and its weights. Each thread ranks its experts against
// all E at once instead of k warp argmax rounds one after another.
__device__ void topk_block(const float* ls, int E, int k, int variant, int norm, int* __restrict__ ids,
                           float* __restrict__ weights) {
    for (int j = threadIdx.x; j < k; j += blockDim.x) ids[j] = -1, weights[j] = -INFINITY;
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        float v = ls[e];
        if (v != v) continue;  // NaN
        int rank = 0;
        for (int j = 0; j < E; j++) rank += (ls[j] > v) || (ls[j] == v && j < e);
        if (rank < k) ids[rank] = e, weights[rank] = v;
    }
    __syncthreads();  // the block's global writes are visible to the block after it
    if (threadIdx.x >= WARP) return;
    float mx = weights[0];  // the largest picked logit
    __syncwarp();           // read by every lane before lane 0 rewrites weights
    topk_weights(ls, E, k, variant, norm, mx, weights);
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
    topk_row(logits + (size_t)t * E, E, k, variant, norm, ids + (size_t)t * k, weights + (size_t)t * k);
}

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
    norm_row(x + (size_t)t * H, nw, H, eps, xs);
    if (blockIdx.x == 0)
        for (int i = threadIdx.x; i < H; i += blockDim.x) normed[(size_t)t * H + i] = xs[i];
    int e = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
    if (e < E) {
        float d = warp_dot_bf16(W + (size_t)e * H, xs, H);
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
    int* id = ids + (size_t)t * k;
    topk_block(ls, E, k, variant, norm, id, weights + (size_t)t * k);  // warp 0 returns from it last
    if (threadIdx.x >= WARP) return;
    __syncwarp();
    if (threadIdx.x == 0) counter[t] = 0;
    if (!map) return;
    for (int j = threadIdx.x; j < k; j += WARP) {
        int ej = id[j];
        slots[t * k + j] = (ej >= 0 && ej < E) ? map[ej] : -1;
        tokens[t * k + j] = t;
    }
    if (threadIdx.x == 0) {
        tok_rows[t] = t;
        tok_off[t] = t * k;
        if (t == T - 1) tok_off[T] = T * k;
    }
}
