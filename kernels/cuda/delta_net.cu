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
