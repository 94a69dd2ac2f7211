// The hot lane: expert GEMVs over the VRAM cache and the decode worklist built on the GPU.
// Part of the moe-lanes kernels: compiled together with common.cuh prepended (kernels/src/cuda/kernel.rs).

// Hot lane, decode: for worklist entry e (cache slot slots[e], token row tokens[e]),
// h[e, r] = silu(G_s[r] . x_t) * (U_s[r] . x_t) over the per-layer cache [n_slots, ff, hidden].
// grid (ceil(ff/8), n_entries), block 256: one warp per ff row.
extern "C" __global__ void moe_gate_up_gemv(const bf16* __restrict__ G, const bf16* __restrict__ U,
                                            const float* __restrict__ x, const int* __restrict__ slots,
                                            const int* __restrict__ tokens, float* __restrict__ h, int ff,
                                            int hidden) {
    int r = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
    int e = blockIdx.y;
    if (r >= ff || slots[e] < 0) return;  // slot -1: a cold entry of a device-built worklist
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
        if (slots[e] < 0) continue;  // cold entry (device-built worklist)
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

// Decode hot worklist built on the GPU from the router's ids, token-major with every routed entry:
// entry e = t * k + j has slot map[ids[e]] (-1 for a cold expert or an out-of-range id; the hot
// kernels skip it) and token t; token row r is token r with entries r*k..(r+1)*k.
// grid ceil(max(T*k, T+1)/256), block 256.
extern "C" __global__ void hot_worklist_tokens(const int* __restrict__ map, const int* __restrict__ ids, int T,
                                               int k, int E, int* __restrict__ slots, int* __restrict__ tokens,
                                               int* __restrict__ tok_off, int* __restrict__ tok_rows) {
    int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e < T * k) {
        int id = ids[e];
        slots[e] = (id >= 0 && id < E) ? map[id] : -1;
        tokens[e] = e / k;
    }
    if (e < T) tok_rows[e] = e;
    if (e <= T) tok_off[e] = e * k;
}
