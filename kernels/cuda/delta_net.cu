// Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention): the per-token part of a layer between
// its input projections and its output projection, two launches per call.
// Part of the moe-lanes kernels: compiled together with common.cuh prepended (kernels/src/cuda/kernel.rs).
// Layout: token t's projections are one row p[t] = [q (kd) | k (kd) | v (vd) | z (vd)] of p_stride
// floats (kd = nk * dk, vd = nv * dv) and one row ba[t] = [b (nv) | a (nv)]; the grouped checkpoints'
// rows are put in this order when the weights are uploaded.

// The depthwise causal conv over the first conv_dim channels of p, then SiLU, in place, token by
// token: channel c of token t is sum_j w[c][j] * x[t - (kernel - 1) + j]. state holds each
// channel's last kernel - 1 inputs ([kernel - 1][conv_dim], oldest first) and moves on by the
// call's tokens. kernel <= DELTA_MAX_KERNEL. grid (ceil(conv_dim / 256)), block 256.
extern "C" __global__ void delta_conv_f32(float* p, int p_stride, float* state, const float* __restrict__ w,
                                          int conv_dim, int kernel, int n_tokens) {
    pdl_enter();
    int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= conv_dim) return;
    int past = kernel - 1;
    float hist[DELTA_MAX_KERNEL - 1];  // oldest first
#pragma unroll
    for (int j = 0; j < DELTA_MAX_KERNEL - 1; ++j) hist[j] = j < past ? state[(size_t)j * conv_dim + ch] : 0.f;
    const float* wc = w + (size_t)ch * kernel;
    for (int t = 0; t < n_tokens; ++t) {
        float* x = p + (size_t)t * p_stride + ch;
        float in = *x;
        float acc = wc[past] * in;
#pragma unroll
        for (int j = 0; j < DELTA_MAX_KERNEL - 1; ++j)
            if (j < past) acc += wc[j] * hist[j];
        *x = silu(acc);
#pragma unroll
        for (int j = 0; j < DELTA_MAX_KERNEL - 1; ++j) {
            if (j + 1 < past) hist[j] = hist[j + 1];
            else if (j + 1 == past) hist[j] = in;
        }
    }
#pragma unroll
    for (int j = 0; j < DELTA_MAX_KERNEL - 1; ++j)
        if (j < past) state[(size_t)j * conv_dim + ch] = hist[j];
}

// The causal conv of a run of tokens, every (token, channel) at once, three launches: the call's raw
// conv inputs copied out of p (delta_conv_gather_f32), each output written in place in p from them and
// the state (delta_conv_rows_f32: the same sum, in the same order, as delta_conv_f32), the state moved
// on (delta_conv_advance_f32). raw: [n_tokens][conv_dim]. grid (ceil(conv_dim / 256), tokens), block 256
// for the first two (token t0 + blockIdx.y: the launcher cuts long calls into grids of at most 65535
// rows); the last: grid (ceil(conv_dim / 256)), block 256.
extern "C" __global__ void delta_conv_gather_f32(const float* __restrict__ p, int p_stride, float* __restrict__ raw,
                                                 int conv_dim, int t0) {
    pdl_enter();
    int ch = blockIdx.x * blockDim.x + threadIdx.x, t = t0 + blockIdx.y;
    if (ch < conv_dim) raw[(size_t)t * conv_dim + ch] = p[(size_t)t * p_stride + ch];
}

extern "C" __global__ void delta_conv_rows_f32(float* __restrict__ p, int p_stride, const float* __restrict__ raw,
                                               const float* __restrict__ state, const float* __restrict__ w,
                                               int conv_dim, int kernel, int t0) {
    pdl_enter();
    int ch = blockIdx.x * blockDim.x + threadIdx.x, t = t0 + blockIdx.y;
    if (ch >= conv_dim) return;
    int past = kernel - 1;
    const float* wc = w + (size_t)ch * kernel;
    float acc = wc[past] * raw[(size_t)t * conv_dim + ch];
    for (int j = 0; j < past; ++j) {
        int u = t - past + j;  // input u: from the call's rows, or the history before it
        float x = u >= 0 ? raw[(size_t)u * conv_dim + ch] : state[(size_t)(past + u) * conv_dim + ch];
        acc += wc[j] * x;
    }
    p[(size_t)t * p_stride + ch] = silu(acc);
}

extern "C" __global__ void delta_conv_advance_f32(const float* __restrict__ raw, float* state, int conv_dim,
                                                  int kernel, int n_tokens) {
    pdl_enter();
    int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= conv_dim) return;
    int past = kernel - 1;
    // Row j of the new history is input n_tokens + j of (old history, the call's inputs); rows move
    // forward only, so increasing j reads no row already rewritten.
    for (int j = 0; j < past; ++j) {
        int at = n_tokens + j;
        state[(size_t)j * conv_dim + ch] =
            at < past ? state[(size_t)at * conv_dim + ch] : raw[(size_t)(at - past) * conv_dim + ch];
    }
}

// The gated delta rule, token by token (decode), before the gated RMSNorm (delta_gated_norm_f32).
// grid (nv, ceil(dv / 32)), block 128: value head blockIdx.x (its key head: head / (nv / nk), or
// head % nk when `tiled`), columns blockIdx.y * 32 + lane of its [dk, dv] state, warp w holding rows
// [w R, w R + R) (R = ceil(dk / 4)) of its lane's column in registers (dk <= DELTA_MAX_DK):
//   q, k = l2norm(q), l2norm(k) (q also / sqrt(dk)); beta = sigmoid(b); g = neg_a * softplus(a + dt_bias)
//   S *= exp(g); S[:, j] += k * beta * (v_j - S[:, j] . k); o_j = S[:, j] . q
// the dot products summed over the four warps in shared memory. state [nv, dk, dv] moves on by the
// call's tokens; out gets each token's o (vd a row).
extern "C" __global__ __launch_bounds__(128) void delta_rule_f32(const float* __restrict__ p, int p_stride,
                                                                  const float* __restrict__ ba, float* state,
                                                                  const float* __restrict__ dt_bias,
                                                                  const float* __restrict__ neg_a,
                                                                  float* __restrict__ out, int nk, int nv, int dk,
                                                                  int dv, int n_tokens, int tiled) {
    pdl_enter();
    __shared__ float qs[DELTA_MAX_DK], ks[DELTA_MAX_DK];
    __shared__ float red[2][4][32];
    int head = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int col = blockIdx.y * 32 + lane;
    bool mine = col < dv;
    int rows = (dk + 3) / 4, row0 = warp * rows, mine_rows = max(0, min(rows, dk - row0));
    int kh = tiled ? head % nk : head / (nv / nk), kd = nk * dk, vd = nv * dv;
    float* st = state + (size_t)head * dk * dv;
    float s[DELTA_MAX_DK / 4];
#pragma unroll
    for (int ii = 0; ii < DELTA_MAX_DK / 4; ++ii)
        s[ii] = (mine && ii < mine_rows) ? st[(size_t)(row0 + ii) * dv + col] : 0.f;
    float q_dim_scale = rsqrtf((float)dk);
    for (int t = 0; t < n_tokens; ++t) {
        const float* row = p + (size_t)t * p_stride;
        float qq = 0.f, kk = 0.f;
        for (int i = threadIdx.x; i < dk; i += blockDim.x) {
            float a = row[kh * dk + i], b = row[kd + kh * dk + i];
            qs[i] = a;
            ks[i] = b;
            qq += a * a;
            kk += b * b;
        }
        qq = block_sum(qq);  // its barriers also publish qs and ks
        kk = block_sum(kk);
        float q_scale = rsqrtf(qq + 1e-6f) * q_dim_scale, k_scale = rsqrtf(kk + 1e-6f);
        const float* bat = ba + (size_t)t * 2 * nv;
        float beta = 1.f / (1.f + expf(-bat[head]));
        float x = bat[nv + head] + dt_bias[head];
        float decay = expf(neg_a[head] * (x > 20.f ? x : log1pf(expf(x))));
        float kv = 0.f;
#pragma unroll
        for (int ii = 0; ii < DELTA_MAX_DK / 4; ++ii)
            if (ii < mine_rows) {
                s[ii] *= decay;
                kv += s[ii] * (ks[row0 + ii] * k_scale);
            }
        red[0][warp][lane] = kv;
        __syncthreads();
        kv = red[0][0][lane] + red[0][1][lane] + red[0][2][lane] + red[0][3][lane];
        float v = mine ? row[2 * kd + head * dv + col] : 0.f;
        float delta = beta * (v - kv), o = 0.f;
#pragma unroll
        for (int ii = 0; ii < DELTA_MAX_DK / 4; ++ii)
            if (ii < mine_rows) {
                s[ii] += (ks[row0 + ii] * k_scale) * delta;
                o += s[ii] * (qs[row0 + ii] * q_scale);
            }
        red[1][warp][lane] = o;
        __syncthreads();  // every warp is past this token's qs, ks and red[0]
        if (warp == 0 && mine)
            out[(size_t)t * vd + (size_t)head * dv + col] =
                red[1][0][lane] + red[1][1][lane] + red[1][2][lane] + red[1][3][lane];
    }
#pragma unroll
    for (int ii = 0; ii < DELTA_MAX_DK / 4; ++ii)
        if (mine && ii < mine_rows) st[(size_t)(row0 + ii) * dv + col] = s[ii];
}

// The chunked prefill (the WY / UT-transform form of flash-linear-attention's chunk_gated_delta_rule),
// three launches after delta_conv_f32 for a run of tokens; the recurrent delta_rule_f32 stays for
// decode. Chunks of DELTA_CHUNK tokens; a head's chunk r = 0..C-1 with G_r = g_0 + ... + g_r,
// beta_r, normalised k_r and scaled q_r, and the state S0 before the chunk:
//   A_rs = beta_r e^(G_r - G_s) k_r.k_s (s < r), T = (I + A)^-1 (unit lower triangular)
//   W = T diag(beta e^G) K, U0 = T diag(beta) V       (prep, every chunk of every head at once)
//   u = U0 - W S0; o_r = e^G_r q_r S0 + sum_{s<=r} e^(G_r - G_s) (q_r.k_s) u_s
//   S = e^G_last S0 + sum_r e^(G_last - G_r) k_r u_r^T  (scan, chunk after chunk)
// then the gated RMSNorm per (token, head). Rows past the call's last token are zero (g = 0, beta = 0),
// so they change nothing. Every exponent is <= 0.
// A (head, chunk) record of the work buffer, delta_chunk_record_floats(dk, dv) floats, its rows
// dk4 = dk and dv4 = dv rounded up to 4 floats (zeros past dk / dv), so every row is 16-byte aligned:
// W [C][dk4] | U0 [C][dv4] | QG = e^G q [C][dk4] | KG = e^(G_last - G) k [C][dk4] | QK [C][C] | e^G_last (4).
#define DC DELTA_CHUNK

__device__ __forceinline__ int delta_round4(int n) { return (n + 3) & ~3; }

__device__ __forceinline__ size_t delta_chunk_record_floats(int dk, int dv) {
    return (size_t)DC * (3 * delta_round4(dk) + delta_round4(dv) + DC) + 4;
}

// grid (nv, n_chunks), block 128. dk <= DELTA_MAX_DK. Reads p after delta_conv_f32 (layout above) and ba;
// value head `head` reads key head head / (nv / nk), or head % nk when `tiled` (as delta_rule_f32).
extern "C" __global__ void delta_chunk_prep_f32(const float* __restrict__ p, int p_stride,
                                                const float* __restrict__ ba, const float* __restrict__ dt_bias,
                                                const float* __restrict__ neg_a, float* __restrict__ work, int nk,
                                                int nv, int dk, int dv, int n_tokens, int tiled) {
    pdl_enter();
    __shared__ float ks[DC * (DELTA_MAX_DK + 1)], qs[DC * (DELTA_MAX_DK + 1)];
    __shared__ float am[DC][DC + 1], tm[DC][DC + 1];
    __shared__ float gs[DC], bs[DC], bg[DC];
    int head = blockIdx.x, chunk = blockIdx.y, t0 = chunk * DC;
    int len = min(DC, n_tokens - t0);
    int kh = tiled ? head % nk : head / (nv / nk), kd = nk * dk, ld = dk + 1;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float q_dim_scale = rsqrtf((float)dk);
    // Normalised q and k rows, the gates.
    for (int r = warp; r < DC; r += nw) {
        const float* row = p + (size_t)(t0 + (r < len ? r : 0)) * p_stride;
        float qq = 0.f, kk = 0.f;
        for (int i = lane; i < dk; i += 32) {
            float a = r < len ? row[kh * dk + i] : 0.f, b = r < len ? row[kd + kh * dk + i] : 0.f;
            qs[r * ld + i] = a;
            ks[r * ld + i] = b;
            qq += a * a;
            kk += b * b;
        }
        qq = warp_sum(qq);
        kk = warp_sum(kk);
        float qn = rsqrtf(qq + 1e-6f) * q_dim_scale, kn = rsqrtf(kk + 1e-6f);
        for (int i = lane; i < dk; i += 32) {
            qs[r * ld + i] *= qn;
            ks[r * ld + i] *= kn;
        }
        if (lane == 0) {
            float g = 0.f, beta = 0.f;
            if (r < len) {
                const float* bat = ba + (size_t)(t0 + r) * 2 * nv;
                beta = 1.f / (1.f + expf(-bat[head]));
                float x = bat[nv + head] + dt_bias[head];
                g = neg_a[head] * (x > 20.f ? x : log1pf(expf(x)));
            }
            gs[r] = g;
            bs[r] = beta;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float acc = 0.f;
        for (int r = 0; r < DC; ++r) {
            acc += gs[r];
            gs[r] = acc;
            bg[r] = bs[r] * expf(acc);
        }
    }
    __syncthreads();
    float* rec = work + ((size_t)head * gridDim.y + chunk) * delta_chunk_record_floats(dk, dv);
    int dk4 = delta_round4(dk), dv4 = delta_round4(dv);
    float *w_out = rec, *u_out = rec + DC * dk4;
    float *qg_out = u_out + DC * dv4, *kg_out = qg_out + DC * dk4, *qk_out = kg_out + DC * dk4;
    // The system (strictly lower) and the read-out weights (lower, diagonal included).
    for (int e = threadIdx.x; e < DC * DC; e += blockDim.x) {
        int r = e / DC, s = e % DC;
        float kk = 0.f, qk = 0.f, decay = 0.f;
        if (s <= r) {
            for (int i = 0; i < dk; ++i) {
                float kv = ks[s * ld + i];
                kk += ks[r * ld + i] * kv;
                qk += qs[r * ld + i] * kv;
            }
            decay = expf(gs[r] - gs[s]);
        }
        am[r][s] = s < r ? bs[r] * decay * kk : 0.f;
        qk_out[e] = qk * decay;
    }
    __syncthreads();
    // T = (I + A)^-1 by forward substitution, one column per thread.
    if (threadIdx.x < DC) {
        int j = threadIdx.x;
        float x[DC];
#pragma unroll
        for (int r = 0; r < DC; ++r) {
            float v = r == j ? 1.f : 0.f;
#pragma unroll
            for (int s = 0; s < r; ++s) v -= am[r][s] * x[s];
            x[r] = r < j ? 0.f : v;
        }
#pragma unroll
        for (int r = 0; r < DC; ++r) tm[r][j] = x[r];
    }
    __syncthreads();
    float last = gs[DC - 1];
    for (int e = threadIdx.x; e < DC * dk4; e += blockDim.x) {
        int r = e / dk4, i = e % dk4;
        float w = 0.f, qg = 0.f, kg = 0.f;
        if (i < dk) {
            for (int s = 0; s <= r; ++s) w += tm[r][s] * bg[s] * ks[s * ld + i];
            qg = expf(gs[r]) * qs[r * ld + i];
            kg = expf(last - gs[r]) * ks[r * ld + i];
        }
        w_out[e] = w;
        qg_out[e] = qg;
        kg_out[e] = kg;
    }
    const float* v = p + 2 * kd + head * dv;
    for (int e = threadIdx.x; e < DC * dv4; e += blockDim.x) {
        int r = e / dv4, c = e % dv4;
        float u = 0.f;
        if (c < dv)
            for (int s = 0; s <= r && s < len; ++s) u += tm[r][s] * bs[s] * v[(size_t)(t0 + s) * p_stride + c];
        u_out[e] = u;
    }
    if (threadIdx.x == 0) qk_out[DC * DC] = expf(last);
}

// The scan: grid (nv, ceil(dv / DS_COLS)), block DS_THREADS, delta_scan_shared_bytes() of dynamic
// shared memory. A block walks one head's chunks for DS_COLS value columns of its state, which it keeps
// in registers (thread (ty, tx): rows 4 ty .. 4 ty + 3, columns 4 tx .. 4 tx + 3) and mirrored in shared
// memory for the products that read every row. Per chunk, from the record staged in shared memory:
//   u = U0 - W S0 and QG S0 (thread: chunk row ty, its 4 columns; W, QG rows and S rows as float4s),
//   o = QG S0 + QK u (the token's read-out, before the norm), S = e^G_last S0 + KG^T u.
// The next chunk's W and QG are copied in (cp.async) while this one's o and state update run; its KG,
// U0 and QK after them.
#define DS_COLS DELTA_SCAN_COLS
#define DS_THREADS (DC * DS_COLS / 4)
#define DS_KP (DELTA_MAX_DK + 4)  // a staged W / QG / KG row: 16-byte aligned, rows ty..ty+3 in distinct banks
#define DS_QKP (DC + 4)
static_assert(DELTA_MAX_DK == 4 * DC, "a scan thread keeps 4 of a head's DELTA_MAX_DK state rows per chunk row");

struct DeltaScanSmem {
    float w[DC][DS_KP], qg[DC][DS_KP], kg[DC][DS_KP];
    float u0[DC][DS_COLS], qk[DC][DS_QKP];
    float decay[4];
    float s[DELTA_MAX_DK][DS_COLS], us[DC][DS_COLS];
};

// This chunk's W and QG rows (dk4 floats each) into shared memory, one 16-byte copy per thread and step.
__device__ __forceinline__ void delta_scan_stage_wq(DeltaScanSmem& sm, const float* rec, int dk4, int dv4) {
    const float *w = rec, *qg = rec + DC * (dk4 + dv4);
    int quads = dk4 / 4;
    for (int e = threadIdx.x; e < 2 * DC * quads; e += DS_THREADS) {
        int m = e / (DC * quads), r = (e / quads) % DC, q = e % quads;
        const float* src = (m == 0 ? w : qg) + (size_t)r * dk4 + 4 * q;
        cp_async16(m == 0 ? &sm.w[r][4 * q] : &sm.qg[r][4 * q], src, true);
    }
    cp_async_commit();
}

// This chunk's KG rows, U0's columns col0 .. col0 + DS_COLS, QK and e^G_last.
__device__ __forceinline__ void delta_scan_stage_rest(DeltaScanSmem& sm, const float* rec, int dk4, int dv4,
                                                      int col0) {
    const float *u0 = rec + DC * dk4, *kg = u0 + DC * dv4 + DC * dk4, *qk = kg + DC * dk4;
    int quads = dk4 / 4, u_quads = min(DS_COLS, dv4 - col0) / 4;
    for (int e = threadIdx.x; e < DC * quads; e += DS_THREADS)
        cp_async16(&sm.kg[e / quads][4 * (e % quads)], kg + (size_t)(e / quads) * dk4 + 4 * (e % quads), true);
    for (int e = threadIdx.x; e < DC * u_quads; e += DS_THREADS) {
        int r = e / u_quads, q = e % u_quads;
        cp_async16(&sm.u0[r][4 * q], u0 + (size_t)r * dv4 + col0 + 4 * q, true);
    }
    for (int e = threadIdx.x; e < DC * DC / 4; e += DS_THREADS)
        cp_async16(&sm.qk[e / (DC / 4)][4 * (e % (DC / 4))], qk + 4 * e, true);
    if (threadIdx.x == 0) cp_async16(sm.decay, qk + DC * DC, true);
    cp_async_commit();
}

__device__ __forceinline__ void fma4(float (&acc)[4], float a, float4 b) {
    acc[0] += a * b.x;
    acc[1] += a * b.y;
    acc[2] += a * b.z;
    acc[3] += a * b.w;
}

extern "C" __global__ __launch_bounds__(DS_THREADS) void delta_chunk_scan_f32(const float* __restrict__ work,
                                                                              float* state, float* __restrict__ out,
                                                                              int nv, int dk, int dv, int n_tokens) {
    pdl_enter();
    extern __shared__ __align__(16) unsigned char ds_raw[];
    DeltaScanSmem& sm = *reinterpret_cast<DeltaScanSmem*>(ds_raw);
    int head = blockIdx.x, col0 = blockIdx.y * DS_COLS;
    int ty = threadIdx.x / (DS_COLS / 4), c0 = 4 * (threadIdx.x % (DS_COLS / 4)), i0 = 4 * ty;
    int dk4 = delta_round4(dk), dv4 = delta_round4(dv), vd = nv * dv;
    int n_chunks = (n_tokens + DC - 1) / DC;
    size_t stride = delta_chunk_record_floats(dk, dv);
    const float* recs = work + (size_t)head * n_chunks * stride;
    // Zeros where no record row lands (rows past dk4, columns past dv4), then the state.
    for (int e = threadIdx.x; e < (int)(sizeof(DeltaScanSmem) / 4); e += DS_THREADS)
        reinterpret_cast<float*>(ds_raw)[e] = 0.f;
    __syncthreads();
    delta_scan_stage_wq(sm, recs, dk4, dv4);
    delta_scan_stage_rest(sm, recs, dk4, dv4, col0);
    float* st = state + (size_t)head * dk * dv;
    float s_reg[4][4];
#pragma unroll
    for (int a = 0; a < 4; ++a) {
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            int row = i0 + a, col = col0 + c0 + b;
            s_reg[a][b] = (row < dk && col < dv) ? st[(size_t)row * dv + col] : 0.f;
        }
        *reinterpret_cast<float4*>(&sm.s[i0 + a][c0]) = make_float4(s_reg[a][0], s_reg[a][1], s_reg[a][2], s_reg[a][3]);
    }
    for (int ch = 0; ch < n_chunks; ++ch) {
        cp_async_wait<0>();
        __syncthreads();  // the chunk's record and the state's rows are in
        float aw[4] = {0.f, 0.f, 0.f, 0.f}, aq[4] = {0.f, 0.f, 0.f, 0.f};
        for (int i = 0; i < dk4; i += 4) {
            float4 w4 = *reinterpret_cast<const float4*>(&sm.w[ty][i]);
            float4 q4 = *reinterpret_cast<const float4*>(&sm.qg[ty][i]);
            float wv[4] = {w4.x, w4.y, w4.z, w4.w}, qv[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                float4 s4 = *reinterpret_cast<const float4*>(&sm.s[i + j][c0]);
                fma4(aw, wv[j], s4);
                fma4(aq, qv[j], s4);
            }
        }
        float4 u04 = *reinterpret_cast<const float4*>(&sm.u0[ty][c0]);
        *reinterpret_cast<float4*>(&sm.us[ty][c0]) =
            make_float4(u04.x - aw[0], u04.y - aw[1], u04.z - aw[2], u04.w - aw[3]);
        __syncthreads();  // u is whole; W, QG and S0 are read
        const float* next = recs + (size_t)(ch + 1) * stride;
        if (ch + 1 < n_chunks) delta_scan_stage_wq(sm, next, dk4, dv4);
        for (int s = 0; s <= ty; ++s) fma4(aq, sm.qk[ty][s], *reinterpret_cast<const float4*>(&sm.us[s][c0]));
        int t = ch * DC + ty;
        if (t < n_tokens) {
#pragma unroll
            for (int b = 0; b < 4; ++b)
                if (col0 + c0 + b < dv) out[(size_t)t * vd + (size_t)head * dv + col0 + c0 + b] = aq[b];
        }
        float decay = sm.decay[0];
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int b = 0; b < 4; ++b) s_reg[a][b] *= decay;
#pragma unroll 4
        for (int r = 0; r < DC; ++r) {
            float4 k4 = *reinterpret_cast<const float4*>(&sm.kg[r][i0]);
            float4 u4 = *reinterpret_cast<const float4*>(&sm.us[r][c0]);
            fma4(s_reg[0], k4.x, u4);
            fma4(s_reg[1], k4.y, u4);
            fma4(s_reg[2], k4.z, u4);
            fma4(s_reg[3], k4.w, u4);
        }
#pragma unroll
        for (int a = 0; a < 4; ++a)
            *reinterpret_cast<float4*>(&sm.s[i0 + a][c0]) =
                make_float4(s_reg[a][0], s_reg[a][1], s_reg[a][2], s_reg[a][3]);
        __syncthreads();  // KG, U0, QK and u are read
        if (ch + 1 < n_chunks) delta_scan_stage_rest(sm, next, dk4, dv4, col0);
    }
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            int row = i0 + a, col = col0 + c0 + b;
            if (row < dk && col < dv) st[(size_t)row * dv + col] = s_reg[a][b];
        }
}

// The gated RMSNorm of the delta rule's read-outs (either form), in place: out_j = o_j * rsqrt(mean(o^2) + eps)
// * norm_w[j] * silu(z_j), z from p. grid (n_tokens, nv), block dv rounded up to a warp.
extern "C" __global__ void delta_gated_norm_f32(const float* __restrict__ p, int p_stride,
                                                const float* __restrict__ norm_w, float* out, int nk, int nv,
                                                int dk, int dv, float eps) {
    pdl_enter();
    int t = blockIdx.x, head = blockIdx.y, j = threadIdx.x;
    bool mine = j < dv;
    int kd = nk * dk, vd = nv * dv;
    float* o = out + (size_t)t * vd + (size_t)head * dv;
    float x = mine ? o[j] : 0.f;
    float ss = block_sum(x * x);
    if (mine) {
        float z = p[(size_t)t * p_stride + 2 * kd + vd + head * dv + j];
        o[j] = x * rsqrtf(ss / (float)dv + eps) * norm_w[j] * silu(z);
    }
}
