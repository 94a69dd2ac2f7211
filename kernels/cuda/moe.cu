// The hot lane: expert GEMVs over the VRAM cache and the decode worklist built on the GPU.
// Part of the moe-lanes kernels: compiled together with common.cuh prepended (kernels/src/cuda/kernel.rs).

// Hot lane, decode: for worklist entry e (cache slot slots[e], token row tokens[e]),
// h[e, r] = glu(act, G_s[r] . x_t + bg[s, r], U_s[r] . x_t + bu[s, r]) over the per-layer cache
// [n_slots, ff, hidden] (common.cuh's glu: SiLU or the clamped SwiGLU; bg, bu per-slot biases
// [n_slots, ff], null: none). grid (ceil(ff/8), n_entries), block 256: one warp per ff row.
extern "C" __global__ void moe_gate_up_gemv(const bf16* __restrict__ G, const bf16* __restrict__ U,
                                            const float* __restrict__ x, const int* __restrict__ slots,
                                            const int* __restrict__ tokens, float* __restrict__ h, int ff,
                                            int hidden, int act, const float* __restrict__ bg,
                                            const float* __restrict__ bu) {
    pdl_enter();
    int r = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
    int e = blockIdx.y;
    if (r >= ff || slots[e] < 0) return;  // slot -1: a cold entry of a device-built worklist
    size_t off = ((size_t)slots[e] * ff + r) * hidden;
    const float* xt = x + (size_t)tokens[e] * hidden;
    float g = warp_dot_bf16(G + off, xt, hidden);
    float u = warp_dot_bf16(U + off, xt, hidden);
    if ((threadIdx.x & 31) == 0) h[(size_t)e * ff + r] = glu_biased(act, g, u, bg, bu, slots[e], r, ff);
}

// Hot lane, decode: weighted down projections accumulated into token rows, deterministic (no
// atomics): output row i is token tok_rows[i], whose entries are tok_off[i]..tok_off[i+1]
// (token-major worklist). out[t, r] += sum_e weights[e] * (D_{slots[e]}[r] . h[e] + bd[slots[e], r]),
// summed in entry order. D is the cache [n_slots, hidden, ff]; bd per-slot down biases
// [n_slots, hidden] (null: none). A block takes DOWN_ROWS output rows and the
// token's entries ROWS_PER_BLOCK at a time, one per warp (its dot products over the rows into
// shared memory), then thread r adds row r's products in entry order: the sum of one warp
// walking the entries, with every entry's loads in flight at once.
// grid (ceil(hidden/DOWN_ROWS), n_rows), block 32 * ROWS_PER_BLOCK.
static_assert(DOWN_ROWS % 2 == 0, "moe_down_accum takes its rows two at a time");
extern "C" __global__ void moe_down_accum(const bf16* __restrict__ D, const float* __restrict__ h,
                                          const int* __restrict__ slots, const float* __restrict__ weights,
                                          const int* __restrict__ tok_off, const int* __restrict__ tok_rows,
                                          float* __restrict__ out, int hidden, int ff,
                                          const float* __restrict__ bd) {
    pdl_enter();
    __shared__ float part[ROWS_PER_BLOCK][DOWN_ROWS];
    int warp = threadIdx.x >> 5, r0 = blockIdx.x * DOWN_ROWS, i = blockIdx.y;
    int rb = min(r0 + (int)threadIdx.x, hidden - 1);  // this thread's output row (clamped for bd's reads)
    int e0 = tok_off[i], e1 = tok_off[i + 1];
    float acc = 0.f;  // thread r < DOWN_ROWS: output row r0 + r
    for (int c = e0; c < e1; c += ROWS_PER_BLOCK) {
        int e = c + warp, s = e < e1 ? slots[e] : -1;  // -1: cold (device-built worklist) or past the end
        if (s >= 0) {
            const float* he = h + (size_t)e * ff;
            const bf16* Ds = D + (size_t)s * hidden * ff;
#pragma unroll
            for (int r = 0; r < DOWN_ROWS; r += 2) {  // two rows a loop, their loads together
                float d0 = 0.f, d1 = 0.f;
                if (r0 + r + 1 < hidden)
                    warp_dot2_bf16(Ds + (size_t)(r0 + r) * ff, Ds + (size_t)(r0 + r + 1) * ff, he, ff, &d0, &d1);
                else if (r0 + r < hidden)
                    d0 = warp_dot_bf16(Ds + (size_t)(r0 + r) * ff, he, ff);
                if ((threadIdx.x & 31) == 0) part[warp][r] = d0, part[warp][r + 1] = d1;
            }
        }
        __syncthreads();
        if (threadIdx.x < DOWN_ROWS)
            for (int u = 0; u < ROWS_PER_BLOCK && c + u < e1; u++)
                if (slots[c + u] >= 0)
                    acc += weights[c + u] * (bd ? part[u][threadIdx.x] + bd[(size_t)slots[c + u] * hidden + rb]
                                                : part[u][threadIdx.x]);
        __syncthreads();
    }
    if (threadIdx.x < DOWN_ROWS && r0 + (int)threadIdx.x < hidden)
        out[(size_t)tok_rows[i] * hidden + r0 + threadIdx.x] += acc;
}

// Hot lane, prefill: after the expert-major grouped GEMMs, y holds one row per entry. Output row i
// (token tok_rows[i]) adds its entries entries[tok_off[i]..tok_off[i+1]] weighted (an entry of -1
// adds nothing).
// grid (n_rows), block 256.
extern "C" __global__ void moe_scatter_accum(const float* __restrict__ y, const int* __restrict__ entries,
                                             const float* __restrict__ weights, const int* __restrict__ tok_off,
                                             const int* __restrict__ tok_rows, float* __restrict__ out, int hidden) {
    pdl_enter();
    int i = blockIdx.x;
    float* o = out + (size_t)tok_rows[i] * hidden;
    for (int d = threadIdx.x; d < hidden; d += blockDim.x) {
        float acc = 0.f;
        for (int j = tok_off[i]; j < tok_off[i + 1]; j++) {
            int e = entries[j];
            if (e < 0) continue;  // a cold entry of hot_worklist_grouped's worklist
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
    pdl_enter();
    int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e < T * k) {
        int id = ids[e];
        slots[e] = (id >= 0 && id < E) ? map[id] : -1;
        tokens[e] = e / k;
    }
    if (e < T) tok_rows[e] = e;
    if (e <= T) tok_off[e] = e * k;
}

// Hot worklist for the grouped GEMMs (a batched decode step or an all-hot prefill call of T rows),
// built on the GPU from the router's ids [T * k] and weights: the hot entries sorted by cache slot
// (stable: by entry index within a slot), sorted row p having token tokens[p] and weight wsorted[p];
// entries[e] = the sorted row of routed entry e (token-major, e = t * k + j), -1 for a cold expert
// or an out-of-range id; token row t is token t with entries t*k..(t+1)*k (tok_off, tok_rows);
// tiles as grouped_tiles writes them (slot, first row, rows <= bm, the tile rows of the GEMMs that
// read them) for each slot's run, then
// (-1, 0, 0) up to n_tiles (the launch's bound: the grouped GEMMs skip those). Sorted rows past the
// hot entries get token 0 and weight 0. One block; warp w ranks the entries of its own contiguous
// segment (a count per slot and warp, scanned over the warps, then __match_any_sync within each 32
// entries), so the sort is O(T * k / threads) a thread. Dynamic shared memory
// (T * k + (3 + warps) * n_slots) ints.
extern "C" __global__ void hot_worklist_grouped(const int* __restrict__ map, const int* __restrict__ ids,
                                                const float* __restrict__ weights, int T, int k, int E, int n_slots,
                                                int n_tiles, int bm, int* __restrict__ tokens, float* __restrict__ wsorted,
                                                int* __restrict__ entries, int* __restrict__ tok_off,
                                                int* __restrict__ tok_rows, int* __restrict__ tiles) {
    pdl_enter();
    extern __shared__ int hw_sh[];
    int n = T * k, n_warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int* slot_of = hw_sh;         // [n]
    int* cnt = hw_sh + n;         // [n_slots]: the slot's hot entries
    int* first = cnt + n_slots;   // [n_slots]: its first sorted row
    int* tile0 = first + n_slots; // [n_slots]: its first tile
    int* base = tile0 + n_slots;  // [n_warps][n_slots]: the slot's entries in earlier warps' segments
    __shared__ int used_rows, used_tiles;
    int seg = (n + n_warps - 1) / n_warps, e0 = min(n, warp * seg), e1 = min(n, e0 + seg);
    for (int i = threadIdx.x; i < n_warps * n_slots; i += blockDim.x) base[i] = 0;
    __syncthreads();
    for (int e = e0 + lane; e < e1; e += 32) {
        int id = ids[e];
        int s = (id >= 0 && id < E) ? map[id] : -1;
        s = s < n_slots ? s : -1;
        slot_of[e] = s;
        if (s >= 0) atomicAdd(&base[warp * n_slots + s], 1);
    }
    __syncthreads();
    for (int s = threadIdx.x; s < n_slots; s += blockDim.x) {  // exclusive scan over the warps
        int run = 0;
        for (int w = 0; w < n_warps; w++) {
            int c = base[w * n_slots + s];
            base[w * n_slots + s] = run;
            run += c;
        }
        cnt[s] = run;
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // exclusive scans of rows and tiles over the slots
        int rows = 0, tl = 0;
        for (int s = 0; s < n_slots; s++) {
            first[s] = rows;
            tile0[s] = tl;
            rows += cnt[s];
            tl += (cnt[s] + bm - 1) / bm;
        }
        used_rows = rows;
        used_tiles = tl;
    }
    __syncthreads();
    int* wbase = base + warp * n_slots;
    for (int e_lo = e0; e_lo < e1; e_lo += 32) {  // warp-uniform trip count
        int e = e_lo + lane;
        int s = e < e1 ? slot_of[e] : -2;
        unsigned same = __match_any_sync(0xffffffffu, s), before = same & ((1u << lane) - 1u);
        if (s >= 0) {
            int p = first[s] + wbase[s] + __popc(before);
            tokens[p] = e / k;
            wsorted[p] = weights[e];
            entries[e] = p;
        } else if (s == -1) {
            entries[e] = -1;
        }
        __syncwarp();
        if (s >= 0 && (same >> lane) == 1u) wbase[s] += __popc(same);  // the group's last lane
        __syncwarp();
    }
    __syncthreads();
    for (int p = used_rows + threadIdx.x; p < n; p += blockDim.x) {
        tokens[p] = 0;
        wsorted[p] = 0.f;
    }
    for (int s = threadIdx.x; s < n_slots; s += blockDim.x)
        for (int c = 0; c * bm < cnt[s]; c++) {
            int* tl = tiles + 3 * (tile0[s] + c);
            tl[0] = s, tl[1] = first[s] + c * bm, tl[2] = min(bm, cnt[s] - c * bm);
        }
    for (int i = used_tiles + threadIdx.x; i < n_tiles; i += blockDim.x) {
        int* tl = tiles + 3 * i;
        tl[0] = -1, tl[1] = 0, tl[2] = 0;
    }
    for (int t = threadIdx.x; t <= T; t += blockDim.x) {
        tok_off[t] = t * k;
        if (t < T) tok_rows[t] = t;
    }
}
