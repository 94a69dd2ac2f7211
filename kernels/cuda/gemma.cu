// Gemma 4's small kernels (issue 41): the scalar scales (embeddings times sqrt(hidden), each
// layer's learned output scalar), the soft-capped logits, the per-expert scale on the routing
// weights after the top-k, and the gated activation of the dense GeGLU branch (common.cuh's glu).
// Each is elementwise: grid ceil(n/256), block 256.

// x[i] *= s on the first n elements.
extern "C" __global__ void scale_f32(float* x, int n, float s) {
    pdl_enter();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}

// x[i] = cap * tanh(x[i] / cap) on the first n elements (the soft-capped logits).
extern "C" __global__ void softcap_f32(float* x, int n, float cap) {
    pdl_enter();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = cap * tanhf(x[i] / cap);
}

// w[j] *= scale[ids[j]] for the n routed entries (ids checked in range 0..n_experts; an id out
// of range leaves its weight, and the worklist's check refuses the route).
extern "C" __global__ void route_expert_scale_f32(const int* __restrict__ ids, float* w,
                                                  const float* __restrict__ scale, int n, int n_experts) {
    pdl_enter();
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j < n) {
        int e = ids[j];
        if (e >= 0 && e < n_experts) w[j] *= scale[e];
    }
}

// out[i] = glu(act, g[i], u[i]) on the first n elements (act: common.cuh's GLU_* codes).
extern "C" __global__ void glu_mul_f32(const float* __restrict__ g, const float* __restrict__ u, float* out,
                                       int n, int act) {
    pdl_enter();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = glu(act, g[i], u[i]);
}
