// Router: top-k expert ids and weights from router logits (both routing variants).
// Part of the moe-lanes kernels: compiled together with common.cuh prepended (kernels/src/cuda/kernel.rs).

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
