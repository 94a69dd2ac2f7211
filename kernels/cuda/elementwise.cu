// Element-wise and row-movement kernels: bias, clamp, add, SiLU-multiply, embedding, gathers and scatters.
// Part of the moe-lanes kernels: compiled together with common.cuh prepended (kernels/src/cuda/kernel.rs).

// x[r, :] += b for every row. grid ceil(rows*dim/256), block 256.
extern "C" __global__ void add_bias_rows(float* x, const float* __restrict__ b, int rows, int dim) {
    pdl_enter();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (size_t)rows * dim) x[i] += b[i % dim];
}

// x = clamp(x, -c, c). grid ceil(n/256), block 256.
extern "C" __global__ void clamp_f32(float* x, int n, float c) {
    pdl_enter();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = fminf(fmaxf(x[i], -c), c);
}

// acc += x. grid ceil(n/256), block 256.
extern "C" __global__ void add_f32(float* acc, const float* __restrict__ x, int n) {
    pdl_enter();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) acc[i] += x[i];
}

// out = silu(g) * u. grid ceil(n/256), block 256.
extern "C" __global__ void silu_mul_f32(const float* g, const float* u, float* out, int n) {
    pdl_enter();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = silu(g[i]) * u[i];
}

// x[i] *= sigmoid(gate[i]) on the first n elements (gated attention's output). grid (ceil(n/256)), block 256.
extern "C" __global__ void mul_sigmoid_f32(float* x, const float* __restrict__ gate, int n) {
    pdl_enter();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= 1.f / (1.f + expf(-gate[i]));
}

// out[t, :] = table[tokens[t], :] as f32. grid (T), block 256.
extern "C" __global__ void embed_bf16(const bf16* __restrict__ table, const int* __restrict__ tokens,
                                      float* __restrict__ out, int hidden) {
    pdl_enter();
    const bf16* row = table + (size_t)tokens[blockIdx.x] * hidden;
    float* o = out + (size_t)blockIdx.x * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = __bfloat162float(row[i]);
}

// f32 -> bf16 hi (+ optional bf16 lo = x - hi) for cuBLAS inputs; hi + lo carries ~16 bits of
// mantissa. Gathers rows: src row = rows ? rows[r] : r. grid (n_rows), block 256.
extern "C" __global__ void gather_split_bf16(const float* __restrict__ x, const int* __restrict__ rows,
                                             bf16* __restrict__ hi, bf16* __restrict__ lo, int dim) {
    pdl_enter();
    int r = blockIdx.x;
    const float* xr = x + (size_t)(rows ? rows[r] : r) * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = xr[i];
        bf16 h = __float2bfloat16_rn(v);
        hi[(size_t)r * dim + i] = h;
        if (lo) lo[(size_t)r * dim + i] = __float2bfloat16_rn(v - __bfloat162float(h));
    }
}

// out[r, :] = x[rows[r], :]. grid (n_rows), block 256.
extern "C" __global__ void gather_rows_f32(const float* __restrict__ x, const int* __restrict__ rows,
                                           float* __restrict__ out, int dim) {
    pdl_enter();
    const float* xr = x + (size_t)rows[blockIdx.x] * dim;
    float* o = out + (size_t)blockIdx.x * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = xr[i];
}

// out[rows[r], :] += src[r, :] (rows distinct). grid (n_rows), block 256.
extern "C" __global__ void scatter_add_rows_f32(const float* __restrict__ src, const int* __restrict__ rows,
                                                float* __restrict__ out, int dim) {
    pdl_enter();
    const float* s = src + (size_t)blockIdx.x * dim;
    float* o = out + (size_t)rows[blockIdx.x] * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] += s[i];
}

// out[t, :] += sigmoid(gate_logit[t]) * x[t, :] (shared expert). grid (T), block 256.
extern "C" __global__ void add_sigmoid_scaled_rows(float* __restrict__ out, const float* __restrict__ x,
                                                   const float* __restrict__ gate_logit, int dim) {
    pdl_enter();
    float g = 1.f / (1.f + expf(-gate_logit[blockIdx.x]));
    const float* xr = x + (size_t)blockIdx.x * dim;
    float* o = out + (size_t)blockIdx.x * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] += g * xr[i];
}
