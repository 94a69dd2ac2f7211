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

// The gated delta rule and the gated RMSNorm, token by token. One block per value head (its key
// head: head / (nv / nk), or head % nk when `tiled`), one thread per value channel j < dv (blockDim: dv rounded up to a
// warp), each holding column j of the head's [dk, dv] state in registers (dk <= DELTA_MAX_DK):
//   q, k = l2norm(q), l2norm(k) (q also / sqrt(dk)); beta = sigmoid(b); g = neg_a * softplus(a + dt_bias)
//   S *= exp(g); S[:, j] += k * beta * (v_j - S[:, j] . k); o_j = S[:, j] . q
//   out_j = o_j * rsqrt(mean(o^2) + eps) * norm_w[j] * silu(z_j)
// state [nv, dk, dv] moves on by the call's tokens. out rows: vd. grid (nv), block dv up to 32.
extern "C" __global__ void delta_rule_f32(const float* __restrict__ p, int p_stride, const float* __restrict__ ba,
                                          float* state, const float* __restrict__ dt_bias,
                                          const float* __restrict__ neg_a, const float* __restrict__ norm_w,
                                          float* __restrict__ out, int nk, int nv, int dk, int dv, float eps,
                                          int n_tokens, int tiled) {
    pdl_enter();
    __shared__ float qs[DELTA_MAX_DK], ks[DELTA_MAX_DK];
    int head = blockIdx.x, j = threadIdx.x;
    bool mine = j < dv;
    int kh = tiled ? head % nk : head / (nv / nk), kd = nk * dk, vd = nv * dv;
    float* st = state + (size_t)head * dk * dv;
    float s[DELTA_MAX_DK];
#pragma unroll
    for (int i = 0; i < DELTA_MAX_DK; ++i) s[i] = (mine && i < dk) ? st[(size_t)i * dv + j] : 0.f;
    float q_dim_scale = rsqrtf((float)dk);
    for (int t = 0; t < n_tokens; ++t) {
        const float* row = p + (size_t)t * p_stride;
        float qq = 0.f, kk = 0.f;
        for (int i = j; i < dk; i += blockDim.x) {
            float a = row[kh * dk + i], b = row[kd + kh * dk + i];
            qs[i] = a;
            ks[i] = b;
            qq += a * a;
            kk += b * b;
        }
        qq = block_sum(qq);  // its barriers also publish qs and ks
        kk = block_sum(kk);
        float q_scale = rsqrtf(qq + 1e-6f) * q_dim_scale, k_scale = rsqrtf(kk + 1e-6f);
        float o = 0.f, z = 0.f;
        if (mine) {
            float v = row[2 * kd + head * dv + j];
            z = row[2 * kd + vd + head * dv + j];
            const float* bat = ba + (size_t)t * 2 * nv;
            float beta = 1.f / (1.f + expf(-bat[head]));
            float x = bat[nv + head] + dt_bias[head];
            float decay = expf(neg_a[head] * (x > 20.f ? x : log1pf(expf(x))));
            float kv = 0.f;
#pragma unroll
            for (int i = 0; i < DELTA_MAX_DK; ++i)
                if (i < dk) {
                    s[i] *= decay;
                    kv += s[i] * (ks[i] * k_scale);
                }
            float delta = beta * (v - kv);
#pragma unroll
            for (int i = 0; i < DELTA_MAX_DK; ++i)
                if (i < dk) {
                    s[i] += (ks[i] * k_scale) * delta;
                    o += s[i] * (qs[i] * q_scale);
                }
        }
        float ss = block_sum(o * o);  // ends with a barrier: qs and ks are free for the next token
        if (mine) out[(size_t)t * vd + (size_t)head * dv + j] = o * rsqrtf(ss / (float)dv + eps) * norm_w[j] * silu(z);
    }
    if (mine) {
#pragma unroll
        for (int i = 0; i < DELTA_MAX_DK; ++i)
            if (i < dk) st[(size_t)i * dv + j] = s[i];
    }
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
// A (head, chunk) record of the work buffer, delta_chunk_record_floats(dk, dv) floats:
// W [C][dk] | U0 [C][dv] | QG = e^G q [C][dk] | KG = e^(G_last - G) k [C][dk] | QK [C][C] | e^G_last (4).
#define DC DELTA_CHUNK

__device__ __forceinline__ size_t delta_chunk_record_floats(int dk, int dv) {
    return (size_t)DC * (3 * dk + dv + DC) + 4;
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
    float *w_out = rec, *u_out = rec + DC * dk;
    float *qg_out = u_out + DC * dv, *kg_out = qg_out + DC * dk, *qk_out = kg_out + DC * dk;
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
    for (int e = threadIdx.x; e < DC * dk; e += blockDim.x) {
        int r = e / dk, i = e % dk;
        float w = 0.f;
        for (int s = 0; s <= r; ++s) w += tm[r][s] * bg[s] * ks[s * ld + i];
        w_out[e] = w;
        qg_out[e] = expf(gs[r]) * qs[r * ld + i];
        kg_out[e] = expf(last - gs[r]) * ks[r * ld + i];
    }
    const float* v = p + 2 * kd + head * dv;
    for (int e = threadIdx.x; e < DC * dv; e += blockDim.x) {
        int r = e / dv, c = e % dv;
        float u = 0.f;
        for (int s = 0; s <= r && s < len; ++s) u += tm[r][s] * bs[s] * v[(size_t)(t0 + s) * p_stride + c];
        u_out[e] = u;
    }
    if (threadIdx.x == 0) qk_out[DC * DC] = expf(last);
}

// grid (nv, ceil(dv / 32)), block 128 (four warps): warp w keeps rows [w R, w R + R) (R = ceil(dk / 4))
// of column blockIdx.y * 32 + lane of the head's state in registers, chunk after chunk of the prep's
// records; out gets each token's read-out (value_dim a row, before the norm); state moves on. The
// records' rows are read straight from global memory (every lane of a warp reads the same address),
// one row of a chunk at a time, so only the state and two sums are live across a row.
extern "C" __global__ void delta_chunk_scan_f32(const float* __restrict__ work, float* state, float* __restrict__ out,
                                                int nv, int dk, int dv, int n_tokens) {
    pdl_enter();
    __shared__ float red_u[4][DC][32], red_q[4][DC][32];  // each warp's part of W S0 and QG S0
    __shared__ float us[DC][33], qss[DC][33];
    int head = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int col = blockIdx.y * 32 + lane;
    bool mine = col < dv;
    int rows = (dk + 3) / 4, row0 = warp * rows;
    int mine_rows = max(0, min(rows, dk - row0));
    int n_chunks = (n_tokens + DC - 1) / DC, vd = nv * dv;
    float* st = state + (size_t)head * dk * dv;
    float s_reg[DELTA_MAX_DK / 4];
#pragma unroll
    for (int ii = 0; ii < DELTA_MAX_DK / 4; ++ii)
        s_reg[ii] = (ii < mine_rows && mine) ? st[(size_t)(row0 + ii) * dv + col] : 0.f;
    size_t stride = delta_chunk_record_floats(dk, dv);
    for (int ch = 0; ch < n_chunks; ++ch) {
        const float* rec = work + ((size_t)head * n_chunks + ch) * stride;
        const float *w = rec, *u0 = rec + DC * dk, *qg = u0 + DC * dv, *kg = qg + DC * dk, *qk = kg + DC * dk;
        float decay = qk[DC * DC];
        // This warp's rows of W S0 and QG S0.
#pragma unroll 1
        for (int r = 0; r < DC; ++r) {
            const float *wr = w + (size_t)r * dk + row0, *qr = qg + (size_t)r * dk + row0;
            float au = 0.f, aq = 0.f;
#pragma unroll
            for (int ii = 0; ii < DELTA_MAX_DK / 4; ++ii)
                if (ii < mine_rows) {
                    au += wr[ii] * s_reg[ii];
                    aq += qr[ii] * s_reg[ii];
                }
            red_u[warp][r][lane] = au;
            red_q[warp][r][lane] = aq;
        }
        __syncthreads();
        for (int k = 0; k < DC / 4; ++k) {
            int r = warp * (DC / 4) + k;
            float su = red_u[0][r][lane] + red_u[1][r][lane] + red_u[2][r][lane] + red_u[3][r][lane];
            us[r][lane] = mine ? u0[r * dv + col] - su : 0.f;
            qss[r][lane] = red_q[0][r][lane] + red_q[1][r][lane] + red_q[2][r][lane] + red_q[3][r][lane];
        }
        __syncthreads();
        for (int k = 0; k < DC / 4; ++k) {
            int r = warp * (DC / 4) + k, t = ch * DC + r;
            float o = qss[r][lane];
            for (int s = 0; s <= r; ++s) o += qk[r * DC + s] * us[s][lane];
            if (mine && t < n_tokens) out[(size_t)t * vd + (size_t)head * dv + col] = o;
        }
#pragma unroll
        for (int ii = 0; ii < DELTA_MAX_DK / 4; ++ii) s_reg[ii] *= decay;
#pragma unroll 1
        for (int r = 0; r < DC; ++r) {
            const float* kr = kg + (size_t)r * dk + row0;
            float u = us[r][lane];
#pragma unroll
            for (int ii = 0; ii < DELTA_MAX_DK / 4; ++ii)
                if (ii < mine_rows) s_reg[ii] += kr[ii] * u;
        }
        __syncthreads();  // red_*, us and qss are the next chunk's
    }
#pragma unroll
    for (int ii = 0; ii < DELTA_MAX_DK / 4; ++ii)
        if (ii < mine_rows && mine) st[(size_t)(row0 + ii) * dv + col] = s_reg[ii];
}

// The gated RMSNorm of the chunked prefill's read-outs, in place: out_j = o_j * rsqrt(mean(o^2) + eps)
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
