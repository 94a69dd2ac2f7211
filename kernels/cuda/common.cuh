// moe-lanes CUDA kernels, shared part: types and warp/block reductions. Prepended to every
// op-family file (gemv, norm_rope, elementwise, attention, argmax, route, moe, grouped_gemm, quant, delta_net); the whole is
// compiled at start-up with NVRTC for the device's own architecture (kernels/src/cuda/mod.rs).
// Constants shared with the Rust launchers (ROWS_PER_BLOCK, ATT_CHUNK, ATT_MAXC, ATT_MAX_HEAD_DIM,
// ATT_SPLIT_WARPS, ATT_TILE_*, ARGMAX_BLOCK, GG_BM, GG_BN, GG_THREADS, GG_PIPE_BK, GG_STAGES, GG_DEC_BM, GG_DEC_STAGES, ATT_MMA_*, ATT_GQA_*, DELTA_MAX_*, DELTA_CHUNK, DELTA_SCAN_COLS, ROUTE_SIG_*, ATT_COMBINE_DIMS, MLA_*, QUANT_MAX_TOKENS, QUANT_WIDE_ROWS, DOWN_ROWS, GEMV_SPLIT, TOPK_PER_LANE) are passed as -D defines from kernels/src/cuda/kernel.rs,
// defined once there. Conventions: weights are bf16 row-major [out, in] (quant.cu: GGML blocks); activations,
// norms and biases are f32, the KV cache f32 or f16 (attention.cu); every kernel states its launch configuration.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

typedef __nv_bfloat16 bf16;

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

#define WARP 32

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide reductions; every thread of the block must call them.
__device__ float block_sum(float v) {
    __shared__ float s[33];
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    if (lane == 0) s[wid] = v;
    __syncthreads();
    if (wid == 0) {
        float t = lane < nw ? s[lane] : 0.f;
        t = warp_sum(t);
        if (lane == 0) s[32] = t;
    }
    __syncthreads();
    float r = s[32];
    __syncthreads();
    return r;
}

__device__ float block_max(float v) {
    __shared__ float s[33];
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    if (lane == 0) s[wid] = v;
    __syncthreads();
    if (wid == 0) {
        float t = lane < nw ? s[lane] : -INFINITY;
        t = warp_max(t);
        if (lane == 0) s[32] = t;
    }
    __syncthreads();
    float r = s[32];
    __syncthreads();
    return r;
}

// Programmatic dependent launch (sm_90+; the launcher sets the stream-serialization attribute
// when the device has it and it is not switched off, kernels/src/cuda/mod.rs): a kernel so
// launched may be scheduled while the kernel before it on the stream still runs. Every kernel
// calls pdl_enter() first, before it reads or writes any memory: pdl_wait() blocks the thread
// until the grids before it have completed and their writes are visible (a no-op without the
// attribute), then pdl_trigger() lets the next kernel's blocks be scheduled once every block of
// this one has triggered or exited. So results are the same with and without it, and at most one
// kernel waits ahead of the running one (a test in kernels/src/cuda/kernel.rs checks that every
// kernel begins so).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" :::); }
#else
__device__ __forceinline__ void pdl_wait() {}
__device__ __forceinline__ void pdl_trigger() {}
#endif
__device__ __forceinline__ void pdl_enter() {
    pdl_wait();
    pdl_trigger();
}

// A 16-bit value's bits (bf16 or, F16, f16) as f32.
template <bool F16>
__device__ __forceinline__ float mma_wide16(unsigned short h) {
    return F16 ? __half2float(__ushort_as_half(h)) : __uint_as_float((unsigned)h << 16);
}

// mma_*_16816's fragment product by plain FMAs (pre-sm_80 devices; never the fast path), the
// same fragment layout.
template <bool F16>
__device__ __forceinline__ void mma_16816_fma(float* d, const unsigned* a, unsigned b0, unsigned b1) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    for (int c = 0; c < 4; c++) {
        int row = g + (c >= 2 ? 8 : 0), col = t * 2 + (c & 1);
        float acc = 0.f;
        for (int kk = 0; kk < 16; kk++) {
            int al = ((row & 7) << 2) | ((kk & 7) >> 1);
            unsigned aw = __shfl_sync(0xffffffffu, a[((kk >> 3) << 1) | (row >> 3)], al);
            int bl = (col << 2) | ((kk & 7) >> 1);
            unsigned bw = __shfl_sync(0xffffffffu, kk < 8 ? b0 : b1, bl);
            unsigned short ah = (kk & 1) ? (aw >> 16) : (aw & 0xffffu);
            unsigned short bh = (kk & 1) ? (bw >> 16) : (bw & 0xffffu);
            acc += mma_wide16<F16>(ah) * mma_wide16<F16>(bh);
        }
        d[c] += acc;
    }
}

// d += a . b on the tensor cores: mma.sync m16n8k16, bf16 inputs, f32 accumulation (sm_80 and
// later; before, mma_16816_fma). a: the A fragment (row g = lane / 4:
// a[0] k 2t..2t+1, a[1] row g + 8, a[2] k + 8, a[3] both, t = lane % 4); b0, b1: B (k 2t.., 2t+8.., column g).
// Used by attention.cu and grouped_gemm.cu.
__device__ __forceinline__ void mma_bf16_16816(float* d, const unsigned* a, unsigned b0, unsigned b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    mma_16816_fma<false>(d, a, b0, b1);
#endif
}

// mma_bf16_16816 with f16 inputs.
__device__ __forceinline__ void mma_f16_16816(float* d, const unsigned* a, unsigned b0, unsigned b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    mma_16816_fma<true>(d, a, b0, b1);
#endif
}

// 16 bytes from global `src` to shared `dst` without waiting (cp.async, sm_80+; a plain copy
// before); zeros when !valid, and `src` is then not read. cp_async_commit closes a group of them,
// cp_async_wait<N> waits until at most N groups are in flight.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
#if __CUDA_ARCH__ >= 800
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0));
#else
    *(uint4*)dst = valid ? *(const uint4*)src : make_uint4(0u, 0u, 0u, 0u);
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }

// The hot lane's gated product of one gate and one up value (after their biases): act 0 (SiLU)
// silu(g) * u; act 1 GPT-OSS's clamped SwiGLU, g = min(g, 7), u = clamp(u, -7, 7),
// (u + 1) * g * sigmoid(1.702 g) (the CPU's Activation::gated, same operations); act 2 (Gemma 4)
// gelu_tanh(g) * u, 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))). `act` is uniform over a
// launch (a kernel argument), so the branch costs no divergence.
#define GLU_SILU 0
#define GLU_SWIGLU_OAI 1
#define GLU_GELU_TANH 2
__device__ __forceinline__ float gelu_tanh(float x) {
    return 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}
__device__ __forceinline__ float glu(int act, float g, float u) {
    if (act == GLU_SWIGLU_OAI) {
        g = fminf(g, 7.f);
        u = fminf(fmaxf(u, -7.f), 7.f);
        return (u + 1.f) * (g / (1.f + expf(-1.702f * g)));
    }
    if (act == GLU_GELU_TANH) return gelu_tanh(g) * u;
    return silu(g) * u;
}

// glu over slot `slot`'s row `r` of per-slot biases [n_slots, n] (null: none) added first.
__device__ __forceinline__ float glu_biased(int act, float g, float u, const float* __restrict__ bg,
                                            const float* __restrict__ bu, int slot, int r, int n) {
    size_t at = (size_t)slot * n + r;
    if (bg) g += bg[at];
    if (bu) u += bu[at];
    return glu(act, g, u);
}

// Loads in flight per thread in norm_row_to: a thread issues this many loads before it uses the
// first (a plain strided loop waits for each load in turn: the one-block decode RMSNorm was a
// chain of memory latencies, 9.8 -> 4.4 us in ncu on the H100). The arithmetic order stays that of
// the plain loop: same bits. (The same in the bf16 GEMVs raised their registers and made them
// slower: many warps already keep their loads in flight.)
#define LOADS_AHEAD 8

// RMSNorm of one row x[0..K) with weight nw into y (block-wide; every thread of the block must
// call it; y may be x): the sum of squares per thread in column order, then block_sum. A row of
// at most LOADS_AHEAD values a thread is read once (x and nw loaded together, kept in registers
// for the second pass: one round of memory latency fewer, the same arithmetic).
// rmsnorm_f32 and norm_row share it, so their bits are the same for blocks of the same size.
__device__ __forceinline__ void norm_row_to(const float* x, const float* __restrict__ nw, int K, float eps,
                                            float* y) {
    int step = blockDim.x;
    if (K <= LOADS_AHEAD * step) {  // one batch: x and the weights stay in registers between passes
        float v[LOADS_AHEAD], w[LOADS_AHEAD];
#pragma unroll
        for (int u = 0; u < LOADS_AHEAD; u++) {
            int i = threadIdx.x + u * step;
            v[u] = i < K ? x[i] : 0.f, w[u] = i < K ? nw[i] : 0.f;
        }
        float ss1 = 0.f;
#pragma unroll
        for (int u = 0; u < LOADS_AHEAD; u++)
            if (threadIdx.x + u * step < K) ss1 += v[u] * v[u];
        ss1 = block_sum(ss1);  // ends with a barrier: every read of x is done (y may be x)
        float inv1 = 1.f / sqrtf(ss1 / (float)K + eps);
#pragma unroll
        for (int u = 0; u < LOADS_AHEAD; u++)
            if (threadIdx.x + u * step < K) y[threadIdx.x + u * step] = v[u] * inv1 * w[u];
        return;
    }
    float ss = 0.f;
    for (int i0 = threadIdx.x; i0 < K; i0 += LOADS_AHEAD * step) {
        float v[LOADS_AHEAD];
#pragma unroll
        for (int u = 0; u < LOADS_AHEAD; u++) v[u] = i0 + u * step < K ? x[i0 + u * step] : 0.f;
#pragma unroll
        for (int u = 0; u < LOADS_AHEAD; u++)
            if (i0 + u * step < K) ss += v[u] * v[u];
    }
    ss = block_sum(ss);
    float inv = 1.f / sqrtf(ss / (float)K + eps);
    for (int i0 = threadIdx.x; i0 < K; i0 += LOADS_AHEAD * step) {
        float v[LOADS_AHEAD], w[LOADS_AHEAD];
#pragma unroll
        for (int u = 0; u < LOADS_AHEAD; u++) {
            int i = i0 + u * step;
            v[u] = i < K ? x[i] : 0.f, w[u] = i < K ? nw[i] : 0.f;
        }
#pragma unroll
        for (int u = 0; u < LOADS_AHEAD; u++)
            if (i0 + u * step < K) y[i0 + u * step] = v[u] * inv * w[u];
    }
}

// RMSNorm of one row into shared memory xs, visible to the whole block on return.
__device__ __forceinline__ void norm_row(const float* __restrict__ x, const float* __restrict__ nw, int K, float eps,
                                         float* __restrict__ xs) {
    norm_row_to(x, nw, K, eps, xs);
    __syncthreads();
}

// acc + eight bf16 weights (p) . eight activations (a, b), in one fixed order: the bf16 GEMVs'
// 8-value step.
__device__ __forceinline__ float dot8_bf16(uint4 p, float4 a, float4 b, float acc) {
    const __nv_bfloat162* h = (const __nv_bfloat162*)&p;
    float2 f0 = __bfloat1622float2(h[0]), f1 = __bfloat1622float2(h[1]);
    float2 f2 = __bfloat1622float2(h[2]), f3 = __bfloat1622float2(h[3]);
    acc += f0.x * a.x + f0.y * a.y + f1.x * a.z + f1.y * a.w;
    acc += f2.x * b.x + f2.y * b.y + f3.x * b.z + f3.y * b.w;
    return acc;
}

// Dot product of a bf16 row with an f32 vector, one warp, result in every lane.
__device__ __forceinline__ float warp_dot_bf16(const bf16* __restrict__ w, const float* __restrict__ x, int k) {
    float acc = 0.f;
    if ((k & 7) == 0 && ((((size_t)w) & 15) == 0) && ((((size_t)x) & 15) == 0)) {
        const uint4* w8 = (const uint4*)w;
        const float4* x4 = (const float4*)x;
        int n8 = k >> 3;
        for (int i = threadIdx.x & 31; i < n8; i += WARP) acc = dot8_bf16(w8[i], x4[2 * i], x4[2 * i + 1], acc);
    } else {
        for (int i = threadIdx.x & 31; i < k; i += WARP) acc += __bfloat162float(w[i]) * x[i];
    }
    return warp_sum(acc);
}

// warp_dot_bf16 of two rows w0, w1 against one x, in one loop: each step loads both rows' 8
// values and x once (the two rows' loads in flight together, x read once for both); each row's
// products are added in warp_dot_bf16's order, so d0 and d1 have its bits. Used by the hot down
// projection's row pairs (ncu, H100, 4-layer BF16: 17.0 -> 15.5 us a layer); the hot gate/up with
// its gate and up rows paired was slower (22.1 -> 23.3 us: 46 registers, 5 blocks an SM, not 6).
__device__ __forceinline__ void warp_dot2_bf16(const bf16* __restrict__ w0, const bf16* __restrict__ w1,
                                               const float* __restrict__ x, int k, float* d0, float* d1) {
    bool vec = (k & 7) == 0 && ((((size_t)w0) & 15) == 0) && ((((size_t)w1) & 15) == 0) &&
               ((((size_t)x) & 15) == 0);
    if (!vec) {
        *d0 = warp_dot_bf16(w0, x, k);
        *d1 = warp_dot_bf16(w1, x, k);
        return;
    }
    const uint4 *a8 = (const uint4*)w0, *b8 = (const uint4*)w1;
    const float4* x4 = (const float4*)x;
    float acc0 = 0.f, acc1 = 0.f;
    for (int i = threadIdx.x & 31; i < (k >> 3); i += WARP) {
        uint4 a = a8[i], b = b8[i];
        float4 xa = x4[2 * i], xb = x4[2 * i + 1];
        acc0 = dot8_bf16(a, xa, xb, acc0);
        acc1 = dot8_bf16(b, xa, xb, acc1);
    }
    *d0 = warp_sum(acc0);
    *d1 = warp_sum(acc1);
}

#if !defined(ROWS_PER_BLOCK) || !defined(ATT_CHUNK) || !defined(ATT_MAXC) || !defined(ATT_MAX_HEAD_DIM) || \
    !defined(ATT_SPLIT_WARPS) || !defined(ARGMAX_BLOCK) || !defined(GG_BM) || !defined(GG_BN) || !defined(GG_THREADS)
#error "compile with the -D options of shared_defines() (kernels/src/cuda/kernel.rs)"
#endif
#if !defined(QUANT_MAX_TOKENS) || !defined(ATT_TILE_ROWS) || !defined(ATT_TILE_KEYS) || !defined(ATT_TILE_MAXC) || \
    !defined(QUANT_WIDE_ROWS) || !defined(DOWN_ROWS) || !defined(GEMV_SPLIT) || !defined(GG_PIPE_BK) || !defined(GG_STAGES) || !defined(GG_DEC_BM) || !defined(GG_DEC_STAGES) || \
    !defined(ATT_MMA_WARPS) || !defined(ATT_MMA_KEYS) || !defined(ATT_MMA_MAXD) || !defined(TOPK_PER_LANE) || \
    !defined(ATT_GQA_HEADS) || !defined(ATT_GQA_MAXD) || !defined(DELTA_MAX_DK) || !defined(DELTA_MAX_KERNEL) || \
    !defined(DELTA_CHUNK) || !defined(DELTA_SCAN_COLS) || !defined(ROUTE_SIG_MAXE) || !defined(ROUTE_SIG_MAXG) || !defined(ATT_COMBINE_DIMS) || \
    !defined(MLA_HEADS) || !defined(MLA_TOKENS) || !defined(MLA_MAX_RANK) || !defined(MLA_MAX_ROPE) || \
    !defined(ATT_MMA_WIDE_KEYS) || !defined(ATT_MMA_WIDE_MAXD) || !defined(MLA_MMA_GROUPS) || !defined(MLA_MMA_KEYS) || \
    !defined(GQ_BK) || !defined(KV_RING_CHUNK) || !defined(GEMV_MMA_WARPS) || !defined(GEMV_MMA_TOKENS)
#error "compile with the -D options of shared_defines() (kernels/src/cuda/kernel.rs)"
#endif
